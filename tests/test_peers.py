"""Background handshakes and cached peers, with real NIXL agents (CPU memory) in this process
and real side-channel servers on 127.0.0.1."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import msgspec
import pytest
import torch

from kvbridge.errors import AuthError, EpochChanged, HandshakeError, TransferError
from kvbridge.handshake.base import HandshakeClient, HandshakeServer
from kvbridge.handshake.http.client import HttpHandshakeClient
from kvbridge.handshake.http.server import HttpHandshakeServer
from kvbridge.handshake.zmq.kvbridge_wire import ZmqHandshakeClient, ZmqHandshakeServer
from kvbridge.kv_cache import allocate_kv_cache
from kvbridge.metadata import KVLayout, compat_of
from kvbridge.peers import Peer, PeerManager
from kvbridge.tp_mapping import heads_per_rank, plan_reads, rank_heads
from kvbridge.transfer import NixlAgent
from tests.helpers import CountingStore, RawServer

TOKEN = "peers-token"
HOST = "127.0.0.1"
MODEL = "peers-test"
LAYERS, BLOCKS, BLOCK, DIM, HEADS = 2, 4, 4, 8, 4
REMOTE_TP = 2
METHODS = ["http", "zmq"]
LOCAL_BLOCKS, REMOTE_BLOCKS = [1, 2], [3, 0]


def _agent(tp: int, fill: float | None, cls: type[NixlAgent] = NixlAgent) -> NixlAgent:
    kv = allocate_kv_cache(LAYERS, BLOCKS, heads_per_rank(tp, HEADS), BLOCK, DIM, torch.float32)
    if fill is not None:
        kv.copy_(torch.arange(kv.numel(), dtype=torch.float32).view_as(kv) + fill)
    agent = cls()
    agent.register_kv_cache(kv, HEADS)
    return agent


class Instance:
    """A prefill instance reduced to its agents (one per TP rank) and its epoch."""

    def __init__(self, epoch: str, fill: float):
        self.epoch = epoch
        self.agents = [_agent(REMOTE_TP, fill + 1e5 * r) for r in range(REMOTE_TP)]

    def publish(self, store: CountingStore, engine_id: str = "prefill-0") -> None:
        for r, a in enumerate(self.agents):
            store.set_rank(a.rank_metadata(engine_id, self.epoch, r, REMOTE_TP))


@pytest.fixture(scope="module")
def instance_a() -> Instance:
    return Instance("epoch-a", 0.0)


@pytest.fixture(scope="module")
def instance_b() -> Instance:
    """The same engine after a restart: new agents, new memory, new epoch."""
    return Instance("epoch-b", 5e5)


@pytest.fixture
def decode() -> NixlAgent:
    return _agent(1, None)


def _store(instance: Instance | None) -> CountingStore:
    kv = _agent_kv_layout()
    store = CountingStore(compat_of(MODEL, kv), REMOTE_TP)
    if instance is not None:
        instance.publish(store)
    return store


def _agent_kv_layout() -> KVLayout:
    heads = heads_per_rank(REMOTE_TP, HEADS)
    block_len = heads * BLOCK * DIM * 4
    return KVLayout(num_layers=LAYERS, num_blocks=BLOCKS, block_size=BLOCK, total_kv_heads=HEADS,
                    kv_heads_per_rank=heads, head_dim=DIM, dtype="float32", layout="HND",
                    base_addrs=[0] * (2 * LAYERS), block_len=block_len)


def _server(method: str, store: CountingStore) -> HandshakeServer:
    if method == "http":
        return HttpHandshakeServer(store, HOST, 0, token=TOKEN)
    return ZmqHandshakeServer(store, HOST, 0, token=TOKEN)


def _client(method: str, token: str | None = TOKEN, timeout: float = 10.0) -> HandshakeClient:
    cls = HttpHandshakeClient if method == "http" else ZmqHandshakeClient
    return cls(timeout, compat_of(MODEL, _agent_kv_layout()), token)


@contextlib.contextmanager
def running(method: str, store: CountingStore) -> Iterator[HandshakeServer]:
    server = _server(method, store)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@contextlib.contextmanager
def manager(decode: NixlAgent, clients: dict[str, HandshakeClient], local_rank: int = 0,
            local_tp: int = 1) -> Iterator[PeerManager]:
    mgr = PeerManager(decode, local_rank, local_tp, HEADS, lambda method: clients[method])
    try:
        yield mgr
    finally:
        mgr.close()
        for c in clients.values():
            c.close()


def _read_and_check(decode: NixlAgent, peer: Peer, instance: Instance, local_rank: int = 0,
                    local_tp: int = 1) -> None:
    """READ the blocks from every remote rank of ``peer`` and compare with ``instance``."""
    kv = decode._kv_tensor
    kv.zero_()
    for rr in peer.ranks.values():
        decode.wait(decode.read(rr, LOCAL_BLOCKS, REMOTE_BLOCKS, b"n"), 30)
    local_start = rank_heads(local_rank, local_tp, HEADS).start
    for q in range(REMOTE_TP):
        remote = instance.agents[q]._kv_tensor
        remote_start = rank_heads(q, REMOTE_TP, HEADS).start
        for g in rank_heads(q, REMOTE_TP, HEADS):
            if g in rank_heads(local_rank, local_tp, HEADS):
                got = kv[:, :, LOCAL_BLOCKS, g - local_start]
                want = remote[:, :, REMOTE_BLOCKS, g - remote_start]
                assert torch.equal(got, want), (q, g)
    assert kv.abs().sum() > 0


# --- background handshakes ---------------------------------------------------------------------

@pytest.mark.parametrize("method", METHODS)
def test_connect_returns_a_future_before_the_server_answers(decode, instance_a, method):
    store = _store(instance_a)
    server = _server(method, store)  # bound (connections wait in the backlog), not serving yet
    try:
        with manager(decode, {method: _client(method)}) as mgr:
            fut = mgr.connect("prefill-0", HOST, server.port, REMOTE_TP, method=method)
            assert isinstance(fut, Future)
            # the caller has its future although the handshake cannot have completed
            assert not fut.done()
            assert store.requests == []
            server.start()
            peer = fut.result(timeout=30)
            assert peer.epoch == "epoch-a" and peer.engine_id == "prefill-0"
            assert sorted(peer.ranks) == [0, 1] and sorted(store.requests) == [0, 1]
            _read_and_check(decode, peer, instance_a)
    finally:
        server.stop()


@pytest.mark.parametrize("method", METHODS)
def test_only_the_needed_remote_ranks_are_fetched(instance_a, method):
    decode = _agent(2, None)  # local rank 1 of TP 2: heads 2, 3 = remote rank 1
    store = _store(instance_a)
    with running(method, store) as server, \
            manager(decode, {method: _client(method)}, local_rank=1, local_tp=2) as mgr:
        peer = mgr.connect("prefill-0", HOST, server.port, REMOTE_TP, method=method).result(30)
        assert sorted(peer.ranks) == [1]
        assert store.requests == [1]
        _read_and_check(decode, peer, instance_a, local_rank=1, local_tp=2)


def test_cached_peer_is_reused(decode, instance_a):
    store = _store(instance_a)
    with running("zmq", store) as server, manager(decode, {"zmq": _client("zmq")}) as mgr:
        first = mgr.connect("prefill-0", HOST, server.port, REMOTE_TP, method="zmq").result(30)
        hits = len(store.requests)
        again = mgr.connect("prefill-0", HOST, server.port, REMOTE_TP, method="zmq")
        assert again.done() and again.result() is first
        same_epoch = mgr.connect("prefill-0", HOST, server.port, REMOTE_TP, method="zmq",
                                 epoch="epoch-a")
        assert same_epoch.result(30) is first
        assert len(store.requests) == hits
        _read_and_check(decode, first, instance_a)


def test_concurrent_connects_share_one_handshake(decode, instance_a):
    store = _store(instance_a)
    server = _server("http", store)
    try:
        with manager(decode, {"http": _client("http")}) as mgr:
            futs = [mgr.connect("prefill-0", HOST, server.port, REMOTE_TP, method="http")
                    for _ in range(5)]
            server.start()
            peers = {id(f.result(30)) for f in futs}
            assert len(peers) == 1 and sorted(store.requests) == [0, 1]
    finally:
        server.stop()


# --- epochs -------------------------------------------------------------------------------------

@pytest.mark.parametrize("method", METHODS)
def test_epoch_change_drops_the_stale_peer(decode, instance_a, instance_b, method):
    store = _store(instance_a)
    with running(method, store) as server, manager(decode, {method: _client(method)}) as mgr:
        old = mgr.connect("prefill-0", HOST, server.port, REMOTE_TP, method=method,
                          epoch="epoch-a").result(30)
        _read_and_check(decode, old, instance_a)
        hits = len(store.requests)

        instance_b.publish(store)  # the prefill restarted
        new = mgr.connect("prefill-0", HOST, server.port, REMOTE_TP, method=method,
                          epoch="epoch-b").result(30)
        assert new is not old and new.epoch == "epoch-b"
        assert len(store.requests) == hits + REMOTE_TP  # a second handshake
        assert {rr.agent_name for rr in new.ranks.values()} == {a.name for a in instance_b.agents}
        # the stale remote agents were removed: their ranks can no longer be read
        for rr in old.ranks.values():
            with pytest.raises(TransferError, match="disconnected"):
                decode.read(rr, LOCAL_BLOCKS, REMOTE_BLOCKS, b"stale")
        _read_and_check(decode, new, instance_b)
        # and the new peer is the cached one now
        assert mgr.connect("prefill-0", HOST, server.port, REMOTE_TP, method=method,
                           epoch="epoch-b").result(30) is new


@pytest.mark.parametrize("method", METHODS)
def test_unknown_epoch(decode, instance_a, method):
    store = _store(instance_a)
    with running(method, store) as server, manager(decode, {method: _client(method)}) as mgr:
        mgr.connect("prefill-0", HOST, server.port, REMOTE_TP, method=method,
                    epoch="epoch-a").result(30)
        hits = len(store.requests)
        fut = mgr.connect("prefill-0", HOST, server.port, REMOTE_TP, method=method,
                          epoch="epoch-gone")
        with pytest.raises(EpochChanged, match="epoch-a.*epoch-go|its blocks are gone"):
            fut.result(30)
        assert len(store.requests) == hits + REMOTE_TP  # it did ask the peer again
        # the peer of the epoch it does run is usable
        peer = mgr.connect("prefill-0", HOST, server.port, REMOTE_TP, method=method,
                           epoch="epoch-a").result(30)
        _read_and_check(decode, peer, instance_a)


class _RecordingAgent(NixlAgent):
    """A real agent that counts the remote ranks it connected."""

    def __init__(self) -> None:
        super().__init__()
        self.connected = threading.Semaphore(0)

    def connect(self, meta, slices):
        rr = super().connect(meta, slices)
        self.connected.release()
        return rr


class _HandshakeFirst(ThreadPoolExecutor):
    """A real pool whose handshakes win the race against the caller's thread: ``submit``
    returns only once the handshake has connected the remote agents."""

    def __init__(self, agent: _RecordingAgent):
        super().__init__(2)
        self.agent = agent

    def submit(self, fn, /, *args, **kwargs):
        fut = super().submit(fn, *args, **kwargs)
        for _ in range(REMOTE_TP):
            assert self.agent.connected.acquire(timeout=30)
        return fut


def test_stale_peer_removed_before_the_new_handshake_adds_the_same_agent(instance_a):
    """Asking for an epoch the peer does not run re-handshakes with the *same* remote agents:
    the stale peer's agents must be removed before, not after, they are added again."""
    decode = _agent(1, None, cls=_RecordingAgent)
    store = _store(instance_a)
    with running("zmq", store) as server, manager(decode, {"zmq": _client("zmq")}) as mgr:
        mgr._handshakes.shutdown()
        mgr._handshakes = _HandshakeFirst(decode)
        mgr.connect("prefill-0", HOST, server.port, REMOTE_TP, method="zmq",
                    epoch="epoch-a").result(30)
        with pytest.raises(EpochChanged):
            mgr.connect("prefill-0", HOST, server.port, REMOTE_TP, method="zmq",
                        epoch="epoch-gone").result(30)
        peer = mgr.connect("prefill-0", HOST, server.port, REMOTE_TP, method="zmq",
                           epoch="epoch-a").result(30)
        _read_and_check(decode, peer, instance_a)


