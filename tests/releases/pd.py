"""Driving P/D between release-tier nodes: prompts, a held prefill, a decode's READ, and the
stats the tests read."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.releases.conftest import Node

BLOCK = 32  # the CPU attention's block sizes are multiples of 32
LEASE_S = 5  # a held request's blocks are freed this long after the prefill computed it
TOKEN = "release-tier-secret"


def prompt(seed: int, n: int = 100) -> list[int]:
    return [3 + (seed * 7919 + i * 104729) % 990 for i in range(n)]


def https(certs: Path, name: str, token_file: Path) -> dict[str, Any]:
    return {"handshake_method": "http", "ssl_certfile": str(certs / f"{name}.pem"),
            "ssl_keyfile": str(certs / f"{name}.key"), "ssl_ca_certs": str(certs / "ca.pem"),
            "ssl_cert_reqs": "required", "token_file": str(token_file),
            "trusted_side_channels": "127.0.0.1"}


def held(p: Node, req_id: str, tokens: list[int]) -> dict[str, Any]:
    """The prefill computes ``req_id`` and holds its KV: its ``kv_transfer_params``."""
    p("add", req_id=req_id, prompt=tokens, max_tokens=1, params={"do_remote_decode": True})
    out = p("run", req_ids=[req_id], timeout=60)
    assert not out["timeout"], out
    params = out["events"][req_id]["kv_transfer_params"]
    assert params and params["remote_block_ids"], out["events"][req_id]
    return params


def read(d: Node, req_id: str, tokens: list[int], params: dict[str, Any],
         max_tokens: int = 4) -> dict[str, Any]:
    """The decode READs ``req_id``'s KV with ``params`` and generates: its events, and what
    its blocks held when its first forward came (``loaded``: tokens checked, wrong ones)."""
    d("add", req_id=req_id, prompt=tokens, max_tokens=max_tokens, params=params)
    out = d("run", req_ids=[req_id], timeout=60)
    assert not out["timeout"], (out, d.log_tail())
    return {"event": out["events"][req_id], "loaded": out["loaded"].get(req_id)}


def reads(node: Node, result: str) -> int:
    return int(node.stats().get("kvbridge_kv_reads", {}).get(result, 0))


def ignored(node: Node, why: str) -> int:
    return int(node.stats().get("kvbridge_notes_ignored", {}).get(why, 0))


def assert_read_whole(result: dict[str, Any], tokens: list[int]) -> None:
    assert result["event"]["finished"] == "length", result
    assert len(result["event"]["output"]) == 4
    loaded = result["loaded"]
    assert loaded is not None, "the decode computed the prompt instead of reading it"
    assert loaded["tokens"] == len(tokens) - 1 and loaded["wrong"] == 0, loaded


def rank_reads(node: Node, result: str) -> dict[int, int]:
    """Each worker rank's READs with ``result``, before vLLM's aggregator adds them up."""
    return {int(rank): int(stats.get("kvbridge_kv_reads", {}).get(result, 0))
            for rank, stats in node("state")["rank_stats"].items()}


def handshake_lines(d: Node, p: Node) -> list[str]:
    """The plug-in's log line of each handshake ``d``'s worker ranks made with ``p``."""
    line = f"kvbridge handshake: http 127.0.0.1:{p.info['port']} engine {p.engine_id} "
    return [s for s in d.log_text().splitlines() if line in s]


def republishes(p: Node) -> int:
    """How many times ``p``'s side channel took new payloads from vLLM's engine core."""
    line = f"kvbridge side channel: republished {p.info['tp']} rank(s) of engine {p.engine_id}"
    return sum(line in s for s in p.log_text().splitlines())
