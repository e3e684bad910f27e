"""Memory goes back after a peak (issue 31): what the broker keeps after many queues were used
and deleted, counted, and the heap pages the allocator keeps, given back.

The first test counts objects (not RSS): a real node's vhost and AMQP sessions fed frames (no
sockets, as benchmarks/hotpath.py does), 100 queues each declared, published to, consumed,
acked and deleted by a connection of its own that then closes; afterwards the live objects
by type must be where they were. The second runs in a child process (the allocator's settings
are process-wide): the node's heap settings, a peak of buffers interleaved with small objects
that stay (as connections' buffers and the objects of a long-lived broker are), then freed;
the memory alarm's measurement outside the alarm must give the free pages back. The third
measures at the top of such a peak first (as the node's once-a-second measurement does while the
queues are still there), then frees it: the next measurement must still give the pages back.
"""

from __future__ import annotations

import asyncio
import gc
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path
from typing import Any

from pamqp import commands
from pamqp import frame as pframe
from pamqp import header as pheader
from pamqp.body import ContentBody

from broker.amqp.session import Session
from broker.config import load_config
from broker.node import Node

REPO = Path(__file__).resolve().parents[1]


def _frames(*methods: object) -> bytes:
    return b"".join(pframe.marshal(m, 1) for m in methods)  # type: ignore[arg-type]


def _open(broker: object, port: int) -> Session:
    s = Session(broker, ("127.0.0.1", port), lambda: None)  # type: ignore[arg-type]
    s.receive_data(b"AMQP\x00\x00\x09\x01")
    s.receive_data(pframe.marshal(commands.Connection.StartOk(
        client_properties={"capabilities": {}}, mechanism="PLAIN", response="\x00guest\x00guest"), 0))
    s.receive_data(pframe.marshal(commands.Connection.TuneOk(2047, 131072, 0), 0))
    s.receive_data(pframe.marshal(commands.Connection.Open("/"), 0))
    s.receive_data(pframe.marshal(commands.Channel.Open(), 1))
    return s


def _use_and_delete(broker: object, name: str, port: int, durable: bool) -> None:
    """One connection: declare ``name``, publish three messages, consume and ack them, delete
    the queue, close."""
    s = _open(broker, port)
    body = b"m" * 300
    props = commands.Basic.Properties(delivery_mode=2 if durable else 1, message_id=name)
    publish = (pframe.marshal(commands.Basic.Publish(exchange="", routing_key=name), 1)
               + pframe.marshal(pheader.ContentHeader(0, len(body), props), 1)
               + pframe.marshal(ContentBody(body), 1))
    s.receive_data(_frames(commands.Queue.Declare(queue=name, durable=durable),
                           commands.Basic.Qos(prefetch_count=10)) + publish * 3)
    s.after_batch()
    s.receive_data(_frames(commands.Basic.Consume(queue=name, consumer_tag="c")))
    s.after_batch()
    q = broker.vhosts["/"].queues[name]  # type: ignore[attr-defined]
    q._deliver()
    s.receive_data(_frames(commands.Basic.Ack(delivery_tag=3, multiple=True)))
    s.after_batch()
    assert q.message_count == 0, q.message_count
    s.receive_data(_frames(commands.Basic.Cancel(consumer_tag="c"), commands.Queue.Delete(queue=name),
                           commands.Channel.Close(0, "", 0, 0)))
    s.receive_data(pframe.marshal(commands.Connection.Close(0, "", 0, 0), 0))
    s.after_batch()
    s.connection_lost()
    assert name not in broker.vhosts["/"].queues  # type: ignore[attr-defined]


def _live() -> Counter[str]:
    gc.collect()
    return Counter(type(o).__qualname__ for o in gc.get_objects())


def _grown(before: Counter[str], after: Counter[str]) -> dict[str, int]:
    return {k: after[k] - before[k] for k in after if after[k] - before[k] > 0}


