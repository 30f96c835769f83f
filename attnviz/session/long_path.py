"""The session's long path: when a full capture would not fit, and the long capture instead.

A full capture holds ``layers x heads x T x T`` float32 weights; at 8k tokens and beyond that is
more memory than a machine has. The long capture (:mod:`attnviz.long`) keeps each layer's
queries, keys and log-sum-exp (``O(T x d)``) and computes exact weights on demand. This module
decides which of the two answers a request and runs the long one; :class:`LongPath` is mixed
into :class:`~attnviz.session.Session`::

    from attnviz.request import CaptureRequest
    from attnviz.session import Session

    cap = Session().run(CaptureRequest(text=book, model="./llama", long=None))
    # a Capture when layers x heads x T^2 x 4 bytes fits under $ATTNVIZ_MAX_FULL_MB,
    # else a LongCapture (the session's warn says which, in one line)

The capture cache holds full captures only: long captures are not cached (their queries and
keys live in a folder of their own, or in memory).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, TypeVar, cast

from attnviz.errors import InputError, UsageError

if TYPE_CHECKING:
    import threading
    from pathlib import Path

    from attnviz.capture import Capture
    from attnviz.long import LongCapture
    from attnviz.models import AttentionSource, ModelShape, ModelSpec
    from attnviz.record import AttentionRecord
    from attnviz.request import CaptureRequest

_T = TypeVar("_T")
ENV_MAX_FULL_MB = "ATTNVIZ_MAX_FULL_MB"
#: The default limit of a full capture when the free memory cannot be read.
FALLBACK_MAX_FULL_MB = 2048
#: Share of the free memory a full capture may take by default.
FREE_MEMORY_SHARE = 0.25
_MAX_FULL_MB_CEILING = 100_000_000
#: The most tokens one long capture takes (2**20; a model's own limit applies first).
MAX_LONG_TOKENS = 1 << 20
#: Special tokens a tokenizer may add around a text and a pair (an upper bound).
_SPECIAL_ROOM = 16
#: What ``dump`` says when it takes the long path by itself (after why).
DUMPING_LONG = ("writing a long capture (long.json, q_/k_/lse_LLL.npy) instead of attention.npy; "
                "--no-long writes every weight")


def size_text(size: float) -> str:
    """``12.3 GB``, ``640 MB``, ``12 KB``: a byte count for messages."""
    for unit, scale in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if size >= scale:
            return f"{size / scale:.3g} {unit}"
    return f"{int(size)} bytes"


def max_full_bytes() -> int:
    """The largest full capture (float32 weights) the session makes before it takes the long
    path by itself: ``$ATTNVIZ_MAX_FULL_MB`` megabytes, else a quarter of the free memory
    (2 GB when that cannot be read).

    Raises:
        UsageError: the variable is not a number of megabytes above 0.
    """
    from attnviz.request import megabytes_from_env

    given = megabytes_from_env(ENV_MAX_FULL_MB, _MAX_FULL_MB_CEILING, 4096,
                               "a quarter of the free memory")
    if given is not None:
        return given
    try:
        import psutil
    except ImportError:  # pragma: no cover - psutil comes with accelerate
        return FALLBACK_MAX_FULL_MB << 20
    return max(1 << 20, int(FREE_MEMORY_SHARE * psutil.virtual_memory().available))


def full_bytes(layers: int, heads: int, tokens: int) -> int:
    """Bytes of a full capture: ``layers x heads x tokens x tokens`` float32 weights."""
    return 4 * layers * heads * tokens * tokens


def _count(number: int, what: str) -> str:
    return f"{number} {what}" + ("" if number == 1 else "s")


def _kept(selection: str | None, size: int, what: str) -> int:
    from attnviz.selection import parse_selection

    return size if not selection else len(parse_selection(selection, size, what))


class LongPath:
    """The long path of :class:`~attnviz.session.Session` (a mixin: it uses the session's
    ``warn``, ``shape``, ``source``, ``validate`` and forward locks)."""

    warn: Callable[[str], None] | None
    forwards: int
    #: Called with ``(layers run, layers the forward runs)`` during a long capture's forward.
    long_progress: Callable[[int, int], None] | None = None

    # Provided by Session.
    def shape(self, model: str | ModelSpec | None = None, **options: Any
              ) -> ModelShape | None:  # pragma: no cover - Session's
        raise NotImplementedError

    def source(self, model: str | ModelSpec | None = None, **options: Any
               ) -> AttentionSource:  # pragma: no cover - Session's
        raise NotImplementedError

    def _spec(self, model: str | ModelSpec | None, **options: Any
              ) -> ModelSpec:  # pragma: no cover - Session's
        raise NotImplementedError

    def _forward_lock(self, spec: ModelSpec) -> threading.Lock:  # pragma: no cover
        raise NotImplementedError

    def _answer(self, request: CaptureRequest) -> Capture:  # pragma: no cover - Session's
        raise NotImplementedError

    def validate(self, model: str | ModelSpec | None = None, **what: Any
                 ) -> None:  # pragma: no cover - Session's
        raise NotImplementedError

    def _note(self, message: str) -> None:
        if self.warn is not None:
            self.warn(message)

    # ------------------------------------------------------------------ deciding
    def _full_size(self, request: CaptureRequest, tokens: int) -> tuple[int, str]:
        """Bytes of the request's full capture at ``tokens`` tokens, and how they add up."""
        shape = self.shape(request.spec)
        if shape is None:  # a model whose size is known only once loaded
            source = self.source(request.spec)
            layers, heads = source.num_layers, source.num_heads
        else:
            layers, heads = shape.num_layers, shape.num_heads
        kept_layers = _kept(request.layers, layers, "layer")
        kept_heads = _kept(request.heads, heads, "head")
        # Eager attention holds one layer's scores and probabilities for every head at once,
        # whichever heads are kept: 2 x heads x T^2 float32 beside what the capture keeps.
        forward = 2 * full_bytes(1, heads, tokens)
        kept = full_bytes(kept_layers, kept_heads, tokens)
        return (kept + forward,
                f"{_count(kept_layers, 'layer')} x {_count(kept_heads, 'head')} x "
                f"{tokens}x{tokens} weights, float32 ({size_text(kept)}), and the eager "
                f"forward's scores and weights of one layer's {_count(heads, 'head')} "
                f"({size_text(forward)})")

    def _token_bound(self, request: CaptureRequest, text: str, pair: str | None) -> int:
        """At most how many tokens the text can have: a token holds at least one UTF-8 byte,
        or is a lone word marker before byte pieces (SentencePiece's ``▁``): at most two per
        byte, plus special tokens; and no more than ``max_tokens`` (when cutting)."""
        size = len(text.encode("utf-8")) + len((pair or "").encode("utf-8"))
        bound = 2 * size + _SPECIAL_ROOM
        if request.max_tokens is not None and request.truncate:
            bound = min(bound, request.max_tokens)
        return bound

    def token_count(self, request: CaptureRequest, text: str, pair: str | None) -> int:
        """The number of tokens the model makes of the text (after ``max_tokens``); loads the
        model (not its forward pass). A model without a tokenizer of its own (the toy model):
        the bound of :meth:`_token_bound`."""
        source = self.source(request.spec)
        encode = getattr(source, "encode", None)
        if not callable(encode):
            return self._token_bound(request, text, pair)
        enc, _ = encode(text, pair, request.max_tokens, request.truncate)
        return int(enc["input_ids"].shape[1])

    def narrowed(self, request: CaptureRequest, text: str, pair: str | None
                 ) -> CaptureRequest:
        """``request`` keeping only the layer (and head) it reads, when it reads one
        (``layer``, ``head``), selects none itself and its capture of every layer would pass
        :func:`max_full_bytes`: a one-head figure of a long text needs that head, not the
        whole model. The head is narrowed only when that makes the full capture fit (a long
        capture keeps every head of its layers). Otherwise ``request`` as it is."""
        if (request.long is not None or request.layer is None or request.layers is not None
                or self.too_big(request, [(text, pair)]) is None):
            return request
        one_layer = dataclasses.replace(request, layers=str(request.layer))
        if request.head is not None and request.heads is None:
            one_head = dataclasses.replace(one_layer, heads=str(request.head))
            if self.too_big(one_head, [(text, pair)]) is None:
                return one_head
        return one_layer

    def wants_long(self, request: CaptureRequest, text: str, pair: str | None, *,
                   dumping: bool = False) -> bool:
        """Whether the long capture answers ``request`` (``request.long``; for ``None``,
        whether the full capture exceeds :func:`max_full_bytes`, said through ``warn``; with
        ``dumping``, the line says which files are written instead of ``attention.npy``).

        The text is tokenized only when a bound on its length does not settle it, so a short
        text never loads the model here (the cache may answer it).
        """
        if request.long is not None:
            return request.long
        reason = self.too_big(request, [(text, pair)])
        if reason is None:
            return False
        if (request.head is not None and request.heads is None
                and request.layers == str(request.layer)):
            # what the one head the request reads would need in full (the long capture keeps
            # every head of the layer, but the figure is of one)
            reason = self.too_big(dataclasses.replace(request, heads=str(request.head)),
                                  [(text, pair)]) or reason
        self._note(f"{reason}: {DUMPING_LONG if dumping else 'taking the long path (--long)'}")
        return True

    def too_big(self, request: CaptureRequest, texts: Iterable[tuple[str, str | None]]
                ) -> str | None:
        """Why the first of ``texts`` whose full capture exceeds :func:`max_full_bytes` needs
        the long path (``"a full capture would need ..."``), or ``None`` when every one fits,
        the request holds a measure (the long path holds weights only) or the model has no
        long path (the toy model). ``texts`` is read up to that text; a text is tokenized only
        when a bound on its length does not settle it."""
        if (request.measure or "weights") != "weights":
            return None  # the long path holds weights only; a measure's own bounds apply
        from attnviz.models import TOY_MODEL

        if request.spec.name == TOY_MODEL:
            return None  # no long path; the toy model's own token limit and memory guard apply
        limit = max_full_bytes()
        for text, pair in texts:
            if self._full_size(request, self._token_bound(request, text, pair))[0] <= limit:
                continue
            size, parts = self._full_size(request, self.token_count(request, text, pair))
            if size > limit:
                return (f"a full capture would need {size_text(size)} ({parts}), more than "
                        f"{size_text(limit)} (${ENV_MAX_FULL_MB})")
        return None

    # ------------------------------------------------------------------ capturing
    def answer_long(self, request: CaptureRequest, text: str, pair: str | None, *,
                    folder: Path | str | None = None,
                    full: Callable[[], _T] | None = None) -> LongCapture | _T:
        """The long capture of the request's text (written into ``folder`` when given), or,
        when the model cannot take the long path and the full capture fits, ``full()`` (the
        full capture, by default; said through ``warn``).

        Raises:
            UsageError: the model cannot take the long path and a full capture would not fit.
        """
        from attnviz.long import LongUnsupported

        if request.heads is not None:
            raise UsageError("--heads does not apply to a long capture: it keeps every head of "
                             "its layers (queries and keys are small)",
                             "leave out --heads; select layers with --layers")
        try:
            summary: dict[str, Any] = ({"summary": True, "k": int(request.long_top_k)}
                                       if request.long_summary else {})
            return self.capture_long(text, pair, model=request.model,
                                     layers=self._long_layers(request),
                                     max_tokens=request.max_tokens, truncate=request.truncate,
                                     dtype=request.long_dtype, folder=folder, **summary)
        except LongUnsupported as why:
            reason = str(why.message).rstrip(".")
        tokens = self.token_count(request, text, pair)
        size, parts = self._full_size(request, tokens)
        limit = max_full_bytes()
        name = request.spec.name
        if size > limit:
            raise UsageError(f"{name} cannot take the long path ({reason}), and a full capture "
                             f"would need {size_text(size)} ({parts}), more than "
                             f"{size_text(limit)} (${ENV_MAX_FULL_MB})",
                             "shorten the input with --max-tokens N, keep fewer layers or "
                             f"heads (--layers, --heads), or raise ${ENV_MAX_FULL_MB}")
        self._note(f"{name} cannot take the long path ({reason}); the full capture fits "
                   f"({size_text(size)}): using it")
        if full is None:
            return cast("_T", self._answer(request))
        return full()

    def _long_layers(self, request: CaptureRequest) -> str | None:
        """The layers a long capture records: the request's ``layers``, else the one layer it
        reads (``layer``: the forward then stops after it), else every layer."""
        if request.layers is not None or request.layer is None:
            return request.layers
        from attnviz.selection import resolve_index

        shape = self.shape(request.spec)
        layers = shape.num_layers if shape is not None else self.source(request.spec).num_layers
        return str(resolve_index(request.layer, layers, "layer"))

    def dump_long(self, request: CaptureRequest, text: str, pair: str | None,
                  path: Path | str, *, float16: bool = False
                  ) -> tuple[Path, Capture | LongCapture]:
        """``attnviz dump --long``: the long capture written into the folder ``path``, or the
        full capture written as :meth:`~attnviz.session.Session.dump` does when the model
        cannot take the long path (see :meth:`answer_long`)."""
        from pathlib import Path

        from attnviz.capture_files import StagedDump

        folder = Path(path)
        self._check_long_folder(folder, float16)

        def full() -> tuple[Path, Capture]:
            written: tuple[Path, Capture] = self.dump(  # type: ignore[attr-defined]
                text, path, pair, model=request.model, layers=request.layers,
                heads=request.heads, max_tokens=request.max_tokens, truncate=request.truncate,
                float16=float16, use_cache=request.use_cache)
            return written

        # Written beside the folder's files, moved in once complete: an interrupted or failed
        # dump leaves the folder as it was (and no folder when it made it).
        with StagedDump(folder) as staged:
            answer = self.answer_long(request, text, pair, folder=staged.path, full=full)
            if isinstance(answer, tuple):
                return answer
            staged.commit()
            answer.folder = folder  # its arrays are mapped already; the files were renamed
        return folder, answer

    def write_long(self, cap: LongCapture, path: Path | str, *, float16: bool = False
                   ) -> tuple[Path, LongCapture]:
        """Save a long capture read with ``--from`` into the folder ``path``."""
        from pathlib import Path

        folder = Path(path)
        self._check_long_folder(folder, float16)
        cap.save(folder)  # staged, then moved in (see LongCapture.save)
        return folder, cap

    @staticmethod
    def _check_long_folder(folder: Path, float16: bool) -> None:
        if float16:
            raise UsageError("--float16 rounds a full capture's weights; a long capture keeps "
                             "queries and keys", "use --long-dtype float16 instead")
        if folder.suffix.lower() == ".npy":
            raise UsageError(f"-o {folder}: a long capture is written as a folder (queries, "
                             "keys, log-sum-exp and a sidecar)",
                             f"use -o {folder.with_suffix('')}/")

    def capture_long(self, text: str, pair: str | None = None, *,
                     model: str | ModelSpec | None = None, layers: Any = None,
                     max_tokens: int | None = None, truncate: bool = True,
                     dtype: str = "float32", folder: Path | str | None = None,
                     summary: bool = False, k: int = 0,
                     progress: Callable[[int, int], None] | None = None,
                     **options: Any) -> LongCapture:
        """The long capture of ``text``: each layer's queries, keys and log-sum-exp, from one
        forward pass with the model's own attention kernel (:func:`attnviz.long.capture_long`).
        With ``summary``, every head's statistics, atlas, attention received and top-k come
        from the same pass (what ``heads`` reads).

        Args:
            text, pair, model, layers, max_tokens, truncate, **options: as in
                :meth:`~attnviz.session.Session.capture` (every head of the kept layers is
                kept).
            dtype: how queries and keys are stored: float32, float16 or bfloat16.
            folder: write the capture there (``attnviz dump --long``); ``None``: in memory.
            k: with ``summary``, every head's top ``k`` keys per query too.
            progress: called with ``(layers run, layers the forward runs)``; by default the
                session's :attr:`long_progress`.

        Raises:
            LongUnsupported: the model cannot take the long path (the toy model, an
                encoder without a seam).
            InputError: past the token limit with ``truncate`` off, or more than
                :data:`MAX_LONG_TOKENS` tokens.
        """
        from attnviz.checks import _checked_request
        from attnviz.long import LongUnsupported, capture_long
        from attnviz.request import LONG_DTYPES
        if dtype not in LONG_DTYPES:
            raise UsageError(f"dtype must be one of {', '.join(LONG_DTYPES)}, not {dtype!r:.40}")
        spec = self._spec(model, **options)
        layer_text, _ = _checked_request(text, pair, layers, None, max_tokens)
        from attnviz.models import TOY_MODEL

        if spec.name == TOY_MODEL:
            raise LongUnsupported("the toy model has no long path")
        self.validate(spec, layers=layer_text)
        source = self.source(spec)
        encode = getattr(source, "encode", None)
        model_object = getattr(source, "model", None)
        if not callable(encode) or model_object is None:
            raise LongUnsupported(f"{spec.name} is not a Hugging Face model")
        enc, _ = encode(text, pair, max_tokens, truncate)  # past the limit: cut or refuse
        tokens = int(enc["input_ids"].shape[1])
        if tokens > MAX_LONG_TOKENS:
            raise InputError(f"the text is {tokens} tokens long, more than the {MAX_LONG_TOKENS} "
                             "a long capture takes", "shorten it with --max-tokens N")
        from attnviz.selection import parse_selection

        layer_list = (parse_selection(layer_text, source.num_layers, "layer")
                      if layer_text else None)
        self._remove_stale_long_folders()  # what killed long commands left in $TMPDIR
        with self._forward_lock(spec):
            cap = capture_long(source, text, pair=pair, layers=layer_list,
                               max_tokens=max_tokens, dtype=dtype, folder=folder,
                               summary=bool(summary), k=int(k) if summary else 0,
                               progress=progress or self.long_progress)
            self.forwards += 1
        device = str(getattr(source, "device", "cpu"))
        if device.startswith("cuda"):  # weights on demand are computed where the model runs
            cap.device = device
        for message in cap.meta.get("warnings", []):
            self._note(str(message))
        return cap

    def _remove_stale_long_folders(self) -> None:
        """Remove the temporary folders of long captures that killed processes left behind
        (they can hold tens of GB), and say so in one line."""
        import tempfile

        from attnviz.capture_files import remove_stale_long_folders

        folders, size = remove_stale_long_folders()
        if folders:
            self._note(f"removed {folders} temporary long-capture folder"
                       f"{'s' if folders > 1 else ''} ({size_text(size)}) left in "
                       f"{tempfile.gettempdir()} by attnviz processes that were killed")

    # ------------------------------------------------------------------ reading
    @staticmethod
    def _saved_long(request: CaptureRequest) -> LongCapture:
        """The long capture in ``request.from_path`` (``attnviz dump --long``), memory-mapped."""
        from attnviz.long import load_long

        if request.heads is not None:
            raise UsageError("--heads does not apply to a long capture: it keeps every head of "
                             "its layers", "leave out --heads")
        refuse_measure(request.measure, cast("Path", request.from_path))
        cap = load_long(cast("Path", request.from_path), mmap=True)
        if request.layers is not None:
            from attnviz.selection import parse_selection

            wanted = parse_selection(request.layers, cap.num_layers, "layer")
            for layer in wanted:
                cap.layer_index(layer)
        LongPath._check_indices(cap, request)
        return cap

    @staticmethod
    def _check_indices(cap: AttentionRecord, request: CaptureRequest) -> None:
        """Check the request's ``layer`` and ``head`` against the record that answers it."""
        if request.layer is not None:
            cap.layer_index(request.layer)
        if request.head is not None:
            cap.head_index(request.head)


