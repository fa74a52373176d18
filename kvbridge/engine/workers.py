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

An instance that spans nodes (``config.multinode``, see
``kvbridge.engine.distributed``): the head forks only its own node's ranks and
they join the group at ``master_addr:master_port``; the other nodes run
``kvbridge.engine.remote_node.run_node`` (``kvbridge serve --headless``). Rank 0 relays
each call to the remote ranks with object collectives and answers for all of them; it sends
them the head's ``EngineConfig`` and connector factory first, so every rank
runs the same engine, engine id and epoch.

As with ``spawn``/``forkserver`` multiprocessing in general, a script that builds an
engine with worker processes must guard its entry point with ``if __name__ == "__main__":``.
"""

from __future__ import annotations

import contextlib
import functools
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

from kvbridge.engine import distributed
from kvbridge.engine.config import EngineConfig
from kvbridge.engine.model_runner import ModelRunner, WorkerConnectorFactory
from kvbridge.errors import NodeError, WorkerDiedError, WorkerError
from kvbridge.multinode import MultiNodeConfig
from kvbridge.net import free_port

logger = logging.getLogger(__name__)

_SHUTDOWN = distributed.SHUTDOWN
# After one rank fails, how long the others get to answer before the group is declared
# broken (a rank that failed before an all-reduce leaves the others blocked in it).
_FAILURE_GRACE_S = 10.0
GLOO_TIMEOUT = timedelta(seconds=120)


class WorkerGroup:
    """The TP workers of one engine. ``call`` is thread-safe (calls are serialised)."""

    def __init__(self, config: EngineConfig, connector_factory: WorkerConnectorFactory):
        self.tp_size = config.tp_size
        self._lock = threading.Lock()
        self._local: ModelRunner | None = None
        self._procs: list[mp.process.BaseProcess] = []
        self._conns: list[Connection] = []
        self._closed = False
        mn = config.multinode if config.multinode and config.multinode.nnodes > 1 else None
        # The address of the node each rank lives on (None: this host, one node).
        self.rank_hosts: list[str | None] = [None] * config.tp_size
        if not config.uses_worker_processes:
            self._local = ModelRunner(config, 0, 1, connector_factory)
            return
        ctx = mp.get_context("forkserver")
        # The fork server imports torch once; each worker is then a cheap fork of it.
        ctx.set_forkserver_preload(["kvbridge.engine.model_runner"])
        rendezvous: int | MultiNodeConfig = free_port() if mn is None else mn
        local_ranks = range(config.tp_size) if mn is None else mn.local_ranks(config.tp_size)
        for rank in local_ranks:
            parent_end, child_end = ctx.Pipe()
            proc = ctx.Process(target=_worker_main, name=f"kvbridge-tp{rank}", daemon=True,
                               args=(child_end, config, rank, rendezvous, connector_factory,
                                     os.getpid()))
            proc.start()
            child_end.close()  # so the head sees EOF if the child dies
            self._procs.append(proc)
            self._conns.append(parent_end)
        try:
            ready = self._gather()  # each child reports once its model and cache are ready
        except BaseException:
            self.shutdown()
            raise
        if mn is not None:
            k = mn.ranks_per_node(config.tp_size)
            self.rank_hosts = [mn.host] * k + list(ready[k:])

    @property
    def pids(self) -> list[int]:
        """Worker process ids (empty when the worker runs in-process)."""
        return [p.pid for p in self._procs]

    @property
    def alive(self) -> bool:
        """Every local worker process runs (rank 0 exits when a remote node is gone)."""
        return not self._closed and all(p.is_alive() for p in self._procs)

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
                    return [resolve_method(self._local, method)(*args)]
                except Exception as e:  # the same error type as from worker processes
                    raise WorkerError(f"[rank 0] {traceback.format_exc()}") from e
            for conn in self._conns:
                try:
                    conn.send((method, args))
                except OSError:
                    pass  # that rank is gone: _gather reads its last word (or EOF) and says so
            return self._gather()

    def _gather(self) -> list[Any]:
        """One reply from every rank; raises if any failed or died.

        Rank 0 of a multi-node instance answers for the remote ranks too ("multi").
        """
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
                    if status == "died":  # rank 0: a remote node is gone
                        self._kill()
                        raise WorkerDiedError(value)
                    replies = ([(rank, status, value)] if status != "multi" else
                               [(r, s, v) for r, (s, v) in
                                zip([0, *range(len(self._conns), self.tp_size)], value,
                                    strict=True)])
                    for r, s, v in replies:
                        if s == "ok":
                            results[r] = v
                        else:
                            errors[r] = v
                            deadline = deadline or time.monotonic() + _FAILURE_GRACE_S
        if errors:
            raise WorkerError(_join(errors))
        return [results[r] for r in range(self.tp_size)]

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


def resolve_method(runner: ModelRunner, method: str) -> Any:
    """The runner's bound method named ``method`` (dotted; no private part)."""
    target: Any = runner
    for part in method.split("."):
        if part.startswith("_"):
            raise AttributeError(f"{method!r}: private attributes are not callable remotely")
        target = getattr(target, part)
    return target


