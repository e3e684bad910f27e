"""One stream-protocol connection turned into the model's operations.

Theory of operation
-------------------
States: ``peer`` (PeerProperties, SaslHandshake) -> ``login`` (SaslAuthenticate checked by the
adapter, which owns the login throttle's waiting) -> ``tune`` (we sent Tune; the client's Tune
and its Open follow) -> ``open`` -> ``closed``. A command the state does not allow, an unknown
key or a malformed frame closes the connection with a Close carrying the protocol's response
code; nothing it asked for happened.

- **Publish** goes through the one publish operation (``VHost.publish_run`` for a frame's
  batch, stored by the stream queue as one run: one write, one replication record, one
  PublishConfirm after the group commit; ``VHost.publish`` message by message when the run
  cannot go at once) to the default exchange with the stream's name, so a stream-protocol
  message is stored as any other (the body is the
  client's message bytes, AMQP 1.0 encoded by the clients; the content type
  ``STREAM_CONTENT_TYPE`` marks it). A PublishConfirm is sent only after the group commit made
  the message durable (and replicated); a failed commit answers PublishError. **Deduplication**:
  a publisher declared with a reference (name) has a sequence, the highest publishing id it
  stored, kept durably with the stream (``StreamQueue.set_publisher_sequence``); a message whose
  id is not above it is confirmed without being stored again. QueryPublisherSequence reads it.
- **Subscribe** adds a model consumer (``Queue.add_consumer``) to the stream queue, starting at
  the offset spec (first, last, next, offset, timestamp: the queue's ``x-stream-offset``).
  **Credit** counts chunks, as the protocol says: a chunk is opened only while the subscription
  has credit, a Credit frame adds credit and wakes the queue. Chunk-level read (the hot path):
  while it has credit, a subscription takes a *run* from the queue's delivery pass
  (``run_room``/``deliver_run``: up to ``CHUNK_MAX_ENTRIES`` consecutive records sliced from one
  segment) and sends it as one Deliver: per message only a length prefix, no object; the chunk
  CRC is one ``zlib.crc32`` over the joined data. A run of alike records (one batch of
  equal-sized messages) comes from the store already joined behind ``entry_prefix`` (the
  entry's length and, for messages from other protocols, the AMQP 1.0 data section head): the
  chunk's data section itself, sent after the chunk header (``deliver_joined``). Filtered
  subscriptions, or the fast paths switched off, get messages one by one (``deliver_record``),
  gathered into chunks of consecutive offsets; the chunk open at the end of the loop turn is
  sent then. Messages stored by other protocols reach a stream client as an AMQP 1.0 message
  with one data section holding the body.
- **Offsets**: StoreOffset/QueryOffset keep a named offset with the stream (durable with its next
  sync), the same names AMQP consumers' stored offsets use.
- **Single active consumer**: subscriptions with ``single-active-consumer=true`` and a ``name``
  join that name's group on the stream (``Groups``); one member is active. On a partition of a
  super stream (property ``super-stream``) the active member is the one at (partition index
  modulo members), so a group spreads over the partitions and rebalances as members come and
  go. A member that becomes active is told with ConsumerUpdate(active) and starts reading where
  its answer's offset spec says; one that stops being active is told and stops at once.
- **Permissions** are AMQP's: configure on the stream for Create/Delete, write to publish, read
  to subscribe and query offsets; vhost access at Open.
"""

from __future__ import annotations

import datetime
import itertools
import logging
import operator
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final, Protocol

from broker import errors
from broker.auth.names import name_problem
from broker.auth.users import User, UserStore
from broker.model import superstream
from broker.model.publish import Names, PublishRequest
from broker.model.stream import RecordConsumer, StreamQueue
from broker.model.vhost import VHost
from broker.streamproto import codec as C

log = logging.getLogger(__name__)

STREAM_CONTENT_TYPE: Final = "application/vnd.skred.stream-message"
CHUNK_MAX_ENTRIES: Final = 256  # messages per Deliver chunk
CHUNK_MAX_BYTES: Final = 1 << 20
MAX_IDS: Final = 256  # publishers and subscriptions per connection (ids are one byte)
_CT: Final = STREAM_CONTENT_TYPE.encode()
_CT_PREFIX: Final = bytes([len(_CT)]) + _CT
_U32_PACK: Final = struct.Struct(">I").pack
_AMQP10_DATA: Final = b"\x00\x53\x75"  # described type: data section
_CREATE_ARGS: Final = {"max-length-bytes": "x-max-length-bytes", "max-age": "x-max-age",
                       "stream-max-segment-size-bytes": "x-stream-max-segment-size-bytes"}


def _stream_props(filter_value: str | None) -> bytes:
    """AMQP properties of a stream-protocol message: persistent, our content type, and the
    filter value as ``x-stream-filter-value`` (what AMQP stream consumers filter on)."""
    out = bytearray(b"\x90\x00")  # content-type, delivery-mode
    if filter_value is not None:
        out[0] |= 0x20  # headers
    out += _CT_PREFIX
    if filter_value is not None:
        name = b"x-stream-filter-value"
        raw = filter_value.encode()
        entry = bytes([len(name)]) + name + b"S" + len(raw).to_bytes(4, "big") + raw
        out += len(entry).to_bytes(4, "big") + entry
    out += b"\x02"
    return bytes(out)


_PLAIN_PROPS: Final = _stream_props(None)


def _increasing(ids: list[int]) -> bool:
    """Whether ``ids`` are strictly increasing (checked in C: no Python step per id)."""
    return all(map(operator.lt, ids, itertools.islice(ids, 1, None)))


