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
import msgspec
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from kvbridge import supervised
from kvbridge.config import SideChannelConfig, TLSConfig
from kvbridge.errors import AuthError, ConfigError, HandshakeError, RegistryError
from kvbridge.handshake import make_client, make_server
from kvbridge.handshake.etcd import HANDSHAKE_PREFIX
from kvbridge.handshake.http.client import HttpHandshakeClient
from kvbridge.proxy import build_proxy_app
from kvbridge.proxy.membership import MAX_RECORD_BYTES, Membership
from kvbridge.proxy.routing import Router
from kvbridge.registry import EtcdRegistry, InstanceRecord, instance_key, parse_registry_url
from kvbridge.registry.record import INSTANCES_PREFIX
from kvbridge.tools.testing.api_server import BackgroundServer
from kvbridge.tools.testing.certs import issue, issue_with_names, new_ca
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
    return supervised.ignored_counts().get(("registry", reason), 0)


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
    assert m.connected.is_set() and supervised.down() == {}
    # and in the metrics
    r = CollectorRegistry()
    r.register(supervised.BackgroundCollector())
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


def test_a_stray_record_created_after_the_real_one_never_wins(etcd, membership):
    """A URL is owned by the record whose key etcd created first, not by key order: a stray
    at a key listed first (``both/0000stray``), written after a live prefill's record and
    naming its URL, was that URL's view from the next proxy start on."""
    reg, router, m = membership
    p = _rec("p0", "prefill", "http://127.0.0.1:31")
    stray = _rec("0000stray", "both", p.api_url, compat_hash="other")
    assert instance_key(stray) < instance_key(p)  # etcd lists it first
    reg.put(instance_key(p), p.encode())
    reg.put(instance_key(stray), stray.encode())
    url_taken = _ignored("url_taken")
    m.start()  # at start: one list, then the watch
    _wait(lambda: _ignored("url_taken") > url_taken, 10, "one of the two ignored")
    assert router.get(p.api_url).engine_id == "p0" and router.urls("decode") == []
    # when watched: the stray written again, and another one, still lose to the older key
    late = _rec("0000late", "both", p.api_url, compat_hash="other")
    url_taken = _ignored("url_taken")
    reg.put(instance_key(stray), stray.encode())
    reg.put(instance_key(late), late.encode())
    _wait(lambda: _ignored("url_taken") >= url_taken + 2, 10, "both strays seen")
    assert router.get(p.api_url).engine_id == "p0" and router.urls("decode") == []
    # the real record rewritten in place (its load) keeps its key's age, so its view
    reg.put(instance_key(p), msgspec.structs.replace(p, load=5).encode())
    _wait(lambda: router.get(p.api_url).info["load"] == 5, 10, "the rewrite seen")
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
    with caplog.at_level(logging.ERROR, logger="kvbridge.supervised"):
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

    with caplog.at_level(logging.DEBUG, logger="kvbridge.supervised"):
        t = supervised.Supervised("kvbridge-test-loop", loop, stop).start()
        try:
            wait_until(lambda: "kvbridge-test-loop" in supervised.down(), 10, "down")
            assert supervised.down()["kvbridge-test-loop"] == "ValueError: broken"
            r = CollectorRegistry()
            r.register(supervised.BackgroundCollector())
            assert 'kvbridge_background_thread_up{thread="kvbridge-test-loop"} 0.0' in \
                generate_latest(r).decode()
            wait_until(lambda: len(runs) >= 3, 10, "restarted with backoff")
            healthy.set()
            wait_until(lambda: "kvbridge-test-loop" not in supervised.down(), 10, "up again")
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
        assert supervised.down() == {}
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
                                                 "token_file": str(own),
                                                 "trusted_side_channels": HOST},
                                                environ={}), compat())
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


# -- the trust layer under hostile input: certificates, globs, token files, the audit log ---

