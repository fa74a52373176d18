"""``kvbridge bench serve``: a load generator against P/D setups and a single engine.

Starts, as separate processes like tests/e2e do, all at once, on loopback, all running
one model (http handshake with a token): the built-in tiny model by default, or
``--model``: a checkpoint directory or a model ``kvbridge model prepare`` knows
(``--model smollm2-135m-instruct``, prepared on first use). Prompts are token ids of the
exact ``--prompt-tokens`` length (the model's tokenizer encodes a text, cut to length).

* ``pd``: ``kvbridge serve --role prefill``, ``kvbridge serve --role decode`` and
  ``kvbridge proxy --no-prewarm``: the first request pays the decode's handshake;
* ``pd_prewarmed``: the same three, the proxy given the side-channel token
  (``--kv-token-file``) so that it has the decode handshake at start-up; the first
  request is sent once the proxy's ``GET /v1/kv/prewarm`` reports done;
* ``mono``: one ``kvbridge serve --role both``.

Per setup: the first request after start-up and the second one; then, for ``pd`` and
``mono`` only, per concurrency level a closed loop of streamed completions (``ignore_eos``,
exact output length), the two setups interleaved level by level: TTFT p50/p99,
inter-token latency p50/p99, output tokens/s, errors. P/D overhead = P/D figure /
monolithic figure. The idle CPU of every process is measured once all are up (NIXL
agents used to spin a core each; ``--spin-baseline`` also measures an engine started with
``KVBRIDGE_NIXL_PROGRESS_DELAY_US=0``, nixl's own setting, for comparison).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from kvbridge.bench.common import load_average, proc_stats, progress, pyplot
from kvbridge.bench.report import goal_lines, percentiles
from kvbridge.launch import KVBridgeProcess, free_port, read_metric

START_TIMEOUT = 180.0
SETUPS = ("pd", "pd_prewarmed", "mono")
SWEPT = ("pd", "mono")  # the concurrency sweep skips pd_prewarmed (its first request is the point)
TRANSFER_SLACK_MS = 3.0  # goal: P/D TTFT <= monolithic TTFT + 3 ms + the KV transfer


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--concurrency", default="1,4,16", help="requests in flight, per level")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument("--requests", type=int, default=0,
                   help="requests per level (default: max(12, 3 x concurrency))")
    p.add_argument("--handshake", choices=["http", "zmq"], default="http")
    p.add_argument("--decode-tp", type=int, default=1)
    p.add_argument("--dtype", default="float32", choices=["float32", "float64", "bfloat16"])
    p.add_argument("--model", default=None,
                   help="checkpoint directory or a preparable model name, e.g. "
                   "smollm2-135m-instruct (default: the built-in tiny model)")
    p.add_argument("--no-spin-baseline", dest="spin_baseline", action="store_false",
                   help="skip the idle-CPU check of an engine with the progress delay at 0")


def _quick(args: argparse.Namespace) -> None:
    args.concurrency, args.prompt_tokens, args.output_tokens, args.requests = "1,2", 16, 4, 2


def _metric(client, url: str, name: str) -> float:
    try:
        return read_metric(client, url, name)
    except Exception:  # an engine that died mid-run: the figure is missing, not zero
        return float("nan")


class _Model:
    """The served model: its name in requests, its tokenizer, its KV bytes per token."""

    def __init__(self, model: str | None, dtype: str):
        from kvbridge.model.loader import load_config, load_tokenizer, resolve_dtype

        self.path = _model_path(model)
        self.name = "kvbridge-tiny" if self.path is None else str(self.path)
        cfg = load_config(self.path)
        self.tokenizer = load_tokenizer(self.path)
        self.kv_bytes_per_token = (cfg.num_hidden_layers * 2 * cfg.num_key_value_heads
                                   * cfg.head_dim * resolve_dtype(dtype).itemsize)
        self.label = ("built-in tiny (2 layers, 4 KV heads)" if self.path is None else
                      f"{Path(self.path).name} ({cfg.num_hidden_layers} layers, "
                      f"{cfg.num_key_value_heads} KV heads, head_dim {cfg.head_dim})")
        self.serve_args = [] if self.path is None else ["--model", str(self.path)]

    def prompt(self, n: int, i: int) -> list[int]:
        """Exactly ``n`` prompt tokens, different per request."""
        words = f"request {i} asks about the side channel and the data plane of kv blocks. "
        ids: list[int] = []
        while len(ids) < n:
            ids = self.tokenizer.encode(words * (n // 4 + 1))
            words *= 2
        return ids[:n]


def _model_path(model: str | None) -> Path | None:
    if model is None or model == "tiny":
        return None
    if Path(model).is_dir():
        return Path(model)
    from kvbridge.model.models import prepare

    return prepare(model)


async def _one(client, url: str, model: _Model, prompt: list[int],
               max_tokens: int) -> dict[str, Any]:
    body = {"model": model.name, "prompt": prompt, "max_tokens": max_tokens,
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
                    results.append(await _one(client, url, args.served,
                                              args.served.prompt(args.prompt_tokens, seed + i),
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
            "ttft_mean_ms": (1000 * sum(r["ttft"] for r in results) / len(results)
                             if results else float("nan")),
            "itl_ms": percentiles(itls, (50, 99)),
            "latency_ms": percentiles([r["latency"] for r in results], (50, 99)),
            "prompt_tokens": results[0]["prompt_tokens"] if results else 0}


def _first_two(client, url: str, args: argparse.Namespace, decode_url: str | None
               ) -> dict[str, Any]:
    """The first request after start-up and the second one, one at a time."""
    out: dict[str, Any] = {}
    for label in ("first", "second"):
        hs0 = _metric(client, decode_url, "kvbridge_handshake_seconds_sum") \
            if decode_url else float("nan")
        r = asyncio.run(_level(url, 1, 1, args, seed=10_000 + len(out)))
        hs1 = _metric(client, decode_url, "kvbridge_handshake_seconds_sum") \
            if decode_url else float("nan")
        if r["requests"] != 1:
            raise RuntimeError(f"{label} request to {url} failed: {r['error_samples']}")
        out[label] = {"ttft_ms": r["ttft_ms"]["p50"], "latency_ms": r["latency_ms"]["p50"]}
        if decode_url:  # the decode's own account of the handshake it did for this request
            out[label]["decode_handshake_ms"] = 1000 * (hs1 - hs0)
    return out


def _idle_cpus(procs: dict[str, KVBridgeProcess], seconds: float) -> dict[str, float]:
    """CPU seconds per second of each process over the same ``seconds`` of no requests."""
    a = {k: proc_stats(p.proc.pid)["cpu_seconds"] for k, p in procs.items()}
    time.sleep(seconds)
    return {k: (proc_stats(p.proc.pid)["cpu_seconds"] - a[k]) / seconds
            for k, p in procs.items()}


def _wait_prewarm(client, proxy_url: str, deadline: float) -> dict[str, Any]:
    """Poll the proxy's ``GET /v1/kv/prewarm`` until it reports done; every pair must be ok."""
    while True:
        st = client.get(proxy_url + "/v1/kv/prewarm", timeout=5).json()
        if st["done"]:
            bad = [x for x in st["pairs"] if x["outcome"] != "ok"]
            if bad or not st["pairs"]:
                raise RuntimeError(f"proxy prewarm failed: {st}")
            return st
        if time.monotonic() > deadline:
            raise RuntimeError(f"proxy prewarm not done in time: {st}")
        time.sleep(0.05)