def message_prefix(props: bytes, body_len: int) -> bytes:
    """What precedes a stored body of ``body_len`` bytes in the message a stream client gets:
    nothing for a message published by a stream client, else an AMQP 1.0 data section's head."""
    if len(props) > len(_CT_PREFIX) + 2 and props[0] & 0x80 and props[2 : 2 + len(_CT_PREFIX)] == _CT_PREFIX:
        return b""
    if body_len < 256:
        return _AMQP10_DATA + b"\xa0" + bytes([body_len])
    return _AMQP10_DATA + b"\xb0" + body_len.to_bytes(4, "big")


def as_stream_message(props: bytes, body: bytes) -> bytes:
    """The bytes a stream client gets: as published by a stream client, else the body in an
    AMQP 1.0 data section."""
    pre = message_prefix(props, len(body))
    return pre + body if pre else body


def stream_entries(props: list[bytes], bodies: list[bytes], same: bool = False) -> list[bytes]:
    """``as_stream_message`` for a run: the bodies themselves when every message of the run
    was published by a stream client without a filter value (the common case, no copy).
    ``same``: one properties value and one body length for the whole run (the store's
    alike run): one check, and one prefix computed for every entry."""
    if same and bodies:
        p0 = props[0]
        if p0 == _PLAIN_PROPS:
            return bodies
        pre = message_prefix(p0, len(bodies[0]))  # depends only on the properties and the length
        return [pre + b for b in bodies] if pre else bodies
    if props.count(_PLAIN_PROPS) == len(props):
        return bodies
    return [as_stream_message(p, b) for p, b in zip(props, bodies, strict=True)]


class Output(Protocol):
    """What the session needs of its connection (broker/streamproto/server.py)."""

    writable: bool

    def write(self, data: bytes) -> None: ...

    def close(self) -> None: ...

    def soon(self, fn: Callable[[], None]) -> None: ...


class AfterSync(Protocol):
    def __call__(self, callback: Callable[[bool], None], deps: Any = None) -> None: ...


@dataclass(frozen=True)
class Settings:
    frame_max: int
    heartbeat: int
    host: str  # what Metadata and Open name as this node's address
    port: int


@dataclass
class _Publisher:
    stream: str
    reference: str
    sequence: int
    # RabbitMQ's publisher counters (``/api/stream/publishers``), in messages
    published: int = 0
    confirmed: int = 0
    errored: int = 0


class _Group:
    """One single-active-consumer group: a stream and a consumer name."""

    def __init__(self) -> None:
        self.members: list[Subscription] = []
        self.active: Subscription | None = None


class Groups:
    """Every single-active-consumer group of the node: (vhost, stream, name) -> members."""

    def __init__(self) -> None:
        self.groups: dict[tuple[str, str, str], _Group] = {}

    def join(self, sub: Subscription) -> None:
        key = sub.group_key
        assert key is not None
        g = self.groups.setdefault(key, _Group())
        g.members.append(sub)
        self._rebalance(g)

    def leave(self, sub: Subscription) -> None:
        key = sub.group_key
        g = self.groups.get(key) if key is not None else None
        if g is None or sub not in g.members:
            return
        g.members.remove(sub)
        if g.active is sub:
            g.active = None
        if not g.members:
            del self.groups[key]  # type: ignore[arg-type]
            return
        self._rebalance(g)

    @staticmethod
    def _rebalance(g: _Group) -> None:
        first = g.members[0]
        index = first.partition_index() if first.super_stream else 0
        want = g.members[index % len(g.members)]
        if g.active is want:
            return
        if g.active is not None:
            g.active.set_active(False)
        g.active = want
        want.set_active(True)


