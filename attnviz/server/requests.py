"""The request bodies of the live server's JSON API, declared with pydantic.

Each route reads one model: :class:`ModelRequest` (``/api/model``), :class:`CaptureRequest`
(``/api/capture``, ``/api/capture.zip``), :class:`TopkRequest`, :class:`InductionRequest` and
:class:`ExplainRequest`. Every field has its type and bound; unknown fields are refused
(``extra="forbid"``), so no request can name a file, a folder or an option the server does not
have. A field sent as ``null`` is the same as a field left out.

Errors speak as the CLI does: :func:`parse` turns pydantic's first error into an
:class:`ApiError` whose message names the field (``'layer' must be an integer such as 5 or -1,
not a string``), with the HTTP status (413 for a field that is too long, 422 otherwise). Bounds
that belong to the running server (``--max-chars``, the largest ``k``) come in the validation
context (:func:`parse`'s ``limits``).
"""

from __future__ import annotations

from typing import Annotated, Any, TypeVar

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    ValidationError,
    ValidationInfo,
    model_validator,
)
from pydantic_core import PydanticCustomError

from attnviz.errors import AttnvizError
from attnviz.measures import MEASURES

MAX_LIST = 4096  # items in a layer or head list of a request
MAX_IDS = 8192  # token positions in an induction request
TEXT_EXAMPLE = '{"text": "The cat sat on the mat"}'
TOY_EXAMPLE = '{"model": "toy", "toy": {"layers": 2, "heads": 4, "causal": true}}'
#: Weight encodings a capture request can ask for: 8- or 16-bit quantised as in the HTML report
#: (compact, what the page uses), or exact float32.
WEIGHT_FORMATS = ("q8", "q16", "float32")
# The toy model's sizes a request may ask for (the CLI allows more; a shared server stays small).
TOY_BOUNDS = {"d_model": 512, "heads": 32, "layers": 12}


class ApiError(AttnvizError):
    """A request the server cannot serve, with its HTTP status.

    Attributes:
        status: the HTTP status code (413, 422, 503, ...).
        kind: the :mod:`attnviz.errors` class the CLI would raise for the same problem; the
            ``--server`` client raises that class again, so exit codes match a local run.
        retry_after: seconds after which the same request may succeed (sent as
            ``Retry-After`` with a 503); ``None`` when trying again will not help.
    """

    def __init__(self, status: int, message: str, hint: str | None = None, *,
                 kind: str = "UsageError", retry_after: int | None = None) -> None:
        super().__init__(message, hint)
        self.status = status
        self.kind = kind
        self.retry_after = retry_after


