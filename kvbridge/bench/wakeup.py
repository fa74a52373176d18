"""``kvbridge bench wakeup``: a warm side-channel fetch on loopback, with the client's spin
on and off (kvbridge.handshake.nonblocking), on idle cores and on cores kept busy.

Why: a warm fetch is a round trip of a few tens of microseconds, and on a VM much of it
can be waking a sleeping core: the client's, while it waits for the reply, and the
server's. The client now spins (yielding) for up to ``SPIN_S`` before it sleeps; stock
vLLM's NIXL progress thread keeps a core busy all the time, which a plug-in that does not
spin is compared against (section 11c). This measures both effects on the real client and
a real side-channel process, http and https, every case every round, in turn.

*busy* cores: one process per core spinning at nice 19 (the lowest priority), as a
spinning thread of another program would.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvbridge.bench.common import apply_quick, load_average, progress, pyplot
from kvbridge.bench.report import goal_lines, percentiles

QUICK = {"fetches": 20, "rounds": 1}
METHODS = ("http", "https")
CORES = ("idle", "busy")
SPIN = ("spin", "no spin")
SPINNER = "import os\nos.nice(19)\nwhile True: pass\n"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--fetches", type=int, default=2000, help="warm fetches per case and round")
    p.add_argument("--rounds", type=int, default=3, help="rounds (every case in each)")


def _server(certs: Path | None) -> Any:
    from kvbridge.config import SideChannelConfig
    from kvbridge.handshake.factory import side_channel
    from kvbridge.handshake.payloads import PayloadStore

    tls = {} if certs is None else {"ssl_certfile": str(certs / "server.pem"),
                                    "ssl_keyfile": str(certs / "server.key")}
    config = SideChannelConfig(handshake_method="http", side_channel_port=0, **tls)
    store = PayloadStore("bench", "engine-0", "epoch-0", 1)
    store.set_payloads({(0, 0): os.urandom(2048)}, {(0, 0): {}})  # a NIXL payload's size
    server = side_channel(config, store, 0)  # its own process, as in vLLM and serve
    server.start()
    return server


def _fetches(port: int, certs: Path | None, n: int, spin: bool) -> list[float]:
    from kvbridge.config import TLSConfig
    from kvbridge.handshake import nonblocking
    from kvbridge.handshake.http_client import HttpHandshakeClient

    tls = None if certs is None else TLSConfig(ca_certs=str(certs / "ca.pem"))
    client = HttpHandshakeClient(10.0, None, None, tls=tls)
    spin_s = nonblocking.SPIN_S
    nonblocking.SPIN_S = spin_s if spin else 0.0
    try:
        client.fetch_body("127.0.0.1", port, 0)  # the connection, made once
        samples = []
        for _ in range(n):
            t0 = time.perf_counter()
            client.fetch_body("127.0.0.1", port, 0)
            samples.append(time.perf_counter() - t0)
        return samples
    finally:
        nonblocking.SPIN_S = spin_s
        client.close()


def _spinners() -> list[subprocess.Popen[bytes]]:
    procs = []
    for cpu in sorted(os.sched_getaffinity(0)):
        p = subprocess.Popen([sys.executable, "-c", SPINNER])
        os.sched_setaffinity(p.pid, {cpu})
        procs.append(p)
    return procs


def run(args: argparse.Namespace) -> dict[str, Any]:
    from kvbridge.testing.certs import write_certs

    apply_quick(args, QUICK)
    load_before = load_average()
    samples: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="kvbridge-bench-wakeup-") as t:
        certs = write_certs(Path(t), ("server",))
        servers = {m: _server(certs if m == "https" else None) for m in METHODS}
        try:
            for r in range(args.rounds):
                for cores in CORES:
                    spinners = _spinners() if cores == "busy" else []
                    try:
                        for method in METHODS:
                            for spin in SPIN:
                                key = f"{method}/{cores}/{spin}"
                                samples.setdefault(key, []).extend(_fetches(
                                    servers[method].port,
                                    certs if method == "https" else None,
                                    args.fetches, spin == "spin"))
                    finally:
                        for p in spinners:
                            p.kill()
                            p.wait()
                progress(f"wakeup: round {r + 1}/{args.rounds} done")
        finally:
            for s in servers.values():
                s.stop()
    us = {k: {q: v * 1000 for q, v in percentiles(s, (50, 90, 99)).items()} | {"n": len(s)}
          for k, s in samples.items()}
    return {
        "config": {"fetches": args.fetches, "rounds": args.rounds, "quick": args.quick,
                   "spin_s": _spin_s(), "order": "per round: idle then busy cores; per "
                   "core state: http then https, each with the spin then without",
                   "busy": "one process per core spinning at nice 19"},
        "warm_fetch_us": us,
        "goals": [],
        "load_average": {"before": load_before, "after": load_average()},
    }


def _spin_s() -> float:
    from kvbridge.handshake.nonblocking import SPIN_S

    return SPIN_S


def summary(r: dict[str, Any]) -> str:
    lines = ["warm fetch (us)        p50      p90      p99"]
    for key, s in r["warm_fetch_us"].items():
        lines.append(f"{key:20s} {s['p50']:8.1f} {s['p90']:8.1f} {s['p99']:8.1f}")
    return "\n".join(lines + goal_lines(r))


def plot(r: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    keys = list(r["warm_fetch_us"])
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.bar(range(len(keys)), [r["warm_fetch_us"][k]["p50"] for k in keys])
    ax.set_xticks(range(len(keys)), keys, rotation=30, ha="right")
    ax.set_ylabel("warm fetch p50 (us)")
    ax.set_title("Warm side-channel fetch: client spin, idle or busy cores (loopback)")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
