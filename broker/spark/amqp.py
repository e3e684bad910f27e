"""Reading a stream over AMQP (``option("uri", ...)``) for the Spark source.

Theory of operation
-------------------
Extent: a running broker is asked for the stream's extent with a one-message consumer at
``x-stream-offset=first`` (its ``x-stream-offset`` header is the first offset held), then a
passive queue.declare (message count), so ``[first, first + count)`` is the readable range; the
probe is taken again until the first offset held did not move meanwhile (retention). Not
``last``: that names the first message of the last *chunk*, and a chunk holds a whole publish
run (a Publish frame, a sink's window), so an extent counted back from it came up short.

Reading a range ``[start, end)`` is the hot path, so it runs on the link layer's connection
(``broker/links/wire.py``: whole socket reads walked frame by frame in one loop, the
``basic.deliver`` fields and the raw property bytes taken in place), not on a general client
library, which built a method, a properties object and a callback per message and then had its
properties re-encoded (about 70 µs of CPU per row, measured). Each delivery goes straight into
the batch's column lists (``rows.Columns``); no object per row. The broker adds the offset and
the append time as the headers ``x-stream-offset`` / ``x-stream-timestamp``:
``split_stream_headers`` reads them and cuts them out of the property bytes by walking the
headers table's top-level entries (so a value that happens to hold those names is never taken
for them), which leaves the record's own properties as stored, the segment-file shape, so both
modes produce identical rows. A property list it cannot walk takes the decode/re-encode route.

The consumer starts at ``x-stream-offset=start`` with a prefetch window of ``_PREFETCH`` and
acks with ``multiple=true`` every quarter window, so the window keeps moving; it stops at the
first delivery at or past ``end``. The task thread runs its own event loop; the generator
drives it one batch at a time: once a batch holds ``batch_rows`` rows the socket stops being
read until Spark has taken the batch (the rows of the read in progress start the next), so a
task holds about one batch and the prefetch window in memory. Every read uses the same
consumer tag per queue, so the broker's stored-offset table does not grow with Spark jobs (the
stored value is irrelevant: reads always pass an explicit offset). No delivery for ``timeout``
seconds raises TimeoutError; a lost connection raises ConnectionError, and the task fails.
"""

from __future__ import annotations

import asyncio
import struct
import time
from collections import deque
from collections.abc import Iterator
from typing import Any, Final

from pamqp import commands

from broker import properties
from broker.links.message import EndLost
from broker.links.wire import Wire, open_first
from broker.spark.rows import Columns, Rec

_PREFETCH: Final = 4000  # unacked deliveries in flight per read
_ACK_EVERY: Final = _PREFETCH // 4
_EXTENT_TRIES: Final = 5  # extent probes before giving up on a stream whose retention keeps running
_CHANNEL: Final = 1
_CLIENT: Final = {"connection_name": "Skred Spark source", "product": "Skred Spark source"}
_OFFSET_KEY: Final = b"x-stream-offset"
_STAMP_KEY: Final = b"x-stream-timestamp"
_U32: Final = struct.Struct(">I")
# field value types: integer readers, and the fixed sizes of the others (0-9-1 errata table)
_INTS: Final = {ord(t): struct.Struct(">" + f) for t, f in
                (("b", "b"), ("B", "B"), ("s", "h"), ("u", "H"), ("I", "i"), ("i", "I"),
                 ("l", "q"), ("L", "Q"), ("T", "Q"))}
_FIXED: Final = {ord("t"): 1, ord("f"): 4, ord("d"): 8, ord("D"): 5, ord("V"): 0}
_SIZED: Final = frozenset(b"SxFA")  # a u32 length, then that many bytes


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
    box: deque[Any] = deque()
    tag = consumer_tag(queue) + ".probe"
    ch.basic_consume(queue, lambda _ch, _m, p, _b: box.append(p), consumer_tag=tag,
                     arguments={"x-stream-offset": "first"})
    try:
        deadline = time.monotonic() + timeout
        while not box:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"stream '{queue}': no delivery for {timeout}s")
            conn.process_data_events(time_limit=min(left, 1.0))
        return int((box[0].headers or {})["x-stream-offset"])
    finally:
        if ch.is_open:
            ch.basic_cancel(tag)


