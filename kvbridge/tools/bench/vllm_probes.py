"""What ``kvbridge bench vllm`` measures against one pair: P/D requests sent with vLLM's
protocol (a closed loop), and the prefill's side channel fetched from outside (vLLM's zmq
wire or the plug-in's http), cold or over one kept connection."""

from __future__ import annotations

import time
from typing import Any

import httpx

from kvbridge.config import TLSConfig
from kvbridge.tools.bench.load import run_closed_loop, stream_completion
from kvbridge.tools.bench.report import percentiles

PROMPT = ("Explain in a few sentences why a decode instance reads the prompt's KV cache from "
          "a prefill instance instead of computing it again. Request {i}.")
GET_META_MSG = b"get_meta_msg"  # vLLM 0.32's zmq handshake request tag


# --- one P/D request with vLLM's protocol -------------------------------------------


def closed_loop(prefill: str, decode: str, model: str, concurrency: int, n: int,
                max_tokens: int, seed: int, raw: bool = False) -> dict[str, Any]:
    async def send(client: httpx.AsyncClient, i: int) -> dict[str, Any]:
        body = {"model": model, "prompt": PROMPT.format(i=seed + i), "temperature": 0}
        t0 = time.perf_counter()
        r = await client.post(prefill + "/v1/completions", json={
            **body, "max_tokens": 1, "stream": False,
            "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False,
                                   "remote_engine_id": None, "remote_block_ids": None,
                                   "remote_host": None, "remote_port": None}})
        if r.status_code != 200:
            raise RuntimeError(f"prefill {r.status_code}: {r.text[:200]}")
        t1 = time.perf_counter()  # the prefill's answer: its TTFT (a 1-token completion)
        got = await stream_completion(client, decode + "/v1/completions", {
            **body, "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
            "kv_transfer_params": r.json().get("kv_transfer_params")})
        return {"ttft": got["first"] - t0, "latency": got["last"] - t0,
                "tokens": got["chunks"], "prefill": t1 - t0, "decode_first": got["first"] - t1}

    loop = run_closed_loop(concurrency, n, send)
    results, wall = loop.results, loop.seconds
    tokens = sum(r["tokens"] for r in results)
    out = {"concurrency": concurrency, "requests": len(results), "errors": len(loop.errors),
           "error_samples": loop.errors[:3], "tokens_per_s": tokens / wall if wall else 0.0,
           "ttft_ms": percentiles([r["ttft"] for r in results], (50, 99))}
    if raw:
        out.update(ttft_s=[r["ttft"] for r in results], tokens=tokens, seconds=wall,
                   prefill_s=[r["prefill"] for r in results],
                   decode_first_s=[r["decode_first"] for r in results])
    return out


# --- the side channel, fetched from outside -----------------------------------------


def fetch_zmq(port: int, n: int, warm: bool) -> list[float]:
    import msgspec
    import zmq

    ctx = zmq.Context()
    req = msgspec.msgpack.encode((GET_META_MSG, 0, 0))
    samples: list[float] = []
    sock = None
    try:
        for _ in range(n):
            t0 = time.perf_counter()
            if sock is None:
                sock = ctx.socket(zmq.REQ)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.RCVTIMEO, 10_000)
                sock.connect(f"tcp://127.0.0.1:{port}")
            sock.send(req)
            frames = sock.recv_multipart()
            samples.append(time.perf_counter() - t0)
            if not frames or not frames[0]:
                raise RuntimeError("empty zmq handshake reply")
            if not warm:
                sock.close()
                sock = None
    finally:
        if sock is not None:
            sock.close()
        ctx.term()
    return samples


def fetch_http(port: int, n: int, warm: bool, tls: TLSConfig | None, token: str,
               never_met: bool = False) -> list[float]:
    """Fetches of rank 0 with the client the plug-in's decode uses (kvbridge's http client):
    ``warm``, over one kept connection; else a new client (and connection) each time.
    ``never_met``: no TLS session to resume (a peer never met), else the client's own."""
    from kvbridge.handshake.http.client import HttpHandshakeClient
    from kvbridge.handshake.http.tls_sessions import tls_sessions

    samples: list[float] = []
    client = None
    try:
        for _ in range(n):
            if never_met and tls is not None:
                tls_sessions(tls).sessions.clear()
            t0 = time.perf_counter()
            if client is None:
                client = HttpHandshakeClient(10.0, None, token, tls=tls)
            client.fetch_body("127.0.0.1", port, 0)
            samples.append(time.perf_counter() - t0)
            if not warm:
                client.close()
                client = None
    finally:
        if client is not None:
            client.close()
    return samples


def bare_tls(port: int, n: int, tls: TLSConfig) -> list[float]:
    """A TCP connect and a full TLS handshake (no session to resume), nothing sent: what a
    cold https fetch cannot go below."""
    import socket

    from kvbridge.handshake.http.tls_sessions import tls_sessions

    context = tls_sessions(tls).context
    samples: list[float] = []
    for _ in range(n):
        t0 = time.perf_counter()
        with socket.create_connection(("127.0.0.1", port), timeout=10) as raw, \
                context.wrap_socket(raw, server_hostname="127.0.0.1"):
            samples.append(time.perf_counter() - t0)
    return samples


# --- the plug-in's READ validation, from the decode's /metrics ------------------------


def read_validation(decode: str) -> dict[str, float]:
    """The decode's READ results (``vllm:kvbridge_kv_reads_total``) and the mean time of a
    tag READ against the mean time of a data READ (``tag_read_share``)."""
    from kvbridge.tools.testing.prometheus import labelled_total, metric_total, parse_samples
    from kvbridge.vllm.validation import RESULTS

    try:
        samples = parse_samples(httpx.get(f"{decode}/metrics", timeout=60).text)
    except httpx.HTTPError:
        return {}
    out = {r: labelled_total(samples, "vllm:kvbridge_kv_reads_total", result=r)
           for r in RESULTS}
    tags = metric_total(samples, "vllm:kvbridge_tag_read_seconds_count")
    data = metric_total(samples, "vllm:nixl_xfer_time_seconds_count")
    if tags and data:
        out["tag_read_mean_ms"] = 1e3 * metric_total(
            samples, "vllm:kvbridge_tag_read_seconds_sum") / tags
        out["data_read_mean_ms"] = 1e3 * metric_total(
            samples, "vllm:nixl_xfer_time_seconds_sum") / data
        out["tag_read_share"] = out["tag_read_mean_ms"] / out["data_read_mean_ms"]
    return out
