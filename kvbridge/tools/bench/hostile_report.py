"""``kvbridge bench hostile``'s summary lines and plot."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvbridge.tools.bench.common import pyplot
from kvbridge.tools.bench.report import goal_lines

RSS_BOUND_MIB = 64  # the bound on growth under the endless-frame attack
HANDSHAKE_GOAL_S = 2.0


def summary(r: dict[str, Any]) -> str:
    lines = []
    for name, a in r["attacks"].items():
        rss = a["rss_mib"]
        held = (
            f"held {a['held_after_handshakes']}/{a['connections']}"
            if "connections" in a
            else f"sent {a['frames_sent_before_drop']}/{a['frames_tried']} frames"
        )
        lines.append(
            f"{name:12s} {held:24s} handshake p50 {a['handshake_ms']['p50']:.1f} ms "
            f"p99 {a['handshake_ms']['p99']:.1f} ms, {a['handshakes_failed']} failed; "
            f"RSS MiB {rss['before']:.0f} -> peak {rss['peak']:.0f} -> "
            f"{rss['after']:.0f}"
        )
    if (pin := r.get("pinning_flood")) is not None:
        lines.append(
            f"pinning_flood {pin['requests']} requests (300-char x-request-id): statuses "
            f"{pin['statuses']}, prefill free blocks {pin['free_blocks_before']:.0f} -> "
            f"{pin['free_blocks_after_flood']:.0f} right after, back in "
            f"{pin['blocks_back_s']:.2f} s; a legitimate request {pin['legit_request_s']['before']:.2f}"
            f" s before, {pin['legit_request_s']['after']:.2f} s right after; non-ASCII id: "
            f"{pin['non_ascii_id_status']}")
    if (kv := r.get("kv_integrity")) is not None:
        k = kv["keyless_releases"]
        lines.append(f"keyless releases: {k['released']} of {k['tries']} took effect, "
                     f"{k['ignored']:.0f} ignored and counted")
        for name, x in kv["reads"].items():
            lines.append(f"READ {name:20s} {x['requests']} requests: {x['wrong_answers']} wrong "
                         f"answers, {x['stale_loads']:.0f} caught stale, request p50 "
                         f"{x['request_ms']['p50']:.1f} ms")
    if (audit := r.get("audit_log")) is not None:
        lines.append(f"audit log: {audit['bytes_per_1000'] / 1024:.1f} KiB and "
                     f"{audit['lines_per_1000']:.0f} lines per 1,000 metadata fetches")
    return "\n".join(lines + goal_lines(r))


def plot(r: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    names = list(r["attacks"])
    if not names:  # --pinning-only: the prefill's free blocks
        pin = r["pinning_flood"]
        fig, ax = plt.subplots(figsize=(5, 4))
        ax.bar(["before", "right after"], [pin["free_blocks_before"],
                                           pin["free_blocks_after_flood"]])
        ax.set_ylabel("prefill free KV blocks")
        ax.set_title(f"pinning flood ({pin['requests']} requests), back in "
                     f"{pin['blocks_back_s']:.2f} s")
        fig.tight_layout()
        fig.savefig(path)
        plt.close(fig)
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    xs = range(len(names))
    for off, q in ((-0.2, "p50"), (0.2, "p99")):
        ax1.bar(
            [x + off for x in xs],
            [r["attacks"][n]["handshake_ms"][q] for n in names],
            width=0.4,
            label=q,
        )
    ax1.axhline(1000 * HANDSHAKE_GOAL_S, color="red", linestyle="--", label="goal")
    ax1.set_xticks(list(xs), names)
    ax1.set_ylabel("real handshake during the attack (ms)")
    ax1.set_yscale("log")
    ax1.legend()
    for off, k in ((-0.27, "before"), (0, "peak"), (0.27, "after")):
        ax2.bar(
            [x + off for x in xs],
            [r["attacks"][n]["rss_mib"][k] for n in names],
            width=0.27,
            label=k,
        )
    ax2.set_xticks(list(xs), names)
    ax2.set_ylabel("prefill RSS (MiB)")
    ax2.legend()
    fig.suptitle(f"kvbridge bench hostile ({r['config']['connections']} connections per flood)")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
