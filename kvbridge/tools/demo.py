"""``kvbridge demo``: the seed's four panes in one command, on a real model.

Starts a prefill (TP 1), a decode and a proxy on loopback as separate processes,
with the http handshake over TLS and a token (throw-away certificates in a
temporary folder), sends a few prompts through the proxy, prints the answers and
a table, and shuts everything down.

The model is SmolLM2-135M-Instruct by default, prepared from its package on the
first run (``kvbridge model prepare``); the prompts are chat questions, so a wrong
transfer shows as a wrong answer. Its 9 query and 3 KV heads split over TP 1 or 3
only; the decode runs TP 1 by default: on two cores, one process per role keeps
both busy, while TP 3 puts three workers (and 60 all-reduces a token) on them --
``--decode-tp 3`` shows the TP-mismatched transfer at that price. ``--model tiny``
runs the built-in random-weight model (decode TP 2, plain-text prompts); ``--model
DIR`` any local Llama checkpoint.
"""

from __future__ import annotations

import contextlib
import json
import os
import ssl
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from kvbridge.tools.launch import KVBridgeProcess, free_port, read_metric
from kvbridge.tools.testing.certs import issue, new_ca

PROMPTS = [
    "The side channel carries metadata, the data plane carries KV blocks.",
    "Prefill computes the prompt; decode continues from its KV cache.",
    "A peer that never answers must not block anything forever.",
]
QUESTIONS = [
    "What is the capital of France?",
    "What is the boiling point of water in Celsius?",
    "Write a haiku about the sea.",
]
DEFAULT_MODEL = "smollm2-135m-instruct"
START_TIMEOUT = 300.0  # a real model on a small, busy machine


@dataclass(frozen=True)
class DemoModel:
    """What the demo serves: a checkpoint directory (None: the built-in tiny model)."""

    path: str | None
    name: str  # served as this name, and shown in the table
    description: str
    chat: bool  # ask chat questions (the model has a chat template) or complete text
    decode_tp: int  # the default decode TP size


def resolve_model(model: str) -> DemoModel:
    """``tiny``, a model ``kvbridge model prepare`` knows (prepared now if need be), or a
    checkpoint directory. ``ConfigError`` (one line) for anything else."""
    from kvbridge.errors import ConfigError
    from kvbridge.model.loader import load_config, load_tokenizer
    from kvbridge.model.models import MODELS, ModelPrepareError, lookup, prepare

    if model == "tiny":
        return DemoModel(None, "kvbridge-tiny", "built-in tiny Llama, random weights (2 layers, "
                         "4 KV heads)", chat=False, decode_tp=2)
    if Path(model).is_dir():
        path, label = Path(model), Path(model).name
    else:
        try:
            label = lookup(model).name
            path = prepare(model)
        except ModelPrepareError as e:
            known = ", ".join(["tiny", *MODELS])
            raise ConfigError(f"--model {model}: {e} (models: {known}, or a checkpoint "
                              "directory)") from None
    cfg = load_config(path)
    chat = load_tokenizer(path).chat_template is not None
    return DemoModel(str(path), label, f"{label}: {cfg.num_hidden_layers} layers, "
                     f"{cfg.num_attention_heads} heads, {cfg.num_key_value_heads} KV heads, "
                     f"head_dim {cfg.head_dim}, float32", chat=chat, decode_tp=1)


def _write_certs(d: Path) -> None:
    issue(new_ca(d), d, "server", "127.0.0.1", "localhost", combined=True)
    token = d / "token"
    token.write_text(os.urandom(16).hex())
    token.chmod(0o600)


@contextlib.contextmanager
def _processes() -> Iterator[list[KVBridgeProcess]]:
    procs: list[KVBridgeProcess] = []
    try:
        yield procs
    finally:
        for p in procs:
            p.stop()


def _start(procs: list[KVBridgeProcess], tmp: Path, name: str, *args: str) -> KVBridgeProcess:
    p = KVBridgeProcess(name, tmp, *args)
    procs.append(p)
    return p


