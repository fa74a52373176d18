"""The proxy's transport (httpx's API on aiohttp): each way an engine can fail reads as the
httpx exception the failover rules were written for, and a request the engine never took
is sent once more on a new connection. Real sockets on loopback: a refused port, servers
that hang up before or during an answer, reset, or never answer, each provoked in order on
the socket (tests/raw_engine.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import aiohttp
import httpx
import pytest

from kvbridge.errors import ClosedUnanswered
from kvbridge.proxy.transport import AiohttpTransport
from kvbridge.proxy.upstream import never_reached, send_retrying_once
from tests import raw_engine
from tests.helpers import refused_port
from tests.raw_engine import RawEngine

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def _head(reader: asyncio.StreamReader) -> None:
    await reader.readuntil(b"\r\n\r\n")


async def serve(handler: Handler) -> tuple[asyncio.Server, int, list[int]]:
    """A server on loopback; the list counts the connections it accepted."""
    accepted: list[int] = []

    async def on_connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(1)
        try:
            await handler(reader, writer)
        finally:
            writer.close()

    server = await asyncio.start_server(on_connection, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1], accepted


def client(read: float = 5.0) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=AiohttpTransport(), trust_env=False,
                             timeout=httpx.Timeout(read, connect=2.0))


async def _keep_alive_ok(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while True:
        try:
            await _head(reader)
        except asyncio.IncompleteReadError:
            return
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                     b"content-length: 12\r\n\r\n{\"ok\": true}")
        await writer.drain()


def test_answers_and_keeps_the_connection_alive() -> None:
    async def main() -> None:
        server, port, accepted = await serve(_keep_alive_ok)
        async with server, client() as c:
            for _ in range(3):
                r = await c.post(f"http://127.0.0.1:{port}/v1/completions", content=b"{}")
                assert (r.status_code, r.json(), r.reason_phrase) == (200, {"ok": True}, "OK")
            # the prefill hop's path: the same pooled connection, the whole body read
            r = await c._transport.read(c.build_request("POST", f"http://127.0.0.1:{port}/x",
                                                        content=b"{}"))
            assert (r.status_code, r.json()) == (200, {"ok": True})
        assert len(accepted) == 1
    asyncio.run(main())


def test_a_streamed_answer_arrives_chunk_by_chunk() -> None:
    async def chunks(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _head(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        for part in (b"data: 1\n\n", b"data: 2\n\n"):
            writer.write(b"%x\r\n%s\r\n" % (len(part), part))
            await writer.drain()
            await asyncio.sleep(0)
        writer.write(b"0\r\n\r\n")
        await writer.drain()

    async def main() -> None:
        server, port, _ = await serve(chunks)
        async with server, client() as c:
            async with c.stream("POST", f"http://127.0.0.1:{port}/x", content=b"{}") as r:
                got = b"".join([part async for part in r.aiter_raw()])
        assert got == b"data: 1\n\ndata: 2\n\n"
    asyncio.run(main())


def test_a_refused_port_is_a_connect_error_never_reached() -> None:
    async def main() -> None:
        async with client() as c:
            with pytest.raises(httpx.ConnectError) as e:
                await c.post(f"http://127.0.0.1:{refused_port()}/x", content=b"{}")
            assert never_reached(e.value)
            request = c.build_request("POST", f"http://127.0.0.1:{refused_port()}/x")
            with pytest.raises(httpx.ConnectError):
                await c._transport.read(request)
    asyncio.run(main())


async def _hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await _head(reader)


async def _half(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await _head(reader)
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n{\"partial")
    await writer.drain()


async def _silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await _head(reader)
    await asyncio.sleep(30)


@pytest.mark.parametrize("path", ["httpx-client", "read"])  # the relay's, the prefill hop's
@pytest.mark.parametrize(("handler", "expected", "reached"), [
    # before any answer, on a new connection: maybe a crash mid-request, not sent again
    (_hang_up, httpx.RemoteProtocolError, True),
    (_half, httpx.RemoteProtocolError, True),  # inside the body: the engine had it
    (_silent, httpx.ReadTimeout, True),  # never answered: still at work, maybe
], ids=["hang-up-before-answering", "hang-up-inside-the-body", "never-answers"])
def test_an_engine_failure_reads_as_the_httpx_exception(handler: Handler, expected: type,
                                                        reached: bool, path: str) -> None:
    async def main() -> None:
        server, port, _ = await serve(handler)
        async with server, client(read=0.3) as c:
            request = c.build_request("POST", f"http://127.0.0.1:{port}/x", content=b"{}")
            with pytest.raises(expected) as e:
                if path == "read":
                    await c._transport.read(request)
                else:
                    await c.send(request)
        assert never_reached(e.value) is not reached
    asyncio.run(main())


# -- a reused connection closed unanswered: sent once more, on a new connection ------------

# Larger than every buffer between the client and a server that stopped reading
# (raw_engine.close_in_body): a close after the head lands while the body is being written.
BIG = b"{" + b" " * (8 << 20) + b"}"


async def _twice(engine: RawEngine, path: str, body: bytes) -> httpx.Response:
    """A first request (its connection kept alive), then a second one on that connection,
    sent as the proxy's hops send it (``send_retrying_once``)."""
    async with client(read=5.0) as c:
        assert (await c.post(engine.url + "/first", content=b"{}")).status_code == 200
        request = c.build_request("POST", engine.url + "/v1/completions", content=body)
        if path == "read":
            return await send_retrying_once(c, request, send=c._transport.read)
        r = await send_retrying_once(c, request, stream=True)
        await r.aread()
        await r.aclose()
        return r


