"""The one question surface of attention, whatever holds it.

Attention of any length is asked the same questions with the same types and answers
(:class:`AttentionRecord`): its tokens and metadata, an exact window (a tile), rows, top-k,
per-head statistics, the atlas at a block size (sum and max), the attention each key receives
and the attention sinks. Where the weights live is the record's business alone:

* :class:`attnviz.capture.Capture` holds every weight in an array and answers from it
  (:mod:`attnviz.capture_questions`);
* :class:`attnviz.long.LongCapture` holds queries, keys and log-sum-exp on disk and computes
  the weights it is asked for, tile by tile;
* :class:`attnviz.server.long_client.RemoteLongCapture` asks a server.

A command, the exporter, a figure, a view or a route asks its question and never which kind it
holds (``tests/test_architecture.py`` keeps it so). A new storage (a capture kept on a GPU, or
sharded on disk) is one class that answers this surface; nothing downstream changes.

What every storage shares, so that the answers and the errors are identical, is in
:mod:`attnviz.capture_checks`: index checks (``check_layer``, ``check_head``, ``check_span``),
the bounds of a question (``MAX_TILE``, ``MAX_TOPK``, ``check_block``) and the sinks rule
(``sink_fractions``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from attnviz.capture_checks import SINK_THRESHOLD

if TYPE_CHECKING:
    from collections.abc import Callable

    import numpy as np

    from attnviz.capture import Capture

class AttentionRecord(Protocol):
    """What every attention record answers (see the module docstring).

    Layers and heads are the model's indices (negative counts from the end); ``head`` is an
    index or ``"mean"`` (the mean over the record's heads). A layer or head the record does
    not hold, a range outside the text and a question past its bound raise the same
    :class:`~attnviz.errors.UsageError` whatever the storage.

    Attributes:
        tokens, display_tokens, word_ids, special: one entry per token.
        text, pair, model, causal, meta: the input and where it came from.
        num_tokens: ``T``. num_layers, num_heads: the model's.
        layers, heads: the model layers and heads the record holds.
        measure, measure_label, rows_sum_to_one: what the weights are (attention, or a
            measure such as ``norm``).
        finest_block: the smallest atlas block the record answers: 1 where every weight is at
            hand (the atlas at block 1 is the matrix, and figures draw every weight), larger
            where weights are computed on demand (figures of a whole head draw the atlas).
    """

    tokens: list[str]
    display_tokens: list[str]
    word_ids: list[int | None]
    special: list[bool]
    text: str
    pair: str | None
    model: str
    causal: bool
    meta: dict[str, Any]
    layers: list[int]
    num_layers: int
    num_heads: int

    @property
    def num_tokens(self) -> int: ...

    @property
    def heads(self) -> list[int]: ...

    @property
    def measure(self) -> str: ...

    @property
    def measure_label(self) -> str: ...

    @property
    def rows_sum_to_one(self) -> bool: ...

    @property
    def finest_block(self) -> int: ...

    @property
    def prepared_block(self) -> int | None:
        """The finest atlas block answered from what the record holds, with no pass over a
        head (1 where every weight is at hand; after :meth:`prepare`, its block), or
        ``None``."""
        ...

    @property
    def title_start(self) -> str: ...

    @property
    def model_label(self) -> str: ...

    @property
    def mean_label(self) -> str: ...

    def layer_index(self, layer: int) -> int:
        """The model layer of ``layer`` (negative counts from the end), checked held."""
        ...

    def head_index(self, head: int | str) -> int | None:
        """The model head of ``head``, checked held; ``None`` for ``"mean"``."""
        ...

    def window_of(self, layer: int) -> int | None:
        """The sliding window of ``layer`` (keys ``i - window < j <= i``), or ``None``."""
        ...

    def tile(self, layer: int, head: int | str, q0: int, q1: int, k0: int, k1: int
             ) -> np.ndarray:
        """Exact weights ``A[q0:q1, k0:k1]``, ``[q1 - q0, k1 - k0]`` float32."""
        ...

    def rows(self, layer: int, head: int | str, q0: int, q1: int) -> np.ndarray:
        """Exact weights of queries ``q0..q1`` against every key, ``[q1 - q0, T]``."""
        ...

    def topk(self, layer: int, head: int | str, k: int, q0: int = 0, q1: int | None = None,
             *, progress: Callable[[int, int], None] | None = None
             ) -> tuple[np.ndarray, np.ndarray]:
        """``(indices, values)`` ``[q1 - q0, k]`` (int64, float32), strongest first; ``-1``
        and 0 where a query sees fewer than ``k`` keys; ``progress(rows done, rows)`` follows
        a pass where the weights are computed on demand."""
        ...

    def atlas(self, layer: int, head: int | str, block: int) -> tuple[np.ndarray, np.ndarray]:
        """``(sums, maxes)`` ``[nb, nb]`` float32 over ``block``-token blocks."""
        ...

    def head_stats(self) -> dict[str, np.ndarray]:
        """Statistic -> ``[layer, head]`` mean over query rows (:mod:`attnviz.analysis.stats`)."""
        ...

    def received(self, layer: int, head: int | str) -> np.ndarray:
        """Attention received by each key, the column sums ``[T]`` float64."""
        ...

    def seen_by(self, layer: int | None = None) -> np.ndarray:
        """How many queries see each key, ``[T]`` int64."""
        ...

    def sinks(self, threshold: float = SINK_THRESHOLD) -> np.ndarray:
        """Per token, the share of held (layer, head) pairs whose mean attention to it (over
        the queries that see it) exceeds ``threshold``; ``[T]`` float64."""
        ...

    def prepare(self, *, block: int | None = None, k: int = 0,
                progress: Callable[[int, int], None] | None = None) -> None:
        """Answer the whole-record questions (statistics, received attention, the atlas at
        ``block`` and coarser, with ``k > 0`` every head's top-``k``) ahead of the asks, in
        one pass where the weights are computed on demand; nothing to do where every weight
        is at hand. Later questions are answered from what it kept."""
        ...

    def close(self) -> None:
        """Let go of what the record holds open (memory maps, a temporary folder)."""
        ...

    def dense(self, what: str) -> Capture:
        """Every held weight at once, as a :class:`~attnviz.capture.Capture`, for ``what``
        (a view that re-normalises whole rows, rollout, a whole-matrix report).

        Raises:
            UsageError: more than :data:`attnviz.capture_checks.MAX_DENSE` weights.
        """
        ...
