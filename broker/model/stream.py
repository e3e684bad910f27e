"""Stream queues: a ``Queue`` whose messages live in an append-only log read by offset.

Theory of operation
-------------------
``StreamQueue`` keeps the public surface the session uses for classic queues (publish,
add/remove_consumer, ack, reject, schedule_delivery, message_count, delete, close) but the
store is a ``StreamStore``: nothing is removed on ack. Each consumer owns a *cursor*: its read
position in the log, the offsets delivered to it and not yet acked (bounded by prefetch, which
is mandatory), and offsets it rejected with requeue (delivered again, redelivered=true).

Delivery tags map to ``msgid = cursor_id << 40 | offset``, so ``ack(msgid)`` finds the cursor
without any change to the session. Every delivery carries an ``x-stream-offset`` header
and ``x-stream-timestamp`` (append time, ms), properties re-encoded with pamqp (only streams
pay for that).

Start position (consumer argument ``x-stream-offset``): ``first``, ``last``, ``next``, an
integer offset (negative: the last N messages, as LavinMQ reads it), a timestamp (first
message at or after it) or an interval such as ``1h`` (messages of the last hour). Without
the argument a consumer resumes from the offset stored for its consumer tag, else ``next``.

Chunk-level paths (the stream protocol's): ``publish_run`` stores a run of messages as one
append (``StreamStore.append_run``: one write, one replication record, visible all at once).
A ``RecordConsumer`` that offers ``run_room`` (no filter, nothing to redeliver, no acks, fast
paths on) gets ``deliver_run``: consecutive records of one segment read by
``StreamStore.read_run`` as two lists of slices, no record tuple per message; one that also
names an ``entry_prefix`` takes runs of alike records already framed for its wire
(``StreamStore.read_joined`` -> ``deliver_joined``: the bodies joined with that prefix, one
bytes object per run). Everyone else goes record by record; differential tests
(tests/test_stream_runs.py) compare the paths.

Server-side offset tracking: after every ack the cursor's *commit point* is stored for its
tag: the lowest offset delivered but not acked (or requeued), else the read position. So a
consumer that reconnects resumes after the last contiguously acked message and never skips a
message that was delivered but not acked, even if later ones were acked. A cursor outlives
its consumer until the channel settles (acks after basic.cancel still count; the requeue on
channel close pins the commit point at the oldest unacked message).

Filtering: messages carry ``x-stream-filter-value`` in their headers; a consumer with
``x-stream-filter`` (a string or a list) only gets messages whose value is in the list, plus
messages without a value if ``x-stream-match-unfiltered`` is true. Filtering is exact, done
here, so clients need no post-filtering.

Retention: the limits in force are the stricter (lower) of each of the queue arguments
(``x-max-length``, ``x-max-length-bytes``, ``x-max-age``), the vhost policy and the operator
policy (keys ``max-length``, ``max-length-bytes``, ``max-age``), as RabbitMQ does for
streams. ``apply_policies`` recomputes them at declare (so also at boot, when the
definitions are replayed) and whenever ``broker/model/policy.py`` re-applies policies after a
change, then runs retention at once. Length and size limits only change on append, where the
store enforces them when a segment fills; age changes with the clock, so a stream with a
``max-age`` keeps one timer (the vhost's ``call_later``) that fires when the oldest removable
segment expires, and at least every ``RETENTION_CHECK_S`` seconds, so idle streams shrink too.
While nothing is removable (only the write segment) the timer waits, and the first publish
that closes a segment re-aims it (one flag test per publish otherwise).
"""

from __future__ import annotations

import datetime
import heapq
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

from pamqp.encode import table_integer

from broker import errors, properties
from broker.model.features import CallLater, TimerHandle
from broker.model.queue import Consumer, Queue
from broker.store.paths import queue_dir, write_name
from broker.store.segment_log import SegmentFiles
from broker.store.sink import ReplicationSink
from broker.store.stream_store import Record, Retention, StreamPosition, StreamStore, parse_age

