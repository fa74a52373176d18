"""Push mode (``KVBridgePushConnector``, vLLM's NixlPushConnector) driven through the real
code of vLLM 0.32, 0.33 and 0.34 (tests/releases/node.py): the decode registers its blocks
with a NIXL note after handshaking with the prefill, the prefill handshakes with the decode
and WRITEs into them, both handshakes over kvbridge's side channel. The decode checks every
byte it was written. docs/vllm.md §6c."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from kvbridge.tools.testing.certs import write_certs
from kvbridge.tools.testing.etcd_server import EtcdProcess
from tests.releases.conftest import Node, start_nodes
from tests.releases.test_plugin_on_releases import (
    BLOCK,
    TOKEN,
    _free_port,
    assert_read_whole,
    held,
    https,
    ignored,
    prompt,
    read,
)

# A module's nodes start together: each imports vLLM (15-20 s of CPU), more on loaded cores.
pytestmark = pytest.mark.timeout(900)

PUSH = "KVBridgePushConnector"


@pytest.fixture(scope="module")
def etcd(log_dir: Path) -> Iterator[EtcdProcess]:
    with EtcdProcess(log_dir=log_dir) as server:
        yield server


@pytest.fixture(scope="module")
def nodes(release: str, log_dir: Path, etcd: EtcdProcess) -> Iterator[dict[str, Node]]:
    """Per release, push pairs: https (mutual TLS, a token), vLLM's zmq wire, etcd."""
    (log_dir / "push-certs").mkdir()
    certs = write_certs(log_dir / "push-certs", ("prefill", "decode"))
    token = log_dir / "push-token"
    token.write_text(TOKEN + "\n")
    token.chmod(0o600)
    model = str(log_dir / "push-model")
    base = {"side_channel_host": "127.0.0.1", "side_channel_port": 0}
    etcd_method = {"side_channel_host": "127.0.0.1", "handshake_method": "etcd",
                   "registry": etcd.url}

    def node(extra: dict[str, Any]) -> dict[str, Any]:
        return {"block_size": BLOCK, "num_blocks": 24, "model": model, "connector": PUSH,
                "extra": extra}

    specs = {
        "P": node({**base, **https(certs, "prefill", token)}),
        "D": node({**base, **https(certs, "decode", token)}),
        "Pz": node(base), "Dz": node(base),
        "Pe": node({**etcd_method, "side_channel_port": _free_port()}),
        "De": node({**etcd_method, "side_channel_port": _free_port()}),
    }
    started = start_nodes(release, log_dir, specs)
    try:
        yield started
    finally:
        for n in started.values():
            n.stop()


def written(p: Node, d: Node, req_id: str, tokens: list[int], params: dict[str, Any]
            ) -> dict[str, Any]:
    """The decode registers its blocks for ``req_id``, is written and generates, while the
    prefill steps until its WRITE is done (vLLM's engine keeps a prefill with push work in
    flight stepping: its steps poll the WRITE, as a pull decode's poll its READ)."""
    p.send("run", req_ids=[req_id], until="sent", timeout=90)
    try:
        return read(d, req_id, tokens, params)
    finally:
        assert not p.answer()["timeout"], "the prefill's WRITE never completed"


def pushed(p: Node, d: Node, req_id: str, tokens: list[int]) -> dict[str, Any]:
    """The prefill computes ``req_id`` and holds it; the decode is written: what ``read``
    says of the decode."""
    params = held(p, req_id, tokens)
    assert params["transfer_mode"] == "push" and params.get("kvbridge_hold_key"), params
    return written(p, d, req_id, tokens, params)


@pytest.mark.parametrize("pair", [("P", "D"), ("Pz", "Dz"), ("Pe", "De")],
                         ids=["https", "zmq", "etcd"])
def test_a_push_writes_the_bytes_the_prefill_computed(nodes, release, pair):
    p, d = nodes[pair[0]], nodes[pair[1]]
    assert p.info["version"].startswith(release)
    tokens = prompt(1)
    # Written, and the prefill's hold released on its WRITE (not at the lease's end).
    assert_read_whole(pushed(p, d, f"push-{pair[0]}", tokens), tokens)


def _registration(req_id: str, decode: Node, **fields: Any) -> str:
    """A registration as vLLM's push decode sends it, for ``req_id``, naming ``decode``'s
    engine and side channel and its block 0 (as a node's note() sends it: latin-1)."""
    reg = {"request_id": req_id, "decode_engine_id": decode.engine_id,
           "decode_host": "127.0.0.1", "decode_port": decode.info["port"],
           "decode_tp_size": 1, "local_block_ids": [[0]], "remote_engine_id": "x",
           "remote_host": "127.0.0.1", "remote_port": 9, "remote_tp_size": 1, **fields}
    return (b"PUSH_REG:" + msgspec.msgpack.encode(reg)).decode("latin-1")


def test_a_forged_registration_without_the_holds_key_writes_nothing(nodes):
    """From an agent the prefill knows (the decode's, so the note arrives), a registration
    naming a held request without its key: refused; the real one, with it, is written."""
    p, d = nodes["Pz"], nodes["Dz"]
    tokens = prompt(2)
    assert_read_whole(pushed(p, d, "forge-warm", tokens), tokens)  # the agents know each other
    params = held(p, "forged", tokens)
    p("steps", n=2)  # vLLM hands the finished blocks to the prefill's writer thread
    before = ignored(p, "no_key")
    assert d("note", peer_engine=p.engine_id, message=_registration("forged", d))["ok"]
    assert not p("wait_stat", key="kvbridge_notes_ignored", label="no_key",
                 at_least=before + 1)["timeout"]
    assert_read_whole(written(p, d, "forged", tokens, params), tokens)


@pytest.mark.parametrize("bad", ["fields", "types"])
def test_a_malformed_registration_is_dropped_and_the_request_still_written(nodes, bad):
    """Stock vLLM matches a registration naming a held request before it fails on a missing
    or mistyped field; the real one then matches nothing and the request is never written."""
    p, d = nodes["Pz"], nodes["Dz"]
    tokens = prompt(3)
    assert_read_whole(pushed(p, d, f"malformed-warm-{bad}", tokens), tokens)
    rid = f"malformed-{bad}"
    params = held(p, rid, tokens)
    p("steps", n=2)  # vLLM hands the finished blocks to the prefill's writer thread
    message = ((b"PUSH_REG:" + msgspec.msgpack.encode({"request_id": rid})).decode("latin-1")
               if bad == "fields" else _registration(rid, d, decode_port=str(d.info["port"])))
    before = ignored(p, "malformed")
    assert d("note", peer_engine=p.engine_id, message=message)["ok"]
    assert not p("wait_stat", key="kvbridge_notes_ignored", label="malformed",
                 at_least=before + 1)["timeout"]
    assert_read_whole(written(p, d, rid, tokens, params), tokens)
