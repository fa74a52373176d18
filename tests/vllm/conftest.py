"""Real vLLM servers for the plug-in's tests: the packaged SmolLM2, one core per server."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvbridge.tools.testing.prometheus import labelled_total, parse_samples
from kvbridge.tools.vllm.launch import VllmServer, completion

# Over 16 tokens: the decode reads whole KV blocks, not only a partial one.
PROMPT = ("Question: What is the capital of France, and which river flows through it? "
          "Answer in one sentence.\nAnswer:")
MAX_TOKENS = 12
START_TIMEOUT = 900.0  # two cores shared by every server a module starts
REQUEST_TIMEOUT = 600.0  # a busy 2-core machine: one request can wait minutes for a core
# Decodes without a prefix cache: every P/D of the same prompt reads the KV again.
NO_PREFIX_CACHE = ["--no-enable-prefix-caching"]


@pytest.fixture(scope="session")
def model() -> Path:
    from kvbridge.model.models import prepare

    return prepare("smollm2-135m-instruct", progress=False)


@contextlib.contextmanager
def running(*servers: VllmServer) -> Iterator[tuple[VllmServer, ...]]:
    """Wait until every server is healthy (they start in parallel); stop them all after."""
    try:
        for s in servers:
            s.wait_healthy(START_TIMEOUT)
        for s in servers:  # the first request of a server is much slower than the next
            completion(s.url, "Hello", max_tokens=1, timeout=START_TIMEOUT).raise_for_status()
        yield servers
    finally:
        for s in servers:
            s.stop()


def nixl_bytes(server: VllmServer) -> float:
    """Bytes the server's NIXL READs moved so far (vLLM's own metric)."""
    return server.metrics().get("vllm:nixl_bytes_transferred_sum", 0.0)


def kv_reads(server: VllmServer, result: str) -> float:
    """The plug-in's ``vllm:kvbridge_kv_reads_total{result=...}`` (kvbridge.vllm.validation)."""
    samples = parse_samples(httpx.get(f"{server.url}/metrics", timeout=60).text)
    return labelled_total(samples, "vllm:kvbridge_kv_reads_total", result=result)


def num_tokens(server: VllmServer, prompt: str) -> int:
    r = httpx.post(f"{server.url}/tokenize", json={"model": "model", "prompt": prompt},
                   timeout=60)
    r.raise_for_status()
    return int(r.json()["count"])


def answer(server: VllmServer, prompt: str = PROMPT) -> str:
    """The server's greedy text for ``prompt``, computed without any KV transfer."""
    r = completion(server.url, prompt, max_tokens=MAX_TOKENS, timeout=REQUEST_TIMEOUT)
    r.raise_for_status()
    return r.json()["choices"][0]["text"]
