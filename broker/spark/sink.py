"""``df.write.format("skred")`` and ``writeStream``: rows published over AMQP with confirms.

Theory of operation
-------------------
Each Spark task opens one AMQP connection (``uri``) and publishes its rows with publisher
confirms; the task returns only when every row is confirmed, and any nack, refusal or lost
connection raises, which fails the task, so Spark retries it (at least once, like Kafka's
sink). Rows use Kafka's sink columns: ``value`` (required, binary or string), ``key`` (the
routing key), ``topic`` (when the ``topic`` option is not set) and ``headers``
(map<string,string>); any other column is refused before a task runs.

The target (``topic``) is an exchange when one of that name exists (rows go to it with their
``key`` as routing key), else a queue or stream reached through the default exchange.

Exactly once (``exactlyOnce=true``): every row gets a deterministic id,
``<query id>.<batch id>.<task partition>.<row number>`` (streaming: Spark's query id, kept in
the checkpoint, and the micro-batch id, the same when a batch is re-run after a failure; batch
writes: the ``queryId`` option, else one id per write job), as both ``message_id`` and the
``x-deduplication-header`` header. The target must be an exchange declared with
``x-message-deduplication: true`` (bound to the stream): it drops a message whose id it has
seen within its cache, so a retried task or a re-run batch adds nothing. The cache is the
exchange's (``x-cache-size``, ``x-cache-ttl``), kept in memory: size it above the rows of a
batch, and note it does not survive a broker restart or leader change.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

from pyspark.sql.datasource import (  # type: ignore[import-not-found,import-untyped,unused-ignore]
    DataSourceStreamWriter,
    DataSourceWriter,
    WriterCommitMessage,
)

from broker.spark.options import SINK_OPTIONS, checked, flag

ROW_COLUMNS = ("value", "key", "topic", "headers", "partition")
DEDUP_HEADER = "x-deduplication-header"


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
        names = schema.fieldNames()
        unknown = [n for n in names if n not in ROW_COLUMNS]
        if unknown:
            raise ValueError(f"skred sink: unknown column(s) {', '.join(unknown)}; "
                             f"rows may have {', '.join(ROW_COLUMNS)}")
        if "value" not in names:
            raise ValueError("skred sink: rows need a 'value' column")
        if not self.topic and "topic" not in names:
            raise ValueError("skred sink: set option 'topic' or give rows a 'topic' column")

    def publish(self, rows: Iterator[Any], batch_id: int | None) -> Published:
        import pika  # type: ignore[import-not-found,import-untyped,unused-ignore]
        from pyspark import TaskContext  # type: ignore[import-not-found,import-untyped,unused-ignore]

        ctx = TaskContext.get()
        task = ctx.partitionId() if ctx is not None else 0
        query = self.query_id
        if batch_id is None and ctx is not None:  # streaming: Spark's ids, stable across re-runs
            query = ctx.getLocalProperty("sql.streaming.queryId") or query
            raw = ctx.getLocalProperty("streaming.sql.batchId")
            batch_id = int(raw) if raw is not None else None
        params = pika.URLParameters(self.uri)
        params.blocked_connection_timeout = self.confirm_timeout
        conn = pika.BlockingConnection(params)
        try:
            ch = conn.channel()
            ch.confirm_delivery()
            targets: dict[str, bool] = {}
            n = 0
            for n, row in enumerate(rows, 1):
                d = row.asDict()
                topic = self.topic or d.get("topic")
                if not topic:
                    raise ValueError("skred sink: a row has no topic")
                if d.get("partition") is not None:
                    raise ValueError("skred sink: the partition column is not supported")
                is_exchange = targets.get(topic)
                if is_exchange is None:
                    is_exchange = targets[topic] = _exchange_exists(conn, topic)
                if self.exactly_once and not is_exchange:
                    raise ValueError(f"skred sink: exactlyOnce needs '{topic}' to be an exchange "
                                     "declared with x-message-deduplication (bound to the stream)")
                value = d["value"]
                body = value.encode() if isinstance(value, str) else bytes(value or b"")
                headers = dict(d.get("headers") or {})
                props = pika.BasicProperties(delivery_mode=2)
                if self.exactly_once:
                    props.message_id = f"{query}.{batch_id or 0}.{task}.{n}"
                    headers[DEDUP_HEADER] = props.message_id
                props.headers = headers or None
                exchange, rk = (topic, d.get("key") or "") if is_exchange else ("", topic)
                # confirm_delivery: basic_publish returns once confirmed, raises on nack/return
                ch.basic_publish(exchange, rk, body, props, mandatory=not is_exchange)
            return Published(n)
        finally:
            if conn.is_open:
                conn.close()


def _exchange_exists(conn: Any, name: str) -> bool:
    import pika
    ch = conn.channel()
    try:
        ch.exchange_declare(name, passive=True)
    except pika.exceptions.ChannelClosedByBroker as exc:
        if exc.reply_code == 404:
            return False
        raise
    ch.close()
    return True


class SkredWriter(DataSourceWriter):  # type: ignore[misc,unused-ignore]
    def __init__(self, options: dict[str, str], schema: Any, overwrite: bool) -> None:
        self.sink = _Sink(options, schema)

    def write(self, iterator: Iterator[Any]) -> Published:
        return self.sink.publish(iterator, 0)


class SkredStreamWriter(DataSourceStreamWriter):  # type: ignore[misc,unused-ignore]
    def __init__(self, options: dict[str, str], schema: Any, overwrite: bool) -> None:
        self.sink = _Sink(options, schema)

    def write(self, iterator: Iterator[Any]) -> Published:
        return self.sink.publish(iterator, None)

    def commit(self, messages: list[Any], batchId: int) -> None:  # noqa: N803 - Spark's name
        pass  # every row was confirmed by its task

    def abort(self, messages: list[Any], batchId: int) -> None:  # noqa: N803 - Spark's name
        pass  # confirmed rows stay; with exactlyOnce the re-run's duplicates are dropped
