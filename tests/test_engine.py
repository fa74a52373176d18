"""The engine: continuous batching, preemption, sampling, connector hooks, TP workers."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kvbridge.connector.base import ConnectorUpdate
from kvbridge.engine import (
    EngineConfig,
    LLMEngine,
    RequestOutput,
    SamplingParams,
    WorkerError,
    build_engine,
)
from kvbridge.errors import FailureKind, LoadFailure
from kvbridge.params import KVTransferParams
from tests.helpers import wait_until

ROOT = Path(__file__).resolve().parent.parent

PROMPTS = [
    "Hello", "The quick brown fox", "a", "Lorem ipsum dolor sit amet, consectetur adipiscing",
    "0123456789", "¿Qué tal?", "short", "a somewhat longer prompt that spans several KV blocks "
    "of sixteen tokens each, to exercise paging", "zz", "The end",
]


# -- test connectors: real, small implementations of kvbridge.connector.base --------------

HOLD = KVTransferParams(do_remote_decode=True)


def copy_from(src_blocks: list[int], num_tokens: int, fail: bool = False) -> KVTransferParams:
    """Params of a request whose prompt KV is copied from held ``src_blocks``."""
    return KVTransferParams(do_remote_prefill=True, remote_block_ids=src_blocks,
                            remote_num_tokens=num_tokens, remote_host="local", remote_port=1,
                            remote_engine_id="fail" if fail else "local")


class LocalCopyConnector:
    """Scheduler side of a "transfer" inside one engine: the KV of a request whose blocks
    were held (``HOLD``) is copied into a later request's blocks (``copy_from``); a
    ``fail`` one makes the load fail."""

    def __init__(self) -> None:
        self.to_start: list[tuple[str, list[int], list[int], bool]] = []
        self.expected: dict[str, int] = {}  # request id -> how many workers must report it
        self.reported: dict[str, list[str | None]] = {}
        self.held: set[str] = set()
        self.to_release: set[str] = set()
        self.params: dict[str, dict[str, Any]] = {}
        self.finished: list[str] = []
        self.events: list[tuple[str, str]] = []
        self.refused: list = []
        self.num_steps = 0

    def num_remote_tokens(self, request_id, prompt_ids, kv_transfer_params) -> int:
        if not kv_transfer_params or not kv_transfer_params.loads_remote_kv:
            return 0
        self.params[request_id] = kv_transfer_params
        return kv_transfer_params.remote_num_tokens

    def on_blocks_allocated(self, request_id, block_ids) -> None:
        p = self.params[request_id]
        self.events.append(("allocated", request_id))
        src = p.remote_block_ids
        self.to_start.append((request_id, src, block_ids[:len(src)],
                              p.remote_engine_id == "fail"))

    def build_worker_meta(self) -> list[tuple[str, list[int], list[int], bool]]:
        meta, self.to_start = self.to_start, []
        return meta

    def has_pending(self) -> bool:
        return False

    def on_refused(self, kv_transfer_params) -> None:
        self.refused.append(kv_transfer_params)

    def update(self, worker_outputs) -> ConnectorUpdate:
        self.num_steps += 1
        loaded = {}
        for out in worker_outputs:
            for request_id, error in out or []:
                self.reported.setdefault(request_id, []).append(error)
        for request_id, errors in list(self.reported.items()):
            if len(errors) == len(worker_outputs):  # every rank is done
                del self.reported[request_id]
                loaded[request_id] = next((e for e in errors if e), None)
        released, self.to_release = self.to_release & self.held, set()
        self.held -= released
        return ConnectorUpdate(loaded=loaded, released=released)

    def on_finished(self, request_id, block_ids, kv_transfer_params, num_computed_tokens):
        self.finished.append(request_id)
        self.events.append(("finished", request_id))
        if kv_transfer_params and kv_transfer_params.do_remote_decode:
            self.held.add(request_id)
            return True, copy_from(block_ids, num_computed_tokens)
        return False, None

    def release(self, request_id: str) -> None:
        self.to_release.add(request_id)


class LocalCopyWorkerConnector:
    """Worker side: copies this rank's KV blocks; picklable (built in each worker)."""

    def __init__(self, tp_rank: int, tp_size: int):
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.kv: torch.Tensor | None = None

    def register_kv_cache(self, kv_cache: torch.Tensor) -> None:
        self.kv = kv_cache

    def handshake_metadata(self) -> bytes:
        return f"rank {self.tp_rank}/{self.tp_size} kv {list(self.kv.shape)}".encode()

    def step(self, meta) -> list[tuple[str, str | None]] | None:
        done = []
        for request_id, src, dst, fail in meta or []:
            if fail:
                done.append((request_id, LoadFailure(FailureKind.TRANSFER,
                                                     f"rank {self.tp_rank}: injected failure")))
                continue
            self.kv[:, :, torch.tensor(dst)] = self.kv[:, :, torch.tensor(src)]
            done.append((request_id, None))
        return done or None


