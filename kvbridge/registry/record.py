"""What an instance publishes about itself in the registry, and where."""

from __future__ import annotations

import msgspec

from kvbridge.settings import ROLES

# Every key the project writes lives under this prefix; one key per instance.
INSTANCES_PREFIX = "/kvbridge/v1/instances/"


class InstanceRecord(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    """One registered instance. Unknown fields are ignored so newer instances can add some."""

    engine_id: str
    epoch: str  # new on every start: a restarted instance is a new registration
    role: str
    api_url: str
    tp_size: int
    compat_hash: str  # only instances with equal hashes can share KV
    model: str = ""
    side_channel_host: str | None = None
    side_channel_port: int | None = None
    handshake_method: str | None = None
    load: int = 0  # KV blocks in use when last written (a hint, not per request)

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise msgspec.ValidationError(f"role {self.role!r}: use one of {ROLES}")
        if not self.api_url.startswith(("http://", "https://")):
            raise msgspec.ValidationError(f"api_url {self.api_url!r} is not http(s)")

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


def instance_key(record: InstanceRecord, prefix: str = INSTANCES_PREFIX) -> str:
    return f"{prefix}{record.role}/{record.engine_id}"
