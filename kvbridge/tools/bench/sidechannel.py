"""``kvbridge bench sidechannel``: a herd of concurrent handshake clients against one
``http`` side-channel server process (plain and TLS).

The server process (``kvbridge.tools.bench.peer sidechannel``) serves a TP 2 metadata store
(real NIXL agents) with a token. This process runs the herd: N clients in flight, each
with its own keep-alive connection, each asking for one rank again and again for a fixed
time (longer if needed, so that a window holds at least one reply per client). The clients
are bare asyncio protocols on uvloop (no HTTP library, no task per request) so that the
single client process, which shares the 2 cores with the server, is as little of a
bottleneck as it can be.

Reported per level: handshakes/s (wall clock), the server's CPU seconds during the window
and handshakes per server CPU second (what one core can do), p50/p99 latency, errors, and
the server's peak RSS (VmHWM).

``--load-generator wrk`` measures with wrk (C, Debian's ``wrk`` package) instead: wrk
pinned to core 0 with one thread and N connections, the server process (all its threads)
pinned to core 1 with ``taskset``, the token in a header; latency percentiles from wrk's
own histogram, errors = wrk's connect/read/write/timeout errors plus non-2xx answers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import shutil
import ssl
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import uvloop

from kvbridge.tools.bench.common import (
    Child,
    apply_quick,
    idle_cpu,
    load_average,
    proc_stats,
    progress,
    pyplot,
)
from kvbridge.tools.bench.report import goal_lines, percentiles
from kvbridge.tools.testing.certs import write_certs

TOKEN = "bench-" + "y" * 26
PATH = "/v1/kv/handshake"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--concurrency", default="64,256,1024", help="clients in flight, per level")
    p.add_argument("--duration", type=float, default=8.0, help="seconds per level")
    p.add_argument("--schemes", default="http,https", help="http and/or https (TLS)")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds one request may take")
    p.add_argument("--load-generator", choices=["python", "wrk"], default="python",
                   help="python: an asyncio herd in this process; wrk: wrk on core 0, the "
                        "server on core 1 (apt-get install wrk)")


QUICK = {"concurrency": "8,32", "duration": 0.4}


class _Level:
    def __init__(self) -> None:
        self.latencies: list[float] = []
        self.connect: list[float] = []
        self.errors: dict[str, int] = {}
        self.measuring = False
        self.stop = False

    def error(self, what: str) -> None:
        self.errors[what] = self.errors.get(what, 0) + 1


class _HerdClient(asyncio.Protocol):
    """One client of the herd: sends the GET, waits for the whole reply, sends the next.
    A bare protocol (no streams, no task per request) keeps the herd's own CPU low."""

    def __init__(self, request: bytes, level: _Level, done: asyncio.Future):
        self.request, self.level, self.done = request, level, done
        self.buf = bytearray()
        self.need = -1  # bytes of head + body once the head is in
        self.status = 0
        self.sent = 0.0
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def send(self) -> None:
        self.sent = time.perf_counter()
        assert self.transport is not None
        self.transport.write(self.request)

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if self.need < 0:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = bytes(self.buf[:end]).split(b"\r\n")
            self.status = int(head[0].split()[1])
            length = next((int(line.split(b":", 1)[1]) for line in head[1:]
                           if line[:15].lower() == b"content-length:"), 0)
            self.need = end + 4 + length
        if len(self.buf) < self.need:
            return
        level = self.level
        if level.measuring:
            if self.status == 200 and self.need > 0:
                level.latencies.append(time.perf_counter() - self.sent)
            else:
                level.error(f"status {self.status}")
        del self.buf[:self.need]
        self.need = -1
        if level.stop:
            self.finish()
        else:
            self.send()

    def finish(self, error: str | None = None) -> None:
        if error is not None:
            self.level.error(error)
        if self.transport is not None:
            self.transport.close()
        if not self.done.done():
            self.done.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.done.done():
            if not self.level.stop:
                self.level.error(f"request: connection lost ({type(exc).__name__})")
            self.done.set_result(None)


