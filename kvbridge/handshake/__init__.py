"""Handshake side channel: one strategy interface, two methods (``zmq``, ``http``)."""

from __future__ import annotations

import logging

from kvbridge.config import SideChannelConfig
from kvbridge.handshake.base import HandshakeClient, HandshakeServer, MetadataStore, Observer
from kvbridge.handshake.http import HttpHandshakeClient, HttpHandshakeServer
from kvbridge.handshake.zmq import ZmqHandshakeClient, ZmqHandshakeServer
from kvbridge.metadata import Compat

log = logging.getLogger(__name__)

__all__ = ["HandshakeClient", "HandshakeServer", "MetadataStore", "make_client", "make_server"]


def make_server(config: SideChannelConfig, store: MetadataStore,
                port: int | None = None, observer: Observer | None = None) -> HandshakeServer:
    """The side-channel server for ``config.handshake_method`` (not started)."""
    port = config.side_channel_port if port is None else port
    if config.handshake_method == "http":
        return HttpHandshakeServer(store, config.side_channel_host, port, token=config.token,
                                   tls=config.tls, observer=observer)
    if config.tls.enabled:
        log.warning("TLS settings do not apply to the zmq side channel: metadata and token "
                    "travel in clear (use --handshake http for TLS)")
    return ZmqHandshakeServer(store, config.side_channel_host, port, token=config.token,
                              observer=observer)


def make_client(config: SideChannelConfig, expected: Compat | None,
                method: str | None = None) -> HandshakeClient:
    """A client for ``method`` (default: the configured one)."""
    method = method or config.handshake_method
    if method == "http":
        return HttpHandshakeClient(config.handshake_timeout, expected, config.token,
                                   config.max_message_bytes, tls=config.tls)
    return ZmqHandshakeClient(config.handshake_timeout, expected, config.token,
                              config.max_message_bytes)
