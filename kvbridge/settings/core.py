"""What a setting is, and how a value from a flag, the environment or vLLM's extra config
becomes a checked one (or one ``ConfigError`` line naming the setting and its source)."""

from __future__ import annotations

import ipaddress
import math
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from kvbridge.errors import ConfigError

# -- values several settings and modules share: defined here, once ------------------------
ROLES = ("prefill", "decode", "both")
ROUTING_POLICIES = ("least-outstanding", "round-robin")
HANDSHAKE_METHODS = ("zmq", "http", "etcd")
KV_LOAD_FAILURE_POLICIES = ("recompute", "fail")
DEFAULT_HOST = "127.0.0.1"  # what every server binds unless told otherwise


def is_wildcard(host: str) -> bool:
    """``0.0.0.0``, ``::``, ``[::]``, ``""``, ``*``: every interface, no host to reach."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_unspecified
    except ValueError:
        return host in ("", "*")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class Setting:
    """One setting: its name, type, default, where it may come from, and its check.

    ``kind`` is ``int``, ``float``, ``str`` or a parser (str -> value, raising
    ``ValueError`` with the reason). ``low``/``high`` bound numbers (``low_open``: the low
    bound itself is refused). ``env``: our variables, read in order, then ``vllm`` (vLLM's
    alias). ``flag``: the command-line flag (``dest`` its argparse destination, default
    the name). ``extra_config``: accepted as a vLLM ``kv_connector_extra_config`` key.
    ``rule``: what else is checked (where the check needs other settings), for the docs.
    """

    name: str
    kind: Any
    default: Any
    help: str
    group: str
    env: tuple[str, ...] = ()
    vllm: str | None = None
    flag: str | None = None
    dest: str | None = None
    choices: tuple[str, ...] = ()
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    extra_config: bool = False
    rule: str = ""
    metavar: str | None = None

    @property
    def env_names(self) -> tuple[str, ...]:
        return self.env + ((self.vllm,) if self.vllm else ())

    @property
    def argparse_dest(self) -> str:
        return self.dest or self.name

    def describe_check(self) -> str:
        """The check, in words (docs and ``--help``)."""
        parts = []
        if self.choices:
            parts.append("one of " + ", ".join(f"`{c}`" for c in self.choices))
        elif self.kind is int:
            parts.append("an integer")
        elif self.kind is float:
            parts.append("a number")
        if self.low is not None and self.high is not None:
            left = "(" if self.low_open else "["
            parts.append(f"in {left}{_num(self.low)}, {_num(self.high)}]")
        elif self.low is not None:
            parts.append(f"{'>' if self.low_open else '>='} {_num(self.low)}")
        if self.rule:
            parts.append(self.rule)
        return "; ".join(parts)

    def parse(self, raw: Any, source: str) -> Any:
        """``raw`` (a string, or an already typed value) checked, or ``ConfigError``
        naming ``source`` (``--flag``, ``KVBRIDGE_X`` or the extra-config key)."""
        try:
            return self._parse(raw)
        except (ValueError, TypeError) as e:
            raise ConfigError(f"{source}={raw!r}: {e}") from None

    def _parse(self, raw: Any) -> Any:
        value = raw
        if self.kind is int:
            if isinstance(raw, bool) or isinstance(raw, float):
                raise ValueError("not an integer")
            try:
                value = int(raw.strip()) if isinstance(raw, str) else int(raw)
            except ValueError:
                raise ValueError("not an integer") from None
        elif self.kind is float:
            if isinstance(raw, bool):
                raise ValueError("not a number")
            try:
                value = float(raw)
            except ValueError:
                raise ValueError("not a number") from None
            if not math.isfinite(value):
                raise ValueError("not a finite number")
        elif self.kind is str:
            if not isinstance(raw, str):
                raise ValueError("not a string")
        else:
            value = self.kind(raw)
        if self.choices:
            value = str(value).strip().lower()
            if value not in self.choices:
                raise ValueError(f"use one of {', '.join(self.choices)}")
        if self.low is not None and (value < self.low or (self.low_open and value == self.low)):
            raise ValueError(f"must be {self._bounds()}")
        if self.high is not None and value > self.high:
            raise ValueError(f"must be {self._bounds()}")
        return value

    def _bounds(self) -> str:
        if self.high is None:
            return f"{'>' if self.low_open else '>='} {_num(self.low)}"
        return f"in {'(' if self.low_open else '['}{_num(self.low)}, {_num(self.high)}]"


def _num(x: float | None) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)


Label = Callable[[Setting], str]


def flag_label(s: Setting) -> str:
    return s.flag or s.name


def name_label(s: Setting) -> str:
    return s.name


class Tree:
    """Every setting, by name."""

    def __init__(self, settings: Iterable[Setting]) -> None:
        self.settings: dict[str, Setting] = {}
        for s in settings:
            if s.name in self.settings:
                raise ValueError(f"setting {s.name} declared twice")
            self.settings[s.name] = s

    def __getitem__(self, name: str) -> Setting:
        return self.settings[name]

    def __iter__(self) -> Iterator[Setting]:
        return iter(self.settings.values())

    def group(self, group: str) -> list[Setting]:
        return [s for s in self if s.group == group]

    def from_env(self, name: str, environ: Mapping[str, str] | None = None) -> Any:
        """The setting from the environment (an empty variable counts as unset), else
        its default."""
        s = self[name]
        environ = os.environ if environ is None else environ
        for env in s.env_names:
            raw = environ.get(env, "")
            if raw != "":
                return s.parse(raw, env)
        return s.default

    def resolve(self, names: Iterable[str], flags: Mapping[str, Any] | None = None,
                environ: Mapping[str, str] | None = None, label: Label = name_label
                ) -> dict[str, Any]:
        """Each setting from ``flags`` (a non-None value, named in errors by ``label``),
        else the environment (ours first, then vLLM's alias), else its default."""
        flags = flags or {}
        out: dict[str, Any] = {}
        for name in names:
            s = self[name]
            if flags.get(name) is not None:
                out[name] = s.parse(flags[name], label(s))
            else:
                out[name] = self.from_env(name, environ)
        return out
