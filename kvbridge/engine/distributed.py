"""The TP group of an instance that spans nodes (``--nnodes N``), on torch.distributed.

Every rank of every node joins one gloo process group; rendezvous is a
``TCPStore`` served by global rank 0 (on the head node) at
``master_addr:master_port``. Ranks of one node are consecutive: node ``n``
holds ranks ``n * k .. n * k + k - 1`` with ``k = tp_size / nnodes``.

The head process talks to its own node's ranks over pipes, as on one node
(``kvbridge.engine.workers``). The ranks of the other nodes ("remote" ranks, run by
``kvbridge.engine.remote_node``) are reached through global rank 0 with torch.distributed
object collectives on a "control" group of rank 0 and every remote rank: rank 0 broadcasts each
``(method, args)`` and gathers the replies. While the head is idle, rank 0
broadcasts a ping every ``HEARTBEAT_S`` so that both sides notice a dead peer
(a gloo operation on a closed connection raises at once; on a silent one it
raises after ``node_timeout``).
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
import socket
import struct
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from kvbridge.errors import NodeError
from kvbridge.multinode import MultiNodeConfig

__all__ = ["MultiNodeConfig", "call_everywhere", "init_rank", "interface_of", "rendezvous_store",
           "serve_remote"]

PING = "__ping__"
SHUTDOWN = "__shutdown__"
HEARTBEAT_S = 2.0


def init_rank(cfg: MultiNodeConfig, rank: int, world_size: int,
              collective_timeout: timedelta) -> Any:
    """Join the instance's process group as global ``rank``; returns the control group.

    Bounded by ``cfg.node_timeout``: a node that never comes raises ``NodeError``.
    Every rank of every node must call this (group creation is collective).
    """
    import torch.distributed as dist

    ifname = interface_of(cfg.host)
    if ifname is not None:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", ifname)
    wait = timedelta(seconds=cfg.node_timeout)
    try:
        store = rendezvous_store(cfg.master_addr, cfg.master_port, world_size, rank == 0, wait)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                                timeout=max(wait, collective_timeout))
        control = dist.new_group([0, *cfg.remote_ranks(world_size)], timeout=wait)
    except Exception as e:  # torch raises DistStoreError / RuntimeError with long texts
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise NodeError(f"rank {rank} (node {cfg.node_rank}): not every node of the "
                        f"instance joined at {cfg.master_addr}:{cfg.master_port} within "
                        f"{cfg.node_timeout:g}s (--node-timeout): {first}") from e
    return control


# Listening sockets handed to a master store: kept open for the life of the process.
_LISTENERS: list[socket.socket] = []


def rendezvous_store(master_addr: str, master_port: int, world_size: int, is_master: bool,
                     timeout: timedelta) -> Any:
    """The instance's ``TCPStore``. The master listens on ``master_addr`` only (torch alone
    would listen on every interface): its socket is bound here and handed to torch
    (``master_listen_fd``). The store answers anyone who reaches it (no authentication):
    ``master_addr`` must be on the instances' private network (docs/security.md)."""
    import torch.distributed as dist

    if not is_master:
        return dist.TCPStore(master_addr, master_port, world_size, is_master=False,
                             timeout=timeout, wait_for_workers=True)
    deadline = time.monotonic() + timeout.total_seconds()
    while True:
        try:  # a name (the head's own DNS name, say) may resolve only once the node is up
            family, _, _, _, addr = socket.getaddrinfo(
                master_addr.strip("[]"), master_port, type=socket.SOCK_STREAM)[0]
            break
        except socket.gaierror as e:
            if time.monotonic() > deadline:
                raise NodeError(f"--master-addr {master_addr!r} does not resolve: {e}") from None
            time.sleep(0.5)
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
    except OSError as e:
        sock.close()
        raise NodeError(f"the rendezvous store cannot listen on {master_addr}:{master_port} "
                        f"(--master-addr/--master-port, an address of this node): "
                        f"{e.strerror or e}") from None
    store = dist.TCPStore(master_addr, master_port, world_size, is_master=True,
                          timeout=timeout, wait_for_workers=True, master_listen_fd=sock.fileno())
    _LISTENERS.append(sock)
    return store


def broadcast_command(control: Any, command: Any) -> Any:
    """Rank 0: send ``command`` to every remote rank. Remote ranks: pass None, get it."""
    import torch.distributed as dist

    box = [command]
    dist.broadcast_object_list(box, src=0, group=control)
    return box[0]


def gather_replies(control: Any, reply: Any, rank: int) -> list[Any] | None:
    """Every member sends ``reply``; rank 0 gets them in rank order (itself first)."""
    import torch.distributed as dist

    size = dist.get_world_size(control)
    out: list[Any] | None = [None] * size if rank == 0 else None
    dist.gather_object(reply, out, dst=0, group=control)
    return out


def call_everywhere(control: Any, method: str, args: tuple, run: Callable[[], tuple[str, Any]]
                    ) -> list[tuple[str, Any]]:
    """Rank 0: run ``method`` on every remote rank and locally (``run``); every reply.

    Raises ``NodeError`` if a remote node is gone (the group is then unusable).
    """
    try:
        broadcast_command(control, (method, args))
    except Exception as e:
        raise NodeError(f"a node of this instance is gone (sending {method}): "
                        f"{_first_line(e)}") from e
    own = run()
    try:
        replies = gather_replies(control, own, 0)
    except Exception as e:
        raise NodeError(f"a node of this instance is gone (during {method}): "
                        f"{_first_line(e)}") from e
    assert replies is not None
    return replies


def serve_remote(control: Any, rank: int, handle: Callable[[str, tuple], Any]) -> None:
    """A remote rank's loop: take each command rank 0 broadcasts, answer by gather.

    Returns on shutdown; raises ``NodeError`` when the head is gone.
    """
    while True:
        try:
            method, args = broadcast_command(control, None)
        except Exception as e:
            raise NodeError(f"rank {rank}: the head node is gone: {_first_line(e)}") from e
        if method == SHUTDOWN:
            return
        if method == PING:
            reply: tuple[str, Any] = ("ok", None)
        else:
            try:
                reply = ("ok", handle(method, args))
            except Exception:
                reply = ("error", traceback.format_exc())
        try:
            gather_replies(control, reply, rank)
        except Exception as e:
            if method != PING and reply[0] == "ok":
                # e.g. the result does not pickle: say so rather than vanish
                try:
                    gather_replies(control, ("error", traceback.format_exc()), rank)
                    continue
                except Exception:
                    pass
            raise NodeError(f"rank {rank}: the head node is gone: {_first_line(e)}") from e


def interface_of(address: str) -> str | None:
    """The local interface that owns IPv4 ``address`` (None if none does, or not IPv4)."""
    try:
        ip = ipaddress.ip_address(socket.gethostbyname(address))
    except (OSError, ValueError):
        return None
    if ip.version != 4:
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:  # SIOCGIFADDR
                raw = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue  # no IPv4 address on this interface
            if socket.inet_ntoa(raw[20:24]) == str(ip):
                return name
    return None


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__

