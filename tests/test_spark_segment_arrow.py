"""The data-dir read path built column-wise from segment bytes (``broker/spark/segment_arrow.py``)
against the per-row path it replaced (``rows.fill_from_segment`` + ``rows.to_batch``): the same
Arrow table over mixed records (varied properties and headers, empty fields, invalid UTF-8,
alike runs, a torn record, several segments), under offset, timestamp, row and byte bounds.
Deliberately broken variants of the new path must be caught. No sockets, no Spark."""

from __future__ import annotations

import datetime
import mmap
import random
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from pamqp import commands
from pyspark.sql.types import (
    BinaryType,
    IntegerType,
    LongType,
    MapType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)

from broker.spark import segment_arrow
from broker.spark.rows import (
    PROPERTY_FIELDS,
    Columns,
    PropsDecoder,
    arrow_schema,
    fill_from_segment,
    segment_batch,
    to_batch,
)
from broker.store.segment import HEADER, HEADER_SIZE

_TYPES = {"string": StringType(), "int": IntegerType(), "timestamp": TimestampType()}
SCHEMA = StructType([
    StructField("key", StringType()), StructField("value", BinaryType()),
    StructField("topic", StringType()), StructField("partition", IntegerType()),
    StructField("offset", LongType()), StructField("timestamp", TimestampType()),
    StructField("timestampType", IntegerType()), StructField("exchange", StringType()),
    StructField("properties", StructType([StructField(n, _TYPES[t]) for n, t in PROPERTY_FIELDS])),
    StructField("headers", MapType(StringType(), StringType())),
])
PA_SCHEMA = arrow_schema(SCHEMA)
NAMES = SCHEMA.fieldNames()
T0 = 1_764_300_000_000


def _props(rng: random.Random) -> bytes:
    pick = rng.randrange(6)
    if pick == 0:
        return b""
    if pick == 1:
        return commands.Basic.Properties().marshal()
    stamp = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC) + datetime.timedelta(seconds=pick)
    return commands.Basic.Properties(
        content_type="text/plain" if pick % 2 else None, delivery_mode=1 + pick % 2,
        priority=pick, message_id=f"m{rng.randrange(4)}", timestamp=stamp if pick > 3 else None,
        headers={"h": pick, "nested": {"a": [1, "x"]}, "s": "\u00e9"} if pick > 2 else None,
    ).marshal()


def _record(ts: int, ex: bytes, rk: bytes, props: bytes, body: bytes) -> bytes:
    return (struct.pack("<qB", ts, len(ex)) + ex + bytes([len(rk)]) + rk + struct.pack("<I", len(props))
            + props + struct.pack("<Q", len(body)) + body)


def _segment(rng: random.Random, n: int, torn: bool) -> bytes:
    out = [HEADER]
    ts = T0
    while len(out) <= n:
        ts += rng.randrange(3)
        rec = _record(ts, rng.choice([b"", b"amq.direct", b"ex"]),
                      rng.choice([b"", b"k", b"key.\xc3\xa9", b"bad\xff"]), _props(rng),
                      rng.choice([b"", b"x", bytes(rng.randrange(300))]))
        out += [rec] * (1 + rng.randrange(4) * (rng.random() < 0.2))  # alike runs
    if torn:  # lengths written, timestamp not yet: the end, and so is all after it
        out.append(_record(0, b"ex", b"k", b"", b"lost") + _record(ts, b"", b"k", b"", b"after"))
    return b"".join(out) + bytes(4096)  # preallocated zeros


def _old(buf: Any, size: int, start: int, stop: int, ts_lo: int | None, ts_hi: int | None,
         rows: int, max_bytes: int) -> Iterator[Any]:
    pos, offset, done, decoder = HEADER_SIZE, 0, False, PropsDecoder()
    while not done:
        cols = Columns()
        pos, offset, done = fill_from_segment(cols, buf, size, pos, offset, start, stop, ts_lo, ts_hi,
                                              rows, max_bytes)
        if len(cols):
            yield to_batch(cols, PA_SCHEMA, decoder, NAMES, "s", 3)


def _new(buf: Any, size: int, start: int, stop: int, ts_lo: int | None, ts_hi: int | None,
         rows: int, max_bytes: int) -> Iterator[Any]:
    pos, offset, done, decoder = HEADER_SIZE, 0, False, PropsDecoder()
    while not done:
        at, stamps, pos, offset, done = segment_arrow.walk(buf, size, pos, offset, start, stop, rows,
                                                           max_bytes)
        if len(at):
            cols = segment_arrow.columns(buf, at, stamps, offset - len(at), ts_lo, ts_hi)
            if len(cols):
                yield segment_batch(cols, PA_SCHEMA, decoder, NAMES, "s", 3)


Read = Callable[..., Iterator[Any]]
CASES = [  # start, stop, ts_lo, ts_hi, rows per batch, bytes per batch
    (0, 1 << 62, None, None, 65536, 64 << 20),
    (0, 1 << 62, None, None, 7, 64 << 20),
    (0, 1 << 62, None, None, 65536, 900),
    (13, 150, None, None, 10, 64 << 20),
    (0, 1 << 62, T0 + 40, T0 + 120, 16, 64 << 20),
    (500, 1 << 62, None, None, 64, 64 << 20),
]


def _table(read: Read, path: Path, case: tuple[Any, ...]) -> pa.Table:
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        batches = list(read(mm, len(mm), *case))  # closing the map fails if a view outlives it
    return pa.Table.from_batches(batches, schema=PA_SCHEMA)


@pytest.fixture(scope="module")
def segments(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    rng = random.Random(30)
    out = []
    for k, torn in enumerate((False, True, False)):
        path = tmp_path_factory.mktemp("seg") / f"msgs.{k:010d}"
        path.write_bytes(_segment(rng, 260, torn))
        out.append(path)
    return out


def _differs(segments: list[Path]) -> list[str]:
    bad = []
    for path in segments:
        for case in CASES:
            old = _table(_old, path, case)
            try:
                same = _table(_new, path, case).equals(old)
            except Exception as e:  # noqa: BLE001 - a broken variant may fail instead of differ
                same, case = False, (*case, repr(e))
            if not same:
                bad.append(f"{path.name} {case}")
    return bad


def test_new_path_equals_old_path(segments: list[Path]) -> None:
    assert _differs(segments) == []
    whole = _table(_new, segments[1], CASES[0])
    assert whole.num_rows > 200 and b"after" not in whole.column("value").to_pylist()  # torn: the end
    assert whole.column("offset").to_pylist() == list(range(whole.num_rows))


def _short_values(real: Any) -> Any:
    def broken(np: Any, u8: Any, at: Any, lengths: Any) -> Any:
        return real(np, u8, at, np.maximum(lengths - 1, 0))
    return broken


def _keep_zero_stamps(real: Any) -> Any:
    def broken(np: Any, u8: Any, at: Any, width: int, dtype: str) -> Any:
        out = real(np, u8, at, width, dtype)
        return out + (out == 0) if dtype == "<i8" else out  # a torn record looks whole
    return broken


@pytest.mark.parametrize("name,mutant", [("_binary", _short_values), ("_fixed", _keep_zero_stamps)])
def test_broken_variants_are_caught(segments: list[Path], monkeypatch: pytest.MonkeyPatch,
                                    name: str, mutant: Any) -> None:
    monkeypatch.setattr(segment_arrow, name, mutant(getattr(segment_arrow, name)))
    assert _differs(segments)
