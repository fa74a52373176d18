"""Engine settings."""

from __future__ import annotations

import os
from dataclasses import dataclass

from kvbridge.config import DEFAULT_BLOCK_SIZE, DEFAULT_NUM_BLOCKS
from kvbridge.multinode import MultiNodeConfig
from kvbridge.settings import KV_LOAD_FAILURE_POLICIES


@dataclass(frozen=True)
class EngineConfig:
    """Everything needed to build an engine (picklable: workers receive it).

    ``model``: a local Hugging Face checkpoint directory, or None for the
    built-in tiny model (whose random weights come from ``seed``).
    ``worker_processes``: run the TP workers as child processes; None means
    "only when tp_size > 1" (a TP=1 engine then runs its model in-process).
    ``num_threads``: torch threads per worker; None means 1 for the tiny model
    (threads only add overhead there) and ``cpu_count // tp_size`` otherwise.
    ``max_model_len``: None means the model's ``max_position_embeddings``,
    capped by what the KV cache can hold.
    ``multinode``: the TP group spans nodes (``kvbridge.engine.distributed``);
    this process runs the head node's ranks.
    """

    model: str | None = None
    tp_size: int = 1
    dtype: str = "float32"
    num_blocks: int = DEFAULT_NUM_BLOCKS
    block_size: int = DEFAULT_BLOCK_SIZE
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 4096
    max_model_len: int | None = None
    kv_load_failure_policy: str = "recompute"
    seed: int = 0
    worker_processes: bool | None = None
    multinode: MultiNodeConfig | None = None
    num_threads: int | None = None

    def __post_init__(self) -> None:
        if self.tp_size < 1:
            raise ValueError(f"tp_size must be >= 1, got {self.tp_size}")
        if self.num_blocks < 1 or self.block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        if self.kv_load_failure_policy not in KV_LOAD_FAILURE_POLICIES:
            raise ValueError(f"kv_load_failure_policy {self.kv_load_failure_policy!r}: use one "
                             f"of {KV_LOAD_FAILURE_POLICIES}")
        if self.worker_processes is False and self.tp_size > 1:
            raise ValueError("tp_size > 1 needs worker processes")
        if self.multinode is not None:
            self.multinode.check(self.tp_size)
            if self.multinode.node_rank != 0:
                raise ValueError("an engine runs on the head node (node rank 0); other "
                                 "nodes run kvbridge.engine.remote_node.run_node")

    @property
    def uses_worker_processes(self) -> bool:
        return self.tp_size > 1 if self.worker_processes is None else self.worker_processes

    @property
    def threads_per_worker(self) -> int:
        if self.num_threads is not None:
            return self.num_threads
        if self.model is None:
            return 1
        return max(1, (os.cpu_count() or 1) // self.tp_size)
