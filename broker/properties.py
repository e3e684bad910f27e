"""Content properties: the one vocabulary of property flag bits, their reads, validation.

Theory of operation
-------------------
A message's properties travel and are stored as the raw AMQP 0-9-1 basic content-header
property list: ``flags u16 | the present properties in flag order``. The broker keeps
those bytes as they came and decodes them only where a feature reads a property. This
module sits beside ``errors`` at the bottom of the package (it imports nothing of ours)
so that every layer, the store included, names the flag bits the same way and reads
the properties the core needs (delivery mode, priority, expiration, headers) one way.

``FLAG_*`` are the bits of the 16-bit flag word; ``HI_*`` are the same bits seen in the
first octet (``props[0] & HI_HEADERS``), the form the hot path tests with one index.
``delivery_mode`` and ``priority`` skip to their octet with a few integer operations;
``decode``/``encode`` (pamqp) are the cold path for headers, expiration and rewrites.

Validation: a property list a client library cannot decode must never be confirmed,
stored or delivered (a pika or aiormq consumer dies on it and it blocks the head of its
queue). ``problem(props)`` walks the list and every field table in it and names the
first defect; ``valid(props)`` is the hot-path form: a list seen valid before is
remembered by its bytes (publish runs repeat the same properties), and so is a headers
table; a table that differs from a valid one only inside its values (a new id in
the same headers) is recognised by comparing its structural bytes at once
(``_check_headers``); a whole list likewise, with its short strings' ASCII and its
timestamps' range in the same masked compare (``LIST_LAYOUTS``). Refused: lengths that
run past their end, unknown field types (the 0-9-1 errata set RabbitMQ, pika and pamqp
share), bytes after the last property, a
second flag word (class basic has 14 properties), field names and short strings that
are not UTF-8, tables nested deeper than clients recurse, and timestamps beyond year
9999 (pamqp turns the timestamp property into a datetime: seconds, or milliseconds when
above 2**32; pika turns a 'T' field into a datetime of seconds).

Header values on the cold path: pamqp decodes an ``S`` long string that is not UTF-8 (py-amqp,
Celery's transport, writes a Python ``bytes`` header so) to ``bytes``, which its own encoder
refuses, and its encoder narrows a float to a 32-bit ``f``. ``encode`` therefore writes headers
with ``encode_table``: pamqp's encoders but ``bytes`` as the ``S`` it came from (a long string is
binary in 0-9-1), ``bytearray`` as a byte array ``x`` (what a front end uses for binary data),
float as a double ``d``; a value no field type holds (an integer beyond 64 bits, an object)
raises ``TypeError``, for the front end to refuse at publish time. A route that only adds or
replaces a few header fields (a stream's offset stamping) splices them into the raw table with
``with_header_fields`` instead, so every other field keeps its bytes and type exactly.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterator
from operator import itemgetter
from typing import Any

from pamqp import commands
from pamqp import encode as pamqp_encode

FLAG_CONTENT_TYPE = 0x8000
FLAG_CONTENT_ENCODING = 0x4000
FLAG_HEADERS = 0x2000
FLAG_DELIVERY_MODE = 0x1000
FLAG_PRIORITY = 0x0800
FLAG_CORRELATION_ID = 0x0400
FLAG_REPLY_TO = 0x0200
FLAG_EXPIRATION = 0x0100
FLAG_MESSAGE_ID = 0x0080
FLAG_TIMESTAMP = 0x0040
FLAG_TYPE = 0x0020
FLAG_USER_ID = 0x0010
FLAG_APP_ID = 0x0008
FLAG_CLUSTER_ID = 0x0004
FLAG_CONTINUATION = 0x0001  # another flag word follows (never for class basic)

HI_CONTENT_TYPE = FLAG_CONTENT_TYPE >> 8
HI_CONTENT_ENCODING = FLAG_CONTENT_ENCODING >> 8
HI_HEADERS = FLAG_HEADERS >> 8
HI_DELIVERY_MODE = FLAG_DELIVERY_MODE >> 8
HI_PRIORITY = FLAG_PRIORITY >> 8
HI_CORRELATION_ID = FLAG_CORRELATION_ID >> 8
HI_REPLY_TO = FLAG_REPLY_TO >> 8
HI_EXPIRATION = FLAG_EXPIRATION >> 8

EMPTY = b"\x00\x00"  # a property list with no property set

# The largest timestamps the common client decoders turn into a datetime (31 Dec 9999).
MAX_TIMESTAMP_PROPERTY = 253402300799999  # pamqp: milliseconds above 2**32
MAX_TIMESTAMP_FIELD = 253402300799  # pika: seconds
# Field tables nest by recursion in every client decoder; this leaves them ample stack.
MAX_TABLE_DEPTH = 100

_U32 = struct.Struct(">I").unpack_from
_U64 = struct.Struct(">Q").unpack_from
_F64 = struct.Struct(">d").pack

_SHORTSTR, _OCTET, _TABLE, _TIMESTAMP = range(4)
# (flag, kind, name) of the basic class's properties, in wire order.
_LAYOUT = (
    (FLAG_CONTENT_TYPE, _SHORTSTR, "content-type"),
    (FLAG_CONTENT_ENCODING, _SHORTSTR, "content-encoding"),
    (FLAG_HEADERS, _TABLE, "headers"),
    (FLAG_DELIVERY_MODE, _OCTET, "delivery-mode"),
    (FLAG_PRIORITY, _OCTET, "priority"),
    (FLAG_CORRELATION_ID, _SHORTSTR, "correlation-id"),
    (FLAG_REPLY_TO, _SHORTSTR, "reply-to"),
    (FLAG_EXPIRATION, _SHORTSTR, "expiration"),
    (FLAG_MESSAGE_ID, _SHORTSTR, "message-id"),
    (FLAG_TIMESTAMP, _TIMESTAMP, "timestamp"),
    (FLAG_TYPE, _SHORTSTR, "type"),
    (FLAG_USER_ID, _SHORTSTR, "user-id"),
    (FLAG_APP_ID, _SHORTSTR, "app-id"),
    (FLAG_CLUSTER_ID, _SHORTSTR, "cluster-id"),
)
_PRESENT: dict[int, tuple[int, ...]] = {}  # flag word -> codes of the properties present

# Field value types (0-9-1 errata): fixed sizes; S, x, F, A carry a u32 length.
_FIXED = {ord(t): n for t, n in (("t", 1), ("b", 1), ("B", 1), ("s", 2), ("u", 2), ("I", 4), ("i", 4),
                                  ("l", 8), ("L", 8), ("f", 4), ("d", 8), ("D", 5), ("T", 8), ("V", 0))}
_T = ord("T")
_F = ord("F")
_A = ord("A")
_SIZED = frozenset((ord("S"), ord("x"), _F, _A))

_CACHE_MAX = 4096  # remembered valid lists and tables (each a few hundred bytes at most)
_valid_lists: set[bytes] = set()
_valid_tables: set[bytes] = set()
# table length -> (mask of its structural bytes, their value, timestamp value positions)
_layouts: dict[int, tuple[int, int, tuple[int, ...]]] = {}


class _Shape:
    """What a full walk of a valid property list learnt about it, for ``LIST_LAYOUTS``."""

    __slots__ = ("spans", "strs", "stamps", "stamp")

    def __init__(self) -> None:
        self.spans: list[tuple[int, int]] = []  # structural bytes: flags, lengths, names, types
        self.strs: list[tuple[int, int, int]] = []  # short-string values (must be UTF-8)
        self.stamps: list[int] = []  # timestamp fields in the headers
        self.stamp = -1  # the timestamp property


# list length -> (strict mask, strict value, loose mask, loose value, short-string value spans,
# timestamp property position or -1, header timestamp positions), learnt from the last valid
# list of that length. ``valid`` of a list that differs from it only in its values (a new
# message-id, timestamp and task id on every message) is three C-level big-integer operations:
# ``int.from_bytes(props) & mask == value``. The strict mask covers the structural bytes (flags,
# lengths, field names and types: equal), the top bit of every short-string octet (clear: ASCII,
# so UTF-8) and the top bits of every timestamp (clear: certainly within the limits). The loose
# mask covers the structural bytes only; a list that passes it but not the strict one has its
# values checked one by one (``_values_ok``: UTF-8 short strings, exact timestamp limits).
_Layout = tuple[int, int, int, int, tuple[slice, ...], int, tuple[int, ...]]
# Public for a caller that inlines ``valid``'s first check (the publish-run parser): a
# layout's first two items are the strict mask and value (cleared in place, never rebound).
LIST_LAYOUTS: dict[int, _Layout] = {}
# list length -> the layouts that list length had before the current one (a few, the latest
# first). Lists of one length may take turns between structures: header values and a
# message-id whose lengths differ from message to message but add up to the same list length
# (issue 31's generator: one list in five walked in full when only the last layout was kept).
# ``valid`` tries them after ``LIST_LAYOUTS``'s and swaps the one that fits in there, so the
# run parser's inlined check sees the structure of the list in hand.
_EARLIER_LAYOUTS: dict[int, list[_Layout]] = {}
_LAYOUTS_PER_LENGTH = 16  # earlier layouts kept per list length (4: one list in 40 walked)
_EARLIER_LENGTHS = _CACHE_MAX // _LAYOUTS_PER_LENGTH  # list lengths with earlier layouts kept
# The top bits that, clear, put a timestamp safely below its limit (see the masks above).
_STAMP_PROPERTY_SAFE = 0xFFFF80 << 40  # < 2**47 ms (year 6429) < MAX_TIMESTAMP_PROPERTY
_STAMP_FIELD_SAFE = 0xFFFFFFE0 << 32  # < 2**37 s (year 6325) < MAX_TIMESTAMP_FIELD


class _Malformed(Exception):
    pass


def valid(props: bytes) -> bool:
    """Whether a property list is one every client decodes (cheap for lists seen before,
    and for lists with the structure of one seen before: see ``LIST_LAYOUTS``)."""
    n = len(props)
    layout = LIST_LAYOUTS.get(n)
    if layout is not None:
        x = int.from_bytes(props)
        if x & layout[0] == layout[1]:
            return True
    if props in _valid_lists:
        return True
    if layout is not None:
        if _fits_loosely(props, x, layout):
            return True
        earlier = _EARLIER_LAYOUTS.get(n)
        if earlier is not None:
            for i, other in enumerate(earlier):
                if x & other[0] == other[1] or _fits_loosely(props, x, other):
                    earlier[i] = layout
                    LIST_LAYOUTS[n] = other
                    return True
    shape = _Shape()
    try:
        _check_list(props, shape)
    except _Malformed:
        return False
    if len(LIST_LAYOUTS) >= _CACHE_MAX:
        LIST_LAYOUTS.clear()
        _EARLIER_LAYOUTS.clear()
    elif layout is not None:
        if len(_EARLIER_LAYOUTS) >= _EARLIER_LENGTHS and n not in _EARLIER_LAYOUTS:
            _EARLIER_LAYOUTS.clear()  # at most _CACHE_MAX of them, as LIST_LAYOUTS
        earlier = _EARLIER_LAYOUTS.setdefault(n, [])
        earlier.insert(0, layout)
        del earlier[_LAYOUTS_PER_LENGTH:]
    LIST_LAYOUTS[n] = _layout_of(props, shape)
    if len(_valid_lists) >= _CACHE_MAX:
        _valid_lists.clear()
    _valid_lists.add(props)
    return True


def _layout_of(props: bytes, shape: _Shape) -> _Layout:
    """The masks of lists with the structure of ``props`` (see ``LIST_LAYOUTS``)."""
    n = len(props)

    def at(bits: int, start: int, length: int) -> int:  # ``bits`` over bytes start..start+length
        return bits << (8 * (n - start - length))

    loose = 0
    for a, b in shape.spans:
        loose |= at((1 << (8 * (b - a))) - 1, a, b - a)
    strict = loose
    for a, b, _ in shape.strs:
        strict |= at(int.from_bytes(b"\x80" * (b - a)), a, b - a)
    if shape.stamp >= 0:
        strict |= at(_STAMP_PROPERTY_SAFE, shape.stamp, 8)
    for p in shape.stamps:
        strict |= at(_STAMP_FIELD_SAFE, p, 8)
    x = int.from_bytes(props)
    return (strict, x & loose, loose, x & loose, tuple(slice(a, b) for a, b, _ in shape.strs),
            shape.stamp, tuple(shape.stamps))


def _fits_loosely(props: bytes, x: int, layout: _Layout) -> bool:
    """``props`` (``x``: as an integer) has ``layout``'s structure and values that pass
    ``_values_ok`` (the strict mask did not settle it)."""
    _, _, loose, structure, strs, stamp, stamps = layout
    return x & loose == structure and _values_ok(props, strs, stamp, stamps)


def _values_ok(props: bytes, strs: tuple[slice, ...], stamp: int, stamps: tuple[int, ...]) -> bool:
    """The value checks of a list whose structure is that of a valid one: short strings are
    UTF-8, timestamps within the years clients decode."""
    if strs and not props.isascii() and not b"".join(map(props.__getitem__, strs)).isascii():
        try:
            for v in map(props.__getitem__, strs):
                v.decode()
        except UnicodeDecodeError:
            return False
    if stamp >= 0 and _U64(props, stamp)[0] > MAX_TIMESTAMP_PROPERTY:
        return False
    for p in stamps:
        if _U64(props, p)[0] > MAX_TIMESTAMP_FIELD:
            return False
    return True


def problem(props: bytes) -> str | None:
    """What is wrong with a property list, or None when nothing is."""
    try:
        _check_list(props)
    except _Malformed as exc:
        return str(exc)
    return None


def _check_list(props: bytes, shape: _Shape | None = None) -> None:
    """Walk a property list; raise ``_Malformed`` at its first defect. With ``shape``,
    note its structure there (headers are then walked in place, not through the table
    caches)."""
    n = len(props)
    if n < 2:
        raise _Malformed("property flags missing")
    flags = (props[0] << 8) | props[1]
    if flags & FLAG_CONTINUATION:
        raise _Malformed("a second property flag word (class basic has 14 properties)")
    present = _PRESENT.get(flags)
    if present is None:
        present = _PRESENT[flags] = tuple(i << 2 | kind for i, (bit, kind, _) in enumerate(_LAYOUT)
                                          if flags & bit)
    ascii_only = props.isascii()  # then every short string and field name is UTF-8
    # short strings to check for UTF-8 unless ascii_only (all of them for a shape)
    strs: list[tuple[int, int, int]] = [] if shape is None else shape.strs
    spans = None if shape is None else shape.spans
    if spans is not None:
        spans.append((0, 2))
    pos = 2
    for code in present:  # (index in _LAYOUT) << 2 | kind
        kind = code & 3
        if kind == _SHORTSTR:
            if pos >= n:
                raise _Malformed(f"{_name(code)} missing")
            start = pos + 1
            pos = start + props[pos]
            if pos > n:
                raise _Malformed(f"{_name(code)} runs past the end of the properties")
            if spans is not None:
                spans.append((start - 1, start))
                strs.append((start, pos, code))
            elif not ascii_only:
                strs.append((start, pos, code))
        elif kind == _OCTET:
            pos += 1
            if pos > n:
                raise _Malformed(f"{_name(code)} missing")
        elif kind == _TIMESTAMP:
            pos += 8
            if pos > n:
                raise _Malformed("timestamp runs past the end of the properties")
            if _U64(props, pos - 8)[0] > MAX_TIMESTAMP_PROPERTY:
                raise _Malformed("timestamp beyond year 9999")
            if shape is not None:
                shape.stamp = pos - 8
        else:
            if pos + 4 > n:
                raise _Malformed("headers length missing")
            start = pos + 4
            pos = start + _U32(props, pos)[0]
            if pos > n:
                raise _Malformed("headers table length runs past the end of the properties")
            if shape is None:
                _check_headers(props[start:pos])
            else:
                shape.spans.append((start - 4, start))
                _check_fields(props, start, pos, 1, ascii_only, True, shape.spans, shape.stamps)
    if pos != n:
        raise _Malformed(f"{n - pos} bytes after the last property")
    # Usually only a table's length fields make a list non-ASCII: one check of the strings.
    if strs and not b"".join([props[a:b] for a, b, _ in strs]).isascii():
        for a, b, code in strs:
            _utf8(props, a, b, _name(code))


def _name(code: int) -> str:
    return _LAYOUT[code >> 2][2]


def _utf8(b: bytes, start: int, end: int, what: str) -> None:
    try:
        b[start:end].decode()
    except UnicodeDecodeError:
        raise _Malformed(f"{what} is not UTF-8") from None


def _check_headers(table: bytes) -> None:
    """Check a headers table. A table seen valid before is remembered by its bytes; one
    of the same length whose structural bytes (field names, type octets, length fields)
    equal those of the last valid table of that length is valid too, bar its timestamps:
    walking it would take the same path, and only string, number and timestamp values
    differ (a client repeating headers with a new id in them). That comparison is three
    C-level big-integer operations instead of a Python loop over the fields."""
    if table in _valid_tables:
        return
    n = len(table)
    layout = _layouts.get(n)
    if layout is not None:
        mask, structure, stamps = layout
        if int.from_bytes(table) & mask == structure:
            for p in stamps:
                if _U64(table, p)[0] > MAX_TIMESTAMP_FIELD:
                    raise _Malformed("timestamp field beyond year 9999")
            return
    spans: list[tuple[int, int]] = []
    stamps_found: list[int] = []
    _check_fields(table, 0, n, 1, table.isascii(), True, spans, stamps_found)
    mask = 0
    for a, b in spans:
        mask |= ((1 << (8 * (b - a))) - 1) << (8 * (n - b))
    if len(_layouts) >= _CACHE_MAX:
        _layouts.clear()
    _layouts[n] = (mask, int.from_bytes(table) & mask, tuple(stamps_found))
    if len(_valid_tables) >= _CACHE_MAX:
        _valid_tables.clear()
    _valid_tables.add(table)


def _check_fields(b: bytes, pos: int, end: int, depth: int, ascii_only: bool, named: bool,
                  spans: list[tuple[int, int]], stamps: list[int]) -> None:
    """Check the fields of a table (``named``: each value preceded by its name) or of an
    array between ``pos`` and ``end``, values inline; note the structural byte ranges in
    ``spans`` and the positions of timestamp values in ``stamps``."""
    if depth > MAX_TABLE_DEPTH:
        raise _Malformed(f"field tables nested deeper than {MAX_TABLE_DEPTH}")
    fixed = _FIXED.get
    span = spans.append
    while pos < end:
        field = pos
        if named:
            start = pos + 1
            pos = start + b[pos]
            if pos >= end:
                raise _Malformed("field name runs past the end of its table")
            if not ascii_only:
                _utf8(b, start, pos, "field name")
        t = b[pos]
        pos += 1
        span((field, pos))  # name and type octet
        size = fixed(t)
        if size is not None:
            pos += size
            if pos > end:
                raise _Malformed(f"field value of type {chr(t)!r} runs past the end of its table")
            if t == _T:
                if _U64(b, pos - 8)[0] > MAX_TIMESTAMP_FIELD:
                    raise _Malformed("timestamp field beyond year 9999")
                stamps.append(pos - 8)
            continue
        if t not in _SIZED:
            raise _Malformed(f"unknown field type {t:#04x}")
        start = pos + 4
        if start > end:
            raise _Malformed(f"field value of type {chr(t)!r} runs past the end of its table")
        span((start - 4, start))  # the length
        pos = start + _U32(b, start - 4)[0]
        if pos > end:
            raise _Malformed(f"field value of type {chr(t)!r} runs past the end of its table")
        if t == _F:
            _check_fields(b, start, pos, depth + 1, ascii_only, True, spans, stamps)
        elif t == _A:
            _check_fields(b, start, pos, depth + 1, ascii_only, False, spans, stamps)


# ------------------------------------------------------------------------ reads
def _octet_after(props: bytes | memoryview, flags: int) -> int:
    """Position of the octet property that follows content-type, content-encoding and
    headers (delivery-mode), given the flag word; assumes a valid list."""
    pos = 2
    if flags & FLAG_CONTENT_TYPE:
        pos += 1 + props[pos]
    if flags & FLAG_CONTENT_ENCODING:
        pos += 1 + props[pos]
    if flags & FLAG_HEADERS:
        pos += 4 + _U32(props, pos)[0]
    return pos


def delivery_mode(props: bytes | memoryview) -> int:
    """The delivery-mode octet (0 when absent), without decoding anything else."""
    if len(props) < 2 or not props[0] & HI_DELIVERY_MODE:
        return 0
    return int(props[_octet_after(props, (props[0] << 8) | props[1])])


def priority(props: bytes | memoryview) -> int:
    """The priority octet (0 when absent), without decoding anything else."""
    if len(props) < 2 or not props[0] & HI_PRIORITY:
        return 0
    flags = (props[0] << 8) | props[1]
    pos = _octet_after(props, flags)
    return int(props[pos + 1 if flags & FLAG_DELIVERY_MODE else pos])


_FIRST_OCTET = itemgetter(0)
_SECOND_OCTET = itemgetter(1)


def run_flags(props: list[bytes]) -> int:
    """The flag words of a run of (valid) property lists ORed together: which properties any
    of them has. The distinct octets are collected at C speed; a run has only a few."""
    hi = lo = 0
    for v in set(map(_FIRST_OCTET, props)):
        hi |= v
    for v in set(map(_SECOND_OCTET, props)):
        lo |= v
    return hi << 8 | lo


def has_reply_to(props: bytes) -> bool:
    return len(props) >= 2 and bool(props[0] & HI_REPLY_TO)


def decode(props: bytes) -> commands.Basic.Properties:
    """Every property decoded (cold path: headers, expiration, rewrites)."""
    p = commands.Basic.Properties()
    if len(props) >= 2:
        p.unmarshal((props[0] << 8) | props[1], props[2:])
    return p


def _field_encoders() -> tuple[tuple[str, int, Callable[[Any], bytes]], ...]:
    props = commands.Basic.Properties
    return tuple((name, props.flags[name], pamqp_encode.METHODS[getattr(props, "_" + name)])
                 for name in props.__slots__)


def _table_value(value: Any) -> bytes:
    """One field value, typed as ``encode_table`` says (pamqp's encoder for the rest)."""
    if isinstance(value, bytes):
        return b"S" + len(value).to_bytes(4, "big") + value
    if isinstance(value, float):
        return b"d" + _F64(value)
    if isinstance(value, dict):
        return b"F" + encode_table(value)
    if isinstance(value, (list, tuple)):
        items = b"".join(map(_table_value, value))
        return b"A" + len(items).to_bytes(4, "big") + items
    return pamqp_encode.encode_table_value(value)


def encode_table(table: dict[str, Any]) -> bytes:
    """A field table (with its length), keys sorted as pamqp writes them; every value pamqp
    decodes is written back with its value unchanged (module docstring); TypeError for a value
    no field type holds."""
    parts = []
    for key, value in sorted(table.items()):
        if not isinstance(key, str):
            raise TypeError(f"header name {key!r} is not a string")
        name = key.encode()
        if len(name) > 128:  # field names are at most 128 bytes (pamqp cuts them too)
            name = name[:128].decode("utf-8", "ignore").encode()
        try:
            parts.append(b"".join((bytes((len(name),)), name, _table_value(value))))
        except (TypeError, struct.error, OverflowError) as exc:
            raise TypeError(f"header {key!r}: {exc}") from None
    out = b"".join(parts)
    return len(out).to_bytes(4, "big") + out


def _headers_encoder(value: dict[str, Any]) -> bytes:
    return encode_table(value) if value else b"\x00\x00\x00\x00"


_ENCODERS = tuple((name, flag, _headers_encoder if name == "headers" else enc)
                  for name, flag, enc in _field_encoders())
# (attribute, flag bit, encoder of its type), in flag order: pamqp's, but headers by encode_table


def encode(p: commands.Basic.Properties) -> bytes:
    """The bytes pamqp's ``Properties.marshal`` writes (a property that is None or '' is absent),
    with pamqp's own field encoders but without its per-field type lookups: a shovel from a remote
    broker encodes every message it moves here."""
    flags = 0
    parts = [b""]
    for name, flag, enc in _ENCODERS:
        value = getattr(p, name)
        if value is not None and value != "":
            flags |= flag
            parts.append(enc(value))
    parts[0] = flags.to_bytes(2, "big")
    return b"".join(parts)


def _headers_at(props: bytes) -> int:
    """Where the headers table (its u32 length) starts in a valid list that has one."""
    at = 2
    if props[0] & HI_CONTENT_TYPE:
        at += 1 + props[at]
    if props[0] & HI_CONTENT_ENCODING:
        at += 1 + props[at]
    return at


def _top_fields(props: bytes, pos: int, end: int) -> Iterator[tuple[int, int, int]]:
    """(field start, name end, value end) of each top-level field of a valid table's fields
    ``props[pos:end]``: name, type octet (at name end), value; walked as _check_fields does."""
    while pos < end:
        field = pos
        name_end = pos + 1 + props[pos]
        t = props[name_end]
        pos = name_end + 1
        size = _FIXED.get(t)
        pos += size if size is not None else 4 + _U32(props, pos)[0]
        yield field, name_end, pos


def with_header_fields(props: bytes, fields: bytes, names: frozenset[bytes]) -> bytes:
    """A valid property list with the header fields named in ``names`` (raw names) dropped and
    ``fields`` (encoded name-type-value fields) added after the rest; every other byte is kept,
    so every other value keeps its exact type (no decode and re-encode). A list without headers
    gets a table of ``fields`` after its content type and encoding; ``fields`` empty leaves it be."""
    if len(props) < 2:
        props = EMPTY
    at = _headers_at(props)
    if not props[0] & HI_HEADERS:
        if not fields:
            return props
        return b"".join((bytes((props[0] | HI_HEADERS, props[1])), props[2:at],
                         len(fields).to_bytes(4, "big"), fields, props[at:]))
    end = at + 4 + _U32(props, at)[0]
    kept = []
    start = at + 4
    for field, name_end, pos in _top_fields(props, start, end):
        if props[field + 1:name_end] in names:
            kept.append(props[start:field])
            start = pos
    if not kept:  # none of the names present: the table's fields as they are, then ours
        table = props[at + 4:end] + fields
    else:
        kept.append(props[start:end])
        table = b"".join(kept) + fields
    return b"".join((props[:at], len(table).to_bytes(4, "big"), table, props[end:]))


_S = ord("S")
_INTS = {ord(t): struct.Struct(f">{c}").unpack_from  # integer field types as pamqp reads them
         for t, c in (("b", "b"), ("B", "B"), ("s", "h"), ("u", "H"), ("I", "i"), ("i", "I"), ("l", "q"),
                      ("L", "q"))}


def header_values(props: bytes, names: tuple[bytes, ...]) -> list[Any]:
    """The values of the top-level headers ``names`` (raw names) of a valid property list,
    each as ``headers(props).get(name)`` gives it (None when absent), without decoding the
    rest: a long string or an integer is read where it lies; any other type, found,
    falls back to the full decode. What a feature that needs one or two headers per message
    (a deduplicating exchange or queue) reads on its hot path."""
    found: list[Any] = [None] * len(names)
    if len(props) < 2 or not props[0] & HI_HEADERS:
        return found
    at = _headers_at(props)
    for field, name_end, end in _top_fields(props, at + 4, at + 4 + _U32(props, at)[0]):
        name = props[field + 1:name_end]
        if name not in names:
            continue
        t = props[name_end]
        if t == _S:
            raw = props[name_end + 5:end]
            try:
                value: Any = raw.decode()
            except UnicodeDecodeError:
                value = raw  # as pamqp: the bytes of a long string that is not UTF-8
        elif t in _INTS:
            value = _INTS[t](props, name_end + 1)[0]
        else:
            full = headers(props)
            return [full.get(n.decode()) for n in names]
        found[names.index(name)] = value
    return found


def headers(props: bytes) -> dict[str, Any]:
    """The headers table as a dict (empty when there is none)."""
    if len(props) < 2 or not props[0] & HI_HEADERS:
        return {}
    h = decode(props).headers
    return dict(h) if h else {}


def expiration_ms(props: bytes) -> int | None:
    """The per-message TTL (the ``expiration`` property) in ms, or None."""
    if len(props) < 2 or not props[0] & HI_EXPIRATION:
        return None
    exp = decode(props).expiration
    if exp is None:
        return None
    try:
        value = int(exp)
    except ValueError:
        return None
    return value if value >= 0 else None
