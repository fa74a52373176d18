"""Handshake side channel: one strategy interface, three methods (``zmq``, ``http``, ``etcd``).

Modules (each imports only the ones above it in this list, and ``kvbridge`` modules below
the package: errors, config, guard, metadata, net, background, registry):

* ``base``               the interface: ``MetadataStore``, ``HandshakeServer``, ``HandshakeClient``
* ``payloads``           opaque per-rank payloads in a versioned envelope (the vLLM plug-in)
* ``audit``              the audit log: one JSON line per decision, refusals rate-limited
* ``authz``              who may fetch: named tokens, client-certificate allow-list, audit log
* ``http_routes``        the http routes and media type both ends agree on
* ``http_fast``          handshakes and probes answered from the parsed head, no ASGI
* ``http_protocol``      uvicorn's httptools protocol: caps on head and body, the fast path
* ``http_server``        the http server: Starlette app, body limit, observer, threaded uvicorn
* ``deadline_watchdog``  one thread that cuts a connection when its fetch's deadline passes
* ``tls_sessions``       TLS client contexts and sessions shared per setting, bounded
* ``http_reply``         one HTTP/1.1 reply read off a socket (llhttp), head and body bounded
* ``http_client``        the http client: keep-alive pool, requests written whole, capped replies
* ``zmtp``               ZMTP 3.0 by hand, bounded: the shared framing and the listener
* ``zmtp_client``        the ZMTP client: a DEALER connection, each reply bounded in frames and bytes
* ``zmq``                the zmq method's messages, server and client (on ``zmtp``)
* ``etcd``               the etcd method: envelopes published under a lease, read from a watch
* ``control``            what the side-channel process and its parent say (a socketpair)
* ``process``            the side channel in a process of its own: started, fed, restarted
* ``factory``            servers and clients from the settings: ``serve`` and the plug-in alike
* ``child``              the side-channel process: ``python -m kvbridge.handshake.child``
"""

from __future__ import annotations

from kvbridge.handshake.base import HandshakeClient, HandshakeServer, MetadataStore
from kvbridge.handshake.factory import make_client, make_server, side_channel

__all__ = ["HandshakeClient", "HandshakeServer", "MetadataStore", "make_client", "make_server",
           "side_channel"]
