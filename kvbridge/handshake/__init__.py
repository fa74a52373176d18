"""Handshake side channel: one strategy interface, three methods (``zmq``, ``http``, ``etcd``).

Modules (each imports only the ones above it in this list, and ``kvbridge`` modules below
the package: errors, config, guard, metadata, net, background, registry):

* ``base``               the interface: ``MetadataStore``, ``HandshakeServer``, ``HandshakeClient``
* ``payloads``           opaque per-rank payloads in a versioned envelope (the vLLM plug-in)
* ``audit``              the audit log: one JSON line per decision, refusals rate-limited
* ``authz``              who may fetch: named tokens, client-certificate allow-list, audit log
* ``http_routes``        the http routes and media type both ends agree on
* ``http_protocol``      uvicorn's httptools protocol with a cap on the request head (431)
* ``http_server``        the http server: Starlette app, body limit, observer, threaded uvicorn
* ``deadline_watchdog``  one thread that cuts a connection when its fetch's deadline passes
* ``tls_sessions``       TLS client contexts and sessions shared per setting, bounded
* ``http_client``        the http client on ``http.client``: keep-alive pool, capped replies
* ``zmtp``               ZMTP 3.0 by hand, bounded: the shared framing and the listener
* ``zmtp_client``        the ZMTP client: a DEALER connection, each reply bounded in frames and bytes
* ``zmq``                the zmq method's messages, server and client (on ``zmtp``)
* ``etcd``               the etcd method: envelopes published under a lease, read from a watch
"""

from __future__ import annotations

import logging

from kvbridge.config import SIDE_CHANNEL_PORT_SETTING, SideChannelConfig
from kvbridge.errors import ConfigError
from kvbridge.handshake.authz import Authorizer
from kvbridge.handshake.base import HandshakeClient, HandshakeServer, MetadataStore, Observer
from kvbridge.handshake.http_client import HttpHandshakeClient
from kvbridge.handshake.http_server import HttpHandshakeServer
from kvbridge.handshake.zmq import ZmqHandshakeClient, ZmqHandshakeServer
from kvbridge.metadata import Compat
from kvbridge.net import bind_error

log = logging.getLogger(__name__)

__all__ = ["HandshakeClient", "HandshakeServer", "MetadataStore", "make_client", "make_server"]


def make_server(config: SideChannelConfig, store: MetadataStore,
                port: int | None = None, observer: Observer | None = None) -> HandshakeServer:
    """The side-channel server for ``config.handshake_method`` (not started).

    A port that cannot be bound (in use, foreign address) raises ``ConfigError``.
    """
    port = config.side_channel_port if port is None else port
    try:
        if config.handshake_method == "etcd":
            from kvbridge.handshake.etcd import EtcdHandshakeServer

            return EtcdHandshakeServer(store, config.registry_endpoint, config.advertised, port)
        if config.handshake_method == "http":
            return HttpHandshakeServer(store, config.side_channel_host, port,
                                       token=config.token, tls=config.tls, observer=observer,
                                       authz=Authorizer.from_config(config),
                                       budget=config.server_budget)
        if config.tls.enabled:
            log.warning("TLS settings do not apply to the zmq side channel: metadata and token "
                        "travel in clear (use --handshake http for TLS)")
        return ZmqHandshakeServer(store, config.side_channel_host, port, token=config.token,
                                  observer=observer, budget=config.server_budget)
    except OSError as e:  # a bind fails as ConfigError already (net.listen_socket); other errors too
        raise bind_error(config.side_channel_host, port, SIDE_CHANNEL_PORT_SETTING, e) from None


def make_client(config: SideChannelConfig, expected: Compat | None,
                method: str | None = None, keep_warm: bool = False) -> HandshakeClient:
    """A client for ``method`` (default: the configured one). ``keep_warm``: an ``http``
    client keeps its connection to every peer it fetched from alive, with a request
    every half of ``side_channel_keep_alive_timeout`` at most (the peer's is assumed to be
    the same setting); see ``kvbridge.handshake.http_client``."""
    method = method or config.handshake_method
    if method == "etcd":
        from kvbridge.handshake.etcd import EtcdHandshakeClient

        if not config.registry:
            raise ConfigError("a peer uses the etcd handshake method; this instance has no "
                              "--registry (KVBRIDGE_REGISTRY) to read it from")
        return EtcdHandshakeClient(config.handshake_timeout, expected, config.token,
                                   config.max_message_bytes, endpoint=config.registry_endpoint)
    if method == "http":
        return HttpHandshakeClient(config.handshake_timeout, expected, config.token,
                                   config.max_message_bytes, tls=config.tls,
                                   token_file=config.token_file,
                                   keep_warm=(config.side_channel_keep_alive_timeout / 2
                                              if keep_warm else None))
    return ZmqHandshakeClient(config.handshake_timeout, expected, config.token,
                              config.max_message_bytes)
