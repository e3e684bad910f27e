"""The sink's Publish frames built per Arrow batch (``broker/spark/arrow_frames.py``), read back
by the server's own codec: every row once, in order, with its publishing id and bytes, and no
frame above ``frame_max``. No sockets, no Spark."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from broker.spark.arrow_frames import RowTooLarge, publish_frames
from broker.streamproto import codec as C


def _read_back(frames: list[bytes], frame_max: int) -> list[tuple[int, bytes]]:
    reader = C.FrameReader(frame_max)
    out: list[tuple[int, bytes]] = []
    for raw in frames:
        assert len(raw) <= frame_max
        (frame,) = reader.feed(raw)  # one whole frame per item
        assert (frame.key, frame.version) == (C.PUBLISH, 1)
        batch = C.decode_publish_batch(frame.payload, 1)
        assert batch.pub_id == 7
        out += zip(batch.ids, batch.datas, strict=True)
    return out


def _ids(first: int, n: int) -> np.ndarray:
    return np.arange(first, first + n, dtype=np.uint64)


def test_rows_of_varied_sizes_and_nulls_round_trip() -> None:
    bodies: list[bytes | None] = [b"a" * (i % 37) for i in range(500)]
    bodies[3] = None  # a null value is an empty body
    first = (5 << 32) | 1  # batch 5, row 1
    frames = publish_frames(7, _ids(first, 500), pa.array(bodies, pa.binary()), 1 << 20)
    assert len(frames) == 1
    assert _read_back(frames, 1 << 20) == [(first + i, b or b"") for i, b in enumerate(bodies)]


def test_string_values_and_a_sliced_chunked_array() -> None:
    values = pa.chunked_array([["x", "héllo"], ["z" * 10]]).slice(1)
    assert _read_back(publish_frames(7, _ids(10, 2), values, 4096), 4096) == \
        [(10, "héllo".encode()), (11, b"z" * 10)]


def test_frames_are_cut_at_entry_boundaries_within_frame_max() -> None:
    bodies = [bytes([i % 256]) * (50 + i) for i in range(300)]
    frame_max = 1000
    frames = publish_frames(7, _ids(0, 300), pa.array(bodies, pa.binary()), frame_max)
    assert len(frames) > 10
    assert _read_back(frames, frame_max) == list(enumerate(bodies))
    # each frame but the last is full: the next entry would not have fitted
    for raw, nxt in zip(frames, frames[1:], strict=False):
        first_next = C.decode_publish_batch(C.FrameReader(0).feed(nxt)[0].payload, 1).datas[0]
        assert len(raw) + 12 + len(first_next) > frame_max


def test_an_empty_batch_is_no_frame_and_a_row_too_large_is_refused() -> None:
    assert publish_frames(7, _ids(0, 0), pa.array([], pa.binary()), 1000) == []
    with pytest.raises(RowTooLarge, match="exceeds the frame size 100"):
        publish_frames(7, _ids(0, 2), pa.array([b"ok", b"x" * 100], pa.binary()), 100)


def test_a_batch_with_a_non_empty_headers_map_is_refused() -> None:
    """The batch path refuses headers (a stream-protocol message has none) but passes empty
    and null maps, also in a slice of a batch."""
    from broker.spark.sink import _no_headers

    headers = pa.array([None, [], [("k", "v")], []], pa.map_(pa.string(), pa.string()))
    batch = pa.record_batch([pa.array([b"a", b"b", b"c", b"d"]), headers], names=["value", "headers"])
    _no_headers(batch.slice(0, 2))
    _no_headers(batch.slice(3, 1))
    _no_headers(pa.record_batch([pa.array([b"a"])], names=["value"]))
    with pytest.raises(ValueError, match="carries no headers"):
        _no_headers(batch)
    with pytest.raises(ValueError, match="carries no headers"):
        _no_headers(batch.slice(2, 1))