# -- helpers ------------------------------------------------------------------------------

def run_all(engine: LLMEngine) -> dict[str, list[RequestOutput]]:
    """Step until no request is in flight; every output, by request."""
    outs: dict[str, list[RequestOutput]] = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
    return outs


def tokens(outs: list[RequestOutput]) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def engine() -> Iterator[LLMEngine]:
    with LLMEngine(EngineConfig(num_blocks=128)) as e:
        yield e


@pytest.fixture(scope="module")
def reference(engine) -> dict[str, list[int]]:
    """Each prompt run alone, greedy."""
    return {p: engine.generate([p], GREEDY)[0] for p in PROMPTS}


# -- batching ------------------------------------------------------------------------------

def test_concurrent_requests_match_one_at_a_time(engine, reference):
    start = engine.num_free_blocks
    sampling = [SamplingParams(max_tokens=12 - i % 3 * 4, ignore_eos=True)
                for i in range(len(PROMPTS))]
    got = engine.generate(PROMPTS, sampling)
    assert got == [reference[p][:s.max_tokens] for p, s in zip(PROMPTS, sampling, strict=True)]
    assert engine.num_free_blocks == start


def test_requests_arriving_mid_generation_join_the_batch(engine, reference):
    start = engine.num_free_blocks
    ids = {}
    outs: dict[str, list[RequestOutput]] = {}
    for i, p in enumerate(PROMPTS):  # a new request every other step
        ids[engine.add_request(engine.tokenizer.encode(p), GREEDY)] = p
        for _ in range(i % 2 + 1):
            for o in engine.step():
                outs.setdefault(o.request_id, []).append(o)
    for rid, rest in run_all(engine).items():
        outs.setdefault(rid, []).extend(rest)
    assert {ids[r]: tokens(o) for r, o in outs.items()} == reference
    assert all(o[-1].finished and o[-1].finish_reason == "length" for o in outs.values())
    assert engine.num_free_blocks == start


def test_preemption_when_blocks_run_out_keeps_outputs_exact(reference):
    # 10 blocks of 4 tokens cannot hold every sequence at once: some get preempted.
    with LLMEngine(EngineConfig(num_blocks=10, block_size=4)) as small:
        short = [p for p in PROMPTS if len(p) <= 20]
        got = small.generate(short, GREEDY)
        assert got == [reference[p] for p in short]
        assert small.scheduler.num_preemptions > 0
        assert small.num_free_blocks == 10


def test_seeded_sampling_ignores_batch_composition(engine):
    hot = SamplingParams(max_tokens=16, temperature=1.0, seed=1234, ignore_eos=True)
    alone = engine.generate([PROMPTS[1]], hot)[0]
    batched = engine.generate(PROMPTS, [hot if i == 1 else GREEDY
                                        for i in range(len(PROMPTS))])[1]
    assert batched == alone
    other_seed = SamplingParams(max_tokens=16, temperature=1.0, seed=99, ignore_eos=True)
    assert engine.generate([PROMPTS[1]], other_seed)[0] != alone
    assert alone != engine.generate([PROMPTS[1]], GREEDY)[0][:16]


