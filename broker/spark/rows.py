"""Stream records -> Spark rows: the schema and a fast Arrow batch builder.

Theory of operation: a record is ``(offset, timestamp_ms, exchange, routing_key, props, body)``
as stored in the segment files (props in AMQP wire order). The Arrow builder turns a list of
records into one ``pyarrow.RecordBatch`` whose schema equals the Spark schema converted the
way PySpark converts it (``to_arrow_schema(..., timezone="UTC")``), so Spark takes the batch
as is (no per-row Python -> JVM conversion). AMQP properties are decoded with pamqp once per
distinct property blob (publishers usually reuse identical properties), so the per-message
cost is a dict lookup.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from pamqp import commands

from broker.store.segment import I64, U32, U64

# (offset, timestamp_ms, exchange, routing_key, props, body)
Rec = tuple[int, int, bytes, bytes, bytes, bytes]

PROPERTY_FIELDS = (
    ("content_type", "string"), ("content_encoding", "string"), ("delivery_mode", "int"),
    ("priority", "int"), ("correlation_id", "string"), ("reply_to", "string"),
    ("expiration", "string"), ("message_id", "string"), ("timestamp", "timestamp"),
    ("type", "string"), ("user_id", "string"), ("app_id", "string"),
)

# Kafka's source columns (key = routing key), then the AMQP ones; ``headers`` only when asked
# for (includeHeaders), as Kafka's source does. timestampType is always 1 (log append time).
SCHEMA_DDL = (
    "key string, value binary, topic string, partition int, offset long, timestamp timestamp, "
    "timestampType int, exchange string, "
    "properties struct<" + ", ".join(f"{n}: {t}" for n, t in PROPERTY_FIELDS) + ">"
)
HEADERS_DDL = ", headers map<string,string>"


def schema_ddl(include_headers: bool) -> str:
    return SCHEMA_DDL + (HEADERS_DDL if include_headers else "")

_CACHE_MAX = 8192
_EPOCH = datetime.datetime(1970, 1, 1, tzinfo=datetime.UTC)


def _plain(value: Any) -> Any:
    """A header value as JSON-able data (nested tables and arrays keep their shape)."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    return _text(value)


def _text(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, (dict, list, tuple)):
        return json.dumps(_plain(value), separators=(",", ":"), ensure_ascii=False)
    if isinstance(value, (bytes, bytearray)):
        return bytes(value).decode("utf-8", "replace")
    if isinstance(value, datetime.datetime):
        stamp: datetime.datetime = value
        if stamp.tzinfo is None:
            stamp = stamp.replace(tzinfo=datetime.UTC)
        return stamp.isoformat()
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _micros(value: Any) -> int | None:
    if not isinstance(value, datetime.datetime):
        return None
    stamp: datetime.datetime = value
    if stamp.tzinfo is None:
        stamp = stamp.replace(tzinfo=datetime.UTC)
    return (stamp - _EPOCH) // datetime.timedelta(microseconds=1)


class PropsDecoder:
    """props bytes -> (properties dict for Arrow, headers as [(k, v)]), cached by value."""

    def __init__(self) -> None:
        self._cache: dict[bytes, tuple[dict[str, Any], list[tuple[str, str | None]]]] = {}

    def decode(self, props: bytes) -> tuple[dict[str, Any], list[tuple[str, str | None]]]:
        hit = self._cache.get(props)
        if hit is not None:
            return hit
        p = commands.Basic.Properties()
        if len(props) >= 2:
            p.unmarshal((props[0] << 8) | props[1], props[2:])
        out: dict[str, Any] = {}
        for name, kind in PROPERTY_FIELDS:
            v = getattr(p, name, None)
            if kind == "string":
                out[name] = _text(v)
            elif kind == "int":
                out[name] = None if v is None else int(v)
            else:
                out[name] = _micros(v)
        headers = [(str(k), _text(v)) for k, v in (p.headers or {}).items()]
        hit = (out, headers)
        if len(self._cache) >= _CACHE_MAX:
            self._cache.clear()
        self._cache[props] = hit
        return hit


def arrow_schema(schema: Any) -> Any:
    """The Arrow schema PySpark expects for ``schema`` (a StructType)."""
    from pyspark.sql.pandas.types import to_arrow_schema  # type: ignore[import-not-found,import-untyped,unused-ignore]
    return to_arrow_schema(schema, timezone="UTC")