OFFSET_BITS: Final = 40
OFFSET_MASK: Final = (1 << OFFSET_BITS) - 1
_PASS_BUDGET: Final = 4096  # deliveries per pass before yielding to the loop
_SKIP_BUDGET: Final = 16384  # filtered-out records examined per pass
_FILTER_VALUE: Final = "x-stream-filter-value"
RETENTION_CHECK_S: Final = 60.0  # longest wait between age-retention checks of a stream
_POLICY_INT_KEYS: Final = ("max-length", "max-length-bytes")
_PUBLISHER_KEY: Final = "\x00publisher:"  # publisher sequences beside consumer offsets


def is_stream_arguments(arguments: dict[str, Any] | None) -> bool:
    return bool(arguments) and (arguments or {}).get("x-queue-type") == "stream"


def _int_arg(arguments: dict[str, Any], key: str) -> int | None:
    value = arguments.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise errors.PreconditionFailed(f"invalid arg '{key}': expected a non-negative integer")
    return value


def retention_from_arguments(arguments: dict[str, Any]) -> Retention:
    """Retention limits from queue arguments; 406 on malformed values."""
    age = arguments.get("x-max-age")
    max_age_ms = None
    if age is not None:
        if isinstance(age, bytes):
            age = age.decode(errors="replace")
        if not isinstance(age, str):
            raise errors.PreconditionFailed("invalid arg 'x-max-age': expected a string like 7D")
        try:
            max_age_ms = parse_age(age)
        except ValueError as exc:
            raise errors.PreconditionFailed(f"invalid arg 'x-max-age': {exc}") from None
    return Retention(_int_arg(arguments, "x-max-length"), _int_arg(arguments, "x-max-length-bytes"),
                     max_age_ms)


def _policy_age(value: Any) -> int:
    if isinstance(value, bytes):
        value = value.decode(errors="replace")
    if not isinstance(value, str):
        raise ValueError("expected a string like 7D")
    return parse_age(value)


def check_policy_definition(definition: dict[str, Any]) -> None:
    """ValueError for a bad ``max-age`` policy value (the integer keys are checked by features)."""
    if "max-age" in definition:
        try:
            _policy_age(definition["max-age"])
        except ValueError as exc:
            raise ValueError(f"invalid value for policy key 'max-age': {exc}") from None


def _policy_retention(definition: dict[str, Any] | None) -> Retention:
    """The retention keys of a policy definition; malformed values are ignored."""
    out = Retention()
    if not definition:
        return out
    ints: list[int | None] = []
    for key in _POLICY_INT_KEYS:
        v = definition.get(key)
        ints.append(v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None)
    out.max_length, out.max_bytes = ints
    if "max-age" in definition:
        try:
            out.max_age_ms = _policy_age(definition["max-age"])
        except ValueError:
            pass
    return out


def _lowest(*values: int | None) -> int | None:
    present = [v for v in values if v is not None]
    return min(present) if present else None


def effective_retention(arguments: Retention, policy: dict[str, Any] | None,
                        operator: dict[str, Any] | None) -> Retention:
    """Arguments + policy + operator policy: for each limit the stricter (lowest) one wins."""
    pol, op = _policy_retention(policy), _policy_retention(operator)
    return Retention(_lowest(arguments.max_length, pol.max_length, op.max_length),
                     _lowest(arguments.max_bytes, pol.max_bytes, op.max_bytes),
                     _lowest(arguments.max_age_ms, pol.max_age_ms, op.max_age_ms))


