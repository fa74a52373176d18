"""An HTTP client that runs inside a network namespace (``ip netns exec NS python nsclient.py``).

The test process stays in the root namespace, which has no address on the test
network; it sends this client one JSON request per stdin line
(``{"id", "method", "url", "json"?, "headers"?, "timeout"?}``) and reads one JSON
answer per stdout line (``{"id", "status", "body"}``, status 0 on a transport
error). Requests run concurrently.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx


def main() -> None:
    verify = os.environ.get("NSCLIENT_CA") or True
    client = httpx.Client(verify=verify, trust_env=False)
    lock = threading.Lock()

    def run(req: dict) -> None:
        try:
            r = client.request(req["method"], req["url"], json=req.get("json"),
                               headers=req.get("headers"), timeout=req.get("timeout", 60))
            status, body = r.status_code, r.text
        except httpx.HTTPError as e:
            status, body = 0, f"{type(e).__name__}: {e}"
        with lock:
            print(json.dumps({"id": req["id"], "status": status, "body": body}), flush=True)

    with ThreadPoolExecutor(8) as pool:
        for line in sys.stdin:
            pool.submit(run, json.loads(line))


if __name__ == "__main__":
    main()
