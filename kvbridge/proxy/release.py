"""Releasing a prefill's held KV blocks when no decode will read them.

A prefill's answer pins the prompt's blocks for a decode until the hold's lease ends.
``Hold`` is that pin on the proxy's side: exactly one owner at a time (the request's
handler, then the streamed answer it returns) closes it on its way out, however it leaves
(an error, a client that hung up, a cancelled task), and closing releases the blocks
unless a decode has them. So no path can forget a release: a path can only hand the hold
over, to a decode or to the next owner.
"""

from __future__ import annotations

import logging
from typing import Any

import anyio
import httpx
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from kvbridge.proxy.background_tasks import TaskSet
from kvbridge.proxy.engine_client import HEALTH_TIMEOUT, EngineClient, dumps
from kvbridge.proxy.metrics import ProxyMetrics
from kvbridge.proxy.upstream import send_retrying_once

__all__ = ["Hold", "HoldingResponse", "Releaser"]

log = logging.getLogger(__name__)


class Releaser:
    def __init__(self, engines: EngineClient, metrics: ProxyMetrics, tasks: TaskSet,
                 kv_token: str | None) -> None:
        self.engines = engines
        self.metrics = metrics
        self.tasks = tasks
        self.kv_token = kv_token

    def later(self, prefill: str, kv_params: Any, request_id: str) -> None:
        """Release in the background (the client's answer does not wait for it)."""
        self.tasks.spawn(self.release(prefill, kv_params, request_id))

    async def release(self, prefill: str, kv_params: Any, request_id: str) -> None:
        """Tell the prefill to free the request's held blocks now rather than at the end
        of their lease (best effort: the lease still bounds them if this fails). Sent once
        more on a new connection if the prefill closed a reused one unanswered, as the hops
        are (``send_retrying_once``)."""
        headers = {"authorization": f"Bearer {self.kv_token}"} if self.kv_token else {}
        client = self.engines.http
        try:
            r = await send_retrying_once(client, client.build_request(
                "POST", prefill + "/v1/kv/release", content=dumps(kv_params),
                headers={**headers, "content-type": "application/json"},
                timeout=HEALTH_TIMEOUT))
            outcome = "ok" if r.status_code == 200 else str(r.status_code)
        except httpx.HTTPError as exc:
            outcome = type(exc).__name__
        self.metrics.releases.labels(outcome).inc()
        if outcome != "ok":
            log.warning("request %s: releasing its blocks on %s failed: %s", request_id,
                        prefill, outcome)


class Hold:
    """One request's blocks held by a prefill (``kv_params``: its answer's params; None:
    it holds nothing). ``close`` releases them unless ``handed_over`` said a decode has
    them; ``pass_on`` gives the hold to a new owner. Closing twice is closing once."""

    def __init__(self, releaser: Releaser, prefill: str, kv_params: Any,
                 request_id: str) -> None:
        self.releaser = releaser
        self.prefill = prefill
        self.kv_params = kv_params
        self.request_id = request_id
        self._open = kv_params is not None

    def handed_over(self) -> None:
        """A decode has the blocks (its READ, or the lease, frees them): nothing to release."""
        self._open = False

    def pass_on(self) -> Hold:
        """The hold for a new owner, who must close it; this one then releases nothing."""
        new = Hold(self.releaser, self.prefill, self.kv_params, self.request_id)
        new._open, self._open = self._open, False
        return new

    def close(self) -> None:
        """Release the blocks now (in the background) unless handed over or passed on."""
        if self._open:
            self._open = False
            self.releaser.later(self.prefill, self.kv_params, self.request_id)


class HoldingResponse(StreamingResponse):
    """A streamed answer that owns a ``Hold``: once the response is over, however it ended
    (also a client gone before the first byte, when the body was never started), the body
    is closed, which ends its hops, then the hold."""

    def __init__(self, content: Any, hold: Hold, headers: dict[str, str]) -> None:
        super().__init__(content, media_type="text/event-stream", headers=headers)
        self.hold = hold

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                # A client gone mid-stream cancels the sending, not the body: closing the
                # body runs its own cleanup (the decode's stream closed, its slot freed).
                with anyio.CancelScope(shield=True):
                    await self.body_iterator.aclose()  # type: ignore[attr-defined]
            finally:
                self.hold.close()
