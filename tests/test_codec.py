"""The hand-written hot-path codec (broker/amqp/codec.py) checked against pamqp.

Everything the fast encoders produce is decoded with ``pamqp.frame.unmarshal``
and compared field by field; raw property bytes are built by pamqp and read
back with ``props_mod.delivery_mode`` / ``props_mod.decode``.
"""

from __future__ import annotations

import datetime
import struct
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pamqp import body as pbody
from pamqp import commands
from pamqp import frame as pframe
from pamqp import header as pheader
from pamqp.base import Frame as PFrame

from broker import properties as props_mod
from broker.amqp import codec

FRAME_MAX_MIN = codec.FRAME_MIN_SIZE
HYPO = settings(max_examples=60, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
# pamqp packs delivery tags as signed long-long, so the cross-check stays below 2**63.
TAGS = st.integers(min_value=0, max_value=2**63 - 1)


# ----------------------------------------------------------------- helpers
def split_frames(data: bytes) -> list[tuple[int, int, bytes]]:
    """(type, channel, payload) of every frame, checking size and frame-end."""
    out = []
    pos = 0
    while pos < len(data):
        ftype, ch, size = struct.unpack_from(">BHI", data, pos)
        end = pos + 7 + size
        assert end < len(data), "truncated frame"
        assert data[end] == 0xCE, "missing frame end"
        out.append((ftype, ch, data[pos + 7 : end]))
        pos = end + 1
    return out


def unmarshal_all(data: bytes) -> list[tuple[int, Any]]:
    """(channel, pamqp frame) for every frame in ``data``."""
    out = []
    pos = 0
    while pos < len(data):
        used, ch, fr = pframe.unmarshal(data[pos:])
        assert used > 0
        out.append((ch, fr))
        pos += used
    assert pos == len(data)
    return out


def deliver_prefix(consumer_tag: bytes) -> bytes:
    return codec.METHOD_ID.pack(0x003C003C) + codec.shortstr(consumer_tag)


def check_content(
    data: bytes,
    channel: int,
    method_type: type[PFrame],
    props: bytes,
    body: bytes,
    frame_max: int,
) -> PFrame:
    """Common checks: method, header with props, body frames; returns the method."""
    raw = split_frames(data)
    frames = unmarshal_all(data)
    assert all(ch == channel for ch, _ in frames)
    assert all(ch == channel for _, ch, _ in raw)
    method = frames[0][1]
    assert isinstance(method, method_type)
    hdr = frames[1][1]
    assert isinstance(hdr, pheader.ContentHeader)
    assert hdr.body_size == len(body)
    assert hdr.weight == 0
    assert hdr.class_id == 60
    # The header payload ends with the raw properties, untouched.
    assert raw[1][0] == codec.FRAME_HEADER
    assert raw[1][2][12:] == props
    bodies = frames[2:]
    assert all(isinstance(f, pbody.ContentBody) for _, f in bodies)
    assert b"".join(f.value for _, f in bodies) == body
    max_payload = frame_max - codec.FRAME_OVERHEAD
    expected_frames = -(-len(body) // max_payload)  # ceil; 0 for an empty body
    assert len(bodies) == expected_frames
    for ftype, _, payload in raw[2:]:
        assert ftype == codec.FRAME_BODY
        assert 0 < len(payload) <= max_payload
        assert len(payload) + codec.FRAME_OVERHEAD <= frame_max
    # Every frame but the last is full.
    for _, _, payload in raw[2:-1]:
        assert len(payload) == max_payload
    return method


def props_bytes(**kw: Any) -> bytes:
    return bytes(commands.Basic.Properties(**kw).marshal())


# --------------------------------------------------------- strategies
# pamqp treats an empty short string property as absent, so present ones are non-empty.
shortstr_text = st.text(
    alphabet=st.characters(min_codepoint=32, max_codepoint=0x2FF), min_size=1, max_size=40
)
short_ascii = st.text(alphabet=st.characters(min_codepoint=33, max_codepoint=126), max_size=30)
small_bytes = st.binary(max_size=40)

field_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**63 - 1),
    st.text(max_size=20),
    st.floats(allow_nan=False, allow_infinity=False, width=32),
)
field_values = st.recursive(
    field_scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(short_ascii, inner, max_size=4),
    ),
    max_leaves=12,
)
field_tables = st.dictionaries(short_ascii, field_values, max_size=5)
timestamps = st.integers(min_value=0, max_value=2**32 - 1).map(
    lambda s: datetime.datetime.fromtimestamp(s, tz=datetime.UTC)
)


