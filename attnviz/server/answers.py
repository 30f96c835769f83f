"""The errors of the ``--server`` client, and the checks of what a server answers.

A server's answer is read like a file from elsewhere: every number, array and token list is
checked before use, and anything wrong is a :class:`ServerError` saying so in one line
("the server's answer is not ...").
"""

from __future__ import annotations

import base64
import binascii
import math
from typing import TYPE_CHECKING, Any

from attnviz.errors import AttnvizError

if TYPE_CHECKING:
    import numpy as np

#: The hint of an answer that is not what attnviz's API sends.
CHECK_SERVER = "check that --server points at 'attnviz serve' of this version"


class ServerError(AttnvizError):
    """The server cannot be reached, needs a token, or did not answer with attnviz's API."""


class NotAttnvizAnswer(ServerError):
    """An answer that is not attnviz's API (e.g. a route an older server does not have)."""


def not_an_answer(what: str, why: str) -> ServerError:
    """``the server's answer is not <what> (<why>)``."""
    return ServerError(f"the server's answer is not {what} ({why[:200]})", CHECK_SERVER)


def shape_of(value: Any, what: str, dims: int) -> tuple[int, ...]:
    """A ``shape`` of ``dims`` non-negative ints."""
    if (not isinstance(value, list) or len(value) != dims
            or not all(type(n) is int and 0 <= n < (1 << 40) for n in value)):
        raise not_an_answer(what, f"its shape {str(value)[:60]} is not {dims} sizes")
    return tuple(value)


def array_of(text: Any, dtype: str, what: str, shape: tuple[int, ...] | None = None,
             *, finite: bool = True) -> np.ndarray:
    """The array a base64 field holds, checked: valid base64, its length the shape's, and
    (``finite``) no NaN or infinity.

    Raises:
        ServerError: any of those is not so.
    """
    import numpy as np

    if not isinstance(text, str):
        raise not_an_answer(what, "its values are not base64 text")
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise not_an_answer(what, f"its values are not valid base64: {exc}") from None
    size = np.dtype(dtype).itemsize
    count = math.prod(shape) if shape is not None else len(raw) // size
    if len(raw) != count * size:
        raise not_an_answer(what, f"it holds {len(raw)} bytes for "
                                  f"{'x'.join(map(str, shape or (count,)))} {np.dtype(dtype)} "
                                  "values")
    data = np.frombuffer(raw, dtype=dtype).copy()
    if finite and not bool(np.isfinite(data).all()):
        raise not_an_answer(what, "it holds NaN or infinite values")
    return data.reshape(shape) if shape is not None else data


def field(answer: Any, name: str, what: str) -> Any:
    """``answer[name]`` of a JSON object answer."""
    if not isinstance(answer, dict) or name not in answer:
        raise not_an_answer(what, f"it has no {name!r}")
    return answer[name]


def numbers(value: Any, what: str, shape: tuple[int, ...], *, integers: bool = False,
            low: float | None = None, high: float | None = None) -> np.ndarray:
    """A JSON list (of lists) of finite numbers of ``shape``, within ``low..high``."""
    import numpy as np

    try:
        data = np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError, OverflowError):
        data = None
    if (data is None or data.shape != shape or not bool(np.isfinite(data).all())
            or (integers and not bool((data == np.round(data)).all()))
            or (low is not None and data.size and data.min() < low)
            or (high is not None and data.size and data.max() > high)):
        raise not_an_answer(what, f"its numbers are not {'x'.join(map(str, shape))} "
                                  f"{'integers' if integers else 'finite numbers'}"
                                  + ("" if low is None else f" from {low:g} to {high:g}"))
    return data.astype(np.int64) if integers else data