def watch_head(head_pid: int) -> None:
    """Exit this rank process when the head process is gone (run in a daemon thread)."""
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


def _worker_main(conn: Connection, config: EngineConfig, rank: int,
                 rendezvous: int | MultiNodeConfig, connector_factory: WorkerConnectorFactory,
                 head_pid: int) -> None:
    import torch.distributed as dist

    threading.Thread(target=watch_head, args=(head_pid,), daemon=True).start()
    runner = None
    control = None
    clean = False
    try:
        if isinstance(rendezvous, int):
            # Every rank is on this host: keep gloo off interfaces the hostname may resolve to.
            if "lo" in {name for _, name in socket.if_nameindex()}:
                os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{rendezvous}",
                                    rank=rank, world_size=config.tp_size,
                                    timeout=GLOO_TIMEOUT)
        else:
            control = distributed.init_rank(rendezvous, rank, config.tp_size, GLOO_TIMEOUT)
            if rank != 0:
                control = None  # only rank 0 of the head node talks to the remote ranks
            else:
                distributed.broadcast_command(control, (config, connector_factory))
        try:
            runner = ModelRunner(config, rank, config.tp_size, connector_factory)
        finally:
            if control is not None:  # the remote ranks report their start-up (host or error)
                started = distributed.gather_replies(control, ("ok", None), 0)
        ready: tuple[str, Any] = ("ok", None)
        if control is not None:  # answer for the remote ranks: each one's host, or error
            ready = ("multi", started)
        conn.send(ready)
        clean = _serve_pipe(conn, runner, control)
    except Exception as e:
        # A node that never came is not a bug: one line, no traceback.
        with contextlib.suppress(OSError):
            conn.send(("error", str(e) if isinstance(e, NodeError) else traceback.format_exc()))
    finally:
        exit_rank(runner, clean)


def _serve_pipe(conn: Connection, runner: ModelRunner, control: Any) -> bool:
    """The command loop of a head-node rank; rank 0 of a multi-node instance relays.

    Returns False when the group is broken (a node is gone)."""
    while True:
        if control is not None and not conn.poll(distributed.HEARTBEAT_S):
            try:  # idle: make sure the other nodes are still there (and they, that we are)
                distributed.call_everywhere(control, distributed.PING, (), lambda: ("ok", None))
            except NodeError as e:
                conn.send(("died", str(e)))
                return False
            continue
        try:
            method, args = conn.recv()
        except (EOFError, OSError):
            return False  # the head is gone
        if method == _SHUTDOWN:
            if control is not None:
                try:
                    distributed.broadcast_command(control, (_SHUTDOWN, ()))
                except Exception:  # already gone: nothing to tell
                    return False
            return True
        reply: tuple[str, Any]
        if control is None:
            reply = _run(runner, method, args)
        else:
            try:
                reply = ("multi", distributed.call_everywhere(
                    control, method, args, functools.partial(_run, runner, method, args)))
            except NodeError as e:
                conn.send(("died", str(e)))
                return False
        try:
            conn.send(reply)
        except OSError:
            return False
        except Exception:  # the result does not pickle
            conn.send(("error", traceback.format_exc()))


def _run(runner: ModelRunner, method: str, args: tuple) -> tuple[str, Any]:
    try:
        return ("ok", resolve_method(runner, method)(*args))
    except Exception:
        return ("error", traceback.format_exc())


def exit_rank(runner: ModelRunner | None, clean: bool = True) -> None:
    """Close the runner, leave the process group (unless broken) and end the process."""
    import torch.distributed as dist

    if runner is not None:
        runner.close()
    if clean and dist.is_initialized():  # a broken group could block here
        dist.destroy_process_group()
    # Skip interpreter teardown: everything is released above, and torch's
    # finalisation would add about half a second to every engine shutdown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
