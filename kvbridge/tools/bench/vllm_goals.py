"""The goals of ``kvbridge bench vllm`` (kvbridge/tools/bench/vllm.py), checked on its results."""

from __future__ import annotations

from typing import Any

COLD_GOAL = 1.2  # cold http <= 1.2x native zmq cold; cold https <= 1.2x (that + bare TLS)
TTFT_GOAL = 1.02  # plug-in P/D TTFT p50 <= 1.02x native
THROUGHPUT_GOAL = 0.98  # plug-in tokens/s at 8 in flight >= 0.98x native


def goals(r: dict[str, Any]) -> list[dict[str, Any]]:
    native = r.get("native") or {}
    goals: list[dict[str, Any]] = []

    def goal(text: str, ratio: float, limit: float, at_least: bool = False) -> None:
        """``ratio`` at most ``limit`` (a cost), or at least (``at_least``: a throughput)."""
        reached = ratio >= limit if at_least else ratio <= limit
        goals.append({"goal": text, "value": f"{ratio:.2f}x", "reached": reached})

    for s in ("zmq", "http", "https"):
        if s in r and native:
            goal(f"{s} warm handshake p50 <= native", r[s]["handshake_warm_ms"]["p50"]
                 / native["handshake_warm_ms"]["p50"], 1.0)
            goal(f"{s} P/D TTFT p50 <= 1.02x native", r[s]["ttft_1_in_flight_ms"]["p50"]
                 / native["ttft_1_in_flight_ms"]["p50"], TTFT_GOAL)
            if native["tokens_per_s_8_in_flight"] and r[s]["tokens_per_s_8_in_flight"]:
                goal(f"{s} tokens/s at 8 in flight >= 0.98x native",
                     r[s]["tokens_per_s_8_in_flight"] / native["tokens_per_s_8_in_flight"],
                     THROUGHPUT_GOAL, at_least=True)
    plain = r.get("http-unvalidated")
    if plain is not None and "http" in r:  # the cost of READ validation
        goal("http TTFT p50 <= 1.02x http-unvalidated", r["http"]["ttft_1_in_flight_ms"]["p50"]
             / plain["ttft_1_in_flight_ms"]["p50"], TTFT_GOAL)
        if plain["tokens_per_s_8_in_flight"] and r["http"]["tokens_per_s_8_in_flight"]:
            goal("http tokens/s at 8 in flight >= 0.98x http-unvalidated",
                 r["http"]["tokens_per_s_8_in_flight"] / plain["tokens_per_s_8_in_flight"],
                 THROUGHPUT_GOAL, at_least=True)
        tag_share = r["http"]["read_validation"].get("tag_read_share")
        if tag_share is not None:
            goal("tag READ <= 1% of the data READ", tag_share / 0.01, 1.0)
    busy = r.get("http-busy")
    if busy is not None and "http" in r and busy["tokens_per_s_8_in_flight"]:
        # the progress delay (docs/vllm.md §5c): no throughput lost to a sleeping thread
        goal("http tokens/s at 8 in flight >= 0.98x http-busy",
             r["http"]["tokens_per_s_8_in_flight"] / busy["tokens_per_s_8_in_flight"],
             THROUGHPUT_GOAL, at_least=True)
    if "http" in r and native:
        goal("cold http handshake p50 <= 1.2x native zmq", r["http"]["handshake_cold_ms"]
             ["p50"] / native["handshake_cold_ms"]["p50"], COLD_GOAL)
    if "https" in r and native and "bare_tls_ms" in r["https"]:
        # a peer never met: a full TLS handshake is the floor, measured in the same run
        floor = native["handshake_cold_ms"]["p50"] + r["https"]["bare_tls_ms"]["p50"]
        goal("cold https handshake p50 <= 1.2x (native zmq cold + a bare TLS handshake)",
             r["https"]["handshake_cold_ms"]["p50"] / floor, COLD_GOAL)
    return goals
