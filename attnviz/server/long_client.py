"""``--server`` with long inputs: a long capture that stays on the server.

:class:`RemoteLongCapture` has the reading surface of :class:`~attnviz.long.LongCapture`
(tokens, shape, ``tile``, ``rows``, ``topk``, ``atlas``, ``head_stats``, ``sinks``,
``received``); each call asks ``/api/long/...`` of the server
(:mod:`attnviz.server.long_routes`), which sends bounded answers: queries and keys never cross
the wire. Larger questions are split into parts the server answers.
"""

from __future__ import annotations

import base64
from typing import TYPE_CHECKING, Any, Protocol

from attnviz.errors import UsageError
from attnviz.long import LongCapture

if TYPE_CHECKING:
    import numpy as np


class Requester(Protocol):
    """What reads of a remote long capture need of the session: its address and requests."""

    url: str

    def request(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any: ...

#: Values asked for in one request (the server's default bound is 4 Mi).
PART_VALUES = 1 << 21


def _array(text: str, dtype: str, shape: list[int] | None = None) -> np.ndarray:
    import numpy as np

    data = np.frombuffer(base64.b64decode(text, validate=True), dtype=dtype).copy()
    return data.reshape(shape) if shape is not None else data


class RemoteLongCapture(LongCapture):
    """A long capture held by ``attnviz serve``, read through its API (a
    :class:`~attnviz.long.LongCapture` whose reads are requests; it has no folder here).

    Args:
        session: the :class:`~attnviz.server.client.RemoteSession` that made it.
        info: the server's answer to ``/api/long/capture``.

    Raises:
        KeyError, TypeError, ValueError: the answer is not a long capture.
    """

    def __init__(self, session: Requester, info: dict[str, Any]) -> None:
        # LongCapture.__init__ opens a folder; this one reads the server's answer instead.
        self._session = session
        self.id = str(info["id"])
        self.part_values = max(1, min(PART_VALUES, int(info.get("max_weights", PART_VALUES))))
        self.model = str(info["model"])
        self.text = str(info["text"])
        self.pair = info.get("pair")
        self.tokens = [str(t) for t in info["tokens"]]
        self.display_tokens = [str(t) for t in info["display_tokens"]]
        self.word_ids = list(info.get("word_ids") or [])
        self.special = [bool(s) for s in info.get("special") or []]
        self.layers = [int(x) for x in info["layers"]]
        self.num_layers = int(info["num_layers"])
        self.num_heads = int(info["num_heads"])
        self.num_kv_heads = int(info["num_kv_heads"])
        self.num_tokens = int(info["num_tokens"])
        self.causal = bool(info["causal"])
        self.window = None if info.get("window") is None else int(info["window"])
        self.dtype = str(info.get("dtype", "float32"))
        self.meta = {"warnings": [str(w) for w in info.get("warnings", [])],
                                     "server": session.url}
        if len(self.display_tokens) != self.num_tokens:
            raise ValueError("its display tokens are not one per token")
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
            parts.append(_array(answer["weights"], "<f4", answer["shape"]))
        if not parts:
            return np.zeros((0, max(0, k1 - k0)), dtype=np.float32)
        return np.concatenate(parts)

    def rows(self, layer: int, head: int | str, q0: int, q1: int) -> np.ndarray:
        return self.tile(layer, head, q0, q1, 0, self.num_tokens)

    def topk(self, layer: int, head: int | str, k: int, q0: int = 0, q1: int | None = None
             ) -> tuple[np.ndarray, np.ndarray]:
        """``(indices, values)`` ``[queries, k]`` as :meth:`LongCapture.topk`, in parts."""
        import numpy as np

        q1 = self.num_tokens if q1 is None else q1
        step = max(1, self.part_values // max(1, k))
        indices, values = [], []
        for start in range(q0, q1, step):
            stop = min(q1, start + step)
            answer = self._ask("topk", layer=layer, head=head, k=k, q0=start, q1=stop)
            indices.append(np.asarray(answer["indices"], dtype=np.int64))
            values.append(_array(answer["values"], "<f4", answer["shape"]))
        return np.concatenate(indices), np.concatenate(values)

    def atlas(self, layer: int, head: int | str, block: int) -> tuple[np.ndarray, np.ndarray]:
        answer = self._ask("atlas", layer=layer, head=head, block=block)
        return (_array(answer["sums"], "<f4", answer["shape"]),
                _array(answer["maxes"], "<f4", answer["shape"]))

    def head_stats(self) -> dict[str, np.ndarray]:
        import numpy as np

        answer = self._ask("stats")
        return {str(name): np.asarray(values, dtype=np.float64)
                for name, values in answer["stats"].items()}

    def sinks(self, threshold: float = 0.3) -> np.ndarray:
        import numpy as np

        return np.asarray(self._ask("stats", threshold=threshold)["sinks"], dtype=np.float64)

    def received(self, layer: int, head: int | str) -> np.ndarray:
        return _array(self._ask("received", layer=layer, head=head)["received"], "<f8")

    def save(self, folder: Any) -> Any:
        raise UsageError("a long capture made by a server stays there: its queries and keys "
                         "are not sent", "run attnviz dump --long on the server's machine, or "
                         "leave out --server")

    def close(self) -> None:
        """Nothing to free here: the server keeps its last few long captures."""

    def __repr__(self) -> str:
        return (f"RemoteLongCapture(model={self.model!r}, tokens={self.num_tokens}, "
                f"server={self._session.url!r})")
