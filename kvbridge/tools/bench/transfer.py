"""``kvbridge bench transfer``: NIXL READs of KV blocks between two processes.

A peer process (``kvbridge.tools.bench.peer transfer``) registers a touched buffer with its own
NIXL agent; this process registers its own touched buffer, adds the peer's agent and
READs ``n`` blocks of ``B`` bytes per transfer, sweeping ``n`` and ``B``:

* contiguous block ids (0..n-1 on both sides: NIXL merges adjacent descriptors), and
  scattered ones (random, distinct ids: nearly nothing to merge), when ``--scattered``;
* each transfer is timed from ``make_prepped_xfer`` to DONE, as kvbridge's reads are.

Baselines on the same bytes in the same run: an in-memory copy (torch, one thread, same
block gather for the scattered case) inside this process, one ``process_vm_readv`` of the
peer's bytes (the kernel copy UCX's ``cma`` transport makes for these READs), and the peer
sending the bytes over a TCP socket on loopback into this process's buffer. Contiguous
blocks are also read as 4 READs posted at once.
"""

from __future__ import annotations

import argparse
import base64
import ctypes
import os
import random
import socket
import struct
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvbridge.tools.bench.common import Child, apply_quick, idle_cpu, load_average, progress, pyplot
from kvbridge.tools.bench.peer import pattern
from kvbridge.tools.bench.report import goal_lines
from kvbridge.tools.bench.timing import descs, interleaved, repeat

KiB = 1024
READS_IN_FLIGHT = 4  # the same blocks split into this many READs at once


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--blocks", help="blocks per transfer (comma-separated; default "
                   "1,4,16,64,256,1024,4096, with --netns 1,4,16,64,256)")
    p.add_argument("--block-sizes", help="block sizes in bytes (comma-separated; default "
                   "16384,65536,262144, with --netns 262144)")
    p.add_argument("--min-seconds", type=float, default=0.3,
                   help="repeat each point at least this long ...")
    p.add_argument("--min-iters", type=int, default=3, help="... and at least this often")
    p.add_argument("--max-iters", type=int, default=200)
    p.add_argument("--no-scattered", dest="scattered", action="store_false",
                   help="skip the scattered block ids")
    p.add_argument("--no-tcp", dest="tcp", action="store_false", help="skip the TCP baseline")
    p.add_argument("--netns", action="store_true",
                   help="the peer in another network namespace (root; UCX_TLS=tcp,self): NIXL "
                        "READ against a raw TCP stream across a veth (transfer_netns.py)")


QUICK = {"blocks": "1,64", "block_sizes": "65536", "min_seconds": 0.0, "min_iters": 2,
         "max_iters": 3}


