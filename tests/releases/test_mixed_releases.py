"""A fleet across releases (docs/vllm.md §4): which pairs read each other. Nodes of two
releases in one test, over vLLM's zmq wire (the same in every release)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.releases.conftest import Node, start_nodes
from tests.releases.pd import BLOCK, assert_read_whole, held, prompt, read

# A module's nodes start together: each imports vLLM (15-20 s of CPU), more on loaded cores.
pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Node]]:
    log_dir = tmp_path_factory.mktemp("vllm-mixed")
    model = str(log_dir / "model")
    base = {"side_channel_host": "127.0.0.1", "side_channel_port": 0}
    lax = {**base, "enforce_handshake_compat": False}
    specs = {
        "P32": {"block_size": BLOCK, "num_blocks": 24, "model": model, "extra": base},
        "P33": {"block_size": BLOCK, "num_blocks": 24, "model": model, "extra": base},
        "D33": {"block_size": BLOCK, "num_blocks": 24, "model": model, "extra": lax},
        "D34": {"block_size": BLOCK, "num_blocks": 24, "model": model, "extra": base},
        "D34lax": {"block_size": BLOCK, "num_blocks": 24, "model": model, "extra": lax},
    }
    releases = {"P32": "0.32", "P33": "0.33", "D33": "0.33", "D34": "0.34", "D34lax": "0.34"}
    nodes = start_nodes(releases, log_dir, specs)
    try:
        yield nodes
    finally:
        for n in nodes.values():
            n.stop()


def test_a_decode_refuses_a_prefill_of_another_release_by_its_hash(fleet):
    p, d = fleet["P33"], fleet["D34"]
    tokens = prompt(20)
    result = read(d, "hash", tokens, held(p, "hash", tokens))
    assert result["event"]["finished"] == "error" and result["loaded"] is None, result
    assert "NIXL compatibility hash mismatch" in d.log_text()


def test_a_034_decode_never_reads_an_older_prefill_even_without_the_hash_check(fleet):
    """0.34's region pairing refuses a prefill whose agent metadata has no region
    members (0.33 and before), whatever enforce_handshake_compat says."""
    p, d = fleet["P33"], fleet["D34lax"]
    tokens = prompt(21)
    result = read(d, "regions", tokens, held(p, "regions", tokens))
    assert result["event"]["finished"] == "error" and result["loaded"] is None, result
    log = d.log_text()
    assert "NIXL compatibility hash mismatch" not in log
    assert "did not advertise the layers of its KV regions" in log


def test_a_033_decode_reads_a_032_prefill_without_the_hash_check(fleet):
    p, d = fleet["P32"], fleet["D33"]
    tokens = prompt(22)
    assert_read_whole(read(d, "across", tokens, held(p, "across", tokens)), tokens)
