"""OpenAI-compatible prefill/decode (P/D) proxy.

For each completion request the proxy asks a prefill instance for one token with
``kv_transfer_params.do_remote_decode`` set, then sends the original request to a decode
instance with the ``kv_transfer_params`` the prefill returned, so the decode pulls the KV
cache over NIXL instead of recomputing it. Field names follow vLLM's disaggregated proxy so
vLLM-style engines work unchanged.

Rooms (each imports only those above it in this list, and never this package):
``engine_client`` (the httpx client, TLS, URL checks, error answers), ``metrics``,
``tasks``, ``rewrite`` (the prefill body, hop headers), ``relay`` (the decode's stream to
the client), ``release`` (freeing a prefill's hold), ``prewarm``, ``flow`` (the P/D hops
and failover), ``admin`` (operator routes), ``app`` (the app factory and runner).
"""

from kvbridge.server.proxy.admin import ADMIN_ROUTES, admin_modes
from kvbridge.server.proxy.app import Proxy, build_proxy_app, run_proxy
from kvbridge.server.proxy.engine_client import DEFAULT_CONNECT_TIMEOUT, DEFAULT_TIMEOUT

__all__ = [
    "ADMIN_ROUTES",
    "DEFAULT_CONNECT_TIMEOUT",
    "DEFAULT_TIMEOUT",
    "Proxy",
    "admin_modes",
    "build_proxy_app",
    "run_proxy",
]
