"""Prefill and decode as separate OS processes, each rank with its own NIXL agent:
handshake over http (TLS + token) and zmq, READ blocks, byte-compare every head slice."""

from __future__ import annotations

import pytest

from kvbridge.tp_mapping import rank_heads, remote_ranks
from tests.conftest import run_decode
from tests.helpers import wait_until

TOKEN = "s3cret-token"
TPS = [1, 2, 4]


def _decode(peer, method: str, tps: list[int], certs, *extra: str) -> dict[str, list[dict]]:
    info = peer.info
    port = info["http_port"] if method == "http" else info["zmq_port"]
    args = ["--tp", ",".join(map(str, tps)), "--remote-tp", str(len(info["agents"])), "--method", method,
            "--port", str(port), "--engine-id", info["engine_id"], "--epoch", info["epoch"],
            "--token", TOKEN, *extra]
    if method == "http":
        args += ["--certs", str(certs)]
    return run_decode(*args)


@pytest.mark.parametrize("method", ["http", "zmq"])
@pytest.mark.parametrize("prefill_tp", TPS)
def test_read_every_head_slice(prefill_peers, certs, method, prefill_tp):
    """Decode TP 1, 2 and 4 (one decode process, one instance after another)."""
    peer = prefill_peers("--tp", str(prefill_tp), "--token", TOKEN, "--certs", str(certs),
                         "--require-client-cert")
    before = peer.notifs()
    by_tp = _decode(peer, method, TPS, certs)
    assert sorted(map(int, by_tp)) == TPS
    reads = 0
    for decode_tp in TPS:
        results = by_tp[str(decode_tp)]
        assert len(results) == decode_tp
        _check(results, decode_tp, prefill_tp)
        reads += sum(len(r["remote_ranks"]) for r in results)
    # every READ's notification reached the prefill rank it read from (they travel on
    # their own: polled until all are in, then exactly as many as READs)
    def got() -> int:
        return sum(map(len, peer.notifs().values())) - sum(map(len, before.values()))

    wait_until(lambda: got() >= reads, 10, "every READ's notification")
    assert got() == reads


def _check(results: list[dict], decode_tp: int, prefill_tp: int) -> None:
    for rank, res in enumerate(results):
        assert "error" not in res, res
        assert res["heads"] == list(rank_heads(rank, decode_tp, 4))
        # only the prefill ranks holding this rank's heads were contacted
        assert res["remote_ranks"] == remote_ranks(rank, decode_tp, prefill_tp, 4)
        assert res["bytes_checked"] > 0
        assert res["mismatched"] == 0, res


def test_gqa_replicated_heads_read_once(prefill_peers, certs):
    """2 KV heads, prefill TP 4 (each head on two ranks), decode TP 4: each decode rank
    reads its one head from exactly one prefill rank, and the replicas are spread."""
    peer = prefill_peers("--tp", "4", "--heads", "2", "--token", TOKEN)
    results = _decode(peer, "zmq", [4], certs, "--heads", "2")["4"]
    for res in results:
        assert res["mismatched"] == 0 and len(res["remote_ranks"]) == 1, res
    assert len({tuple(r["remote_ranks"]) for r in results}) == 4
