"""``POST /api/generate``: generated tokens stream as they are chosen, with their attention.

The answer is newline-delimited JSON (``application/x-ndjson``), one line per generated token
as soon as the model has chosen it (``step``, ``position``, ``token``, ``top``: the ``k``
strongest keys of the request's layer and head, as ``Generation.top_k`` gives them), then one
closing line ``{"done": true, "text": ..., "tokens": [...], ...}``. A page reads it with
``fetch`` and a stream reader; ``curl -N`` shows it line by line.

Problems found before the first token (a model that cannot generate, a bad layer, a prompt
too long) are ordinary JSON errors with their HTTP status; one after it is a last line
``{"error": {...}}``. A client that goes away stops the generation at the next token.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from attnviz.errors import AttnvizError, UsageError
from attnviz.server.requests import ApiError

if TYPE_CHECKING:
    from attnviz.long.generate import Step
    from attnviz.server.engine import Engine
    from attnviz.server.requests import GenerateRequest


class _Gone(Exception):  # noqa: N818 - a signal: the client stopped reading
    """Raised in the generation thread once the client has gone."""


def _line(value: Any) -> bytes:
    return (json.dumps(value, ensure_ascii=False, allow_nan=False) + "\n").encode("utf-8")


def _error_body(error: AttnvizError) -> dict[str, Any]:
    status = error.status if isinstance(error, ApiError) else (
        422 if isinstance(error, UsageError) else 500)
    return {"error": {"type": error.kind if isinstance(error, ApiError) else
                      type(error).__name__, "message": error.message, "hint": error.hint,
                      "status": status}}


async def generation_lines(engine: Engine, body: GenerateRequest,
                           submit: Callable[[Callable[[], None]], Any]
                           ) -> AsyncIterator[bytes]:
    """The answer's lines; raises an :class:`AttnvizError` found before the first token.

    ``submit`` runs the blocking generation on a worker thread (the server's pool).
    """
    from attnviz.long.generate import check_causal_lm, check_max_new_tokens
    from attnviz.session import spec_key

    if isinstance(body.head, list):
        raise ApiError(422, "'head' must be one head index or \"mean\" here",
                       'send e.g. {"head": 3} or {"head": "mean"}')
    spec = engine.spec(body.model)
    if body.max_new_tokens > engine.limits.max_tokens:
        raise ApiError(422, f"'max_new_tokens' must be at most {engine.limits.max_tokens} "
                            "(the server's --max-tokens)", "ask for fewer tokens")
    check_max_new_tokens(body.max_new_tokens)
    check_causal_lm(spec)  # from config.json: an encoder is refused before anything loads
    loop = asyncio.get_running_loop()
    lines: asyncio.Queue[bytes | AttnvizError | None] = asyncio.Queue()
    gone = threading.Event()
    release = engine.admit("generate " + spec_key(spec))
    head = body.head

    def put(item: bytes | AttnvizError | None) -> None:
        loop.call_soon_threadsafe(lines.put_nowait, item)

    def on_step(step: Step) -> None:
        if gone.is_set():
            raise _Gone
        put(_line(step.top(body.layer, head, body.k)))

    def work() -> None:
        try:
            session = engine.session
            session.validate(spec, layer=body.layer,
                             head=head if isinstance(head, int) else None)
            result = session.generate(
                body.text, model=spec, max_new_tokens=body.max_new_tokens,
                sample=body.sample, seed=body.seed, layers=[body.layer],
                heads=[head] if isinstance(head, int) else None,
                max_tokens=engine.limits.max_tokens, truncate=False, on_step=on_step)
            put(_line({"done": True, "text": result.text, "tokens": result.tokens,
                       "prompt_length": result.prompt_length, "steps": result.steps,
                       "layer": result.layers[0], "head": head, "k": body.k,
                       "stopped": result.meta["stopped"], "seed": result.meta["seed"]}))
        except _Gone:
            pass
        except AttnvizError as error:
            put(error)
        finally:
            release()
            put(None)

    try:
        submit(work)
    except RuntimeError:  # the pool is shutting down
        release()
        raise ApiError(503, "the server is stopping", "start it again with attnviz serve",
                       kind="AttnvizError") from None
    try:
        first = await asyncio.wait_for(lines.get(), engine.limits.timeout_s)
    except asyncio.TimeoutError:
        gone.set()
        raise ApiError(503, f"no first token within {engine.limits.timeout_s:g} s: the model "
                            "is loading or busy", "try again in a moment, or start the "
                            "server with a longer --timeout", kind="AttnvizError",
                       retry_after=1) from None
    if isinstance(first, AttnvizError):
        raise first
    return _stream(first, lines, gone)


async def _stream(first: bytes | None, lines: asyncio.Queue[bytes | AttnvizError | None],
                  gone: threading.Event) -> AsyncIterator[bytes]:
    item: bytes | AttnvizError | None = first
    try:
        while item is not None:
            yield _line(_error_body(item)) if isinstance(item, AttnvizError) else item
            item = await lines.get()
    finally:
        gone.set()  # finished, or the client went away: the next token stops generation
