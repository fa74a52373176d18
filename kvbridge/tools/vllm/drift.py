"""The drift guard: vLLM's members the plug-in overrides, bypasses or mirrors, fingerprinted,
and the fields of vLLM's data it reads, named.

Each member's source is read as text (the installed vLLM's files, or a wheel's, without
importing vLLM), parsed with ``ast``, stripped of docstrings (comments are gone already)
and printed back with ``ast.unparse``: the fingerprint is a hash of that. A ``signature``
member (a helper the plug-in only calls) is fingerprinted on its ``def`` line alone.
Beside the members, every place vLLM keys a check on the name ``NixlConnector`` is
fingerprinted too (kvbridge/vllm/refusals.py answers them). And every field of vLLM's data the
plug-in reads (``FIELDS``: the scheduler output, requests, the connector metadata) is looked
up: a field that is gone is named, as a fingerprint cannot (a class whose other fields
changed would say "changed", not what the plug-in lost). kvbridge/tools/vllm/fingerprints.py holds
the recorded values, one entry per supported vLLM minor version.

``python -m kvbridge.tools.vllm.drift [--wheel PATH] [--write]``: compare (or with ``--write``
record) the installed vLLM or a downloaded wheel (``pip download vllm==X --no-deps``).
"""

from __future__ import annotations

import argparse
import ast
import copy
import hashlib
import importlib.util
import sys
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from kvbridge.tools.vllm.dependencies import (
    FIELDS,
    MEMBERS,
    NAME,
    NAME_EXPORTS,
    NIXL,
    Fields,
    Member,
)

__all__ = ["FIELDS", "MEMBERS", "NIXL", "Fields", "Member", "SourceTree", "drift", "fingerprint",
           "installed_tree", "main", "member_fingerprints", "minor_version", "read_fields",
           "wheel_tree"]


# A vLLM source tree: read(path under vllm/) -> text or None, and its .py paths.
Reader = Callable[[str], "str | None"]


@dataclass
class SourceTree:
    read: Reader
    paths: Callable[[], Iterator[str]]
    where: str


def installed_tree() -> SourceTree:
    """The installed vLLM's files (found, not imported)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("kvbridge.tools.vllm.drift: vLLM is not installed")
    root = Path(next(iter(spec.submodule_search_locations)))

    def read(path: str) -> str | None:
        f = root / path
        return f.read_text(encoding="utf-8") if f.is_file() else None

    return SourceTree(read, lambda: (str(p.relative_to(root)) for p in root.rglob("*.py")),
                      str(root))


def wheel_tree(wheel: Path) -> SourceTree:
    """A vLLM wheel's files, read from the zip (nothing extracted, nothing imported)."""
    z = zipfile.ZipFile(wheel)
    names = set(z.namelist())

    def read(path: str) -> str | None:
        name = "vllm/" + path
        return z.read(name).decode("utf-8") if name in names else None

    return SourceTree(read, lambda: (n[5:] for n in sorted(names)
                                     if n.startswith("vllm/") and n.endswith(".py")),
                      str(wheel))


def minor_version(tree: SourceTree) -> str:
    """``X.Y`` of the tree's ``vllm/_version.py`` (``__version__ = version = '0.32.0'``)."""
    text = tree.read("_version.py")
    if text is None:
        raise SystemExit(f"kvbridge.tools.vllm.drift: no vllm/_version.py in {tree.where}")
    for node in ast.parse(text).body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and any(
                isinstance(t, ast.Name) and t.id == "__version__" for t in node.targets):
            return ".".join(str(node.value.value).split("+")[0].split(".")[:2])
    raise SystemExit(f"kvbridge.tools.vllm.drift: no __version__ in {tree.where}")


def _strip_docstrings(node: ast.AST) -> ast.AST:
    for n in ast.walk(node):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Module)):
            body = n.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                n.body = body[1:] or [ast.Pass()]
    return node


def fingerprint(node: ast.AST, kind: str = "source") -> str:
    node = _strip_docstrings(copy.deepcopy(node))
    if kind == "signature":
        assert isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        node.body = [ast.Pass()]
    return hashlib.sha256(ast.unparse(node).encode()).hexdigest()[:16]


