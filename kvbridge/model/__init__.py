"""A Llama-architecture reference model for CPU: paged-KV attention, tensor parallelism,
the built-in tiny model, a loader for local Hugging Face checkpoints, and trained models
prepared from installed packages (``kvbridge.model.models``).

Names are imported on first use: ``kvbridge model prepare`` does not load torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "AttentionMetadata": "kvbridge.model.attention",
    "SeqChunk": "kvbridge.model.attention",
    "paged_attention": "kvbridge.model.attention",
    "LlamaConfig": "kvbridge.model.llama",
    "LlamaForCausalLM": "kvbridge.model.llama",
    "load_config": "kvbridge.model.loader",
    "load_model": "kvbridge.model.loader",
    "load_tokenizer": "kvbridge.model.loader",
    "resolve_dtype": "kvbridge.model.loader",
    "tiny_weights": "kvbridge.model.loader",
    "write_tiny_checkpoint": "kvbridge.model.loader",
    "ByteTokenizer": "kvbridge.model.tokenizer",
    "HFTokenizer": "kvbridge.model.tokenizer",
    "Tokenizer": "kvbridge.model.tokenizer",
    "prepare": "kvbridge.model.models",
}

__all__ = [
    "AttentionMetadata", "ByteTokenizer", "HFTokenizer", "LlamaConfig", "LlamaForCausalLM",
    "SeqChunk", "Tokenizer", "load_config", "load_model", "load_tokenizer", "paged_attention",
    "prepare", "resolve_dtype", "tiny_weights", "write_tiny_checkpoint",
]

if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs
    from kvbridge.model.attention import AttentionMetadata, SeqChunk, paged_attention
    from kvbridge.model.llama import LlamaConfig, LlamaForCausalLM
    from kvbridge.model.loader import (
        load_config,
        load_model,
        load_tokenizer,
        resolve_dtype,
        tiny_weights,
        write_tiny_checkpoint,
    )
    from kvbridge.model.models import prepare
    from kvbridge.model.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvbridge.model' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
