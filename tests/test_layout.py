"""The package's rooms: the proxy loads no engine (and so no torch); the layers, line
budget and private names of docs/layout.md, checked from the source with ``ast``."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import ROOT


def test_the_proxy_loads_no_torch():
    """``kvbridge proxy`` (its CLI path and its app) must not import the engine: the
    request checks it shares with the engines live in kvbridge.openai.schemas."""
    code = (
        "import sys\n"
        "from kvbridge.cli import main\n"
        "try:\n"
        "    main(['proxy', '--help'])\n"
        "except SystemExit:\n"
        "    pass\n"
        "from kvbridge.proxy import build_proxy_app, run_proxy\n"
        "build_proxy_app(['http://127.0.0.1:1'], ['http://127.0.0.1:2'], prewarm=False,\n"
        "                admin_routes='open')\n"
        "import kvbridge.openai.schemas, kvbridge.openai.responses\n"
        "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith(('torch.',\n"
        "             'kvbridge.engine', 'kvbridge.model')))\n"
        "print('loaded:', bad)\n"
        "sys.exit(1 if bad else 0)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "usage: kvbridge proxy" in out.stdout and "loaded: []" in out.stdout


# -- the package's layers, from docs/layout.md, checked against the source with ast ------------

LAYOUT_DOC = ROOT / "docs" / "layout.md"
PACKAGE = ROOT / "kvbridge"
LINE_BUDGET = 400


@dataclass(frozen=True)
class Import:
    target: str  # the kvbridge module imported (``from kvbridge.x import y``: kvbridge.x[.y])
    names: tuple[str, ...]  # the names taken from it (empty for ``import a.b``)
    line: int
    local: bool  # inside a function
    type_only: bool  # under ``if TYPE_CHECKING:``


@dataclass(frozen=True)
class LayerMap:
    layers: dict[str, int]  # room ("config.py", "handshake/") -> layer
    lazy_upward: frozenset[tuple[str, str]]  # (importer module, imported module) allowed
    over_budget: frozenset[str]  # paths relative to the repository


def _section(text: str, title: str) -> str:
    head = f"### {title}\n"
    assert head in text, f"docs/layout.md has no section {title!r}"
    return text.split(head, 1)[1].split("\n#", 1)[0]


def read_layer_map(text: str) -> LayerMap:
    layers = {m[2]: int(m[1]) for m in re.finditer(r"^\| (\d+) \| `([^`]+)` \|", text, re.M)}
    lazy = frozenset((m[1], m[2]) for m in re.finditer(
        r"^- `([\w.]+)` → `([\w.]+)`", _section(text, "Function-local upward imports allowed"),
        re.M))
    over = frozenset(re.findall(r"^- `(kvbridge/[\w/]+\.py)`",
                                _section(text, "Modules allowed over 400 lines"), re.M))
    return LayerMap(layers, lazy, over)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def room_of(module: str) -> str:
    """kvbridge.handshake.zmq -> "handshake/"; kvbridge.config -> "config.py"; the package
    itself -> "__init__.py"."""
    parts = module.split(".")
    if len(parts) == 1:
        return "__init__.py"
    return parts[1] + "/" if (PACKAGE / parts[1]).is_dir() else parts[1] + ".py"


def _is_module(dotted: str) -> bool:
    path = ROOT.joinpath(*dotted.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def imports_of(module: str, source: str, is_package: bool = False) -> list[Import]:
    """Every import of a kvbridge module in ``source`` (the module ``module``)."""
    out: list[Import] = []

    def visit(node: ast.AST, local: bool, type_only: bool) -> None:
        for child in ast.iter_child_nodes(node):
            in_fn = local or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                ast.Lambda))
            tc = type_only or (isinstance(child, ast.If)
                               and "TYPE_CHECKING" in ast.unparse(child.test))
            if isinstance(child, ast.Import):
                out.extend(Import(a.name, (), child.lineno, in_fn, tc) for a in child.names
                           if a.name.split(".")[0] == "kvbridge")
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = module.split(".") if is_package else module.split(".")[:-1]
                    base = base[:len(base) - child.level + 1]
                    target = ".".join(base + ([child.module] if child.module else []))
                else:
                    target = child.module or ""
                if target.split(".")[0] == "kvbridge":
                    plain = [a.name for a in child.names]
                    subs = [n for n in plain if _is_module(f"{target}.{n}")]
                    out.extend(Import(f"{target}.{n}", (), child.lineno, in_fn, tc) for n in subs)
                    rest = tuple(n for n in plain if n not in subs)
                    if rest:
                        out.append(Import(target, rest, child.lineno, in_fn, tc))
            visit(child, in_fn, tc)

    visit(ast.parse(source), False, False)
    return out


def upward_imports(module: str, source: str, layer_map: LayerMap,
                   is_package: bool = False) -> list[str]:
    """Imports of ``module`` that point to its own layer's other rooms or above."""
    layers = layer_map.layers
    room = room_of(module)
    if room not in layers:
        return [f"{module}: its room {room} is not in docs/layout.md's table"]
    problems = []
    for imp in imports_of(module, source, is_package):
        target_room = room_of(imp.target)
        if target_room == room:
            continue
        if target_room not in layers:
            problems.append(f"{module}:{imp.line} imports {imp.target}, whose room "
                            f"{target_room} is not in docs/layout.md's table")
            continue
        if layers[target_room] < layers[room]:
            continue
        if imp.local and (module, imp.target) in layer_map.lazy_upward:
            continue
        kind = ("function-local " if imp.local else "") + ("TYPE_CHECKING " if imp.type_only
                                                           else "")
        problems.append(f"{module}:{imp.line} ({room}, layer {layers[room]}) has a {kind}import "
                        f"of {imp.target} ({target_room}, layer {layers[target_room]}): "
                        "a room imports only lower layers")
    return problems


