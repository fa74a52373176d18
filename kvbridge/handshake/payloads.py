"""Opaque per-rank payloads on the side channel: for engines that encode their own metadata.

A ``PayloadStore`` is a ``MetadataStore`` whose ranks are bytes kvbridge does not read
(vLLM's ``NixlHandshakePayload``), keyed by (pp_rank, tp_rank). The http and etcd servers
serve it unchanged: ``/v1/kv/handshake`` answers every rank, ``/v1/kv/handshake/{tp_rank}``
every pipeline stage of that tensor rank, ``/readyz`` is 200 once every rank is in. Replies
are ``PayloadEnvelope`` (kvbridge.metadata), encoded per request so that ``clock`` is the
time of the answer. ``HandshakeClient.fetch_payloads`` is the client side: one deadline, the transport's
retries inside it. See docs/protocol.md, "Opaque payloads".
"""

from __future__ import annotations

import base64
import time
from collections.abc import Callable
from typing import Any

from kvbridge.handshake.base import FetchedPayloads, HandshakeClient, MetadataStore, Rank, Reply
from kvbridge.metadata import (
    PAYLOAD_SCHEMA_VERSION,
    Compat,
    PayloadEnvelope,
    RankPayload,
    encode_payload_envelope,
)

# Turns one payload into something a person can read in the JSON view.
Describe = Callable[[bytes], dict[str, Any]]


class PayloadStore(MetadataStore):
    """Every (pp_rank, tp_rank)'s opaque payload of this instance. Thread-safe."""

    def __init__(self, kind: str, engine_id: str, epoch: str, tp_size: int, pp_size: int = 1,
                 describe: Describe | None = None):
        # No kvbridge Compat: the engine checks compatibility inside its payloads.
        super().__init__(compat=Compat(schema_version=0, model="", dtype="", total_kv_heads=0,
                                       head_dim=0, num_layers=0, layout="", block_size=0),
                         tp_size=tp_size)
        self.kind = kind
        self.engine_id = engine_id
        self.epoch = epoch
        self.pp_size = pp_size
        self.describe = describe
        self._payloads: dict[Rank, bytes] = {}
        # Each payload's JSON view, made once per change (and so carried to a side-channel
        # process, which need not import what ``describe`` does).
        self._described: dict[Rank, dict[str, Any]] = {}

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        state["describe"] = None
        return state

    def set_rank(self, meta: object) -> None:  # a RankMetadata has no place here
        raise TypeError("PayloadStore holds opaque payloads: use set_payloads")

    def set_payloads(self, payloads: dict[Rank, bytes],
                     described: dict[Rank, dict[str, Any]] | None = None) -> None:
        """Serve ``payloads`` from now on (each given rank replaced). ``described``: their
        JSON views, made elsewhere (default: by ``describe``, if any)."""
        for pp, tp in payloads:
            if not (0 <= pp < self.pp_size and 0 <= tp < self.tp_size):
                raise ValueError(f"rank (pp {pp}, tp {tp}) does not fit pp_size {self.pp_size} "
                                 f"tp_size {self.tp_size}")
        if described is None:
            described = {rank: self._describe(p) for rank, p in payloads.items()}
        with self._lock:
            self._payloads.update(payloads)
            self._described.update(described)

    def payloads(self) -> tuple[dict[Rank, bytes], dict[Rank, dict[str, Any]]]:
        """Every rank's payload and JSON view, as held now (copies)."""
        with self._lock:
            return dict(self._payloads), dict(self._described)

    def _describe(self, payload: bytes) -> dict[str, Any]:
        if self.describe is None:
            return {"payload": base64.b64encode(payload).decode()}
        try:
            return self.describe(payload)
        except Exception as e:  # the view must not fail on what it only shows
            return {"describe_error": f"{type(e).__name__}: {e}"}

    @property
    def expected(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def ready(self) -> bool:
        with self._lock:
            if len(self._payloads) != self.expected:
                return False
        return self.health is None or self.health() is None

    def _select(self, tp_rank: int | None) -> list[RankPayload]:
        return [RankPayload(pp_rank=pp, tp_rank=tp, payload=p)
                for (pp, tp), p in sorted(self._payloads.items())
                if tp_rank is None or tp == tp_rank]

    def reply(self, tp_rank: int | None) -> Reply:
        if self.health is not None and (why := self.health()) is not None:
            return Reply(503, error=f"not ready: {why}")
        with self._lock:
            if len(self._payloads) < self.expected:
                return Reply(503, error=f"metadata of {len(self._payloads)}/{self.expected} "
                                        "ranks in; not ready")
            if tp_rank is not None and not 0 <= tp_rank < self.tp_size:
                return Reply(404, error=f"no tp_rank {tp_rank}: tp_size is {self.tp_size}")
            ranks = self._select(tp_rank)
        return Reply(200, encode_payload_envelope(PayloadEnvelope(
            payload_schema=PAYLOAD_SCHEMA_VERSION, kind=self.kind, engine_id=self.engine_id,
            epoch=self.epoch, clock=time.perf_counter(), wall=time.time(), ranks=ranks)))

    def json_view(self, tp_rank: int | None) -> dict:
        with self._lock:
            ranks = self._select(tp_rank)
            described = dict(self._described)
        out = []
        for r in ranks:
            item: dict[str, Any] = {"pp_rank": r.pp_rank, "tp_rank": r.tp_rank,
                                    "payload_bytes": len(r.payload)}
            item.update(described.get((r.pp_rank, r.tp_rank), {}))
            out.append(item)
        return {"payload_schema": PAYLOAD_SCHEMA_VERSION, "kind": self.kind,
                "engine_id": self.engine_id, "epoch": self.epoch, "tp_size": self.tp_size,
                "pp_size": self.pp_size, "ranks": out}


def fetch_payloads(client: HandshakeClient, kind: str, host: str, port: int,
                   ranks: list[Rank], *, expected_engine_id: str | None = None
                   ) -> FetchedPayloads:
    """``client.fetch_payloads``, as a function."""
    return client.fetch_payloads(kind, host, port, ranks,
                                 expected_engine_id=expected_engine_id)