def _wait_prewarmed(p: KVBridgeProcess, url: str, client: httpx.Client) -> bool:
    """Wait for the proxy's prewarm; True when every (decode, prefill) pair succeeded."""
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        status = client.get(url, timeout=5).json()
        if status["done"]:
            for pair in status["pairs"]:
                if pair["outcome"] != "ok":
                    print(f"  prewarm {pair['decode']} -> {pair['prefill']}: {pair['outcome']}")
            return all(pair["outcome"] == "ok" for pair in status["pairs"])
        time.sleep(0.1)
    raise RuntimeError(f"{p.name}: prewarm not done after {START_TIMEOUT:g}s:\n{p.tail()}")


def _stream(client: httpx.Client, url: str, model: DemoModel, prompt: str,
            max_tokens: int) -> tuple[str, float]:
    """The streamed answer and its time to first token: a chat question, or a text to
    complete."""
    body = {"model": model.name, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    if model.chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    route = "/v1/chat/completions" if model.chat else "/v1/completions"
    t0 = time.perf_counter()
    ttft, text = None, []
    with client.stream("POST", url + route, json=body, timeout=300) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{url} answered {r.status_code}: {r.read().decode()[:300]}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            piece = (choice.get("delta", {}).get("content") or "") if model.chat \
                else choice["text"]
            if ttft is None and (piece or not model.chat):  # not the role-only chunk
                ttft = time.perf_counter() - t0
            text.append(piece)
    return "".join(text), ttft or float("nan")


def run_demo(prompts: list[str] | None = None, max_tokens: int = 24,
             decode_tp: int | None = None, handshake: str = "http",
             model: str = DEFAULT_MODEL) -> int:
    """Run the demo; 0 when every answer was read from the prefill's KV and equals the
    decode's own. ``decode_tp`` None: the model's default (see the module docstring)."""
    from kvbridge.errors import ConfigError
    from kvbridge.model.loader import load_config

    m = resolve_model(model)
    decode_tp = m.decode_tp if decode_tp is None else decode_tp
    try:
        load_config(m.path).check_tp(decode_tp)
    except ValueError as e:
        raise ConfigError(f"--decode-tp {decode_tp}: {e} ({m.name})") from None
    prompts = prompts or (QUESTIONS if m.chat else PROMPTS)
    with tempfile.TemporaryDirectory(prefix="kvbridge-demo-") as t:
        tmp = Path(t)
        _write_certs(tmp)
        pp, dp, xp, sp = (free_port() for _ in range(4))
        tls = ["--ssl-certfile", str(tmp / "server.pem"), "--ssl-ca-certs", str(tmp / "ca.pem")]
        side = ["--handshake", handshake, "--side-channel-token-file", str(tmp / "token"),
                "--trusted-side-channels", "127.0.0.1"]
        served = ["--served-model-name", m.name] + ([] if m.path is None else
                                                   ["--model", m.path])
        print(f"kvbridge demo: model {m.description}", flush=True)
        print(f"kvbridge demo: prefill TP 1 on :{pp}, decode TP {decode_tp} on :{dp}, "
              f"proxy on :{xp}; {handshake} handshake on :{sp}"
              f"{' over TLS' if handshake == 'http' else ''} with a token", flush=True)
        ca = ssl.create_default_context(cafile=str(tmp / "ca.pem"))
        with _processes() as procs, httpx.Client(verify=ca) as client:
            prefill = _start(procs, tmp, "prefill", "serve", "--role", "prefill", "--port",
                             str(pp), "--side-channel-port", str(sp), *served, *side, *tls)
            decode = _start(procs, tmp, "decode", "serve", "--role", "decode", "--tp",
                            str(decode_tp), "--port", str(dp), *served, *side, *tls)
            for p, port in ((prefill, pp), (decode, dp)):
                print(f"  starting {p.name} ...", flush=True)
                p.wait_healthy(f"https://127.0.0.1:{port}/health",
                               time.monotonic() + START_TIMEOUT, ca)
            proxy = _start(procs, tmp, "proxy", "proxy", "--port", str(xp), "--prefill",
                           f"https://127.0.0.1:{pp}", "--decode", f"https://127.0.0.1:{dp}",
                           "--ca-certs", str(tmp / "ca.pem"), "--kv-token-file",
                           str(tmp / "token"), "--admin-routes", "open")
            proxy.wait_healthy(f"http://127.0.0.1:{xp}/health", time.monotonic() + START_TIMEOUT)
            # The proxy has the decode handshake with the prefill before any request.
            prewarmed = _wait_prewarmed(proxy, f"http://127.0.0.1:{xp}/v1/kv/prewarm", client)
            d_url = f"https://127.0.0.1:{dp}"
            hs = read_metric(client, d_url, "kvbridge_handshake_seconds_sum") * 1000
            n = read_metric(client, d_url, "kvbridge_handshake_seconds_count")
            print(f"  all up; {n:.0f} decode rank(s) handshaken with the prefill ahead of the "
                  f"first request ({hs:.1f} ms in total); sending prompts\n", flush=True)
            rows = []
            for i, prompt in enumerate(prompts, 1):
                before = {m: read_metric(client, d_url, m) for m in _COLUMNS}
                text, ttft = _stream(client, f"http://127.0.0.1:{xp}", m, prompt, max_tokens)
                after = {m: read_metric(client, d_url, m) for m in _COLUMNS}
                delta = {m: after[m] - before[m] for m in _COLUMNS}
                # The same prompt computed on the decode alone, without transferred KV:
                # equal answers say the blocks arrived whole and in the right place.
                local, _ = _stream(client, d_url, m, prompt, max_tokens)
                print(f"[{i}] {prompt!r}\n    -> {text!r}", flush=True)
                rows.append((i, ttft, delta, text == local))
            _print_table(rows, f"{m.name}, prefill TP 1 -> decode TP {decode_tp}")
    # A demo that recomputed (or could not prewarm) shows nothing of the transfer: fail.
    problems = [] if prewarmed else ["the decode could not handshake ahead (prewarm failed)"]
    problems += [f"prompt {i}: {why}" for i, _, d, same in rows
                 for why in _row_problems(d, same)]
    for why in problems:
        print(f"kvbridge demo: FAILED: {why}", file=sys.stderr)
    return 1 if problems else 0


_LOADED = 'kvbridge_kv_loads_total{outcome="ok"}'
_FAILED = 'kvbridge_kv_loads_total{outcome="failed"}'
_COLUMNS = ("kvbridge_handshake_seconds_sum", "kvbridge_kv_bytes_loaded_total",
            "kvbridge_kv_load_seconds_sum", _LOADED, _FAILED)


def _row_problems(d: dict[str, float], same: bool) -> list[str]:
    out = []
    if d[_LOADED] != 1 or d[_FAILED] != 0:
        out.append(f"the KV was not read ({d[_FAILED]:.0f} failed load(s), recomputed)")
    if not same:
        out.append("the answer differs from the decode's own computation")
    return out


def _print_table(rows: list[tuple[int, float, dict[str, float], bool]], title: str) -> None:
    print(f"\nmodel {title}")
    print("  #  TTFT (ms)  handshake (ms)  KV moved (KiB)  transfer (ms)  KV read  = local")
    for i, ttft, d, same in rows:
        hs = d["kvbridge_handshake_seconds_sum"] * 1000
        read = d[_LOADED] == 1 and d[_FAILED] == 0
        print(f"{i:>3} {ttft * 1000:>10.1f} {hs:>15.1f} "
              f"{d['kvbridge_kv_bytes_loaded_total'] / 1024:>15.1f} "
              f"{d['kvbridge_kv_load_seconds_sum'] * 1000:>14.1f}  {'yes' if read else 'NO':>7}"
              f"  {'yes' if same else 'NO'}")
    print("\nhandshake: during the request, summed over decode ranks (0 when done ahead);"
          "\ntransfer: from blocks allocated on decode to KV arrived on every rank;"
          "\nKV read: the decode loaded the prompt's KV from the prefill (NO: it recomputed);"
          "\n= local: the answer equals the decode's own, computed without transferred KV.")
