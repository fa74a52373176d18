"""Smoke tests of ``kvbridge bench``: every benchmark runs with ``--quick`` into a tmp
``--out`` and writes a JSON with the expected keys and sane values, and a PNG.

No timing assertions: the figures depend on the machine and on what else runs on it.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvbridge.tools.bench import BENCHMARKS
from tests.conftest import ROOT


def _run(name: str, out: Path, *extra: str, timeout: float = 120) -> dict:
    proc = subprocess.run(
        [sys.executable, "-m", "kvbridge.cli", "bench", name, "--quick", "--out", str(out),
         *extra], capture_output=True, text=True, timeout=timeout,
        env={**os.environ, "PYTHONPATH": str(ROOT), "MPLBACKEND": "Agg"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"wrote {out / name}.json" in proc.stdout
    data = json.loads((out / f"{name}.json").read_text())
    png = out / f"{name}.png"
    assert png.exists() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert data["benchmark"] == name and data["machine"]["cpus"] >= 1
    assert data["config"]["quick"] is True
    return data


def _positive(*values: float) -> None:
    for v in values:
        assert isinstance(v, (int, float)) and math.isfinite(v) and v > 0, values


def _goals(data: dict) -> None:
    for g in data["goals"]:
        assert set(g) == {"goal", "value", "reached"} and isinstance(g["reached"], bool)


def test_every_benchmark_is_registered():
    assert set(BENCHMARKS) == {
        "handshake", "sidechannel", "transfer", "serve", "fleet", "hostile", "vllm", "clients"}


def test_handshake(tmp_path):
    d = _run("handshake", tmp_path)
    assert d["metadata"]["envelope_bytes_per_rank"] and all(
        b > 0 for b in d["metadata"]["envelope_bytes_per_rank"])
    for m in ("zmq", "http", "https"):
        w = d["warm_ms"][m]
        _positive(w["p50"], w["p90"], w["p99"])
        assert w["p50"] <= w["p90"] <= w["p99"] and w["n"] == d["config"]["warm"]
        for case in ("cold_ms", "known_ms", "known_idle_ms"):  # unknown peer, known peer
            for part in ("total", "fetch", "connect"):
                _positive(*(d[case][m][part][q] for q in ("p50", "p90", "p99")))
            assert d[case][m]["total"]["n"] == d["config"]["cold"]
        assert d["ratios"][f"{m}_known_over_zmq_cold_p50"] > 0
        assert d["ratios"][f"{m}_known_idle_over_zmq_cold_p50"] > 0
    for m in ("http", "https"):  # a keep-warm request, kept connection and reconnect
        _positive(*(d["keep_warm_ms"][m][k]["p50"] for k in ("kept", "reconnect")))
    # the TLS stack's cost for an unknown peer, part by part
    assert set(d["tls_split_ms"]) == {"tcp_connect", "tls_full", "tls_resumed",
                                      "first_get_tls", "first_get_plain"}
    _positive(*(v["p50"] for v in d["tls_split_ms"].values()))
    _positive(d["ratios"]["http_over_zmq_warm_p50"], d["ratios"]["https_over_zmq_warm_p50"])
    _positive(*d["ratios"].values())
    assert len(d["goals"]) == 4
    assert d["goals"][3]["goal"] == "cold https to a known peer p50 <= 1.5x cold zmq"
    assert d["goals"][3]["value"] == round(d["ratios"]["https_known_over_zmq_cold_p50"], 3)
    _goals(d)


@pytest.mark.parametrize("generator", ["python", "wrk"])
def test_sidechannel(tmp_path, generator):
    # wrk comes from Debian's package (.ci/run installs it): a missing one fails here.
    d = _run("sidechannel", tmp_path, "--load-generator", generator)
    assert d["config"]["client"].startswith("wrk" if generator == "wrk" else "asyncio")
    assert set(d["results"]) == {"http", "https"}
    for rows in d["results"].values():
        assert [r["clients"] for r in rows] == d["config"]["levels"]
        for r in rows:
            assert r["errors"] == 0, r["error_kinds"]
            _positive(r["handshakes"], r["handshakes_per_s"], r["latency_ms"]["p50"],
                      r["latency_ms"]["p99"], r["server_cpu_seconds"],
                      r["server_peak_rss_mib"])
    _goals(d)


def test_transfer(tmp_path):
    d = _run("transfer", tmp_path)
    assert len(d["results"]) == len(d["config"]["blocks"]) * len(d["config"]["block_bytes"])
    for r in d["results"]:
        _positive(r["nixl_tags_read"]["seconds"])
        _positive(r["bytes"], r["nixl_contiguous"]["gb_per_s"],
                  r["nixl_contiguous"]["descs_per_s"], r["memcpy_contiguous"]["gb_per_s"],
                  r["tcp_contiguous"]["gb_per_s"], r["nixl_over_memcpy"])
        if r["blocks"] > 1:
            _positive(r["nixl_scattered"]["gb_per_s"], r["memcpy_scattered"]["gb_per_s"])
    _goals(d)


def test_transfer_netns(tmp_path):
    """The peer in a network namespace of its own, UCX over TCP across a veth: every READ's
    bytes cross the veth, and both namespaces are gone afterwards."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        reason = "network namespaces need root and the ip command (iproute2)"
        (pytest.fail if os.environ.get("CI") == "true" else pytest.skip)(reason)
    d = _run("transfer", tmp_path, "--netns")
    assert d["config"]["ucx_env"]["UCX_TLS"] == "tcp,self"
    assert len(d["results"]) == len(d["config"]["blocks"]) * len(d["config"]["block_bytes"])
    for r in d["results"]:
        _positive(r["nixl_contiguous"]["gb_per_s"], r["tcp_contiguous"]["gb_per_s"],
                  r["nixl_over_tcp"])
        assert r["veth_rx_bytes_per_read"] >= r["bytes"]  # the READ went over the wire
    _goals(d)
    assert d["goals"]
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                          check=True).stdout
    for ns in d["config"]["namespaces"].values():
        assert ns not in left


