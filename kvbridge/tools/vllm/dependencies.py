"""What of vLLM the plug-in depends on: the members it overrides, bypasses or mirrors
(``MEMBERS``) and the fields of vLLM's data it reads (``FIELDS``), each with why. The drift
guard (kvbridge/tools/vllm/drift.py) fingerprints and looks them up in a vLLM's source."""

from __future__ import annotations

from dataclasses import dataclass

NIXL = "distributed/kv_transfer/kv_connector/v1/nixl/"
NAME = "NixlConnector"
# Files that only register or export the name (no check keyed on it).
NAME_EXPORTS = (NIXL, "distributed/kv_transfer/kv_connector/factory.py")


@dataclass(frozen=True)
class Member:
    path: str  # under vllm/
    qualname: str  # Class.member, or a class
    kind: str  # "source" or "signature"
    why: str  # what the plug-in does with it
    prefix: str = ""  # tells apart members of the same qualname in two files

    @property
    def key(self) -> str:
        return self.prefix + self.qualname  # unique among MEMBERS


def _m(path: str, qualname: str, why: str, kind: str = "source", prefix: str = "") -> Member:
    return Member(path, qualname, kind, why, prefix)


@dataclass(frozen=True)
class Fields:
    """Fields of one vLLM class the plug-in (or kvbridge's release tier) reads."""

    path: str
    cls: str
    names: tuple[str, ...]
    why: str


