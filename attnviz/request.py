"""One question to the session: which capture a command (or a Python caller) works on.

A :class:`CaptureRequest` names the input (a text, standard input or a saved capture), the
model, the layers and heads to keep, the indices the caller is going to read and the token
limit. :class:`~attnviz.session.Session` answers it in one call::

    from attnviz.request import CaptureRequest
    from attnviz.session import Session

    request = CaptureRequest(text="The cat sat on the mat", model="toy", layer=0, head=1)
    cap = Session().run(request)      # indices checked from the config, then cache or model

:meth:`~attnviz.session.Session.run` reads the text (or the saved capture), checks the indices
against the model's config before any weights load, looks in the capture cache, captures, and
checks the indices against the capture it returns; :meth:`~attnviz.session.Session.write` does
the same and writes the record (``attnviz dump``); :meth:`~attnviz.session.Session.run_each`
answers several requests, every one checked before the first model loads (``attnviz
compare``); :meth:`~attnviz.session.Session.run_texts` captures many texts with one request's
model, selection and limits (``--input``).

Each command of :mod:`attnviz.cli` builds one request from its options and makes one of these
calls. Only the standard library and :mod:`attnviz.errors` are imported when this module
loads, so ``attnviz --help`` stays fast.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from attnviz.checks import check_text  # noqa: F401 - re-exported
from attnviz.errors import InputError, UsageError

if TYPE_CHECKING:
    from attnviz.models import ModelSpec

ENV_MAX_INPUT_MB = "ATTNVIZ_MAX_INPUT_MB"
#: How a long capture may store its queries and keys (``--long-dtype``).
LONG_DTYPES = ("float32", "float16", "bfloat16")
DEFAULT_MAX_INPUT_MB = 16
_MAX_INPUT_MB_CEILING = 1_000_000


@dataclass(frozen=True)
class CaptureRequest:
    """What to capture, from what, and what the caller will read of it.

    Attributes:
        text: the text to capture (``None`` with ``stdin`` or ``from_path``).
        stdin: read the text from standard input (the command line's ``TEXT -``), at most
            :func:`max_input_bytes`.
        from_path: a saved capture (folder or ``.npy`` from ``attnviz dump``) instead of text.
        pair: the second sentence of a sentence pair (not with ``from_path``).
        model: a model name (``"minilm"``, ``"toy"``, a hub id, a folder) or a
            :class:`~attnviz.models.ModelSpec`; ``None``: ``$ATTNVIZ_MODEL`` or MiniLM.
        layers: the layers to keep, as ``"0,2-4"`` (``None``: all).
        heads: the heads to keep, likewise.
        layer: a layer the caller reads; ``head`` a head. Checked against the model's config
            before its weights load and against the capture before it is returned, so an
            index out of range fails before the slow parts.
        start_layer: the first layer of a product over layers (rollout): checked against the
            model's config before its weights load (errors name ``--start-layer``); whether
            the capture holds every layer from there is the analysis's to say.
        max_tokens: token limit (``None``: the model's own).
        truncate: past the limit keep the first tokens with a warning, or raise
            :class:`~attnviz.errors.InputError`.
        use_cache: read and write the capture cache (a session made with ``use_cache=False``
            never does).
        measure: what to capture: ``weights`` (attention) or a measure of
            :mod:`attnviz.measures` (``norm``, ``norm-res-ln``, ``alti``, ``value-zeroing``).
            ``None``: attention weights for a text; with ``from_path``, whatever the saved
            capture holds (a name there must match it).
        long: which capture answers: ``False`` the full record of weights (a
            :class:`~attnviz.capture.Capture`); ``True`` the long capture (queries, keys and
            log-sum-exp per layer, a :class:`~attnviz.long.LongCapture`: exact weights on
            demand, memory O(T x d)); ``None`` the full record when it fits under
            :func:`attnviz.session.long_path.max_full_bytes`, else the long capture (said through
            the session's ``warn``).
        long_summary: a long capture also computes every head's statistics, atlas, attention
            received and top-k in the pass that finds the log-sum-exp (``heads`` asks for it:
            it reads every head; one head's top-k does not); ``long_top_k`` keys per query of
            every head are ranked in it too (``export --long``'s ``topk.csv``).
        long_dtype: how a long capture stores queries and keys: ``"float32"``, ``"float16"``
            or ``"bfloat16"``.

    Raises:
        UsageError: the request names two inputs, a pair with a saved capture, or an unknown
            measure.
    """

    text: str | None = None
    stdin: bool = False
    from_path: Path | None = None
    pair: str | None = None
    model: str | ModelSpec | None = None
    layers: str | None = None
    heads: str | None = None
    layer: int | None = None
    head: int | None = None
    start_layer: int | None = None
    max_tokens: int | None = None
    truncate: bool = True
    use_cache: bool = True
    measure: str | None = None

    long: bool | None = False
    long_dtype: str = "float32"
    long_summary: bool = False
    long_top_k: int = 0

    def __post_init__(self) -> None:
        if self.measure is not None:
            if not isinstance(self.measure, str):
                raise UsageError(f"measure must be a name such as \"norm\", not "
                                 f"{self.measure!r:.40}")
            from attnviz.measures import check_measure

            object.__setattr__(self, "measure", check_measure(self.measure))
            if self.long and self.measure != "weights":
                raise UsageError(f"the long path captures attention weights only, not "
                                 f"{self.measure}", "drop --long, or use --measure weights")
        if self.long not in (True, False, None):
            raise UsageError(f"long must be True, False or None (decide by size), not "
                             f"{self.long!r:.40}")
        if self.long_dtype not in LONG_DTYPES:
            raise UsageError(f"long_dtype must be one of {', '.join(LONG_DTYPES)}, not "
                             f"{self.long_dtype!r:.40}")
        given = [name for name, value in (("text", self.text), ("stdin", self.stdin or None),
                                          ("from_path", self.from_path)) if value is not None]
        if len(given) > 1:
            raise UsageError(f"a capture request takes one input, not {' and '.join(given)}",
                             "give text, stdin=True or from_path")
        if self.from_path is not None and self.pair is not None:
            raise UsageError("a pair cannot be given with from_path: the saved capture already "
                             "holds its text")

    @property
    def has_input(self) -> bool:
        """Whether the request names a text, standard input or a saved capture."""
        return self.text is not None or self.stdin or self.from_path is not None

    @property
    def spec(self) -> ModelSpec:
        """The model as a :class:`~attnviz.models.ModelSpec` (the default model for ``None``)."""
        from attnviz.models import ModelSpec

        if isinstance(self.model, ModelSpec):
            return self.model
        return ModelSpec() if self.model is None else ModelSpec(name=self.model)

    def input_text(self) -> str:
        """The request's text: ``text``, or standard input read now (unchecked).

        Raises:
            UsageError: the request names no text (a saved capture, or nothing).
            InputError: standard input is too long or not UTF-8.
        """
        if self.stdin:
            return read_stdin()
        if self.text is None:
            raise UsageError("this capture request names no text",
                             "give text=..., stdin=True or from_path=...")
        return self.text


# --------------------------------------------------------------------------- text
# --------------------------------------------------------------------------- standard input
def megabytes_from_env(name: str, ceiling: int, example: int, unset: str) -> int | None:
    """Bytes the variable ``name`` gives in megabytes (above 0, at most ``ceiling``), or
    ``None`` when it is unset or blank; the hint shows ``example`` and says what leaving it
    unset means (``unset``).

    Raises:
        UsageError: the variable is not such a number (NaN, text, 0, past the ceiling).
    """
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    try:
        megabytes = float(raw)
    except ValueError:
        megabytes = float("nan")
    if not 0 < megabytes <= ceiling:  # also false for NaN
        raise UsageError(f"{name}={raw!r:.40} is not a size: give megabytes above 0, up to "
                         f"{ceiling}",
                         f"for example: export {name}={example}, or unset it for {unset}")
    return max(1, int(megabytes * 1024 * 1024))


def max_input_bytes() -> int:
    """The most bytes one text may have on standard input: ``$ATTNVIZ_MAX_INPUT_MB`` (16 MB).

    Raises:
        UsageError: the variable is not a number of megabytes above 0.
    """
    given = megabytes_from_env(ENV_MAX_INPUT_MB, _MAX_INPUT_MB_CEILING, 64,
                               f"the default of {DEFAULT_MAX_INPUT_MB}")
    return DEFAULT_MAX_INPUT_MB * 1024 * 1024 if given is None else given


def read_limited(stream: Any, what: str = "standard input") -> bytes | str:
    """Everything on ``stream`` up to :func:`max_input_bytes`; never reads past the limit.

    Raises:
        InputError: the stream holds more (``/dev/zero`` would otherwise be read for ever).
    """
    limit = max_input_bytes()
    data = stream.read(limit + 1)
    if len(data) > limit:
        raise InputError(f"{what} holds more than {limit} bytes ({limit / 1024 / 1024:g} MB), "
                         "the limit for one text",
                         f"pass a shorter text, or raise the limit with "
                         f"{ENV_MAX_INPUT_MB}=<megabytes>")
    return cast("bytes | str", data)


def read_stdin() -> str:
    """One text from standard input (UTF-8, bounded, the final line break dropped).

    Raises:
        InputError: more than :func:`max_input_bytes`, or not UTF-8.
    """
    data = read_limited(sys.stdin.buffer if hasattr(sys.stdin, "buffer") else sys.stdin)
    if isinstance(data, bytes):
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InputError(f"standard input is not valid UTF-8 (byte {exc.start})",
                             "save the text as UTF-8 and try again") from None
    else:
        text = data
    return text.rstrip("\r\n")


__all__ = ["CaptureRequest", "check_text", "max_input_bytes", "read_limited", "read_stdin"]
