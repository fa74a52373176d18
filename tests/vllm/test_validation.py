"""No silently wrong answer inside vLLM: the plug-in validates every READ (block tags,
kvbridge.vllm.validation) in real vLLM.

Three plug-in servers for the module: a prefill with a small KV cache (24 blocks of 32
tokens, so released blocks are soon reused) and a 6 s lease, and two decodes whose
``kv_load_failure_policy`` is ``recompute``: one with the prefill's block size, one with
vLLM's default (prefills and decodes are often tuned apart). Each test hands the decode ``kv_transfer_params``
that point at the wrong KV (blocks released and reused, reordered block ids, another
prompt's blocks): stock vLLM answers those with a 200 and another prompt's text; here the
answer equals the decode's own (computed without any transfer), and
``vllm:kvbridge_kv_reads{result="stale"}`` counts the READ."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvbridge.tools.testing.prometheus import labelled_total, parse_samples
from kvbridge.tools.vllm.launch import VllmServer, completion, decode, prefill
from tests.helpers import wait_until
from tests.vllm.conftest import (
    REQUEST_TIMEOUT,
    answer,
    kv_reads,
    nixl_bytes,
    num_tokens,
    running,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

SMALL = ["--block-size", "32", "--num-gpu-blocks-override", "24", "--no-enable-prefix-caching"]
MAX_LEN = 640
LEASE_S = 6
TOKENS = 12
# 35 tokens: two blocks of 32, and an answer that is real text (not an end of sequence).
A = ("Question: What is the capital of France, and which river flows through it? Name the "
     "river and one famous bridge that crosses it. Answer in one sentence.\nAnswer:")


@pytest.fixture(scope="module")
def all_servers(model: Path, tmp_path_factory: pytest.TempPathFactory
                ) -> Iterator[tuple[VllmServer, VllmServer, VllmServer]]:
    d = tmp_path_factory.mktemp("vllm-validation")
    p = VllmServer.start(model, name="prefill", core=0, log_dir=d, max_model_len=MAX_LEN,
                         extra_config={"handshake_method": "http",
                                       "kv_lease_duration": LEASE_S},
                         extra_args=SMALL)
    dec = VllmServer.start(model, name="decode", core=1, log_dir=d, max_model_len=MAX_LEN,
                           extra_config={"handshake_method": "http", "side_channel_port": 0},
                           extra_args=SMALL, kv_load_failure_policy="recompute")
    other = VllmServer.start(model, name="decode-default-block-size", core=1, log_dir=d,
                             max_model_len=MAX_LEN,
                             extra_config={"handshake_method": "http", "side_channel_port": 0},
                             extra_args=["--no-enable-prefix-caching"],
                             kv_load_failure_policy="recompute")
    with running(p, dec, other):
        yield p, dec, other


@pytest.fixture
def servers(all_servers) -> tuple[VllmServer, VllmServer]:
    """The prefill and the decode of the same block size."""
    return all_servers[0], all_servers[1]


def notes_ignored(server: VllmServer, why: str) -> float:
    samples = parse_samples(httpx.get(f"{server.url}/metrics", timeout=60).text)
    return labelled_total(samples, "vllm:kvbridge_notes_ignored_total", why=why)


def _decoded(d: VllmServer, prompt: str, params: dict) -> str:
    r = decode(d.url, prompt, params, max_tokens=TOKENS, timeout=REQUEST_TIMEOUT)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def _stale_read(d: VllmServer, prompt: str, params: dict, why: str = "stale") -> None:
    """The decode answers ``prompt`` with its own text, after one READ found ``why``."""
    expected = answer(d, prompt)
    assert expected.strip()  # real text, or the comparison proves nothing
    before = kv_reads(d, why)
    assert _decoded(d, prompt, params) == expected
    wait_until(lambda: kv_reads(d, why) == before + 1, 30,
               f'vllm:kvbridge_kv_reads{{result="{why}"}} counts the READ')


def test_a_valid_read_is_validated_and_used(servers):
    p, d = servers
    expected = answer(d, A)
    assert expected.strip()
    validated, bytes_before = kv_reads(d, "validated"), nixl_bytes(d)
    assert _decoded(d, A, prefill(p.url, A, REQUEST_TIMEOUT)) == expected
    assert nixl_bytes(d) > bytes_before  # the KV was read, not recomputed
    wait_until(lambda: kv_reads(d, "validated") == validated + 1, 30,
               'vllm:kvbridge_kv_reads{result="validated"} counts the READ')
    assert kv_reads(d, "stale") == 0


def test_a_read_across_block_sizes_is_recomputed_never_served(all_servers):
    """vLLM's own READ from a prefill at 32 into a decode at its default block size puts
    the KV in the wrong places (stock vLLM answers a 200 with garbage text; so did the
    plug-in once it validated the prefill's tags): refused, and recomputed here."""
    p, _, d = all_servers
    _stale_read(d, A, prefill(p.url, A, REQUEST_TIMEOUT), why="block_size_mismatch")
    assert kv_reads(d, "validated") == 0 and kv_reads(d, "unvalidated") == 0


@pytest.mark.parametrize("decode_index", [1, 2], ids=["same-block-size", "default-block-size"])
def test_blocks_released_after_the_lease_and_reused_are_recomputed(all_servers, decode_index):
    """The issue's repro: stock vLLM answers it with another prompt's text. With the
    decode's block size other than the prefill's, the plug-in once dropped the prefill's
    tags and served the reused blocks (a 200 with another prompt's text)."""
    p, d = all_servers[0], all_servers[decode_index]
    why = "stale" if decode_index == 1 else "block_size_mismatch"
    params = prefill(p.url, A, REQUEST_TIMEOUT)
    expired = f"Releasing expired KV blocks for request {params['remote_request_id']}"
    wait_until(lambda: expired in p.log_text(), 60, "the prefill's lease runs out")
    for i in range(3):  # the freed blocks get other prompts' KV
        prompt = " ".join(f"word{i}{j}" for j in range(100))  # ~400 of the 768 tokens
        completion(p.url, prompt, max_tokens=1, timeout=REQUEST_TIMEOUT).raise_for_status()
    _stale_read(d, A, params, why)


def test_reordered_block_ids_are_recomputed(servers):
    p, d = servers
    params = prefill(p.url, A, REQUEST_TIMEOUT)
    assert len(params["remote_block_ids"][0]) >= 2
    params["remote_block_ids"] = [list(reversed(params["remote_block_ids"][0]))]
    _stale_read(d, A, params)


def test_another_prompts_params_of_the_same_length_are_recomputed(servers):
    p, d = servers
    b = A.replace("France", "Spain")
    assert b != A and num_tokens(d, b) == num_tokens(d, A)
    _stale_read(d, b, prefill(p.url, A, REQUEST_TIMEOUT))


def _forger(p: VllmServer) -> tuple[Any, str]:
    """A NIXL agent of our own that knows the prefill's rank 0, as anyone who can reach its
    NIXL port and fetch its metadata can: (the agent, the prefill's agent name). Made before
    the hold exists: importing vLLM's metadata types here takes longer than the lease."""
    import msgspec
    from nixl._api import nixl_agent
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
        NixlAgentMetadata,
        NixlHandshakePayload,
    )

    from kvbridge.config import SideChannelConfig
    from kvbridge.handshake.factory import make_client
    from kvbridge.handshake.payloads import fetch_payloads
    from kvbridge.vllm.nixl_payload import PAYLOAD_KIND

    client = make_client(SideChannelConfig(handshake_method="http"), None)
    try:
        fetched = fetch_payloads(client, PAYLOAD_KIND, "127.0.0.1", p.side_channel_port,
                                 [(0, 0)])
    finally:
        client.close()
    payload = msgspec.msgpack.decode(fetched.payloads[(0, 0)], type=NixlHandshakePayload)
    meta = msgspec.msgpack.decode(payload.agent_metadata_bytes, type=NixlAgentMetadata)
    agent = nixl_agent("forger")
    return agent, agent.add_remote_agent(meta.agent_metadata)


