"""``kvbridge bench transfer --netns``: NIXL READ against a raw TCP stream between two hosts.

Two network namespaces made for the run ("hosts" a and b, joined by one veth pair, with
addresses from 198.18.0.0/15, the range set aside for network tests) and ``UCX_TLS=tcp,self``
in both processes, so that UCX moves the bytes over TCP across the veth as between two
machines (without it UCX sees one machine and copies through shared memory). The peer
(``kvbridge.tools.bench.peer transfer``) is started in b; this process enters a, registers its
buffer, adds the peer's agent and, per point, times a NIXL READ of ``n`` contiguous blocks
and the same bytes sent by the peer over one TCP connection (the raw stream), interleaved.
Both namespaces (and with them the veth) are deleted at the end, on any outcome.
"""

from __future__ import annotations

import argparse
import base64
import ctypes
import json
import os
import shutil
import socket
import struct
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from kvbridge.tools.bench.common import Child, load_average, progress, pyplot
from kvbridge.tools.bench.report import goal_lines
from kvbridge.tools.bench.timing import descs, interleaved

KiB = 1024
SUBNET = "198.18.20"  # a and b: .1 and .2 (inside the namespaces made here only)
BLOCKS = "1,4,16,64,256"
BLOCK_SIZES = "262144"
GOAL = 0.8
_CLONE_NEWNET = 0x40000000


def _ip(*args: str) -> str:
    return subprocess.run(["ip", *args], check=True, capture_output=True, text=True,
                          timeout=30).stdout