class Subscription(RecordConsumer):
    """A stream-protocol subscription: the model consumer that fills chunks within its credit."""

    __slots__ = ("session", "sub_id", "stream", "credit", "chunk", "first", "stamp", "size", "flush_due",
                 "group_key", "super_stream", "active", "consuming", "pending_update", "properties",
                 "consumed", "offset")

    def __init__(self, session: StreamSession, sub_id: int, q: StreamQueue, credit: int,
                 arguments: dict[str, Any]) -> None:
        super().__init__(f"stream-{id(session):x}-{sub_id}", q, True, False, arguments)
        self.session = session
        self.sub_id = sub_id
        self.stream = q
        self.credit = credit
        self.chunk: list[bytes] = []
        self.first = 0
        self.stamp = 0  # the chunk's timestamp: its first message's append time
        self.size = 0
        self.flush_due = False
        self.group_key: tuple[str, str, str] | None = None
        self.super_stream = ""
        self.active = True
        self.consuming = False
        self.pending_update: int | None = None  # correlation id of the ConsumerUpdate we await
        self.properties: dict[str, str] = {}  # its Subscribe properties
        self.consumed = 0  # messages sent (RabbitMQ's ``consumed``)
        self.offset = 0  # the offset after the last one sent

    # ------------------------------------------------------------ model side
    def ready(self) -> bool:
        if not self.session.out.writable or not self.consuming:
            return False
        if self.chunk:
            return len(self.chunk) < CHUNK_MAX_ENTRIES and self.size < CHUNK_MAX_BYTES or self.credit > 0
        return self.credit > 0

    def deliver_record(self, offset: int, timestamp_ms: int, props: bytes, body: bytes) -> None:
        chunk = self.chunk
        if chunk and (offset != self.first + len(chunk) or len(chunk) >= CHUNK_MAX_ENTRIES
                      or self.size >= CHUNK_MAX_BYTES):
            self.flush()
        if not self.chunk:
            self.first = offset
            self.stamp = timestamp_ms
            self.credit -= 1
        data = as_stream_message(props, body)
        self.chunk.append(data)
        self.size += len(data)
        if not self.flush_due:
            self.flush_due = True
            self.session.out.soon(self.flush)

    def run_room(self) -> tuple[int, int]:
        if self.credit > 0 and self.consuming and self.session.out.writable:
            return CHUNK_MAX_ENTRIES, CHUNK_MAX_BYTES
        return 0, 0

    def deliver_run(self, first_offset: int, timestamp_ms: int, props: list[bytes],
                    bodies: list[bytes], same: bool = False) -> None:
        """A run of stored records as one chunk: one credit, one Deliver frame; per message
        only the properties check and a length prefix (``codec.encode_deliver_run``), and
        not even the check when the store says the run is alike (``same``)."""
        if self._chunk_taken(first_offset, len(bodies)):
            entries = stream_entries(props, bodies, same)
            self.session.out.write(C.encode_deliver_run(self.sub_id, first_offset, timestamp_ms, entries,
                                                        self.committed(), same))

    def entry_prefix(self, props: bytes, body_len: int) -> bytes:
        """An alike run's entries as the chunk's data section wants them: the message's
        length, then its prefix (``message_prefix``), then the stored body."""
        pre = message_prefix(props, body_len)
        return _U32_PACK(len(pre) + body_len) + pre

    def deliver_joined(self, first_offset: int, timestamp_ms: int, count: int, data: bytes) -> None:
        """An alike run framed by the store with ``entry_prefix`` (``read_joined``): the
        chunk's data section itself, so the Deliver is its header and these bytes."""
        if self._chunk_taken(first_offset, count):
            self.session.out.write(C.encode_deliver_data(self.sub_id, first_offset, timestamp_ms, count, data,
                                                         self.committed()))

    def _chunk_taken(self, first_offset: int, count: int) -> bool:
        """A run of ``count`` from ``first_offset`` becomes a chunk of its own: what is
        gathered goes first, one credit is spent, the counters move; False: the session
        is closed, nothing to send."""
        self.flush()
        self.credit -= 1
        session = self.session
        if session.closed:
            return False
        session.delivered += count
        self.consumed += count
        self.offset = first_offset + count
        return True

    def flush(self) -> None:
        self.flush_due = False
        if self.chunk:
            chunk, self.chunk, self.size = self.chunk, [], 0
            if not self.session.closed:
                self.session.delivered += len(chunk)
                self.consumed += len(chunk)
                self.offset = self.first + len(chunk)
                self.session.out.write(C.encode_deliver(self.sub_id, self.first, self.stamp, chunk,
                                                        self.committed()))

    def committed(self) -> int | None:
        """Deliver version 2's committed chunk id: the first offset of the last chunk the
        stream holds (Skred hands chunks to consumers once stored, before the group commit
        that confirms them, so this is the last chunk stored); None for a version 1 client."""
        return self.stream.stream.last_chunk_offset if self.session.deliver_v2 else None

    def cancelled_by_server(self) -> None:
        self.session.stream_gone(self)

    def lag(self) -> int:
        """Messages stored past what it was sent (RabbitMQ 3.11's ``offset_lag``): from where it
        reads while consuming; a waiting member of a single-active-consumer group from the
        offset its name stored (everything when none is)."""
        s = self.stream
        reading = s.reading_offset(self) if self.consuming else None
        if reading is None:
            name = self.properties.get("name")
            stored = s.stored_offset(name) if name else None
            reading = stored + 1 if stored is not None else s.stream.first_offset
        return max(s.stream.next_offset - reading, 0)

    @property
    def prefetch(self) -> int:
        """What the management API shows as the prefetch: the chunks it may still be sent."""
        return self.credit

    # ------------------------------------------------------------ group side
    def partition_index(self) -> int:
        try:
            return superstream.partitions(self.session.vh, self.super_stream).index(self.stream.name)
        except (errors.SkredError, ValueError):
            return 0

    def set_active(self, active: bool) -> None:
        self.active = active
        self.session.activity_changed(self, active)

    def start(self, spec: C.OffsetSpec) -> None:
        """Begin reading at ``spec`` (at subscribe, or when the group made us active)."""
        if self.consuming:
            return
        self.arguments = {**self.arguments, "x-stream-offset": offset_argument(spec)}  # filters kept
        self.consuming = True
        self.stream.add_consumer(self)

    def stop(self) -> None:
        """Stop reading; what is gathered for the current chunk is still sent."""
        self.flush()
        if self.consuming:
            self.consuming = False
            self.stream.remove_consumer(self)


def _activity(sub: Subscription) -> str:
    """RabbitMQ's ``activity_status`` of a consumer: ``up``, or for a member of a single
    active consumer group ``single_active`` / ``waiting``."""
    if sub.group_key is None:
        return "up"
    return "single_active" if sub.active else "waiting"


def offset_argument(spec: C.OffsetSpec) -> Any:
    """The queue's ``x-stream-offset`` for an offset specification."""
    if spec.kind == C.OFFSET_FIRST:
        return "first"
    if spec.kind == C.OFFSET_LAST:
        return "last"
    if spec.kind == C.OFFSET_NEXT:
        return "next"
    if spec.kind == C.OFFSET_OFFSET:
        return spec.value
    ms = max(spec.value, 0)
    return datetime.datetime.fromtimestamp(ms / 1000, datetime.UTC)


