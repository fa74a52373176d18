"""The registry against a real etcd: leases, keep-alive, re-registration, and
``kvbridge serve --registry`` registering, crashing and draining."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Callable

import httpx
import msgspec
import pytest

from kvbridge.errors import ConfigError, RegistryError, WatchCompacted
from kvbridge.proxy.membership import Membership
from kvbridge.proxy.routing import Router
from kvbridge.registry import (
    INSTANCES_PREFIX,
    EtcdRegistry,
    InstanceRecord,
    Registrar,
    instance_key,
    parse_registry_url,
)
from kvbridge.tools.launch import KVBridgeProcess, free_port
from tests.conftest import ROOT
from tests.helpers import wait_until


def _wait(cond: Callable[[], object], timeout: float, what: str) -> object:
    # an etcd read that times out on a busy machine is "not yet", not a failure
    return wait_until(cond, timeout, what, tolerate=(RegistryError,), every=0.05)


def _record(**kw) -> InstanceRecord:
    return InstanceRecord(
        **{
            "engine_id": "e1",
            "epoch": "ep1",
            "role": "prefill",
            "api_url": "http://127.0.0.1:1",
            "tp_size": 1,
            "compat_hash": "c" * 64,
            **kw,
        }
    )


def test_parse_registry_url():
    ep = parse_registry_url("etcd://127.0.0.1:2379")
    assert (ep.host, ep.port, ep.tls) == ("127.0.0.1", 2379, False)
    assert parse_registry_url("etcds://etcd.local").tls
    assert parse_registry_url("etcd://h:1", ca_certs="/ca.pem").tls  # a CA means TLS
    for bad in ("http://h:1", "etcd://", "etcd://h:1/x", "h:1"):
        with pytest.raises(ConfigError):
            parse_registry_url(bad)
    with pytest.raises(ConfigError):
        parse_registry_url("etcd://h:1", certfile="c.pem")


def test_record_round_trip_and_strictness():
    r = _record(load=3)
    assert InstanceRecord.decode(r.encode()) == r
    with pytest.raises(msgspec.ValidationError):
        InstanceRecord.decode(_record().encode().replace(b'"prefill"', b'"mystery"'))
    with pytest.raises(msgspec.ValidationError):
        InstanceRecord.decode(b'{"engine_id": "x"}')


def test_register_keepalive_update_deregister(etcd):
    reg = EtcdRegistry(parse_registry_url(etcd.url))
    load = {"n": 0}
    # A 4 s lease, kept alive every 1.3 s: a keep-alive late by 2.6 s (a 2 s lease left
    # 1.3 s, which loaded cores overran: the lease lapsed and it registered again).
    registrar = Registrar(reg, lambda: _record(load=load["n"]), ttl=4).start()
    assert registrar.wait_registered(5)
    key = instance_key(_record())
    assert key == INSTANCES_PREFIX + "prefill/e1"
    kvs, _ = reg.get_prefix(INSTANCES_PREFIX)
    assert InstanceRecord.decode(kvs[key]) == _record(load=0)
    # kept alive past its TTL and a half
    t_end = time.monotonic() + 6
    while time.monotonic() < t_end:
        assert key in reg.get_prefix(INSTANCES_PREFIX)[0]
        time.sleep(0.2)
    # a changed load is rewritten under the same lease, with no new registration
    load["n"] = 7
    _wait(
        lambda: InstanceRecord.decode(reg.get_prefix(INSTANCES_PREFIX)[0][key]).load == 7,
        10,
        "load rewritten",
    )
    assert registrar.registrations == 1
    assert registrar.deregister()
    assert key not in reg.get_prefix(INSTANCES_PREFIX)[0]


def test_deregister_revokes_at_once(etcd):
    reg = EtcdRegistry(parse_registry_url(etcd.url))
    registrar = Registrar(reg, _record, ttl=60).start()
    assert registrar.wait_registered(5)
    assert registrar.deregister()
    # read right after: gone, so revoked (the 60 s lease would still hold it)
    assert instance_key(_record()) not in reg.get_prefix(INSTANCES_PREFIX)[0]


def test_lease_lost_registers_again(etcd):
    """etcd forgot the lease (it was revoked, or etcd came back empty): register anew."""
    reg = EtcdRegistry(parse_registry_url(etcd.url))
    registrar = Registrar(reg, _record, ttl=4).start()  # no lapse on loaded cores
    try:
        assert registrar.wait_registered(5)
        lease = registrar.lease
        reg.revoke(lease)  # from outside: the record goes with it
        # the count moves after the write, so wait on it (not on the key) before reading it
        _wait(lambda: registrar.registrations == 2, 10, "registered again")
        assert instance_key(_record()) in reg.get_prefix(INSTANCES_PREFIX)[0]
        assert registrar.lease.id != lease.id
    finally:
        registrar.deregister()


def test_a_foreign_write_at_a_live_registrars_key_is_undone_and_logged(etcd, caplog):
    """Another record put at a live instance's key (another URL), a delete, or its own
    bytes put again without its lease: each is written back by the next keep-alive (every
    TTL/3), logged once with the foreign value summarised, and the proxy's view follows.
    The registrar rewrote only when its own record changed: the foreign one stayed."""
    reg = EtcdRegistry(parse_registry_url(etcd.url))
    own = EtcdRegistry(parse_registry_url(etcd.url))  # the registrar's: its calls counted
    registrar = Registrar(own, _record, ttl=3).start()
    router = Router()
    m = Membership(EtcdRegistry(parse_registry_url(etcd.url)), router, grace=0.5,
                   probe_timeout=1).start()
    key, ours = instance_key(_record()), _record().encode()
    url = _record().api_url
    foreign = _record(epoch="evil", api_url="http://127.0.0.1:2")

    def warnings() -> list[str]:
        return [r.getMessage() for r in caplog.records
                if r.name == "kvbridge.registry.registrar" and "someone else" in r.getMessage()]

    def restored() -> bool:
        entry = reg.get(key)
        return entry is not None and entry.value == ours

    try:
        with caplog.at_level(logging.INFO, logger="kvbridge.registry.registrar"):
            assert registrar.wait_registered(5)
            _wait(lambda: router.get(url), 10, "the proxy's view")
            reg.put(key, foreign.encode())  # no lease: it would outlive the instance
            _wait(restored, 10, "written back")
            _wait(lambda: router.get(url) and router.get(url).epoch == "ep1"
                  and router.get(foreign.api_url) is None, 10, "the proxy's view back")
            (line,) = warnings()
            assert key in line and "overwritten" in line and "'evil'" in line
            assert foreign.api_url in line
            # logged once: more keep-alives go by with nothing new
            writes = own.writes
            _wait(lambda: own.writes >= writes + 2, 10, "two more keep-alives")
            assert len(warnings()) == 1 and registrar.foreign_writes == 1
            reg.delete(key)
            _wait(lambda: registrar.foreign_writes == 2 and restored(), 10, "a delete undone")
            assert "deleted" in warnings()[1]
            replay = reg.put(key, ours)  # the same bytes, detached from the lease
            _wait(lambda: registrar.foreign_writes == 3 and reg.get(key).revision > replay,
                  10, "a replay written over")
            assert "a record of engine 'e1'" in warnings()[2]
            assert registrar.registrations == 1  # kept, not registered anew
        # under its lease again: revoking it takes the record with it
        assert registrar.deregister()
        assert key not in reg.get_prefix(INSTANCES_PREFIX)[0]
    finally:
        registrar.deregister()
        m.close()


def test_etcd_down_then_back(etcd):
    """etcd killed: the registrar keeps trying without raising; etcd back (same data
    dir): the record is there again."""
    reg = EtcdRegistry(parse_registry_url(etcd.url), timeout=0.5)
    registrar = Registrar(reg, _record, ttl=2).start()
    try:
        assert registrar.wait_registered(5)
        etcd.proc.kill()
        etcd.proc.wait()
        with pytest.raises(RegistryError):
            reg.get_prefix(INSTANCES_PREFIX)
        assert registrar.running
        etcd.start()
        reader = EtcdRegistry(parse_registry_url(etcd.url))  # not the registrar's 0.5 s client
        _wait(
            lambda: instance_key(_record()) in reader.get_prefix(INSTANCES_PREFIX)[0],
            20,
            "registered after etcd returned",
        )
    finally:
        registrar.deregister()


def test_watch_sees_puts_and_deletes(etcd):
    reg = EtcdRegistry(parse_registry_url(etcd.url))
    _, rev = reg.get_prefix(INSTANCES_PREFIX)
    seen: list = []

    def watch() -> None:
        try:
            for ev in reg.watch_prefix(INSTANCES_PREFIX, rev + 1):
                seen.append((ev.kind, ev.key))
        except RegistryError as e:
            seen.append(("end", str(e)))

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    lease = reg.grant(5)
    reg.put(INSTANCES_PREFIX + "decode/x", b"{}", lease)
    reg.put("/elsewhere/y", b"{}")
    reg.revoke(lease)
    _wait(lambda: len(seen) >= 2, 10, "two events")
    assert seen[:2] == [
        ("put", INSTANCES_PREFIX + "decode/x"),
        ("delete", INSTANCES_PREFIX + "decode/x"),
    ]
    reg.close()  # ends the watch: the iterator raises, the thread ends
    t.join(5)
    assert not t.is_alive() and seen[-1][0] == "end"


# --- kvbridge serve --registry: real engine processes ---------------------------------


def _serve(tmp_path, etcd, name: str, ttl: int) -> tuple[KVBridgeProcess, str]:
    port = free_port()
    proc = KVBridgeProcess(
        name,
        tmp_path,
        "serve",
        "--role",
        "prefill",
        "--port",
        str(port),
        "--side-channel-port",
        "0",
        "--registry",
        etcd.url,
        "--registry-ttl",
        str(ttl),
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        log_level="info",
    )
    url = f"http://127.0.0.1:{port}"
    proc.wait_healthy(url + "/health", time.monotonic() + 120)
    return proc, url


def _registered(reg: EtcdRegistry) -> dict[str, InstanceRecord]:
    return {k: InstanceRecord.decode(v) for k, v in reg.get_prefix(INSTANCES_PREFIX)[0].items()}


def test_serve_registers_and_crash_expires(etcd, tmp_path):
    reg = EtcdRegistry(parse_registry_url(etcd.url))
    proc, url = _serve(tmp_path, etcd, "p-crash", ttl=2)
    try:
        recs = _wait(lambda: _registered(reg), 10, "registered")
        (rec,) = recs.values()
        info = httpx.get(url + "/v1/kv/info").json()
        assert (rec.engine_id, rec.epoch, rec.role, rec.api_url, rec.tp_size) == (
            info["engine_id"],
            info["epoch"],
            "prefill",
            url,
            1,
        )
        assert (rec.side_channel_port, rec.handshake_method) == (
            info["side_channel_port"],
            info["handshake_method"],
        )
        assert len(rec.compat_hash) == 64
        t_kill = time.monotonic()
        proc.proc.send_signal(signal.SIGKILL)
        proc.proc.wait()
        # etcd checks expiry every 0.5 s and may be slow on a busy machine: a generous bound
        _wait(lambda: not _registered(reg), 2 + 15, "gone after the TTL")
        assert time.monotonic() - t_kill > 0.5  # gone by expiry (nobody revoked it)
    finally:
        proc.stop()


def test_serve_graceful_stop_deregisters_at_once(etcd, tmp_path):
    reg = EtcdRegistry(parse_registry_url(etcd.url))
    proc, _ = _serve(tmp_path, etcd, "p-term", ttl=30)
    try:
        _wait(lambda: _registered(reg), 10, "registered")
        proc.proc.send_signal(signal.SIGTERM)
        # Gone within 10 s of a 30 s TTL: the lease was revoked, not left to expire.
        _wait(lambda: not _registered(reg), 10, "deregistered")
        assert proc.proc.wait(30) == 0
    finally:
        proc.stop()


def test_serve_bad_registry_is_a_config_error(tmp_path):
    proc = KVBridgeProcess(
        "p-bad",
        tmp_path,
        "serve",
        "--registry",
        "http://x:1",
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.proc.wait(60) == 2
    assert "etcd://HOST:PORT" in proc.log.read_text()


def test_registry_over_tls_with_client_certificates(certs, tmp_path):
    """etcds:// with the CA and a client certificate works; without the certificate etcd
    refuses, and a plaintext client gets nowhere."""
    from kvbridge.tools.testing.etcd_server import EtcdProcess, EtcdTLS

    tls = EtcdTLS(
        str(certs / "ca.pem"),
        str(certs / "prefill.pem"),
        str(certs / "prefill.key"),
        str(certs / "decode.pem"),
        str(certs / "decode.key"),
    )
    with EtcdProcess(log_dir=tmp_path, tls=tls) as etcd:
        assert etcd.url.startswith("etcds://")
        ep = parse_registry_url(
            etcd.url, ca_certs=tls.ca, certfile=tls.client_certfile, keyfile=tls.client_keyfile
        )
        registrar = Registrar(EtcdRegistry(ep), _record, ttl=2).start()
        try:
            assert registrar.wait_registered(5)
            assert instance_key(_record()) in EtcdRegistry(ep).get_prefix(INSTANCES_PREFIX)[0]
        finally:
            registrar.deregister()
        no_cert = parse_registry_url(etcd.url, ca_certs=tls.ca)
        with pytest.raises(RegistryError):
            EtcdRegistry(no_cert).get_prefix(INSTANCES_PREFIX)
        plain = parse_registry_url(etcd.url.replace("etcds://", "etcd://"))
        with pytest.raises(RegistryError):
            EtcdRegistry(plain, timeout=1).get_prefix(INSTANCES_PREFIX)


def test_cli_refuses_bad_fleet_flags(capsys):
    from kvbridge.cli import main

    assert main(["proxy", "--port", "0"]) == 2
    assert "--registry" in capsys.readouterr().err
    assert main(["proxy", "--registry", "etcd://127.0.0.1:1/x", "--port", "0"]) == 2
    assert "etcd://HOST:PORT" in capsys.readouterr().err
    assert (
        main(["serve", "--registry", "etcd://127.0.0.1:1", "--registry-ttl", "0", "--port", "0"])
        == 2
    )
    assert "--registry-ttl" in capsys.readouterr().err
    assert main(["serve", "--handshake", "etcd", "--port", "0"]) == 2
    assert "registry" in capsys.readouterr().err


def test_unhealthy_instance_is_withdrawn_until_it_recovers(etcd):
    reg = EtcdRegistry(parse_registry_url(etcd.url))
    state: dict[str, str | None] = {"why": None}
    # a 60 s lease: gone within the wait below means revoked, not expired
    registrar = Registrar(reg, _record, ttl=60, health=lambda: state["why"]).start()
    key = instance_key(_record())
    try:
        assert registrar.wait_registered(5)
        state["why"] = "engine is not running"
        _wait(lambda: key not in reg.get_prefix(INSTANCES_PREFIX)[0], 20, "withdrawn")
        state["why"] = None
        # the count moves after the write, so wait on it (not on the key) before reading it
        _wait(lambda: registrar.registrations == 2, 20, "registered again")
        assert key in reg.get_prefix(INSTANCES_PREFIX)[0]
    finally:
        registrar.deregister()


def test_watch_from_a_compacted_revision_says_so(etcd):
    """A watch resumed from a revision etcd has compacted away ends with WatchCompacted
    (the caller lists again), not with a silent gap."""
    reg = EtcdRegistry(parse_registry_url(etcd.url))
    try:
        _, start = reg.get_prefix(INSTANCES_PREFIX)
        for i in range(3):
            reg.put(INSTANCES_PREFIX + f"decode/c{i}", b"{}")
        _, now = reg.get_prefix(INSTANCES_PREFIX)
        r = httpx.post(f"http://127.0.0.1:{etcd.port}/v3/kv/compaction",
                       json={"revision": now, "physical": True}, timeout=10, trust_env=False)
        assert r.status_code == 200, r.text
        with pytest.raises(WatchCompacted, match=f"compacted at {now}"):
            for _ in reg.watch_prefix(INSTANCES_PREFIX, start + 1):
                pass
        # from the current revision on, the watch runs and sees a new put
        seen: list = []

        def watch() -> None:
            with contextlib.suppress(RegistryError):
                for ev in reg.watch_prefix(INSTANCES_PREFIX, now + 1):
                    seen.append((ev.kind, ev.key))

        t = threading.Thread(target=watch, daemon=True)
        t.start()
        reg.put(INSTANCES_PREFIX + "decode/after", b"{}")
        _wait(lambda: seen, 10, "the put after the compaction")
        assert seen == [("put", INSTANCES_PREFIX + "decode/after")]
    finally:
        reg.close()
    t.join(5)
    assert not t.is_alive()
