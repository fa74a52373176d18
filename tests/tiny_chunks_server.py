"""A side channel's worst framing: answer one GET with a body of N bytes in tiny pieces,
each its own write (its own TLS record over TLS), then wait for the client to close.

    python tests/tiny_chunks_server.py --size N --framing chunked|length [--piece 2]
        [--certfile F --keyfile K]

Prints the port it listens on (127.0.0.1), then serves connections until killed. Used by
tests/test_http_reply_memory.py: a process of its own, so that the client's memory is
measured alone.
"""

from __future__ import annotations

import argparse
import socket
import ssl
import threading


def reply_pieces(size: int, framing: str, piece: int) -> list[bytes]:
    body = bytes(i % 251 for i in range(size))
    parts = [body[i:i + piece] for i in range(0, size, piece)]
    if framing == "chunked":
        head = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
        return [head, *(b"%x\r\n%s\r\n" % (len(p), p) for p in parts), b"0\r\n\r\n"]
    head = b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % size
    return [head, *parts]


def serve(conn: socket.socket, pieces: list[bytes]) -> None:
    with conn:
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = conn.recv(4096)
            if not chunk:
                return
            data += chunk
        for p in pieces:
            conn.sendall(p)
        while conn.recv(4096):  # until the client closes
            pass


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", type=int, required=True)
    ap.add_argument("--framing", choices=("chunked", "length"), required=True)
    ap.add_argument("--piece", type=int, default=2)
    ap.add_argument("--certfile")
    ap.add_argument("--keyfile")
    args = ap.parse_args()
    pieces = reply_pieces(args.size, args.framing, args.piece)
    ctx = None
    if args.certfile:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(args.certfile, args.keyfile)
    listener = socket.create_server(("127.0.0.1", 0))
    print(listener.getsockname()[1], flush=True)
    while True:
        conn, _ = listener.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if ctx is not None:
            try:
                conn = ctx.wrap_socket(conn, server_side=True)
            except (OSError, ssl.SSLError):
                conn.close()
                continue
        threading.Thread(target=serve, args=(conn, pieces), daemon=True).start()


if __name__ == "__main__":
    main()