def test_invalidate_forces_a_new_handshake(decode, instance_a):
    store = _store(instance_a)
    with running("zmq", store) as server, manager(decode, {"zmq": _client("zmq")}) as mgr:
        old = mgr.connect("prefill-0", HOST, server.port, REMOTE_TP, method="zmq").result(30)
        hits = len(store.requests)
        mgr.invalidate("prefill-0")
        with pytest.raises(TransferError):
            decode.read(old.ranks[0], LOCAL_BLOCKS, REMOTE_BLOCKS, b"x")
        new = mgr.connect("prefill-0", HOST, server.port, REMOTE_TP, method="zmq").result(30)
        assert new is not old and len(store.requests) == hits + REMOTE_TP
        _read_and_check(decode, new, instance_a)


# --- failures ------------------------------------------------------------------------------------

@pytest.mark.parametrize("method", METHODS)
def test_handshake_error_surfaces_and_a_later_connect_retries(decode, instance_a, method):
    store = _store(instance_a)
    clients = {method: _client(method, token="wrong")}
    with running(method, store) as server, manager(decode, clients) as mgr:
        fut = mgr.connect("prefill-0", HOST, server.port, REMOTE_TP, method=method)
        assert isinstance(fut.exception(timeout=30), AuthError)
        assert store.requests == []  # refused before the store is asked
        # fix the credentials: the next connect handshakes again instead of caching the error
        good = _client(method)
        clients[method] = good
        peer = mgr.connect("prefill-0", HOST, server.port, REMOTE_TP, method=method).result(30)
        assert sorted(store.requests) == [0, 1]
        _read_and_check(decode, peer, instance_a)
        events = mgr.drain_events()
        assert [e.outcome for e in events] == ["AuthError", "ok"]


