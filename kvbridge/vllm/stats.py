"""The plug-in's counters in vLLM's own ``/metrics``: vLLM's NIXL stats plus the result of
every validated READ (``vllm:kvbridge_kv_reads{result=...}``, kvbridge.vllm.validation).

Workers record into the stats object vLLM ships to the API process with each step's
output; vLLM rebuilds it there with the connector's ``build_kv_connector_stats`` and feeds
it to ``build_prom_metrics``'s object.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats import (
    NixlKVConnectorStats,
    NixlPromMetrics,
)

from kvbridge.vllm.validation import RESULTS

READS = "kvbridge_kv_reads"  # the stats key: one result name per READ
TAG_READ_SECONDS = "kvbridge_tag_read_seconds"  # each tag READ's time (NIXL telemetry)
NOTES_IGNORED = "kvbridge_notes_ignored"  # a prefill's notes without the hold's key: why
KEYS = (READS, TAG_READ_SECONDS, NOTES_IGNORED)


class KVBridgeStats(NixlKVConnectorStats):
    """vLLM's NIXL stats and the READ results."""

    def reset(self) -> None:
        super().reset()
        for key in KEYS:
            self.data[key] = []

    def record_read(self, result: str) -> None:
        self.data.setdefault(READS, []).append(result)  # type: ignore[arg-type]

    def record_note_ignored(self, why: str) -> None:
        self.data.setdefault(NOTES_IGNORED, []).append(why)  # type: ignore[arg-type]

    def record_tag_read_seconds(self, seconds: float) -> None:
        self.data.setdefault(TAG_READ_SECONDS, []).append(seconds)

    def is_empty(self) -> bool:
        return super().is_empty() and not any(self.data.get(key) for key in KEYS)

    def aggregate(self, other: Any) -> Any:
        for stats in (self, other):
            if isinstance(stats, NixlKVConnectorStats):
                for key in KEYS:
                    stats.data.setdefault(key, [])
        return super().aggregate(other)


class KVBridgePromMetrics(NixlPromMetrics):
    """vLLM's NIXL metrics and ``vllm:kvbridge_kv_reads{result}``."""

    def __init__(self, vllm_config: Any, metric_types: Any, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.kvbridge_reads = self._counter_cls(
            name="vllm:kvbridge_kv_reads",
            documentation="KV READs of a decode by result: validated (the block tags "
            "matched the prompt), stale (they did not: the load failed and took "
            "kv_load_failure_policy), tag_read_failed, block_size_mismatch (a peer of another "
            "block size: refused, a failed load), unvalidated (a peer without tags).",
            labelnames=[*labelnames, "result"])
        for values in per_engine_labelvalues.values():  # every result shows, even at 0
            for result in RESULTS:
                self.kvbridge_reads.labels(*values, result)
        self.kvbridge_notes_ignored = self._counter_cls(
            name="vllm:kvbridge_notes_ignored",
            documentation="READ-done notes a prefill did not pass to vLLM because they lack "
            "the hold's key (kvbridge.vllm.holds): no_key, bad_key; or that vLLM could not "
            "parse: malformed.",
            labelnames=[*labelnames, "why"])
        self.kvbridge_tag_read_seconds = self._histogram_cls(
            name="vllm:kvbridge_tag_read_seconds",
            documentation="Time of each validating tag READ (NIXL telemetry), to set "
            "against vllm:nixl_xfer_time_seconds of the data READs.",
            buckets=[1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1],
            labelnames=labelnames)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        super().observe(transfer_stats_data, engine_idx)
        values = self.per_engine_labelvalues[engine_idx]
        for result in transfer_stats_data.get(READS, ()):
            self.kvbridge_reads.labels(*values, result).inc()
        for why in transfer_stats_data.get(NOTES_IGNORED, ()):
            self.kvbridge_notes_ignored.labels(*values, why).inc()
        for seconds in transfer_stats_data.get(TAG_READ_SECONDS, ()):
            self.kvbridge_tag_read_seconds.labels(*values).observe(seconds)
