"""A Spark Arrow batch's values as stream-protocol Publish frames, built per batch, not per row.

Theory of operation
-------------------
A Publish frame (version 1) is ``u32 size``, ``u16 key``, ``u16 version``, ``u8 publisher id``,
``i32 count``, then per message ``u64 publishing id``, ``u32 size`` and the bytes. The sink's
exactly-once rows carry consecutive publishing ids (``batch id << 32 | row number``), so a
batch's entries are built column-wise: the 12-byte heads of all rows in one NumPy structured
array (big-endian), joined to the values with Arrow's element-wise binary join, which leaves
every entry back to back in one data buffer with an offsets array beside it. Frames are then
cut from that buffer at entry boundaries (a binary search over the offsets per frame) so none
exceeds ``frame_max``; no Python code runs per row. A null value is sent as an empty body, a
string value as its UTF-8 bytes (the per-row path does the same).
"""

from __future__ import annotations

import struct
from typing import Any, Final

from broker.streamwire import PUBLISH

_HEAD: Final = struct.Struct(">IHHBi")  # size, key, version, publisher id, count
ENTRY_HEAD: Final = 12  # publishing id (u64) and size (u32)


class RowTooLarge(ValueError):
    """One row does not fit in a frame of ``frame_max`` bytes."""


def values_as_binary(values: Any) -> Any:
    """``values`` (an Arrow binary or string array, maybe chunked) as one binary array
    without nulls (a null is an empty body)."""
    import pyarrow as pa  # type: ignore[import-not-found,import-untyped,unused-ignore]

    if isinstance(values, pa.ChunkedArray):
        values = values.combine_chunks()
    if not pa.types.is_binary(values.type):
        values = values.cast(pa.binary())
    if values.null_count:
        values = values.fill_null(b"")
    return values


def publish_frames(publisher_id: int, ids: Any, values: Any, frame_max: int) -> list[bytes]:
    """Publish frames for ``values`` (an Arrow binary or string array), the i-th with publishing
    id ``ids[i]`` (a NumPy array of as many ids), each frame at most ``frame_max`` bytes."""
    import numpy as np  # type: ignore[import-not-found,import-untyped,unused-ignore]
    import pyarrow as pa  # type: ignore[import-not-found,import-untyped,unused-ignore]
    import pyarrow.compute as pc  # type: ignore[import-not-found,import-untyped,unused-ignore]

    values = values_as_binary(values)
    n = len(values)
    if not n:
        return []
    heads = np.empty(n, dtype=[("id", ">u8"), ("size", ">u4")])
    heads["id"] = ids
    heads["size"] = pc.binary_length(values).to_numpy(zero_copy_only=False)
    head_col = pa.FixedSizeBinaryArray.from_buffers(pa.binary(ENTRY_HEAD), n,
                                                    [None, pa.py_buffer(heads.tobytes())])
    entries = pc.binary_join_element_wise(head_col.cast(pa.binary()), values, b"")
    _validity, offsets_buf, data = entries.buffers()
    offsets = np.frombuffer(offsets_buf, dtype=np.int32, count=n + 1, offset=entries.offset * 4)
    room = frame_max - _HEAD.size
    frames: list[bytes] = []
    start = 0
    while start < n:
        # the most entries from ``start`` whose bytes fit in one frame
        end = int(np.searchsorted(offsets, offsets[start] + room, side="right")) - 1
        end = min(end, n)
        if end <= start:
            size = int(offsets[start + 1] - offsets[start]) - ENTRY_HEAD
            raise RowTooLarge(f"skred sink: a row of {size} bytes exceeds the frame size {frame_max}")
        lo, hi = int(offsets[start]), int(offsets[end])
        head = _HEAD.pack(hi - lo + _HEAD.size - 4, PUBLISH, 1, publisher_id, end - start)
        frames.append(b"".join((head, memoryview(data)[lo:hi])))
        start = end
    return frames
