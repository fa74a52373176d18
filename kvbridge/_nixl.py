"""The nixl import shim and the progress-thread setting: the only module that imports nixl."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
from collections.abc import Iterator
from typing import Any

from kvbridge.settings import SETTINGS


def nixl_module() -> Any:
    """nixl's ``_api`` module, as vLLM imports it (no change to its logging)."""
    # `nixl` (the meta package of the engine extra, and what vLLM imports) loads the backend
    # wheel matching the CUDA in use (nixl_cu12, nixl_cu13; any one without CUDA); a lone
    # backend wheel (nixl-cu12) is taken too.
    try:
        from nixl import _api
    except ModuleNotFoundError as e:  # pragma: no cover - depends on the installed wheels
        if e.name != "nixl":
            raise
        from nixl_cu12 import _api
    return _api


def nixl_api():
    _api = nixl_module()
    # NIXL logs every agent creation at INFO to stdout, which is our tools' output channel.
    nixl_log = logging.getLogger("nixl")
    for h in nixl_log.handlers:
        if isinstance(h, logging.StreamHandler) and h.stream is sys.stdout:
            h.setStream(sys.stderr)
    if not os.environ.get("NIXL_LOG_LEVEL"):
        nixl_log.setLevel(logging.WARNING)
    return _api


def _progress_delay_us() -> int:
    # KVBRIDGE_NIXL_PROGRESS_DELAY_US (kvbridge/settings/tree.py); a bad value: ConfigError
    return SETTINGS.from_env("nixl_progress_delay_us")


# Microseconds NIXL's progress thread sleeps between polls. nixl's Python wrapper
# hard-codes 0, so every agent's thread spins a whole core even when idle; 1 ms costs
# little latency here (READs between processes are driven by the initiator).
PROGRESS_DELAY_US = _progress_delay_us()
_agent_lock = threading.Lock()


@contextlib.contextmanager
def progress_delay(api: Any) -> Iterator[None]:
    """Every NIXL agent built inside the block gets ``PROGRESS_DELAY_US`` (``0``: nixl's
    busy-polling default). For agents built by others too: vLLM's worker builds its own."""
    if PROGRESS_DELAY_US <= 0:
        yield
        return
    base = api.nixlBind.nixlAgentConfig

    class _Config(base):  # the wrapper builds one of these and sets pthrDelay = 0 on it
        def __setattr__(self, key: str, value: Any) -> None:
            super().__setattr__(key, PROGRESS_DELAY_US if key == "pthrDelay" else value)

    with _agent_lock:  # the swap is process-wide for the length of the block
        api.nixlBind.nixlAgentConfig = _Config
        try:
            yield
        finally:
            api.nixlBind.nixlAgentConfig = base


def new_agent(api: Any, name: str) -> Any:
    with progress_delay(api):
        return api.nixl_agent(name, api.nixl_agent_config(backends=["UCX"]))
