"""Every READ validated inside vLLM: kvbridge's block tags (kvbridge.kv_tags) in the plug-in.

vLLM's pull path answers from whatever the prefill's blocks hold when the decode READs them:
after a lease ran out and the blocks were reused, with reordered ``remote_block_ids``, or
with another prompt's ``kv_transfer_params``, the answer is a 200 with another prompt's KV.
The plug-in closes that as kvbridge's own engine does (optimistic read, then validate):

* **every worker keeps one tag per KV block** (8 bytes, NIXL-registered next to the cache;
  its address travels in the handshake as two extra fields of vLLM's own agent metadata,
  which a stock vLLM ignores);
* **the scheduler names what each step writes** (``TagWriter``, from the scheduler output):
  the worker clears those blocks' tags before the forward (``start_load_kv``) and sets
  them after it (``wait_for_save``) to the chain hash of the prompt tokens they now hold;
* **a decode READs the tags after the data** and compares them with the tags of its own
  prompt (``ReadValidator``). A block cleared or rewritten since, or holding other tokens,
  gives another tag: the request takes vLLM's load-failure path (``kv_load_failure_policy``:
  ``recompute`` computes the prompt, ``fail`` refuses it), and
  ``vllm:kvbridge_kv_reads{result=...}`` counts it.

A peer without tags (a stock vLLM) is read unvalidated, logged once and counted
``unvalidated``; ``read_validation: require`` refuses such READs instead (a load failure),
``off`` turns validation off (tags are neither kept nor read).
Only vLLM's attention KV with one cache group is validated. A READ from a peer whose block
size differs from the decode's is refused (``block_size_mismatch``, a load failure): vLLM
0.32's own READ across block sizes puts the KV in the wrong places on CPU (a prefill at 32
and a decode at vLLM's default gave a 200 with garbage text, stock vLLM alike), and the
tags, which are of the prefill's blocks, cannot see where the decode's copy landed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Container, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np

from kvbridge.kv_tags import TagChain

log = logging.getLogger("vllm.kvbridge")

MODES = ("auto", "require", "off")
# vllm:kvbridge_kv_reads{result=...}: what a decode's READ turned out to be.
RESULTS = ("validated", "stale", "tag_read_failed", "block_size_mismatch", "unvalidated")
MAX_SOURCES = 8  # prefill ranks one decode rank reads from (heterogeneous TP)
# Where peers' tags land: columns per source row, taken by a READ for its remote blocks
# (as many as its local blocks: every local block can be in flight at once).
COLUMNS_PER_BLOCK = 1
SPIN_S = 0.002  # how long a tag READ is waited for before it is left to the next step


# --- the scheduler: which blocks each step writes, and with what ----------------------


@dataclass
class _Seq:
    tokens: list[int] | None  # the prompt (None: embeddings, tags only cleared)
    blocks: list[int]
    chain: TagChain


@dataclass
class StepTags:
    """What one step's forward writes: blocks whose tags are cleared before it, and
    (block, tag) pairs set after it. Sent to the workers in the connector metadata."""

    clear: list[int] = field(default_factory=list)
    set: list[tuple[int, int]] = field(default_factory=list)


class TagWriter:
    """Follows every scheduled request's blocks and prompt (scheduler side)."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self._seqs: dict[str, _Seq] = {}

    def step(self, so: Any) -> StepTags:
        """The tags of ``so`` (vLLM's ``SchedulerOutput``)."""
        out = StepTags()
        for new in so.scheduled_new_reqs:
            tokens = list(new.prompt_token_ids) if new.prompt_token_ids is not None else None
            seq = _Seq(tokens, list(new.block_ids[0]), TagChain(self.block_size))
            self._seqs[new.req_id] = seq
            self._written(seq, new.num_computed_tokens,
                          so.num_scheduled_tokens.get(new.req_id, 0), out)
        cached = so.scheduled_cached_reqs
        # vLLM 0.32-0.33 list resumed requests here; 0.34 sends them back whole as new
        # requests (above) and has no such field.
        resumed = getattr(cached, "resumed_req_ids", ())
        for i, req_id in enumerate(cached.req_ids):
            seq = self._seqs.get(req_id)
            if seq is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in resumed and new_ids is not None:
                seq.blocks = list(new_ids[0])  # resumed after preemption: the whole list
            elif new_ids is not None:
                seq.blocks.extend(new_ids[0])
            self._written(seq, cached.num_computed_tokens[i],
                          so.num_scheduled_tokens.get(req_id, 0), out)
        self.forget(so.finished_req_ids)
        return out

    def forget(self, req_ids: Iterable[str]) -> None:
        for req_id in req_ids:
            self._seqs.pop(req_id, None)

    def _written(self, seq: _Seq, start: int, n: int, out: StepTags) -> None:
        bs, end = self.block_size, start + n
        for b in range(start // bs, -(-end // bs)):
            if b >= len(seq.blocks):
                break
            block = seq.blocks[b]
            out.clear.append(block)
            stop = min((b + 1) * bs, end)
            # Blocks that get generated tokens keep no tag: a decode reads prompts only.
            if seq.tokens is not None and stop <= len(seq.tokens):
                out.set.append((block, seq.chain.tag(seq.tokens, b, stop)))


# --- the worker: the tags, and the READ of a peer's -----------------------------------


class TagInfo(msgspec.Struct):
    """The two fields the plug-in adds to vLLM's ``NixlAgentMetadata`` (0: no tags)."""

    kvbridge_tags_addr: int = 0
    kvbridge_tags_blocks: int = 0
    kvbridge_tags_block_size: int = 0


_tag_info = msgspec.msgpack.Decoder(TagInfo)


@dataclass
class _Peer:
    agent: str
    dlist: Any  # the peer's tag array, one 8-byte descriptor per block
    blocks: int
    block_size: int  # the peer's: its tags are of its blocks


@dataclass
class _Expect:
    engine_id: str
    tokens: list[int]
    num_tokens: int
    remote: list[int]  # logical block ids, as the prefill listed them
    local: list[int]


@dataclass
class _Pending:
    handles: list[Any]
    columns: np.ndarray  # the scratch columns the peer's tags land in (one per block)
    sources: int
    expected: list[int]


def _descs(base: int, n: int) -> np.ndarray:
    """NIXL descriptors (address, length 8, device 0) of ``n`` consecutive 8-byte tags."""
    return np.stack([base + 8 * np.arange(n, dtype=np.uint64),
                     np.full(n, 8, dtype=np.uint64), np.zeros(n, dtype=np.uint64)], axis=1)


class ReadValidator:
    """One worker's tags and its validating READs (see the module's docstring)."""

    def __init__(self, agent: Any, backends: list[str], num_blocks: int, block_size: int,
                 mode: str, record: Callable[[str], None],
                 record_seconds: Callable[[float], None] | None = None):
        self.agent, self.backends = agent, backends
        self.num_blocks, self.block_size, self.mode = num_blocks, block_size, mode
        self._record = record
        self._record_seconds = record_seconds  # each tag READ's own time (NIXL telemetry)
        self.tags = np.zeros(num_blocks, dtype=np.uint64)
        # Where peers' tags land: one row per source rank; a READ takes free columns.
        self.columns = COLUMNS_PER_BLOCK * num_blocks
        self.scratch = np.zeros((MAX_SOURCES, self.columns), dtype=np.uint64)
        self._free_columns = list(range(self.columns - 1, -1, -1))
        self.registered: list[Any] = []
        self._local: Any = None
        self._peers: dict[tuple[str, int], _Peer] = {}
        self._expect: dict[str, _Expect] = {}
        self._pending: dict[str, _Pending] = {}
        self._warned: set[str] = set()  # engines whose READs are not validated (said once)
        self._said: set[str] = set()  # engines whose READs are validated (said once)
        self._mismatched: set[str] = set()  # engines of another block size (said once)

    # -- this worker's own tags --------------------------------------------------------

    def register(self) -> None:
        """Register the tags and the scratch rows with NIXL. Before vLLM takes its agent
        metadata, so a peer's agent knows the memory."""
        for arr in (self.tags, self.scratch):
            self.registered.append(self.agent.register_memory(
                [(arr.ctypes.data, arr.nbytes, 0, "")], mem_type="DRAM",
                backends=self.backends))
        base = self.scratch.ctypes.data
        self._local = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT",
                                                 _descs(base, self.scratch.size), "DRAM")

    def advertise(self, agent_metadata_bytes: bytes) -> bytes:
        """vLLM's encoded ``NixlAgentMetadata`` with this worker's tag fields added."""
        fields = msgspec.msgpack.decode(agent_metadata_bytes)
        fields.update(kvbridge_tags_addr=int(self.tags.ctypes.data),
                      kvbridge_tags_blocks=self.num_blocks,
                      kvbridge_tags_block_size=self.block_size)
        return msgspec.msgpack.encode(fields)

    def clear(self, blocks: Sequence[int]) -> None:
        if blocks:
            self.tags[np.asarray(blocks, dtype=np.int64)] = 0

    def set(self, pairs: Sequence[tuple[int, int]]) -> None:
        for block, tag in pairs:
            self.tags[block] = tag

    # -- peers -------------------------------------------------------------------------

    def add_peer(self, engine_id: str, rank: int, agent: str, agent_metadata_bytes: bytes
                 ) -> None:
        """After vLLM's ``add_remote_agent``: the peer's tags, if it has any."""
        old = self._peers.pop((engine_id, rank), None)
        if old is not None:
            self._release_dlist(old.dlist)
        info = _tag_info.decode(agent_metadata_bytes)
        if not info.kvbridge_tags_addr or info.kvbridge_tags_block_size <= 0:
            return  # no tags: a stock vLLM
        descs = _descs(info.kvbridge_tags_addr, info.kvbridge_tags_blocks)
        self._peers[(engine_id, rank)] = _Peer(
            agent, self.agent.prep_xfer_dlist(agent, descs, "DRAM"), info.kvbridge_tags_blocks,
            info.kvbridge_tags_block_size)

    # -- a decode's READs --------------------------------------------------------------

    def expect(self, req_id: str, meta: Any, tokens: Sequence[int] | None) -> None:
        """At ``start_load_kv``: what ``req_id``'s READ must bring (from its own prompt)."""
        remote = meta.remote
        if tokens is None or remote is None or len(remote.block_ids) != 1:
            return
        n = len(tokens) if remote.num_tokens is None else min(remote.num_tokens, len(tokens))
        self._expect[req_id] = _Expect(remote.engine_id, list(tokens), n,
                                       list(remote.block_ids[0]),
                                       list(meta.local_block_ids[0]))

    def hold_back(self, done: set[str], failed: set[str],
                  sources: Callable[[str], Sequence[int]],
                  live: Container[str]) -> tuple[set[str], set[str]]:
        """Filter vLLM's finished READs: a READ whose data is in is held back while its
        tags are READ; one whose tags are in is done, or failed when they differ.
        ``live``: the requests vLLM still receives (others are forgotten)."""
        for req_id in [r for r in self._expect if r not in live and r not in done]:
            del self._expect[req_id]
        for req_id in list(self._pending):
            result = self._finished(req_id)
            if result is not None:
                done.add(req_id)
                self._conclude(req_id, result, failed)
        for req_id in list(done):
            exp = self._expect.pop(req_id, None)
            if exp is None or req_id in failed or req_id in self._pending:
                continue
            result = self._start(req_id, exp, list(sources(exp.engine_id)))
            if result is None:
                done.discard(req_id)  # its tags are on their way
            else:
                self._conclude(req_id, result, failed)
        return done, failed

    def _conclude(self, req_id: str, result: str, failed: set[str]) -> None:
        """Count the READ; a stale or unreadable one (or, with ``require``, an unvalidated
        one) becomes a load failure, which vLLM's kv_load_failure_policy handles."""
        self._record(result)
        if result == "validated" or (result == "unvalidated" and self.mode != "require"):
            return
        failed.add(req_id)
        log.warning("kvbridge: KV READ of request %s is %s: recomputed or refused per "
                    "kv_load_failure_policy", req_id, result)

    def _start(self, req_id: str, exp: _Expect, ranks: list[int]) -> str | None:
        peers = [self._peers.get((exp.engine_id, r)) for r in ranks]
        if not peers or len(peers) > MAX_SOURCES or any(p is None for p in peers):
            if exp.engine_id not in self._warned:
                self._warned.add(exp.engine_id)
                log.warning("kvbridge: engine %s has no block tags (a stock vLLM?): its KV "
                            "READs are not validated%s", exp.engine_id,
                            "; refused (read_validation: require)"
                            if self.mode == "require" else "")
            return "unvalidated"
        sizes = {p.block_size for p in peers if p is not None}
        if sizes != {self.block_size}:
            if exp.engine_id not in self._mismatched:
                self._mismatched.add(exp.engine_id)
                log.warning("kvbridge: engine %s's block size %s is not this decode's %d: "
                            "vLLM's READ across block sizes misplaces the KV, so its READs "
                            "are refused (recomputed or failed per kv_load_failure_policy); "
                            "give prefill and decode the same --block-size", exp.engine_id,
                            "/".join(str(b) for b in sorted(sizes)), self.block_size)
            return "block_size_mismatch"
        # The READ's blocks: vLLM reads the last ones when the decode has the prefix.
        first = len(exp.remote) - min(len(exp.remote), len(exp.local))
        remote, bs = exp.remote[first:], self.block_size
        chain = TagChain(bs)
        expected = [chain.tag(exp.tokens, j, min((j + 1) * bs, exp.num_tokens))
                    for j in range(first, len(exp.remote))]
        if not remote:
            return "validated"
        if any(b < 0 or b >= p.blocks for p in peers if p for b in remote):
            return "stale"  # a block id outside the cache is no block of this prompt
        if len(remote) > len(self._free_columns):
            log.warning("kvbridge: no room to READ the %d tags of request %s (%d free of "
                        "%d): not validated", len(remote), req_id, len(self._free_columns),
                        self.columns)
            return "tag_read_failed"
        columns = np.asarray([self._free_columns.pop() for _ in remote], dtype=np.int64)
        handles: list[Any] = []
        try:
            for s, peer in enumerate(peers):
                assert peer is not None
                h = self.agent.make_prepped_xfer(
                    "READ", self._local, s * self.columns + columns, peer.dlist,
                    np.asarray(remote, dtype=np.int64))
                handles.append(h)
                if self.agent.transfer(h) == "ERR":
                    raise RuntimeError("the tag READ did not start")
        except Exception as e:  # noqa: BLE001 - a peer gone mid-way: the load failed
            log.warning("kvbridge: tag READ of request %s: %s: %s", req_id,
                        type(e).__name__, e)
            self._release(handles)
            self._free_columns.extend(columns.tolist())
            return "tag_read_failed"
        self._pending[req_id] = _Pending(handles, columns, len(peers), expected)
        if exp.engine_id not in self._said:
            self._said.add(exp.engine_id)
            log.info("kvbridge: KV READs from engine %s are validated (block tags)",
                     exp.engine_id)
        # A few bytes per block: usually done within microseconds. Waiting that long here
        # saves the request an engine step (vLLM polls transfers once per step).
        deadline = time.perf_counter() + SPIN_S
        while time.perf_counter() < deadline:
            result = self._finished(req_id)
            if result is not None:
                return result
        return None

    def _finished(self, req_id: str) -> str | None:
        p = self._pending[req_id]
        try:
            states = [self.agent.check_xfer_state(h) for h in p.handles]
        except Exception:  # noqa: BLE001
            states = ["ERR"]
        if "PROC" in states and "ERR" not in states:
            return None
        del self._pending[req_id]
        if self._record_seconds is not None and "ERR" not in states:
            for h in p.handles:
                try:
                    res = self.agent.get_xfer_telemetry(h)
                except Exception:  # noqa: BLE001 - telemetry off: nothing to record
                    res = None
                if res is not None:
                    self._record_seconds(res.xferDuration / 1e6)
        self._release(p.handles)
        self._free_columns.extend(p.columns.tolist())
        if any(s != "DONE" for s in states):
            return "tag_read_failed"
        want = np.asarray(p.expected, dtype=np.uint64)
        for s in range(p.sources):
            if not np.array_equal(self.scratch[s, p.columns], want):
                return "stale"
        return "validated"

    def _release(self, handles: list[Any]) -> None:
        for h in handles:
            try:
                self.agent.release_xfer_handle(h)
            except Exception:  # noqa: BLE001, S110 - a handle still busy is freed by NIXL
                pass

    def _release_dlist(self, dlist: Any) -> None:
        try:
            self.agent.release_dlist_handle(dlist)
        except Exception:  # noqa: BLE001, S110 - the peer's agent may be gone already
            pass

    def shutdown(self) -> None:
        self._release([h for p in self._pending.values() for h in p.handles])
        self._pending.clear()
        for peer in self._peers.values():
            self._release_dlist(peer.dlist)
        self._peers.clear()
        if self._local is not None:
            self._release_dlist(self._local)
            self._local = None
