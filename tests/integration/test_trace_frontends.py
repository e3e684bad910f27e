"""Firehose tracing for every front end, not only AMQP: a real paho-mqtt client, the management
API's publish and get, and LMQ's HTTP API each leave ``publish.<exchange>`` and
``deliver.<queue>`` copies on ``amq.rabbitmq.trace`` (as RabbitMQ traces MQTT and the management
publish), naming the user and the front end's connection; the queue reading the copies never
feeds itself. The module runs against a single node, the cluster's leader and through a follower
(``cluster_modes``): tracing is a durable vhost switch, and every client byte of the follower
mode is proxied to the leader."""

from __future__ import annotations

import time
import urllib.parse
from collections.abc import Iterator
from typing import Any

import pytest

from ._support import Broker, connect, is_external, run_async, unique
from .test_lmq import session
from .test_mgmt_api import Api
from .test_mqtt import Paho, cid

pytestmark = [pytest.mark.skipif(is_external(), reason="needs the broker's MQTT and LMQ ports"),
              pytest.mark.cluster_modes]

TRACE = "amq.rabbitmq.trace"
Copy = tuple[str, dict[str, Any], bytes]


def _node(b: Any) -> Any:
    return getattr(b, "node", b)  # a cluster-mode target: the node's own ports


def _api(b: Any) -> Api:
    api = Api(b.mgmt_port)
    api.base = f"http://{b.host}:{b.mgmt_port}"
    return api


@pytest.fixture
def firehose(shared_broker: Broker) -> Iterator[tuple[Any, str]]:
    """Tracing on for ``/`` and a queue bound to every copy; off again afterwards."""
    api = _api(shared_broker)
    conn = connect(shared_broker)
    ch = conn.channel()
    tq = unique("firehose")
    ch.queue_declare(tq)
    ch.queue_bind(tq, TRACE, "#")
    api.ok("PUT", "/api/vhosts/%2F", {"tracing": True})
    try:
        yield ch, tq
    finally:
        api.ok("PUT", "/api/vhosts/%2F", {"tracing": False})
        ch.queue_delete(tq)
        conn.close()


def _collect(ch: Any, tq: str, want: set[str], timeout: float = 15) -> list[Copy]:
    """The copies on ``tq`` until every routing key in ``want`` was seen (gets from ``tq`` are
    themselves deliveries a feeding firehose would copy again)."""
    got: list[Copy] = []
    deadline = time.monotonic() + timeout
    while not want <= {rk for rk, _, _ in got}:
        m, p, body = ch.basic_get(tq, auto_ack=True)
        if m is not None:
            got.append((m.routing_key, dict(p.headers or {}), body))
        elif time.monotonic() > deadline:
            raise AssertionError(f"copies {sorted(want)} not all seen: {[rk for rk, _, _ in got]}")
        else:
            ch.connection.sleep(0.02)
    return got


def _one(got: list[Copy], key: str) -> tuple[dict[str, Any], bytes]:
    hits = [(h, body) for rk, h, body in got if rk == key]
    assert len(hits) == 1, (key, [rk for rk, _, _ in got])
    return hits[0]


def _never_fed_itself(ch: Any, tq: str, got: list[Copy]) -> None:
    keys = [rk for rk, _, _ in got]
    assert not [k for k in keys if k == f"deliver.{tq}" or k.startswith(f"publish.{TRACE}")], keys
    m, _, _ = ch.basic_get(tq, auto_ack=True)
    assert m is None, "a copy appeared after the last expected one"


def test_mqtt_publishes_and_deliveries_are_traced(shared_broker: Broker, firehose: tuple[Any, str]) -> None:
    ch, tq = firehose
    b, client_id = shared_broker, cid()
    port = _node(b).mqtt_port
    sub = Paho(b.host, port, client_id)
    pub = Paho(b.host, port, cid())
    try:
        assert sub.subscribe("trace/mqtt/+", 1) == [1]
        pub.publish("trace/mqtt/one", b"over mqtt", 1)
        assert [m.payload for m in sub.take(1)] == [b"over mqtt"]
        sub_queue = f"mqtt-subscription-{client_id}qos1"
        got = _collect(ch, tq, {"publish.amq.topic", f"deliver.{sub_queue}"})
        ph, pbody = _one(got, "publish.amq.topic")
        assert pbody == b"over mqtt"
        assert ph["exchange_name"] == "amq.topic" and ph["routing_keys"] == ["trace.mqtt.one"]
        assert ph["routed_queues"] == [sub_queue]
        assert ph["user"] == "guest" and ph["vhost"] == "/" and ph["node"] and ph["connection"]
        dh, dbody = _one(got, f"deliver.{sub_queue}")
        assert dbody == b"over mqtt" and dh["redelivered"] == 0 and dh["routing_keys"] == ["trace.mqtt.one"]
        assert dh["user"] == "guest" and dh["exchange_name"] == "amq.topic"
        _never_fed_itself(ch, tq, got)
    finally:
        sub.close()
        pub.close()


