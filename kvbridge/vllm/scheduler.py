"""``KVBridgeScheduler``: vLLM's pull scheduler whose handshake listener is kvbridge's
side-channel server for ``handshake_method``, in a process of its own (the port actually
bound is what ``kv_transfer_params`` advertise; a second ``set_xfer_handshake_metadata``,
vLLM 0.33 after a wake-up, republishes), which registers the instance in etcd with ``api_url``, and which
names the block tags each step writes (kvbridge.vllm.validation) and gives every hold a key
(kvbridge.vllm.holds)."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler import (
    NixlPullConnectorScheduler,
)

from kvbridge.handshake.base import HandshakeServer
from kvbridge.handshake.factory import side_channel
from kvbridge.handshake.payloads import PayloadStore, Rank
from kvbridge.vllm.holds import KEY_PARAM, new_key
from kvbridge.vllm.payload import PAYLOAD_KIND, describe_payload, log, payload_decoder, validating
from kvbridge.vllm.settings import PluginSettings
from kvbridge.vllm.validation import TagWriter
from kvbridge.vllm.wire import WIRE

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request


class KVBridgeScheduler(NixlPullConnectorScheduler):
    """vLLM's pull scheduler; its handshake listener is kvbridge's side-channel server."""

    def __init__(self, vllm_config: VllmConfig, engine_id: str,
                 kv_cache_config: KVCacheConfig, settings: PluginSettings):
        super().__init__(vllm_config, engine_id, kv_cache_config)
        sc = settings.side_channel
        self.kvbridge_settings = settings
        self.kvbridge_epoch = uuid.uuid4().hex
        self.kvbridge_server: HandshakeServer | None = None
        self._kvbridge_error: BaseException | None = None
        # Replaces the payloads the running server hands out (set with the server).
        self._kvbridge_republish: Callable[[dict[Rank, bytes]], None] | None = None
        # What kv_transfer_params advertise (remote_host, remote_port); the port becomes
        # the bound one once the server listens.
        self.side_channel_host = sc.advertised
        self.side_channel_port = sc.side_channel_port
        # READ validation: the tags each step writes, and the prompts of requests to read.
        self._kvbridge_tags = (TagWriter(vllm_config.cache_config.block_size)
                               if validating(settings, kv_cache_config) else None)
        self._kvbridge_prompts: dict[str, list[int]] = {}
        # Hold keys (kvbridge.vllm.holds): a prefill's request has its key from the step
        # that computes it (the workers know it before anyone can name the request in a
        # note); it is given out with the params if the request is held. A decode gets
        # the keys of requests to read with their params.
        self._kvbridge_keys_on = settings.hold_keys == "require"
        self._kvbridge_keys: dict[str, str] = {}  # prefill: request id -> its hold's key
        self._kvbridge_new_keys: dict[str, str] = {}  # not yet sent to the workers
        self._kvbridge_recv_keys: dict[str, str] = {}

    def update_state_after_alloc(self, request: Request, blocks: Any,
                                 num_external_tokens: int) -> None:
        super().update_state_after_alloc(request, blocks, num_external_tokens)
        rid = request.request_id
        if self._kvbridge_keys_on and (request.kv_transfer_params or {}).get("do_remote_decode"):
            self._kvbridge_new_keys[rid] = self._kvbridge_keys.setdefault(rid, new_key())
        if rid not in self._reqs_need_recv:
            return
        # vLLM queued a READ for it (it clears do_remote_prefill itself): keep its prompt
        # (the expected tags) and its hold's key (the READ-done note's).
        if self._kvbridge_tags is not None and request.prompt_token_ids is not None:
            self._kvbridge_prompts[rid] = list(request.prompt_token_ids)
        key = (request.kv_transfer_params or {}).get(KEY_PARAM)
        if isinstance(key, str) and key:
            self._kvbridge_recv_keys[rid] = key

    def request_finished(self, request: Request, block_ids: Any
                         ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's; a held request's params carry its hold's key."""
        delay, params = super().request_finished(request, block_ids)
        key = self._kvbridge_keys.pop(request.request_id, None)
        if delay and params is not None and self._kvbridge_keys_on:
            if key is None:  # held without an allocation seen here: keyed now (late)
                key = self._kvbridge_new_keys[request.request_id] = new_key()
            params[KEY_PARAM] = key
        return delay, params

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> Any:
        meta = super().build_connector_meta(scheduler_output)
        if self._kvbridge_tags is not None:
            meta.kvbridge_tags = self._kvbridge_tags.step(scheduler_output)
            meta.kvbridge_prompts = {r: self._kvbridge_prompts.pop(r)
                                     for r in meta.reqs_to_recv if r in self._kvbridge_prompts}
        meta.kvbridge_hold_keys, self._kvbridge_new_keys = self._kvbridge_new_keys, {}
        meta.kvbridge_recv_keys = {r: self._kvbridge_recv_keys.pop(r)
                                   for r in meta.reqs_to_recv if r in self._kvbridge_recv_keys}
        for r in scheduler_output.finished_req_ids:
            self._kvbridge_prompts.pop(r, None)
            self._kvbridge_recv_keys.pop(r, None)
        return meta

    def set_xfer_handshake_metadata(self, metadata: dict[tuple[int, int], Any]) -> None:
        # vLLM's: type check, encoding, then our listener in its thread (waits until bound;
        # started once). Called again (vLLM 0.33: a wake-up re-registered the KV cache),
        # the listener is not restarted: hand the running server the new payloads, encoded
        # as vLLM encodes them (its generation bump makes decodes handshake again).
        republish = self._kvbridge_republish
        super().set_xfer_handshake_metadata(metadata)
        if self._kvbridge_error is not None:
            raise self._kvbridge_error
        if republish is not None:
            encoder = msgspec.msgpack.Encoder()
            republish({rank: encoder.encode(m) for rank, m in metadata.items()})
            log.info("kvbridge side channel: republished %d rank(s) of engine %s",
                     len(metadata), self.engine_id)

    def _nixl_handshake_listener(self, encoded_data: dict[Rank, bytes],  # type: ignore[override]
                                 ready_event: threading.Event, stop_event: threading.Event,
                                 host: str, port: int) -> None:
        try:
            server, republish = self._kvbridge_make_server(dict(encoded_data), port)
            server.start()
        except BaseException as e:  # vLLM waits on ready_event: never leave it unset
            self._kvbridge_error = e
            ready_event.set()
            return
        self.kvbridge_server = server
        self.side_channel_port = server.port
        self._kvbridge_republish = republish
        sc = self.kvbridge_settings.side_channel
        log.info("kvbridge side channel: %s on %s:%d (advertised %s:%d), engine %s epoch %s, "
                 "%d rank(s)", server.method, sc.side_channel_host, server.port,
                 self.side_channel_host, server.port, self.engine_id, self.kvbridge_epoch,
                 len(encoded_data))
        try:
            registrar = self._kvbridge_register(encoded_data, server.port)
        except BaseException as e:  # as above: say why in the caller, never hang it
            self._kvbridge_error = e
            server.stop()
            ready_event.set()
            return
        ready_event.set()
        stop_event.wait()
        if registrar is not None:  # withdrawn before the side channel goes
            registrar.deregister()
        server.stop()

    def _kvbridge_register(self, encoded_data: dict[Rank, bytes], port: int):
        """With ``api_url`` (and a ``registry``): this instance's record in etcd, kept under
        a lease (the record ``kvbridge serve --registry`` writes, with vLLM's compatibility
        hash); etcd down at start-up or later only delays it (the registrar retries)."""
        reg = self.kvbridge_settings.registration
        if reg is None:
            return None
        from kvbridge.vllm.registration import instance_record, start_registration

        sc = self.kvbridge_settings.side_channel
        first = payload_decoder.decode(next(iter(encoded_data.values())))
        record = instance_record(
            reg, sc, engine_id=self.engine_id, epoch=self.kvbridge_epoch,
            tp_size=self.transfer_tp_size, compat_hash=first.compatibility_hash,
            model=self.vllm_config.model_config.served_model_name or "", side_channel_port=port)
        log.info("kvbridge: registering %s (%s) in %s", reg.api_url, reg.role, sc.registry)
        return start_registration(reg, sc, record)

    def _kvbridge_make_server(self, payloads: dict[Rank, bytes], port: int
                              ) -> tuple[HandshakeServer, Callable[[dict[Rank, bytes]], None]]:
        """The server for ``handshake_method``, built as ``kvbridge serve`` builds its own
        (``kvbridge.handshake.factory``: in a process of its own unless
        ``side_channel_isolation`` is ``thread``; budget and keep-alive, named tokens,
        allow-list, audit log, TLS), and how to hand it new payloads."""
        sc = self.kvbridge_settings.side_channel
        pp_size = self.vllm_config.parallel_config.pipeline_parallel_size
        store = PayloadStore(PAYLOAD_KIND, self.engine_id, self.kvbridge_epoch,
                             tp_size=self.transfer_tp_size, pp_size=pp_size,
                             describe=describe_payload)
        store.set_payloads(payloads)
        server = side_channel(sc, store, port, wire=WIRE)

        def republish(new: dict[Rank, bytes]) -> None:
            store.set_payloads(new)
            server.payloads_changed(new)  # etcd's record, vLLM's wire, the process

        return server, republish
