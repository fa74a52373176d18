"""The ``http`` side channel. Modules (each imports only the ones above it in this list):

* ``routes``        the routes and media type both ends agree on
* ``fast_path``     handshakes and probes answered from the parsed head, no ASGI
* ``protocol``      uvicorn's httptools protocol: caps on head and body, the fast path
* ``server``        the server: Starlette app, body limit, observer, threaded uvicorn
* ``deadlines``     one thread that cuts a connection when its fetch's deadline passes
* ``tls_sessions``  TLS client contexts and sessions shared per setting, bounded
* ``reply``         one HTTP/1.1 reply read off a socket (llhttp), head and body bounded
* ``client``        the client: keep-alive pool, requests written whole, capped replies
"""
