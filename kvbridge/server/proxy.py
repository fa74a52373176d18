"""OpenAI-compatible prefill/decode (P/D) proxy.

For each completion request the proxy asks a prefill instance for one token with
``kv_transfer_params.do_remote_decode`` set, then sends the original request to a decode
instance with the ``kv_transfer_params`` the prefill returned, so the decode pulls the KV
cache over NIXL instead of recomputing it. Field names follow vLLM's disaggregated proxy so
vLLM-style engines work unchanged.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import json
import logging
import ssl
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import anyio
import certifi
import httpx
import uvicorn
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from kvbridge import background
from kvbridge.errors import ConfigError, RequestError, error_body
from kvbridge.guard import ConnectionBudget, GuardCollector, GuardedServer, guarded_config
from kvbridge.limits import read_json_body
from kvbridge.params import KVTransferParams
from kvbridge.requestid import MAX_REQUEST_ID, accept_request_id
from kvbridge.server.api import check_request_body
from kvbridge.server.routing import Backend, Router
from kvbridge.server.upstream import CLIENT_KEEP_ALIVE, never_reached, send_retrying_once
from kvbridge.settings import DEFAULT_HOST

if TYPE_CHECKING:  # the registry needs the ``fleet`` extra: imported only when used
    from kvbridge.registry.etcd import EtcdEndpoint
    from kvbridge.server.membership import Membership

__all__ = [
    "DEFAULT_CONNECT_TIMEOUT",
    "DEFAULT_TIMEOUT",
    "build_proxy_app",
    "run_proxy",
]

log = logging.getLogger(__name__)

PREWARM_WINDOW = 300.0  # seconds the proxy keeps trying to reach engines that are starting

# Read/write timeout per operation: a long prompt's prefill or a long non-streamed generation
# sends nothing until it is done, so this is generous; connecting should be quick.
DEFAULT_TIMEOUT = 300.0
DEFAULT_CONNECT_TIMEOUT = 10.0
_HEALTH_TIMEOUT = 5.0

# A decode that cannot be reached or dropped the connection: retried on another one.
_DEAD_DECODE = (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError,
                httpx.ReadError, httpx.WriteError)
_RETRY_DECODE_STATUS = frozenset({502, 503})

_COMPLETIONS = "/v1/completions"
_CHAT = "/v1/chat/completions"

# Per-hop headers, and ones we set ourselves, are not relayed from the decode to the client.
_DROP_HEADERS = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "content-length",
        "content-encoding",
        "date",
        "server",
        "x-request-id",
    }
)


def _error(
    status: int, message: str, err_type: str = "upstream_error", param: Any = None
) -> JSONResponse:
    """An OpenAI-shaped error response (``code`` carries the status, as vLLM does)."""
    return JSONResponse(error_body(message, err_type, param, status), status_code=status)


def _dumps(obj: Any) -> bytes:
    # Our own encoding rather than httpx's json=, which rejects NaN that json.loads accepted.
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()


def _upstream_reason(resp: httpx.Response) -> tuple[str, str | None, Any]:
    """(message, type, param) of an engine's error reply, whatever shape it has."""
    try:
        data = resp.json()
    except ValueError:
        data = None
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict) and "message" in err:
            etype = err.get("type")
            return str(err["message"]), etype if isinstance(etype, str) else None, err.get("param")
        for key in ("message", "detail", "error"):
            if isinstance(data.get(key), str):
                return data[key], None, None
    text = resp.text.strip()[:1000]
    return text or resp.reason_phrase or "no reason given", None, None


def _transport_error(role: str, url: str, exc: httpx.HTTPError) -> JSONResponse:
    """502/504 for an engine that could not be reached or did not answer in time."""
    detail = str(exc) or type(exc).__name__
    if isinstance(exc, httpx.TimeoutException):
        return _error(504, f"{role} {url} timed out ({type(exc).__name__}): {detail}", "timeout")
    return _error(502, f"{role} {url} unreachable ({type(exc).__name__}): {detail}")


