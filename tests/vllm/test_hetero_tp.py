"""Heterogeneous tensor parallelism through the plug-in in real vLLM, over http: a prefill
at TP 1 read by a decode at TP 2, and a prefill at TP 2 read by a decode at TP 1.

SmolLM2-135M's 3 KV heads do not split over 2 ranks, so the module writes a 2-layer Llama
with 2 KV heads (head_dim 64) and random weights (kvbridge.tools.testing.checkpoints), with
SmolLM2's tokenizer. Two servers, each both prefill and decode (``kv_both``): ``tp1`` on
core 0, ``tp2`` with both ranks on core 1 (instances on disjoint cores: with ``tp2`` on
``0|1``, core 0 double-booked, decode handshakes timed out in 4 of 8 runs; docs/vllm.md
§5d). Each direction checks the decode's greedy text against its own answer computed
without a transfer, the NIXL bytes read against the exact size of the prompt's KV blocks
(each TP-2 decode rank reads its half of the heads, a TP-1 decode both halves, one from
each prefill rank), the READs validated by block tags, and that each decode rank
handshook only with the prefill rank(s) it reads from."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvbridge.tools.testing.checkpoints import random_llama
from kvbridge.tools.vllm.launch import VllmServer, decode, prefill
from tests.helpers import wait_until
from tests.vllm.conftest import (
    MAX_TOKENS,
    PROMPT,
    REQUEST_TIMEOUT,
    answer,
    kv_reads,
    nixl_bytes,
    running,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

LAYERS, KV_HEADS, HEAD_DIM, BLOCK = 2, 2, 64, 128
# One block's K and V, every layer and KV head, float32: what a READ of one block moves in
# all (a TP-2 side holds half of the heads on each rank).
BLOCK_BYTES = LAYERS * 2 * KV_HEADS * BLOCK * HEAD_DIM * 4
ARGS = ["--block-size", str(BLOCK), "--no-enable-prefix-caching"]


@pytest.fixture(scope="module")
def servers(model: Path, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[dict[str, VllmServer]]:
    d = tmp_path_factory.mktemp("vllm-hetero-tp")
    ckpt = random_llama(d / "ckpt", model, kv_heads=KV_HEADS, heads=4, head_dim=HEAD_DIM,
                        layers=LAYERS)
    http = {"handshake_method": "http"}
    tp1 = VllmServer.start(ckpt, name="tp1", core=0, log_dir=d, max_model_len=512,
                           extra_config=http, extra_args=ARGS)
    tp2 = VllmServer.start(ckpt, name="tp2", core="1|1", log_dir=d, max_model_len=512,
                           tensor_parallel_size=2, extra_config=http, extra_args=ARGS)
    with running(tp1, tp2):
        yield {"tp1": tp1, "tp2": tp2}


@pytest.mark.parametrize(("p_name", "d_name", "ranks_per_decode_rank", "decode_ranks"),
                         [("tp1", "tp2", 1, 2), ("tp2", "tp1", 2, 1)],
                         ids=["prefill-tp1-to-decode-tp2", "prefill-tp2-to-decode-tp1"])
def test_each_decode_rank_reads_its_share_and_answers_the_same(
        servers, p_name: str, d_name: str, ranks_per_decode_rank: int, decode_ranks: int):
    p, d = servers[p_name], servers[d_name]
    expected = answer(d)
    params = prefill(p.url, PROMPT, REQUEST_TIMEOUT)
    blocks = params["remote_block_ids"][0]
    validated, before = kv_reads(d, "validated"), nixl_bytes(d)
    r = decode(d.url, PROMPT, params, max_tokens=MAX_TOKENS, timeout=REQUEST_TIMEOUT)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == expected
    assert nixl_bytes(d) - before == len(blocks) * BLOCK_BYTES
    wait_until(lambda: kv_reads(d, "validated") == validated + decode_ranks, 30,
               "every decode rank's READ is validated")
    line = (f"kvbridge handshake: http 127.0.0.1:{p.side_channel_port} engine "
            f"{params['remote_engine_id']} epoch ")
    handshakes = [s for s in d.log_text().splitlines() if line in s]
    assert len(handshakes) == decode_ranks, handshakes
    assert all(s.endswith(f", {ranks_per_decode_rank} rank(s)") for s in handshakes), handshakes
