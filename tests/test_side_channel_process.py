"""The side channel in a process of its own (kvbridge.handshake.process.parent): real child
processes serving real clients on loopback, killed for real.

Every method is served from the child with the settings it is given (token, mutual TLS,
vLLM's wire, etcd); payloads handed again are served; the instance's health and what the
child answered cross the process boundary; a child that dies is restarted and its absence
seen; a parent killed with SIGKILL leaves no process and no port behind.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import socket
import ssl
import subprocess
import sys
import textwrap
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from kvbridge import supervised
from kvbridge.config import SideChannelConfig
from kvbridge.errors import AuthError, ConfigError
from kvbridge.guard import ConnectionBudget, GuardCollector
from kvbridge.handshake import MetadataStore, make_client, side_channel
from kvbridge.handshake.payloads import PayloadStore
from kvbridge.handshake.process.parent import LIVENESS_TIMEOUT, SideChannelProcess
from kvbridge.handshake.zmq.vllm_wire import VllmZmqClient
from kvbridge.net import listen_socket
from kvbridge.tools.testing.procfs import gone, listening, status_field
from kvbridge.tools.testing.wait import wait_until
from tests.helpers import compat, rank_meta

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "s3cret-token"


def full_store(tp_size: int = 2, ranks: int | None = None) -> MetadataStore:
    """A plain store (what crosses to the child is its state, not a subclass's)."""
    store = MetadataStore(compat(), tp_size)
    for r in range(tp_size if ranks is None else ranks):
        store.set_rank(rank_meta(r, tp_size))
    return store


def config(method: str = "http", **kw: object) -> SideChannelConfig:
    return SideChannelConfig.load({"handshake_method": method, "side_channel_host": "127.0.0.1",
                                   "side_channel_port": 0,
                                   "trusted_side_channels": "127.0.0.1", **kw}, {})


@contextmanager
def running(server: SideChannelProcess) -> Iterator[SideChannelProcess]:
    server.start()
    try:
        yield server
    finally:
        server.stop()


def get(port: int, path: str, **headers: str) -> tuple[int, bytes]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def port_free(port: int) -> bool:
    return not listening(port)


def test_every_rank_served_from_the_child_with_the_token_checked() -> None:
    cfg = config(token=TOKEN)
    with running(side_channel(cfg, full_store(2))) as server:
        assert isinstance(server, SideChannelProcess) and server.pid != os.getpid()
        client = make_client(cfg, compat())
        try:
            assert [r.tp_rank for r in client.fetch("127.0.0.1", server.port)] == [0, 1]
        finally:
            client.close()
        wrong = make_client(config(token="another"), compat())
        try:
            with pytest.raises(AuthError):
                wrong.fetch("127.0.0.1", server.port)
        finally:
            wrong.close()
        assert get(server.port, "/readyz")[0] == 200


def test_readyz_is_true_only_once_every_rank_is_in() -> None:
    with running(side_channel(config(), full_store(2, ranks=1))) as server:
        assert get(server.port, "/readyz")[0] == 503
        assert get(server.port, "/v1/kv/handshake")[0] == 503


@pytest.mark.parametrize("method", ["http", "zmq"])
def test_the_childs_fd_table_has_room_for_its_connections_before_any_arrive(method: str) -> None:
    """Grown under load, the table stalls accept for an RCU grace period at each doubling
    (kvbridge.net.grow_fd_table): a child starts with its parent's, 64 to 256 fds."""
    budget = ConnectionBudget.load(side_channel=True).max_connections
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    with running(side_channel(config(method), full_store(2))) as server:
        assert int(status_field(str(server.pid), "FDSize")) >= min(budget, soft)


def test_the_zmq_method_is_served_from_the_child() -> None:
    cfg = config("zmq", token=TOKEN)
    with running(side_channel(cfg, full_store(2))) as server:
        ranks = make_client(cfg, compat()).fetch("127.0.0.1", server.port, 1)
        assert [r.tp_rank for r in ranks] == [1]


def test_vllms_wire_is_served_and_a_republish_reaches_the_child() -> None:
    store = PayloadStore("vllm-nixl/NixlHandshakePayload", "engine-a", "epoch-1", tp_size=2)
    store.set_payloads({(0, 0): b"rank-0", (0, 1): b"rank-1"})
    with running(side_channel(config("zmq"), store, wire="vllm")) as server:
        client = VllmZmqClient(5.0, 1 << 20)
        assert client.fetch_ranks("127.0.0.1", server.port, [(0, 1)]).payloads == {(0, 1): b"rank-1"}
        store.set_payloads({(0, 1): b"rank-1-after-wake-up"})
        server.payloads_changed({(0, 1): b"rank-1-after-wake-up"})  # returns once served
        assert client.fetch_ranks("127.0.0.1", server.port, [(0, 1)]).payloads == {
            (0, 1): b"rank-1-after-wake-up"}


def test_https_with_mutual_tls_is_served_from_the_child(certs: Path) -> None:
    tls = {"ssl_certfile": str(certs / "prefill.pem"), "ssl_keyfile": str(certs / "prefill.key"),
           "ssl_ca_certs": str(certs / "ca.pem"), "ssl_cert_reqs": "required"}
    with running(side_channel(config(**tls), full_store(1))) as server:
        good = make_client(config(ssl_certfile=str(certs / "decode.pem"),
                                  ssl_keyfile=str(certs / "decode.key"),
                                  ssl_ca_certs=str(certs / "ca.pem")), compat())
        try:
            assert [r.tp_rank for r in good.fetch("127.0.0.1", server.port)] == [0]
        finally:
            good.close()
        ctx = ssl.create_default_context(cafile=str(certs / "ca.pem"))  # no client cert
        with pytest.raises((ssl.SSLError, urllib.error.URLError, ConnectionError)):
            urllib.request.urlopen(f"https://127.0.0.1:{server.port}/v1/kv/handshake",
                                   context=ctx, timeout=5).read()


def test_etcd_is_published_from_the_child(etcd) -> None:
    cfg = config("etcd", registry=etcd.url)
    with running(side_channel(cfg, full_store(2))) as server:
        client = make_client(cfg, compat())
        try:
            ranks = wait_until(lambda: client.fetch("127.0.0.1", server.port), 20,
                               "the metadata in etcd")
        finally:
            client.close()
        assert [r.tp_rank for r in ranks] == [0, 1]


def test_the_instances_health_reaches_the_child() -> None:
    problem: list[str | None] = ["engine is not running: test"]
    with running(side_channel(config(), full_store(2), health=lambda: problem[0])) as server:
        status, body = get(server.port, "/v1/kv/handshake")
        assert status == 503 and b"engine is not running: test" in body
        assert get(server.port, "/readyz")[0] == 503
        problem[0] = None
        wait_until(lambda: get(server.port, "/readyz")[0] == 200, 10, "ready once healthy")


def test_what_the_child_answered_reaches_the_observer() -> None:
    seen: list[tuple[str, int, int]] = []
    with running(side_channel(config(), full_store(2), observer=lambda *a: seen.append(a))
                 ) as server:
        for _ in range(3):
            assert get(server.port, "/v1/kv/handshake/1")[0] == 200
        assert get(server.port, "/v1/kv/handshake/9")[0] == 404
        wait_until(lambda: len(seen) >= 4, 10, "four requests observed", message=lambda: seen)
    ok = [s for s in seen if s[:2] == ("handshake_rank", 200)]
    assert len(ok) == 3 and sum(s[2] for s in ok) > 0
    assert [s[:2] for s in seen if s[1] == 404] == [("handshake_rank", 404)]


def _open_side_channel_connections() -> float:
    families = {f.name: f for f in GuardCollector().collect()}
    return sum(s.value for s in families["kvbridge_connections"].samples
               if s.labels["server"] == "side channel")


def test_the_childs_connection_guard_is_in_the_parents_metrics() -> None:
    with running(side_channel(config(), full_store(2))) as server:
        before = _open_side_channel_connections()
        idle = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(3)]
        try:
            wait_until(lambda: _open_side_channel_connections() >= before + 3, 10,
                       "three idle connections counted", message=_open_side_channel_connections)
        finally:
            for s in idle:
                s.close()


