"""Push mode: vLLM's ``NixlPushConnectorScheduler`` and ``NixlPushConnectorWorker`` with
kvbridge's side channel for both handshakes (the decode's, to send its registration note;
the prefill's, to WRITE into the decode's blocks), registration notes parse-checked, and a
hold's key on the registration and on the WRITE-done note (docs/vllm.md §6c).

The keys: a prefill gives every request it computes for a remote decode a fresh key, in
``kv_transfer_params`` as in pull mode (kvbridge.vllm.holds). The decode puts it in its
registration; the prefill WRITEs only for a registration carrying the key of the request it
matches, and adds the key to its WRITE-done note; the decode takes a WRITE-done note for a
request only with the key. A stock vLLM on either side gives or sends no key: a plug-in
prefill with ``hold_keys: require`` writes for no stock decode (set ``hold_keys: off``)."""

from __future__ import annotations

import hmac
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import PUSH_REG_NOTIF_PREFIX
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.push_scheduler import (
    NixlPushConnectorScheduler,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.push_worker import (
    NixlPushConnectorWorker,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.utils import get_base_request_id

from kvbridge._nixl import nixl_module, progress_delay
from kvbridge.errors import ConfigError
from kvbridge.vllm.affinity import kept_affinity
from kvbridge.vllm.client import SideChannelHandshake
from kvbridge.vllm.holds import KEY_PARAM, HoldKeys, KeyedAgent
from kvbridge.vllm.listener import SideChannelListener
from kvbridge.vllm.nixl_payload import log
from kvbridge.vllm.pushreg import PUSH_REG_PREFIX, registration
from kvbridge.vllm.settings import PluginSettings
from kvbridge.vllm.stats import KVBridgeStats

if PUSH_REG_NOTIF_PREFIX != PUSH_REG_PREFIX:  # the note filter would drop every registration
    raise ConfigError(f"kvbridge.vllm: this vLLM's push registration notes start with "
                      f"{PUSH_REG_NOTIF_PREFIX!r}, not {PUSH_REG_PREFIX!r} (kvbridge/vllm/pushreg.py)")

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request


class KVBridgePushScheduler(HoldKeys, SideChannelListener, NixlPushConnectorScheduler):
    """vLLM's push scheduler; its handshake listener is kvbridge's side-channel server (the
    decode's is where a prefill handshakes before it WRITEs), and its holds are keyed."""

    def __init__(self, vllm_config: VllmConfig, engine_id: str,
                 kv_cache_config: KVCacheConfig, settings: PluginSettings):
        super().__init__(vllm_config, engine_id, kv_cache_config)
        self._kvbridge_listen_init(settings)
        self._kvbridge_keys_init(settings.hold_keys)

    def update_state_after_alloc(self, request: Request, blocks: Any,
                                 num_external_tokens: int) -> None:
        super().update_state_after_alloc(request, blocks, num_external_tokens)
        rid, params = request.request_id, request.kv_transfer_params or {}
        self._kvbridge_key_computed(request)  # before any registration can name it
        reg = self._push_pending_registrations.get(rid)
        key = params.get(KEY_PARAM)
        if reg is not None and isinstance(key, str) and key:
            reg[KEY_PARAM] = key  # the prefill writes only for it
            if self._kvbridge_keys_on:
                self._kvbridge_recv_keys[rid] = key  # the WRITE-done note must carry it

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> Any:
        meta = super().build_connector_meta(scheduler_output)
        self._kvbridge_keys_meta(meta, scheduler_output)
        return meta


def _candidates(ids: Any, rid: str) -> Iterator[str]:
    """vLLM's matching of a registration and a finished request: the same id first, then
    the same id without vLLM's random suffix."""
    if rid in ids:
        yield rid
    base = get_base_request_id(rid)
    yield from (i for i in list(ids) if i != rid and get_base_request_id(i) == base)


class KVBridgePushWorker(SideChannelHandshake, NixlPushConnectorWorker):
    """vLLM's push worker; both handshakes go through kvbridge's client, registration notes
    are parse-checked, and a keyed hold is written only for a registration with its key."""

    def __init__(self, vllm_config: VllmConfig, engine_id: str,
                 kv_cache_config: KVCacheConfig, settings: PluginSettings):
        # As the pull worker: NIXL's progress thread sleeps between polls, and the
        # forward's thread keeps its cores (kvbridge/vllm/worker_side.py).
        with progress_delay(nixl_module()), kept_affinity():
            super().__init__(vllm_config, engine_id, kv_cache_config)
        self._kvbridge_client_init(settings)
        stats = self.xfer_stats = KVBridgeStats()
        # Every note either way passes the filter: the writer thread's get_new_notifs
        # (registrations, WRITE-done notes, heartbeats) and the notes vLLM sends.
        self.kvbridge_keys = KeyedAgent(self.nixl_wrapper, stats.record_note_ignored,
                                        keys=settings.hold_keys == "require",
                                        registrations=True)
        self.nixl_wrapper = self.kvbridge_keys
        self._kvbridge_written: dict[str, str] = {}  # prefill request id -> decode's
        self._kvbridge_warned: set[str] = set()

    def kvbridge_before_forward(self, metadata: Any) -> None:
        """The connector's ``bind_connector_metadata``: a prefill's new keys, before any
        registration can name their requests."""
        held = self.kvbridge_keys.hold_keys
        held.update(getattr(metadata, "kvbridge_hold_keys", {}))
        for req_id in getattr(metadata, "reqs_not_processed", ()):  # aborted: never held
            held.pop(req_id, None)

    def start_load_kv(self, metadata: Any) -> None:
        # A decode: the key the prefill's WRITE-done note must carry, known before vLLM
        # queues the registration that lets the prefill write.
        self.kvbridge_keys.hold_keys.update(getattr(metadata, "kvbridge_recv_keys", {}))
        super().start_load_kv(metadata)

    def _kvbridge_key_ok(self, req_id: str, reg: dict[str, Any]) -> bool:
        """A registration may be matched to this prefill's request ``req_id``: the request
        was not keyed, or the registration carries its key."""
        keys = self.kvbridge_keys
        held = keys.hold_keys.get(req_id) if keys.keys else None
        if held is None:
            return True
        key = reg.get(KEY_PARAM)
        return isinstance(key, str) and hmac.compare_digest(key, held)

    def _kvbridge_refuse(self, reg: dict[str, Any]) -> None:
        why = "no_key" if reg.get(KEY_PARAM) is None else "bad_key"
        stats = self.xfer_stats
        assert isinstance(stats, KVBridgeStats)
        stats.record_note_ignored(why)
        if why not in self._kvbridge_warned:
            self._kvbridge_warned.add(why)
            log.warning("kvbridge: a push registration for request %s from engine %s without "
                        "its hold's key (%s) was refused: nothing is written for it (a stock "
                        "vLLM decode sends no key: hold_keys off on the prefill for one)",
                        reg.get("request_id"), reg.get("decode_engine_id"), why)

    def _handle_push_reg_notif(self, notif: bytes) -> None:
        """vLLM's, with the registration parse-checked and matched only to a request whose
        key it carries; one that names a keyed request without its key is refused."""
        reg = registration(notif)
        if reg is None:  # the note filter passes none such; kept for a direct call
            return
        rid = reg["request_id"]
        named = False
        for fin_id in _candidates(self._push_finished_blocks, rid):
            named = True
            if self._kvbridge_key_ok(fin_id, reg):
                self._do_start_push_kv(fin_id, self._push_finished_blocks.pop(fin_id), reg)
                return
        # Not finished yet: refused now if it names a request keyed here without its key,
        # so a forged one cannot take the real one's place among the pending ones.
        for req_id in _candidates(self.kvbridge_keys.hold_keys, rid):
            named = True
            if self._kvbridge_key_ok(req_id, reg):
                named = False
                break
        if named:
            self._kvbridge_refuse(reg)
            return
        self._pending_d_registrations[rid] = reg

    def _pop_matching_registration(self, request_id: str) -> dict[str, Any] | None:
        """vLLM's, matching only a registration with the request's key (others are
        dropped: they name it without its key)."""
        for reg_id in list(_candidates(self._pending_d_registrations, request_id)):
            reg = self._pending_d_registrations.pop(reg_id)
            if self._kvbridge_key_ok(request_id, reg):
                return reg
            self._kvbridge_refuse(reg)
        return None

    def _do_start_push_kv(self, request_id: str, local_block_ids: Any,
                          registration_data: dict[str, Any]) -> None:
        key = registration_data.get(KEY_PARAM)
        held = self.kvbridge_keys.hold_keys.get(request_id)
        if held is not None and key == held:  # the decode checks its WRITE-done note for it
            decode_id = registration_data["request_id"]
            self.kvbridge_keys.send_keys[decode_id] = held
            self._kvbridge_written[request_id] = decode_id
        super()._do_start_push_kv(request_id, local_block_ids, registration_data)

    def get_transfer_results(self) -> Any:
        results = super().get_transfer_results()
        keys = self.kvbridge_keys
        for req_id in results.finished_sending:  # written, or its lease ran out
            keys.hold_keys.pop(req_id, None)
            decode_id = self._kvbridge_written.pop(req_id, None)
            if decode_id is not None:
                keys.send_keys.pop(decode_id, None)
        for req_id in results.finished_recving:
            keys.hold_keys.pop(req_id, None)
        return results