class _CrossMemory:
    """Baseline: the peer's bytes copied by the kernel with one ``process_vm_readv`` call,
    which is what UCX's ``cma`` transport does for a READ between two processes on one
    machine (UCX_PROTO_INFO=y shows "remote memory read ... zero-copy cma/memory")."""

    class _Iovec(ctypes.Structure):
        _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]

    def __init__(self, pid: int):
        self.pid = pid
        self.libc = ctypes.CDLL(None, use_errno=True)
        self.libc.process_vm_readv.restype = ctypes.c_ssize_t

    def read(self, local: int, remote: int, nbytes: int) -> None:
        lv, rv = self._Iovec(local, nbytes), self._Iovec(remote, nbytes)
        got = self.libc.process_vm_readv(self.pid, ctypes.byref(lv), ctypes.c_ulong(1),
                                         ctypes.byref(rv), ctypes.c_ulong(1), ctypes.c_ulong(0))
        if got != nbytes:
            raise OSError(ctypes.get_errno(), f"process_vm_readv read {got} of {nbytes} bytes")


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from kvbridge._nixl import PROGRESS_DELAY_US, new_agent, nixl_api

    apply_quick(args, QUICK)
    if args.netns:
        from kvbridge.tools.bench import transfer_netns

        return transfer_netns.run(args)
    blocks = [int(x) for x in str(args.blocks or "1,4,16,64,256,1024,4096").split(",")]
    sizes = [int(x) for x in str(args.block_sizes or "16384,65536,262144").split(",")]
    max_blocks, max_size = max(blocks), max(sizes)
    pool = max_blocks * max_size
    torch.set_num_threads(1)
    load_before = load_average()
    progress(f"transfer: two buffers of {pool / 2**20:.0f} MiB here, one in the peer")
    api = nixl_api()
    rng = random.Random(0)
    results: list[dict[str, Any]] = []
    # Both agents are made as kvbridge makes them: a progress thread that sleeps
    # PROGRESS_DELAY_US between polls (without any thread on the target side the READs
    # never complete: UCX needs the target to progress).
    with Child("transfer", "--pool-bytes", str(pool)) as peer:
        info = peer.info
        # Touch every page of both local buffers before any timing.
        dst = torch.ones(pool, dtype=torch.uint8)
        src = torch.from_numpy(pattern(pool))
        agent = new_agent(api, f"bench-dst-{info['pid']}")
        peer_idle_cpu = idle_cpu(peer.pid, 0.5)
        reg = agent.register_memory([(dst.data_ptr(), dst.nbytes, 0, "")], mem_type="DRAM")
        remote = agent.add_remote_agent(base64.b64decode(info["agent_metadata"]))
        if isinstance(remote, bytes):
            remote = remote.decode()
        tcp = socket.create_connection(("127.0.0.1", info["tcp_port"]))
        tcp.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        dst_np, src_np = dst.numpy(), src.numpy()
        cma = _CrossMemory(peer.pid)
        try:
            for size in sizes:
                count = max_blocks
                rlist = agent.prep_xfer_dlist(remote, descs(info["addr"], count, size), "DRAM")
                llist = agent.prep_xfer_dlist("NIXL_INIT_AGENT",
                                              descs(dst.data_ptr(), count, size), "DRAM")
                # A validated load (protocol.md 9a) READs one 8-byte tag per block after
                # the blocks: here, 8-byte descriptors at the start of the same buffers.
                rtags = agent.prep_xfer_dlist(remote, descs(info["addr"], count, 8), "DRAM")
                ltags = agent.prep_xfer_dlist("NIXL_INIT_AGENT",
                                              descs(dst.data_ptr(), count, 8), "DRAM")

                def nixl_read(lidx: np.ndarray, ridx: np.ndarray, llist=llist,
                              rlist=rlist) -> None:
                    h = agent.make_prepped_xfer("READ", llist, lidx, rlist, ridx, b"")
                    state = agent.transfer(h)
                    give_up = time.monotonic() + 60
                    while state == "PROC" and time.monotonic() < give_up:
                        state = agent.check_xfer_state(h)
                    agent.release_xfer_handle(h)
                    if state != "DONE":
                        raise RuntimeError(f"NIXL READ ended {state}")

                def nixl_reads(lidx: np.ndarray, ridx: np.ndarray, parts: int, llist=llist,
                               rlist=rlist) -> None:
                    """The same blocks as ``parts`` READs posted at once, then all awaited."""
                    hs = [agent.make_prepped_xfer("READ", llist, li, rlist, ri, b"")
                          for li, ri in zip(np.array_split(lidx, parts),
                                            np.array_split(ridx, parts), strict=True)]
                    states = [agent.transfer(h) for h in hs]
                    give_up = time.monotonic() + 60
                    while "PROC" in states and time.monotonic() < give_up:
                        states = [s if s != "PROC" else agent.check_xfer_state(h)
                                  for s, h in zip(states, hs, strict=True)]
                    for h in hs:
                        agent.release_xfer_handle(h)
                    if any(s != "DONE" for s in states):
                        raise RuntimeError(f"NIXL READs ended {states}")

                warm = np.arange(1, dtype=np.int64)
                nixl_read(warm, warm)  # first READ sets up the UCX endpoint
                for n in blocks:
                    nbytes = n * size
                    modes = {"contiguous": (np.arange(n, dtype=np.int64),
                                            np.arange(n, dtype=np.int64))}
                    if args.scattered and n > 1:
                        modes["scattered"] = (
                            np.array(rng.sample(range(max_blocks), n), dtype=np.int64),
                            np.array(rng.sample(range(max_blocks), n), dtype=np.int64))
                    row: dict[str, Any] = {"block_bytes": size, "blocks": n, "bytes": nbytes}
                    for mode, (lidx, ridx) in modes.items():
                        for k in {0, n - 1}:
                            dst_np[int(lidx[k]) * size:(int(lidx[k]) + 1) * size] = 0
                        secs, iters = repeat(lambda lidx=lidx, ridx=ridx: nixl_read(lidx, ridx),
                                              args)
                        # Check what arrived: block k of the READ holds remote block ridx[k].
                        for k in {0, n - 1}:
                            off = int(lidx[k]) * size
                            roff = int(ridx[k]) * size
                            want = (np.arange(roff, roff + size, dtype=np.int64) % 251
                                    ).astype(np.uint8)
                            if not np.array_equal(dst_np[off:off + size], want):
                                raise RuntimeError(f"READ {mode} n={n} B={size}: wrong bytes")
                        row[f"nixl_{mode}"] = {"seconds": secs, "iters": iters,
                                               "gb_per_s": nbytes / secs / 1e9,
                                               "descs_per_s": n / secs}
                        if mode == "contiguous":
                            # what validation adds: the READ of the blocks' tags, on its own
                            secs, iters = repeat(lambda lidx=lidx, ridx=ridx, lt=ltags,
                                                  rt=rtags: nixl_read(lidx, ridx, lt, rt), args)
                            row["nixl_tags_read"] = {
                                "seconds": secs, "iters": iters,
                                "over_blocks_read": secs / row["nixl_contiguous"]["seconds"]}
                        if mode == "contiguous" and n >= READS_IN_FLIGHT:
                            secs, iters = repeat(lambda lidx=lidx, ridx=ridx: nixl_reads(
                                lidx, ridx, READS_IN_FLIGHT), args)
                            row[f"nixl_{mode}_{READS_IN_FLIGHT}_in_flight"] = {
                                "seconds": secs, "iters": iters,
                                "gb_per_s": nbytes / secs / 1e9}
                        # memcpy of the same bytes (same gather for the scattered ids)
                        if mode == "contiguous":
                            def copy(nbytes=nbytes) -> None:
                                dst[:nbytes].copy_(src[:nbytes])
                        else:
                            dv, sv = dst_np.reshape(-1, size), src_np.reshape(-1, size)
                            pairs = list(zip(lidx.tolist(), ridx.tolist(), strict=True))

                            def copy(dv=dv, sv=sv, pairs=pairs) -> None:
                                for lb, rb in pairs:  # one memcpy per block, no temporary
                                    dv[lb] = sv[rb]
                        secs, iters = repeat(copy, args)
                        row[f"memcpy_{mode}"] = {"seconds": secs, "iters": iters,
                                                 "gb_per_s": nbytes / secs / 1e9}
                    # NIXL READ against process_vm_readv of the same bytes, interleaved
                    lidx, ridx = modes["contiguous"]
                    pair = interleaved({
                        "nixl": lambda lidx=lidx, ridx=ridx: nixl_read(lidx, ridx),
                        "cma": lambda nbytes=nbytes: cma.read(dst.data_ptr(), info["addr"],
                                                              nbytes)}, args)
                    for key, (secs, iters) in (("cma_contiguous", pair["cma"]),
                                               ("nixl_paired_with_cma", pair["nixl"])):
                        row[key] = {"seconds": secs, "iters": iters,
                                    "gb_per_s": nbytes / secs / 1e9}
                    row["nixl_over_cma"] = pair["cma"][0] / pair["nixl"][0]
                    if args.tcp:
                        view = memoryview(dst_np)

                        def over_tcp(nbytes=nbytes, view=view) -> None:
                            tcp.sendall(struct.pack("<QQ", 0, nbytes))
                            got = 0
                            while got < nbytes:
                                k = tcp.recv_into(view[got:nbytes])
                                if not k:
                                    raise RuntimeError("TCP peer closed")
                                got += k

                        secs, iters = repeat(over_tcp, args)
                        row["tcp_contiguous"] = {"seconds": secs, "iters": iters,
                                                 "gb_per_s": nbytes / secs / 1e9}
                    row["nixl_over_memcpy"] = (row["nixl_contiguous"]["gb_per_s"]
                                               / row["memcpy_contiguous"]["gb_per_s"])
                    results.append(row)
                    progress(f"transfer: {n:>5} x {size // KiB:>4} KiB: NIXL "
                             f"{row['nixl_contiguous']['gb_per_s']:.2f} GB/s, memcpy "
                             f"{row['memcpy_contiguous']['gb_per_s']:.2f} GB/s"
                             + (f", TCP {row['tcp_contiguous']['gb_per_s']:.2f} GB/s"
                                if args.tcp else ""))
                for dl in (rlist, llist, rtags, ltags):
                    agent.release_dlist_handle(dl)
        finally:
            tcp.close()
            agent.remove_remote_agent(remote)
            agent.deregister_memory(reg)
        peer_stats = peer.stats()
    big = [r for r in results if r["bytes"] >= 4 * 2**20]
    worst = min((r["nixl_over_memcpy"] for r in big), default=float("nan"))
    worst_cma = min((r["nixl_over_cma"] for r in big), default=float("nan"))
    goals = []
    if big:
        goals.append({"goal": "NIXL READ >= 0.7x in-memory copy bandwidth for transfers "
                              ">= 4 MiB (contiguous; worst point)", "value": round(worst, 3),
                      "reached": worst >= 0.7})
        goals.append({"goal": "NIXL READ >= 0.9x process_vm_readv of the same bytes for "
                              "transfers >= 4 MiB (contiguous, interleaved; worst point)",
                      "value": round(worst_cma, 3), "reached": worst_cma >= 0.9})
    return {
        "config": {"blocks": blocks, "block_bytes": sizes, "pool_bytes": pool,
                   "scattered": args.scattered, "tcp": args.tcp,
                   "min_seconds": args.min_seconds, "min_iters": args.min_iters,
                   "timing": "median per point; NIXL: make_prepped_xfer .. DONE, busy poll",
                   "memcpy": "contiguous: torch copy_ (torch.set_num_threads(1)); scattered: "
                             "one numpy row copy per block",
                   "tags_read": "what validating a load adds (protocol.md 9a): one READ "
                                "of an 8-byte tag per block, timed on its own",
                   "cma": "the same bytes from the peer with one process_vm_readv call (what "
                          "UCX's cma transport does for these READs), timed interleaved with a "
                          "NIXL READ of them (nixl_paired_with_cma; nixl_over_cma)",
                   "ucx_env": {k: v for k, v in sorted(os.environ.items())
                               if k.startswith(("UCX_", "KVBRIDGE_NIXL"))},
                   "backend": "NIXL UCX, DRAM to DRAM between two processes",
                   "nixl_progress_thread": True, "nixl_progress_delay_us": PROGRESS_DELAY_US,
                   "quick": args.quick},
        "results": results,
        "peer_process": {**peer_stats, "idle_cpu_per_s": peer_idle_cpu},
        "goals": goals,
        "load_average": {"before": load_before, "after": load_average()},
    }


