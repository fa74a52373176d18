"""The deadline watchdog (``kvbridge.handshake.http.deadlines``): each deadline fires
unless cancelled, the nearest first, and arming one that is not the nearest does not wake
its thread (one wake-up per fetch was a thread switch on every warm handshake)."""

from __future__ import annotations

import threading
import time

from kvbridge.handshake.http.deadlines import Watchdog


class CountingCondition(threading.Condition):
    """The watchdog's condition, counting the wake-ups it is asked for."""

    notified = 0

    def notify(self, n: int = 1) -> None:
        self.notified += 1
        super().notify(n)


def test_a_deadline_fires_and_a_cancelled_one_does_not() -> None:
    dog = Watchdog("test-watchdog")
    cancelled, fired = threading.Event(), threading.Event()
    dog.arm(time.monotonic() + 0.05, cancelled.set).cancel()
    dog.arm(time.monotonic() + 0.1, fired.set)
    assert fired.wait(10)
    assert not cancelled.is_set()
    assert dog.pending == 0


def test_a_nearer_deadline_armed_after_a_far_one_fires_first() -> None:
    dog = Watchdog("test-watchdog")
    far, near = threading.Event(), threading.Event()
    dog.arm(time.monotonic() + 3600, far.set)
    dog.arm(time.monotonic() + 0.05, near.set)
    assert near.wait(10)
    assert not far.is_set()
    assert dog.pending == 1


def test_deadlines_later_than_the_next_wake_up_do_not_wake_the_thread() -> None:
    dog = Watchdog("test-watchdog")
    dog._cond = cond = CountingCondition()
    fired = threading.Event()
    dog.arm(time.monotonic() + 0.01, fired.set)
    assert fired.wait(10)
    before = cond.notified
    for _ in range(500):  # what 500 warm fetches do: arm a deadline, cancel it on the answer
        dog.arm(time.monotonic() + 3600, lambda: None).cancel()
    # at most the first wakes it (when it sleeps with nothing due); it then sleeps towards
    # that deadline, which every later one follows
    assert cond.notified - before <= 1
    assert dog.pending == 0
