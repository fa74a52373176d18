"""``kvbridge demo --engine vllm``: the seed's four panes on real vLLM with the plug-in.

A vLLM prefill and a vLLM decode (``KVBridgeConnector``, http side channel over TLS with a
token; each server pinned to its own core), kvbridge's proxy in front of them, and a few
questions to the real SmolLM2 through the proxy. Per question: the answer, TTFT, the KV
bytes the decode read over NIXL (vLLM's own ``vllm:nixl_*`` metrics) and whether the
answer equals the decode's own computation without transferred KV.
No vLLM import here: vLLM runs in its own processes.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

import httpx

from kvbridge.tools.launch import KVBridgeProcess, free_port, read_metric
from kvbridge.tools.testing.certs import write_certs
from kvbridge.tools.vllm.launch import VllmServer

QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "What is 12 times 12?",
]
START_TIMEOUT = 900.0  # two vLLM servers on a small machine: minutes
_BYTES = "vllm:nixl_bytes_transferred_sum"
_READS = "vllm:nixl_bytes_transferred_count"
_XFER = "vllm:nixl_xfer_time_seconds_sum"
_COLUMNS = (_BYTES, _READS, _XFER)


def _certs(d: Path) -> Path:
    """A throw-away CA and server certificate (the benchmarks' own), and a token file."""
    write_certs(d)
    token = d / "token"
    token.write_text(os.urandom(16).hex())
    token.chmod(0o600)
    return d


def _chat(client: httpx.Client, url: str, question: str, max_tokens: int
          ) -> tuple[str, float]:
    body = {"model": "model", "messages": [{"role": "user", "content": question}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True}
    t0 = time.perf_counter()
    ttft, text = None, []
    with client.stream("POST", url + "/v1/chat/completions", json=body, timeout=300) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{url} answered {r.status_code}: {r.read().decode()[:300]}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            delta = json.loads(line[6:])["choices"][0].get("delta", {}).get("content") or ""
            if delta and ttft is None:
                ttft = time.perf_counter() - t0
            text.append(delta)
    return "".join(text), ttft or float("nan")


def _wait_prewarmed(client: httpx.Client, proxy: str) -> list[dict]:
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        status = client.get(proxy + "/v1/kv/prewarm", timeout=10).json()
        if status["done"]:
            return status["pairs"]
        time.sleep(0.2)
    raise RuntimeError("the proxy's prewarm did not finish")


def run_vllm_demo(questions: list[str] | None = None, max_tokens: int = 32) -> int:
    from kvbridge.model.models import prepare

    questions = questions or QUESTIONS
    model = prepare("smollm2-135m-instruct")
    with tempfile.TemporaryDirectory(prefix="kvbridge-demo-vllm-") as t:
        tmp = _certs(Path(t))
        side = {"handshake_method": "http", "token_file": str(tmp / "token"),
                "trusted_side_channels": "127.0.0.1",
                "ssl_certfile": str(tmp / "server.pem"), "ssl_keyfile": str(tmp / "server.key"),
                "ssl_ca_certs": str(tmp / "ca.pem")}
        servers: dict[str, VllmServer] = {}
        proxy_proc = None
        try:
            for core, role in enumerate(("prefill", "decode")):
                # No prefix cache: the decode's own answer ("= local") is computed, never
                # read from blocks an earlier question brought over.
                servers[role] = VllmServer.start(model, name=role, log_dir=tmp, core=core,
                                                 connector="kvbridge", extra_config=side,
                                                 extra_args=["--no-enable-prefix-caching"])
            print(f"kvbridge demo --engine vllm: model {model}\n  vLLM prefill on "
                  f"{servers['prefill'].url} (side channel https://127.0.0.1:"
                  f"{servers['prefill'].side_channel_port}, token), vLLM decode on "
                  f"{servers['decode'].url}; starting both (minutes on a small machine) ...",
                  flush=True)
            t0 = time.monotonic()
            for s in servers.values():
                s.wait_healthy(START_TIMEOUT - (time.monotonic() - t0))
            xp = free_port()
            proxy = f"http://127.0.0.1:{xp}"
            proxy_proc = KVBridgeProcess("proxy", tmp, "proxy", "--port", str(xp), "--prefill",
                                         servers["prefill"].url, "--decode",
                                         servers["decode"].url, "--admin-routes", "open")
            proxy_proc.wait_healthy(proxy + "/health", time.monotonic() + 120)
            with httpx.Client(trust_env=False) as client:
                pairs = _wait_prewarmed(client, proxy)
                prewarmed = all(p["outcome"] == "ok" for p in pairs)
                print(f"  all up after {time.monotonic() - t0:.0f} s; the decode handshook "
                      f"with the prefill ahead of the first question: "
                      f"{'yes' if prewarmed else pairs}\n", flush=True)
                d_url = servers["decode"].url
                rows = []
                for i, q in enumerate(questions, 1):
                    before = {m: read_metric(client, d_url, m) for m in _COLUMNS}
                    text, ttft = _chat(client, proxy, q, max_tokens)
                    after = {m: read_metric(client, d_url, m) for m in _COLUMNS}
                    local, _ = _chat(client, d_url, q, max_tokens)
                    print(f"[{i}] {q}\n    -> {text}", flush=True)
                    rows.append((i, ttft, {m: after[m] - before[m] for m in _COLUMNS},
                                 text == local))
        finally:
            if proxy_proc is not None:
                proxy_proc.stop()
            for s in servers.values():
                s.stop()
    _print_table(model, rows)
    problems = [] if prewarmed else ["the decode could not handshake ahead (prewarm failed)"]
    for i, _, d, same in rows:
        if d[_READS] < 1:
            problems.append(f"question {i}: the KV was not read over NIXL (recomputed)")
        if not same:
            problems.append(f"question {i}: the answer differs from the decode's own")
    for why in problems:
        print(f"kvbridge demo: FAILED: {why}", file=sys.stderr)
    return 1 if problems else 0


def _print_table(model: Path, rows: list[tuple[int, float, dict[str, float], bool]]) -> None:
    print(f"\nmodel: {model.name} on vLLM with KVBridgeConnector (http side channel, TLS, "
          "token)")
    print("  #  TTFT (ms)  KV moved (KiB)  transfer (ms)  KV read  = local")
    for i, ttft, d, same in rows:
        print(f"{i:>3} {ttft * 1000:>10.1f} {d[_BYTES] / 1024:>15.1f} {d[_XFER] * 1000:>14.1f}"
              f"  {'yes' if d[_READS] >= 1 else 'NO':>7}  {'yes' if same else 'NO'}")
    print("\nKV moved / transfer: vLLM's own NIXL metrics on the decode for that question;"
          "\n= local: the answer equals the decode's own, computed without transferred KV.")
