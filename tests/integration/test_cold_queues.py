"""Cold queues (issue 31): a new queue's first segment is made off the event loop when the queue
is declared (``segment_log``: ``_prepare_first``), and the first message only maps it. The
behaviour a client sees must not change: the first confirmed message into each of many new
durable queues is delivered on a single node, the cluster's leader and through a follower
(``cluster_modes``), and survives kill -9 together with queues whose first segment was made but
never used."""

from __future__ import annotations

from typing import Any

import pika
import pytest

from ._support import Broker, connect, is_external, queue_count, unique

QUEUES = 40
PERSISTENT = pika.BasicProperties(delivery_mode=2)


def _declare_and_publish(b: Any, names: list[str], publish_to: list[str]) -> None:
    conn = connect(b)
    try:
        ch = conn.channel()
        ch.confirm_delivery()
        for q in names:
            ch.queue_declare(q, durable=True)
        for q in publish_to:  # each confirm: the message is on disk (pika raises otherwise)
            ch.basic_publish("", q, f"first {q}".encode(), PERSISTENT, mandatory=True)
    finally:
        conn.close()


def _take_all(b: Any, names: list[str], expect: set[str], delete: bool = False) -> None:
    conn = connect(b)
    try:
        ch = conn.channel()
        for q in names:
            m, _, body = ch.basic_get(q, auto_ack=True)
            if q in expect:
                assert body == f"first {q}".encode(), (q, m, body)
            else:
                assert m is None, (q, body)
            if delete:
                ch.queue_delete(q)
    finally:
        conn.close()


@pytest.mark.cluster_modes
def test_the_first_message_into_each_new_queue_is_delivered(shared_broker: Any) -> None:
    names = [unique("cold") for _ in range(QUEUES)]
    _declare_and_publish(shared_broker, names, names)
    _take_all(shared_broker, names, set(names), delete=True)


@pytest.mark.skipif(is_external(), reason="kills the Skred process")
def test_first_segments_made_and_used_survive_kill_9(broker: Broker) -> None:
    names = [unique("cold") for _ in range(QUEUES)]
    used = names[1::2]  # the others keep a first segment made ahead and never used
    _declare_and_publish(broker, names, used)
    broker.kill9()
    broker.start()
    conn = connect(broker)
    try:
        for q in names:
            assert queue_count(conn, q) == (1 if q in used else 0), q
    finally:
        conn.close()
    _take_all(broker, names, set(used))
    _declare_and_publish(broker, names, names)  # every queue takes appends again
    _take_all(broker, names, set(names), delete=True)
