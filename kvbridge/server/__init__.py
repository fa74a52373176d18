"""The serving side: an engine's OpenAI API, one instance's wiring, and the P/D proxy.

Modules (each imports only the ones above it in this list, and ``kvbridge`` modules below
the package; nothing below the package imports ``kvbridge.server``; only ``kvbridge.cli``,
the demo, the benches and tests import it from above):

* ``responses``     the one error answer (``errors.error_body`` as JSON); anyone in server
* ``schemas``       OpenAI request schemas and every check before tokenizing; no engine, no
                    torch; used by ``api`` and the proxy
* ``sse``           response bodies and server-sent-event chunks of one request; ``api`` only
* ``upstream``      keep-alive and the one retry of a request that never reached an engine;
                    the proxy
* ``routing``       instances, compatible pairs, least-outstanding / round-robin, cool-down;
                    the proxy and ``membership``
* ``membership``    the proxy's view of the etcd registry (watch, probe, add/remove); the proxy
* ``api``           an engine's OpenAI app and its runner (imports the engine, so torch);
                    ``instance`` and the CLI
* ``instance``      one serving instance: engine + connector + side channel + API + KV routes;
                    the CLI, ``node``, ``registration``
* ``registration``  an instance's record in etcd under a lease; the CLI
* ``node``          a non-head node of a multi-node instance; the CLI
* ``proxy/``        the P/D proxy (no engine import): ``engine_client`` (the httpx client, TLS,
                    URL checks, error answers), ``metrics``, ``tasks`` (background tasks
                    shutdown waits for), ``rewrite`` (the one-token prefill body, hop headers),
                    ``relay`` (the decode's stream to the client), ``release`` (freeing a
                    prefill's hold), ``prewarm``, ``flow`` (the P/D hops and one failover),
                    ``admin`` (``/v1/fleet``, ``/healthz/backends``, ``GET /v1/kv/prewarm``,
                    ``/metrics``: off, token or open), ``app`` (the app factory and runner);
                    the package exports ``build_proxy_app`` and ``run_proxy`` for the CLI and
                    tests
"""
