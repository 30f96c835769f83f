"""Errors a person can act on.

Every error attnviz raises on purpose is an :class:`AttnvizError`. The CLI prints
``Error: <message>`` followed by the hint and exits with :attr:`AttnvizError.exit_code`
(2 for usage errors, 1 for everything else). Anything else is a bug and is re-raised.
"""

from __future__ import annotations


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


class NotAFileError(OutputError):
    """The output named is a device, a pipe or a socket (or a link to one): a usage error."""

    exit_code = 2