def _spin_baseline(tmp: Path, side: list[str]) -> float:
    """Idle CPU of a ``--role both`` engine whose NIXL progress thread has no delay."""
    port = free_port()
    proc = KVBridgeProcess("spin", tmp, "serve", "--role", "both", "--port", str(port), *side,
                           env={**os.environ, "KVBRIDGE_NIXL_PROGRESS_DELAY_US": "0"})
    try:
        proc.wait_healthy(f"http://127.0.0.1:{port}/health", time.monotonic() + START_TIMEOUT)
        time.sleep(1.0)  # let start-up work settle, as for the others
        return _idle_cpus({"spin": proc}, 2.0)["spin"]
    finally:
        proc.stop()


PHASES = ("queue", "kv_load", "after_load", "first_step", "time_to_first_token")


def _samples(client, url: str) -> dict[str, float]:
    """Every sample of ``url``'s Prometheus ``/metrics`` (empty if it cannot be read)."""
    try:
        text = client.get(url + "/metrics", timeout=10).text
    except Exception:
        return {}
    out = {}
    for line in text.splitlines():
        key, _, value = line.rpartition(" ")
        if key and not line.startswith("#"):
            out[key] = float(value)
    return out


def _snapshot(client, urls: dict[str, str]) -> dict[str, dict[str, float]]:
    return {k: _samples(client, u) for k, u in urls.items()}


