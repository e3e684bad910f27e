"""What a full disk must not do beyond SIGBUS (issue 14): half-store a run of publishes, lose
or crash on a timer's write, or corrupt the definitions log and JSON stores.

Theory of operation: a broker on a small tmpfs in a private mount namespace (``_tmpfs.py``),
the disk alarm off so that the store itself meets ENOSPC.

- Runs: a raw AMQP client pipelines batches of confirmed publishes to a fanout exchange
  with two queues (so the broker stores them as runs, crossing segment boundaries) until
  nacks come. Every message is answered once (ack or nack); acked ones are in both queues
  after kill -9, nacked ones in neither.
- Timers: delayed messages (``x-delayed-message``) and TTL dead letters fall due while the
  disk is full. The broker stays up with no traceback; once space is back they arrive.
- Definitions: a durable declare, a user, a vhost and a policy on a full disk get a clean
  error (AMQP 406 on the channel; HTTP 503); the files stay readable: after kill -9 the
  broker starts with every definition made before.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pika
import pytest
import requests

from ._support import connect, unique, wait_until
from ._tmpfs import NEEDS, NamespacedBroker, mount_tmpfs
from .single_faults import confirm_pipelined, drain, fanout_pair

pytestmark = [NEEDS, pytest.mark.timeout(240)]

SIZE = 12 * 1024 * 1024


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[tuple[Path, int]]:
    yield from mount_tmpfs(tmp_path, SIZE)


@pytest.fixture
def broker(tmpfs: tuple[Path, int], tmp_path: Path) -> Iterator[NamespacedBroker]:
    mnt, holder = tmpfs
    b = NamespacedBroker(mnt / "data", holder, ["--free-disk-min", "0", "--segment-size", "256KiB"])
    b.log_path = tmp_path / "broker.log"  # outside the tmpfs: readable from here
    try:
        b.start()
        yield b
    finally:
        b.close()


def _fill_disk(b: NamespacedBroker, mnt: Path, leave: int = 0) -> None:
    """Another process takes the space (``leave`` bytes free, roughly)."""
    b.run_inside("dd", "if=/dev/zero", f"of={mnt}/filler", "bs=64K")
    if leave:
        b.run_inside("truncate", "-s", f"-{leave}", f"{mnt}/filler")


def _free_disk(b: NamespacedBroker, mnt: Path) -> None:
    assert b.run_inside("rm", "-f", f"{mnt}/filler").returncode == 0


def _ids(b: NamespacedBroker, queue: str) -> list[int]:
    return [i for i, _ in drain(b, queue)]


def test_runs_on_a_full_disk_are_all_or_nothing(broker: NamespacedBroker, tmpfs: tuple[Path, int]) -> None:
    b = broker
    mnt, _ = tmpfs
    ex, qa, qb = fanout_pair(b)
    _fill_disk(b, mnt, leave=3 * 1024 * 1024)
    acked, nacked, note = confirm_pipelined(b, ex, 6000, lambda: 100, max_batches=60)
    assert note is None, note
    assert acked and nacked, f"{len(acked)} acked, {len(nacked)} nacked: the disk never filled"
    assert not acked & nacked
    b.kill9()
    _free_disk(b, mnt)
    b.start()
    for q in (qa, qb):
        got = _ids(b, q)
        assert len(got) == len(set(got)), f"{q}: duplicates"
        stored = set(got)
        assert acked <= stored, f"{q}: {len(acked - stored)} confirmed messages lost"
        assert not stored & nacked, f"{q}: {len(stored & nacked)} nacked messages stored"
    assert "Traceback" not in b.log_text()


def _count(b: NamespacedBroker, queue: str) -> int:
    conn = connect(b)
    try:
        return int(conn.channel().queue_declare(queue, passive=True).method.message_count)
    finally:
        conn.close()


def test_timer_writes_wait_for_space(broker: NamespacedBroker, tmpfs: tuple[Path, int]) -> None:
    """Delayed messages and TTL dead letters that fall due on a full disk are neither lost
    nor a traceback: they wait, and arrive once there is space again."""
    b = broker
    mnt, _ = tmpfs
    n, body = 150, b"d" * 4000
    dx, qd, qttl, qdl = unique("dx"), unique("qd"), unique("qttl"), unique("qdl")
    conn = connect(b)
    ch = conn.channel()
    ch.confirm_delivery()
    ch.exchange_declare(dx, "x-delayed-message", durable=True, arguments={"x-delayed-type": "direct"})
    ch.queue_declare(qd, durable=True)
    ch.queue_bind(qd, dx, routing_key="k")
    ch.queue_declare(qdl, durable=True)
    ch.queue_declare(qttl, durable=True, arguments={"x-message-ttl": 2500, "x-dead-letter-exchange": "",
                                                    "x-dead-letter-routing-key": qdl})
    persistent = pika.BasicProperties(delivery_mode=2, headers={"x-delay": 2500})
    for _ in range(n):
        ch.basic_publish(dx, "k", body, persistent)
        ch.basic_publish("", qttl, body, pika.BasicProperties(delivery_mode=2))
    conn.close()
    _fill_disk(b, mnt)
    wait_until(lambda: "due delayed messages wait" in b.log_text(), 30, "the delayed messages waiting")
    wait_until(lambda: "dead letters wait" in b.log_text(), 30, "the dead letters waiting")
    assert b.alive() and "Traceback" not in b.log_text(), b.log_tail()
    assert _count(b, qd) < n and _count(b, qdl) < n  # the full disk held some back
    _free_disk(b, mnt)
    wait_until(lambda: _count(b, qd) == n and _count(b, qdl) == n, 30, "every message, once space is back")
    assert _count(b, qttl) == 0
    time.sleep(2.0)  # the settlements' durability window (ack_sync_interval, 1 s) passes: the property
    b.kill9()  # and none of them twice after a crash: the sources were settled
    b.start()
    assert (_count(b, qd), _count(b, qdl), _count(b, qttl)) == (n, n, 0)
    assert "Traceback" not in b.log_text()


Channel = pika.adapters.blocking_connection.BlockingChannel


def _refused(b: NamespacedBroker, declare: Callable[[Channel], object]) -> int:
    """The reply code of a channel error ``declare`` gets (0: none)."""
    conn = connect(b)
    try:
        declare(conn.channel())
    except pika.exceptions.ChannelClosedByBroker as exc:
        return int(exc.reply_code)
    finally:
        if conn.is_open:
            conn.close()
    return 0


def test_definitions_on_a_full_disk(broker: NamespacedBroker, tmpfs: tuple[Path, int]) -> None:
    """A declare, a binding, a delete, a user, a vhost and a policy on a full disk get a clean
    error and change nothing, in memory or on disk; what is declared once space is back
    survives kill -9 (a torn record in the definitions log would hide it)."""
    b = broker
    mnt, _ = tmpfs
    api = f"http://{b.host}:{b.mgmt_port}/api"
    auth = ("guest", "guest")
    ex0, q0, ex1, ex2 = unique("ex0"), unique("q0"), unique("ex1"), unique("ex2")
    conn = connect(b)
    ch = conn.channel()
    ch.exchange_declare(ex0, "direct", durable=True)
    ch.queue_declare(q0, durable=True)
    ch.queue_bind(q0, ex0, "k0")
    conn.close()
    _fill_disk(b, mnt)
    pad = {"pad": "x" * 20000}  # more than the slack in the log's last page: a partial write
    assert _refused(b, lambda c: c.exchange_declare(ex1, "direct", durable=True, arguments=pad)) == 406
    assert _refused(b, lambda c: c.exchange_declare(ex1, "direct", passive=True)) == 404
    assert _refused(b, lambda c: c.queue_bind(q0, ex0, "k1", arguments=pad)) == 406
    assert _refused(b, lambda c: c.queue_unbind(q0, ex0, "k1", arguments=pad)) == 0  # it was never bound
    for what, body in (("users/u1", {"password": "p", "tags": ""}), ("vhosts/v1", {}),
                       ("policies/%2F/p1", {"pattern": "^zz", "definition": {"max-length": 1}})):
        r = requests.put(f"{api}/{what}", json=body, auth=auth, timeout=30)
        assert r.status_code == 503 and r.json()["error"] == "disk_full", (what, r.status_code, r.text)
        assert requests.get(f"{api}/{what}", auth=auth, timeout=30).status_code == 404, what
    assert b.alive() and "Traceback" not in b.log_text(), b.log_tail()
    _free_disk(b, mnt)
    conn = connect(b)
    conn.channel().exchange_declare(ex2, "fanout", durable=True)
    conn.close()
    b.kill9()
    b.start()
    assert _refused(b, lambda c: c.exchange_declare(ex2, "fanout", passive=True)) == 0, "lost after kill -9"
    assert _refused(b, lambda c: c.exchange_declare(ex1, "direct", passive=True)) == 404
    assert _refused(b, lambda c: c.queue_declare(q0, passive=True)) == 0
    assert requests.get(f"{api}/users/guest", auth=auth, timeout=30).status_code == 200
    binds = requests.get(f"{api}/exchanges/%2F/{ex0}/bindings/source", auth=auth, timeout=30).json()
    assert sorted(x["routing_key"] for x in binds) == ["k0"]
    assert "Traceback" not in b.log_text()
