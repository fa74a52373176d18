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
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from kvbridge.tools.bench.common import apply_quick, load_average, proc_stats, progress
from kvbridge.tools.bench.load import run_closed_loop, stream_completion
from kvbridge.tools.bench.report import percentiles
from kvbridge.tools.bench.serve_metrics import breakdown, metric, snapshot, transfer_totals
from kvbridge.tools.bench.serve_report import SWEPT, plot, summary
from kvbridge.tools.launch import KVBridgeProcess, free_port
from kvbridge.tools.testing.wait import wait_until

__all__ = ["add_arguments", "plot", "run", "summary"]

START_TIMEOUT = 180.0
SETUPS = ("pd", "pd_prewarmed", "mono")
QUICK = {"concurrency": "1,2", "prompt_tokens": 16, "output_tokens": 4, "requests": 2}
TRANSFER_SLACK_MS = 3.0  # goal: P/D TTFT <= monolithic TTFT + 3 ms + the KV transfer
FIRST_TOKEN_SLACK_MS = 2.0  # goal with the first token from the prefill: + 2 ms


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--concurrency", default="1,4,16", help="requests in flight, per level")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument("--requests", type=int, default=0,
                   help="requests per level (default: max(12, 3 x concurrency))")
    p.add_argument("--handshake", choices=["http", "zmq"], default="http")
    p.add_argument("--first-token-from", choices=["prefill", "decode"], default="prefill",
                   help="the proxies' --first-token-from (prefill: the first token straight "
                        "from the prefill's answer)")
    p.add_argument("--decode-tp", type=int, default=1)
    p.add_argument("--dtype", default="float32", choices=["float32", "float64", "bfloat16"])
    p.add_argument("--model", default=None,
                   help="checkpoint directory or a preparable model name, e.g. "
                   "smollm2-135m-instruct (default: the built-in tiny model)")
    p.add_argument("--no-spin-baseline", dest="spin_baseline", action="store_false",
                   help="skip the idle-CPU check of an engine with the progress delay at 0")


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


def _level(url: str, concurrency: int, requests: int, args: argparse.Namespace,
           seed: int) -> dict[str, Any]:
    """A closed loop of streamed completions (``ignore_eos``, exact output length)."""
    model: _Model = args.served

    async def send(client, i: int) -> dict[str, Any]:
        body = {"model": model.name, "prompt": model.prompt(args.prompt_tokens, seed + i),
                "max_tokens": args.output_tokens, "temperature": 0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        t0 = time.perf_counter()
        got = await stream_completion(client, url + "/v1/completions", body)
        end = time.perf_counter()
        tokens = got["usage"].get("completion_tokens", got["chunks"])
        return {"ttft": got["first"] - t0, "latency": end - t0, "tokens": tokens,
                "prompt_tokens": got["usage"].get("prompt_tokens", 0),
                "itl": (got["last"] - got["first"]) / (tokens - 1) if tokens > 1 else None}

    loop = run_closed_loop(concurrency, requests, send)
    results, errors, wall = loop.results, loop.errors, loop.seconds
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
        hs0 = metric(client, decode_url, "kvbridge_handshake_seconds_sum") \
            if decode_url else float("nan")
        r = _level(url, 1, 1, args, seed=10_000 + len(out))
        hs1 = metric(client, decode_url, "kvbridge_handshake_seconds_sum") \
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
    def status() -> dict[str, Any] | None:
        st = client.get(proxy_url + "/v1/kv/prewarm", timeout=5).json()
        return st if st["done"] else None

    st = wait_until(status, max(0.0, deadline - time.monotonic()), "proxy prewarm done",
                    every=0.05)
    bad = [x for x in st["pairs"] if x["outcome"] != "ok"]
    if bad or not st["pairs"]:
        raise RuntimeError(f"proxy prewarm failed: {st}")
    return st


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


def run(args: argparse.Namespace) -> dict[str, Any]:
    import httpx

    from kvbridge._nixl import PROGRESS_DELAY_US

    apply_quick(args, QUICK)
    args.levels = [int(x) for x in str(args.concurrency).split(",")]
    args.served = model = _Model(args.model, args.dtype)
    load_before = load_average()
    with tempfile.TemporaryDirectory(prefix="kvbridge-bench-serve-") as t:
        tmp = Path(t)
        token = tmp / "token"
        token.write_text(os.urandom(16).hex())
        token.chmod(0o600)
        side = ["--handshake", args.handshake, "--side-channel-token-file", str(token),
                "--trusted-side-channels", "127.0.0.1",
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
                        "--admin-routes", "open", "--first-token-from",
                        args.first_token_from, *proxy_args[s])
                for s in ("pd", "pd_prewarmed"):
                    procs[s]["proxy"].wait_healthy(urls[s]["proxy"] + "/health", deadline)
                t_ready = time.monotonic()
                prewarm = _wait_prewarm(client, urls["pd_prewarmed"]["proxy"], deadline)
                prewarm_wait = time.monotonic() - t_ready
                startup = time.monotonic() - t_start
                ahead_ms = 1000 * metric(client, urls["pd_prewarmed"]["decode"],
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
                        kv0 = transfer_totals(client, urls[s]["decode"]) if s == "pd" else None
                        snap0 = snapshot(client, urls[s])
                        r = _level(target[s], c, n, args, seed=1000 * c)
                        r["ttft_breakdown_ms"] = breakdown(
                            s, snap0, snapshot(client, urls[s]), r.pop("ttft_mean_ms"),
                            first_from_prefill=args.first_token_from == "prefill")
                        r["cpu_seconds"] = {k: proc_stats(p.proc.pid)["cpu_seconds"] - cpu0[k]
                                            for k, p in procs[s].items()}
                        if kv0 is not None:  # the decode's own timing of the KV loads
                            kv1 = transfer_totals(client, urls[s]["decode"])
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
    if pd1 and mono1 and args.first_token_from == "prefill":
        budget = mono1["ttft_ms"]["p50"] + FIRST_TOKEN_SLACK_MS
        goals.append({"goal": "P/D TTFT p50 <= monolithic TTFT p50 + 2 ms (the first token "
                              "from the prefill), 1 in flight, loopback",
                      "value": {"pd_ttft_p50_ms": round(pd1["ttft_ms"]["p50"], 2),
                                "budget_ms": round(budget, 2)},
                      "reached": pd1["ttft_ms"]["p50"] <= budget})
        goals.append({"goal": "P/D inter-token latency p50 <= monolithic's, 1 in flight",
                      "value": {"pd_itl_p50_ms": round(pd1["itl_ms"]["p50"], 2),
                                "mono_itl_p50_ms": round(mono1["itl_ms"]["p50"], 2)},
                      "reached": pd1["itl_ms"]["p50"] <= mono1["itl_ms"]["p50"]})
    elif pd1 and mono1:
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
                   "token": True, "tls": False, "quick": args.quick,
                   "first_token_from": args.first_token_from},
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
