"""Side-channel settings: flags first, then environment (``KVBRIDGE_*`` or the vLLM alias).

Every setting is printed once at start-up by ``describe()`` (secrets redacted).
"""

from __future__ import annotations

import ssl
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

from kvbridge.errors import ConfigError
from kvbridge.extras import missing_extra_message
from kvbridge.settings import (
    HANDSHAKE_METHODS,
    SETTINGS,
    SIDE_CHANNEL_PORT_SETTING,
    ConnectionBudget,
    is_wildcard,
    name_label,
)
from kvbridge.settings.core import Label
from kvbridge.tokens import read_named_tokens, read_token_file

METHODS = HANDSHAKE_METHODS

# -- serving defaults: the one place flags, InstanceOptions, EngineConfig and build_engine
# take them from (the settings tree's) -----------------------------------------------------
DEFAULT_NUM_BLOCKS: int = SETTINGS["num_blocks"].default  # KV blocks per worker
DEFAULT_BLOCK_SIZE: int = SETTINGS["block_size"].default  # tokens per block
# prefill: held blocks are freed after this even if unread
DEFAULT_LEASE_SECONDS: float = SETTINGS["kv_lease_seconds"].default
# decode: seconds a started READ may take (within the lease)
DEFAULT_TRANSFER_TIMEOUT: float = SETTINGS["transfer_timeout"].default

__all__ = ["SIDE_CHANNEL_PORT_SETTING", "SideChannelConfig", "TLSConfig", "parse_cert_reqs"]


@dataclass(frozen=True)
class TLSConfig:
    """uvicorn-style TLS settings, used for the server and, as a client, for mTLS.

    ``cert_reqs`` is an ``ssl.VerifyMode`` value as uvicorn takes it.
    """

    certfile: str | None = None
    keyfile: str | None = None
    ca_certs: str | None = None
    cert_reqs: int = ssl.CERT_NONE

    @property
    def enabled(self) -> bool:
        return self.certfile is not None

    def client_context(self) -> ssl.SSLContext:
        """Verify the server against ``ca_certs`` (system store if unset); present our
        certificate so a server that requires client certificates accepts us."""
        ctx = ssl.create_default_context(cafile=self.ca_certs)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        if self.certfile:
            ctx.load_cert_chain(self.certfile, self.keyfile)
        return ctx


def _d(name: str) -> Any:
    return SETTINGS[name].default


