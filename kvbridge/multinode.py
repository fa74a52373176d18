"""Where a node sits in a multi-node instance (vLLM's flag names), and the checks of that
layout."""

from __future__ import annotations

from dataclasses import dataclass

from kvbridge.errors import ConfigError
from kvbridge.settings import SETTINGS, is_loopback, is_wildcard

__all__ = ["MultiNodeConfig"]

DEFAULT_NODE_TIMEOUT: float = SETTINGS["node_timeout"].default


@dataclass(frozen=True)
class MultiNodeConfig:
    """Where this node sits in a multi-node instance (vLLM's flag names).

    ``host``: this node's address as other nodes and peers reach it (its
    ``--advertise-host``); gloo binds the interface that owns it.
    ``node_timeout``: seconds to wait for every node to join (and for a silent
    peer before it is declared gone).
    """

    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int
    host: str
    node_timeout: float = DEFAULT_NODE_TIMEOUT

    def check(self, tp_size: int) -> None:
        """Refuse a layout that cannot work, with one line saying what to change."""
        if self.nnodes < 1:
            raise ConfigError(f"--nnodes must be >= 1, got {self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ConfigError(f"--node-rank {self.node_rank} outside 0..{self.nnodes - 1}")
        if tp_size % self.nnodes:
            raise ConfigError(f"--tp {tp_size} is not a multiple of --nnodes {self.nnodes}: "
                              "every node must hold the same number of ranks")
        if not 0 < self.master_port < 65536:
            raise ConfigError(f"--master-port {self.master_port} out of range")
        if not self.master_addr:
            raise ConfigError("--master-addr is required with --nnodes > 1")
        if not 0 < self.node_timeout <= 3600:
            raise ConfigError(f"--node-timeout must be in (0, 3600] seconds, got "
                              f"{self.node_timeout}")
        if is_loopback(self.host) and not is_loopback(self.master_addr):
            raise ConfigError(f"this node's address {self.host!r} is a loopback address but "
                              f"the head is at {self.master_addr!r}: set --advertise-host to "
                              "an address the other nodes reach this one at")
        if is_wildcard(self.host):
            raise ConfigError(f"advertising the wildcard address {self.host!r} tells other "
                              "nodes nothing: set --advertise-host to this node's address")

    def ranks_per_node(self, tp_size: int) -> int:
        return tp_size // self.nnodes

    def local_ranks(self, tp_size: int) -> list[int]:
        k = self.ranks_per_node(tp_size)
        return list(range(self.node_rank * k, self.node_rank * k + k))

    def remote_ranks(self, tp_size: int) -> list[int]:
        """Ranks outside the head node: those reached through the control group."""
        return list(range(self.ranks_per_node(tp_size), tp_size))