@dataclass
class StreamSession:
    vhosts: dict[str, VHost]
    users: UserStore
    settings: Settings
    after_sync: AfterSync
    groups: Groups
    out: Output
    peer: str
    state: str = "peer"
    user: User | None = None
    vh: VHost = field(init=False)
    heartbeat: int = 0
    frame_max: int = 0
    closed: bool = False
    publishers: dict[int, _Publisher] = field(default_factory=dict)
    subs: dict[int, Subscription] = field(default_factory=dict)
    client_properties: dict[str, str] = field(default_factory=dict)  # its PeerProperties
    # RabbitMQ's per-protocol counters (views.FRONT_END_COUNTERS), in messages
    received: int = 0
    confirmed: int = 0
    delivered: int = 0
    published: bool = False  # declared a publisher (the publishers gauge counts these)
    deliver_v2: bool = False  # the client speaks Deliver version 2 (ExchangeCommandVersions)
    _corr: int = 0

    # ------------------------------------------------------------------ entry
    def handle(self, f: C.Frame) -> None:
        """One frame; ``Malformed`` (and only it) escapes for the adapter to close with."""
        key = f.key & 0x7FFF
        handler = _OPEN_HANDLERS.get(key) if self.state == "open" else _EARLY_HANDLERS.get((self.state, key))
        if f.key & C.RESPONSE:
            if key == C.CONSUMER_UPDATE and self.state == "open":
                self.consumer_update_answer(f.payload)
                return
            if key == C.CLOSE:  # the answer to our Close: the connection is over
                self.end()
                self.out.close()
                return
            if key == C.CONSUMER_UPDATE:
                return  # answers a ConsumerUpdate sent before the vhost was open: none are
            raise C.Malformed(f"unexpected response to command {key}", C.UNKNOWN_FRAME)
        if key == C.HEARTBEAT:
            return
        if key == C.CLOSE:
            c = C.Cursor(f.payload)
            corr = c.u32()
            self.out.write(C.response(C.CLOSE, corr, C.OK))
            self.end()
            self.out.close()
            return
        if handler is None:
            raise C.Malformed(f"command {key} not allowed {'now' if key in C.VERSIONS else '(unknown)'}",
                              C.UNKNOWN_FRAME)
        handler(self, f)

    def done(self) -> bool:
        """Whether the session ended (a call, so a caller's earlier test of it is not trusted)."""
        return self.closed

    def close_with(self, code: int, reason: str) -> None:
        if not self.closed:
            self._corr += 1
            self.out.write(C.encode_close(self._corr, code, reason))
        self.end()
        self.out.close()

    def end(self) -> None:
        """The connection is over: subscriptions stop, groups rebalance."""
        if self.closed:
            return
        self.closed = True
        self.state = "closed"
        for sub in list(self.subs.values()):
            self._drop(sub)
        self.subs.clear()
        self.publishers.clear()

    # ------------------------------------------------------------------ management API
    def publisher_infos(self) -> list[dict[str, Any]]:
        """Its publishers as RabbitMQ's stream plugin reports them (``stream``: the queue)."""
        return [{"stream": p.stream, "publisher_id": pub_id, "reference": p.reference,
                 "published": p.published, "confirmed": p.confirmed, "errored": p.errored}
                for pub_id, p in self.publishers.items()]

    def consumer_infos(self) -> list[dict[str, Any]]:
        """Its subscriptions as RabbitMQ's stream plugin reports them: chunk credit left,
        messages sent, the offset after the last one sent and ``offset_lag`` (``Subscription.lag``)."""
        return [{"stream": sub.stream.name, "subscription_id": sub_id, "credits": sub.credit,
                 "consumed": sub.consumed, "offset": sub.offset, "offset_lag": sub.lag(),
                 "properties": dict(sub.properties), "active": sub.active,
                 "activity_status": _activity(sub)}
                for sub_id, sub in self.subs.items()]

    # ------------------------------------------------------------------ opening
    def peer_properties(self, f: C.Frame) -> None:
        c = C.Cursor(f.payload)
        corr = c.u32()
        self.client_properties = c.properties()
        c.end()
        props = {"product": "Skred", "platform": "Python", "copyright": "Skred authors",
                 "information": "Skred's RabbitMQ stream protocol listener"}
        self.out.write(C.response(C.PEER_PROPERTIES, corr, C.OK, C.props_bytes(props)))

    def sasl_handshake(self, f: C.Frame) -> None:
        c = C.Cursor(f.payload)
        corr = c.u32()
        c.end()
        self.out.write(C.response(C.SASL_HANDSHAKE, corr, C.OK, C.strings_bytes(["PLAIN"])))

    def sasl_credentials(self, payload: bytes) -> tuple[int, str, str] | None:
        """(corr, user, password) of a PLAIN SaslAuthenticate; None once answered with an error."""
        c = C.Cursor(payload)
        corr, mech, data = c.u32(), c.string(), c.blob()
        c.end()
        if mech != "PLAIN":
            self.out.write(C.response(C.SASL_AUTHENTICATE, corr, C.SASL_MECHANISM_NOT_SUPPORTED))
            return None
        parts = data.split(b"\x00")
        if len(parts) != 3:
            self.out.write(C.response(C.SASL_AUTHENTICATE, corr, C.SASL_ERROR))
            return None
        try:
            return corr, parts[1].decode(), parts[2].decode()
        except UnicodeDecodeError:
            self.out.write(C.response(C.SASL_AUTHENTICATE, corr, C.SASL_ERROR))
            return None

    def logged_in(self, corr: int, user: User | None) -> None:
        if self.closed:
            return
        if user is None:
            self.out.write(C.response(C.SASL_AUTHENTICATE, corr, C.AUTHENTICATION_FAILURE))
            self.close_with(C.AUTHENTICATION_FAILURE, "authentication failure")
            return
        self.user = user
        self.state = "tune"
        self.out.write(C.response(C.SASL_AUTHENTICATE, corr, C.OK))
        self.out.write(C.encode_tune(self.settings.frame_max, self.settings.heartbeat))

    def tune(self, f: C.Frame) -> None:
        c = C.Cursor(f.payload)
        frame_max, heartbeat = c.u32(), c.u32()
        c.end()
        mine = self.settings.frame_max
        self.frame_max = min(frame_max, mine) if frame_max else mine
        mine_hb = self.settings.heartbeat
        self.heartbeat = min(heartbeat, mine_hb) if heartbeat and mine_hb else 0

    def open(self, f: C.Frame) -> None:
        c = C.Cursor(f.payload)
        corr, name = c.u32(), c.string()
        c.end()
        vh = self.vhosts.get(name)
        assert self.user is not None
        if vh is None or not self.users.has_vhost_access(self.user, name):
            log.warning("stream client from %s: user '%s' has no access to vhost '%s'", self.peer,
                        self.user.name, name)
            self.out.write(C.response(C.OPEN, corr, C.VHOST_ACCESS_FAILURE))
            self.close_with(C.VHOST_ACCESS_FAILURE, f"no access to vhost '{name}'")
            return
        self.vh = vh
        self.state = "open"
        props = {"advertised_host": self.settings.host, "advertised_port": str(self.settings.port)}
        self.out.write(C.response(C.OPEN, corr, C.OK, C.props_bytes(props)))

    def command_versions(self, f: C.Frame) -> None:
        """Both sides list the versions they speak; a client that speaks Deliver version 2
        gets its chunks as version 2 from here on (with the committed chunk id)."""
        c = C.Cursor(f.payload)
        corr = c.u32()
        for _ in range(c.count()):
            key, _lo, hi = c.u16(), c.u16(), c.u16()
            if key == C.DELIVER:
                self.deliver_v2 = hi >= 2
        c.end()
        self.out.write(C.encode_command_versions(corr))

    # ------------------------------------------------------------------ helpers
    def _stream(self, name: str) -> StreamQueue | None:
        q = self.vh.queues.get(name)
        return q if isinstance(q, StreamQueue) and not q.deleted else None

    def _can(self, action: str, name: str) -> bool:
        assert self.user is not None
        check = {"configure": self.users.can_configure, "write": self.users.can_write,
                 "read": self.users.can_read}[action]
        if check(self.user, self.vh.name, name):
            return True
        log.warning("stream client from %s: user '%s' has no %s permission on '%s' in vhost '%s'",
                    self.peer, self.user.name, action, name, self.vh.name)
        return False

    # ------------------------------------------------------------------ streams
    def create(self, f: C.Frame) -> None:
        c = C.Cursor(f.payload)
        corr, name, props = c.u32(), c.string(), c.properties()
        c.end()
        code = C.OK
        if name_problem("queue", name) is not None:  # an empty name would be server-named
            code = C.PRECONDITION_FAILED
        elif not self._can("configure", name):
            code = C.ACCESS_REFUSED
        elif name in self.vh.queues:
            code = C.STREAM_ALREADY_EXISTS
        else:
            try:
                self.vh.declare_queue(name, durable=True, arguments=create_arguments(props), owner=None)
            except (errors.SkredError, ValueError) as exc:
                log.warning("stream client from %s: create '%s' refused: %s", self.peer, name, exc)
                code = C.PRECONDITION_FAILED
        self.out.write(C.response(C.CREATE, corr, code))

    def delete(self, f: C.Frame) -> None:
        c = C.Cursor(f.payload)
        corr, name = c.u32(), c.string()
        c.end()
        code = C.OK
        if not self._can("configure", name):
            code = C.ACCESS_REFUSED
        elif self._stream(name) is None:
            code = C.STREAM_DOES_NOT_EXIST
        else:
            try:
                self.vh.delete_queue(name, owner=None)
            except errors.SkredError as exc:
                log.warning("stream client from %s: delete '%s' refused: %s", self.peer, name, exc)
                code = C.PRECONDITION_FAILED
        self.out.write(C.response(C.DELETE, corr, code))

    def metadata(self, f: C.Frame) -> None:
        c = C.Cursor(f.payload)
        corr, names = c.u32(), c.strings()
        c.end()
        s = self.settings
        found = [(n, self._stream(n) is not None) for n in names]
        self.out.write(C.encode_metadata(corr, s.host, s.port, found))

    def create_super_stream(self, f: C.Frame) -> None:
        c = C.Cursor(f.payload)
        corr, name, parts, keys, props = c.u32(), c.string(), c.strings(), c.strings(), c.properties()
        c.end()
        code = C.OK
        if not all(self._can("configure", n) for n in [name, *parts]):
            code = C.ACCESS_REFUSED
        elif name in self.vh.exchanges:
            code = C.STREAM_ALREADY_EXISTS
        else:
            try:
                if [p for p, _ in superstream.layout(name, 0, keys)] != parts:
                    raise ValueError("partition names must be <super stream>-<binding key>")
                superstream.create(self.vh, name, binding_keys=keys, arguments=create_arguments(props))
            except (errors.SkredError, ValueError) as exc:
                log.warning("stream client from %s: super stream '%s' refused: %s", self.peer, name, exc)
                code = C.PRECONDITION_FAILED
        self.out.write(C.response(C.CREATE_SUPER_STREAM, corr, code))

    def delete_super_stream(self, f: C.Frame) -> None:
        c = C.Cursor(f.payload)
        corr, name = c.u32(), c.string()
        c.end()
        code = C.OK
        if not superstream.is_super_stream(self.vh, name):
            code = C.STREAM_DOES_NOT_EXIST
        elif not all(self._can("configure", n) for n in [name, *superstream.partitions(self.vh, name)]):
            code = C.ACCESS_REFUSED
        else:
            try:
                superstream.delete(self.vh, name)
            except errors.SkredError as exc:
                log.warning("stream client from %s: delete of super stream '%s' refused: %s", self.peer,
                            name, exc)
                code = C.PRECONDITION_FAILED
        self.out.write(C.response(C.DELETE_SUPER_STREAM, corr, code))

    def partitions(self, f: C.Frame) -> None:
        c = C.Cursor(f.payload)
        corr, name = c.u32(), c.string()
        c.end()
        try:
            found = superstream.partitions(self.vh, name)
        except errors.NotFound:
            self.out.write(C.response(C.PARTITIONS, corr, C.STREAM_DOES_NOT_EXIST, C.strings_bytes([])))
            return
        self.out.write(C.response(C.PARTITIONS, corr, C.OK, C.strings_bytes(found)))

    def route(self, f: C.Frame) -> None:
        c = C.Cursor(f.payload)
        corr, key, name = c.u32(), c.string(), c.string()
        c.end()
        try:
            found = superstream.route(self.vh, name, key)
        except errors.NotFound:
            self.out.write(C.response(C.ROUTE, corr, C.STREAM_DOES_NOT_EXIST, C.strings_bytes([])))
            return
        self.out.write(C.response(C.ROUTE, corr, C.OK, C.strings_bytes(found)))

    # ------------------------------------------------------------------ publishing
    def declare_publisher(self, f: C.Frame) -> None:
        c = C.Cursor(f.payload)
        corr, pub_id, ref, name = c.u32(), c.u8(), c.string(), c.string()
        c.end()
        q = self._stream(name)
        code = C.OK
        if pub_id in self.publishers:
            code = C.PRECONDITION_FAILED
        elif q is None:
            code = C.STREAM_DOES_NOT_EXIST
        elif not self._can("write", name):
            code = C.ACCESS_REFUSED
        else:
            seq = q.publisher_sequence(ref) if ref else None
            self.publishers[pub_id] = _Publisher(name, ref, seq or 0)
            self.published = True
        self.out.write(C.response(C.DECLARE_PUBLISHER, corr, code))

    def delete_publisher(self, f: C.Frame) -> None:
        c = C.Cursor(f.payload)
        corr, pub_id = c.u32(), c.u8()
        c.end()
        code = C.OK if self.publishers.pop(pub_id, None) is not None else C.PUBLISHER_DOES_NOT_EXIST
        self.out.write(C.response(C.DELETE_PUBLISHER, corr, code))

    def query_publisher_sequence(self, f: C.Frame) -> None:
        c = C.Cursor(f.payload)
        corr, ref, name = c.u32(), c.string(), c.string()
        c.end()
        q = self._stream(name)
        if q is None:
            self.out.write(C.response(C.QUERY_PUBLISHER_SEQUENCE, corr, C.STREAM_DOES_NOT_EXIST, bytes(8)))
            return
        if not self._can("read", name):
            self.out.write(C.response(C.QUERY_PUBLISHER_SEQUENCE, corr, C.ACCESS_REFUSED, bytes(8)))
            return
        seq = q.publisher_sequence(ref) or 0
        self.out.write(C.response(C.QUERY_PUBLISHER_SEQUENCE, corr, C.OK, seq.to_bytes(8, "big")))

    def publish(self, f: C.Frame) -> None:
        b = C.decode_publish_batch(f.payload, f.version)
        pub_id, ids, datas = b.pub_id, b.ids, b.datas
        self.received += len(ids)
        filters = b.filters if b.filters is not None and any(b.filters) else None
        p = self.publishers.get(pub_id)
        q = self._stream(p.stream) if p is not None else None
        if p is None or q is None:
            code = C.PUBLISHER_DOES_NOT_EXIST if p is None else C.STREAM_NOT_AVAILABLE
            self.out.write(C.encode_publish_error(pub_id, [(i, code) for i in ids]))
            if p is not None:
                p.published += len(ids)
                p.errored += len(ids)
            return
        p.published += len(ids)
        if b.groups is not None:
            self._publish_groups(p, q, pub_id, ids, b.groups)
            return
        done: list[int] = []
        failed: list[tuple[int, int]] = []
        deps: set[Any] = set()
        ts = int(time.time() * 1000)
        same_size = b.same_size
        if p.reference and ids and not (ids[0] > p.sequence and _increasing(ids)):
            # deduplication: ids not above the sequence were stored already (a frame of ids
            # above it in increasing order, as publishers send them, keeps all: checked in C)
            keep: list[int] = []
            top = p.sequence
            for i, pid in enumerate(ids):
                if pid <= top:
                    done.append(pid)  # a duplicate (also within the frame): confirmed again
                else:
                    keep.append(i)
                    top = pid
            if len(keep) != len(ids):
                ids = [ids[i] for i in keep]
                datas = [datas[i] for i in keep]
                filters = None if filters is None else [filters[i] for i in keep]
        seq = p.sequence  # from here: raised only by what is stored
        if filters is None:
            props = [_PLAIN_PROPS] * len(ids)
        else:
            props = [_PLAIN_PROPS if v is None else _stream_props(v) for v in filters]
        run = None
        if len(ids) > 1:  # the publish operation's own batching, when it can take them at once
            same = filters is None and (same_size or len(set(map(len, datas))) == 1)
            try:
                run = self.vh.publish_run("", p.stream, Names("", p.stream), props, datas, same, ts)
            except errors.SkredError as exc:
                log.warning("stream client from %s: publish to '%s' refused: %s", self.peer, p.stream, exc)
                failed.extend((i, C.INTERNAL_ERROR) for i in ids)
                ids = []
        if run is not None:
            deps.update(qq.store for qq in run.queues)
            done.extend(ids)
            seq = max(seq, max(ids))
            ids = []
        for pid, data, prop in zip(ids, datas, props, strict=False):
            try:
                out = self.vh.publish(PublishRequest("", p.stream, prop, data, ts, persistent=True))
            except errors.SkredError as exc:
                log.warning("stream client from %s: publish to '%s' refused: %s", self.peer, p.stream, exc)
                failed.append((pid, C.INTERNAL_ERROR))
                continue
            if out.rejected or not out.queues:
                failed.append((pid, C.STREAM_NOT_AVAILABLE))
                continue
            deps.update(qq.store for qq in out.queues)
            done.append(pid)
            seq = max(seq, pid)
        self._answer_publish(p, q, pub_id, seq, done, failed, deps)

    def _publish_groups(self, p: _Publisher, q: StreamQueue, pub_id: int, ids: list[int],
                        groups: list[list[bytes]]) -> None:
        """A Publish with sub-entries: each publishing id's records are stored as one run when
        the publish operation can take them at once (else one by one) and confirmed together;
        deduplication is by the publishing id, as for single messages."""
        done: list[int] = []
        failed: list[tuple[int, int]] = []
        deps: set[Any] = set()
        ts = int(time.time() * 1000)
        seq = p.sequence
        p.published += len(ids)
        for pid, records in zip(ids, groups, strict=True):
            if p.reference and pid <= seq:
                done.append(pid)  # stored already: confirmed again
                continue
            self.received += len(records) - 1
            code = self._store_records(p.stream, records, ts, deps)
            if code != C.OK:
                failed.append((pid, code))
                continue
            done.append(pid)
            seq = max(seq, pid)
        self._answer_publish(p, q, pub_id, seq, done, failed, deps)

    def _answer_publish(self, p: _Publisher, q: StreamQueue, pub_id: int, seq: int, done: list[int],
                        failed: list[tuple[int, int]], deps: set[Any]) -> None:
        """After a Publish: keep the publisher's highest stored id (deduplication), then answer
        the failed ids with PublishError and the stored ones with a confirm."""
        if p.reference and seq != p.sequence:
            p.sequence = seq
            q.set_publisher_sequence(p.reference, seq)
        if failed:
            p.errored += len(failed)
            self.out.write(C.encode_publish_error(pub_id, failed))
        if done:
            self._confirm(p, pub_id, done, deps)

    def _store_records(self, stream: str, records: list[bytes], ts: int, deps: set[Any]) -> int:
        """Store one sub-entry's records; the response code."""
        props = [_PLAIN_PROPS] * len(records)
        try:
            if len(records) > 1:
                same = len(set(map(len, records))) == 1
                run = self.vh.publish_run("", stream, Names("", stream), props, records, same, ts)
                if run is not None:
                    deps.update(qq.store for qq in run.queues)
                    return C.OK
            for data in records:
                out = self.vh.publish(PublishRequest("", stream, _PLAIN_PROPS, data, ts, persistent=True))
                if out.rejected or not out.queues:
                    return C.STREAM_NOT_AVAILABLE
                deps.update(qq.store for qq in out.queues)
        except errors.SkredError as exc:
            log.warning("stream client from %s: publish to '%s' refused: %s", self.peer, stream, exc)
            return C.INTERNAL_ERROR
        return C.OK

    def _confirm(self, p: _Publisher, pub_id: int, ids: list[int], deps: set[Any]) -> None:
        def synced(ok: bool) -> None:
            if self.closed:
                return
            if ok:
                self.confirmed += len(ids)
                p.confirmed += len(ids)
                self.out.write(C.encode_confirm(pub_id, ids))
            else:
                p.errored += len(ids)
                self.out.write(C.encode_publish_error(pub_id, [(i, C.INTERNAL_ERROR) for i in ids]))

        self.after_sync(synced, deps or None)

    # ------------------------------------------------------------------ consuming
    def subscribe(self, f: C.Frame) -> None:
        s = C.decode_subscribe(f.payload)
        q = self._stream(s.stream)
        code = C.OK
        if s.sub_id in self.subs:
            code = C.SUBSCRIPTION_ID_ALREADY_EXISTS
        elif q is None:
            code = C.STREAM_DOES_NOT_EXIST
        elif not self._can("read", s.stream):
            code = C.ACCESS_REFUSED
        elif s.properties.get("single-active-consumer") == "true" and not s.properties.get("name"):
            code = C.PRECONDITION_FAILED
        if code != C.OK or q is None:
            self.out.write(C.response(C.SUBSCRIBE, s.corr, code))
            return
        args: dict[str, Any] = {}
        filters = [v for k, v in s.properties.items() if k.startswith("filter.")]
        if filters:
            args["x-stream-filter"] = filters
            args["x-stream-match-unfiltered"] = s.properties.get("match-unfiltered") == "true"
        sub = Subscription(self, s.sub_id, q, s.credit, args)
        sub.properties = dict(s.properties)
        self.subs[s.sub_id] = sub
        self.out.write(C.response(C.SUBSCRIBE, s.corr, C.OK))
        if s.properties.get("single-active-consumer") == "true":
            sub.group_key = (self.vh.name, s.stream, s.properties["name"])
            sub.super_stream = s.properties.get("super-stream", "")
            sub.active = False
            self.groups.join(sub)
            return
        try:
            sub.start(s.offset)
        except errors.SkredError as exc:  # a bad offset: the subscription goes again
            log.warning("stream client from %s: subscription to '%s' failed: %s", self.peer, s.stream, exc)
            self.subs.pop(s.sub_id, None)
            self.out.write(C.encode_metadata_update(C.STREAM_NOT_AVAILABLE, s.stream))

    def activity_changed(self, sub: Subscription, active: bool) -> None:
        """The group made ``sub`` (in)active: tell the client; an active one starts on its answer."""
        if self.closed:
            return
        if not active:
            sub.stop()
        self._corr += 1
        sub.pending_update = self._corr if active else None
        self.out.write(C.encode_consumer_update(self._corr, sub.sub_id, active))

    def consumer_update_answer(self, payload: bytes) -> None:
        c = C.Cursor(payload)
        corr, _code = c.u32(), c.u16()
        spec = C.offset_spec(c)  # rstream sends a value after first/last/next too: not checked
        for sub in self.subs.values():
            if sub.pending_update == corr:
                sub.pending_update = None
                if sub.active:
                    sub.start(spec)
                return

    def unsubscribe(self, f: C.Frame) -> None:
        c = C.Cursor(f.payload)
        corr, sub_id = c.u32(), c.u8()
        c.end()
        sub = self.subs.pop(sub_id, None)
        if sub is None:
            self.out.write(C.response(C.UNSUBSCRIBE, corr, C.SUBSCRIPTION_ID_DOES_NOT_EXIST))
            return
        self._drop(sub)
        self.out.write(C.response(C.UNSUBSCRIBE, corr, C.OK))

    def _drop(self, sub: Subscription) -> None:
        sub.stop()
        if sub.group_key is not None:
            self.groups.leave(sub)

    def credit(self, f: C.Frame) -> None:
        c = C.Cursor(f.payload)
        sub_id, n = c.u8(), c.u16()
        c.end()
        sub = self.subs.get(sub_id)
        if sub is None:
            self.out.write(C.encode_credit_error(C.SUBSCRIPTION_ID_DOES_NOT_EXIST, sub_id))
            return
        sub.credit = min(sub.credit + n, 0xFFFF)
        if sub.consuming:
            sub.stream.schedule_delivery()

    def stream_gone(self, sub: Subscription) -> None:
        """The stream was deleted under a subscription: MetadataUpdate, as the protocol says."""
        sub.consuming = False
        if self.subs.get(sub.sub_id) is sub:
            del self.subs[sub.sub_id]
            if sub.group_key is not None:
                self.groups.leave(sub)
            if not self.closed:
                self.out.write(C.encode_metadata_update(C.STREAM_NOT_AVAILABLE, sub.stream.name))

    def resume(self) -> None:
        """The socket drained: wake the subscriptions' queues."""
        for sub in self.subs.values():
            if sub.consuming:
                sub.stream.schedule_delivery()

    # ------------------------------------------------------------------ offsets
    def store_offset(self, f: C.Frame) -> None:
        c = C.Cursor(f.payload)
        ref, name, offset = c.string(), c.string(), c.u64()
        c.end()
        q = self._stream(name)
        if q is None or not ref or not self._can("read", name):
            return  # StoreOffset has no answer
        q.store_offset(ref, offset)

    def query_offset(self, f: C.Frame) -> None:
        c = C.Cursor(f.payload)
        corr, ref, name = c.u32(), c.string(), c.string()
        c.end()
        q = self._stream(name)
        if q is None:
            self.out.write(C.response(C.QUERY_OFFSET, corr, C.STREAM_DOES_NOT_EXIST, bytes(8)))
            return
        if not self._can("read", name):
            self.out.write(C.response(C.QUERY_OFFSET, corr, C.ACCESS_REFUSED, bytes(8)))
            return
        offset = q.stored_offset(ref)
        if offset is None:
            self.out.write(C.response(C.QUERY_OFFSET, corr, C.NO_OFFSET, bytes(8)))
            return
        self.out.write(C.response(C.QUERY_OFFSET, corr, C.OK, offset.to_bytes(8, "big")))


