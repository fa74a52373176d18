"""One set of factories: every side-channel setting of the tree reaches the plug-in's server
or client as the plug-in builds them (real vLLM config classes, the scheduler connector's
own listener; no vLLM server), and means there what it means for ``kvbridge serve``.

Each setting gets a non-default value (``kv_connector_extra_config`` for the plug-in,
flags for serve; the connection budget from the environment, as both read it); the same
reader is applied to the plug-in's objects and to serve's, built as serve builds them
(``SideChannelConfig.load`` and ``kvbridge.handshake``'s factories), and both must show it.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from kvbridge.config import SideChannelConfig, TLSConfig
from kvbridge.guard import ConnectionBudget
from kvbridge.handshake import make_client, side_channel
from kvbridge.handshake.http.tls_sessions import tls_sessions
from kvbridge.handshake.payloads import PayloadStore
from kvbridge.net import free_port
from kvbridge.settings import SETTINGS
from kvbridge.tools.testing.certs import write_certs

pytest.importorskip("vllm")

from tests.vllm.objects import payload, scheduler_connector  # noqa: E402

# The settings the side channel's servers and clients run under: its own group, and the
# connection budget every server of the process shares.
GROUPS = ("side_channel", "budget")
WALKED = [s.name for s in SETTINGS if s.group in GROUPS]
REGISTRY = "etcd://127.0.0.1:23790"  # never reached: the etcd objects are not started
# In this process (``side_channel_isolation: thread``), where the server's objects can be
# read; the process case checks that both start the same server in a process of its own.
BASE = {"http": {"handshake_method": "http"}, "zmq": {"handshake_method": "zmq"},
        "etcd": {"handshake_method": "etcd", "registry": REGISTRY}}
BASE = {m: {**v, "side_channel_isolation": "thread"} for m, v in BASE.items()}


@dataclass
class Built:
    server: Any
    client: Any


def budget_of(server: Any) -> ConnectionBudget:
    listener = getattr(server, "_listener", None)  # the zmq servers' ZMTP listener
    return listener.budget if listener is not None else server._budget


def header(client: Any) -> str:
    """The Authorization header the client's next request carries."""
    request = client._request_bytes("127.0.0.1", 1, "/").decode("latin-1")
    return next(line.split(": ", 1)[1] for line in request.split("\r\n")
                if line.lower().startswith("authorization: "))


def rotate(path: str, token: str) -> None:
    """A new token in the file (another size, so the change is seen however fast)."""
    Path(path).write_text(token)
    os.chmod(path, 0o600)


def read_token_rotation(b: Built, files: dict[str, str]) -> tuple[str, int]:
    rotate(files["token_file"], "rotated-token-two")
    return header(b.client), b.server._authz.decide("Bearer rotated-token-two", None).status


@dataclass
class Case:
    """A setting's non-default value(s), the methods it is checked on, what to read."""

    extra: dict[str, Any]
    read: Callable[[Built, dict[str, str]], Any]
    expect: Any  # None: (method, method); a dict: per method
    methods: tuple[str, ...] = ("http",)
    env: dict[str, str] = field(default_factory=dict)


TLS = {"ssl_certfile": "{prefill.pem}", "ssl_keyfile": "{prefill.key}",
       "ssl_ca_certs": "{ca.pem}", "ssl_cert_reqs": "required"}
REGISTRY_TLS = {"registry": "etcds://127.0.0.1:23790", "registry_ca_certs": "{ca.pem}",
                "registry_certfile": "{decode.pem}", "registry_keyfile": "{decode.key}"}


def tls_read(name: str) -> Callable[[Built, dict[str, str]], Any]:
    """The server's TLS setting, and whether the client's TLS is the same setting's."""
    def read(b: Built, files: dict[str, str]) -> Any:
        tls: TLSConfig = b.server._tls
        return getattr(tls, name), b.client._tls is tls_sessions(tls)
    return read


def registry_read(name: str) -> Callable[[Built, dict[str, str]], Any]:
    def read(b: Built, files: dict[str, str]) -> Any:
        return (getattr(b.server._registry.endpoint, name),
                getattr(b.client._registry.endpoint, name))
    return read


def budget_case(name: str, env: str, raw: str, value: float) -> Case:
    return Case({}, lambda b, f: getattr(budget_of(b.server), name), value,
                methods=("http", "zmq"), env={env: raw})