def test_wrong_engine_id(decode, instance_a):
    store = _store(instance_a)
    with running("zmq", store) as server, manager(decode, {"zmq": _client("zmq")}) as mgr:
        fut = mgr.connect("prefill-9", HOST, server.port, REMOTE_TP, method="zmq")
        with pytest.raises(HandshakeError, match="is engine 'prefill-0', expected 'prefill-9'"):
            fut.result(30)


def test_wrong_remote_tp(decode, instance_a):
    store = _store(instance_a)
    with running("zmq", store) as server, manager(decode, {"zmq": _client("zmq")}) as mgr:
        fut = mgr.connect("prefill-0", HOST, server.port, 1, method="zmq")
        with pytest.raises(HandshakeError, match="reports tp_size 2, expected 1"):
            fut.result(30)


def test_peer_memory_outside_its_registration(decode, instance_a):
    """A peer whose metadata points outside its registered memory: the handshake fails with
    TransferError (not a raw NIXL exception) and nothing stays connected."""
    store = _store(None)
    for r, a in enumerate(instance_a.agents):
        meta = a.rank_metadata("prefill-0", "epoch-a", r, REMOTE_TP)
        kv = msgspec.structs.replace(meta.kv, base_addrs=[x + (1 << 40) for x in meta.kv.base_addrs])
        store.set_rank(msgspec.structs.replace(meta, kv=kv))
    with running("zmq", store) as server, manager(decode, {"zmq": _client("zmq")}) as mgr:
        fut = mgr.connect("prefill-0", HOST, server.port, REMOTE_TP, method="zmq")
        assert isinstance(fut.exception(timeout=30), TransferError), fut.exception()


