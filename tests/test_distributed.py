"""A TP group across two "nodes" on loopback (real processes, real gloo; no root needed).

The network-namespace tests (tests/netns/) run the same across real interfaces.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import subprocess
import sys

import pytest

from kvbridge.engine.distributed import interface_of
from kvbridge.engine.engine import build_engine
from kvbridge.engine.sampling import SamplingParams
from kvbridge.engine.workers import WorkerDiedError
from kvbridge.multinode import MultiNodeConfig
from kvbridge.tools.launch import free_port
from tests.conftest import ROOT
from tests.helpers import wait_until

PROMPTS = ["two nodes, one group", "abc"]


def _node(port: int, tp: int) -> None:
    from kvbridge.engine.remote_node import run_node

    sys.exit(run_node(MultiNodeConfig(2, 1, "127.0.0.1", port, "127.0.0.1", 60), tp))


@pytest.mark.slow
def test_two_nodes_match_one_and_a_lost_node_is_an_error() -> None:
    port = free_port()
    node = mp.get_context("spawn").Process(target=_node, args=(port, 4))
    node.start()
    try:
        mn = MultiNodeConfig(2, 0, "127.0.0.1", port, "127.0.0.1", 60)
        sp = SamplingParams(max_tokens=6, temperature=0)
        with build_engine(dtype="float64") as ref:
            want = ref.generate(PROMPTS, sp)
        eng = build_engine(tp_size=4, dtype="float64", multinode=mn)
        try:
            assert eng.workers.rank_hosts == ["127.0.0.1"] * 4
            assert eng.generate(PROMPTS, sp) == want
            node.kill()  # the whole node: its ranks follow (they watch their parent)
            node.join()
            # Idle, the head notices through rank 0's heartbeat, and the next call says why.
            wait_until(lambda: not eng.workers.alive, 60, "the lost node noticed", every=0.1)
            with pytest.raises(WorkerDiedError, match="a node of this instance is gone"):
                eng.generate(PROMPTS[:1], sp)
        finally:
            eng.shutdown()
    finally:
        if node.is_alive():
            node.kill()
        node.join()


def test_node_layout_is_checked_before_anything_starts() -> None:
    def serve(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "kvbridge.cli", "serve", *args],
                              capture_output=True, text=True, timeout=60,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})

    r = serve("--tp", "3", "--nnodes", "2", "--master-addr", "127.0.0.1")
    assert r.returncode == 2 and "not a multiple of --nnodes" in r.stderr
    r = serve("--tp", "2", "--nnodes", "2", "--node-rank", "1", "--master-addr", "127.0.0.1")
    assert r.returncode == 2 and "--headless" in r.stderr
    r = serve("--tp", "2", "--nnodes", "2", "--node-rank", "1", "--headless",
              "--master-addr", "127.0.0.1", "--registry", "etcd://127.0.0.1:2379")
    assert r.returncode == 2 and "--registry goes on the head" in r.stderr
    r = serve("--tp", "2", "--nnodes", "2", "--master-addr", "198.18.0.1")
    assert r.returncode == 2 and "--advertise-host" in r.stderr  # 127.0.0.1 by default
    r = serve("--tp", "2", "--nnodes", "2")
    assert r.returncode == 2 and "--master-addr" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1



def test_gloo_binds_the_interface_that_owns_the_advertised_address() -> None:
    assert interface_of("127.0.0.1") == "lo"
    assert interface_of("192.0.2.1") is None  # TEST-NET-1: on no interface here
    assert interface_of("::1") is None  # IPv6: left to gloo's own choice


def _listening_addresses(port: int) -> set[str]:
    """Local addresses of the sockets listening on ``port`` (from /proc/net/tcp{,6})."""
    out = set()
    for name in ("tcp", "tcp6"):
        with open(f"/proc/net/{name}") as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                addr, _, hexport = local.partition(":")
                if state == "0A" and int(hexport, 16) == port:  # LISTEN
                    out.add(addr)
    return out


def test_the_rendezvous_store_listens_on_the_master_address_only() -> None:
    from datetime import timedelta

    from kvbridge.engine.distributed import rendezvous_store
    from kvbridge.errors import NodeError

    port = free_port()
    store = rendezvous_store("127.0.0.1", port, 1, True, timedelta(seconds=10))
    store.set("k", "v")
    assert _listening_addresses(port) == {"0100007F"}  # 127.0.0.1, not 0.0.0.0 nor ::
    with pytest.raises(NodeError, match="cannot listen on 198.18.0.1"):  # not this node's
        rendezvous_store("198.18.0.1", free_port(), 1, True, timedelta(seconds=1))
