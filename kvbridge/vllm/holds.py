"""A hold is a capability inside vLLM too: a READ-done note releases a prefill's blocks only
with the hold's key (as kvbridge's own engine, protocol.md §9a).

vLLM's prefill frees a request's blocks on any NIXL note ``"<request id>:<consumers>"``,
so any process with NIXL access to it can release a hold by naming a request id (a decode
then READs blocks given to another prompt). With the plug-in:

* the prefill's scheduler gives every hold a fresh 128-bit key, in ``kv_transfer_params``
  (``kvbridge_hold_key``) and, through the connector metadata, to its workers. The workers
  get it with the step that computes the request, before its id leaves the prefill: a key
  sent only once the request is held left a step in which a note naming it freed it;
* a decode adds the key of the request to every note it sends for it
  (``"<request id>:<consumers>|kvbridge-key=<key>"``); a prefill without keys (a stock
  vLLM) never gives one, so it only ever gets vLLM's own notes;
* the prefill passes on to vLLM only notes that carry the key of a hold it keyed; others
  release nothing, are counted (``vllm:kvbridge_notes_ignored_total{why}``) and logged
  once per sender. Heartbeats (``HB:...``) pass: they only extend a lease.

Both sides work through ``KeyedAgent``, a thin wrapper of vLLM's NIXL agent. A stock vLLM
decode's notes carry no key: its holds last the lease, unless ``hold_keys: off``.

Whatever ``hold_keys`` says, a prefill passes vLLM only notes it can parse: vLLM unpacks
``msg.rsplit(":", 1)`` and ``int(...)`` inside the engine step, so one malformed note from
anyone with NIXL access would kill the engine. Anything else is dropped and counted
(``why="malformed"``).

In push mode (``registrations``) the notes are the other way round: a decode's registration
(``PUSH_REG:``, parse-checked by kvbridge.vllm.pushreg, its key checked by the push worker
when it is matched) and the prefill's WRITE-done note ``"<decode request id>:<writers>"``,
to which the prefill adds the key and which the decode checks as a prefill checks READ-done
notes in pull mode.
"""

from __future__ import annotations

import hmac
import logging
import re
import secrets
from collections.abc import Callable
from typing import Any

from kvbridge.vllm.pushreg import PUSH_REG_PREFIX, registration

log = logging.getLogger("vllm.kvbridge")

KEY_PARAM = "kvbridge_hold_key"  # in kv_transfer_params
SEP = "|kvbridge-key="
HEARTBEAT = "HB:"
# What vLLM's _get_new_notifs parses: "<request id>:<consumers>" (a positive count).
_READ_DONE = re.compile(r"(?s).+:[1-9][0-9]{0,8}")


def new_key() -> str:
    return secrets.token_urlsafe(16)  # 128 bits; no ':' or '|'


