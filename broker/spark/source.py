"""The ``skred`` PySpark Python Data Source: stream queues as DataFrames.

Theory of operation
-------------------
Two ways in, same rows:

* ``option("data_dir", DIR)`` reads the segment files of ``vhost``/``queue`` directly (a
  stopped broker, a follower's replicated copy, or a running broker: files are only read,
  and only complete records are seen). Planning reads the per-segment index files
  (``sidx.*``: first offset, first timestamp) and walks only the last segment, then makes ONE
  INPUT PARTITION PER SEGMENT. Offset bounds (``startingOffset``/``endingOffset`` options and
  pushed-down filters on ``offset``) and timestamp bounds (filters on ``timestamp``) drop
  whole segments before any task runs; rows are then trimmed exactly, and the filters are
  still handed back to Spark, so pruning is an optimisation, never a semantic change.
  Filter pushdown (``option("pushdown")``) is ``auto`` by default: Spark refuses a reader that
  implements ``pushFilters`` unless the session sets
  ``spark.sql.python.filterPushdown.enabled=true`` (off by default), and the data source is
  not told that setting. So ``reader()`` looks at the Spark planner worker that calls it: the
  filter-pushdown worker (only run when the setting is on) or the plain planning worker's
  ``enable_pushdown`` flag. If pushdown is allowed it returns the pushdown reader, otherwise
  (or when the caller is not recognised, e.g. another Spark version) the plain one, which
  reads everything correctly and still prunes with the ``startingOffset``/``endingOffset``
  options. ``true`` forces pushdown (Spark then errors unless the setting is on), ``false``
  turns it off.
* ``option("uri", "amqp://...")`` reads from a running broker over AMQP with stream offsets
  (``broker/spark/amqp.py``), split into ``numPartitions`` offset ranges.

Structured Streaming: offsets are ``{"offset": next_offset}``. ``latestOffset`` is the
stream's current end (capped by ``maxRecordsPerTrigger``), a micro-batch reads exactly
``[start, end)``; Spark checkpoints those offsets, so a restarted query continues at the
checkpointed end: no loss and no duplicates, because an offset always names the same message.

Rows are built as Arrow record batches (``rows.py``) for throughput.
"""

from __future__ import annotations

import datetime
import mmap
import os
import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pyspark.sql.datasource import (  # type: ignore[import-not-found,import-untyped,unused-ignore]
    DataSource,
    DataSourceReader,
    DataSourceStreamReader,
    EqualTo,
    GreaterThan,
    GreaterThanOrEqual,
    In,
    InputPartition,
    LessThan,
    LessThanOrEqual,
)

from broker.spark import amqp
from broker.spark.rows import SCHEMA_DDL, Columns, PropsDecoder, arrow_schema, fill_from_segment, to_batch
from broker.store.paths import queue_dir, vhost_dir
from broker.store.segment import HEADER_SIZE
from broker.store.stream_store import list_segments

_BATCH_ROWS = 65536  # rows per Arrow batch (measured: 8192 is ~2x slower end to end)
_BATCH_BYTES = 64 << 20  # and at most this many record bytes per batch
_EPOCH = datetime.datetime(1970, 1, 1, tzinfo=datetime.UTC)


@dataclass
class Bounds:
    """Half-open offset range and inclusive millisecond timestamp range (None: open)."""

    lo: int = 0
    hi: int | None = None
    ts_lo: int | None = None
    ts_hi: int | None = None

    def cap_hi(self, hi: int) -> None:
        self.hi = hi if self.hi is None else min(self.hi, hi)


class SegmentPartition(InputPartition):  # type: ignore[misc,unused-ignore]
    path: str
    first_offset: int
    start: int  # first offset to return
    stop: int  # offset to stop at (exclusive)
    ts_lo: int | None
    ts_hi: int | None

    def __init__(self, path: str, first_offset: int, start: int, stop: int,
                 ts_lo: int | None = None, ts_hi: int | None = None) -> None:
        super().__init__(path)
        self.path, self.first_offset, self.start, self.stop = path, first_offset, start, stop
        self.ts_lo, self.ts_hi = ts_lo, ts_hi