def private_imports(module: str, source: str, is_package: bool = False) -> list[str]:
    """Private names (``_x``) ``module`` takes from a kvbridge module of another room."""
    room = room_of(module)
    problems = []
    aliases: dict[str, str] = {}  # local name bound to a kvbridge module -> that module
    tree = ast.parse(source)
    for imp in imports_of(module, source, is_package):
        if room_of(imp.target) != room:
            problems += [f"{module}:{imp.line} imports the private name {n} from {imp.target}"
                         for n in imp.names if n.startswith("_") and not n.startswith("__")]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "kvbridge":
                    aliases[a.asname or a.name] = a.name
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for a in node.names:
                if _is_module(f"{node.module}.{a.name}"):
                    aliases[a.asname or a.name] = f"{node.module}.{a.name}"
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and node.attr.startswith("_")
                and not node.attr.startswith("__")):
            owner = ast.unparse(node.value)
            if owner in aliases and room_of(aliases[owner]) != room:
                problems.append(f"{module}:{node.lineno} reads the private name {node.attr} "
                                f"of {aliases[owner]}")
    return problems


def _sources() -> list[tuple[Path, str, str]]:
    return [(p, module_name(p), p.read_text()) for p in sorted(PACKAGE.rglob("*.py"))]


def _layer_map() -> LayerMap:
    return read_layer_map(LAYOUT_DOC.read_text())


def test_every_room_is_in_the_layer_map():
    rooms = {room_of(m) for _, m, _ in _sources()}
    listed = set(_layer_map().layers)
    assert rooms == listed, (f"rooms missing from docs/layout.md: {sorted(rooms - listed)}; "
                             f"listed but gone: {sorted(listed - rooms)}")


def test_no_module_over_the_line_budget():
    over = {str(p.relative_to(ROOT)): len(src.splitlines()) for p, _, src in _sources()
            if len(src.splitlines()) > LINE_BUDGET}
    allowed = _layer_map().over_budget
    unlisted = {p: n for p, n in over.items() if p not in allowed}
    assert not unlisted, (f"modules over {LINE_BUDGET} lines (split them by job): "
                          + ", ".join(f"{p} ({n})" for p, n in sorted(unlisted.items())))


def test_no_upward_import():
    layer_map = _layer_map()
    problems = [p for path, m, src in _sources()
                for p in upward_imports(m, src, layer_map, path.name == "__init__.py")]
    assert not problems, "\n".join(problems)


def test_no_private_name_crosses_a_room():
    problems = [p for path, m, src in _sources()
                for p in private_imports(m, src, path.name == "__init__.py")]
    assert not problems, "\n".join(problems)


_MAP = LayerMap({"errors.py": 1, "config.py": 4, "handshake/": 5, "tools/": 11,
                 "server/": 9, "engine/": 8}, frozenset({("kvbridge.config", "kvbridge.server.api")}),
                frozenset())


@pytest.mark.parametrize(("module", "source", "expected"), [
    ("kvbridge.config", "from kvbridge.handshake.authz import Authorizer\n",
     "kvbridge.config:1 (config.py, layer 4) has a import of kvbridge.handshake.authz"),
    ("kvbridge.config", "def f():\n    from kvbridge.engine import LLMEngine\n",
     "kvbridge.config:2 (config.py, layer 4) has a function-local import of kvbridge.engine"),
    ("kvbridge.config", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
     "    import kvbridge.server.api\n", "has a TYPE_CHECKING import of kvbridge.server.api"),
    ("kvbridge.server.api", "from kvbridge import tools\n",
     "kvbridge.server.api:1 (server/, layer 9) has a import of kvbridge.tools"),
    ("kvbridge.server.instance", "from ..tools.testing.certs import issue\n",
     "has a import of kvbridge.tools.testing.certs (tools/, layer 11)"),
    ("kvbridge.engine.engine", "from kvbridge.server.api import run_server\n",
     "kvbridge.engine.engine:1 (engine/, layer 8) has a import of kvbridge.server.api"),
])
def test_an_upward_import_is_caught(module: str, source: str, expected: str):
    problems = upward_imports(module, source, _MAP)
    assert len(problems) == 1 and expected in problems[0], problems


