"""Start real vLLM OpenAI servers (plug-in or stock NixlConnector) and drive vLLM's P/D protocol.

For tests and benchmarks; imports no vLLM (each server is ``python -m
vllm.entrypoints.openai.api_server`` in its own process group, with its log in a file).

    server = VllmServer.start(model_dir, connector="kvbridge", core=0,
                              extra_config={"handshake_method": "http"}, log_dir=tmp)
    server.wait_healthy(600)
    text, params = prefill(server_p.url, prompt)    # do_remote_decode, max_tokens 1
    answer = decode(server_d.url, prompt, params)   # the KV read over NIXL
    server.stop()
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import httpx

from kvbridge.net import free_port
from kvbridge.tools.testing.prometheus import parse_samples

# "kvbridge": the plug-in (pull), "kvbridge-push": its push connector, "nixl": vLLM's own
# NixlConnector (pull), "nixl-push": vLLM's own NixlPushConnector.
Connector = Literal["kvbridge", "kvbridge-push", "nixl", "nixl-push", None]
PLUGIN_CLASSES = {"kvbridge": "KVBridgeConnector", "kvbridge-push": "KVBridgePushConnector"}
STOCK_CLASSES = {"nixl": "NixlConnector", "nixl-push": "NixlPushConnector"}


def _die_with_parent() -> None:
    """In the child: SIGTERM when the process that started it dies (Linux), so a killed
    test run leaves no vLLM server behind."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG

# vLLM's CPU build: a KV cache of 1 GiB is plenty for the small models used here.
DEFAULT_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "INFO",
               "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}


def kv_transfer_config(connector: Connector, extra_config: Mapping[str, Any] | None = None,
                       kv_buffer_device: str = "cpu",
                       kv_load_failure_policy: str | None = None) -> str | None:
    """The ``--kv-transfer-config`` JSON for the plug-in or vLLM's stock NixlConnector
    (``kv_load_failure_policy``: vLLM's, ``recompute`` or ``fail``; None: vLLM's default)."""
    if connector is None:
        return None
    cfg: dict[str, Any] = {"kv_role": "kv_both", "kv_buffer_device": kv_buffer_device}
    if kv_load_failure_policy is not None:
        cfg["kv_load_failure_policy"] = kv_load_failure_policy
    if connector in PLUGIN_CLASSES:
        cfg.update(kv_connector=PLUGIN_CLASSES[connector],
                   kv_connector_module_path="kvbridge.vllm")
    else:
        cfg["kv_connector"] = STOCK_CLASSES[connector]
    if extra_config:
        cfg["kv_connector_extra_config"] = dict(extra_config)
    return json.dumps(cfg)


