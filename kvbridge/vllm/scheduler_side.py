"""``KVBridgeScheduler``: vLLM's pull scheduler whose handshake listener is kvbridge's
side-channel server (kvbridge.vllm.listener, shared with the push connector), which names the
block tags each step writes (kvbridge.vllm.validation) and gives every hold a key
(kvbridge.vllm.holds)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler import (
    NixlPullConnectorScheduler,
)

from kvbridge.vllm.holds import KEY_PARAM, HoldKeys
from kvbridge.vllm.listener import SideChannelListener
from kvbridge.vllm.nixl_payload import validating
from kvbridge.vllm.settings import PluginSettings
from kvbridge.vllm.validation import TagWriter

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request


class KVBridgeScheduler(HoldKeys, SideChannelListener, NixlPullConnectorScheduler):
    """vLLM's pull scheduler; its handshake listener is kvbridge's side-channel server."""

    def __init__(self, vllm_config: VllmConfig, engine_id: str,
                 kv_cache_config: KVCacheConfig, settings: PluginSettings):
        super().__init__(vllm_config, engine_id, kv_cache_config)
        self._kvbridge_listen_init(settings)
        # READ validation: the tags each step writes, and the prompts of requests to read.
        self._kvbridge_tags = (TagWriter(vllm_config.cache_config.block_size)
                               if validating(settings, kv_cache_config) else None)
        self._kvbridge_prompts: dict[str, list[int]] = {}
        self._kvbridge_keys_init(settings.hold_keys)

    def update_state_after_alloc(self, request: Request, blocks: Any,
                                 num_external_tokens: int) -> None:
        super().update_state_after_alloc(request, blocks, num_external_tokens)
        rid = request.request_id
        self._kvbridge_key_computed(request)
        if rid not in self._reqs_need_recv:
            return
        # vLLM queued a READ for it (it clears do_remote_prefill itself): keep its prompt
        # (the expected tags) and its hold's key (the READ-done note's).
        if self._kvbridge_tags is not None and request.prompt_token_ids is not None:
            self._kvbridge_prompts[rid] = list(request.prompt_token_ids)
        key = (request.kv_transfer_params or {}).get(KEY_PARAM)
        if isinstance(key, str) and key:
            self._kvbridge_recv_keys[rid] = key

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> Any:
        meta = super().build_connector_meta(scheduler_output)
        if self._kvbridge_tags is not None:
            meta.kvbridge_tags = self._kvbridge_tags.step(scheduler_output)
            meta.kvbridge_prompts = {r: self._kvbridge_prompts.pop(r)
                                     for r in meta.reqs_to_recv if r in self._kvbridge_prompts}
        self._kvbridge_keys_meta(meta, scheduler_output)
        for r in scheduler_output.finished_req_ids:
            self._kvbridge_prompts.pop(r, None)
        return meta
