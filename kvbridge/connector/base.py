"""The contract between the engine and a KV connector.

The engine knows nothing about NIXL or side channels: it calls these hooks at
fixed points. ``NullConnector`` is what an engine without KV transfer uses.

Scheduler side (head process, one instance):
    ``num_remote_tokens`` when a request arrives; ``on_blocks_allocated`` once
    its blocks exist; ``build_worker_meta`` before every step; ``update`` with
    every worker's output after it; ``on_finished`` when a request ends;
    ``on_refused`` when the API refused a request that named remote KV.

Worker side (one instance per TP worker process):
    ``register_kv_cache`` once at start; ``handshake_metadata`` when the head
    gathers metadata; ``step`` once per engine step with the head's metadata.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from kvbridge.errors import LoadFailure
from kvbridge.params import KVTransferParams


@dataclass
class ConnectorUpdate:
    """What the scheduler learns from one step of all workers.

    ``loaded``: request id -> None when its remote KV arrived whole, or the
    ``LoadFailure`` (the scheduler then recomputes or fails it; a request fault is a 400).
    ``released``: request ids whose held blocks may now be freed (every consumer
    has read them, or their lease expired).
    """

    loaded: dict[str, LoadFailure | None] = field(default_factory=dict)
    released: set[str] = field(default_factory=set)


class SchedulerConnector(Protocol):
    def num_remote_tokens(self, request_id: str, prompt_ids: list[int],
                          kv_transfer_params: KVTransferParams | None) -> int:
        """Prompt tokens whose KV will arrive from a remote instance (0: compute locally).
        Raises ``InvalidKVTransferParams`` (a 400) for params this prompt cannot use."""

    def on_blocks_allocated(self, request_id: str, block_ids: list[int]) -> None:
        """Blocks now exist for a request that waits for remote KV."""

    def build_worker_meta(self) -> Any:
        """Picklable metadata passed to every worker's ``step`` (e.g. reads to start)."""

    def update(self, worker_outputs: list[Any | None]) -> ConnectorUpdate:
        """Fold one step's per-worker outputs; a worker may report ``None``."""

    def on_refused(self, kv_transfer_params: KVTransferParams) -> None:
        """A request carrying these params was refused before it ran: tell the instance
        that holds its KV that nobody will read it (best effort)."""

    def has_pending(self) -> bool:
        """The connector awaits news from the workers with no request in flight (e.g. a
        handshake started ahead of time): the engine keeps stepping while True."""

    def on_finished(self, request_id: str, block_ids: list[int],
                    kv_transfer_params: KVTransferParams | None, num_computed_tokens: int
                    ) -> tuple[bool, KVTransferParams | None]:
        """A request ended with KV computed for ``num_computed_tokens`` tokens. Returns
        (hold_blocks, kv_transfer_params for the response).

        When ``hold_blocks`` is true the engine keeps the blocks allocated until
        a later ``update`` lists the request in ``released``.
        """


class WorkerConnector(Protocol):
    def register_kv_cache(self, kv_cache: torch.Tensor) -> None:
        """The worker's whole paged KV cache, see ``kvbridge.kv_cache.kv_cache_shape``."""

    def handshake_metadata(self) -> bytes:
        """This worker's encoded handshake metadata, gathered by the head process."""

    def step(self, meta: Any) -> Any | None:
        """Start what ``meta`` asks, poll what is in flight, return this worker's news."""


class NullConnector:
    """No KV transfer: every request computes its prompt locally."""

    def num_remote_tokens(self, request_id, prompt_ids, kv_transfer_params) -> int:
        return 0

    def on_blocks_allocated(self, request_id, block_ids) -> None:
        pass

    def build_worker_meta(self) -> None:
        return None

    def update(self, worker_outputs) -> ConnectorUpdate:
        return ConnectorUpdate()

    def on_refused(self, kv_transfer_params) -> None:
        pass

    def has_pending(self) -> bool:
        return False

    def on_finished(self, request_id, block_ids, kv_transfer_params, num_computed_tokens):
        return False, None


class NullWorkerConnector:
    def register_kv_cache(self, kv_cache: torch.Tensor) -> None:
        pass

    def handshake_metadata(self) -> bytes:
        return b""

    def step(self, meta: Any) -> None:
        return None
