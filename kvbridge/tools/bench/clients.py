"""``kvbridge bench clients``: which asyncio HTTP client the proxy should use, measured.

Against one real engine (``kvbridge serve --role both``, tiny model, loopback) the
proxy's two kinds of call are timed with httpx and with aiohttp, interleaved in a
shuffled order every round so drift hits both alike:

* ``health``: ``GET /health`` (what probes and prewarm do), one keep-alive connection;
* ``completion``: a streamed ``POST /v1/completions`` of ``--max-tokens`` tokens, read to
  the end (the relay's path); time to the first body byte and to the end.

The engine's own work is the same for both clients, so the difference is the client's.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import time
from pathlib import Path
from typing import Any

from kvbridge.tools.bench.common import apply_quick, load_average, progress, pyplot
from kvbridge.tools.bench.report import goal_lines, percentiles
from kvbridge.tools.launch import KVBridgeProcess, free_port

HOST = "127.0.0.1"
QUICK = {"rounds": 20, "warmup": 3}
# httpx on its own transport (httpcore, h11), aiohttp, and the proxy's client: httpx's API
# on aiohttp's connections (kvbridge.proxy.transport).
CLIENTS = ("httpx", "aiohttp", "httpx+aiohttp")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rounds", type=int, default=400, help="timed calls per client and kind")
    p.add_argument("--warmup", type=int, default=20, help="untimed calls first")
    p.add_argument("--max-tokens", type=int, default=4, help="tokens per streamed completion")


async def _measure(url: str, args: argparse.Namespace) -> dict[str, Any]:
    import aiohttp
    import httpx

    body = {"model": "kvbridge-tiny", "prompt": "The proxy's client, measured.",
            "max_tokens": args.max_tokens, "temperature": 0, "stream": True}
    from kvbridge.proxy.transport import AiohttpTransport

    hxs = {"httpx": httpx.AsyncClient(timeout=60, trust_env=False),
           "httpx+aiohttp": httpx.AsyncClient(timeout=60, trust_env=False,
                                              transport=AiohttpTransport())}
    ah = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60))

    async def health(client: str) -> float:
        t0 = time.perf_counter()
        if client in hxs:
            r = await hxs[client].get(url + "/health")
            r.raise_for_status()
        else:
            async with ah.get(url + "/health") as r:
                r.raise_for_status()
                await r.read()
        return time.perf_counter() - t0

    async def completion(client: str) -> tuple[float, float]:
        t0 = time.perf_counter()
        first = None
        if client in hxs:
            async with hxs[client].stream("POST", url + "/v1/completions", json=body) as r:
                r.raise_for_status()
                async for _ in r.aiter_raw():
                    first = first or time.perf_counter()
        else:
            async with ah.post(url + "/v1/completions", json=body) as r:
                r.raise_for_status()
                async for _ in r.content.iter_any():
                    first = first or time.perf_counter()
        end = time.perf_counter()
        return (first or end) - t0, end - t0

    times: dict[str, dict[str, list[float]]] = {
        c: {"health": [], "first_byte": [], "completion": []} for c in CLIENTS}
    stale = (httpx.RemoteProtocolError, aiohttp.ServerDisconnectedError)
    retries = dict.fromkeys(CLIENTS, 0)

    async def once_more(call, client: str):
        """A kept-alive connection the engine closed as the request went out is retried
        once, as the proxy does (``send_retrying_once``); the time includes the retry."""
        try:
            return await call(client)
        except stale:
            retries[client] += 1
            return await call(client)

    try:
        for _ in range(args.warmup):
            for c in CLIENTS:
                await health(c)
                await completion(c)
        rng = random.Random(0)
        for i in range(args.rounds):
            order = list(CLIENTS)
            rng.shuffle(order)
            for c in order:
                times[c]["health"].append(await once_more(health, c))
                fb, total = await once_more(completion, c)
                times[c]["first_byte"].append(fb)
                times[c]["completion"].append(total)
            if (i + 1) % max(1, args.rounds // 4) == 0:
                progress(f"clients: {i + 1}/{args.rounds} rounds")
    finally:
        for hx in hxs.values():
            await hx.aclose()
        await ah.close()
    return {c: {**{k: percentiles(v) for k, v in kinds.items()}, "retries": retries[c]}
            for c, kinds in times.items()}


def run(args: argparse.Namespace) -> dict[str, Any]:
    apply_quick(args, QUICK)
    load_before = load_average()
    with tempfile.TemporaryDirectory(prefix="kvbridge-bench-clients-") as t:
        port = free_port()
        engine = KVBridgeProcess("clients-engine", Path(t), "serve", "--role", "both",
                                 "--port", str(port), "--side-channel-port", "0")
        try:
            url = f"http://{HOST}:{port}"
            engine.wait_healthy(url + "/health", time.monotonic() + 180)
            progress(f"clients: {', '.join(CLIENTS)}, {args.rounds} rounds, interleaved")
            stats = asyncio.run(_measure(url, args))
        finally:
            engine.stop()
    saved = {k: stats["httpx"][k]["p50"] - stats["aiohttp"][k]["p50"]
             for k in ("health", "first_byte", "completion")}
    return {
        "config": {"rounds": args.rounds, "warmup": args.warmup,
                   "max_tokens": args.max_tokens, "quick": args.quick,
                   "engine": "kvbridge serve --role both (tiny model), loopback, plain http",
                   "order": "every client every round, shuffled"},
        "clients": stats,
        "httpx_minus_aiohttp_p50_ms": saved,
        "goals": [],
        "load_average": {"before": load_before, "after": load_average()},
    }


def summary(r: dict[str, Any]) -> str:
    lines = ["client    health p50/p99 ms   first byte p50/p99 ms   completion p50/p99 ms  "
             "retries"]
    for c, s in r["clients"].items():
        lines.append(f"{c:13s} {s['health']['p50']:7.2f} /{s['health']['p99']:7.2f}   "
                     f"{s['first_byte']['p50']:9.2f} /{s['first_byte']['p99']:7.2f}   "
                     f"{s['completion']['p50']:9.2f} /{s['completion']['p99']:7.2f}  "
                     f"{s['retries']:7d}")
    d = r["httpx_minus_aiohttp_p50_ms"]
    lines.append(f"httpx - aiohttp at p50: health {d['health']:+.2f} ms, first byte "
                 f"{d['first_byte']:+.2f} ms, completion {d['completion']:+.2f} ms")
    return "\n".join(lines + goal_lines(r))


def plot(r: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    kinds = ("health", "first_byte", "completion")
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(r["clients"])
    for i, c in enumerate(r["clients"]):
        ax.bar([k + i * width for k in range(len(kinds))],
               [r["clients"][c][k]["p50"] for k in kinds], width, label=c)
    ax.set_xticks([k + width * (len(r["clients"]) - 1) / 2 for k in range(len(kinds))], kinds)
    ax.set_ylabel("p50 ms")
    ax.set_title("The proxy's HTTP client against one engine (loopback)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