CASES: dict[str, Case] = {
    "handshake_method": Case({}, lambda b, f: (b.server.method, b.client.method), None,
                             methods=("http", "zmq", "etcd")),
    "handshake_timeout": Case({"handshake_timeout": 7.5}, lambda b, f: b.client.timeout, 7.5,
                              methods=("http", "zmq", "etcd")),
    "side_channel_host": Case({"side_channel_host": "127.0.0.2"},
                              lambda b, f: b.server._sock.getsockname()[0], "127.0.0.2",
                              methods=("http", "zmq")),
    "side_channel_port": Case({"side_channel_port": "{port}"}, lambda b, f: b.server.port,
                              "{port}", methods=("http", "zmq", "etcd")),
    "advertise_host": Case({"advertise_host": "10.1.2.3"}, lambda b, f: b.server._host,
                           "10.1.2.3", methods=("etcd",)),
    "token": Case({"token": "token-one"},
                  lambda b, f: (header(b.client),
                                b.server._authz.decide("Bearer token-one", None).status,
                                b.server._authz.decide("Bearer other", None).status),
                  ("Bearer token-one", 200, 401)),
    "token_file": Case({"token_file": "{token_file}"}, read_token_rotation,
                       ("Bearer rotated-token-two", 200)),
    **{name: Case(TLS, tls_read(attr), (value, True)) for name, attr, value in [
        ("ssl_certfile", "certfile", "{prefill.pem}"),
        ("ssl_keyfile", "keyfile", "{prefill.key}"),
        ("ssl_ca_certs", "ca_certs", "{ca.pem}"),
        ("ssl_cert_reqs", "cert_reqs", 2)]},
    "max_message_bytes": Case({"max_message_bytes": 123456},
                              lambda b, f: b.client.max_message_bytes, 123456,
                              methods=("http", "zmq", "etcd")),
    "registry": Case({}, registry_read("url"), (REGISTRY, REGISTRY), methods=("etcd",)),
    **{name: Case(REGISTRY_TLS, registry_read(attr), (value, value), methods=("etcd",))
       for name, attr, value in [("registry_ca_certs", "ca_certs", "{ca.pem}"),
                                 ("registry_certfile", "certfile", "{decode.pem}"),
                                 ("registry_keyfile", "keyfile", "{decode.key}")]},
    "tokens_file": Case({"tokens_file": "{tokens_file}"},
                        lambda b, f: (b.server._authz.decide("Bearer tok-a", None).status,
                                      b.server._authz.decide("Bearer tok-b", None).status,
                                      b.server._authz.decide("Bearer tok-b", None,
                                                             "release").status),
                        (200, 403, 200)),
    "ssl_allowed_peers": Case({**TLS, "ssl_allowed_peers": "decode-*.kv.internal"},
                              lambda b, f: b.server._authz.allowed.patterns,
                              ["decode-*.kv.internal"]),
    "trusted_side_channels": Case({"trusted_side_channels": "prefill-*.kv.internal:5600"},
                                  lambda b, f: b.client.trusted.patterns,
                                  ["prefill-*.kv.internal:5600"]),
    "audit_log": Case({"audit_log": "{audit_log}"},
                      lambda b, f: b.server._authz.audit._file.name, "{audit_log}"),
    # the servers' keep-alive, and the period a (long-lived) client keeps peers warm at
    "side_channel_isolation": Case(
        {"side_channel_isolation": "process"},
        lambda b, f: (type(b.server).__name__, b.server.port > 0), ("SideChannelProcess", True),
        methods=("http", "zmq")),
    "side_channel_keep_alive_timeout": Case(
        {"side_channel_keep_alive_timeout": 42.0},
        lambda b, f: (budget_of(b.server).keep_alive_timeout,
                      b.client.keep_warm if b.client.method == "http" else "no keep-warm"),
        {"http": (42.0, 21.0), "zmq": (42.0, "no keep-warm")}, methods=("http", "zmq")),
    "max_connections": budget_case("max_connections", "KVBRIDGE_MAX_CONNECTIONS", "77", 77),
    "first_byte_timeout": budget_case("first_byte_timeout", "KVBRIDGE_FIRST_BYTE_TIMEOUT",
                                      "3.5", 3.5),
    "head_timeout": budget_case("head_timeout", "KVBRIDGE_HEAD_TIMEOUT", "4.5", 4.5),
    "body_timeout": budget_case("body_timeout", "KVBRIDGE_BODY_TIMEOUT", "5.5", 5.5),
    "max_head_bytes": budget_case("max_head_bytes", "KVBRIDGE_MAX_HEAD_BYTES", "20000", 20000),
    "max_headers": budget_case("max_headers", "KVBRIDGE_MAX_HEADERS", "50", 50),
    # the engine API's and the proxy's keep-alive: not the side channel's (it has its own)
    "keep_alive_timeout": budget_case("keep_alive_timeout", "KVBRIDGE_KEEP_ALIVE_TIMEOUT",
                                      "2.5", SETTINGS["side_channel_keep_alive_timeout"].default),
}
PARAMS = [(name, method) for name in CASES for method in CASES[name].methods]


def test_the_walk_covers_every_side_channel_setting() -> None:
    assert sorted(CASES) == sorted(WALKED)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    d = write_certs(tmp_path_factory.mktemp("factories"), ("prefill", "decode"))
    out = {p.name: str(p) for p in d.iterdir()}
    out["tokens_file"] = str(d / "tokens")
    rotate(out["tokens_file"], "peer[metadata]:tok-a\nproxy[release,prewarm]:tok-b\n")
    out["audit_log"] = str(d / "audit.log")
    return out


