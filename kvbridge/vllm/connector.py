"""``KVBridgeConnector``: vLLM's NixlConnector (pull mode) with kvbridge's side channel.

vLLM keeps everything but the handshake's transport: its NIXL agent and data path, block
management, heterogeneous-TP rank selection, compatibility-hash check, load-failure
policy and ``vllm:nixl_*`` metrics. What changes (every override is listed in
docs/vllm.md with its reason):

* scheduler: ``_nixl_handshake_listener`` serves the payloads vLLM gathered from every
  (pp, tp) rank with kvbridge's side-channel server for ``handshake_method``; the port
  actually bound is what ``kv_transfer_params`` advertise. ``set_xfer_handshake_metadata``
  re-raises the server's start-up error in the caller, and a second call (vLLM 0.33 after
  a wake-up that re-registered the KV cache) republishes: every method's server serves
  the new payloads from then on.
* worker: ``_nixl_handshake`` fetches the payloads through kvbridge's client (one deadline,
  ``handshake_timeout``) and then runs vLLM's own checks on them, in vLLM's order, with its
  helpers (``_validate_remote_parallel_config``, ``add_remote_agent``, ...).
  ``shutdown`` also closes the client.
* connector: ``__init__`` builds these two classes instead of the stock ones (one NIXL
  agent per worker, as stock).
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import (
    NixlBaseConnector,
    NixlPullConnector,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
    NixlAgentMetadata,
    NixlHandshakePayload,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler import (
    NixlPullConnectorScheduler,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import (
    NixlPullConnectorWorker,
)
from vllm.logger import init_logger
from vllm.platforms import current_platform

from kvbridge.errors import ConfigError
from kvbridge.handshake.base import HandshakeClient, HandshakeServer
from kvbridge.handshake.factory import make_client, make_server
from kvbridge.handshake.payloads import FetchedPayloads, PayloadStore, Rank, fetch_payloads
from kvbridge.vllm.guards import refuse_unguarded
from kvbridge.vllm.settings import PluginSettings, load_settings
from kvbridge.vllm.wire import VllmZmqClient, VllmZmqServer, vllm_wire_client, vllm_wire_server

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

_payload_decoder = msgspec.msgpack.Decoder(NixlHandshakePayload)
_agent_decoder = msgspec.msgpack.Decoder(NixlAgentMetadata)


def describe_payload(data: bytes) -> dict[str, Any]:
    """The side channel's JSON view of one rank: what a person checks, no secrets."""
    payload = _payload_decoder.decode(data)
    meta = _agent_decoder.decode(payload.agent_metadata_bytes)
    return {"compatibility_hash": payload.compatibility_hash, "engine_id": meta.engine_id,
            "num_blocks": meta.num_blocks, "block_size": meta.block_size,
            "block_lens": meta.block_lens, "kv_cache_layout": meta.kv_cache_layout,
            "attn_backend_name": meta.attn_backend_name, "dcp_size": meta.dcp_size,
            "agent_metadata_bytes": len(meta.agent_metadata)}