def test_bogus_agent_metadata(decode, instance_a):
    store = _store(None)
    for r, a in enumerate(instance_a.agents):
        meta = a.rank_metadata("prefill-0", "epoch-a", r, REMOTE_TP)
        store.set_rank(msgspec.structs.replace(meta, agent_metadata=b"not nixl metadata"))
    with running("zmq", store) as server, manager(decode, {"zmq": _client("zmq")}) as mgr:
        fut = mgr.connect("prefill-0", HOST, server.port, REMOTE_TP, method="zmq")
        assert isinstance(fut.exception(timeout=30), TransferError), fut.exception()


def test_read_after_the_remote_agent_was_removed_is_a_transfer_error(decode, instance_a):
    """Two RemoteRanks on the same remote agent: once one is disconnected (the agent removed),
    a READ on the other fails as TransferError, not as a raw NIXL exception."""
    meta = instance_a.agents[0].rank_metadata("prefill-0", "epoch-a", 0, REMOTE_TP)
    slices = [s for s in plan_reads(0, 1, REMOTE_TP, HEADS) if s.remote_rank == 0]
    first = decode.connect(meta, slices)
    second = decode.connect(meta, slices)
    decode.wait(decode.read(second, LOCAL_BLOCKS, REMOTE_BLOCKS, b"ok"), 30)
    decode.disconnect(first)
    with pytest.raises(TransferError, match="could not be built"):
        decode.read(second, LOCAL_BLOCKS, REMOTE_BLOCKS, b"gone")
    decode.disconnect(second)


def test_a_silent_peer_never_delays_another(decode, instance_a):
    """Handshakes to different peers run side by side: one whose side channel accepts
    and never answers does not hold up a healthy one."""
    store = _store(instance_a)
    # The manager outermost: the silent server closes its connection first on the way
    # out, so the stuck handshake ends there rather than at its 20 s timeout.
    with manager(decode, {"http": _client("http", timeout=20)}) as mgr, \
            RawServer(lambda conn: conn.recv(1 << 16) and threading.Event().wait(30)) as silent, \
            running("http", store) as server:
        stuck = mgr.connect("silent-0", HOST, silent.port, REMOTE_TP, method="http")
        healthy = mgr.connect("prefill-0", HOST, server.port, REMOTE_TP, method="http")
        assert healthy.result(15).engine_id == "prefill-0"
        assert not stuck.done()  # still waiting for its 20 s timeout
