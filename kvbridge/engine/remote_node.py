"""The ranks of a non-head node of a multi-node instance (``kvbridge serve --headless``).

``run_node`` forks this node's ranks (as the head forks its own, ``kvbridge.engine.workers``);
each joins the instance's process group, receives the head's ``EngineConfig`` and connector
factory from rank 0, and then serves the calls rank 0 relays (``kvbridge.engine.distributed``)
until the head shuts the instance down or is gone.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import Any

from kvbridge.engine import distributed
from kvbridge.engine.model_runner import ModelRunner, WorkerConnectorFactory
from kvbridge.engine.workers import GLOO_TIMEOUT, exit_rank, resolve_method, watch_head
from kvbridge.errors import NodeError
from kvbridge.multinode import MultiNodeConfig

logger = logging.getLogger(__name__)

NodeLocalizer = Callable[[WorkerConnectorFactory], WorkerConnectorFactory]


def run_node(mn: MultiNodeConfig, tp_size: int, localize: NodeLocalizer | None = None,
             on_ready: Callable[[list[int]], None] | None = None) -> int:
    """Run this node's ranks until the head shuts them down (0) or is gone (1).

    ``localize`` adapts the head's connector factory to this node (e.g. its own
    certificate paths); ``on_ready`` is called once every local rank has joined.
    """
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["kvbridge.engine.model_runner"])
    procs: list[mp.process.BaseProcess] = []
    conns: list[Connection] = []
    ranks = mn.local_ranks(tp_size)
    try:
        for rank in ranks:
            parent_end, child_end = ctx.Pipe()
            proc = ctx.Process(target=_remote_main, name=f"kvbridge-tp{rank}", daemon=True,
                               args=(child_end, mn, rank, tp_size, localize, os.getpid()))
            proc.start()
            child_end.close()
            procs.append(proc)
            conns.append(parent_end)
        failures = []
        for rank, conn, proc in zip(ranks, conns, procs, strict=True):
            try:
                status, value = conn.recv()  # each rank bounds its own wait (node_timeout)
            except (EOFError, OSError):
                status, value = "error", f"rank {rank} exited ({proc.exitcode})"
            if status != "ok":
                failures.append(str(value).strip().splitlines()[-1])
        if failures:
            logger.error("node %d could not join: %s", mn.node_rank, "; ".join(failures))
            return 1
        if on_ready is not None:
            on_ready(ranks)
        wait([p.sentinel for p in procs])
        # One rank ended: the head shut the instance down (all exit 0) or a peer is gone.
        deadline = time.monotonic() + 10
        for proc in procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        codes = [p.exitcode for p in procs]
        for conn in conns:
            if conn.poll():
                with contextlib.suppress(EOFError, OSError):
                    logger.error("%s", conn.recv()[1])
        return 0 if codes == [0] * len(procs) else 1
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join()
        for conn in conns:
            conn.close()


def _remote_main(conn: Connection, mn: MultiNodeConfig, rank: int, tp_size: int,
                 localize: NodeLocalizer | None, head_pid: int) -> None:
    threading.Thread(target=watch_head, args=(head_pid,), daemon=True).start()
    runner = None
    code = 0
    try:
        control = distributed.init_rank(mn, rank, tp_size, GLOO_TIMEOUT)
        config, factory = distributed.broadcast_command(control, None)
        started: tuple[str, Any]
        try:
            if config.tp_size != tp_size:
                raise NodeError(f"the head runs --tp {config.tp_size}, this node --tp {tp_size}")
            runner = ModelRunner(config, rank, tp_size,
                                 factory if localize is None else localize(factory))
            started = ("ok", mn.host)
        except Exception:
            started = ("error", traceback.format_exc())
        distributed.gather_replies(control, started, rank)
        conn.send(started)
        if runner is None:
            code = 1
            return
        distributed.serve_remote(control, rank, lambda m, a: resolve_method(runner, m)(*a))
    except Exception as e:
        code = 1
        with contextlib.suppress(OSError):
            conn.send(("error", str(e) if isinstance(e, NodeError) else traceback.format_exc()))
    finally:
        if code:
            # The group may be broken: skip destroy_process_group, which could block.
            if runner is not None:
                runner.close()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        exit_rank(runner)
