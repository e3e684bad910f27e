"""Property-list validation against pamqp: what clients encode is valid, what they cannot decode is not."""

from __future__ import annotations

import datetime
import struct
from decimal import Decimal
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pamqp import commands

from broker import properties

_KEYS = st.text(min_size=0, max_size=8)
_SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**63), 2**63 - 1), st.text(max_size=20),
    st.floats(allow_nan=False, allow_infinity=False, width=32),
    st.decimals(min_value=-(10**6), max_value=10**6, places=2, allow_nan=False, allow_infinity=False),
    st.datetimes(min_value=datetime.datetime(1970, 1, 2), max_value=datetime.datetime(9999, 1, 1),
                 timezones=st.just(datetime.UTC)),
)
_VALUES = st.recursive(_SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                          st.dictionaries(_KEYS, inner, max_size=4)),
                       max_leaves=12)


def _encode(p: commands.Basic.Properties) -> bytes:
    return bytes(p.marshal())


@settings(max_examples=100, deadline=None)
@given(headers=st.dictionaries(_KEYS, _VALUES, max_size=6), message_id=st.none() | st.text(max_size=30),
       ctype=st.none() | st.text(max_size=20), mode=st.none() | st.sampled_from([1, 2]),
       ts=st.none() | st.integers(0, 2**32))
def test_what_pamqp_encodes_is_valid(headers: dict[str, Any], message_id: str | None, ctype: str | None,
                                     mode: int | None, ts: int | None) -> None:
    stamp = None if ts is None else datetime.datetime.fromtimestamp(ts, datetime.UTC)
    raw = _encode(commands.Basic.Properties(headers=headers or None, message_id=message_id,
                                            content_type=ctype, delivery_mode=mode, timestamp=stamp))
    assert properties.problem(raw) is None
    assert properties.valid(raw)


@settings(max_examples=100, deadline=None)
@given(headers=st.dictionaries(_KEYS, _VALUES, min_size=1, max_size=6), cut=st.integers(1, 200))
def test_a_truncated_list_is_refused(headers: dict[str, Any], cut: int) -> None:
    raw = _encode(commands.Basic.Properties(headers=headers, delivery_mode=2))
    short = raw[: max(0, len(raw) - cut)]
    assert not properties.valid(short)
    assert not properties.valid(raw + b"\x00")


def test_refusals_name_the_defect() -> None:
    table = b"\x01aZ"
    props = b"\x20\x00" + struct.pack(">I", len(table)) + table
    assert properties.problem(props) == "unknown field type 0x5a"
    assert properties.problem(b"\x20\x00\x00\x00\x00\x09") == \
        "headers table length runs past the end of the properties"
    assert properties.problem(b"\x00\x01\x00\x00") is not None
    assert properties.problem(b"\x00\x02") is None  # reserved bit: ignored, as RabbitMQ does


def test_cached_verdicts_are_stable() -> None:
    good = _encode(commands.Basic.Properties(headers={"a": Decimal("1.5")}, message_id="m"))
    bad = good[:-1]
    for _ in range(3):
        assert properties.valid(good)
        assert not properties.valid(bad)


def test_flag_bits_match_pamqp() -> None:
    for name, flag in commands.Basic.Properties.flags.items():
        name = "type" if name == "message_type" else name
        assert getattr(properties, "FLAG_" + name.upper()) == flag, name


def _headers_check(table: bytes) -> str | None:
    props = b"\x20\x00" + struct.pack(">I", len(table)) + table
    return properties.problem(props)


def _forget() -> None:
    properties._valid_lists.clear()
    properties._valid_tables.clear()
    properties._layouts.clear()
    properties.LIST_LAYOUTS.clear()
    properties._EARLIER_LAYOUTS.clear()


@settings(max_examples=300, deadline=None)
@given(headers=st.dictionaries(_KEYS, _VALUES, min_size=1, max_size=6),
       flips=st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), min_size=1, max_size=4))
def test_the_same_structure_shortcut_agrees_with_a_full_walk(headers: dict[str, Any],
                                                              flips: list[tuple[int, int]]) -> None:
    """A table checked against the layout of a valid table of the same length gets the verdict
    a full walk gives it, whatever bytes differ (values only, or structure too)."""
    table = _encode(commands.Basic.Properties(headers=headers))[6:]
    other = bytearray(table)
    for at, value in flips:
        other[at % len(other)] = value
    _forget()
    full = _headers_check(bytes(other))
    _forget()
    assert _headers_check(table) is None  # primes the layout of this length
    shortcut = _headers_check(bytes(other))
    _forget()
    assert (shortcut is None) == (full is None), (full, shortcut)