def _setns_fd(fd: int, what: str) -> None:
    """Move this thread (and the threads and processes it starts later) to a namespace."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, _CLONE_NEWNET) != 0:
        raise OSError(ctypes.get_errno(), f"setns {what}")


def _setns(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        _setns_fd(fd, path)
    finally:
        os.close(fd)


class _Hosts:
    """Namespaces ``a`` and ``b`` joined by a veth pair (``eth0`` in each)."""

    def __init__(self) -> None:
        if os.geteuid() != 0:
            raise SystemExit("kvbridge bench transfer --netns: network namespaces need root")
        if shutil.which("ip") is None:
            raise SystemExit("kvbridge bench transfer --netns: the ip command (iproute2) "
                             "is missing")
        rid = uuid.uuid4().hex[:6]
        self.ns = {"a": f"kvb-{rid}-xa", "b": f"kvb-{rid}-xb"}
        self.addr = {"a": f"{SUBNET}.1", "b": f"{SUBNET}.2"}
        self._made: list[str] = []

    def __enter__(self) -> _Hosts:
        try:
            for h in ("a", "b"):
                _ip("netns", "add", self.ns[h])
                self._made.append(self.ns[h])
            _ip("-n", self.ns["a"], "link", "add", "eth0", "type", "veth", "peer", "name",
                "eth0", "netns", self.ns["b"])
            for h in ("a", "b"):
                _ip("-n", self.ns[h], "addr", "add", f"{self.addr[h]}/24", "dev", "eth0")
                _ip("-n", self.ns[h], "link", "set", "eth0", "up")
                _ip("-n", self.ns[h], "link", "set", "lo", "up")
        except BaseException:
            self.delete()
            raise
        return self

    def path(self, h: str) -> str:
        return f"/run/netns/{self.ns[h]}"

    def counters(self, h: str) -> dict[str, int]:
        """Bytes received and sent by ``eth0`` of host ``h``."""
        st = json.loads(_ip("-n", self.ns[h], "-j", "-s", "link", "show", "dev", "eth0")
                        )[0]["stats64"]
        return {"rx_bytes": int(st["rx"]["bytes"]), "tx_bytes": int(st["tx"]["bytes"])}

    def mtu(self) -> int:
        return int(json.loads(_ip("-n", self.ns["a"], "-j", "link", "show", "dev", "eth0")
                              )[0]["mtu"])

    def delete(self) -> None:
        for ns in reversed(self._made):  # deleting a namespace deletes its end of the veth
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        self._made.clear()

    def __exit__(self, *exc: object) -> None:
        self.delete()


def _sysctls() -> dict[str, str]:
    """Socket buffer limits of the namespace this thread is in."""
    out = {}
    for key in ("net/ipv4/tcp_rmem", "net/ipv4/tcp_wmem", "net/core/rmem_max",
                "net/core/wmem_max"):
        try:
            out[key.replace("/", ".")] = Path(f"/proc/sys/{key}").read_text().strip()
        except OSError:
            pass
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    from kvbridge._nixl import PROGRESS_DELAY_US

    blocks = [int(x) for x in str(args.blocks or BLOCKS).split(",")]
    sizes = [int(x) for x in str(args.block_sizes or BLOCK_SIZES).split(",")]
    os.environ["UCX_TLS"] = "tcp,self"  # both processes: UCX over TCP across the veth
    load_before = load_average()
    home = os.open("/proc/self/ns/net", os.O_RDONLY)
    try:
        with _Hosts() as hosts:
            try:
                results, seen = _in_hosts(args, hosts, blocks, sizes)
            finally:  # back home before the namespaces go
                _setns_fd(home, "/proc/self/ns/net")
    finally:
        os.close(home)
    big = [r for r in results if r["bytes"] >= 4 * 2**20]
    worst = min((r["nixl_over_tcp"] for r in big), default=float("nan"))
    goals = []
    if big:
        goals.append({"goal": f"NIXL READ >= {GOAL}x a raw TCP stream between two network "
                              "namespaces (UCX_TLS=tcp,self; transfers >= 4 MiB, interleaved; "
                              "worst point)", "value": round(worst, 3),
                      "reached": worst >= GOAL})
    return {
        "config": {"mode": "netns", "blocks": blocks, "block_bytes": sizes,
                   "min_seconds": args.min_seconds, "min_iters": args.min_iters,
                   "timing": "median per point; NIXL READ (make_prepped_xfer .. DONE, busy "
                             "poll) and the TCP stream timed interleaved, one of each per round",
                   "tcp": "the peer sends the same bytes over one TCP connection (TCP_NODELAY, "
                          "default socket buffers) into this process's buffer (recv_into)",
                   **seen,
                   "ucx_env": {k: v for k, v in sorted(os.environ.items())
                               if k.startswith(("UCX_", "KVBRIDGE_NIXL"))},
                   "nixl_progress_delay_us": PROGRESS_DELAY_US, "quick": args.quick},
        "results": results,
        "goals": goals,
        "load_average": {"before": load_before, "after": load_average()},
    }


def _in_hosts(args: argparse.Namespace, hosts: _Hosts, blocks: list[int],
              sizes: list[int]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The peer started in b, this thread moved to a, the points measured. The agent made
    here (and its progress thread, which lives in a) is gone when this returns."""
    import torch

    from kvbridge._nixl import new_agent, nixl_api

    pool = max(blocks) * max(sizes)
    progress(f"transfer --netns: hosts {hosts.ns['a']} ({hosts.addr['a']}) and "
             f"{hosts.ns['b']} ({hosts.addr['b']}), {pool / 2**20:.0f} MiB each")
    _setns(hosts.path("b"))
    try:
        peer = Child("transfer", "--pool-bytes", str(pool), "--bind", hosts.addr["b"])
    finally:
        _setns(hosts.path("a"))
    with peer:
        info = peer.info
        seen = {"pool_bytes": pool, "namespaces": dict(hosts.ns),
                "addresses": dict(hosts.addr), "veth_mtu": hosts.mtu(),
                "sysctls_host_a": _sysctls()}
        dst = torch.ones(pool, dtype=torch.uint8)  # touched before any timing
        agent = new_agent(nixl_api(), f"bench-netns-{info['pid']}")
        reg = agent.register_memory([(dst.data_ptr(), dst.nbytes, 0, "")], mem_type="DRAM")
        remote = agent.add_remote_agent(base64.b64decode(info["agent_metadata"]))
        if isinstance(remote, bytes):
            remote = remote.decode()
        tcp = socket.create_connection((hosts.addr["b"], info["tcp_port"]))
        tcp.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            results = _measure(args, agent, remote, info, dst, tcp, memoryview(dst.numpy()),
                               hosts, blocks, sizes)
        finally:
            tcp.close()
            agent.remove_remote_agent(remote)
            agent.deregister_memory(reg)
    return results, seen


