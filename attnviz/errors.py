"""Errors a person can act on.

Every error attnviz raises on purpose is an :class:`AttnvizError`. The CLI prints
``Error: <message>`` followed by the hint and exits with :attr:`AttnvizError.exit_code`
(2 for usage errors, 1 for everything else). Anything else is a bug and is re-raised.
"""

from __future__ import annotations

from typing import TypeVar


class AttnvizError(Exception):
    """Base class: a message that says what went wrong, and a hint that says what to do next."""

    exit_code = 1

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message if not self.hint else f"{self.message}\n{self.hint}"


class UsageError(AttnvizError):
    """The command line asks for something impossible (bad option value, index out of range)."""

    exit_code = 2


class InputError(UsageError):
    """The text or input file cannot be used (empty, unreadable, not UTF-8)."""


class ModelLoadError(AttnvizError):
    """A model cannot be loaded or does not return attention weights."""


class DeviceError(AttnvizError):
    """The requested device or dtype is not available on this machine."""


class DumpError(AttnvizError):
    """A saved capture (``attention.npy`` + JSON sidecar) is missing or corrupt."""


class OutputError(AttnvizError):
    """An output file or folder cannot be written."""


class NoSpaceError(OutputError):
    """The disk (or a quota) is full while attnviz writes: free space or write elsewhere.

    ``public`` says the same without any path (what a server answers its clients)."""

    public = "no space left on the device: the disk is full"


class NotAFileError(OutputError):
    """The output named is a device, a pipe or a socket (or a link to one): a usage error."""

    exit_code = 2


# --------------------------------------------------------------------------- Python callers
# The same errors reach Python callers (attnviz.capture_text, Session, attnviz.capture), who
# pass keyword arguments rather than command-line options: their messages name those.
_FLAG_NAMES = [  # (option, keyword); an option followed by its value becomes keyword=value
    ("--max-new-tokens", "max_new_tokens"), ("--max-tokens", "max_tokens"),
    ("--batch-size", "batch_size"), ("--layers", "layers"),
    ("--heads", "heads"), ("--dtype", "dtype"), ("--device-map", "device_map"),
    ("--device", "device"), ("--model", "model"), ("--revision", "revision"),
    ("--toy-heads", "toy['heads']"), ("--toy-layers", "toy['layers']"),
    ("--d-model", "toy['d_model']"), ("--seed", "toy['seed']"),
]
#: Values taken as an option's own (beside numbers): anything else after an option is a word of
#: the sentence, or a name (a model folder, a revision) that is left as it is.
_KNOWN_VALUES = {"minilm", "toy", "auto", "cpu", "cuda", "mps", "float32", "float16", "bfloat16"}
_FLAG_SWITCHES = [("--no-truncate", "truncate=False"), ("--truncate", "truncate=True"),
                  ("--no-cache", "use_cache=False"), ("--float16", "float16=True"),
                  ("--sample", "sample=True"),
                  ("--trust-remote-code", "trust_remote_code=True"),
                  ("--server", "a RemoteSession")]
_QUOTED = r"('[^'\n]*'|\"[^\"\n]*\")"  # the user's own text, shown quoted: never rewritten


def _python_text(text: str) -> str:
    import re

    pieces = re.split(_QUOTED, text)
    return "".join(piece if number % 2 else _python_words(piece)
                   for number, piece in enumerate(pieces))


def _python_words(text: str) -> str:
    """:func:`_python_text` of a stretch outside quotes."""
    import re

    text = re.sub(r"attnviz dump \.\.\. ", "Session.dump(text, path, ...) with ", text)
    text = re.sub(r"\battnviz [a-z][a-z-]* $", "", text)  # before a quoted example
    before = r"(?<![\w/.'\"-])"  # an option stands alone: not inside a path or a word
    for flag, keyword in _FLAG_SWITCHES:
        text = re.sub(before + re.escape(flag) + r"(?![\w-])", keyword, text)
    for flag, keyword in _FLAG_NAMES:
        def name(match: re.Match[str], keyword: str = keyword) -> str:
            value = match.group(1)
            if value is None:
                return keyword
            if re.fullmatch(r"-?\d+", value):
                return f"{keyword}={value}"
            if value in _KNOWN_VALUES:
                return f"{keyword}={value!r}"
            return f"{keyword} {value}"  # a word of the sentence, or a name as it is

        text = re.sub(before + re.escape(flag) + r"(?![\w-])(?: ([A-Za-z0-9_-]+)(?![\w/.]))?",
                      name, text)
    return text


class python_names:  # noqa: N801 - used as a context manager, like contextlib's
    """Rewrite the messages of attnviz errors raised in the block for a Python caller
    (``--max-tokens 40`` -> ``max_tokens=40``)."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: object, error: BaseException | None, traceback: object) -> None:
        if isinstance(error, AttnvizError):
            named_for_python(error)


_Error = TypeVar("_Error", bound=AttnvizError)


def named_for_python(error: _Error) -> _Error:
    """``error`` with its message and hint in a Python caller's words (once; in place)."""
    if not getattr(error, "_python_names", False):
        error.message = _python_text(error.message)
        error.hint = None if error.hint is None else _python_text(error.hint)
        error.args = (error.message, *error.args[1:])
        error._python_names = True  # type: ignore[attr-defined]
    return error
