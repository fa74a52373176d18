"""What the plug-in's side channel carries: vLLM's ``NixlHandshakePayload`` per rank, its
decoders, and the side channel's JSON view of one; vLLM's logger, shared by the plug-in's
modules. Also the two decisions both sides take from the settings."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgspec
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlPullConnector
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
    NixlAgentMetadata,
    NixlHandshakePayload,
)
from vllm.logger import init_logger

from kvbridge.vllm.settings import PluginSettings, load_settings

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

log = init_logger("vllm.kvbridge")  # vLLM's handler: our lines in its log

# What the opaque payloads of the side channel are (PayloadEnvelope.kind).
PAYLOAD_KIND = "vllm-nixl/NixlHandshakePayload"

# A feature, not a version: a vLLM whose NixlPullConnector answers supports_sleep_mode
# (0.33 and later) calls set_xfer_handshake_metadata again after a wake-up and bumps its
# registration generation, so decodes handshake again; the plug-in republishes then.
WAKE_UP_REPUBLISHES = callable(getattr(NixlPullConnector, "supports_sleep_mode", None))

payload_decoder = msgspec.msgpack.Decoder(NixlHandshakePayload)
agent_decoder = msgspec.msgpack.Decoder(NixlAgentMetadata)


def describe_payload(data: bytes) -> dict[str, Any]:
    """The side channel's JSON view of one rank: what a person checks, no secrets."""
    payload = payload_decoder.decode(data)
    meta = agent_decoder.decode(payload.agent_metadata_bytes)
    return {"compatibility_hash": payload.compatibility_hash, "engine_id": meta.engine_id,
            "num_blocks": meta.num_blocks, "block_size": meta.block_size,
            "block_lens": meta.block_lens, "kv_cache_layout": meta.kv_cache_layout,
            "attn_backend_name": meta.attn_backend_name, "dcp_size": meta.dcp_size,
            "agent_metadata_bytes": len(meta.agent_metadata)}


def plugin_settings(vllm_config: VllmConfig, mode: str = "pull") -> PluginSettings:
    ktc = vllm_config.kv_transfer_config
    assert ktc is not None
    return load_settings(ktc.kv_connector_extra_config,
                         dp_index=vllm_config.parallel_config.data_parallel_index, mode=mode)


def validating(settings: PluginSettings, kv_cache_config: KVCacheConfig) -> bool:
    """Block tags are kept and read (kvbridge.vllm.validation): not with
    ``read_validation: off``, and only for one KV cache group (the attention KV)."""
    return settings.read_validation != "off" and len(kv_cache_config.kv_cache_groups) == 1
