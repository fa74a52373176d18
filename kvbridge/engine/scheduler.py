"""Continuous batching: which sequences run in the next step, and what happens after it.

Each step is either a prefill of newly admitted sequences (several at once,
within ``max_num_batched_tokens``) or a decode of every running sequence.
Prefill goes first whenever a waiting sequence fits; when decode runs out of
blocks the newest running sequence is preempted (blocks freed, recomputed later).

Remote KV (the connector hooks, see ``kvbridge.connector.base``): a request the
connector claims waits in ``remote`` until blocks for its whole prompt are
allocated and a connector ``update`` reports it loaded; then it joins the
waiting queue with its loaded prefix counted as cached. A finished request's
blocks are freed, or held for the connector until an ``update`` releases them.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass

import msgspec

from kvbridge.connector.base import ConnectorUpdate, SchedulerConnector
from kvbridge.engine.block_manager import BlockManager
from kvbridge.engine.config import EngineConfig
from kvbridge.engine.sequence import RequestOutput, RequestStatus, Sequence
from kvbridge.errors import LoadFailure

logger = logging.getLogger(__name__)


@dataclass
class ScheduledBatch:
    seqs: list[Sequence]
    is_prefill: bool


class Scheduler:
    def __init__(self, config: EngineConfig, connector: SchedulerConnector,
                 eos_token_ids: frozenset[int], max_model_len: int):
        self.blocks = BlockManager(config.num_blocks, config.block_size)
        self.connector = connector
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.failure_policy = config.kv_load_failure_policy
        self.waiting: deque[Sequence] = deque()
        self.remote: list[Sequence] = []
        self.running: deque[Sequence] = deque()
        self.held: dict[str, list[int]] = {}  # finished request id -> blocks the connector holds
        self.requests: dict[str, Sequence] = {}  # every unfinished request
        self.num_preemptions = 0

    # -- queries -------------------------------------------------------------------------

    def has_runnable(self) -> bool:
        """A step would run the model (unless blocks are short)."""
        return bool(self.waiting or self.running)

    def has_pending(self) -> bool:
        """Steps are still needed: requests in flight or blocks held for the connector."""
        return bool(self.requests or self.held) or self.connector.has_pending()

    def is_known(self, request_id: str) -> bool:
        return request_id in self.requests or request_id in self.held

    # -- request lifecycle ---------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        self.requests[seq.request_id] = seq
        n = self.connector.num_remote_tokens(seq.request_id, seq.prompt_token_ids,
                                             seq.kv_transfer_params)
        if n > 0:
            seq.num_remote_tokens = min(n, seq.num_prompt_tokens)
            seq.status = RequestStatus.WAITING_FOR_REMOTE_KV
            self.remote.append(seq)
        else:
            self.waiting.append(seq)

    def abort(self, request_id: str) -> RequestOutput | None:
        seq = self.requests.get(request_id)
        if seq is None:
            return None
        if seq.status == RequestStatus.WAITING_FOR_REMOTE_KV and seq.block_table:
            # A transfer may still be writing into its blocks: finish it once loaded.
            seq.aborted = True
            return None
        for queue in (self.waiting, self.running, self.remote):
            if seq in queue:
                queue.remove(seq)
        return self._finish(seq, "abort")

    # -- scheduling ----------------------------------------------------------------------

    def schedule(self) -> ScheduledBatch | None:
        self._allocate_remote()
        batch = self._schedule_prefill()
        return batch if batch is not None else self._schedule_decode()

    def _allocate_remote(self) -> None:
        """Give requests that wait for remote KV their blocks, oldest first."""
        for seq in self.remote:
            if seq.block_table:
                continue
            need = self.blocks.blocks_for(seq.num_prompt_tokens)
            if not self.blocks.can_allocate(need):
                break
            seq.block_table = self.blocks.allocate(need)
            seq.times["load_started"] = time.monotonic()
            self.connector.on_blocks_allocated(seq.request_id, list(seq.block_table))

    def _schedule_prefill(self) -> ScheduledBatch | None:
        scheduled: list[Sequence] = []
        num_tokens = 0
        while self.waiting and len(self.running) + len(scheduled) < self.max_num_seqs:
            seq = self.waiting[0]
            new_tokens = seq.num_tokens - seq.num_cached_tokens
            if scheduled and num_tokens + new_tokens > self.max_num_batched_tokens:
                break
            need = self.blocks.blocks_for(seq.num_tokens) - len(seq.block_table)
            if not self.blocks.can_allocate(need):
                break
            self.waiting.popleft()
            seq.block_table += self.blocks.allocate(need)
            seq.status = RequestStatus.RUNNING
            seq.times.setdefault("scheduled", time.monotonic())
            if seq.prefix_cached_tokens is None:
                seq.prefix_cached_tokens = seq.num_cached_tokens
            scheduled.append(seq)
            num_tokens += new_tokens
        return ScheduledBatch(scheduled, is_prefill=True) if scheduled else None

    def _schedule_decode(self) -> ScheduledBatch | None:
        scheduled: list[Sequence] = []
        while self.running and len(scheduled) < self.max_num_seqs:
            seq = self.running.popleft()
            # The token fed this step is written at position num_tokens - 1.
            need = self.blocks.blocks_for(seq.num_tokens) - len(seq.block_table)
            while need and not self.blocks.can_allocate(need):
                if self.running:
                    self._preempt(self.running.pop())
                else:
                    self._preempt(seq)
                    break
            else:
                seq.block_table += self.blocks.allocate(need)
                scheduled.append(seq)
        self.running.extendleft(reversed(scheduled))
        return ScheduledBatch(scheduled, is_prefill=False) if scheduled else None

    def _preempt(self, seq: Sequence) -> None:
        logger.debug("preempting %s", seq)
        self.num_preemptions += 1
        self.blocks.free(seq.block_table)
        seq.block_table = []
        seq.num_cached_tokens = 0
        seq.status = RequestStatus.WAITING
        self.waiting.appendleft(seq)

    # -- after a step --------------------------------------------------------------------

    def postprocess(self, batch: ScheduledBatch, tokens: list[int]) -> list[RequestOutput]:
        outputs = []
        for seq, token in zip(batch.seqs, tokens, strict=True):
            if batch.is_prefill:
                self.running.append(seq)
            seq.num_cached_tokens = seq.num_tokens
            seq.token_ids.append(token)
            reason = None
            if token in self.eos_token_ids and not seq.sampling.ignore_eos:
                reason = "stop"
            elif (seq.num_output_tokens >= seq.sampling.max_tokens
                  or seq.num_tokens >= self.max_model_len):
                reason = "length"
            if reason is None:
                out = self._output(seq, [token])
            else:
                self.running.remove(seq)
                out = self._finish(seq, reason, new_token_ids=[token])
            if seq.num_output_tokens == seq.num_sent_tokens + 1:
                out.times = {**seq.times, "first_token": time.monotonic()}
            outputs.append(out)
        return outputs

    def apply_update(self, update: ConnectorUpdate) -> list[RequestOutput]:
        outputs = []
        for request_id, error in update.loaded.items():
            seq = self.requests.get(request_id)
            if (seq is None or seq.status != RequestStatus.WAITING_FOR_REMOTE_KV
                    or not seq.block_table):
                logger.warning("connector reported %r loaded, but it is not waiting for KV",
                               request_id)
                continue
            self.remote.remove(seq)
            seq.times["kv_loaded"] = time.monotonic()
            if seq.aborted:
                outputs.append(self._finish(seq, "abort"))
                continue
            if error is None:
                # The last token is always computed: its logits pick the next token (the
                # last prompt token, or the last token the prefill sent).
                seq.num_cached_tokens = min(seq.num_remote_tokens, seq.num_tokens - 1)
            elif self.failure_policy == "recompute" and not error.request_fault:
                logger.warning("KV load of %s failed (%s): recomputing the prompt",
                               request_id, error.message)
                seq.num_cached_tokens = 0
            else:
                outputs.append(self._finish(seq, "error", error=error))
                continue
            seq.status = RequestStatus.WAITING
            # First in line: it already holds its blocks, so it rarely has to wait.
            self.waiting.appendleft(seq)
        for request_id in update.released:
            blocks = self.held.pop(request_id, None)
            if blocks is not None:
                self.blocks.free(blocks)
        return outputs

    def _finish(self, seq: Sequence, reason: str, error: LoadFailure | None = None,
                new_token_ids: list[int] | None = None) -> RequestOutput:
        seq.status = RequestStatus.FINISHED
        del self.requests[seq.request_id]
        hold, params = self.connector.on_finished(seq.request_id, list(seq.block_table),
                                                  seq.kv_transfer_params, seq.num_cached_tokens)
        if hold and params is not None and seq.output_token_ids:  # a prefill's answer
            params = msgspec.structs.replace(params,
                                             remote_output_token_ids=seq.output_token_ids[:64])
        if hold and seq.block_table:
            self.held[seq.request_id] = seq.block_table
        else:
            self.blocks.free(seq.block_table)
        seq.block_table = []
        out = self._output(seq, new_token_ids or [])
        out.finished, out.finish_reason, out.error = True, reason, error
        out.kv_transfer_params = params
        return out

    @staticmethod
    def _output(seq: Sequence, new_token_ids: list[int]) -> RequestOutput:
        return RequestOutput(seq.request_id, new_token_ids, seq.num_prompt_tokens,
                             seq.num_output_tokens,
                             num_cached_tokens=seq.prefix_cached_tokens or 0)