def test_stops_at_eos_unless_ignored():
    # Find a prompt whose greedy continuation hits EOS, on a model seed where one exists.
    with LLMEngine(EngineConfig(num_blocks=128)) as e:
        eos = e.tokenizer.eos_token_id
        long_run = e.generate(PROMPTS, SamplingParams(max_tokens=200, ignore_eos=True))
        hit = [(p, out.index(eos)) for p, out in zip(PROMPTS, long_run, strict=True) if eos in out]
        assert hit, "no prompt reaches EOS within 200 tokens: pick another prompt set"
        prompt, at = hit[0]
        rid = e.add_request(e.tokenizer.encode(prompt), SamplingParams(max_tokens=200))
        outs = run_all(e)[rid]
        assert tokens(outs) == long_run[PROMPTS.index(prompt)][:at + 1]
        assert outs[-1].finish_reason == "stop"


def test_abort_frees_blocks(engine):
    start = engine.num_free_blocks
    a = engine.add_request(engine.tokenizer.encode(PROMPTS[3]), GREEDY)
    b = engine.add_request(engine.tokenizer.encode(PROMPTS[4]), GREEDY)
    engine.step()
    engine.abort_request(a)
    engine.abort_request(b)
    outs = engine.step()
    assert {(o.request_id, o.finish_reason) for o in outs} == {(a, "abort"), (b, "abort")}
    assert not engine.has_unfinished_requests()
    assert engine.num_free_blocks == start


def test_invalid_requests_are_rejected(engine):
    with pytest.raises(ValueError, match="context length"):
        engine.add_request([1] * 10, SamplingParams(max_tokens=engine.max_model_len))
    with pytest.raises(ValueError, match="out of range"):
        engine.add_request([1, 258], GREEDY)
    with pytest.raises(ValueError, match="empty"):
        engine.add_request([], GREEDY)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    rid = engine.add_request([1, 2, 3], GREEDY, request_id="dup")
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request([1, 2, 3], GREEDY, request_id="dup")
    engine.abort_request(rid)
    engine.step()


# -- connector hooks -----------------------------------------------------------------------

@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def copy_engine(request) -> Iterator[tuple[LLMEngine, LocalCopyConnector]]:
    conn = LocalCopyConnector()
    with build_engine(tp_size=request.param, num_blocks=64, connector=conn,
                      worker_connector_factory=LocalCopyWorkerConnector) as e:
        yield e, conn


