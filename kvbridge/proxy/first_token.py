"""The first token straight from the prefill (``--first-token-from prefill``, the default).

The prefill hop already samples the answer's first token. For a streamed request the
proxy sends it to the client at once, then asks the decode to continue after it
(``kv_transfer_params.sent_token_ids``): the decode reads the prompt's KV, computes that
one token and streams the rest. The client's time to first token is then the prefill
hop's, not the prefill's plus the decode's (as in SGLang's disaggregation).

Only for what the prefill answers exactly as the decode would: a streamed request of one
choice, without logprobs, echo or stop strings, from a prefill that names the token it
sampled (``remote_output_token_ids``: kvbridge's engine; a stock vLLM prefill does not, and
its requests take the two-hop path). Once the first token is sent the response is
committed: a decode that fails before its first byte is replaced once by another
compatible decode, and otherwise the stream ends with an error event.

The streamed answer owns the prefill's hold (``release.HoldingResponse``): unless a decode
started answering (it has read the blocks), the hold is released when the answer ends, on
every way it can end: a client gone before or after the first chunk, or during a decode hop.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import AsyncIterator
from typing import Any

import httpx

from kvbridge.errors import error_body
from kvbridge.openai.responses import sse
from kvbridge.proxy.engine_client import Deadline, dumps, upstream_reason
from kvbridge.proxy.release import Hold, HoldingResponse
from kvbridge.proxy.rewrite import CHAT
from kvbridge.proxy.routing import Backend
from kvbridge.proxy.upstream import send_retrying_once

__all__ = ["FirstToken", "first_token"]

log = logging.getLogger(__name__)

# Request fields the prefill's one-token answer cannot stand in for.
_NOT_FROM_PREFILL = ("logprobs", "top_logprobs", "echo", "stop", "best_of", "suffix")


@dataclasses.dataclass(frozen=True)
class FirstToken:
    """The prefill's first token, as the client's first chunk."""

    token_ids: list[int]
    text: str
    finish_reason: str | None
    id: str
    created: int
    model: str
    usage: dict[str, Any] | None


def first_token(body: dict[str, Any], pdata: dict[str, Any], kv_params: Any,
                endpoint: str) -> FirstToken | None:
    """The prefill's answer as a first token the client may get now, or None (two hops)."""
    if body.get("stream") is not True or body.get("n") not in (None, 1):
        return None
    if any(body.get(k) not in (None, False, 0, []) for k in _NOT_FROM_PREFILL):
        return None
    if not isinstance(kv_params, dict):
        return None
    ids = kv_params.get("remote_output_token_ids")
    if not (isinstance(ids, list) and ids and all(isinstance(t, int) for t in ids)):
        return None
    try:
        choice = pdata["choices"][0]
        text = choice["message"]["content"] if endpoint == CHAT else choice["text"]
    except (KeyError, IndexError, TypeError):
        return None
    if not isinstance(text, str):
        return None
    # An incomplete character is left to the decode, which decodes all tokens together.
    return FirstToken(ids, text.rstrip("\ufffd"), choice.get("finish_reason"),
                      str(pdata.get("id", "")), int(pdata.get("created", 0)),
                      str(pdata.get("model", "")), pdata.get("usage"))


def _wanted(body: dict[str, Any], endpoint: str) -> int | None:
    for key in (("max_completion_tokens", "max_tokens") if endpoint == CHAT
                else ("max_tokens",)):
        if isinstance(body.get(key), int):
            return body[key]
    return None


def _chunk(ft: FirstToken, chat: bool, text: str | None, finish: str | None
           ) -> dict[str, Any]:
    if chat:
        delta: dict[str, Any] = {} if text is None else {"role": "assistant", "content": text}
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        obj = "text_completion"
    return {"id": ft.id, "object": obj, "created": ft.created, "model": ft.model,
            "choices": [choice]}


