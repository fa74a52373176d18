"""Several "hosts" on one machine: network namespaces joined by a bridge.

Each host is a namespace with one veth interface (``eth0``) and an address from
198.18.0.0/15 (the range set aside for network tests); the bridge lives in a
namespace of its own, so the root namespace gets no interface and no address.
Names are unique per run, and every namespace is deleted when the module's
tests end, whatever their outcome.

Processes that play separate hosts run with ``UCX_TLS=tcp,self``: UCX would
otherwise see one machine and move KV through shared memory, not the veth.

Needs root (``ip netns``). In CI (``CI=true``, root) these tests must run, so a
missing requirement fails them there; elsewhere they skip with the reason.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvbridge.tools.testing.certs import write_certs
from kvbridge.tools.testing.prometheus import metric_total, parse_samples
from tests.conftest import ROOT
from tests.helpers import wait_until

SUBNET = "198.18.0"
START_TIMEOUT = 180.0
# Everything here models a separate host: make UCX use TCP over the veth.
HOST_ENV = {"UCX_TLS": "tcp,self", "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}


def _require_root() -> None:
    in_ci = os.environ.get("CI") == "true"
    if os.geteuid() != 0:
        (pytest.fail if in_ci else pytest.skip)("network namespaces need root")
    if shutil.which("ip") is None and in_ci:
        # A fresh CI machine: install iproute2 from the distribution (bounded).
        subprocess.run(["apt-get", "update", "-qq"], check=False, timeout=300,
                       stdout=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
        subprocess.run(["apt-get", "install", "-y", "-qq", "iproute2"], check=False,
                       timeout=300, stdout=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
                       env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
    if shutil.which("ip") is None:
        (pytest.fail if in_ci else pytest.skip)("the ip command (iproute2) is missing")


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


class Host:
    """One namespace: ``addr`` on ``eth0``."""

    def __init__(self, ns: str, addr: str):
        self.ns = ns
        self.addr = addr

    def counter(self, what: str) -> int:
        """``rx_bytes`` or ``tx_bytes`` of this host's interface, read inside it."""
        out = subprocess.run(["ip", "netns", "exec", self.ns, "cat",
                              f"/sys/class/net/eth0/statistics/{what}"],
                             check=True, capture_output=True, text=True, timeout=30)
        return int(out.stdout)

    def popen(self, args: list[str], log: Path, **kw) -> subprocess.Popen:
        """A process inside this namespace (``ip netns exec`` execs it: same pid), in a
        session of its own so that the whole "machine" can be killed at once."""
        with log.open("w") as f:
            return subprocess.Popen(["ip", "netns", "exec", self.ns, *args], stdout=f,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env={**os.environ, **HOST_ENV}, start_new_session=True,
                                    **kw)


