"""One set of factories: the side channel's servers and clients, for ``kvbridge serve`` and
the vLLM plug-in alike, so every setting means the same in both (docs/configuration.md):
connection budgets and keep-alive, token and its rotation, named tokens and their scopes,
the client-certificate allow-list, the side channels trusted with the token, the audit log,
TLS, ``max_message_bytes``, the registry.

What differs is only what the ``zmq`` method speaks, its ``wire``: kvbridge's own messages
(``"kvbridge"``, the default) or vLLM's (``"vllm"``, the plug-in's). A name, not code: a
side-channel process of its own is told it in its start-up spec.
"""

from __future__ import annotations

import logging
import socket
from typing import Literal

from kvbridge.config import SIDE_CHANNEL_PORT_SETTING, SideChannelConfig
from kvbridge.errors import ConfigError
from kvbridge.handshake.authz import Authorizer
from kvbridge.handshake.base import HandshakeClient, HandshakeServer, MetadataStore, Observer
from kvbridge.handshake.http.client import HttpHandshakeClient
from kvbridge.handshake.http.server import HttpHandshakeServer
from kvbridge.handshake.payloads import PayloadStore
from kvbridge.handshake.zmq.kvbridge_wire import ZmqHandshakeClient, ZmqHandshakeServer
from kvbridge.handshake.zmq.vllm_wire import VllmZmqClient, VllmZmqServer, no_token
from kvbridge.metadata import Compat
from kvbridge.net import bind_error
from kvbridge.trust import SideChannelTrust

__all__ = ["WIRES", "Wire", "make_client", "make_server"]

log = logging.getLogger(__name__)


Wire = Literal["kvbridge", "vllm"]
WIRES: tuple[Wire, ...] = ("kvbridge", "vllm")


def make_server(config: SideChannelConfig, store: MetadataStore,
                port: int | None = None, observer: Observer | None = None, *,
                wire: Wire = "kvbridge",
                sock: socket.socket | None = None) -> HandshakeServer:
    """The side-channel server for ``config.handshake_method`` (not started), in this
    process. ``wire``: what the ``zmq`` method speaks (vLLM's serves a ``PayloadStore``'s
    payloads). ``sock``: a listening socket to serve (default: ``port`` bound now).

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
                                       budget=config.server_budget, sock=sock)
        if config.tls.enabled:
            log.warning("TLS settings do not apply to the zmq side channel: metadata and token "
                        "travel in clear (use --handshake http for TLS)")
        if wire == "vllm":
            no_token(config.token)
            if not isinstance(store, PayloadStore):
                raise TypeError("vLLM's wire serves a PayloadStore's payloads")
            return VllmZmqServer(store.payloads()[0], config.side_channel_host, port,
                                 budget=config.server_budget, sock=sock)
        return ZmqHandshakeServer(store, config.side_channel_host, port, token=config.token,
                                  observer=observer, budget=config.server_budget, sock=sock)
    except OSError as e:  # a bind fails as ConfigError already (net.listen_socket); other errors too
        raise bind_error(config.side_channel_host, port, SIDE_CHANNEL_PORT_SETTING, e) from None


def make_client(config: SideChannelConfig, expected: Compat | None,
                method: str | None = None, keep_warm: bool = False, *,
                wire: Wire = "kvbridge") -> HandshakeClient:
    """A client for ``method`` (default: the configured one). ``keep_warm``: an ``http``
    client keeps its connection to every peer it fetched from alive, with a request
    every half of ``side_channel_keep_alive_timeout`` at most (the peer's is assumed to be
    the same setting); see ``kvbridge.handshake.http.client``. ``wire``: what the ``zmq``
    method speaks.

    The token goes only to the side channels ``trusted_side_channels`` names (none when
    unset): a fetch from another is refused before connecting (``kvbridge.trust``)."""
    client = _client(config, expected, method or config.handshake_method, keep_warm, wire)
    client.trusted = SideChannelTrust.parse(config.trusted_side_channels)
    return client


def _client(config: SideChannelConfig, expected: Compat | None, method: str, keep_warm: bool,
            wire: Wire) -> HandshakeClient:
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
    if wire == "vllm":
        no_token(config.token)
        return VllmZmqClient(config.handshake_timeout, config.max_message_bytes)
    return ZmqHandshakeClient(config.handshake_timeout, expected, config.token,
                              config.max_message_bytes)