def _find(tree: ast.Module, qualname: str) -> ast.AST | None:
    scope: list[ast.stmt] = tree.body
    node: ast.AST | None = None
    for part in qualname.split("."):
        node = next((n for n in scope if isinstance(
            n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == part), None)
        if node is None:
            return None
        scope = node.body  # type: ignore[attr-defined]
    return node


def member_fingerprints(tree: SourceTree) -> dict[str, str | None]:
    """Each member's fingerprint; None where this vLLM has no such member."""
    parsed: dict[str, ast.Module | None] = {}
    out: dict[str, str | None] = {}
    for m in MEMBERS:
        if m.path not in parsed:
            text = tree.read(m.path)
            parsed[m.path] = None if text is None else ast.parse(text)
        module = parsed[m.path]
        node = None if module is None else _find(module, m.qualname)
        out[m.key] = None if node is None else fingerprint(node, m.kind)
    return out


def class_fields(node: ast.ClassDef) -> set[str]:
    """The attributes a class declares: class-level names (dataclass and Struct fields),
    properties and methods, and ``self.X`` assigned in ``__init__``."""
    names: set[str] = set()
    for n in node.body:
        if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name):
            names.add(n.target.id)
        elif isinstance(n, ast.Assign):
            names.update(t.id for t in n.targets if isinstance(t, ast.Name))
        elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(n.name)
            if n.name == "__init__":
                for a in ast.walk(n):
                    targets = (a.targets if isinstance(a, ast.Assign) else
                               [a.target] if isinstance(a, ast.AnnAssign) else [])
                    names.update(t.attr for t in targets if isinstance(t, ast.Attribute)
                                 and isinstance(t.value, ast.Name) and t.value.id == "self")
    return names


def read_fields(tree: SourceTree) -> dict[str, bool]:
    """``Class.field`` -> whether this vLLM has it, for every field in FIELDS."""
    out: dict[str, bool] = {}
    for f in FIELDS:
        text = tree.read(f.path)
        node = None if text is None else _find(ast.parse(text), f.cls)
        have = class_fields(node) if isinstance(node, ast.ClassDef) else set()
        out.update((f"{f.cls}.{name}", name in have) for name in f.names)
    return out


def name_checks(tree: SourceTree) -> dict[str, str]:
    """Every function (``path:qualname``) whose code holds the string ``NixlConnector``
    outside the NIXL package and the factory's registration, with its fingerprint."""
    out: dict[str, str] = {}
    for path in tree.paths():
        if path.startswith(NAME_EXPORTS):
            continue
        text = tree.read(path)
        if text is None or f'"{NAME}"' not in text and f"'{NAME}'" not in text:
            continue
        _scan(ast.parse(text), path, "", out)
    return dict(sorted(out.items()))


def _scan(node: ast.AST, path: str, prefix: str, out: dict[str, str]) -> None:
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            qual = prefix + child.name
            if isinstance(child, ast.ClassDef):
                _scan(child, path, qual + ".", out)
            elif any(isinstance(n, ast.Constant) and n.value == NAME for n in ast.walk(child)):
                out[f"{path}:{qual}"] = fingerprint(child)
        elif any(isinstance(n, ast.Constant) and n.value == NAME for n in ast.walk(child)):
            out[f"{path}:<module>"] = fingerprint(child)