def _mean_ms(a: dict[str, float], b: dict[str, float], name: str) -> float:
    """Mean of histogram ``name`` (a ``..._sum``/``..._count`` pair, labels included in
    ``name``'s braces) over what was observed between snapshots ``a`` and ``b``."""
    base, _, labels = name.partition("{")
    labels = "{" + labels if labels else ""
    n = b.get(f"{base}_count{labels}", 0.0) - a.get(f"{base}_count{labels}", 0.0)
    s = b.get(f"{base}_sum{labels}", 0.0) - a.get(f"{base}_sum{labels}", 0.0)
    return 1000 * s / n if n > 0 else float("nan")


def _breakdown(setup: str, a: dict[str, dict[str, float]], b: dict[str, dict[str, float]],
               ttft_mean_ms: float) -> dict[str, float]:
    """The level's mean TTFT split into named parts that add up to it: the engines' own
    phases (``kvbridge_request_phase_seconds``), the proxy's prefill hop, and the rest
    (HTTP hops, the proxy's and the API's own work, the stream's relay) as the remainder."""
    def phase(role: str, p: str) -> float:
        return _mean_ms(a[role], b[role], f'kvbridge_request_phase_seconds{{phase="{p}"}}')

    if setup == "mono":
        engine = {p: phase("mono", p) for p in ("queue", "first_step")}
        rest = ttft_mean_ms - phase("mono", "time_to_first_token")
        return {"engine_queue": engine["queue"], "engine_first_step": engine["first_step"],
                "api_and_http_remainder": rest, "ttft_mean": ttft_mean_ms}
    hop = _mean_ms(a["proxy"], b["proxy"], "kvbridge_proxy_prefill_seconds")
    prefill_engine = phase("prefill", "time_to_first_token")
    decode = {p: phase("decode", p) for p in PHASES}
    return {
        "prefill_hop": hop,  # the proxy's own timing of the whole prefill request
        "prefill_hop_engine_part": prefill_engine,  # of which in the prefill's engine
        "decode_queue": decode["queue"],
        "kv_load": decode["kv_load"],
        "decode_after_load": decode["after_load"],
        "first_decode_step": decode["first_step"],
        "proxy_and_http_remainder": ttft_mean_ms - hop - decode["time_to_first_token"],
        "ttft_mean": ttft_mean_ms,
    }


def _transfer_ms(client, decode_url: str) -> tuple[float, float, float]:
    return (_metric(client, decode_url, "kvbridge_kv_load_seconds_sum"),
            _metric(client, decode_url, "kvbridge_kv_load_seconds_count"),
            _metric(client, decode_url, "kvbridge_kv_bytes_loaded_total"))


