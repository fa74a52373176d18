"""One set of factories: the side channel's servers and clients, for ``kvbridge serve`` and
the vLLM plug-in alike, so every setting means the same in both (docs/configuration.md):
connection budgets and keep-alive, token and its rotation, named tokens and their scopes,
the client-certificate allow-list, the side channels trusted with the token, the audit log,
TLS, ``max_message_bytes``, the registry.

What differs is only what the ``zmq`` method speaks: kvbridge's own messages by default,
or another wire on the same settings (the plug-in's: vLLM's own, ``kvbridge.vllm.wire``),
passed as ``zmq=`` or named by ``wire=`` ("module:function", what a process of its own can
import: a function of the store's payloads giving the ``zmq`` method's server maker).

``side_channel`` is what serve and the plug-in start: the server in a process of its own
(``kvbridge.handshake.process``) or, with ``side_channel_isolation: thread``, in this one.
"""

from __future__ import annotations

import importlib
import logging
import socket
from collections.abc import Callable
from typing import Protocol, TypeVar

from kvbridge.config import SIDE_CHANNEL_PORT_SETTING, SideChannelConfig
from kvbridge.errors import ConfigError
from kvbridge.guard import ConnectionBudget
from kvbridge.handshake.authz import Authorizer
from kvbridge.handshake.base import HandshakeClient, HandshakeServer, MetadataStore, Observer
from kvbridge.handshake.http_client import HttpHandshakeClient
from kvbridge.handshake.http_server import HttpHandshakeServer
from kvbridge.handshake.zmq import ZmqHandshakeClient, ZmqHandshakeServer
from kvbridge.metadata import Compat
from kvbridge.net import bind_error
from kvbridge.trust import SideChannelTrust

__all__ = ["ZmqServerMaker", "make_client", "make_server", "side_channel"]

log = logging.getLogger(__name__)

C = TypeVar("C")


class ZmqServerMaker(Protocol):
    """Builds the ``zmq`` method's server from what the settings say (not started)."""

    def __call__(self, host: str, port: int, *, token: str | None, observer: Observer | None,
                 budget: ConnectionBudget, sock: socket.socket | None = None
                 ) -> HandshakeServer: ...


def side_channel(config: SideChannelConfig, store: MetadataStore, port: int | None = None,
                 observer: Observer | None = None, *, wire: str | None = None,
                 health: Callable[[], str | None] | None = None) -> HandshakeServer:
    """The side-channel server an instance starts (not started): in a process of its own
    unless ``config.side_channel_isolation`` is ``thread``. ``health``: why the instance
    cannot serve KV now (None: it can); the side channel answers 503 meanwhile."""
    if config.side_channel_isolation == "process":
        from kvbridge.handshake.process import SideChannelProcess

        return SideChannelProcess(config, store, port, observer, wire=wire, health=health)
    store.health = health
    return make_server(config, store, port, observer, wire=wire)


def make_server(config: SideChannelConfig, store: MetadataStore,
                port: int | None = None, observer: Observer | None = None, *,
                zmq: ZmqServerMaker | None = None, wire: str | None = None,
                sock: socket.socket | None = None) -> HandshakeServer:
    """The side-channel server for ``config.handshake_method`` (not started), in this
    process. ``zmq``: the ``zmq`` method's server (default: the one ``wire`` names, else
    kvbridge's, serving ``store``). ``sock``: a listening socket to serve (default:
    ``port`` bound now).

    A port that cannot be bound (in use, foreign address) raises ``ConfigError``.
    """
    port = config.side_channel_port if port is None else port
    if zmq is None and wire is not None and config.handshake_method == "zmq":
        zmq = _wire_server(wire, store)
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
        if zmq is None:
            return ZmqHandshakeServer(store, config.side_channel_host, port, token=config.token,
                                      observer=observer, budget=config.server_budget,
                                      sock=sock)
        return zmq(config.side_channel_host, port, token=config.token, observer=observer,
                   budget=config.server_budget, sock=sock)
    except OSError as e:  # a bind fails as ConfigError already (net.listen_socket); other errors too
        raise bind_error(config.side_channel_host, port, SIDE_CHANNEL_PORT_SETTING, e) from None


def make_client(config: SideChannelConfig, expected: Compat | None,
                method: str | None = None, keep_warm: bool = False, *,
                zmq: Callable[..., C] = ZmqHandshakeClient) -> HandshakeClient | C:
    """A client for ``method`` (default: the configured one). ``keep_warm``: an ``http``
    client keeps its connection to every peer it fetched from alive, with a request
    every half of ``side_channel_keep_alive_timeout`` at most (the peer's is assumed to be
    the same setting); see ``kvbridge.handshake.http_client``. ``zmq``: the ``zmq``
    method's client, called as ``zmq(timeout, expected, token, max_message_bytes)``.

    The token goes only to the side channels ``trusted_side_channels`` names (none when
    unset): a fetch from another is refused before connecting (``kvbridge.trust``)."""
    method = method or config.handshake_method
    client = _client(config, expected, method, keep_warm, zmq)
    if isinstance(client, HandshakeClient):  # the etcd method sends its token nowhere
        client.trusted = SideChannelTrust.parse(config.trusted_side_channels)
    return client


def _client(config: SideChannelConfig, expected: Compat | None, method: str, keep_warm: bool,
            zmq: Callable[..., C]) -> HandshakeClient | C:
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
    return zmq(config.handshake_timeout, expected, config.token, config.max_message_bytes)


def _wire_server(wire: str, store: MetadataStore) -> ZmqServerMaker:
    """The maker ``wire`` ("module:function") gives for the payloads ``store`` holds."""
    module, _, name = wire.partition(":")
    payloads = getattr(store, "payloads", None)
    if not name or payloads is None:
        raise ValueError(f"wire {wire!r}: 'module:function' of a PayloadStore's payloads")
    return getattr(importlib.import_module(module), name)(payloads()[0])