@dataclass(frozen=True)
class SideChannelConfig:
    """The side channel's settings: the tree's ``side_channel`` group (docs/configuration.md),
    plus ``budget``, the connection budget its server runs under (None: the tree's, from
    the environment, with ``side_channel_keep_alive_timeout``)."""

    handshake_method: str = _d("handshake_method")
    handshake_timeout: float = _d("handshake_timeout")
    side_channel_host: str = _d("side_channel_host")
    side_channel_port: int = _d("side_channel_port")
    advertise_host: str | None = None
    token: str | None = None
    token_file: str | None = None
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    ssl_ca_certs: str | None = None
    ssl_cert_reqs: int = _d("ssl_cert_reqs")
    max_message_bytes: int = _d("max_message_bytes")
    # etcd (etcd://HOST:PORT): where the ``etcd`` method publishes and reads metadata
    registry: str | None = None
    registry_ca_certs: str | None = None
    registry_certfile: str | None = None
    registry_keyfile: str | None = None
    # who may fetch (kvbridge/handshake/authz.py): NAME:TOKEN lines accepted by the side
    # channel and the KV routes (instead of the single token; re-read when changed),
    # glob patterns a client certificate's CN or SAN must match (mutual TLS), and where
    # to append one JSON line per fetch, refusal and release
    tokens_file: str | None = None
    ssl_allowed_peers: str | None = None
    # side channels this instance presents its token to (kvbridge/trust.py)
    trusted_side_channels: str | None = None
    audit_log: str | None = None
    side_channel_isolation: str = _d("side_channel_isolation")
    side_channel_keep_alive_timeout: float = _d("side_channel_keep_alive_timeout")
    budget: ConnectionBudget | None = field(default=None, repr=False)

    @classmethod
    def load(cls, flags: Mapping[str, Any] | None = None,
             environ: Mapping[str, str] | None = None, label: Label = name_label,
             budget: ConnectionBudget | None = None) -> SideChannelConfig:
        """Flags (non-None values, named in errors by ``label``) win over the environment
        (``KVBRIDGE_*``, then the vLLM alias), which wins over the defaults."""
        values = SETTINGS.resolve(SETTING_NAMES, flags, environ, label)
        return cls(**values, budget=budget).validated()

    @property
    def server_budget(self) -> ConnectionBudget:
        """The budget of this side channel's server: ``budget`` (else the environment's)
        with the side channel's own keep-alive."""
        base = self.budget or ConnectionBudget.load()
        return replace(base, keep_alive_timeout=self.side_channel_keep_alive_timeout)

    @property
    def tls(self) -> TLSConfig:
        return TLSConfig(self.ssl_certfile, self.ssl_keyfile, self.ssl_ca_certs, self.ssl_cert_reqs)

    @property
    def registry_endpoint(self):  # -> EtcdEndpoint; the registry module needs the fleet extra
        try:
            from kvbridge.registry.etcd_client import parse_registry_url
        except ModuleNotFoundError as e:  # one line naming the extra, in vLLM as in the CLI
            line = missing_extra_message(e, "the registry")
            if line is None:
                raise
            raise ConfigError(line) from None

        return parse_registry_url(self.registry, ca_certs=self.registry_ca_certs,
                                  certfile=self.registry_certfile, keyfile=self.registry_keyfile)

    @property
    def advertised(self) -> str:
        return self.advertise_host or self.side_channel_host

    def validated(self) -> SideChannelConfig:
        """Refuse unsafe or inconsistent settings with a message saying what to change."""
        # the tree's check of each value (for a config built by hand: normalised too)
        checked = {name: SETTINGS[name].parse(getattr(self, name), name)
                   for name in SETTING_NAMES if getattr(self, name) is not None}
        if any(checked[k] != getattr(self, k) for k in checked):
            return replace(self, **checked).validated()
        if self.handshake_method == "etcd" and not self.registry:
            raise ConfigError("the etcd handshake method needs the registry: --registry "
                              "etcd://HOST:PORT (KVBRIDGE_REGISTRY)")
        if self.registry:
            self.registry_endpoint  # noqa: B018 - parsed now, so a bad URL fails at start
        if is_wildcard(self.advertised):
            raise ConfigError(
                f"advertising the wildcard address {self.advertised!r} tells peers nothing: "
                "set KVBRIDGE_ADVERTISE_HOST (--advertise-host) to an address peers can reach")
        if self.ssl_keyfile and not self.ssl_certfile:
            raise ConfigError("TLS key given without a certificate (ssl_certfile)")
        if self.ssl_cert_reqs != ssl.CERT_NONE and not self.ssl_certfile:
            # uvicorn would serve plaintext: no certificate, no TLS, no client check
            raise ConfigError("client certificates required (ssl_cert_reqs) but no server "
                              "certificate (ssl_certfile): TLS would be off")
        if self.ssl_cert_reqs != ssl.CERT_NONE and not self.ssl_ca_certs:
            raise ConfigError("client certificates required but no CA bundle (ssl_ca_certs) "
                              "to verify them")
        if self.ssl_allowed_peers and self.ssl_cert_reqs != ssl.CERT_REQUIRED:
            raise ConfigError("ssl_allowed_peers needs client certificates: set ssl_cert_reqs "
                              "to required")
        if self.tokens_file:
            read_named_tokens(self.tokens_file)  # now, so a bad file fails at start
        if self.token and self.token_file:
            raise ConfigError("give the side-channel token either inline or as a file, not both")
        if self.token_file:
            return replace(self, token=read_token_file(self.token_file), token_file=self.token_file)
        return self

    def describe(self) -> list[str]:
        out = []
        for f in fields(self):
            if f.name == "budget":
                continue
            v = getattr(self, f.name)
            if f.name == "token":
                v = "<set>" if v else None
            elif f.name == "ssl_cert_reqs":
                v = ssl.VerifyMode(v).name
            out.append(f"{f.name}={v}")
        return out


def parse_cert_reqs(value: str | int | None) -> int:
    """uvicorn's ``ssl_cert_reqs``: none/optional/required (or 0/1/2) -> ``ssl.VerifyMode``."""
    return int(ssl.CERT_NONE) if value is None else SETTINGS["ssl_cert_reqs"].parse(
        value, "ssl_cert_reqs")




# SideChannelConfig's settings: the tree's side-channel group, in field order.
SETTING_NAMES = tuple(s.name for s in SETTINGS.group("side_channel"))
assert SETTING_NAMES == tuple(f.name for f in fields(SideChannelConfig))[:-1]
