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
* ``option("uri", "http://user:password@host:15672")`` reads from a running broker over the
  network: its management port answers a stream's stored records raw (``netread.py``), which
  the task decodes with the data-dir path's column-wise code, so both modes build their rows
  the same way. ``option("uri", "amqp://...")`` still reads by consuming the stream over AMQP
  with stream offsets (``broker/spark/amqp.py``), several times slower (docs/benchmarks.md).

Several streams are read at once (``subscribe``, ``subscribePattern``, ``assign``; see
``options.py``): planning works per ``TopicPartition``, and an input partition is an offset
range of one of them (a segment, or a slice of one when ``minPartitions`` /
``maxRecordsPerPartition`` ask for more). An explicit start offset below the first retained
one, or a segment removed between planning and reading, is data loss: an error unless
``failOnDataLoss=false``.

Structured Streaming: offsets are Kafka-shaped, ``{"stream": {"0": next_offset}}``.
``latestOffset`` is each partition's current end, capped by ``maxOffsetsPerTrigger`` (shared
in proportion to each partition's backlog), held back while fewer than
``minOffsetsPerTrigger`` are waiting unless ``maxTriggerDelay`` has passed since the last
batch; ``Trigger.AvailableNow`` fixes the ends once (``prepareForTriggerAvailableNow``) and
then runs rate-limited batches up to them. A micro-batch reads exactly ``[start, end)`` of each
partition; Spark checkpoints those offsets, so a restarted query continues at the
checkpointed end: no loss and no duplicates, because an offset always names the same message.

