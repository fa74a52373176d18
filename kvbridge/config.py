"""Side-channel settings: flags first, then environment (``KVBRIDGE_*`` or the vLLM alias).

Every setting is printed once at start-up by ``describe()`` (secrets redacted).
"""

from __future__ import annotations

import ipaddress
import os
import ssl
import stat
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from kvbridge.errors import ConfigError
from kvbridge.metadata import DEFAULT_MAX_MESSAGE_BYTES

METHODS = ("zmq", "http", "etcd")

# -- serving defaults: the one place flags, InstanceOptions, EngineConfig and build_engine
# take them from -------------------------------------------------------------------------
DEFAULT_NUM_BLOCKS = 256        # KV blocks per worker
DEFAULT_BLOCK_SIZE = 16         # tokens per block
DEFAULT_LEASE_SECONDS = 30.0    # prefill: held blocks are freed after this even if unread
DEFAULT_TRANSFER_TIMEOUT = 30.0  # decode: seconds a started READ may take (within the lease)

# setting -> environment names, ours first, then the vLLM alias
ENV_NAMES: dict[str, tuple[str, ...]] = {
    "handshake_method": ("KVBRIDGE_HANDSHAKE_METHOD", "VLLM_NIXL_HANDSHAKE_METHOD"),
    "handshake_timeout": ("KVBRIDGE_HANDSHAKE_TIMEOUT", "VLLM_NIXL_HANDSHAKE_TIMEOUT"),
    "side_channel_host": ("KVBRIDGE_SIDE_CHANNEL_HOST", "VLLM_NIXL_SIDE_CHANNEL_HOST"),
    "side_channel_port": ("KVBRIDGE_SIDE_CHANNEL_PORT", "VLLM_NIXL_SIDE_CHANNEL_PORT"),
    "advertise_host": ("KVBRIDGE_ADVERTISE_HOST",),
    "token": ("KVBRIDGE_SIDE_CHANNEL_TOKEN",),
    "token_file": ("KVBRIDGE_SIDE_CHANNEL_TOKEN_FILE",),
    "ssl_certfile": ("KVBRIDGE_SSL_CERTFILE",),
    "ssl_keyfile": ("KVBRIDGE_SSL_KEYFILE",),
    "ssl_ca_certs": ("KVBRIDGE_SSL_CA_CERTS",),
    "ssl_cert_reqs": ("KVBRIDGE_SSL_CERT_REQS",),
    "max_message_bytes": ("KVBRIDGE_MAX_MESSAGE_BYTES",),
    "registry": ("KVBRIDGE_REGISTRY",),
    "registry_ca_certs": ("KVBRIDGE_REGISTRY_CA_CERTS",),
    "registry_certfile": ("KVBRIDGE_REGISTRY_CERTFILE",),
    "registry_keyfile": ("KVBRIDGE_REGISTRY_KEYFILE",),
    "tokens_file": ("KVBRIDGE_SIDE_CHANNEL_TOKENS_FILE",),
    "ssl_allowed_peers": ("KVBRIDGE_SSL_ALLOWED_PEERS",),
    "audit_log": ("KVBRIDGE_AUDIT_LOG",),
}

# How a port-in-use error names the side-channel port setting.
SIDE_CHANNEL_PORT_SETTING = "--side-channel-port / KVBRIDGE_SIDE_CHANNEL_PORT"

_CERT_REQS = {"none": ssl.CERT_NONE, "optional": ssl.CERT_OPTIONAL, "required": ssl.CERT_REQUIRED,
              "0": ssl.CERT_NONE, "1": ssl.CERT_OPTIONAL, "2": ssl.CERT_REQUIRED}


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


@dataclass(frozen=True)
class SideChannelConfig:
    handshake_method: str = "zmq"
    handshake_timeout: float = 10.0
    side_channel_host: str = "127.0.0.1"
    side_channel_port: int = 5600
    advertise_host: str | None = None
    token: str | None = None
    token_file: str | None = None
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    ssl_ca_certs: str | None = None
    ssl_cert_reqs: int = ssl.CERT_NONE
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
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
    audit_log: str | None = None

    @classmethod
    def load(cls, flags: Mapping[str, Any] | None = None,
             environ: Mapping[str, str] | None = None) -> SideChannelConfig:
        """Flags (non-None values) win over the environment, which wins over defaults."""
        environ = os.environ if environ is None else environ
        flags = flags or {}
        values: dict[str, Any] = {}
        for f in fields(cls):
            if flags.get(f.name) is not None:
                values[f.name] = flags[f.name]
                continue
            for env in ENV_NAMES.get(f.name, ()):
                if environ.get(env, "") != "":
                    values[f.name] = environ[env]
                    break
        return cls(**_coerce(values)).validated()

    @property
    def tls(self) -> TLSConfig:
        return TLSConfig(self.ssl_certfile, self.ssl_keyfile, self.ssl_ca_certs, self.ssl_cert_reqs)

    @property
    def registry_endpoint(self):  # -> EtcdEndpoint; the registry module needs the fleet extra
        from kvbridge.registry.etcd import parse_registry_url

        return parse_registry_url(self.registry, ca_certs=self.registry_ca_certs,
                                  certfile=self.registry_certfile, keyfile=self.registry_keyfile)

    @property
    def advertised(self) -> str:
        return self.advertise_host or self.side_channel_host

    def validated(self) -> SideChannelConfig:
        """Refuse unsafe or inconsistent settings with a message saying what to change."""
        if self.handshake_method not in METHODS:
            raise ConfigError(f"handshake method {self.handshake_method!r}: use one of {METHODS}")
        if self.handshake_method == "etcd" and not self.registry:
            raise ConfigError("the etcd handshake method needs the registry: --registry "
                              "etcd://HOST:PORT (KVBRIDGE_REGISTRY)")
        if self.registry:
            self.registry_endpoint  # noqa: B018 - parsed now, so a bad URL fails at start
        if not 0 < self.handshake_timeout <= 3600:
            raise ConfigError(f"handshake timeout must be in (0, 3600] seconds, got "
                              f"{self.handshake_timeout}")
        if not 1024 <= self.max_message_bytes <= 1 << 30:
            raise ConfigError(f"max_message_bytes {self.max_message_bytes} outside 1 KiB .. 1 GiB")
        if not 0 <= self.side_channel_port <= 65535:
            raise ConfigError(f"side channel port {self.side_channel_port} out of range")
        if _is_wildcard(self.advertised):
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
            from kvbridge.handshake.authz import _read_named

            _read_named(self.tokens_file)  # now, so a bad file fails at start
        if self.token and self.token_file:
            raise ConfigError("give the side-channel token either inline or as a file, not both")
        if self.token_file:
            return replace(self, token=read_token_file(self.token_file), token_file=self.token_file)
        return self

    def describe(self) -> list[str]:
        out = []
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name == "token":
                v = "<set>" if v else None
            elif f.name == "ssl_cert_reqs":
                v = ssl.VerifyMode(v).name
            out.append(f"{f.name}={v}")
        return out