def new_stream_queue(vhost: str, vhost_dir: Path, name: str, *, durable: bool, exclusive: bool,
                     auto_delete: bool, arguments: dict[str, Any], segment_size: int,
                     sink: ReplicationSink, files: SegmentFiles,
                     schedule: Callable[[Callable[[], None]], object],
                     on_unused: Callable[[Queue], None], on_dirty: Callable[[Any], None],
                     call_later: CallLater | None) -> StreamQueue:
    """Build the stream queue for ``VHost.declare_queue`` (406 unless durable, shared, kept);
    the vhost then gives it its policies' retention (``policy.apply_to_queue``)."""
    if not durable or exclusive or auto_delete:
        raise errors.PreconditionFailed(
            f"invalid property for queue '{name}' in vhost '{vhost}': stream queues must be "
            "durable, non-exclusive and not auto-delete")
    retention = retention_from_arguments(arguments)
    seg_size = _int_arg(arguments, "x-stream-max-segment-size-bytes") or segment_size
    directory = queue_dir(vhost_dir, name)
    store = StreamStore(directory, segment_size=max(seg_size, 64), sink=sink, retention=retention,
                        files=files)
    write_name(directory / ".queue", name, sink)
    return StreamQueue(vhost, name, arguments=arguments, stream=store, schedule=schedule,
                       on_unused=on_unused, on_dirty=on_dirty, call_later=call_later)


class _Filter:
    __slots__ = ("values", "match_unfiltered")

    def __init__(self, values: frozenset[str], match_unfiltered: bool) -> None:
        self.values = values
        self.match_unfiltered = match_unfiltered

    def matches(self, props: bytes) -> bool:
        headers = _decode(props).headers
        value = headers.get(_FILTER_VALUE) if headers else None
        if value is None:
            return self.match_unfiltered
        if isinstance(value, bytes):
            value = value.decode(errors="replace")
        return str(value) in self.values


class _Cursor:
    __slots__ = ("cid", "tag", "consumer", "pos", "pending", "redeliver", "floor", "acked_any",
                 "filter")

    def __init__(self, cid: int, tag: str, consumer: Consumer, pos: StreamPosition,
                 filt: _Filter | None) -> None:
        self.cid = cid
        self.tag = tag
        self.consumer: Consumer | None = consumer
        self.pos = pos
        self.pending: set[int] = set()  # delivered, not yet acked
        self.redeliver: list[int] = []  # heap: requeued by a live consumer, to deliver again
        self.floor: int | None = None  # lowest offset requeued after the consumer went away
        self.acked_any = False
        self.filter = filt

    def commit_point(self) -> int:
        low = self.pos.offset
        if self.pending:
            low = min(low, min(self.pending))
        if self.redeliver:
            low = min(low, self.redeliver[0])
        if self.floor is not None:
            low = min(low, self.floor)
        return low


_decode = properties.decode


def named_offset(s: StreamStore, name: str) -> int | None:
    """The offset ``first``, ``last`` or ``next`` names in ``s`` (``x-stream-offset`` and the
    management API's stream reader take the same names); None for any other string."""
    if name == "first":
        return s.first_offset
    if name == "last":  # the first message of the last chunk stored, as RabbitMQ
        return s.last_chunk_offset
    if name == "next":
        return s.next_offset
    return None


_STREAM_KEYS: Final = (b"\x0fx-stream-offset", b"\x12x-stream-timestamp")  # short-string keys
_STREAM_NAMES: Final = frozenset(k[1:] for k in _STREAM_KEYS)


def with_offset_header(props: bytes, offset: int, timestamp_ms: int) -> bytes:
    """``props`` with ``x-stream-offset`` (and the append time, ``x-stream-timestamp`` in ms).

    The two fields are spliced into the raw headers table (``properties.with_header_fields``):
    a publisher's own fields of those names are dropped, every other byte is kept, so a value
    that pamqp would not re-encode as it came (a long string that is not UTF-8, a double, an
    unsigned 64-bit integer) reaches the consumer unchanged. A record without headers gets a
    table of the two. The values are typed as pamqp types them (its smallest integer), as a
    decode and re-encode would (tests/test_spark_stream_headers.py compares the two).
    """
    fields = b"".join((_STREAM_KEYS[0], table_integer(offset), _STREAM_KEYS[1], table_integer(timestamp_ms)))
    return properties.with_header_fields(props, fields, _STREAM_NAMES)