def _measure(args: argparse.Namespace, agent: Any, remote: str, info: dict[str, Any],
             dst: Any, tcp: socket.socket, view: memoryview, hosts: _Hosts,
             blocks: list[int], sizes: list[int]) -> list[dict[str, Any]]:
    results = []
    for size in sizes:
        count = max(blocks)
        rlist = agent.prep_xfer_dlist(remote, descs(info["addr"], count, size), "DRAM")
        llist = agent.prep_xfer_dlist("NIXL_INIT_AGENT", descs(dst.data_ptr(), count, size),
                                      "DRAM")

        def nixl_read(idx: np.ndarray, llist=llist, rlist=rlist) -> None:
            h = agent.make_prepped_xfer("READ", llist, idx, rlist, idx, b"")
            state = agent.transfer(h)
            give_up = time.monotonic() + 60
            while state == "PROC" and time.monotonic() < give_up:
                state = agent.check_xfer_state(h)
            agent.release_xfer_handle(h)
            if state != "DONE":
                raise RuntimeError(f"NIXL READ ended {state}")

        def over_tcp(nbytes: int) -> None:
            tcp.sendall(struct.pack("<QQ", 0, nbytes))
            got = 0
            while got < nbytes:
                k = tcp.recv_into(view[got:nbytes])
                if not k:
                    raise RuntimeError("TCP peer closed")
                got += k

        nixl_read(np.arange(1, dtype=np.int64))  # the first READ sets up the UCX endpoint
        for n in blocks:
            nbytes = n * size
            idx = np.arange(n, dtype=np.int64)
            dst[:nbytes] = 0
            before = hosts.counters("a")
            nixl_read(idx)  # one READ alone: what crossed the veth, and its bytes checked
            after = hosts.counters("a")
            for off in {0, nbytes - size}:
                want = (np.arange(off, off + size, dtype=np.int64) % 251).astype(np.uint8)
                if not np.array_equal(dst.numpy()[off:off + size], want):
                    raise RuntimeError(f"READ n={n} B={size} over TCP: wrong bytes")
            pair = interleaved({"nixl": lambda idx=idx: nixl_read(idx),
                                 "tcp": lambda nbytes=nbytes: over_tcp(nbytes)}, args)
            row: dict[str, Any] = {
                "block_bytes": size, "blocks": n, "bytes": nbytes,
                "veth_rx_bytes_per_read": after["rx_bytes"] - before["rx_bytes"],
                "veth_tx_bytes_per_read": after["tx_bytes"] - before["tx_bytes"]}
            for key, (secs, iters) in pair.items():
                row[f"{key}_contiguous"] = {"seconds": secs, "iters": iters,
                                            "gb_per_s": nbytes / secs / 1e9}
            row["nixl_over_tcp"] = pair["tcp"][0] / pair["nixl"][0]
            results.append(row)
            progress(f"transfer --netns: {n:>5} x {size // KiB:>4} KiB: NIXL "
                     f"{row['nixl_contiguous']['gb_per_s']:.2f} GB/s, TCP "
                     f"{row['tcp_contiguous']['gb_per_s']:.2f} GB/s "
                     f"({row['nixl_over_tcp']:.2f}x)")
        for dl in (rlist, llist):
            agent.release_dlist_handle(dl)
    return results


def summary(r: dict[str, Any]) -> str:
    lines = ["block  blocks      MiB  NIXL GB/s  TCP GB/s  NIXL/TCP  veth rx MiB/READ"]
    for x in r["results"]:
        lines.append(f"{x['block_bytes'] // KiB:>4}K {x['blocks']:>7} "
                     f"{x['bytes'] / 2**20:>8.2f} {x['nixl_contiguous']['gb_per_s']:>10.3f} "
                     f"{x['tcp_contiguous']['gb_per_s']:>9.3f} {x['nixl_over_tcp']:>9.2f} "
                     f"{x['veth_rx_bytes_per_read'] / 2**20:>17.2f}")
    return "\n".join(lines + goal_lines(r))


def plot(r: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.4))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, size in enumerate(r["config"]["block_bytes"]):
        rows = [x for x in r["results"] if x["block_bytes"] == size]
        xs = [x["bytes"] / 2**20 for x in rows]
        c, lab = colors[i % len(colors)], f"{size // KiB} KiB blocks"
        axes[0].plot(xs, [x["nixl_contiguous"]["gb_per_s"] for x in rows], "o-", color=c,
                     label=f"NIXL READ, {lab}")
        axes[0].plot(xs, [x["tcp_contiguous"]["gb_per_s"] for x in rows], "^--", color=c,
                     alpha=0.6, label=f"raw TCP stream, {lab}")
        axes[1].plot(xs, [x["nixl_over_tcp"] for x in rows], "o-", color=c, label=lab)
    axes[0].set(xscale="log", xlabel="MiB per transfer", ylabel="GB/s",
                title="bandwidth across the veth (median per point)")
    axes[1].axhline(GOAL, color="black", lw=0.8, ls="--", label=f"goal {GOAL} (from 4 MiB)")
    axes[1].axvline(4, color="grey", lw=0.8, ls=":")
    axes[1].set(xscale="log", xlabel="MiB per transfer", ylabel="NIXL / TCP",
                title="NIXL READ / raw TCP stream")
    for ax in axes:
        ax.legend(fontsize=7)
    fig.suptitle("kvbridge NIXL READ between two network namespaces (UCX_TLS=tcp,self) "
                 "vs a raw TCP stream")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