@pytest.mark.timeout(120)
def test_serve(tmp_path):
    """SLOW (~15-30 s, over the 25 s aimed at): starts two P/D set-ups (prefill, decode,
    proxy; one proxy prewarming) and a monolithic engine; the engines' start-up dominates."""
    d = _run("serve", tmp_path, "--no-spin-baseline")
    for setup in ("pd", "mono"):
        assert [r["concurrency"] for r in d["results"][setup]] == d["config"]["levels"]
        for r in d["results"][setup]:
            assert r["errors"] == 0, r["error_samples"]
            _positive(r["tokens_per_s"], r["ttft_ms"]["p50"], r["ttft_ms"]["p99"],
                      r["itl_ms"]["p50"], r["output_tokens"])
            # every millisecond of the mean TTFT has a name: the parts add up to it
            parts = dict(r["ttft_breakdown_ms"])
            total, _ = parts.pop("ttft_mean"), parts.pop("prefill_hop_engine_part", None)
            assert all(math.isfinite(v) for v in parts.values()), parts
            assert sum(parts.values()) == pytest.approx(total, rel=0.02), parts
    for setup in ("pd", "pd_prewarmed", "mono"):
        for which in ("first", "second"):
            _positive(d["first_requests"][setup][which]["ttft_ms"])
    assert "pd_prewarmed" not in d["results"]
    # cold: the first request paid the handshake; prewarmed: the proxy had it done before
    _positive(d["first_requests"]["pd"]["first"]["decode_handshake_ms"])
    assert d["first_requests"]["pd_prewarmed"]["first"]["decode_handshake_ms"] == 0
    _positive(d["first_requests"]["pd_prewarmed"]["handshake_done_ahead_ms"])
    assert d["prewarm"]["done"] and all(x["outcome"] == "ok" for x in d["prewarm"]["pairs"])
    for k, v in d["idle_cpu_per_s"].items():
        assert math.isfinite(v) and v >= 0, k
    for o in d["pd_over_mono"]:
        _positive(o["ttft_p50"], o["itl_p50"], o["tokens_per_s"])
    _goals(d)


