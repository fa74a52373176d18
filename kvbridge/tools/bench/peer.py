"""The far side of a benchmark, run as its own OS process (see ``common.Child``).

    python -m kvbridge.tools.bench.peer sidechannel --tp 2 --methods zmq,http,https --certs DIR ...
        a prefill reduced to its side channel: one NIXL agent + KV cache per rank, a
        ``MetadataStore`` served over the requested methods; prints ports and sizes.
    python -m kvbridge.tools.bench.peer transfer --pool-bytes N
        a registered, touched buffer of N bytes for NIXL READs, and a TCP socket that
        sends slices of the same buffer (the loopback baseline).

Both print one JSON line when ready and exit when stdin closes.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import socket
import struct
import sys
import threading
import uuid

BENCH_MODEL = "kvbridge-bench"


def kv_shape_args(p: argparse.ArgumentParser) -> None:
    """The KV cache both sides of the handshake benchmarks allocate (per rank)."""
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8, help="total KV heads")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=128)


def make_agents(args: argparse.Namespace, tp: int, count: int | None = None) -> list:
    """``count`` (default ``tp``) agents, each with a KV cache shaped like one rank of ``tp``."""
    import torch

    from kvbridge.kv_cache import allocate_kv_cache
    from kvbridge.tp_mapping import heads_per_rank
    from kvbridge.transfer import NixlAgent

    agents = []
    for _ in range(tp if count is None else count):
        kv = allocate_kv_cache(args.layers, args.num_blocks,
                               heads_per_rank(tp, args.kv_heads), args.block_size,
                               args.head_dim, torch.float16)
        agent = NixlAgent()  # as kvbridge makes them (progress thread with its delay)
        agent.register_kv_cache(kv, args.kv_heads)
        agents.append(agent)
    return agents


def sidechannel(args: argparse.Namespace) -> None:
    from kvbridge.config import SideChannelConfig
    from kvbridge.handshake import MetadataStore, side_channel
    from kvbridge.metadata import compat_of

    agents = make_agents(args, args.tp)
    engine_id, epoch = uuid.uuid4().hex, uuid.uuid4().hex
    store = MetadataStore(compat_of(BENCH_MODEL, agents[0].kv), args.tp)
    for r, a in enumerate(agents):
        store.set_rank(a.rank_metadata(engine_id, epoch, r, args.tp))
    servers = {}
    for method in args.methods.split(","):
        tls = {}
        if method == "https":
            tls = dict(ssl_certfile=os.path.join(args.certs, "server.pem"),
                       ssl_keyfile=os.path.join(args.certs, "server.key"))
        config = SideChannelConfig.load(dict(
            handshake_method="zmq" if method == "zmq" else "http", token=args.token,
            side_channel_port=0, **tls), environ={})
        servers[method] = side_channel(config, store)  # a process of its own, as deployed
        servers[method].start()
    print(json.dumps({
        "pid": os.getpid(), "engine_id": engine_id, "epoch": epoch,
        "ports": {m: s.port for m, s in servers.items()},
        "server_pids": {m: getattr(s, "pid", None) or os.getpid() for m, s in servers.items()},
        "envelope_bytes_per_rank": [len(store.reply(r).body) for r in range(args.tp)],
        "agent_metadata_bytes_per_rank": [len(a.metadata()) for a in agents],
        "envelope_bytes_all_ranks": len(store.reply(None).body),
    }), flush=True)
    for _line in sys.stdin:
        print(json.dumps({"ok": True}), flush=True)
    for s in servers.values():
        s.stop()


def pattern(nbytes: int):
    """``nbytes`` bytes where byte ``i`` is ``i % 251`` (every page written)."""
    import numpy as np

    tile = np.arange(251, dtype=np.uint8)
    return np.tile(tile, nbytes // 251 + 1)[:nbytes].copy()


def transfer(args: argparse.Namespace) -> None:
    import torch

    from kvbridge._nixl import new_agent, nixl_api

    api = nixl_api()
    # Touch every page now (and give it a pattern) so no READ pays first-touch faults.
    buf = torch.from_numpy(pattern(args.pool_bytes))
    name = f"bench-src-{uuid.uuid4().hex[:8]}"
    agent = new_agent(api, name)  # as kvbridge's: progress thread with its delay
    reg = agent.register_memory([(buf.data_ptr(), buf.nbytes, 0, "")], mem_type="DRAM")
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((args.bind, 0))
    listener.listen(4)
    view = memoryview(buf.numpy())

    def serve_tcp() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with conn:
                while True:
                    head = conn.recv(16, socket.MSG_WAITALL)
                    if len(head) < 16:
                        break
                    off, n = struct.unpack("<QQ", head)
                    conn.sendall(view[off:off + n])

    threading.Thread(target=serve_tcp, daemon=True).start()
    print(json.dumps({"pid": os.getpid(), "agent_name": name, "addr": buf.data_ptr(),
                      "pool_bytes": buf.nbytes, "tcp_port": listener.getsockname()[1],
                      "agent_metadata": base64.b64encode(agent.get_agent_metadata()).decode()}),
          flush=True)
    for _line in sys.stdin:
        print(json.dumps({"notifs": sum(len(v) for v in agent.get_new_notifs().values())}),
              flush=True)
    listener.close()
    del reg


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m kvbridge.tools.bench.peer")
    sub = p.add_subparsers(dest="role", required=True)
    s = sub.add_parser("sidechannel")
    s.add_argument("--tp", type=int, default=2)
    s.add_argument("--methods", default="zmq,http,https")
    s.add_argument("--token")
    s.add_argument("--certs", help="dir with server.pem / server.key (for https)")
    kv_shape_args(s)
    t = sub.add_parser("transfer")
    t.add_argument("--pool-bytes", type=int, required=True)
    t.add_argument("--bind", default="127.0.0.1", help="address of the TCP baseline's socket")
    args = p.parse_args()
    {"sidechannel": sidechannel, "transfer": transfer}[args.role](args)


if __name__ == "__main__":
    main()
