"""``wait_until``: the one way tests, benchmarks and the demo wait for a condition.

A condition polled with a deadline, never a fixed sleep: it returns as soon as the
condition holds, and fails with a message naming what did not happen.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

__all__ = ["WaitTimeout", "wait_until"]


class WaitTimeout(AssertionError):
    """The condition did not hold within the timeout (an ``AssertionError``, so that a
    test reports it as a failed check)."""


def wait_until(cond: Callable[[], T], timeout: float, what: str, *,
               tolerate: tuple[type[BaseException], ...] = (), every: float = 0.02,
               message: Callable[[], object] | None = None) -> T:
    """Poll ``cond`` until it returns something true (returned), failing after ``timeout``.

    An exception in ``tolerate`` counts as "not yet": a store that is slow to answer on a
    busy machine (an etcd read timing out) must not fail an "eventually" check.
    ``every`` is the interval between polls; ``message``, if given, is called on timeout
    and its result added to the error (the last state seen, a log tail).
    """
    deadline = time.monotonic() + timeout
    while True:
        try:
            if value := cond():
                return value
        except tolerate:
            pass
        if time.monotonic() >= deadline:
            detail = f": {message()}" if message is not None else ""
            raise WaitTimeout(f"not within {timeout:g}s: {what}{detail}")
        time.sleep(every)