@st.composite
def properties(draw: st.DrawFn) -> commands.Basic.Properties:
    kw: dict[str, Any] = {}
    for name, strat in (
        ("content_type", shortstr_text),
        ("content_encoding", shortstr_text),
        ("headers", field_tables),
        ("delivery_mode", st.integers(min_value=1, max_value=2)),
        ("priority", st.integers(min_value=0, max_value=9)),
        ("correlation_id", shortstr_text),
        ("reply_to", shortstr_text),
        ("expiration", st.integers(min_value=0, max_value=10**9).map(str)),
        ("message_id", shortstr_text),
        ("timestamp", timestamps),
        ("message_type", shortstr_text),
        ("user_id", shortstr_text),
        ("app_id", shortstr_text),
    ):
        if draw(st.booleans()):
            kw[name] = draw(strat)
    return commands.Basic.Properties(**kw)


# ------------------------------------------------------------ deliver
@pytest.mark.parametrize("frame_max", [FRAME_MAX_MIN, 8192, 131072])
@pytest.mark.parametrize(
    "body_len_of",
    [
        lambda m: 0,
        lambda m: 1,
        lambda m: m - 1,
        lambda m: m,  # exactly one full frame
        lambda m: m + 1,
        lambda m: 2 * m,  # exact multiple: no empty trailing frame
        lambda m: 3 * m - 1,
        lambda m: 3 * m + 7,
    ],
    ids=["empty", "one", "max-1", "max", "max+1", "2max", "3max-1", "3max+7"],
)
def test_encode_delivery_splits_body(frame_max: int, body_len_of: Any) -> None:
    max_payload = frame_max - codec.FRAME_OVERHEAD
    body = bytes(i % 251 for i in range(body_len_of(max_payload)))
    props = props_bytes(content_type="text/plain", delivery_mode=2, headers={"a": 1})
    data = codec.encode_delivery(
        7, deliver_prefix(b"ctag-1"), 42, True, b"amq.topic", b"a.b.c", props, body, frame_max
    )
    method = check_content(data, 7, commands.Basic.Deliver, props, body, frame_max)
    assert isinstance(method, commands.Basic.Deliver)
    assert method.consumer_tag == "ctag-1"
    assert method.delivery_tag == 42
    assert method.redelivered is True
    assert method.exchange == "amq.topic"
    assert method.routing_key == "a.b.c"


@HYPO
@given(
    channel=st.integers(min_value=1, max_value=65535),
    ctag=st.text(max_size=60).filter(lambda s: len(s.encode()) <= 255),
    tag=TAGS,
    redelivered=st.booleans(),
    exchange=st.text(alphabet="abcdefghij.-_", max_size=255),
    routing_key=st.text(max_size=60).filter(lambda s: len(s.encode()) <= 255),
    props=properties(),
    body=st.binary(max_size=3 * FRAME_MAX_MIN),
    frame_max=st.sampled_from([FRAME_MAX_MIN, FRAME_MAX_MIN + 1, 5000, 131072]),
)
def test_encode_delivery_matches_pamqp(
    channel: int,
    ctag: str,
    tag: int,
    redelivered: bool,
    exchange: str,
    routing_key: str,
    props: commands.Basic.Properties,
    body: bytes,
    frame_max: int,
) -> None:
    raw_props = props_mod.encode(props)
    data = codec.encode_delivery(
        channel,
        deliver_prefix(ctag.encode()),
        tag,
        redelivered,
        exchange.encode(),
        routing_key.encode(),
        raw_props,
        body,
        frame_max,
    )
    m = check_content(data, channel, commands.Basic.Deliver, raw_props, body, frame_max)
    assert isinstance(m, commands.Basic.Deliver)
    assert (m.consumer_tag, m.delivery_tag, m.redelivered, m.exchange, m.routing_key) == (
        ctag,
        tag,
        redelivered,
        exchange,
        routing_key,
    )
    # The method frame is byte-identical to pamqp's encoding.
    expected = pframe.marshal(commands.Basic.Deliver(ctag, tag, redelivered, exchange, routing_key), channel)
    assert data[: len(expected)] == expected
    # The properties the client sees are the ones encoded.
    hdr = unmarshal_all(data)[1][1]
    assert props_mod.encode(hdr.properties) == raw_props


