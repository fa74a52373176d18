"""``ConnectionBudget``: the limits of one server's connections, made from the tree."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from kvbridge.settings.core import Label, name_label
from kvbridge.settings.tree import SETTINGS


@dataclass(frozen=True)
class ConnectionBudget:
    """Limits of one server's connections (seconds, counts and request-head bytes); the
    defaults are the tree's (``keep_alive_timeout``: the engine API's and the proxy's)."""

    max_connections: int = SETTINGS["max_connections"].default
    first_byte_timeout: float = SETTINGS["first_byte_timeout"].default
    head_timeout: float = SETTINGS["head_timeout"].default
    max_head_bytes: int = SETTINGS["max_head_bytes"].default
    max_headers: int = SETTINGS["max_headers"].default
    body_timeout: float = SETTINGS["body_timeout"].default
    keep_alive_timeout: float = SETTINGS["keep_alive_timeout"].default

    @classmethod
    def load(cls, flags: Mapping[str, Any] | None = None,
             environ: Mapping[str, str] | None = None, *, side_channel: bool = False,
             label: Label = name_label) -> ConnectionBudget:
        """From ``flags`` (non-None values), else the environment, else the defaults.
        ``side_channel``: the keep-alive is ``side_channel_keep_alive_timeout``."""
        names = [f.name for f in fields(cls)]
        if side_channel:
            names[names.index("keep_alive_timeout")] = "side_channel_keep_alive_timeout"
        values = SETTINGS.resolve(names, flags, environ, label)
        if side_channel:
            values["keep_alive_timeout"] = values.pop("side_channel_keep_alive_timeout")
        return cls(**values).validated()

    def validated(self) -> ConnectionBudget:
        """Each value checked as the tree says (for a budget built by hand)."""
        for f in fields(self):
            SETTINGS[f.name].parse(getattr(self, f.name), f.name)
        return self
