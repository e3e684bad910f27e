"""Bounded fuzz of malformed frames and message properties against a real broker (chaos group).

Theory of operation: every input here is complete and wrong, so each one must get an
answer. Two generators:

- properties: a property list pamqp encoded (random headers, ids, timestamps), then
  mutated inside a correctly framed content header (bits flipped, bytes set, cut,
  inserted, a length overwritten). The oracle is the client libraries: when pamqp or
  pika cannot decode the list, the broker must refuse it (connection.close 502 naming
  basic.publish, or 501 for a header frame too short to hold flags) and confirm
  nothing; when the broker confirms it, both libraries must decode what it delivers,
  byte for byte what was sent. The broker may be stricter than the libraries (bytes
  after the last property), but then it must answer with the same 502.
- frames: a well-formed frame of a known kind broken in one way (frame-end octet, frame
  type, size above frame_max, unknown class/method, garbled arguments that pamqp
  rejects, content frames out of order, a heartbeat off channel 0); each must get
  connection.close or channel.close with one of the codes the spec gives for it.

The broker must stay up, log no traceback, never answer 541, and a pika client must
still publish and consume afterwards. ``SKRED_CHAOS_FUZZ_EXAMPLES`` sets the number of
examples per generator (CI runs the small default).
"""

from __future__ import annotations

import datetime
import os
import struct

import pika.spec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pamqp import commands
from pamqp import frame as pframe

from ._raw import RawConn, frame_bytes, method_bytes
from ._support import Broker, SkredProcess, assert_healthy, connect, is_external, unique

pytestmark = pytest.mark.chaos

EXAMPLES = int(os.environ.get("SKRED_CHAOS_FUZZ_EXAMPLES", "60"))
_SETTINGS = settings(max_examples=EXAMPLES, deadline=None, database=None,
                     suppress_health_check=list(HealthCheck))

_KEYS = st.text(max_size=6)
_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**63 - 1), st.text(max_size=12),
                     st.floats(allow_nan=False, allow_infinity=False, width=32))
_VALUES = st.recursive(_SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                          st.dictionaries(_KEYS, inner, max_size=3)),
                       max_leaves=8)


@st.composite
def _valid_props(draw: st.DrawFn) -> bytes:
    ts = draw(st.none() | st.integers(0, 2**32))
    p = commands.Basic.Properties(
        content_type=draw(st.none() | st.text(max_size=12)),
        headers=draw(st.none() | st.dictionaries(_KEYS, _VALUES, min_size=1, max_size=4)),
        delivery_mode=draw(st.none() | st.sampled_from([1, 2])),
        priority=draw(st.none() | st.integers(0, 9)),
        message_id=draw(st.none() | st.text(max_size=16)),
        timestamp=None if ts is None else datetime.datetime.fromtimestamp(ts, datetime.UTC),
    )
    return bytes(p.marshal())


@st.composite
def _mutated_props(draw: st.DrawFn) -> bytes:
    raw = bytearray(draw(_valid_props()))
    for _ in range(draw(st.integers(1, 3))):
        op = draw(st.sampled_from(["flip", "set", "cut", "insert", "delete", "length"]))
        if not raw:
            break
        i = draw(st.integers(0, len(raw) - 1))
        if op == "flip":
            raw[i] ^= 1 << draw(st.integers(0, 7))
        elif op == "set":
            raw[i] = draw(st.sampled_from([0x00, 0x01, 0x7F, 0x80, 0xFF, ord("Z"), ord("F"), ord("A")]))
        elif op == "cut":
            del raw[i:]
        elif op == "insert":
            raw[i:i] = draw(st.binary(min_size=1, max_size=6))
        elif op == "delete":
            del raw[i : i + draw(st.integers(1, 6))]
        else:
            raw[i : i + 4] = struct.pack(">I", draw(st.sampled_from([0, 1, 5, 2**16, 2**31, 2**32 - 1])))
    return bytes(raw)


