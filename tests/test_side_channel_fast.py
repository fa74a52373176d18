"""The side channel's requests answered in the protocol layer (kvbridge.handshake.http.fast_path)
answer exactly as the app does: real servers on loopback, raw HTTP/1.1 over a socket.

Each request goes to two servers on the same store and settings, one with the fast path
and one without; status, content type, body, the audit log's lines and what the observer
saw must be the same.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from kvbridge.config import SideChannelConfig
from kvbridge.handshake.authz import Authorizer
from kvbridge.handshake.http.protocol import HeadLimitedHttpTools
from kvbridge.handshake.http.server import HttpHandshakeServer
from tests.helpers import full_store

TOKEN = "fast-token"


def recv_responses(sock: socket.socket, n: int) -> list[tuple[int, dict[str, str], bytes]]:
    """``n`` responses read off ``sock`` (content-length framed)."""
    buf = b""
    out = []
    while len(out) < n:
        while b"\r\n\r\n" not in buf:
            chunk = sock.recv(65536)
            assert chunk, f"connection closed after {len(out)} response(s)"
            buf += chunk
        head, buf = buf.split(b"\r\n\r\n", 1)
        lines = head.decode("latin-1").split("\r\n")
        headers = {k.lower(): v.strip() for k, v in (h.split(":", 1) for h in lines[1:])}
        size = int(headers["content-length"])
        while len(buf) < size:
            buf += sock.recv(65536)
        out.append((int(lines[0].split()[1]), headers, buf[:size]))
        buf = buf[size:]
    return out


def exchange(port: int, raw: bytes, n: int = 1) -> list[tuple[int, dict[str, str], bytes]]:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(raw)
        return recv_responses(sock, n)


@contextmanager
def server(tmp_path: Path, name: str, fast: bool) -> Iterator[tuple[HttpHandshakeServer,
                                                                    list, Path]]:
    audit = tmp_path / f"{name}.audit"
    cfg = SideChannelConfig(token=TOKEN, audit_log=str(audit))
    seen: list[tuple[str, int, int]] = []
    s = HttpHandshakeServer(full_store(2), "127.0.0.1", 0, token=TOKEN,
                            observer=lambda *a: seen.append(a),
                            authz=Authorizer.from_config(cfg))
    answered: list[bytes] = []  # targets the fast path answered
    inner = s._protocol.responder
    if fast:
        def counted(method, target, *rest):  # type: ignore[no-untyped-def]
            answer = inner(method, target, *rest)
            if answer is not None:
                answered.append(target)
            return answer
        s._protocol.responder = staticmethod(counted)
    else:
        s._protocol = HeadLimitedHttpTools  # the app answers everything
    s.answered = answered  # type: ignore[attr-defined]
    s.start()
    try:
        yield s, seen, audit
    finally:
        s.stop()


def get(path: str, *headers: str, version: str = "1.1") -> bytes:
    lines = [f"GET {path} HTTP/{version}", "host: x", *headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


AUTH = f"authorization: Bearer {TOKEN}"
# What the fast path answers; the rest goes to the app.
FAST = {"healthz", "readyz", "all", "rank", "two tokens, first right"}
CASES = {
    "healthz": get("/healthz"),
    "readyz": get("/readyz"),
    "all": get("/v1/kv/handshake", AUTH),
    "rank": get("/v1/kv/handshake/1", AUTH),
    "no token": get("/v1/kv/handshake"),
    "wrong token": get("/v1/kv/handshake/0", "authorization: Bearer nope"),
    "two tokens, first right": get("/v1/kv/handshake/0", AUTH, "authorization: Bearer no"),
    "no such rank": get("/v1/kv/handshake/7", AUTH),
    "not a rank": get("/v1/kv/handshake/x1", AUTH),
    "json view": get("/v1/kv/handshake/0", AUTH, "accept: application/json"),
    "query": get("/v1/kv/handshake?x=1", AUTH),
    "other path": get("/v1/kv/other", AUTH),
    "post": f"POST /v1/kv/handshake HTTP/1.1\r\nhost: x\r\n{AUTH}\r\ncontent-length: 2\r\n"
            "\r\n{}".encode(),
}


def audit_results(path: Path) -> list[tuple[str, str]]:
    lines = path.read_text().splitlines() if path.exists() else []
    return [(r["route"], r["result"]) for r in map(json.loads, lines)]


@pytest.mark.parametrize("case", list(CASES))
def test_the_fast_path_answers_as_the_app(case: str, tmp_path: Path) -> None:
    with server(tmp_path, "fast", True) as (fast, fast_seen, fast_audit), \
            server(tmp_path, "app", False) as (app, app_seen, app_audit):
        (f_status, f_headers, f_body), = exchange(fast.port, CASES[case])
        (a_status, a_headers, a_body), = exchange(app.port, CASES[case])
    assert (f_status, f_headers.get("content-type"), f_body) == (
        a_status, a_headers.get("content-type"), a_body)
    assert fast_seen == app_seen
    assert audit_results(fast_audit) == audit_results(app_audit)
    assert len(fast.answered) == (1 if case in FAST else 0)  # type: ignore[attr-defined]


def test_pipelined_requests_are_answered_in_order(tmp_path: Path) -> None:
    """An app request (the JSON view) then fast ones, in one write: answered in order."""
    raw = (get("/v1/kv/handshake/0", AUTH, "accept: application/json") + get("/healthz")
           + get("/v1/kv/handshake/1", AUTH) + get("/readyz"))
    with server(tmp_path, "fast", True) as (fast, _, _):
        answers = exchange(fast.port, raw, 4)
    assert [a[0] for a in answers] == [200, 200, 200, 200]
    assert json.loads(answers[0][2])["ranks"][0]["tp_rank"] == 0
    assert [a[2] for a in answers[1::2]] == [b"ok", b"ready"]
    assert answers[2][1]["content-type"] == "application/vnd.msgpack"


def test_keep_alive_serves_many_and_http_1_0_closes(tmp_path: Path) -> None:
    with server(tmp_path, "fast", True) as (fast, seen, _):
        with socket.create_connection(("127.0.0.1", fast.port), timeout=10) as sock:
            for _ in range(50):
                sock.sendall(get("/v1/kv/handshake/0", AUTH))
                assert recv_responses(sock, 1)[0][0] == 200
        with socket.create_connection(("127.0.0.1", fast.port), timeout=10) as sock:
            sock.sendall(get("/healthz", version="1.0"))
            (status, headers, body), = recv_responses(sock, 1)
            assert (status, headers.get("connection"), body) == (200, "close", b"ok")
            assert sock.recv(1) == b""  # closed after the answer
    assert len(seen) == 51
