"""docs/configuration.md's settings tables, made from the tree.

The doc holds each table between ``<!-- settings: GROUP ... -->`` and ``<!-- /settings -->``;
``kvbridge settings --write docs/configuration.md`` replaces what is between them, and
tests/test_settings.py checks that the doc holds exactly what the tree makes.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from kvbridge.settings.core import Setting
from kvbridge.settings.tree import SETTINGS

BLOCK = re.compile(r"(<!-- settings: ([a-z_ ]+) -->\n)(.*?)(<!-- /settings -->)", re.DOTALL)
HEADER = ("| Setting | Flag | Environment (ours, vLLM alias) | Default | Meaning | Check |\n"
          "|---|---|---|---|---|---|\n")


def show_default(value: Any) -> str:
    if value is None:
        return "unset"
    name = getattr(value, "name", None)  # ssl.VerifyMode
    if name is not None:
        return f"`{name.removeprefix('CERT_').lower()}`"
    return f"`{value:g}`" if isinstance(value, float) else f"`{value}`"


def row(s: Setting) -> str:
    env = ", ".join(f"`{e}`" for e in s.env_names) or "–"
    flag = f"`{s.flag}`" if s.flag else "–"
    cells = [f"`{s.name}`", flag, env, show_default(s.default), s.help,
             s.describe_check() or "–"]
    return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |\n"


def table(groups: list[str]) -> str:
    return HEADER + "".join(row(s) for g in groups for s in SETTINGS.group(g))


def render(text: str) -> str:
    """``text`` with every generated block made anew from the tree."""
    return BLOCK.sub(lambda m: m.group(1) + table(m.group(2).split()) + m.group(4), text)


def blocks(text: str) -> dict[str, str]:
    """The generated blocks of ``text``, by their groups."""
    return {m.group(2).strip(): m.group(3) for m in BLOCK.finditer(text)}


def write_tables(path: str | Path) -> None:
    p = Path(path)
    p.write_text(render(p.read_text()))


def table_text(markdown: bool = False) -> str:
    """Every setting: a markdown table per group, or one plain line each."""
    groups = list(dict.fromkeys(s.group for s in SETTINGS))
    if markdown:
        return "\n".join(f"<!-- settings: {g} -->\n{table([g])}<!-- /settings -->\n"
                         for g in groups)
    lines = []
    for s in SETTINGS:
        env = ",".join(s.env_names) or "-"
        lines.append(f"{s.group:13} {s.name:33} {s.flag or '-':34} {env:44} "
                     f"default={show_default(s.default).strip('`')}")
    return "\n".join(lines)
