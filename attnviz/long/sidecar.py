"""The long capture's sidecar (``long.json``), read through one declared pydantic model.

Every field a :class:`~attnviz.long.LongCapture` reads is checked when the file is read: its
type (strictly: ``"8"`` is not a number, ``1.0`` not a count), its bounds, and how the fields
agree (one token entry per token, one scale and window per recorded layer, recorded layers
unique, sorted and within the model). Keys this version does not know are ignored, so files
of later minor versions still open. Token text is shown with its control characters escaped,
as a full capture's display tokens are: a file cannot drive the terminal.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

#: Bounds of the sidecar's sizes (far beyond any model: they keep a damaged file from asking
#: for absurd amounts of memory before the arrays' shapes are compared).
MAX_LAYERS = 4096
MAX_HEADS = 4096
MAX_HEAD_DIM = 1 << 16
MAX_TOKENS = 1 << 24

_Layer = Annotated[int, Field(ge=0, lt=MAX_LAYERS)]
_Scale = Annotated[float, Field(gt=0, allow_inf_nan=False)]
_Window = Annotated[int, Field(ge=1, le=MAX_TOKENS)]
_WordId = Annotated[int, Field(ge=0, le=MAX_TOKENS)]


class Sidecar(BaseModel):
    """What ``long.json`` must hold (see ``docs/long.md``)."""

    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)

    model: str
    text: str
    pair: str | None = None
    tokens: list[str] = Field(min_length=1, max_length=MAX_TOKENS)
    display_tokens: list[str]
    word_ids: list[_WordId | None]
    special: list[bool]
    layers: list[_Layer] = Field(min_length=1, max_length=MAX_LAYERS)
    num_layers: Annotated[int, Field(ge=1, le=MAX_LAYERS)]
    num_heads: Annotated[int, Field(ge=1, le=MAX_HEADS)]
    num_kv_heads: Annotated[int, Field(ge=1, le=MAX_HEADS)]
    head_dim: Annotated[int, Field(ge=1, le=MAX_HEAD_DIM)]
    dtype: Literal["float32", "float16", "bfloat16"]
    causal: bool
    scales: list[_Scale]
    windows: list[_Window | None]
    meta: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _agree(self) -> Sidecar:
        size = len(self.tokens)
        for name in ("display_tokens", "word_ids", "special"):
            count = len(getattr(self, name))
            if count != size:
                raise ValueError(f"'{name}' has {count} entries for {size} tokens")
        if any(b <= a for a, b in zip(self.layers, self.layers[1:])):
            raise ValueError(f"'layers' {self.layers[:8]} are not unique and in order")
        if self.layers[-1] >= self.num_layers:
            raise ValueError(f"'layers' name layer {self.layers[-1]} of a model of "
                             f"{self.num_layers} layers")
        for name in ("scales", "windows"):
            count = len(getattr(self, name))
            if count != len(self.layers):
                raise ValueError(f"'{name}' has {count} entries for {len(self.layers)} "
                                 "recorded layers")
        if self.num_kv_heads > self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads "
                             f"{self.num_kv_heads}")
        return self


def problem(error: ValidationError) -> str:
    """pydantic's first error in one line: where in the file, and what is wrong."""
    first = error.errors(include_url=False)[0]
    where = ".".join(str(part) for part in first["loc"])
    message = str(first["msg"]).removeprefix("Value error, ")
    return f"{where}: {message}" if where else message


def read_sidecar(data: Any) -> Sidecar:
    """The checked sidecar of ``data`` (the parsed JSON).

    Raises:
        ValueError: what is wrong, in one line (pydantic's first error).
    """
    try:
        return Sidecar.model_validate(data)
    except ValidationError as error:
        raise ValueError(problem(error)) from None
