"""Trust boundaries against real components: registry bytes from etcd are checked before
they are trusted, a stray record cannot take over an instance's view, and background
threads that fail are restarted and reported, never silently gone."""

from __future__ import annotations

import base64
import json
import logging
import os
import threading
from collections.abc import Iterator

import httpx
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from kvbridge import background
from kvbridge.config import SideChannelConfig, TLSConfig
from kvbridge.errors import AuthError, ConfigError, HandshakeError, RegistryError
from kvbridge.handshake import make_client, make_server
from kvbridge.handshake.etcd import HANDSHAKE_PREFIX
from kvbridge.handshake.http_client import HttpHandshakeClient
from kvbridge.registry import EtcdRegistry, InstanceRecord, instance_key, parse_registry_url
from kvbridge.registry.record import INSTANCES_PREFIX
from kvbridge.server.membership import MAX_RECORD_BYTES, Membership
from kvbridge.server.proxy import build_proxy_app
from kvbridge.server.routing import Router
from kvbridge.testing.api_server import BackgroundServer
from kvbridge.testing.certs import issue, new_ca
from tests.helpers import compat, full_store, wait_until

HOST = "127.0.0.1"


def _wait(cond, timeout: float, what: str) -> object:
    return wait_until(cond, timeout, what, tolerate=(RegistryError,))


def _put_raw(etcd, key: bytes, value: bytes) -> None:
    """A put through etcd's gateway with raw bytes: what any etcd client may write."""
    ep = parse_registry_url(etcd.url)
    r = httpx.post(f"http://{ep.host}:{ep.port}/v3/kv/put", timeout=10, json={
        "key": base64.b64encode(key).decode(), "value": base64.b64encode(value).decode()})
    assert r.status_code == 200, r.text


def _rec(engine_id: str, role: str, url: str, compat_hash: str = "h") -> InstanceRecord:
    return InstanceRecord(engine_id=engine_id, epoch="e", role=role, api_url=url, tp_size=1,
                          compat_hash=compat_hash)


def _ignored(reason: str) -> int:
    return background.ignored_counts().get(("registry", reason), 0)


@pytest.fixture
def membership(etcd) -> Iterator[tuple[EtcdRegistry, Router, Membership]]:
    reg = EtcdRegistry(parse_registry_url(etcd.url))
    router = Router()
    m = Membership(EtcdRegistry(parse_registry_url(etcd.url), timeout=1.0), router,
                   grace=0.5, probe_timeout=1)
    try:
        yield reg, router, m
    finally:
        m.close()


def test_bad_keys_and_records_under_the_instances_prefix_are_ignored(etcd, membership):
    reg, router, m = membership
    # already there when the proxy starts: listed, not fatal
    _put_raw(etcd, INSTANCES_PREFIX.encode() + b"decode/\xff\xfe", b"{}")
    p = _rec("p0", "prefill", "http://127.0.0.1:1")
    reg.put(instance_key(p), p.encode())
    bad_keys = _ignored("key_not_utf8")
    m.start()
    _wait(lambda: router.urls("prefill") == [p.api_url], 10, "listed past the bad key")
    assert m.connected.is_set()
    # arriving on the watch: ignored, and the watch goes on
    _put_raw(etcd, INSTANCES_PREFIX.encode() + b"prefill/\xc3\x28", b"{}")
    oversized = _ignored("oversized")
    big = _rec("big", "decode", "http://127.0.0.1:3")
    huge = big.encode()[:-1] + b',"pad":"' + b"x" * (MAX_RECORD_BYTES + 1) + b'"}'
    reg.put(instance_key(big), huge)
    d = _rec("d0", "decode", "http://127.0.0.1:2")
    reg.put(instance_key(d), d.encode())
    _wait(lambda: router.urls("decode") == [d.api_url], 10, "a record after the bad key")
    assert _ignored("key_not_utf8") >= bad_keys + 2
    assert _ignored("oversized") == oversized + 1
    assert m.connected.is_set() and background.down() == {}
    # and in the metrics
    r = CollectorRegistry()
    r.register(background.BackgroundCollector())
    text = generate_latest(r).decode()
    assert 'kvbridge_ignored_inputs_total{reason="key_not_utf8",source="registry"}' in text


