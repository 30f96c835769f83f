"""The capture record: everything downstream of a model works from this one type.

A :class:`Capture` holds the tokens of one input, which word each token belongs to, which tokens
are special, and the attention weights ``[layer, head, query, key]`` of the layers and heads that
were kept. It is saved as ``attention.npy`` plus a JSON sidecar ``capture.json`` and loaded back
with numpy and json alone, so re-rendering never imports torch.

On disk (see README, "The capture format")::

    my_capture/                    or   my_capture.npy + my_capture.json
        attention.npy              float32 or float16, shape [layer, head, query, key]
        capture.json               tokens, word ids, layers, heads, model, ...
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from attnviz.capture_build import (  # noqa: F401  (guess_word_ids re-exported)
    attention_fields,
    clean_token,
    escape_controls,
    guess_word_ids,
    measure_label,
    model_label,
)
from attnviz.capture_checks import (  # noqa: F401  (format_indices re-exported)
    SINK_THRESHOLD,
    check_head,
    check_layer,
    format_indices,
    sink_fractions,
)
from attnviz.capture_files import (
    FULL_FILES,
    check_not_incomplete_long,
    remove_other_captures,
    remove_other_sidecars,
)
from attnviz.capture_format import (  # noqa: F401  (re-exported)
    FORMAT_NAME,
    FORMAT_VERSION,
    JSON_NAME,
    MAX_COUNT,
    NPY_NAME,
    ROW_SUM_TOLERANCE,
    _Invalid,
    _paths_for_load,
    _paths_for_save,
    _sidecar_text,
    sidecar_fields,
)
from attnviz.errors import DumpError, UsageError

if TYPE_CHECKING:
    import numpy as np

#: What :meth:`Capture.heatmap`, :meth:`Capture.show` and a notebook's display of a capture
#: call: the package root registers them (see :func:`register_view`).
VIEWS = ("heatmap", "show", "html")
_views: dict[str, Callable[..., Any]] = {}


def register_view(name: str, view: Callable[..., Any]) -> None:
    """Make ``view`` what a capture's convenience ``name`` calls, with the capture first.

    The record draws nothing itself and imports nothing that draws: ``attnviz/__init__.py``
    registers functions that load the figure and notebook code on first use.

    Args:
        name: ``heatmap`` (``view(capture, layer, head, ax, **options) -> (figure, axes)``),
            ``show`` (``view(capture, view, **options) -> widget``) or ``html``
            (``view(capture) -> str``, what a notebook shows for a bare capture).
        view: the function.
    """
    if name not in VIEWS:
        raise ValueError(f"unknown capture view {name!r}: use one of {', '.join(VIEWS)}")
    _views[name] = view


def _view(name: str) -> Callable[..., Any]:
    view = _views.get(name)
    if view is None:  # importing attnviz.capture imports the package root, which registers it
        raise RuntimeError(f"no {name!r} view is registered for captures")
    return view


@dataclass
class Capture:
    """Attention captured from one input.

    Attributes:
        tokens: tokens as the tokenizer shows them (``##ing``, ``Ġcat``), length ``T``.
        display_tokens: the same tokens without subword markers, for labels.
        word_ids: for each token, the index of the word it belongs to, or ``None`` for special
            tokens. Words of a second sentence (``pair``) continue the numbering.
        special: for each token, whether it is a special token ([CLS], [SEP], <s>, ...).
        weights: float32 (or float16 on disk) array ``[layer, head, query, key]`` holding the
            layers in :attr:`layers` and the heads in :attr:`heads`.
        layers: the model's layer index of each entry on axis 0 of :attr:`weights`.
        heads: the model's head index of each entry on axis 1 of :attr:`weights`.
        num_layers: how many layers the model has (for messages and negative indices).
        num_heads: how many heads per layer the model has.
        model: the model's name (``minilm``, ``toy``, a hub id or a folder).
        causal: whether queries attend only to earlier keys (decoder models).
        text: the input text.
        pair: the second sentence of a sentence pair, or ``None``.
        meta: anything else worth keeping (model type, revision, dtype, device, toy config).
    """

    tokens: list[str]
    word_ids: list[int | None]
    special: list[bool]
    weights: np.ndarray
    layers: list[int]
    heads: list[int]
    num_layers: int
    num_heads: int
    model: str
    causal: bool
    text: str
    pair: str | None = None
    display_tokens: list[str] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.display_tokens:
            self.display_tokens = [clean_token(t) for t in self.tokens]
        elif any(not t.isprintable() for t in self.display_tokens):  # from a file or server
            self.display_tokens = [escape_controls(t) for t in self.display_tokens]

    def __repr__(self) -> str:
        """One line (what a notebook shows as text): the weights are not written out."""
        text = " ".join(self.text.split())
        short = text if len(text) <= 40 else text[:39] + "\u2026"
        measure = self.meta.get("measure")
        def count(n: int, what: str) -> str:
            return f"{n} {what}" + ("" if n == 1 else "s")

        return (f"Capture({self.model_label!r}: {count(self.num_tokens, 'token')}, "
                f"{count(len(self.layers), 'layer')} x {count(len(self.heads), 'head')}"
                + (", causal" if self.causal else "")
                + (f", {measure}" if measure else "") + f", text={short!r})")

    # ----------------------------------------------------------------- shape helpers
    @property
    def num_tokens(self) -> int:
        """Number of tokens ``T`` (query and key axes)."""
        return len(self.tokens)

    def layer_position(self, layer: int) -> int:
        """Position on axis 0 of :attr:`weights` of model layer ``layer`` (negative allowed)."""
        return self.layers.index(self.layer_index(layer))

    def head_position(self, head: int) -> int:
        """Position on axis 1 of :attr:`weights` of model head ``head`` (negative allowed)."""
        index = check_head(head, self.num_heads, self.heads)
        if index is None:
            raise UsageError("a head position needs a head index, not the mean of the heads")
        return self.heads.index(index)

    # ----------------------------------------------------------------- the record's questions
    # (attnviz.record.AttentionRecord; answered from the array in attnviz.capture_questions)
    def layer_index(self, layer: int) -> int:
        """The model layer of ``layer`` (negative counts from the end), checked held."""
        return check_layer(layer, self.num_layers, self.layers)

    def head_index(self, head: int | str) -> int | None:
        """The model head of ``head``, checked held; ``None`` for ``"mean"``."""
        return check_head(head, self.num_heads, self.heads)

    @property
    def finest_block(self) -> int:
        """1: every weight is at hand (the atlas at block 1 is the matrix)."""
        return 1

    @property
    def prepared_block(self) -> int | None:
        """1: every atlas block is answered from the array, with no pass to prepare."""
        return 1

    def window_of(self, layer: int) -> int | None:
        """The sliding window of ``layer``: none is recorded in a materialised capture (its
        masked weights are zeros in the array)."""
        self.layer_index(layer)
        return None

    def tile(self, layer: int, head: int | str, q0: int, q1: int, k0: int, k1: int
             ) -> np.ndarray:
        """Exact weights ``A[q0:q1, k0:k1]`` of one head (or ``"mean"``), float32."""
        import attnviz.capture_questions as capture_questions

        return capture_questions.tile(self, layer, head, q0, q1, k0, k1)

    def rows(self, layer: int, head: int | str, q0: int, q1: int) -> np.ndarray:
        """Exact weights of queries ``q0..q1`` against every key: ``[q1 - q0, T]``."""
        return self.tile(layer, head, q0, q1, 0, self.num_tokens)

    def topk(self, layer: int, head: int | str, k: int, q0: int = 0, q1: int | None = None,
             *, progress: Callable[[int, int], None] | None = None
             ) -> tuple[np.ndarray, np.ndarray]:
        """The ``k`` keys each query in ``q0..q1`` attends to most, strongest first (ties:
        the lower key first): ``(indices, values)`` ``[q1 - q0, min(k, T)]`` int64 and
        float32, ``-1`` and 0 for a key a causal query cannot see."""
        import attnviz.capture_questions as capture_questions

        return capture_questions.topk(self, layer, head, k, q0, q1)

    def atlas(self, layer: int, head: int | str, block: int) -> tuple[np.ndarray, np.ndarray]:
        """``(sums, maxes)`` of ``block``-token blocks of queries and keys, ``[nb, nb]``."""
        import attnviz.capture_questions as capture_questions

        return capture_questions.atlas(self, layer, head, block)

    def head_stats(self) -> dict[str, np.ndarray]:
        """Statistic -> ``[layer, head]`` mean over query rows (:mod:`attnviz.analysis.stats`)."""
        import attnviz.capture_questions as capture_questions

        return capture_questions.head_stats(self)

    def received(self, layer: int, head: int | str) -> np.ndarray:
        """Attention received by each key, the column sums ``[T]`` float64 (``"mean"``
        averages them over the held heads)."""
        import attnviz.capture_questions as capture_questions

        return capture_questions.received(self, layer, head)

    def seen_by(self, layer: int | None = None) -> np.ndarray:
        """How many queries see each key: ``[T]`` int64."""
        import attnviz.capture_questions as capture_questions

        return capture_questions.seen_by(self, layer)

    def sinks(self, threshold: float = SINK_THRESHOLD) -> np.ndarray:
        """Attention sinks (Gu et al., 2024): per token, the share of held (layer, head)
        pairs whose mean attention to it over the queries that see it exceeds
        ``threshold``. ``[T]`` float64."""
        return sink_fractions(self, threshold)

    def dense(self, what: str) -> Capture:
        """Every held weight at once: the capture itself."""
        return self

    def prepare(self, *, block: int | None = None, k: int = 0,
                progress: Callable[[int, int], None] | None = None) -> None:
        """Nothing to compute ahead: every weight is at hand."""

    def close(self) -> None:
        """Nothing to let go: the weights are an array (or a memory map numpy closes)."""

    def matrix(self, layer: int, head: int) -> np.ndarray:
        """The ``[query, key]`` float32 matrix of one model layer and head."""
        import numpy as np

        return np.asarray(
            self.weights[self.layer_position(layer), self.head_position(head)], dtype=np.float32
        )

    def mean_matrix(self, layer: int) -> np.ndarray:
        """The ``[query, key]`` mean over the held heads of one model layer."""
        import numpy as np

        block = np.asarray(self.weights[self.layer_position(layer)], dtype=np.float32)
        return block.mean(axis=0)

    @property
    def mean_label(self) -> str:
        """How :meth:`mean_matrix` is named in titles: ``mean of all heads`` or ``mean of heads
        0, 2`` (a capture holding some of the heads)."""
        return ("mean of all heads" if len(self.heads) == self.num_heads
                else f"mean of heads {format_indices(self.heads)}")

    @property
    def measure(self) -> str:
        """What :attr:`weights` hold: ``weights`` (attention itself) or a measure such as
        ``norm`` (``meta["measure"]``, written by the source that computed it)."""
        return str(self.meta.get("measure") or "weights")

    @property
    def measure_label(self) -> str:
        """How titles name the measure (``norm ||αf(x)||``, from its conventions in the
        sidecar); ``""`` for attention weights."""
        if self.measure == "weights":
            return ""
        conventions = self.meta.get("measure_conventions")
        label = conventions.get("label") if isinstance(conventions, dict) else None
        return str(label) if isinstance(label, str) and label else measure_label(self.measure)

    @property
    def rows_sum_to_one(self) -> bool:
        """Whether each query row is a distribution (attention, or a measure whose
        conventions say its rows sum to 1); ``norm`` rows are amounts."""
        if self.measure == "weights":
            return True
        conventions = self.meta.get("measure_conventions")
        return isinstance(conventions, dict) and conventions.get("rows") == "sum to 1"

    @property
    def title_start(self) -> str:
        """The start of every title: ``minilm: `` or, for a measure, ``minilm: norm
        ||\u03b1f(x)||, `` (then ``layer 2, head 3``)."""
        measure = self.measure_label
        return f"{self.model_label}: " + (f"{measure}, " if measure else "")

    @property
    def model_label(self) -> str:
        """The model's name for titles: a local folder's name, not its path
        (:func:`~attnviz.capture_build.model_label`); :attr:`model` keeps the path."""
        return model_label(self.model)

    def select(self, layers: Sequence[int] | None = None,
               heads: Sequence[int] | None = None) -> Capture:
        """A new capture holding only the given model layers and heads (absolute indices)."""
        import numpy as np

        layer_pos = [self.layer_position(i) for i in (self.layers if layers is None else layers)]
        head_pos = [self.head_position(i) for i in (self.heads if heads is None else heads)]
        weights = np.asarray(self.weights[np.ix_(layer_pos, head_pos)], dtype=np.float32)
        return replace(
            self,
            weights=weights,
            layers=[self.layers[p] for p in layer_pos],
            heads=[self.heads[p] for p in head_pos],
            tokens=list(self.tokens),
            display_tokens=list(self.display_tokens),
            word_ids=list(self.word_ids),
            special=list(self.special),
            meta=dict(self.meta),
        )

    def with_weights(self, weights: np.ndarray, **changes: Any) -> Capture:
        """A copy with new weights (and any other changed fields), e.g. after merging words."""
        return replace(self, weights=weights, **changes)

    # ----------------------------------------------------------------- from your own run
    @classmethod
    def from_attentions(cls, attentions: Any, tokens: Any, *,
                        batch_index: int | None = None,
                        attention_mask: Any = None, tokenizer: Any = None,
                        special: Sequence[bool] | None = None,
                        word_ids: Sequence[int | None] | None = None,
                        layers: Sequence[int] | None = None, heads: Sequence[int] | None = None,
                        num_layers: int | None = None, num_heads: int | None = None,
                        model: str = "model", text: str | None = None, pair: str | None = None,
                        causal: bool | None = None, meta: dict[str, Any] | None = None,
                        measure: str = "weights") -> Capture:
        """A capture from attention weights you already have, e.g. ``outputs.attentions``.

        Args:
            attentions: one ``[batch, head, query, key]`` array per layer (torch tensors on any
                device and dtype, or numpy), as ``model(..., output_attentions=True)`` returns
                them; a single stacked ``[layer, batch, head, query, key]`` array also works,
                and ``[head, query, key]`` per layer for an unbatched run.
            tokens: the row's tokens (strings, or ids with ``tokenizer``): either every
                position of the padded row (padding where the mask has 0, nothing else) or
                only its real tokens. A batch of rows (a list of lists, or a 2-D id tensor) is
                indexed with ``batch_index``.
            batch_index: which row of the batch (negative counts from the end); required when
                the weights, tokens or mask hold more than one row.
            attention_mask: ``[batch, key]`` (or ``[key]``) mask of the batch; positions where
                it is 0 (padding, left or right) are dropped from both axes. Without it, a
                key that no query of any layer and head attends to (padding read as a real
                token) is refused, unless the capture is causal.
            tokenizer: optional; turns ids into tokens and tells which tokens are special.
            special: per token, whether it is special ([CLS], <s>...); default: from the
                tokenizer, else tokens that look like ``[CLS]`` or ``<s>``.
            word_ids: per token, its word (``None`` for special tokens); default: guessed
                from subword markers (``##``, ``Ġ``, ``▁``).
            layers: the model layer of each entry of ``attentions`` (default ``0..L-1``);
                ``heads`` likewise for the head axis.
            num_layers: how many layers the model has (default: one past the last layer);
                ``num_heads`` likewise.
            model: the model's name; ``text``/``pair`` the input (default: the joined tokens).
            causal: whether queries only see earlier keys (default: every weight above the
                diagonal is exactly 0).
            meta: anything else to keep.
            measure: only ``"weights"``: the other measures (``norm``, ``alti``...) are
                computed from the model's internals, which attention weights alone do not hold.

        Returns:
            The capture, float32 weights ``[layer, head, query, key]`` of the real tokens.

        Raises:
            UsageError: shapes that disagree (layers, batch, tokens, mask), a batch of
                several rows without ``batch_index`` or a batch index out of range, tokens of
                another row than the mask's (real tokens where it pads, or padding where it
                does not), ``None`` weights (a fused attention kernel), arguments of the wrong
                type, or weights that are not attention: NaN or infinity, negative values,
                key columns of zeros without a mask in a capture that is not causal,
                rows that do not sum to 1 (0 for a row with every key masked), weight above the
                diagonal of a capture said to be ``causal``; a ``measure`` other than weights.
        """
        if measure != "weights":
            raise UsageError(f"Capture.from_attentions builds attention weights, not the measure "
                             f"{measure!r:.40}",
                             "capture the measure from the model: attnviz.capture(model, "
                             f"tokenizer, text, measure={measure!r:.40})")
        return cls(**attention_fields(
            attentions, tokens, batch_index=batch_index, attention_mask=attention_mask,
            tokenizer=tokenizer, special=special, word_ids=word_ids, layers=layers, heads=heads,
            num_layers=num_layers, num_heads=num_heads, model=model, text=text, pair=pair,
            causal=causal, meta=meta))

    # ----------------------------------------------------------------- figures
    def heatmap(self, layer: int, head: int | str = "mean", ax: Any = None,
                **options: Any) -> tuple[Any, Any]:
        """Draw one head as ``attnviz heatmap --layer L --head H`` draws it.

        Args:
            layer: model layer (negative counts from the end).
            head: model head, or ``"mean"`` of the layer's held heads.
            ax: a matplotlib ``Axes`` of your own figure to draw into; ``None``: a new figure
                sized from the content, exactly as the command line makes it.
            **options: the figure options of :class:`attnviz.render.heatmap.FigureOptions`:
                ``cmap``, ``scale`` (``linear``/``power``/``log``), ``gamma``, ``vmax``
                (``"auto"`` or a number; ``1`` for the fixed 0..1 scale), ``annot``, ``dpi``,
                ``words``, ``exclude_special``, ``tokens``/``queries``/``keys`` (windows such
                as ``"10:40"`` or ``"bank:loan"``).

        Returns:
            ``(figure, axes)``: the matplotlib ``Figure`` and the heatmap's ``Axes``. Save with
            ``figure.savefig("head.png")``.
        """
        return _view("heatmap")(self, layer, head, ax, **options)

    # ----------------------------------------------------------------- notebooks
    def show(self, view: str = "head", **options: Any) -> Any:
        """An inline view in a notebook; see :func:`attnviz.show` for the options."""
        return _view("show")(self, view, **options)

    def _repr_html_(self) -> str:
        """Notebooks display a capture as the self-contained report in an iframe."""
        return str(_view("html")(self))

    # ----------------------------------------------------------------- save / load
    def sidecar(self) -> dict[str, Any]:
        """The JSON sidecar as a dict (everything but the weights)."""
        return {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
            "shape": list(self.weights.shape),
            "axes": ["layer", "head", "query", "key"],
            "model": self.model,
            "causal": self.causal,
            "text": self.text,
            "pair": self.pair,
            "layers": list(self.layers),
            "heads": list(self.heads),
            "num_layers": self.num_layers,
            "num_heads": self.num_heads,
            "tokens": list(self.tokens),
            "display_tokens": list(self.display_tokens),
            "word_ids": list(self.word_ids),
            "special": list(self.special),
            "meta": self.meta,
        }

    def save(self, path: Path | str, *, float16: bool = False) -> Path:
        """Write the capture atomically; returns the path of the ``.npy`` file.

        ``path`` ending in ``.npy`` writes ``path`` and ``path.with_suffix('.json')``; any other
        path is a folder holding ``attention.npy`` and ``capture.json``.
        """
        import numpy as np

        from attnviz.fileio import atomic_write, atomic_write_text, ensure_dir

        npy_path, json_path = _paths_for_save(Path(path))
        data = np.ascontiguousarray(self.weights, dtype=np.float16 if float16 else np.float32)
        sidecar = self.sidecar()
        sidecar["dtype"] = str(data.dtype)
        sidecar["weights_file"] = npy_path.name
        text = _sidecar_text(sidecar)  # before any file is touched: a bad meta loses nothing
        ensure_dir(npy_path.parent)
        folder = (npy_path.name, json_path.name) == FULL_FILES  # the folder's one capture
        # Old sidecars out, weights in, new sidecar last: a sidecar always describes the weights
        # beside it, so an interrupted save never pairs new weights with old metadata (nor
        # leaves a long capture's long.json to be read instead of this capture).
        owned = remove_other_sidecars(npy_path.parent, json_path.name) if folder else []
        json_path.unlink(missing_ok=True)
        atomic_write(npy_path, lambda handle: np.save(handle, data, allow_pickle=False))
        atomic_write_text(json_path, text)
        if folder:  # complete: the rest of a long capture saved here before goes
            remove_other_captures(npy_path.parent, FULL_FILES, owned)
        return npy_path


def load_capture(path: Path | str, *, mmap: bool = False) -> Capture:
    """Load a capture saved by :meth:`Capture.save` (no torch needed).

    Args:
        path: the capture folder, or its ``.npy`` or ``.json`` file.
        mmap: memory-map the weights instead of reading them, so only the slices a command
            uses are read from disk.

    Raises:
        DumpError: the files are missing, unreadable, or disagree with each other.
    """
    import numpy as np

    path = Path(path)
    if not path.exists():
        raise DumpError(f"capture {path} does not exist",
                        "create one with: attnviz dump \"your text\" -o my_capture")
    npy_path, json_path = _paths_for_load(path)
    from attnviz.reading import check_regular, load_npy, read_text

    check_regular(json_path)  # a FIFO or a device is refused, never waited on
    check_regular(npy_path)
    if not json_path.is_file():
        if path.is_dir():
            check_not_incomplete_long(path)
        raise DumpError(f"capture {path} has no JSON sidecar ({json_path.name} is missing)",
                        "the capture is incomplete: create it again with attnviz dump")
    if not npy_path.is_file():
        raise DumpError(f"capture {path} has no weights ({npy_path.name} is missing)",
                        "the capture is incomplete: create it again with attnviz dump")
    try:
        meta = json.loads(read_text(json_path))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise DumpError(f"cannot read {json_path}: {exc}",
                        "the sidecar is corrupt: create the capture again") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_NAME:
        raise DumpError(f"{json_path} is not an attnviz capture sidecar",
                        "create one with: attnviz dump \"your text\" -o my_capture")
    with np.errstate(all="ignore"):  # a lying header overflows numpy's size arithmetic
        weights = load_npy(npy_path, mmap=mmap, hint="the weights file is truncated or "
                                                     "corrupt: create the capture again")
    capture = capture_from_parts(meta, weights, origin=str(json_path), check_all=not mmap)
    if not mmap and capture.weights.dtype != np.float32:
        capture.weights = capture.weights.astype(np.float32)
    return capture


def capture_from_parts(meta: dict[str, Any], weights: np.ndarray, *, origin: str,
                       check_all: bool = True) -> Capture:
    """A :class:`Capture` from a parsed sidecar and its weights, after checking both.

    Every field must have its documented type and a sensible value (finite whole numbers in
    range, no duplicate layers or heads, lists as long as the tokens); the weights must be
    float32/float16 ``[layer, head, query, key]`` of the described shape, finite, non-negative,
    each row summing to 1 (within :data:`ROW_SUM_TOLERANCE`; an all-zero row is allowed) and,
    for a causal capture, zero above the diagonal.

    Args:
        meta: the sidecar as parsed JSON.
        weights: the array from the ``.npy`` file (may be memory-mapped).
        origin: the sidecar's path, for messages.
        check_all: check the values of every row; ``False`` checks the first query row of each
            layer and head only (a memory-mapped capture may be larger than memory).

    Raises:
        DumpError: which field or which part of the weights is wrong.
    """
    try:
        return _capture_from(meta, weights, check_all=check_all)
    except _Invalid as exc:
        raise DumpError(f"{origin} is not a valid capture: {exc}",
                        "the capture is damaged or was not written by attnviz: create it again "
                        "with attnviz dump") from None


def _capture_from(meta: dict[str, Any], weights: np.ndarray, check_all: bool = True) -> Capture:
    """Check a parsed sidecar and its weights (raises :class:`_Invalid`, a ``ValueError``)."""
    return Capture(**sidecar_fields(meta, weights, check_all=check_all))
