"""``KVBridgeWorker``: vLLM's pull worker whose handshake fetches through kvbridge's client
and then runs vLLM's own checks (kvbridge.vllm.client, shared with the push connector); which
keeps block tags and validates every READ (kvbridge.vllm.validation); and whose READ-done
notes carry, and are checked for, the hold's key (kvbridge.vllm.holds)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NixlHandshakePayload
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import (
    NixlPullConnectorWorker,
)
from vllm.platforms import current_platform

from kvbridge._nixl import nixl_module, progress_delay
from kvbridge.vllm.affinity import kept_affinity
from kvbridge.vllm.client import SideChannelHandshake
from kvbridge.vllm.holds import KeyedAgent
from kvbridge.vllm.nixl_payload import validating
from kvbridge.vllm.settings import PluginSettings
from kvbridge.vllm.stats import KVBridgeStats
from kvbridge.vllm.validation import ReadValidator, StepTags

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig


class KVBridgeWorker(SideChannelHandshake, NixlPullConnectorWorker):
    """vLLM's pull worker; its handshake fetches through kvbridge's client."""

    def __init__(self, vllm_config: VllmConfig, engine_id: str,
                 kv_cache_config: KVCacheConfig, settings: PluginSettings):
        # vLLM builds its NIXL agent here with nixl's busy-polling progress thread, which
        # spins a core even when idle (on vLLM's CPU build, the worker's own core); kvbridge's
        # nixl_progress_delay_us applies to it as to kvbridge's agents (kvbridge/_nixl.py).
        # vLLM also pins this thread, the one that runs the forward, to the machine's last
        # core on its CPU build; kept_affinity puts it back (kvbridge/vllm/affinity.py).
        with progress_delay(nixl_module()), kept_affinity():
            super().__init__(vllm_config, engine_id, kv_cache_config)
        self._kvbridge_client_init(settings)
        self.xfer_stats = KVBridgeStats()  # vLLM's NIXL stats and the READ results
        self._kvbridge_validating = validating(settings, kv_cache_config)
        self.kvbridge_validator: ReadValidator | None = None
        self._kvbridge_unsynced: list[tuple[Any, list[tuple[int, int]]]] = []  # GPU only
        # Hold keys (kvbridge.vllm.holds): vLLM's NIXL agent, wrapped; every use of it by
        # vLLM (notes sent with READs, notes received) goes through the wrapper.
        self.kvbridge_keys: KeyedAgent | None = None
        self._kvbridge_remote_ids: dict[str, str] = {}  # local request id -> remote one
        # Wrapped whatever hold_keys says: it also keeps malformed notes from vLLM's parse.
        stats = self.xfer_stats
        assert isinstance(stats, KVBridgeStats)
        self.kvbridge_keys = KeyedAgent(self.nixl_wrapper, stats.record_note_ignored,
                                        keys=settings.hold_keys == "require")
        self.nixl_wrapper = self.kvbridge_keys

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """vLLM's, with the block tags registered first (vLLM's agent metadata then knows
        them) and their address added to the handshake payload."""
        if not self._kvbridge_validating:
            super().register_kv_caches(kv_caches)
            return
        stats = self.xfer_stats
        assert isinstance(stats, KVBridgeStats)
        v = ReadValidator(self.nixl_wrapper, self.nixl_backends, self.kv_cache_config.num_blocks,
                          self.vllm_config.cache_config.block_size,
                          self.kvbridge_settings.read_validation,
                          stats.record_read, stats.record_tag_read_seconds)
        v.register()
        self.kvbridge_validator = v
        super().register_kv_caches(kv_caches)
        self._registered_descs.extend(v.registered)  # deregistered with vLLM's
        p = self.xfer_handshake_metadata
        assert isinstance(p, NixlHandshakePayload)
        self.xfer_handshake_metadata = NixlHandshakePayload(
            compatibility_hash=p.compatibility_hash,
            agent_metadata_bytes=v.advertise(p.agent_metadata_bytes))

    def restore_kv_caches(self) -> None:
        """vLLM 0.33, after a wake-up: its payload is re-encoded from vLLM's own type, which
        drops the tag fields; add them again (the tags' memory is re-registered with vLLM's,
        being in ``_registered_descs``)."""
        super().restore_kv_caches()  # type: ignore[misc]
        p, v = self.xfer_handshake_metadata, self.kvbridge_validator
        if v is not None and isinstance(p, NixlHandshakePayload):
            p.agent_metadata_bytes = v.advertise(p.agent_metadata_bytes)

    def kvbridge_before_forward(self, metadata: Any) -> None:
        """The connector's ``bind_connector_metadata``, before the step's forward: the tags
        of the blocks it will write are cleared (vLLM starts its loads after the forward,
        so ``start_load_kv`` would be too late)."""
        self._kvbridge_apply_finished_sets()
        if self.kvbridge_keys is not None:  # before this step's notes are read
            held = self.kvbridge_keys.hold_keys
            held.update(getattr(metadata, "kvbridge_hold_keys", {}))
            for req_id in getattr(metadata, "reqs_not_processed", ()):  # aborted: never held
                held.pop(req_id, None)
        tags: StepTags | None = getattr(metadata, "kvbridge_tags", None)
        if self.kvbridge_validator is not None and tags is not None:
            self.kvbridge_validator.clear(tags.clear)

    def kvbridge_after_forward(self, metadata: Any) -> None:
        """The connector's ``wait_for_save``: the tags of what the forward wrote. On a GPU
        the forward may still run: the tags are set once an event recorded now completes
        (a READ meanwhile sees them cleared: a recompute, never wrong KV)."""
        tags: StepTags | None = getattr(metadata, "kvbridge_tags", None)
        if self.kvbridge_validator is None or tags is None or not tags.set:
            return
        if current_platform.is_cuda_alike():
            import torch

            event = torch.cuda.Event()
            event.record()
            self._kvbridge_unsynced.append((event, tags.set))
        else:  # the CPU forward is done when it returns
            self.kvbridge_validator.set(tags.set)

    def _kvbridge_apply_finished_sets(self) -> None:
        v = self.kvbridge_validator
        while v is not None and self._kvbridge_unsynced and self._kvbridge_unsynced[0][0].query():
            v.set(self._kvbridge_unsynced.pop(0)[1])

    def start_load_kv(self, metadata: Any) -> None:
        keys = getattr(metadata, "kvbridge_recv_keys", {})
        if self.kvbridge_keys is not None:
            for req_id, key in keys.items():  # before vLLM posts the READs and their notes
                meta = metadata.reqs_to_recv.get(req_id)
                if meta is not None and meta.remote is not None:
                    self.kvbridge_keys.send_keys[meta.remote.request_id] = key
                    self._kvbridge_remote_ids[req_id] = meta.remote.request_id
        v = self.kvbridge_validator
        if v is not None:
            prompts = getattr(metadata, "kvbridge_prompts", {})
            for req_id, meta in metadata.reqs_to_recv.items():
                v.expect(req_id, meta, prompts.get(req_id))  # before vLLM remaps the ids
        super().start_load_kv(metadata)

    def get_transfer_results(self) -> Any:
        results = super().get_transfer_results()
        keys = self.kvbridge_keys
        if keys is not None:  # released holds and finished READs need their keys no more
            for req_id in results.finished_sending:
                keys.hold_keys.pop(req_id, None)
            for req_id in results.finished_recving:
                remote = self._kvbridge_remote_ids.pop(req_id, None)
                if remote is not None:
                    keys.send_keys.pop(remote, None)
        return results

    def _pop_done_transfers(self, transfers: dict[str, list[int]]
                            ) -> tuple[set[str], set[str]]:
        done, failed = super()._pop_done_transfers(transfers)
        self._kvbridge_apply_finished_sets()
        v = self.kvbridge_validator
        if v is None or transfers is not self._recving_transfers:
            return done, failed
        return v.hold_back(done, failed, self._kvbridge_sources, self._recving_metadata)

    def _kvbridge_sources(self, engine_id: str) -> tuple[int, ...]:
        plan = self.tp_mappings.get(engine_id)
        return tuple(plan.all_source_ranks) if plan is not None else ()

    def _kvbridge_admitted(self, engine_id: str, remote_rank: int, agent: str,
                           agent_metadata_bytes: bytes) -> None:
        if self.kvbridge_validator is not None:
            self.kvbridge_validator.add_peer(engine_id, remote_rank, agent, agent_metadata_bytes)

    def shutdown(self) -> None:
        if self.kvbridge_validator is not None:
            self.kvbridge_validator.shutdown()
        super().shutdown()
