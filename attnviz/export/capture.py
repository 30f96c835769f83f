"""Export: texts through the session, a batch at a time, and the layer and head selection.

The model runs in the exporting process (or a Ray worker), through one
:class:`~attnviz.session.Session`: a text that needs the model is captured together with
the next texts of the input that need it too (``batch_size`` per forward pass); the
captures of those later texts wait here until their turn.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from attnviz.errors import InputError
from attnviz.export.plan import folder_name, normal_selection

if TYPE_CHECKING:
    from attnviz.capture import Capture
    from attnviz.export.plan import ExportItem, ExportOptions, Lookahead
    from attnviz.models import ModelSpec
    from attnviz.session import Session


def model_settings(spec: ModelSpec | None, max_tokens: int | None,
                   truncate: bool) -> dict[str, Any]:
    """What decides the captures of a text (a re-run with another model recaptures)."""
    import dataclasses

    if spec is None:
        return {}
    return {"name": spec.name, "revision": spec.revision, "dtype": spec.dtype,
            "toy": dataclasses.asdict(spec.toy) if spec.toy is not None else None,
            "max_tokens": max_tokens, "truncate": truncate}


def select(capture: Capture, options: ExportOptions) -> Capture:
    """The options' layers and heads of ``capture`` (all when they select everything).

    Raises:
        UsageError: a selection out of range for this model.
    """
    from attnviz.selection import parse_selection

    layers, heads = normal_selection(options.layers), normal_selection(options.heads)
    if layers is None and heads is None:
        return capture
    return capture.select(
        parse_selection(options.layers, capture.num_layers, "layer") if layers else None,
        parse_selection(options.heads, capture.num_heads, "head") if heads else None)


class TextCaptures:
    """Captures of an export's texts, through one session.

    Args:
        spec: the model texts run through (``None``: saved captures only).
        max_tokens, truncate, use_cache: as for :func:`attnviz.export.export_items`.
        batch_size: texts per forward pass (1: one by one).
        note: called with a line to show (``"Loading NAME..."``).
        session: the engine (default: :func:`~attnviz.session.default_session`, on first use).
        measure: ``weights`` or a measure of :mod:`attnviz.measures` to capture.
    """

    def __init__(self, spec: ModelSpec | None, *, max_tokens: int | None, truncate: bool,
                 use_cache: bool, batch_size: int, note: Callable[[str], None],
                 session: Session | None = None, measure: str = "weights") -> None:
        self.spec = spec
        self.measure = measure
        self.max_tokens = max_tokens
        self.truncate = truncate
        self.use_cache = use_cache
        self.batch_size = batch_size
        self.note = note
        self._session = session
        self.loaded = False  # the model loaded once: a later load error is one text's
        # Captures of texts further down the input, from the last batch (at most batch_size).
        self._prefetched: dict[int, tuple[ExportItem, Capture | InputError]] = {}

    def session(self) -> Session:
        """The session (created on first use)."""
        if self._session is None:
            from attnviz.session import default_session

            self._session = default_session()
        return self._session

    def _announce(self, name: str) -> None:
        self.note(f"Loading {name}...")

    def capture_text(self, text: str, pair: str | None) -> Capture:
        """Run one text (and pair) through the model."""
        assert self.spec is not None
        session = self.session()
        with session.announcing(self._announce):
            capture = session.capture(text, pair, model=self.spec, max_tokens=self.max_tokens,
                                      truncate=self.truncate, use_cache=self.use_cache,
                                      write_cache=False, measure=self.measure)
        self.loaded = self.loaded or session.is_loaded(self.spec)
        return capture

    def capture_item(self, item: ExportItem, text: str, pair: str | None,
                     stream: Lookahead | None,
                     needs_model: Callable[[ExportItem], str | None]) -> Capture:
        """The capture of a text item: from the current batch, else from a new one.

        Args:
            item: the item; ``text`` and ``pair`` its checked text.
            stream: the input, to look ahead for the rest of a batch.
            needs_model: the folder name (lower case) of an item that will run through the
                model, ``None`` for one that will not.
        """
        if self.batch_size > 1 and self.spec is not None:
            entry = self._prefetched.get(id(item))
            if entry is None or entry[0] is not item:
                self._prefetch(item, text, pair, stream, needs_model)
                entry = self._prefetched.get(id(item))
            if entry is not None and entry[0] is item:
                result = entry[1]
                if isinstance(result, InputError):
                    raise result
                return result
        return self.capture_text(text, pair)

    def _prefetch(self, item: ExportItem, text: str, pair: str | None,
                  stream: Lookahead | None,
                  needs_model: Callable[[ExportItem], str | None]) -> None:
        """Capture ``item`` and the next texts that will need the model in one batch."""
        assert self.spec is not None
        self._prefetched.clear()
        batch = [item]
        names = {folder_name(text, pair, item.id).lower()}
        for other in stream.peek() if stream is not None else []:
            if len(batch) >= self.batch_size:
                break
            name = needs_model(other)
            if name is not None and name not in names:
                names.add(name)
                batch.append(other)
        texts = [(text, pair)] + [(other.text or "", other.pair) for other in batch[1:]]
        session = self.session()
        try:
            with session.announcing(self._announce):
                for other, result in zip(batch, session.captures(
                        texts, model=self.spec, batch_size=self.batch_size,
                        max_tokens=self.max_tokens, truncate=self.truncate,
                        use_cache=self.use_cache, write_cache=False, measure=self.measure)):
                    self._prefetched[id(other)] = (other, result)
            self.loaded = self.loaded or session.is_loaded(self.spec)
        except InputError:
            pass  # the texts left run one by one, where the error is reported as usual

    def forget(self, item: ExportItem) -> None:
        """Free ``item``'s capture (it is drawn from disk now)."""
        self._prefetched.pop(id(item), None)

    def clear(self) -> None:
        """Free every capture waiting for its turn."""
        self._prefetched.clear()
