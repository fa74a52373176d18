"""``kvbridge bench handshake``: side-channel latency per method, warm and cold.

One server process holds a realistic metadata store (a NIXL agent + KV cache per
rank, TP 2) and serves it over ``zmq``, ``http`` and ``http`` + TLS, all with a token.
This process is the client:

* warm: one persistent client per method fetches one rank again and again (after a
  warm-up), the three methods interleaved in a shuffled order every round so drift
  of the machine hits them alike;
* cold: a new client (new connection, new TLS session) fetches one rank, then
  ``NixlAgent.connect`` adds the remote agent and prepares both descriptor lists, then
  disconnect and close: what a decode instance pays for a peer it has never seen.
"""

from __future__ import annotations

import argparse
import random
import socket
import tempfile
import time
from pathlib import Path
from typing import Any

from kvbridge.bench.common import Child, apply_quick, idle_cpu, load_average, progress, pyplot
from kvbridge.bench.peer import BENCH_MODEL, kv_shape_args, make_agents
from kvbridge.bench.report import goal_lines, percentiles
from kvbridge.testing.certs import write_certs

METHODS = ("zmq", "http", "https")
TOKEN = "bench-" + "x" * 26


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--warm", type=int, default=2000, help="warm fetches per method")
    p.add_argument("--warmup", type=int, default=100, help="warm-up fetches per method")
    p.add_argument("--cold", type=int, default=100, help="cold handshakes per method")
    p.add_argument("--tp", type=int, default=2, help="TP size of the server")
    kv_shape_args(p)


QUICK = {"warm": 30, "warmup": 5, "cold": 3, "layers": 4, "num_blocks": 8}


def _config(method: str, certs: Path):
    from kvbridge.config import SideChannelConfig

    tls = {"ssl_ca_certs": str(certs / "ca.pem")} if method == "https" else {}
    return SideChannelConfig.load(dict(handshake_method="zmq" if method == "zmq" else "http",
                                       token=TOKEN, handshake_timeout=10.0, **tls), environ={})


def _client(method: str, certs: Path, expected):
    from kvbridge.handshake import make_client

    return make_client(_config(method, certs), expected)


RAW = "http_raw_socket"


class _RawHttp:
    """Baseline, not a kvbridge client: the same GET over one keep-alive socket with no
    HTTP library, then the same envelope decode: what the server and the wire cost."""

    def __init__(self, port: int, expected):
        self.expected = expected
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.requests = [(f"GET /v1/kv/handshake/{r} HTTP/1.1\r\nhost: 127.0.0.1\r\n"
                          f"authorization: Bearer {TOKEN}\r\naccept: application/vnd.msgpack"
                          "\r\n\r\n").encode() for r in range(64)]

    def fetch(self, rank: int):
        from kvbridge.metadata import decode_envelope

        self.sock.sendall(self.requests[rank])
        buf = b""
        while b"\r\n\r\n" not in buf:
            buf += self.sock.recv(65536)
        head, _, body = buf.partition(b"\r\n\r\n")
        length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:"))
        while len(body) < length:
            body += self.sock.recv(65536)
        if not head.startswith(b"HTTP/1.1 200"):
            raise RuntimeError(head[:100])
        return decode_envelope(body, self.expected)

    def close(self) -> None:
        self.sock.close()


