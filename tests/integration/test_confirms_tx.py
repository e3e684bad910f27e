"""Publisher confirms and transactions, through pika."""

from __future__ import annotations

from typing import Any

import pika
import pytest

from ._support import channel_error, connect, drain, queue_count, unique, wait_until

# Durable state: also against a cluster leader and through a follower (_cluster_modes.py).
pytestmark = pytest.mark.cluster_modes


def test_confirms_many_messages(pika_conn: pika.BlockingConnection) -> None:
    ch = pika_conn.channel()
    q = ch.queue_declare("", exclusive=True).method.queue
    ch.confirm_delivery()
    n = 1000
    for i in range(n):
        # BlockingChannel waits for each basic.ack; a nack would raise NackError
        ch.basic_publish("", q, b"%d" % i, pika.BasicProperties(delivery_mode=2))
    assert queue_count(pika_conn, q) == n
    assert drain(ch, q) == [b"%d" % i for i in range(n)]


def test_confirm_mandatory_unroutable_raises(pika_conn: pika.BlockingConnection) -> None:
    ch = pika_conn.channel()
    ch.confirm_delivery()
    with pytest.raises(pika.exceptions.UnroutableError):
        ch.basic_publish("amq.direct", unique("nowhere"), b"x", mandatory=True)
    # an unroutable non-mandatory message is simply confirmed
    ch.basic_publish("amq.direct", unique("nowhere"), b"y")
    assert ch.is_open


def test_confirm_publish_to_missing_exchange_closes_channel(pika_conn: pika.BlockingConnection) -> None:
    ch = pika_conn.channel()
    ch.confirm_delivery()
    with channel_error(404):
        ch.basic_publish(unique("missing"), "k", b"x")
    assert pika_conn.is_open


def test_tx_commit_and_rollback_publishes(pika_conn: pika.BlockingConnection) -> None:
    ch = pika_conn.channel()
    q = ch.queue_declare("", exclusive=True).method.queue
    ch.tx_select()
    for b in (b"r1", b"r2", b"r3"):
        ch.basic_publish("", q, b)
    assert queue_count(pika_conn, q) == 0, "uncommitted publishes must not be visible"
    ch.tx_rollback()
    assert queue_count(pika_conn, q) == 0
    for b in (b"c1", b"c2"):
        ch.basic_publish("", q, b)
    ch.tx_commit()
    assert queue_count(pika_conn, q) == 2
    # the channel stays transactional after commit
    ch.basic_publish("", q, b"c3")
    ch.tx_rollback()
    assert drain(pika_conn.channel(), q) == [b"c1", b"c2"]


def test_tx_acks_take_effect_only_on_commit(pika_conn: pika.BlockingConnection) -> None:
    setup = pika_conn.channel()
    q = setup.queue_declare("", exclusive=True).method.queue
    for b in (b"a", b"b"):
        setup.basic_publish("", q, b)
    ch = pika_conn.channel()
    ch.tx_select()
    m, _, body = ch.basic_get(q, auto_ack=False)
    assert body == b"a"
    ch.basic_ack(m.delivery_tag)
    ch.tx_rollback()  # discards the ack: the message stays unacked on this channel
    ch.close()  # ... so closing the channel requeues it
    wait_until(lambda: queue_count(pika_conn, q) == 2, what="rolled-back ack requeued")

    ch = pika_conn.channel()
    ch.tx_select()
    m, _, body = ch.basic_get(q, auto_ack=False)
    assert body == b"a"
    ch.basic_ack(m.delivery_tag)
    ch.tx_commit()
    ch.close()
    wait_until(lambda: queue_count(pika_conn, q) == 1, what="committed ack applied")
    assert drain(pika_conn.channel(), q) == [b"b"]


def test_tx_commit_without_select_is_406(pika_conn: pika.BlockingConnection) -> None:
    ch = pika_conn.channel()
    with channel_error(406):
        ch.tx_commit()
    ch = pika_conn.channel()
    with channel_error(406):
        ch.tx_rollback()
    assert pika_conn.is_open


def test_confirm_and_tx_are_exclusive(pika_conn: pika.BlockingConnection) -> None:
    ch = pika_conn.channel()
    ch.tx_select()
    with channel_error(406):
        ch.confirm_delivery()
    ch = pika_conn.channel()
    ch.confirm_delivery()
    with channel_error(406):
        ch.tx_select()
    assert pika_conn.is_open


def test_a_synchronous_confirm_publisher_into_a_backlogged_queue_with_a_consumer(broker: Any) -> None:
    """pika ``confirm_delivery`` waits for each confirm; the queue has a backlog and a consumer
    (at its prefetch, not acking). Every publish is confirmed and stored in order; the broker's
    publisher hold (net/server.py) must not apply to such a publisher (the mechanism is tested
    in tests/test_publish_defects.py; benchmarks/run.py scenario 6 measures the rate)."""
    setup = connect(broker)
    q = unique("backlog")
    sch = setup.channel()
    sch.queue_declare(q)
    for i in range(2000):
        sch.basic_publish("", q, b"backlog-%d" % i)
    cons = connect(broker)
    cch = cons.channel()
    cch.basic_qos(prefetch_count=10)
    cch.basic_consume(q, lambda *a: None)  # takes 10, never acks: the backlog stays
    cons.process_data_events(time_limit=0.2)
    pub = connect(broker)
    pch = pub.channel()
    pch.confirm_delivery()
    for i in range(300):
        pch.basic_publish("", q, b"sync-%d" % i, pika.BasicProperties(delivery_mode=2))
    wait_until(lambda: queue_count(setup, q) == 2300 - 10, what="backlog + sync publishes queued")
    for c in (pub, cons, setup):
        c.close()