class FirstTokenStream:
    """The streamed answer: the prefill's token now, then the decode's continuation."""

    def __init__(self, flow: Any, p: Backend, d: Backend, ft: FirstToken, hold: Hold,
                 decode_body: dict[str, Any], endpoint: str, headers: dict[str, str],
                 request_id: str) -> None:
        self.flow, self.p, self.d, self.ft = flow, p, d, ft
        self.hold = hold
        self.body = {**decode_body,
                     "kv_transfer_params": {**hold.kv_params, "sent_token_ids": ft.token_ids}}
        self.endpoint, self.headers, self.request_id = endpoint, headers, request_id
        self.chat = endpoint == CHAT

    def response(self) -> HoldingResponse:
        """The answer, which owns the hold from now on."""
        return HoldingResponse(self._stream(), self.hold, {"x-request-id": self.request_id})

    async def _stream(self) -> AsyncIterator[bytes]:
        ft = self.ft
        self.flow.metrics.first_token_from.labels("prefill").inc()
        done = ft.finish_reason == "stop" or _wanted(self.body, self.endpoint) == 1
        yield sse(_chunk(ft, self.chat, ft.text, ft.finish_reason if done else None)).encode()
        if done:  # nothing left for a decode: the prefill's answer is the whole answer
            self.hold.close()
            options = self.body.get("stream_options")
            if isinstance(options, dict) and options.get("include_usage") and ft.usage:
                usage = _chunk(ft, self.chat, None, None)
                usage["choices"], usage["usage"] = [], ft.usage
                yield sse(usage).encode()
            yield b"data: [DONE]\n\n"
            return
        failed: set[str] = set()
        d: Backend | None = self.d
        while d is not None:
            relayed = False
            continuation = self._decode(d)
            try:
                async for chunk in continuation:
                    if chunk is None:
                        break  # failed before its first byte: another decode may take it
                    relayed = True
                    yield chunk
                else:
                    return
            finally:
                await continuation.aclose()
            if relayed:
                return
            failed.add(d.url)
            d = self._another_decode(failed)
        self.hold.close()  # no decode will read it
        yield sse(error_body("no decode instance could continue the answer after its first "
                             "token", "upstream_error", None, "502")).encode()
        yield b"data: [DONE]\n\n"

    def _another_decode(self, failed: set[str]) -> Backend | None:
        if len(failed) > 1:
            return None  # one replacement, as for the two-hop path
        pair = self.flow.router.pick_pair(set(), failed)
        return pair[1] if pair is not None and pair[1].compatible(self.p) else None

    async def _error(self, d: Backend, resp: httpx.Response, first_byte: Deadline
                     ) -> tuple[str, str | None, Any, str | None]:
        """A decode's error answer, read no further than the proxy's cap, by its first-byte
        deadline: (message, type, param, code) for the client's error event."""
        try:
            async with first_byte:
                detail = await self.flow.engines.read_body(resp)
        except httpx.HTTPError as exc:  # past the cap, or cut: what it said is unknown
            log.warning("request %s: decode %s returned %d, its body unread: %r",
                        self.request_id, d.url, resp.status_code, exc)
            return (f"decode {d.url} returned {resp.status_code}: {exc}", None, None, None)
        log.warning("request %s: decode %s returned %d: %s", self.request_id, d.url,
                    resp.status_code, detail[:500].decode(errors="replace"))
        message, etype, param, code = upstream_reason(
            httpx.Response(resp.status_code, content=detail))
        return f"decode {d.url} returned {resp.status_code}: {message}", etype, param, code

    async def _decode(self, d: Backend) -> AsyncIterator[bytes | None]:
        """The decode's stream, relayed; ``None`` once if it failed before its first byte."""
        flow, client = self.flow, self.flow.engines.http
        release = flow.router.acquire(d)
        try:
            req = client.build_request("POST", d.url + self.endpoint,
                                       content=dumps(self.body),
                                       headers=self.headers)
            # Its answer's head and first chunk (or its error) within --timeout in all.
            first_byte = flow.engines.first_byte()
            try:
                async with first_byte:
                    resp = await send_retrying_once(client, req, stream=True)
            except httpx.HTTPError as exc:
                log.warning("request %s: decode %s failed: %r", self.request_id, d.url, exc)
                flow.metrics.upstream_errors.labels("decode").inc()
                flow.router.failed(d)
                yield None
                return
            first = True
            try:
                if resp.status_code >= 400:
                    message, etype, param, code = await self._error(d, resp, first_byte)
                    flow.metrics.upstream_errors.labels("decode").inc()
                    # Nobody will read the prefill's blocks through this decode.
                    if resp.status_code >= 500:
                        flow.router.failed(d)
                        yield None  # another decode may continue
                        return
                    # The request's own fault: the client gets the decode's error, in band,
                    # as one event of our own encoding (its body could hold events).
                    self.hold.close()
                    yield sse(error_body(message, etype or "upstream_error", param,
                                         code or str(resp.status_code))).encode()
                    yield b"data: [DONE]\n\n"
                    return
                chunks = resp.aiter_bytes()
                try:
                    async with first_byte:
                        chunk = await chunks.__anext__()
                except StopAsyncIteration:
                    return
                # It answers, so it has read the prefill's blocks.
                self.hold.handed_over()
                flow.router.succeeded(d)
                first = False
                yield chunk
                async for chunk in chunks:
                    yield chunk
            except httpx.HTTPError as exc:
                if first:  # died before its first byte: another decode may continue
                    log.warning("request %s: decode %s failed before its first token: %r",
                                self.request_id, d.url, exc)
                    flow.metrics.upstream_errors.labels("decode").inc()
                    flow.router.failed(d)
                    yield None
                    return
                # The client already has part of the answer: cutting the connection says so.
                log.error("decode %s failed mid-response: %r", d.url, exc)
                raise
            finally:
                await resp.aclose()
        finally:
            release()