# ------------------------------------------------------------- get-ok
@HYPO
@given(
    tag=TAGS,
    redelivered=st.booleans(),
    exchange=st.text(alphabet="xyz.", max_size=50),
    routing_key=st.text(max_size=50).filter(lambda s: len(s.encode()) <= 255),
    count=st.integers(min_value=0, max_value=2**32 - 1),
    props=properties(),
    body=st.binary(max_size=2 * FRAME_MAX_MIN + 10),
    frame_max=st.sampled_from([FRAME_MAX_MIN, 4100, 131072]),
)
def test_encode_get_ok_matches_pamqp(
    tag: int,
    redelivered: bool,
    exchange: str,
    routing_key: str,
    count: int,
    props: commands.Basic.Properties,
    body: bytes,
    frame_max: int,
) -> None:
    raw_props = props_mod.encode(props)
    data = codec.encode_get_ok(
        3, tag, redelivered, exchange.encode(), routing_key.encode(), count, raw_props, body, frame_max
    )
    m = check_content(data, 3, commands.Basic.GetOk, raw_props, body, frame_max)
    assert isinstance(m, commands.Basic.GetOk)
    assert (m.delivery_tag, m.redelivered, m.exchange, m.routing_key, m.message_count) == (
        tag,
        redelivered,
        exchange,
        routing_key,
        count,
    )
    expected = pframe.marshal(commands.Basic.GetOk(tag, redelivered, exchange, routing_key, count), 3)
    assert data[: len(expected)] == expected


@pytest.mark.parametrize("mult", [0, 1, 2, 5])
def test_encode_get_ok_exact_multiples(mult: int) -> None:
    max_payload = FRAME_MAX_MIN - codec.FRAME_OVERHEAD
    body = b"\xab" * (mult * max_payload)
    data = codec.encode_get_ok(1, 9, False, b"", b"q", 0, props_mod.EMPTY, body, FRAME_MAX_MIN)
    check_content(data, 1, commands.Basic.GetOk, props_mod.EMPTY, body, FRAME_MAX_MIN)
    assert len(split_frames(data)) == 2 + mult


# ------------------------------------------------------------- return
@HYPO
@given(
    code=st.sampled_from([312, 313]),
    text=st.text(max_size=40).filter(lambda s: len(s.encode()) <= 255),
    exchange=st.text(alphabet="abc.", max_size=40),
    routing_key=st.text(max_size=40).filter(lambda s: len(s.encode()) <= 255),
    props=properties(),
    body=st.binary(max_size=2 * FRAME_MAX_MIN),
    frame_max=st.sampled_from([FRAME_MAX_MIN, 131072]),
)
def test_encode_return_matches_pamqp(
    code: int,
    text: str,
    exchange: str,
    routing_key: str,
    props: commands.Basic.Properties,
    body: bytes,
    frame_max: int,
) -> None:
    raw_props = props_mod.encode(props)
    data = codec.encode_return(
        11, code, text.encode(), exchange.encode(), routing_key.encode(), raw_props, body, frame_max
    )
    m = check_content(data, 11, commands.Basic.Return, raw_props, body, frame_max)
    assert isinstance(m, commands.Basic.Return)
    assert (m.reply_code, m.reply_text, m.exchange, m.routing_key) == (code, text, exchange, routing_key)


def test_encode_return_empty_body_has_no_body_frames() -> None:
    data = codec.encode_return(1, 312, b"NO_ROUTE", b"ex", b"rk", props_mod.EMPTY, b"", 131072)
    frames = unmarshal_all(data)
    assert len(frames) == 2
    assert frames[1][1].body_size == 0


# ------------------------------------------------------------ confirm
@HYPO
@given(
    channel=st.integers(min_value=0, max_value=65535),
    tag=TAGS,
    multiple=st.booleans(),
)
def test_encode_confirm_matches_pamqp(channel: int, tag: int, multiple: bool) -> None:
    ack = codec.encode_confirm(channel, tag, multiple)
    assert ack == pframe.marshal(commands.Basic.Ack(tag, multiple), channel)
    ((ch, m),) = unmarshal_all(ack)
    assert ch == channel and isinstance(m, commands.Basic.Ack)
    assert (m.delivery_tag, m.multiple) == (tag, multiple)

    nack = codec.encode_confirm(channel, tag, multiple, nack=True)
    ((ch, m),) = unmarshal_all(nack)
    assert ch == channel and isinstance(m, commands.Basic.Nack)
    assert (m.delivery_tag, m.multiple) == (tag, multiple)
    assert m.requeue is False  # a confirm nack carries no requeue request


def test_encode_method_and_decode_method_round_trip() -> None:
    method = commands.Queue.Declare(queue="q1", durable=True, arguments={"x-max-length": 10})
    data = codec.encode_method(5, method)
    ((ftype, ch, payload),) = split_frames(data)
    assert (ftype, ch) == (codec.FRAME_METHOD, 5)
    back = codec.decode_method(payload)
    assert isinstance(back, commands.Queue.Declare)
    assert (back.queue, back.durable, back.arguments) == ("q1", True, {"x-max-length": 10})


def test_decode_method_unknown_and_malformed() -> None:
    with pytest.raises(KeyError):
        codec.decode_method(struct.pack(">HH", 99, 1))
    with pytest.raises(ValueError):
        # queue.declare with a short string that runs past the end
        codec.decode_method(struct.pack(">HHHB", 50, 10, 0, 200) + b"abc")