def _clients_decode(props: bytes) -> bool:
    """Whether both pamqp (aiormq, aio-pika) and pika decode this property list."""
    try:
        p = commands.Basic.Properties()
        p.unmarshal(struct.unpack_from(">H", props)[0], props[2:])
        pika.spec.BasicProperties().decode(props)
    except Exception:  # noqa: BLE001 - any failure is "a client cannot decode it"
        return False
    return True


def _opened(b: Broker) -> RawConn:
    c = RawConn(b.host, b.port, timeout=5)
    c.handshake()
    c.open_channel(1)
    return c


def _check_broker(b: Broker) -> None:
    if isinstance(b, SkredProcess):
        assert b.alive(), "broker process died:\n" + b.log_tail()
        assert "Traceback" not in b.log_text(), b.log_tail()


@pytest.mark.timeout(240)
def test_fuzz_message_properties(broker: Broker) -> None:
    queue = unique("fuzzprops")
    conn = connect(broker)
    conn.channel().queue_declare(queue)
    seen = {"refused": 0, "confirmed": 0}

    @_SETTINGS
    @given(props=st.one_of(_mutated_props(), _valid_props()))
    def run(props: bytes) -> None:
        decodable = _clients_decode(props)
        with _opened(broker) as c:
            c.send_method(1, commands.Confirm.Select())
            c.expect(commands.Confirm.SelectOk, 1)
            c.send(method_bytes(1, commands.Basic.Publish(exchange="", routing_key=queue))
                   + frame_bytes(2, 1, struct.pack(">HHQ", 60, 0, 4) + props) + frame_bytes(3, 1, b"body"))
            kind, m = c.next_answer()
            if kind == "ack":
                assert decodable, f"confirmed a property list clients cannot decode: {props!r}"
                c.send_method(1, commands.Basic.Get(queue=queue, no_ack=True))
                c.expect(commands.Basic.GetOk, 1)
                hp, body, _ = c.read_content()
                assert (hp[12:], body) == (props, b"body")
                seen["confirmed"] += 1
            elif kind == "channel.close":  # a valid list with a value RabbitMQ refuses (406): an
                # expiration that is no number, a user-id that is not the connection's user
                assert decodable and props[1] & 0x10 | props[0] & 0x01, f"{m!r} for {props!r}"
                assert (m.reply_code, m.class_id, m.method_id) == (406, 60, 40), (m.reply_text, props)
                seen["refused"] += 1
            elif is_external():
                assert kind in ("connection.close", "eof"), (kind, m)
            else:
                assert kind == "connection.close", f"{kind} {m!r} for {props!r}"
                if len(props) < 2:  # the header frame cannot hold the flags: a frame error
                    assert m.reply_code == 501, m
                else:
                    assert (m.reply_code, m.class_id, m.method_id) == (502, 60, 40), (m, props)
                seen["refused"] += 1
        _check_broker(broker)

    try:
        run()
        assert seen["refused"] and seen["confirmed"], seen
        if not is_external():
            n = conn.channel().queue_declare(queue, passive=True).method.message_count
            assert n == 0, f"{n} refused messages were stored"
        conn.channel().queue_delete(queue)
    finally:
        if conn.is_open:
            conn.close()
    _check_broker(broker)
    assert_healthy(broker)


def _garbled_method(draw: st.DrawFn) -> bytes | None:
    """A known method's payload with arguments pamqp rejects, or None if this draw decodes."""
    method = draw(st.sampled_from([
        commands.Queue.Declare(queue="fz", arguments={"x-max-length": 5}),
        commands.Exchange.Declare(exchange="fz", exchange_type="fanout", arguments={"a": [1, "b"]}),
        commands.Queue.Bind(queue="fz", exchange="amq.fanout", arguments={"k": {"n": 1}}),
        commands.Basic.Consume(queue="fz", consumer_tag="t", arguments={"x-priority": 1}),
        commands.Basic.Qos(prefetch_count=3),
        commands.Basic.Reject(delivery_tag=1),
    ]))
    payload = bytearray(method_bytes(1, method)[7:-1])
    i = draw(st.integers(4, max(4, len(payload) - 1)))
    op = draw(st.sampled_from(["cut", "set", "insert"]))
    if op == "cut":
        del payload[i:]
    elif op == "set" and i < len(payload):
        payload[i] = draw(st.sampled_from([0x00, 0x7F, 0xFF, ord("Z")]))
    else:
        payload[i:i] = draw(st.binary(min_size=1, max_size=4))
    try:
        pframe.unmarshal(frame_bytes(1, 1, bytes(payload)))
    except Exception:  # noqa: BLE001 - pamqp rejects it: the broker must too
        return frame_bytes(1, 1, bytes(payload))
    return None


