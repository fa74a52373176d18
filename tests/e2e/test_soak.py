"""A bounded soak: many clients through the proxy for a while, prefill TP 2 and decode
TP 1 (different sizes on purpose). Zero failed requests, no block leak, memory flat.

The suite runs a short version. The long one, by one command:

    KVBRIDGE_SOAK_SECONDS=300 KVBRIDGE_SOAK_CLIENTS=32 \\
        .venv/bin/python -m pytest -q tests/e2e/test_soak.py
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import time
from pathlib import Path

import httpx
import pytest

from kvbridge.server.proxy import build_proxy_app
from kvbridge.testing.api_server import BackgroundServer
from tests.e2e.conftest import PROMPTS
from tests.e2e.conftest import complete as _complete
from tests.e2e.test_pd import _wait_blocks_back

SECONDS = float(os.environ.get("KVBRIDGE_SOAK_SECONDS", "12"))
CLIENTS = int(os.environ.get("KVBRIDGE_SOAK_CLIENTS", "8"))
MEMORY_SLACK_MIB = 64  # allocator noise; a leak per request grows without bound


def _rss_mib(pid: int) -> float:
    """Resident memory of a process and its children (the TP workers)."""
    total = 0
    pids = [pid]
    children = Path(f"/proc/{pid}/task/{pid}/children")
    if children.exists():
        pids += [int(c) for c in children.read_text().split()]
    for p in pids:
        for line in Path(f"/proc/{p}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                total += int(line.split()[1])
    return total / 1024


def _proxy(p, d, certs: Path, token: str) -> BackgroundServer:
    """The proxy as deployed: https to the engines, the side-channel token for prewarm."""
    return BackgroundServer(build_proxy_app([p.url], [d.url], ca_certs=str(certs / "ca.pem"),
                                            kv_token=token, admin_routes="open"))


# The suite's per-test timeout is 300 s: the long form needs its duration on top.
@pytest.mark.timeout(int(2 * SECONDS) + 300)
def test_soak(cluster, reference, certs, token_file):
    p, d = cluster["p2-http"], cluster["d1"]
    start = {e.name: e.metric("kvbridge_blocks_free") for e in (p, d)}
    done, failures = 0, []
    with _proxy(p, d, certs, token_file.read_text()) as proxy:
        def client(i: int) -> tuple[int, list[str]]:
            n, errs = 0, []
            with httpx.Client(timeout=60):
                while time.monotonic() < stop:
                    prompt = PROMPTS[(i + n) % len(PROMPTS)]
                    try:
                        got = _complete(proxy.url, prompt, stream=bool(n % 2))
                        if got != reference[prompt]:
                            errs.append(f"wrong answer for {prompt!r}: {got!r}")
                    except (AssertionError, httpx.HTTPError) as e:
                        errs.append(f"{type(e).__name__}: {e}")
                    n += 1
            return n, errs

        deadline = time.monotonic() + 60
        with httpx.Client() as c:
            while not (status := c.get(proxy.url + "/v1/kv/prewarm").json())["done"]:
                assert time.monotonic() < deadline, status
                time.sleep(0.05)
        assert [pair["outcome"] for pair in status["pairs"]] == ["ok"], status
        # warm-up, then the memory baseline
        stop = time.monotonic() + min(3.0, SECONDS / 4)
        with cf.ThreadPoolExecutor(CLIENTS) as pool:
            list(pool.map(client, range(CLIENTS)))
        rss0 = {e.name: _rss_mib(e.proc.pid) for e in (p, d)}
        stop = time.monotonic() + SECONDS
        with cf.ThreadPoolExecutor(CLIENTS) as pool:
            for n, errs in pool.map(client, range(CLIENTS)):
                done += n
                failures += errs
    rss1 = {e.name: _rss_mib(e.proc.pid) for e in (p, d)}
    print(f"soak: {done} requests by {CLIENTS} clients in {SECONDS:g}s, "
          f"{len(failures)} failed; RSS MiB before {rss0} after {rss1}")
    assert done > CLIENTS and failures == []
    _wait_blocks_back([p, d], start)
    for name in rss0:
        assert rss1[name] - rss0[name] < MEMORY_SLACK_MIB, (name, rss0[name], rss1[name])
