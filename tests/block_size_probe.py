"""What stock vLLM answers for a fresh, valid P/D between a prefill at ``--block-size 32`` and
a decode at vLLM's default block size (docs/vllm.md §6a): two real servers, the decode's own
answer, then the P/D answer and the bytes the decode READ.

    python tests/block_size_probe.py [nixl|kvbridge]

``nixl`` (default) runs vLLM's own NixlConnector; ``kvbridge`` the plug-in, which refuses
the READ (``block_size_mismatch``) and answers the decode's own text.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from kvbridge.model.models import prepare
from kvbridge.tools.vllm.launch import VllmServer, completion, decode, prefill

PROMPT = ("Question: What is the capital of France, and which river flows through it? Name "
          "the river and one famous bridge that crosses it. Answer in one sentence.\nAnswer:")


def main(connector: str) -> None:
    model = prepare("smollm2-135m-instruct", progress=False)
    logs = Path(tempfile.mkdtemp(prefix="block-size-probe-"))
    p = VllmServer.start(model, name="prefill", connector=connector, core=0, log_dir=logs,
                         max_model_len=640, extra_args=[
                             "--block-size", "32", "--num-gpu-blocks-override", "24",
                             "--no-enable-prefix-caching"])
    d = VllmServer.start(model, name="decode", connector=connector, core=1, log_dir=logs,
                         max_model_len=640, extra_args=["--no-enable-prefix-caching"])
    try:
        p.wait_healthy(900)
        d.wait_healthy(900)
        own = completion(d.url, PROMPT, max_tokens=12, timeout=600).json()["choices"][0]
        r = decode(d.url, PROMPT, prefill(p.url, PROMPT, 600), max_tokens=12, timeout=600)
        print("decode alone:", repr(own["text"]))
        print("P/D:", r.status_code, repr(r.json()["choices"][0]["text"]))
        print("bytes READ:", d.metrics().get("vllm:nixl_bytes_transferred_sum"))
        print("logs:", logs)
    finally:
        p.stop()
        d.stop()


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "nixl")
