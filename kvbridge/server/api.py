"""The OpenAI-compatible API of one engine instance (Starlette).

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with
``stream`` as server-sent events), ``GET /v1/models``, ``GET /health``.

Beyond OpenAI's fields, requests may carry ``kv_transfer_params`` (a dict,
passed to the KV connector), ``ignore_eos`` and an ``X-Request-Id`` header (the
request's label: the engine's own id is always unique, ``kvbridge.requestid``). A response carries the connector's ``kv_transfer_params``
as a top-level field when it returned some. Errors use OpenAI's shape
``{"error": {"message", "type", "param", "code"}}``: 4xx for bad input, 502
when the engine failed the request (e.g. remote KV could not be loaded under the
``fail`` policy), 503 when the engine is not running (``code`` a string or null: see
docs/protocol.md). The request schemas and their checks are ``kvbridge.openai.schemas``,
the response bodies and SSE chunks ``kvbridge.server.sse``.

    engine = AsyncEngine(build_engine(tp_size=2))
    run_server(build_app(engine, "tiny", shutdown_engine_on_exit=True), "0.0.0.0", 8000)
"""

from __future__ import annotations

import contextlib
import logging
import signal
import socket
import ssl
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

import msgspec
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from kvbridge import supervised
from kvbridge.engine.async_engine import AsyncEngine
from kvbridge.engine.sampling import SamplingParams
from kvbridge.errors import (
    InvalidKVTransferParams,
    KVBridgeError,
    LoadFailure,
    RequestError,
    failure_status,
    status_of,
)
from kvbridge.guard import ConnectionBudget, GuardedServer, guarded_config
from kvbridge.limits import read_json_body
from kvbridge.openai.responses import error_response
from kvbridge.openai.schemas import (
    DEFAULT_COMPLETION_MAX_TOKENS,
    ChatCompletionRequest,
    CommonRequest,
    CompletionRequest,
    chat_max_tokens,
    parse_request,
    sampling_settings,
)
from kvbridge.requestid import engine_request_ids
from kvbridge.server.sse import Formatter

__all__ = ["build_app", "run_server"]

log = logging.getLogger(__name__)

# -- the app -------------------------------------------------------------------------------

def build_app(engine_client: AsyncEngine, model_name: str, *,
              shutdown_engine_on_exit: bool = False, root: str | None = None) -> Starlette:
    """The API app over a running ``AsyncEngine``, serving it as model ``model_name``
    (``root``: what the name stands for, listed as vLLM does; default ``model_name``).

    With ``shutdown_engine_on_exit`` the engine (and its workers) stop when the
    app's lifespan ends.
    """
    api = _API(engine_client, model_name, root)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        if shutdown_engine_on_exit:
            engine_client.shutdown()

    return Starlette(routes=[
        Route("/v1/completions", _endpoint(api.completions), methods=["POST"]),
        Route("/v1/chat/completions", _endpoint(api.chat_completions), methods=["POST"]),
        Route("/v1/models", api.models, methods=["GET"]),
        Route("/health", api.health, methods=["GET"]),
    ], lifespan=lifespan)


def _endpoint(handler: Callable[[Request], Awaitable[Response]]
              ) -> Callable[[Request], Awaitable[Response]]:
    async def run(request: Request) -> Response:
        try:
            return await handler(request)
        except RequestError as e:
            return JSONResponse(e.body(), status_code=e.status)
        except KVBridgeError as e:  # e.g. EngineDeadError: 503, through the one table
            st = status_of(e)
            return error_response(st.status, str(e), type_=st.type, code=st.code)
    return run


