"""Every exception kvbridge raises, in one place."""

from __future__ import annotations


class KVBridgeError(Exception):
    """Base class of kvbridge's errors."""


class ConfigError(KVBridgeError, ValueError):
    """A setting is missing, malformed or unsafe."""


class WireFormatError(KVBridgeError):
    """A message is malformed: wrong types, unknown or missing fields, too large."""


class SchemaVersionError(WireFormatError):
    """The peer speaks another version of the wire schema."""


class CompatibilityError(KVBridgeError):
    """The peer's KV cache cannot be read by us (different model, dtype, heads, ...).

    ``fields`` maps each differing field to (ours, theirs).
    """

    def __init__(self, fields: dict[str, tuple[object, object]]):
        self.fields = fields
        detail = ", ".join(f"{k}: ours={a!r} theirs={b!r}" for k, (a, b) in sorted(fields.items()))
        super().__init__(f"incompatible peer ({detail})")


class HandshakeError(KVBridgeError):
    """A handshake failed; the message says why."""


class HandshakeTimeout(HandshakeError, TimeoutError):
    """The peer did not answer within the handshake timeout."""


class AuthError(HandshakeError):
    """The side channel refused our credentials (token or certificate)."""


class PeerMismatch(HandshakeError):
    """The peer is not the one the request named (engine id, TP size)."""


class EpochChanged(HandshakeError):
    """The peer restarted: its instance epoch differs from the one expected."""


class TransferError(KVBridgeError):
    """A NIXL transfer failed or could not be built."""


class InvalidBlockIds(TransferError):
    """Block ids outside the cache they name."""


class TPMappingError(KVBridgeError, ValueError):
    """The two TP sizes and the head count cannot be mapped onto each other."""
