"""Background tasks of the proxy (prewarms of new pairs, releases) that shutdown waits for."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

__all__ = ["TaskSet"]


class TaskSet:
    def __init__(self) -> None:
        self._tasks: set[asyncio.Task] = set()

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def wait(self, timeout: float) -> None:
        """Let the tasks under way finish (e.g. releases reach the prefills), up to ``timeout``."""
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=timeout)
