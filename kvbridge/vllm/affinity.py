"""The worker keeps the CPU cores it was given.

On vLLM's CPU build, vLLM's NIXL worker (``NixlBaseConnectorWorker.__init__``) calls
``os.sched_setaffinity(0, ...)`` with the last core of each NUMA node, "to reserve
different cores for start_load_kv() from model_forward()". But the thread that builds the
connector is the worker's main thread, which also runs the forward (it is OpenMP's master
thread): the forward moves off the cores ``VLLM_CPU_OMP_THREADS_BIND`` (or the operator's
``taskset``) gave it, onto the machine's last core. A prefill and a decode bound to
cores 0 and 1 then both compute on core 1, and each waits for the other's idle spin
(vLLM's worker polls its queue for a second after each step): a prefill of 0.13 s took
1.1 s. Stock vLLM has the same defect; the plug-in puts the
thread back where it was.

Only where the cores were chosen outside vLLM's automatic binding: an explicit
``VLLM_CPU_OMP_THREADS_BIND`` list, or ``nobind`` (the operator's ``taskset`` or cgroup).
With ``auto`` (vLLM's default) vLLM itself leaves the last core of each NUMA node out of
the OpenMP binding for this purpose (vLLM pull request 32365), and the move is kept.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from kvbridge.vllm.nixl_payload import log


@contextlib.contextmanager
def kept_affinity() -> Iterator[None]:
    """Run the body, then give the calling thread back the cores it had before (if the
    body changed them)."""
    if not hasattr(os, "sched_getaffinity") or \
            os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto") == "auto":
        yield  # not Linux (nothing pinned), or vLLM's own layout (reserved cores)
        return
    before = os.sched_getaffinity(0)
    yield
    after = os.sched_getaffinity(0)
    if after != before:
        os.sched_setaffinity(0, before)
        log.info("kvbridge.vllm: this worker's forward stays on cores %s, as "
                 "VLLM_CPU_OMP_THREADS_BIND or the operator chose (vLLM's NIXL worker had "
                 "moved its thread to %s)", _cores(before), _cores(after))


def _cores(cores: set[int]) -> str:
    return ",".join(str(c) for c in sorted(cores))
