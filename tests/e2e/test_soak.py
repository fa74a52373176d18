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

from kvbridge.proxy import build_proxy_app
from kvbridge.tools.testing.api_server import BackgroundServer
from kvbridge.tools.testing.procfs import instance_rss_mib
from tests.e2e.conftest import PROMPTS
from tests.e2e.conftest import complete as _complete
from tests.e2e.test_pd import _wait_blocks_back
from tests.helpers import wait_until

SECONDS = float(os.environ.get("KVBRIDGE_SOAK_SECONDS", "12"))
CLIENTS = int(os.environ.get("KVBRIDGE_SOAK_CLIENTS", "8"))
MEMORY_SLACK_MIB = 64  # allocator noise; a leak per request grows without bound


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

        with httpx.Client() as c:
            def prewarmed() -> dict | None:
                st = c.get(proxy.url + "/v1/kv/prewarm").json()
                return st if st["done"] else None

            status = wait_until(prewarmed, 60, "the proxy's prewarm done", every=0.05)
        assert [pair["outcome"] for pair in status["pairs"]] == ["ok"], status
        # warm-up, then the memory baseline
        stop = time.monotonic() + min(3.0, SECONDS / 4)
        with cf.ThreadPoolExecutor(CLIENTS) as pool:
            list(pool.map(client, range(CLIENTS)))
        rss0 = {e.name: instance_rss_mib(e.proc.pid) for e in (p, d)}
        stop = time.monotonic() + SECONDS
        with cf.ThreadPoolExecutor(CLIENTS) as pool:
            for n, errs in pool.map(client, range(CLIENTS)):
                done += n
                failures += errs
    rss1 = {e.name: instance_rss_mib(e.proc.pid) for e in (p, d)}
    print(f"soak: {done} requests by {CLIENTS} clients in {SECONDS:g}s, "
          f"{len(failures)} failed; RSS MiB before {rss0} after {rss1}")
    assert done > CLIENTS and failures == []
    _wait_blocks_back([p, d], start)
    for name in rss0:
        assert rss1[name] - rss0[name] < MEMORY_SLACK_MIB, (name, rss0[name], rss1[name])
