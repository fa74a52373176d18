"""Configurations the plug-in refuses, in one line, when its connector is built.

vLLM checks (or adjusts) some configurations only for a connector *named*
``NixlConnector`` (``has_connector("NixlConnector")`` in ``vllm/config/vllm.py``,
``vllm/platforms/cpu.py``): for ``KVBridgeConnector`` those checks never fire, so the
plug-in refuses what they guard rather than transfer it wrongly (docs/vllm.md lists each
one). Sleep mode is refused where a wake-up does not republish the NIXL metadata.
Duck-typed on vLLM's configs; vLLM is imported only to read the Mamba conv layout.
"""

from __future__ import annotations

from typing import Any

from kvbridge.errors import ConfigError


def refuse_unguarded(vllm_config: Any, kv_cache_config: Any, *,
                     wake_up_republishes: bool) -> None:
    """``ConfigError`` in one line for a configuration the plug-in cannot serve correctly.

    ``wake_up_republishes``: this vLLM calls ``set_xfer_handshake_metadata`` again after a
    wake-up and decodes then handshake again (vLLM 0.33's registration generation).
    """
    model = getattr(vllm_config, "model_config", None)
    if model is not None and getattr(model, "enable_sleep_mode", False) \
            and not wake_up_republishes:
        raise ConfigError("kvbridge.vllm: sleep mode needs a vLLM whose wake-up republishes "
                          "the NIXL metadata (0.33 and later); with this one decodes would "
                          "read the KV cache registered before the sleep")
    aux = getattr(vllm_config, "aux_output_config", None)
    if aux is not None and getattr(aux, "enabled", False):
        raise ConfigError("kvbridge.vllm: auxiliary outputs (--enable-return-routed-experts) "
                          "are not transferred P/D; vLLM refuses them for NixlConnector by "
                          "name, so the plug-in does")
    dcp = vllm_config.parallel_config.decode_context_parallel_size
    if dcp > 1:
        raise ConfigError(f"kvbridge.vllm: decode_context_parallel_size={dcp} is not "
                          "supported: vLLM checks it and aligns cp_kv_cache_interleave_size "
                          "for P/D only for a connector named NixlConnector")
    if getattr(kv_cache_config, "has_mamba_layers", False) and not _conv_state_dim_first():
        raise ConfigError("kvbridge.vllm: Mamba state over NIXL needs the DS conv state "
                          "layout: set VLLM_SSM_CONV_STATE_LAYOUT=DS (vLLM sets it on CPU "
                          "only for a connector named NixlConnector)")


def _conv_state_dim_first() -> bool:
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

    return is_conv_state_dim_first()
