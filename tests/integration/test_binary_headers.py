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

from typing import Any

import amqp
import pika
import pytest

from ._support import Cleanup

# Durable state: also against a cluster leader and through a follower (_cluster_modes.py).
pytestmark = pytest.mark.cluster_modes

BIN = b"\xff\xfe\x00\x80"  # not UTF-8
HEADERS: dict[str, Any] = {
    "bin": BIN, "nested": {"b": b"\x81", "s": "text"}, "arr": [b"\x82", 1, "two"],
    "d": 0.1, "big": 1 << 40, "neg": -(1 << 40),
}
# What pika decodes of them: S and x alike as bytes when not UTF-8.
WANT: dict[str, Any] = {**HEADERS, "nested": {"b": b"\x81", "s": b"text"}, "arr": [b"\x82", 1, b"two"]}


def _publish(url: str, exchange: str, routing_key: str, headers: dict[str, Any]) -> None:
    params = pika.URLParameters(url)
    conn = amqp.Connection(f"{params.host}:{params.port}", userid="guest", password="guest",
                           virtual_host=params.virtual_host, confirm_publish=True)
    conn.connect()
    try:
        ch = conn.channel()
        ch.basic_publish(amqp.Message(b"payload", application_headers=headers, delivery_mode=2),
                         exchange=exchange, routing_key=routing_key)
    finally:
        conn.close()


def _get_one(url: str, queue: str, arguments: dict[str, Any] | None = None) -> tuple[bytes, dict[str, Any]]:
    """Consume one message (a stream needs a consumer with prefetch); fail after 15 s."""
    with pika.BlockingConnection(pika.URLParameters(url)) as conn:
        ch = conn.channel()
        ch.basic_qos(prefetch_count=10)
        for _method, props, body in ch.consume(queue, arguments=arguments, inactivity_timeout=15):
            assert body is not None, f"nothing delivered from {queue}"
            ch.cancel()
            return body, dict(props.headers or {})
    raise AssertionError("unreachable")


def _decoded(headers: dict[str, Any]) -> dict[str, Any]:
    """pika decodes S fields that are valid UTF-8 to str; compare as bytes."""
    def norm(v: Any) -> Any:
        if isinstance(v, str):
            return v.encode()
        if isinstance(v, dict):
            return {k: norm(x) for k, x in v.items()}
        if isinstance(v, list):
            return [norm(x) for x in v]
        return v
    return {k: norm(v) for k, v in headers.items()}


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
    assert _decoded(headers) == _decoded(WANT)


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
    assert headers.pop("x-death")[0]["reason"] == b"expired"
    headers.pop("x-first-death-reason", None)
    for k in ("x-first-death-queue", "x-first-death-exchange", "x-last-death-reason",
              "x-last-death-queue", "x-last-death-exchange"):
        headers.pop(k, None)
    assert _decoded(headers) == _decoded(WANT)


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
        assert _decoded(headers) == _decoded(WANT)
