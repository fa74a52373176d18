"""A prefill instance that spans two hosts, read by a decode on a third, on real interfaces.

Host a: prefill head (TP ranks 0, API, scheduler, side channel). Host b: the
prefill's second node (rank 1, ``--headless``). Host c: a TP 2 decode, a TP 1
decode, the head of a TP 2 decode whose rank 1 runs on host d, the proxy and the
client. The tests run in order and share these processes.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from kvbridge.engine.engine import build_engine
from kvbridge.engine.sampling import SamplingParams
from tests.helpers import wait_until
from tests.netns.conftest import START_TIMEOUT, Client, Net, Proc

pytestmark = pytest.mark.slow

MASTER_PORT = "29500"
MAX_TOKENS = 12
PROMPTS = [
    "Two hosts hold the heads of one prefill; the decode reads each half from its own host.",
    "short",
    "The side channel of the head serves the metadata of every rank, " * 4,
]
DECODE_BLOCKS = 96


def _prefill_args(net: Net, tls: Path, node_rank: int, handshake: str) -> list[str]:
    a, b = net.hosts["a"], net.hosts["b"]
    common = ["serve", "--role", "prefill", "--tp", "2", "--nnodes", "2", "--node-rank",
              str(node_rank), "--master-addr", a.addr, "--master-port", MASTER_PORT,
              "--dtype", "float64", "--node-timeout", "120"]
    if node_rank:
        return [*common, "--headless", "--advertise-host", b.addr]
    return [*common, "--host", a.addr, "--port", "8000", "--handshake", handshake,
            "--side-channel-host", a.addr, "--side-channel-port", "5600",
            "--side-channel-token-file", str(tls / "token"),
            "--ssl-certfile", str(tls / "server.pem"), "--ssl-keyfile", str(tls / "server.key")]


class Cluster:
    def __init__(self, net: Net, tls: Path, logs: Path):
        self.net, self.tls, self.logs = net, tls, logs
        a, c = net.hosts["a"], net.hosts["c"]
        self.api = f"https://{a.addr}:8000"
        self.side = f"https://{a.addr}:5600"
        self.decode = f"http://{c.addr}:8000"
        self.proxy = f"http://{c.addr}:8100"
        self.decode_tp1 = f"http://{c.addr}:8001"
        self.decode_nodes = f"http://{c.addr}:8002"
        self.token = (tls / "token").read_text()
        self.procs: dict[str, Proc] = {}
        self.client = Client(c, tls / "ca.pem", logs)

    def start_prefill(self, handshake: str, tag: str) -> tuple[float, float]:
        """Node b first, then the head: the order of start must not matter.
        Returns (seconds until the side channel was ready, seconds for the head alone)."""
        t0 = time.monotonic()
        self.procs["b"] = Proc(self.net.hosts["b"], f"prefill-b{tag}", self.logs,
                               *_prefill_args(self.net, self.tls, 1, handshake))
        t_head = time.monotonic()
        self.procs["a"] = Proc(self.net.hosts["a"], f"prefill-a{tag}", self.logs,
                               *_prefill_args(self.net, self.tls, 0, handshake))
        deadline = time.monotonic() + START_TIMEOUT
        if handshake == "http":
            self.client.wait_status(self.side + "/readyz", 200, deadline,
                                    "prefill side channel", [self.procs["a"], self.procs["b"]])
        # The API starts after every rank of every node is in.
        self.client.wait_status(self.api + "/health", 200, deadline, "prefill API",
                                [self.procs["a"], self.procs["b"]])
        now = time.monotonic()
        return now - t0, now - t_head

    def start_decode_and_proxy(self) -> None:
        c, tls = self.net.hosts["c"], self.tls
        # zmq-configured decode: accepts http prefills too (only http refuses zmq)
        self.procs["c"] = Proc(c, "decode", self.logs, "serve", "--role", "decode", "--tp", "2",
                               "--host", c.addr, "--port", "8000", "--dtype", "float64",
                               "--num-blocks", str(DECODE_BLOCKS), "--handshake", "zmq",
                               "--side-channel-host", c.addr,
                               "--side-channel-ssl-ca-certs", str(tls / "ca.pem"),
                               "--side-channel-token-file", str(tls / "token"),
                               "--trusted-side-channels", "198.18.0.*")
        decode_common = ["serve", "--role", "decode", "--dtype", "float64",
                         "--num-blocks", str(DECODE_BLOCKS), "--handshake", "zmq",
                         "--side-channel-ssl-ca-certs", str(tls / "ca.pem"),
                         "--side-channel-token-file", str(tls / "token"),
                         "--trusted-side-channels", "198.18.0.*"]
        self.procs["c1"] = Proc(c, "decode-tp1", self.logs, *decode_common, "--tp", "1",
                                "--host", c.addr, "--port", "8001", "--side-channel-host", c.addr)
        # A TP 4 decode across hosts c and d (two ranks each); d has its own copies of the
        # CA bundle and token.
        d = self.net.hosts["d"]
        nodes = ["--tp", "4", "--nnodes", "2", "--master-addr", c.addr, "--master-port", "29501"]
        self.procs["d"] = Proc(d, "decode-nodes-d", self.logs, *decode_common, *nodes,
                               "--node-rank", "1", "--headless", "--advertise-host", d.addr)
        self.procs["cn"] = Proc(c, "decode-nodes-c", self.logs, *decode_common, *nodes,
                                "--host", c.addr, "--port", "8002", "--side-channel-host", c.addr)
        self.procs["proxy"] = Proc(c, "proxy", self.logs, "proxy", "--prefill", self.api,
                                   "--decode", self.decode, "--host", c.addr, "--port", "8100",
                                   "--ca-certs", str(tls / "ca.pem"),
                                   "--kv-token-file", str(tls / "token"))
        deadline = time.monotonic() + START_TIMEOUT
        self.client.wait_status(self.decode + "/health", 200, deadline, "decode",
                                [self.procs["c"]])
        self.client.wait_status(self.proxy + "/health", 200, deadline, "proxy",
                                [self.procs["proxy"]])
        self.client.wait_status(self.decode_tp1 + "/health", 200, deadline, "decode tp 1",
                                [self.procs["c1"]])
        self.client.wait_status(self.decode_nodes + "/health", 200, deadline, "decode on c+d",
                                [self.procs["cn"], self.procs["d"]])

    def complete(self, url: str, prompt: str, max_tokens: int = MAX_TOKENS,
                 **extra) -> tuple[int, dict | str]:
        status, body = self.client.request("POST", url + "/v1/completions", {
            "model": "kvbridge-tiny", "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0, **extra})
        try:
            return status, json.loads(body)
        except ValueError:
            return status, body

    def stop(self) -> None:
        for p in self.procs.values():
            p.stop()
        self.client.close()


@pytest.fixture(scope="module")
def cluster(net: Net, tls: Path, tmp_path_factory: pytest.TempPathFactory):
    cl = Cluster(net, tls, tmp_path_factory.mktemp("netns-logs"))
    try:
        cl.start_decode_and_proxy()
        cl.startup = cl.start_prefill("http", "1")
        yield cl
    finally:
        cl.stop()


@pytest.fixture(scope="module")
def reference() -> dict[str, str]:
    """A monolithic engine (TP 1, one process, float64): the answers to match."""
    with build_engine(dtype="float64") as eng:
        out = eng.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
        return {p: eng.tokenizer.decode(ids) for p, ids in zip(PROMPTS, out, strict=True)}


def test_head_serves_every_rank_with_its_host(cluster: Cluster, net: Net) -> None:
    auth = {"Authorization": f"Bearer {cluster.token}", "Accept": "application/json"}
    status, body = cluster.client.request("GET", cluster.side + "/v1/kv/handshake",
                                          headers=auth)
    assert status == 200, body
    ranks = json.loads(body)["ranks"]
    assert [(r["tp_rank"], r["host"]) for r in ranks] == [(0, net.hosts["a"].addr),
                                                          (1, net.hosts["b"].addr)]
    assert len({r["agent_name"] for r in ranks}) == 2
    status, body = cluster.client.request("GET", cluster.side + "/v1/kv/handshake",
                                          headers={"Accept": "application/json"})
    assert status == 401, body  # the token still guards it


def test_greedy_output_equals_monolithic(cluster: Cluster, reference: dict[str, str]) -> None:
    for prompt in PROMPTS:
        status, body = cluster.complete(cluster.proxy, prompt)
        assert status == 200, body
        assert body["choices"][0]["text"] == reference[prompt], prompt
    assert cluster.client.metric(cluster.decode, "kvbridge_kv_loads_total{outcome=\"ok\"}") \
        >= len(PROMPTS)


def test_figures(cluster: Cluster) -> None:
    """The figures docs/multinode.md quotes (printed with ``-s``)."""
    total, head = cluster.startup
    hs_sum = cluster.client.metric(cluster.decode, "kvbridge_handshake_seconds_sum")
    hs_count = cluster.client.metric(cluster.decode, "kvbridge_handshake_seconds_count")
    assert hs_count >= 2  # each decode rank handshook with the two-node prefill
    print(f"\ntwo-node prefill start-up: {total:.1f} s from node b's start, {head:.1f} s "
          f"from the head's; decode handshakes: {hs_count:.0f}, mean {hs_sum / hs_count:.3f} s")


def test_kv_of_node_b_crosses_node_b_interface(cluster: Cluster, net: Net) -> None:
    """The decode reads rank 1's half of the heads straight from host b: b's interface
    sends at least that many bytes, and host a neither receives nor sends them."""
    a, b = net.hosts["a"], net.hosts["b"]
    prompt = "Node b holds half of every block's heads. " * 12
    status, pre = cluster.complete(cluster.api, prompt, max_tokens=1,
                                   kv_transfer_params={"do_remote_decode": True})
    assert status == 200, pre
    params = pre["kv_transfer_params"]
    loaded0 = cluster.client.metric(cluster.decode, "kvbridge_kv_bytes_loaded_total")
    before = {h: (h.counter("rx_bytes"), h.counter("tx_bytes")) for h in (a, b)}
    status, body = cluster.complete(cluster.decode, prompt, max_tokens=2,
                                    kv_transfer_params=params)
    after = {h: (h.counter("rx_bytes"), h.counter("tx_bytes")) for h in (a, b)}
    assert status == 200, body
    loaded = cluster.client.metric(cluster.decode, "kvbridge_kv_bytes_loaded_total") - loaded0
    from_b = loaded / 2  # prefill TP 2: rank 1 (host b) holds half the heads of each block
    assert from_b > 200_000, loaded  # large enough to stand out from pings and HTTP
    b_tx = after[b][1] - before[b][1]
    a_rx, a_tx = after[a][0] - before[a][0], after[a][1] - before[a][1]
    print(f"KV loaded {loaded:.0f} B, of it from node b {from_b:.0f} B; node b sent "
          f"{b_tx} B; node a sent {a_tx} B, received {a_rx} B")
    assert b_tx >= from_b
    assert a_rx < from_b / 4, "host a received node b's KV: relayed"
    assert a_tx < from_b * 1.5, "host a sent more than its own half: relayed"


def _two_hops(cluster: Cluster, decode: str, prompt: str, max_tokens: int = MAX_TOKENS
              ) -> tuple[int, dict | str]:
    """What the proxy does: a one-token prefill that holds its KV, then the decode."""
    status, pre = cluster.complete(cluster.api, prompt, max_tokens=1,
                                   kv_transfer_params={"do_remote_decode": True})
    assert status == 200, pre
    return cluster.complete(decode, prompt, max_tokens=max_tokens,
                            kv_transfer_params=pre["kv_transfer_params"])


def test_decode_tp1_and_a_decode_across_hosts(cluster: Cluster, net: Net,
                                              reference: dict[str, str]) -> None:
    """A TP 1 decode reads both halves; a TP 4 decode on hosts c and d reads each half
    with the ranks on its own host: d's ranks take b's half straight from b."""
    for url in (cluster.decode_tp1, cluster.decode_nodes):
        for prompt in PROMPTS:
            status, body = _two_hops(cluster, url, prompt)
            assert status == 200, body
            assert body["choices"][0]["text"] == reference[prompt], (url, prompt)
    b, c, d = net.hosts["b"], net.hosts["c"], net.hosts["d"]
    prompt = "Host d reads from host b. " * 20
    status, pre = cluster.complete(cluster.api, prompt, max_tokens=1,
                                   kv_transfer_params={"do_remote_decode": True})
    assert status == 200, pre
    loaded0 = cluster.client.metric(cluster.decode_nodes, "kvbridge_kv_bytes_loaded_total")
    before = {h: h.counter("rx_bytes") for h in (c, d)}
    b_tx0 = b.counter("tx_bytes")
    status, body = cluster.complete(cluster.decode_nodes, prompt, max_tokens=2,
                                    kv_transfer_params=pre["kv_transfer_params"])
    assert status == 200, body
    d_rx, c_rx = (d.counter("rx_bytes") - before[d]), (c.counter("rx_bytes") - before[c])
    b_tx = b.counter("tx_bytes") - b_tx0
    half = (cluster.client.metric(cluster.decode_nodes, "kvbridge_kv_bytes_loaded_total")
            - loaded0) / 2
    print(f"decode across c+d: {2 * half:.0f} B loaded; host d received {d_rx} B, "
          f"host c {c_rx} B, host b sent {b_tx} B")
    assert half > 200_000
    assert d_rx >= half and b_tx >= half
    assert c_rx < half * 1.5, "host c received more than its own half: relayed"


def test_killing_node_b_fails_cleanly(cluster: Cluster, reference: dict[str, str]) -> None:
    rids = [cluster.client.send("POST", cluster.proxy + "/v1/completions", {
        "model": "kvbridge-tiny", "prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0},
        timeout=90) for p in PROMPTS * 2]
    cluster.procs["b"].kill_machine()
    for rid, prompt in zip(rids, PROMPTS * 2, strict=True):
        status, body = cluster.client.result(rid, timeout=120)  # never hangs
        if status == 200:  # finished before, or the decode recomputed it
            assert json.loads(body)["choices"][0]["text"] == reference[prompt]
        else:
            assert status >= 500 and json.loads(body)["error"]["message"], body
    # A request after the loss gets a clear error, and the head stops saying ready.
    status, body = cluster.complete(cluster.api, "after", kv_transfer_params={
        "do_remote_decode": True})
    assert status >= 500 and any(w in json.dumps(body) for w in ("gone", "died")), body
    deadline = time.monotonic() + 30
    cluster.client.wait_status(cluster.side + "/readyz", 503, deadline, "head unready")
    cluster.client.wait_status(cluster.api + "/health", 503, deadline, "head API unhealthy")
    # The decode lost nothing: every block is free again, and it still serves.
    wait_until(lambda: cluster.client.metric(cluster.decode, "kvbridge_blocks_free")
               == DECODE_BLOCKS, 60, "every decode block free again (none leaked)", every=0.2)
    status, body = cluster.complete(cluster.decode, PROMPTS[1])
    assert status == 200 and body["choices"][0]["text"] == reference[PROMPTS[1]], body


def test_restart_over_zmq_new_epoch_then_head_loss_stops_node_b(
        cluster: Cluster, reference: dict[str, str]) -> None:
    status, info = cluster.client.request("GET", cluster.api + "/v1/kv/info", timeout=5)
    old_epoch = json.loads(info)["epoch"] if status == 200 else None
    cluster.procs["a"].stop()
    cluster.start_prefill("zmq", "2")
    status, info = cluster.client.request("GET", cluster.api + "/v1/kv/info")
    assert status == 200 and json.loads(info)["handshake_method"] == "zmq", info
    assert json.loads(info)["epoch"] != old_epoch
    for prompt in PROMPTS:
        status, body = cluster.complete(cluster.proxy, prompt)
        assert status == 200, body
        assert body["choices"][0]["text"] == reference[prompt]
    # The head dies: node b notices and exits on its own, within a bounded time.
    cluster.procs["a"].kill_machine()
    cluster.procs["b"].proc.wait(timeout=60)
    assert cluster.procs["b"].proc.returncode == 1
    assert "gone" in cluster.procs["b"].tail()


def test_node_that_never_comes_is_a_clear_error(net: Net, tls: Path,
                                                tmp_path_factory: pytest.TempPathFactory
                                                ) -> None:
    args = _prefill_args(net, tls, 0, "http")
    args[args.index("--node-timeout") + 1] = "5"
    head = Proc(net.hosts["a"], "prefill-alone", tmp_path_factory.mktemp("alone"), *args)
    try:
        assert head.proc.wait(timeout=120) != 0
    finally:
        head.stop()
    assert "not every node of the instance joined" in head.tail(), head.tail()
