"""The P/D flow of one completion: check the request, the prefill hop, the decode hop, and
one failover to another instance when a hop fails before the client got anything."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Coroutine
from typing import Any

import httpx
from starlette.requests import Request
from starlette.responses import Response

from kvbridge.errors import RequestError
from kvbridge.limits import decode_json_body, read_json_body
from kvbridge.openai.schemas import check_request
from kvbridge.proxy.engine_client import (
    DEFAULT_TIMEOUT,
    Deadline,
    EngineClient,
    dumps,
    proxy_error,
    transport_error,
    upstream_reason,
)
from kvbridge.proxy.first_token import FirstTokenStream, first_token
from kvbridge.proxy.metrics import ProxyMetrics
from kvbridge.proxy.relay import UpstreamResponse
from kvbridge.proxy.release import Hold, Releaser
from kvbridge.proxy.rewrite import CHAT, engine_headers, prefill_body
from kvbridge.proxy.routing import Backend, Router
from kvbridge.proxy.upstream import never_reached, send_retrying_once
from kvbridge.requestid import MAX_REQUEST_ID, accept_request_id

__all__ = ["Flow", "Retry"]

log = logging.getLogger(__name__)

# A decode that cannot be reached or dropped the connection: retried on another one.
DEAD_DECODE = (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError,
               httpx.ReadError, httpx.WriteError)
RETRY_DECODE_STATUS = frozenset({502, 503})


@dataclasses.dataclass(frozen=True)
class Retry:
    """A hop's error that another instance may not have: the request is tried once more
    elsewhere, and this error is the client's if there is no elsewhere."""

    error: Response