def _prefill_body(body: dict[str, Any], endpoint: str) -> dict[str, Any]:
    """The client's request, cut down to a one-token, non-streamed prefill."""
    out = dict(body)
    out["max_tokens"] = 1
    if endpoint == _CHAT and "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out["stream"] = False
    # vLLM rejects stream_options without stream, and min_tokens above max_tokens.
    out.pop("stream_options", None)
    out.pop("min_tokens", None)
    out["kv_transfer_params"] = KVTransferParams.for_prefill()
    return out


def _ssl_context(
    ca_certs: str | None, client_cert: tuple[str, str] | None
) -> ssl.SSLContext | bool:
    """Verification settings for https engines; files are read now so mistakes fail at start."""
    if ca_certs is None and client_cert is None:
        return True  # httpx's default: verify against certifi's bundle
    try:
        ctx = ssl.create_default_context(cafile=ca_certs or certifi.where())
        if client_cert is not None:
            certfile, keyfile = client_cert
            ctx.load_cert_chain(certfile, keyfile)
    except (OSError, ssl.SSLError, ValueError) as exc:
        raise ConfigError(f"cannot load TLS files for the proxy's engine client: {exc}") from exc
    return ctx


def _check_urls(role: str, urls: Sequence[str], allow_none: bool = False) -> list[str]:
    if isinstance(urls, str) or not (urls or allow_none):
        raise ConfigError(f"the proxy needs a list of at least one {role} URL (or --registry)")
    out = []
    for url in urls:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ConfigError(f"bad {role} URL {url!r}: expected http(s)://host:port")
        out.append(url.rstrip("/"))
    return out


@dataclasses.dataclass(frozen=True)
class _Retry:
    """A hop's error that another instance may not have: the request is tried once more
    elsewhere, and this error is the client's if there is no elsewhere."""

    error: Response


class _UpstreamResponse(StreamingResponse):
    """Relays an engine's streamed response as it arrives and always closes it afterwards,
    also when the client goes away mid-stream (else the engine keeps generating)."""

    def __init__(self, upstream: httpx.Response, url: str, request_id: str,
                 first: bytes | None = None, chunks: AsyncIterator[bytes] | None = None,
                 on_close: Callable[[], None] | None = None) -> None:
        headers = {k: v for k, v in upstream.headers.items() if k.lower() not in _DROP_HEADERS}
        headers["x-request-id"] = request_id
        super().__init__(
            self._relay(upstream, url, first, chunks), status_code=upstream.status_code,
            headers=headers
        )
        self._upstream = upstream
        self._on_close = on_close

    @staticmethod
    async def _relay(upstream: httpx.Response, url: str, first: bytes | None,
                     chunks: AsyncIterator[bytes] | None) -> AsyncIterator[bytes]:
        try:
            if first:  # read ahead to know the decode was alive at its first token
                yield first
            async for chunk in chunks or upstream.aiter_bytes():
                yield chunk
        except httpx.HTTPError as exc:
            # The status is already sent; aborting the connection tells the client it's cut.
            log.error("decode %s failed mid-response: %r", url, exc)
            raise

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self._upstream.aclose()
            if self._on_close is not None:
                self._on_close()


