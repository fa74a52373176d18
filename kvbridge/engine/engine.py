"""The engine: requests in, one ``step()`` at a time, outputs out. Not thread-safe by itself
(``AsyncEngine`` drives it from one thread); ``collective_rpc`` may be called from any thread.

A step: the scheduler picks a batch (and allocates blocks for requests waiting on
remote KV), the connector builds its worker metadata, every worker runs its
connector step and then the forward, rank 0 samples, the scheduler appends the
tokens, and the connector's ``update`` of all workers' outputs is applied.
"""

from __future__ import annotations

import random
import time
import uuid
from typing import Any

from kvbridge.config import DEFAULT_BLOCK_SIZE, DEFAULT_NUM_BLOCKS
from kvbridge.connector.base import NullConnector, NullWorkerConnector, SchedulerConnector
from kvbridge.engine.config import EngineConfig
from kvbridge.engine.model_runner import StepInput, WorkerConnectorFactory
from kvbridge.engine.sampling import SampleSpec, SamplingParams
from kvbridge.engine.scheduler import ScheduledBatch, Scheduler
from kvbridge.engine.sequence import RequestOutput, Sequence
from kvbridge.engine.workers import WorkerGroup
from kvbridge.errors import InvalidKVTransferParams
from kvbridge.kv_tags import TagChain
from kvbridge.model.attention import SeqChunk
from kvbridge.model.loader import load_config, load_tokenizer, resolve_dtype
from kvbridge.params import KVTransferParams


