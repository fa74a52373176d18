"""``kvbridge bench handshake``: side-channel latency per method, warm and cold.

One server process holds a realistic metadata store (a NIXL agent + KV cache per
rank, TP 2) and serves it over ``zmq``, ``http`` and ``http`` + TLS, all with a token.
This process is the client:

* warm: one persistent client per method fetches one rank again and again (after a
  warm-up), the three methods interleaved in a shuffled order every round so drift
  of the machine hits them alike;
* handshakes (each: fetch one rank, then ``NixlAgent.connect`` adds the remote agent and
  prepares both descriptor lists, then disconnect), interleaved the same way, three cases
  per method:

  - ``cold``: a peer never met: a new client (new connection; for https no TLS session
    to resume, a full handshake);
  - ``known``: a peer the client has talked to (after prewarm, or kept by keep-warm): the
    worker's persistent client, whose keep-alive connection is still open;
  - ``known_idle``: a known peer whose connection was closed while idle (the peer's
    keep-alive timeout, no keep-warm): the persistent client reconnects, and https resumes
    the TLS session;

* keep-warm: what one keep-warm request costs (``warm()`` on the kept connection), and
  one after the connection was closed (a resumed reconnect);
* the TLS stack's cost for an unknown peer, split with bare sockets (no kvbridge client):
  TCP connect, TLS handshake full and resumed, and the first GET on the new connection.
"""

from __future__ import annotations

import argparse
import random
import socket
import ssl
import tempfile
import time
from pathlib import Path
from typing import Any

from kvbridge.tools.bench.common import Child, apply_quick, idle_cpu, load_average, progress, pyplot
from kvbridge.tools.bench.peer import BENCH_MODEL, kv_shape_args, make_agents
from kvbridge.tools.bench.report import goal_lines, percentiles
from kvbridge.tools.testing.certs import write_certs

METHODS = ("zmq", "http", "https")
TOKEN = "bench-" + "x" * 26


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--warm", type=int, default=2000, help="warm fetches per method")
    p.add_argument("--warmup", type=int, default=100, help="warm-up fetches per method")
    p.add_argument("--cold", type=int, default=100,
                   help="handshakes per method and case (cold, known, known_idle)")
    p.add_argument("--tp", type=int, default=2, help="TP size of the server")
    kv_shape_args(p)


QUICK = {"warm": 30, "warmup": 5, "cold": 3, "layers": 4, "num_blocks": 8}


def _config(method: str, certs: Path):
    from kvbridge.config import SideChannelConfig

    tls = {"ssl_ca_certs": str(certs / "ca.pem")} if method == "https" else {}
    return SideChannelConfig.load(dict(handshake_method="zmq" if method == "zmq" else "http",
                                       token=TOKEN, handshake_timeout=10.0,
                                       trusted_side_channels="127.0.0.1", **tls), environ={})


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


CASES = ("cold", "known", "known_idle")


def _drop_idle(client, port: int) -> None:
    """Close the client's idle connections to the peer, as the peer's keep-alive does
    (zmq keeps none: a DEALER per fetch)."""
    for sock in getattr(client, "idle_sockets", lambda *_: [])("127.0.0.1", port):
        socket.socket.shutdown(sock, socket.SHUT_RDWR)


def _forget_session(method: str, certs: Path, port: int) -> None:
    """Make the peer unknown to the shared TLS session cache (next connection: full)."""
    from kvbridge.handshake.http.tls_sessions import tls_sessions

    state = tls_sessions(_config(method, certs).tls)
    with state.lock:
        state.sessions.pop(("127.0.0.1", port), None)