class _Proxy:
    def __init__(
        self,
        router: Router,
        verify: ssl.SSLContext | bool,
        timeout: httpx.Timeout,
        prewarm: bool = True,
        kv_token: str | None = None,
        prefill_timeout: float | None = None,
    ) -> None:
        self.router = router
        self.prefill_timeout = prefill_timeout
        self.prewarm = prewarm
        self.kv_token = kv_token
        # (prefill url, decode url) -> "ok" or the reason it failed; filled in the background
        self.prewarmed: dict[tuple[str, str], str] = {}
        self.prewarm_done = asyncio.Event()
        r = self.registry = CollectorRegistry()
        self.requests = Counter("kvbridge_proxy_requests", "Client requests by route and status",
                                ["route", "status"], registry=r)
        self.prefill_seconds = Histogram("kvbridge_proxy_prefill_seconds",
                                         "Duration of the prefill hop", registry=r)
        self.upstream_errors = Counter("kvbridge_proxy_upstream_errors",
                                       "Engines that could not be reached, by hop", ["stage"],
                                       registry=r)
        self.prewarm_failures = Counter(
            "kvbridge_proxy_prewarm_failures",
            "Decode/prefill pairs whose prewarm failed, by reason", ["reason"], registry=r)
        r.register(GuardCollector())  # the proxy server's connection budget
        r.register(background.BackgroundCollector())
        self.releases = Counter("kvbridge_proxy_kv_releases",
                                "Prefill holds released after a failed decode hop, by outcome",
                                ["outcome"], registry=r)
        self.failovers = Counter("kvbridge_proxy_failovers",
                                 "Requests retried on another instance, by failed hop",
                                 ["stage"], registry=r)
        self._tasks: set[asyncio.Task] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self.membership: Membership | None = None
        self._verify = verify
        self._timeout = timeout
        self._client: httpx.AsyncClient | None = None

    @property
    def prefill_urls(self) -> list[str]:
        return self.router.urls("prefill")

    @property
    def decode_urls(self) -> list[str]:
        return self.router.urls("decode")

    def backend_added(self, backend: Backend) -> None:
        """A new instance (from the registry): prewarm its pairs, from any thread."""
        if self.prewarm and self._loop is not None:
            self._loop.call_soon_threadsafe(self._prewarm_new, backend)

    def _prewarm_new(self, backend: Backend) -> None:
        others = self.router.backends("decode" if backend.serves("prefill") else "prefill")
        pairs = [(backend.url, o.url) if backend.serves("prefill") else (o.url, backend.url)
                 for o in others if o.compatible(backend) and o.url != backend.url]
        for p, d in pairs:
            task = asyncio.create_task(self._prewarm_pair(p, d))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def fleet(self, request: Request) -> Response:
        view = self.router.view()
        if (m := self.membership) is not None:
            view["registry"] = {"url": m.registry.endpoint.url, "connected": m.connected.is_set(),
                                "reads": m.registry.reads, "writes": m.registry.writes,
                                "events": m.events}
        view["background_down"] = background.down()  # supervised threads waiting to restart
        return JSONResponse(view)

    @property
    def client(self) -> httpx.AsyncClient:
        # Normally opened by the lifespan; opened here too if the app is served without one.
        if self._client is None:
            self._client = self._new_client()
        return self._client

    def _new_client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(
            verify=self._verify,
            timeout=self._timeout,
            # Streams can be long-lived: don't make requests queue for a pool slot.
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=100,
                                keepalive_expiry=CLIENT_KEEP_ALIVE),
            # Engines are internal: don't route them through HTTP(S)_PROXY from the environment.
            trust_env=False,
        )

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        self._client = self._new_client()
        self._loop = asyncio.get_running_loop()
        task = asyncio.create_task(self._prewarm_all()) if self.prewarm else None
        if self.membership is not None:
            self.membership.start()
            # Serve with the registry's view when it answers soon; else start empty.
            await asyncio.to_thread(self.membership.synced.wait, _HEALTH_TIMEOUT)
        try:
            yield
        finally:
            if task is not None:
                task.cancel()
            self._loop = None
            if self.membership is not None:
                await asyncio.to_thread(self.membership.close)
            if self._tasks:  # releases under way: let them reach the prefills
                await asyncio.wait(self._tasks, timeout=_HEALTH_TIMEOUT)
            client, self._client = self._client, None
            if client is not None:
                await client.aclose()

    async def _prewarm_all(self) -> None:
        """Tell every decode to handshake with every prefill now, so that no client
        request pays for it. Engines still starting are retried for ``PREWARM_WINDOW``
        seconds; engines that do not offer it (4xx) are skipped."""
        try:
            await asyncio.gather(*(self._prewarm_pair(p, d) for p in self.prefill_urls
                                   for d in self.decode_urls))
        finally:
            self.prewarm_done.set()

    async def _prewarm_pair(self, p_url: str, d_url: str) -> None:
        deadline = asyncio.get_running_loop().time() + PREWARM_WINDOW
        headers = {"authorization": f"Bearer {self.kv_token}"} if self.kv_token else {}
        delay = 0.2
        while True:
            try:
                r = await self.client.get(p_url + "/v1/kv/info")
                if r.status_code == 404:  # a vLLM engine: no prewarm route, so warm up
                    r = await self._warm_up(p_url, d_url)
                elif r.status_code == 200:
                    info = r.json()
                    body = {"host": info["side_channel_host"],
                            "port": info["side_channel_port"],
                            "method": info["handshake_method"], "wait": True}
                    r = await self.client.post(d_url + "/v1/kv/prewarm", json=body,
                                               headers=headers)
                outcome = "ok" if r.status_code == 200 else f"{r.status_code}: {r.text[:200]}"
                if r.status_code < 500:
                    break  # done, or refused for good (no such route, wrong token)
            except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as e:
                outcome = f"{type(e).__name__}: {e}"
            if asyncio.get_running_loop().time() + delay > deadline:
                break
            await asyncio.sleep(delay)  # an engine still starting: try again shortly
            delay = min(2 * delay, 2.0)
        self.prewarmed[(p_url, d_url)] = outcome
        if outcome.startswith(("401", "403")):
            # The decodes require the side-channel token and we have none (or another):
            # every first request to each pair will pay for the handshake. Say so loudly.
            self.prewarm_failures.labels("unauthorized").inc()
            log.error("prewarm of %s with %s refused (%s): give the proxy the side-channel "
                      "token (--kv-token-file)", d_url, p_url, outcome)
        elif outcome != "ok":
            self.prewarm_failures.labels("other").inc()
            log.warning("prewarm of %s with %s: %s", d_url, p_url, outcome)

    async def _warm_up(self, p_url: str, d_url: str) -> httpx.Response:
        """A one-token P/D request through the pair: how an engine without kvbridge's
        prewarm route (vLLM, with or without the plug-in) handshakes before any client
        request does. The prefill's blocks are read and freed as for any request."""
        r = await self.client.get(p_url + "/v1/models")
        if r.status_code != 200:
            return r
        body = {"model": r.json()["data"][0]["id"], "prompt": "Hello", "max_tokens": 1,
                "temperature": 0}
        r = await self.client.post(p_url + _COMPLETIONS, content=_dumps(
            _prefill_body(body, _COMPLETIONS)), headers={"content-type": "application/json"})
        if r.status_code != 200:
            return r
        body["kv_transfer_params"] = r.json().get("kv_transfer_params")
        return await self.client.post(d_url + _COMPLETIONS, content=_dumps(body),
                                      headers={"content-type": "application/json"})

    async def prewarm_status(self, request: Request) -> Response:
        return JSONResponse({"done": self.prewarm_done.is_set(), "pairs": [
            {"prefill": p, "decode": d, "outcome": o} for (p, d), o in self.prewarmed.items()]})

    @staticmethod
    def _engine_headers(request: Request, request_id: str) -> dict[str, str]:
        headers = {
            "content-type": "application/json",
            "x-request-id": request_id,
            # Relayed bodies are passed through as bytes; keep them uncompressed.
            "accept-encoding": "identity",
        }
        auth = request.headers.get("authorization")
        if auth is not None:
            headers["authorization"] = auth
        return headers

    def completions_endpoint(
        self, endpoint: str
    ) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        async def handle(request: Request) -> Response:
            response = await self._handle_completion(request, endpoint)
            self.requests.labels(endpoint, str(response.status_code)).inc()
            return response

        return handle

    async def metrics(self, request: Request) -> Response:
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)

    async def _handle_completion(self, request: Request, endpoint: str) -> Response:
        try:
            body = json.loads(await read_json_body(request))
        except RequestError as e:
            return _error(e.status, e.message, e.type, e.param)
        except (ValueError, UnicodeDecodeError):
            return _error(400, "request body is not valid JSON", "invalid_request_error")
        if not isinstance(body, dict):
            return _error(400, "request body must be a JSON object", "invalid_request_error")
        try:
            # The decode's own checks, now: a request it would refuse must not make a
            # prefill compute and hold KV (the client's kv_transfer_params are replaced).
            check_request_body(_dumps({**body, "kv_transfer_params": None}),
                               chat=endpoint == _CHAT)
        except RequestError as e:
            return _error(e.status, e.message, e.type, e.param)
        request_id, refused_id = accept_request_id(request.headers.get("x-request-id"))
        if refused_id is not None:
            log.info("request %s: the client's x-request-id %s is not used (at most %d "
                     "characters of [A-Za-z0-9._:@+=-])", request_id, refused_id,
                     MAX_REQUEST_ID)
        headers = self._engine_headers(request, request_id)
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
                self.failovers.labels("prefill" if failed_p else "decode").inc()
                # The engines may still hold the first attempt under the client's id (its
                # release is on its way): the retry goes under an id of its own.
                headers = {**headers, "x-request-id": f"{request_id}-retry"}
            p, d = pair
            hop = await self._prefill_hop(p, body, endpoint, headers, request_id)
            if isinstance(hop, Response):
                return hop  # the engine refused the request: not the engine's fault
            if isinstance(hop, _Retry):
                error = hop.error
                failed_p.add(p.url)
                continue
            kv_params, decode_body = hop
            answer = await self._decode_hop(p, d, kv_params, decode_body, endpoint, headers,
                                            request_id, last=attempt == 1)
            if not isinstance(answer, _Retry):
                return answer
            error = answer.error
            failed_d.add(d.url)
        return error or _error(503, "no compatible prefill and decode instances are "
                                    "available", "service_unavailable")

    async def _prefill_hop(
        self, p: Backend, body: dict[str, Any], endpoint: str, headers: dict[str, str],
        request_id: str
    ) -> Response | _Retry | tuple[Any, dict[str, Any]]:
        """(kv_params, decode body), or the error for the client: final as a Response,
        worth one more try elsewhere as a ``_Retry``."""
        prefill = p.url
        release = self.router.acquire(p)
        preq = self.client.build_request(
            "POST", prefill + endpoint, content=_dumps(_prefill_body(body, endpoint)),
            headers=headers,
            timeout=self._timeout if self.prefill_timeout is None
            else httpx.Timeout(self.prefill_timeout, connect=self._timeout.connect),
        )
        try:
            with self.prefill_seconds.time():
                presp = await send_retrying_once(self.client, preq)
        except httpx.HTTPError as exc:
            log.warning("request %s: prefill %s failed: %r", request_id, prefill, exc)
            self.upstream_errors.labels("prefill").inc()
            if self.prefill_timeout is not None and isinstance(
                    exc, httpx.TimeoutException) and not isinstance(exc, httpx.ConnectTimeout):
                # Not answered within --prefill-timeout: another prefill may answer in time.
                return _Retry(_error(504, f"prefill {prefill} did not answer within "
                                          f"{self.prefill_timeout:g}s (--prefill-timeout)",
                                     "timeout"))
            # A read timeout is a prefill still at work: retrying it elsewhere doubles the wait.
            retry = not isinstance(exc, httpx.TimeoutException) or isinstance(
                exc, httpx.ConnectTimeout)
            if retry:
                self.router.failed(p)
            error = _transport_error("prefill", prefill, exc)
            return _Retry(error) if retry else error
        finally:
            release()
        if not presp.is_success:
            message, etype, param = _upstream_reason(presp)
            log.warning(
                "request %s: prefill %s returned %d: %s",
                request_id,
                prefill,
                presp.status_code,
                message,
            )
            # Pass the engine's own status on, except a 1xx/3xx which a client can't act on.
            status = presp.status_code if presp.status_code >= 400 else 502
            if status >= 500:
                self.router.failed(p)
            error = _error(
                status,
                f"prefill {prefill} returned {presp.status_code}: {message}",
                etype or "upstream_error",
                param,
            )
            return _Retry(error) if status >= 500 else error
        try:
            pdata = presp.json()
        except ValueError:
            pdata = None
        if not isinstance(pdata, dict):
            return _Retry(_error(502, f"prefill {prefill} returned a body that is not a "
                                      "JSON object"))
        self.router.succeeded(p)

        decode_body = dict(body)
        kv_params = pdata.get("kv_transfer_params")
        if kv_params is None:
            # Still served correctly, but the decode recomputes the prompt: no disaggregation.
            log.warning(
                "request %s: prefill %s returned no kv_transfer_params; decode will prefill locally",
                request_id,
                prefill,
            )
            decode_body.pop("kv_transfer_params", None)
        else:
            decode_body["kv_transfer_params"] = kv_params
        return kv_params, decode_body

    async def _decode_hop(
        self, p: Backend, d: Backend, kv_params: Any, decode_body: dict[str, Any],
        endpoint: str, headers: dict[str, str], request_id: str, last: bool
    ) -> Response | _Retry:
        """The response for the client, or (unless ``last``) the error of a decode that
        failed before its first token, the prefill's hold released, as a ``_Retry``."""
        decode, prefill = d.url, p.url
        release = self.router.acquire(d)
        dreq = self.client.build_request(
            "POST", decode + endpoint, content=_dumps(decode_body), headers=headers
        )
        try:
            dresp = await send_retrying_once(self.client, dreq, stream=True)
        except httpx.HTTPError as exc:
            release()
            log.warning("request %s: decode %s failed: %r", request_id, decode, exc)
            self.upstream_errors.labels("decode").inc()
            dead = isinstance(exc, _DEAD_DECODE)
            if dead:
                self.router.failed(d)
            if kv_params is not None and (dead or never_reached(exc)):
                self._release_later(prefill, kv_params, request_id)
            response = _transport_error("decode", decode, exc)
            return _Retry(response) if dead and not last else response
        if dresp.status_code >= 400:
            if kv_params is not None:
                # The decode answered with an error before its first token: its load (if
                # it started one) is over, and nobody will read the prefill's blocks.
                self._release_later(prefill, kv_params, request_id)
            if dresp.status_code in _RETRY_DECODE_STATUS and not last:
                self.router.failed(d)
                await dresp.aclose()
                release()
                return _Retry(_error(502, f"decode {decode} returned {dresp.status_code}"))
            return _UpstreamResponse(dresp, decode, request_id, on_close=release)
        chunks = dresp.aiter_bytes()
        try:
            first = await chunks.__anext__()
        except StopAsyncIteration:
            first = b""
        except httpx.HTTPError as exc:  # died before its first token
            await dresp.aclose()
            release()
            log.warning("request %s: decode %s failed before its first token: %r",
                        request_id, decode, exc)
            self.upstream_errors.labels("decode").inc()
            self.router.failed(d)
            if kv_params is not None:
                self._release_later(prefill, kv_params, request_id)
            response = _transport_error("decode", decode, exc)
            return response if last else _Retry(response)
        self.router.succeeded(d)
        return _UpstreamResponse(dresp, decode, request_id, first, chunks, on_close=release)

    def _release_later(self, prefill: str, kv_params: Any, request_id: str) -> None:
        task = asyncio.create_task(self._release(prefill, kv_params, request_id))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _release(self, prefill: str, kv_params: Any, request_id: str) -> None:
        """Tell the prefill to free the request's held blocks now rather than at the end
        of their lease (best effort: the lease still bounds them if this fails)."""
        headers = {"authorization": f"Bearer {self.kv_token}"} if self.kv_token else {}
        try:
            r = await self.client.post(prefill + "/v1/kv/release", content=_dumps(kv_params),
                                       headers={**headers, "content-type": "application/json"},
                                       timeout=_HEALTH_TIMEOUT)
            outcome = "ok" if r.status_code == 200 else str(r.status_code)
        except httpx.HTTPError as exc:
            outcome = type(exc).__name__
        self.releases.labels(outcome).inc()
        if outcome != "ok":
            log.warning("request %s: releasing its blocks on %s failed: %s", request_id,
                        prefill, outcome)

    async def models(self, request: Request) -> Response:
        if not self.decode_urls:
            return _error(503, "no decode instance is known yet", "service_unavailable")
        url = self.decode_urls[0]
        headers = {}
        if (auth := request.headers.get("authorization")) is not None:
            headers["authorization"] = auth
        try:
            resp = await self.client.get(url + "/v1/models", headers=headers)
        except httpx.HTTPError as exc:
            return _transport_error("decode", url, exc)
        return Response(
            resp.content,
            status_code=resp.status_code,
            media_type=resp.headers.get("content-type", "application/json"),
        )

    async def health(self, request: Request) -> Response:
        if stopped := background.down():
            return JSONResponse({"status": "degraded", "background_down": stopped},
                                status_code=503)
        return JSONResponse({"status": "ok"})

    async def _probe(self, url: str) -> dict[str, Any]:
        try:
            resp = await self.client.get(url + "/health", timeout=_HEALTH_TIMEOUT)
        except httpx.HTTPError as exc:
            return {"url": url, "ok": False, "status": None, "error": repr(exc)}
        return {"url": url, "ok": resp.is_success, "status": resp.status_code, "error": None}

    async def backends_health(self, request: Request) -> Response:
        results = await asyncio.gather(
            *(self._probe(u) for u in self.prefill_urls + self.decode_urls)
        )
        n = len(self.prefill_urls)
        healthy = all(r["ok"] for r in results)
        body = {
            "status": "ok" if healthy else "degraded",
            "prefill": results[:n],
            "decode": results[n:],
        }
        return JSONResponse(body, status_code=200 if healthy else 503)