@pytest.mark.parametrize(("module", "source"), [
    ("kvbridge.server.api", "from kvbridge.errors import ConfigError\nimport kvbridge.handshake.zmq\n"
     "from kvbridge.engine import LLMEngine\nfrom . import responses\n"),
    ("kvbridge.config", "def f():\n    from kvbridge.server.api import run_server\n"),  # listed
    ("kvbridge.config", "from kvbridge.config import TLSConfig\n"),  # its own room
])
def test_a_downward_or_listed_import_passes(module: str, source: str):
    assert upward_imports(module, source, _MAP) == []


def test_a_listed_lazy_import_is_still_caught_at_module_level():
    problems = upward_imports("kvbridge.config", "from kvbridge.server.api import run_server\n",
                              _MAP)
    assert problems and "kvbridge.server.api" in problems[0]


@pytest.mark.parametrize(("source", "expected"), [
    ("from kvbridge.handshake.authz import _NAME\n",
     "kvbridge.config:1 imports the private name _NAME from kvbridge.handshake.authz"),
    ("from kvbridge.errors import ConfigError, _helper\n",
     "imports the private name _helper from kvbridge.errors"),
    ("from kvbridge.handshake import zmq\nzmq._frames(b'')\n",
     "kvbridge.config:2 reads the private name _frames of kvbridge.handshake.zmq"),
    ("import kvbridge.guard as g\nx = g._conns\n", "reads the private name _conns of kvbridge.guard"),
])
def test_a_private_name_is_caught(source: str, expected: str):
    problems = private_imports("kvbridge.config", source)
    assert len(problems) == 1 and expected in problems[0], problems


def test_public_dunder_and_same_room_names_pass():
    source = ("from kvbridge import __version__\nfrom kvbridge.handshake import zmq\n"
              "zmq.ZmqHandshakeClient\nself_._x = 1\n")
    assert private_imports("kvbridge.config", source) == []
    assert private_imports("kvbridge.handshake.zmq", "from kvbridge.handshake.zmtp import _x\n"
                           "from kvbridge.handshake import base\nbase._y\n") == []


def test_the_layer_map_reads_its_exceptions():
    text = ("| 3 | `registry/` | a | b |\n| 4 | `config.py` | c | d |\n"
            "### Function-local upward imports allowed\n\n- `kvbridge.config` → "
            "`kvbridge.handshake.etcd`: etcd3gw\n\n### Modules allowed over 400 lines\n\n"
            "- `kvbridge/engine/workers.py`: one job\n")
    got = read_layer_map(text)
    assert got.layers == {"registry/": 3, "config.py": 4}
    assert got.lazy_upward == {("kvbridge.config", "kvbridge.handshake.etcd")}
    assert got.over_budget == {"kvbridge/engine/workers.py"}


def exceptions_outside_errors(module: str, source: str, error_names: set[str]) -> list[str]:
    """Public exception classes ``module`` defines (errors.py says every one lives there; a
    ``_`` one is a module's own signal, caught inside it)."""
    bases_of_errors = error_names | {"Exception", "BaseException", "ValueError", "RuntimeError",
                                     "TimeoutError", "OSError"}
    return [f"{module}:{node.lineno} defines the exception {node.name} (kvbridge/errors.py "
            "holds every exception)"
            for node in ast.walk(ast.parse(source)) if isinstance(node, ast.ClassDef)
            and not node.name.startswith("_") and any(ast.unparse(b).split(".")[-1] in bases_of_errors for b in node.bases)]


def _error_names() -> set[str]:
    tree = ast.parse((PACKAGE / "errors.py").read_text())
    return {n.name for n in tree.body if isinstance(n, ast.ClassDef)}


def test_every_exception_is_in_errors_py():
    # testing/ is not the product: its WaitTimeout is an AssertionError of tests
    problems = [p for path, m, src in _sources()
                if m != "kvbridge.errors" and room_of(m) != "testing/"
                for p in exceptions_outside_errors(m, src, _error_names())]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("source", [
    "from kvbridge.errors import ConfigError\nclass BadModel(ConfigError):\n    pass\n",
    "import kvbridge.errors\nclass Oops(kvbridge.errors.KVBridgeError):\n    pass\n",
    "import os\nclass Mine(RuntimeError):\n    pass\nclass _Signal(Exception):\n    pass\n",
])
def test_an_exception_outside_errors_py_is_caught(source: str):
    problems = exceptions_outside_errors("kvbridge.model.llama", source, _error_names())
    assert len(problems) == 1 and "kvbridge.model.llama:2 defines the exception" in problems[0]


