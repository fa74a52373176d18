"""A node of a multi-node instance other than the head (``kvbridge serve --headless``).

It runs its share of the TP ranks and nothing else: no API, no scheduler, no side
channel. The head sends it the engine settings and the connector factory (engine
id, epoch, side-channel settings), so the instance is configured in one place;
this node only supplies what is its own: its address, and certificate / token
files when it has its own copies (paths on the head may not exist here).
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from dataclasses import dataclass

from kvbridge.config import SideChannelConfig
from kvbridge.engine.remote_node import run_node
from kvbridge.multinode import MultiNodeConfig

log = logging.getLogger(__name__)

# Side-channel settings that name files or secrets on the node that reads them.
_NODE_OWN = ("token", "token_file", "ssl_certfile", "ssl_keyfile", "ssl_ca_certs")


@dataclass(frozen=True)
class NodeLocal:
    """Picklable: applied in each rank of this node to the head's connector factory."""

    side_channel: SideChannelConfig

    def __call__(self, factory):
        head = getattr(factory, "side_channel", None)
        if not isinstance(head, SideChannelConfig) or not dataclasses.is_dataclass(factory):
            return factory
        own = {k: getattr(self.side_channel, k) for k in _NODE_OWN
               if getattr(self.side_channel, k) is not None}
        return dataclasses.replace(factory, side_channel=dataclasses.replace(head, **own))


def serve_node(mn: MultiNodeConfig, tp_size: int, side_channel: SideChannelConfig) -> int:
    """Run until the head shuts the instance down (0) or is gone (1)."""

    def ready(ranks: list[int]) -> None:
        print(f"kvbridge serve: node {mn.node_rank} joined {mn.master_addr}:{mn.master_port} "
              f"with ranks {ranks[0]}-{ranks[-1]} of {tp_size} (host {mn.host})",
              file=sys.stderr, flush=True)

    code = run_node(mn, tp_size, NodeLocal(side_channel), on_ready=ready)
    print(f"kvbridge serve: node {mn.node_rank}: " +
          ("the instance is gone or never formed; exiting" if code else
           "the head shut the instance down; exiting"), file=sys.stderr, flush=True)
    return code