def summary(r: dict[str, Any]) -> str:
    if r["config"].get("mode") == "netns":
        from kvbridge.tools.bench.transfer_netns import summary as netns_summary

        return netns_summary(r)
    lines = ["block  blocks      MiB  NIXL GB/s  scat GB/s  memcpy GB/s  TCP GB/s  "
             f"NIXL/memcpy  descs/s  {READS_IN_FLIGHT} READs GB/s  CMA GB/s  NIXL/CMA"]
    for x in r["results"]:
        split = x.get(f"nixl_contiguous_{READS_IN_FLIGHT}_in_flight", {}).get("gb_per_s",
                                                                            float("nan"))
        scat = x.get("nixl_scattered", {}).get("gb_per_s", float("nan"))
        tcp = x.get("tcp_contiguous", {}).get("gb_per_s", float("nan"))
        lines.append(f"{x['block_bytes'] // KiB:>4}K {x['blocks']:>7} "
                     f"{x['bytes'] / 2**20:>8.2f} {x['nixl_contiguous']['gb_per_s']:>10.2f} "
                     f"{scat:>10.2f} {x['memcpy_contiguous']['gb_per_s']:>12.2f} {tcp:>9.2f} "
                     f"{x['nixl_over_memcpy']:>12.2f} "
                     f"{x['nixl_contiguous']['descs_per_s']:>8.0f} {split:>13.2f} "
                     f"{x['cma_contiguous']['gb_per_s']:>9.2f} {x['nixl_over_cma']:>9.2f}")
    for x in r["results"]:
        if "nixl_tags_read" in x:
            t = x["nixl_tags_read"]
            lines.append(f"validating {x['blocks']} blocks of {x['block_bytes'] // KiB} KiB "
                         f"(a READ of their tags after them) adds {t['seconds'] * 1e6:.0f} us "
                         f"= {t['over_blocks_read']:.1%} of the blocks' READ")
    return "\n".join(lines + goal_lines(r))