def long_layer(cap: AttentionRecord, layer: int) -> int:
    """The model's layer index of ``layer`` (negative counts from the end), checked against
    the layers the record holds (:meth:`~attnviz.record.AttentionRecord.layer_index`).

    Raises:
        UsageError: out of range, or a layer the capture does not hold.
    """
    return cap.layer_index(layer)


def refuse_measure(measure: str | None, folder: Path | str) -> None:
    """Refuse ``--measure`` other than ``weights`` for the long capture in ``folder``.

    Raises:
        UsageError: a long capture holds attention weights only.
    """
    if (measure or "weights") != "weights":
        raise UsageError(f"{folder} is a long capture: it holds attention weights, not "
                         f"{measure}", "leave out --measure, or capture the text again with "
                                       f"--no-long --measure {measure}")


def is_long_folder(path: Path | str) -> bool:
    """Whether ``path`` is a folder that holds a long capture (``attnviz dump --long``).

    Raises:
        DumpError: the folder holds a full capture and a long one.
    """
    from pathlib import Path

    from attnviz.capture_files import check_one_capture
    from attnviz.long.record import SIDECAR

    folder = Path(path)
    if not folder.is_dir():
        return False
    check_one_capture(folder)  # a full and a long capture: which is the latest is not known
    return (folder / SIDECAR).exists()  # a FIFO there too: the long reader refuses it