@settings(max_examples=300, deadline=None)
@given(headers=st.dictionaries(_KEYS, _VALUES, max_size=4), message_id=st.none() | st.text(max_size=12),
       ts=st.none() | st.integers(0, 2**32),
       flips=st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), min_size=1, max_size=4))
def test_the_same_list_structure_shortcut_agrees_with_a_full_walk(
        headers: dict[str, Any], message_id: str | None, ts: int | None,
        flips: list[tuple[int, int]]) -> None:
    """``valid`` of a whole property list checked against the layout of a valid list of the
    same length (what a producer sending a new message-id, timestamp and header values per
    message hits) gives the verdict of a full walk, whatever bytes differ."""
    stamp = None if ts is None else datetime.datetime.fromtimestamp(ts, datetime.UTC)
    props = _encode(commands.Basic.Properties(headers=headers or None, message_id=message_id,
                                              content_type="text/plain", timestamp=stamp))
    other = bytearray(props)
    for at, value in flips:
        other[at % len(other)] = value
    _forget()
    full = properties.problem(bytes(other))
    _forget()
    assert properties.valid(props)  # primes the layout of this length
    assert properties.valid(bytes(other)) == (full is None), full
    _forget()


def test_the_list_shortcut_keeps_the_exact_limits() -> None:
    """Lists learnt once and then seen with other values: timestamps at and just beyond the
    limits clients decode, and short strings that are UTF-8 or not, get a full walk's verdict
    (the masked compare only takes values certainly inside the limits)."""
    def props(ts: int, stamp: int, message_id: bytes) -> bytes:
        table = b"\x01tT" + struct.pack(">Q", stamp)
        return (b"\x20\xc0" + struct.pack(">I", len(table)) + table + bytes([len(message_id)]) + message_id
                + struct.pack(">Q", ts))

    _forget()
    assert properties.valid(props(1_700_000_000, 1_700_000_000, b"abcd"))
    top_p, top_f = properties.MAX_TIMESTAMP_PROPERTY, properties.MAX_TIMESTAMP_FIELD
    cases = [(top_p, 1, b"abcd"), (top_p + 1, 1, b"abcd"), (1, top_f, b"abcd"), (1, top_f + 1, b"abcd"),
             (2**63, 1, b"abcd"), (1, 2**63, b"abcd"), (1, 1, "\u00e9\u00e9".encode()),
             (1, 1, b"\xff\xfe\xfd\xfc")]
    for ts, stamp, mid in cases:
        p = props(ts, stamp, mid)
        full = properties.problem(p)
        assert properties.valid(p) == (full is None), (ts, stamp, mid, full)
    assert not properties.valid(props(properties.MAX_TIMESTAMP_PROPERTY + 1, 1, b"abcd"))
    assert properties.valid(props(properties.MAX_TIMESTAMP_PROPERTY, properties.MAX_TIMESTAMP_FIELD, b"abcd"))
    _forget()


def _turns(lengths: tuple[int, int, int], seq: int, message_id: bytes = b"") -> bytes:
    """A list with three string headers of ``lengths`` and a message-id, values from ``seq``."""
    table = b"".join(bytes([1]) + key + b"S" + struct.pack(">I", n) + str(seq % 10**n).zfill(n).encode()
                     for key, n in zip((b"a", b"b", b"c"), lengths, strict=True))
    mid = message_id or b"id-%08d" % seq
    return (b"\x20\xc0" + struct.pack(">I", len(table)) + table + bytes([len(mid)]) + mid
            + struct.pack(">Q", seq))


def test_lists_of_one_length_taking_turns_between_structures_are_walked_once_each(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 31's generator: header values whose lengths vary add up to one list length in
    several ways. Each structure is walked in full once; after that a list with any of them
    takes the masked compare, whichever came last (main kept one layout per length and walked
    every list whose structure was not the last one's)."""
    walks: list[bytes] = []
    real = properties._check_list

    def counted(props: bytes, shape: Any = None) -> None:
        walks.append(props)
        real(props, shape)

    monkeypatch.setattr(properties, "_check_list", counted)
    _forget()
    shapes = ((2, 3, 3), (3, 2, 3), (3, 3, 2))
    lists = [_turns(shape, 1000 * r + k) for r in range(10) for k, shape in enumerate(shapes)]
    assert len({len(p) for p in lists}) == 1 and len(set(lists)) == len(lists)
    assert all(properties.valid(p) for p in lists)
    assert len(walks) == len(shapes), len(walks)  # main: 30
    # a list with an earlier structure and a bad value still gets a full walk's verdict
    bad = _turns(shapes[0], 7, b"\xff\xfe\xfd\xfc\xfb\xfa\xf9\xf8\xf7\xf6\xf5")
    assert len(bad) == len(lists[0]) and properties.problem(bad) is not None
    assert not properties.valid(bad)
    _forget()