def run(args: argparse.Namespace) -> dict[str, Any]:
    import httpx

    from kvbridge._nixl import PROGRESS_DELAY_US

    if args.quick:
        _quick(args)
    args.levels = [int(x) for x in str(args.concurrency).split(",")]
    args.served = model = _Model(args.model, args.dtype)
    load_before = load_average()
    with tempfile.TemporaryDirectory(prefix="kvbridge-bench-serve-") as t:
        tmp = Path(t)
        token = tmp / "token"
        token.write_text(os.urandom(16).hex())
        token.chmod(0o600)
        side = ["--handshake", args.handshake, "--side-channel-token-file", str(token),
                "--side-channel-port", "0", "--dtype", args.dtype]
        served = [*side, *model.serve_args]
        # Every setup runs at the same time (idle NIXL agents no longer spin a core, see
        # idle_cpu_per_s), so that the sweep can interleave P/D and monolithic per level.
        names = {"pd": ("prefill", "decode", "proxy"),
                 "pd_prewarmed": ("prefill", "decode", "proxy"), "mono": ("mono",)}
        ports = {s: {k: free_port() for k in ks} for s, ks in names.items()}
        urls = {s: {k: f"http://127.0.0.1:{p}" for k, p in ps.items()}
                for s, ps in ports.items()}
        proxy_args = {"pd": ["--no-prewarm"], "pd_prewarmed": ["--kv-token-file", str(token)]}
        procs: dict[str, dict[str, KVBridgeProcess]] = {s: {} for s in SETUPS}
        try:
            progress("serve: starting every set-up (P/D cold, P/D prewarmed, monolithic)")
            t_start = time.monotonic()
            for s in ("pd", "pd_prewarmed"):
                procs[s]["prefill"] = KVBridgeProcess(
                    f"{s}-prefill", tmp, "serve", "--role", "prefill", "--port",
                    str(ports[s]["prefill"]), *served)
                procs[s]["decode"] = KVBridgeProcess(
                    f"{s}-decode", tmp, "serve", "--role", "decode", "--tp", str(args.decode_tp),
                    "--port", str(ports[s]["decode"]), *served)
            procs["mono"]["mono"] = KVBridgeProcess("mono", tmp, "serve", "--role", "both",
                                                    "--port", str(ports["mono"]["mono"]),
                                                    *served)
            deadline = time.monotonic() + START_TIMEOUT
            with httpx.Client(trust_env=False) as client:
                for s in SETUPS:
                    for k, p in procs[s].items():
                        p.wait_healthy(urls[s][k] + "/health", deadline)
                for s in ("pd", "pd_prewarmed"):
                    procs[s]["proxy"] = KVBridgeProcess(
                        f"{s}-proxy", tmp, "proxy", "--port", str(ports[s]["proxy"]),
                        "--prefill", urls[s]["prefill"], "--decode", urls[s]["decode"],
                        "--admin-routes", "open", *proxy_args[s])
                for s in ("pd", "pd_prewarmed"):
                    procs[s]["proxy"].wait_healthy(urls[s]["proxy"] + "/health", deadline)
                t_ready = time.monotonic()
                prewarm = _wait_prewarm(client, urls["pd_prewarmed"]["proxy"], deadline)
                prewarm_wait = time.monotonic() - t_ready
                startup = time.monotonic() - t_start
                ahead_ms = 1000 * _metric(client, urls["pd_prewarmed"]["decode"],
                                          "kvbridge_handshake_seconds_sum")
                time.sleep(1.0)  # let start-up work settle before the idle reading
                flat = {f"{s}/{k}": p for s in SETUPS for k, p in procs[s].items()}
                idle = _idle_cpus(flat, 2.0)
                progress(f"serve: all up after {startup:.1f} s (idle CPU per process "
                         f"{ {k: round(v, 3) for k, v in idle.items()} }); first requests")
                target = {"pd": urls["pd"]["proxy"], "pd_prewarmed": urls["pd_prewarmed"]["proxy"],
                          "mono": urls["mono"]["mono"]}
                first = {s: _first_two(client, target[s], args,
                                       urls[s]["decode"] if s != "mono" else None)
                         for s in SETUPS}
                first["pd_prewarmed"]["handshake_done_ahead_ms"] = ahead_ms
                for p in procs.pop("pd_prewarmed").values():  # not in the sweep
                    p.stop()
                runs: dict[str, list[dict[str, Any]]] = {s: [] for s in SWEPT}
                for c in args.levels:  # interleaved: drift of the machine hits both alike
                    n = args.requests or max(12, 3 * c)
                    for s in SWEPT:
                        cpu0 = {k: proc_stats(p.proc.pid)["cpu_seconds"]
                                for k, p in procs[s].items()}
                        kv0 = _transfer_ms(client, urls[s]["decode"]) if s == "pd" else None
                        snap0 = _snapshot(client, urls[s])
                        r = asyncio.run(_level(target[s], c, n, args, seed=1000 * c))
                        r["ttft_breakdown_ms"] = _breakdown(s, snap0, _snapshot(client, urls[s]),
                                                            r.pop("ttft_mean_ms"))
                        r["cpu_seconds"] = {k: proc_stats(p.proc.pid)["cpu_seconds"] - cpu0[k]
                                            for k, p in procs[s].items()}
                        if kv0 is not None:  # the decode's own timing of the KV loads
                            kv1 = _transfer_ms(client, urls[s]["decode"])
                            loads = kv1[1] - kv0[1]
                            r["kv_loads"] = loads
                            r["kv_load_ms_mean"] = (1000 * (kv1[0] - kv0[0]) / loads
                                                    if loads else float("nan"))
                            # what the decode read over NIXL per request: whole blocks
                            r["kv_bytes_per_request"] = ((kv1[2] - kv0[2]) / loads
                                                         if loads else float("nan"))
                        runs[s].append(r)
                        progress(f"serve: {s:<4} x{c}: TTFT p50 {r['ttft_ms']['p50']:.1f} ms, "
                                 f"ITL p50 {r['itl_ms']['p50']:.1f} ms, "
                                 f"{r['tokens_per_s']:.0f} tok/s, {r['errors']} errors")
                peak = {f"{s}/{k}": proc_stats(p.proc.pid)["peak_rss_mib"]
                        for s in SWEPT for k, p in procs[s].items()}
        finally:
            for ps in procs.values():
                for p in ps.values():
                    p.stop()
        spin = _spin_baseline(tmp, side) if args.spin_baseline else None
    overhead = []
    for pd, mono in zip(runs["pd"], runs["mono"], strict=True):
        overhead.append({
            "concurrency": pd["concurrency"],
            "ttft_p50": pd["ttft_ms"]["p50"] / mono["ttft_ms"]["p50"],
            "ttft_p99": pd["ttft_ms"]["p99"] / mono["ttft_ms"]["p99"],
            "itl_p50": pd["itl_ms"]["p50"] / mono["itl_ms"]["p50"],
            "tokens_per_s": pd["tokens_per_s"] / mono["tokens_per_s"],
            "ttft_p50_minus_mono_ms": pd["ttft_ms"]["p50"] - mono["ttft_ms"]["p50"]})
    goals = []
    pd1 = next((r for r in runs["pd"] if r["concurrency"] == 1), None)
    mono1 = next((r for r in runs["mono"] if r["concurrency"] == 1), None)
    if pd1 and mono1:
        budget = mono1["ttft_ms"]["p50"] + TRANSFER_SLACK_MS + pd1["kv_load_ms_mean"]
        goals.append({"goal": "P/D TTFT p50 <= monolithic TTFT p50 + 3 ms + KV transfer "
                              "(decode's mean kv_load time), 1 in flight, loopback",
                      "value": {"pd_ttft_p50_ms": round(pd1["ttft_ms"]["p50"], 2),
                                "budget_ms": round(budget, 2)},
                      "reached": pd1["ttft_ms"]["p50"] <= budget})
    idle_all = {**idle, **({"mono_progress_delay_0": spin} if spin is not None else {})}
    return {
        "config": {"levels": args.levels, "prompt_tokens": args.prompt_tokens,
                   "output_tokens": args.output_tokens, "requests_per_level": args.requests
                   or "max(12, 3 x concurrency)", "handshake": args.handshake,
                   "decode_tp": args.decode_tp, "prefill_tp": 1, "dtype": args.dtype,
                   "model": model.label, "model_path": None if model.path is None
                   else str(model.path), "kv_bytes_per_token": model.kv_bytes_per_token,
                   "proxy_prewarm": {"pd": "off (--no-prewarm)",
                                     "pd_prewarmed": "on (--kv-token-file), waited for"},
                   "order": "all set-ups started together; first requests per set-up; "
                            "pd_prewarmed stopped; pd and mono interleaved per level",
                   "nixl_progress_delay_us": PROGRESS_DELAY_US,
                   "token": True, "tls": False, "quick": args.quick},
        "startup_seconds": startup,
        "prewarm": {**prewarm, "wait_after_proxies_healthy_s": prewarm_wait},
        "idle_cpu_per_s": idle_all,
        "first_requests": first,
        "results": runs,
        "pd_over_mono": overhead,
        "goals": goals,
        "peak_rss_mib": peak,
        "load_average": {"before": load_before, "after": load_average()},
    }