ADMIN_ROUTES = ("off", "token", "open")


def admin_modes(admin_routes: str | None, metrics_route: str | None,
                admin_token: str | None) -> tuple[str, str]:
    """(admin routes, /metrics) modes: ``off`` (not served), ``token`` (served behind
    ``Authorization: Bearer <admin_token>``) or ``open``. Unset: ``token`` when an admin
    token is given, else ``off``; ``/metrics`` follows the admin routes unless set."""
    admin = admin_routes or ("token" if admin_token is not None else "off")
    metrics = metrics_route or admin
    for what, mode in (("admin routes", admin), ("metrics route", metrics)):
        if mode not in ADMIN_ROUTES:
            raise ConfigError(f"{what} {mode!r}: use one of {', '.join(ADMIN_ROUTES)}")
        if mode == "token" and admin_token is None:
            raise ConfigError(f"{what} 'token' needs an admin token (--admin-token-file)")
    return admin, metrics


def _admin_only(handler: Callable[[Request], Coroutine[Any, Any, Response]],
                token: str) -> Callable[[Request], Coroutine[Any, Any, Response]]:
    """``handler`` behind ``Authorization: Bearer <token>``."""

    async def guarded(request: Request) -> Response:
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.encode(),
                                                                 token.encode()):
            return _error(401, "this route needs the proxy's admin token (--admin-token-file)",
                          "authentication_error")
        return await handler(request)

    return guarded


