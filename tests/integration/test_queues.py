"""Queue declaration flavours, purge/delete and queue-level errors, through pika."""

from __future__ import annotations

from typing import Any

import pika
import pytest

from ._support import (
    Broker,
    Cleanup,
    channel_error,
    connect,
    drain,
    exists_queue,
    queue_count,
    unique,
    wait_until,
)

# Durable state: also against a cluster leader and through a follower (_cluster_modes.py).
pytestmark = pytest.mark.cluster_modes


def test_durable_queue_declare_and_passive_counts(
    pika_conn: pika.BlockingConnection, cleanup: Cleanup
) -> None:
    ch = pika_conn.channel()
    q = cleanup.queue()
    ok = ch.queue_declare(q, durable=True)
    assert ok.method.queue == q
    assert ok.method.message_count == 0 and ok.method.consumer_count == 0
    for i in range(3):
        ch.basic_publish("", q, b"%d" % i, pika.BasicProperties(delivery_mode=2))
    ch.basic_consume(q, lambda *a: None)
    ok = ch.queue_declare(q, passive=True)
    # One consumer, no prefetch: the 3 messages may already be in flight to it.
    assert ok.method.consumer_count == 1
    assert 0 <= ok.method.message_count <= 3
    # Redeclaring with identical arguments is fine and returns the same name.
    assert pika_conn.channel().queue_declare(q, durable=True).method.queue == q


def test_server_named_queue(pika_conn: pika.BlockingConnection) -> None:
    ch = pika_conn.channel()
    names = {ch.queue_declare("", exclusive=True).method.queue for _ in range(5)}
    assert len(names) == 5
    for n in names:
        assert n.startswith("amq.gen-"), n
        ch.basic_publish("", n, b"x")
        assert drain(ch, n) == [b"x"]


def test_exclusive_queue_locked_to_owner_and_deleted_on_close(shared_broker: Broker) -> None:
    owner = connect(shared_broker)
    other = connect(shared_broker)
    try:
        q = unique("excl")
        owner.channel().queue_declare(q, exclusive=True)
        with channel_error(405):
            other.channel().queue_declare(q, exclusive=True)
        with channel_error(405):
            other.channel().basic_consume(q, lambda *a: None)
        with channel_error(405):
            other.channel().queue_delete(q)
        assert other.is_open
        owner.close()
        wait_until(lambda: not exists_queue(other, q), what="exclusive queue deleted after its owner closed")
    finally:
        for c in (owner, other):
            if c.is_open:
                c.close()


def test_auto_delete_after_last_consumer_cancels(
    pika_conn: pika.BlockingConnection, cleanup: Cleanup
) -> None:
    ch = pika_conn.channel()
    q = cleanup.queue()
    ch.queue_declare(q, auto_delete=True)
    t1 = ch.basic_consume(q, lambda *a: None)
    t2 = ch.basic_consume(q, lambda *a: None)
    ch.basic_cancel(t1)
    assert exists_queue(pika_conn, q), "deleted while a consumer remained"
    ch.basic_cancel(t2)
    wait_until(lambda: not exists_queue(pika_conn, q), what="auto-delete queue removed")


def test_auto_delete_queue_without_consumers_stays(
    pika_conn: pika.BlockingConnection, cleanup: Cleanup
) -> None:
    ch = pika_conn.channel()
    q = cleanup.queue()
    ch.queue_declare(q, auto_delete=True)
    ch.basic_publish("", q, b"x")
    assert queue_count(pika_conn, q) == 1  # never had a consumer -> not deleted


def test_passive_missing_queue_404_closes_only_that_channel(pika_conn: pika.BlockingConnection) -> None:
    other = pika_conn.channel()
    ch = pika_conn.channel()
    with channel_error(404):
        ch.queue_declare(unique("missing"), passive=True)
    assert not ch.is_open
    assert pika_conn.is_open and other.is_open
    q = other.queue_declare("", exclusive=True).method.queue
    fresh = pika_conn.channel()
    fresh.basic_publish("", q, b"ok")
    assert drain(fresh, q) == [b"ok"]