Rows are built as Arrow record batches (``rows.py``) for throughput.
"""

from __future__ import annotations

import datetime
import mmap
import os
import sys
import time
import types
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pyspark.sql.datasource import (  # type: ignore[import-not-found,import-untyped,unused-ignore]
    DataSource,
    DataSourceReader,
    DataSourceStreamReader,
    DataSourceStreamWriter,
    DataSourceWriter,
    EqualTo,
    GreaterThan,
    GreaterThanOrEqual,
    In,
    InputPartition,
    LessThan,
    LessThanOrEqual,
)
from pyspark.sql.streaming.datasource import (  # type: ignore[import-not-found,import-untyped,unused-ignore]
    ReadAllAvailable,
    ReadMaxRows,
    SupportsTriggerAvailableNow,
)

from broker.spark import amqp, netread
from broker.spark.options import (
    EARLIEST,
    LATEST,
    SOURCE_OPTIONS,
    TopicPartition,
    checked,
    duration_ms,
    flag,
    number,
    per_partition,
    topic_partitions,
)
from broker.spark.rows import (
    Columns,
    PropsDecoder,
    arrow_schema,
    fill_from_segment,
    schema_ddl,
    segment_batch,
    to_batch,
)
from broker.spark.segment_arrow import columns, walk
from broker.store.paths import find_vhost_dir, queue_dir
from broker.store.segment import HEADER_SIZE
from broker.store.stream_store import list_segments

_BATCH_ROWS = 65536  # rows per Arrow batch (measured: 8192 is ~2x slower end to end)
_BATCH_BYTES = 64 << 20  # and at most this many record bytes per batch
_EPOCH = datetime.datetime(1970, 1, 1, tzinfo=datetime.UTC)
_MAX_TRIGGER_DELAY_MS = 15 * 60_000  # Kafka's default maxTriggerDelay

Offsets = dict[str, dict[str, int]]  # {"stream": {"0": offset}}


class DataLoss(RuntimeError):
    """Offsets a read needs were removed by retention (failOnDataLoss=true)."""


@dataclass
class Bounds:
    """Half-open offset range and inclusive millisecond timestamp range (None: open)."""

    lo: int = 0
    hi: int | None = None
    ts_lo: int | None = None
    ts_hi: int | None = None

    def cap_hi(self, hi: int) -> None:
        self.hi = hi if self.hi is None else min(self.hi, hi)

    def narrowed(self, other: Bounds) -> Bounds:
        out = Bounds(max(self.lo, other.lo), self.hi, _most(max, self.ts_lo, other.ts_lo),
                     _most(min, self.ts_hi, other.ts_hi))
        if other.hi is not None:
            out.cap_hi(other.hi)
        return out


def _most(pick: Any, a: int | None, b: int | None) -> int | None:
    return b if a is None else a if b is None else int(pick(a, b))


class RangePartition(InputPartition):  # type: ignore[misc,unused-ignore]
    """Offsets ``[start, stop)`` of one stream partition; ``path`` names the segment file to
    read (data dir mode; ``first_offset`` is its first record) or is empty (AMQP mode)."""

    def __init__(self, tp: TopicPartition, start: int, stop: int, path: str = "",
                 first_offset: int = 0, ts_lo: int | None = None, ts_hi: int | None = None) -> None:
        super().__init__((tp.key, start))
        self.tp, self.start, self.stop, self.path = tp, start, stop, path
        self.first_offset, self.ts_lo, self.ts_hi = first_offset, ts_lo, ts_hi


class _Options:
    def __init__(self, raw: dict[str, str]) -> None:
        options = checked(raw, SOURCE_OPTIONS, "source")
        self.uri = options.get("uri")
        self.vhost = options.get("vhost", "/")
        data_dir = options.get("data_dir") or options.get("path")
        if not self.uri and not data_dir:
            raise ValueError("skred: set option 'data_dir' (segment files) or 'uri' (http:// or amqp://)")
        self.vdir = find_vhost_dir(Path(data_dir), self.vhost) if data_dir and not self.uri else None
        if options.get("subscribepattern") and self.vdir is None:
            raise ValueError("skred: subscribePattern needs data_dir (a network read cannot list streams)")
        self.parts = topic_partitions(options, self._list_streams)
        self.batch_rows = number(options, "batchrows", minimum=1) or _BATCH_ROWS
        self.batch_bytes = number(options, "batchbytes", minimum=1) or _BATCH_BYTES
        self.min_partitions = number(options, "minpartitions", minimum=1) or \
            number(options, "numpartitions", minimum=1)
        self.max_per_partition = number(options, "maxrecordsperpartition", minimum=1)
        # auto (default): push filters down when the Spark session allows it (see reader()).
        self.pushdown = options.get("pushdown", "auto").strip().lower()
        if self.pushdown not in ("auto", "true", "false"):
            raise ValueError("skred: option 'pushdown' must be auto, true or false")
        words = {"earliest": EARLIEST, "first": EARLIEST, "latest": LATEST, "next": LATEST}
        self.starting = per_partition(options, "startingoffsets", self.parts, words) or \
            per_partition(options, "startingoffset", self.parts, words)
        self.ending = per_partition(options, "endingoffsets", self.parts, words) or \
            per_partition(options, "endingoffset", self.parts, words)
        # Timestamps: startingTimestamp wins over startingOffsetsByTimestamp, which wins over
        # startingOffsets (Kafka's precedence); an ending timestamp T keeps messages before T.
        self.ts_lo = per_partition(options, "startingtimestamp", self.parts, {}) or \
            per_partition(options, "startingoffsetsbytimestamp", self.parts, {})
        ts_end = per_partition(options, "endingtimestamp", self.parts, {}) or \
            per_partition(options, "endingoffsetsbytimestamp", self.parts, {})
        self.ts_hi = None if ts_end is None else {tp: t - 1 for tp, t in ts_end.items()}
        self.fail_on_data_loss = flag(options, "failondataloss", True)
        self.include_headers = flag(options, "includeheaders", False)
        self.max_per_trigger = number(options, "maxoffsetspertrigger", minimum=1) or \
            number(options, "maxrecordspertrigger", minimum=1)
        self.min_per_trigger = number(options, "minoffsetspertrigger", minimum=1)
        delay = options.get("maxtriggerdelay")
        self.max_trigger_delay_ms = _MAX_TRIGGER_DELAY_MS if delay is None else duration_ms(delay)
        self.timeout = float(options.get("timeout", "30"))
        self.net = netread.is_records_uri(self.uri)  # raw records over HTTP, not AMQP

    def client(self) -> netread.RecordsClient:
        assert self.uri is not None
        return netread.RecordsClient(self.uri, self.vhost, self.timeout)

    def _list_streams(self) -> list[str]:
        """Stream queues in the data dir (directories with a name marker and a segment index)."""
        assert self.vdir is not None
        out = []
        for d in self.vdir.iterdir() if self.vdir.is_dir() else ():
            marker = d / ".queue"
            if marker.is_file() and any(d.glob("sidx.*")):
                out.append(marker.read_bytes().decode("utf-8", "replace"))
        return out

    def _dir(self, tp: TopicPartition) -> Path:
        assert self.vdir is not None
        return queue_dir(self.vdir, tp.queue)

    def extent(self, tp: TopicPartition) -> tuple[int, int]:
        """(first offset, next offset) of one partition right now."""
        if self.net:
            with self.client() as c:
                return c.extent(tp.queue)
        if self.uri:
            return amqp.extent(self.uri, tp.queue, self.timeout)
        infos = [i for i in list_segments(self._dir(tp)) if i.count]
        if not infos:
            nxt = _next_of(self._dir(tp))
            return nxt, nxt
        last = infos[-1]
        assert infos[0].first_offset is not None and last.first_offset is not None
        assert last.count is not None
        return infos[0].first_offset, last.first_offset + last.count

    def check_loss(self, tp: TopicPartition, lo: int, first: int) -> None:
        if lo < first and self.fail_on_data_loss:
            raise DataLoss(f"skred: offsets {lo}..{first - 1} of stream '{tp.topic}' partition "
                           f"{tp.partition} were removed by retention (set failOnDataLoss=false "
                           "to read on from the first retained offset)")

    def batch_bounds(self) -> dict[TopicPartition, Bounds]:
        """Each partition's bounds for a batch read, from the offset and timestamp options."""
        out = {}
        for tp in self.parts:
            first, nxt = self.extent(tp)
            lo = (self.starting or {}).get(tp, EARLIEST)
            if lo == LATEST:
                raise ValueError("skred: startingOffsets=latest is for streaming queries only")
            if lo == EARLIEST:
                lo = first
            self.check_loss(tp, lo, first)
            hi = (self.ending or {}).get(tp, LATEST)
            if hi == EARLIEST:
                raise ValueError("skred: endingOffsets=earliest is not allowed")
            b = Bounds(max(lo, first), nxt if hi == LATEST else min(hi, nxt),
                       (self.ts_lo or {}).get(tp), (self.ts_hi or {}).get(tp))
            out[tp] = b
        return out

    def plan(self, bounds: dict[TopicPartition, Bounds]) -> list[InputPartition]:
        """Input partitions covering ``bounds`` (segments pruned by offset and timestamp), split
        to honour ``minPartitions`` and ``maxRecordsPerPartition``."""
        parts: list[RangePartition] = []
        for tp, b in bounds.items():
            parts.extend(self._plan_one(tp, b))
        chunk = self.max_per_partition
        if self.min_partitions and len(parts) < self.min_partitions:
            total = sum(p.stop - p.start for p in parts)
            if total:
                even = -(-total // self.min_partitions)
                chunk = even if chunk is None else min(chunk, even)
        if chunk is None:
            return list(parts)
        out: list[InputPartition] = []
        for p in parts:
            for s in range(p.start, p.stop, chunk):
                out.append(RangePartition(p.tp, s, min(s + chunk, p.stop), p.path, p.first_offset,
                                          p.ts_lo, p.ts_hi))
        return out

    def _plan_one(self, tp: TopicPartition, b: Bounds) -> list[RangePartition]:
        if self.uri:
            first, nxt = self.extent(tp)
            lo, hi = max(b.lo, first), nxt if b.hi is None else min(b.hi, nxt)
            return [RangePartition(tp, lo, hi, "", 0, b.ts_lo, b.ts_hi)] if lo < hi else []
        infos = list_segments(self._dir(tp))
        parts = []
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
            parts.append(RangePartition(tp, start, stop, str(info.path), first, b.ts_lo, b.ts_hi))
        return parts

    def batches(self, part: InputPartition, schema: Any) -> Iterator[Any]:
        """Arrow record batches of one partition."""
        if not isinstance(part, RangePartition):
            return  # Spark runs one placeholder partition when partitions() is empty
        pa_schema = arrow_schema(schema)
        names = schema.fieldNames()
        decoder = PropsDecoder()
        tp = part.tp

        if not part.path and self.net:
            def gap(lo: int, hi: int) -> None:
                if self.fail_on_data_loss:
                    raise DataLoss(f"skred: offsets {lo}..{hi - 1} of stream '{tp.topic}' partition "
                                   f"{tp.partition} were removed by retention while the query ran "
                                   "(set failOnDataLoss=false to read on)")

            with self.client() as c:
                per_request = min(self.batch_bytes, netread.DEFAULT_MAX_BYTES)
                for seg in netread.read_columns(c, tp.queue, part.start, part.stop, self.batch_rows,
                                                per_request, part.ts_lo, part.ts_hi, gap):
                    yield segment_batch(seg, pa_schema, decoder, names, tp.topic, tp.partition)
            return
        if not part.path:
            assert self.uri is not None
            for cols in amqp.read_columns(self.uri, tp.queue, part.start, part.stop, self.batch_rows,
                                          part.ts_lo, part.ts_hi, self.timeout):
                yield to_batch(cols, pa_schema, decoder, names, tp.topic, tp.partition)
            return
        try:
            f = open(part.path, "rb")  # noqa: SIM115 - closed below
        except FileNotFoundError:
            if self.fail_on_data_loss:
                raise DataLoss(f"skred: a segment of stream '{tp.topic}' (offsets from "
                               f"{part.first_offset}) was removed by retention while the query "
                               "ran (set failOnDataLoss=false to skip it)") from None
            return
        with f:
            size = os.fstat(f.fileno()).st_size
            if size <= HEADER_SIZE:
                return
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                pos, offset, done = HEADER_SIZE, part.first_offset, False
                while not done:
                    at, stamps, pos, offset, done = walk(mm, size, pos, offset, part.start, part.stop,
                                                         self.batch_rows, self.batch_bytes)
                    if len(at):
                        seg = columns(mm, at, stamps, offset - len(at), part.ts_lo, part.ts_hi)
                        if len(seg):
                            yield segment_batch(seg, pa_schema, decoder, names, tp.topic, tp.partition)

    def first_at(self, tp: TopicPartition, ts: int, first: int, nxt: int) -> int:
        """The first offset appended at or after ``ts`` (``nxt`` if none)."""
        for part in self._plan_one(tp, Bounds(first, nxt, ts, None)):
            assert isinstance(part, RangePartition)
            if not part.path and self.net:
                with self.client() as c:
                    found = c.first_at(tp.queue, ts)
                return min(max(found, part.start), nxt)
            if not part.path:
                at = amqp.first_at(self.uri or "", tp.queue, part.start, part.stop, ts, self.timeout)
                return nxt if at is None else at
            with open(part.path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                cols = Columns()
                fill_from_segment(cols, mm, len(mm), HEADER_SIZE, part.first_offset, part.start,
                                  part.stop, ts, None, 1)
            if len(cols):
                return cols.offsets[0]
        return nxt


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


class SkredDataSource(DataSource):  # type: ignore[misc,unused-ignore]
    """``spark.read.format("skred")`` / ``readStream`` and ``df.write`` / ``writeStream``."""

    @classmethod
    def name(cls) -> str:
        return "skred"

    def schema(self) -> str:
        opts = {k.lower(): v for k, v in dict(self.options).items()}
        return schema_ddl(flag(opts, "includeheaders", False))

    def reader(self, schema: Any) -> DataSourceReader:
        opts = _Options(dict(self.options))
        push = opts.pushdown == "true" or (opts.pushdown == "auto" and spark_allows_pushdown())
        if push:
            return SkredPushdownReader(opts, schema)
        return SkredBatchReader(opts, schema)

    def streamReader(self, schema: Any) -> DataSourceStreamReader:
        return SkredStreamReader(_Options(dict(self.options)), schema)

    def writer(self, schema: Any, overwrite: bool) -> DataSourceWriter:
        from broker.spark.sink import SkredWriter
        return SkredWriter(dict(self.options), schema, overwrite)

    def streamWriter(self, schema: Any, overwrite: bool) -> DataSourceStreamWriter:
        from broker.spark.sink import SkredStreamWriter
        return SkredStreamWriter(dict(self.options), schema, overwrite)


class SkredBatchReader(DataSourceReader):  # type: ignore[misc,unused-ignore]
    def __init__(self, opts: _Options, schema: Any) -> None:
        self.opts = opts
        self.schema = schema
        self.bounds = Bounds()  # narrowed by pushed-down filters, applied to every partition

    def partitions(self) -> list[InputPartition]:
        per = self.opts.batch_bounds()
        return self.opts.plan({tp: b.narrowed(self.bounds) for tp, b in per.items()})

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


def _flat(offsets: dict[str, Any], parts: list[TopicPartition]) -> dict[TopicPartition, int]:
    """Checkpointed offsets per partition; the single-stream ``{"offset": n}`` of earlier
    Skred versions is read as that stream's offset."""
    legacy = offsets.get("offset")
    if isinstance(legacy, int) and len(parts) == 1:
        return {parts[0]: legacy}
    out = {}
    for tp in parts:
        v = offsets.get(tp.topic, {}).get(str(tp.partition))
        if v is not None:
            out[tp] = int(v)
    return out


def _nested(flat: dict[TopicPartition, int]) -> Offsets:
    out: Offsets = {}
    for tp, v in sorted(flat.items()):
        out.setdefault(tp.topic, {})[str(tp.partition)] = v
    return out


def share(start: dict[TopicPartition, int], end: dict[TopicPartition, int],
          cap: int) -> dict[TopicPartition, int]:
    """``end`` capped so at most ``cap`` offsets are read in all, each partition's share in
    proportion to its backlog (the remainder goes to the first partitions with room)."""
    lag = {tp: max(0, end[tp] - start.get(tp, end[tp])) for tp in end}
    total = sum(lag.values())
    if total <= cap:
        return dict(end)
    take = {tp: cap * n // total for tp, n in lag.items()}
    left = cap - sum(take.values())
    for tp in sorted(take):
        extra = min(left, lag[tp] - take[tp])
        take[tp] += extra
        left -= extra
    return {tp: start.get(tp, end[tp]) + take[tp] for tp in end}


class SkredStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):  # type: ignore[misc,unused-ignore]
    def __init__(self, opts: _Options, schema: Any) -> None:
        if opts.ending is not None or opts.ts_hi is not None:
            raise ValueError("skred: endingOffsets / endingTimestamp are for batch reads only")
        self.opts = opts
        self.schema = schema
        self._target: dict[TopicPartition, int] | None = None  # Trigger.AvailableNow's end
        self._last_batch = time.monotonic()

    def initialOffset(self) -> Offsets:
        out = {}
        for tp in self.opts.parts:
            first, nxt = self.opts.extent(tp)
            ts = (self.opts.ts_lo or {}).get(tp)
            if ts is not None:
                out[tp] = self.opts.first_at(tp, ts, first, nxt)
                continue
            v = (self.opts.starting or {}).get(tp, LATEST)  # Kafka's streaming default
            if v == EARLIEST:
                v = first
            elif v == LATEST:
                v = nxt
            else:
                self.opts.check_loss(tp, v, first)
            out[tp] = v
        return _nested(out)

    def _ends(self) -> dict[TopicPartition, int]:
        if self._target is not None:
            return dict(self._target)
        return {tp: self.opts.extent(tp)[1] for tp in self.opts.parts}

    def prepareForTriggerAvailableNow(self) -> None:
        self._target = {tp: self.opts.extent(tp)[1] for tp in self.opts.parts}

    def latestOffset(self, start: Offsets | None = None, limit: Any = None) -> Offsets:
        ends = self._ends()
        begin = _flat(start, self.opts.parts) if start is not None else {}
        ends = {tp: max(n, begin.get(tp, n)) for tp, n in ends.items()}
        if isinstance(limit, ReadAllAvailable):
            return _nested(ends)
        cap = getattr(limit, "max_rows", None)
        if cap is None and limit is None:
            cap = self.opts.max_per_trigger
        waiting = sum(n - begin.get(tp, n) for tp, n in ends.items())
        if (self.opts.min_per_trigger is not None and self._target is None and start is not None
                and waiting < self.opts.min_per_trigger
                and (time.monotonic() - self._last_batch) * 1000 < self.opts.max_trigger_delay_ms):
            return _nested({tp: begin.get(tp, n) for tp, n in ends.items()})
        if cap is not None and start is not None:
            ends = share(begin, ends, int(cap))
        if waiting:
            self._last_batch = time.monotonic()
        return _nested(ends)

    def getDefaultReadLimit(self) -> Any:
        if self.opts.max_per_trigger is not None:
            return ReadMaxRows(int(self.opts.max_per_trigger))
        return ReadAllAvailable()

    def partitions(self, start: Offsets, end: Offsets) -> list[InputPartition]:
        begin, stop = _flat(start, self.opts.parts), _flat(end, self.opts.parts)
        bounds = {}
        for tp, hi in stop.items():
            lo = begin.get(tp, hi)
            if lo < hi:
                first, _nxt = self.opts.extent(tp)
                self.opts.check_loss(tp, lo, first)
                bounds[tp] = Bounds(max(lo, first), hi)
        return self.opts.plan(bounds)

    def read(self, partition: InputPartition) -> Iterator[Any]:
        return self.opts.batches(partition, self.schema)

    def commit(self, end: Offsets) -> None:
        pass  # nothing to release: the broker keeps the log, Spark keeps the offsets
