"""``SideChannelListener``: the scheduler side of kvbridge's side channel inside vLLM, for the
pull and the push connector alike.

vLLM's listener thread body (``_nixl_handshake_listener``, a zmq ROUTER) is replaced by
kvbridge's server for ``handshake_method``, in a process of its own: the port actually bound
is what ``kv_transfer_params`` (pull) and push registrations advertise; a second
``set_xfer_handshake_metadata`` (vLLM 0.33, after a wake-up) republishes; with ``api_url``
the instance is registered in etcd."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable
from typing import Any

import msgspec

from kvbridge.handshake.base import HandshakeServer
from kvbridge.handshake.payloads import PayloadStore, Rank
from kvbridge.handshake.process.parent import side_channel
from kvbridge.vllm.nixl_payload import PAYLOAD_KIND, describe_payload, log, payload_decoder
from kvbridge.vllm.settings import PluginSettings


class SideChannelListener:
    """Mixed into a subclass of vLLM's ``NixlBaseConnectorScheduler`` (before it in the
    bases); ``_kvbridge_listen_init`` runs after vLLM's ``__init__``."""

    # vLLM's, set by NixlBaseConnectorScheduler.__init__
    engine_id: str
    vllm_config: Any
    transfer_tp_size: int
    side_channel_host: str
    side_channel_port: int

    def _kvbridge_listen_init(self, settings: PluginSettings) -> None:
        sc = settings.side_channel
        self.kvbridge_settings = settings
        self.kvbridge_epoch = uuid.uuid4().hex
        self.kvbridge_server: HandshakeServer | None = None
        self._kvbridge_error: BaseException | None = None
        # Replaces the payloads the running server hands out (set with the server).
        self._kvbridge_republish: Callable[[dict[Rank, bytes]], None] | None = None
        # What kv_transfer_params and push registrations advertise; the port becomes the
        # bound one once the server listens.
        self.side_channel_host = sc.advertised
        self.side_channel_port = sc.side_channel_port

    def set_xfer_handshake_metadata(self, metadata: dict[tuple[int, int], Any]) -> None:
        # vLLM's: type check, encoding, then our listener in its thread (waits until bound;
        # started once). Called again (vLLM 0.33: a wake-up re-registered the KV cache),
        # the listener is not restarted: hand the running server the new payloads, encoded
        # as vLLM encodes them (its generation bump makes peers handshake again).
        republish = self._kvbridge_republish
        super().set_xfer_handshake_metadata(metadata)  # type: ignore[misc]
        if self._kvbridge_error is not None:
            raise self._kvbridge_error
        if republish is not None:
            encoder = msgspec.msgpack.Encoder()
            republish({rank: encoder.encode(m) for rank, m in metadata.items()})
            log.info("kvbridge side channel: republished %d rank(s) of engine %s",
                     len(metadata), self.engine_id)

    def _nixl_handshake_listener(self, encoded_data: dict[Rank, bytes],
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

    def _kvbridge_register(self, encoded_data: dict[Rank, bytes], port: int) -> Any:
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
        server = side_channel(sc, store, port, wire="vllm")

        def republish(new: dict[Rank, bytes]) -> None:
            store.set_payloads(new)
            server.payloads_changed(new)  # etcd's record, vLLM's wire, the process

        return server, republish