class RecordConsumer(Consumer):
    """A consumer that takes stream records as stored (offset, append time, raw properties,
    body) instead of AMQP deliveries with offset headers: the stream protocol's subscriptions
    (broker/streamproto), which would otherwise pay for re-encoding every message's properties."""

    def deliver_record(self, offset: int, timestamp_ms: int, props: bytes, body: bytes) -> None:
        raise NotImplementedError

    def run_room(self) -> tuple[int, int]:
        """(records, body bytes) this consumer takes as one run now; (0, 0): records one by
        one through ``deliver_record`` (the default)."""
        return 0, 0

    def deliver_run(self, first_offset: int, timestamp_ms: int, props: list[bytes],
                    bodies: list[bytes], same: bool = False) -> None:
        """Consecutive records from ``first_offset`` as stored (``timestamp_ms``: the first's);
        ``same``: the store proved one properties value and one body length for all of them
        (``StreamStore.read_run``), so they need no per-record check; False says nothing."""
        raise NotImplementedError

    def entry_prefix(self, props: bytes, body_len: int) -> bytes | None:
        """What this consumer frames before each body of an alike run of records with these
        properties and body length, to take it already framed (``deliver_joined``); None:
        the run comes through ``deliver_run`` (the default)."""
        return None

    def deliver_joined(self, first_offset: int, timestamp_ms: int, count: int, data: bytes) -> None:
        """``count`` alike records from ``first_offset`` (``StreamStore.read_joined``): ``data``
        holds each body after the prefix ``entry_prefix`` gave."""
        raise NotImplementedError


