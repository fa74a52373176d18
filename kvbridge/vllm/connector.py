"""``KVBridgeConnector``: vLLM's NixlConnector (pull mode) with kvbridge's side channel,
every READ validated and every hold a capability.

vLLM keeps its NIXL agent and data path, block management, heterogeneous-TP rank
selection, compatibility-hash check, load-failure policy and ``vllm:nixl_*`` metrics. What
changes (every override is listed in docs/vllm.md §5 with its reason):

* scheduler (kvbridge/vllm/scheduler_side.py): kvbridge's side-channel server in place of vLLM's
  listener, its registration in etcd, the block tags each step writes, and a key per hold;
* worker (kvbridge/vllm/worker_side.py): the handshake through kvbridge's client followed by
  vLLM's own checks, the block tags kept and READ (kvbridge/vllm/validation.py), and
  hold keys on READ-done notes (kvbridge/vllm/holds.py);
* connector (here): ``__init__`` builds those two instead of the stock ones (one NIXL agent
  per worker, as stock); ``bind_connector_metadata`` and ``wait_for_save`` bracket the
  forward for the tags; the stats and ``/metrics`` add the READ results
  (kvbridge/vllm/stats.py).

``KVBridgePushConnector``: vLLM's NixlPushConnector with the same side channel for both of
its handshakes, registration notes parse-checked and holds keyed (kvbridge/vllm/push.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import (
    NixlBaseConnector,
    NixlPullConnector,
    NixlPushConnector,
)

from kvbridge.errors import ConfigError
from kvbridge.vllm.nixl_payload import (
    PAYLOAD_KIND,
    WAKE_UP_REPUBLISHES,
    describe_payload,
    log,
    plugin_settings,
)
from kvbridge.vllm.push import KVBridgePushScheduler, KVBridgePushWorker
from kvbridge.vllm.refusals import refuse_unguarded
from kvbridge.vllm.scheduler_side import KVBridgeScheduler
from kvbridge.vllm.stats import KVBridgePromMetrics, KVBridgeStats
from kvbridge.vllm.worker_side import KVBridgeWorker

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

__all__ = ["PAYLOAD_KIND", "WAKE_UP_REPUBLISHES", "KVBridgeConnector", "KVBridgePushConnector",
           "KVBridgeScheduler", "KVBridgeWorker", "describe_payload"]


class _KVBridgeSides:
    """What both connectors add to vLLM's (before it in the bases): kvbridge's scheduler
    and worker sides built in place of the stock ones, their stats and metrics, and the
    worker told of each step's metadata before the forward."""

    mode = "pull"
    scheduler_class: type = KVBridgeScheduler
    worker_class: type = KVBridgeWorker
    connector_scheduler: Any
    connector_worker: Any
    engine_id: str

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVBridgeStats:
        return KVBridgeStats(data=data) if data is not None else KVBridgeStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: Any,
                           labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]
                           ) -> KVBridgePromMetrics:
        return KVBridgePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        super().bind_connector_metadata(connector_metadata)  # type: ignore[misc]
        if isinstance(self.connector_worker, self.worker_class):
            self.connector_worker.kvbridge_before_forward(connector_metadata)

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig):
        settings = plugin_settings(vllm_config, mode=self.mode)  # a bad one fails here
        refuse_unguarded(vllm_config, kv_cache_config, wake_up_republishes=WAKE_UP_REPUBLISHES)
        # vLLM's connector __init__ would build the stock scheduler/worker (and a NIXL
        # agent): run the base's and build ours in their place. (Push: its refusal of
        # decode context parallelism is refuse_unguarded's too.)
        NixlBaseConnector.__init__(self, vllm_config, role, kv_cache_config)  # type: ignore[arg-type]
        self.connector_scheduler = self.connector_worker = None
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = self.scheduler_class(vllm_config, self.engine_id,
                                                            kv_cache_config, settings)
            log.info("kvbridge.vllm%s: %s", "" if self.mode == "pull" else f" ({self.mode})",
                     " ".join(settings.side_channel.describe()))
        elif role == KVConnectorRole.WORKER:
            self.connector_worker = self.worker_class(vllm_config, self.engine_id,
                                                      kv_cache_config, settings)
        else:
            raise ConfigError(f"kvbridge.vllm: unsupported connector role {role}")


class KVBridgeConnector(_KVBridgeSides, NixlPullConnector):
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

    def wait_for_save(self) -> None:
        super().wait_for_save()
        assert isinstance(self.connector_worker, KVBridgeWorker)
        self.connector_worker.kvbridge_after_forward(self._connector_metadata)


class KVBridgePushConnector(_KVBridgeSides, NixlPushConnector):
    """vLLM's NixlPushConnector (the prefill WRITEs into the blocks a decode registered) whose
    handshakes, the decode's to the prefill and the prefill's to the decode, travel over
    kvbridge's side channel. Load it with ``"kv_connector": "KVBridgePushConnector",
    "kv_connector_module_path": "kvbridge.vllm"``. No READ validation: no READ happens
    (docs/vllm.md §6c)."""

    mode = "push"
    scheduler_class = KVBridgePushScheduler
    worker_class = KVBridgePushWorker