def test_a_stray_record_naming_an_instance_url_does_not_take_it_over(etcd, membership):
    reg, router, m = membership
    p, d = _rec("p0", "prefill", "http://127.0.0.1:11"), _rec("d0", "decode", "http://127.0.0.1:12")
    for rec in (p, d):
        reg.put(instance_key(rec), rec.encode())
    m.start()
    _wait(lambda: router.pick_pair() is not None, 10, "a pair")
    # another engine id and compatibility hash, the decode's URL
    stray = _rec("stray", "decode", d.api_url, compat_hash="other")
    url_taken = _ignored("url_taken")
    reg.put(instance_key(stray), stray.encode())
    _wait(lambda: _ignored("url_taken") > url_taken, 10, "the stray record seen")
    assert router.get(d.api_url).engine_id == "d0" and router.pick_pair() is not None
    reg.delete(instance_key(stray))
    marker = _rec("p1", "prefill", "http://127.0.0.1:13")
    reg.put(instance_key(marker), marker.encode())  # the watch has passed the delete
    _wait(lambda: router.get(marker.api_url) is not None, 10, "the watch to move on")
    assert router.get(d.api_url).engine_id == "d0" and router.pick_pair() is not None
    # the first record goes while another names the URL: the view comes from that one
    reg.put(instance_key(stray), stray.encode())
    reg.delete(instance_key(d))
    _wait(lambda: router.get(d.api_url).engine_id == "stray", 10, "the remaining record")
    # a record stored under another instance's key is not that instance
    mismatch = _ignored("key_mismatch")
    reg.put(instance_key(p), _rec("p9", "prefill", p.api_url, "other").encode())
    _wait(lambda: _ignored("key_mismatch") > mismatch, 10, "the mismatched record seen")
    assert router.get(p.api_url).engine_id == "p0"


def test_the_membership_thread_survives_an_unexpected_error(etcd, membership, caplog):
    reg, router, m = membership
    calls = []

    def on_added(backend) -> None:  # a bug in a callback, the first time only
        calls.append(backend.url)
        if len(calls) == 1:
            raise RuntimeError("callback bug")

    router.on_added = on_added
    m.start()
    with caplog.at_level(logging.ERROR, logger="kvbridge.background"):
        a = _rec("d0", "decode", "http://127.0.0.1:21")
        reg.put(instance_key(a), a.encode())
        _wait(lambda: calls, 10, "the failing callback")
        _wait(lambda: m.connected.is_set(), 10, "listed again after the restart")
        b = _rec("d1", "decode", "http://127.0.0.1:22")
        reg.put(instance_key(b), b.encode())
        _wait(lambda: router.get(b.api_url) is not None, 10, "a record after the restart")
    failures = [r for r in caplog.records if "kvbridge-membership" in r.getMessage()]
    assert len(failures) == 1 and "callback bug" in failures[0].getMessage()
    assert failures[0].exc_info is not None  # with its cause


def test_a_failing_thread_is_down_while_it_waits_and_logged_once(caplog):
    stop, healthy = threading.Event(), threading.Event()
    runs = []

    def loop() -> None:
        runs.append(1)
        if not healthy.is_set():
            raise ValueError("broken")
        stop.wait()

    with caplog.at_level(logging.DEBUG, logger="kvbridge.background"):
        t = background.Supervised("kvbridge-test-loop", loop, stop).start()
        try:
            wait_until(lambda: "kvbridge-test-loop" in background.down(), 10, "down")
            assert background.down()["kvbridge-test-loop"] == "ValueError: broken"
            r = CollectorRegistry()
            r.register(background.BackgroundCollector())
            assert 'kvbridge_background_thread_up{thread="kvbridge-test-loop"} 0.0' in \
                generate_latest(r).decode()
            wait_until(lambda: len(runs) >= 3, 10, "restarted with backoff")
            healthy.set()
            wait_until(lambda: "kvbridge-test-loop" not in background.down(), 10, "up again")
            assert t.is_alive() and t.restarts >= 2
        finally:
            stop.set()
            t.join(5)
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "broken" in errors[0].getMessage()  # once, not per restart
    assert not t.is_alive()


def _config(etcd) -> SideChannelConfig:
    return SideChannelConfig.load({"handshake_method": "etcd", "registry": etcd.url,
                                   "side_channel_port": 0, "handshake_timeout": 2}, environ={})


def _fetched_from_the_watch(client, port: int) -> bool:
    """One fetch answered from what the watch delivered (no etcd read of its own)."""
    reads = client.reads
    client.fetch(HOST, port, 0)
    return client.reads == reads


def test_a_bad_key_under_the_handshake_prefix_does_not_stop_the_watch(etcd):
    cfg = _config(etcd)
    _put_raw(etcd, HANDSHAKE_PREFIX.encode() + b"\xff:1/0", b"x")  # there before the decode
    client = make_client(cfg, compat())
    servers = []
    try:
        for bad in (HANDSHAKE_PREFIX.encode() + b"\xfe:2/0", None):
            server = make_server(cfg, full_store(1))
            server.start()
            servers.append(server)
            assert server.published.wait(10)
            _wait(lambda s=server: _fetched_from_the_watch(client, s.port), 10,
                  "the prefill's metadata delivered by the watch")
            if bad is not None:  # and one arriving on the watch
                _put_raw(etcd, bad, b"x")
        assert background.down() == {}
    finally:
        for server in servers:
            server.stop()
        client.close()