class LLMEngine:
    """A continuous-batching engine over ``config.tp_size`` TP workers.

    ``connector``: the scheduler side of KV transfer (default ``NullConnector``).
    ``worker_connector_factory``: called as ``factory(tp_rank, tp_size)`` in each
    worker to build its worker-side connector; must be picklable when workers
    are processes (a module-level function or class). Default ``NullWorkerConnector``.
    """

    def __init__(self, config: EngineConfig | None = None,
                 connector: SchedulerConnector | None = None,
                 worker_connector_factory: WorkerConnectorFactory | None = None):
        self.config = config = config or EngineConfig()
        resolve_dtype(config.dtype)
        self.model_config = load_config(config.model)
        self.model_config.check_tp(config.tp_size)
        self.tokenizer = load_tokenizer(config.model)
        cache_len = config.num_blocks * config.block_size
        self.max_model_len = min(config.max_model_len or self.model_config.max_position_embeddings,
                                 self.model_config.max_position_embeddings, cache_len)
        self.connector = connector if connector is not None else NullConnector()
        self.scheduler = Scheduler(config, self.connector, self.tokenizer.eos_token_ids,
                                   self.max_model_len)
        self._pending_outputs: list[RequestOutput] = []
        self.last_step_ran_model = False
        self.last_step_loaded = False  # a remote load completed: its request can run now
        self._seeds = random.Random()
        # Connectors whose blocks peers READ ask for block tags (see kvbridge.kv_tags).
        self._tags = bool(getattr(self.connector, "tags_blocks", False))
        self.workers = WorkerGroup(config, worker_connector_factory or _null_worker_connector)

    # -- requests ------------------------------------------------------------------------

    def check_request(self, prompt_token_ids: list[int], sampling: SamplingParams,
                      kv_transfer_params: KVTransferParams | None = None) -> None:
        """Raise ``ValueError`` if the request can never run (thread-safe, no side effects);
        ``InvalidKVTransferParams`` (a ``ValueError``) for params this prompt cannot use."""
        if kv_transfer_params is not None and kv_transfer_params.check().loads_remote_kv:
            kv_transfer_params.plan_load(len(prompt_token_ids), self.config.block_size)
        if not prompt_token_ids:
            raise ValueError("the prompt is empty")
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt_token_ids if not (isinstance(t, int) and 0 <= t < vocab)]
        if bad:
            raise ValueError(f"prompt token ids out of range [0, {vocab}): {bad[:5]}")
        sent = (kv_transfer_params.sent_token_ids or []) if kv_transfer_params else []
        if [t for t in sent if t >= vocab]:
            raise InvalidKVTransferParams(
                f"invalid kv_transfer_params.sent_token_ids: token ids out of range [0, {vocab})")
        if sent and len(sent) >= sampling.max_tokens:
            raise InvalidKVTransferParams(
                f"invalid kv_transfer_params.sent_token_ids: {len(sent)} tokens already sent "
                f"leave nothing to generate within max_tokens {sampling.max_tokens}")
        if len(prompt_token_ids) + sampling.max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt ({len(prompt_token_ids)} tokens) plus max_tokens "
                f"({sampling.max_tokens}) exceeds the maximum context length "
                f"{self.max_model_len}")

    def add_request(self, prompt_token_ids: list[int], sampling: SamplingParams | None = None,
                    request_id: str | None = None,
                    kv_transfer_params: KVTransferParams | None = None,
                    arrival_time: float | None = None) -> str:
        """Queue a request; returns its id. ``ValueError`` if invalid or the id is in use.

        ``arrival_time``: when the request arrived (time.monotonic()), default now.
        """
        sampling = sampling or SamplingParams()
        self.check_request(prompt_token_ids, sampling, kv_transfer_params)
        request_id = request_id or uuid.uuid4().hex
        if self.scheduler.is_known(request_id):
            raise ValueError(f"request id {request_id!r} is already in use")
        seed = sampling.seed if sampling.seed is not None else self._seeds.getrandbits(62)
        seq = Sequence(request_id, prompt_token_ids, sampling, seed, kv_transfer_params,
                       kv_transfer_params.sent_token_ids if kv_transfer_params else None)
        seq.times["arrived"] = time.monotonic() if arrival_time is None else arrival_time
        self.scheduler.add(seq)
        return request_id

    def abort_request(self, request_id: str) -> None:
        """Stop a request; its final output (reason "abort") comes with the next step."""
        out = self.scheduler.abort(request_id)
        if out is not None:
            self._pending_outputs.append(out)

    # -- stepping ------------------------------------------------------------------------

    def has_unfinished_requests(self) -> bool:
        return bool(self.scheduler.requests)

    def has_pending_work(self) -> bool:
        """Steps are needed: requests in flight, blocks held for the connector, or outputs."""
        return self.scheduler.has_pending() or bool(self._pending_outputs)

    def has_runnable_work(self) -> bool:
        """The next step would try to run the model (blocks permitting); otherwise it
        could only poll the connector."""
        return self.scheduler.has_runnable()

    def step(self) -> list[RequestOutput]:
        outputs, self._pending_outputs = self._pending_outputs, []
        batch = self.scheduler.schedule()
        self.last_step_ran_model = batch is not None
        meta = self.connector.build_worker_meta()
        step_input = self._step_input(batch) if batch is not None else None
        results = self.workers.call("execute_step", meta, step_input)
        if batch is not None:
            outputs += self.scheduler.postprocess(batch, results[0][1])
        update = self.connector.update([connector_output for connector_output, _ in results])
        self.last_step_loaded = bool(update.loaded)
        outputs += self.scheduler.apply_update(update)
        return outputs

    def _step_input(self, batch: ScheduledBatch) -> StepInput:
        chunks, samples, tags = [], [], []
        for seq in batch.seqs:
            start = seq.num_cached_tokens
            chunks.append(SeqChunk(seq.token_ids[start:], start, list(seq.block_table)))
            sp = seq.sampling
            samples.append(SampleSpec(sp.temperature, sp.top_p, seq.seed, seq.num_output_tokens))
            if self._tags:
                if seq.tag_chain is None:
                    seq.tag_chain = TagChain(self.config.block_size)
                tags += [(seq.block_table[b], t) for b, t in
                         seq.tag_chain.written(seq.token_ids, start, seq.num_tokens)]
        return StepInput(chunks, samples, tags)

    def generate(self, prompts: list[list[int]] | list[str],
                 sampling: SamplingParams | list[SamplingParams] | None = None) -> list[list[int]]:
        """Run prompts to completion together; their output token ids, in order.

        Raises ``RuntimeError`` if a request fails.
        """
        if not isinstance(sampling, list):
            sampling = [sampling or SamplingParams()] * len(prompts)
        ids = [self.add_request(self.tokenizer.encode(p) if isinstance(p, str) else p, sp)
               for p, sp in zip(prompts, sampling, strict=True)]
        tokens: dict[str, list[int]] = {i: [] for i in ids}
        done: set[str] = set()
        while len(done) < len(ids):
            for out in self.step():
                if out.request_id not in tokens:
                    continue
                if out.error is not None:
                    raise RuntimeError(f"request {out.request_id} failed: {out.error}")
                tokens[out.request_id] += out.new_token_ids
                if out.finished:
                    done.add(out.request_id)
        return [tokens[i] for i in ids]

    # -- workers -------------------------------------------------------------------------

    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        """Call ``method`` on every TP worker's ``ModelRunner``; one result per rank.

        E.g. ``collective_rpc("kv_handshake_metadata")``; dotted names reach into
        the runner (``"connector.<method>"`` calls the worker connector).
        """
        return self.workers.call(method, *args)

    @property
    def num_free_blocks(self) -> int:
        return self.scheduler.blocks.num_free_blocks

    @property
    def num_blocks(self) -> int:
        return self.config.num_blocks

    @property
    def worker_pids(self) -> list[int]:
        return self.workers.pids

    def shutdown(self) -> None:
        self.workers.shutdown()

    def __enter__(self) -> LLMEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _null_worker_connector(tp_rank: int, tp_size: int) -> NullWorkerConnector:
    return NullWorkerConnector()


def build_engine(model: str | None = None, tp_size: int = 1, dtype: str = "float32",
                 num_blocks: int = DEFAULT_NUM_BLOCKS, block_size: int = DEFAULT_BLOCK_SIZE,
                 connector: SchedulerConnector | None = None,
                 worker_connector_factory: WorkerConnectorFactory | None = None,
                 kv_load_failure_policy: str = "recompute", **config: Any) -> LLMEngine:
    """An engine from simple parameters; extra keywords go to ``EngineConfig``."""
    cfg = EngineConfig(model=model, tp_size=tp_size, dtype=dtype, num_blocks=num_blocks,
                       block_size=block_size, kv_load_failure_policy=kv_load_failure_policy,
                       **config)
    return LLMEngine(cfg, connector, worker_connector_factory)
