"""The ``http`` side channel's common requests answered in the protocol layer, without ASGI.

A handshake is a ``GET`` of a precomputed envelope: routing it through Starlette (a
request object, two middlewares, a response object, an ASGI task) cost most of the
server's CPU. ``responder`` answers, straight from the parsed request
head, what it can answer the same way the app would:

* ``GET /healthz``, ``GET /readyz``;
* ``GET /v1/kv/handshake[/{tp_rank}]`` with no body and no JSON ``Accept``, when the
  caller is allowed (``Authorizer.decide``: token, scope, certificate allow-list) and the
  store answers 200; the audit log and the observer see it as they see the app's.

Anything else (a refusal, a 503 or 404, the JSON view, another method or path, a query
string, a body) returns None, and the request goes to the app (``server``), which decides
again: one answer per request either way.
"""

from __future__ import annotations

from collections.abc import Callable

from kvbridge.handshake.authz import Authorizer
from kvbridge.handshake.base import MetadataStore, Observer
from kvbridge.handshake.http.routes import MSGPACK, PATH

__all__ = ["Answer", "Responder", "responder"]

# A status line, and the rest of the response after the server's default headers.
Answer = tuple[bytes, bytes]
# (method, request target, headers as uvicorn lowercases them, peer certificate, client)
Responder = Callable[[bytes, bytes, list[tuple[bytes, bytes]], dict | None,
                      tuple[str, int] | None], Answer | None]

_OK = b"HTTP/1.1 200 OK\r\n"
_503 = b"HTTP/1.1 503 Service Unavailable\r\n"
_TEXT = b"content-type: text/plain; charset=utf-8\r\n"
_PATH = PATH.encode()
_RANK_PREFIX = _PATH + b"/"


def _text(status: bytes, body: bytes) -> Answer:
    return status, _TEXT + b"content-length: %d\r\n\r\n" % len(body) + body


_HEALTHZ = _text(_OK, b"ok")
_READY = _text(_OK, b"ready")
_NOT_READY = _text(_503, b"not ready")
_MSGPACK = b"content-type: " + MSGPACK.encode() + b"\r\ncontent-length: "


def responder(store: MetadataStore, authz: Authorizer,
              observer: Observer | None = None) -> Responder:
    """Answers for ``store`` under ``authz`` (see the module); None: the app's to answer."""
    observe = observer or (lambda route, status, nbytes: None)

    def answer(method: bytes, target: bytes, headers: list[tuple[bytes, bytes]],
               peer_cert: dict | None, client: tuple[str, int] | None) -> Answer | None:
        if method != b"GET":
            return None
        if target == b"/healthz":
            observe("healthz", 200, 2)
            return _HEALTHZ
        if target == b"/readyz":
            ready = store.ready
            observe("readyz", 200 if ready else 503, 5 if ready else 9)
            return _READY if ready else _NOT_READY
        if target == _PATH:
            tp_rank, route = None, "handshake_all"
        elif target.startswith(_RANK_PREFIX):
            raw = target[len(_RANK_PREFIX):]
            if not (raw.isdigit() and len(raw) <= 6):
                return None  # (the app's 404 names what was wrong)
            tp_rank, route = int(raw), "handshake_rank"
        else:
            return None
        authorization: str | None = None
        for name, value in headers:
            if name == b"authorization":
                if authorization is None:  # the first, as Starlette reads it
                    authorization = value.decode("latin-1")
            elif name == b"accept":
                if b"application/json" in value:
                    return None
            elif name == b"transfer-encoding" or (name == b"content-length" and value != b"0"):
                return None  # a body: the app's limits apply
        decision = authz.decide(authorization, peer_cert, "metadata")
        if not decision.ok:
            return None
        reply = store.reply(tp_rank)
        if reply.status != 200:
            return None
        authz.record(decision, None if client is None else f"{client[0]}:{client[1]}",
                     route, tp_rank, "ok")
        observe(route, 200, len(reply.body))
        return _OK, _MSGPACK + b"%d\r\n\r\n" % len(reply.body) + reply.body

    return answer
