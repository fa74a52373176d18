"""Handshake side channel: one strategy interface, two methods (``zmq``, ``http``)."""

from __future__ import annotations

from kvbridge.config import SideChannelConfig
from kvbridge.handshake.base import HandshakeClient, HandshakeServer, MetadataStore
from kvbridge.handshake.http import HttpHandshakeClient, HttpHandshakeServer
from kvbridge.handshake.zmq import ZmqHandshakeClient, ZmqHandshakeServer
from kvbridge.metadata import Compat

__all__ = ["HandshakeClient", "HandshakeServer", "MetadataStore", "make_client", "make_server"]


def make_server(config: SideChannelConfig, store: MetadataStore,
                port: int | None = None) -> HandshakeServer:
    """The side-channel server for ``config.handshake_method`` (not started)."""
    port = config.side_channel_port if port is None else port
    if config.handshake_method == "http":
        return HttpHandshakeServer(store, config.side_channel_host, port, token=config.token,
                                   tls=config.tls)
    return ZmqHandshakeServer(store, config.side_channel_host, port, token=config.token)


def make_client(config: SideChannelConfig, expected: Compat | None,
                method: str | None = None) -> HandshakeClient:
    """A client for ``method`` (default: the configured one)."""
    method = method or config.handshake_method
    if method == "http":
        return HttpHandshakeClient(config.handshake_timeout, expected, config.token,
                                   config.max_message_bytes, tls=config.tls)
    return ZmqHandshakeClient(config.handshake_timeout, expected, config.token,
                              config.max_message_bytes)
