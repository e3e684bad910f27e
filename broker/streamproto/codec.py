"""The RabbitMQ Stream protocol's frames, sans-IO: bytes in, commands out; answers to bytes.

Theory of operation
-------------------
A frame is ``u32 size`` then ``size`` bytes: ``u16 key``, ``u16 version``, the command's
fields, all big-endian. Strings are ``i16 length`` + UTF-8 (length -1: null), byte blobs
``i32 length`` + bytes, arrays ``i32 count`` + items. A response sets the key's top bit
(``key | 0x8000``) and carries the request's correlation id and a ``u16`` response code.

``FrameReader.feed(data)`` returns every complete frame as a ``Frame`` (key, version, payload)
and keeps the rest: "need more bytes" is simply no frame. A frame larger than the limit in
force (``max_frame``: small before authentication, the tuned ``frame_max`` after) raises
``FrameTooLarge``. The decoders (``decode_*``) take a payload and return the command's fields;
a truncated or malformed payload raises ``Malformed``, which the session answers with the
protocol's response code (or a Close) — never a crash.

Deliver (``encode_deliver``) carries one *chunk* in osiris' format: magic/version ``0x50``,
chunk type 0 (user data), entry and record counts, the chunk's timestamp, epoch and first
offset, a CRC-32 of the data, the data and trailer lengths, a reserved word, then the entries,
each ``u32 size`` (top bit 0: a simple entry) and the message bytes. Offsets in a chunk are
consecutive from its first offset.

Sub-entry batching (Publish version 1): after its publishing id an entry whose first byte has
the top bit set is a sub-entry: ``u8 0x80 | compression << 4``, ``u16`` records, ``u32``
uncompressed size, ``u32`` data size, then the data: ``u32 size`` + bytes per record, gzip
compressed (compression 1) or not (0). ``decode_publish_batch`` unpacks it into its records
(``PublishBatch.groups``: one list per publishing id); the declared uncompressed size bounds
the decompression (at most ``SUB_ENTRY_MAX`` bytes), and any other compression is refused
with code 17 (precondition failed).
"""

from __future__ import annotations

import operator
import struct
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Final

from broker.streamwire import *  # noqa: F403 - the protocol's numbers, used as C.<NAME>
from broker.streamwire import (
    CLOSE,
    CONSUMER_UPDATE,
    CREATE,
    CREATE_SUPER_STREAM,
    CREDIT,
    DECLARE_PUBLISHER,
    DELETE,
    DELETE_PUBLISHER,
    DELETE_SUPER_STREAM,
    DELIVER,
    EXCHANGE_COMMAND_VERSIONS,
    FRAME_TOO_LARGE,
    HEARTBEAT,
    METADATA,
    METADATA_UPDATE,
    OFFSET_FIRST,
    OFFSET_LAST,
    OFFSET_NEXT,
    OFFSET_OFFSET,
    OFFSET_TIMESTAMP,
    OK,
    OPEN,
    PARTITIONS,
    PEER_PROPERTIES,
    PRECONDITION_FAILED,
    PUBLISH,
    PUBLISH_CONFIRM,
    PUBLISH_ERROR,
    QUERY_OFFSET,
    QUERY_PUBLISHER_SEQUENCE,
    RESPONSE,
    ROUTE,
    SASL_AUTHENTICATE,
    SASL_HANDSHAKE,
    STORE_OFFSET,
    STREAM_DOES_NOT_EXIST,
    SUBSCRIBE,
    TUNE,
    UNKNOWN_FRAME,
    UNSUBSCRIBE,
)
from broker.streamwire import frame as _frame
from broker.streamwire import (
    response as response,  # re-exported: C.response
)

# What this server speaks: key -> (min version, max version), for ExchangeCommandVersions.
VERSIONS: Final[dict[int, tuple[int, int]]] = {
    k: (1, 2 if k in (PUBLISH, DELIVER) else 1)
    for k in (DECLARE_PUBLISHER, PUBLISH, PUBLISH_CONFIRM, PUBLISH_ERROR, QUERY_PUBLISHER_SEQUENCE,
              DELETE_PUBLISHER, SUBSCRIBE, DELIVER, CREDIT, STORE_OFFSET, QUERY_OFFSET, UNSUBSCRIBE,
              CREATE, DELETE, METADATA, METADATA_UPDATE, PEER_PROPERTIES, SASL_HANDSHAKE,
              SASL_AUTHENTICATE, TUNE, OPEN, CLOSE, HEARTBEAT, ROUTE, PARTITIONS, CONSUMER_UPDATE,
              EXCHANGE_COMMAND_VERSIONS, CREATE_SUPER_STREAM, DELETE_SUPER_STREAM)
}

