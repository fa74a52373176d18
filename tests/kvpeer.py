"""A prefill or decode instance reduced to its KV caches, run as its own OS process.

Used by tests/test_transfer_e2e.py: each TP rank has its own NIXL agent and a
KV cache; the prefill's caches hold a pattern that encodes (layer, K/V, block,
global head, token, dim), so the decode can tell exactly where every byte came
from.

    python tests/kvpeer.py prefill --tp 2 --token T --certs DIR
        prints {"http_port", "zmq_port", "engine_id", "epoch"}; then, for each line
        "notifs" on stdin, prints the notifications received so far; exits on EOF.
    python tests/kvpeer.py decode --tp 4 --remote-tp 2 --method http --port P ...
        handshakes, READs, checks, prints a JSON result.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import uuid
from pathlib import Path

import torch

from kvbridge.config import SideChannelConfig
from kvbridge.handshake import MetadataStore, make_client, make_server
from kvbridge.kv_cache import allocate_kv_cache
from kvbridge.metadata import compat_of
from kvbridge.peers import PeerManager
from kvbridge.tp_mapping import heads_per_rank, rank_heads
from kvbridge.transfer import NixlAgent

LAYERS, HEADS, BLOCK, DIM = 2, 4, 4, 8
MODEL = "kvpeer-pattern"


def pattern(layers: int, blocks: int, heads: range) -> torch.Tensor:
    """Every element names its own coordinates (exact in float64)."""
    layer = torch.arange(layers).view(-1, 1, 1, 1, 1, 1)
    kv = torch.arange(2).view(1, -1, 1, 1, 1, 1)
    blk = torch.arange(blocks).view(1, 1, -1, 1, 1, 1)
    head = torch.tensor(list(heads)).view(1, 1, 1, -1, 1, 1)
    tok = torch.arange(BLOCK).view(1, 1, 1, 1, -1, 1)
    dim = torch.arange(DIM).view(1, 1, 1, 1, 1, -1)
    val = (((((layer * 2 + kv) * 1000 + blk) * 100 + head) * BLOCK + tok) * DIM + dim)
    return val.to(torch.float64)


def _config(args: argparse.Namespace, method: str) -> SideChannelConfig:
    certs = Path(args.certs) if args.certs else None
    tls = {}
    if certs is not None:
        tls = dict(ssl_certfile=str(certs / f"{args.role}.pem"),
                   ssl_keyfile=str(certs / f"{args.role}.key"),
                   ssl_ca_certs=str(certs / "ca.pem"))
        if args.role == "prefill" and args.require_client_cert:
            tls["ssl_cert_reqs"] = "required"
    return SideChannelConfig.load(dict(handshake_method=method, token=args.token,
                                       side_channel_port=0, handshake_timeout=args.timeout,
                                       trusted_side_channels="127.0.0.1", **tls), environ={})


def _agents(tp: int, blocks: int, fill: bool) -> list[NixlAgent]:
    agents = []
    for r in range(tp):
        kv = allocate_kv_cache(LAYERS, blocks, heads_per_rank(tp, HEADS), BLOCK, DIM,
                               torch.float64)
        if fill:
            kv.copy_(pattern(LAYERS, blocks, rank_heads(r, tp, HEADS)))
        agent = NixlAgent()
        agent.register_kv_cache(kv, HEADS)
        agents.append(agent)
    return agents


def prefill(args: argparse.Namespace) -> None:
    args.tp = int(args.tp)
    agents = _agents(args.tp, args.blocks, fill=True)
    engine_id, epoch = args.engine_id or uuid.uuid4().hex, uuid.uuid4().hex
    store = MetadataStore(compat_of(MODEL, agents[0].kv), args.tp)
    for r, a in enumerate(agents):
        store.set_rank(a.rank_metadata(engine_id, epoch, r, args.tp))
    http = make_server(_config(args, "http"), store)
    zmq = make_server(_config(args, "zmq"), store)
    http.start()
    zmq.start()
    print(json.dumps({"http_port": http.port, "zmq_port": zmq.port, "engine_id": engine_id,
                      "epoch": epoch, "agents": [a.name for a in agents]}), flush=True)
    notifs: dict[str, list[str]] = {}
    for line in sys.stdin:
        if line.strip() == "notifs":
            for i, a in enumerate(agents):
                for sender, msgs in a.notifications().items():
                    notifs.setdefault(f"{i}<-{sender}", []).extend(m.decode() for m in msgs)
            print(json.dumps(notifs), flush=True)
    http.stop()
    zmq.stop()


def decode(args: argparse.Namespace) -> None:
    """One decode instance per TP size in ``--tp`` (comma-separated), one after another."""
    print(json.dumps({tp: _decode_one(args, int(tp)) for tp in args.tp.split(",")}), flush=True)


def _decode_one(args: argparse.Namespace, tp: int) -> list[dict]:
    agents = _agents(tp, args.blocks, fill=False)
    config = _config(args, args.method)
    local = [int(b) for b in args.local_blocks.split(",")]
    remote = [int(b) for b in args.remote_blocks.split(",")]
    results: list[dict] = [{} for _ in agents]

    def run(rank: int) -> None:
        client = make_client(config, compat_of(MODEL, agents[rank].kv))
        mgr = PeerManager(agents[rank], rank, tp, HEADS, lambda _method: client)
        try:
            peer = mgr.connect(args.engine_id, "127.0.0.1", args.port, args.remote_tp,
                               method=args.method, epoch=args.epoch).result()
            for rr in peer.ranks.values():
                agents[rank].wait(agents[rank].read(rr, local, remote,
                                                    f"req-1:{rank}".encode()), 30)
            results[rank] = {"remote_ranks": sorted(peer.ranks),
                             "handshake_ms": 1000 * peer.handshake_seconds}
        except Exception as e:
            results[rank] = {"error": f"{type(e).__name__}: {e}"}
        finally:
            mgr.close()
            client.close()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(tp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for rank, agent in enumerate(agents):
        if "error" in results[rank]:
            continue
        kv = agent._kv_tensor
        heads = rank_heads(rank, tp, HEADS)
        src = pattern(LAYERS, max(remote) + 1, heads)
        expected = torch.zeros_like(kv)
        expected[:, :, local] = src[:, :, remote]
        results[rank]["heads"] = list(heads)
        results[rank]["bytes_checked"] = kv.nbytes
        results[rank]["mismatched"] = int((kv != expected).sum())
    return results


def main() -> None:
    global HEADS
    p = argparse.ArgumentParser()
    p.add_argument("role", choices=["prefill", "decode"])
    p.add_argument("--tp", required=True, help="prefill: one size; decode: comma-separated")
    p.add_argument("--blocks", type=int, default=16)
    p.add_argument("--heads", type=int, default=4, help="total KV heads")
    p.add_argument("--token")
    p.add_argument("--certs")
    p.add_argument("--require-client-cert", action="store_true")
    p.add_argument("--timeout", type=float, default=10.0)
    p.add_argument("--engine-id")
    p.add_argument("--epoch")
    p.add_argument("--method", default="zmq")
    p.add_argument("--port", type=int)
    p.add_argument("--remote-tp", type=int)
    p.add_argument("--local-blocks", default="1,2,3,4,9")
    p.add_argument("--remote-blocks", default="3,5,6,7,0")
    args = p.parse_args()
    HEADS = args.heads
    (prefill if args.role == "prefill" else decode)(args)


if __name__ == "__main__":
    main()
