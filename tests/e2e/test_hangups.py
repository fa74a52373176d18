"""Clients that leave, against real ``kvbridge serve`` prefill and decode processes and a
real ``kvbridge proxy`` (the first token from the prefill, the default), on loopback.

A client that hangs up (a reset, or a plain close) at any point of a streamed answer must
not leave the prefill's blocks pinned for the hold's lease (engines named to the proxy,
or an etcd fleet): the prefill's free-block
gauge is back at full within 2 s (the issue's bound). The points are made exact by
stopping a process (SIGSTOP) where the client must leave, and are observed through the
proxy's ``/v1/fleet`` and the engines' gauges, never guessed with sleeps.

And client request ids are labels: two clients naming the same ``x-request-id`` at
once are both served.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import json
import os
import signal
import socket
import struct
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvbridge.tools.launch import KVBridgeProcess, free_port
from kvbridge.tools.testing.etcd_server import EtcdProcess
from tests.conftest import ROOT
from tests.e2e.conftest import START_TIMEOUT, Serve
from tests.helpers import wait_until

HOST = "127.0.0.1"
BACK_WITHIN = 2.0  # seconds: the bound for a hold a client left behind
LEASE = 10  # seconds: a hold nobody releases is freed by this, far past BACK_WITHIN
PROMPT = "A prompt that fills a few of the prefill's KV blocks, then some more of them."
POINTS = ["before the prefill answers", "after the prefill answered", "after the first chunk",
          "during the decode hop"]


class Proxy(KVBridgeProcess):
    def __init__(self, name: str, log_dir: Path, engines: list[str], token_file: Path):
        self.port = free_port()
        self.url = f"http://{HOST}:{self.port}"
        super().__init__(name, log_dir, "proxy", *engines, "--port", str(self.port),
                         "--kv-token-file", str(token_file), "--admin-routes", "open",
                         env={**os.environ, "PYTHONPATH": str(ROOT)})

    def fleet(self) -> dict:
        return httpx.get(self.url + "/v1/fleet", timeout=10).json()

    def outstanding(self, role: str) -> int:
        return sum(b["outstanding"] for b in self.fleet()[role])


@pytest.fixture(scope="module", params=["static", "etcd"])
def pd(request, token_file, serve_log_dir) -> Iterator[dict]:
    """A prefill, a decode and a proxy: named to the proxy (static), or registered in etcd
    and found by the proxy's watch (an etcd fleet)."""
    fleet = request.param
    etcd = EtcdProcess(log_dir=serve_log_dir, name="hangups-etcd").start() \
        if fleet == "etcd" else None
    registry = () if etcd is None else ("--registry", etcd.url)
    side = ("--side-channel-port", "0", "--side-channel-token-file", str(token_file),
            "--handshake", "http", *registry)
    procs = {"p": Serve(f"hangups-{fleet}-p", serve_log_dir, "--role", "prefill",
                        "--kv-lease-seconds", str(LEASE), *side),
             "d": Serve(f"hangups-{fleet}-d", serve_log_dir, "--role", "decode", *side)}
    proxy = None
    try:
        deadline = time.monotonic() + START_TIMEOUT
        for p in procs.values():
            p.wait_ready(deadline)
        full = procs["p"].metric("kvbridge_blocks_free")
        engines = (["--prefill", procs["p"].url, "--decode", procs["d"].url] if etcd is None
                   else ["--registry", etcd.url])
        proxy = Proxy(f"hangups-{fleet}-proxy", serve_log_dir, engines, token_file)
        proxy.wait_healthy(proxy.url + "/health", deadline)
        wait_until(lambda: [len(proxy.fleet()[r]) for r in ("prefill", "decode")] == [1, 1],
                   60, "the proxy's view of the fleet")
        # one answer end to end: the decode has its handshake with the prefill
        r = httpx.post(proxy.url + "/v1/completions", timeout=60, json=_body("completions"))
        assert r.status_code == 200, r.text
        yield {**procs, "proxy": proxy, "full": full}
    finally:
        for p in procs.values():
            p.proc.send_signal(signal.SIGCONT)
        if proxy is not None:
            proxy.stop()
        for p in procs.values():
            p.stop()
        if etcd is not None:
            etcd.close()


def _body(endpoint: str) -> dict:
    common = {"model": "kvbridge-tiny", "max_tokens": 8, "temperature": 0, "stream": True,
              "ignore_eos": True}  # the prefill's token is never the whole answer
    if endpoint == "chat":
        return {**common, "messages": [{"role": "user", "content": PROMPT}]}
    return {**common, "prompt": PROMPT}