@st.composite
def _bad_frame(draw: st.DrawFn) -> tuple[str, bytes, tuple[int, ...]]:
    kind = draw(st.sampled_from(["frame-end", "frame-type", "oversized", "unknown-method", "garbled",
                                 "body-first", "header-first", "header-class", "heartbeat-channel"]))
    if kind == "frame-end":
        end = draw(st.integers(0, 255).filter(lambda e: e != 0xCE))
        return kind, frame_bytes(1, 1, struct.pack(">HH", 60, 10) + b"\x00" * 7, end=end), (501,)
    if kind == "frame-type":
        ftype = draw(st.sampled_from([0, 4, 5, 6, 7, 9, 0x41, 0xFF]))
        return kind, frame_bytes(ftype, draw(st.integers(0, 2)), draw(st.binary(max_size=16))), (501, 505)
    if kind == "oversized":
        return kind, frame_bytes(3, 1, b"x" * (131072 + draw(st.integers(1, 4096)))), (501,)
    if kind == "unknown-method":
        cls = draw(st.sampled_from([10, 20, 40, 50, 60, 85, 90, 99, 0, 65535]))
        mid = draw(st.integers(0, 65535))
        if (cls << 16 | mid) in commands.INDEX_MAPPING:
            mid = 65535
        return kind, frame_bytes(1, 1, struct.pack(">HH", cls, mid) + draw(st.binary(max_size=8))), (540, 503)
    if kind == "garbled":
        data = _garbled_method(draw)
        if data is not None:
            return kind, data, (502, 501)
        return "unknown-method", frame_bytes(1, 1, struct.pack(">HH", 99, 1)), (540, 503)
    if kind == "body-first":
        return kind, frame_bytes(3, 1, draw(st.binary(min_size=1, max_size=32))), (505,)
    if kind == "header-first":
        return kind, frame_bytes(2, 1, struct.pack(">HHQ", 60, 0, 1) + b"\x00\x00"), (505,)
    if kind == "header-class":
        publish = method_bytes(1, commands.Basic.Publish(exchange="", routing_key="nowhere"))
        cls = draw(st.sampled_from([0, 10, 50, 61, 65535]))
        return kind, publish + frame_bytes(2, 1, struct.pack(">HHQ", cls, 0, 1) + b"\x00\x00"), (501, 505)
    return kind, frame_bytes(8, draw(st.integers(1, 3)), b""), (501, 503, 505)


@pytest.mark.timeout(240)
def test_fuzz_malformed_frames(broker: Broker) -> None:
    counts: dict[str, int] = {}

    @_SETTINGS
    @given(case=_bad_frame())
    def run(case: tuple[str, bytes, tuple[int, ...]]) -> None:
        kind, data, codes = case
        with _opened(broker) as c:
            c.send(data)
            got, m = c.next_answer()
            if is_external():
                assert got != "ack", (kind, m)
            else:
                assert got in ("connection.close", "channel.close"), f"{kind}: {got} for {data!r}"
                assert m.reply_code in codes, f"{kind}: {m.reply_code} {m.reply_text} (expected {codes})"
        counts[kind] = counts.get(kind, 0) + 1
        _check_broker(broker)

    run()
    assert len(counts) >= min(5, EXAMPLES // 10), counts
    _check_broker(broker)
    assert_healthy(broker)