def drift(tree: SourceTree) -> tuple[str, list[str]]:
    """The tree's ``X.Y`` and one line per difference from the recorded fingerprints."""
    from kvbridge.tools.vllm.fingerprints import FIELDS_PRESENT, FINGERPRINTS, NAME_CHECKS

    version = minor_version(tree)
    if version not in FINGERPRINTS:
        return version, [f"no fingerprints recorded for vLLM {version} (supported: "
                         f"{', '.join(sorted(FINGERPRINTS))}): see docs/vllm.md, 'The next vLLM'"]
    problems = []
    recorded = FINGERPRINTS[version]
    found = member_fingerprints(tree)
    for m in MEMBERS:
        was, now = recorded.get(m.key, "(not recorded)"), found[m.key]
        if was != now:
            what = "is gone" if now is None else "appeared" if was is None else "changed"
            problems.append(f"vLLM {version}: {m.qualname} ({m.path}) {what} "
                            f"[{m.kind} {was} -> {now}]; the plug-in: {m.why}")
    have, now_have = FIELDS_PRESENT.get(version, {}), read_fields(tree)
    for f in FIELDS:
        for name in f.names:
            key = f"{f.cls}.{name}"
            if have.get(key) != now_have[key]:
                what = ("is gone" if have.get(key) else "appeared" if now_have[key]
                        else "(not recorded)")
                problems.append(f"vLLM {version}: the field {key} ({f.path}) {what}; the "
                                f"plug-in reads it: {f.why}")
    names, now_names = NAME_CHECKS.get(version, {}), name_checks(tree)
    for key in sorted(set(names) | set(now_names)):
        if names.get(key) != now_names.get(key):
            what = ("is new" if key not in names else "is gone" if key not in now_names
                    else "changed")
            problems.append(f"vLLM {version}: a check on the name {NAME} at {key} {what}: "
                            "see kvbridge/vllm/refusals.py and docs/vllm.md")
    return version, problems


FINGERPRINTS_FILE = Path(__file__).with_name("fingerprints.py")
_HEADER = '''"""Recorded fingerprints of the vLLM members the plug-in depends on, one entry per
supported vLLM minor version (see kvbridge/tools/vllm/drift.py; docs/vllm.md, "The next vLLM").

Written by ``python -m kvbridge.tools.vllm.drift [--wheel PATH] --write``: do not edit by hand.
None: the member does not exist in that version.
"""

from __future__ import annotations

'''


def write_fingerprints(version: str, members: dict[str, str | None],
                       names: dict[str, str], fields: dict[str, bool]) -> Path:
    """Replace ``version``'s entry in fingerprints.py (the other versions' stay)."""
    from kvbridge.tools.vllm.fingerprints import FIELDS_PRESENT, FINGERPRINTS, NAME_CHECKS

    prints = {**FINGERPRINTS, version: members}
    checks = {**NAME_CHECKS, version: names}
    present = {**FIELDS_PRESENT, version: fields}

    def block(name: str, hint: str, data: dict) -> str:
        lines = [f"{name}: {hint} = {{"]
        for v in sorted(data, key=lambda x: tuple(int(p) for p in x.split("."))):
            lines.append(f'    "{v}": {{')
            lines += [f'        "{k}": ' + (repr(h) if h is None or isinstance(h, bool)
                                                 else f'"{h}"') + ","
                      for k, h in data[v].items()]
            lines.append("    },")
        return "\n".join([*lines, "}"]) + "\n"

    FINGERPRINTS_FILE.write_text(
        _HEADER + block("FINGERPRINTS", "dict[str, dict[str, str | None]]", prints) + "\n"
        + "# Functions keyed on the name NixlConnector (path under vllm/:qualname).\n"
        + block("NAME_CHECKS", "dict[str, dict[str, str]]", checks) + "\n"
        + "# Whether each field the plug-in reads (drift.FIELDS) exists.\n"
        + block("FIELDS_PRESENT", "dict[str, dict[str, bool]]", present))
    return FINGERPRINTS_FILE


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvbridge.tools.vllm.drift", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--wheel", type=Path, help="a vLLM wheel (default: the installed vLLM)")
    ap.add_argument("--write", action="store_true",
                    help="record this vLLM's fingerprints in kvbridge/tools/vllm/fingerprints.py")
    args = ap.parse_args(argv)
    tree = wheel_tree(args.wheel) if args.wheel else installed_tree()
    if args.write:
        version = minor_version(tree)
        path = write_fingerprints(version, member_fingerprints(tree), name_checks(tree),
                                  read_fields(tree))
        print(f"vLLM {version} ({tree.where}): recorded in {path}")
        return 0
    version, problems = drift(tree)
    for line in problems:
        print(line)
    print(f"vLLM {version} ({tree.where}): "
          + (f"{len(problems)} difference(s)" if problems else
             f"{len(MEMBERS)} members, {sum(len(f.names) for f in FIELDS)} fields and the "
             f"{NAME} name checks as recorded"))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