def _send(port: int, endpoint: str, headers: str = "") -> socket.socket:
    """A streamed request on a raw socket, which the test then closes its own way."""
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    data = json.dumps(_body(endpoint)).encode()
    s = socket.create_connection((HOST, port), timeout=30)
    s.sendall(f"POST {path} HTTP/1.1\r\nHost: {HOST}\r\nContent-Type: application/json\r\n"
              f"Content-Length: {len(data)}\r\n{headers}\r\n".encode() + data)
    return s


def _first_chunk(s: socket.socket) -> bytes:
    """Read until the answer's first server-sent event is complete."""
    got = b""
    while not ((i := got.find(b"data: ")) >= 0 and b"\n\n" in got[i:]):
        chunk = s.recv(65536)
        assert chunk, f"closed before the first chunk: {got!r}"
        got += chunk
    assert got.startswith(b"HTTP/1.1 200"), got
    return got


def _hang_up(s: socket.socket, how: str) -> None:
    if how == "reset":  # SO_LINGER 0: close sends an RST, not a FIN
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    s.close()


@contextlib.contextmanager
def _stopped(proc: KVBridgeProcess) -> Iterator[None]:
    proc.proc.send_signal(signal.SIGSTOP)
    try:
        yield
    finally:
        proc.proc.send_signal(signal.SIGCONT)


def _free(pd: dict) -> float:
    return pd["p"].metric("kvbridge_blocks_free")


def _quiet(pd: dict) -> None:
    """The previous test's requests are over and the prefill's blocks all free (a hold a
    previous run leaked is freed by the lease)."""
    proxy = pd["proxy"]
    wait_until(lambda: proxy.outstanding("prefill") == 0 and proxy.outstanding("decode") == 0
               and _free(pd) == pd["full"], LEASE + 20, "a quiet prefill and proxy",
               message=lambda: _free(pd))


def _back_at_full(pd: dict, since: str) -> None:
    wait_until(lambda: _free(pd) == pd["full"], BACK_WITHIN,
               f"the prefill's blocks back at full after a client left {since}",
               every=0.02, message=lambda: f"{_free(pd):g} of {pd['full']:g} free")


@pytest.mark.parametrize("how", ["reset", "close"])
@pytest.mark.parametrize("endpoint", ["completions", "chat"])
@pytest.mark.parametrize("point", POINTS)
def test_a_client_that_leaves_leaves_no_hold(pd, point, endpoint, how):
    p, d, proxy = pd["p"], pd["d"], pd["proxy"]
    _quiet(pd)
    if point == "before the prefill answers":
        with _stopped(p):
            s = _send(proxy.port, endpoint)
            wait_until(lambda: proxy.outstanding("prefill") == 1, 30,
                       "the proxy waiting for the prefill")
            _hang_up(s, how)
        # the prefill answers now, to a proxy whose client is gone
    elif point == "after the prefill answered":
        try:
            with _stopped(p):
                s = _send(proxy.port, endpoint)
                wait_until(lambda: proxy.outstanding("prefill") == 1, 30,
                           "the proxy waiting for the prefill")
                proxy.proc.send_signal(signal.SIGSTOP)
            # the prefill answers (its hold is taken) while the proxy cannot write yet
            wait_until(lambda: _free(pd) < pd["full"], 30, "the prefill's hold")
            _hang_up(s, how)
        finally:  # the proxy reads the prefill's answer and its client's hang-up together
            proxy.proc.send_signal(signal.SIGCONT)
    else:
        with _stopped(d):
            s = _send(proxy.port, endpoint)
            _first_chunk(s)  # the prefill's token, while no decode can read its blocks
            if point == "during the decode hop":
                wait_until(lambda: proxy.outstanding("decode") == 1, 30,
                           "the proxy waiting for the decode")
            _hang_up(s, how)
            _back_at_full(pd, point)  # with the decode still stopped: the proxy released it
        return
    _back_at_full(pd, point)


def test_two_clients_with_one_request_id_are_both_served(pd):
    """The same plain ``x-request-id`` from two clients at once: each request gets an id of
    the engines' own, both are answered, and each answer is labelled with the client's id."""
    proxy = pd["proxy"]
    _quiet(pd)
    body = {**_body("completions"), "stream": False}
    with cf.ThreadPoolExecutor(2) as pool:
        with _stopped(pd["p"]):
            # both wait at the stopped prefill: in flight together when it resumes
            futures = [pool.submit(httpx.post, proxy.url + "/v1/completions", json=body,
                                   headers={"x-request-id": "same-id"}, timeout=60)
                       for _ in range(2)]
            wait_until(lambda: proxy.outstanding("prefill") == 2, 30, "both at the prefill")
        answers = [f.result() for f in futures]
    for r in answers:
        assert r.status_code == 200, r.text
        assert r.headers["x-request-id"] == "same-id"
    _quiet(pd)
