"""The OpenAI-compatible API of one engine instance (Starlette).

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with
``stream`` as server-sent events), ``GET /v1/models``, ``GET /health``.

Beyond OpenAI's fields, requests may carry ``kv_transfer_params`` (a dict,
passed to the KV connector), ``ignore_eos`` and an ``X-Request-Id`` header (the
engine's request id). A response carries the connector's ``kv_transfer_params``
as a top-level field when it returned some. Errors use OpenAI's shape
``{"error": {"message", "type", "param", "code"}}``: 4xx for bad input, 502
when the engine failed the request (e.g. remote KV could not be loaded under the
``fail`` policy), 503 when the engine is not running.

    engine = AsyncEngine(build_engine(tp_size=2))
    run_server(build_app(engine, "tiny", shutdown_engine_on_exit=True), "0.0.0.0", 8000)
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import signal
import socket
import ssl
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import msgspec
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from kvbridge import background
from kvbridge.engine.async_engine import AsyncEngine
from kvbridge.engine.sampling import SamplingParams
from kvbridge.engine.sequence import RequestOutput
from kvbridge.errors import (
    EngineDeadError,
    InvalidKVTransferParams,
    KVBridgeError,
    LoadFailure,
    RequestError,
    error_body,
    failure_status,
    status_of,
)
from kvbridge.guard import ConnectionBudget, GuardedServer, guarded_config
from kvbridge.limits import check_json_body, read_json_body
from kvbridge.params import KVTransferParams
from kvbridge.requestid import accept_request_id

__all__ = ["BackgroundServer", "build_app", "check_request_body", "run_server"]

log = logging.getLogger(__name__)

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


# -- request schemas (unknown fields are ignored, known ones are type-checked) -------------

class _StreamOptions(msgspec.Struct):
    include_usage: bool = False


class _Common(msgspec.Struct, kw_only=True):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: _StreamOptions | None = None
    seed: int | None = None
    ignore_eos: bool = False
    kv_transfer_params: KVTransferParams | None = None


class CompletionRequest(_Common, kw_only=True):
    prompt: str | list[int | str | list[int]]


class ChatMessage(msgspec.Struct):
    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_Common, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None


def error_response(status: int, message: str, param: str | None = None,
                   type_: str = "invalid_request_error", code: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, type_, param, code), status_code=status)


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
        if stopped := background.down():  # a supervised thread failed; restarting it
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
        req = _parse(await read_json_body(request), chat=False)
        return await self._completions(request, req)

    async def chat_completions(self, request: Request) -> Response:
        req = _parse(await read_json_body(request), chat=True)
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
        param, max_tokens = _chat_max_tokens(req)
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

    async def _respond(self, request: Request, req: _Common, prompt_ids: list[int],
                       sampling: SamplingParams, prompt_param: str, chat: bool) -> Response:
        try:
            self.engine.check_request(prompt_ids, sampling, req.kv_transfer_params)
        except InvalidKVTransferParams as e:
            raise RequestError(400, str(e), e.param) from None
        except ValueError as e:
            raise RequestError(400, str(e), prompt_param) from None
        request_id, refused_id = accept_request_id(request.headers.get("x-request-id"))
        if refused_id is not None:
            log.info("request %s: the client's x-request-id %s is not used", request_id,
                     refused_id)
        outputs = self.engine.generate(prompt_ids, sampling, request_id, req.kv_transfer_params)
        fmt = _Formatter(self.engine.tokenizer, self.model_name, request_id, chat, len(prompt_ids))
        headers = {"x-request-id": request_id}
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


def check_request_body(body: bytes, chat: bool) -> None:
    """Every check an engine makes of a request before it tokenizes the prompt: the schema
    (types, ``kv_transfer_params``) and the sampling settings. Raises ``RequestError``.

    The proxy runs it before the prefill hop, so that a request the decode would refuse
    never makes a prefill compute and hold KV that nobody reads.
    """
    req = _parse(body, chat)
    if chat:
        param, max_tokens = _chat_max_tokens(req)
    else:
        param, max_tokens = "max_tokens", req.max_tokens
    _sampling(req, DEFAULT_COMPLETION_MAX_TOKENS if max_tokens is None else max_tokens, param)


def _parse(body: bytes, chat: bool) -> Any:
    schema = ChatCompletionRequest if chat else CompletionRequest
    check_json_body(body)  # msgspec recurses per level: a deep body must not reach it
    try:
        req = msgspec.json.decode(body, type=schema)
    except msgspec.ValidationError as e:
        m = re.search(r"at `\$\.([A-Za-z_]+)", str(e))
        param = m.group(1) if m else None
        what = "kv_transfer_params" if param == "kv_transfer_params" else "request"
        raise RequestError(400, f"invalid {what}: {e}", param) from None
    except msgspec.DecodeError as e:
        raise RequestError(400, f"malformed JSON body: {e}") from None
    if chat and not req.messages:
        raise RequestError(400, "messages must not be empty", "messages")
    if req.kv_transfer_params is not None:
        try:
            req.kv_transfer_params.check()
        except InvalidKVTransferParams as e:
            raise RequestError(400, str(e), e.param) from None
    return req


def _chat_max_tokens(req: ChatCompletionRequest) -> tuple[str, int | None]:
    if req.max_completion_tokens is not None:
        return "max_completion_tokens", req.max_completion_tokens
    return "max_tokens", req.max_tokens


def _sampling(req: _Common, max_tokens: int, max_tokens_param: str) -> SamplingParams:
    if req.n != 1:
        raise RequestError(400, "only n=1 is supported", "n")
    if max_tokens < 1:
        raise RequestError(400, f"{max_tokens_param} must be at least 1, got {max_tokens}",
                        max_tokens_param)
    temperature = 1.0 if req.temperature is None else req.temperature
    if not 0 <= temperature <= 2:
        raise RequestError(400, f"temperature must be in [0, 2], got {temperature}", "temperature")
    top_p = 1.0 if req.top_p is None else req.top_p
    if not 0 < top_p <= 1:
        raise RequestError(400, f"top_p must be in (0, 1], got {top_p}", "top_p")
    return SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                          seed=req.seed, ignore_eos=req.ignore_eos)


class _Formatter:
    """OpenAI response bodies and SSE chunks for one request."""

    def __init__(self, tokenizer: Any, model: str, request_id: str, chat: bool,
                 num_prompt_tokens: int):
        self.tokenizer = tokenizer
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

    def full(self, token_ids: list[int], last: RequestOutput) -> dict[str, Any]:
        text = self.tokenizer.decode(token_ids)
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
            if self.chat:
                yield _sse(self._chunk("", None, role=True))
            token_ids: list[int] = []
            sent = 0  # characters of the decoded text already sent
            out = first
            while True:
                token_ids += out.new_token_ids
                if out.error is not None:
                    st = failure_status(out.error)
                    yield _sse(error_body(str(out.error), st.type, None, st.code))
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
                    yield _sse(chunk)
                    if include_usage:
                        usage = self._envelope(chunk["object"], [])
                        usage["usage"] = self._usage(len(token_ids))
                        yield _sse(usage)
                    break
                if delta:
                    yield _sse(self._chunk(delta, None))
                try:
                    out = await anext(outputs)
                except EngineDeadError as e:  # headers are sent: report it in the stream
                    yield _sse({"error": {"message": str(e), "type": "server_error",
                                          "param": None, "code": "engine_not_running"}})
                    break
        yield "data: [DONE]\n\n"


def _request_failed(failure: LoadFailure) -> RequestError:
    """The request's own fault (bad kv_transfer_params) is a 400; anything else a 502."""
    st = failure_status(failure)
    return RequestError(st.status, str(failure), "kv_transfer_params" if failure.request_fault
                     else None, st.type, st.code)


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


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


class BackgroundServer:
    """uvicorn in a thread, on a socket bound before it starts (port 0: any free port).

    The socket listens from construction on, so clients may connect at once:
    the kernel queues them until uvicorn accepts, and no readiness wait is needed.
    """

    def __init__(self, app: Starlette, host: str = "127.0.0.1", port: int = 0,
                 **uvicorn_kwargs: Any):
        self._sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self._sock.listen(128)
        self.host, self.port = host, self._sock.getsockname()[1]
        scheme = "https" if uvicorn_kwargs.get("ssl_certfile") else "http"
        self.url = f"{scheme}://{host}:{self.port}"
        uvicorn_kwargs.setdefault("log_level", "warning")
        for k, v in guarded_config("engine API").items():
            uvicorn_kwargs.setdefault(k, v)
        self._server = GuardedServer(uvicorn.Config(app, **uvicorn_kwargs))
        self._thread = threading.Thread(target=self._server.run, args=([self._sock],),
                                        name="kvbridge-api", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join()
        self._sock.close()

    def __enter__(self) -> BackgroundServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