def plot(r: dict[str, Any], path: Path) -> None:
    if r["config"].get("mode") == "netns":
        from kvbridge.tools.bench.transfer_netns import plot as netns_plot

        return netns_plot(r, path)
    plt = pyplot()
    sizes = r["config"]["block_bytes"]
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.6))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, size in enumerate(sizes):
        rows = [x for x in r["results"] if x["block_bytes"] == size]
        xs = [x["bytes"] / 2**20 for x in rows]
        c = colors[i % len(colors)]
        lab = f"{size // KiB} KiB"
        axes[0].plot(xs, [x["nixl_contiguous"]["gb_per_s"] for x in rows], "o-", color=c,
                     label=f"NIXL {lab}")
        if any("nixl_scattered" in x for x in rows):
            sc = [x for x in rows if "nixl_scattered" in x]
            axes[0].plot([x["bytes"] / 2**20 for x in sc],
                         [x["nixl_scattered"]["gb_per_s"] for x in sc], "x:", color=c,
                         label=f"NIXL scattered {lab}")
        axes[0].plot(xs, [x["memcpy_contiguous"]["gb_per_s"] for x in rows], "s--", color=c,
                     alpha=0.6, label=f"memcpy {lab}")
        axes[0].plot(xs, [x["cma_contiguous"]["gb_per_s"] for x in rows], "d-", color=c,
                     alpha=0.4, lw=0.8, label=f"process_vm_readv {lab}")
        if any("tcp_contiguous" in x for x in rows):
            axes[0].plot(xs, [x["tcp_contiguous"]["gb_per_s"] for x in rows], "^-.", color=c,
                         alpha=0.6, label=f"TCP {lab}")
        axes[2].plot(xs, [x["nixl_over_memcpy"] for x in rows], "o-", color=c,
                     label=f"/ memcpy {lab}")
        axes[2].plot(xs, [x["nixl_over_cma"] for x in rows], "d--", color=c,
                     label=f"/ process_vm_readv {lab}")
        axes[1].plot([x["blocks"] for x in rows],
                     [x["nixl_contiguous"]["descs_per_s"] for x in rows], "o-", color=c,
                     label=f"contiguous {lab}")
        if any("nixl_scattered" in x for x in rows):
            sc = [x for x in rows if "nixl_scattered" in x]
            axes[1].plot([x["blocks"] for x in sc], [x["nixl_scattered"]["descs_per_s"]
                                                     for x in sc], "x:", color=c,
                         label=f"scattered {lab}")
    axes[0].axvline(4, color="grey", lw=0.8, ls=":")
    axes[0].set(xscale="log", yscale="log", xlabel="MiB per transfer", ylabel="GB/s",
                title="bandwidth (median per point)")
    axes[1].set(xscale="log", yscale="log", xlabel="blocks per transfer",
                ylabel="blocks (descriptors) / s", title="NIXL descriptor rate")
    axes[2].axhline(0.7, color="grey", lw=0.8, ls=":", label="goal / memcpy 0.7 (from 4 MiB)")
    axes[2].axhline(0.9, color="black", lw=0.8, ls="--",
                    label="goal / process_vm_readv 0.9 (from 4 MiB)")
    axes[2].axvline(4, color="grey", lw=0.8, ls=":")
    axes[2].set(xscale="log", xlabel="MiB per transfer", ylabel="ratio",
                title="NIXL READ / memcpy and / process_vm_readv (contiguous)")
    axes[2].legend(fontsize=7)
    axes[0].legend(fontsize=6, ncol=2)
    axes[1].legend(fontsize=7)
    fig.suptitle("kvbridge NIXL READ between two processes (CPU memory) vs memcpy and TCP")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
