"""Per-worker "finished" reports folded into per-request completions (head process).

A request is done only when every worker that takes part has reported it. A
worker that reports nothing in a step (``None``) is simply skipped: that was
the crash the seed's fix addresses (``kv_connector_output is None``).
"""

from __future__ import annotations

from collections.abc import Iterable

from kvbridge.errors import LoadFailure
from kvbridge.tp_mapping import consumers


class LoadAggregator:
    """Decode side: a load is finished when all ``tp_size`` workers reported it.

    The first error reported by any worker is the request's error.
    """

    def __init__(self, tp_size: int):
        self.tp_size = tp_size
        self._remaining: dict[str, int] = {}
        self._errors: dict[str, LoadFailure] = {}

    def expect(self, request_id: str) -> None:
        self._remaining[request_id] = self.tp_size

    def fold(self, ok: Iterable[str], failed: dict[str, LoadFailure]
             ) -> dict[str, LoadFailure | None]:
        """One worker's report; returns requests now complete (None = success)."""
        done: dict[str, LoadFailure | None] = {}
        for rid, err in [*((r, None) for r in ok), *failed.items()]:
            if rid not in self._remaining:
                continue  # aborted meanwhile, or a duplicate report
            if err is not None:
                self._errors.setdefault(rid, err)
            self._remaining[rid] -= 1
            if self._remaining[rid] == 0:
                del self._remaining[rid]
                done[rid] = self._errors.pop(rid, None)
        return done

    def forget(self, request_id: str) -> None:
        self._remaining.pop(request_id, None)
        self._errors.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._remaining)


class SendAggregator:
    """Prefill side: held blocks are released once every consumer rank has read them.

    Each decode rank that read from prefill rank ``p`` notifies ``p`` once, naming
    the decode TP size; from it the head knows how many notifications each
    prefill rank must see (``tp_mapping.consumers``), including ranks nobody reads.
    """

    def __init__(self, tp_size: int, total_kv_heads: int):
        self.tp_size = tp_size
        self.total_kv_heads = total_kv_heads
        self._seen: dict[str, dict[int, set[int]]] = {}
        self._decode_tp: dict[str, int] = {}

    def fold(self, prefill_rank: int, notes: Iterable[tuple[str, int, int]],
             held: Iterable[str]) -> set[str]:
        """Notifications ``(request_id, decode_rank, decode_tp)`` received by one rank;
        returns the held requests now fully read."""
        held = set(held)
        done = set()
        for rid, d_rank, d_tp in notes:
            if rid not in held:
                continue  # lease already expired, or not ours
            self._decode_tp.setdefault(rid, d_tp)
            self._seen.setdefault(rid, {}).setdefault(prefill_rank, set()).add(d_rank)
            if self._complete(rid):
                done.add(rid)
        for rid in done:
            self.forget(rid)
        return done

    def _complete(self, rid: str) -> bool:
        d_tp = self._decode_tp[rid]
        seen = self._seen.get(rid, {})
        return all(set(consumers(p, self.tp_size, d_tp, self.total_kv_heads)) <= seen.get(p, set())
                   for p in range(self.tp_size))

    def forget(self, request_id: str) -> None:
        self._seen.pop(request_id, None)
        self._decode_tp.pop(request_id, None)
