"""How the head process runs its TP workers and calls them.

With worker processes (always when tp_size > 1) every rank, rank 0 included,
is a child process, forked by a ``forkserver`` that has already imported torch
(starting a rank costs a fork, not an interpreter); the ranks join one gloo
process group on a free loopback port. The head process itself never joins a
process group, so one Python process can host several engines. Each child
has a pipe to the head: it receives ``(method, args)``, calls that method of
its ``ModelRunner`` and sends back the result or the traceback.

The fork server starts with the first such engine and keeps the environment
(``os.environ``) of that moment for every later worker of this process.

A TP=1 engine without ``worker_processes`` keeps its single ``ModelRunner`` in
the head process and calls it directly.

Children exit when told to, when the head's end of the pipe closes, or when
the head process disappears (a watchdog thread polls for it).

As with ``spawn``/``forkserver`` multiprocessing in general, a script that builds an
engine with worker processes must guard its entry point with ``if __name__ == "__main__":``.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import socket
import sys
import threading
import time
import traceback
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any

from kvbridge.engine.config import EngineConfig
from kvbridge.engine.model_runner import ModelRunner, WorkerConnectorFactory
from kvbridge.errors import WorkerDiedError, WorkerError

logger = logging.getLogger(__name__)

_SHUTDOWN = "__shutdown__"
# After one rank fails, how long the others get to answer before the group is declared
# broken (a rank that failed before an all-reduce leaves the others blocked in it).
_FAILURE_GRACE_S = 10.0
_GLOO_TIMEOUT = timedelta(seconds=120)


class WorkerGroup:
    """The TP workers of one engine. ``call`` is thread-safe (calls are serialised)."""

    def __init__(self, config: EngineConfig, connector_factory: WorkerConnectorFactory):
        self.tp_size = config.tp_size
        self._lock = threading.Lock()
        self._local: ModelRunner | None = None
        self._procs: list[mp.process.BaseProcess] = []
        self._conns: list[Connection] = []
        self._closed = False
        if not config.uses_worker_processes:
            self._local = ModelRunner(config, 0, 1, connector_factory)
            return
        ctx = mp.get_context("forkserver")
        # The fork server imports torch once; each worker is then a cheap fork of it.
        ctx.set_forkserver_preload(["kvbridge.engine.model_runner"])
        port = _free_port()
        for rank in range(config.tp_size):
            parent_end, child_end = ctx.Pipe()
            proc = ctx.Process(target=_worker_main, name=f"kvbridge-tp{rank}", daemon=True,
                               args=(child_end, config, rank, port, connector_factory,
                                     os.getpid()))
            proc.start()
            child_end.close()  # so the head sees EOF if the child dies
            self._procs.append(proc)
            self._conns.append(parent_end)
        try:
            self._gather()  # each child reports once its model and cache are ready
        except BaseException:
            self.shutdown()
            raise

    @property
    def pids(self) -> list[int]:
        """Worker process ids (empty when the worker runs in-process)."""
        return [p.pid for p in self._procs]

    def call(self, method: str, *args: Any) -> list[Any]:
        """Call ``ModelRunner.<method>(*args)`` on every rank; results in rank order.

        ``method`` may be dotted (``"connector.some_method"``) to reach an
        attribute of the runner, e.g. the worker connector.
        """
        with self._lock:
            if self._closed:
                raise WorkerDiedError("the engine's workers are shut down")
            if self._local is not None:
                try:
                    return [_resolve(self._local, method)(*args)]
                except Exception as e:  # the same error type as from worker processes
                    raise WorkerError(f"[rank 0] {traceback.format_exc()}") from e
            for conn in self._conns:
                conn.send((method, args))
            return self._gather()

    def _gather(self) -> list[Any]:
        """One reply from every rank; raises if any failed or died."""
        results: dict[int, Any] = {}
        errors: dict[int, str] = {}
        pending = dict(enumerate(self._conns))
        deadline = None
        while pending:
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready = wait([*pending.values(), *(self._procs[r].sentinel for r in pending)],
                         timeout)
            if not ready:
                self._kill()
                raise WorkerDiedError(f"ranks {sorted(pending)} stopped answering after "
                                      f"ranks {sorted(errors)} failed:\n" + _join(errors))
            for rank, conn in list(pending.items()):
                if conn in ready or self._procs[rank].sentinel in ready:
                    try:
                        status, value = conn.recv()
                    except (EOFError, OSError):
                        self._kill()
                        raise WorkerDiedError(f"TP worker {rank} died (exit code "
                                              f"{self._procs[rank].exitcode})") from None
                    del pending[rank]
                    if status == "ok":
                        results[rank] = value
                    else:
                        errors[rank] = value
                        deadline = deadline or time.monotonic() + _FAILURE_GRACE_S
        if errors:
            raise WorkerError(_join(errors))
        return [results[r] for r in range(len(self._conns))]

    def shutdown(self, timeout: float = 10.0) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._local is not None:
                self._local.close()
                return
            for conn in self._conns:
                try:
                    conn.send((_SHUTDOWN, ()))
                except OSError:
                    pass
            deadline = time.monotonic() + timeout
            for proc in self._procs:
                proc.join(max(0.0, deadline - time.monotonic()))
            self._kill()
            for conn in self._conns:
                conn.close()

    def _kill(self) -> None:
        self._closed = True
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
            proc.join()


def _join(errors: dict[int, str]) -> str:
    return "\n".join(f"[rank {r}] {tb}" for r, tb in sorted(errors.items()))


def _resolve(runner: ModelRunner, method: str) -> Any:
    target: Any = runner
    for part in method.split("."):
        if part.startswith("_"):
            raise AttributeError(f"{method!r}: private attributes are not callable remotely")
        target = getattr(target, part)
    return target


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _watch_head(head_pid: int) -> None:
    # A rank blocked in a collective would not notice the head's pipe closing. The fork
    # server (our parent) exits with the head, so a new parent also means the head is gone.
    parent = os.getppid()
    while os.getppid() == parent and _pid_exists(head_pid):
        time.sleep(0.5)
    os._exit(1)


def _pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _worker_main(conn: Connection, config: EngineConfig, rank: int, port: int,
                 connector_factory: WorkerConnectorFactory, head_pid: int) -> None:
    import torch.distributed as dist

    threading.Thread(target=_watch_head, args=(head_pid,), daemon=True).start()
    # Every rank is on this host: keep gloo off interfaces the hostname may resolve to.
    if "lo" in {name for _, name in socket.if_nameindex()}:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    runner = None
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=config.tp_size, timeout=_GLOO_TIMEOUT)
        runner = ModelRunner(config, rank, config.tp_size, connector_factory)
        conn.send(("ok", None))
        while True:
            try:
                method, args = conn.recv()
            except (EOFError, OSError):
                break  # the head is gone
            if method == _SHUTDOWN:
                break
            try:
                reply = ("ok", _resolve(runner, method)(*args))
            except Exception:
                reply = ("error", traceback.format_exc())
            try:
                conn.send(reply)
            except OSError:
                break
            except Exception:  # the result does not pickle
                conn.send(("error", traceback.format_exc()))
    except Exception:
        try:
            conn.send(("error", traceback.format_exc()))
        except OSError:
            pass
    finally:
        if runner is not None:
            runner.close()
        if dist.is_initialized():
            dist.destroy_process_group()
        # Skip interpreter teardown: everything is released above, and torch's
        # finalisation would add about half a second to every engine shutdown.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
