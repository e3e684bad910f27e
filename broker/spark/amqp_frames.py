"""Sink rows as AMQP 0-9-1 ``basic.publish`` frames: one row at a time, or a whole Arrow batch.

Theory of operation
-------------------
A publish on channel 1 is three frames, each ``u8 type, u16 channel, u32 size, payload, 0xCE``:
the method (class 60, method 40, ticket 0, exchange, routing key, the mandatory bit), the
content header (class 60, weight 0, ``u64`` body size, the property bytes) and the body, cut
into frames of at most ``frame_max - 8`` bytes (none for an empty body).

``frame_row`` writes one row into a buffer (the general path: any body size, any
properties). ``frame_batch`` builds the same bytes for a batch of rows that share the exchange,
column-wise like ``arrow_frames.py``: everything of a row before its routing key, between the
key and the properties, and between the properties and the body, are fixed-size NumPy
structured records (big-endian) whose few varying fields (frame sizes, key length, body size)
are filled per column; Arrow's element-wise binary join then lays out every row's
``head + key + middle + properties + tail + body + 0xCE`` back to back in one buffer, with no
Python code per row. The properties are one value for the batch, or a column of each row's
(``dedup_props``: exactly once to a deduplicating exchange, each row's id in ``message_id``
and the ``x-deduplication-header`` header, built the same way).
It answers None when a row needs the general path (an empty body, a body of more than one
frame), and the caller frames that batch row by row. ``tests/test_spark_frames.py`` checks
that both give the same bytes, and ``dedup_props`` those of ``properties.encode``.
"""

from __future__ import annotations

from typing import Any, Final

from broker.links.publisher import append_publish
from broker.spark.arrow_frames import values_as_binary

CHANNEL: Final = 1
_END: Final = b"\xce"
# Basic.Properties flag bits (AMQP 0-9-1 content header, class 60)
_HEADERS: Final = 0x2000
_DELIVERY_MODE: Final = 0x1000
_MESSAGE_ID: Final = 0x0080


class RowRefused(ValueError):
    """A row cannot be published as it is (a routing key over 255 bytes)."""


def _short(value: bytes, what: str) -> bytes:
    if len(value) > 255:
        raise RowRefused(f"skred sink: a {what} of {len(value)} bytes (AMQP allows 255)")
    return bytes([len(value)]) + value


def frame_row(out: bytearray, exchange: bytes, mandatory: bool, routing_key: bytes, props: bytes,
              body: bytes, frame_max: int) -> None:
    """Append one publish (method, content header, body frames) to ``out``."""
    args = _short(exchange, "exchange name") + _short(routing_key, "routing key") + \
        (b"\x01" if mandatory else b"\x00")
    append_publish(out, args, props, body, frame_max)


def frame_batch(exchange: bytes, mandatory: bool, keys: Any, props: Any, values: Any,
                frame_max: int) -> bytes | None:
    """The publishes of ``values`` (an Arrow binary or string array) with routing keys ``keys``
    (an Arrow array of as many, or one ``bytes`` for all) to ``exchange``, with properties
    ``props`` (one ``bytes`` for all, or an Arrow binary array of each row's: ``dedup_props``);
    None when a row needs ``frame_row`` (an empty body or one larger than a frame)."""
    import numpy as np  # type: ignore[import-not-found,import-untyped,unused-ignore]
    import pyarrow as pa  # type: ignore[import-not-found,import-untyped,unused-ignore]
    import pyarrow.compute as pc  # type: ignore[import-not-found,import-untyped,unused-ignore]

    values = values_as_binary(values)
    n = len(values)
    if not n:
        return b""
    sizes = pc.binary_length(values).to_numpy(zero_copy_only=False)
    if int(sizes.min()) == 0 or int(sizes.max()) > frame_max - 8:
        return None
    if isinstance(keys, bytes):
        _short(keys, "routing key")
        keys = pa.array([keys], pa.binary()).take(pa.array(np.zeros(n, dtype=np.int32)))
    else:
        keys = values_as_binary(keys)
    key_sizes = pc.binary_length(keys).to_numpy(zero_copy_only=False)
    if n and int(key_sizes.max()) > 255:
        raise RowRefused("skred sink: a routing key of more than 255 bytes (AMQP allows 255)")
    _short(exchange, "exchange name")
    ex = len(exchange)
    head_fields = [("type", "u1"), ("channel", ">u2"), ("size", ">u4"), ("cls", ">u2"), ("method", ">u2"),
                   ("ticket", ">u2"), ("exlen", "u1")]
    if ex:
        head_fields.append(("ex", f"S{ex}"))
    head_fields.append(("rklen", "u1"))
    head = np.zeros(n, dtype=head_fields)
    head["type"], head["channel"], head["cls"], head["method"], head["exlen"] = 1, CHANNEL, 60, 40, ex
    if ex:
        head["ex"] = exchange
    head["size"] = key_sizes + (9 + ex)
    head["rklen"] = key_sizes
    same_props = isinstance(props, bytes)
    mid_fields = [("bits", "u1"), ("end1", "u1"), ("type", "u1"), ("channel", ">u2"), ("size", ">u4"),
                  ("cls", ">u2"), ("weight", ">u2"), ("bodysize", ">u8")]
    if same_props and props:
        mid_fields.append(("props", f"S{len(props)}"))
    mid = np.zeros(n, dtype=mid_fields)
    mid["bits"] = 1 if mandatory else 0
    mid["end1"] = 0xCE
    mid["type"], mid["channel"], mid["cls"] = 2, CHANNEL, 60
    mid["bodysize"] = sizes
    if same_props:
        mid["size"] = 12 + len(props)
        if props:
            mid["props"] = props
    else:
        mid["size"] = pc.binary_length(props).to_numpy(zero_copy_only=False) + 12
    tail = np.zeros(n, dtype=[("end2", "u1"), ("btype", "u1"), ("bchannel", ">u2"), ("bsize", ">u4")])
    tail["end2"], tail["btype"], tail["bchannel"] = 0xCE, 3, CHANNEL
    tail["bsize"] = sizes
    end = pa.FixedSizeBinaryArray.from_buffers(pa.binary(1), n, [None, pa.py_buffer(_END * n)])
    parts = [_fixed(head), keys, _fixed(mid)] + ([] if same_props else [props]) + \
        [_fixed(tail), values, end.cast(pa.binary())]
    rows = pc.binary_join_element_wise(*parts, b"")
    return _data(rows)