async def _client(i: int, port: int, ctx: ssl.SSLContext | None, level: _Level,
                  started: asyncio.Event, go: asyncio.Event, timeout: float) -> None:
    loop = asyncio.get_running_loop()
    request = (f"GET {PATH}/{i % 2} HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\n"
               f"authorization: Bearer {TOKEN}\r\naccept: application/vnd.msgpack\r\n\r\n"
               ).encode()
    done = loop.create_future()
    t0 = time.perf_counter()
    try:
        _, client = await asyncio.wait_for(loop.create_connection(
            lambda: _HerdClient(request, level, done), "127.0.0.1", port, ssl=ctx,
            server_hostname="127.0.0.1" if ctx else None), timeout)
    except Exception as e:
        level.error(f"connect: {type(e).__name__}")
        started.set()
        return
    level.connect.append(time.perf_counter() - t0)
    await go.wait()
    client.send()
    await done


async def _level(port: int, ctx: ssl.SSLContext | None, n: int, duration: float,
                 timeout: float, server: _Process) -> dict[str, Any]:
    level = _Level()
    go = asyncio.Event()
    started = asyncio.Event()
    t_connect = time.perf_counter()
    tasks = [asyncio.create_task(_client(i, port, ctx, level, started, go, timeout))
             for i in range(n)]
    # Wait until every client has connected (or failed to), boundedly.
    deadline = time.monotonic() + 60
    while (len(level.connect) + sum(level.errors.values()) < n
           and time.monotonic() < deadline):
        await asyncio.sleep(0.02)
    connect_wall = time.perf_counter() - t_connect
    go.set()
    await asyncio.sleep(min(1.0, duration / 4))  # ramp-up, not measured
    before = server.stats()
    t0 = time.perf_counter()
    level.measuring = True
    await asyncio.sleep(duration)
    # A window holds at least one reply per client: on a starved machine a short window
    # could otherwise measure nothing at all (bounded by the request timeout).
    end = time.perf_counter() + timeout
    while len(level.latencies) < n and time.perf_counter() < end and not level.errors:
        await asyncio.sleep(0.05)
    level.measuring = False
    wall = time.perf_counter() - t0
    after = server.stats()
    level.stop = True
    _, late = await asyncio.wait(tasks, timeout=timeout + 5)
    for _ in late:  # a reply that never came
        level.error("request: no reply")
    done = len(level.latencies)
    cpu = after["cpu_seconds"] - before["cpu_seconds"]
    return {
        "clients": n, "handshakes": done, "seconds": wall,
        "handshakes_per_s": done / wall,
        "server_cpu_seconds": cpu,
        "server_cpu_utilisation": cpu / wall,
        "handshakes_per_server_cpu_second": done / cpu if cpu > 0 else float("nan"),
        "latency_ms": {**percentiles(level.latencies), "mean": 1000 * sum(level.latencies)
                       / max(1, done)},
        "connect_ms": percentiles(level.connect), "connect_wall_s": connect_wall,
        "errors": sum(level.errors.values()), "error_kinds": level.errors,
        "server_peak_rss_mib": after["peak_rss_mib"], "server_rss_mib": after["rss_mib"],
    }


# wrk's Lua hooks: the token header, and one JSON line with the figures at the end.
_WRK_SCRIPT = """
wrk.headers["Authorization"] = "Bearer %s"
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    '{"requests":%%d,"duration_us":%%d,"p50_us":%%d,"p90_us":%%d,"p99_us":%%d,' ..
    '"mean_us":%%f,"max_us":%%d,"connect":%%d,"read":%%d,"write":%%d,"status":%%d,' ..
    '"timeout":%%d}\\n', summary.requests, summary.duration, latency:percentile(50),
    latency:percentile(90), latency:percentile(99), latency.mean, latency.max,
    e.connect, e.read, e.write, e.status, e.timeout))
end
"""


class _Process:
    """The process whose CPU and memory a level measures (a scheme's server)."""

    def __init__(self, pid: int):
        self.pid = pid

    def stats(self) -> dict[str, float]:
        return proc_stats(self.pid)


