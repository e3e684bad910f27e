"""The sink's batch framing of AMQP publishes (``broker/spark/amqp_frames.py``) gives the same
bytes as its row-by-row framing, and declines the rows only the row path frames. No sockets."""

from __future__ import annotations

import pytest

pa = pytest.importorskip("pyarrow")
pytest.importorskip("numpy")

from broker.spark.amqp_frames import RowRefused, frame_batch, frame_row  # noqa: E402

FRAME_MAX = 4096
PROPS = b"\x10\x00\x02"  # delivery mode 2


def _rows(exchange: bytes, mandatory: bool, keys: list[bytes], props: bytes, bodies: list[bytes]) -> bytes:
    out = bytearray()
    for key, body in zip(keys, bodies, strict=True):
        frame_row(out, exchange, mandatory, key, props, body, FRAME_MAX)
    return bytes(out)


@pytest.mark.parametrize(("exchange", "mandatory", "props"),
                         [(b"", True, PROPS), (b"orders", False, PROPS), (b"x", False, b"\x00\x00")])
def test_batch_equals_rows(exchange: bytes, mandatory: bool, props: bytes) -> None:
    bodies = [b"v%d" % i * (1 + i % 7) for i in range(50)] + [b"\x00" * (FRAME_MAX - 8)]
    keys = [b"k%d" % (i % 5) if i % 3 else b"" for i in range(len(bodies))]
    got = frame_batch(exchange, mandatory, pa.array(keys, pa.binary()), props, pa.array(bodies, pa.binary()),
                      FRAME_MAX)
    assert got == _rows(exchange, mandatory, keys, props, bodies)
    # one routing key for all, string values, a null key
    same = frame_batch(exchange, mandatory, b"rk", props, pa.array([b.decode("latin-1") for b in bodies[:9]]),
                       FRAME_MAX)
    assert same == _rows(exchange, mandatory, [b"rk"] * 9, props,
                         [b.decode("latin-1").encode() for b in bodies[:9]])
    nulls = frame_batch(exchange, mandatory, pa.array([None, "a"], pa.string()), props,
                        pa.array([b"1", b"2"]), FRAME_MAX)
    assert nulls == _rows(exchange, mandatory, [b"", b"a"], props, [b"1", b"2"])


def test_rows_only_the_row_path_frames() -> None:
    assert frame_batch(b"", True, b"q", PROPS, pa.array([b"a", b""]), FRAME_MAX) is None  # no body frame
    assert frame_batch(b"", True, b"q", PROPS, pa.array([b"a" * (FRAME_MAX - 7)]), FRAME_MAX) is None
    big = _rows(b"", True, [b"q"], PROPS, [b"a" * (FRAME_MAX * 2)])
    assert big.count(b"\xce") >= 4  # the body in three frames
    with pytest.raises(RowRefused):
        frame_batch(b"", True, pa.array([b"k" * 256]), PROPS, pa.array([b"a"]), FRAME_MAX)
    with pytest.raises(RowRefused):
        _rows(b"", True, [b"k" * 256], PROPS, [b"a"])


@pytest.mark.parametrize("prefix", ["q1.0.0", "ü-query.7.1", "x" * 200])
def test_dedup_props_batch_equals_rows(prefix: str) -> None:
    """Exactly once to a deduplicating exchange: each row's properties (``message_id`` and the
    deduplication header, ``<prefix>.<row>``), built column-wise and framed with the batch, give
    the bytes of ``properties.encode`` and the row path, across id lengths (rows 1..120 and past
    a power of ten)."""
    from pamqp.commands import Basic

    from broker import properties
    from broker.spark.amqp_frames import dedup_props
    from broker.spark.sink import DEDUP_HEADER

    for first, n in ((1, 120), (99_995, 10)):
        ids = [f"{prefix}.{i}" for i in range(first, first + n)]
        want = [properties.encode(Basic.Properties(delivery_mode=2, message_id=i, headers={DEDUP_HEADER: i}))
                for i in ids]
        assert dedup_props(DEDUP_HEADER, prefix, first, n).to_pylist() == want
        bodies = [b"b%d" % i for i in range(n)]
        keys = [b"k%d" % (i % 3) for i in range(n)]
        got = frame_batch(b"dedup.in", False, pa.array(keys), dedup_props(DEDUP_HEADER, prefix, first, n),
                          pa.array(bodies), FRAME_MAX)
        out = bytearray()
        for key, p, body in zip(keys, want, bodies, strict=True):
            frame_row(out, b"dedup.in", False, key, p, body, FRAME_MAX)
        assert got == bytes(out)
    with pytest.raises(RowRefused):
        dedup_props(DEDUP_HEADER, "y" * 250, 1, 100_000)