class AmqpPartition(InputPartition):  # type: ignore[misc,unused-ignore]
    start: int
    stop: int

    def __init__(self, start: int, stop: int) -> None:
        super().__init__(start)
        self.start, self.stop = start, stop


class _Options:
    def __init__(self, raw: dict[str, str]) -> None:
        options = {k.lower(): v for k, v in raw.items()}  # Spark options are case-insensitive
        self.uri = options.get("uri")
        self.queue = options.get("queue") or ""
        if not self.queue:
            raise ValueError("skred: option 'queue' is required")
        self.vhost = options.get("vhost", "/")
        data_dir = options.get("data_dir") or options.get("path")
        if not self.uri and not data_dir:
            raise ValueError("skred: set option 'data_dir' (segment files) or 'uri' (AMQP)")
        self.dir = queue_dir(vhost_dir(Path(data_dir), self.vhost), self.queue) if data_dir else None
        self.batch_rows = int(options.get("batchrows", _BATCH_ROWS))
        self.batch_bytes = int(options.get("batchbytes", _BATCH_BYTES))
        self.partitions = max(1, int(options.get("numpartitions", "1")))
        # auto (default): push filters down when the Spark session allows it (see reader()).
        self.pushdown = options.get("pushdown", "auto").strip().lower()
        if self.pushdown not in ("auto", "true", "false"):
            raise ValueError("skred: option 'pushdown' must be auto, true or false")
        self.starting = options.get("startingoffset", options.get("startingoffsets"))
        self.ending = options.get("endingoffset")
        self.max_per_trigger = options.get("maxrecordspertrigger")
        self.timeout = float(options.get("timeout", "30"))

    def extent(self) -> tuple[int, int]:
        """(first offset, next offset) right now."""
        if self.uri:
            return amqp.extent(self.uri, self.queue, self.timeout)
        assert self.dir is not None
        infos = [i for i in list_segments(self.dir) if i.count]
        if not infos:
            nxt = _next_of(self.dir)
            return nxt, nxt
        last = infos[-1]
        assert infos[0].first_offset is not None and last.first_offset is not None
        assert last.count is not None
        return infos[0].first_offset, last.first_offset + last.count

    def plan(self, b: Bounds) -> list[InputPartition]:
        """Partitions covering ``b`` (segments pruned by offset and timestamp)."""
        if self.uri:
            first, nxt = self.extent()
            lo, hi = max(b.lo, first), nxt if b.hi is None else min(b.hi, nxt)
            if lo >= hi:
                return []
            n = min(self.partitions, hi - lo)
            step = -(-(hi - lo) // n)
            return [AmqpPartition(s, min(s + step, hi)) for s in range(lo, hi, step)]
        assert self.dir is not None
        infos = list_segments(self.dir)
        parts: list[InputPartition] = []
        for k, info in enumerate(infos):
            if not info.count or info.first_offset is None:
                continue
            first, stop = info.first_offset, info.first_offset + info.count
            start = max(first, b.lo)
            if b.hi is not None:
                stop = min(stop, b.hi)
            if start >= stop:
                continue
            seg_ts_lo = info.first_ts
            seg_ts_hi = infos[k + 1].first_ts if k + 1 < len(infos) else None
            if b.ts_hi is not None and seg_ts_lo is not None and seg_ts_lo > b.ts_hi:
                continue
            if b.ts_lo is not None and seg_ts_hi is not None and seg_ts_hi < b.ts_lo:
                continue
            parts.append(SegmentPartition(str(info.path), first, start, stop, b.ts_lo, b.ts_hi))
        return parts

    def batches(self, part: InputPartition, schema: Any) -> Iterator[Any]:
        """Arrow record batches of one partition."""
        pa_schema = arrow_schema(schema)
        columns = schema.fieldNames()
        decoder = PropsDecoder()
        if isinstance(part, AmqpPartition):
            assert self.uri is not None
            cols = Columns()
            for rec in amqp.read_range(self.uri, self.queue, part.start, part.stop, self.timeout):
                cols.add(rec)
                if len(cols) >= self.batch_rows:
                    yield to_batch(cols, pa_schema, decoder, columns)
                    cols = Columns()
            if len(cols):
                yield to_batch(cols, pa_schema, decoder, columns)
            return
        if not isinstance(part, SegmentPartition):
            return  # Spark runs one placeholder partition when partitions() is empty
        try:
            f = open(part.path, "rb")  # noqa: SIM115 - closed below
        except FileNotFoundError:
            return  # removed by retention after planning
        with f:
            size = os.fstat(f.fileno()).st_size
            if size <= HEADER_SIZE:
                return
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                pos, offset, done = HEADER_SIZE, part.first_offset, False
                while not done:
                    cols = Columns()
                    pos, offset, done = fill_from_segment(cols, mm, size, pos, offset, part.start,
                                                          part.stop, part.ts_lo, part.ts_hi,
                                                          self.batch_rows, self.batch_bytes)
                    if len(cols):
                        yield to_batch(cols, pa_schema, decoder, columns)


def _next_of(directory: Path) -> int:
    infos = list_segments(directory)
    if not infos or infos[-1].first_offset is None:
        return 0
    return infos[-1].first_offset + (infos[-1].count or 0)


def _ms(value: Any) -> int | None:
    """A pushed-down timestamp literal as epoch milliseconds (floor)."""
    if isinstance(value, datetime.datetime):
        stamp: datetime.datetime = value
        if stamp.tzinfo is None:
            stamp = stamp.astimezone()  # naive literals are in the local zone
        return (stamp - _EPOCH) // datetime.timedelta(milliseconds=1)
    if isinstance(value, (int, float)):
        return int(value)
    return None


_PUSHDOWN_WORKER = "pyspark.sql.worker.data_source_pushdown_filters"
_PLAN_WORKER = "pyspark.sql.worker.plan_data_source_read"


def spark_allows_pushdown(max_depth: int = 8) -> bool:
    """Whether the Spark planner calling ``DataSource.reader`` accepts a ``pushFilters`` reader.

    Spark (4.1 to 4.3 at least) plans a Python data source read in a worker process: the
    filter-pushdown worker runs only when ``spark.sql.python.filterPushdown.enabled`` is on;
    the plain planning worker holds that setting in its local ``enable_pushdown`` and fails a
    reader with ``pushFilters`` when it is off. Neither is passed to the data source, so look
    at the calling frames. Anything unrecognised answers False: the plain reader is always
    correct, it only prunes less.
    """
    frame: types.FrameType | None = sys._getframe(1)
    for _ in range(max_depth):
        if frame is None:
            return False
        module = frame.f_globals.get("__name__")
        if module == _PUSHDOWN_WORKER:
            return True
        if module == _PLAN_WORKER:
            return frame.f_locals.get("enable_pushdown") is True
        frame = frame.f_back
    return False


def _parse_offset(value: str | None, first: int, nxt: int, default: int) -> int:
    if value is None:
        return default
    v = value.strip().lower()
    if v in ("earliest", "first"):
        return first
    if v in ("latest", "next"):
        return nxt
    return int(v)


class SkredDataSource(DataSource):  # type: ignore[misc,unused-ignore]
    """``spark.read.format("skred")`` / ``spark.readStream.format("skred")``."""

    @classmethod
    def name(cls) -> str:
        return "skred"

    def schema(self) -> str:
        return SCHEMA_DDL

    def reader(self, schema: Any) -> DataSourceReader:
        opts = _Options(dict(self.options))
        push = opts.pushdown == "true" or (opts.pushdown == "auto" and spark_allows_pushdown())
        if push:
            return SkredPushdownReader(opts, schema)
        return SkredBatchReader(opts, schema)

    def streamReader(self, schema: Any) -> DataSourceStreamReader:
        return SkredStreamReader(_Options(dict(self.options)), schema)


class SkredBatchReader(DataSourceReader):  # type: ignore[misc,unused-ignore]
    def __init__(self, opts: _Options, schema: Any) -> None:
        self.opts = opts
        self.schema = schema
        self.bounds = Bounds()
        if opts.starting is not None and opts.starting.strip().lower() not in ("earliest", "first"):
            self.bounds.lo = int(opts.starting)
        if opts.ending is not None and opts.ending.strip().lower() not in ("latest", "next"):
            self.bounds.cap_hi(int(opts.ending))

    def partitions(self) -> list[InputPartition]:
        return self.opts.plan(self.bounds)

    def read(self, partition: InputPartition) -> Iterator[Any]:
        return self.opts.batches(partition, self.schema)


class SkredPushdownReader(SkredBatchReader):
    def pushFilters(self, filters: list[Any]) -> Iterator[Any]:
        """Narrow the offset/timestamp bounds; every filter is still returned to Spark."""
        b = self.bounds
        for f in filters:
            col = f.attribute[0] if len(f.attribute) == 1 and hasattr(f, "value") else None
            if col == "offset":
                if isinstance(f, EqualTo):
                    b.lo = max(b.lo, int(f.value))
                    b.cap_hi(int(f.value) + 1)
                elif isinstance(f, GreaterThan):
                    b.lo = max(b.lo, int(f.value) + 1)
                elif isinstance(f, GreaterThanOrEqual):
                    b.lo = max(b.lo, int(f.value))
                elif isinstance(f, LessThan):
                    b.cap_hi(int(f.value))
                elif isinstance(f, LessThanOrEqual):
                    b.cap_hi(int(f.value) + 1)
                elif isinstance(f, In) and f.value:
                    vals = [int(v) for v in f.value if v is not None]
                    if vals:
                        b.lo = max(b.lo, min(vals))
                        b.cap_hi(max(vals) + 1)
            elif col == "timestamp":
                ms = _ms(f.value) if not isinstance(f, In) else None
                if ms is None:
                    pass
                elif isinstance(f, (GreaterThan, GreaterThanOrEqual)):
                    b.ts_lo = ms if b.ts_lo is None else max(b.ts_lo, ms)
                elif isinstance(f, (LessThan, LessThanOrEqual)):
                    # ms is floored: a record at ms (< value in microseconds) may still match
                    b.ts_hi = ms if b.ts_hi is None else min(b.ts_hi, ms)
                elif isinstance(f, EqualTo):
                    b.ts_lo = ms if b.ts_lo is None else max(b.ts_lo, ms)
                    b.ts_hi = ms if b.ts_hi is None else min(b.ts_hi, ms)
            yield f


class SkredStreamReader(DataSourceStreamReader):  # type: ignore[misc,unused-ignore]
    def __init__(self, opts: _Options, schema: Any) -> None:
        self.opts = opts
        self.schema = schema

    def initialOffset(self) -> dict[str, int]:
        first, nxt = self.opts.extent()
        return {"offset": _parse_offset(self.opts.starting, first, nxt, first)}

    def latestOffset(self, start: dict[str, int] | None = None, limit: Any = None) -> dict[str, int]:
        _first, nxt = self.opts.extent()
        cap: int | None = None
        max_rows = getattr(limit, "max_rows", None)
        if max_rows is not None:
            cap = int(max_rows)
        elif self.opts.max_per_trigger is not None and limit is None:
            cap = int(self.opts.max_per_trigger)
        if cap is not None and start is not None:
            nxt = min(nxt, int(start["offset"]) + cap)
        if start is not None:
            nxt = max(nxt, int(start["offset"]))
        return {"offset": nxt}

    def getDefaultReadLimit(self) -> Any:
        from pyspark.sql.streaming.datasource import (  # type: ignore[import-not-found,import-untyped,unused-ignore]
            ReadAllAvailable,
            ReadMaxRows,
        )
        if self.opts.max_per_trigger is not None:
            return ReadMaxRows(int(self.opts.max_per_trigger))
        return ReadAllAvailable()

    def partitions(self, start: dict[str, int], end: dict[str, int]) -> list[InputPartition]:
        return self.opts.plan(Bounds(int(start["offset"]), int(end["offset"])))

    def read(self, partition: InputPartition) -> Iterator[Any]:
        return self.opts.batches(partition, self.schema)

    def commit(self, end: dict[str, int]) -> None:
        pass  # nothing to release: the broker keeps the log, Spark keeps the offsets