class Net:
    def __init__(self, run_id: str):
        self.run_id = run_id
        self.hub = f"kvb-{run_id}-hub"
        self.hosts: dict[str, Host] = {}
        self._made: list[str] = []

    def build(self, names: list[str]) -> None:
        _ip("netns", "add", self.hub)
        self._made.append(self.hub)
        _ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.hub, "link", "set", "br0", "up")
        for i, name in enumerate(names, start=1):
            ns = f"kvb-{self.run_id}-{name}"
            _ip("netns", "add", ns)
            self._made.append(ns)
            port = f"p{name}{self.run_id}"[:15]
            _ip("-n", self.hub, "link", "add", port, "type", "veth", "peer", "name", "eth0",
                "netns", ns)
            _ip("-n", self.hub, "link", "set", port, "master", "br0", "up")
            _ip("-n", ns, "addr", "add", f"{SUBNET}.{i}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            self.hosts[name] = Host(ns, f"{SUBNET}.{i}")

    def delete(self) -> None:
        for ns in reversed(self._made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        self._made.clear()


@pytest.fixture(scope="module")
def net(request: pytest.FixtureRequest) -> Iterator[Net]:
    """Hosts a (prefill head), b (prefill's second node), c (decodes, proxy, client),
    d (a decode's second node)."""
    _require_root()
    n = Net(uuid.uuid4().hex[:6])
    request.addfinalizer(n.delete)  # registered before anything exists: runs on any outcome
    n.build(["a", "b", "c", "d"])
    yield n


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory, net: Net) -> Path:
    """A CA and one server certificate valid for every host's address."""
    d = write_certs(tmp_path_factory.mktemp("netns-certs"),
                    identities=[*(h.addr for h in net.hosts.values()), "127.0.0.1"])
    (d / "token").write_text("netns-" + uuid.uuid4().hex)
    (d / "token").chmod(0o600)
    return d


class Proc:
    """``kvbridge ARGS`` on a host; stops (SIGTERM, then SIGKILL) with its session."""

    def __init__(self, host: Host, name: str, log_dir: Path, *args: str):
        self.host = host
        self.name = name
        self.log = log_dir / f"{name}.log"
        self.proc = host.popen([sys.executable, "-m", "kvbridge.cli", "--log-level", "warning",
                                *args], self.log)

    def tail(self, n: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])

    def kill_machine(self) -> None:
        """Every process of this "host" at once, as when the machine dies."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=30)

    def stop(self, timeout: float = 30) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                pass
        try:  # whatever is left of its session (workers, fork server)
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=30)
        return self.proc.returncode


class Client:
    """``tests/netns/nsclient.py`` running on a host: HTTP requests from inside it."""

    def __init__(self, host: Host, ca: Path, log_dir: Path):
        self._proc = subprocess.Popen(
            ["ip", "netns", "exec", host.ns, sys.executable, str(Path(__file__).with_name(
                "nsclient.py"))],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=(log_dir / "nsclient.log").open("w"), text=True,
            env={**os.environ, **HOST_ENV, "NSCLIENT_CA": str(ca)})
        self._answers: dict[str, dict] = {}
        self._cond = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            answer = json.loads(line)
            with self._cond:
                self._answers[answer["id"]] = answer
                self._cond.notify_all()

    def send(self, method: str, url: str, body: dict | None = None,
             headers: dict | None = None, timeout: float = 60) -> str:
        rid = uuid.uuid4().hex
        assert self._proc.stdin is not None
        self._proc.stdin.write(json.dumps({"id": rid, "method": method, "url": url,
                                           "json": body, "headers": headers,
                                           "timeout": timeout}) + "\n")
        self._proc.stdin.flush()
        return rid

    def result(self, rid: str, timeout: float = 120) -> tuple[int, str]:
        deadline = time.monotonic() + timeout
        with self._cond:
            while rid not in self._answers:
                left = deadline - time.monotonic()
                if left <= 0 or self._proc.poll() is not None:
                    raise TimeoutError(f"no answer to request {rid}")
                self._cond.wait(min(left, 1.0))
            a = self._answers.pop(rid)
        return a["status"], a["body"]

    def request(self, method: str, url: str, body: dict | None = None, **kw) -> tuple[int, str]:
        return self.result(self.send(method, url, body, **kw))

    def wait_status(self, url: str, status: int, deadline: float, what: str,
                    procs: list[Proc] = ()) -> None:
        """Poll ``url`` until it answers ``status`` (a condition with a deadline); one of
        ``procs`` exiting meanwhile fails at once."""
        last: list[object] = [None, ""]

        def answered() -> bool:
            last[:] = self.request("GET", url, timeout=5)
            if last[0] == status:
                return True
            for p in procs:
                if p.proc.poll() is not None:
                    raise RuntimeError(f"{p.name} exited {p.proc.returncode}:\n{p.tail()}")
            return False

        wait_until(answered, max(0.0, deadline - time.monotonic()),
                   f"{what}: {url} answers {status}", every=0.2,
                   message=lambda: f"it answers {last[0]} {str(last[1])[:200]}")

    def metric(self, url: str, name: str) -> float:
        status, text = self.request("GET", url + "/metrics")
        assert status == 200, text
        return metric_total(parse_samples(text), name)

    def close(self) -> None:
        if self._proc.stdin is not None:
            self._proc.stdin.close()
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
