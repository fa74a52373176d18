"""The tree's settings as ``argparse`` flags: defaults left None when the parser is built,
the environment and the defaults read when a sub-command runs (``fill``), so ``--help``
works whatever the environment holds and a bad value is one line naming its source."""

from __future__ import annotations

import argparse
from collections.abc import Collection, Mapping, Sequence

from kvbridge.settings.core import Setting, flag_label
from kvbridge.settings.tree import SETTINGS


def flag_help(s: Setting) -> str:
    text = s.help.replace("`", "").replace("**", "").replace("%", "%%")
    first = text.split(". ")[0].rstrip(".")
    env = f"env {', '.join(s.env_names)}; " if s.env_names else ""
    default = "unset" if s.default is None else getattr(s.default, "name", s.default)
    return f"{first} ({env}default {default})"


def add_flags(p: argparse.ArgumentParser | argparse._ArgumentGroup,
              names: Sequence[str]) -> None:
    for name in names:
        s = SETTINGS[name]
        assert s.flag is not None, name
        metavar = s.metavar or ("{" + ",".join(s.choices) + "}" if s.choices else None)
        p.add_argument(s.flag, dest=s.argparse_dest, metavar=metavar, help=flag_help(s))


def fill(args: argparse.Namespace, environ: Mapping[str, str],
         keep: Collection[str] = ()) -> None:
    """Each tree setting ``args`` holds (by its argparse destination, except those in
    ``keep``): the flag, else the environment, else the default, checked."""
    given = vars(args)
    names = [s.name for s in SETTINGS if s.flag and s.argparse_dest in given
             and s.argparse_dest not in keep]
    flags = {n: given[SETTINGS[n].argparse_dest] for n in names}
    for name, value in SETTINGS.resolve(names, flags, environ, flag_label).items():
        setattr(args, SETTINGS[name].argparse_dest, value)
