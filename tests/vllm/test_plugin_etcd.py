"""The plug-in in real vLLM over the ``etcd`` method: the prefill publishes every rank's
payload under ``/kvbridge/v1/handshake/HOST:PORT/`` in a real etcd (no side-channel
socket), the decode reads it there; P/D with vLLM's protocol, then a prefill restarted on
the same ports, picked up by the decode under its new epoch without a decode restart."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvbridge.tools.launch import free_port
from kvbridge.tools.testing.etcd_server import EtcdProcess
from kvbridge.tools.vllm.launch import VllmServer, decode, prefill
from tests.helpers import wait_until
from tests.vllm.conftest import (
    MAX_TOKENS,
    NO_PREFIX_CACHE,
    PROMPT,
    REQUEST_TIMEOUT,
    answer,
    nixl_bytes,
    running,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdProcess]:
    with EtcdProcess(log_dir=tmp_path_factory.mktemp("etcd-method")) as server:
        yield server


@pytest.fixture(scope="module")
def servers(model: Path, etcd: EtcdProcess, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[tuple[VllmServer, VllmServer]]:
    d = tmp_path_factory.mktemp("vllm-etcd")

    def method(port: int) -> dict[str, object]:
        # the port names the record (HOST:PORT); nothing listens on it
        return {"handshake_method": "etcd", "registry": etcd.url, "side_channel_port": port}

    p = VllmServer.start(model, name="prefill", core=0, log_dir=d, port=free_port(),
                         extra_config=method(free_port()), extra_args=NO_PREFIX_CACHE)
    dec = VllmServer.start(model, name="decode", core=1, log_dir=d,
                           extra_config=method(free_port()), extra_args=NO_PREFIX_CACHE)
    with running(p, dec):
        yield p, dec


def _epoch(p: VllmServer) -> str:
    """The epoch the prefill's scheduler published last (its start-up line)."""
    found = re.findall(r"kvbridge side channel: etcd on .* epoch ([0-9a-f]+)", p.log_text())
    assert found, p.log_tail()
    return found[-1]


def test_pd_over_the_etcd_method_reads_the_kv_and_answers_the_same(servers):
    p, d = servers
    expected = answer(p)
    params = prefill(p.url, PROMPT, REQUEST_TIMEOUT)
    assert params["remote_port"] == p.side_channel_port
    before = nixl_bytes(d)
    r = decode(d.url, PROMPT, params, max_tokens=MAX_TOKENS, timeout=REQUEST_TIMEOUT)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == expected
    assert nixl_bytes(d) > before
    assert f"kvbridge handshake: etcd 127.0.0.1:{p.side_channel_port} engine" in d.log_text()


def test_a_restarted_prefill_is_read_under_its_new_epoch_without_decode_restart(servers):
    p, d = servers
    expected = answer(p)
    first = prefill(p.url, PROMPT, REQUEST_TIMEOUT)["remote_engine_id"]
    old_epoch = _epoch(p)
    p.restart()
    p.wait_healthy(900)
    epoch = _epoch(p)
    assert epoch != old_epoch
    params = prefill(p.url, PROMPT, REQUEST_TIMEOUT)
    assert params["remote_engine_id"] != first
    before = nixl_bytes(d)
    r = decode(d.url, PROMPT, params, max_tokens=MAX_TOKENS, timeout=REQUEST_TIMEOUT)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == expected
    assert nixl_bytes(d) > before
    wait_until(lambda: f"epoch {epoch} (new; was {old_epoch})" in d.log_text(), 10,
               "the decode's log names the restarted prefill's new epoch")