CHUNK_MAGIC_VERSION: Final = 0x50
_SIZE: Final = struct.Struct(">I")
_U8: Final = struct.Struct(">B")
_U16: Final = struct.Struct(">H")
_I16: Final = struct.Struct(">h")
_U32: Final = struct.Struct(">I")
_I32: Final = struct.Struct(">i")
_U64: Final = struct.Struct(">Q")
_I64: Final = struct.Struct(">q")
_CHUNK: Final = struct.Struct(">IHHBbbHIqQQIIII")  # frame head, sub id, chunk header
_CHUNK_V2: Final = struct.Struct(">IHHBQbbHIqQQIIII")  # ... with the committed chunk id after sub id
MAX_ARRAY: Final = 65536  # items in any array a client sends (strings, messages, properties)


class Malformed(ValueError):
    """A frame whose fields do not parse: answered with ``code``."""

    def __init__(self, text: str, code: int = UNKNOWN_FRAME) -> None:
        super().__init__(text)
        self.code = code


class FrameTooLarge(Malformed):
    def __init__(self, size: int, limit: int) -> None:
        super().__init__(f"frame of {size} bytes, larger than {limit}", FRAME_TOO_LARGE)


@dataclass(frozen=True, slots=True)
class Frame:
    key: int
    version: int
    payload: bytes


class FrameReader:
    """Splits a byte stream into frames; ``max_frame`` bounds each one (0: no bound)."""

    def __init__(self, max_frame: int) -> None:
        self.max_frame = max_frame
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[Frame]:
        buf = self._buf
        buf += data
        out: list[Frame] = []
        pos = 0
        n = len(buf)
        while n - pos >= 4:
            (size,) = _SIZE.unpack_from(buf, pos)
            if self.max_frame and size > self.max_frame:
                del buf[:pos]
                raise FrameTooLarge(size, self.max_frame)
            if n - pos - 4 < size:
                break
            if size < 4:
                del buf[:pos + 4 + size]
                raise Malformed(f"frame of {size} bytes has no key and version")
            key, version = struct.unpack_from(">HH", buf, pos + 4)
            out.append(Frame(key, version, bytes(buf[pos + 8 : pos + 4 + size])))
            pos += 4 + size
        if pos:
            del buf[:pos]
        return out

    @property
    def buffered(self) -> int:
        return len(self._buf)

    def take(self) -> bytes:
        """The bytes of a frame begun but not complete (a connection handed to another worker)."""
        rest, self._buf = bytes(self._buf), bytearray()
        return rest


def raw_frame(f: Frame) -> bytes:
    """``f`` as it came on the wire (frames read but not handled go along with a hand-over)."""
    return _SIZE.pack(4 + len(f.payload)) + struct.pack(">HH", f.key, f.version) + f.payload