def test_without_a_health_to_follow_the_supervisor_never_wakes_for_nothing() -> None:
    """The vLLM plug-in gives no health: its supervisor thread, in vLLM's engine core,
    waits on the child alone (it polled every 0.1 s). Counted over a 1 s window of an idle
    child: the thread's voluntary context switches, from /proc."""
    with running(side_channel(config(), full_store(2))) as server:
        assert get(server.port, "/readyz")[0] == 200
        (tid,) = [t.native_id for t in threading.enumerate() if t.name == "kvbridge-side-channel"]

        def switches() -> int:
            return int(status_field(f"self/task/{tid}", "voluntary_ctxt_switches"))

        before = switches()
        time.sleep(1.0)  # the window measured, not a wait for anything
        assert switches() - before <= 2


def test_a_killed_child_is_restarted_and_seen_down_meanwhile() -> None:
    with running(side_channel(config(), full_store(2))) as server:
        first = server.pid
        assert first is not None and server.problem is None
        os.kill(first, signal.SIGKILL)
        # down: the instance's /health names it (supervised.down), until the restart
        reason = wait_until(lambda: "exited" in (r := supervised.down().get(
            "kvbridge-side-channel", "")) and r, 10, "the side channel seen down")
        assert f"process {first} exited with signal 9" in reason
        wait_until(lambda: server.problem is None and server.pid not in (None, first), 10,
                   "a new child serving")
        assert server.restarts == 1
        assert get(server.port, "/v1/kv/handshake")[0] == 200
        assert "kvbridge-side-channel" not in supervised.down()


def _side_channel_down() -> str | None:
    return supervised.down().get("kvbridge-side-channel")


