"""Firehose tracing against a real broker (pika, the management API, skredctl): the
``amq.rabbitmq.trace`` exchange gets ``publish.<exchange>`` and ``deliver.<queue>`` copies with
RabbitMQ's headers while tracing is on for the vhost, and nothing while it is off."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pika
import pytest

from ._support import SkredProcess, channel_error, connect, unique, wait_until
from .test_ctl import ctl
from .test_mgmt_api import Api, start_mgmt_broker

TRACE = "amq.rabbitmq.trace"


@pytest.fixture(scope="module")
def mb(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SkredProcess]:
    b = start_mgmt_broker(tmp_path_factory.mktemp("trace"))
    yield b
    b.close()


def _drain(ch: Any, queue: str) -> list[tuple[str, dict[str, Any], bytes]]:
    out = []
    while True:
        m, p, body = ch.basic_get(queue, auto_ack=True)
        if m is None:
            return out
        out.append((m.routing_key, dict(p.headers or {}), body))


def test_firehose_copies_publishes_and_deliveries_while_on(mb: SkredProcess) -> None:
    api = Api(mb.mgmt_port)
    ex = api.get(f"/api/exchanges/%2F/{TRACE}")
    assert (ex["type"], ex["internal"], ex["durable"]) == ("topic", True, True)
    assert api.get("/api/vhosts/%2F")["tracing"] is False
    conn = connect(mb)
    ch = conn.channel()
    q, tq = unique("traced"), unique("firehose")
    ch.queue_declare(q)
    ch.queue_declare(tq)
    ch.queue_bind(tq, TRACE, "#")
    ch.confirm_delivery()
    try:
        ch.basic_publish("", q, b"before")
        assert ch.basic_get(q, auto_ack=True)[2] == b"before"
        assert _drain(ch, tq) == []  # off by default

        api.ok("PUT", "/api/vhosts/%2F", {"tracing": True})
        assert api.get("/api/vhosts/%2F")["tracing"] is True
        props = pika.BasicProperties(content_type="text/plain", headers={"k": "v"})
        ch.basic_publish("", q, b"traced", props)
        assert ch.basic_get(q, auto_ack=True)[2] == b"traced"
        got = _drain(ch, tq)
        assert [rk for rk, _, _ in got] == ["publish.", f"deliver.{q}"], got
        (_, pub, body), (_, dlv, body2) = got
        assert body == body2 == b"traced"
        assert pub["exchange_name"] == "" and pub["routing_keys"] == [q] and pub["routed_queues"] == [q]
        assert pub["properties"]["content_type"] == "text/plain"
        assert pub["properties"]["headers"] == {"k": "v"}
        assert pub["vhost"] == "/" and pub["user"] == "guest" and isinstance(pub["channel"], int)
        assert pub["node"] and pub["connection"]
        assert dlv["exchange_name"] == "" and dlv["routing_keys"] == [q] and dlv["redelivered"] == 0

        # a run of publishes without confirms, consumed by a consumer: every one is traced
        pub_ch = conn.channel()
        for i in range(5):
            pub_ch.basic_publish("amq.direct", q, b"r%d" % i)
        ch.queue_bind(q, "amq.direct", q)
        for i in range(5):
            pub_ch.basic_publish("amq.direct", q, b"r%d" % i)
        got_bodies: list[bytes] = []
        ch.basic_consume(q, lambda c, m, p, b: got_bodies.append(b), auto_ack=True)
        deadline = time.monotonic() + 10
        while len(got_bodies) < 5 and time.monotonic() < deadline:
            conn.process_data_events(time_limit=0.05)
        wait_until(lambda: api.get(f"/api/queues/%2F/{tq}")["messages"] >= 15, 10, "15 trace copies")
        keys = [rk for rk, _, _ in _drain(ch, tq)]
        assert keys.count("publish.amq.direct") == 10 and keys.count(f"deliver.{q}") == 5, keys

        # the trace exchange is internal: clients cannot publish to it
        forger = conn.channel()
        forger.confirm_delivery()
        with channel_error(403):
            forger.basic_publish(TRACE, "publish.x", b"forged")

        r = ctl(mb, "trace_off", "--vhost", "/")
        assert r.returncode == 0, r.stderr
        assert api.get("/api/vhosts/%2F")["tracing"] is False
        ch.basic_publish("", q, b"after")
        deadline = time.monotonic() + 10
        while len(got_bodies) < 6 and time.monotonic() < deadline:
            conn.process_data_events(time_limit=0.05)
        assert got_bodies[-1] == b"after"
        assert _drain(ch, tq) == []
        r = ctl(mb, "trace_on")
        assert r.returncode == 0 and api.get("/api/vhosts/%2F")["tracing"] is True, r.stderr
        api.ok("PUT", "/api/vhosts/%2F", {"tracing": False})
    finally:
        conn.close()


def test_tracing_must_be_a_boolean(mb: SkredProcess) -> None:
    api = Api(mb.mgmt_port)
    assert api.call("PUT", "/api/vhosts/%2F", {"tracing": "yes"})[0] == 400
    assert api.get("/api/vhosts/%2F")["tracing"] is False
    # RabbitMQ's own rabbitmqadmin sends every field as a string ("tracing=true" -> "true"), and
    # RabbitMQ takes the strings "true" and "false" for this switch; so does Skred.
    api.ok("PUT", "/api/vhosts/%2F", {"tracing": "true"})
    assert api.get("/api/vhosts/%2F")["tracing"] is True
    api.ok("PUT", "/api/vhosts/%2F", {"tracing": "false"})
    assert api.get("/api/vhosts/%2F")["tracing"] is False


def test_log_exchange_gets_the_brokers_warnings(tmp_path_factory: pytest.TempPathFactory) -> None:
    b = start_mgmt_broker(tmp_path_factory.mktemp("logx"), ["--log-exchange"])
    try:
        ex = Api(b.mgmt_port).get("/api/exchanges/%2F/amq.rabbitmq.log")
        assert (ex["type"], ex["internal"]) == ("topic", True)
        conn = connect(b)
        ch = conn.channel()
        q = unique("logs")
        ch.queue_declare(q)
        ch.queue_bind(q, "amq.rabbitmq.log", "warning")
        with pytest.raises(pika.exceptions.ProbableAuthenticationError):
            pika.BlockingConnection(pika.URLParameters(
                f"amqp://guest:wrong@127.0.0.1:{b.port}/%2F?connection_attempts=1"))
        got: list[tuple[str, bytes]] = []

        def seen() -> bool:
            m, p, body = ch.basic_get(q, auto_ack=True)
            if m is not None:
                got.append((m.routing_key, body))
            return any(b"login refused" in body for _, body in got)

        wait_until(seen, 10, "the refused login's warning on amq.rabbitmq.log")
        assert all(rk == "warning" for rk, _ in got)
        conn.close()
    finally:
        b.close()