def _get(sock: socket.socket, port: int) -> None:
    sock.sendall((f"GET /v1/kv/handshake/0 HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\n"
                  f"authorization: Bearer {TOKEN}\r\naccept: application/vnd.msgpack"
                  "\r\n\r\n").encode())
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = sock.recv(65536)
        if not chunk:
            raise RuntimeError("the server closed the connection")
        buf += chunk
    head, _, body = buf.partition(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.1 200"):
        raise RuntimeError(head[:100])
    length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    while len(body) < length:
        body += sock.recv(65536)


def _tls_split(https_port: int, http_port: int, certs: Path, rounds: int,
               rng: random.Random) -> dict[str, list[float]]:
    """A new connection to the bench's side channel with bare sockets and ``ssl``, timed per
    part: TCP connect, TLS handshake (full: no session; resumed: the last one's), the first
    GET on the connection (TLS and plain)."""
    ctx = ssl.create_default_context(cafile=str(certs / "ca.pem"))
    out: dict[str, list[float]] = {k: [] for k in (
        "tcp_connect", "tls_full", "tls_resumed", "first_get_tls", "first_get_plain")}
    session = None
    kinds = ["full", "resumed", "plain"]
    for _ in range(rounds):
        rng.shuffle(kinds)
        for kind in kinds:
            port = http_port if kind == "plain" else https_port
            t0 = time.perf_counter()
            raw = socket.create_connection(("127.0.0.1", port))
            raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            t1 = time.perf_counter()
            out["tcp_connect"].append(t1 - t0)
            if kind == "plain":
                _get(raw, port)
                out["first_get_plain"].append(time.perf_counter() - t1)
                raw.close()
                continue
            resume = session if kind == "resumed" else None
            sock = ctx.wrap_socket(raw, server_hostname="127.0.0.1", session=resume)
            t2 = time.perf_counter()
            assert sock.session_reused == (resume is not None), kind
            out[f"tls_{kind}"].append(t2 - t1)
            _get(sock, port)
            out["first_get_tls"].append(time.perf_counter() - t2)
            if kind == "full":
                session = sock.session  # TLS 1.3 tickets arrive with the first reply
            sock.close()
    return out


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
            progress(f"handshake: handshakes ({args.cold} per method and case, interleaved)")
            cases = [(m, c) for m in METHODS for c in CASES] + [(m, "keep_warm") for m in
                                                                 ("http", "https")]
            hs: dict[str, dict[str, dict[str, list[float]]]] = {
                c: {m: {"total": [], "fetch": [], "connect": []} for m in METHODS}
                for c in CASES}
            keep_warm: dict[str, dict[str, list[float]]] = {
                m: {"kept": [], "reconnect": []} for m in ("http", "https")}
            kept = {m: _client(m, certs, expected) for m in METHODS}
            idle = {m: _client(m, certs, expected) for m in METHODS}
            try:
                for m in METHODS:  # both have met the peer: a connection (and TLS session)
                    kept[m].fetch("127.0.0.1", ports[m], 0)
                    idle[m].fetch("127.0.0.1", ports[m], 0)
                for i in range(args.cold):
                    rank = i % args.tp
                    slices = plan_reads(rank, args.tp, args.tp, args.kv_heads)
                    rng.shuffle(cases)
                    for m, case in cases:
                        if case == "keep_warm":
                            c = kept[m]
                            t0 = time.perf_counter()
                            assert c.warm("127.0.0.1", ports[m])
                            keep_warm[m]["kept"].append(time.perf_counter() - t0)
                            _drop_idle(idle[m], ports[m])
                            t0 = time.perf_counter()
                            assert idle[m].warm("127.0.0.1", ports[m])
                            keep_warm[m]["reconnect"].append(time.perf_counter() - t0)
                            continue
                        if case == "cold":
                            if m == "https":  # a peer never met: no session to resume
                                _forget_session(m, certs, ports[m])
                            c = None
                        elif case == "known_idle":
                            _drop_idle(idle[m], ports[m])  # as the peer's keep-alive does
                            c = idle[m]
                        else:
                            c = kept[m]
                        t0 = time.perf_counter()
                        client = c or _client(m, certs, expected)
                        meta = client.fetch("127.0.0.1", ports[m], rank)[0]
                        t1 = time.perf_counter()
                        peer = local.connect(meta, slices)
                        t2 = time.perf_counter()
                        local.disconnect(peer)
                        if c is None:
                            client.close()
                        t3 = time.perf_counter()
                        hs[case][m]["total"].append(t3 - t0)
                        hs[case][m]["fetch"].append(t1 - t0)
                        hs[case][m]["connect"].append(t2 - t1)
                    if (i + 1) % max(1, args.cold // 4) == 0:
                        progress(f"handshake: handshakes {i + 1}/{args.cold}")
            finally:
                for c in (*kept.values(), *idle.values()):
                    c.close()
            progress(f"handshake: the TLS stack's cost, bare sockets ({args.cold} rounds)")
            tls_split = _tls_split(ports["https"], ports["http"], certs, args.cold, rng)
            server_stats = server.stats()
            info = server.info
    warm_stats = {m: _stats(v) for m, v in warm.items()}
    hs_stats = {c: {m: {k: _stats(v) for k, v in parts.items()} for m, parts in per.items()}
                for c, per in hs.items()}
    cold_stats = hs_stats["cold"]
    zmq_warm, zmq_cold = warm_stats["zmq"]["p50"], cold_stats["zmq"]["total"]["p50"]
    http_ratio = warm_stats["http"]["p50"] / zmq_warm
    https_ratio = warm_stats["https"]["p50"] / zmq_warm
    http_over_raw = warm_stats["http"]["p50"] / warm_stats[RAW]["p50"]
    cold_http = cold_stats["http"]["total"]["p50"] / zmq_cold
    cold_https = cold_stats["https"]["total"]["p50"] / zmq_cold
    known_https = hs_stats["known"]["https"]["total"]["p50"] / zmq_cold
    descs = 2 * args.layers * args.num_blocks * len(plan_reads(0, args.tp, args.tp,
                                                               args.kv_heads))
    return {
        "config": {"tp": args.tp, "layers": args.layers, "kv_heads": args.kv_heads,
                   "head_dim": args.head_dim, "block_size": args.block_size,
                   "num_blocks": args.num_blocks, "dtype": "float16", "warm": args.warm,
                   "warmup": args.warmup, "cold": args.cold, "token": True,
                   "https": "TLS, server cert verified against a trustme CA",
                   "cases": {"cold": "a peer never met: new client, https a full TLS handshake",
                             "known": "a peer met before, its connection kept (keep-warm)",
                             "known_idle": "a peer met before, its connection closed while "
                                           "idle: reconnect, https resumes the TLS session"},
                   "descriptors_prepared_per_cold_handshake": 2 * descs,
                   "nixl_progress_delay_us": PROGRESS_DELAY_US, "quick": args.quick},
        "metadata": {k: info[k] for k in ("envelope_bytes_per_rank",
                                          "agent_metadata_bytes_per_rank",
                                          "envelope_bytes_all_ranks")},
        "warm_ms": warm_stats,
        "cold_ms": cold_stats,
        "known_ms": hs_stats["known"],
        "known_idle_ms": hs_stats["known_idle"],
        "keep_warm_ms": {m: {k: _stats(v) for k, v in parts.items()}
                         for m, parts in keep_warm.items()},
        "tls_split_ms": {k: _stats(v) for k, v in tls_split.items()},
        "ratios": {"http_over_zmq_warm_p50": http_ratio, "https_over_zmq_warm_p50": https_ratio,
                   "http_raw_socket_over_zmq_warm_p50": warm_stats[RAW]["p50"] / zmq_warm,
                   "http_over_raw_socket_warm_p50": http_over_raw,
                   "http_over_zmq_cold_p50": cold_http, "https_over_zmq_cold_p50": cold_https,
                   **{f"{m}_known_over_zmq_cold_p50":
                      hs_stats["known"][m]["total"]["p50"] / zmq_cold for m in METHODS},
                   **{f"{m}_known_idle_over_zmq_cold_p50":
                      hs_stats["known_idle"][m]["total"]["p50"] / zmq_cold for m in METHODS}},
        "goals": [
            {"goal": "warm http p50 <= 1.0x zmq p50", "value": round(http_ratio, 3),
             "reached": http_ratio <= 1.0},
            {"goal": "warm http p50 <= 2x the raw-socket baseline", "value": round(http_over_raw, 3),
             "reached": http_over_raw <= 2.0},
            {"goal": "cold http p50 <= 1.2x zmq", "value": round(cold_http, 3),
             "reached": cold_http <= 1.2},
            {"goal": "cold https to a known peer p50 <= 1.5x cold zmq",
             "value": round(known_https, 3), "reached": known_https <= 1.5},
        ],
        "server_process": {**server_stats, "idle_cpu_per_s": server_idle_cpu},
        "load_average": {"before": load_before, "after": load_average()},
    }


def summary(r: dict[str, Any]) -> str:
    lines = [f"metadata per rank: {r['metadata']['envelope_bytes_per_rank']} bytes "
             f"(NIXL agent metadata {r['metadata']['agent_metadata_bytes_per_rank']})",
             "method   warm p50/p90/p99 (ms)       handshake p50 (ms): cold / known / "
             "known, connection closed while idle"]
    for m in METHODS:
        w = r["warm_ms"][m]
        c, k, i = (r[key][m]["total"]["p50"] for key in ("cold_ms", "known_ms", "known_idle_ms"))
        lines.append(f"{m:<7} {w['p50']:7.3f} {w['p90']:7.3f} {w['p99']:7.3f}    "
                     f"{c:7.2f} {k:7.2f} {i:7.2f}")
    w = r["warm_ms"][RAW]
    lines.append(f"baseline: same GET on a raw keep-alive socket (no HTTP library) "
                 f"{w['p50']:.3f} {w['p90']:.3f} {w['p99']:.3f}")
    kw = r["keep_warm_ms"]["https"]
    lines.append(f"keep-warm request (https) p50: {kw['kept']['p50']:.3f} ms on the kept "
                 f"connection, {kw['reconnect']['p50']:.3f} ms with a resumed reconnect")
    t = r["tls_split_ms"]
    lines.append("new connection, bare sockets, p50 ms: TCP connect "
                 f"{t['tcp_connect']['p50']:.3f}, TLS full {t['tls_full']['p50']:.3f}, "
                 f"TLS resumed {t['tls_resumed']['p50']:.3f}, first GET TLS "
                 f"{t['first_get_tls']['p50']:.3f} / plain {t['first_get_plain']['p50']:.3f}")
    return "\n".join(lines + goal_lines(r))


def plot(r: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.4))
    qs = ("p50", "p90", "p99")
    width = 0.25
    ax = axes[0]
    names = [*METHODS, RAW]
    for i, q in enumerate(qs):
        vals = [r["warm_ms"][m][q] for m in names]
        xs = [j + (i - 1) * width for j in range(len(names))]
        bars = ax.bar(xs, vals, width, label=q)
        ax.bar_label(bars, fmt="%.2f", fontsize=7)
    ax.set_xticks(range(len(names)), [n.replace("_", "\n", 1) for n in names])
    # goals: http p50 <= zmq p50 and <= 2x the raw socket's
    ax.axhline(r["warm_ms"]["zmq"]["p50"], color="grey", lw=0.8, ls=":",
               label="goal: http p50 <= zmq p50")
    ax.axhline(2 * r["warm_ms"][RAW]["p50"], color="black", lw=0.8, ls="--",
               label="goal: http p50 <= 2x raw p50")
    ax.set_ylabel("ms")
    ax.set_title("warm fetch (persistent client)")
    ax.legend(fontsize=7)
    ax = axes[1]
    cases = (("cold_ms", "cold: unknown peer"), ("known_ms", "known peer, connection kept"),
             ("known_idle_ms", "known peer, closed while idle"))
    for i, (key, label) in enumerate(cases):
        vals = [r[key][m]["total"]["p50"] for m in METHODS]
        xs = [j + (i - 1) * width for j in range(len(METHODS))]
        bars = ax.bar(xs, vals, width, label=label)
        ax.bar_label(bars, fmt="%.2f", fontsize=7)
    ax.set_xticks(range(len(METHODS)), list(METHODS))
    zmq = r["cold_ms"]["zmq"]["total"]["p50"]
    ax.axhline(1.2 * zmq, color="grey", lw=0.8, ls=":", label="goal: cold http <= 1.2x cold zmq")
    ax.axhline(1.5 * zmq, color="black", lw=0.8, ls="--",
               label="goal: https, known peer <= 1.5x cold zmq")
    ax.set_ylabel("ms (p50)")
    ax.set_title("handshake: fetch + NIXL connect")
    ax.legend(fontsize=7)
    md = r["metadata"]["envelope_bytes_per_rank"][0]
    fig.suptitle(f"kvbridge handshake, TP {r['config']['tp']}, {md} B metadata per rank "
                 f"(http/zmq warm p50 = {r['ratios']['http_over_zmq_warm_p50']:.2f}x)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
