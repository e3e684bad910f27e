"""Acks, rejects, nacks, purges and the delivered mark survive kill -9 (issue 14, item 1).

Theory of operation: each test owns a broker process. Messages are published with
confirms (so they are on disk), then settled (ack / reject / nack / purge) or only
delivered. After the durability window (``ack_sync_interval``, 1 s by default) has
passed, the broker is killed with SIGKILL and restarted on the same data dir: nothing
settled may come back, and everything delivered but unsettled must come back flagged
``redelivered``. With ``ack_sync_interval = 0`` (synchronous) the same holds with no
wait at all: the kill follows the settlement's round trip at once.

The waits below are the property under test (time passing beyond the window), not a
synchronisation: the broker offers no event that says "this ack is durable".
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pika
import pytest

from ._support import Broker, connect, is_external, queue_count, unique

pytestmark = pytest.mark.skipif(
    is_external(),
    reason="kills the Skred process; SKRED_TEST_EXTERNAL_URL points at an external broker",
)

N = 400
WINDOW = 1.0  # the default ack_sync_interval, seconds


def _fill(ch: pika.adapters.blocking_connection.BlockingChannel, queue: str, n: int = N) -> None:
    ch.queue_declare(queue, durable=True)
    for i in range(n):
        ch.basic_publish("", queue, str(i).encode(), pika.BasicProperties(delivery_mode=2))


def _take(conn: pika.BlockingConnection, queue: str, n: int = N) -> tuple[
        pika.adapters.blocking_connection.BlockingChannel, list[int]]:
    """Consume ``n`` messages with manual ack on a fresh channel; returns (channel, tags)."""
    ch = conn.channel()
    ch.basic_qos(prefetch_count=n)
    tags: list[int] = []
    ch.basic_consume(queue, lambda c, m, p, b: tags.append(m.delivery_tag))
    deadline = time.monotonic() + 30
    while len(tags) < n and time.monotonic() < deadline:
        conn.process_data_events(0.05)
    assert len(tags) == n, f"{queue}: received {len(tags)} of {n}"
    return ch, tags


def _settle_all(broker: Broker) -> list[str]:
    """Four queues of N confirmed messages: acked one by one, rejected, nacked, purged.
    Nothing is published after the settlements (a confirm would force a sync)."""
    names = [unique(k) for k in ("ack", "reject", "nack", "purge")]
    conn = connect(broker)
    pub = conn.channel()
    pub.confirm_delivery()
    for q in names:
        _fill(pub, q)
    settle: list[Callable[[pika.adapters.blocking_connection.BlockingChannel, int], None]] = [
        lambda c, t: c.basic_ack(t),
        lambda c, t: c.basic_reject(t, requeue=False),
        lambda c, t: c.basic_nack(t, requeue=False),
    ]
    for q, how in zip(names, settle, strict=False):
        ch, tags = _take(conn, q)
        for t in tags:
            how(ch, t)
        ch.close()  # a round trip: every settlement before it was processed
    pub.queue_purge(names[3])
    for q in names:
        assert queue_count(conn, q) == 0, q
    conn.close()
    return names


def _deliver_unacked(broker: Broker) -> tuple[str, pika.BlockingConnection]:
    """N confirmed messages delivered and left unacked; the caller keeps the connection open."""
    q = unique("unacked")
    conn = connect(broker)
    pub = conn.channel()
    pub.confirm_delivery()
    _fill(pub, q)
    _take(conn, q)
    pub.queue_declare(q, passive=True)  # a round trip after the deliveries went out
    return q, conn


def _after_kill9(broker: Broker, settled: list[str], unacked: str) -> None:
    assert isinstance(broker.pid, int)
    broker.kill9()
    broker.start()
    conn = connect(broker)
    back = {q: queue_count(conn, q) for q in settled}
    assert back == dict.fromkeys(settled, 0), f"settled messages came back after kill -9: {back}"
    ch = conn.channel()
    flags: list[bool] = []
    for _ in range(N + 1):
        m, _, _body = ch.basic_get(unacked, auto_ack=True)
        if m is None:
            break
        flags.append(bool(m.redelivered))
    assert len(flags) == N, f"{len(flags)} of {N} delivered messages came back"
    missing = flags.count(False)
    assert missing == 0, f"{missing} of {N} delivered messages came back without redelivered"
    conn.close()


def test_settlements_older_than_the_window_survive_kill9(broker: Broker) -> None:
    unacked, _held = _deliver_unacked(broker)
    settled = _settle_all(broker)
    time.sleep(2 * WINDOW)  # let the window pass (the property under test)
    _after_kill9(broker, settled, unacked)


def test_deliveries_just_before_kill9_come_back_redelivered(
        broker_factory: Callable[..., Broker]) -> None:
    """No wait at all with the default window: the delivered mark on disk lags these
    deliveries, so the store, not closed cleanly, must flag everything it recovers. A
    clean restart first, so the store starts from a "closed cleanly" meta it must
    overwrite before delivering."""
    broker = broker_factory([])
    q = unique("fresh")
    conn = connect(broker)
    pub = conn.channel()
    pub.confirm_delivery()
    _fill(pub, q)
    conn.close()
    broker.stop()
    broker.start()
    conn = connect(broker)
    _take(conn, q, N // 2)
    conn.channel().queue_declare(q, passive=True)  # a round trip after the deliveries went out
    assert isinstance(broker.pid, int)
    broker.kill9()
    broker.start()
    conn = connect(broker)
    ch = conn.channel()
    flags = []
    for _ in range(N + 1):
        m, _, _body = ch.basic_get(q, auto_ack=True)
        if m is None:
            break
        flags.append(bool(m.redelivered))
    assert len(flags) == N
    assert flags[: N // 2].count(False) == 0, f"{flags[: N // 2].count(False)} delivered came back unflagged"
    conn.close()


def test_synchronous_settlements_survive_an_immediate_kill9(
        broker_factory: Callable[..., Broker]) -> None:
    broker = broker_factory(["--ack-sync-interval", "0"])
    unacked, _held = _deliver_unacked(broker)
    settled = _settle_all(broker)
    _after_kill9(broker, settled, unacked)