def _settings(vllm_config: VllmConfig) -> PluginSettings:
    ktc = vllm_config.kv_transfer_config
    assert ktc is not None
    return load_settings(ktc.kv_connector_extra_config,
                         dp_index=vllm_config.parallel_config.data_parallel_index)


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
        first = _payload_decoder.decode(next(iter(encoded_data.values())))
        record = instance_record(
            reg, sc, engine_id=self.engine_id, epoch=self.kvbridge_epoch,
            tp_size=self.transfer_tp_size, compat_hash=first.compatibility_hash,
            model=self.vllm_config.model_config.served_model_name or "", side_channel_port=port)
        log.info("kvbridge: registering %s (%s) in %s", reg.api_url, reg.role, sc.registry)
        return start_registration(reg, sc, record)

    def _kvbridge_make_server(self, payloads: dict[Rank, bytes], port: int
                              ) -> tuple[HandshakeServer, Callable[[dict[Rank, bytes]], None]]:
        """The server for ``handshake_method``, built as ``kvbridge serve`` builds its own
        (``kvbridge.handshake.factory``: budget and keep-alive, named tokens, allow-list,
        audit log, TLS), and how to hand it new payloads."""
        sc = self.kvbridge_settings.side_channel
        pp_size = self.vllm_config.parallel_config.pipeline_parallel_size
        store = PayloadStore(PAYLOAD_KIND, self.engine_id, self.kvbridge_epoch,
                             tp_size=self.transfer_tp_size, pp_size=pp_size,
                             describe=describe_payload)
        if sc.handshake_method != "zmq":  # vLLM's wire serves the payloads itself
            store.set_payloads(payloads)
        server = make_server(sc, store, port, zmq=vllm_wire_server(payloads))
        if isinstance(server, VllmZmqServer):
            return server, server.set_payloads
        if sc.handshake_method == "etcd":
            from kvbridge.handshake.etcd import EtcdHandshakeServer

            assert isinstance(server, EtcdHandshakeServer)
            etcd_server = server

            def republish(new: dict[Rank, bytes]) -> None:
                store.set_payloads(new)
                etcd_server.republish()  # the record in etcd, not only the store

            return server, republish
        return server, store.set_payloads


class KVBridgeWorker(NixlPullConnectorWorker):
    """vLLM's pull worker; its handshake fetches through kvbridge's client."""

    def __init__(self, vllm_config: VllmConfig, engine_id: str,
                 kv_cache_config: KVCacheConfig, settings: PluginSettings):
        super().__init__(vllm_config, engine_id, kv_cache_config)
        self.kvbridge_settings = settings
        # (host, port) -> the epoch of the instance last handshaken there ("" over zmq)
        self.kvbridge_epochs: dict[tuple[str, int], str] = {}
        self._kvbridge_client: HandshakeClient | VllmZmqClient | None = None
        self._kvbridge_lock = threading.Lock()

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
            handshake_payload = _payload_decoder.decode(handshake_bytes)
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
            metadata = _agent_decoder.decode(handshake_payload.agent_metadata_bytes)
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
        return self.add_remote_agent(metadata, remote_rank, remote_tp_size, metadata.dcp_size)

    def shutdown(self) -> None:
        super().shutdown()
        client, self._kvbridge_client = self._kvbridge_client, None
        if client is not None and hasattr(client, "close"):
            client.close()


class KVBridgeConnector(NixlPullConnector):
    """vLLM's NixlConnector (pull) whose handshake travels over kvbridge's side channel.

    Load it with ``--kv-transfer-config '{"kv_connector": "KVBridgeConnector",
    "kv_connector_module_path": "kvbridge.vllm", "kv_role": "kv_both",
    "kv_buffer_device": "cpu", "kv_connector_extra_config": {"handshake_method": "http"}}'``.
    """

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        """vLLM's answer (UCX only, in 0.33) where a wake-up republishes the metadata,
        which the plug-in then serves over every method; never otherwise. (vLLM 0.32 does
        not ask: ``refuse_unguarded`` refuses sleep mode there.)"""
        if not WAKE_UP_REPUBLISHES:
            return False
        return bool(super().supports_sleep_mode(kv_transfer_config))  # type: ignore[misc]

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig):
        settings = _settings(vllm_config)  # a bad setting fails here, in one line
        refuse_unguarded(vllm_config, kv_cache_config, wake_up_republishes=WAKE_UP_REPUBLISHES)
        # NixlPullConnector.__init__ would build the stock scheduler/worker (and a NIXL
        # agent): run the base's and build ours in their place.
        NixlBaseConnector.__init__(self, vllm_config, role, kv_cache_config)
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = KVBridgeScheduler(vllm_config, self.engine_id,
                                                         kv_cache_config, settings)
            self.connector_worker = None
        elif role == KVConnectorRole.WORKER:
            self.connector_scheduler = None
            self.connector_worker = KVBridgeWorker(vllm_config, self.engine_id,
                                                   kv_cache_config, settings)
        else:
            raise ConfigError(f"kvbridge.vllm: unsupported connector role {role}")
        if role == KVConnectorRole.SCHEDULER:
            log.info("kvbridge.vllm: %s", " ".join(settings.side_channel.describe()))