def test_readme_names_every_room():
    """README's table of what is in it names every room of docs/layout.md."""
    table = (ROOT / "README.md").read_text().split("## What is in it", 1)[1].split("\n## ", 1)[0]
    missing = sorted(room for room in _layer_map().layers
                     if room != "__init__.py" and f"`kvbridge/{room}`" not in table)
    assert not missing, f"README.md's table does not name these rooms: {missing}"


def module_order(docstring: str) -> list[str]:
    """The modules a package docstring lists in order (``* ``name`` ...`` bullets) when it
    says each imports only the ones above it."""
    if "each imports only the ones above it in this list" not in " ".join(docstring.split()):
        return []
    return re.findall(r"^\* ``(\w+)/?``", docstring, re.M)


def inward_upward_imports(module: str, source: str, order: list[str],
                          is_package: bool = False, package: str | None = None) -> list[str]:
    """Imports of ``module`` (in ``package``, default its room, whose docstring orders its
    modules and sub-packages) of one listed below it. What the list does not name is not
    checked."""
    package = package or ".".join(module.split(".")[:2])
    if not module.startswith(package + "."):
        return []
    me = module[len(package) + 1:].split(".")[0]
    if me not in order:
        return []
    problems = []
    for imp in imports_of(module, source, is_package):
        if not imp.target.startswith(package + "."):
            continue
        other = imp.target[len(package) + 1:].split(".")[0]
        if other in order and other != me and order.index(other) > order.index(me):
            problems.append(f"{module}:{imp.line} imports {imp.target}, listed below "
                            f"{me} in {package.replace('.', '/')}/__init__.py's module map")
    return problems


def test_rooms_with_a_module_map_follow_it():
    """Every package whose docstring orders its modules, sub-packages included."""
    problems, checked = [], []
    for init in sorted(PACKAGE.rglob("__init__.py")):
        order = module_order(ast.get_docstring(ast.parse(init.read_text())) or "")
        if not order or init.parent == PACKAGE:
            continue
        package = module_name(init)
        checked.append(package)
        problems += [p for path, m, src in _sources() if m.startswith(package + ".")
                     for p in inward_upward_imports(m, src, order, path.name == "__init__.py",
                                                    package)]
    assert {"kvbridge.handshake", "kvbridge.server", "kvbridge.handshake.http",
            "kvbridge.handshake.zmq", "kvbridge.handshake.process"} <= set(checked), checked
    assert not problems, "\n".join(problems)


def test_an_import_against_a_module_map_is_caught():
    order = module_order("Modules (each imports only the ones above it in this list):\n\n"
                         "* ``base``  the interface\n* ``zmtp``  ZMTP\n* ``proxy/``  rooms\n")
    assert order == ["base", "zmtp", "proxy"]
    problems = inward_upward_imports("kvbridge.handshake.base",
                                     "from kvbridge.handshake.proxy.app import x\n", order)
    assert problems == ["kvbridge.handshake.base:1 imports kvbridge.handshake.proxy.app, listed "
                        "below base in kvbridge/handshake/__init__.py's module map"]
    assert inward_upward_imports("kvbridge.handshake.zmtp",
                                 "from kvbridge.handshake.base import y\n", order) == []


def test_every_module_imports():
    """A move that leaves an import behind (a name gone from the module it came from) fails
    here, not in the first test that happens to start a vLLM server."""
    import importlib
    import pkgutil

    import kvbridge

    failed = []
    for info in pkgutil.walk_packages(kvbridge.__path__, "kvbridge."):
        try:
            importlib.import_module(info.name)
        except Exception as e:  # noqa: BLE001 - every failure is listed
            failed.append(f"{info.name}: {type(e).__name__}: {e}")
    assert not failed, "\n".join(failed)


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The cycles of an import graph (its strongly connected components of more than one
    module), each sorted (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_no_module_imports_itself_round_a_circle():
    """No circle between modules, whatever the kind of import (module-level,
    function-local, TYPE_CHECKING); a package's ``__init__`` re-exporting its modules does
    not count."""
    modules = {m for _, m, _ in _sources()}
    graph: dict[str, set[str]] = {}
    for path, m, src in _sources():
        if path.name == "__init__.py":
            continue
        graph[m] = set()
        for imp in imports_of(m, src):
            target = imp.target
            while target not in modules and "." in target:
                target = target.rsplit(".", 1)[0]
            if target in modules and target != m and not (ROOT / "kvbridge").joinpath(
                    *target.split(".")[1:], "__init__.py").exists():
                graph[m].add(target)
    cycles = import_cycles(graph)
    assert not cycles, cycles


def test_a_circle_is_found():
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert import_cycles({"a": {"b"}, "b": set()}) == []
