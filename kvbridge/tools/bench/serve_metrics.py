"""``kvbridge bench serve``'s readings of the engines' and the proxy's ``/metrics``: one
figure, a snapshot of every sample, and a level's mean TTFT split into named parts."""

from __future__ import annotations

from kvbridge.tools.launch import read_metric
from kvbridge.tools.testing.prometheus import read_samples

PHASES = ("queue", "kv_load", "after_load", "first_step", "time_to_first_token")


def metric(client, url: str, name: str) -> float:
    """One figure of ``url``'s ``/metrics`` (NaN when it cannot be read)."""
    try:
        return read_metric(client, url, name)
    except Exception:  # an engine that died mid-run: the figure is missing, not zero
        return float("nan")


def _samples(client, url: str) -> dict[str, float]:
    """Every sample of ``url``'s Prometheus ``/metrics`` (empty if it cannot be read)."""
    try:
        return read_samples(client, url)
    except Exception:
        return {}


def snapshot(client, urls: dict[str, str]) -> dict[str, dict[str, float]]:
    return {k: _samples(client, u) for k, u in urls.items()}


def _mean_ms(a: dict[str, float], b: dict[str, float], name: str) -> float:
    """Mean of histogram ``name`` (a ``..._sum``/``..._count`` pair, labels included in
    ``name``'s braces) over what was observed between snapshots ``a`` and ``b``."""
    base, _, labels = name.partition("{")
    labels = "{" + labels if labels else ""
    n = b.get(f"{base}_count{labels}", 0.0) - a.get(f"{base}_count{labels}", 0.0)
    s = b.get(f"{base}_sum{labels}", 0.0) - a.get(f"{base}_sum{labels}", 0.0)
    return 1000 * s / n if n > 0 else float("nan")


def breakdown(setup: str, a: dict[str, dict[str, float]], b: dict[str, dict[str, float]],
              ttft_mean_ms: float, first_from_prefill: bool = False) -> dict[str, float]:
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
    if first_from_prefill:
        # The client's first token is the prefill's: the decode's phases come after it.
        return {
            "prefill_hop": hop,
            "prefill_hop_engine_part": prefill_engine,
            "proxy_and_http_remainder": ttft_mean_ms - hop,
            "ttft_mean": ttft_mean_ms,
        }
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


def transfer_totals(client, decode_url: str) -> tuple[float, float, float]:
    """The decode's KV loads so far: seconds, count, bytes."""
    return (metric(client, decode_url, "kvbridge_kv_load_seconds_sum"),
            metric(client, decode_url, "kvbridge_kv_load_seconds_count"),
            metric(client, decode_url, "kvbridge_kv_bytes_loaded_total"))