class Flow:
    def __init__(self, router: Router, engines: EngineClient, metrics: ProxyMetrics,
                 releaser: Releaser, prefill_timeout: float | None = None,
                 first_token_from: str = "prefill") -> None:
        self.router = router
        self.first_token_from = first_token_from
        self.engines = engines
        self.metrics = metrics
        self.releaser = releaser
        self.prefill_timeout = prefill_timeout

    def endpoint(self, endpoint: str) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        """The route handler of ``endpoint`` (completions or chat completions)."""
        async def handle(request: Request) -> Response:
            response = await self.handle(request, endpoint)
            self.metrics.requests.labels(endpoint, str(response.status_code)).inc()
            return response

        return handle

    async def handle(self, request: Request, endpoint: str) -> Response:
        try:
            # Decoded as strictly as the engines decode it: nothing the proxy could not
            # encode again for them (a lone surrogate, NaN) gets past this point.
            body = decode_json_body(await read_json_body(request))
        except RequestError as e:
            return proxy_error(e.status, e.message, e.type, e.param, e.code)
        if not isinstance(body, dict):
            return proxy_error(400, "request body must be a JSON object", "invalid_request_error")
        try:
            # The decode's own checks, now: a request it would refuse must not make a
            # prefill compute and hold KV (the client's kv_transfer_params are replaced).
            check_request({**body, "kv_transfer_params": None}, chat=endpoint == CHAT)
        except RequestError as e:
            return proxy_error(e.status, e.message, e.type, e.param, e.code)
        request_id, refused_id = accept_request_id(request.headers.get("x-request-id"))
        if refused_id is not None:
            log.info("request %s: the client's x-request-id %s is not used (at most %d "
                     "characters of [A-Za-z0-9._:@+=-])", request_id, refused_id,
                     MAX_REQUEST_ID)
        headers = engine_headers(request, request_id)
        # Failover: a prefill that fails before the decode hop, or a decode that fails
        # before its first token, is retried once on another instance.
        failed_p: set[str] = set()
        failed_d: set[str] = set()
        error: Response | None = None
        for attempt in (0, 1):
            pair = self.router.pick_pair(failed_p, failed_d)
            if pair is None:
                break
            if attempt:
                self.metrics.failovers.labels("prefill" if failed_p else "decode").inc()
                # The engines' own ids are unique per request: this label only tells
                # the retry apart in their logs.
                headers = {**headers, "x-request-id": f"{request_id}-retry"}
            p, d = pair
            hop = await self.prefill_hop(p, body, endpoint, headers, request_id)
            if isinstance(hop, Response):
                return hop  # the engine refused the request: not the engine's fault
            if isinstance(hop, Retry):
                error = hop.error
                failed_p.add(p.url)
                continue
            kv_params, decode_body, pdata = hop
            # The prefill now holds the prompt's blocks: released on every way out of here
            # (a failed decode hop, an exception, a cancellation) unless a decode has them
            # or the streamed answer took the hold over.
            hold = Hold(self.releaser, p.url, kv_params, request_id)
            try:
                if self.first_token_from == "prefill" and (
                        ft := first_token(body, pdata, kv_params, endpoint)) is not None:
                    return FirstTokenStream(self, p, d, ft, hold.pass_on(), decode_body,
                                            endpoint, headers, request_id).response()
                answer = await self.decode_hop(p, d, hold, decode_body, endpoint, headers,
                                               request_id, last=attempt == 1)
            finally:
                hold.close()
            if not isinstance(answer, Retry):
                return answer
            error = answer.error
            failed_d.add(d.url)
        return error or proxy_error(503, "no compatible prefill and decode instances are "
                                         "available", "service_unavailable")

    async def prefill_hop(
        self, p: Backend, body: dict[str, Any], endpoint: str, headers: dict[str, str],
        request_id: str
    ) -> Response | Retry | tuple[Any, dict[str, Any], dict[str, Any]]:
        """(kv_params, decode body, the prefill's answer), or the error for the client:
        final as a Response, worth one more try elsewhere as a ``Retry``."""
        prefill = p.url
        client = self.engines.http
        release = self.router.acquire(p)
        timeout = self.engines.timeout
        preq = client.build_request(
            "POST", prefill + endpoint, content=dumps(prefill_body(body, endpoint)),
            headers=headers,
            timeout=timeout if self.prefill_timeout is None
            else httpx.Timeout(self.prefill_timeout, connect=timeout.connect),
        )
        # The whole hop, its one resend included: each read's timeout alone lets a prefill
        # that trickles a byte at a time hold the request for ever.
        total = self.prefill_timeout or timeout.read or DEFAULT_TIMEOUT
        flag = "--prefill-timeout" if self.prefill_timeout is not None else "--timeout"
        try:
            with self.metrics.prefill_seconds.time():
                async with Deadline(total, f"no whole answer within {total:g}s ({flag})"):
                    presp = await send_retrying_once(client, preq, send=self.engines.read)
        except httpx.HTTPError as exc:
            log.warning("request %s: prefill %s failed: %r", request_id, prefill, exc)
            self.metrics.upstream_errors.labels("prefill").inc()
            if self.prefill_timeout is not None and isinstance(
                    exc, httpx.TimeoutException) and not isinstance(exc, httpx.ConnectTimeout):
                # Not answered within --prefill-timeout: another prefill may answer in time.
                return Retry(proxy_error(504, f"prefill {prefill} did not answer within "
                                              f"{self.prefill_timeout:g}s (--prefill-timeout)",
                                         "timeout"))
            # A read timeout is a prefill still at work: retrying it elsewhere doubles the wait.
            retry = not isinstance(exc, httpx.TimeoutException) or isinstance(
                exc, httpx.ConnectTimeout)
            if retry:
                self.router.failed(p)
            error = transport_error("prefill", prefill, exc)
            return Retry(error) if retry else error
        finally:
            release()
        if not presp.is_success:
            message, etype, param, code = upstream_reason(presp)
            log.warning("request %s: prefill %s returned %d: %s", request_id, prefill,
                        presp.status_code, message)
            # Pass the engine's own status on, except a 1xx/3xx which a client can't act on.
            status = presp.status_code if presp.status_code >= 400 else 502
            if status >= 500:
                self.router.failed(p)
            error = proxy_error(status, f"prefill {prefill} returned {presp.status_code}: "
                                        f"{message}", etype or "upstream_error", param, code)
            return Retry(error) if status >= 500 else error
        try:
            pdata = presp.json()
        except ValueError:
            pdata = None
        if not isinstance(pdata, dict):
            return Retry(proxy_error(502, f"prefill {prefill} returned a body that is not a "
                                          "JSON object"))
        self.router.succeeded(p)

        decode_body = dict(body)
        kv_params = pdata.get("kv_transfer_params")
        if kv_params is None:
            # Still served correctly, but the decode recomputes the prompt: no disaggregation.
            log.warning("request %s: prefill %s returned no kv_transfer_params; decode will "
                        "prefill locally", request_id, prefill)
            decode_body.pop("kv_transfer_params", None)
        else:
            decode_body["kv_transfer_params"] = kv_params
        return kv_params, decode_body, pdata

    async def decode_hop(
        self, p: Backend, d: Backend, hold: Hold, decode_body: dict[str, Any],
        endpoint: str, headers: dict[str, str], request_id: str, last: bool
    ) -> Response | Retry:
        """The response for the client, or (unless ``last``) the error of a decode that
        failed before its first token as a ``Retry``. ``hold`` is handed over when the
        decode has (or may still read) the prefill's blocks; the caller releases it
        otherwise."""
        decode = d.url
        client = self.engines.http
        release = self.router.acquire(d)
        dreq = client.build_request(
            "POST", decode + endpoint, content=dumps(decode_body), headers=headers
        )
        # Its answer's head and first chunk within --timeout in all, not per read.
        first_byte = self.engines.first_byte()
        try:
            async with first_byte:
                dresp = await send_retrying_once(client, dreq, stream=True)
        except httpx.HTTPError as exc:
            release()
            log.warning("request %s: decode %s failed: %r", request_id, decode, exc)
            self.metrics.upstream_errors.labels("decode").inc()
            dead = isinstance(exc, DEAD_DECODE)
            if dead:
                self.router.failed(d)
            if not (dead or never_reached(exc)):
                hold.handed_over()  # a decode still at work may read the blocks yet
            response = transport_error("decode", decode, exc)
            return Retry(response) if dead and not last else response
        if dresp.status_code >= 400:
            # The decode answered with an error before its first token: its load (if it
            # started one) is over, and nobody will read the prefill's blocks (released).
            if dresp.status_code in RETRY_DECODE_STATUS and not last:
                self.router.failed(d)
                await dresp.aclose()
                release()
                return Retry(proxy_error(502, f"decode {decode} returned {dresp.status_code}"))
            return UpstreamResponse(dresp, decode, request_id, on_close=release)
        chunks = dresp.aiter_bytes()
        try:
            async with first_byte:
                first = await chunks.__anext__()
        except StopAsyncIteration:
            first = b""
        except httpx.HTTPError as exc:  # died before its first token
            await dresp.aclose()
            release()
            log.warning("request %s: decode %s failed before its first token: %r",
                        request_id, decode, exc)
            self.metrics.upstream_errors.labels("decode").inc()
            self.router.failed(d)
            response = transport_error("decode", decode, exc)
            return response if last else Retry(response)
        hold.handed_over()  # its first token: the decode has read the prefill's blocks
        self.router.succeeded(d)
        return UpstreamResponse(dresp, decode, request_id, first, chunks, on_close=release)
