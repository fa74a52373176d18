"""Real vLLM objects for the plug-in's tests without a vLLM server: a VllmConfig without a
model, a KVCacheConfig, the scheduler connector, handshake payloads."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import msgspec


def attention_spec():
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    return FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=64, dtype=torch.float32)


def build_config(extra: dict[str, Any]):
    """A real VllmConfig (no model) and a one-group KVCacheConfig."""
    from vllm.config import KVTransferConfig, VllmConfig

    ktc = KVTransferConfig(
        kv_connector="KVBridgeConnector", kv_connector_module_path="kvbridge.vllm",
        kv_role="kv_both", kv_buffer_device="cpu",
        kv_connector_extra_config={"side_channel_host": "127.0.0.1", "side_channel_port": 0,
                                   **extra})
    return VllmConfig(kv_transfer_config=ktc), cache_config(attention_spec())


def cache_config(*specs):
    """A KVCacheConfig of one group per spec."""
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    return KVCacheConfig(num_blocks=4, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec([f"layer.{i}"], spec) for i, spec in enumerate(specs)])


@contextmanager
def scheduler_connector(extra: dict[str, Any]) -> Iterator[Any]:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvbridge.vllm import KVBridgeConnector

    cfg, kcc = build_config(extra)
    connector = KVBridgeConnector(cfg, KVConnectorRole.SCHEDULER, kcc)
    try:
        yield connector
    finally:
        connector.shutdown()


def payload(agent: bytes):
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NixlHandshakePayload

    return NixlHandshakePayload(compatibility_hash="compat-1", agent_metadata_bytes=agent)


def agent_of(data: bytes) -> bytes:
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NixlHandshakePayload

    return msgspec.msgpack.decode(data, type=NixlHandshakePayload).agent_metadata_bytes
