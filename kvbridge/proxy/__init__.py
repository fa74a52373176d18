"""OpenAI-compatible prefill/decode (P/D) proxy.

For each completion request the proxy asks a prefill instance for one token with
``kv_transfer_params.do_remote_decode`` set, then sends the original request to a decode
instance with the ``kv_transfer_params`` the prefill returned, so the decode pulls the KV
cache over NIXL instead of recomputing it. Field names follow vLLM's disaggregated proxy so
vLLM-style engines work unchanged.

It never imports an engine (nor torch): ``kvbridge.server`` is the engine's side.

Modules (each imports only the ones above it in this list, and never this package):

* ``upstream``       keep-alive, and the one retry of a request that never reached an engine
* ``transport``      aiohttp's connections under httpx's API; its exceptions mapped to httpx's
* ``routing``        instances, compatible pairs, least-outstanding / round-robin, cool-down
* ``membership``     the view of the etcd registry (watch, probe, add/remove)
* ``engine_client``  the client to engines: TLS, URL checks, error answers
* ``metrics``        the proxy's Prometheus metrics
* ``background_tasks`` background tasks that shutdown waits for
* ``rewrite``        the one-token prefill body, hop-by-hop headers
* ``relay``          the decode's stream to the client
* ``release``        freeing a prefill's hold
* ``prewarm``        handshakes made ahead of traffic
* ``first_token``    the prefill's first token streamed to the client while the decode starts
* ``flow``           the P/D hops and one failover
* ``admin``          ``/v1/fleet``, ``/healthz/backends``, ``GET /v1/kv/prewarm``, ``/metrics``
* ``app``            the app factory and runner
"""

from kvbridge.proxy.admin import ADMIN_ROUTES, admin_modes
from kvbridge.proxy.app import Proxy, build_proxy_app, run_proxy
from kvbridge.proxy.engine_client import DEFAULT_CONNECT_TIMEOUT, DEFAULT_TIMEOUT

__all__ = [
    "ADMIN_ROUTES",
    "DEFAULT_CONNECT_TIMEOUT",
    "DEFAULT_TIMEOUT",
    "Proxy",
    "admin_modes",
    "build_proxy_app",
    "run_proxy",
]