class _API:
    def __init__(self, engine: AsyncEngine, model_name: str, root: str | None = None):
        self.engine = engine
        self.model_name = model_name
        self.root = root or model_name
        self.created = int(time.time())

    async def health(self, request: Request) -> Response:
        if not self.engine.is_running:
            return error_response(503, f"engine is not running: {self.engine.dead_reason}",
                                  type_="server_error", code="engine_not_running")
        if stopped := supervised.down():  # a supervised thread failed; restarting it
            return JSONResponse({"status": "degraded", "background_down": stopped},
                                status_code=503)
        return JSONResponse({"status": "ok"})

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": self.created,
            "owned_by": "kvbridge", "root": self.root, "parent": None,
            "max_model_len": self.engine.max_model_len}]})

    # A request refused with a 4xx does not release the prefill's hold its params name:
    # nothing proves the params are the caller's (any client could name another request's
    # hold). The proxy that got them from the prefill releases them (/v1/kv/release, with
    # the side-channel token); otherwise the hold's lease ends it.
    async def completions(self, request: Request) -> Response:
        req = parse_request(await read_json_body(request), chat=False)
        return await self._completions(request, req)

    async def chat_completions(self, request: Request) -> Response:
        req = parse_request(await read_json_body(request), chat=True)
        return await self._chat_completions(request, req)

    async def _completions(self, request: Request, req: CompletionRequest) -> Response:
        self._check_model(req.model)
        prompt_ids = self._prompt_ids(req.prompt)
        max_tokens = req.max_tokens if req.max_tokens is not None \
            else DEFAULT_COMPLETION_MAX_TOKENS
        sampling = _sampling(req, max_tokens, "max_tokens")
        return await self._respond(request, req, prompt_ids, sampling, "prompt", chat=False)

    async def _chat_completions(self, request: Request, req: ChatCompletionRequest) -> Response:
        self._check_model(req.model)
        messages = [{"role": m.role, "content": m.content} for m in req.messages]
        try:
            prompt_ids = self.engine.tokenizer.encode_chat(messages)
        except ValueError as e:
            raise RequestError(400, str(e), "messages") from None
        param, max_tokens = chat_max_tokens(req)
        if max_tokens is None:  # OpenAI chat: until the context is full
            max_tokens = max(1, self.engine.max_model_len - len(prompt_ids))
        sampling = _sampling(req, max_tokens, param)
        return await self._respond(request, req, prompt_ids, sampling, "messages", chat=True)

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise RequestError(404, f"the model {model!r} does not exist (serving "
                                 f"{self.model_name!r})", "model", code="model_not_found")

    def _prompt_ids(self, prompt: str | list) -> list[int]:
        if isinstance(prompt, list) and len(prompt) == 1 and not isinstance(prompt[0], int):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            return self.engine.tokenizer.encode(prompt)
        if all(isinstance(t, int) for t in prompt):
            return list(prompt)
        raise RequestError(400, "batched prompts are not supported: send one string or one list "
                             "of token ids", "prompt")

    async def _respond(self, request: Request, req: CommonRequest, prompt_ids: list[int],
                       sampling: SamplingParams, prompt_param: str, chat: bool) -> Response:
        try:
            self.engine.check_request(prompt_ids, sampling, req.kv_transfer_params)
        except InvalidKVTransferParams as e:
            raise RequestError(400, str(e), e.param) from None
        except ValueError as e:
            raise RequestError(400, str(e), prompt_param) from None
        ids = engine_request_ids(request.headers.get("x-request-id"))
        if ids.refused is not None:
            log.info("request %s: the client's x-request-id %s is not used", ids.own,
                     ids.refused)
        params = req.kv_transfer_params
        if params is not None and params.loads_remote_kv and params.remote_request_id is None:
            # vLLM's protocol without remote_request_id: the prefill's request went by the
            # id the proxy gave both hops, this request's label (not the engine's own id).
            params = msgspec.structs.replace(params, remote_request_id=ids.label)
        outputs = self.engine.generate(prompt_ids, sampling, ids.own, params)
        # Labelled with the client's id: a proxy gives both hops one, so the prefill's first
        # chunk and the decode's continuation carry one answer id.
        fmt = Formatter(self.engine.tokenizer, self.model_name, ids.label, chat, len(prompt_ids),
                        params.sent_token_ids if params else None)
        headers = {"x-request-id": ids.label}
        try:
            first = await anext(outputs)
        except InvalidKVTransferParams as e:
            raise RequestError(400, str(e), e.param) from None
        except ValueError as e:
            raise RequestError(400, str(e)) from None
        if first.error is not None:  # failed before producing anything
            raise _request_failed(first.error)
        if req.stream:
            include_usage = req.stream_options is not None and req.stream_options.include_usage
            return StreamingResponse(fmt.stream(first, outputs, include_usage),
                                     media_type="text/event-stream", headers=headers)
        async with contextlib.aclosing(outputs):
            last, token_ids = first, list(first.new_token_ids)
            while not last.finished:
                last = await anext(outputs)
                token_ids += last.new_token_ids
        if last.error is not None:
            raise _request_failed(last.error)
        return JSONResponse(fmt.full(token_ids, last), headers=headers)


def _sampling(req: CommonRequest, max_tokens: int, max_tokens_param: str) -> SamplingParams:
    return SamplingParams(**sampling_settings(req, max_tokens, max_tokens_param))


def _request_failed(failure: LoadFailure) -> RequestError:
    """The request's own fault (bad kv_transfer_params) is a 400; anything else a 502."""
    st = failure_status(failure)
    return RequestError(st.status, str(failure), "kv_transfer_params" if failure.request_fault
                     else None, st.type, st.code)


# -- running it ----------------------------------------------------------------------------

class _Server(GuardedServer):
    """uvicorn, minus re-raising SIGINT/SIGTERM once it has stopped: the caller still
    has work to do after the API closes (``kvbridge serve`` drains held KV blocks)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit)
                    for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def run_server(app: Starlette, host: str = "127.0.0.1", port: int = 8000, *,
               ssl_certfile: str | None = None, ssl_keyfile: str | None = None,
               ssl_ca_certs: str | None = None, ssl_cert_reqs: int = ssl.CERT_NONE,
               log_level: str = "info", sock: socket.socket | None = None,
               budget: ConnectionBudget | None = None) -> None:
    """Serve ``app`` with uvicorn until SIGINT/SIGTERM, then return (HTTPS when
    ``ssl_certfile`` is set). ``sock``: already bound to ``host:port`` (uvicorn listens).
    ``budget``: its connections' (default: the settings tree's, from the environment)."""
    _Server(uvicorn.Config(app, host=host, port=port, ssl_certfile=ssl_certfile,
                           ssl_keyfile=ssl_keyfile, ssl_ca_certs=ssl_ca_certs,
                           ssl_cert_reqs=ssl_cert_reqs, log_level=log_level,
                           **guarded_config("engine API", budget))).run(
        sockets=None if sock is None else [sock])