def summary(r: dict[str, Any]) -> str:
    f = r["first_requests"]
    lines = [f"first request: P/D TTFT {f['pd']['first']['ttft_ms']:.1f} ms "
             f"(decode handshake {f['pd']['first']['decode_handshake_ms']:.1f} ms), second "
             f"{f['pd']['second']['ttft_ms']:.1f} ms; P/D prewarmed first "
             f"{f['pd_prewarmed']['first']['ttft_ms']:.1f} ms, second "
             f"{f['pd_prewarmed']['second']['ttft_ms']:.1f} ms; monolithic first "
             f"{f['mono']['first']['ttft_ms']:.1f} ms, second {f['mono']['second']['ttft_ms']:.1f}"
             " ms",
             "idle CPU s/s: " + ", ".join(f"{k} {v:.3f}" for k, v in r["idle_cpu_per_s"].items()),
             f"model {r['config']['model']}: KV {r['config']['kv_bytes_per_token']} bytes "
             "per token",
             "setup conc  TTFT p50/p99 ms    ITL p50/p99 ms   tok/s  errors"]
    for setup in SWEPT:
        for x in r["results"][setup]:
            lines.append(f"{setup:<5} {x['concurrency']:>4} {x['ttft_ms']['p50']:>7.1f} "
                         f"{x['ttft_ms']['p99']:>7.1f}  {x['itl_ms']['p50']:>7.2f} "
                         f"{x['itl_ms']['p99']:>7.2f} {x['tokens_per_s']:>7.0f} {x['errors']:>7}")
    for x in r["results"]["pd"]:
        if "kv_bytes_per_request" in x:
            lines.append(f"pd x{x['concurrency']}: KV read per request "
                         f"{x['kv_bytes_per_request'] / 1024:.0f} KiB in "
                         f"{x['kv_load_ms_mean']:.1f} ms (decode's mean kv_load)")
    for setup in SWEPT:
        for x in r["results"][setup]:
            parts = ", ".join(f"{k} {v:.1f}" for k, v in x["ttft_breakdown_ms"].items())
            lines.append(f"{setup} x{x['concurrency']} mean TTFT breakdown (ms): {parts}")
    for o in r["pd_over_mono"]:
        lines.append(f"P/D / mono at {o['concurrency']}: TTFT p50 x{o['ttft_p50']:.2f}, "
                     f"ITL p50 x{o['itl_p50']:.2f}, tokens/s x{o['tokens_per_s']:.2f}")
    return "\n".join(lines + goal_lines(r))