class Columns:
    """Column buffers of one batch; properties and headers dictionary-encoded by props blob."""

    __slots__ = ("offsets", "stamps", "exchanges", "keys", "prop_idx", "uniq", "bodies", "_text")

    def __init__(self) -> None:
        self.offsets: list[int] = []
        self.stamps: list[int] = []  # milliseconds
        self.exchanges: list[str] = []
        self.keys: list[str] = []
        self.prop_idx: list[int] = []
        self.uniq: dict[bytes, int] = {}
        self.bodies: list[bytes] = []
        self._text: dict[bytes, str] = {}

    def __len__(self) -> int:
        return len(self.offsets)

    def records(self) -> Iterator[Rec]:
        """The rows as record tuples again (tests and cold paths)."""
        props = list(self.uniq)  # dict order == index order
        for i, offset in enumerate(self.offsets):
            yield (offset, self.stamps[i], self.exchanges[i].encode(), self.keys[i].encode(),
                   props[self.prop_idx[i]], self.bodies[i])

    def text(self, raw: bytes) -> str:
        s = self._text.get(raw)
        if s is None:
            if len(self._text) > _CACHE_MAX:
                self._text.clear()
            s = self._text[raw] = raw.decode("utf-8", "replace")
        return s

    def add(self, rec: Rec) -> None:
        self.offsets.append(rec[0])
        self.stamps.append(rec[1])
        self.exchanges.append(self.text(rec[2]))
        self.keys.append(self.text(rec[3]))
        i = self.uniq.get(rec[4])
        if i is None:
            i = self.uniq[rec[4]] = len(self.uniq)
        self.prop_idx.append(i)
        self.bodies.append(rec[5])


def fill_from_segment(cols: Columns, buf: Any, size: int, pos: int, offset: int, start: int, stop: int,
                      ts_lo: int | None, ts_hi: int | None, max_rows: int,
                      max_bytes: int = 64 << 20) -> tuple[int, int, bool]:
    """Parse records from ``pos`` (whose offset is ``offset``) into ``cols``.

    Stops after ``max_rows`` rows or ``max_bytes`` of record bytes, at ``stop``, or at the
    end of complete records. Returns (next position, next offset, finished).
    Tight loop: this is the batch read hot path.
    """
    i64 = I64.unpack_from
    u32 = U32.unpack_from
    u64 = U64.unpack_from
    text = cols.text
    uniq = cols.uniq
    add_off = cols.offsets.append
    add_ts = cols.stamps.append
    add_ex = cols.exchanges.append
    add_rk = cols.keys.append
    add_pi = cols.prop_idx.append
    add_body = cols.bodies.append
    n = len(cols.offsets)
    budget = max_bytes
    lo = -(1 << 63) if ts_lo is None else ts_lo
    hi = (1 << 63) if ts_hi is None else ts_hi
    while pos + 22 <= size:
        if offset >= stop:
            return pos, offset, True
        if n >= max_rows or budget <= 0:
            return pos, offset, False
        ts = i64(buf, pos)[0]
        if ts == 0:
            return pos, offset, True
        p = pos + 9
        q = p + buf[pos + 8]
        ex = buf[p:q]
        if q >= size:
            return pos, offset, True
        p = q + 1
        q = p + buf[q]
        rk = buf[p:q]
        p = q + 4
        if p > size:
            return pos, offset, True
        q = p + u32(buf, q)[0]
        props = buf[p:q]
        p = q + 8
        if p > size:
            return pos, offset, True
        end = p + u64(buf, q)[0]
        if end > size:
            return pos, offset, True
        if offset >= start and lo <= ts <= hi:
            add_off(offset)
            add_ts(ts)
            add_ex(text(ex))
            add_rk(text(rk))
            i = uniq.get(props)
            if i is None:
                i = uniq[props] = len(uniq)
            add_pi(i)
            add_body(buf[p:end])
            n += 1
            budget -= end - pos
        offset += 1
        pos = end
    return pos, offset, True


def to_batch(cols: Columns, pa_schema: Any, decoder: PropsDecoder, columns: Sequence[str],
             topic: str = "", partition: int = 0) -> Any:
    """One ``pyarrow.RecordBatch`` with ``columns`` (in that order) of one stream partition."""
    import pyarrow as pa  # type: ignore[import-not-found,import-untyped,unused-ignore]
    return assemble(len(cols), pa_schema, decoder, columns, {
        "offset": lambda: pa.array(cols.offsets, type=pa.int64()),
        "stamps": lambda: pa.array(cols.stamps, type=pa.int64()),
        "exchange": lambda: pa.array(cols.exchanges, type=pa.string()),
        "key": lambda: pa.array(cols.keys, type=pa.string()),
        "value": lambda: pa.array(cols.bodies, type=pa.binary()),
        "props": lambda: (list(cols.uniq), pa.array(cols.prop_idx, type=pa.int32())),  # dict order == index
    }, topic, partition)


