"""A Starlette app served by uvicorn in a thread, on a port bound before it starts: how
tests run an engine API or a proxy in-process."""

from __future__ import annotations

import socket
import threading
from typing import Any

import uvicorn
from starlette.applications import Starlette

from kvbridge.guard import GuardedServer, guarded_config

__all__ = ["BackgroundServer"]


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