async def _settled(broker: Any, before: Counter[str], deadline_s: float = 20.0) -> Counter[str]:
    """The live objects once the loop ran what the last operations scheduled: a full sync
    first (a deleted queue's store stays in the syncer's sets until the next full sync, the
    window's, which a plateau of polls could come before), then polled until nothing more goes
    away, with a deadline."""
    loop = asyncio.get_running_loop()
    end = loop.time() + deadline_s
    broker.syncer.sync_now()
    last = _live()
    while loop.time() < end:
        await asyncio.sleep(0.05)
        now = _live()
        if sum(_grown(before, now).values()) >= sum(_grown(before, last).values()):
            return now
        last = now
    return last


def test_used_and_deleted_queues_leave_no_objects_behind(tmp_path: Path) -> None:
    async def main() -> None:
        cfg = load_config(["--data-dir", str(tmp_path / "data"), "--no-mgmt"], environ={})
        broker = Node(cfg).load(asyncio.get_running_loop())
        try:
            for i in range(10):  # first-use caches, interned names, dict growth
                _use_and_delete(broker, f"warm-{i}", 1000 + i, i % 2 == 0)
                await asyncio.sleep(0)  # the deliveries and group commits it scheduled run
            before = await _settled(broker, _live())
            n = 100
            for i in range(n):
                _use_and_delete(broker, f"churn-{i:04d}", 2000 + i, i % 2 == 0)
                await asyncio.sleep(0)
            grown = _grown(before, await _settled(broker, before))
            # a queue left behind holds a dozen objects or more (queue, store, segments, sets,
            # consumers, channels): 100 queues would show as a hundred or more of one type
            assert sum(grown.values()) < n // 2, sorted(grown.items(), key=lambda kv: -kv[1])[:15]
        finally:
            for vh in broker.vhosts.values():
                vh.close()

    asyncio.run(main())


_PEAK_MADE = textwrap.dedent("""
    from broker.amqp.memory import MemoryAlarm, TRIM_EVERY, anon_memory
    from broker.node import keep_buffers_on_the_heap

    MiB = 1 << 20
    assert keep_buffers_on_the_heap()
    now = [0.0]
    alarm = MemoryAlarm(1 << 50, clock=lambda: now[0])  # a watermark never reached
    idle = anon_memory()
    kept, peak = [], []
    for i in range(1600):  # 100 MiB in 64 KiB buffers, each followed by a small object that stays
        peak.append(bytearray(64 * 1024))
        kept.append(bytearray(2048))
""")
_PEAK = _PEAK_MADE + textwrap.dedent("""
    top = anon_memory()
    del peak
    now[0] += TRIM_EVERY
    freed = anon_memory()
    alarm.measure()
    print(idle // MiB, top // MiB, freed // MiB, alarm.used // MiB, len(kept))
""")


def _child(script: str) -> tuple[list[int], str]:
    """``script`` run in a fresh interpreter (the allocator's settings are process-wide): the
    numbers it printed, and its output for the assertions' messages."""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         cwd=REPO, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    return [int(x) for x in out.stdout.split()], out.stdout


def test_freed_heap_pages_go_back_after_a_peak() -> None:
    (idle, top, freed, measured, _), stdout = _child(_PEAK)
    assert top - idle >= 90, stdout  # the peak was on the heap
    assert freed - idle >= 60, stdout  # freeing alone gave little back (glibc keeps it)
    assert measured - idle <= 15, stdout  # the measurement trimmed it


_PEAK_THEN_FREED = _PEAK_MADE + textwrap.dedent("""
    now[0] += TRIM_EVERY
    alarm.measure()  # measured at the top of the peak (the queues are still there)
    top = alarm.used
    del peak  # then the queues are deleted and their connections closed
    now[0] += TRIM_EVERY
    alarm.measure()
    print(idle // MiB, top // MiB, alarm.used // MiB, len(kept))
""")


def test_a_peak_measured_at_its_top_is_given_back_once_freed() -> None:
    (idle, top, measured, _), stdout = _child(_PEAK_THEN_FREED)
    assert top - idle >= 90, stdout  # the peak was resident when measured
    assert measured - idle <= 15, stdout  # freed after that measurement, and trimmed