def build_proxy_app(
    prefill_urls: list[str],
    decode_urls: list[str],
    *,
    ca_certs: str | None = None,
    client_cert: tuple[str, str] | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
    prewarm: bool = True,
    kv_token: str | None = None,
    registry: EtcdEndpoint | None = None,
    routing: str = "least-outstanding",
    prefill_timeout: float | None = None,
    admin_token: str | None = None,
    admin_routes: str | None = None,
    metrics_route: str | None = None,
) -> Starlette:
    """The P/D proxy as a Starlette app.

    Engines come from the static lists and, with ``registry``, from watching etcd;
    ``routing`` picks among them (see ``kvbridge.server.routing``).

    ``ca_certs`` verifies https engines (default: certifi's bundle); ``client_cert`` is a
    (certfile, keyfile) pair presented for mTLS. ``timeout`` bounds each read/write towards an
    engine, ``connect_timeout`` each connection attempt. With ``prewarm`` the proxy tells
    every decode, at start-up, to handshake with every prefill (``kv_token``: the
    side-channel token the decodes require for that). ``prefill_timeout`` bounds the
    prefill hop alone (default: ``timeout``): past it the client gets a 504 saying so.

    The admin routes (``/v1/fleet``, ``/healthz/backends``, ``GET /v1/kv/prewarm``) are
    ``admin_routes``: ``"off"`` (not served), ``"token"`` (``Authorization: Bearer
    <admin_token>``) or ``"open"``; default ``"token"`` with an ``admin_token``, else
    ``"off"``. ``/metrics`` is ``metrics_route``, the same choices (default: as the admin
    routes).
    """
    router = Router(routing)
    router.add_static("prefill", _check_urls("prefill", prefill_urls, registry is not None))
    router.add_static("decode", _check_urls("decode", decode_urls, registry is not None))
    verify = _ssl_context(ca_certs, client_cert)
    proxy = _Proxy(
        router,
        verify,
        httpx.Timeout(timeout, connect=connect_timeout),
        prewarm,
        kv_token,
        prefill_timeout,
    )
    if registry is not None:
        from kvbridge.registry.etcd import EtcdRegistry
        from kvbridge.server.membership import Membership

        proxy.membership = Membership(EtcdRegistry(registry), router, verify=verify)
        router.on_added = proxy.backend_added
    routes = [
        Route(_COMPLETIONS, proxy.completions_endpoint(_COMPLETIONS), methods=["POST"]),
        Route(_CHAT, proxy.completions_endpoint(_CHAT), methods=["POST"]),
        Route("/v1/models", proxy.models, methods=["GET"]),
        Route("/health", proxy.health, methods=["GET"]),
    ]
    # What the fleet looks like, and the proxy's counters: for operators, not users.
    admin, metrics = admin_modes(admin_routes, metrics_route, admin_token)
    for mode, paths in ((admin, (("/healthz/backends", proxy.backends_health),
                                 ("/v1/kv/prewarm", proxy.prewarm_status),
                                 ("/v1/fleet", proxy.fleet))),
                        (metrics, (("/metrics", proxy.metrics),))):
        if mode != "off":
            routes += [Route(path, handler if mode == "open" or admin_token is None
                             else _admin_only(handler, admin_token), methods=["GET"])
                       for path, handler in paths]
    app = Starlette(routes=routes, lifespan=proxy.lifespan)
    app.state.proxy = proxy
    return app