def fill(value: Any, files: dict[str, str]) -> Any:
    """``{name}`` placeholders: the test's files, and one free port."""
    if isinstance(value, str) and value.startswith("{") and value.endswith("}"):
        return files[value[1:-1]]
    if isinstance(value, tuple):
        return tuple(fill(v, files) for v in value)
    return value


def plugin_client(settings: Any) -> Any:
    """The client the plug-in's worker builds (its own method). ``KVBridgeWorker.__init__``
    needs a NIXL agent and vLLM's parallel state: a shell holding the plug-in's attributes."""
    from kvbridge.vllm.connector import KVBridgeWorker

    worker = KVBridgeWorker.__new__(KVBridgeWorker)
    worker.kvbridge_settings = settings
    worker._kvbridge_lock = threading.Lock()
    worker._kvbridge_client = None
    return worker._kvbridge_transport()


@contextmanager
def plugin_objects(extra: dict[str, Any]) -> Iterator[Built]:
    """The plug-in's server as its scheduler connector starts it (the etcd one: built, not
    started, so no etcd is needed) and its worker's client."""
    with scheduler_connector(extra) as connector:
        sched = connector.connector_scheduler
        if extra["handshake_method"] == "etcd":
            server, _ = sched._kvbridge_make_server({(0, 0): b"agent"}, sched.side_channel_port)
        else:
            connector.set_xfer_handshake_metadata_pp_aware({(0, 0): payload(b"agent")})
            server = sched.kvbridge_server
        client = plugin_client(sched.kvbridge_settings)
        try:
            yield Built(server, client)
        finally:
            if hasattr(client, "close"):
                client.close()
            if extra["handshake_method"] == "etcd":
                server._registry.close()  # built, never started


@contextmanager
def serve_objects(extra: dict[str, Any]) -> Iterator[Built]:
    """``kvbridge serve``'s server (not started) and a decode worker's client, from the
    same values as flags (the budget from the environment, as its CLI reads it)."""
    cfg = SideChannelConfig.load({"side_channel_host": "127.0.0.1", "side_channel_port": 0,
                                  **extra}, os.environ, budget=ConnectionBudget.load())
    store = PayloadStore("test/opaque", "engine-a", "epoch-1", tp_size=1)
    server = side_channel(cfg, store)
    client = make_client(cfg, None, keep_warm=True)
    try:
        yield Built(server, client)
    finally:
        client.close()
        if cfg.handshake_method == "etcd":
            server._registry.close()  # built, never started
        else:
            server.stop()


@pytest.mark.parametrize(("name", "method"), PARAMS, ids=[f"{n}-{m}" for n, m in PARAMS])
def test_each_setting_reaches_the_plugins_server_or_client(
        name: str, method: str, files: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    case = CASES[name]
    files = {**files, "port": free_port(), "token_file": files["ca.pem"] + ".token"}
    rotate(files["token_file"], "token-one")
    for k, v in case.env.items():
        monkeypatch.setenv(k, v)
    extra = {**BASE[method], **{k: fill(v, files) for k, v in case.extra.items()}}
    expect = case.expect[method] if isinstance(case.expect, dict) else case.expect
    expect = fill(expect, files) if expect is not None else (method, method)
    with serve_objects(extra) as built:
        assert case.read(built, files) == expect, f"{name}: kvbridge serve"
    rotate(files["token_file"], "token-one")
    with plugin_objects(extra) as built:
        assert case.read(built, files) == expect, f"{name}: the vLLM plug-in ({method})"


def test_the_budget_is_read_with_the_settings() -> None:
    """The connection budget comes from the environment the settings are loaded with, and
    a bad value fails there, in one line (as kvbridge serve's at start)."""
    from kvbridge.errors import ConfigError
    from kvbridge.vllm.settings import load_settings

    env = {"KVBRIDGE_MAX_CONNECTIONS": "77", "KVBRIDGE_KEEP_ALIVE_TIMEOUT": "2.5"}
    budget = load_settings({"side_channel_keep_alive_timeout": 42}, environ=env
                           ).side_channel.server_budget
    assert (budget.max_connections, budget.keep_alive_timeout) == (77, 42.0)
    with pytest.raises(ConfigError, match="KVBRIDGE_HEAD_TIMEOUT"):
        load_settings({}, environ={"KVBRIDGE_HEAD_TIMEOUT": "-1"})


def test_vllms_zmq_wire_never_drops_a_token() -> None:
    """vLLM's wire has no place for a token: built with one, it refuses rather than serve or
    fetch without it (load_settings refuses the setting first)."""
    from kvbridge.errors import ConfigError
    from kvbridge.handshake import make_client, make_server

    cfg = SideChannelConfig.load({"handshake_method": "zmq", "side_channel_port": 0,
                                  "token": "s3cret"}, {})
    with pytest.raises(ConfigError, match="no place for a side-channel token"):
        make_client(cfg, None, wire="vllm")
    with pytest.raises(ConfigError, match="no place for a side-channel token"):
        make_server(cfg, PayloadStore("k", "e", "x", 1), wire="vllm")
