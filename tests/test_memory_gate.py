"""The memory gate's admission rule (broker/amqp/memory.py), without sockets.

Memory "used" is pinned by the test instead of measured, so each step is exact: a body is
admitted while used + admitted + its size stays under the watermark, or when nothing else is
admitted (so the gate never deadlocks); others wait in arrival order and are admitted as
earlier bodies complete.
"""

from __future__ import annotations

from broker.amqp.memory import MemoryAlarm, watermark
from broker.config import load_config

MiB = 1 << 20


class Conn:
    def __init__(self) -> None:
        self.held = 0

    def admitted(self, total: int) -> None:
        self.held = total


class PinnedAlarm(MemoryAlarm):
    def measure(self) -> None:  # the test sets ``used``
        pass


def test_admission_order_and_release() -> None:
    gate = PinnedAlarm(100 * MiB)
    gate.used = 20 * MiB
    a, b, c = Conn(), Conn(), Conn()
    assert gate.request(a, 0, 50 * MiB)  # 20 + 50 fits
    a.held = 50 * MiB
    assert not gate.request(b, 0, 40 * MiB)  # 20 + 50 + 40 > 100: waits
    assert not gate.request(c, 0, 10 * MiB)  # would fit, but b came first
    assert gate.evaluate()  # someone waits: the alarm is on
    assert (b.held, c.held) == (0, 0)
    assert gate.request(a, a.held, 0)  # a's body is complete
    a.held = 0
    assert not gate.evaluate()  # measured again: b then c admitted, nobody waits
    assert (b.held, c.held) == (40 * MiB, 10 * MiB)
    assert gate.admitted == 50 * MiB


def test_one_body_always_goes_through() -> None:
    gate = PinnedAlarm(100 * MiB)
    gate.used = 150 * MiB  # already over the watermark
    a = Conn()
    assert gate.request(a, 0, 80 * MiB)  # nothing else admitted: never a deadlock
    assert gate.evaluate()  # but the alarm is on (used >= limit)
    b = Conn()
    assert not gate.request(b, 0, MiB)
    gate.release(a, 80 * MiB)  # a's connection closed
    gate.used = 10 * MiB
    assert not gate.evaluate()
    assert b.held == MiB


def test_a_connection_that_holds_some_asks_for_the_difference() -> None:
    gate = PinnedAlarm(100 * MiB)
    gate.used = 0
    a, b = Conn(), Conn()
    assert gate.request(a, 0, 30 * MiB)
    assert gate.request(b, 0, 30 * MiB)
    assert gate.request(a, 30 * MiB, 60 * MiB)  # 0 + 60 + 30 fits
    assert not gate.request(b, 30 * MiB, 60 * MiB)  # 0 + 90 + 30 does not
    assert gate.request(a, 60 * MiB, 0)
    gate.evaluate()
    assert b.held == 60 * MiB and gate.admitted == 60 * MiB


def test_watermark_from_config() -> None:
    main = load_config(["--vm-memory-high-watermark-absolute", "64MiB"], environ={}).main
    assert watermark(main.vm_memory_high_watermark, main.vm_memory_high_watermark_absolute) == 64 * MiB
    main = load_config(["--vm-memory-high-watermark", "0"], environ={}).main
    assert watermark(main.vm_memory_high_watermark, main.vm_memory_high_watermark_absolute) == 0
    relative = load_config([], environ={}).main.vm_memory_high_watermark
    assert relative == 0.4
    assert 0 < watermark(relative, 0) < watermark(0.8, 0)
    assert not PinnedAlarm(0).evaluate()  # off