def dedup_props(header: str, id_prefix: str, first: int, n: int) -> Any:
    """Each of ``n`` rows' properties for exactly once to a deduplicating exchange, as an Arrow
    binary array: persistent, ``message_id`` and header ``header`` both ``<id_prefix>.<row>``
    for rows ``first..first+n-1``, the bytes ``properties.encode`` gives for
    ``Basic.Properties(delivery_mode=2, message_id=id, headers={header: id})``: flags
    (headers, delivery mode, message id), the table (``header``, long string ``S``, the id),
    the delivery mode and the id as a short string. RowRefused when an id exceeds 255 bytes."""
    import numpy as np  # type: ignore[import-not-found,import-untyped,unused-ignore]
    import pyarrow as pa  # type: ignore[import-not-found,import-untyped,unused-ignore]
    import pyarrow.compute as pc  # type: ignore[import-not-found,import-untyped,unused-ignore]

    key = _short(header.encode(), "header name")
    rows = pa.array(np.arange(first, first + n, dtype=np.int64))
    ids = pc.binary_join_element_wise(pa.scalar(f"{id_prefix}.".encode(), pa.binary()),
                                      pc.cast(pc.cast(rows, pa.string()), pa.binary()), b"")
    id_sizes = pc.binary_length(ids).to_numpy(zero_copy_only=False)
    if n and int(id_sizes.max()) > 255:
        raise RowRefused(f"skred sink: a message id of {int(id_sizes.max())} bytes (AMQP allows 255)")
    table = np.zeros(n, dtype=[("flags", ">u2"), ("tsize", ">u4"), ("key", f"S{len(key)}"), ("kind", "u1"),
                               ("idsize", ">u4")])
    table["flags"] = _HEADERS | _DELIVERY_MODE | _MESSAGE_ID
    table["tsize"] = id_sizes + (len(key) + 5)
    table["key"], table["kind"], table["idsize"] = key, ord("S"), id_sizes
    after = np.zeros(n, dtype=[("mode", "u1"), ("idlen", "u1")])
    after["mode"], after["idlen"] = 2, id_sizes
    return pc.binary_join_element_wise(_fixed(table), ids, _fixed(after), ids, b"")


def _data(rows: Any) -> bytes:
    """The bytes of an Arrow binary array's elements, back to back."""
    import numpy as np  # type: ignore[import-not-found,import-untyped,unused-ignore]

    n = len(rows)
    _validity, offsets_buf, data = rows.buffers()
    offsets = np.frombuffer(offsets_buf, dtype=np.int32, count=n + 1, offset=rows.offset * 4)
    return bytes(memoryview(data)[int(offsets[0]):int(offsets[n])])


def _fixed(records: Any) -> Any:
    """A NumPy structured array as an Arrow binary array, one element per record."""
    import pyarrow as pa  # type: ignore[import-not-found,import-untyped,unused-ignore]

    width = records.dtype.itemsize
    return pa.FixedSizeBinaryArray.from_buffers(pa.binary(width), len(records),
                                                [None, pa.py_buffer(records.tobytes())]).cast(pa.binary())
