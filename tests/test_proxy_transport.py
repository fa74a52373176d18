"""The proxy's transport (httpx's API on aiohttp): each way an engine can fail reads as the
httpx exception the failover rules were written for. Real sockets on loopback: a refused
port, servers that hang up before or during an answer, or never answer."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import httpx
import pytest

from kvbridge.server.proxy.transport import AiohttpTransport
from kvbridge.server.upstream import never_reached
from tests.helpers import refused_port

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
    (_hang_up, httpx.RemoteProtocolError, False),  # before any answer: safe to send again
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
