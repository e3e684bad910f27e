"""A stream keeps its extent when a publish that reached it is refused by a full disk (issue 30).

Theory of operation: a message routed to several queues reserves room in every one of them
before it is written anywhere (``model.publish.reserve``: a full disk stores it everywhere or
nowhere). Reserving room in a stream whose write segment is full rolls a new, empty segment.
If retention then ran at once, a stream capped by ``x-max-length-bytes`` lost its last records
to an empty segment, and when the next queue met the full disk and the publish was refused,
the stream was left empty: a count of 0, which the Spark source's AMQP mode read as the extent
(0, 0) instead of (first, next). Here a fanout exchange reaches the stream first and a second
stream after it; a message of 120 KiB needs a new segment in each, and a tmpfs with 200 KiB
free has room for one: the publish is nacked and the first stream must still hold its last
records, with the same extent, also after kill -9.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pika
import pytest

from ._support import connect, unique
from ._tmpfs import NEEDS, NamespacedBroker, mount_tmpfs, tmpfs_broker
from .single_faults import confirm_pipelined

pytestmark = [NEEDS, pytest.mark.timeout(240)]

SIZE = 12 * 1024 * 1024
SEGMENT = 1024 * 1024
BIG = 120 * 1024  # one frame; a new segment of this much fits in the 200 KiB left once, not twice


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[tuple[Path, int]]:
    yield from mount_tmpfs(tmp_path, SIZE)


@pytest.fixture
def broker(tmpfs: tuple[Path, int], tmp_path: Path) -> Iterator[NamespacedBroker]:
    yield from tmpfs_broker(tmpfs, tmp_path, ["--free-disk-min", "0", "--segment-size", str(SEGMENT)])


def _extent(b: NamespacedBroker, stream: str) -> tuple[int, int]:
    from broker.spark.amqp import extent

    return extent(b.url, stream, timeout=20)


def test_a_refused_publish_leaves_the_stream_its_records(broker: NamespacedBroker,
                                                         tmpfs: tuple[Path, int]) -> None:
    pytest.importorskip("pyspark")
    b = broker
    mnt, _ = tmpfs
    ex, stream, other = unique("fan"), unique("stream"), unique("other")
    conn = connect(b)
    ch = conn.channel()
    ch.confirm_delivery()
    ch.exchange_declare(ex, "fanout", durable=True)
    ch.queue_declare(stream, durable=True, arguments={
        "x-queue-type": "stream", "x-stream-max-segment-size-bytes": 8192, "x-max-length-bytes": 1})
    ch.queue_declare(other, durable=True, arguments={
        "x-queue-type": "stream", "x-stream-max-segment-size-bytes": 8192})
    ch.queue_bind(stream, ex)  # reached first
    ch.queue_bind(other, ex)
    persistent = pika.BasicProperties(delivery_mode=2)
    for i in range(20):
        ch.basic_publish("", stream, b"s%04d" % i * 200, persistent)
    conn.close()
    before = _extent(b, stream)
    assert before[1] == 20 and before[0] < 20, before
    b.run_inside("dd", "if=/dev/zero", f"of={mnt}/filler", "bs=64K")
    b.run_inside("truncate", "-s", "-200K", f"{mnt}/filler")
    acked, nacked, note = confirm_pipelined(b, ex, BIG, lambda: 1, max_batches=1)
    assert (acked, nacked, note) == (set(), {1}, None)
    assert _extent(b, stream) == before  # not (0, 0): the stream kept its last records
    b.kill9()
    assert b.run_inside("rm", "-f", f"{mnt}/filler").returncode == 0
    b.start()
    assert _extent(b, stream) == before
    assert "Traceback" not in b.log_text(), b.log_tail()
