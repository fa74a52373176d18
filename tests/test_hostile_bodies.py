"""Hostile request bodies against real ``kvbridge serve`` and ``kvbridge proxy`` processes:
crafted bodies cost time linear in their size and never stall the event loop, and bodies
no encoder can write back are a 400 in the one error shape."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvbridge.errors import RequestError
from kvbridge.limits import decode_json_body
from kvbridge.tools.launch import KVBridgeProcess, free_port
from tests.conftest import ROOT

# A string that never ends, of quote-backslash pairs: the old pre-scan restarted its string
# match at every quote and took time quadratic in the body (64 KiB stalled a server 22 s).
CRAFTED = b'"\\'
SMALL, BIG = 64 << 10, 1 << 20
# The big body is 16 times the small one: linear time is about 16 times, quadratic 256.
FACTOR = 48
HEALTH_BOUND = 1.0  # seconds /health may take while the big body is processed


def _stop(proc: KVBridgeProcess) -> None:
    # A server stalled on a body answers no SIGTERM: do not wait long for it.
    proc.stop(timeout=5)


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """An engine (``kvbridge serve``, the tiny model, prefill and decode in one) and a proxy
    in front of it, each in its own process."""
    logs = tmp_path_factory.mktemp("hostile-bodies")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    e_port, p_port = free_port(), free_port()
    engine = KVBridgeProcess("engine", logs, "serve", "--port", str(e_port),
                             "--side-channel-port", "0", env=env)
    urls = {"engine": f"http://127.0.0.1:{e_port}", "proxy": f"http://127.0.0.1:{p_port}"}
    proxy = KVBridgeProcess("proxy", logs, "proxy", "--port", str(p_port), "--prefill",
                            urls["engine"], "--decode", urls["engine"], "--no-prewarm", env=env)
    try:
        deadline = time.monotonic() + 120
        engine.wait_healthy(urls["engine"] + "/health", deadline)
        proxy.wait_healthy(urls["proxy"] + "/health", deadline)
        yield urls
    finally:
        _stop(proxy)
        _stop(engine)


def _post(url: str, body: bytes, timeout: float) -> tuple[int, float]:
    with httpx.Client(timeout=timeout, trust_env=False) as c:
        start = time.perf_counter()
        r = c.post(url, content=body, headers={"content-type": "application/json"})
        return r.status_code, time.perf_counter() - start


def _fastest(url: str, body: bytes, timeout: float, runs: int = 3) -> float:
    """The fastest of ``runs`` answers (each a refusal or a parse, never a 5xx)."""
    best = float("inf")
    for _ in range(runs):
        status, took = _post(url, body, timeout)
        assert 400 <= status < 500, status
        best = min(best, took)
    return best


@pytest.mark.parametrize("target,path", [("proxy", "/v1/completions"),
                                         ("proxy", "/v1/chat/completions"),
                                         ("engine", "/v1/completions")])
def test_a_crafted_body_costs_linear_time_and_health_answers_meanwhile(
        servers: dict[str, str], target: str, path: str) -> None:
    base = servers[target]
    big = CRAFTED * (BIG // len(CRAFTED))
    answers: list[tuple[int, float] | Exception] = []

    def send_big() -> None:
        try:
            answers.append(_post(base + path, big, timeout=30))
        except Exception as e:  # reported below
            answers.append(e)

    sender = threading.Thread(target=send_big, daemon=True)
    sender.start()
    with httpx.Client(timeout=HEALTH_BOUND * 2, trust_env=False) as c:
        while True:  # at least one probe, and more as long as the big body is in flight
            start = time.perf_counter()
            try:
                status = c.get(base + "/health").status_code
            except httpx.TimeoutException:
                status = None
            took = time.perf_counter() - start
            assert status == 200 and took < HEALTH_BOUND, (
                f"/health took {took:.2f}s (status {status}) while a {BIG}-byte crafted body "
                "was processed")
            if not sender.is_alive():
                break
    sender.join()
    assert isinstance(answers[0], tuple) and 400 <= answers[0][0] < 500, answers

    small_s = _fastest(base + path, CRAFTED * (SMALL // len(CRAFTED)), timeout=30)
    big_s = _fastest(base + path, big, timeout=max(30, FACTOR * small_s * 2))
    assert big_s <= FACTOR * small_s, (
        f"{BIG} bytes took {big_s:.3f}s, {SMALL} bytes {small_s:.4f}s: "
        f"{big_s / small_s:.0f} times for 16 times the size")


# The scan alone, in a child process: a quadratic scan holds the GIL for hours, and only a
# process can be stopped at the deadline.
_SCAN_TIMES = """
import sys, time
from kvbridge.limits import json_depth
for piece in sys.argv[1:]:
    piece = piece.encode().decode("unicode_escape").encode("latin-1")
    times = []
    for size in (64 << 10, 1 << 20):
        body = piece * (size // len(piece))
        best = float("inf")
        for _ in range(5):
            start = time.process_time()  # CPU time: another process's turn is not counted
            json_depth(body)
            best = min(best, time.process_time() - start)
        times.append(best)
    print(repr(piece), times[0], times[1], flush=True)
"""

# Bodies made to be slow for a string matcher: unterminated strings of every kind, strings
# that close at once, brackets between quotes, and escapes.
PIECES = ['"\\\\', '\\\\"', '"', '"[', '"a', '\\\\', '"\\\\\\\\', '[]', '{"a":[', 'x']


def test_the_depth_scan_is_linear_in_the_body() -> None:
    try:
        out = subprocess.run([sys.executable, "-c", _SCAN_TIMES, *PIECES], capture_output=True,
                             text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)},
                             cwd=Path(ROOT), check=True).stdout
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the scan of 64 KiB and 1 MiB bodies took over 60s: {e.stdout!r}")
    for line in out.splitlines():
        piece, small_s, big_s = line.rsplit(" ", 2)
        # 16 times the size; a floor of 1 ms for timings too small to compare
        assert float(big_s) <= FACTOR * max(float(small_s), 1e-3), (piece, small_s, big_s)


# -- strings no encoder can write back ------------------------------------------------------

LONE_SURROGATES = [
    ("/v1/completions", rb'{"prompt": "hi \ud800", "max_tokens": 2}'),
    ("/v1/completions", rb'{"prompt": "hi \ud800x", "max_tokens": 2}'),
    ("/v1/completions", rb'{"prompt": "hi", "max_tokens": 2, "user": "\udfff"}'),
    ("/v1/chat/completions",
     rb'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "user": "\udfff"}'),
    ("/v1/chat/completions",
     rb'{"messages": [{"role": "user", "content": "\ude00 hi"}], "max_tokens": 2}'),
]


@pytest.mark.parametrize("path,body", LONE_SURROGATES)
def test_a_lone_surrogate_is_a_400_in_the_error_shape_as_on_the_engine(
        servers: dict[str, str], path: str, body: bytes) -> None:
    for target in ("proxy", "engine"):
        r = httpx.post(servers[target] + path, content=body, trust_env=False, timeout=30,
                       headers={"content-type": "application/json"})
        assert r.status_code == 400, (target, r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"], target
        assert err["type"] == "invalid_request_error", target


def test_a_surrogate_pair_is_still_text() -> None:
    body = decode_json_body(rb'{"prompt": "hi \ud83d\ude00"}')
    assert body == {"prompt": "hi \U0001f600"}
    with pytest.raises(RequestError) as e:
        decode_json_body(rb'{"prompt": "hi \ud800"}')
    assert e.value.status == 400