def _pin(pid: int, core: int) -> None:
    """Every thread of ``pid`` on ``core`` (the server has NIXL's and uvicorn's threads)."""
    subprocess.run(["taskset", "-a", "-p", "-c", str(core), str(pid)], check=True,
                   capture_output=True)


def _wrk_level(url: str, n: int, duration: float, timeout: float, script: Path,
               server: _Process) -> dict[str, Any]:
    before = server.stats()
    t0 = time.perf_counter()
    out = subprocess.run(
        ["taskset", "-c", "0", "wrk", "-t1", f"-c{n}", f"-d{max(1, round(duration))}s",
         f"--timeout={max(1, round(timeout))}s", "-s", str(script), url],
        capture_output=True, text=True, timeout=duration + timeout + 60)
    wall = time.perf_counter() - t0
    after = server.stats()
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"wrk failed ({out.returncode}): {out.stderr[-500:] or out.stdout}")
    w = json.loads(lines[-1])
    seconds = w["duration_us"] / 1e6
    cpu = after["cpu_seconds"] - before["cpu_seconds"]
    kinds = {k: w[k] for k in ("connect", "read", "write", "status", "timeout") if w[k]}
    return {
        "clients": n, "handshakes": w["requests"] - w["status"], "seconds": seconds,
        "handshakes_per_s": (w["requests"] - w["status"]) / seconds,
        "server_cpu_seconds": cpu, "server_cpu_utilisation": cpu / wall,
        "handshakes_per_server_cpu_second": w["requests"] / cpu if cpu > 0 else float("nan"),
        "latency_ms": {"p50": w["p50_us"] / 1000, "p90": w["p90_us"] / 1000,
                       "p99": w["p99_us"] / 1000, "mean": w["mean_us"] / 1000,
                       "max": w["max_us"] / 1000},
        "errors": sum(kinds.values()), "error_kinds": kinds,
        "server_peak_rss_mib": after["peak_rss_mib"], "server_rss_mib": after["rss_mib"],
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    apply_quick(args, QUICK)
    levels = [int(x) for x in str(args.concurrency).split(",")]
    schemes = [s for s in args.schemes.split(",") if s]
    from kvbridge._nixl import PROGRESS_DELAY_US

    load_before = load_average()
    results: dict[str, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="kvbridge-bench-") as t:
        certs = write_certs(Path(t))
        methods = ",".join("http" if s == "http" else "https" for s in schemes)
        progress("sidechannel: starting the server process (TP 2, 32 layers)")
        wrk = args.load_generator == "wrk"
        if wrk and not (shutil.which("wrk") and shutil.which("taskset")):
            raise SystemExit("kvbridge bench sidechannel: --load-generator wrk needs wrk and "
                             "taskset (apt-get install wrk util-linux)")
        script = Path(t) / "token.lua"
        script.write_text(_WRK_SCRIPT % TOKEN)
        with Child("sidechannel", "--tp", "2", "--methods", methods, "--token", TOKEN,
                   "--certs", str(certs), "--num-blocks", "4") as server:
            # Each scheme's server is a process of its own (the side-channel process), as
            # deployed: its CPU and memory are what is measured.
            pids = {scheme: server.info["server_pids"][scheme] for scheme in schemes}
            if wrk:
                for pid in {server.pid, *pids.values()}:
                    _pin(pid, 1)
            start_stats = {s: proc_stats(pid) for s, pid in pids.items()}
            server_idle_cpu = {s: idle_cpu(pid, 0.5) for s, pid in pids.items()}
            for scheme in schemes:
                ctx = None
                if scheme == "https":
                    ctx = ssl.create_default_context(cafile=str(certs / "ca.pem"))
                port = server.info["ports"][scheme]
                measured = _Process(pids[scheme])
                results[scheme] = []
                for n in levels:
                    progress(f"sidechannel: {scheme}, {n} clients in flight, "
                             f"{args.duration:g} s")
                    if wrk:
                        r = _wrk_level(f"{scheme}://127.0.0.1:{port}{PATH}/0", n,
                                       args.duration, args.timeout, script, measured)
                    else:
                        # uvloop: the herd shares 2 cores with the server; the lighter it
                        # is, the more the figures are the server's.
                        r = uvloop.run(_level(port, ctx, n, args.duration, args.timeout,
                                              measured))
                    progress(f"sidechannel: {scheme} x{n}: {r['handshakes_per_s']:.0f}/s, "
                             f"p99 {r['latency_ms']['p99']:.1f} ms, {r['errors']} errors")
                    results[scheme].append(r)
            end_stats = {s: proc_stats(pid) for s, pid in pids.items()}
            info = server.info
    http = {r["clients"]: r for r in results.get("http", [])}
    goals = []
    if http:
        best = max(r["handshakes_per_server_cpu_second"] for r in http.values())
        goals.append({"goal": ">= 21000 handshakes per server CPU second (http, best level; "
                              "3x the 7,000 of the Starlette-routed server)",
                      "value": round(best), "reached": best >= 21000})
        if 256 in http:
            p99 = http[256]["latency_ms"]["p99"]
            goals.append({"goal": "p99 < 50 ms at 256 in flight (http)", "value": round(p99, 2),
                          "reached": p99 < 50})
        if 1024 in http:
            errs = sum(results[s][levels.index(1024)]["errors"] for s in results)
            goals.append({"goal": "zero errors at 1024 in flight (http and https)",
                          "value": errs, "reached": errs == 0})
    return {
        "config": {"levels": levels, "duration_s": args.duration, "schemes": schemes,
                   "server": "the side-channel process (kvbridge.handshake.process.child: uvicorn, one "
                             "event-loop thread, handshakes answered in the protocol layer), "
                             "one per scheme, TP 2 store, 32 layers, token"
                             + (", pinned to core 1" if wrk else ""),
                   "client": ("wrk, one thread pinned to core 0, one keep-alive connection per "
                              "client" if wrk else "asyncio raw HTTP/1.1, one keep-alive "
                              "connection per client, one process"),
                   "nixl_progress_delay_us": PROGRESS_DELAY_US, "quick": args.quick},
        "envelope_bytes_per_rank": info["envelope_bytes_per_rank"],
        "results": results,
        "server_process": {"start": start_stats, "end": end_stats,
                           "idle_cpu_per_s": server_idle_cpu},
        "goals": goals,
        "load_average": {"before": load_before, "after": load_average()},
    }


def summary(r: dict[str, Any]) -> str:
    lines = ["scheme  clients   hs/s  hs/server-cpu-s   p50 ms   p99 ms  errors  peak RSS MiB"]
    for scheme, rows in r["results"].items():
        for x in rows:
            lines.append(f"{scheme:<6} {x['clients']:>8} {x['handshakes_per_s']:>6.0f} "
                         f"{x['handshakes_per_server_cpu_second']:>16.0f} "
                         f"{x['latency_ms']['p50']:>8.2f} {x['latency_ms']['p99']:>8.2f} "
                         f"{x['errors']:>7} {x['server_peak_rss_mib']:>12.1f}")
    return "\n".join(lines + goal_lines(r))


def plot(r: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for scheme, rows in r["results"].items():
        xs = [x["clients"] for x in rows]
        axes[0].plot(xs, [x["handshakes_per_s"] for x in rows], "o-", label=f"{scheme} wall")
        axes[0].plot(xs, [x["handshakes_per_server_cpu_second"] for x in rows], "s--",
                     label=f"{scheme} per server CPU s")
        for q, style in (("p50", "o-"), ("p99", "s--")):
            ys = [x["latency_ms"][q] for x in rows]
            axes[1].plot(xs, [y if math.isfinite(y) else 0 for y in ys], style,
                         label=f"{scheme} {q}")
    axes[0].axhline(2000, color="grey", lw=0.8, ls=":", label="goal 2000/s")
    axes[1].axhline(50, color="grey", lw=0.8, ls=":", label="goal p99 50 ms")
    for ax, ylabel in ((axes[0], "handshakes / s"), (axes[1], "latency (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("clients in flight")
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=8)
    axes[1].set_yscale("log")
    fig.suptitle("kvbridge http side channel under a herd of clients (one server process)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
