"""The Spark source's AMQP mode cuts the broker's ``x-stream-offset`` / ``x-stream-timestamp``
headers out of a delivery's property bytes in place (``broker/spark/amqp.py``
``split_stream_headers``); the result must be what decoding, dropping the two headers and
re-encoding gives (the route it replaced, kept for lists it cannot walk). The deliveries are
made by the broker's own ``with_offset_header``. No sockets."""

from __future__ import annotations

import datetime
import decimal

import pytest
from pamqp import commands

from broker import properties
from broker.model.stream import with_offset_header
from broker.spark.amqp import _find_stream_headers, _split_slow, split_stream_headers

P = commands.Basic.Properties
STAMP = datetime.datetime(2026, 11, 28, 3, 0, 0, tzinfo=datetime.UTC)
CORPUS = [
    P(),
    P(delivery_mode=2),
    P(content_type="text/plain", content_encoding="gzip", delivery_mode=2, priority=3,
      correlation_id="c", reply_to="r", expiration="60000", message_id="m1", timestamp=STAMP,
      message_type="t", user_id="guest", app_id="a"),
    P(content_type="application/json", headers={"a": 1}),
    P(headers={}),  # an empty table: the record's flag goes (as the re-encode route does)
    P(headers={"i": 7, "kind": "even", "neg": -70000, "big": 1 << 40, "f": 1.5, "ok": True,
               "when": STAMP, "dec": decimal.Decimal("1.25"), "none": None,
               "list": [1, "two", {"three": 3}], "nested": {"a": {"b": [True, None]}}}),
    # a value that spells the names must not be taken for them; near-miss keys stay
    P(headers={"note": "x-stream-offset", "x-stream-offsetx": 1, "x-stream": "x-stream-timestamp"}),
    # a publisher's own x-stream-offset is overwritten by the broker's
    P(content_type="text/plain", headers={"x-stream-offset": "mine", "z": "last"}),
]
OFFSETS = [0, 127, 128, 32767, 40000, 65536, 1 << 31, 1 << 40]


@pytest.mark.parametrize("props", CORPUS, ids=range(len(CORPUS)))
@pytest.mark.parametrize("offset", OFFSETS)
def test_cut_equals_reencode(props: commands.Basic.Properties, offset: int) -> None:
    raw = bytes(props.marshal())
    stamp = 1_795_000_000_123 + offset
    delivered = with_offset_header(raw, offset, stamp)
    assert _find_stream_headers(delivered) is not None  # the walk, not the fallback
    got, slow = split_stream_headers(delivered), _split_slow(delivered)
    assert got[:2] == slow[:2]
    assert properties.decode(got[2]) == properties.decode(slow[2])
    if "f" not in (props.headers or {}):  # the route re-encodes a float as a double
        assert got[2] == slow[2]
    assert got[:2] == (offset, stamp)
    headers = dict(props.headers or {})
    headers.pop("x-stream-offset", None)
    assert properties.decode(got[2]).headers == (headers or None)


def _stamped_by_reencode(raw: bytes, offset: int, stamp: int) -> bytes:
    p = properties.decode(raw)
    p.headers = {**(p.headers or {}), "x-stream-offset": offset, "x-stream-timestamp": stamp}
    return bytes(p.marshal())


@pytest.mark.parametrize("props", CORPUS, ids=range(len(CORPUS)))
@pytest.mark.parametrize("offset", OFFSETS)
def test_broker_stamp_equals_reencode(props: commands.Basic.Properties, offset: int) -> None:
    """The broker's in-place stamping decodes as the decode/re-encode route's (byte for byte for
    a record without headers; with headers its two fields follow the record's own, where pamqp
    sorts them in), and cutting the headers out again gives the record's bytes back."""
    raw = bytes(props.marshal())
    stamp = 1_795_000_000_123 + offset
    fast, slow = with_offset_header(raw, offset, stamp), _stamped_by_reencode(raw, offset, stamp)
    assert properties.decode(fast) == properties.decode(slow)
    if props.headers is None:
        assert fast == slow
    if props.headers is None:
        assert split_stream_headers(fast)[2] == raw


def test_unwalkable_takes_the_decode_route() -> None:
    delivered = with_offset_header(bytes(P(headers={"a": 1}).marshal()), 5, 9)
    t_at = 2  # past the flags: the table's length
    assert delivered[t_at + 4 + 2:t_at + 4 + 3] == b"b"  # "\x01a" then the value type
    odd = delivered[:t_at + 6] + b"?" + delivered[t_at + 7:]  # an unknown field type
    assert _find_stream_headers(odd) is None
    with pytest.raises(Exception):  # noqa: B017, PT011 - pamqp refuses it too; the task fails
        split_stream_headers(odd)


def test_no_offset_header_is_refused() -> None:
    with pytest.raises(KeyError):
        split_stream_headers(bytes(P(headers={"a": 1}).marshal()))