def split_stream_headers(props: bytes) -> tuple[int, int, bytes]:
    """(offset, append time in ms, ``props`` without the broker's two stream headers).

    A headers table left empty goes with its flag (the record had none). KeyError if the
    delivery carries no ``x-stream-offset``."""
    cut = _find_stream_headers(props)
    if cut is None:
        return _split_slow(props)
    offset, stamp, spans, t_at, t_end = cut
    table = bytearray()
    at = t_at + 4
    for lo, hi in spans:
        table += props[at:lo]
        at = hi
    table += props[at:t_end]
    if table:
        return offset, stamp, b"".join((props[:t_at], _U32.pack(len(table)), table, props[t_end:]))
    flags = ((props[0] << 8) | props[1]) & ~properties.FLAG_HEADERS
    return offset, stamp, b"".join((flags.to_bytes(2, "big"), props[2:t_at], props[t_end:]))


def _find_stream_headers(props: bytes) -> tuple[int, int, list[tuple[int, int]], int, int] | None:
    """(offset, stamp, spans of the two entries, table start, table end), walking the headers
    table's top-level entries; None when absent or not walkable here."""
    if len(props) < 2 or not props[0] & properties.HI_HEADERS:
        return None
    at = 2
    if props[0] & properties.HI_CONTENT_TYPE:
        at += 1 + props[at]
    if props[0] & properties.HI_CONTENT_ENCODING:
        at += 1 + props[at]
    t_at = at
    t_end = at + 4 + _U32.unpack_from(props, at)[0]
    if t_end > len(props):
        return None
    at += 4
    offset = stamp = None
    spans = []
    while at < t_end:
        lo = at
        key = props[at + 1:at + 1 + props[at]]
        at += 1 + props[at]
        kind = props[at]
        at += 1
        reader = _INTS.get(kind)
        if reader is not None:
            value = reader.unpack_from(props, at)[0]
            at += reader.size
            if key == _OFFSET_KEY:
                offset = value
                spans.append((lo, at))
            elif key == _STAMP_KEY:
                stamp = value
                spans.append((lo, at))
        elif kind in _SIZED:
            at += 4 + _U32.unpack_from(props, at)[0]
        elif kind in _FIXED:
            at += _FIXED[kind]
        else:
            return None
    if at != t_end or offset is None:
        return None
    return offset, stamp or 0, spans, t_at, t_end


def _split_slow(props: bytes) -> tuple[int, int, bytes]:
    p = properties.decode(props)
    headers = dict(p.headers or {})
    offset = headers.pop(_OFFSET_KEY.decode())
    stamp = headers.pop(_STAMP_KEY.decode(), 0)
    if not isinstance(offset, int):
        raise KeyError(f"{_OFFSET_KEY.decode()} is {offset!r}")
    p.headers = headers or None
    return offset, stamp if isinstance(stamp, int) else 0, properties.encode(p)


class _ReadWire(Wire):
    """The link connection, each delivery's fields appended to the batch being filled."""

    role = "stream"

    def __init__(self, lost: asyncio.Future[str]) -> None:
        super().__init__(lost)
        self.cols = Columns()  # the batch being filled
        self.full: deque[Columns] = deque()  # batches of ``batch_rows`` rows not yet taken
        self.end = 0
        self.ts_lo, self.ts_hi = -(1 << 63), 1 << 63
        self.batch_rows = 1
        self.finished = False
        self.seen = 0  # deliveries taken (the idle timeout watches it)
        self.unacked = 0
        self.moved = asyncio.get_running_loop().create_future()  # a batch is full, or the range done

    def _emit(self, body: bytes) -> None:
        assert self._deliver is not None
        tag, _redelivered, exchange, routing_key = self._deliver
        self._deliver = None
        if self.finished:
            return  # in flight past the range's end
        offset, stamp, props = split_stream_headers(self._props)
        self.seen += 1
        self.unacked += 1
        if self.unacked >= _ACK_EVERY:
            self.write(_CHANNEL, commands.Basic.Ack(delivery_tag=tag, multiple=True))
            self.unacked = 0
        if offset >= self.end:
            self._stop()
            return
        cols = self.cols
        if self.ts_lo <= stamp <= self.ts_hi:
            cols.offsets.append(offset)
            cols.stamps.append(stamp)
            cols.exchanges.append(exchange)
            cols.keys.append(routing_key)
            i = cols.uniq.get(props)
            if i is None:
                i = cols.uniq[props] = len(cols.uniq)
            cols.prop_idx.append(i)
            cols.bodies.append(body)
        if offset + 1 >= self.end:
            self._stop()
        elif len(cols) >= self.batch_rows:
            self.full.append(cols)
            self.cols = Columns()
            if self.transport is not None:
                self.transport.pause_reading()
            if not self.moved.done():
                self.moved.set_result(None)

    def _stop(self) -> None:
        self.finished = True
        if not self.moved.done():
            self.moved.set_result(None)

    async def next_batch(self, timeout: float) -> Columns:
        """The next batch of ``batch_rows`` rows, or the last rows once the range is done."""
        if not self.full and not self.finished:
            await self._wait_moved(timeout)
        if self.full:
            return self.full.popleft()
        cols, self.cols = self.cols, Columns()
        return cols

    async def _wait_moved(self, timeout: float) -> None:
        """Read until a batch fills or the range ends; TimeoutError after ``timeout`` seconds
        without a delivery, ConnectionError when the connection goes."""
        if self.moved.done():
            self.moved = asyncio.get_running_loop().create_future()
        if self.transport is not None:
            self.transport.resume_reading()
        last = self.seen
        while not self.moved.done():
            done, _ = await asyncio.wait([self.moved, self.lost], timeout=timeout,
                                         return_when=asyncio.FIRST_COMPLETED)
            if self.moved.done():
                return
            if self.lost.done():
                raise ConnectionError(f"skred: stream read ended: {self.lost.result()}")
            if not done and self.seen == last:
                raise TimeoutError(f"skred: no delivery for {timeout:g} s")
            last = self.seen


