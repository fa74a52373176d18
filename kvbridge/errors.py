"""Every exception kvbridge raises, in one place; the failure record a KV load ends with;
and the one table that turns either into an HTTP answer (engine API, proxy, side channel
all answer errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``)."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any


class KVBridgeError(Exception):
    """Base class of kvbridge's errors."""


class ConfigError(KVBridgeError, ValueError):
    """A setting is missing, malformed or unsafe."""


class UnsupportedModelError(ConfigError):
    """A checkpoint's config asks for something this engine does not compute."""


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


class UntrustedSideChannel(HandshakeError):
    """A fetch with our token from a side channel not in ``trusted_side_channels``: refused
    before connecting, so the token never reaches it."""


class EpochChanged(HandshakeError):
    """The peer restarted: its instance epoch differs from the one expected."""


class RetryableHandshakeError(HandshakeError):
    """A transport failure worth another attempt before the deadline (refused, reset, not
    published yet): ``HandshakeClient.fetch_body`` retries it, then raises ``HandshakeTimeout``."""


class RegistryError(KVBridgeError):
    """etcd could not be reached or refused a call."""


class WatchCompacted(RegistryError):
    """The revision to resume from is gone: list again, then watch."""


class ClosedUnanswered(KVBridgeError):
    """An engine closed a reused keep-alive connection without a byte of answer to the
    request on it: the request never reached it, and is sent once more on a new connection
    (``kvbridge.proxy.upstream.send_retrying_once``). The proxy's transport raises an httpx
    ``RemoteProtocolError`` from it (its ``__cause__``), which the failover rules read."""


class AnswerTooLarge(KVBridgeError):
    """An engine's answer passed the proxy's cap on what it reads whole
    (``max_answer_bytes``): read no further, the connection closed. The proxy's transport
    raises an httpx ``RemoteProtocolError`` from it (its ``__cause__``)."""

    def __init__(self, limit: int):
        super().__init__(f"the answer passed the proxy's limit of {limit} bytes "
                         "(KVBRIDGE_MAX_ANSWER_BYTES)")
        self.limit = limit


class TransferError(KVBridgeError):
    """A NIXL transfer failed or could not be built."""


class InvalidBlockIds(TransferError):
    """Block ids outside the cache they name."""


class TPMappingError(KVBridgeError, ValueError):
    """The two TP sizes and the head count cannot be mapped onto each other."""


class EngineDeadError(KVBridgeError, RuntimeError):
    """The engine loop stopped (a worker failed, or the engine was shut down)."""


class WorkerError(KVBridgeError, RuntimeError):
    """A TP worker raised; the message holds every failing rank's traceback."""


class WorkerDiedError(KVBridgeError, RuntimeError):
    """A TP worker process exited or stopped answering; the engine cannot continue."""


class SideChannelError(KVBridgeError, RuntimeError):
    """The side-channel process could not start, or is down."""


class NodeError(KVBridgeError, RuntimeError):
    """A node of a multi-node instance did not join in time, or is gone."""


class ModelPrepareError(KVBridgeError):
    """``kvbridge model prepare``: a model could not be prepared; the message is one line
    that says why."""


class InvalidKVTransferParams(KVBridgeError, ValueError):
    """``kv_transfer_params`` that can never be served: wrong types, missing fields, blocks
    that do not fit the prompt, a peer other than the one named. The request's own fault:
    answered with a 400 naming ``param`` (always ``kv_transfer_params``), never recomputed."""

    param = "kv_transfer_params"


class RequestError(KVBridgeError):
    """A client request refused or failed, with the HTTP answer it gets."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 type_: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = (
            status, message, param, type_, code)

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


class FailureKind(enum.StrEnum):
    """Why a KV load failed: the request's own fault, or the infrastructure's."""

    INVALID_PARAMS = "invalid_params"  # never recomputed; a 400
    HANDSHAKE = "handshake"            # peer down, timeout, auth, TLS, incompatible, restarted
    TRANSFER = "transfer"              # a READ could not start, failed or timed out
    STALE = "stale"                    # the blocks read did not hold the prompt's KV
    ABORTED = "aborted"                # the request went away while loading


@dataclass(frozen=True)
class LoadFailure:
    """How one KV load failed (what workers report and the scheduler acts on)."""

    kind: FailureKind
    message: str

    @property
    def request_fault(self) -> bool:
        return self.kind is FailureKind.INVALID_PARAMS

    def __str__(self) -> str:
        if self.request_fault:
            return f"invalid kv_transfer_params: {self.message}"
        return f"KV load failed: {self.message}"


@dataclass(frozen=True)
class ErrorStatus:
    status: int
    type: str
    code: str | None = None


# First match in order wins: subclasses before their bases.
_STATUS: list[tuple[type[BaseException], ErrorStatus]] = [
    (InvalidKVTransferParams, ErrorStatus(400, "invalid_request_error")),
    (ConfigError, ErrorStatus(400, "invalid_request_error")),
    (WireFormatError, ErrorStatus(400, "invalid_request_error")),
    (AuthError, ErrorStatus(401, "authentication_error")),
    (HandshakeTimeout, ErrorStatus(504, "timeout")),
    (HandshakeError, ErrorStatus(502, "upstream_error")),
    (CompatibilityError, ErrorStatus(502, "upstream_error")),
    (TransferError, ErrorStatus(502, "server_error", "request_failed")),
    (EngineDeadError, ErrorStatus(503, "server_error", "engine_not_running")),
    (KVBridgeError, ErrorStatus(500, "server_error")),
]


def status_of(exc: BaseException) -> ErrorStatus:
    """The HTTP answer for an exception raised while serving a request."""
    for cls, status in _STATUS:
        if isinstance(exc, cls):
            return status
    return ErrorStatus(500, "server_error")


def failure_status(failure: LoadFailure) -> ErrorStatus:
    """The HTTP answer for a request whose KV load failed under the ``fail`` policy."""
    if failure.request_fault:
        return ErrorStatus(400, "invalid_request_error")
    return ErrorStatus(502, "server_error", "request_failed")


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape, used by every server kvbridge runs: ``code`` is a string naming
    the failure (the proxy's: the engine's, else the HTTP status as a string) or None."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
