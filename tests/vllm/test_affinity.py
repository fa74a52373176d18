"""kept_affinity (kvbridge/vllm/affinity.py) on a real thread of this process: what vLLM's
NIXL worker does to the thread that builds it (sched_setaffinity to another core), undone
where the operator chose the cores, kept under vLLM's automatic binding."""

from __future__ import annotations

import os
import threading

import pytest

from kvbridge.vllm.affinity import kept_affinity


def _in_thread(bind: str, monkeypatch: pytest.MonkeyPatch) -> tuple[set[int], set[int]]:
    """(cores before, cores after) of a thread that runs what vLLM's worker does inside
    kept_affinity, with VLLM_CPU_OMP_THREADS_BIND=``bind``."""
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", bind)
    cores = sorted(os.sched_getaffinity(0))
    assert len(cores) >= 2, "a move between cores needs two (the suite's machines have two)"
    got: dict[str, set[int]] = {}

    def run() -> None:
        os.sched_setaffinity(0, {cores[0]})  # what the operator's binding gave
        got["before"] = os.sched_getaffinity(0)
        with kept_affinity():
            os.sched_setaffinity(0, {cores[-1]})  # vLLM: the last core
        got["after"] = os.sched_getaffinity(0)

    t = threading.Thread(target=run)
    t.start()
    t.join()
    return got["before"], got["after"]


@pytest.mark.parametrize("bind", ["0", "nobind"])
def test_an_explicit_binding_is_kept(bind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    before, after = _in_thread(bind, monkeypatch)
    assert after == before


def test_vllms_automatic_binding_keeps_its_reserved_core(monkeypatch: pytest.MonkeyPatch) -> None:
    before, after = _in_thread("auto", monkeypatch)
    assert after != before and after == {max(os.sched_getaffinity(0))}
