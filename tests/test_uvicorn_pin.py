"""kvbridge/guard/protocol.py, kvbridge/bounded_http.py (and the side channel's HeadLimitedHttpTools)
drive uvicorn through state uvicorn does not publish: the httptools protocol's ``cycle``,
``pipeline``, ``connections``, ``timeout_keep_alive_task``, ``flow`` (its ``FlowControl``,
replaced by a subclass), ``_start_asgi_task``, its parser callbacks, and ``Server.startup``
calling ``loop.create_server``. pyproject.toml pins the uvicorn versions this was checked on; these
tests fail, naming what changed, when the installed uvicorn no longer has what is driven."""

from __future__ import annotations

import asyncio
import inspect
import re
import tomllib

import uvicorn
from packaging.requirements import Requirement
from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState

from tests.conftest import ROOT

# What the guard and HeadLimitedHttpTools override or call (methods) and read (state).
METHODS = ("connection_made", "connection_lost", "data_received", "on_message_begin", "on_url",
           "on_header", "on_headers_complete", "on_body", "on_message_complete",
           "on_response_complete", "timeout_keep_alive_handler", "_start_asgi_task", "shutdown",
           "pause_writing", "resume_writing")
STATE = ("cycle", "pipeline", "connections", "timeout_keep_alive_task", "loop", "parser")
# Set later than __init__: where uvicorn sets them.
SET_IN = {"transport": "connection_made", "flow": "connection_made", "scope": "on_message_begin"}
# What bounded_http's FlowControl subclass overrides and reads.
FLOW = ("pause_reading", "resume_reading", "pause_writing", "resume_writing", "drain")
FLOW_STATE = ("read_paused", "write_paused", "_transport")


def _changed(what: list[str]) -> str:
    return (f"uvicorn {uvicorn.__version__} changed what kvbridge/guard/protocol.py drives through its "
            f"private state: {', '.join(what)}. Check guard/protocol.py (and handshake/http/protocol.py) "
            "against this uvicorn before moving the pin in pyproject.toml.")


def test_the_installed_uvicorn_is_in_the_pinned_range():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (req,) = [Requirement(d) for d in deps if re.match(r"uvicorn\b", d)]
    assert req.specifier and any(s.operator == "<" for s in req.specifier), (
        f"pyproject.toml: {req} has no upper bound, but guard/protocol.py drives uvicorn's private state")
    assert req.specifier.contains(uvicorn.__version__), (
        f"uvicorn {uvicorn.__version__} is outside the pinned {req}")


def test_the_httptools_protocol_has_what_the_guard_drives():
    missing = [f"HttpToolsProtocol.{m}()" for m in METHODS
               if not callable(getattr(HttpToolsProtocol, m, None))]
    loop = asyncio.new_event_loop()
    try:
        config = uvicorn.Config(app=lambda scope, receive, send: None, log_level="warning")
        config.load()
        proto = HttpToolsProtocol(config, ServerState(), {}, _loop=loop)
        missing += [f"HttpToolsProtocol.{a}" for a in STATE if not hasattr(proto, a)]
        if hasattr(proto, "connections") and not isinstance(proto.connections, set):
            missing.append("HttpToolsProtocol.connections as a set")
    finally:
        loop.close()
    missing += [f"FlowControl.{m}()" for m in FLOW if not callable(getattr(FlowControl, m, None))]
    flow = FlowControl(None)  # type: ignore[arg-type]
    missing += [f"FlowControl.{a}" for a in FLOW_STATE if not hasattr(flow, a)]
    for attr, method in SET_IN.items():
        source = inspect.getsource(getattr(HttpToolsProtocol, method, lambda: None))
        if f"self.{attr} =" not in source:
            missing.append(f"HttpToolsProtocol.{attr} (set in {method})")
    assert not missing, _changed(missing)


def test_server_startup_binds_through_loop_create_server():
    """GuardedServer bounds the TLS handshake by wrapping ``loop.create_server`` during
    ``startup`` and reads ``config.http_protocol_class``."""
    source = inspect.getsource(uvicorn.Server.startup)
    missing = [what for what, needle in (("Server.startup calling loop.create_server",
                                          "create_server("),
                                         ("Config.http_protocol_class", "http_protocol_class"))
               if needle not in source]
    assert not missing, _changed(missing)


def test_the_check_names_what_is_missing():
    message = _changed(["HttpToolsProtocol.pipeline"])
    assert "HttpToolsProtocol.pipeline" in message and uvicorn.__version__ in message
