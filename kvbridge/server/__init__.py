"""The engine's serving side: its OpenAI API and one instance's wiring. (The P/D proxy, which
never imports an engine, is ``kvbridge.proxy``.)

Modules (each imports only the ones above it in this list, and ``kvbridge`` modules below
the package; nothing below the package imports ``kvbridge.server``; only ``kvbridge.cli``,
the demo, the benches and tests import it from above):

* ``sse``           response bodies and server-sent-event chunks of one request
* ``api``           an engine's OpenAI app and its runner (imports the engine, so torch);
                    ``instance`` and the CLI
* ``instance``      one serving instance: engine + connector + side channel + API + KV routes;
                    the CLI, ``node``, ``registration``
* ``registration``  an instance's record in etcd under a lease; the CLI
* ``node``          a non-head node of a multi-node instance; the CLI
"""