MEMBERS: tuple[Member, ...] = (
    _m(NIXL + "connector.py", "NixlPullConnector.__init__",
       "bypassed: KVBridgeConnector.__init__ builds its scheduler and worker instead"),
    _m(NIXL + "connector.py", "NixlBaseConnector.__init__",
       "run by KVBridgeConnector.__init__ in place of NixlPullConnector's"),
    _m(NIXL + "connector.py", "NixlBaseConnector.set_xfer_handshake_metadata_pp_aware",
       "the engine's way to the scheduler's set_xfer_handshake_metadata"),
    _m(NIXL + "connector.py", "NixlPullConnector.supports_sleep_mode",
       "KVBridgeConnector.supports_sleep_mode answers with it (absent: no republish)"),
    _m(NIXL + "base_scheduler.py", "NixlBaseConnectorScheduler.__init__",
       "side_channel_host/port and the listener thread the plug-in relies on"),
    _m(NIXL + "base_scheduler.py", "NixlBaseConnectorScheduler.set_xfer_handshake_metadata",
       "overridden: wraps it, republishes, encodes payloads as it does"),
    _m(NIXL + "base_scheduler.py", "NixlBaseConnectorScheduler._nixl_handshake_listener",
       "overridden: kvbridge's side-channel server; what encoded_data holds"),
    _m(NIXL + "base_scheduler.py", "NixlBaseConnectorScheduler.shutdown",
       "its stop event stops the plug-in's server"),
    _m(NIXL + "pull_scheduler.py", "NixlPullConnectorScheduler.request_finished",
       "advertises side_channel_host/port (the plug-in's bound port) to decodes"),
    _m(NIXL + "base_worker.py", "NixlBaseConnectorWorker._nixl_handshake",
       "overridden: KVBridgeWorker._nixl_handshake/_kvbridge_admit copy its checks"),
    _m(NIXL + "base_worker.py", "NixlBaseConnectorWorker._ensure_handshake",
       "calls _nixl_handshake (arguments the override takes)"),
    _m(NIXL + "base_worker.py", "NixlBaseConnectorWorker._validate_remote_parallel_config",
       "called by _kvbridge_admit", "signature"),
    _m(NIXL + "base_worker.py", "NixlBaseConnectorWorker._validate_csa_linear_tp_layout",
       "called by KVBridgeWorker._nixl_handshake", "signature"),
    _m(NIXL + "base_worker.py", "NixlBaseConnectorWorker.add_remote_agent",
       "called by _kvbridge_admit", "signature"),
    _m(NIXL + "base_worker.py", "NixlBaseConnectorWorker._add_notif_only_remote_agent",
       "called by _kvbridge_admit", "signature"),
    _m(NIXL + "base_worker.py", "NixlBaseConnectorWorker.shutdown",
       "overridden: KVBridgeWorker.shutdown calls it, then closes its client", "signature"),
    _m(NIXL + "pull_worker.py", "NixlPullConnectorWorker.__init__",
       "KVBridgeWorker.__init__ calls it", "signature"),
    _m("distributed/kv_transfer/kv_connector/utils.py", "TransferTopology.handshake_target_ranks",
       "called by KVBridgeWorker._nixl_handshake", "signature"),
    # READ validation (kvbridge/vllm/validation.py): where the plug-in hooks vLLM's data path.
    _m(NIXL + "pull_scheduler.py", "NixlPullConnectorScheduler.update_state_after_alloc",
       "wrapped: the prompt of a request whose KV is read, kept for its expected tags"),
    _m(NIXL + "base_scheduler.py", "NixlBaseConnectorScheduler.build_connector_meta",
       "wrapped: the step's block tags and reqs_to_recv's prompts are added to its metadata"),
    _m(NIXL + "base_worker.py", "NixlBaseConnectorWorker.register_kv_caches",
       "wrapped: tags registered before it takes the agent metadata; its payload re-encoded"),
    _m(NIXL + "pull_worker.py", "NixlPullConnectorWorker.start_load_kv",
       "wrapped: tags cleared, and the logical block ids read before it remaps them"),
    _m(NIXL + "base_worker.py", "NixlBaseConnectorWorker._pop_done_transfers",
       "wrapped: a finished data READ is held back while its tags are READ"),
    _m(NIXL + "base_worker.py", "NixlBaseConnectorWorker.get_transfer_results",
       "a request returned failed becomes a load error (kv_load_failure_policy)"),
    _m(NIXL + "base_worker.py", "NixlBaseConnectorWorker.restore_kv_caches",
       "wrapped (0.33): the tag fields its re-encoded payload drops are added again"),
    _m("v1/worker/kv_connector_model_runner_mixin.py",
       "KVConnectorModelRunnerMixin._get_kv_connector_output",
       "its order: bind_connector_metadata before the forward (tags cleared), wait_for_save "
       "after it (tags set), start_load_kv maybe after it"),
    _m(NIXL + "connector.py", "NixlBaseConnector.wait_for_save",
       "wrapped: the tags of what the forward wrote are set after it"),
    # Hold keys (kvbridge/vllm/holds.py): the note formats the key is added to and checked in.
    _m(NIXL + "pull_worker.py", "NixlPullConnectorWorker._get_new_notifs",
       "its parse of '<request id>:<consumers>' and 'HB:' notes, fed only keyed notes"),
    _m(NIXL + "pull_worker.py", "NixlPullConnectorWorker._read_blocks",
       "builds the READ-done note '<request id>:<consumers>' the key is appended to"),
    _m(NIXL + "base_worker.py", "NixlBaseConnectorWorker._send_heartbeats",
       "its 'HB:' notes, which pass without a key"),
    _m(NIXL + "stats.py", "NixlKVConnectorStats",
       "subclassed: KVBridgeStats adds the READ results to vLLM's stats"),
    _m(NIXL + "stats.py", "NixlPromMetrics.observe",
       "KVBridgePromMetrics.observe calls it, then counts the READ results", "signature"),
    _m(NIXL + "metadata.py", "NixlHandshakePayload",
       "decoded by the plug-in (_kvbridge_admit, describe_payload, registration)"),
    _m(NIXL + "metadata.py", "NixlAgentMetadata",
       "decoded by _kvbridge_admit; describe_payload reads its fields"),
    # The model runner's connector bracket from 0.34 on (the mixin above before it): the
    # order bind_connector_metadata, forward, start_load_kv, wait_for_save the tags rely on.
    _m("v1/worker/cpu/kv_connector.py", "ActiveKVConnector.pre_forward",
       "binds the metadata before the forward (tags cleared)", prefix="cpu."),
    _m("v1/worker/cpu/kv_connector.py", "ActiveKVConnector.post_forward",
       "wait_for_save after the forward (tags set), then the transfer results", prefix="cpu."),
    _m("v1/worker/gpu/kv_connector.py", "ActiveKVConnector.pre_forward",
       "binds the metadata before the forward (tags cleared)", prefix="gpu."),
    _m("v1/worker/gpu/kv_connector.py", "ActiveKVConnector.post_forward",
       "the transfer results after the forward", prefix="gpu."),
    _m("v1/worker/gpu/kv_connector.py", "ActiveKVConnector.finalize_step",
       "wait_for_save once the step's forwards are done (tags set)", prefix="gpu."),
    # Push mode (kvbridge/vllm/push.py): KVBridgePushConnector and its scheduler and worker.
    _m(NIXL + "connector.py", "NixlPushConnector.__init__",
       "bypassed: KVBridgePushConnector.__init__ builds its scheduler and worker instead"),
    _m(NIXL + "push_scheduler.py", "NixlPushConnectorScheduler.__init__",
       "KVBridgePushScheduler.__init__ calls it", "signature"),
    _m(NIXL + "push_scheduler.py", "NixlPushConnectorScheduler.update_state_after_alloc",
       "wrapped: the hold's key is added to the registration it stages "
       "(_push_pending_registrations), which advertises side_channel_host/port"),
    _m(NIXL + "push_scheduler.py", "NixlPushConnectorScheduler.request_finished",
       "wrapped: a held request's params carry its key; advertises the plug-in's port"),
    _m(NIXL + "push_scheduler.py", "NixlPushConnectorScheduler.build_connector_meta",
       "wrapped: the step's new keys and the keys of reqs_to_recv are added to its metadata"),
    _m(NIXL + "push_worker.py", "NixlPushConnectorWorker.__init__",
       "KVBridgePushWorker.__init__ calls it", "signature"),
    _m(NIXL + "push_worker.py", "NixlPushConnectorWorker.start_load_kv",
       "wrapped: a decode's keys set before it queues the registration"),
    _m(NIXL + "push_worker.py", "NixlPushConnectorWorker._push_writer_loop",
       "its routing of the notes get_new_notifs returns (PUSH_REG to _handle_push_reg_notif), "
       "fed only notes that parse"),
    _m(NIXL + "push_worker.py", "NixlPushConnectorWorker._handle_push_reg_notif",
       "overridden: KVBridgePushWorker's matches a registration only with the request's key"),
    _m(NIXL + "push_worker.py", "NixlPushConnectorWorker._pop_matching_finished_blocks",
       "bypassed by _handle_push_reg_notif; its lookup is copied in push._candidates"),
    _m(NIXL + "push_worker.py", "NixlPushConnectorWorker._pop_matching_registration",
       "overridden: the same lookup, matching only a registration with the request's key"),
    _m(NIXL + "push_worker.py", "NixlPushConnectorWorker._do_start_push_kv",
       "wrapped: reads the registration's fields (pushreg checks them); the WRITE-done "
       "note's key"),
    _m(NIXL + "push_worker.py", "NixlPushConnectorWorker._send_registration_to_p",
       "its handshake (notif agents only) goes through the plug-in's _nixl_handshake"),
    _m(NIXL + "push_worker.py", "NixlPushConnectorWorker._do_send_reg_notif",
       "the registration note's format (PUSH_REG_NOTIF_PREFIX + msgpack) pushreg checks"),
    _m(NIXL + "push_worker.py", "NixlPushConnectorWorker._xfer_blocks",
       "builds the WRITE-done note '<request id>:<writers>' the key is appended to"),
    _m(NIXL + "push_worker.py", "NixlPushConnectorWorker._get_new_notifs",
       "its parse of WRITE-done and 'HB:' notes, fed only notes that parse"),
    _m(NIXL + "push_worker.py", "NixlPushConnectorWorker.get_transfer_results",
       "wrapped: the keys of finished transfers are dropped"),
    _m(NIXL + "utils.py", "get_base_request_id",
       "the request-id match push._candidates copies"),
    # How vLLM finds the class: its branches on connector names (transfer_mode is read
    # only for NixlConnector; the plug-in refuses it for push).
    _m("distributed/kv_transfer/kv_connector/factory.py",
       "KVConnectorFactory.get_connector_class",
       "loads KVBridgeConnector and KVBridgePushConnector by module path; its branches on "
       "names pass them by"),
)

