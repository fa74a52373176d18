"""Real ``kvbridge serve`` processes for the end-to-end tests."""

from __future__ import annotations

import json
import os
import ssl
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from kvbridge.tools.launch import KVBridgeProcess, free_port, read_metric
from tests.conftest import ROOT

START_TIMEOUT = 180.0
PROMPTS = [
    "The quick brown fox jumps over the lazy dog, then naps in the warm afternoon sun.",
    "KV blocks travel from prefill to decode over NIXL; the side channel tells where.",
    "short",
]
MAX_TOKENS = 10
# Every engine here is on loopback: a decode presents its token to those side channels
# (a test of the setting itself passes its own value in ``env``).
TRUST_LOOPBACK = {"KVBRIDGE_TRUSTED_SIDE_CHANNELS": "127.0.0.1,localhost"}



class Serve(KVBridgeProcess):
    """One ``kvbridge serve`` process (float64, TLS when ``tls`` names the certs); ``url``
    is its API."""

    def __init__(self, name: str, log_dir: Path, *args: str, tls: Path | None = None,
                 port: int | None = None, env: dict[str, str] | None = None):
        self.port = port or free_port()
        self.url = f"{'https' if tls else 'http'}://127.0.0.1:{self.port}"
        self.verify = ssl.create_default_context(cafile=str(tls / "ca.pem")) if tls else True
        tls_args = ([] if tls is None else
                    ["--ssl-certfile", str(tls / "prefill.pem"), "--ssl-keyfile",
                     str(tls / "prefill.key"), "--ssl-ca-certs", str(tls / "ca.pem")])
        super().__init__(name, log_dir, "serve", "--port", str(self.port), "--dtype", "float64",
                         *tls_args, *args,
                         env={**os.environ, "PYTHONPATH": str(ROOT), **TRUST_LOOPBACK,
                              **(env or {})})

    def wait_ready(self, deadline: float) -> None:
        self.wait_healthy(self.url + "/health", deadline, self.verify)

    def metric(self, name: str) -> float:
        with httpx.Client(verify=self.verify) as c:
            return read_metric(c, self.url, name)


@pytest.fixture(scope="session")
def token_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    p = tmp_path_factory.mktemp("token") / "token"
    p.write_text("e2e-" + os.urandom(8).hex())
    p.chmod(0o600)
    return p


@pytest.fixture(scope="session")
def serve_log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("serve-logs")


def start_all(specs: dict[str, tuple[tuple[str, ...], Path | None]], log_dir: Path
              ) -> Iterator[dict[str, Serve]]:
    """Start every instance at once (they boot in parallel), then wait for each."""
    procs = {name: Serve(name, log_dir, *args, tls=tls) for name, (args, tls) in specs.items()}
    try:
        deadline = time.monotonic() + START_TIMEOUT
        for p in procs.values():
            p.wait_ready(deadline)
        yield procs
    finally:
        # Stopped together: each drains for up to seconds, and they do not wait on each other.
        with ThreadPoolExecutor(len(procs)) as pool:
            list(pool.map(lambda p: p.stop(), procs.values()))


@pytest.fixture(scope="session")
def cluster(certs, token_file, serve_log_dir) -> Iterator[dict[str, Serve]]:
    """Prefills at TP 1 and 2 per handshake method, decodes at TP 1 and 2 (one more with
    the fail policy) and a ``--role both`` reference engine, all in float64."""
    side = ("--side-channel-port", "0", "--side-channel-token-file", str(token_file),
            "--handshake-timeout", "5")
    specs: dict[str, tuple[tuple[str, ...], Path | None]] = {
        "ref": (("--role", "both", "--side-channel-port", "0"), certs)}
    for tp in (1, 2):
        for method in ("http", "zmq"):
            specs[f"p{tp}-{method}"] = (("--role", "prefill", "--tp", str(tp),
                                         "--handshake", method, *side), certs)
        specs[f"d{tp}"] = (("--role", "decode", "--tp", str(tp), *side), certs)
    specs["d1-fail"] = (("--role", "decode", "--kv-load-failure-policy", "fail", *side), certs)
    yield from start_all(specs, serve_log_dir)


@pytest.fixture(scope="session")
def reference(cluster) -> dict[str, str]:
    ref = cluster["ref"]
    return {p: complete(ref.url, p, verify=ref.verify) for p in PROMPTS}


def complete(url: str, prompt: str, *, verify=True, stream: bool = False,
              **extra) -> str:
    body = {"model": "kvbridge-tiny", "prompt": prompt, "max_tokens": MAX_TOKENS,
            "temperature": 0, "stream": stream, **extra}
    with httpx.Client(verify=verify, timeout=60) as c:
        if not stream:
            r = c.post(url + "/v1/completions", json=body)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"]
        text = []
        with c.stream("POST", url + "/v1/completions", json=body) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    text.append(json.loads(line[6:])["choices"][0]["text"])
        return "".join(text)