def read_token_file(path: str) -> str:
    p = Path(path)
    try:
        st = p.stat()
        text = p.read_text().strip()
    except OSError as e:
        raise ConfigError(f"cannot read token file {path}: {e.strerror}") from None
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError(f"token file {path} is readable by group or others "
                          f"(mode {stat.S_IMODE(st.st_mode):o}): chmod 600 it")
    if not text:
        raise ConfigError(f"token file {path} is empty")
    return text


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _is_wildcard(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_unspecified
    except ValueError:
        return host in ("", "*")


def _coerce(values: dict[str, Any]) -> dict[str, Any]:
    out = dict(values)
    try:
        if "handshake_method" in out:
            out["handshake_method"] = str(out["handshake_method"]).strip().lower()
        if "handshake_timeout" in out:
            out["handshake_timeout"] = float(out["handshake_timeout"])
        for k in ("side_channel_port", "max_message_bytes"):
            if k in out:
                out[k] = int(out[k])
    except ValueError as e:
        raise ConfigError(f"bad setting value: {e}") from None
    if "ssl_cert_reqs" in out:
        out["ssl_cert_reqs"] = parse_cert_reqs(out["ssl_cert_reqs"])
    return out


def parse_cert_reqs(value: str | int | None) -> int:
    """uvicorn's ``ssl_cert_reqs``: none/optional/required (or 0/1/2) -> ``ssl.VerifyMode``."""
    if value is None:
        return int(ssl.CERT_NONE)
    if isinstance(value, int) and not isinstance(value, bool) and value in (0, 1, 2):
        return value
    key = str(value).strip().lower().removeprefix("cert_")
    if key not in _CERT_REQS:
        raise ConfigError(f"ssl_cert_reqs {value!r}: use none, optional or required (or 0, 1, 2)")
    return int(_CERT_REQS[key])


DEFAULT_NODE_TIMEOUT = 120.0


@dataclass(frozen=True)
class MultiNodeConfig:
    """Where this node sits in a multi-node instance (vLLM's flag names).

    ``host``: this node's address as other nodes and peers reach it (its
    ``--advertise-host``); gloo binds the interface that owns it.
    ``node_timeout``: seconds to wait for every node to join (and for a silent
    peer before it is declared gone).
    """

    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int
    host: str
    node_timeout: float = DEFAULT_NODE_TIMEOUT

    def check(self, tp_size: int) -> None:
        """Refuse a layout that cannot work, with one line saying what to change."""
        if self.nnodes < 1:
            raise ConfigError(f"--nnodes must be >= 1, got {self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ConfigError(f"--node-rank {self.node_rank} outside 0..{self.nnodes - 1}")
        if tp_size % self.nnodes:
            raise ConfigError(f"--tp {tp_size} is not a multiple of --nnodes {self.nnodes}: "
                              "every node must hold the same number of ranks")
        if not 0 < self.master_port < 65536:
            raise ConfigError(f"--master-port {self.master_port} out of range")
        if not self.master_addr:
            raise ConfigError("--master-addr is required with --nnodes > 1")
        if not 0 < self.node_timeout <= 3600:
            raise ConfigError(f"--node-timeout must be in (0, 3600] seconds, got "
                              f"{self.node_timeout}")
        if _is_loopback(self.host) and not _is_loopback(self.master_addr):
            raise ConfigError(f"this node's address {self.host!r} is a loopback address but "
                              f"the head is at {self.master_addr!r}: set --advertise-host to "
                              "an address the other nodes reach this one at")
        if _is_wildcard(self.host):
            raise ConfigError(f"advertising the wildcard address {self.host!r} tells other "
                              "nodes nothing: set --advertise-host to this node's address")

    def ranks_per_node(self, tp_size: int) -> int:
        return tp_size // self.nnodes

    def local_ranks(self, tp_size: int) -> list[int]:
        k = self.ranks_per_node(tp_size)
        return list(range(self.node_rank * k, self.node_rank * k + k))

    def remote_ranks(self, tp_size: int) -> list[int]:
        """Ranks outside the head node: those reached through the control group."""
        return list(range(self.ranks_per_node(tp_size), tp_size))
