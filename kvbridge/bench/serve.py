"""``kvbridge bench serve``: a load generator against a P/D setup and a single engine.

Starts, as separate processes like tests/e2e do, ``kvbridge serve --role prefill``,
``kvbridge serve --role decode`` and ``kvbridge proxy`` (http handshake with a token; the
proxy's start-up prewarm switched off when it has one, so that the first request pays
the handshake), and a monolithic ``kvbridge serve --role both``, all on loopback. All
run the built-in tiny model. The two setups run one after the other (each engine's
NIXL progress thread spins a core, even idle: a setup left running would steal the CPU of
the other on a small machine); their idle CPU is reported.

Per setup: the first request after start-up (P/D: it pays the decode's handshake with
the prefill) and the second one, then per concurrency level a closed loop of streamed
completions (``ignore_eos``, exact output length): TTFT p50/p99, inter-token latency
p50/p99, output tokens/s, errors. P/D overhead = P/D figure / monolithic figure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvbridge.bench.common import idle_cpu, load_average, proc_stats, progress, pyplot
from kvbridge.bench.report import percentiles
from kvbridge.launch import KVBridgeProcess, free_port, read_metric

START_TIMEOUT = 180.0
SETUPS = ("pd", "mono")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--concurrency", default="1,4,16", help="requests in flight, per level")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument("--requests", type=int, default=0,
                   help="requests per level (default: max(12, 3 x concurrency))")
    p.add_argument("--handshake", choices=["http", "zmq"], default="http")
    p.add_argument("--decode-tp", type=int, default=1)
    p.add_argument("--dtype", default="float32", choices=["float32", "float64", "bfloat16"])


def _quick(args: argparse.Namespace) -> None:
    args.concurrency, args.prompt_tokens, args.output_tokens, args.requests = "1,2", 16, 4, 2


def _metric(client, url: str, name: str) -> float:
    try:
        return read_metric(client, url, name)
    except Exception:  # an engine that died mid-run: the figure is missing, not zero
        return float("nan")


def _prompt(n: int, i: int) -> str:
    """``n`` bytes (the tiny model's tokenizer is byte-level), different per request."""
    words = f"request {i} asks about the side channel and the data plane of kv blocks. "
    return (words * (n // len(words) + 1))[:n]


async def _one(client, url: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    body = {"model": "kvbridge-tiny", "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first = last = None
    chunks = 0
    usage: dict[str, int] = {}
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"status {r.status_code}: {(await r.aread())[:200]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"stream error: {chunk['error']}")
            if chunk.get("usage"):
                usage = chunk["usage"]
            if chunk.get("choices"):
                now = time.perf_counter()
                first = first if first is not None else now
                last = now
                chunks += 1
    end = time.perf_counter()
    tokens = usage.get("completion_tokens", chunks)
    if first is None:
        raise RuntimeError("no tokens streamed")
    return {"ttft": first - t0, "latency": end - t0, "tokens": tokens,
            "prompt_tokens": usage.get("prompt_tokens", 0),
            "itl": (last - first) / (tokens - 1) if tokens > 1 else None}


async def _level(url: str, concurrency: int, requests: int, args: argparse.Namespace,
                 seed: int) -> dict[str, Any]:
    import httpx

    results: list[dict[str, Any]] = []
    errors: list[str] = []
    counter = iter(range(requests))
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=300, limits=limits, trust_env=False) as client:
        async def worker() -> None:
            for i in counter:
                try:
                    results.append(await _one(client, url, _prompt(args.prompt_tokens,
                                                                   seed + i),
                                              args.output_tokens))
                except Exception as e:
                    errors.append(f"{type(e).__name__}: {e}"[:200])

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    tokens = sum(r["tokens"] for r in results)
    itls = [r["itl"] for r in results if r["itl"] is not None]
    return {"concurrency": concurrency, "requests": len(results), "errors": len(errors),
            "error_samples": errors[:3], "seconds": wall,
            "output_tokens": tokens, "tokens_per_s": tokens / wall if wall > 0 else 0.0,
            "requests_per_s": len(results) / wall if wall > 0 else 0.0,
            "ttft_ms": percentiles([r["ttft"] for r in results], (50, 99)),
            "itl_ms": percentiles(itls, (50, 99)),
            "latency_ms": percentiles([r["latency"] for r in results], (50, 99)),
            "prompt_tokens": results[0]["prompt_tokens"] if results else 0}


def _first_two(client, url: str, args: argparse.Namespace, metrics_url: str | None
               ) -> dict[str, Any]:
    """The first request after start-up and the second one, one at a time."""
    out: dict[str, Any] = {}
    for label in ("first", "second"):
        hs0 = _metric(client, metrics_url, "kvbridge_handshake_seconds_sum") \
            if metrics_url else float("nan")
        r = asyncio.run(_level(url, 1, 1, args, seed=10_000 + len(out)))
        hs1 = _metric(client, metrics_url, "kvbridge_handshake_seconds_sum") \
            if metrics_url else float("nan")
        if r["requests"] != 1:
            raise RuntimeError(f"{label} request to {url} failed: {r['error_samples']}")
        out[label] = {"ttft_ms": r["ttft_ms"]["p50"], "latency_ms": r["latency_ms"]["p50"]}
        if metrics_url:  # the decode's own account of the handshake it did
            out[label]["decode_handshake_ms"] = 1000 * (hs1 - hs0)
    return out


def _setup(name: str, args: argparse.Namespace, tmp: Path, no_prewarm: list[str]
           ) -> dict[str, Any]:
    """Start one setup, measure it, stop it."""
    import httpx

    side = ["--handshake", args.handshake, "--side-channel-token-file", str(tmp / "token"),
            "--side-channel-port", "0", "--dtype", args.dtype]
    procs: dict[str, KVBridgeProcess] = {}
    ports = {k: free_port() for k in ("prefill", "decode", "proxy", "mono")}
    urls = {k: f"http://127.0.0.1:{p}" for k, p in ports.items()}
    try:
        progress(f"serve: starting {name}")
        t_start = time.monotonic()
        if name == "pd":
            procs["prefill"] = KVBridgeProcess("prefill", tmp, "serve", "--role", "prefill",
                                               "--port", str(ports["prefill"]), *side)
            procs["decode"] = KVBridgeProcess("decode", tmp, "serve", "--role", "decode", "--tp",
                                              str(args.decode_tp), "--port",
                                              str(ports["decode"]), *side)
        else:
            procs["mono"] = KVBridgeProcess("mono", tmp, "serve", "--role", "both", "--port",
                                            str(ports["mono"]), *side)
        with httpx.Client(trust_env=False) as client:
            deadline = time.monotonic() + START_TIMEOUT
            for k, p in procs.items():
                p.wait_healthy(urls[k] + "/health", deadline)
            if name == "pd":
                procs["proxy"] = KVBridgeProcess("proxy", tmp, "proxy", "--port",
                                                 str(ports["proxy"]), "--prefill",
                                                 urls["prefill"], "--decode", urls["decode"],
                                                 *no_prewarm)
                procs["proxy"].wait_healthy(urls["proxy"] + "/health", deadline)
            startup = time.monotonic() - t_start
            idle = {k: idle_cpu(p.proc.pid, 1.0) for k, p in procs.items()}
            progress(f"serve: {name} up after {startup:.1f} s (idle CPU per process "
                     f"{ {k: round(v, 2) for k, v in idle.items()} }); first requests")
            target = urls["proxy"] if name == "pd" else urls["mono"]
            first = _first_two(client, target, args, urls["decode"] if name == "pd" else None)
        runs = []
        for c in args.levels:
            n = args.requests or max(12, 3 * c)
            cpu0 = {k: proc_stats(p.proc.pid)["cpu_seconds"] for k, p in procs.items()}
            r = asyncio.run(_level(target, c, n, args, seed=1000 * c))
            r["cpu_seconds"] = {k: proc_stats(p.proc.pid)["cpu_seconds"] - cpu0[k]
                                for k, p in procs.items()}
            runs.append(r)
            progress(f"serve: {name:<4} x{c}: TTFT p50 {r['ttft_ms']['p50']:.1f} ms, ITL p50 "
                     f"{r['itl_ms']['p50']:.1f} ms, {r['tokens_per_s']:.0f} tok/s, "
                     f"{r['errors']} errors")
        peak = {k: proc_stats(p.proc.pid)["peak_rss_mib"] for k, p in procs.items()}
    finally:
        for p in procs.values():
            p.stop()
    return {"startup_seconds": startup, "idle_cpu_per_s": idle, "first": first, "runs": runs,
            "peak_rss_mib": peak}


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.quick:
        _quick(args)
    args.levels = [int(x) for x in str(args.concurrency).split(",")]
    load_before = load_average()
    proxy_help = subprocess.run([sys.executable, "-m", "kvbridge.cli", "proxy", "--help"],
                                capture_output=True, text=True).stdout
    no_prewarm = ["--no-prewarm"] if "--no-prewarm" in proxy_help else []
    with tempfile.TemporaryDirectory(prefix="kvbridge-bench-serve-") as t:
        tmp = Path(t)
        token = tmp / "token"
        token.write_text(os.urandom(16).hex())
        token.chmod(0o600)
        # One setup at a time: each engine's NIXL progress thread spins a core even when
        # idle, so a setup left running would take the CPU of the one measured.
        setups = {name: _setup(name, args, tmp, no_prewarm) for name in SETUPS}
    runs = {k: v["runs"] for k, v in setups.items()}
    overhead = []
    for pd, mono in zip(runs["pd"], runs["mono"], strict=True):
        overhead.append({
            "concurrency": pd["concurrency"],
            "ttft_p50": pd["ttft_ms"]["p50"] / mono["ttft_ms"]["p50"],
            "ttft_p99": pd["ttft_ms"]["p99"] / mono["ttft_ms"]["p99"],
            "itl_p50": pd["itl_ms"]["p50"] / mono["itl_ms"]["p50"],
            "tokens_per_s": pd["tokens_per_s"] / mono["tokens_per_s"]})
    return {
        "config": {"levels": args.levels, "prompt_tokens": args.prompt_tokens,
                   "output_tokens": args.output_tokens, "requests_per_level": args.requests
                   or "max(12, 3 x concurrency)", "handshake": args.handshake,
                   "decode_tp": args.decode_tp, "prefill_tp": 1, "dtype": args.dtype,
                   "model": "built-in tiny (2 layers, 4 KV heads)",
                   "proxy_prewarm": "off" if no_prewarm else "not available in this proxy",
                   "order": "P/D set-up measured, stopped, then the monolithic one",
                   "token": True, "tls": False, "quick": args.quick},
        "startup_seconds": {k: v["startup_seconds"] for k, v in setups.items()},
        "idle_cpu_per_s": {k: v["idle_cpu_per_s"] for k, v in setups.items()},
        "first_requests": {k: v["first"] for k, v in setups.items()},
        "results": runs,
        "pd_over_mono": overhead,
        "peak_rss_mib": {k: v["peak_rss_mib"] for k, v in setups.items()},
        "load_average": {"before": load_before, "after": load_average()},
    }


def summary(r: dict[str, Any]) -> str:
    f = r["first_requests"]
    lines = [f"first request: P/D TTFT {f['pd']['first']['ttft_ms']:.1f} ms "
             f"(decode handshake {f['pd']['first']['decode_handshake_ms']:.1f} ms), second "
             f"{f['pd']['second']['ttft_ms']:.1f} ms; monolithic first "
             f"{f['mono']['first']['ttft_ms']:.1f} ms, second {f['mono']['second']['ttft_ms']:.1f}"
             " ms",
             "setup conc  TTFT p50/p99 ms    ITL p50/p99 ms   tok/s  errors"]
    for setup in SETUPS:
        for x in r["results"][setup]:
            lines.append(f"{setup:<5} {x['concurrency']:>4} {x['ttft_ms']['p50']:>7.1f} "
                         f"{x['ttft_ms']['p99']:>7.1f}  {x['itl_ms']['p50']:>7.2f} "
                         f"{x['itl_ms']['p99']:>7.2f} {x['tokens_per_s']:>7.0f} {x['errors']:>7}")
    for o in r["pd_over_mono"]:
        lines.append(f"P/D / mono at {o['concurrency']}: TTFT p50 x{o['ttft_p50']:.2f}, "
                     f"ITL p50 x{o['itl_p50']:.2f}, tokens/s x{o['tokens_per_s']:.2f}")
    return "\n".join(lines)


def plot(r: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))
    names = {"pd": "P/D (prefill + decode + proxy)", "mono": "monolithic (--role both)"}
    for setup in SETUPS:
        rows = r["results"][setup]
        xs = [x["concurrency"] for x in rows]
        for q, style in (("p50", "o-"), ("p99", "s--")):
            axes[0].plot(xs, [x["ttft_ms"][q] for x in rows], style, label=f"{setup} {q}")
            axes[1].plot(xs, [x["itl_ms"][q] for x in rows], style, label=f"{setup} {q}")
        axes[2].plot(xs, [x["tokens_per_s"] for x in rows], "o-", label=names[setup])
    for ax, title, ylabel in ((axes[0], "time to first token", "ms"),
                              (axes[1], "inter-token latency", "ms"),
                              (axes[2], "output throughput", "tokens / s")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("requests in flight")
        ax.set_title(title)
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=8)
    f = r["first_requests"]["pd"]
    fig.suptitle(f"kvbridge serve, tiny model, prompt {r['config']['prompt_tokens']} / output "
                 f"{r['config']['output_tokens']} tokens; P/D first request TTFT "
                 f"{f['first']['ttft_ms']:.0f} ms (handshake), second {f['second']['ttft_ms']:.0f}"
                 " ms")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
