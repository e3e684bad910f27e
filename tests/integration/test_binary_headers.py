"""Header values a client library can send that pamqp decodes to a type its encoder refuses or
narrows, delivered by routes that rewrite the headers: a stream's ``x-stream-offset`` stamping,
dead-lettering and the CC/BCC publish rewrite. On a single node, a cluster leader and through a
follower (the stream and the dead-letter target are durable).

py-amqp (Celery's and kombu's transport) writes a Python ``bytes`` header as an ``S`` long
string of those bytes; not UTF-8, pamqp decodes it to ``bytes``, which its encoder refuses. It
writes a float as a double ``d``, which pamqp's encoder narrows to a 32-bit ``f``, and an
integer beyond 32 bits as ``L``. Each must reach an AMQP consumer with its value unchanged.
"""

from __future__ import annotations

import time
from typing import Any
from urllib.parse import quote, urlsplit

import amqp
import pika
import pytest
from rstream import AMQPMessage, Producer

from ._support import Cleanup, queue_count, run_async
from .test_ctl_lavinmq import api_of

# Durable state: also against a cluster leader and through a follower (_cluster_modes.py).
pytestmark = pytest.mark.cluster_modes

BIN = b"\xff\xfe\x00\x80"  # not UTF-8
HEADERS: dict[str, Any] = {
    "bin": BIN, "nested": {"b": b"\x81", "s": "text"}, "arr": [b"\x82", 1, "two"],
    "d": 0.1, "big": 1 << 40, "neg": -(1 << 40),
}


def _connect(url: str) -> amqp.Connection:
    params = pika.URLParameters(url)
    creds = params.credentials
    conn = amqp.Connection(f"{params.host}:{params.port}", userid=creds.username, password=creds.password,
                           virtual_host=params.virtual_host, confirm_publish=True)
    conn.connect()
    return conn


def _publish(url: str, exchange: str, routing_key: str, headers: dict[str, Any]) -> None:
    conn = _connect(url)
    try:
        conn.channel().basic_publish(amqp.Message(b"payload", application_headers=headers, delivery_mode=2),
                                     exchange=exchange, routing_key=routing_key)
    finally:
        conn.close()


def _get_one(url: str, queue: str, arguments: dict[str, Any] | None = None) -> tuple[bytes, dict[str, Any]]:
    """Consume one message with py-amqp (it decodes S, x and d as they were written; pika turns a
    double into an integer); fail after 15 s."""
    conn = _connect(url)
    got: list[amqp.Message] = []
    try:
        ch = conn.channel()
        ch.basic_qos(0, 10, False)  # a stream needs a prefetch
        ch.basic_consume(queue, callback=got.append, arguments=arguments)
        deadline = time.monotonic() + 15
        while not got and time.monotonic() < deadline:
            try:
                conn.drain_events(timeout=1)
            except TimeoutError:
                pass
        assert got, f"nothing delivered from {queue}"
        ch.basic_ack(got[0].delivery_tag)
        return bytes(got[0].body), dict(got[0].headers or {})
    finally:
        conn.close()


def test_stream_delivers_binary_headers(shared_broker: Any, cleanup: Cleanup) -> None:
    url = shared_broker.url
    stream = cleanup.queue()
    with pika.BlockingConnection(pika.URLParameters(url)) as conn:
        conn.channel().queue_declare(stream, durable=True, arguments={"x-queue-type": "stream"})
    _publish(url, "", stream, HEADERS)
    body, headers = _get_one(url, stream, {"x-stream-offset": "first"})
    assert body == b"payload"
    assert headers.pop("x-stream-offset") == 0
    assert isinstance(headers.pop("x-stream-timestamp"), int)
    assert headers == HEADERS


