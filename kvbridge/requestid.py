"""Request ids are ours: a client's ``x-request-id`` is a label, never an engine's key.

The id an engine gives a request ends up in its scheduler, in ``kv_transfer_params`` (as
``remote_request_id``), in the prefill's held-blocks table and in the logs. It is always
unique (``engine_request_ids``): two clients naming the same ``x-request-id`` at once
are two requests, never a collision that fails one of them. The client's id is kept as
the request's label: the answer's ``x-request-id`` header and ``id``, the logs (the
engine's id starts with it), and what a proxy sends both hops.

A client's id is taken as a label only if it is at most ``MAX_REQUEST_ID`` characters of
``[A-Za-z0-9._:@+=-]``; anything else (too long, non-ASCII, spaces, control characters)
is replaced by an id of our own, and the client's is kept only for the logs (escaped and
cut short). So no client can name an id that a later hop refuses, nor one that breaks a
header.
"""

from __future__ import annotations

import dataclasses
import re
import uuid

__all__ = ["MAX_REQUEST_ID", "RequestIds", "accept_request_id", "client_label",
           "engine_request_ids"]

# With our suffix, below params' 256-character bound on remote_request_id.
MAX_REQUEST_ID = 128
_PLAIN = re.compile(rf"[A-Za-z0-9._:@+=-]{{1,{MAX_REQUEST_ID}}}")
_LABEL_CHARS = 64


def accept_request_id(given: str | None) -> tuple[str, str | None]:
    """``(label to use, client's refused id as a log label or None)``.

    A plain id of at most ``MAX_REQUEST_ID`` characters is used as is; otherwise a new
    one (32 hex digits) is made and the client's comes back as a short, escaped label.
    """
    if given is None or given == "":
        return uuid.uuid4().hex, None
    if _PLAIN.fullmatch(given):
        return given, None
    return uuid.uuid4().hex, client_label(given)


@dataclasses.dataclass(frozen=True)
class RequestIds:
    """One request's ids in an engine."""

    own: str  # the engine's key for it, unique: never the client's alone
    label: str  # what the client calls it: its plain x-request-id, else ``own``
    refused: str | None  # the client's x-request-id for the logs, when not plain


def engine_request_ids(given: str | None) -> RequestIds:
    """The ids of a request that came with ``x-request-id: given`` (or none)."""
    label, refused = accept_request_id(given)
    if label != given:  # not the client's: made just now, so unique already
        return RequestIds(label, label, refused)
    return RequestIds(f"{label}-{uuid.uuid4().hex}", label, None)


def client_label(given: str) -> str:
    """The client's id, printable and bounded: for logs, never for a header or a key."""
    text = given[:_LABEL_CHARS].encode("ascii", "backslashreplace").decode("ascii")
    text = "".join(c if c.isprintable() else f"\\x{ord(c):02x}" for c in text)
    return text + (f"...({len(given)} chars)" if len(given) > _LABEL_CHARS else "")
