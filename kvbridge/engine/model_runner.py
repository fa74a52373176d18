"""One TP worker: its model shard, its KV cache, its worker-side connector.

The head process calls these methods on every rank at once (``WorkerGroup.call``);
``execute_step`` is the per-step one. All ranks run the forward (the all-reduces
need everyone); rank 0 samples and returns the tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from kvbridge.connector.base import WorkerConnector
from kvbridge.engine.config import EngineConfig
from kvbridge.engine.sampling import SampleSpec, sample
from kvbridge.kv_cache import allocate_kv_cache
from kvbridge.model.attention import AttentionMetadata, SeqChunk
from kvbridge.model.loader import load_model

# Called in each worker process with (tp_rank, tp_size); must be picklable.
WorkerConnectorFactory = Callable[[int, int], WorkerConnector]


@dataclass(frozen=True)
class StepInput:
    """The model work of one engine step, the same for every rank."""

    chunks: list[SeqChunk]
    samples: list[SampleSpec]
    # (block id, tag) of every block this step writes KV into (see kvbridge.kv_tags)
    block_tags: list[tuple[int, int]] = field(default_factory=list)


class ModelRunner:
    def __init__(self, config: EngineConfig, tp_rank: int, tp_size: int,
                 connector_factory: WorkerConnectorFactory):
        torch.set_num_threads(config.threads_per_worker)
        self.config = config
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.model = load_model(config.model, tp_rank, tp_size, config.dtype, config.seed)
        mc = self.model.config
        self.kv_cache = allocate_kv_cache(mc.num_hidden_layers, config.num_blocks,
                                          self.model.num_kv_heads, config.block_size,
                                          mc.head_dim, self.model.dtype)
        self.connector = connector_factory(tp_rank, tp_size)
        self.connector.register_kv_cache(self.kv_cache)

    def kv_handshake_metadata(self) -> bytes:
        return self.connector.handshake_metadata()

    def kv_connector_call(self, method: str, *args: Any) -> Any:
        """Run a connector-specific method (e.g. ``prewarm``) on this worker's connector."""
        return getattr(self.connector, method)(*args)

    def execute_step(self, meta: Any, step: StepInput | None) -> tuple[Any, list[int] | None]:
        """Run the connector's step, then the model; returns (connector output, rank 0's tokens)."""
        connector_output = self.connector.step(meta)
        if step is None:
            return connector_output, None
        if step.block_tags:  # cleared before the KV changes, set once it has
            self.connector.clear_block_tags([b for b, _ in step.block_tags])
        logits = self.forward(step.chunks)
        if step.block_tags:
            self.connector.set_block_tags(step.block_tags)
        tokens = sample(logits, step.samples) if self.tp_rank == 0 else None
        return connector_output, tokens

    def forward(self, chunks: list[SeqChunk], all_logits: bool = False,
                kv_cache: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of each chunk's last token [num_chunks, vocab] (or of every new token)."""
        meta = AttentionMetadata.build(chunks, self.config.block_size)
        input_ids = torch.tensor([t for c in chunks for t in c.token_ids], dtype=torch.long)
        positions = torch.tensor([c.start_pos + i for c in chunks for i in range(len(c.token_ids))],
                                 dtype=torch.long)
        cache = self.kv_cache if kv_cache is None else kv_cache
        hidden = self.model(input_ids, positions, cache, meta)
        return self.model.compute_logits(hidden if all_logits else hidden[meta.last_token])

    def score(self, token_ids: list[int]) -> torch.Tensor:
        """Logits at every position of ``token_ids`` [T, vocab], in a scratch KV cache.

        For tests and debugging; leaves the engine's cache and blocks alone.
        """
        mc, bs = self.model.config, self.config.block_size
        num_blocks = -(-len(token_ids) // bs)
        scratch = allocate_kv_cache(mc.num_hidden_layers, num_blocks, self.model.num_kv_heads,
                                    bs, mc.head_dim, self.model.dtype)
        chunk = SeqChunk(list(token_ids), 0, list(range(num_blocks)))
        return self.forward([chunk], all_logits=True, kv_cache=scratch)

    def close(self) -> None:
        close = getattr(self.connector, "close", None)
        if callable(close):
            close()
