"""Reading a stream over AMQP (``option("uri", ...)``) for the Spark source.

Theory of operation: a running broker is asked for the stream's extent with a one-message
consumer at ``x-stream-offset=first`` (its ``x-stream-offset`` header is the first offset held),
then a passive queue.declare (message count), so ``[first, first + count)`` is the readable range;
the probe is taken again until the first offset held did not move meanwhile (retention). Not
``last``: that names the first message of the last *chunk*, and a chunk holds a whole publish
run (a Publish frame, a sink's window), so an extent counted back from it came up short.

A range ``[start, end)`` is read by a consumer at ``x-stream-offset=start`` that stops
at the first delivery at or past ``end``; acks go out with ``multiple=true`` every
``_ACK_EVERY`` deliveries so the prefetch window keeps moving. Every read uses the same
consumer tag per queue, so the broker's stored-offset table does not grow with Spark jobs
(the stored value is irrelevant: reads always pass an explicit offset).

Records are rebuilt in the segment-file shape (props re-encoded with pamqp, without the
broker-added ``x-stream-offset`` / ``x-stream-timestamp`` headers), so both modes produce
identical rows.
"""

from __future__ import annotations

import datetime
import time
from collections import deque
from collections.abc import Iterator
from typing import Any

from pamqp import commands

from broker.spark.rows import Rec

_ACK_EVERY = 256
_EXTENT_TRIES = 5  # extent probes before giving up on a stream whose retention keeps running
_PREFETCH = 1000
_BROKER_HEADERS = ("x-stream-offset", "x-stream-timestamp")
_PROP_NAMES = ("content_type", "content_encoding", "delivery_mode", "priority", "correlation_id",
               "reply_to", "expiration", "message_id", "type", "user_id", "app_id", "cluster_id")


def _connect(uri: str) -> Any:
    import pika  # type: ignore[import-not-found,import-untyped,unused-ignore]
    return pika.BlockingConnection(pika.URLParameters(uri))


def consumer_tag(queue: str) -> str:
    return f"skred-spark.{queue}"


def extent(uri: str, queue: str, timeout: float = 10.0) -> tuple[int, int]:
    """(first offset, next offset) of a stream on a running broker."""
    conn = _connect(uri)
    try:
        ch = conn.channel()
        ch.basic_qos(prefetch_count=1)
        first = _first_offset(conn, ch, queue, timeout)
        for _attempt in range(_EXTENT_TRIES):
            count = ch.queue_declare(queue, passive=True).method.message_count
            if not count:
                return 0, 0
            again = _first_offset(conn, ch, queue, timeout)
            if again is not None and again == first:
                return first, first + count
            first = again
        raise TimeoutError(f"stream '{queue}': retention kept moving its first offset")
    finally:
        conn.close()


def _first_offset(conn: Any, ch: Any, queue: str, timeout: float) -> int | None:
    """The first offset ``queue`` holds (None: it holds nothing)."""
    if not ch.queue_declare(queue, passive=True).method.message_count:
        return None
    for _method, props, _body in _consume(conn, ch, queue, {"x-stream-offset": "first"},
                                          consumer_tag(queue) + ".probe", timeout):
        return int((props.headers or {})["x-stream-offset"])
    raise TimeoutError(f"stream '{queue}' consumer ended")  # pragma: no cover


def read_range(uri: str, queue: str, start: int, end: int, timeout: float = 30.0) -> Iterator[Rec]:
    """Records with offsets in ``[start, end)`` (fewer if retention removed some)."""
    if start >= end:
        return
    conn = _connect(uri)
    try:
        ch = conn.channel()
        ch.basic_qos(prefetch_count=_PREFETCH)
        unacked = 0
        last_tag = 0
        for method, props, body in _consume(conn, ch, queue, {"x-stream-offset": start},
                                            consumer_tag(queue), timeout):
            headers = dict(props.headers or {})
            offset = int(headers.pop("x-stream-offset"))
            ts = int(headers.pop("x-stream-timestamp", 0))
            last_tag = method.delivery_tag
            unacked += 1
            if offset >= end:
                break
            if unacked >= _ACK_EVERY:
                ch.basic_ack(last_tag, multiple=True)
                unacked = 0
            yield (offset, ts, method.exchange.encode(), method.routing_key.encode(),
                   _encode_props(props, headers), body)
            if offset + 1 >= end:
                break
        if unacked and last_tag:
            ch.basic_ack(last_tag, multiple=True)
    finally:
        conn.close()


def _consume(conn: Any, ch: Any, queue: str, arguments: dict[str, Any], tag: str,
             timeout: float) -> Iterator[tuple[Any, Any, bytes]]:
    """Deliveries of one consumer with a fixed tag; TimeoutError after ``timeout`` idle seconds."""
    box: deque[tuple[Any, Any, bytes]] = deque()
    ch.basic_consume(queue, lambda _ch, m, p, b: box.append((m, p, b)), consumer_tag=tag,
                     arguments=arguments)
    try:
        while True:
            deadline = time.monotonic() + timeout
            while not box:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"stream '{queue}': no delivery for {timeout}s")
                conn.process_data_events(time_limit=min(left, 1.0))
            yield box.popleft()
    finally:
        if ch.is_open:
            ch.basic_cancel(tag)


def _encode_props(props: Any, headers: dict[str, Any]) -> bytes:
    p = commands.Basic.Properties()
    for name in _PROP_NAMES:
        value = getattr(props, name, None)
        if value is not None:
            setattr(p, name, value)
    if props.timestamp is not None:
        p.timestamp = datetime.datetime.fromtimestamp(int(props.timestamp), datetime.UTC)
    for key in _BROKER_HEADERS:
        headers.pop(key, None)
    p.headers = headers or None
    return bytes(p.marshal())
