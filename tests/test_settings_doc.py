"""docs/configuration.md's settings tables are the settings tree's (kvbridge/settings):
regenerate them with ``kvbridge settings --write docs/configuration.md``."""

from __future__ import annotations

import pytest

from kvbridge.settings import SETTINGS
from kvbridge.settings.markdown import blocks, render, table
from tests.conftest import ROOT

DOC = ROOT / "docs" / "configuration.md"


def test_configuration_md_tables_are_the_trees():
    """Regenerate with: kvbridge settings --write docs/configuration.md"""
    text = DOC.read_text()
    found = blocks(text)
    groups = {g for key in found for g in key.split()}
    assert groups == {s.group for s in SETTINGS}, "a group of settings has no table in the doc"
    for key, body in found.items():
        assert body == table(key.split()), (
            f"docs/configuration.md's {key!r} table differs from the settings tree: run "
            "kvbridge settings --write docs/configuration.md")
    assert render(text) == text


@pytest.mark.parametrize("change", ["drop a row", "another default", "another env name"])
def test_the_doc_check_can_fail(change):
    text = DOC.read_text()
    rows = [line for line in text.splitlines() if line.startswith("| `side_channel_port` |")]
    assert len(rows) == 1
    row = rows[0]
    new = {"drop a row": "", "another default": row.replace("`5600`", "`5601`"),
           "another env name": row.replace("VLLM_NIXL_SIDE_CHANNEL_PORT", "VLLM_PORT")}[change]
    assert new != row
    changed = text.replace(row + "\n", new + "\n" if new else "")
    assert render(changed) != changed
