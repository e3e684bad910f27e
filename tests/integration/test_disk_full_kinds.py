"""A full disk stores a message routed to several queues in all of them or in none, whatever
kind of store each queue has (issue 14): a plain classic queue, a priority queue (one store
per level), a quorum queue (two levels) and a stream.

Theory of operation: a broker on a small tmpfs in a private mount namespace (``_tmpfs.py``),
the disk alarm off so that the stores themselves meet ENOSPC. A fanout exchange reaches the
four queues, the plain one bound first. The plain queue is given a head start (messages
published to it alone before the disk fills) so that its write segment already has room
allocated when the others need more: the first store to meet the full disk is one of the
other kinds, *after* the plain queue took the message, unless every store reserves its room
before any of them writes. Confirmed publishes go on until the first nack; then every queue
must hold exactly the confirmed messages (plus the plain queue's head start), before and
after kill -9.
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
HEAD_START = 600  # messages of 1 KiB in the plain queue alone: its allocation reaches 1 MiB


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[tuple[Path, int]]:
    yield from mount_tmpfs(tmp_path, SIZE)


@pytest.fixture
def broker(tmpfs: tuple[Path, int], tmp_path: Path) -> Iterator[NamespacedBroker]:
    yield from tmpfs_broker(tmpfs, tmp_path, ["--free-disk-min", "0", "--segment-size", str(SEGMENT)])


def _counts(b: NamespacedBroker, queues: dict[str, dict[str, object]]) -> dict[str, int]:
    conn = connect(b)
    try:
        ch = conn.channel()
        return {q: int(ch.queue_declare(q, passive=True).method.message_count) for q in queues}
    finally:
        conn.close()


@pytest.mark.parametrize("size", [1000, 7000])
def test_a_message_to_every_kind_of_store_is_all_or_nothing(
        broker: NamespacedBroker, tmpfs: tuple[Path, int], size: int) -> None:
    b = broker
    mnt, _ = tmpfs
    ex = unique("fan")
    queues: dict[str, dict[str, object]] = {
        unique("plain"): {},
        unique("prio"): {"x-max-priority": 5},
        unique("quorum"): {"x-queue-type": "quorum"},
        unique("stream"): {"x-queue-type": "stream"},
    }
    plain = next(iter(queues))
    conn = connect(b)
    ch = conn.channel()
    ch.confirm_delivery()
    ch.exchange_declare(ex, "fanout", durable=True)
    for q, args in queues.items():
        ch.queue_declare(q, durable=True, arguments=args)
        ch.queue_bind(q, ex)
    persistent = pika.BasicProperties(delivery_mode=2)
    for _ in range(HEAD_START):
        ch.basic_publish("", plain, b"h" * 1000, persistent)
    conn.close()
    b.run_inside("dd", "if=/dev/zero", f"of={mnt}/filler", "bs=64K")
    b.run_inside("truncate", "-s", "-200K", f"{mnt}/filler")
    acked, nacked, note = confirm_pipelined(b, ex, size, lambda: 1, max_batches=400)
    assert note is None, note
    assert acked and nacked, f"{len(acked)} acked, {len(nacked)} nacked: the disk never filled"
    want = {q: len(acked) + (HEAD_START if q == plain else 0) for q in queues}
    assert _counts(b, queues) == want, "a nacked message was stored in some queues"
    assert b.alive() and "Traceback" not in b.log_text(), b.log_tail()
    b.kill9()
    assert b.run_inside("rm", "-f", f"{mnt}/filler").returncode == 0
    b.start()
    assert _counts(b, queues) == want
    assert "Traceback" not in b.log_text()