UNANSWERED = {
    "close-before-the-head-is-read": (raw_engine.close_before_head, b"{}"),
    "close-after-the-head-while-the-body-is-sent": (raw_engine.close_in_body, BIG),
    "reset-before-the-status-line": (raw_engine.reset_unanswered, b"{}"),
    "eof-before-the-status-line": (raw_engine.eof_before_status, b"{}"),
}


@pytest.mark.parametrize("path", ["httpx-client", "read"])  # the decode's, the prefill's
@pytest.mark.parametrize("variant", list(UNANSWERED))
def test_a_reused_connection_closed_unanswered_is_sent_once_more(variant: str,
                                                                  path: str) -> None:
    misbehave, body = UNANSWERED[variant]
    with RawEngine(misbehave) as engine:
        r = asyncio.run(_twice(engine, path, body))
        assert (r.status_code, r.json()) == (200, {"choices": [{"text": "x"}],
                                                   "kv_transfer_params": None})
        # the first request, then the second on a new connection
        assert (engine.connections, engine.answered) == (2, 2)


@pytest.mark.parametrize("variant", list(UNANSWERED))
def test_a_reused_connection_closed_unanswered_reads_as_never_reached(variant: str) -> None:
    """What each variant raises, and the aiohttp failure under it: the variants reach the
    transport as the different failures they are meant to provoke."""
    misbehave, body = UNANSWERED[variant]

    async def main() -> BaseException:
        async with client() as c:
            await c.post(engine.url + "/first", content=b"{}")
            with pytest.raises(httpx.RemoteProtocolError) as e:
                await c.post(engine.url + "/v1/completions", content=body)
        return e.value

    with RawEngine(misbehave) as engine:
        exc = asyncio.run(main())
    assert never_reached(exc), exc
    assert isinstance(exc.__cause__, ClosedUnanswered)
    cause = exc.__cause__.__cause__  # aiohttp's
    if variant == "eof-before-the-status-line":
        assert isinstance(cause, aiohttp.ServerDisconnectedError), repr(cause)
    else:
        # A reset; under a body still being written, aiohttp says "Can not write request
        # body" or "Connection reset by peer", whichever of its writer and its reader
        # sees the RST first.
        assert isinstance(cause, aiohttp.ClientOSError), repr(cause)


REFUSED = {
    # the engine had begun to answer: it took the request
    "half-a-status-line": (raw_engine.half_status_line, (0, 1), httpx.RemoteProtocolError),
    "cut-inside-the-body": (raw_engine.cut_in_body, (0, 1), httpx.RemoteProtocolError),
    # an engine maybe still at work
    "never-answers": (raw_engine.silent, (0, 1), httpx.ReadTimeout),
    # a new connection, accepted for this request: closed unanswered may be a crash
    "new-connection-reset": (raw_engine.reset_unanswered, (0, 0), httpx.RemoteProtocolError),
    "new-connection-eof": (raw_engine.eof_before_status, (0, 0), httpx.RemoteProtocolError),
}


@pytest.mark.parametrize("path", ["httpx-client", "read"])
@pytest.mark.parametrize("variant", list(REFUSED))
def test_a_request_the_engine_may_have_taken_is_never_sent_again(variant: str,
                                                                 path: str) -> None:
    misbehave, at, expected = REFUSED[variant]
    # Only the engine that never answers waits out the read timeout: the others fail at
    # once, whatever the load (a short timeout made them read timeouts on loaded cores).
    read = 0.5 if expected is httpx.ReadTimeout else 10.0

    async def main() -> None:
        async with client(read=read) as c:
            if at == (0, 1):  # a first request: the second reuses its connection
                await c.post(engine.url + "/first", content=b"{}")
            request = c.build_request("POST", engine.url + "/v1/completions", content=b"{}")
            with pytest.raises(expected) as e:
                if path == "read":
                    await send_retrying_once(c, request, send=c._transport.read)
                else:
                    r = await send_retrying_once(c, request, stream=True)
                    await r.aread()
            assert not never_reached(e.value)

    with RawEngine(misbehave, at) as engine:
        asyncio.run(main())
        assert engine.connections == 1  # not sent again