async def _open(uri: str, queue: str, start: int, end: int, batch_rows: int,
                ts_lo: int | None, ts_hi: int | None) -> _ReadWire:
    try:
        wire, _lost = await open_first([uri], dict(_CLIENT), _ReadWire)
    except EndLost as exc:
        raise ConnectionError(f"skred: {exc}") from None
    wire.end, wire.batch_rows = end, batch_rows
    if ts_lo is not None:
        wire.ts_lo = ts_lo
    if ts_hi is not None:
        wire.ts_hi = ts_hi
    try:
        await wire.call(_CHANNEL, commands.Channel.Open(), commands.Channel.OpenOk)
        await wire.call(_CHANNEL, commands.Basic.Qos(prefetch_count=_PREFETCH), commands.Basic.QosOk)
        wire.channel, wire.consuming = _CHANNEL, True
        await wire.call(_CHANNEL, commands.Basic.Consume(queue=queue, consumer_tag=consumer_tag(queue),
                                                         arguments={"x-stream-offset": start}),
                        commands.Basic.ConsumeOk)
    except EndLost as exc:
        await wire.shutdown("skred spark source closing")
        raise ConnectionError(f"skred: stream '{queue}': {exc}") from None
    return wire


def read_columns(uri: str, queue: str, start: int, end: int, batch_rows: int,
                 ts_lo: int | None = None, ts_hi: int | None = None,
                 timeout: float = 30.0) -> Iterator[Columns]:
    """Batches of the records with offsets in ``[start, end)`` (fewer if retention removed
    some) whose append time is within ``[ts_lo, ts_hi]``, ``batch_rows`` rows each but the last."""
    if start >= end:
        return
    loop = asyncio.new_event_loop()
    wire: _ReadWire | None = None
    try:
        wire = loop.run_until_complete(_open(uri, queue, start, end, batch_rows, ts_lo, ts_hi))
        while True:
            cols = loop.run_until_complete(wire.next_batch(timeout))
            if len(cols):
                yield cols
            if wire.finished and not wire.full and not len(wire.cols):
                break
    finally:
        if wire is not None:
            loop.run_until_complete(wire.shutdown("skred spark source done"))
        loop.close()


def read_range(uri: str, queue: str, start: int, end: int, timeout: float = 30.0) -> Iterator[Rec]:
    """The records with offsets in ``[start, end)`` as tuples (tests and cold paths)."""
    for cols in read_columns(uri, queue, start, end, _PREFETCH, timeout=timeout):
        yield from cols.records()


def first_at(uri: str, queue: str, start: int, end: int, ts: int, timeout: float = 30.0) -> int | None:
    """The first offset in ``[start, end)`` appended at or after ``ts`` (None: none is)."""
    for cols in read_columns(uri, queue, start, end, 1, ts, None, timeout):
        return cols.offsets[0]
    return None