@pytest.mark.timeout(150)
def test_fleet(tmp_path):
    """SLOW (~40 s): etcd, 2 prefills, 2 decodes, a proxy, then a third decode."""
    d = _run("fleet", tmp_path, timeout=150)
    assert d["kill"]["client_errors"] == 0, d["totals"]["error_samples"]
    assert d["steady"]["proxy_registry_calls"] == 0  # nothing on the request path
    assert d["steady"]["requests"] > 0 and d["kill"]["requests"] > 0
    _positive(d["kill"]["to_unrouted_ms"], d["kill"]["to_out_of_view_ms"],
              d["join"]["start_to_first_routed_ms"])
    assert d["kill"]["to_unrouted_ms"] <= d["kill"]["to_out_of_view_ms"]
    assert d["join"]["start_to_ready_ms"] < d["join"]["start_to_first_routed_ms"] + 1000
    assert len(d["timeline"]["ends"]) == d["totals"]["requests"]
    _goals(d)


# matplotlib made unimportable in the CLI's process (None in sys.modules stops an import).
_NO_MATPLOTLIB = ("import sys; sys.modules['matplotlib'] = None; "
                  "from kvbridge.cli import main; sys.exit(main(sys.argv[1:]))")


def test_without_matplotlib_the_json_is_still_written(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-c", _NO_MATPLOTLIB, "bench", "transfer", "--quick", "--out",
         str(tmp_path)], capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    # the benchmark's own progress lines ("[bench ...]"), then one line about the plot
    lines = [ln for ln in proc.stderr.strip().splitlines() if not ln.startswith("[bench ")]
    assert len(lines) == 1 and "matplotlib is not installed" in lines[0], proc.stderr[-3000:]
    assert "kvbridge[bench]" in lines[0]
    data = json.loads((tmp_path / "transfer.json").read_text())
    assert data["benchmark"] == "transfer" and data["results"]
    assert not (tmp_path / "transfer.png").exists()


def test_hostile(tmp_path):
    d = _run("hostile", tmp_path, timeout=300)  # five engines and a proxy start
    _goals(d)
    for name in ("idle_flood", "mtls_flood", "slowloris", "zmq_endless"):
        a = d["attacks"][name]
        assert a["handshakes_failed"] == 0, (name, a)
        _positive(a["handshake_ms"]["p50"], a["rss_mib"]["before"], a["rss_mib"]["after"])
    assert d["attacks"]["zmq_endless"]["dropped"] is True
    pin = d["pinning_flood"]  # served, and the prefill's blocks not held
    assert pin["statuses"] == ["200"] and pin["non_ascii_id_status"] == 200
    assert pin["blocks_back_s"] < 5  # not at the 30 s lease
    kv = d["kv_integrity"]
    assert kv["keyless_releases"]["released"] == 0
    assert kv["keyless_releases"]["ignored"] == kv["keyless_releases"]["tries"]
    rounds = d["config"]["kv_rounds"]
    for name, x in kv["reads"].items():
        assert x["wrong_answers"] == 0, (name, x)
        assert x["stale_loads"] == (0 if name == "normal" else rounds), (name, x)
    assert d["audit_log"]["lines_per_1000"] == 1000  # one line per fetch
    _positive(d["audit_log"]["bytes_per_1000"])


def test_clients(tmp_path):
    d = _run("clients", tmp_path)
    assert set(d["clients"]) == {"httpx", "aiohttp", "httpx+aiohttp"}  # the proxy's: the last
    for s in d["clients"].values():
        for kind in ("health", "first_byte", "completion"):
            _positive(s[kind]["p50"], s[kind]["p99"])
            assert s[kind]["p50"] <= s[kind]["p99"]
        assert s["first_byte"]["p50"] <= s["completion"]["p50"]
