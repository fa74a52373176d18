"""What the ``http`` side channel's server and client agree on: the routes and the media type.

* ``GET /v1/kv/handshake``            every rank's metadata (msgpack envelope)
* ``GET /v1/kv/handshake/{tp_rank}``  one rank's metadata
* ``GET /healthz``                    liveness, no token, no metadata
* ``GET /readyz``                     200 once every rank's metadata is in, else 503

``Accept: application/json`` on the handshake routes gives a JSON view.
"""

from __future__ import annotations

MSGPACK = "application/vnd.msgpack"
PATH = "/v1/kv/handshake"


def handshake_path(tp_rank: int | None) -> str:
    """The route that serves ``tp_rank`` (every rank when None)."""
    return PATH + ("" if tp_rank is None else f"/{tp_rank}")


def route_name(path: str) -> str:
    """The name a request path is counted under (metrics, audit log)."""
    if path == PATH:
        return "handshake_all"
    if path.startswith(PATH + "/"):
        return "handshake_rank"
    return path.strip("/") if path in ("/healthz", "/readyz") else "other"