# -- who may fetch, and a record of who did ---------------------------------------------------

@pytest.fixture(scope="module")
def peer_certs(tmp_path_factory) -> dict[str, str]:
    """One CA; a server certificate for 127.0.0.1; client certificates for two names."""
    d = tmp_path_factory.mktemp("peer-certs")
    ca = new_ca(d)
    out = {"ca": str(d / "ca.pem")}
    for name, ids in (("server", ("127.0.0.1",)), ("decode-a", ("decode-a.kv.internal",)),
                      ("intruder", ("intruder.kv.internal",))):
        out[name] = str(issue(ca, d, name, *ids))
        out[name + ".key"] = str(d / f"{name}.key")
    return out


def _write_tokens(path, text: str) -> None:
    """As a secret store rotates a file: a new file moved into place."""
    tmp = path.with_suffix(".new")
    tmp.write_text(text)
    tmp.chmod(0o600)
    os.replace(tmp, path)


def _http_client(token: str | None, certs: dict[str, str], name: str) -> HttpHandshakeClient:
    return HttpHandshakeClient(5, compat(), token, tls=TLSConfig(
        certs[name], certs[name + ".key"], certs["ca"]))


def test_allow_list_rotation_and_audit(tmp_path, peer_certs):
    tokens, audit = tmp_path / "tokens", tmp_path / "audit.jsonl"
    _write_tokens(tokens, "# peer: token\ndecode-a:tok-a-1\ndecode-b:tok-b-1\n")
    cfg = SideChannelConfig.load({
        "handshake_method": "http", "side_channel_port": 0, "tokens_file": str(tokens),
        "ssl_certfile": peer_certs["server"], "ssl_keyfile": peer_certs["server.key"],
        "ssl_ca_certs": peer_certs["ca"], "ssl_cert_reqs": "required",
        "ssl_allowed_peers": "decode-*.kv.internal", "audit_log": str(audit)}, environ={})
    server = make_server(cfg, full_store(1))
    server.start()
    clients = []

    def client(token: str | None, name: str = "decode-a") -> HttpHandshakeClient:
        clients.append(_http_client(token, peer_certs, name))
        return clients[-1]

    try:
        assert len(client("tok-a-1").fetch(HOST, server.port, 0)) == 1
        # a valid certificate from the right CA, with a valid token, but not on the list
        with pytest.raises(HandshakeError, match="not allowed"):
            client("tok-a-1", "intruder").fetch(HOST, server.port, 0)
        # rotation without a restart: decode-a's new token works, its old one is refused,
        # decode-b's (untouched) still works
        _write_tokens(tokens, "decode-a:tok-a-2\ndecode-b:tok-b-1\n")
        assert len(client("tok-a-2").fetch(HOST, server.port, 0)) == 1
        with pytest.raises(AuthError):
            client("tok-a-1").fetch(HOST, server.port, 0)
        assert len(client("tok-b-1").fetch(HOST, server.port)) == 1
        # revoked: decode-b's line removed
        _write_tokens(tokens, "decode-a:tok-a-2\n")
        with pytest.raises(AuthError):
            client("tok-b-1").fetch(HOST, server.port, 0)
    finally:
        for c in clients:
            c.close()
        server.stop()
    lines = [json.loads(line) for line in audit.read_text().splitlines()]
    assert [(r["token"], r["cert"], r["route"], r["rank"], r["result"]) for r in lines] == [
        ("decode-a", "decode-a.kv.internal", "handshake_rank", 0, "ok"),
        (None, "intruder.kv.internal", "handshake_rank", None, "refused 403"),
        ("decode-a", "decode-a.kv.internal", "handshake_rank", 0, "ok"),
        (None, "decode-a.kv.internal", "handshake_rank", None, "refused 401"),
        ("decode-b", "decode-a.kv.internal", "handshake_all", None, "ok"),
        (None, "decode-a.kv.internal", "handshake_rank", None, "refused 401"),
    ]
    assert all(r["peer"].startswith("127.0.0.1:") and r["time"].endswith("Z") for r in lines)
    per_line = len(audit.read_bytes()) / len(lines)
    print(f"audit log: {per_line:.0f} bytes per line, {per_line * 1000 / 1024:.0f} KiB per "
          "1,000 handshakes")


