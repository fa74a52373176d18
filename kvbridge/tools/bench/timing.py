"""What the transfer benchmarks share (loopback and across network namespaces): timing a
call by its median, interleaved rounds, NIXL descriptor lists."""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np

__all__ = ["descs", "interleaved", "repeat"]


def repeat(fn, args: argparse.Namespace) -> tuple[float, int]:
    """Median seconds of ``fn()`` over enough runs."""
    times: list[float] = []
    t_end = time.perf_counter() + args.min_seconds
    while len(times) < args.max_iters and (len(times) < args.min_iters
                                           or time.perf_counter() < t_end):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times)), len(times)


def interleaved(fns: dict[str, Any], args: argparse.Namespace) -> dict[str, tuple[float, int]]:
    """Median seconds of each of ``fns``, run in rounds (one call of each per round, the
    order alternating), so that load from the rest of the machine hits all of them alike."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    names = list(fns)
    t_end = time.perf_counter() + args.min_seconds
    rounds = 0
    while rounds < args.max_iters and (rounds < args.min_iters or time.perf_counter() < t_end):
        for k in (names if rounds % 2 == 0 else names[::-1]):
            t0 = time.perf_counter()
            fns[k]()
            times[k].append(time.perf_counter() - t0)
        rounds += 1
    return {k: (float(np.median(v)), len(v)) for k, v in times.items()}


def descs(base: int, count: int, size: int) -> np.ndarray:
    """NIXL descriptors (address, length, device 0) of ``count`` blocks of ``size`` bytes."""
    out = np.zeros((count, 3), dtype=np.uint64)
    out[:, 0] = np.uint64(base) + np.arange(count, dtype=np.uint64) * np.uint64(size)
    out[:, 1] = size
    return out
