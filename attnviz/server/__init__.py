"""``attnviz serve``: a local web app and JSON API over a warm :class:`~attnviz.session.Session`.

- :mod:`attnviz.server.requests`: the request bodies, declared with pydantic (types, bounds,
  no unknown fields) and their errors in the CLI's words.
- :mod:`attnviz.server.engine`: what the API does, without HTTP: the served models, a bounded
  queue per model, a small in-memory capture cache and the JSON payloads.
- :mod:`attnviz.server.app`: the Starlette application (:func:`create_app`): routes, the token,
  body limits, timeouts, security headers and the page.
- :mod:`attnviz.server.client`: :class:`~attnviz.server.client.RemoteSession`, the session the
  CLI uses with ``--server URL``; :mod:`attnviz.server.long_client` its long captures, and
  :mod:`attnviz.server.answers` the checks of what a server answers.

Importing this package is cheap; Starlette is imported by :func:`create_app`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from attnviz.server.app import create_app

__all__ = ["create_app"]


def __getattr__(name: str) -> Any:
    if name == "create_app":
        from attnviz.server.app import create_app

        return create_app
    raise AttributeError(f"module 'attnviz.server' has no attribute {name!r}")