def test_dead_lettered_binary_headers(shared_broker: Any, cleanup: Cleanup) -> None:
    url = shared_broker.url
    src, dst = cleanup.queue(), cleanup.queue()
    with pika.BlockingConnection(pika.URLParameters(url)) as conn:
        ch = conn.channel()
        ch.queue_declare(dst, durable=True)
        ch.queue_declare(src, durable=True, arguments={
            "x-message-ttl": 0, "x-dead-letter-exchange": "", "x-dead-letter-routing-key": dst})
    _publish(url, "", src, HEADERS)
    body, headers = _get_one(url, dst)
    assert body == b"payload"
    assert headers.pop("x-death")[0]["reason"] == "expired"
    headers.pop("x-first-death-reason", None)
    for k in ("x-first-death-queue", "x-first-death-exchange", "x-last-death-reason",
              "x-last-death-queue", "x-last-death-exchange"):
        headers.pop(k, None)
    assert headers == HEADERS


def test_bcc_rewrite_keeps_binary_headers(shared_broker: Any, cleanup: Cleanup) -> None:
    url = shared_broker.url
    q1, q2 = cleanup.queue(), cleanup.queue()
    with pika.BlockingConnection(pika.URLParameters(url)) as conn:
        ch = conn.channel()
        for q in (q1, q2):
            ch.queue_declare(q, durable=True)
    _publish(url, "", q1, {**HEADERS, "BCC": [q2]})
    for q in (q1, q2):
        body, headers = _get_one(url, q)
        assert body == b"payload"
        assert "BCC" not in headers
        assert headers == HEADERS


def test_http_publish_keeps_doubles_refuses_huge_ints(shared_broker: Any, cleanup: Cleanup) -> None:
    """The HTTP publish API encodes its JSON headers as the broker's other rewrites do: a JSON
    number with a fraction as a double (was a 32-bit float: 0.1 arrived as 0.10000000149...),
    and an integer beyond 64 bits is a 400 with nothing published."""
    url = shared_broker.url
    api = api_of(shared_broker)
    q = cleanup.queue()
    with pika.BlockingConnection(pika.URLParameters(url)) as conn:
        conn.channel().queue_declare(q, durable=True)
    vhost = quote(pika.URLParameters(url).virtual_host, safe="")

    def publish(headers: dict[str, Any]) -> tuple[int, Any]:
        status, body, _ = api.call("POST", f"/api/exchanges/{vhost}/amq.default/publish", {
            "properties": {"headers": headers, "delivery_mode": 2}, "routing_key": q,
            "payload": "payload", "payload_encoding": "string"})
        return status, body

    status, _ = publish({"d": 0.1, "huge": 1 << 70})
    assert status == 400
    with pika.BlockingConnection(pika.URLParameters(url)) as conn:
        assert queue_count(conn, q) == 0
    status, body = publish({"d": 0.1, "n": [1.5, {"e": 2.25}]})
    assert (status, body) == (200, {"routed": True})
    body_bytes, headers = _get_one(url, q)
    assert (body_bytes, headers) == (b"payload", {"d": 0.1, "n": [1.5, {"e": 2.25}]})


def test_stream_protocol_binary_properties_reach_amqp(shared_broker: Any, broker_mode: str,
                                                      cleanup: Cleanup) -> None:
    """A stream client's AMQP 1.0 message with binary application properties and annotations is
    stored as its bytes (the stream protocol puts nothing of it into the headers), so an AMQP
    consumer of the stream gets it whole, with only the broker's two offset headers. Passed before
    the fix too: no stream-protocol value reaches the header encoder."""
    u = urlsplit(shared_broker.url)
    stream = cleanup.queue()
    msg = AMQPMessage(body=b"payload", application_properties={"bin": b"\xff\x00", "s": "t"},
                      message_annotations={"x-opt-bin": b"\x80"})

    async def send() -> None:
        async with Producer(shared_broker.host, port=int(shared_broker.stream_port),
                            username=u.username or "guest", password=u.password or "guest",
                            load_balancer_mode=broker_mode == "follower") as p:
            await p.create_stream(stream)
            await p.send_wait(stream, msg)

    run_async(send(), 30)
    body, headers = _get_one(shared_broker.url, stream, {"x-stream-offset": "first"})
    assert body == bytes(msg)
    assert sorted(headers) == ["x-stream-offset", "x-stream-timestamp"]
