"""``SideChannelHandshake``: the worker side of kvbridge's side channel inside vLLM, for the
pull and the push connector alike.

vLLM interleaves its zmq REQ with its checks in one method, ``_nixl_handshake``: here it
fetches every target rank's payload through kvbridge's client for ``handshake_method``
within one deadline (``handshake_timeout``), then runs vLLM's own checks, in vLLM's order
and wording, with its helpers. vLLM's ``_ensure_handshake`` calls it on its background
executor: a pull decode to READ, a push decode to send a registration note (notif agents
only), a push prefill to WRITE into the decode that registered."""

from __future__ import annotations

import threading
from typing import Any

import msgspec
from vllm.platforms import current_platform

from kvbridge.handshake.base import FetchedPayloads, HandshakeClient, Rank
from kvbridge.handshake.factory import make_client
from kvbridge.vllm.nixl_payload import PAYLOAD_KIND, agent_decoder, log, payload_decoder
from kvbridge.vllm.settings import PluginSettings


class SideChannelHandshake:
    """Mixed into a subclass of vLLM's ``NixlBaseConnectorWorker`` (before it in the
    bases); ``_kvbridge_client_init`` runs after vLLM's ``__init__``."""

    # vLLM's, set by NixlBaseConnectorWorker.__init__
    _is_csa_linear: bool
    use_host_buffer: bool
    device_id: Any
    transfer_topo: Any
    compat_hash: str | None
    enforce_compat_hash: bool

    def _kvbridge_client_init(self, settings: PluginSettings) -> None:
        self.kvbridge_settings = settings
        # (host, port) -> the epoch of the instance last handshaken there ("" over zmq)
        self.kvbridge_epochs: dict[tuple[str, int], str] = {}
        self._kvbridge_client: HandshakeClient | None = None
        self._kvbridge_lock = threading.Lock()

    def _kvbridge_transport(self) -> HandshakeClient:
        with self._kvbridge_lock:
            if self._kvbridge_client is None:
                # As kvbridge serve's decode workers: token rotation (token_file), TLS,
                # max_message_bytes, trusted side channels, and connections to known
                # peers kept warm.
                self._kvbridge_client = make_client(self.kvbridge_settings.side_channel, None,
                                                    keep_warm=True, wire="vllm")
            return self._kvbridge_client

    def _kvbridge_fetch(self, host: str, port: int, ranks: list[Rank],
                        expected_engine_id: str) -> FetchedPayloads:
        return self._kvbridge_transport().fetch_payloads(
            PAYLOAD_KIND, host, port, ranks, expected_engine_id=expected_engine_id)

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
            self._validate_csa_linear_tp_layout(remote_tp_size)  # type: ignore[attr-defined]
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
        """vLLM's checks of ``_nixl_handshake`` (0.32 to 0.34 alike), unchanged in order
        and wording; kvbridge/tools/vllm/drift.py fails the suite when vLLM's change."""
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
        self._validate_remote_parallel_config(metadata)  # type: ignore[attr-defined]
        if metadata.engine_id != expected_engine_id:
            raise RuntimeError(
                f"Remote NIXL agent engine ID mismatch. "
                f"Expected {expected_engine_id},"
                f"received {metadata.engine_id}."
            )
        if notif_agents_only:
            return self._add_notif_only_remote_agent(  # type: ignore[attr-defined]
                metadata, remote_tp_size, metadata.dcp_size)
        agent = self.add_remote_agent(  # type: ignore[attr-defined]
            metadata, remote_rank, remote_tp_size, metadata.dcp_size)
        self._kvbridge_admitted(metadata.engine_id, remote_rank, agent,
                                handshake_payload.agent_metadata_bytes)
        return agent

    def _kvbridge_admitted(self, engine_id: str, remote_rank: int, agent: str,
                           agent_metadata_bytes: bytes) -> None:
        """A peer's agent was added (the pull worker reads its block tags from here on)."""

    def shutdown(self) -> None:
        super().shutdown()  # type: ignore[misc]
        client, self._kvbridge_client = self._kvbridge_client, None
        if client is not None and hasattr(client, "close"):
            client.close()
