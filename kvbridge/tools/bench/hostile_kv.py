"""``kvbridge bench hostile``'s attacks on held KV (protocol.md 9a): releases without the
hold's key, READs of blocks that are not the prompt's (reordered, another prompt, released
and reused), and the audit log's volume per 1,000 metadata fetches."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx

from kvbridge.tools.bench.common import progress
from kvbridge.tools.bench.report import percentiles
from kvbridge.tools.launch import read_metric
from kvbridge.tools.testing.wait import wait_until

PROMPT = "Held KV must only ever be read by the request it was computed for. " * 3
MAX_TOKENS = 8


def _body(prompt: str, **extra: Any) -> dict[str, Any]:
    return {"model": "kvbridge-tiny", "prompt": prompt, "max_tokens": MAX_TOKENS,
            "temperature": 0, **extra}


def kv_integrity(prefill: str, decode: str, token: str, rounds: int) -> dict[str, Any]:
    """Each attack ``rounds`` times against a prefill and a decode (no proxy): how many
    answers differ from the decode's own (monolithic) answer, how many loads were caught
    as stale, and what a caught request costs against a normal P/D one."""
    auth = {"authorization": f"Bearer {token}"}
    with httpx.Client(timeout=120, trust_env=False) as c:
        def text(prompt: str, params: dict[str, Any] | None) -> tuple[str, float]:
            t0 = time.perf_counter()
            r = c.post(decode + "/v1/completions", json=_body(
                prompt, **({"kv_transfer_params": params} if params else {})))
            r.raise_for_status()
            return r.json()["choices"][0]["text"], time.perf_counter() - t0

        def hold(prompt: str) -> dict[str, Any]:
            r = c.post(prefill + "/v1/completions", json=_body(
                prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True}))
            r.raise_for_status()
            return r.json()["kv_transfer_params"]

        def release(params: dict[str, Any]) -> bool:
            r = c.post(prefill + "/v1/kv/release", json=params, headers=auth)
            r.raise_for_status()
            return bool(r.json()["released"])

        def settle() -> None:
            wait_until(lambda: not read_metric(c, prefill, "kvbridge_held_requests"), 60,
                       "the prefill's holds released", every=0.02)

        other = PROMPT[::-1]  # as many tokens: the tiny model's tokenizer is byte-level
        want = {p: text(p, None)[0] for p in (PROMPT, other)}
        text(PROMPT, hold(PROMPT))  # the decode handshakes once, before anything is timed
        settle()
        ignored0 = read_metric(c, prefill, 'kvbridge_kv_notes_ignored_total{why="bad_key"}')
        keyless = {"released": 0, "held_after": 0}
        for _ in range(rounds):
            params = hold(PROMPT)
            bare = {k: v for k, v in params.items() if k != "remote_hold_key"}
            keyless["released"] += release(bare) + release({**params, "remote_hold_key": "0"})
            keyless["held_after"] += int(read_metric(c, prefill, "kvbridge_held_requests"))
            release(params)
        keyless["ignored"] = read_metric(
            c, prefill, 'kvbridge_kv_notes_ignored_total{why="bad_key"}') - ignored0
        settle()

        def attack(name: str) -> tuple[str, dict[str, Any]]:
            params, ask = hold(PROMPT), PROMPT
            if name == "reordered_blocks":
                params["remote_block_ids"] = params["remote_block_ids"][::-1]
            elif name == "another_prompt":
                ask = other
            elif name == "released_and_reused":
                release(params)
                settle()
                for _ in range(int(read_metric(c, prefill, "kvbridge_blocks_free"))):
                    again = hold(other)
                    release(again)
                    if set(again["remote_block_ids"]) & set(params["remote_block_ids"]):
                        break
            return ask, params

        results: dict[str, Any] = {}
        for name in ("normal", "reordered_blocks", "another_prompt", "released_and_reused"):
            progress(f"hostile: KV integrity, {name} x {rounds}")
            stale0 = read_metric(c, decode, "kvbridge_kv_loads_stale_total")
            wrong, times = 0, []
            for _ in range(rounds):
                ask, params = attack(name) if name != "normal" else (PROMPT, hold(PROMPT))
                got, secs = text(ask, params)
                wrong += got != want[ask]
                times.append(secs)
                settle()
            results[name] = {
                "requests": rounds, "wrong_answers": wrong, "request_ms": percentiles(times),
                "stale_loads": read_metric(c, decode, "kvbridge_kv_loads_stale_total") - stale0}
    return {"keyless_releases": {**keyless, "tries": 2 * rounds}, "reads": results}


def audit_volume(audit_log: Path, fetch: Any, n: int) -> dict[str, Any]:
    """Bytes and lines the side channel's audit log gains per 1,000 metadata fetches."""
    size0 = audit_log.stat().st_size
    lines0 = audit_log.read_bytes().count(b"\n")
    for _ in range(n):
        fetch()
    grown = audit_log.stat().st_size - size0
    lines = audit_log.read_bytes().count(b"\n") - lines0
    return {"fetches": n, "bytes_per_1000": grown * 1000 / n,
            "lines_per_1000": lines * 1000 / n}