# ------------------------------------------------------ delivery mode
@pytest.mark.parametrize("dm", [None, 1, 2])
@pytest.mark.parametrize("content_type", [None, "", "application/json", "x" * 255])
@pytest.mark.parametrize("content_encoding", [None, "", "gzip"])
@pytest.mark.parametrize(
    "headers",
    [
        None,
        {},
        {"a": 1},
        {"nested": {"deeper": {"x": [1, "two", {"three": 3.0}]}, "b": True}, "s": "v" * 300},
    ],
    ids=["none", "empty", "flat", "nested"],
)
def test_delivery_mode_combinations(
    dm: int | None, content_type: str | None, content_encoding: str | None, headers: Any
) -> None:
    raw = props_bytes(
        content_type=content_type,
        content_encoding=content_encoding,
        headers=headers,
        delivery_mode=dm,
        priority=5,
        reply_to="r",
        app_id="app",
    )
    expected = props_mod.decode(raw).delivery_mode or 0
    assert expected == (dm or 0)
    assert props_mod.delivery_mode(raw) == expected
    assert props_mod.delivery_mode(memoryview(raw)) == expected


def test_delivery_mode_empty_and_short() -> None:
    assert props_mod.delivery_mode(b"") == 0
    assert props_mod.delivery_mode(props_mod.EMPTY) == 0


@HYPO
@given(props=properties())
def test_delivery_mode_matches_pamqp(props: commands.Basic.Properties) -> None:
    raw = props_mod.encode(props)
    assert props_mod.delivery_mode(raw) == (props_mod.decode(raw).delivery_mode or 0)
    assert props_mod.has_reply_to(raw) == (props.reply_to is not None)


def _holds_float(value: object) -> bool:
    if isinstance(value, float):
        return True
    if isinstance(value, dict):
        return any(map(_holds_float, value.values()))
    if isinstance(value, (list, tuple)):
        return any(map(_holds_float, value))
    return False


@HYPO
@given(props=properties())
def test_properties_round_trip_byte_exact(props: commands.Basic.Properties) -> None:
    """pamqp's bytes, except a float header: pamqp writes it as a 32-bit ``f`` (0.1 would come
    back as 0.10000000149...), ``properties.encode`` as the ``d`` that keeps its value."""
    raw = props_mod.encode(props)
    if not _holds_float(props.headers):
        assert raw == bytes(props.marshal())
    decoded = props_mod.decode(raw)
    assert props_mod.encode(decoded) == raw
    for name in ("content_type", "content_encoding", "delivery_mode", "priority", "reply_to", "app_id"):
        assert getattr(decoded, name) == getattr(props, name)
    assert decoded.headers == props.headers


def test_has_reply_to_flag_bit() -> None:
    assert props_mod.has_reply_to(props_bytes(reply_to="amq.rabbitmq.reply-to"))
    assert not props_mod.has_reply_to(props_bytes(correlation_id="c", expiration="100", delivery_mode=2))
    assert not props_mod.has_reply_to(b"")


def test_heartbeat_frame_matches_pamqp() -> None:
    from pamqp import heartbeat

    assert codec.HEARTBEAT_FRAME == pframe.marshal(heartbeat.Heartbeat(), 0)


@given(
    channel=st.integers(1, 2047),
    tag=st.integers(1, 2**64 - 1),
    redelivered=st.booleans(),
    exchange=st.binary(max_size=20),
    routing_key=st.binary(max_size=40),
    props=properties(),
    body=st.binary(max_size=300),
)
def test_delivery_template_matches_encode_delivery(
    channel: int, tag: int, redelivered: bool, exchange: bytes, routing_key: bytes,
    props: commands.Basic.Properties, body: bytes,
) -> None:
    """The template (and encode_delivery_raw, built on it) gives exactly the bytes of
    encode_delivery, which test_encode_delivery_matches_pamqp checks against pamqp."""
    prefix = codec.METHOD_ID.pack(0x003C003C) + codec.shortstr(b"ctag")
    exrk = codec.shortstr(exchange) + codec.shortstr(routing_key)
    raw_props = props.marshal()
    head, before, after, tail = codec.delivery_template(channel, prefix, redelivered, exrk, len(raw_props),
                                                        len(body))
    want = codec.encode_delivery(channel, prefix, tag, redelivered, exchange, routing_key, raw_props, body,
                                 131072)
    assert head + codec.U64.pack(tag) + before + raw_props + after + body + tail == want
    assert codec.encode_delivery_raw(channel, prefix, tag, redelivered, exrk, raw_props, body, 131072) == want