def _wired(p: VllmServer, forger: Any, prefill_agent: str) -> None:
    """Wire the forger's NIXL connection to the prefill before a lease is timed: the first
    note on a new connection waits for its wire-up, which a loaded machine can stretch
    towards a lease. A note naming no request, sent while a hold keeps vLLM's engine
    stepping (it reads notes only then), which vLLM counts as a note after expiry."""
    after = p.metrics().get("vllm:nixl_num_notifications_after_expiry_total", 0.0)
    prefill(p.url, A, REQUEST_TIMEOUT)  # held for the lease: the engine steps meanwhile
    forger.send_notif(prefill_agent, notif_msg=b"kvbridge-test-wire-up:1")
    wait_until(lambda: p.metrics().get("vllm:nixl_num_notifications_after_expiry_total", 0.0)
               > after, 60, "the forger's first note reaches the prefill")


def test_a_forged_read_done_note_without_the_holds_key_releases_nothing(servers):
    """vLLM's note format, naming a held request, from an agent without the key: the hold
    stays until its lease runs out (stock vLLM frees the blocks at once)."""
    p, _ = servers
    forger, prefill_agent = _forger(p)
    _wired(p, forger, prefill_agent)
    ignored = p.metrics().get("vllm:kvbridge_notes_ignored_total", 0.0)
    params = prefill(p.url, A, REQUEST_TIMEOUT)
    rid = params["remote_request_id"]
    forger.send_notif(prefill_agent, notif_msg=f"{rid}:1".encode())

    def seen() -> str:  # what the prefill said of the request, should a wait fail
        return " | ".join(line for line in p.log_text().splitlines() if rid in line)

    wait_until(lambda: p.metrics().get("vllm:kvbridge_notes_ignored_total", 0.0)
               == ignored + 1, 60, "the prefill counts the note it ignored", message=seen)
    # Held until the lease: vLLM logs an expiry only for blocks still held then (with
    # hold_keys off, the note frees them at once and this never comes).
    wait_until(lambda: f"Releasing expired KV blocks for request {rid}" in p.log_text(),
               60, "the hold outlives the forged note and expires with its lease", message=seen)
    assert "released nothing" in p.log_text()
    assert params.get("kvbridge_hold_key")  # the capability, for whoever decodes
    del forger


def test_a_malformed_note_is_dropped_and_the_prefill_keeps_serving(servers):
    """vLLM parses notes in its engine step: one that does not parse raised there and took
    the engine (and its API server) down. The plug-in drops it and counts it."""
    p, d = servers
    forger, prefill_agent = _forger(p)
    _wired(p, forger, prefill_agent)
    before = notes_ignored(p, "malformed")
    prefill(p.url, A, REQUEST_TIMEOUT)  # a hold keeps the engine stepping: notes are read
    for note in (b"garbage-without-colon", b"x:notanumber", b"\xff\xfe:1"):
        forger.send_notif(prefill_agent, notif_msg=note)
    wait_until(lambda: notes_ignored(p, "malformed") == before + 3, 60,
               "the prefill counts the three malformed notes")
    expected = answer(d, A)
    assert _decoded(d, A, prefill(p.url, A, REQUEST_TIMEOUT)) == expected
    assert "malformed NIXL note" in p.log_text()
    del forger