def _stats(samples: list[float]) -> dict[str, float]:
    out = percentiles(samples)
    out["mean"] = 1000 * sum(samples) / len(samples)
    out["n"] = len(samples)
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    from kvbridge._nixl import PROGRESS_DELAY_US
    from kvbridge.metadata import compat_of
    from kvbridge.tp_mapping import plan_reads

    apply_quick(args, QUICK)
    rng = random.Random(0)
    load_before = load_average()
    with tempfile.TemporaryDirectory(prefix="kvbridge-bench-") as t:
        certs = write_certs(Path(t))
        shape = ["--layers", str(args.layers), "--kv-heads", str(args.kv_heads), "--head-dim",
                 str(args.head_dim), "--block-size", str(args.block_size), "--num-blocks",
                 str(args.num_blocks)]
        progress(f"handshake: starting the server (TP {args.tp}, {args.layers} layers, "
                 f"{args.num_blocks} blocks per rank)")
        with Child("sidechannel", "--tp", str(args.tp), "--methods", ",".join(METHODS),
                   "--token", TOKEN, "--certs", str(certs), *shape) as server:
            ports = server.info["ports"]
            server_idle_cpu = idle_cpu(server.pid, 0.5)
            local = make_agents(args, args.tp, count=1)[0]
            expected = compat_of(BENCH_MODEL, local.kv)
            clients = {m: _client(m, certs, expected) for m in METHODS}
            raw = _RawHttp(ports["http"], expected)
            warm: dict[str, list[float]] = {m: [] for m in (*METHODS, RAW)}
            try:
                progress(f"handshake: warm-up ({args.warmup} per method)")
                for i in range(args.warmup):
                    for m in METHODS:
                        clients[m].fetch("127.0.0.1", ports[m], i % args.tp)
                    raw.fetch(i % args.tp)
                progress(f"handshake: warm fetches ({args.warm} per method, interleaved)")
                order = [*METHODS, RAW]
                for i in range(args.warm):
                    rng.shuffle(order)
                    for m in order:
                        t0 = time.perf_counter()
                        if m == RAW:
                            ranks = raw.fetch(i % args.tp)
                        else:
                            ranks = clients[m].fetch("127.0.0.1", ports[m], i % args.tp)
                        warm[m].append(time.perf_counter() - t0)
                        assert ranks[0].tp_rank == i % args.tp
                    if (i + 1) % max(1, args.warm // 4) == 0:
                        progress(f"handshake: warm {i + 1}/{args.warm}")
            finally:
                for c in clients.values():
                    c.close()
                raw.close()
            order = list(METHODS)
            progress(f"handshake: cold handshakes ({args.cold} per method, interleaved)")
            cold: dict[str, dict[str, list[float]]] = {
                m: {"total": [], "fetch": [], "connect": []} for m in METHODS}
            for i in range(args.cold):
                rank = i % args.tp
                slices = plan_reads(rank, args.tp, args.tp, args.kv_heads)
                rng.shuffle(order)
                for m in order:
                    t0 = time.perf_counter()
                    client = _client(m, certs, expected)
                    meta = client.fetch("127.0.0.1", ports[m], rank)[0]
                    t1 = time.perf_counter()
                    peer = local.connect(meta, slices)
                    t2 = time.perf_counter()
                    local.disconnect(peer)
                    client.close()
                    t3 = time.perf_counter()
                    cold[m]["total"].append(t3 - t0)
                    cold[m]["fetch"].append(t1 - t0)
                    cold[m]["connect"].append(t2 - t1)
            server_stats = server.stats()
            info = server.info
    warm_stats = {m: _stats(v) for m, v in warm.items()}
    cold_stats = {m: {k: _stats(v) for k, v in parts.items()} for m, parts in cold.items()}
    zmq_warm, zmq_cold = warm_stats["zmq"]["p50"], cold_stats["zmq"]["total"]["p50"]
    http_ratio = warm_stats["http"]["p50"] / zmq_warm
    https_ratio = warm_stats["https"]["p50"] / zmq_warm
    http_over_raw = warm_stats["http"]["p50"] / warm_stats[RAW]["p50"]
    cold_http = cold_stats["http"]["total"]["p50"] / zmq_cold
    cold_https = cold_stats["https"]["total"]["p50"] / zmq_cold
    descs = 2 * args.layers * args.num_blocks * len(plan_reads(0, args.tp, args.tp,
                                                               args.kv_heads))
    return {
        "config": {"tp": args.tp, "layers": args.layers, "kv_heads": args.kv_heads,
                   "head_dim": args.head_dim, "block_size": args.block_size,
                   "num_blocks": args.num_blocks, "dtype": "float16", "warm": args.warm,
                   "warmup": args.warmup, "cold": args.cold, "token": True,
                   "https": "TLS, server cert verified against a trustme CA",
                   "descriptors_prepared_per_cold_handshake": 2 * descs,
                   "nixl_progress_delay_us": PROGRESS_DELAY_US, "quick": args.quick},
        "metadata": {k: info[k] for k in ("envelope_bytes_per_rank",
                                          "agent_metadata_bytes_per_rank",
                                          "envelope_bytes_all_ranks")},
        "warm_ms": warm_stats,
        "cold_ms": cold_stats,
        "ratios": {"http_over_zmq_warm_p50": http_ratio, "https_over_zmq_warm_p50": https_ratio,
                   "http_raw_socket_over_zmq_warm_p50": warm_stats[RAW]["p50"] / zmq_warm,
                   "http_over_raw_socket_warm_p50": http_over_raw,
                   "http_over_zmq_cold_p50": cold_http, "https_over_zmq_cold_p50": cold_https},
        "goals": [
            {"goal": "warm http p50 <= 1.0x zmq p50", "value": round(http_ratio, 3),
             "reached": http_ratio <= 1.0},
            {"goal": "warm http p50 <= 2x the raw-socket baseline", "value": round(http_over_raw, 3),
             "reached": http_over_raw <= 2.0},
            {"goal": "cold http p50 <= 1.2x zmq", "value": round(cold_http, 3),
             "reached": cold_http <= 1.2},
            {"goal": "cold https p50 <= 1.5x zmq", "value": round(cold_https, 3),
             "reached": cold_https <= 1.5},
        ],
        "server_process": {**server_stats, "idle_cpu_per_s": server_idle_cpu},
        "load_average": {"before": load_before, "after": load_average()},
    }


def summary(r: dict[str, Any]) -> str:
    lines = [f"metadata per rank: {r['metadata']['envelope_bytes_per_rank']} bytes "
             f"(NIXL agent metadata {r['metadata']['agent_metadata_bytes_per_rank']})",
             "method   warm p50/p90/p99 (ms)       cold p50/p90/p99 (ms)"]
    for m in METHODS:
        w, c = r["warm_ms"][m], r["cold_ms"][m]["total"]
        lines.append(f"{m:<7} {w['p50']:7.3f} {w['p90']:7.3f} {w['p99']:7.3f}    "
                     f"{c['p50']:7.2f} {c['p90']:7.2f} {c['p99']:7.2f}")
    w = r["warm_ms"][RAW]
    lines.append(f"baseline: same GET on a raw keep-alive socket (no HTTP library) "
                 f"{w['p50']:.3f} {w['p90']:.3f} {w['p99']:.3f}")
    return "\n".join(lines + goal_lines(r))


def plot(r: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    qs = ("p50", "p90", "p99")
    width = 0.25
    for ax, key, title in ((axes[0], "warm_ms", "warm fetch (persistent client)"),
                           (axes[1], "cold_ms", "cold handshake (new client + NIXL connect)")):
        names = [*METHODS, RAW] if key == "warm_ms" else list(METHODS)
        for i, q in enumerate(qs):
            vals = [r[key][m][q] if key == "warm_ms" else r[key][m]["total"][q] for m in names]
            xs = [j + (i - 1) * width for j in range(len(names))]
            bars = ax.bar(xs, vals, width, label=q)
            ax.bar_label(bars, fmt="%.2f", fontsize=7)
        ax.set_xticks(range(len(names)), [n.replace("_", "\n", 1) for n in names])
        if key == "warm_ms":  # goals: http p50 <= zmq p50 and <= 2x the raw socket's
            ax.axhline(r[key]["zmq"]["p50"], color="grey", lw=0.8, ls=":",
                       label="goal: http p50 <= zmq p50")
            ax.axhline(2 * r[key][RAW]["p50"], color="black", lw=0.8, ls="--",
                       label="goal: http p50 <= 2x raw p50")
        else:
            zmq = r[key]["zmq"]["total"]["p50"]
            ax.axhline(1.2 * zmq, color="grey", lw=0.8, ls=":", label="goal: http <= 1.2x zmq")
            ax.axhline(1.5 * zmq, color="black", lw=0.8, ls="--",
                       label="goal: https <= 1.5x zmq")
        ax.set_ylabel("ms")
        ax.set_title(title)
        ax.legend(fontsize=7)
    md = r["metadata"]["envelope_bytes_per_rank"][0]
    fig.suptitle(f"kvbridge handshake, TP {r['config']['tp']}, {md} B metadata per rank "
                 f"(http/zmq warm p50 = {r['ratios']['http_over_zmq_warm_p50']:.2f}x)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