def test_management_publish_and_get_are_traced(shared_broker: Broker, firehose: tuple[Any, str]) -> None:
    ch, tq = firehose
    api = _api(shared_broker)
    q = unique("traced-http")
    ch.queue_declare(q)
    try:
        out = api.ok("POST", "/api/exchanges/%2F/amq.default/publish", {
            "properties": {"content_type": "text/plain"}, "routing_key": q, "payload": "over http",
            "payload_encoding": "string"}, expect=(200,))
        assert out == {"routed": True}
        msgs = api.ok("POST", f"/api/queues/%2F/{urllib.parse.quote(q, safe='')}/get", {
            "count": 1, "ackmode": "ack_requeue_false", "encoding": "auto"}, expect=(200,))
        assert [m["payload"] for m in msgs] == ["over http"]
        got = _collect(ch, tq, {"publish.", f"deliver.{q}"})
        ph, pbody = _one(got, "publish.")
        assert pbody == b"over http" and ph["routing_keys"] == [q] and ph["routed_queues"] == [q]
        assert ph["properties"]["content_type"] == "text/plain"
        assert ph["user"] == "guest" and ph["connection"].startswith("HTTP ")
        dh, dbody = _one(got, f"deliver.{q}")
        assert dbody == b"over http" and dh["user"] == "guest" and dh["redelivered"] == 0
        _never_fed_itself(ch, tq, got)
    finally:
        ch.queue_delete(q)


def test_lmq_puts_and_takes_are_traced(shared_broker: Broker, firehose: tuple[Any, str]) -> None:
    ch, tq = firehose
    b = shared_broker
    q = unique("traced-lmq")
    base = f"http://{b.host}:{_node(b).lmq_http_port}"

    async def main() -> None:
        async with session() as http:
            r = await http.post(f"{base}/messages/{q}", data=b"over lmq",
                                headers={"content-type": "text/plain"})
            assert r.status == 200, await r.text()
            r = await http.get(f"{base}/messages/{q}?t=5")
            assert r.status == 200 and await r.read() == b"over lmq"
            r = await http.post(f"{base}/messages/{q}/{r.headers['x-lmq-message-id']}?reply=ack")
            assert r.status == 204

    try:
        run_async(main())
        got = _collect(ch, tq, {"publish.", f"deliver.{q}"})
        ph, pbody = _one(got, "publish.")
        assert pbody == b"over lmq" and ph["routing_keys"] == [q] and ph["routed_queues"] == [q]
        assert ph["user"] == "guest" and ph["connection"] == "LMQ"
        dh, dbody = _one(got, f"deliver.{q}")
        assert dbody == b"over lmq" and dh["user"] == "guest"
        _never_fed_itself(ch, tq, got)
    finally:
        ch.queue_delete(q)


def test_broker_own_publishes_are_not_traced(shared_broker: Broker, firehose: tuple[Any, str]) -> None:
    """A dead-lettered message is the broker's publish, not a client's: only the client's
    publish and the consumer's delivery are copied (as RabbitMQ's firehose)."""
    ch, tq = firehose
    q, dlq = unique("traced-dlx"), unique("traced-dead")
    ch.queue_declare(dlq)
    ch.queue_declare(q, arguments={"x-dead-letter-exchange": "", "x-dead-letter-routing-key": dlq})
    try:
        ch.basic_publish("", q, b"to be rejected")
        m, _, _ = ch.basic_get(q)
        assert m is not None
        ch.basic_reject(m.delivery_tag, requeue=False)
        deadline = time.monotonic() + 10
        while ch.queue_declare(dlq, passive=True).method.message_count < 1:
            assert time.monotonic() < deadline, "not dead-lettered"
            ch.connection.sleep(0.02)
        got = _collect(ch, tq, {"publish.", f"deliver.{q}"})
        assert [rk for rk, _, _ in got].count("publish.") == 1, [rk for rk, _, _ in got]
        _never_fed_itself(ch, tq, got)
    finally:
        ch.queue_delete(q)
        ch.queue_delete(dlq)

