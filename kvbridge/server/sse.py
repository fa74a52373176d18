"""OpenAI response bodies and server-sent-event chunks of one request."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from kvbridge.errors import EngineDeadError, error_body, failure_status, status_of
from kvbridge.openai.responses import sse

if TYPE_CHECKING:
    from kvbridge.engine.sequence import RequestOutput

__all__ = ["Formatter"]


class Formatter:
    """OpenAI response bodies and SSE chunks for one request."""

    def __init__(self, tokenizer: Any, model: str, request_id: str, chat: bool,
                 num_prompt_tokens: int, sent_token_ids: list[int] | None = None):
        self.tokenizer = tokenizer
        # Output tokens the client already has (``sent_token_ids``: the proxy streamed the
        # prefill's first token): counted and decoded with the rest, never sent again.
        self.sent_token_ids = list(sent_token_ids or [])
        self.model = model
        self.chat = chat
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{request_id}"
        self.created = int(time.time())
        self.num_prompt_tokens = num_prompt_tokens

    def _usage(self, completion_tokens: int) -> dict[str, int]:
        return {"prompt_tokens": self.num_prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": self.num_prompt_tokens + completion_tokens}

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices}

    def _sent_chars(self) -> int:
        """Characters of the decoded text the client already has: the sent tokens' text,
        less a trailing incomplete character (the client got the text without it)."""
        if not self.sent_token_ids:
            return 0
        return len(self.tokenizer.decode(self.sent_token_ids).rstrip("\ufffd"))

    def full(self, token_ids: list[int], last: RequestOutput) -> dict[str, Any]:
        # The sent tokens count (usage) but their text is not sent again (protocol.md §11):
        # the text is decoded with them, so a character split across both comes out whole.
        token_ids = self.sent_token_ids + token_ids
        text = self.tokenizer.decode(token_ids)[self._sent_chars():]
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "logprobs": None, "finish_reason": last.finish_reason}
            body = self._envelope("chat.completion", [choice])
        else:
            choice = {"index": 0, "text": text, "logprobs": None,
                      "finish_reason": last.finish_reason}
            body = self._envelope("text_completion", [choice])
        body["usage"] = self._usage(len(token_ids))
        if last.kv_transfer_params is not None:
            body["kv_transfer_params"] = last.kv_transfer_params.to_json()
        return body

    def _chunk(self, text: str | None, finish_reason: str | None,
               role: bool = False) -> dict[str, Any]:
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": None,
                      "finish_reason": finish_reason}
            return self._envelope("chat.completion.chunk", [choice])
        choice = {"index": 0, "text": text or "", "logprobs": None,
                  "finish_reason": finish_reason}
        return self._envelope("text_completion", [choice])

    async def stream(self, first: RequestOutput, outputs: AsyncIterator[RequestOutput],
                     include_usage: bool) -> AsyncIterator[str]:
        # Closing ``outputs`` (also when the client disconnects) aborts the request.
        async with contextlib.aclosing(outputs):
            token_ids = list(self.sent_token_ids)
            sent = self._sent_chars()  # characters of the decoded text already sent
            if self.chat and not token_ids:
                yield sse(self._chunk("", None, role=True))
            out = first
            while True:
                token_ids += out.new_token_ids
                if out.error is not None:
                    st = failure_status(out.error)
                    yield sse(error_body(str(out.error), st.type, None, st.code))
                    break
                text = self.tokenizer.decode(token_ids)
                # Hold back an incomplete multi-byte character until its other bytes come.
                if not out.finished and text.endswith("\ufffd"):
                    text = text[:sent]
                delta, sent = text[sent:], max(sent, len(text))
                if out.finished:
                    chunk = self._chunk(delta, out.finish_reason)
                    if out.kv_transfer_params is not None:
                        chunk["kv_transfer_params"] = out.kv_transfer_params.to_json()
                    yield sse(chunk)
                    if include_usage:
                        usage = self._envelope(chunk["object"], [])
                        usage["usage"] = self._usage(len(token_ids))
                        yield sse(usage)
                    break
                if delta:
                    yield sse(self._chunk(delta, None))
                try:
                    out = await anext(outputs)
                except EngineDeadError as e:  # headers are sent: report it in the stream
                    st = status_of(e)
                    yield sse(error_body(str(e), st.type, None, st.code))
                    break
        yield "data: [DONE]\n\n"
