"""The drift guard: the installed vLLM's members the plug-in overrides, bypasses or mirrors
(and its checks keyed on the name NixlConnector) are the recorded ones, and a difference
is named. Fast: source text only, no vLLM server."""

from __future__ import annotations

import ast
import importlib
import inspect
import textwrap
import zipfile
from pathlib import Path

import pytest

from kvbridge.tools.vllm.drift import (
    FIELDS,
    MEMBERS,
    NIXL,
    SourceTree,
    drift,
    fingerprint,
    installed_tree,
    main,
    minor_version,
)
from kvbridge.tools.vllm.fingerprints import FINGERPRINTS
from kvbridge.vllm.settings import TESTED_VLLM

pytest.importorskip("vllm")


def test_the_installed_vllm_is_as_recorded() -> None:
    version, problems = drift(installed_tree())
    assert problems == [], "\n".join(problems)
    assert version in FINGERPRINTS


def test_every_minor_version_in_the_window_has_fingerprints() -> None:
    (major, low), (_, high) = TESTED_VLLM
    assert sorted(FINGERPRINTS) == [f"{major}.{m}" for m in range(low, high)]


def edited(tree: SourceTree, path: str, old: str, new: str) -> SourceTree:
    def read(p: str) -> str | None:
        text = tree.read(p)
        if p == path and text is not None:
            assert old in text
            return text.replace(old, new, 1)
        return text

    return SourceTree(read, tree.paths, tree.where)


def test_a_changed_member_is_named() -> None:
    tree = edited(installed_tree(), NIXL + "base_worker.py",
                  'f"Remote NIXL agent engine ID mismatch. "',
                  'f"Remote NIXL engine ID mismatch. "')  # a check's wording, as copied
    _, problems = drift(tree)
    assert len(problems) == 1, problems
    assert "NixlBaseConnectorWorker._nixl_handshake (" in problems[0]
    assert "changed" in problems[0] and "_kvbridge_admit copy its checks" in problems[0]


def test_a_comment_or_docstring_is_not_drift() -> None:
    tree = edited(installed_tree(), NIXL + "base_scheduler.py",
                  '"""Background thread for getting new NIXL handshakes."""',
                  "# a comment only\n        \"\"\"Another docstring.\"\"\"")
    assert drift(tree)[1] == []


def test_a_new_check_on_the_name_is_named() -> None:
    tree = edited(installed_tree(), "config/vllm.py", "    def validate_block_size(self) -> None:",
                  "    def _new_check(self):\n        return self.kv_connector == "
                  "'NixlConnector'\n\n    def validate_block_size(self) -> None:")
    _, problems = drift(tree)
    assert problems == [
        f"vLLM {minor_version(tree)}: a check on the name NixlConnector at "
        "config/vllm.py:VllmConfig._new_check is new: see kvbridge/vllm/refusals.py and "
        "docs/vllm.md"]


def test_the_fingerprints_are_of_the_members_vllm_imports() -> None:
    """The files read are the code vLLM runs: inspect.getsource of each imported member."""
    for m in MEMBERS:
        try:
            module = importlib.import_module("vllm." + m.path[:-3].replace("/", "."))
        except ModuleNotFoundError:  # a file of a later vLLM
            assert FINGERPRINTS[minor_version(installed_tree())][m.key] is None, m.key
            continue
        obj = module
        try:
            for part in m.qualname.split("."):
                obj = getattr(obj, part)
        except AttributeError:
            assert FINGERPRINTS[minor_version(installed_tree())][m.key] is None, m.key
            continue
        node = ast.parse(textwrap.dedent(inspect.getsource(obj))).body[0]
        assert fingerprint(node, m.kind) == FINGERPRINTS[minor_version(installed_tree())][
            m.key], m.qualname


def test_the_script_reads_a_wheel(tmp_path: Path, capsys) -> None:
    """``--wheel``: a zip of the installed files (what it needs), clean, then one member
    changed: exit 1 and the member named."""
    tree = installed_tree()
    names = {m.path for m in MEMBERS} | {f.path for f in FIELDS} | {
        "_version.py", "config/vllm.py", "platforms/cpu.py", "models/step5/nvidia/model.py"}

    def wheel(path: Path, tree: SourceTree) -> Path:
        with zipfile.ZipFile(path, "w") as z:
            for name in names:
                if (text := tree.read(name)) is not None:
                    z.writestr("vllm/" + name, text)
        return path

    assert main(["--wheel", str(wheel(tmp_path / "clean.whl", tree))]) == 0
    assert "as recorded" in capsys.readouterr().out
    changed = edited(tree, NIXL + "base_scheduler.py", "ready_event.set()",
                     "ready_event.set()\n            pass")
    assert main(["--wheel", str(wheel(tmp_path / "changed.whl", changed))]) == 1
    out = capsys.readouterr().out
    assert "NixlBaseConnectorScheduler._nixl_handshake_listener (" in out, out


def test_a_removed_field_the_plugin_reads_is_named() -> None:
    """vLLM 0.34 removed CachedRequestData.resumed_req_ids, which the plug-in read: no
    member it overrides changed, so only the fields' look-up says so."""
    tree = edited(installed_tree(), "v1/core/sched/output.py",
                  "    resumed_req_ids: set[str]\n", "")
    _, problems = drift(tree)
    assert problems == [
        f"vLLM {minor_version(tree)}: the field CachedRequestData.resumed_req_ids "
        "(v1/core/sched/output.py) is gone; the plug-in reads it: TagWriter.step: a running "
        "request's new blocks (resumed_req_ids: read if there)"]


def test_every_field_the_plugin_reads_is_found_somewhere() -> None:
    """A field name mistyped in drift.FIELDS would be recorded absent everywhere."""
    from kvbridge.tools.vllm.fingerprints import FIELDS_PRESENT

    for key in FIELDS_PRESENT["0.32"]:
        assert any(FIELDS_PRESENT[v][key] for v in FIELDS_PRESENT), key
