"""One settings tree: every setting declared once (name, type, default, environment names,
vLLM alias, check), in kvbridge/settings/tree.py. See docs/configuration.md."""

from kvbridge.settings.budget import ConnectionBudget
from kvbridge.settings.core import (
    DEFAULT_HOST,
    HANDSHAKE_METHODS,
    KV_LOAD_FAILURE_POLICIES,
    ROLES,
    ROUTING_POLICIES,
    Setting,
    Tree,
    flag_label,
    is_loopback,
    is_wildcard,
    name_label,
)
from kvbridge.settings.tree import SETTINGS, SIDE_CHANNEL_PORT_SETTING, cert_reqs

__all__ = [
    "DEFAULT_HOST",
    "HANDSHAKE_METHODS",
    "KV_LOAD_FAILURE_POLICIES",
    "ROLES",
    "ROUTING_POLICIES",
    "SETTINGS",
    "SIDE_CHANNEL_PORT_SETTING",
    "ConnectionBudget",
    "Setting",
    "Tree",
    "cert_reqs",
    "flag_label",
    "is_loopback",
    "is_wildcard",
    "name_label",
]
