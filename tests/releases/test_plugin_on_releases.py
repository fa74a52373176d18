"""The plug-in driven through the real code of vLLM 0.32, 0.33 and 0.34: each release's
``Scheduler`` and ``Request``s, its connector factory and transfer state, its model-runner
connector bracket, with KV caches registered with real NIXL and the side channel between
a prefill and a decode in processes of their own (tests/releases/node.py). No model runs:
a step writes a known value per (token, position, KV head), so the decode checks every byte
it READ. One node runs at TP 2 (a process per rank) for heterogeneous TP and a republish.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvbridge.tools.testing.certs import write_certs
from kvbridge.tools.testing.etcd_server import EtcdProcess
from tests.releases.conftest import Node, start_nodes
from tests.releases.node import NUM_KV_HEADS
from tests.releases.pd import (
    BLOCK,
    LEASE_S,
    TOKEN,
    assert_read_whole,
    handshake_lines,
    held,
    https,
    ignored,
    prompt,
    rank_reads,
    read,
    reads,
    republishes,
)

# A module's nodes start together: each imports vLLM (15-20 s of CPU), more on loaded cores.
pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def etcd(log_dir: Path) -> Iterator[EtcdProcess]:
    with EtcdProcess(log_dir=log_dir) as server:
        yield server


@pytest.fixture(scope="module")
def nodes(release: str, log_dir: Path, etcd: EtcdProcess) -> Iterator[dict[str, Node]]:
    """Per release: an https prefill (mutual TLS, a token, short leases, chunked prefill) with
    a decode of the same block size and one of twice it; a pair over vLLM's zmq wire; a pair
    over the etcd method; an https node at TP 2, which prefills for the decode and decodes
    from it."""
    (log_dir / "certs").mkdir()
    certs = write_certs(log_dir / "certs", ("prefill", "decode", "tp2"))
    token = log_dir / "token"
    token.write_text(TOKEN + "\n")
    token.chmod(0o600)
    model = str(log_dir / "model")
    base = {"side_channel_host": "127.0.0.1", "side_channel_port": 0}
    lease = {"kv_lease_duration": LEASE_S}
    etcd_method = {"side_channel_host": "127.0.0.1", "handshake_method": "etcd",
                   "registry": etcd.url}
    specs = {
        "P": {"block_size": BLOCK, "num_blocks": 24, "batch_tokens": 64, "model": model,
              "extra": {**base, **https(certs, "prefill", token), **lease}},
        "D": {"block_size": BLOCK, "num_blocks": 64, "model": model,
              "extra": {**base, **https(certs, "decode", token)}},
        "D2": {"block_size": 2 * BLOCK, "num_blocks": 32, "model": model,
               "extra": {**base, **https(certs, "decode", token)}},
        "Pz": {"block_size": BLOCK, "num_blocks": 24, "model": model, "extra": base},
        "Dz": {"block_size": BLOCK, "num_blocks": 24, "model": model, "extra": base},
        "Pe": {"block_size": BLOCK, "num_blocks": 24, "model": model,
               "extra": {**etcd_method, "side_channel_port": _free_port()}},
        "De": {"block_size": BLOCK, "num_blocks": 24, "model": model,
               "extra": {**etcd_method, "side_channel_port": _free_port()}},
        "T": {"block_size": BLOCK, "num_blocks": 24, "model": model, "tp": 2,
              "extra": {**base, **https(certs, "tp2", token)}},
    }
    started = start_nodes(release, log_dir, specs)
    try:
        yield started
    finally:
        for n in started.values():
            n.stop()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("pair", [("P", "D"), ("Pz", "Dz"), ("Pe", "De")],
                         ids=["https-token", "vllm-zmq", "etcd"])
def test_a_read_brings_the_bytes_the_prefill_wrote_and_is_validated(nodes, release, pair):
    p, d = nodes[pair[0]], nodes[pair[1]]
    tokens = prompt(1)
    before = reads(d, "validated")
    result = read(d, f"whole-{pair[0]}", tokens, held(p, f"whole-{pair[0]}", tokens))
    assert_read_whole(result, tokens)
    assert reads(d, "validated") == before + 1
    assert nodes["P"].info["bracket"] == ("ActiveKVConnector" if release == "0.34"
                                          else "KVConnectorModelRunnerMixin")


def test_a_read_across_block_sizes_is_refused_never_served(nodes):
    """vLLM's own READ across block sizes misplaces the KV on a CPU server (stock vLLM
    answers a 200 with garbage text): the plug-in refuses it, under vLLM's default
    kv_load_failure_policy (fail) an error, never an answer."""
    p, d2 = nodes["P"], nodes["D2"]
    tokens = prompt(2)
    before = reads(d2, "block_size_mismatch")
    result = read(d2, "bs-whole", tokens, held(p, "bs-whole", tokens))
    assert result["event"]["finished"] == "error" and result["loaded"] is None, result
    assert reads(d2, "block_size_mismatch") == before + 1
    assert reads(d2, "unvalidated") == 0 and reads(d2, "validated") == 0


@pytest.mark.parametrize("decode, why", [("D", "stale"), ("D2", "block_size_mismatch")],
                         ids=["same-block-size", "other-block-size"])
def test_a_read_after_the_lease_ran_out_and_the_blocks_were_reused_is_refused(nodes, decode,
                                                                             why):
    """The public incident: the prefill frees a held request's blocks when its lease runs
    out, other prompts take them, and a decode then handed the old params READs them."""
    p, d = nodes["P"], nodes[decode]
    tokens = prompt(3)
    params = held(p, f"late-{decode}", tokens)
    out = p("run", req_ids=[f"late-{decode}"], until="sent", timeout=LEASE_S * 6)
    assert not out["timeout"], "the prefill never released the hold at its lease's end"
    others = [f"reuse-{decode}-{i}" for i in range(3)]
    for i, r in enumerate(others):  # together they take 21 of the 23 blocks
        p("add", req_id=r, prompt=prompt(10 + i, 7 * BLOCK), max_tokens=1)
    assert not p("run", req_ids=others, timeout=60)["timeout"]
    before = reads(d, why)
    result = read(d, f"late-{decode}", tokens, params)
    assert reads(d, why) == before + 1
    assert reads(d, "unvalidated") == 0
    # vLLM's default kv_load_failure_policy (fail): refused, never answered from reused KV
    assert result["event"]["finished"] == "error", result
    assert result["loaded"] is None, result


def test_a_note_without_the_holds_key_releases_nothing(nodes):
    p, d = nodes["P"], nodes["D"]
    warm = prompt(4)
    assert_read_whole(read(d, "forge-warm", warm, held(p, "forge-warm", warm)), warm)
    tokens = prompt(5)
    params = held(p, "forged", tokens)
    before = ignored(p, "no_key")
    d("note", peer_engine=p.engine_id, message="forged:1")  # vLLM's READ-done note
    assert not p("wait_stat", key="kvbridge_notes_ignored", label="no_key",
                 at_least=before + 1)["timeout"]
    assert "sent" not in p("run", req_ids=[], timeout=1)["events"].get("forged", {})
    assert_read_whole(read(d, "forged", tokens, params), tokens)  # the blocks were kept


@pytest.mark.parametrize("message", ["garbage-without-colon", "x:notanumber", "x:0", "\xff:1"],
                         ids=["no-colon", "count-not-a-number", "count-zero", "not-utf8"])
def test_a_malformed_note_is_dropped_and_the_prefill_keeps_serving(nodes, message):
    p, d = nodes["P"], nodes["D"]
    warm = prompt(6)
    assert_read_whole(read(d, f"note-{message}", warm, held(p, f"note-{message}", warm)), warm)
    before = ignored(p, "malformed")
    d("note", peer_engine=p.engine_id, message=message)
    # vLLM's parse of notes runs in the step that gets it: a raise there fails the node
    assert not p("wait_stat", key="kvbridge_notes_ignored", label="malformed",
                 at_least=before + 1)["timeout"]
    tokens = prompt(7)
    assert_read_whole(read(d, f"after-{message}", tokens, held(p, f"after-{message}", tokens)),
                      tokens)


def test_a_request_preempted_and_resumed_on_the_prefill_is_read_validated(nodes):
    """The prefill computes the prompt in chunks (64 tokens a step); preempted after its
    first chunk, it is resumed (0.32-0.33: ``resumed_req_ids``; 0.34: as a new request)
    into other blocks, and its tags follow it."""
    p, d = nodes["P"], nodes["D"]
    tokens = prompt(8, 150)
    p("add", req_id="preempted", prompt=tokens, max_tokens=1,
      params={"do_remote_decode": True})
    p("steps", n=1)
    p("preempt", req_id="preempted")
    out = p("run", req_ids=["preempted"], timeout=60)
    params = out["events"]["preempted"]["kv_transfer_params"]
    before = reads(d, "validated")
    assert_read_whole(read(d, "preempted", tokens, params), tokens)
    assert reads(d, "validated") == before + 1


def test_the_drift_guard_is_clean_on_the_release(release):
    """Every member the plug-in overrides, every field it reads and every check on the name
    NixlConnector are as recorded for this release (kvbridge/tools/vllm/fingerprints.py)."""
    import os
    import subprocess
    import sys

    from tests.releases.conftest import ROOT, release_path

    path = release_path(release)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(p) for p in (path, ROOT) if p is not None])}
    r = subprocess.run([sys.executable, "-m", "kvbridge.tools.vllm.drift"], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"vLLM {release} (" in r.stdout and "as recorded" in r.stdout


@pytest.mark.parametrize(("p_name", "d_name"), [("D", "T"), ("T", "D")],
                         ids=["prefill-tp1-to-decode-tp2", "prefill-tp2-to-decode-tp1"])
def test_each_decode_rank_reads_its_share_of_the_kv_heads_validated(nodes, p_name, d_name):
    """Heterogeneous TP over https with a token: each rank of a TP-2 decode READs its half
    of the KV heads from the TP-1 prefill; a TP-1 decode READs each half from the TP-2
    prefill rank that holds it. Every value names its global KV head, so each decode rank
    checks every byte of its share, and that it came from the right rank."""
    p, d = nodes[p_name], nodes[d_name]
    p_tp, d_tp = p.info["tp"], d.info["tp"]
    req, tokens = f"tp-{p_name}-{d_name}", prompt(30 + d_tp)
    before = rank_reads(d, "validated")
    result = read(d, req, tokens, held(p, req, tokens))
    assert_read_whole(result, tokens)
    ranks = result["loaded"]["ranks"]
    assert sorted(ranks) == [str(r) for r in range(d_tp)], ranks
    assert all(r["tokens"] == len(tokens) - 1 and r["wrong"] == 0 for r in ranks.values()), ranks
    assert sorted(h for r in ranks.values() for h in r["heads"]) == list(range(NUM_KV_HEADS))
    after = rank_reads(d, "validated")  # each decode rank validated its own READ
    assert [after.get(r, 0) - before.get(r, 0) for r in range(d_tp)] == [1] * d_tp
    assert reads(d, "unvalidated") == 0
    # each decode rank fetched the prefill ranks it reads from: one, or both
    lines = handshake_lines(d, p)
    assert len(lines) >= d_tp, lines
    assert all(s.endswith(f", {max(1, p_tp // d_tp)} rank(s)") for s in lines), lines


def test_sleep_mode_is_accepted_only_where_a_wake_up_republishes(nodes, release):
    """0.33 and 0.34 republish the NIXL metadata after a wake-up (``supports_sleep_mode``,
    a registration generation in the params): vLLM's own check accepts the plug-in with
    sleep mode and it builds. 0.32 has neither: the plug-in refuses sleep mode."""
    p, d = nodes["T"], nodes["D"]
    mode = p("sleep_mode")
    tokens = prompt(35)
    params = held(p, "generation", tokens)
    assert_read_whole(read(d, "generation", tokens, params), tokens)
    if release == "0.32":
        assert not mode["supports_sleep_mode"] and not mode["restore_kv_caches"], mode
        assert "remote_registration_generation" not in params
        assert mode["plugin"] == (
            "ConfigError: kvbridge.vllm: sleep mode needs a vLLM whose wake-up republishes the "
            "NIXL metadata (0.33 and later); with this one decodes would read the KV cache "
            "registered before the sleep")
    else:
        assert mode == {"supports_sleep_mode": True, "restore_kv_caches": True,
                        "vllm_check": "accepted", "plugin": "built"}
        assert params["remote_registration_generation"] >= 1


def test_a_republish_after_a_wake_up_is_picked_up(nodes, release):
    """vLLM's sleep and wake-up of the KV cache on the TP-2 prefill (node.py's ``sleep``
    and ``wake``: every rank's connector unregisters it, its content is lost, the connector
    registers it again, and the engine core hands both ranks' metadata to the plug-in's
    running side channel again). Host memory registered again has the same metadata, so
    vLLM keeps its generation and the decode its handshake; a new registration (a GPU's
    wake-up; node.py's ``rank_wake``) is republished, the generation rises, and the
    decode handshakes again and fetches it. Either way the decode then READs what the
    prefill wrote after the wake-up, validated, every byte right."""
    p, d = nodes["T"], nodes["D"]
    if release == "0.32":  # no republish: sleep mode, which would need it, is refused
        assert p("sleep_mode")["plugin"].startswith("ConfigError: kvbridge.vllm: sleep mode")
        return
    where = {"host": "127.0.0.1", "port": p.info["port"], "engine_id": p.engine_id,
             "ranks": [[0, 0], [0, 1]]}
    tokens = prompt(40)
    first = held(p, "before-sleep", tokens)
    assert_read_whole(read(d, "before-sleep", tokens, first), tokens)
    served = d("fetch_digests", **where)
    assert served == p("payload_digests")
    handshakes, republished = len(handshake_lines(d, p)), republishes(p)

    p("sleep")
    p("wake")
    assert republishes(p) == republished + 1  # the engine core's hand-over reached it
    assert p("payload_digests") == served
    assert d("fetch_digests", **where) == served
    tokens = prompt(41)
    params = held(p, "same-registration", tokens)
    assert params["remote_registration_generation"] == first["remote_registration_generation"]
    validated = reads(d, "validated")
    assert_read_whole(read(d, "same-registration", tokens, params), tokens)
    assert reads(d, "validated") == validated + 1
    assert len(handshake_lines(d, p)) == handshakes

    p("sleep")
    p("wake", new_registration=True)
    new = p("payload_digests")
    assert sorted(new) == sorted(served) and all(new[r] != served[r] for r in served)
    assert d("fetch_digests", **where) == new  # the side channel serves the new payloads
    tokens = prompt(42)
    params = held(p, "new-registration", tokens)
    assert params["remote_registration_generation"] > first["remote_registration_generation"]
    validated = reads(d, "validated")
    assert_read_whole(read(d, "new-registration", tokens, params), tokens)
    assert reads(d, "validated") == validated + 1
    assert len(handshake_lines(d, p)) == handshakes + 1  # picked up: handshaken again
