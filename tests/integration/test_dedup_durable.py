"""A deduplicating exchange's cache survives kill -9 and a leader's kill -9 (issue 30).

Exactly once through ``x-message-deduplication`` (the Spark sink's ``exactlyOnce`` to an
exchange) rests on the cache: a task retry re-publishes a batch whose first attempt was
confirmed, and the exchange must drop it. So the keys of confirmed messages must be where the
messages are: on disk before the confirm, and on the followers. Each test publishes keyed
messages with confirms, kills the broker (or the cluster's leader) with SIGKILL, publishes the
same keys again, and counts what the bound queue holds: the first attempt only, plus the new
keys. Small counts; one private broker or two-node cluster each.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pika
import pytest

from ._support import Broker, connect, count_at, unique, wait_until

KEYS = 20
SINK_ROWS = 500


def _declare(url: str, ex: str, q: str, kind: str = "direct", **arguments: Any) -> None:
    with pika.BlockingConnection(pika.URLParameters(url)) as conn:
        ch = conn.channel()
        ch.exchange_declare(ex, kind, durable=True,
                            arguments={"x-message-deduplication": True, "x-cache-size": 1000, **arguments})
        ch.queue_declare(q, durable=True)
        ch.queue_bind(q, ex, "k")


def _publish(url: str, ex: str, keys: range, tag: str) -> None:
    """Persistent messages keyed ``k<i>``, each confirmed (a run of them per call)."""
    with pika.BlockingConnection(pika.URLParameters(url)) as conn:
        ch = conn.channel()
        ch.confirm_delivery()
        for i in keys:
            ch.basic_publish(ex, "k", f"{tag}{i}".encode(), pika.BasicProperties(
                delivery_mode=2, headers={"x-deduplication-header": f"k{i}"}))


def _sink_task(url: str, ex: str) -> int:
    """The Spark sink's task (``exactlyOnce``, its batches framed whole: runs in the broker)
    writing SINK_ROWS rows, as Spark runs it and runs it again on a retry."""
    pa = pytest.importorskip("pyarrow")
    pytest.importorskip("pyspark.sql.datasource")
    from .test_spark_sink_amqp import _publish as sink_publish

    values = [b"s%d" % i for i in range(SINK_ROWS)]
    batches = [pa.record_batch([pa.array(values[:200], pa.binary())], names=["value"]),
               pa.record_batch([pa.array(values[200:], pa.binary())], names=["value"])]
    return sink_publish(url, batches, topic=ex, exactlyOnce="true", confirmWindow="64")


def test_confirmed_keys_survive_kill9(broker: Broker) -> None:
    ex, q = unique("dx"), unique("dq")
    mem_ex, mem_q = unique("mx"), unique("mq")
    sink_ex, sink_q = unique("sx"), unique("sq")
    _declare(broker.url, ex, q)
    _declare(broker.url, mem_ex, mem_q, **{"x-cache-persistence": "memory"})
    _declare(broker.url, sink_ex, sink_q, "fanout")
    _publish(broker.url, ex, range(KEYS), "first")
    _publish(broker.url, mem_ex, range(KEYS), "first")
    assert _sink_task(broker.url, sink_ex) == SINK_ROWS
    broker.kill9()
    broker.start()
    # the retry of a confirmed batch, and new keys after it
    _publish(broker.url, ex, range(KEYS + 5), "retry")
    _publish(broker.url, mem_ex, range(KEYS), "retry")
    assert _sink_task(broker.url, sink_ex) == SINK_ROWS  # the task retried: every row dropped
    assert count_at(broker.url, q) == KEYS + 5
    assert count_at(broker.url, sink_q) == SINK_ROWS
    # memory, as asked: the keys went with the process (RabbitMQ's plugin's default kind)
    assert count_at(broker.url, mem_q) == 2 * KEYS
    with connect(broker) as conn:
        ch = conn.channel()
        bodies = []
        for _ in range(KEYS + 5):
            _m, _p, body = ch.basic_get(q, auto_ack=True)
            bodies.append(body)
    assert bodies == [f"first{i}".encode() for i in range(KEYS)] + \
        [f"retry{i}".encode() for i in range(KEYS, KEYS + 5)]
    with connect(broker) as conn:
        ch = conn.channel()
        with pytest.raises(pika.exceptions.ChannelClosedByBroker) as ei:
            ch.exchange_declare(unique("bx"), "direct", durable=True, arguments={
                "x-message-deduplication": True, "x-cache-size": 10, "x-cache-persistence": "tape"})
        assert ei.value.reply_code == 406


def test_leader_kill9_new_leader_drops_a_retry(tmp_path: Path) -> None:
    from .test_cluster import Cluster, start_cluster, wait_for

    c = Cluster(tmp_path, ips=["127.0.0.1", "127.0.0.1"])
    try:
        leader, followers = start_cluster(c)
        follower = followers[0]
        ex, q = unique("cx"), unique("cq")
        _declare(follower.url, ex, q)
        _publish(follower.url, ex, range(KEYS), "first")  # through the follower's proxy
        _publish(leader.url, ex, range(KEYS, 2 * KEYS), "first")  # on the leader
        leader.kill9()
        killed = time.monotonic()
        successor = wait_for(lambda: c.leader() is follower and follower.answers(), c.ttl + 20,
                             "the follower leading")
        assert successor
        print(f"\nnew leader serving {time.monotonic() - killed:.1f} s after the kill")
        _publish(follower.url, ex, range(2 * KEYS + 3), "retry")
        wait_until(lambda: count_at(follower.url, q) >= 2 * KEYS, 10, "the first attempt's messages")
        assert count_at(follower.url, q) == 2 * KEYS + 3
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{c.diag()}") from None
    finally:
        c.close()