def test_purge_returns_count(pika_conn: pika.BlockingConnection) -> None:
    ch = pika_conn.channel()
    q = ch.queue_declare("", exclusive=True).method.queue
    for _i in range(7):
        ch.basic_publish("", q, b"m")
    assert ch.queue_purge(q).method.message_count == 7
    assert ch.queue_purge(q).method.message_count == 0
    assert queue_count(pika_conn, q) == 0


def test_purge_keeps_unacked(pika_conn: pika.BlockingConnection) -> None:
    ch = pika_conn.channel()
    q = ch.queue_declare("", exclusive=True).method.queue
    for i in range(3):
        ch.basic_publish("", q, b"%d" % i)
    m, _, _ = ch.basic_get(q, auto_ack=False)
    assert m is not None
    assert ch.queue_purge(q).method.message_count == 2
    ch.basic_reject(m.delivery_tag, requeue=True)
    assert drain(ch, q) == [b"0"]


def test_delete_returns_count_and_if_empty_if_unused(
    pika_conn: pika.BlockingConnection, cleanup: Cleanup
) -> None:
    ch = pika_conn.channel()
    q = cleanup.queue()
    ch.queue_declare(q)
    ch.basic_publish("", q, b"x")
    ch.basic_publish("", q, b"y")
    wait_until(lambda: queue_count(pika_conn, q) == 2, what="2 messages enqueued")
    with channel_error(406):
        ch.queue_delete(q, if_empty=True)
    assert exists_queue(pika_conn, q)

    ch = pika_conn.channel()
    tag = ch.basic_consume(q, lambda *a: None)
    with channel_error(406):
        pika_conn.channel().queue_delete(q, if_unused=True)
    ch.basic_cancel(tag)
    ch.close()  # requeues whatever the consumer held unacked
    assert pika_conn.is_open
    wait_until(lambda: queue_count(pika_conn, q) == 2, what="unacked messages requeued")

    ok = pika_conn.channel().queue_delete(q, if_unused=True)
    assert ok.method.message_count == 2
    assert not exists_queue(pika_conn, q)


def test_delete_missing_queue_is_ok_or_404(pika_conn: pika.BlockingConnection) -> None:
    # AMQP 0-9-1 spec says 404; RabbitMQ (since 3.x) answers delete-ok with 0
    # for a queue that does not exist. Both behaviours are accepted here.
    ch = pika_conn.channel()
    try:
        ok = ch.queue_delete(unique("missing"))
    except pika.exceptions.ChannelClosedByBroker as exc:
        assert exc.reply_code == 404
    else:
        assert ok.method.message_count == 0
    assert pika_conn.is_open


@pytest.mark.parametrize(
    "first,second",
    [
        ({"durable": False}, {"durable": True}),
        ({"auto_delete": False}, {"auto_delete": True}),
        ({"arguments": {"x-max-length": 10}}, {"arguments": {"x-max-length": 11}}),
        ({"arguments": {"x-message-ttl": 60000}}, {}),
    ],
    ids=["durable", "auto_delete", "x-max-length", "x-message-ttl-missing"],
)
def test_redeclare_with_different_args_is_406_on_that_channel(
    pika_conn: pika.BlockingConnection, cleanup: Cleanup, first: dict[str, Any], second: dict[str, Any]
) -> None:
    q = cleanup.queue()
    pika_conn.channel().queue_declare(q, **first)
    other = pika_conn.channel()
    ch = pika_conn.channel()
    with channel_error(406):
        ch.queue_declare(q, **second)
    assert pika_conn.is_open and other.is_open
    assert other.queue_declare(q, **first).method.queue == q


def test_declare_amq_prefixed_queue_is_403(pika_conn: pika.BlockingConnection) -> None:
    ch = pika_conn.channel()
    with channel_error(403):
        ch.queue_declare("amq." + unique("q"))
    assert pika_conn.is_open


def test_bind_missing_queue_or_exchange_is_404(pika_conn: pika.BlockingConnection) -> None:
    ch = pika_conn.channel()
    q = ch.queue_declare("", exclusive=True).method.queue
    with channel_error(404):
        ch.queue_bind(q, unique("nox"), routing_key="k")
    ch = pika_conn.channel()
    with channel_error(404):
        ch.queue_bind(unique("noq"), "amq.direct", routing_key="k")
    assert pika_conn.is_open
