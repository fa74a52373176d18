"""One vLLM instance without a model, run on the real code of whichever vLLM is imported.

Each node is a process of its own, forked by its release's zygote (``node.py --zygote
SOCKET``, which imports that vLLM once: tests/releases/conftest.py) with the release
first on ``PYTHONPATH``: it builds that release's real ``VllmConfig``, ``Scheduler`` and
``Request``s, the plug-in's connectors through vLLM's own factory and transfer state, KV caches as CPU
tensors (registered with real NIXL by the connector) and drives them with that release's
model-runner connector bracket (0.34's ``ActiveKVConnector``, the mixin before it). The only
stand-in is the forward: a step writes a known value per (token, position) into the blocks
the scheduler gave, so a decode can check the bytes it READ, and samples a token that is a
function of the sequence.

With ``tp=2`` the process is the engine core and the rank-0 worker, and runs the rank-1
worker in a child process (this file, ``--worker FD``): one gloo group of world size 2, a
plug-in worker connector and a KV cache of half of the KV heads per rank, each with the
release's bracket. The scheduler gathers both ranks' handshake metadata, every step's
``SchedulerOutput`` goes to both ranks, and their outputs are combined by vLLM's
``KVOutputAggregator``. The value written encodes the global KV head, so a decode rank
checks it has exactly its share of heads.

Commands are JSON lines on stdin, answers JSON lines on stdout (logs go to stderr):
``start``, ``add``, ``run``, ``note``, ``preempt``, ``state``, ``quit``; for a
republish (vLLM 0.33+): ``sleep``, ``wake``, ``sleep_mode``, ``payload_digests``,
``fetch_digests``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

NUM_KV_HEADS = 4  # not 2: the K/V axis of a cache tensor is told apart by its size
HEAD_SIZE = 64
LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")


def model_dir(root: Path) -> Path:
    """A model configuration without weights: vLLM reads config.json only (no tokenizer)."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
        "intermediate_size": 512, "num_hidden_layers": len(LAYERS), "num_attention_heads": 4,
        "num_key_value_heads": NUM_KV_HEADS, "head_dim": HEAD_SIZE, "vocab_size": 1000,
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2,
        "tie_word_embeddings": False}))
    return root


MAX_POSITION = 1024  # kv_value's positions, so that every value is below 2**24


def kv_value(token: int, position: int, layer: int, head: int = 0) -> float:
    """What the stand-in forward writes for one token in one KV head (numbered over the
    whole model, not the rank): distinct per (token, position, layer, head) and exact in
    float32 (tokens below 1000: at most 2**23)."""
    assert 0 <= position < MAX_POSITION and 0 <= head < NUM_KV_HEADS
    return float(((token * MAX_POSITION + position) * len(LAYERS) + layer) * NUM_KV_HEADS
                 + head)


def sample(tokens: list[int]) -> int:
    """The stand-in sampler: a function of the sequence so far, never the EOS (2)."""
    return 3 + (sum(tokens) * 31 + len(tokens)) % 990