@dataclass
class VllmServer:
    """One vLLM OpenAI server process (its own process group) and where to reach it."""

    name: str
    proc: subprocess.Popen
    port: int
    side_channel_port: int | None
    log_path: Path
    argv: list[str]
    env: dict[str, str] = field(repr=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @classmethod
    def start(cls, model: str | Path, *, name: str = "vllm", connector: Connector = "kvbridge",
              core: int | str | None = None, port: int | None = None,
              side_channel_port: int | None = None,
              extra_config: Mapping[str, Any] | None = None,
              env: Mapping[str, str] | None = None, log_dir: str | Path = ".",
              max_model_len: int = 2048, dtype: str = "float32", enforce_eager: bool = True,
              tensor_parallel_size: int = 1, extra_args: list[str] | None = None,
              kv_load_failure_policy: str | None = None) -> VllmServer:
        """Start the server (not waiting for it). ``core``: ``VLLM_CPU_OMP_THREADS_BIND``
        (give each server its own core on a small machine). ``side_channel_port``: the
        plug-in's ``side_channel_port`` (unless in ``extra_config``) and stock vLLM's
        ``VLLM_NIXL_SIDE_CHANNEL_PORT``; default a free port."""
        port = port or free_port()
        extra = dict(extra_config or {})
        plugin = connector in PLUGIN_CLASSES
        if plugin and "side_channel_port" in extra:
            side_channel_port = int(extra["side_channel_port"]) or None  # 0: chosen at bind
        elif connector is not None:
            side_channel_port = side_channel_port or free_port()
            if plugin:
                extra["side_channel_port"] = side_channel_port
        argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model",
                str(model), "--port", str(port), "--host", "127.0.0.1",
                "--max-model-len", str(max_model_len), "--dtype", dtype,
                "--served-model-name", "model", "--disable-uvicorn-access-log"]
        if enforce_eager:
            argv.append("--enforce-eager")
        if tensor_parallel_size > 1:
            argv += ["--tensor-parallel-size", str(tensor_parallel_size)]
        ktc = kv_transfer_config(connector, extra, kv_load_failure_policy=kv_load_failure_policy)
        if ktc is not None:
            argv += ["--kv-transfer-config", ktc]
        argv += extra_args or []
        full_env = {**os.environ, **DEFAULT_ENV, **(env or {})}
        if core is not None:
            full_env["VLLM_CPU_OMP_THREADS_BIND"] = str(core)
        if connector in STOCK_CLASSES:
            full_env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(side_channel_port)
        log_path = Path(log_dir) / f"{name}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log,
                                    stderr=subprocess.STDOUT, env=full_env,
                                    start_new_session=True, preexec_fn=_die_with_parent)
        return cls(name, proc, port, side_channel_port, log_path, argv, full_env)

    def restart(self) -> None:
        """Stop the server and start it again with the same command line, environment and
        ports (a new process: a new engine id and epoch). Not waiting for it."""
        self.stop()
        with open(self.log_path, "ab") as log:
            log.write(b"\n--- restarted ---\n")
            log.flush()
            self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, env=self.env,
                                         start_new_session=True,
                                         preexec_fn=_die_with_parent)

    def log_tail(self, lines: int = 60) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def wait_healthy(self, timeout: float = 600.0) -> None:
        """Until ``/health`` answers 200; ``RuntimeError`` with the log's tail when the
        process exits or ``timeout`` passes."""
        deadline = time.monotonic() + timeout
        with httpx.Client(timeout=5.0) as client:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"vLLM server {self.name} exited with "
                                       f"{self.proc.returncode} during start-up; log tail:\n"
                                       f"{self.log_tail()}")
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(f"{self.url}/health").status_code == 200:
                        return
                if time.monotonic() > deadline:
                    raise RuntimeError(f"vLLM server {self.name} not healthy within "
                                       f"{timeout:g}s; log tail:\n{self.log_tail()}")
                time.sleep(1.0)  # polling a process we do not control (no event to wait on)

    def metrics(self, timeout: float = 60.0) -> dict[str, float]:
        """The server's Prometheus samples, summed over labels: ``{name: value}``.

        ``timeout``: vLLM's API process answers late while another vLLM server starts on
        the same cores (10 s was missed on 2 cores during a prefill's restart)."""
        out: dict[str, float] = {}
        for sample, value in parse_samples(
                httpx.get(f"{self.url}/metrics", timeout=timeout).text).items():
            name = sample.partition("{")[0]
            out[name] = out.get(name, 0.0) + value
        return out

    def pause(self) -> None:
        """SIGSTOP the whole process group (API server, engine core, workers): a paused
        vLLM CPU server spins no core, so several can wait on one small machine."""
        os.killpg(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT the process group (after ``pause``)."""
        os.killpg(self.proc.pid, signal.SIGCONT)

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM the process group, SIGKILL it after ``timeout``."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGCONT)  # a paused group cannot exit
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        # The group may hold children (EngineCore, workers) after the parent exits.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5)


def completion(url: str, prompt: str, *, max_tokens: int = 16,
               kv_transfer_params: Mapping[str, Any] | None = None,
               timeout: float = 120.0, request_id: str | None = None) -> httpx.Response:
    """POST /v1/completions, greedy (the raw response: the caller checks its status)."""
    body: dict[str, Any] = {"model": "model", "prompt": prompt, "max_tokens": max_tokens,
                            "temperature": 0.0, "stream": False}
    if kv_transfer_params is not None:
        body["kv_transfer_params"] = dict(kv_transfer_params)
    headers = {"X-Request-Id": request_id} if request_id else {}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=timeout, headers=headers)


def prefill(url: str, prompt: str, timeout: float = 120.0,
            request_id: str | None = None) -> dict[str, Any]:
    """vLLM's P/D protocol, first hop: the prefill's ``kv_transfer_params`` for the decode.
    ``request_id`` (``X-Request-Id``): push mode pairs the two hops by it, so give both
    the same."""
    r = completion(url, prompt, max_tokens=1, timeout=timeout, request_id=request_id,
                   kv_transfer_params={"do_remote_decode": True, "do_remote_prefill": False,
                                       "remote_engine_id": None, "remote_block_ids": None,
                                       "remote_host": None, "remote_port": None})
    r.raise_for_status()
    params = r.json().get("kv_transfer_params")
    if not params:
        raise RuntimeError(f"prefill at {url} returned no kv_transfer_params: {r.text[:300]}")
    return params


def decode(url: str, prompt: str, params: Mapping[str, Any], *, max_tokens: int = 16,
           timeout: float = 120.0, request_id: str | None = None) -> httpx.Response:
    """Second hop: the decode reads the prefill's KV, or in push mode registers its blocks
    for the prefill to write (the raw response)."""
    return completion(url, prompt, max_tokens=max_tokens, kv_transfer_params=params,
                      timeout=timeout, request_id=request_id)


def pd_text(prefill_url: str, decode_url: str, prompt: str, *, max_tokens: int = 16,
            timeout: float = 120.0, request_id: str | None = None) -> str:
    """Both hops; the decode's text (raises on any error). ``request_id``: both hops'
    ``X-Request-Id`` (push mode pairs them by it)."""
    params = prefill(prefill_url, prompt, timeout, request_id=request_id)
    r = decode(decode_url, prompt, params, max_tokens=max_tokens, timeout=timeout,
               request_id=request_id)
    r.raise_for_status()
    return r.json()["choices"][0]["text"]
