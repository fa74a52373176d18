"""What the head and the workers tell each other each step (pickled, in-process only)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvbridge.errors import LoadFailure


@dataclass(frozen=True)
class LoadSpec:
    """Read a request's KV from a remote prefill into local blocks."""

    request_id: str
    local_block_ids: list[int]
    remote_block_ids: list[int]
    remote_request_id: str
    remote_engine_id: str
    remote_host: str
    remote_port: int
    remote_tp_size: int
    remote_epoch: str | None
    method: str
    # Seconds from now on within which every READ must be over: the prefill's lease, less
    # a margin, less the time the request already waited. Past it the load is aborted.
    fence_seconds: float = float("inf")
    # The prefill's capability for this hold: READ-done and release notes carry it.
    hold_key: str | None = None
    # The tags the remote blocks must carry for our prompt (kvbridge.kv_tags): READ
    # after the blocks, they validate the load. None: not validated.
    expected_tags: list[int] | None = None


@dataclass(frozen=True)
class PeerSpec:
    """A remote instance to handshake with before any request needs it."""

    engine_id: str
    host: str
    port: int
    tp_size: int
    epoch: str
    method: str


@dataclass
class WorkerMeta:
    loads: list[LoadSpec] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)
    # (remote engine id, remote request id) whose held blocks nobody here will read
    releases: list[tuple[str, str]] = field(default_factory=list)


@dataclass
class WorkerOutput:
    """One worker's news for one step; a worker with no news returns ``None`` instead."""

    tp_rank: int
    loaded: list[str] = field(default_factory=list)
    failed: dict[str, LoadFailure] = field(default_factory=dict)
    # (remote request id, decode rank, decode tp size, hold key) of READs that finished on
    # our blocks, or of releases (decode rank RELEASE_RANK)
    notified: list[tuple[str, int, int, str | None]] = field(default_factory=list)
    # (engine id, method, seconds, outcome) of handshakes that finished on this worker
    handshakes: list[tuple[str, str, float, str]] = field(default_factory=list)

    def empty(self) -> bool:
        return not (self.loaded or self.failed or self.notified or self.handshakes)


# A note with this decode rank says "nobody will read this request's blocks": the decode
# refused the request, or its load failed and is over. Prefills of older versions ignore it.
RELEASE_RANK = -1


def encode_release(remote_request_id: str, hold_key: str | None) -> bytes:
    return encode_notif(remote_request_id, RELEASE_RANK, 0, hold_key)


def encode_notif(remote_request_id: str, tp_rank: int, tp_size: int,
                 hold_key: str | None) -> bytes:
    """``request id|rank|size|k<hold key>`` (without a key the note has three fields,
    which a prefill that issued a key ignores)."""
    tail = "" if hold_key is None else f"|k{hold_key}"
    return f"{remote_request_id}|{tp_rank}|{tp_size}{tail}".encode()


def decode_notif(msg: bytes) -> tuple[str, int, int, str | None] | None:
    """None for a message that is not ours (malformed notes are ignored, not fatal)."""
    try:
        text = msg.decode()
        head, last = text.rsplit("|", 1)
        if last.startswith("k"):
            rid, rank, size = head.rsplit("|", 2)
            return rid, int(rank), int(size), last[1:]
        rid, rank, size = text.rsplit("|", 2)
        return rid, int(rank), int(size), None
    except ValueError:
        return None
