"""``kvbridge bench serve``'s summary lines and plot."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvbridge.tools.bench.common import pyplot
from kvbridge.tools.bench.report import goal_lines

SWEPT = ("pd", "mono")  # the concurrency sweep skips pd_prewarmed (its first request is the point)


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
    for g in [g for g in r["goals"] if "budget_ms" in g["value"]]:  # TTFT at 1 in flight
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