class Cursor:
    """Reads a payload's fields in order; any short read raises ``Malformed``."""

    __slots__ = ("data", "pos")

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0

    def _take(self, st: struct.Struct) -> int:
        if self.pos + st.size > len(self.data):
            raise Malformed("frame too short")
        (v,) = st.unpack_from(self.data, self.pos)
        self.pos += st.size
        return int(v)

    def u8(self) -> int:
        return self._take(_U8)

    def u16(self) -> int:
        return self._take(_U16)

    def u32(self) -> int:
        return self._take(_U32)

    def i32(self) -> int:
        return self._take(_I32)

    def u64(self) -> int:
        return self._take(_U64)

    def i64(self) -> int:
        return self._take(_I64)

    def raw(self, n: int) -> bytes:
        if n < 0 or self.pos + n > len(self.data):
            raise Malformed("frame too short")
        v = self.data[self.pos : self.pos + n]
        self.pos += n
        return v

    def string(self) -> str:
        n = self._take(_I16)
        if n < 0:
            return ""  # null string
        try:
            return self.raw(n).decode("utf-8")
        except UnicodeDecodeError:
            raise Malformed("string is not UTF-8") from None

    def blob(self) -> bytes:
        n = self._take(_I32)
        return b"" if n < 0 else self.raw(n)

    def count(self) -> int:
        n = self._take(_I32)
        if n < 0 or n > MAX_ARRAY:
            raise Malformed(f"array of {n} items")
        return n

    def strings(self) -> list[str]:
        return [self.string() for _ in range(self.count())]

    def properties(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for _ in range(self.count()):
            k = self.string()
            out[k] = self.string()
        return out

    def end(self) -> None:
        if self.pos != len(self.data):
            raise Malformed(f"{len(self.data) - self.pos} bytes after the last field")


# ---------------------------------------------------------------------- requests

@dataclass(frozen=True, slots=True)
class OffsetSpec:
    kind: int
    value: int = 0


@dataclass(frozen=True, slots=True)
class Subscribe:
    corr: int
    sub_id: int
    stream: str
    offset: OffsetSpec
    credit: int
    properties: dict[str, str]


@dataclass(frozen=True, slots=True)
class PublishedMessage:
    publishing_id: int
    filter_value: str | None
    data: bytes


def offset_spec(c: Cursor) -> OffsetSpec:
    kind = c.u16()
    if kind in (OFFSET_FIRST, OFFSET_LAST, OFFSET_NEXT):
        return OffsetSpec(kind)
    if kind == OFFSET_OFFSET:
        return OffsetSpec(kind, c.u64())
    if kind == OFFSET_TIMESTAMP:
        return OffsetSpec(kind, c.i64())
    raise Malformed(f"unknown offset specification type {kind}", PRECONDITION_FAILED)


def decode_subscribe(payload: bytes) -> Subscribe:
    c = Cursor(payload)
    corr, sub_id, stream = c.u32(), c.u8(), c.string()
    spec = offset_spec(c)
    credit = c.u16()
    props = c.properties() if c.pos < len(payload) else {}
    c.end()
    return Subscribe(corr, sub_id, stream, spec, credit, props)


@dataclass(slots=True)
class PublishBatch:
    """A Publish frame's messages as parallel lists (no object per message)."""

    pub_id: int
    ids: list[int]
    filters: list[str | None] | None  # None: version 1, no filter values
    datas: list[bytes]
    # sub-entry batches: the records of each publishing id (``datas`` then holds no messages)
    groups: list[list[bytes]] | None = None
    same_size: bool = False  # every message of ``datas`` is known to be of one length


_ID_SIZE: Final = struct.Struct(">Qi")
_ID_OF, _SIZE_OF, _DATA_OF = operator.itemgetter(0), operator.itemgetter(1), operator.itemgetter(2)
_SUB_ENTRY: Final = struct.Struct(">BHII")  # type|compression, records, uncompressed, data size
SUB_NONE: Final = 0
SUB_GZIP: Final = 1
SUB_ENTRY_MAX: Final = 64 << 20  # uncompressed bytes of one sub-entry


def _sub_entry(payload: bytes, pos: int) -> tuple[list[bytes], int]:
    """The records of the sub-entry at ``pos`` and the position after it."""
    if pos + _SUB_ENTRY.size > len(payload):
        raise Malformed("frame too short")
    kind, count, raw_size, size = _SUB_ENTRY.unpack_from(payload, pos)
    pos += _SUB_ENTRY.size
    if pos + size > len(payload):
        raise Malformed("frame too short")
    data = payload[pos:pos + size]
    compression = (kind >> 4) & 0x7
    if compression == SUB_GZIP:
        if raw_size > SUB_ENTRY_MAX:
            raise Malformed(f"sub-entry of {raw_size} bytes uncompressed", PRECONDITION_FAILED)
        z = zlib.decompressobj(16 + zlib.MAX_WBITS)
        try:
            data = z.decompress(data, raw_size + 1)
        except zlib.error as exc:
            raise Malformed(f"sub-entry does not decompress: {exc}", PRECONDITION_FAILED) from None
    elif compression != SUB_NONE:
        raise Malformed(f"sub-entry compression {compression} is not supported", PRECONDITION_FAILED)
    if len(data) != raw_size:
        raise Malformed("sub-entry size does not match its data", PRECONDITION_FAILED)
    records: list[bytes] = []
    at = 0
    for _ in range(count):
        if at + 4 > len(data):
            raise Malformed("sub-entry record cut short", PRECONDITION_FAILED)
        (n,) = _U32.unpack_from(data, at)
        at += 4
        if at + n > len(data):
            raise Malformed("sub-entry record cut short", PRECONDITION_FAILED)
        records.append(data[at:at + n])
        at += n
    if at != len(data) or not records:
        raise Malformed("sub-entry records do not fill it", PRECONDITION_FAILED)
    return records, pos + size


def _decode_with_sub_entries(payload: bytes, pub_id: int, n: int, pos: int) -> PublishBatch:
    """A version 1 Publish holding sub-entries (each message may be one)."""
    ids: list[int] = []
    groups: list[list[bytes]] = []
    end = len(payload)
    for _ in range(n):
        if pos + 9 > end:
            raise Malformed("frame too short")
        ids.append(_U64.unpack_from(payload, pos)[0])
        pos += 8
        if payload[pos] & 0x80:
            records, pos = _sub_entry(payload, pos)
            groups.append(records)
            continue
        if pos + 4 > end:
            raise Malformed("frame too short")
        (size,) = _I32.unpack_from(payload, pos)
        pos += 4
        if pos + size > end:
            raise Malformed("frame too short")
        groups.append([payload[pos:pos + size]])
        pos += size
    if pos != end:
        raise Malformed(f"{end - pos} bytes after the last field")
    return PublishBatch(pub_id, ids, None, [], groups)


def decode_publish_batch(payload: bytes, version: int) -> PublishBatch:
    """Publisher id and messages; sub-entries are unpacked (version 1; refused in version 2).
    Version 1 (no filter values) is the hot path: one unpack and one slice per message."""
    if version >= 2:
        c = Cursor(payload)
        pub_id = c.u8()
        ids: list[int] = []
        filters: list[str | None] = []
        datas: list[bytes] = []
        for _ in range(c.count()):
            ids.append(c.u64())
            filters.append(c.string() or None)
            size = c.i32()
            if size < 0:
                raise Malformed("sub-entry batches are not supported", PRECONDITION_FAILED)
            datas.append(c.raw(size))
        c.end()
        return PublishBatch(pub_id, ids, filters, datas)
    c = Cursor(payload)
    pub_id = c.u8()
    n = c.count()
    pos = c.pos
    end = len(payload)
    if n and end >= pos + 12:  # all messages of the first one's size: one C-level unpack
        size = _ID_SIZE.unpack_from(payload, pos)[1]
        if size >= 0 and end - pos == n * (12 + size):
            rows = list(struct.iter_unpack(f">Qi{size}s", memoryview(payload)[pos:]))
            if list(map(_SIZE_OF, rows)).count(size) == n:  # then this parse is the field-by-field one
                return PublishBatch(pub_id, list(map(_ID_OF, rows)), None, list(map(_DATA_OF, rows)),
                                    same_size=True)
    ids = [0] * n
    datas = [b""] * n
    unpack = _ID_SIZE.unpack_from
    first = pos
    for i in range(n):
        if pos + 12 > end:
            raise Malformed("frame too short")
        pid, size = unpack(payload, pos)
        pos += 12
        if size < 0:
            return _decode_with_sub_entries(payload, pub_id, n, first)
        if pos + size > end:
            raise Malformed("frame too short")
        ids[i] = pid
        datas[i] = payload[pos:pos + size]
        pos += size
    c.pos = pos
    c.end()
    return PublishBatch(pub_id, ids, None, datas)


def decode_publish(payload: bytes, version: int) -> tuple[int, list[PublishedMessage]]:
    """``decode_publish_batch`` as one object per message."""
    b = decode_publish_batch(payload, version)
    filters = b.filters or [None] * len(b.ids)
    return b.pub_id, [PublishedMessage(i, f, d) for i, f, d in zip(b.ids, filters, b.datas, strict=True)]


# --------------------------------------------------------------------- answers

def _str(s: str) -> bytes:
    b = s.encode()
    return _I16.pack(len(b)) + b


def props_bytes(props: dict[str, str]) -> bytes:
    return _I32.pack(len(props)) + b"".join(_str(k) + _str(v) for k, v in props.items())


def strings_bytes(items: Sequence[str]) -> bytes:
    return _I32.pack(len(items)) + b"".join(_str(s) for s in items)


def encode_tune(frame_max: int, heartbeat: int) -> bytes:
    return _frame(TUNE, _U32.pack(frame_max) + _U32.pack(heartbeat))


def encode_heartbeat() -> bytes:
    return _frame(HEARTBEAT, b"")


def encode_close(corr: int, code: int, reason: str) -> bytes:
    return _frame(CLOSE, _U32.pack(corr) + _U16.pack(code) + _str(reason))


def encode_confirm(pub_id: int, ids: Sequence[int]) -> bytes:
    n = len(ids)
    return _frame(PUBLISH_CONFIRM, _U8.pack(pub_id) + _I32.pack(n) + struct.pack(f">{n}Q", *ids))


def encode_publish_error(pub_id: int, errors: Sequence[tuple[int, int]]) -> bytes:
    return _frame(PUBLISH_ERROR, _U8.pack(pub_id) + _I32.pack(len(errors))
                  + b"".join(_U64.pack(i) + _U16.pack(code) for i, code in errors))


def encode_metadata_update(code: int, stream: str) -> bytes:
    return _frame(METADATA_UPDATE, _U16.pack(code) + _str(stream))


def encode_credit_error(code: int, sub_id: int) -> bytes:
    """A Credit for an unknown subscription is answered (only then) with this."""
    return _frame(CREDIT | RESPONSE, _U16.pack(code) + _U8.pack(sub_id))


def encode_consumer_update(corr: int, sub_id: int, active: bool) -> bytes:
    return _frame(CONSUMER_UPDATE, _U32.pack(corr) + _U8.pack(sub_id) + _U8.pack(1 if active else 0))


def encode_metadata(corr: int, host: str, port: int, streams: Iterable[tuple[str, bool]]) -> bytes:
    """One broker (reference 0: this node, or the address the client reached it by); each
    stream led by it, no replicas named (followers replicate files, they serve no stream)."""
    items = list(streams)
    body = [_U32.pack(corr), _I32.pack(1), _U16.pack(0), _str(host), _U32.pack(port), _I32.pack(len(items))]
    for name, exists in items:
        code = OK if exists else STREAM_DOES_NOT_EXIST
        body.append(_str(name) + _U16.pack(code) + _U16.pack(0 if exists else 0xFFFF) + _I32.pack(0))
    return _frame(METADATA | RESPONSE, b"".join(body))


def encode_command_versions(corr: int) -> bytes:
    items = b"".join(_U16.pack(k) + _U16.pack(lo) + _U16.pack(hi) for k, (lo, hi) in sorted(VERSIONS.items()))
    return response(EXCHANGE_COMMAND_VERSIONS, corr, OK, _I32.pack(len(VERSIONS)) + items)


def encode_deliver(sub_id: int, first_offset: int, timestamp_ms: int, messages: Sequence[bytes],
                   committed: int | None = None) -> bytes:
    """One Deliver of a chunk holding ``messages`` at consecutive offsets: version 1, or with
    ``committed`` (the committed chunk id) version 2, for a client that asked for it."""
    return encode_deliver_run(sub_id, first_offset, timestamp_ms, list(messages), committed)


def encode_deliver_run(sub_id: int, first_offset: int, timestamp_ms: int, messages: list[bytes],
                       committed: int | None = None, same_size: bool = False) -> bytes:
    """``encode_deliver`` with the entries built in one join (length prefixes packed in one
    call), the chunk's crc32 computed over the joined data: the consume hot path.
    ``same_size``: the caller knows every message has one length (the store's alike run),
    so the per-message check is skipped; it must never be True otherwise."""
    n = len(messages)
    if n and (same_size or len(set(map(len, messages))) == 1):  # one length: one prefix joins them all
        prefix = _U32.pack(len(messages[0]))
        data = prefix + prefix.join(messages)
    else:
        lengths = struct.pack(f">{n}I", *map(len, messages))
        parts: list[bytes] = [b""] * (2 * n)
        parts[0::2] = [lengths[i:i + 4] for i in range(0, 4 * n, 4)]
        parts[1::2] = messages
        data = b"".join(parts)
    return encode_deliver_data(sub_id, first_offset, timestamp_ms, n, data, committed)


def encode_deliver_data(sub_id: int, first_offset: int, timestamp_ms: int, n: int, data: bytes,
                        committed: int | None = None) -> bytes:
    """One Deliver of a chunk of ``n`` entries already framed in ``data`` (each a 4-byte
    length and the message: the chunk's data section as the protocol lays it out): the
    chunk header (its crc32 over ``data``) and ``data`` itself."""
    if committed is not None:
        head = _CHUNK_V2.pack(len(data) + _CHUNK_V2.size - 4, DELIVER, 2, sub_id, committed,
                              CHUNK_MAGIC_VERSION, 0, n, n, timestamp_ms, 0, first_offset, zlib.crc32(data),
                              len(data), 0, 0)
        return head + data
    head = _CHUNK.pack(len(data) + _CHUNK.size - 4, DELIVER, 1, sub_id, CHUNK_MAGIC_VERSION, 0, n, n,
                       timestamp_ms, 0, first_offset, zlib.crc32(data), len(data), 0, 0)
    return head + data
