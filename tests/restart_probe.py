"""Start and stop a prefill and a decode instance N times in one process (each time the
decode handshakes with the prefill: remote agent added, descriptor lists prepared), and
print one JSON line per round: open file descriptors, threads and resident memory.

    python tests/restart_probe.py 20

Used by tests/test_restarts.py; the closing figures of the KV-lifecycle work come from it.
"""

from __future__ import annotations

import json
import os
import sys
import threading

# Marks the probe's lines: a library writing to stdout (seen once under load) is not one.
PREFIX = "round: "


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def main(rounds: int) -> None:
    from kvbridge.config import SideChannelConfig
    from kvbridge.server.instance import Instance, InstanceOptions

    for method in ("zmq", "http"):
        side = SideChannelConfig(handshake_method=method, side_channel_port=0)
        for i in range(rounds // 2 if method == "zmq" else rounds - rounds // 2):
            prefill = Instance(InstanceOptions(role="prefill", side_channel=side, num_blocks=32))
            decode = Instance(InstanceOptions(role="decode", side_channel=side, num_blocks=32))
            try:
                decode.prewarm("127.0.0.1", prefill.side_channel_port, wait=True)
                peers = decode.engine.collective_rpc("kv_connector_call", "peer_count")
                assert peers == [1], peers
            finally:
                # Prefill first: with both agents in one process, a prefill agent destroyed
                # after the decode agent that connected to it makes UCX log a refused
                # connect while closing its reply endpoint (separate processes do not).
                prefill.shutdown()
                decode.shutdown()
            print(PREFIX + json.dumps({"method": method, "round": i, "fds": len(os.listdir("/proc/self/fd")),
                              "threads": threading.active_count(), "rss_mib": round(_rss_mib(), 1)}),
                  flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 20)