def plot(r: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 4, figsize=(19, 4.4))
    names = {"pd": "P/D (prefill + decode + proxy)", "mono": "monolithic (--role both)"}
    for g in r["goals"]:  # the TTFT budget at 1 in flight
        axes[0].plot([1], [g["value"]["budget_ms"]], "k_", ms=18, mew=2,
                     label="goal at 1 in flight")
    # Mean TTFT at the lowest level, split into its named parts.
    bottom = {s: 0.0 for s in SWEPT}
    low = {s: r["results"][s][0] for s in SWEPT}
    for setup in SWEPT:
        for part, ms in low[setup]["ttft_breakdown_ms"].items():
            if part in ("ttft_mean", "prefill_hop_engine_part") or ms != ms:  # NaN: absent
                continue
            axes[3].bar(setup, ms, bottom=bottom[setup], label=f"{setup}: {part}")
            axes[3].text(setup, bottom[setup] + ms / 2, f"{part} {ms:.1f}", ha="center",
                         va="center", fontsize=6)
            bottom[setup] += ms
    axes[3].set(ylabel="ms", title=f"mean TTFT, {low['pd']['concurrency']} in flight, by part")
    for setup in SWEPT:
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
    f = r["first_requests"]
    fig.suptitle(f"kvbridge serve, {r['config']['model']}, prompt {r['config']['prompt_tokens']} / output "
                 f"{r['config']['output_tokens']} tokens; P/D first request TTFT "
                 f"{f['pd']['first']['ttft_ms']:.0f} ms (handshake), prewarmed "
                 f"{f['pd_prewarmed']['first']['ttft_ms']:.0f} ms, second "
                 f"{f['pd']['second']['ttft_ms']:.0f} ms")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
