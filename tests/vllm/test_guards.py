"""What vLLM guards only for a connector named ``NixlConnector``, and sleep mode where a
wake-up does not republish, are refused by the plug-in in one line: the real connector
with real vLLM configs, no vLLM server."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvbridge.errors import ConfigError
from kvbridge.vllm.refusals import refuse_unguarded

pytest.importorskip("vllm")

from tests.vllm.objects import attention_spec, build_config, cache_config  # noqa: E402


def build(vllm_config, kv_cache_config):
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvbridge.vllm import KVBridgeConnector

    return KVBridgeConnector(vllm_config, KVConnectorRole.SCHEDULER, kv_cache_config)


def refused(vllm_config, kv_cache_config, says: str) -> None:
    with pytest.raises(ConfigError, match=says) as e:
        build(vllm_config, kv_cache_config)
    assert "\n" not in str(e.value) and str(e.value).startswith("kvbridge.vllm: ")


def mamba_spec():
    import torch
    from vllm.v1.kv_cache_interface import MambaSpec

    return MambaSpec(block_size=16, shapes=((4, 64),), dtypes=(torch.float32,))


def test_mamba_state_without_the_ds_conv_layout_is_refused(monkeypatch) -> None:
    """vLLM on CPU picks the DS layout NIXL needs only for NixlConnector by name."""
    from vllm.model_executor.layers.mamba import mamba_utils

    monkeypatch.delenv("VLLM_SSM_CONV_STATE_LAYOUT", raising=False)
    mamba_utils.get_conv_state_layout.cache_clear()
    cfg, _ = build_config({"handshake_method": "http"})
    refused(cfg, cache_config(attention_spec(), mamba_spec()),
            "Mamba state over NIXL needs the DS conv state layout: set "
            "VLLM_SSM_CONV_STATE_LAYOUT=DS")


def test_decode_context_parallelism_is_refused() -> None:
    cfg, kcc = build_config({"handshake_method": "http"})
    cfg.parallel_config.decode_context_parallel_size = 2
    refused(cfg, kcc, "decode_context_parallel_size=2 is not supported")


def test_routed_experts_output_is_refused() -> None:
    cfg, kcc = build_config({"handshake_method": "http"})
    cfg.aux_output_config.enable_return_routed_experts = True
    refused(cfg, kcc, r"auxiliary outputs \(--enable-return-routed-experts\)")


def test_sleep_mode_only_where_a_wake_up_republishes(model) -> None:
    """vLLM 0.32 neither republishes after a wake-up nor asks the connector: the plug-in
    refuses sleep mode there. (vLLM on CPU refuses sleep mode itself, so the flag is set
    on a real ModelConfig after its validation, as a GPU build would have it.)"""
    from vllm.config import ModelConfig

    from kvbridge.vllm import KVBridgeConnector
    from kvbridge.vllm.connector import WAKE_UP_REPUBLISHES

    cfg, kcc = build_config({"handshake_method": "http"})
    cfg.model_config = ModelConfig(model=str(model), dtype="float32")
    cfg.model_config.enable_sleep_mode = True
    if WAKE_UP_REPUBLISHES:  # vLLM 0.33: served fresh, vLLM's own answer
        build(cfg, kcc).shutdown()
    else:
        refused(cfg, kcc, r"sleep mode needs a vLLM whose wake-up republishes the NIXL "
                          r"metadata \(0\.33 and later\)")
        assert KVBridgeConnector.supports_sleep_mode(cfg.kv_transfer_config) is False
    # The feature, not the version, decides.
    sleeping = SimpleNamespace(model_config=cfg.model_config,
                               parallel_config=cfg.parallel_config)
    with pytest.raises(ConfigError, match="sleep mode needs"):
        refuse_unguarded(sleeping, kcc, wake_up_republishes=False)
    refuse_unguarded(sleeping, kcc, wake_up_republishes=True)


def test_a_plain_configuration_is_not_refused() -> None:
    cfg, kcc = build_config({"handshake_method": "http"})
    build(cfg, kcc).shutdown()