class Node:
    def __init__(self) -> None:
        self.tokens: dict[str, list[int]] = {}  # every request's prompt and output so far
        self.events: dict[str, dict[str, Any]] = {}
        self.loaded: dict[str, dict[str, Any]] = {}
        self.stats: dict[str, Any] = {}  # the connector's stats, added up over the steps
        self.rank, self.tp = 0, 1
        self.rank_stats: dict[int, dict[str, Any]] = {}  # each rank's, before aggregation
        self.peer: _Peer | None = None  # tp=2: the rank-1 worker's process

    # -- set-up ------------------------------------------------------------------------

    def start(self, block_size: int, num_blocks: int, extra: dict[str, Any],
              model: str, model_len: int = 512, batch_tokens: int = 512, tp: int = 1,
              connector: str = "KVBridgeConnector") -> dict[str, Any]:
        """``model``: a directory for the model's config.json, one for every node of a
        test (its path is part of vLLM's compatibility hash). ``tp``: 1 or 2 ranks.
        ``connector``: the plug-in's class (``KVBridgePushConnector`` for push mode)."""
        import torch
        import vllm
        from vllm.config import (
            CacheConfig,
            DeviceConfig,
            KVTransferConfig,
            ModelConfig,
            ParallelConfig,
            SchedulerConfig,
            VllmConfig,
            set_current_vllm_config,
        )
        from vllm.v1.kv_cache_interface import FullAttentionSpec

        self.version = vllm.__version__
        _cpu_without_triton_cpu()
        self.block_size = block_size
        assert tp in (1, 2) and model_len <= MAX_POSITION, (tp, model_len)
        self.tp = tp
        ktc = KVTransferConfig(
            kv_connector=connector, kv_connector_module_path="kvbridge.vllm",
            kv_role="kv_both", kv_buffer_device="cpu", kv_connector_extra_config=extra)
        mc = ModelConfig(model=str(model_dir(Path(model))), dtype="float32",
                         skip_tokenizer_init=True, max_model_len=model_len)
        sc = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=batch_tokens,
                             max_model_len=model_len, is_encoder_decoder=False,
                             enable_chunked_prefill=True)
        cc = CacheConfig(block_size=block_size, enable_prefix_caching=False)
        self.config = VllmConfig(model_config=mc, cache_config=cc, scheduler_config=sc,
                                 kv_transfer_config=ktc, device_config=DeviceConfig("cpu"),
                                 parallel_config=ParallelConfig(tensor_parallel_size=tp))
        _logging(self.config)
        spec = FullAttentionSpec(block_size=block_size, num_kv_heads=NUM_KV_HEADS // tp,
                                 head_size=HEAD_SIZE, dtype=torch.float32)
        with set_current_vllm_config(self.config):
            _resolve_layout(self.config, spec)
            # The engine core's plan of the cache (num_blocks of them), then the model
            # runner's allocation of it, as views [block, head, slot, channel] per layer.
            self.config.cache_config.num_gpu_blocks_override = num_blocks
            self.kv_cache_config = _plan(self.config, {n: spec for n in LAYERS}, num_blocks)
            self.config.cache_config.num_gpu_blocks = self.kv_cache_config.num_blocks
            self._start_worker()
            self._start_scheduler(block_size)
        sched_conn = self.scheduler.get_kv_connector()
        inner = sched_conn.connector_scheduler
        return {"version": self.version, "engine_id": sched_conn.engine_id,
                "host": inner.side_channel_host, "port": inner.side_channel_port,
                "bracket": self.bracket_name, "tp": tp}

    def _start_worker(self, port: int | None = None) -> None:
        """``port``: the group's, given to rank 1 (rank 0 picks it and starts rank 1)."""
        import torch
        from vllm.distributed import (
            ensure_model_parallel_initialized,
            init_distributed_environment,
        )
        from vllm.distributed.kv_transfer import ensure_kv_transfer_initialized
        from vllm.distributed.kv_transfer.kv_transfer_state import get_kv_transfer_group

        if port is None:
            port = _free_port()
            if self.tp > 1:  # the rank-1 worker joins the group from its own process
                self.peer = _Peer(self.config, self.kv_cache_config, self.block_size, port)
        # As vLLM's CPU worker: its kernels (where they load), which decide whether the TP
        # group talks over vLLM's shared memory, and the name of that memory. Every rank
        # must take the same path.
        from vllm.platforms import current_platform

        current_platform.import_kernels()
        os.environ["VLLM_DIST_IDENT"] = str(port)
        init_distributed_environment(world_size=self.tp, rank=self.rank,
                                     local_rank=self.rank, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{port}")
        ensure_model_parallel_initialized(self.tp, 1)
        try:
            ensure_kv_transfer_initialized(self.config, self.kv_cache_config)
        except TypeError:  # a release whose state takes the config alone
            ensure_kv_transfer_initialized(self.config)
        self.worker = get_kv_transfer_group()
        from vllm.v1.worker.utils import allocate_kv_cache

        layout = self.config.cache_config.get_resolved_kv_cache_layout()
        self.kv = allocate_kv_cache(self.kv_cache_config, torch.device("cpu"), layout)
        self.views = list(self.kv.values())
        self.bracket = _Bracket(self.config, self.kv)
        self.bracket_name = self.bracket.name
        if self.peer is not None:
            self.peer.call("ready")

    def _start_scheduler(self, block_size: int) -> None:
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.structured_output import StructuredOutputManager

        self.scheduler = Scheduler(
            vllm_config=self.config, kv_cache_config=self.kv_cache_config,
            structured_output_manager=StructuredOutputManager(self.config),
            block_size=block_size, log_stats=True)
        # The engine core's hand-over: every worker's handshake metadata, by (pp, tp).
        conn = self.scheduler.get_kv_connector()
        content: dict[tuple[int, int], Any] = {}
        for worker_dict in self._handshake_metadata():
            content.update(worker_dict)
        if self.peer is not None:  # as the engine core, for the executor's outputs
            from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator

            self.aggregator = KVOutputAggregator.from_connector(conn, self.tp)
        if hasattr(conn, "set_xfer_handshake_metadata_pp_aware"):
            conn.set_xfer_handshake_metadata_pp_aware(content)
        else:
            conn.set_xfer_handshake_metadata(content)

    def _own_handshake_metadata(self) -> dict[tuple[int, int], Any]:
        """This worker's, keyed as vLLM's ``Worker.get_kv_connector_handshake_metadata``."""
        from vllm.distributed.parallel_state import get_pp_group, get_tp_group

        return {(get_pp_group().rank_in_group, get_tp_group().rank_in_group):
                self.worker.get_handshake_metadata()}

    def _handshake_metadata(self) -> list[dict[tuple[int, int], Any]]:
        """The executor's ``get_kv_connector_handshake_metadata``: one dict per worker."""
        out = [self._own_handshake_metadata()]
        if self.peer is not None:
            out.append(self.peer.call("meta"))
        return out

    # -- requests ----------------------------------------------------------------------

    def add(self, req_id: str, prompt: list[int], max_tokens: int,
            params: dict[str, Any] | None = None) -> dict[str, Any]:
        from vllm import SamplingParams
        from vllm.v1.request import Request

        sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        sp.extra_args = {"kv_transfer_params": params} if params is not None else None
        req = Request(request_id=req_id, prompt_token_ids=list(prompt), sampling_params=sp,
                      pooling_params=None)
        if params is not None and getattr(req, "kv_transfer_params", None) is None:
            req.kv_transfer_params = params
        self.tokens[req_id] = list(prompt)
        self.scheduler.add_request(req)
        return {"ok": True}

    def run(self, req_ids: list[str], timeout: float = 60.0,
            until: str = "finished") -> dict[str, Any]:
        """Step until every request in ``req_ids`` is finished (or, ``until="held"``, has
        finished computing with its KV held, ``until="sent"``, its hold released)."""
        deadline = time.monotonic() + timeout
        steps = 0
        while not all(self._reached(r, until) for r in req_ids):
            if time.monotonic() > deadline:
                return {"timeout": True, "steps": steps, "events": self.events,
                        "loaded": self.loaded}
            self.step()
            steps += 1
            if not self._busy():
                time.sleep(0.005)  # waiting on a peer: NIXL progresses on its own thread
        return {"timeout": False, "steps": steps, "events": self.events,
                "loaded": self.loaded}

    def _reached(self, req_id: str, until: str) -> bool:
        ev = self.events.get(req_id, {})
        return {"finished": "finished" in ev, "sent": ev.get("sent", False),
                "held": "finished" in ev}[until]

    def _busy(self) -> bool:
        return bool(self.scheduler.running or self.scheduler.waiting)

    def step(self) -> None:
        so = self.scheduler.schedule()
        scheduled = self._scheduled(so)
        if self.peer is not None:  # before this rank's bracket binds the metadata
            self.peer.send("step", so, scheduled,
                           {r: self.tokens[r] for r, _, _, _ in scheduled})
        kv_out = self.bracket.run(so, lambda: self._forward(so, scheduled))
        out = self._model_runner_output(scheduled, kv_out)
        self._add_rank_stats(0, kv_out)
        if self.peer is not None:
            out = self._aggregate(out, *self.peer.answer())
            kv_out = out.kv_connector_output
        engine_outputs = self.scheduler.update_from_output(so, out)
        for eco in engine_outputs.values():
            for o in eco.outputs:
                ev = self.events.setdefault(o.request_id, {})
                if o.new_token_ids:
                    ev.setdefault("output", []).extend(o.new_token_ids)
                if o.finish_reason is not None:
                    ev["finished"] = str(o.finish_reason)
                    ev["kv_transfer_params"] = o.kv_transfer_params
        if kv_out is not None:
            for r in kv_out.finished_sending or ():
                self.events.setdefault(r, {})["sent"] = True
            if kv_out.kv_connector_stats is not None:
                self._add_stats(kv_out.kv_connector_stats.data)

    def _add_stats(self, data: dict[str, Any], into: dict[str, Any] | None = None) -> None:
        stats = self.stats if into is None else into
        for key, value in data.items():
            if isinstance(value, (int, float)):
                stats[key] = stats.get(key, 0) + value
            elif value and all(isinstance(v, str) for v in value):  # labels: counted
                counts = stats.setdefault(key, {})
                for v in value:
                    counts[v] = counts.get(v, 0) + 1
            elif value:
                stats[key + "_count"] = stats.get(key + "_count", 0) + len(value)

    def _add_rank_stats(self, rank: int, kv_out: Any) -> None:
        """One rank's stats, counted before the aggregator merges them in place."""
        if kv_out is not None and kv_out.kv_connector_stats is not None:
            self._add_stats(kv_out.kv_connector_stats.data,
                            self.rank_stats.setdefault(rank, {}))

    def _aggregate(self, out: Any, peer_out: Any, peer_loaded: dict[str, Any]) -> Any:
        """The executor's side: rank 1's output joins rank 0's through vLLM's aggregator
        (a request is done sending or receiving once every rank says so)."""
        self._add_rank_stats(1, peer_out.kv_connector_output)
        for req_id, checked in peer_loaded.items():
            mine = self.loaded[req_id]
            mine["wrong"] += checked["wrong"]
            mine["ranks"].update(checked["ranks"])
        return self.aggregator.aggregate([out, peer_out], 0)

    def wait_stat(self, key: str, label: str, at_least: int, timeout: float = 30.0
                  ) -> dict[str, Any]:
        """Step until the stats count ``at_least`` of ``key{label}`` (a note arrives on
        NIXL's own time)."""
        deadline = time.monotonic() + timeout
        while self.stats.get(key, {}).get(label, 0) < at_least:
            if time.monotonic() > deadline:
                return {"timeout": True, "stats": self.stats}
            self.step()
            time.sleep(0.002)
        return {"timeout": False, "stats": self.stats}

    def steps(self, n: int) -> dict[str, Any]:
        for _ in range(n):
            self.step()
        return {"events": self.events}

    def _scheduled(self, so: Any) -> list[tuple[str, int, int, list[int]]]:
        """(request, first position, count, block ids) of everything this step computes."""
        out = []
        blocks_of = self.scheduler.kv_cache_manager.get_block_ids
        for new in so.scheduled_new_reqs:
            out.append((new.req_id, new.num_computed_tokens,
                        so.num_scheduled_tokens[new.req_id], list(blocks_of(new.req_id)[0])))
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            out.append((req_id, cached.num_computed_tokens[i], so.num_scheduled_tokens[req_id],
                        list(blocks_of(req_id)[0])))
        return out

    def _forward(self, so: Any, scheduled: list[tuple[str, int, int, list[int]]]) -> None:
        bs = self.block_size
        for req_id, start, n, blocks in scheduled:
            toks = self.tokens[req_id]
            if start > 0 and req_id not in self.loaded and req_id in _new_ids(so):
                self.loaded[req_id] = self._check_loaded(req_id, start, blocks)
            for pos in range(start, start + n):
                b, s = blocks[pos // bs], pos % bs
                for layer, view in enumerate(self.views):
                    view[b, :, s, :] = self._head_values(toks[pos], pos, layer)

    def _heads(self) -> list[int]:
        """The global KV heads this rank holds, in the order of its cache's head axis."""
        per_rank = NUM_KV_HEADS // self.tp
        return list(range(self.rank * per_rank, (self.rank + 1) * per_rank))

    def _head_values(self, token: int, pos: int, layer: int) -> Any:
        """This rank's heads' values for one token, shaped [head, 1] against [H, C]."""
        import torch

        return torch.tensor([[kv_value(token, pos, layer, h)] for h in self._heads()])

    def _check_loaded(self, req_id: str, n: int, blocks: list[int]) -> dict[str, Any]:
        """Before its first forward after a READ: do its blocks hold the prompt's KV, in
        every head of this rank's share (``ranks``: each rank's own count)?"""
        bs, toks = self.block_size, self.tokens[req_id]
        wrong = 0
        for pos in range(n):
            b, s = blocks[pos // bs], pos % bs
            for layer, view in enumerate(self.views):
                if not bool((view[b, :, s, :] == self._head_values(toks[pos], pos, layer)
                             ).all()):
                    wrong += 1
        return {"tokens": n, "wrong": wrong,
                "ranks": {str(self.rank): {"tokens": n, "wrong": wrong,
                                           "heads": self._heads()}}}

    def _model_runner_output(self, scheduled: list[tuple[str, int, int, list[int]]],
                             kv_out: Any) -> Any:
        from vllm.v1.outputs import ModelRunnerOutput

        req_ids, sampled = [], []
        for req_id, start, n, _ in scheduled:
            req_ids.append(req_id)
            toks = self.tokens[req_id]
            req = self.scheduler.requests[req_id]
            if start + n >= req.num_prompt_tokens and start + n >= len(toks):
                tok = sample(toks[:start + n])
                toks.append(tok)
                sampled.append([tok])
            else:
                sampled.append([])  # a chunk of a prompt: nothing sampled
        names = {f.name for f in dataclasses.fields(ModelRunnerOutput)}
        kwargs: dict[str, Any] = {"req_ids": req_ids, "sampled_token_ids": sampled,
                                  "kv_connector_output": kv_out}
        if "req_id_to_index" in names:
            kwargs["req_id_to_index"] = {r: i for i, r in enumerate(req_ids)}
        if "pooler_output" in names:
            kwargs["pooler_output"] = []
        return ModelRunnerOutput(**kwargs)

    # -- sleep mode and a republish (vLLM 0.33+) ----------------------------------------

    def sleep_mode(self) -> dict[str, Any]:
        """Sleep mode asked of this release and of the plug-in: whether vLLM's pull
        connector has the republish (``supports_sleep_mode``, ``restore_kv_caches``), what
        vLLM's own config check says of the plug-in, and whether the plug-in's connector
        builds, all with ``enable_sleep_mode`` set on this node's config."""
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import (
            NixlPullConnector,
        )

        out: dict[str, Any] = {
            "supports_sleep_mode": hasattr(NixlPullConnector, "supports_sleep_mode"),
            "restore_kv_caches": hasattr(NixlPullConnector, "restore_kv_caches")}
        mc = self.config.model_config
        mc.enable_sleep_mode = True  # not at construction: vLLM's CPU platform refuses it
        try:
            try:
                self.config._verify_kv_transfer_compat()
                out["vllm_check"] = "accepted"
            except ValueError as e:
                out["vllm_check"] = str(e)
            try:
                conn = KVConnectorFactory.create_connector(
                    self.config, KVConnectorRole.SCHEDULER, self.kv_cache_config)
            except Exception as e:  # noqa: BLE001 - the answer is the refusal
                out["plugin"] = f"{type(e).__name__}: {e}"
            else:
                conn.shutdown()
                out["plugin"] = "built"
        finally:
            mc.enable_sleep_mode = False
        return out

    def sleep(self, timeout: float = 30.0) -> dict[str, Any]:
        """vLLM's sleep (level 1) as far as the KV cache goes, on every rank. The engine
        core pauses first and lets the requests in flight finish (a held one: until its
        READ is done)."""
        deadline = time.monotonic() + timeout
        while self.scheduler.requests:
            if time.monotonic() > deadline:
                raise RuntimeError(f"requests in flight: {sorted(self.scheduler.requests)}")
            self.step()
            if not self._busy():
                time.sleep(0.005)  # waiting on a peer's note
        self.rank_sleep()
        if self.peer is not None:
            self.peer.call("sleep")
        return {"ok": True}

    def rank_sleep(self) -> None:
        """The GPU worker's ``sleep``: the connector unregisters the KV cache, then the
        allocator releases its memory, whose content is gone. CPU memory under live
        tensors cannot be unmapped: the content is zeroed instead."""
        self.worker.unregister_kv_caches()
        for view in self.views:
            view.zero_()

    def wake(self, new_registration: bool = False) -> dict[str, Any]:
        """vLLM's wake-up of the KV cache: every rank's connector registers it again (the
        GPU worker's ``wake_up``), then the engine core hands every worker's new metadata
        to the scheduler's connector (``EngineCore.wake_up`` with the ``kv_cache`` tag
        calls ``_set_kv_connector_handshake_metadata``; run here on this node's scheduler
        and an executor of its ranks). ``new_registration``: see ``rank_wake``."""
        from types import SimpleNamespace

        from vllm.v1.engine.core import EngineCore

        self.rank_wake(new_registration)
        if self.peer is not None:
            self.peer.call("wake", new_registration)
        executor = SimpleNamespace(get_kv_connector_handshake_metadata=self._handshake_metadata)
        EngineCore._set_kv_connector_handshake_metadata(
            SimpleNamespace(scheduler=self.scheduler, model_executor=executor))
        return {"ok": True}

    def rank_wake(self, new_registration: bool) -> None:
        """The GPU worker's ``wake_up``: the connector registers the KV cache again. On a
        GPU the cache is back on new physical pages, so NIXL's keys and the agent's
        metadata change; host memory registered again gives byte-identical metadata (the
        same memory at the same address, the same keys). ``new_registration`` stands in for
        the GPU's change: one more page registered with this worker's NIXL agent before
        vLLM's restore reads the agent's metadata (the KV regions are unchanged)."""
        if new_registration:
            import torch

            w = self.worker.connector_worker
            agent = getattr(w.nixl_wrapper, "_agent", w.nixl_wrapper)  # without hold keys
            page = torch.zeros(4096, dtype=torch.int8)
            agent.register_memory(agent.get_reg_descs([(page.data_ptr(), page.numel(), 0, "")],
                                                      "DRAM"), backends=w.nixl_backends)
            self.pages = [*getattr(self, "pages", []), page]  # registered: kept alive
        self.worker.restore_kv_caches()

    def payload_digests(self) -> dict[str, str]:
        """The SHA-256 of each rank's handshake payload as vLLM encodes it now."""
        import hashlib

        import msgspec

        encoder = msgspec.msgpack.Encoder()
        return {f"{pp},{tp}": hashlib.sha256(encoder.encode(meta)).hexdigest()
                for worker in self._handshake_metadata() for (pp, tp), meta in worker.items()}

    def fetch_digests(self, host: str, port: int, engine_id: str, ranks: list[list[int]]
                      ) -> dict[str, str]:
        """What a peer's side channel serves, fetched as this node's decode fetches it
        (its worker's own transport): the SHA-256 of each rank's payload."""
        import hashlib

        fetched = self.worker.connector_worker._kvbridge_fetch(
            host, port, [(pp, tp) for pp, tp in ranks], engine_id)
        return {f"{pp},{tp}": hashlib.sha256(data).hexdigest()
                for (pp, tp), data in fetched.payloads.items()}

    # -- the rank-1 worker's side of tp=2 ------------------------------------------------

    def rank_ready(self) -> None:
        """Its worker started (the connector, the KV cache and its registration)."""

    def rank_meta(self) -> dict[tuple[int, int], Any]:
        return self._own_handshake_metadata()

    def rank_step(self, so: Any, scheduled: list[tuple[str, int, int, list[int]]],
                  tokens: dict[str, list[int]]) -> tuple[Any, dict[str, Any]]:
        """One step's bracket and forward; what a worker returns to the executor (its
        connector's output only: rank 0's carries the sampled tokens) and what READ
        blocks held before the forward."""
        from vllm.v1.outputs import ModelRunnerOutput

        self.tokens.update(tokens)
        checked = set(self.loaded)
        kv_out = self.bracket.run(so, lambda: self._forward(so, scheduled))
        return (ModelRunnerOutput.with_kv_conn_output_only(kv_out),
                {r: v for r, v in self.loaded.items() if r not in checked})

    def rank_quit(self) -> None:
        self.worker.shutdown()

    # -- faults ------------------------------------------------------------------------

    def note(self, peer_engine: str, message: str) -> dict[str, Any]:
        """Send ``message`` as a NIXL note from this node's agent to an agent of
        ``peer_engine`` it handshook with (a forged or malformed note)."""
        w = self.worker.connector_worker
        agents = w._remote_agents.get(peer_engine, {})
        if not agents:
            return {"ok": False, "why": f"no agent of {peer_engine}"}
        name = next(iter(agents.values()))
        agent = getattr(w.nixl_wrapper, "_agent", w.nixl_wrapper)  # without hold keys
        agent.send_notif(name, message.encode("latin-1"))
        return {"ok": True}

    def preempt(self, req_id: str) -> dict[str, Any]:
        """Preempt a running request as vLLM does when it runs out of blocks."""
        req = self.scheduler.requests[req_id]
        self.scheduler.running.remove(req)
        self.scheduler._preempt_request(req, time.monotonic())
        return {"ok": True}

    def state(self) -> dict[str, Any]:
        return {"stats": self.stats, "rank_stats": self.rank_stats,
                "free_blocks": self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks(),
                "requests": sorted(self.scheduler.requests)}

    def quit(self) -> None:
        if self.peer is not None:
            self.peer.close()
        self.worker.shutdown()
        conn = self.scheduler.get_kv_connector()
        if conn is not None:
            conn.shutdown()


class _Peer:
    """The rank-1 worker's process, spoken to with pickles over a socket, as vLLM's
    executor speaks to its workers: forked by the zygote when the node came from one
    (its log is the node's), else this file run with ``--worker FD``."""

    def __init__(self, config: Any, kv_cache_config: Any, block_size: int, port: int):
        import socket
        import subprocess
        from multiprocessing.connection import Connection

        self.proc: subprocess.Popen[bytes] | None = None
        if zygote := os.environ.get("KVBRIDGE_NODE_ZYGOTE"):
            mine = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            mine.connect(zygote)
            mine.sendall((json.dumps({"worker": True, "log": os.environ["KVBRIDGE_NODE_LOG"],
                                      "cwd": os.getcwd()}) + "\n").encode())
            with mine.makefile("r") as f:  # its first line; nothing follows before the config
                self.pid = int(json.loads(f.readline())["pid"])
        else:
            mine, theirs = socket.socketpair()
            # Its output goes to this node's log (fd 1 here carries the answers).
            self.proc = subprocess.Popen(
                [sys.executable, __file__, "--worker", str(theirs.fileno())],
                pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, stdout=sys.__stderr__,
                stderr=sys.__stderr__)
            theirs.close()
            self.pid = self.proc.pid
        self.conn = Connection(mine.detach())
        self.conn.send((config, kv_cache_config, block_size, port))

    def send(self, op: str, *args: Any) -> None:
        self.conn.send((op, *args))

    def answer(self) -> Any:
        try:
            status, value = self.conn.recv()
        except EOFError:
            raise RuntimeError(f"the rank-1 worker (pid {self.pid}) died") from None
        if status == "error":
            raise RuntimeError(f"the rank-1 worker: {value}")
        return value

    def call(self, op: str, *args: Any) -> Any:
        self.send(op, *args)
        return self.answer()

    def close(self) -> None:
        import subprocess

        try:
            self.call("quit")
        except (OSError, RuntimeError):
            pass
        self.conn.close()
        if self.proc is None:  # the zygote's child: the kernel reaps it
            return
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def worker_main(fd: int) -> None:
    """The rank-1 worker of a tp=2 node: its worker set up from rank 0's config and KV
    cache plan, then ``rank_*`` calls until ``quit`` or rank 0 is gone."""
    from multiprocessing.connection import Connection

    conn = Connection(fd)
    config, kv_cache_config, block_size, port = conn.recv()
    from vllm.config import set_current_vllm_config

    _cpu_without_triton_cpu()
    _logging(config)
    node = Node()
    node.rank, node.tp = 1, config.parallel_config.tensor_parallel_size
    node.config, node.kv_cache_config, node.block_size = config, kv_cache_config, block_size
    with set_current_vllm_config(config):
        node._start_worker(port)
    while True:
        try:
            op, *args = conn.recv()
        except EOFError:
            break
        try:
            conn.send(("ok", getattr(node, "rank_" + op)(*args)))
        except Exception:  # noqa: BLE001 - rank 0 raises it
            conn.send(("error", traceback.format_exc()))
        if op == "quit":
            break
    os._exit(0)


class _Bracket:
    """The release's own model-runner code around the forward: 0.34's CPU
    ``ActiveKVConnector`` (it also registers the caches), else the model-runner mixin."""

    def __init__(self, config: Any, kv: dict[str, Any]) -> None:
        try:
            from vllm.v1.worker.cpu.kv_connector import get_kv_connector
        except ImportError:
            get_kv_connector = None
        if get_kv_connector is not None:
            self.name = "ActiveKVConnector"
            self._active = get_kv_connector(config, kv)  # registers the caches
            return
        from vllm.distributed.kv_transfer.kv_connector.utils import copy_kv_blocks
        from vllm.distributed.kv_transfer.kv_transfer_state import get_kv_transfer_group

        self.name = "KVConnectorModelRunnerMixin"
        self._active = None
        self.config = config
        group = get_kv_transfer_group()
        group.register_kv_caches(kv)  # as the model runner's initialize_kv_cache
        group.set_host_xfer_buffer_ops(copy_kv_blocks)

    def run(self, so: Any, forward: Any) -> Any:
        if self._active is not None:
            self._active.pre_forward(so)
            forward()
            self._active.finish_forward()
            return self._active.post_forward(so.finished_req_ids)
        from vllm.forward_context import set_forward_context
        from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin

        with set_forward_context(None, self.config), \
                KVConnectorModelRunnerMixin._get_kv_connector_output(so) as out:
            forward()
        return out


def _resolve_layout(config: Any, spec: Any) -> None:
    """The engine core's resolution of the KV cache layout, from what the worker's
    attention backends support."""
    from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends
    from vllm.v1.attention.backends.utils import (
        get_supported_kv_cache_layouts,
        record_kv_cache_layout,
        resolve_kv_cache_layout,
    )

    backends = get_current_attn_backends(config)
    supported = [layout.name for layout in get_supported_kv_cache_layouts(backends)]
    layout = resolve_kv_cache_layout(config, [supported], [spec])
    record_kv_cache_layout(config.cache_config, layout.name)


def _new_ids(so: Any) -> set[str]:
    return {n.req_id for n in so.scheduled_new_reqs}


def _plan(config: Any, specs: dict[str, Any], num_blocks: int) -> Any:
    """The engine core's KVCacheConfig for ``specs`` (its module moved in 0.33, which
    also plans the model's groups first)."""
    import importlib
    import inspect

    try:
        planning = importlib.import_module("vllm.v1.core.kv_cache_planning")
    except ImportError:
        planning = importlib.import_module("vllm.v1.core.kv_cache_utils")
    page = next(iter(specs.values())).page_size_bytes
    args: list[Any] = [config, [specs], [page * len(specs) * num_blocks]]
    if "global_kv_cache_groups" in inspect.signature(planning.get_kv_cache_configs).parameters:
        args.append(planning.get_global_kv_cache_groups(config, [specs]))
    return planning.get_kv_cache_configs(*args)[0]


def _logging(config: Any) -> None:
    """vLLM's logging, as its engine core and worker processes configure it (the
    plug-in's lines too: handshakes, republishes) into this node's log."""
    from vllm.logger import configure_logging

    configure_logging(config.logging_config)


def _cpu_without_triton_cpu() -> None:
    """vLLM 0.34 refuses x86 CPUs without Triton's CPU backend (``triton-cpu``), which no
    package index here has. No kernel runs in this process, so the check is answered
    yes: the one stand-in of the tier, for a check about kernels it never uses."""
    try:
        import vllm.triton_utils as tu
    except ImportError:
        return
    tu.HAS_TRITON = True


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    node = Node()
    out = sys.stdout
    sys.stdout = sys.stderr  # vLLM's prints never mix with the answers
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd.pop("op")
        try:
            if op == "quit":
                node.quit()
                answer: Any = {"ok": True}
            else:
                answer = getattr(node, op)(**cmd)
        except Exception as e:  # noqa: BLE001 - the test reads the error, the node lives on
            traceback.print_exc()
            answer = {"error": f"{type(e).__name__}: {e}"}
        out.write(json.dumps(answer, default=str) + "\n")
        out.flush()
        if op == "quit":
            break
    os._exit(0)


# What a node imports, loaded once by the zygote so that each node forked from it starts
# without importing vLLM again (a few seconds of CPU per node, dozens of nodes per run).
# A module a release does not have is skipped.
PRELOAD = (
    "torch", "msgspec", "vllm", "vllm.config", "vllm.logger", "vllm.platforms",
    "vllm.v1.kv_cache_interface", "vllm.v1.request", "vllm.v1.outputs",
    "vllm.v1.core.sched.scheduler", "vllm.v1.structured_output", "vllm.v1.engine.core",
    "vllm.v1.worker.utils", "vllm.v1.worker.cpu.kv_connector",
    "vllm.v1.worker.kv_connector_model_runner_mixin", "vllm.v1.attention.backends.utils",
    "vllm.forward_context", "vllm.distributed", "vllm.distributed.parallel_state",
    "vllm.distributed.kv_transfer.kv_transfer_state",
    "vllm.distributed.kv_transfer.kv_connector.factory",
    "vllm.distributed.kv_transfer.kv_connector.utils",
    "vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector",
    "kvbridge.vllm.connector", "kvbridge.vllm.push",
)


def zygote_main(path: str) -> None:
    """``--zygote PATH``: import what a node imports, then fork one node per connection to
    the Unix socket ``PATH``. The connection carries the node's commands and answers (its
    first line is ``{"pid": ...}``); the first line received names the node's log file and
    working directory. Ends when its stdin closes. Why fork is safe here: nothing before
    the fork starts a thread (checked), and every agent, socket and group is made after it."""
    import importlib
    import select
    import signal
    import socket

    answers = sys.stdout
    sys.stdout = sys.stderr  # as in main(): vLLM's log handler must never hold fd 1
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    _cpu_without_triton_cpu()
    _inspect_the_model_once()
    threads = os.listdir("/proc/self/task")
    if len(threads) != 1:
        raise SystemExit(f"zygote: {len(threads)} threads after the imports; fork is unsafe")
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps the nodes
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(64)
    answers.write("ready\n")
    answers.flush()
    while True:
        ready, _, _ = select.select([server, sys.stdin], [], [])
        if sys.stdin in ready and not sys.stdin.readline():
            break
        if server not in ready:
            continue
        conn, _ = server.accept()
        with conn.makefile("r") as f:
            spec = json.loads(f.readline())
        sys.stderr.flush()
        if os.fork() == 0:
            server.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            os.environ.update(KVBRIDGE_NODE_ZYGOTE=path, KVBRIDGE_NODE_LOG=spec["log"])
            _become_node(conn, spec["log"], spec["cwd"], spec.get("worker", False))
        conn.close()
    os._exit(0)


def _inspect_the_model_once() -> None:
    """vLLM inspects a model's class in a subprocess (a whole vLLM import) unless its cache
    (``VLLM_CACHE_ROOT``'s ``modelinfos``) has it: on a fresh machine every node started
    together would pay it. Done once here, before any fork, the nodes find it cached."""
    import tempfile

    from vllm.config import ModelConfig

    with tempfile.TemporaryDirectory() as d:
        ModelConfig(model=str(model_dir(Path(d))), dtype="float32", skip_tokenizer_init=True,
                    max_model_len=512)


def _become_node(conn: Any, log: str, cwd: str, worker: bool) -> None:
    """In a forked child: the log as stderr, the pid sent back, then either the node's
    command loop with the connection as stdin and stdout, or (``worker``) a rank-1 worker
    speaking pickles over the connection, its output appended to its node's log."""
    os.setsid()  # a node killed by a test takes no sibling with it
    # Appending, both: a node and its worker write the same log.
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND | (0 if worker else os.O_TRUNC),
                 0o644)
    os.dup2(fd, 2)
    os.close(fd)
    os.chdir(cwd)
    conn.sendall((json.dumps({"pid": os.getpid()}) + "\n").encode())
    try:
        if worker:
            os.dup2(2, 1)
            worker_main(conn.detach())
        os.dup2(conn.fileno(), 0)
        os.dup2(conn.fileno(), 1)
        conn.close()
        # sys.stderr (and vLLM's log handler) write to fd 2, now the log.
        sys.stdin = open(0, closefd=False)  # noqa: SIM115 - the process's own
        sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115
        main()
    finally:
        os._exit(1)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        worker_main(int(sys.argv[2]))
    elif sys.argv[1:2] == ["--zygote"]:
        zygote_main(sys.argv[2])
    else:
        main()