def run_proxy(
    prefill_urls: list[str],
    decode_urls: list[str],
    *,
    host: str = DEFAULT_HOST,
    port: int = 8000,
    ca_certs: str | None = None,
    client_cert: tuple[str, str] | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
    ssl_certfile: str | None = None,
    ssl_keyfile: str | None = None,
    log_level: str = "info",
    prewarm: bool = True,
    kv_token: str | None = None,
    registry: EtcdEndpoint | None = None,
    routing: str = "least-outstanding",
    prefill_timeout: float | None = None,
    admin_token: str | None = None,
    admin_routes: str | None = None,
    metrics_route: str | None = None,
    budget: ConnectionBudget | None = None,
) -> None:
    """Serve the proxy with uvicorn until interrupted.

    ``ssl_certfile``/``ssl_keyfile`` make the proxy itself serve https to its clients.
    """
    app = build_proxy_app(
        prefill_urls,
        decode_urls,
        ca_certs=ca_certs,
        client_cert=client_cert,
        timeout=timeout,
        connect_timeout=connect_timeout,
        prewarm=prewarm,
        kv_token=kv_token,
        registry=registry,
        routing=routing,
        prefill_timeout=prefill_timeout,
        admin_token=admin_token,
        admin_routes=admin_routes,
        metrics_route=metrics_route,
    )
    scheme = "https" if ssl_certfile else "http"
    print(
        f"kvbridge proxy on {scheme}://{host}:{port} "
        f"prefill={','.join(prefill_urls)} decode={','.join(decode_urls)}"
        + (f" registry={registry.url} routing={routing}" if registry else ""),
        flush=True,
    )
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        ssl_certfile=ssl_certfile,
        ssl_keyfile=ssl_keyfile,
        **guarded_config("proxy", budget),
    )
    server = GuardedServer(config)
    server.run()
    if not server.started:
        raise SystemExit(3)  # as uvicorn.run: the server could not start