class HoldKeys:
    """A scheduler's hold keys (mixed in before vLLM's scheduler, pull or push): a
    prefill's request has its key from the step that computes it (the workers know it
    before anyone can name the request in a note) and gives it out with its params if it
    is held; a decode passes the key of each request it receives to its workers."""

    def _kvbridge_keys_init(self, hold_keys: str) -> None:
        self._kvbridge_keys_on = hold_keys == "require"
        self._kvbridge_keys: dict[str, str] = {}  # prefill: request id -> its hold's key
        self._kvbridge_new_keys: dict[str, str] = {}  # not yet sent to the workers
        self._kvbridge_recv_keys: dict[str, str] = {}  # decode: request id -> its key

    def _kvbridge_key_computed(self, request: Any) -> None:
        """From the step that computes a request a decode will read: its key."""
        if self._kvbridge_keys_on and (request.kv_transfer_params or {}).get("do_remote_decode"):
            rid = request.request_id
            self._kvbridge_new_keys[rid] = self._kvbridge_keys.setdefault(rid, new_key())

    def request_finished(self, request: Any, block_ids: Any
                         ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's; a held request's params carry its hold's key."""
        delay, params = super().request_finished(request, block_ids)  # type: ignore[misc]
        key = self._kvbridge_keys.pop(request.request_id, None)
        if delay and params is not None and self._kvbridge_keys_on:
            if key is None:  # held without an allocation seen here: keyed now (late)
                key = self._kvbridge_new_keys[request.request_id] = new_key()
            params[KEY_PARAM] = key
        return delay, params

    def _kvbridge_keys_meta(self, meta: Any, scheduler_output: Any) -> None:
        """The step's keys on its connector metadata: the new holds' (a prefill's) and
        those of the requests to receive (a decode's)."""
        meta.kvbridge_hold_keys, self._kvbridge_new_keys = self._kvbridge_new_keys, {}
        meta.kvbridge_recv_keys = {r: self._kvbridge_recv_keys.pop(r)
                                   for r in meta.reqs_to_recv if r in self._kvbridge_recv_keys}
        for r in scheduler_output.finished_req_ids:
            self._kvbridge_recv_keys.pop(r, None)


class KeyedAgent:
    """vLLM's NIXL agent with hold keys on READ-done notes (everything else is the agent's)."""

    def __init__(self, agent: Any, on_ignored: Callable[[str], None], keys: bool = True,
                 registrations: bool = False):
        """``keys``: hold keys are given and checked (``hold_keys: require``); without,
        only the parse check applies. ``registrations``: push mode's registration notes
        pass (when they parse)."""
        self._agent = agent
        self._on_ignored = on_ignored
        self.keys = keys
        self.registrations = registrations
        self.send_keys: dict[str, str] = {}  # decode: remote request id -> its hold's key
        self.hold_keys: dict[str, str] = {}  # prefill: request id -> the key it gave out
        self._warned: set[tuple[str, str]] = set()  # (sender, why): logged once

    def __getattr__(self, name: str) -> Any:
        return getattr(self._agent, name)

    # -- a decode's notes ------------------------------------------------------------

    def _keyed(self, msg: Any) -> Any:
        if not msg or not self.send_keys or (isinstance(msg, bytes)
                                             and msg.startswith(PUSH_REG_PREFIX)):
            return msg
        text = msg.decode("utf-8", "replace") if isinstance(msg, bytes) else str(msg)
        key = self.send_keys.get(text.rsplit(":", 1)[0])
        return msg if key is None or text.startswith(HEARTBEAT) else f"{text}{SEP}{key}".encode()

    def make_prepped_xfer(self, *args: Any, **kwargs: Any) -> Any:
        if "notif_msg" in kwargs:
            kwargs["notif_msg"] = self._keyed(kwargs["notif_msg"])
        elif len(args) > 5:
            args = (*args[:5], self._keyed(args[5]), *args[6:])
        return self._agent.make_prepped_xfer(*args, **kwargs)

    def send_notif(self, remote_agent: str, *args: Any, **kwargs: Any) -> Any:
        if "notif_msg" in kwargs:
            kwargs["notif_msg"] = self._keyed(kwargs["notif_msg"])
        elif args:
            args = (self._keyed(args[0]), *args[1:])
        return self._agent.send_notif(remote_agent, *args, **kwargs)

    # -- a prefill's notes -----------------------------------------------------------

    def get_new_notifs(self, *args: Any, **kwargs: Any) -> dict[str, list[bytes]]:
        out: dict[str, list[bytes]] = {}
        for sender, msgs in self._agent.get_new_notifs(*args, **kwargs).items():
            kept = [m for m in (self._admit(sender, msg) for msg in msgs) if m is not None]
            if kept:
                out[sender] = kept
        return out

    def _admit(self, sender: str, msg: Any) -> bytes | None:
        try:
            raw = bytes(msg)
        except TypeError:
            return self._drop(sender, "malformed")
        if self.registrations and raw.startswith(PUSH_REG_PREFIX):
            return raw if registration(raw) is not None else self._drop(sender, "malformed")
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            return self._drop(sender, "malformed")
        if text.startswith(HEARTBEAT):
            return text.encode()  # vLLM only splits it on commas
        base, sep, key = text.partition(SEP)
        if not _READ_DONE.fullmatch(base) or (sep and not key):
            return self._drop(sender, "malformed")
        held = self.hold_keys.get(base.rsplit(":", 1)[0]) if self.keys else None
        if held is None:
            return base.encode()  # no key given for it: vLLM's own checks follow
        if key and hmac.compare_digest(key, held):
            return base.encode()
        return self._drop(sender, "bad_key" if key else "no_key")

    def _drop(self, sender: str, why: str) -> None:
        self._on_ignored(why)
        if (sender, why) not in self._warned:
            self._warned.add((sender, why))
            if why == "malformed":
                log.warning("kvbridge: a malformed NIXL note from agent %s was dropped (vLLM "
                            "takes '<request id>:<consumers>', 'HB:<ids>'%s)", sender,
                            " or a whole PUSH_REG registration" if self.registrations else "")
            else:
                log.warning("kvbridge: a note from NIXL agent %s without its hold's key (%s) "
                            "released nothing%s", sender, why,
                            "; a stock vLLM decode's holds last the lease (kv_lease_duration) "
                            "unless hold_keys is off" if why == "no_key" else "")
        return None