SCHED_OUTPUT = "v1/core/sched/output.py"
FIELDS: tuple[Fields, ...] = (
    Fields(SCHED_OUTPUT, "SchedulerOutput",
           ("scheduled_new_reqs", "scheduled_cached_reqs", "num_scheduled_tokens",
            "finished_req_ids", "kv_connector_metadata"),
           "TagWriter.step and build_connector_meta follow every scheduled request"),
    Fields(SCHED_OUTPUT, "NewRequestData",
           ("req_id", "prompt_token_ids", "block_ids", "num_computed_tokens"),
           "TagWriter.step: a new (or, 0.34, resumed) request's prompt and blocks"),
    Fields(SCHED_OUTPUT, "CachedRequestData",
           ("req_ids", "resumed_req_ids", "new_block_ids", "num_computed_tokens"),
           "TagWriter.step: a running request's new blocks (resumed_req_ids: read if there)"),
    Fields("v1/request.py", "Request",
           ("request_id", "prompt_token_ids", "kv_transfer_params"),
           "KVBridgeScheduler: keys and prompts of requests held or read"),
    Fields(NIXL + "metadata.py", "NixlConnectorMetadata",
           ("reqs_to_recv", "reqs_not_processed"),
           "the worker: READs to validate and key, aborted holds to forget"),
    Fields(NIXL + "metadata.py", "ReqMeta", ("local_block_ids", "remote"),
           "ReadValidator.expect: the READ's local blocks"),
    Fields(NIXL + "metadata.py", "RemoteMeta",
           ("block_ids", "engine_id", "num_tokens", "request_id"),
           "ReadValidator.expect and the READ-done note's key"),
    Fields("distributed/kv_transfer/kv_connector/v1/base.py", "KVConnectorTransferResults",
           ("finished_sending", "finished_recving"),
           "KVBridgeWorker.get_transfer_results drops the keys of finished transfers"),
)
