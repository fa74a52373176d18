"""Request ids are ours: a client's ``x-request-id`` is used only when it is short and plain.

The id a proxy or an engine gives a request ends up in ``kv_transfer_params`` (as
``remote_request_id``), in the prefill's held-blocks table, in logs and in response
headers. A client's id is taken as is only if it is at most ``MAX_REQUEST_ID`` characters
of ``[A-Za-z0-9._:@+=-]``; anything else (too long, non-ASCII, spaces, control characters)
is replaced by an id of our own, and the client's is kept only as a label for the logs
(escaped and cut short). So no client can name an id that a later hop refuses, nor one
that breaks a header.
"""

from __future__ import annotations

import re
import uuid

__all__ = ["MAX_REQUEST_ID", "accept_request_id", "client_label"]

# Below params' 256-character bound on remote_request_id, with room for a retry's suffix.
MAX_REQUEST_ID = 128
_PLAIN = re.compile(rf"[A-Za-z0-9._:@+=-]{{1,{MAX_REQUEST_ID}}}")
_LABEL_CHARS = 64


def accept_request_id(given: str | None) -> tuple[str, str | None]:
    """``(id to use, client's refused id as a log label or None)``.

    A plain id of at most ``MAX_REQUEST_ID`` characters is used as is; otherwise a new
    one (32 hex digits) is made and the client's comes back as a short, escaped label.
    """
    if given is None or given == "":
        return uuid.uuid4().hex, None
    if _PLAIN.fullmatch(given):
        return given, None
    return uuid.uuid4().hex, client_label(given)


def client_label(given: str) -> str:
    """The client's id, printable and bounded: for logs, never for a header or a key."""
    text = given[:_LABEL_CHARS].encode("ascii", "backslashreplace").decode("ascii")
    text = "".join(c if c.isprintable() else f"\\x{ord(c):02x}" for c in text)
    return text + (f"...({len(given)} chars)" if len(given) > _LABEL_CHARS else "")
