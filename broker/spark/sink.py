"""``df.write.format("skred")`` and ``writeStream``: rows published over AMQP with confirms.

Theory of operation
-------------------
The writers are Spark's Arrow writers: a task gets its rows as Arrow record batches. Each
task opens one AMQP connection (``uri``, the link layer's publisher: ``amqp_sink.py``) and
publishes its rows with publisher confirms, keeping up to ``confirmWindow`` rows (``WINDOW``)
in flight: a full window waits for half of it to be confirmed, so the task costs a round trip
per half window, not per row. The task returns only when every row is confirmed, and any
nack, returned (unroutable) row, confirm timeout or lost connection raises, which fails the
task, so Spark retries it (at least once, like Kafka's sink); rows still in flight then count
as not written (with ``exactlyOnce`` the retry's copies of those that were stored are dropped).
Rows use Kafka's sink columns: ``value`` (required, binary or string), ``key`` (the routing key), ``topic``
(when the ``topic`` option is not set) and ``headers`` (map<string,string>); any other column
is refused before a task runs.

The target (``topic``) is an exchange when one of that name exists (rows go to it with their
``key`` as routing key), else a queue or stream reached through the default exchange.

Exactly once (``exactlyOnce=true``): every row gets a deterministic id from the query id
(streaming: Spark's, kept in the checkpoint; batch writes: the ``queryId`` option, else one per
write job), the micro-batch id (the same when a batch is re-run after a failure), the task's
partition and the row number. Two targets deduplicate by it:

* a **stream** (the durable way): rows go over the stream protocol (``streamPort``, 5552 by
  default) as a publisher named ``<query id>.<partition>`` with publishing ids
  ``batch id << 32 | row number`` (``stream_publish.py``); the stream keeps each publisher's
  highest stored id in order with its log, so a retried task or re-run batch adds nothing, also
  after a broker restart, kill -9 or a leader change. Per-row ``headers`` are refused there.
  With the ``topic`` option set, a whole Arrow batch is framed at once (``arrow_frames.py``);
  rows naming their own topic go one by one.
* an **exchange** declared with ``x-message-deduplication: true`` (bound to the stream): the id
  ``<query id>.<batch id>.<partition>.<row number>`` goes in ``message_id`` and the
  ``x-deduplication-header`` header, and the exchange drops an id it has seen within its cache
  (``x-cache-size``, ``x-cache-ttl``). A durable exchange keeps its cache on disk and replicated
  by default (``x-cache-persistence: disk``, broker/model/dedup_cache.py), so a retry is dropped
  after a restart, kill -9 or leader change too; a transient one, or ``memory``, does not. With
  the ``topic`` option set and no ``headers``, a whole Arrow batch is framed at once, each row's
  properties built column-wise (``amqp_frames.dedup_props``).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from typing import Any

from pamqp.commands import Basic
from pyspark.sql.datasource import (  # type: ignore[import-not-found,import-untyped,unused-ignore]
    DataSourceArrowWriter,
    DataSourceStreamArrowWriter,
    WriterCommitMessage,
)

from broker import properties
from broker.spark.amqp_frames import dedup_props, frame_batch
from broker.spark.amqp_sink import SinkPublisher
from broker.spark.options import SINK_OPTIONS, checked, flag
from broker.spark.stream_publish import NoSuchStream, StreamPublisher, publishing_id

ROW_COLUMNS = ("value", "key", "topic", "headers", "partition")
DEDUP_HEADER = "x-deduplication-header"
# Rows in flight (published, confirm not yet in) per task, by default. A row in flight is bytes
# in the socket's buffer, no object; a window of 1000 left the task waiting on the broker's group
# commit (a fifth to a tenth of the rows/s of 20,000, both paths: docs/benchmarks.md).
WINDOW = 20_000
WINDOW_MAX = 100_000


class Published(WriterCommitMessage):  # type: ignore[misc,unused-ignore]
    def __init__(self, rows: int) -> None:
        self.rows = rows


class _Sink:
    def __init__(self, raw: dict[str, str], schema: Any) -> None:
        opts = checked(raw, SINK_OPTIONS, "sink")
        self.uri = opts.get("uri") or ""
        if not self.uri:
            raise ValueError("skred sink: option 'uri' is required")
        if opts.get("path"):
            raise ValueError("skred sink: name the target with option 'topic', not a path")
        self.topic = opts.get("topic")
        self.exactly_once = flag(opts, "exactlyonce", False)
        self.query_id = opts.get("queryid") or uuid.uuid4().hex
        self.confirm_timeout = float(opts.get("confirmtimeout", "30"))
        given = opts.get("confirmwindow")
        self.window = int(given) if given else WINDOW
        self.stream_port = int(opts.get("streamport", "5552"))
        self.vhost = opts.get("vhost")
        if not 1 <= self.window <= WINDOW_MAX:
            raise ValueError(f"skred sink: confirmWindow must be 1..{WINDOW_MAX}")
        names = schema.fieldNames()
        unknown = [n for n in names if n not in ROW_COLUMNS]
        if unknown:
            raise ValueError(f"skred sink: unknown column(s) {', '.join(unknown)}; "
                             f"rows may have {', '.join(ROW_COLUMNS)}")
        if "value" not in names:
            raise ValueError("skred sink: rows need a 'value' column")
        if not self.topic and "topic" not in names:
            raise ValueError("skred sink: set option 'topic' or give rows a 'topic' column")

    def publish(self, batches: Iterator[Any], batch_id: int | None) -> Published:
        from pyspark import TaskContext  # type: ignore[import-not-found,import-untyped,unused-ignore]

        ctx = TaskContext.get()
        task = ctx.partitionId() if ctx is not None else 0
        query = self.query_id
        if batch_id is None and ctx is not None:  # streaming: Spark's ids, stable across re-runs
            query = ctx.getLocalProperty("sql.streaming.queryId") or query
            raw = ctx.getLocalProperty("streaming.sql.batchId")
            batch_id = int(raw) if raw is not None else None
        return asyncio.run(self._publish(batches, query, batch_id or 0, task))

    async def _publish(self, batches: Iterator[Any], query: str, batch_id: int, task: int) -> Published:
        """Publish a task's Arrow batches; rows are numbered from 1 across them."""
        id_prefix = f"{query}.{batch_id}.{task}"
        amqp = SinkPublisher(self.window, self.confirm_timeout)
        streams: dict[str, StreamPublisher] = {}
        try:
            async with asyncio.timeout(self.confirm_timeout):
                await amqp.open(self.uri)
            targets: dict[str, bool] = {}

            async def is_exchange(topic: str) -> bool:
                known = targets.get(topic)
                if known is None:
                    known = targets[topic] = await amqp.exchange_exists(topic)
                return known

            async def stream_of(topic: str) -> StreamPublisher:
                pub = streams.get(topic)
                if pub is None:
                    pub = streams[topic] = await self._stream_publisher(topic, f"{query}.{task}")
                return pub

            n = 0
            for batch in batches:
                _no_partition(batch)
                if self.exactly_once and self.topic and not await is_exchange(self.topic):
                    _no_headers(batch)  # a stream: the batch framed whole (arrow_frames)
                    pub = await stream_of(self.topic)
                    await pub.add_batch(publishing_id(batch_id, n + 1), batch.column("value"))
                    n += batch.num_rows
                    continue
                names = batch.schema.names
                rows = batch.num_rows
                if self.topic and not _has_headers(batch):
                    # one target: framed a piece of the batch at a time (with exactlyOnce, the
                    # target is a deduplicating exchange and each row's id is in its properties)
                    exchange = await is_exchange(self.topic)
                    keys = batch.column("key") if exchange and "key" in names else \
                        (b"" if exchange else self.topic.encode())
                    await _put_batch(amqp, self.topic if exchange else "", keys, batch.column("value"),
                                     id_prefix if self.exactly_once else None, n + 1)
                    n += rows
                    continue
                values = batch.column("value").to_pylist()
                keys = batch.column("key").to_pylist() if "key" in names else [None] * rows
                topics = batch.column("topic").to_pylist() if "topic" in names and not self.topic \
                    else [self.topic] * rows
                heads = batch.column("headers").to_pylist() if "headers" in names else [None] * rows
                for value, key, topic, head in zip(values, keys, topics, heads, strict=True):
                    n += 1
                    if not topic:
                        raise ValueError("skred sink: a row has no topic")
                    exchange = await is_exchange(topic) if topic not in targets else targets[topic]
                    body = _bytes(value)
                    if self.exactly_once and not exchange:  # a stream: deduplicated by the stream
                        if head:
                            raise ValueError(_NO_HEADERS)
                        await (await stream_of(topic)).add(publishing_id(batch_id, n), body)
                        continue
                    raw = _PERSISTENT
                    if head or self.exactly_once:
                        headers = dict(head or {})
                        message_id = None
                        if self.exactly_once:
                            message_id = headers[DEDUP_HEADER] = f"{id_prefix}.{n}"
                        raw = properties.encode(Basic.Properties(delivery_mode=2, message_id=message_id,
                                                                 headers=headers))
                    if amqp.pending >= amqp.window:
                        await amqp.drain(amqp.low)
                    amqp.put(topic if exchange else "", (key or "") if exchange else topic, raw, body)
            await amqp.drain(0)
            for pub in streams.values():
                await pub.finish()
            return Published(n)
        finally:
            for pub in streams.values():
                await pub.close()
            await amqp.close()

    async def _stream_publisher(self, topic: str, reference: str) -> StreamPublisher:
        pub = StreamPublisher(self.uri, self.stream_port, self.vhost, topic, reference, self.window,
                              self.confirm_timeout)
        try:
            await pub.open()
        except (NoSuchStream, OSError, TimeoutError) as exc:
            await pub.close()
            raise ValueError(f"skred sink: exactlyOnce needs '{topic}' to be a stream (reached over the "
                             f"stream protocol, port {self.stream_port}) or an exchange declared with "
                             f"x-message-deduplication (bound to the stream): {exc}") from None
        except BaseException:
            await pub.close()
            raise
        return pub


