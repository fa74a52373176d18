"""A Llama-architecture reference model for CPU: paged-KV attention, tensor parallelism,
the built-in tiny model and a loader for local Hugging Face checkpoints."""

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
from kvbridge.model.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer

__all__ = [
    "AttentionMetadata", "ByteTokenizer", "HFTokenizer", "LlamaConfig", "LlamaForCausalLM",
    "SeqChunk", "Tokenizer", "load_config", "load_model", "load_tokenizer", "paged_attention",
    "resolve_dtype", "tiny_weights", "write_tiny_checkpoint",
]