@pytest.mark.parametrize("text", ["no-colon-here\n", "a:x\na:y\n", "bad name:x\n", "# only\n"])
def test_a_bad_tokens_file_is_refused_at_start(tmp_path, text):
    path = tmp_path / "tokens"
    _write_tokens(path, text)
    with pytest.raises(ConfigError, match="tokens"):
        SideChannelConfig.load({"tokens_file": str(path)}, environ={})


def test_an_allow_list_needs_client_certificates():
    with pytest.raises(ConfigError, match="ssl_cert_reqs"):
        SideChannelConfig.load({"ssl_allowed_peers": "decode-*"}, environ={})


def test_proxy_admin_routes_need_the_admin_token_or_are_off():
    admin = ("/v1/fleet", "/healthz/backends", "/v1/kv/prewarm", "/metrics")
    app = build_proxy_app(["http://127.0.0.1:1"], ["http://127.0.0.1:2"], prewarm=False,
                          admin_token="adm-1")
    with BackgroundServer(app) as proxy, httpx.Client(base_url=proxy.url, timeout=10) as c:
        for path in admin:
            assert c.get(path).status_code == 401, path
            assert c.get(path, headers={"authorization": "Bearer nope"}).status_code == 401
        assert c.get("/v1/fleet", headers={"authorization": "Bearer adm-1"}).status_code == 200
        assert c.get("/health").status_code == 200  # liveness stays open
    app = build_proxy_app(["http://127.0.0.1:1"], ["http://127.0.0.1:2"], prewarm=False,
                          admin_routes="off")
    with BackgroundServer(app) as proxy, httpx.Client(base_url=proxy.url, timeout=10) as c:
        for path in admin:
            assert c.get(path).status_code in (404, 405), path


def test_proxy_admin_routes_are_off_by_default_and_metrics_is_set_apart():
    admin = ("/v1/fleet", "/healthz/backends", "/v1/kv/prewarm")
    urls = (["http://127.0.0.1:1"], ["http://127.0.0.1:2"])
    with BackgroundServer(build_proxy_app(*urls, prewarm=False)) as proxy, \
            httpx.Client(base_url=proxy.url, timeout=10) as c:
        for path in (*admin, "/metrics"):
            assert c.get(path).status_code == 404, path  # nothing for operators by default
        assert c.get("/health").status_code == 200
    app = build_proxy_app(*urls, prewarm=False, admin_token="adm-1", metrics_route="open")
    with BackgroundServer(app) as proxy, httpx.Client(base_url=proxy.url, timeout=10) as c:
        assert "kvbridge_proxy_requests" in c.get("/metrics").text  # scraped without a token
        for path in admin:
            assert c.get(path).status_code == 401, path
    app = build_proxy_app(*urls, prewarm=False, admin_routes="open")
    with BackgroundServer(app) as proxy, httpx.Client(base_url=proxy.url, timeout=10) as c:
        for path in (*admin, "/metrics"):  # served (the backends are down: a 503 says so)
            assert c.get(path).status_code == (503 if "backends" in path else 200), path
    with pytest.raises(ConfigError, match="needs an admin token"):
        build_proxy_app(*urls, prewarm=False, admin_routes="token")
    with pytest.raises(ConfigError, match="metrics route 'public'"):
        build_proxy_app(*urls, prewarm=False, metrics_route="public")


def test_rotation_end_to_end_without_restarting_server_or_client(tmp_path):
    """The server accepts old and new during the switch; the client's token file is
    rewritten and its next fetch sends the new token; then the old one is removed."""
    accepted, own = tmp_path / "tokens", tmp_path / "token"
    _write_tokens(accepted, "decode-a:old-token\n")
    _write_tokens(own, "old-token\n")
    server = make_server(SideChannelConfig.load({
        "handshake_method": "http", "side_channel_port": 0, "tokens_file": str(accepted)},
        environ={}), full_store(1))
    server.start()
    client = make_client(SideChannelConfig.load({"handshake_method": "http",
                                                 "token_file": str(own)}, environ={}), compat())
    try:
        assert len(client.fetch(HOST, server.port, 0)) == 1
        _write_tokens(accepted, "decode-a:old-token\ndecode-a-next:new-token\n")
        _write_tokens(own, "new-token\n")
        _write_tokens(accepted, "decode-a-next:new-token\n")
        assert len(client.fetch(HOST, server.port, 0)) == 1  # same client, new token
        with pytest.raises(AuthError):
            HttpHandshakeClient(5, compat(), "old-token").fetch(HOST, server.port, 0)
    finally:
        client.close()
        server.stop()