_NO_HEADERS = "skred sink: exactlyOnce to a stream carries no headers"
_PERSISTENT = properties.encode(Basic.Properties(delivery_mode=2))  # a row without headers or id


def _no_partition(batch: Any) -> None:
    names = batch.schema.names
    if "partition" in names:
        col = batch.column("partition")
        if col.null_count != len(col):
            raise ValueError("skred sink: the partition column is not supported")


def _bytes(value: Any) -> bytes:
    """A ``value`` cell as a message body (a string as UTF-8, a null as empty)."""
    return value.encode() if isinstance(value, str) else bytes(value or b"")


def _has_headers(batch: Any) -> bool:
    """Whether a row of ``batch`` has a non-empty ``headers`` map."""
    if "headers" not in batch.schema.names:
        return False
    col = batch.column("headers")  # a map: its offsets span every entry of the batch's rows
    return bool(col.null_count != len(col) and col.offsets[-1].as_py() > col.offsets[0].as_py())


def _no_headers(batch: Any) -> None:
    """Refuse a batch with a non-empty ``headers`` map: the stream path carries no headers."""
    if _has_headers(batch):
        raise ValueError(_NO_HEADERS)


async def _put_batch(amqp: SinkPublisher, exchange: str, keys: Any, values: Any, id_prefix: str | None,
                     first: int) -> None:
    """A batch's rows to one target, half a window at a time: with ``_PERSISTENT`` properties,
    or with ``id_prefix`` (exactly once) each row's id ``<id_prefix>.<row>`` (rows numbered
    from ``first``) in its properties (``dedup_props``); framed whole (``frame_batch``) unless
    a row needs the row-by-row framing."""
    piece = max(1, amqp.window // 2)
    ex = exchange.encode()
    for lo in range(0, len(values), piece):
        part = values.slice(lo, piece)
        if amqp.pending + len(part) > amqp.window:
            await amqp.drain(amqp.window - len(part))
        part_keys: Any = keys if isinstance(keys, bytes) else keys.slice(lo, piece)
        props: Any = _PERSISTENT if id_prefix is None else \
            dedup_props(DEDUP_HEADER, id_prefix, first + lo, len(part))
        data = frame_batch(ex, not exchange, part_keys, props, part, amqp.frame_max)
        if data is not None:
            amqp.put_framed(data, len(part))
            continue
        bodies = part.to_pylist()
        rks = [keys.decode()] * len(bodies) if isinstance(keys, bytes) else part_keys.to_pylist()
        each = [props] * len(bodies) if isinstance(props, bytes) else props.to_pylist()
        for body, rk, raw in zip(bodies, rks, each, strict=True):
            amqp.put(exchange, rk or "", raw, _bytes(body))


class SkredWriter(DataSourceArrowWriter):  # type: ignore[misc,unused-ignore]
    """Batch writes: each task gets its rows as Arrow batches."""

    def __init__(self, options: dict[str, str], schema: Any, overwrite: bool) -> None:
        self.sink = _Sink(options, schema)

    def write(self, iterator: Iterator[Any]) -> Published:
        return self.sink.publish(iterator, 0)


class SkredStreamWriter(DataSourceStreamArrowWriter):  # type: ignore[misc,unused-ignore]
    """Micro-batches: each task gets its rows as Arrow batches."""

    def __init__(self, options: dict[str, str], schema: Any, overwrite: bool) -> None:
        self.sink = _Sink(options, schema)

    def write(self, iterator: Iterator[Any]) -> Published:
        return self.sink.publish(iterator, None)

    def commit(self, messages: list[Any], batchId: int) -> None:  # noqa: N803 - Spark's name
        pass  # every row was confirmed by its task

    def abort(self, messages: list[Any], batchId: int) -> None:  # noqa: N803 - Spark's name
        pass  # confirmed rows stay; with exactlyOnce the re-run's duplicates are dropped