def _failing(ids: list[int]) -> KVTransferParams:
    return copy_from(list(range(-(-len(ids) // 16))), len(ids), fail=True)


def _held_prefill(engine: LLMEngine, prompt: str) -> tuple[str, RequestOutput]:
    """A one-token "prefill" whose blocks the connector holds."""
    rid = engine.add_request(engine.tokenizer.encode(prompt), SamplingParams(max_tokens=1),
                             kv_transfer_params=HOLD)
    (out,) = run_all(engine)[rid]
    return rid, out


def test_remote_kv_is_used_and_held_blocks_are_released(copy_engine, reference):
    engine, conn = copy_engine
    start = engine.num_free_blocks
    prompt = PROMPTS[7]
    ids = engine.tokenizer.encode(prompt)
    src_id, prefill = _held_prefill(engine, prompt)
    assert prefill.finished and prefill.new_token_ids == reference[prompt][:1]
    src_blocks = prefill.kv_transfer_params.remote_block_ids
    assert len(src_blocks) == -(-len(ids) // 16)
    assert engine.num_free_blocks == start - len(src_blocks)  # held, not freed

    rid = engine.add_request(ids, GREEDY, kv_transfer_params=copy_from(src_blocks, len(ids)))
    outs = run_all(engine)[rid]
    assert tokens(outs) == reference[prompt]
    # Only the last prompt token was recomputed: the rest came from the copied blocks.
    assert outs[-1].num_cached_tokens == len(ids) - 1

    assert engine.num_free_blocks == start - len(src_blocks)
    assert engine.has_pending_work() and not engine.has_runnable_work()
    steps = conn.num_steps
    conn.release(src_id)
    assert engine.step() == []
    assert conn.num_steps == steps + 1  # the connector is stepped with nothing to run
    assert engine.num_free_blocks == start and not engine.has_pending_work()


def test_first_token_carries_the_phases_of_the_request(copy_engine):
    """Where the time to first token went: every phase's start, in order, on the first
    output only; and the metrics built from them add up to the whole."""
    from kvbridge.metrics import Metrics

    engine, conn = copy_engine
    prompt = PROMPTS[7]
    ids = engine.tokenizer.encode(prompt)
    src_id, prefill = _held_prefill(engine, prompt)
    assert set(prefill.times) == {"arrived", "scheduled", "first_token"}
    rid = engine.add_request(ids, SamplingParams(max_tokens=3, temperature=0.0),
                             kv_transfer_params=copy_from(
                                 prefill.kv_transfer_params.remote_block_ids, len(ids)))
    outs = run_all(engine)[rid]
    conn.release(src_id)
    engine.step()
    first = next(o for o in outs if o.new_token_ids)
    t = first.times
    assert [k for k in sorted(t, key=t.get)] == ["arrived", "load_started", "kv_loaded",
                                                 "scheduled", "first_token"]
    assert all(o.times is None for o in outs if o is not first)
    m = Metrics()
    m.observe_phases(t)
    phase = {p: m.value("kvbridge_request_phase_seconds_sum", {"phase": p})
             for p in ("queue", "kv_load", "after_load", "first_step", "time_to_first_token")}
    assert phase["time_to_first_token"] == pytest.approx(t["first_token"] - t["arrived"])
    assert sum(phase[p] for p in ("queue", "kv_load", "after_load", "first_step")) == \
        pytest.approx(phase["time_to_first_token"])


def test_remote_kv_really_replaces_the_prompt_computation(copy_engine, reference):
    """Loading another prompt's KV (a wrong "transfer") changes the output: the engine
    trusts the cache for the loaded prefix instead of recomputing it."""
    engine, conn = copy_engine
    start = engine.num_free_blocks
    a, b = "0123456789", "zyxwvutsrq"  # same length, different text
    src_id, prefill = _held_prefill(engine, b)
    ids = engine.tokenizer.encode(a)
    rid = engine.add_request(ids, GREEDY, kv_transfer_params=copy_from(
        prefill.kv_transfer_params.remote_block_ids, len(ids)))
    got = tokens(run_all(engine)[rid])
    assert got != reference[a]
    conn.release(src_id)
    engine.step()
    assert engine.num_free_blocks == start


def test_failed_load_is_recomputed_by_default(copy_engine, reference):
    engine, conn = copy_engine
    start = engine.num_free_blocks
    prompt = PROMPTS[3]
    ids = engine.tokenizer.encode(prompt)
    rid = engine.add_request(ids, GREEDY, kv_transfer_params=_failing(ids))
    outs = run_all(engine)[rid]
    assert tokens(outs) == reference[prompt]
    assert outs[-1].num_cached_tokens == 0 and outs[-1].error is None
    assert engine.num_free_blocks == start


def test_failed_load_fails_the_request_under_the_fail_policy():
    conn = LocalCopyConnector()
    with build_engine(num_blocks=32, connector=conn, kv_load_failure_policy="fail",
                      worker_connector_factory=LocalCopyWorkerConnector) as engine:
        ids = engine.tokenizer.encode(PROMPTS[3])
        rid = engine.add_request(ids, GREEDY, kv_transfer_params=_failing(ids))
        ok = engine.add_request(ids, GREEDY)
        outs = run_all(engine)
        (failed,) = outs[rid]
        assert failed.finished and failed.finish_reason == "error"
        assert "injected failure" in str(failed.error) and failed.new_token_ids == []
        assert outs[ok][-1].finish_reason == "length"
        assert conn.finished.count(rid) == 1
        assert engine.num_free_blocks == 32


def test_requests_wait_for_blocks_before_remote_load(copy_engine):
    """With too few free blocks, a remote request gets its blocks (and on_blocks_allocated)
    only after a running request frees them."""
    engine, conn = copy_engine
    start = engine.num_free_blocks
    big = engine.add_request([65] * (start * 16 - 40), SamplingParams(max_tokens=2))
    engine.step()  # the big prefill now holds nearly every block until its next token
    ids = engine.tokenizer.encode(PROMPTS[7])
    rid = engine.add_request(ids, GREEDY, kv_transfer_params=_failing(ids))
    outs = run_all(engine)
    assert outs[big][-1].finished and outs[rid][-1].finish_reason == "length"
    events = conn.events
    assert events.index(("finished", big)) < events.index(("allocated", rid))
    assert engine.num_free_blocks == start


def test_collective_rpc_reaches_every_rank(copy_engine):
    engine, _ = copy_engine
    tp = engine.config.tp_size
    meta = engine.collective_rpc("kv_handshake_metadata")
    kv_heads = 4 // tp
    assert meta == [f"rank {r}/{tp} kv [2, 2, 64, {kv_heads}, 16, 16]".encode()
                    for r in range(tp)]
    assert engine.collective_rpc("connector.handshake_metadata") == meta
    with pytest.raises(WorkerError, match="no_such_method"):
        engine.collective_rpc("no_such_method")
    with pytest.raises((WorkerError, AttributeError), match="private"):
        engine.collective_rpc("_resolve")
    assert engine.collective_rpc("kv_handshake_metadata") == meta  # still usable


# -- worker processes ----------------------------------------------------------------------

def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return "\nState:\tZ" not in f.read()  # a zombie has exited
    except FileNotFoundError:
        return False


def test_workers_exit_on_shutdown(copy_engine):
    engine, _ = copy_engine
    if engine.config.tp_size == 1:
        assert engine.worker_pids == []
        return
    pids = engine.worker_pids
    assert len(pids) == 2 and all(_alive(p) for p in pids)
    engine.shutdown()
    assert not any(_alive(p) for p in pids)
    engine.shutdown()  # idempotent


def test_workers_exit_when_the_head_process_dies():
    script = textwrap.dedent("""
        import os, sys
        from kvbridge.engine import build_engine
        if __name__ == "__main__":
            e = build_engine(tp_size=2, num_blocks=8, num_threads=1)
            print(" ".join(map(str, e.worker_pids)), flush=True)
            os._exit(0)  # no shutdown, no atexit handlers
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    pids = [int(p) for p in out.stdout.split()]
    assert len(pids) == 2, out.stderr
    wait_until(lambda: not any(_alive(p) for p in pids), 20, "the workers gone", every=0.05)


# -- continuing after tokens the client already has (the first token from the prefill) -------

@pytest.mark.parametrize("sampling", [GREEDY, SamplingParams(max_tokens=12, temperature=1.0,
                                                             seed=7, ignore_eos=True)],
                         ids=["greedy", "seeded"])
def test_a_request_continues_after_the_tokens_already_sent(engine, sampling):
    """``sent_token_ids``: the prefill's first token counts as this request's first output
    (sampling position, max_tokens), so the rest is what one engine alone would give."""
    ids = engine.tokenizer.encode(PROMPTS[5])
    whole = engine.generate([ids], sampling)[0]
    rid = engine.add_request(ids, sampling,
                             kv_transfer_params=KVTransferParams(sent_token_ids=whole[:1]))
    outs = run_all(engine)[rid]
    assert tokens(outs) == whole[1:]
    assert outs[-1].num_output_tokens == len(whole)
    first = next(o for o in outs if o.new_token_ids)
    assert first.times is not None and "first_token" in first.times


def test_sent_tokens_must_leave_something_to_generate(engine):
    ids = engine.tokenizer.encode(PROMPTS[0])
    with pytest.raises(ValueError, match="sent_token_ids"):
        engine.add_request(ids, SamplingParams(max_tokens=1),
                           kv_transfer_params=KVTransferParams(sent_token_ids=[ids[0]]))
    with pytest.raises(ValueError, match="sent_token_ids"):
        engine.add_request(ids, GREEDY, kv_transfer_params=KVTransferParams(
            sent_token_ids=[engine.model_config.vocab_size]))