def test_a_stopped_child_is_down_until_it_answers_again() -> None:
    """The instance's side channel is pinged over the control socket: a child that stops
    answering (SIGSTOP here; hung or flooded alike) is down once it missed
    LIVENESS_TIMEOUT of pings, and up again once it answers."""
    with running(side_channel(config(), full_store(2), health=lambda: None)) as server:
        assert _side_channel_down() is None and get(server.port, "/readyz")[0] == 200
        pid = server.pid
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)
        try:
            reason = wait_until(_side_channel_down, LIVENESS_TIMEOUT + 10,
                                "the stopped side channel seen down")
            assert f"side-channel process {pid} not answering" in reason
        finally:
            os.kill(pid, signal.SIGCONT)
        wait_until(lambda: _side_channel_down() is None, 10, "up again once it answers",
                   message=_side_channel_down)
        assert server.pid == pid and server.restarts == 0
        assert get(server.port, "/readyz")[0] == 200


def test_a_restarted_child_is_down_until_it_serves() -> None:
    """While a new child starts (here stopped before it could say it serves) the side
    channel is down, not only while the supervisor waits to start it."""
    with running(side_channel(config(), full_store(2), health=lambda: None)) as server:
        first = server.pid
        assert first is not None
        os.kill(first, signal.SIGKILL)
        second = wait_until(lambda: (p := server._proc) is not None and p.pid != first
                            and p.pid, 10, "a new child started")
        os.kill(second, signal.SIGSTOP)
        try:
            # starting (or, had it served before it stopped, not answering): down either way
            reason = wait_until(lambda: (r := _side_channel_down()) and "exited" not in r
                                and r, LIVENESS_TIMEOUT + 10, "the new child seen down")
            assert str(second) in reason and ("starting" in reason or "not answering" in reason)
            assert server.problem is not None
        finally:
            os.kill(second, signal.SIGCONT)
        wait_until(lambda: _side_channel_down() is None and server.problem is None, 20,
                   "up once the new child serves", message=_side_channel_down)
        assert get(server.port, "/readyz")[0] == 200


def test_a_child_that_cannot_start_says_why_at_start(tmp_path: Path) -> None:
    cfg = config(ssl_certfile=str(tmp_path / "missing.pem"),
                 ssl_keyfile=str(tmp_path / "missing.key"))
    server = side_channel(cfg, full_store(1))
    with pytest.raises(Exception, match="missing.pem|No such file"):
        server.start()
    assert server.pid is None


def test_a_port_in_use_is_refused_before_any_child_starts() -> None:
    taken = listen_socket("127.0.0.1", 0, "test")
    try:
        with pytest.raises(ConfigError, match="already in use.*KVBRIDGE_SIDE_CHANNEL_PORT"):
            side_channel(config(side_channel_port=taken.getsockname()[1]), full_store(1))
    finally:
        taken.close()


def test_stop_ends_the_child_and_frees_the_port() -> None:
    server = side_channel(config(), full_store(1))
    with running(server):
        pid, port = server.pid, server.port
    assert pid is not None and gone(pid)
    assert port_free(port)


PARENT = textwrap.dedent("""
    import json, sys
    from kvbridge.config import SideChannelConfig
    from kvbridge.handshake import side_channel
    from tests.test_side_channel_process import full_store
    cfg = SideChannelConfig.load({"handshake_method": sys.argv[1],
                                  "side_channel_host": "127.0.0.1", "side_channel_port": 0}, {})
    server = side_channel(cfg, full_store(2))
    server.start()
    print(json.dumps({"port": server.port, "pid": server.pid}), flush=True)
    sys.stdin.read()
""")


# Runs PARENT, and becomes the reaper of its orphans (PR_SET_CHILD_SUBREAPER): once the
# parent is killed, its side-channel child is this script's to wait for, and how it ended
# can be told.
REAPER = textwrap.dedent("""
    import ctypes, json, os, subprocess, sys
    ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    parent = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    info = json.loads(parent.stdout.readline())
    print(json.dumps(info), flush=True)
    sys.stdin.readline()  # the test has looked at the running child
    parent.kill()
    parent.wait()
    _, status = os.waitpid(info["pid"], 0)  # the whole child, its last thread included
    print(json.dumps({"signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
                      "code": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None}),
          flush=True)
""")


@pytest.mark.parametrize("method", ["http", "zmq"])
def test_a_parent_killed_with_sigkill_leaves_no_process_and_no_port(method: str) -> None:
    """The kernel kills the child with its parent (no graceful stop that would hold the
    port while it drains keep-alive peers): once it is reaped, the port is free, so an
    instance restarted at once on the same ports binds them."""
    reaper = subprocess.Popen([sys.executable, "-c", REAPER, PARENT, method],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
    peer = None
    try:
        info = json.loads(reaper.stdout.readline())
        assert not gone(info["pid"])
        # a keep-alive peer, which a graceful stop would wait for
        peer = socket.create_connection(("127.0.0.1", info["port"]), timeout=5)
        if method == "http":
            assert get(info["port"], "/readyz")[0] == 200
        reaper.stdin.write("kill\n")
        reaper.stdin.flush()
        ended = json.loads(reaper.stdout.readline())
        assert ended == {"signal": signal.SIGKILL, "code": None}
        assert gone(info["pid"])
        assert port_free(info["port"])
    finally:
        if peer is not None:
            peer.close()
        if reaper.poll() is None:
            reaper.kill()
            reaper.wait()