def json_type(value: Any) -> str:
    """The JSON name of a value's type, for messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object" if isinstance(value, dict) else type(value).__name__


# --------------------------------------------------------------------------- field types
def _refuse(message: str, hint: str | None = None, *, status: int = 422,
            kind: str = "UsageError") -> PydanticCustomError:
    """A validation error that :func:`parse` turns into ``ApiError(status, message, hint)``."""
    return PydanticCustomError("attnviz", "{message}", {"message": message, "hint": hint,
                                                        "status": status, "kind": kind})


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _whole(value: Any, name: str, low: int, high: int) -> int:
    if not _is_int(value):
        raise _refuse(f"'{name}' must be an integer such as 5 or -1, not {json_type(value)}")
    if not low <= value <= high:
        raise _refuse(f"'{name}' is {value}; it must be between {low} and {high}")
    return int(value)


def _check_length(name: str, value: list[Any]) -> None:
    if len(value) > MAX_LIST:
        raise _refuse(f"'{name}' lists {len(value)} items; at most {MAX_LIST}",
                      "send a selection string such as \"0-11\" instead", status=413)


def chars(limit: int | None = None) -> BeforeValidator:
    """A string of at most ``limit`` characters (``None``: the server's ``--max-chars``)."""
    def check(value: Any, info: ValidationInfo) -> str:
        name = info.field_name
        if not isinstance(value, str):
            raise _refuse(f"'{name}' must be a string, not {json_type(value)}")
        bound = limit if limit is not None else int((info.context or {})["max_chars"])
        if len(value) > bound:
            raise _refuse(f"'{name}' is {len(value):,} characters long; this server takes at "
                          f"most {bound:,}", "send a shorter text, or start the server with a "
                          "higher --max-chars", status=413, kind="InputError")
        return value

    return BeforeValidator(check)


def between(low: int, high: int) -> BeforeValidator:
    """A whole number from ``low`` to ``high`` (JSON ``true`` is not a number here)."""
    return BeforeValidator(lambda value, info: _whole(value, str(info.field_name), low, high))


def one_of(*options: str) -> BeforeValidator:
    """One of ``options``."""
    def check(value: Any, info: ValidationInfo) -> str:
        if not isinstance(value, str) or value not in options:
            shown = value if isinstance(value, str) else json_type(value)
            raise _refuse(f"'{info.field_name}' must be one of {', '.join(options)}, not "
                          f"{shown[:100]!r}")
        return value

    return BeforeValidator(check)


def _flag(value: Any, info: ValidationInfo) -> bool:
    if not isinstance(value, bool):
        raise _refuse(f"'{info.field_name}' must be true or false, not {json_type(value)}")
    return value


def _top_k(value: Any, info: ValidationInfo) -> int:
    """``k``, up to the server's bound."""
    return _whole(value, "k", 1, int((info.context or {}).get("max_k", 100)))


def _selection(value: Any, info: ValidationInfo) -> str:
    """A layer or head selection: ``"0,2-4"``, ``"all"`` or a list of integers (as text)."""
    name = str(info.field_name)
    if isinstance(value, str):
        if len(value) > 1000:
            raise _refuse(f"'{name}' is longer than 1000 characters", status=413)
        return value
    if isinstance(value, list) and all(_is_int(v) for v in value):
        if not value:
            raise _refuse(f"'{name}' is an empty list", "leave it out to keep all")
        _check_length(name, value)
        return ",".join(str(v) for v in value)
    raise _refuse(f"'{name}' must be a selection such as \"0,2-4\" or a list of integers, not "
                  f"{json_type(value)}")


def _head(value: Any, info: ValidationInfo) -> int | str | list[int]:
    """A head index, ``"mean"`` (the mean of the layer's heads) or a list of heads (their
    mean)."""
    name = str(info.field_name)
    if isinstance(value, str) and value.strip().lower() == "mean":
        return "mean"
    if isinstance(value, list) and all(_is_int(v) for v in value):
        if not value:
            raise _refuse(f"'{name}' is an empty list",
                          f'send e.g. {{"{name}": [0, 3]}} or "mean"')
        _check_length(name, value)
        return [int(v) for v in value] if len(value) > 1 else int(value[0])
    if not _is_int(value):
        raise _refuse(f"'{name}' must be a head index, \"mean\" or a list of heads, not "
                      f"{json_type(value)}")
    return int(value)


def _ids(value: Any, info: ValidationInfo) -> list[int]:
    name = info.field_name
    if not isinstance(value, list) or not all(_is_int(v) for v in value):
        raise _refuse(f"'{name}' must be a list of integers, not {json_type(value)}")
    if len(value) > MAX_IDS:
        raise _refuse(f"'{name}' holds {len(value)} items, more than {MAX_IDS}", status=413)
    return [int(v) for v in value]


def _token(value: Any, info: ValidationInfo) -> int | str:
    if not (_is_int(value) or isinstance(value, str)):
        raise _refuse("'token' must be a position (an integer) or a word, not "
                      f"{json_type(value)}")
    if isinstance(value, str) and len(value) > 200:
        raise _refuse("'token' is longer than 200 characters", status=413)
    return value


Text = Annotated[str, chars()]
OptionalText = Annotated[str | None, chars()]
ModelName = Annotated[str | None, chars(500)]
Flag = Annotated[bool, BeforeValidator(_flag)]
OptionalFlag = Annotated[bool | None, BeforeValidator(_flag)]
Layers = Annotated[str | None, BeforeValidator(_selection)]
Position = Annotated[int | None, between(-(1 << 20), 1 << 20)]


# --------------------------------------------------------------------------- the requests
class _Request(BaseModel):
    """A JSON object with known fields only; ``null`` is the same as leaving a field out."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_absent(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {key: value for key, value in data.items() if value is not None}
        return data


class ToyRequest(_Request):
    """``toy``: the toy model's settings (unset ones keep the toy model's defaults)."""

    d_model: Annotated[int | None, between(1, TOY_BOUNDS["d_model"])] = None
    heads: Annotated[int | None, between(1, TOY_BOUNDS["heads"])] = None
    layers: Annotated[int | None, between(1, TOY_BOUNDS["layers"])] = None
    seed: Annotated[int | None, between(0, 2**32 - 1)] = None
    causal: OptionalFlag = None
    scale: OptionalFlag = None


class ModelRequest(_Request):
    """``/api/model``: which model (default: the server's first), and the toy's settings."""

    model: ModelName = None
    toy: ToyRequest | None = None


class TextRequest(_Request):
    """The fields every capture of a text takes: the text (and pair), the model, the token
    limit and the layers to keep."""

    text: Text
    pair: OptionalText = None
    model: ModelName = None
    toy: ToyRequest | None = None
    max_tokens: Annotated[int | None, between(1, 1 << 30)] = None
    layers: Layers = None
    truncate: Flag = True


class CaptureRequest(TextRequest):
    """``/api/capture.zip``: the text (and pair) to capture, on which model, what to keep."""

    heads: Layers = None
    measure: Annotated[str, one_of(*MEASURES)] = "weights"


class WeightsRequest(CaptureRequest):
    """``/api/capture``: a capture, with its weights' encoding and (optionally) statistics."""

    weights: Annotated[str, one_of(*WEIGHT_FORMATS)] = "q8"
    stats: Flag = False


class TopkRequest(CaptureRequest):
    """``/api/topk``: one head (or ``"mean"``, or a list: their mean) of a capture."""

    layer: Annotated[int, between(-(1 << 20), 1 << 20)]
    head: Annotated[int | str | list[int], BeforeValidator(_head)]
    k: Annotated[int, BeforeValidator(_top_k)] = 3
    words: Flag = False
    exclude_special: Flag = False
    query: Position = None
    format: Annotated[str, one_of("json", "csv")] = "json"


class GenerateRequest(_Request):
    """``/api/generate``: a prompt to continue on a served causal language model, and the head
    whose strongest keys each generated token streams."""

    text: Text
    model: ModelName = None
    max_new_tokens: Annotated[int, between(1, 4096)] = 20
    sample: Flag = False
    seed: Annotated[int | None, between(0, (1 << 32) - 1)] = None
    layer: Annotated[int, between(-(1 << 20), 1 << 20)] = -1
    head: Annotated[int | str | list[int], BeforeValidator(_head)] = "mean"
    k: Annotated[int, BeforeValidator(_top_k)] = 3


class InductionRequest(ModelRequest):
    """``/api/induction``: the model's prefix ids followed by positions in its usable tokens."""

    ids: Annotated[list[int], BeforeValidator(_ids)]


class ExplainRequest(_Request):
    """``/api/explain``: one toy head's calculation for one query token."""

    text: Text
    token: Annotated[int | str, BeforeValidator(_token)]
    model: ModelName = None
    layer: Annotated[int, between(-64, 64)] = 0
    head: Annotated[int, between(-256, 256)] = 0
    toy: ToyRequest | None = None


# --------------------------------------------------------------------------- errors
# The message of a required field left out (or sent as null): (message, hint, kind).
_MISSING = {
    "text": ("'text' is missing from the request body", f"send e.g. {TEXT_EXAMPLE}",
             "InputError"),
    "layer": ("'layer' is missing", 'send e.g. {"layer": 5, "head": 3}', "UsageError"),
    "head": ("'head' is missing", 'send e.g. {"head": 3} or "mean"', "UsageError"),
    "ids": ("'ids' must be a list of integers, not null", None, "UsageError"),
    "token": ("'token' must be a position (an integer) or a word, not null", None,
              "UsageError"),
}


def _where(loc: tuple[Any, ...]) -> tuple[str, str]:
    """The object a location is in, for messages, and an example of it."""
    if loc and loc[0] == "toy":
        return "'toy'", TOY_EXAMPLE
    return "the request body", TEXT_EXAMPLE


def _api_error(error: ValidationError, model: type[BaseModel]) -> ApiError:
    """The first of pydantic's errors, as the CLI would say it."""
    errors = error.errors(include_url=False)
    first = errors[0]
    loc = tuple(first["loc"])
    if first["type"] == "attnviz":
        ctx = first.get("ctx") or {}
        return ApiError(int(ctx["status"]), str(ctx["message"]), ctx.get("hint"),
                        kind=str(ctx["kind"]))
    if first["type"] in ("model_type", "model_attributes_type", "dict_type"):
        what = "the request body" if not loc else f"'{loc[-1]}'"
        example = TEXT_EXAMPLE if not loc else TOY_EXAMPLE
        return ApiError(422, f"{what} must be a JSON object, not {json_type(first['input'])}",
                        f"send e.g. {example}")
    if first["type"] == "missing" and loc and loc[-1] in _MISSING:
        message, hint, kind = _MISSING[str(loc[-1])]
        return ApiError(422, message, hint, kind=kind)
    if first["type"] == "extra_forbidden":
        parent = loc[:-1]
        unknown = sorted(str(e["loc"][-1]) for e in errors
                         if e["type"] == "extra_forbidden" and tuple(e["loc"][:-1]) == parent)
        what, _ = _where(parent)
        known = ToyRequest if parent else model
        names = ", ".join(repr(n)[:60] for n in unknown[:5])
        return ApiError(422, f"unknown field(s) in {what}: {names}",
                        f"the fields are {', '.join(sorted(known.model_fields))}")
    name = ".".join(str(part) for part in loc) or "the request body"
    return ApiError(422, f"'{name}': {first['msg']}"[:300])


_Model = TypeVar("_Model", bound=BaseModel)


def parse(model: type[_Model], data: Any, *, max_chars: int, max_k: int) -> _Model:
    """``data`` (parsed JSON) as ``model``, or the :class:`ApiError` of its first problem.

    Args:
        model: the request model of the route.
        data: the decoded JSON body.
        max_chars: the server's bound on the characters of ``text`` and ``pair`` each.
        max_k: the server's bound on top-k's ``k``.
    """
    try:
        return model.model_validate(data, context={"max_chars": max_chars, "max_k": max_k})
    except ValidationError as error:
        raise _api_error(error, model) from None


__all__ = ["ApiError", "CaptureRequest", "ExplainRequest", "InductionRequest", "ModelRequest",
           "ToyRequest", "TopkRequest", "WeightsRequest", "json_type", "parse"]