@pytest.fixture(scope="module")
def odd_certs(tmp_path_factory) -> dict[str, object]:
    """A CA, a server certificate, and client certificates with unusual names."""
    import ipaddress

    from cryptography import x509
    from cryptography.x509.oid import NameOID

    d = tmp_path_factory.mktemp("odd-certs")
    ca = new_ca(d)
    dirname = x509.DirectoryName(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME,
                                                                "decode-a.kv.internal")]))
    out: dict[str, object] = {"ca": str(d / "ca.pem"), "ca_obj": ca, "dir": d,
                              "server": (str(issue(ca, d, "server", "127.0.0.1")),
                                         str(d / "server.key"))}
    out["dirname-only"] = issue_with_names(ca, d, "dirname-only", [dirname])
    out["dirname-then-dns"] = issue_with_names(
        ca, d, "dirname-then-dns", [dirname, x509.RFC822Name("ops@kv.internal"),
                                    x509.DNSName("decode-b.kv.internal")])
    out["ip"] = issue_with_names(ca, d, "ip", [dirname,
                                              x509.IPAddress(ipaddress.ip_address("10.0.0.7"))])
    for name in ("decode-a", "decode-x.attacker.example", "a.b.kv.internal", "b.kv.internal"):
        out[name] = (str(issue(ca, d, name, name)), str(d / f"{name}.key"))
    return out


def _mtls_server(certs: dict[str, object], allowed: str, **extra: str):
    cert, key = certs["server"]  # type: ignore[misc]
    cfg = SideChannelConfig.load({
        "handshake_method": "http", "side_channel_port": 0, "ssl_certfile": cert,
        "ssl_keyfile": key, "ssl_ca_certs": certs["ca"], "ssl_cert_reqs": "required",
        "ssl_allowed_peers": allowed, **extra}, environ={})
    server = make_server(cfg, full_store(1))
    server.start()
    return server


def _get(certs: dict[str, object], name: str, port: int, token: str | None = None
         ) -> httpx.Response:
    import ssl

    ctx = ssl.create_default_context(cafile=certs["ca"])  # type: ignore[arg-type]
    ctx.load_cert_chain(*certs[name])  # type: ignore[misc]
    headers = {"authorization": f"Bearer {token}"} if token else {}
    with httpx.Client(verify=ctx, timeout=10) as c:
        return c.get(f"https://{HOST}:{port}/v1/kv/handshake/0", headers=headers)


def test_a_certificate_whose_only_san_is_a_dirname_is_refused_not_a_500(odd_certs):
    server = _mtls_server(odd_certs, "decode-*.kv.internal,10.0.0.*")
    try:
        r = _get(odd_certs, "dirname-only", server.port)
        assert r.status_code == 403, r.text  # the DirName names no host: not on the list
        assert "names no host" in r.json()["error"]["message"]
        # a DirName (and an email) before the DNS name that is on the list: skipped
        assert _get(odd_certs, "dirname-then-dns", server.port).status_code == 200
        assert _get(odd_certs, "ip", server.port).status_code == 200  # an IP SAN matches
    finally:
        server.stop()


def test_an_allow_list_star_stays_within_one_dns_label(odd_certs):
    server = _mtls_server(odd_certs, "decode-*,*.kv.internal")
    try:
        status = {name: _get(odd_certs, name, server.port).status_code for name in (
            "decode-a", "decode-x.attacker.example", "b.kv.internal", "a.b.kv.internal")}
    finally:
        server.stop()
    assert status == {"decode-a": 200, "decode-x.attacker.example": 403,
                      "b.kv.internal": 200, "a.b.kv.internal": 403}


def _tokens_server(path, **extra: str):
    server = make_server(SideChannelConfig.load({
        "handshake_method": "http", "side_channel_port": 0, "tokens_file": str(path),
        **extra}, environ={}), full_store(1))
    server.start()
    return server


def _status(port: int, token: str) -> int:
    return httpx.get(f"http://{HOST}:{port}/v1/kv/handshake/0", timeout=10,
                     headers={"authorization": f"Bearer {token}"}).status_code


def _untrusted(path, how: str) -> None:
    """Revoke ``b`` with a file that cannot be trusted, ``how``."""
    if how == "mode 644":
        _write_tokens(path, "a:tok-a\n")
        path.chmod(0o644)
    elif how == "chmod 644 only":
        path.chmod(0o644)  # same content, b still in it: the mode alone is a change
    elif how == "malformed line":
        _write_tokens(path, "a:tok-a\nthis line is no token\n")
    elif how == "duplicate name":
        _write_tokens(path, "a:tok-a\na:tok-a2\n")
    elif how == "unknown scope":
        _write_tokens(path, "a[everything]:tok-a\n")
    elif how == "deleted":
        path.unlink()
    elif how == "unreadable":
        path.unlink()
        path.mkdir()  # reading it fails (as root, a mode 000 file would still be read)
    elif how == "not utf-8":
        _write_tokens(path, "a:tok-a\n")
        path.write_bytes(b"a:tok-\xff\n")


