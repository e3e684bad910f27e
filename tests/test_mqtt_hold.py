"""The MQTT publisher hold (``broker/mqtt/hold.py``) on real queues of a real vhost: who waits,
who goes, in which order, and that nobody waits longer than ``longest``."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from broker.model.publish import PublishRequest
from broker.model.queue import Consumer, Queue
from broker.model.vhost import VHost
from broker.mqtt.hold import PublisherHold
from broker.store.sink import NullSink


class _Full(Consumer):
    """A subscriber at its in-flight limit: takes nothing now."""

    def ready(self) -> bool:
        return False


class _Publisher:
    """A held connection; read again, it publishes ``burst`` messages (what its socket held)."""

    def __init__(self, name: str, order: list[str], vh: VHost | None = None, burst: int = 0) -> None:
        self.name = name
        self.order = order
        self.vh = vh
        self.burst = burst

    def read_again(self) -> None:
        self.order.append(self.name)
        for i in range(self.burst):
            assert self.vh is not None
            self.vh.publish(PublishRequest("", "mqtt-subscription-s", b"\x00\x00", b"b%d" % i, 0))


def _queue(tmp_path: Path, ready: int, consumed: bool = True) -> tuple[VHost, Queue]:
    vh = VHost("/", tmp_path / "data", segment_size=64 * 1024, sink=NullSink(), schedule=lambda cb: None,
               mark_dirty=lambda _obj: None, transient_root=tmp_path / "transient")
    q, _ = vh.declare_queue("mqtt-subscription-s", durable=False, owner=None)
    if consumed:
        q.add_consumer(_Full("c", q, no_ack=False, exclusive=False))
    for i in range(ready):
        vh.publish(PublishRequest("", q.name, b"\x00\x00", b"m%d" % i, 0))
    assert q.message_count == ready
    return vh, q


def _drain(q: Queue, n: int) -> None:
    for _ in range(n):
        got = q.get()
        assert got is not None
        q.ack(got[0])


async def _until(cond: object, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not cond() and time.monotonic() < deadline:  # type: ignore[operator]
        await asyncio.sleep(0.002)


def test_a_backlog_holds_its_publishers_and_lets_them_go_a_few_at_a_time(tmp_path: Path) -> None:
    vh, q = _queue(tmp_path, ready=30)

    async def run() -> list[str]:
        hold = PublisherHold(backlog=20, tick=0.001, longest=60.0)
        order: list[str] = []
        assert hold.backlogged([q])
        for i in range(5):
            hold.hold(_Publisher(f"p{i}", order, vh, 5), [q], 5)
        await asyncio.sleep(0.05)
        assert order == []  # 30 ready > 20: everyone waits
        _drain(q, 20)  # 10 ready: room for two reads of 5, not three
        await _until(lambda: len(order) >= 2)
        await asyncio.sleep(0.02)
        assert order == ["p0", "p1"]
        assert q.message_count == 20  # their reads refilled it: the others wait
        _drain(q, 20)  # empty: the other three fit (15 <= 20)
        await _until(lambda: len(order) == 5)
        hold.close()
        return order

    assert asyncio.run(run()) == ["p0", "p1", "p2", "p3", "p4"]
    vh.close()


def test_a_consumer_that_never_takes_only_slows_its_publishers(tmp_path: Path) -> None:
    vh, q = _queue(tmp_path, ready=50)

    async def run() -> float:
        hold = PublisherHold(backlog=20, tick=0.001, longest=0.1)
        order: list[str] = []
        t0 = time.monotonic()
        hold.hold(_Publisher("p", order), [q], 1)
        await _until(lambda: order == ["p"])
        waited = time.monotonic() - t0
        assert not hold.backlogged([q])  # a stalled queue holds nobody (its messages just wait)
        q.n_delivered += 1  # its consumer took one: it holds again
        assert hold.backlogged([q])
        hold.close()
        return waited

    waited = asyncio.run(run())
    assert 0.09 <= waited < 5.0
    vh.close()


def test_queues_without_consumers_hold_nobody(tmp_path: Path) -> None:
    vh, q = _queue(tmp_path, ready=50, consumed=False)
    assert not PublisherHold(backlog=20).backlogged([q])
    vh.close()


def test_a_loop_turn_takes_a_bounded_number_of_publishes() -> None:
    async def run() -> list[str]:
        hold = PublisherHold()
        order: list[str] = []
        for _ in range(hold.turn_limit):
            assert not hold.turn_full()
            hold.count()
        assert hold.turn_full()
        hold.wait_turn(_Publisher("late", order))
        assert order == []
        await _until(lambda: order == ["late"])
        assert not hold.turn_full()
        hold.close()
        return order

    assert asyncio.run(run()) == ["late"]


def test_a_stalled_line_lets_each_go_once_per_look(tmp_path: Path) -> None:
    """Publishers that wait again at once (their queue still full) are not let go again in the
    same look: the look ends."""
    vh, q = _queue(tmp_path, ready=50)

    async def run() -> int:
        hold = PublisherHold(backlog=20, tick=0.001, longest=0.02)
        order: list[str] = []

        class _Again(_Publisher):
            def read_again(self) -> None:
                super().read_again()
                if len(self.order) < 6:
                    hold.hold(self, [q], 1)

        hold.hold(_Again("p", order), [q], 1)
        await _until(lambda: len(order) >= 6)
        hold.close()
        return len(order)

    assert asyncio.run(run()) == 6
    vh.close()
