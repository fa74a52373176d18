"""Handshake side channel: one strategy interface, three methods (``zmq``, ``http``, ``etcd``).

Modules and sub-packages (each imports only the ones above it in this list, and
``kvbridge`` modules below the package: errors, config, guard, metadata, net, background,
registry):

* ``base``       the interface: ``MetadataStore``, ``HandshakeServer``, ``HandshakeClient``
* ``payloads``   opaque per-rank payloads in a versioned envelope (the vLLM plug-in)
* ``audit``      the audit log: one JSON line per decision, refusals rate-limited
* ``authz``      who may fetch: named tokens, client-certificate allow-list, audit log
* ``http/``      the ``http`` method: server (fast path, bounded protocol), client, TLS
* ``zmq/``       the ``zmq`` method on ZMTP by hand: kvbridge's wire and vLLM's
* ``etcd``       the ``etcd`` method: envelopes published under a lease, read from a watch
* ``factory``    servers and clients from the settings: ``serve`` and the plug-in alike
* ``process/``   the side channel in a process of its own: parent, child, control
"""

from __future__ import annotations

from kvbridge.handshake.base import HandshakeClient, HandshakeServer, MetadataStore
from kvbridge.handshake.factory import make_client, make_server
from kvbridge.handshake.process.parent import side_channel

__all__ = ["HandshakeClient", "HandshakeServer", "MetadataStore", "make_client", "make_server",
           "side_channel"]
