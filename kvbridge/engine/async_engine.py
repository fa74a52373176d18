"""An asyncio front for ``LLMEngine``: the engine loop runs in a background thread.

Coroutines submit work through a thread-safe command queue; the loop thread
adds and aborts requests between steps and hands each output to the request's
``asyncio.Queue`` on the event loop that asked for it. While requests only wait
(for remote KV or held blocks), the loop steps to let the connector make progress,
instead of spinning: soon after the wait began (a READ of a few blocks takes about a
millisecond) and then less and less often, every ``poll_interval`` seconds at most.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from kvbridge.engine.engine import LLMEngine
from kvbridge.engine.sampling import SamplingParams
from kvbridge.engine.sequence import RequestOutput
from kvbridge.errors import EngineDeadError
from kvbridge.params import KVTransferParams

logger = logging.getLogger(__name__)

_STOP = ("stop",)
# First poll of a wait; each poll without progress doubles it, up to poll_interval.
_FIRST_POLL = 0.0002


_WORKERS_LOST = "a TP worker of this engine (or the node it runs on) is gone"


class AsyncEngine:
    """Owns ``engine`` from now on: only the loop thread touches it (besides collective_rpc)."""

    def __init__(self, engine: LLMEngine, poll_interval: float = 0.005,
                 phase_observer: Callable[[dict[str, float]], None] | None = None):
        """``phase_observer``: called on the loop thread with ``RequestOutput.times`` of
        each request's first token (for metrics)."""
        self.engine = engine
        self.poll_interval = poll_interval
        self._phase_observer = phase_observer
        self._commands: queue.Queue[tuple] = queue.Queue()
        # request id -> where its outputs go; None once aborted, until the engine's final
        # output for it arrives (so the id cannot be reused while the engine still has it).
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue] | None] = {}
        self._lock = threading.Lock()
        self._dead: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="kvbridge-engine", daemon=True)
        self._thread.start()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def is_running(self) -> bool:
        # A lost worker (or node) counts at once, not only after the next step fails.
        return self._dead is None and self._thread.is_alive() and self.engine.workers.alive

    @property
    def dead_reason(self) -> str | None:
        if self._dead is None:
            return None if self.engine.workers.alive else _WORKERS_LOST
        return str(self._dead) or type(self._dead).__name__

    def check_request(self, prompt_token_ids: list[int], sampling: SamplingParams,
                      kv_transfer_params: KVTransferParams | None = None) -> None:
        self.engine.check_request(prompt_token_ids, sampling, kv_transfer_params)

    async def generate(self, prompt_token_ids: list[int], sampling: SamplingParams,
                       request_id: str | None = None,
                       kv_transfer_params: KVTransferParams | None = None,
                       ) -> AsyncIterator[RequestOutput]:
        """The request's outputs as they come; the last has ``finished`` set.

        Raises ``ValueError`` if the request is rejected, ``EngineDeadError`` if
        the engine stops. Closing the iterator early aborts the request.
        """
        self.check_request(prompt_token_ids, sampling, kv_transfer_params)
        request_id = request_id or uuid.uuid4().hex
        q: asyncio.Queue = asyncio.Queue()
        with self._lock:
            if self._dead is not None:
                raise EngineDeadError(f"engine is not running: {self.dead_reason}")
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._streams[request_id] = (asyncio.get_running_loop(), q)
        self._commands.put(("add", request_id, prompt_token_ids, sampling, kv_transfer_params,
                            time.monotonic()))
        finished = False
        try:
            while not finished:
                item = await q.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        with self._lock:
            if self._streams.get(request_id) is None:
                return  # unknown, finished, or already aborting
            self._streams[request_id] = None
        self._commands.put(("abort", request_id))

    def refused(self, kv_transfer_params: KVTransferParams) -> None:
        """A request with these params was refused before it reached the engine: the
        connector tells the instance holding its KV (``SchedulerConnector.on_refused``)."""
        self._commands.put(("refused", kv_transfer_params))

    def wake(self) -> None:
        """Make an idle loop look for work again (e.g. the connector now awaits workers)."""
        self._commands.put(("wake",))

    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        """Blocking; thread-safe (serialised with engine steps)."""
        return self.engine.collective_rpc(method, *args)

    def shutdown(self) -> None:
        if self._thread.is_alive():
            self._commands.put(_STOP)
            self._thread.join()
        self.engine.shutdown()

    def __enter__(self) -> AsyncEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # -- the loop thread -----------------------------------------------------------------

    def _run(self) -> None:
        engine = self.engine
        poll = _FIRST_POLL
        try:
            while True:
                # Go straight on while the model has work (or a load just completed); a
                # step that ran nothing (all requests wait for remote KV, held blocks or
                # free blocks) means poll, sooner at first.
                if engine.has_runnable_work() and (engine.last_step_ran_model
                                                   or engine.last_step_loaded):
                    timeout: float | None = 0.0
                    poll = _FIRST_POLL
                elif engine.has_pending_work():
                    timeout = poll
                    poll = min(2 * poll, self.poll_interval)
                else:
                    timeout = None  # idle: sleep until a command arrives
                    poll = _FIRST_POLL
                command = self._handle_commands(timeout)
                if command is None:
                    break
                if command:
                    poll = _FIRST_POLL  # new work: its wait starts now
                if engine.has_pending_work():
                    self._deliver(engine.step())
            self._fail_all(EngineDeadError("engine shut down"))
        except BaseException as e:
            logger.exception("engine loop failed")
            self._fail_all(EngineDeadError(f"engine failed: {e}"), e)

    def _handle_commands(self, timeout: float | None) -> bool | None:
        """Apply queued commands (waiting up to ``timeout`` for the first): whether there
        were any; None on stop."""
        try:
            if timeout == 0:
                cmd = self._commands.get_nowait()
            else:
                cmd = self._commands.get(timeout=timeout)
        except queue.Empty:
            return False
        while True:
            if cmd is _STOP:
                return None
            if cmd[0] == "add":
                _, request_id, prompt, sampling, params, arrived = cmd
                try:
                    self.engine.add_request(prompt, sampling, request_id, params, arrived)
                except ValueError as e:
                    self._deliver_to(request_id, e, last=True)
            elif cmd[0] == "abort":
                self.engine.abort_request(cmd[1])
            elif cmd[0] == "refused":
                self.engine.connector.on_refused(cmd[1])
            # "wake": nothing to do; the loop re-checks for pending work
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            if out.times is not None and self._phase_observer is not None:
                try:
                    self._phase_observer(out.times)
                except Exception:  # metrics must not stop the engine
                    logger.exception("phase observer failed")
            self._deliver_to(out.request_id, out, last=out.finished)

    def _deliver_to(self, request_id: str, item: RequestOutput | BaseException,
                    last: bool) -> None:
        with self._lock:
            entry = self._streams.pop(request_id, None) if last else self._streams.get(request_id)
        if entry is None:
            return  # aborted by its consumer (or unknown)
        loop, q = entry
        try:
            loop.call_soon_threadsafe(q.put_nowait, item)
        except RuntimeError:
            pass  # its event loop is closed

    def _fail_all(self, error: EngineDeadError, cause: BaseException | None = None) -> None:
        with self._lock:
            self._dead = cause or error
            streams, self._streams = self._streams, {}
        for loop, q in filter(None, streams.values()):
            try:
                loop.call_soon_threadsafe(q.put_nowait, error)
            except RuntimeError:
                pass
