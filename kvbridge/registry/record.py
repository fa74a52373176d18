"""What an instance publishes about itself in the registry, and where."""

from __future__ import annotations

from typing import Annotated
from urllib.parse import urlsplit

import msgspec

from kvbridge.settings import ROLES

# Every key the project writes lives under this prefix; one key per instance.
INSTANCES_PREFIX = "/kvbridge/v1/instances/"

# Bounds checked as a record is decoded (what etcd holds is bytes anyone with write access
# put there): a record the proxy keeps is one it can route to.
Port = Annotated[int, msgspec.Meta(ge=1, le=65535)]
Positive = Annotated[int, msgspec.Meta(ge=1)]
NonNegative = Annotated[int, msgspec.Meta(ge=0)]


class InstanceRecord(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    """One registered instance. Unknown fields are ignored so newer instances can add some."""

    engine_id: str
    epoch: str  # new on every start: a restarted instance is a new registration
    role: str
    api_url: str
    tp_size: Positive
    compat_hash: str  # only instances with equal hashes can share KV
    model: str = ""
    side_channel_host: str | None = None
    side_channel_port: Port | None = None
    handshake_method: str | None = None
    load: NonNegative = 0  # KV blocks in use when last written (a hint, not per request)

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise msgspec.ValidationError(f"role {self.role!r}: use one of {ROLES}")
        if not _routable(self.api_url):
            raise msgspec.ValidationError(f"api_url {self.api_url!r} is not an http(s) URL "
                                          "with a host (and a port in 1-65535)")

    @property
    def serves_prefill(self) -> bool:
        return self.role in ("prefill", "both")

    @property
    def serves_decode(self) -> bool:
        return self.role in ("decode", "both")

    def encode(self) -> bytes:
        return msgspec.json.encode(self)

    @staticmethod
    def decode(data: bytes) -> InstanceRecord:
        """Raises ``msgspec.ValidationError``/``DecodeError`` for anything malformed."""
        return msgspec.json.decode(data, type=InstanceRecord)


def _routable(url: str) -> bool:
    """An http(s) URL an HTTP client takes: printable ASCII, a host, a port in range."""
    if not (url.isascii() and url.isprintable()) or " " in url:
        return False
    try:
        parts = urlsplit(url)  # ValueError: a bracketed host not closed
        port = parts.port  # ValueError: not a number, or over 65535
    except ValueError:
        return False
    return parts.scheme in ("http", "https") and bool(parts.hostname) and port != 0


def instance_key(record: InstanceRecord, prefix: str = INSTANCES_PREFIX) -> str:
    return f"{prefix}{record.role}/{record.engine_id}"
