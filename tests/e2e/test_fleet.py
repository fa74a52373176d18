"""A fleet for real: etcd, two prefills and two decodes registered in it, and a
``kvbridge proxy --registry`` that discovers them by watching. Under 8 clients: a prefill
is SIGKILLed, a third decode joins, etcd is frozen for 10 s; no client sees an error and
every answer equals a single engine's.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from kvbridge.errors import RegistryError
from kvbridge.proxy.routing import DEFAULT_COOLDOWN
from kvbridge.registry import INSTANCES_PREFIX, EtcdRegistry, InstanceRecord, parse_registry_url
from kvbridge.tools.bench.load import ClosedLoop
from kvbridge.tools.launch import KVBridgeProcess, free_port
from kvbridge.tools.testing.etcd_server import EtcdProcess
from tests.conftest import ROOT
from tests.e2e.conftest import PROMPTS, START_TIMEOUT, Serve, complete
from tests.helpers import wait_until

pytestmark = pytest.mark.slow

TTL = 3
CLIENTS = 8
FLEET_PROMPTS = [*PROMPTS, "Fleets grow: more prefills, more decodes, one proxy in front."]


def _wait(cond: Callable[[], object], timeout: float, what: str) -> float:
    """Poll ``cond`` until true; returns when it became so (monotonic). An etcd read that
    times out on a busy machine is "not yet", not a failure."""
    wait_until(cond, timeout, what, tolerate=(RegistryError,))
    return time.monotonic()


class Load(ClosedLoop):
    """``CLIENTS`` closed-loop clients sending completions through the proxy until
    stopped, each answer checked against the reference; every other request streamed
    while ``streaming`` is set."""

    def __init__(self, url: str, reference: dict[str, str]):
        self.streaming = True

        def request(i: int, n: int) -> str | None:
            prompt = FLEET_PROMPTS[(i + n) % len(FLEET_PROMPTS)]
            got = complete(url, prompt, stream=self.streaming and bool((i + n) % 2))
            return None if got == reference[prompt] else f"wrong answer {got!r}"

        super().__init__(CLIENTS, request)

    def progress(self, n: int, timeout: float = 60) -> None:
        """Wait until ``n`` more requests have succeeded (failing at the first error)."""
        self.wait_ok(n, timeout)


def _serve(name: str, log_dir: Path, role: str, etcd: EtcdProcess) -> Serve:
    return Serve(
        name,
        log_dir,
        "--role",
        role,
        "--handshake",
        "http",
        "--side-channel-port",
        "0",
        "--handshake-timeout",
        "3",
        "--transfer-timeout",
        "5",
        "--registry",
        etcd.url,
        "--registry-ttl",
        str(TTL),
    )


@pytest.fixture(scope="module")
def fleet(tmp_path_factory) -> Iterator[dict]:
    log_dir = tmp_path_factory.mktemp("fleet")
    etcd = EtcdProcess(log_dir=log_dir).start()
    procs: dict[str, KVBridgeProcess] = {}
    try:
        for name, role in (
            ("p0", "prefill"),
            ("p1", "prefill"),
            ("d0", "decode"),
            ("d1", "decode"),
        ):
            procs[name] = _serve(name, log_dir, role, etcd)
        port = free_port()
        procs["proxy"] = KVBridgeProcess(
            "proxy",
            log_dir,
            "proxy",
            "--registry",
            etcd.url,
            "--port",
            str(port),
            "--admin-routes",  # the tests read /v1/fleet, /v1/kv/prewarm and /metrics
            "open",
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            log_level="info",
        )
        deadline = time.monotonic() + START_TIMEOUT
        for p in procs.values():
            if isinstance(p, Serve):
                p.wait_ready(deadline)
        proxy_url = f"http://127.0.0.1:{port}"
        procs["proxy"].wait_healthy(proxy_url + "/health", deadline)
        yield {"etcd": etcd, "procs": procs, "proxy": proxy_url, "log_dir": log_dir}
    finally:
        for p in procs.values():
            if p.proc.poll() is None:
                p.proc.kill()
                p.proc.wait()
        etcd.close()


def _fleet(proxy: str) -> dict:
    return httpx.get(proxy + "/v1/fleet", timeout=10).json()


def _routed(proxy: str, url: str) -> int | None:
    """Requests the proxy routed to ``url``; None once it is out of the view."""
    view = _fleet(proxy)
    found = [b["routed"] for b in view["prefill"] + view["decode"] if b["url"] == url]
    return found[0] if found else None


def _registered(etcd: EtcdProcess) -> set[str]:
    reg = EtcdRegistry(parse_registry_url(etcd.url))
    return {InstanceRecord.decode(v).api_url for v in reg.get_prefix(INSTANCES_PREFIX)[0].values()}


def test_fleet_failover_join_and_registry_outage(fleet):
    procs, proxy, etcd = fleet["procs"], fleet["proxy"], fleet["etcd"]
    p0, p1, d0, d1 = (procs[n] for n in ("p0", "p1", "d0", "d1"))
    # the reference: a decode instance alone computes the prompt itself
    reference = {q: complete(d0.url, q) for q in FLEET_PROMPTS}
    _wait(
        lambda: (
            {b["url"] for b in _fleet(proxy)["prefill"] + _fleet(proxy)["decode"]}
            == {p0.url, p1.url, d0.url, d1.url}
        ),
        10,
        "the proxy sees all four",
    )

    with Load(proxy, reference) as load:
        load.progress(16)
        for e in (p0, p1, d0, d1):  # traffic on every instance
            assert (_routed(proxy, e.url) or 0) > 0, (e.name, _fleet(proxy))

        # 1. SIGKILL a prefill under load: nobody notices
        p0.proc.send_signal(signal.SIGKILL)
        p0.proc.wait()
        # Polled from the kill on: once the proxy has put p0 aside (a failed attempt sends
        # it to cool down) nothing more is routed to it, and it leaves the view when its
        # lease expires.
        # (A cool-down that ends before the lease does lets one more request try p0 and
        # fail over: only the first cool-down is compared.)
        routed_while_aside: list[tuple[float, int]] = []

        def out_of_view() -> bool:
            entry = [b for b in _fleet(proxy)["prefill"] if b["url"] == p0.url]
            if entry and entry[0]["cooling_down"]:
                routed_while_aside.append((time.monotonic(), entry[0]["routed"]))
            return not entry

        # etcd checks expiry every 0.5 s and may be slow on a busy machine: a generous bound
        _wait(out_of_view, TTL + 15, "p0 out of the proxy's view")
        if routed_while_aside:
            t_aside = routed_while_aside[0][0]
            first = {r for t, r in routed_while_aside if t - t_aside < DEFAULT_COOLDOWN - 1}
            assert len(first) == 1, routed_while_aside
        assert p0.url not in _registered(etcd)
        load.progress(32)
        # requests that picked p0 after the kill were retried on p1
        metrics = httpx.get(proxy + "/metrics", timeout=10).text
        assert 'kvbridge_proxy_failovers_total{stage="prefill"}' in metrics, metrics

        # 2. a third decode joins: routed to soon after it is ready (`kvbridge bench fleet` measures it)
        d2 = _serve("d2", fleet["log_dir"], "decode", etcd)
        procs["d2"] = d2
        d2.wait_ready(time.monotonic() + START_TIMEOUT)
        t_ready = time.monotonic()
        t_routed = _wait(lambda: (_routed(proxy, d2.url) or 0) > 0, 10, "d2 routed to")
        print(f"d2 ready -> first routed: {t_routed - t_ready:.3f}s")

        def prewarmed() -> bool:  # the new pair was handshaken ahead, by the proxy
            pairs = httpx.get(proxy + "/v1/kv/prewarm", timeout=10).json()["pairs"]
            return {"prefill": p1.url, "decode": d2.url, "outcome": "ok"} in pairs

        _wait(prewarmed, 20, "p1/d2 prewarmed")
        load.progress(16)

        # 3. etcd frozen for 10 s: the proxy routes on its last view
        etcd.pause()
        try:
            frozen_until = time.monotonic() + 10
            n0 = load.ok
            _wait(lambda: time.monotonic() >= frozen_until or load.errors, 11, "10 s")
            assert not load.errors, load.errors[:5]
            assert load.ok > n0  # served meanwhile
        finally:
            etcd.resume()
        load.progress(16)
        # everyone alive is registered again, and still in the proxy's view
        alive = {p1.url, d0.url, d1.url, d2.url}
        _wait(lambda: _registered(etcd) == alive, 3 * TTL + 10, "registrations back")

        def view() -> set[str]:
            fleet_view = _fleet(proxy)
            return {b["url"] for b in fleet_view["prefill"] + fleet_view["decode"]}

        _wait(lambda: view() == alive, 10, "everyone alive back in the proxy's view")

        # 4. SIGKILL a decode under non-streamed load: a decode that dies before its first
        # token (a non-streamed answer comes whole) is failed over too. A stream already
        # past its first token cannot be hidden, so streams end first.
        load.streaming = False
        before = list(load.done)
        _wait(
            lambda: all(a > b for a, b in zip(load.done, before, strict=True)),
            60,
            "every client past its last stream",
        )
        d0.proc.send_signal(signal.SIGKILL)
        d0.proc.wait()
        load.progress(24)
        _wait(
            lambda: d0.url not in {b["url"] for b in _fleet(proxy)["decode"]},
            TTL + 15,
            "d0 out of the proxy's view",
        )
        load.progress(8)
    assert not load.errors, load.errors[:5]
    assert load.ok > 80
