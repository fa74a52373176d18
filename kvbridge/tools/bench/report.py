"""Shared by the benchmarks: percentiles, the machine they ran on, JSON + PNG output."""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path
from typing import Any

DEFAULT_OUT = Path("bench/results")


def percentiles(samples: list[float], qs: tuple[float, ...] = (50, 90, 99)) -> dict[str, float]:
    """Nearest-rank percentiles of ``samples`` (seconds in, milliseconds out)."""
    if not samples:
        return {f"p{int(q)}": float("nan") for q in qs}
    s = sorted(samples)
    return {f"p{int(q)}": 1000 * s[min(len(s) - 1, max(0, round(q / 100 * len(s)) - 1))]
            for q in qs}


def goal_lines(result: dict[str, Any]) -> list[str]:
    """One summary line per goal of the issue: the figure, reached or not."""
    return [f"goal {g['goal']}: {g['value']} -> {'reached' if g['reached'] else 'NOT reached'}"
            for g in result.get("goals", [])]


def machine() -> dict[str, Any]:
    mem = 0
    try:
        with open("/proc/meminfo") as f:
            mem = int(f.readline().split()[1]) // 1024
    except OSError:
        pass
    cpu = ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")),
                       "")
    except OSError:
        pass
    return {"cpus": os.cpu_count(), "cpu": cpu, "memory_mib": mem,
            "python": platform.python_version(), "platform": platform.platform()}


def write(name: str, result: dict[str, Any], out_dir: Path = DEFAULT_OUT) -> Path:
    """``out_dir/name.json`` with the machine and a timestamp added."""
    out_dir.mkdir(parents=True, exist_ok=True)
    result = {"benchmark": name, "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "machine": machine(), **result}
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    return path