@pytest.mark.parametrize("how", ["mode 644", "chmod 644 only", "malformed line",
                                 "duplicate name", "unknown scope", "deleted", "unreadable",
                                 "not utf-8"])
def test_a_tokens_file_that_cannot_be_trusted_fails_closed(tmp_path, how, caplog):
    path = tmp_path / "tokens"
    _write_tokens(path, "a:tok-a\nb:tok-b\n")
    server = _tokens_server(path)
    try:
        assert _status(server.port, "tok-a") == _status(server.port, "tok-b") == 200
        with caplog.at_level(logging.INFO, logger="kvbridge.handshake.authz"):
            _untrusted(path, how)
            # b's line is gone (or the file may no longer say so): nobody gets in
            assert [_status(server.port, t) for t in ("tok-b", "tok-a", "tok-b")] == [401] * 3
            errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
            assert len(errors) == 1, [r.getMessage() for r in errors]  # once per change
            assert "refusing every token" in errors[0].getMessage()
            if path.is_dir():
                path.rmdir()
            _write_tokens(path, "a:tok-a\n")  # fixed: a is back, b stays revoked
            assert (_status(server.port, "tok-a"), _status(server.port, "tok-b")) == (200, 401)
    finally:
        server.stop()


def test_token_scopes_limit_what_a_named_token_may_do(tmp_path):
    path = tmp_path / "tokens"
    _write_tokens(path, "# the proxy releases and prewarms; it reads no metadata\n"
                        "proxy[release,prewarm]:tok-p\ndecode-a[metadata]:tok-a\nold:tok-o\n")
    server = _tokens_server(path)
    try:
        r = httpx.get(f"http://{HOST}:{server.port}/v1/kv/handshake/0", timeout=10,
                      headers={"authorization": "Bearer tok-p"})
        assert r.status_code == 403 and "'metadata' scope" in r.json()["error"]["message"]
        assert _status(server.port, "tok-a") == _status(server.port, "tok-o") == 200
    finally:
        server.stop()


@pytest.mark.parametrize("text", ["a[bogus]:x\n", "a[]:x\n", "a[release,release]:x\n",
                                  "a[release:x\n", "a[Release]:x\n"])
def test_token_scopes_are_checked_at_start(tmp_path, text):
    path = tmp_path / "tokens"
    _write_tokens(path, "a[release]:x\nb[metadata,prewarm]:y\nc:z\n")
    SideChannelConfig.load({"tokens_file": str(path)}, environ={})  # the syntax: accepted
    _write_tokens(path, text)
    with pytest.raises(ConfigError, match="tokens"):
        SideChannelConfig.load({"tokens_file": str(path)}, environ={})


def test_refused_callers_cannot_grow_the_audit_log_without_bound(tmp_path):
    from kvbridge.handshake.audit import AUDIT_BURST

    tokens, audit = tmp_path / "tokens", tmp_path / "audit.jsonl"
    _write_tokens(tokens, "a:tok-a\n")
    server = _tokens_server(tokens, audit_log=str(audit))
    flood = 1000
    try:
        with httpx.Client(base_url=f"http://{HOST}:{server.port}", timeout=10) as c:
            for _ in range(flood):
                assert c.get("/v1/kv/handshake/0").status_code == 401
            assert c.get("/v1/kv/handshake/0",
                         headers={"authorization": "Bearer tok-a"}).status_code == 200
    finally:
        server.stop()  # writes what is still counted
    lines = [json.loads(line) for line in audit.read_text().splitlines()]
    refused = [r for r in lines if r["result"] == "refused 401"]
    counted = [r for r in lines if r["result"] == "suppressed"]
    assert [r["token"] for r in lines if r["result"] == "ok"] == ["a"]  # never dropped
    assert AUDIT_BURST <= len(refused) < flood / 2, len(refused)
    assert counted and all(r["outcome"] == "refused 401" for r in counted)
    assert len(refused) + sum(r["count"] for r in counted) == flood  # every refusal told
    print(f"audit log: {len(lines)} lines ({audit.stat().st_size} bytes) for {flood} refusals")
