"""The load generator of the benchmarks and the end-to-end tests: closed loops.

* ``ClosedLoop``: ``clients`` threads, each sending one request after the other until
  stopped (a fleet under load while its members come and go); every answer is counted
  with the time it ended.
* ``run_closed_loop``: ``requests`` requests at ``concurrency`` in flight on one asyncio
  client (a latency/throughput level), each request's own figures kept.
* ``stream_completion``: one streamed ``/v1/completions``: the time of its first and
  last chunk, and the server's token count.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Awaitable, Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

from kvbridge.tools.testing.wait import wait_until

__all__ = ["ClosedLoop", "LoopResult", "run_closed_loop", "stream_completion"]

ERROR_CHARS = 200


class ClosedLoop:
    """``clients`` threads calling ``request(client, n)`` (``n``: that client's count of
    requests so far) until stopped. ``request`` returns None for a good answer, or a
    sentence saying what was wrong; an exception it raises counts as an error too.

    ``session``: a context manager factory (an ``httpx.Client``) entered once per thread;
    then ``request(client, n, session)``.
    """

    def __init__(self, clients: int, request: Callable[..., str | None], *,
                 session: Callable[[], AbstractContextManager[Any]] | None = None):
        self.request = request
        self.session = session
        self.ok = 0
        self.errors: list[str] = []
        self.done = [0] * clients  # requests finished, per client
        self.timeline: list[tuple[float, bool]] = []  # (end time, ok), monotonic
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True)
                         for i in range(clients)]

    def _run(self, i: int) -> None:
        with self.session() if self.session is not None else nullcontext() as session:
            self._loop(i, () if self.session is None else (session,))

    def _loop(self, i: int, extra: tuple[Any, ...]) -> None:
        n = 0
        while not self._stop.is_set():
            try:
                error = self.request(i, n, *extra)
            except Exception as e:
                error = f"{type(e).__name__}: {e}"
            with self._lock:
                if error is None:
                    self.ok += 1
                else:
                    self.errors.append(error[:300])
                self.done[i] += 1
                self.timeline.append((time.monotonic(), error is None))
            n += 1

    def start(self) -> ClosedLoop:
        for t in self._threads:
            t.start()
        return self

    def stop(self, timeout: float = 150) -> None:
        self._stop.set()
        for t in self._threads:
            if t.ident is not None:  # started
                t.join(timeout)

    def __enter__(self) -> ClosedLoop:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def count(self, since: float, until: float | None = None) -> tuple[int, int]:
        """(requests, errors) that ended in [since, until)."""
        until = until or float("inf")
        with self._lock:
            window = [ok for t, ok in self.timeline if since <= t < until]
        return len(window), window.count(False)

    def wait_ok(self, n: int, timeout: float = 60, *, fail_on_error: bool = True) -> float:
        """Wait until ``n`` more requests have been answered well (or, with
        ``fail_on_error``, until one fails: then raise). Returns when (monotonic)."""
        target = self.ok + n
        wait_until(lambda: self.ok >= target or (fail_on_error and self.errors), timeout,
                   f"{n} more answers")
        if fail_on_error and self.errors:
            raise AssertionError(f"requests failed: {self.errors[:5]}")
        return time.monotonic()


@dataclass
class LoopResult:
    """What ``run_closed_loop`` saw: each good request's figures, the errors, the wall time."""

    results: list[dict[str, Any]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    seconds: float = 0.0


def run_closed_loop(concurrency: int, requests: int,
                    send: Callable[[Any, int], Awaitable[dict[str, Any]]], *,
                    max_connections: int | None = None, timeout: float = 300) -> LoopResult:
    """``requests`` calls of ``send(client, i)`` (``i`` = 0..requests-1), ``concurrency`` at
    a time, on one ``httpx.AsyncClient``; an exception is an error (its first words kept)."""
    import httpx

    async def main() -> LoopResult:
        out = LoopResult()
        todo = iter(range(requests))
        limits = httpx.Limits(max_connections=max_connections or concurrency + 4)
        async with httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False) as client:
            async def worker() -> None:
                for i in todo:
                    try:
                        out.results.append(await send(client, i))
                    except Exception as e:
                        out.errors.append(f"{type(e).__name__}: {e}"[:ERROR_CHARS])

            t0 = time.perf_counter()
            await asyncio.gather(*(worker() for _ in range(concurrency)))
            out.seconds = time.perf_counter() - t0
        return out

    return asyncio.run(main())


async def stream_completion(client: Any, url: str, body: dict[str, Any]) -> dict[str, Any]:
    """POST ``body`` (``"stream": true``) to ``url`` and read the server-sent events:
    ``first``/``last`` (perf_counter times of the first and last chunk with choices),
    ``chunks`` and ``usage`` (the last usage chunk, if any)."""
    first = last = None
    chunks = 0
    usage: dict[str, int] = {}
    async with client.stream("POST", url, json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"status {r.status_code}: {(await r.aread())[:200]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"stream error: {chunk['error']}")
            if chunk.get("usage"):
                usage = chunk["usage"]
            if chunk.get("choices"):
                last = time.perf_counter()
                first = first if first is not None else last
                chunks += 1
    if first is None:
        raise RuntimeError("no tokens streamed")
    return {"first": first, "last": last, "chunks": chunks, "usage": usage}
