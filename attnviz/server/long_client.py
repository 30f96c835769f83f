"""``--server`` with long inputs: a long capture that stays on the server.

:class:`RemoteLongCapture` has the reading surface of :class:`~attnviz.long.LongCapture`
(tokens, shape, ``tile``, ``rows``, ``topk``, ``atlas``, ``head_stats``, ``sinks``,
``received``); each call asks ``/api/long/...`` of the server
(:mod:`attnviz.server.long_routes`), which sends bounded answers: queries and keys never cross
the wire. Larger questions are split into parts the server answers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, Protocol

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from attnviz.errors import UsageError
from attnviz.long import LongCapture
from attnviz.server.answers import array_of, field, not_an_answer, numbers, shape_of

if TYPE_CHECKING:
    from collections.abc import Callable

    import numpy as np


class Requester(Protocol):
    """What reads of a remote long capture need of the session: its address and requests."""

    url: str

    def request(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any: ...

#: Values asked for in one request (the server's default bound is 4 Mi).
PART_VALUES = 1 << 21
#: Bounds of what a server may say about a long capture.
MAX_TOKENS = 1 << 24
MAX_LAYERS = 4096
_Size = Annotated[int, Field(ge=1, le=MAX_TOKENS)]
_Count = Annotated[int, Field(ge=1, le=MAX_LAYERS)]


class LongInfo(BaseModel):
    """What ``/api/long/capture`` answers, checked (the fields a client reads)."""

    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)

    id: Annotated[str, Field(min_length=1, max_length=64)]
    max_weights: _Size = PART_VALUES
    model: str
    text: str
    pair: str | None = None
    tokens: list[str]
    display_tokens: list[str]
    word_ids: list[Annotated[int, Field(ge=0)] | None] | None = None
    special: list[bool] | None = None
    layers: list[Annotated[int, Field(ge=0, lt=MAX_LAYERS)]] = Field(min_length=1)
    num_layers: _Count
    num_heads: _Count
    num_kv_heads: _Count
    num_tokens: _Size
    causal: bool
    window: _Size | None = None
    dtype: str = "float32"
    warnings: list[str] = []

    @model_validator(mode="after")
    def _agree(self) -> LongInfo:
        for name in ("tokens", "display_tokens", "word_ids", "special"):
            entries = getattr(self, name)
            if entries is not None and len(entries) != self.num_tokens:
                raise ValueError(f"its {name} are {len(entries)} for {self.num_tokens} tokens")
        if len(set(self.layers)) != len(self.layers) or max(self.layers) >= self.num_layers:
            raise ValueError(f"its layers {self.layers[:8]} are not layers of a model of "
                             f"{self.num_layers}")
        return self


def _shown(text: str) -> str:
    """A server's text for this terminal: control and format characters (escapes, bidi
    overrides) removed."""
    import unicodedata

    return "".join(ch for ch in text if unicodedata.category(ch) not in ("Cc", "Cf"))


class RemoteLongCapture(LongCapture):
    """A long capture held by ``attnviz serve``, read through its API (a
    :class:`~attnviz.long.LongCapture` whose reads are requests; it has no folder here).
    Every answer is checked (shapes, base64, finite numbers, token lists) before use.

    Args:
        session: the :class:`~attnviz.server.client.RemoteSession` that made it.
        info: the server's answer to ``/api/long/capture``.

    Raises:
        ServerError: the answer is not a long capture.
    """

    def __init__(self, session: Requester, info: dict[str, Any]) -> None:
        from attnviz.capture_build import escape_controls

        # LongCapture.__init__ opens a folder; this one reads the server's answer instead.
        self._session = session
        try:
            checked = LongInfo.model_validate(info)
        except ValidationError as error:
            from attnviz.long.sidecar import problem

            raise not_an_answer("a long capture", problem(error)) from None
        self.id = checked.id
        self.part_values = max(1, min(PART_VALUES, checked.max_weights))
        self.model = _shown(checked.model)
        self.text = checked.text
        self.pair = checked.pair
        size = checked.num_tokens
        # Token text is printed here: control characters as their escapes, as local ones.
        self.tokens = [escape_controls(t) for t in checked.tokens]
        self.display_tokens = [escape_controls(t) for t in checked.display_tokens]
        self.word_ids = list(checked.word_ids or [None] * size)
        self.special = list(checked.special or [False] * size)
        self.layers = list(checked.layers)
        self.num_layers = checked.num_layers
        self.num_heads = checked.num_heads
        self.num_kv_heads = checked.num_kv_heads
        self.num_tokens = size
        self.causal = checked.causal
        self.window = checked.window
        self.dtype = _shown(checked.dtype)[:16]
        self.meta = {"warnings": [_shown(w) for w in checked.warnings],
                     "server": session.url}
        self.windows = dict.fromkeys(self.layers, self.window)

    def _ask(self, route: str, **body: Any) -> Any:
        return self._session.request("POST", f"/api/long/{route}", {"id": self.id, **body})

    def tile(self, layer: int, head: int | str, q0: int, q1: int, k0: int, k1: int
             ) -> np.ndarray:
        """Exact weights ``A[q0:q1, k0:k1]`` (``[rows, keys]`` float32), in parts the server
        sends (at most :data:`PART_VALUES` values, or its own bound)."""
        import numpy as np

        step = max(1, self.part_values // max(1, k1 - k0))
        parts = []
        for start in range(q0, q1, step):
            stop = min(q1, start + step)
            answer = self._ask("tile", layer=layer, head=head, q0=start, q1=stop, k0=k0, k1=k1)
            shape = shape_of(field(answer, "shape", "a tile"), "a tile", 2)
            if shape != (stop - start, k1 - k0):
                raise not_an_answer("the tile asked for", f"its shape is {list(shape)}, not "
                                                          f"{[stop - start, k1 - k0]}")
            parts.append(_weights(field(answer, "weights", "a tile"), "a tile", shape))
        if not parts:
            return np.zeros((0, max(0, k1 - k0)), dtype=np.float32)
        return np.concatenate(parts)

    def rows(self, layer: int, head: int | str, q0: int, q1: int) -> np.ndarray:
        return self.tile(layer, head, q0, q1, 0, self.num_tokens)

    def topk(self, layer: int, head: int | str, k: int, q0: int = 0, q1: int | None = None,
             *, progress: Callable[[int, int], None] | None = None
             ) -> tuple[np.ndarray, np.ndarray]:
        """``(indices, values)`` ``[queries, k]`` as :meth:`LongCapture.topk`, in parts
        (``progress(queries done, queries)`` after each)."""
        import numpy as np

        q1 = self.num_tokens if q1 is None else q1
        step = max(1, self.part_values // max(1, k))
        indices, values = [], []
        for start in range(q0, q1, step):
            stop = min(q1, start + step)
            answer = self._ask("topk", layer=layer, head=head, k=k, q0=start, q1=stop)
            shape = shape_of(field(answer, "shape", "a top-k"), "a top-k", 2)
            if shape[0] != stop - start or not 1 <= shape[1] <= max(1, k):
                raise not_an_answer("the top-k asked for", f"its shape is {list(shape)} for "
                                                           f"{stop - start} queries")
            indices.append(numbers(field(answer, "indices", "a top-k"), "a top-k", shape,
                                   integers=True, low=-1, high=self.num_tokens - 1))
            values.append(_weights(field(answer, "values", "a top-k"), "a top-k", shape))
            if progress is not None:
                progress(stop - q0, q1 - q0)
        if not values:
            return np.zeros((0, k), dtype=np.int64), np.zeros((0, k), dtype=np.float32)
        return np.concatenate(indices), np.concatenate(values)

    def atlas(self, layer: int, head: int | str, block: int) -> tuple[np.ndarray, np.ndarray]:
        answer = self._ask("atlas", layer=layer, head=head, block=block)
        shape = shape_of(field(answer, "shape", "an atlas"), "an atlas", 2)
        side = -(-self.num_tokens // max(1, int(block)))
        if shape != (side, side):
            raise not_an_answer("the atlas asked for", f"its shape is {list(shape)}, not "
                                                       f"{[side, side]}")
        sums = array_of(field(answer, "sums", "an atlas"), "<f4", "an atlas", shape)
        return sums, _weights(field(answer, "maxes", "an atlas"), "an atlas", shape)

    def head_stats(self) -> dict[str, np.ndarray]:
        stats = field(self._ask("stats"), "stats", "head statistics")
        if not isinstance(stats, dict) or len(stats) > 64:
            raise not_an_answer("head statistics", "its stats are not named tables")
        shape = (len(self.layers), self.num_heads)
        return {_shown(str(name))[:40]: numbers(values, "head statistics", shape)
                for name, values in stats.items()}

    def sinks(self, threshold: float = 0.3) -> np.ndarray:
        return numbers(field(self._ask("stats", threshold=threshold), "sinks", "sinks"),
                       "sinks", (self.num_tokens,), low=0, high=1)

    def received(self, layer: int, head: int | str) -> np.ndarray:
        return array_of(field(self._ask("received", layer=layer, head=head), "received",
                              "attention received"), "<f8", "attention received",
                        (self.num_tokens,))

    def save(self, folder: Any) -> Any:
        raise UsageError("a long capture made by a server stays there: its queries and keys "
                         "are not sent", "run attnviz dump --long on the server's machine, or "
                         "leave out --server")

    @property
    def prepared_block(self) -> int | None:
        """None: every atlas is asked of the server."""
        return None

    def prepare(self, *, block: int | None = None, k: int = 0,
                progress: Callable[[int, int], None] | None = None) -> None:
        """Nothing to compute here: the server answers each question (from its own pass)."""

    def close(self) -> None:
        """Nothing to free here: the server keeps its last few long captures."""

    def __repr__(self) -> str:
        return (f"RemoteLongCapture(model={self.model_label!r}, tokens={self.num_tokens}, "
                f"server={self._session.url!r})")


def _weights(text: Any, what: str, shape: tuple[int, ...]) -> np.ndarray:
    """Attention weights a server sent: float32 of ``shape``, each from 0 to 1."""
    import numpy as np

    values = array_of(text, "<f4", what, shape)
    if values.size and not (float(values.min()) >= 0 and float(values.max()) <= 1 + 1e-3):
        raise not_an_answer(what, "its weights are not between 0 and 1")
    return values.astype(np.float32)