def create_arguments(props: dict[str, str]) -> dict[str, Any]:
    """Queue arguments of a Create's properties (RabbitMQ's names; numbers as integers)."""
    args: dict[str, Any] = {"x-queue-type": "stream"}
    for k, v in props.items():
        target = _CREATE_ARGS.get(k)
        if target is None:
            continue  # queue-leader-locator, initial-cluster-size: no meaning on one leader
        if target == "x-max-age":
            args[target] = v
        else:
            try:
                args[target] = int(v)
            except ValueError:
                raise ValueError(f"'{k}' must be an integer") from None
    return args


_Handler = Callable[[StreamSession, C.Frame], None]
_EARLY_HANDLERS: Final[dict[tuple[str, int], _Handler]] = {
    ("peer", C.PEER_PROPERTIES): StreamSession.peer_properties,
    ("peer", C.SASL_HANDSHAKE): StreamSession.sasl_handshake,
    ("tune", C.TUNE): StreamSession.tune,
    ("tune", C.OPEN): StreamSession.open,
}
_OPEN_HANDLERS: Final[dict[int, _Handler]] = {
    C.DECLARE_PUBLISHER: StreamSession.declare_publisher,
    C.PUBLISH: StreamSession.publish,
    C.QUERY_PUBLISHER_SEQUENCE: StreamSession.query_publisher_sequence,
    C.DELETE_PUBLISHER: StreamSession.delete_publisher,
    C.SUBSCRIBE: StreamSession.subscribe,
    C.CREDIT: StreamSession.credit,
    C.STORE_OFFSET: StreamSession.store_offset,
    C.QUERY_OFFSET: StreamSession.query_offset,
    C.UNSUBSCRIBE: StreamSession.unsubscribe,
    C.CREATE: StreamSession.create,
    C.DELETE: StreamSession.delete,
    C.METADATA: StreamSession.metadata,
    C.ROUTE: StreamSession.route,
    C.PARTITIONS: StreamSession.partitions,
    C.EXCHANGE_COMMAND_VERSIONS: StreamSession.command_versions,
    C.CREATE_SUPER_STREAM: StreamSession.create_super_stream,
    C.DELETE_SUPER_STREAM: StreamSession.delete_super_stream,
}
