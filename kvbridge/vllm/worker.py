"""``KVBridgeWorker``: vLLM's pull worker whose handshake fetches through kvbridge's client
(one deadline, ``handshake_timeout``) and then runs vLLM's own checks, in vLLM's order, with
its helpers; which keeps block tags and validates every READ (kvbridge.vllm.validation);
and whose READ-done notes carry, and are checked for, the hold's key (kvbridge.vllm.holds)."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

import msgspec
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NixlHandshakePayload
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import (
    NixlPullConnectorWorker,
)
from vllm.platforms import current_platform

from kvbridge._nixl import nixl_module, progress_delay
from kvbridge.handshake.base import HandshakeClient
from kvbridge.handshake.factory import make_client
from kvbridge.handshake.payloads import FetchedPayloads, Rank, fetch_payloads
from kvbridge.vllm.affinity import kept_affinity
from kvbridge.vllm.holds import KeyedAgent
from kvbridge.vllm.payload import PAYLOAD_KIND, agent_decoder, log, payload_decoder, validating
from kvbridge.vllm.settings import PluginSettings
from kvbridge.vllm.stats import KVBridgeStats
from kvbridge.vllm.validation import ReadValidator, StepTags
from kvbridge.vllm.wire import VllmZmqClient, vllm_wire_client

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig


class KVBridgeWorker(NixlPullConnectorWorker):
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
        self.kvbridge_settings = settings
        # (host, port) -> the epoch of the instance last handshaken there ("" over zmq)
        self.kvbridge_epochs: dict[tuple[str, int], str] = {}
        self._kvbridge_client: HandshakeClient | VllmZmqClient | None = None
        self._kvbridge_lock = threading.Lock()
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

    def _kvbridge_transport(self) -> HandshakeClient | VllmZmqClient:
        with self._kvbridge_lock:
            if self._kvbridge_client is None:
                # As kvbridge serve's decode workers: token rotation (token_file), TLS,
                # max_message_bytes, and connections to known peers kept warm.
                self._kvbridge_client = make_client(self.kvbridge_settings.side_channel, None,
                                                    keep_warm=True, zmq=vllm_wire_client)
            return self._kvbridge_client

    def _kvbridge_fetch(self, host: str, port: int, ranks: list[Rank],
                        expected_engine_id: str) -> FetchedPayloads:
        client = self._kvbridge_transport()
        if isinstance(client, VllmZmqClient):
            return client.fetch(host, port, ranks)
        return fetch_payloads(client, PAYLOAD_KIND, host, port, ranks,
                              expected_engine_id=expected_engine_id,
                              wait_for_engine=client.method == "etcd")

    def _nixl_handshake(
        self,
        host: str,
        port: int,
        remote_tp_size: int,
        expected_engine_id: str,
        remote_dcp_size: int = 1,
        remote_pp_size: int = 1,
        notif_agents_only: bool = False,
    ) -> tuple[dict[tuple[int, int], str], float]:
        """vLLM's handshake with kvbridge's transport: fetch every target rank's payload
        within one deadline, then vLLM's checks and ``add_remote_agent`` per rank."""
        if self._is_csa_linear:
            self._validate_csa_linear_tp_layout(remote_tp_size)
        if not self.use_host_buffer:  # as vLLM: the handshake thread needs the device set
            current_platform.set_device(self.device_id)
        assert self.transfer_topo is not None
        p_remote_ranks = self.transfer_topo.handshake_target_ranks(remote_tp_size,
                                                                   remote_dcp_size)
        targets = [(pp, tp) for pp in range(remote_pp_size) for tp in p_remote_ranks]
        fetched = self._kvbridge_fetch(host, port, targets, expected_engine_id)
        previous = self.kvbridge_epochs.get((host, port))
        self.kvbridge_epochs[(host, port)] = fetched.epoch
        log.info("kvbridge handshake: %s %s:%d engine %s epoch %s%s, %d rank(s)",
                 self.kvbridge_settings.method, host, port, expected_engine_id,
                 fetched.epoch or "-",
                 f" (new; was {previous})" if previous and previous != fetched.epoch else "",
                 len(targets))
        remote_rank_to_agent_name: dict[tuple[int, int], str] = {}
        for remote_pp_rank, remote_rank in targets:
            remote_rank_to_agent_name[(remote_pp_rank, remote_rank)] = self._kvbridge_admit(
                fetched.payloads[(remote_pp_rank, remote_rank)], remote_rank,
                remote_tp_size, expected_engine_id, notif_agents_only)
        return remote_rank_to_agent_name, fetched.clock_offset

    def _kvbridge_admit(self, handshake_bytes: bytes, remote_rank: int, remote_tp_size: int,
                        expected_engine_id: str, notif_agents_only: bool) -> str:
        """vLLM's checks of ``_nixl_handshake`` (0.32 and 0.33 alike), unchanged in order
        and wording; kvbridge/vllm/drift.py fails the suite when vLLM's change."""
        try:
            handshake_payload = payload_decoder.decode(handshake_bytes)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise RuntimeError(
                f"Failed to decode NixlHandshakePayload. This likely indicates "
                f"an incompatibility between connector version. Error: {e}"
            ) from e
        assert self.compat_hash is not None
        if (
            self.enforce_compat_hash
            and handshake_payload.compatibility_hash != self.compat_hash
        ):
            raise RuntimeError(
                f"NIXL compatibility hash mismatch. "
                f"Local: {self.compat_hash}, "
                f"Remote: {handshake_payload.compatibility_hash}. "
                f"Prefill and decode instances have incompatible "
                f"configurations. This may be due to: different vLLM versions,"
                f" models, dtypes, KV cache layouts, attention backends, etc. "
                f"Both instances must use identical configurations."
                f"Disable this check using "
                f'--kv-transfer-config \'{{"kv_connector_extra_config": '
                f'{{"enforce_handshake_compat": false}}}}\''
            )
        try:
            metadata = agent_decoder.decode(handshake_payload.agent_metadata_bytes)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise RuntimeError(f"Failed to decode NixlAgentMetadata. Error: {e}") from e
        self._validate_remote_parallel_config(metadata)
        if metadata.engine_id != expected_engine_id:
            raise RuntimeError(
                f"Remote NIXL agent engine ID mismatch. "
                f"Expected {expected_engine_id},"
                f"received {metadata.engine_id}."
            )
        if notif_agents_only:
            return self._add_notif_only_remote_agent(metadata, remote_tp_size,
                                                     metadata.dcp_size)
        agent = self.add_remote_agent(metadata, remote_rank, remote_tp_size, metadata.dcp_size)
        if self.kvbridge_validator is not None:
            self.kvbridge_validator.add_peer(metadata.engine_id, remote_rank, agent,
                                             handshake_payload.agent_metadata_bytes)
        return agent

    def shutdown(self) -> None:
        if self.kvbridge_validator is not None:
            self.kvbridge_validator.shutdown()
        super().shutdown()
        client, self._kvbridge_client = self._kvbridge_client, None
        if client is not None and hasattr(client, "close"):
            client.close()