class StreamQueue(Queue):
    store: StreamStore
    __slots__ = ("stream", "_cursors", "_by_consumer", "_next_cid", "_more", "arg_retention",
                 "_call_later", "_retention_timer", "_age_waiting")

    def __init__(self, vhost: str, name: str, *, arguments: dict[str, Any], stream: StreamStore,
                 schedule: Callable[[Callable[[], None]], object],
                 on_unused: Callable[[Queue], None], on_dirty: Callable[[Any], None],
                 call_later: CallLater | None = None) -> None:
        # The session and management API read ``queue.store`` for counters, flush and sync:
        # the ``QueueCounters`` every queue's store provides (broker/store/api.py).
        super().__init__(vhost, name, durable=True, exclusive_owner=None, auto_delete=False,
                         arguments=arguments, store=stream, schedule=schedule,
                         on_unused=on_unused, on_dirty=on_dirty)
        self.stream = stream
        self._cursors: dict[int, _Cursor] = {}
        self._by_consumer: dict[int, _Cursor] = {}  # id(consumer) -> its live cursor
        self._next_cid = 1
        self._more = False
        r = stream.retention  # the store was built with the argument limits
        self.arg_retention = Retention(r.max_length, r.max_bytes, r.max_age_ms)
        self._call_later = call_later
        self._retention_timer: TimerHandle | None = None
        self._age_waiting = False  # age timer armed with nothing removable yet

    # ------------------------------------------------------------ publishing
    def publish(self, ts: int, exchange: bytes, routing_key: bytes, props: bytes,
                body: bytes | memoryview, persistent: bool, exrk: bytes | None = None) -> None:
        self.stream.append(ts, exchange, routing_key, props, body)
        self.n_published += 1
        if self._age_waiting and self.stream.next_age_expiry() is not None:
            self._arm_retention()  # a segment was closed: aim the age timer at its expiry
        # Every stream message is kept (delivery mode is irrelevant), so confirms wait for fsync.
        self.on_dirty(self.store)
        if self.consumers and not self._scheduled:
            self._scheduled = True
            self._schedule(self._deliver)

    def publish_run(self, ts: int, exchange: bytes, routing_key: bytes, props: list[bytes],
                    bodies: list[bytes], persistent: bool, exrk: bytes, same: bool) -> None:
        """A run stored as one append (one write, one sink record, one dirty mark)."""
        self.stream.append_run(ts, exrk, props, bodies, same)
        self.n_published += len(bodies)
        if self._age_waiting and self.stream.next_age_expiry() is not None:
            self._arm_retention()
        self.on_dirty(self.store)
        if self.consumers and not self._scheduled:
            self._scheduled = True
            self._schedule(self._deliver)

    @property
    def message_count(self) -> int:
        return self.stream.count

    # ------------------------------------------------------------- consumers
    def check_consume(self, no_ack: bool, prefetch: int, global_prefetch: int,
                      arguments: dict[str, Any]) -> None:
        """Stream consumers: manual ack, a prefetch, a valid offset and filter (406 like RabbitMQ)."""
        prefetch = prefetch or global_prefetch
        if no_ack:
            raise errors.PreconditionFailed(
                "stream queues only support consumers with manual acknowledgement", 60, 20)
        if not prefetch:
            raise errors.PreconditionFailed(
                "consumer prefetch count is not set for stream queue "
                f"'{self.name}' in vhost '{self.vhost}'", 60, 20)
        self._start_offset("", arguments)
        self._filter(arguments)

    def _start_offset(self, tag: str, arguments: dict[str, Any]) -> int:
        s = self.stream
        spec = arguments.get("x-stream-offset")
        if spec is None:
            stored = s.stored_offset(tag) if tag else None
            return stored if stored is not None else s.next_offset
        if isinstance(spec, bytes):
            spec = spec.decode(errors="replace")
        if isinstance(spec, bool):
            raise errors.PreconditionFailed("invalid x-stream-offset", 60, 20)
        if isinstance(spec, int):  # negative: the last -spec messages (LavinMQ)
            return max(s.next_offset + spec, s.first_offset) if spec < 0 else spec
        if isinstance(spec, datetime.datetime):
            if spec.tzinfo is None:
                spec = spec.replace(tzinfo=datetime.UTC)
            return s.offset_for_timestamp(int(spec.timestamp() * 1000))
        if isinstance(spec, str):
            named = named_offset(s, spec)
            if named is not None:
                return named
            try:
                ago = parse_age(spec)
            except ValueError:
                pass
            else:
                return s.offset_for_timestamp(int(time.time() * 1000) - ago)
        raise errors.PreconditionFailed(f"invalid x-stream-offset {spec!r}", 60, 20)

    @staticmethod
    def _filter(arguments: dict[str, Any]) -> _Filter | None:
        raw = arguments.get("x-stream-filter")
        if raw is None:
            return None
        items = raw if isinstance(raw, list) else [raw]
        values = frozenset(v.decode(errors="replace") if isinstance(v, bytes) else str(v) for v in items)
        return _Filter(values, bool(arguments.get("x-stream-match-unfiltered", False)))

    def add_consumer(self, consumer: Consumer) -> None:
        args = consumer.arguments
        start = self._start_offset(consumer.tag, args)
        cur = _Cursor(self._next_cid, consumer.tag, consumer, self.stream.seek(start), self._filter(args))
        self._next_cid += 1
        self._cursors[cur.cid] = cur
        self._by_consumer[id(consumer)] = cur
        super().add_consumer(consumer)

    def remove_consumer(self, consumer: Consumer) -> None:
        cur = self._by_consumer.pop(id(consumer), None)
        if cur is not None:
            cur.consumer = None
            if cur.redeliver:  # nobody will deliver them again: pin the commit point
                low = cur.redeliver[0]
                cur.floor = low if cur.floor is None else min(cur.floor, low)
                cur.redeliver.clear()
            self._maybe_forget(cur)
        super().remove_consumer(consumer)

    def _maybe_forget(self, cur: _Cursor) -> None:
        if cur.consumer is None and not cur.pending:
            self._cursors.pop(cur.cid, None)

    def _deliver(self) -> None:
        self._scheduled = False
        if self.deleted or self.paused:
            return
        self._more = False
        budget = _PASS_BUDGET
        fast = self.fast.on
        progress = True
        while budget and progress:
            progress = False
            for cur in list(self._by_consumer.values()):
                c = cur.consumer
                if c is None or not c.ready():
                    continue
                if (fast and not cur.redeliver and cur.filter is None and c.no_ack
                        and isinstance(c, RecordConsumer)):
                    count, nbytes = c.run_room()
                    if count:  # chunk-level read: one run of records from one segment
                        joined = self.stream.read_joined(cur.pos, min(count, budget), nbytes, c.entry_prefix)
                        if joined is not None:  # alike records, framed as the consumer asked
                            k = joined[2]
                            self.n_delivered += k
                            c.deliver_joined(*joined)
                        else:
                            run = self.stream.read_run(cur.pos, min(count, budget), nbytes)
                            if run is None:
                                continue
                            k = len(run[3])
                            self.n_delivered += k
                            c.deliver_run(*run)
                        progress = True
                        budget -= k
                        if not budget:
                            break
                        continue
                got = self._next_for(cur)
                if got is None:
                    continue
                rec, redelivered = got
                offset = rec[0]
                if not c.no_ack:
                    cur.pending.add(offset)
                self.n_delivered += 1
                if redelivered:
                    self.n_redelivered += 1
                if isinstance(c, RecordConsumer):
                    c.deliver_record(offset, rec[1], rec[4], rec[5])
                else:
                    c.deliver((cur.cid << OFFSET_BITS) | offset, rec[2], rec[3],
                              with_offset_header(rec[4], offset, rec[1]), rec[5], redelivered)
                progress = True
                budget -= 1
                if not budget:
                    break
        if not budget or self._more:
            self.schedule_delivery()

    def _next_for(self, cur: _Cursor) -> tuple[Record, bool] | None:
        s = self.stream
        while cur.redeliver:
            rec = s.read_at(heapq.heappop(cur.redeliver))
            if rec is not None:  # None: removed by retention meanwhile
                return rec, True
        filt = cur.filter
        skips = _SKIP_BUDGET
        while True:
            rec = s.read_next(cur.pos)
            if rec is None:
                return None
            if filt is None or filt.matches(rec[4]):
                return rec, False
            skips -= 1
            if not skips:
                self._more = True
                return None

    # ------------------------------------------------------------------ settle
    def ack(self, msgid: int) -> None:
        if self.deleted:
            return
        cur = self._cursors.get(msgid >> OFFSET_BITS)
        if cur is None:
            return
        cur.pending.discard(msgid & OFFSET_MASK)
        cur.acked_any = True
        self.n_acked += 1
        self._commit(cur)
        self._maybe_forget(cur)

    def ack_many(self, msgids: list[int]) -> None:
        """A ``multiple`` ack: every offset settled, then each cursor's commit point stored
        once, the state ``ack`` one by one ends in (a commit point scans the pending offsets:
        per message that was quadratic in the prefetch window, most of a reader's CPU)."""
        if self.deleted:
            return
        touched: dict[int, _Cursor] = {}
        cursors = self._cursors
        for msgid in msgids:
            cid = msgid >> OFFSET_BITS
            cur = cursors.get(cid)
            if cur is None:
                continue
            cur.pending.discard(msgid & OFFSET_MASK)
            touched[cid] = cur
            self.n_acked += 1
        for cur in touched.values():
            cur.acked_any = True
            self._commit(cur)
            self._maybe_forget(cur)

    def reject(self, msgid: int, requeue: bool) -> None:
        if self.deleted:
            return
        cur = self._cursors.get(msgid >> OFFSET_BITS)
        if cur is None:
            return
        offset = msgid & OFFSET_MASK
        if offset not in cur.pending:
            return
        cur.pending.discard(offset)
        if requeue and cur.consumer is not None:
            heapq.heappush(cur.redeliver, offset)
            self.schedule_delivery()
            return
        if requeue:  # the consumer is gone: never let the stored offset pass this message
            cur.floor = offset if cur.floor is None else min(cur.floor, offset)
        else:  # rejected without requeue: settled (discarded for this consumer)
            cur.acked_any = True
        self._commit(cur)
        self._maybe_forget(cur)

    def _commit(self, cur: _Cursor) -> None:
        if cur.acked_any:
            self.stream.store_offset(cur.tag, cur.commit_point())
            self.on_dirty(self.store)

    def reading_offset(self, consumer: Consumer) -> int | None:
        """The next offset ``consumer`` reads (None: it does not consume here): its lag is
        ``next_offset`` minus this."""
        cur = self._by_consumer.get(id(consumer))
        return None if cur is None else cur.pos.offset

    # ------------------------------------------- named offsets (the stream protocol's)
    def stored_offset(self, name: str) -> int | None:
        """The offset stored under ``name`` (a consumer tag, or a stream client's reference)."""
        return self.stream.stored_offset(name)

    def store_offset(self, name: str, offset: int) -> None:
        """Store ``offset`` under ``name``; durable with the stream's next sync."""
        if not self.deleted:
            self.stream.store_offset(name, offset)
            self.on_dirty(self.store)

    def publisher_sequence(self, reference: str) -> int | None:
        """The highest publishing id stored for a named publisher (deduplication)."""
        return self.stream.stored_offset(_PUBLISHER_KEY + reference)

    def set_publisher_sequence(self, reference: str, publishing_id: int) -> None:
        """Keep a named publisher's highest stored id, written in order with the log
        (``StreamStore.store_sequence``), so deduplication holds across kill -9 and failover."""
        if not self.deleted:
            self.stream.store_sequence(_PUBLISHER_KEY + reference, publishing_id)
            self.on_dirty(self.store)

    # ------------------------------------------------------------- unsupported
    def get(self) -> tuple[int, bytes, bytes, bytes, bytes, bool] | None:
        raise errors.PreconditionFailed(
            f"queue '{self.name}' in vhost '{self.vhost}' is a stream; basic.get is not supported",
            60, 70)

    def purge(self) -> int:
        raise errors.PreconditionFailed(
            f"queue '{self.name}' in vhost '{self.vhost}' is a stream and cannot be purged", 50, 30)

    # ------------------------------------------------------------------ lifecycle
    def apply_retention(self, now_ms: int | None = None) -> int:
        """Apply retention now (idle streams; policies call this after changing limits)."""
        return self.stream.apply_retention(int(time.time() * 1000) if now_ms is None else now_ms)

    def apply_policies(self, policy: dict[str, Any] | None, operator: dict[str, Any] | None) -> None:
        """Recompute the limits from arguments and policy definitions; enforce them now."""
        if self.deleted:
            return
        self.stream.retention = effective_retention(self.arg_retention, policy, operator)
        if self.stream.retention.active:
            self.apply_retention()
        self._arm_retention()

    def _arm_retention(self) -> None:
        """(Re)arm the age timer: at the oldest removable segment's expiry, else in 60 s."""
        self._cancel_retention()
        if self._call_later is None or self.deleted or self.stream.retention.max_age_ms is None:
            return
        delay = RETENTION_CHECK_S
        due = self.stream.next_age_expiry()
        self._age_waiting = due is None
        if due is not None:
            # +10 ms: the store removes a segment once its successor's first timestamp is
            # strictly older than the cut-off, so fire just after that instant.
            delay = min(delay, max(0.0, (due - time.time() * 1000) / 1000.0) + 0.01)
        self._retention_timer = self._call_later(delay, self._on_retention_timer)

    def _on_retention_timer(self) -> None:
        self._retention_timer = None
        if self.deleted:
            return
        self.apply_retention()
        self._arm_retention()

    def _cancel_retention(self) -> None:
        self._age_waiting = False
        if self._retention_timer is not None:
            self._retention_timer.cancel()
            self._retention_timer = None

    def close(self) -> None:
        self._cancel_retention()
        self.stream.close()

    def delete(self) -> None:
        self.deleted = True
        self._cancel_retention()
        consumers, self.consumers = self.consumers, []
        self._by_consumer.clear()
        self._cursors.clear()
        for c in consumers:
            c.cancelled_by_server()
        self.stream.delete()
