"""Routing (pure) and the proxy's membership view fed by a real etcd."""

from __future__ import annotations

import threading
import time

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.responses import Response
from starlette.routing import Route

from kvbridge.proxy.membership import Membership
from kvbridge.proxy.routing import Backend, Router
from kvbridge.registry import EtcdRegistry, InstanceRecord, instance_key, parse_registry_url
from kvbridge.tools.launch import free_port
from tests.helpers import wait_until as _wait


def test_pairs_only_compatible_instances():
    r = Router()
    r.upsert(Backend("http://p-a", "prefill", compat_hash="a"))
    r.upsert(Backend("http://p-b", "prefill", compat_hash="b"))
    r.upsert(Backend("http://d-b", "decode", compat_hash="b"))
    for _ in range(4):
        p, d = r.pick_pair()
        assert (p.url, d.url) == ("http://p-b", "http://d-b")
    assert r.pick_pair(exclude_prefill=["http://p-b"]) is None
    r.upsert(Backend("http://d-any", "decode"))  # a static one: pairs with anything
    assert {r.pick_pair()[0].url for _ in range(4)} == {"http://p-a", "http://p-b"}


def test_least_outstanding_then_least_recent():
    r = Router()
    for i in range(3):
        r.upsert(Backend(f"http://p{i}", "prefill"))
    r.upsert(Backend("http://d", "decode"))
    order = [r.pick_pair()[0].url for _ in range(3)]
    assert order == ["http://p0", "http://p1", "http://p2"]  # ties: least recently picked
    busy = r.get("http://p0")
    done = r.acquire(busy)
    assert [r.pick_pair()[0].url for _ in range(4)] == ["http://p1", "http://p2"] * 2
    done()
    done()  # idempotent
    assert busy.outstanding == 0
    r.failed(r.get("http://p1"))  # cooling down: last resort only
    assert "http://p1" not in {r.pick_pair()[0].url for _ in range(4)}
    assert r.pick_pair(exclude_prefill=["http://p0", "http://p2"])[0].url == "http://p1"


def test_restart_clears_cooldown_and_bad_policy():
    r = Router()
    b = r.upsert(Backend("http://p", "prefill", epoch="1"))
    r.failed(b)
    r.upsert(Backend("http://p", "prefill", epoch="2"))
    assert r.get("http://p").down_until == 0.0 and r.get("http://p").failures == 1
    with pytest.raises(ValueError):
        Router("random")


# --- membership over a real etcd ----------------------------------------------------


class _Health:
    """A real HTTP server answering /health, for the membership's liveness probe."""

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        app = Starlette(routes=[Route("/health", lambda r: Response(status_code=200))])
        self.server = uvicorn.Server(
            uvicorn.Config(app, port=self.port, log_config=None, log_level="warning")
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        _wait(lambda: self.server.started, 10, "health server up")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def _rec(engine_id: str, role: str, url: str) -> InstanceRecord:
    return InstanceRecord(
        engine_id=engine_id, epoch="e", role=role, api_url=url, tp_size=1, compat_hash="h"
    )


def test_membership_follows_the_registry(etcd):
    reg = EtcdRegistry(parse_registry_url(etcd.url))
    alive = _Health()
    dead_url = f"http://127.0.0.1:{free_port()}"
    router = Router()
    added: list[str] = []
    router.on_added = lambda b: added.append(b.url)
    lease = reg.grant(30)
    reg.put(
        instance_key(_rec("p0", "prefill", dead_url)),
        _rec("p0", "prefill", dead_url).encode(),
        lease,
    )
    m = Membership(
        EtcdRegistry(parse_registry_url(etcd.url), timeout=0.5),
        router,
        grace=1.5,
        probe_timeout=5,  # the live one must not look dead on a busy machine
    ).start()
    try:
        _wait(lambda: router.urls("prefill") == [dead_url], 5, "listed at start")
        rec = _rec("d0", "decode", alive.url)
        reg.put(instance_key(rec), rec.encode(), lease)
        _wait(lambda: router.urls("decode") == [alive.url], 10, "watched in")
        # on_added is called after the router lists it: wait for it too
        _wait(lambda: added == [dead_url, alive.url], 5, "on_added for both")
        reg.put(instance_key(_rec("bad", "decode", alive.url)), b"{not json", lease)
        # a record that goes, of an instance that does not answer: dropped at once
        reg.delete(instance_key(_rec("p0", "prefill", dead_url)))
        _wait(lambda: router.urls("prefill") == [], 10, "dead one dropped")
        # of one that still answers: kept for the grace, then dropped if not back
        t0 = time.monotonic()
        reg.delete(instance_key(rec))
        time.sleep(0.5)
        assert router.urls("decode") == [alive.url]
        _wait(lambda: router.urls("decode") == [], 5, "orphan dropped after the grace")
        assert time.monotonic() - t0 >= 1.5
        # etcd gone: the view stays; etcd back: new records are seen again
        reg.put(instance_key(rec), rec.encode(), lease)
        _wait(lambda: router.urls("decode") == [alive.url], 10, "back")
        etcd.proc.kill()
        etcd.proc.wait()
        _wait(lambda: not m.connected.is_set(), 5, "membership saw etcd go")
        assert router.urls("decode") == [alive.url]
        etcd.start()
        _wait(m.connected.is_set, 10, "membership reconnected")
        rec2 = _rec("p1", "prefill", alive.url.replace("127.0.0.1", "localhost"))
        reg.put(instance_key(rec2), rec2.encode())
        _wait(lambda: router.urls("prefill") == [rec2.api_url], 10, "seen after reconnect")
        assert router.urls("decode") == [alive.url]
    finally:
        m.close()
        alive.stop()