def segment_batch(cols: Any, pa_schema: Any, decoder: PropsDecoder, columns: Sequence[str],
                  topic: str = "", partition: int = 0) -> Any:
    """``to_batch`` of a ``segment_arrow.SegmentColumns`` (the data-dir read path)."""
    import pyarrow as pa  # type: ignore[import-not-found,import-untyped,unused-ignore]
    import pyarrow.compute as pc  # type: ignore[import-not-found,import-untyped,unused-ignore]

    def props() -> tuple[list[bytes], Any]:
        enc = pc.dictionary_encode(cols.props)
        return enc.dictionary.to_pylist(), enc.indices.cast(pa.int32())

    return assemble(len(cols), pa_schema, decoder, columns, {
        "offset": lambda: pa.array(cols.offsets, type=pa.int64()),
        "stamps": lambda: pa.array(cols.stamps, type=pa.int64()),
        "exchange": lambda: _utf8(pa, cols.exchanges),
        "key": lambda: _utf8(pa, cols.keys),
        "value": lambda: cols.bodies,
        "props": props,
    }, topic, partition)


def _utf8(pa: Any, values: Any) -> Any:
    """A binary array as strings; invalid UTF-8 is replaced per value, as ``bytes.decode`` does."""
    try:
        return values.cast(pa.string())
    except pa.ArrowInvalid:
        return pa.array([None if v is None else v.decode("utf-8", "replace") for v in values.to_pylist()],
                        type=pa.string())


def assemble(n: int, pa_schema: Any, decoder: PropsDecoder, columns: Sequence[str],
             source: dict[str, Any], topic: str, partition: int) -> Any:
    """The record batch of ``n`` rows from ``source``'s column makers (called only for the
    columns asked for): ``offset``, ``stamps`` (ms), ``exchange``, ``key``, ``value`` give
    Arrow arrays, ``props`` gives (distinct property blobs, each row's index into them)."""
    import pyarrow as pa  # type: ignore[import-not-found,import-untyped,unused-ignore]
    import pyarrow.compute as pc  # type: ignore[import-not-found,import-untyped,unused-ignore]
    arrays: list[Any] = []
    idx: Any = None
    decoded: list[tuple[dict[str, Any], list[tuple[str, str | None]]]] = []
    if "properties" in columns or "headers" in columns:
        uniq, idx = source["props"]()
        decoded = [decoder.decode(p) for p in uniq]
    for name in columns:
        typ = pa_schema.field(name).type
        if name in ("offset", "exchange", "key", "value"):
            arrays.append(source[name]().cast(typ))
        elif name == "timestamp":
            arrays.append(pc.multiply(source["stamps"](), 1000).cast(typ))
        elif name == "topic":
            arrays.append(pa.repeat(pa.scalar(topic, typ), n))
        elif name == "partition":
            arrays.append(pa.repeat(pa.scalar(partition, typ), n))
        elif name == "timestampType":
            arrays.append(pa.repeat(pa.scalar(1, typ), n))
        elif name == "properties":
            arrays.append(_struct_array(pa, [d[0] for d in decoded], typ).take(idx))
        elif name == "headers":
            arrays.append(pa.array([d[1] for d in decoded], type=typ).take(idx))
        else:
            raise ValueError(f"unknown column {name}")
    return pa.RecordBatch.from_arrays(arrays, schema=pa_schema)


def _struct_array(pa: Any, dicts: list[dict[str, Any]], typ: Any) -> Any:
    children = []
    for field in typ:
        values = [d[field.name] for d in dicts]
        if pa.types.is_timestamp(field.type):
            children.append(pa.array(values, type=pa.int64()).cast(field.type))
        else:
            children.append(pa.array(values, type=field.type))
    return pa.StructArray.from_arrays(children, fields=list(typ))


def to_rows(records: Iterable[Rec], decoder: PropsDecoder) -> Iterable[tuple[Any, ...]]:
    """Plain tuples (fallback when Arrow batches are not wanted)."""
    for r in records:
        props, headers = decoder.decode(r[4])
        p = dict(props)
        if p["timestamp"] is not None:
            p["timestamp"] = _EPOCH + datetime.timedelta(microseconds=p["timestamp"])
        yield (r[0], datetime.datetime.fromtimestamp(r[1] / 1000, datetime.UTC),
               r[2].decode("utf-8", "replace"), r[3].decode("utf-8", "replace"), p,
               dict(headers), r[5])
