"""The sans-IO server connection (broker/amqp/connection.py), driven by pamqp bytes.

A small subclass records every hook call; client frames are produced with
``pamqp.frame.marshal`` and everything the server writes to ``out`` is decoded
back with ``pamqp.frame.unmarshal``. No sockets, no event loop.
"""

from __future__ import annotations

import struct
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pamqp import body as pbody
from pamqp import commands
from pamqp import frame as pframe
from pamqp import header as pheader
from pamqp import heartbeat as pheartbeat
from pamqp.base import Frame as PFrame

from broker import errors, properties
from broker.amqp import codec
from broker.amqp.connection import _PUBLISH_ARGS_CACHE, AMQPConnection, PublishArgs, State

HYPO = settings(max_examples=40, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
HARD_CODES = {320, 402, 403, 501, 502, 503, 504, 505, 506, 530, 540, 541}


class Recorder(AMQPConnection):
    """Records hook calls; ``fail`` maps a queue name to the error Queue.Declare raises."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.calls: list[tuple[Any, ...]] = []
        self.fail: dict[str, errors.AMQPError] = {}

    def authenticate(self, mechanism: str, response: bytes) -> str:
        self.calls.append(("authenticate", mechanism, response))
        if response != b"\x00guest\x00guest":
            raise errors.ConnectionAccessRefused("bad credentials")
        return "guest"

    def open_vhost(self, vhost: str) -> None:
        self.calls.append(("open_vhost", vhost))
        if vhost != "/":
            raise errors.NotAllowed(f"no vhost {vhost}")

    def channel_opened(self, channel: int) -> None:
        self.calls.append(("channel_opened", channel))

    def channel_closed(self, channel: int) -> None:
        self.calls.append(("channel_closed", channel))

    def handle_method(self, channel: int, method: PFrame) -> None:
        self.calls.append(("method", channel, method.name))
        if isinstance(method, commands.Queue.Declare) and method.queue in self.fail:
            raise self.fail[method.queue]

    def handle_publish(self, channel: int, args: PublishArgs, props: bytes, body: bytes | memoryview) -> None:
        self.calls.append(("publish", channel, args.exchange, args.routing_key, args.mandatory, bytes(props),
                           bytes(body)))

    def handle_ack(self, channel: int, delivery_tag: int, multiple: bool) -> None:
        self.calls.append(("ack", channel, delivery_tag, multiple))

    def connection_closing(self) -> None:
        self.calls.append(("connection_closing",))


# ----------------------------------------------------------------- helpers
def m(method: PFrame, channel: int = 0) -> bytes:
    return pframe.marshal(method, channel)


def content(channel: int, props: commands.Basic.Properties, body: bytes, chunk: int) -> bytes:
    """A content header and the body split into frames of at most ``chunk`` bytes."""
    out = m(pheader.ContentHeader(0, len(body), props), channel)
    for i in range(0, len(body), chunk):
        out += m(pbody.ContentBody(body[i : i + chunk]), channel)
    return out


def publish(
    channel: int,
    body: bytes,
    *,
    exchange: str = "ex",
    routing_key: str = "rk",
    mandatory: bool = False,
    props: commands.Basic.Properties | None = None,
    chunk: int = 131072 - 8,
) -> bytes:
    props = props or commands.Basic.Properties(content_type="text/plain", delivery_mode=2)
    method = commands.Basic.Publish(exchange=exchange, routing_key=routing_key, mandatory=mandatory)
    return m(method, channel) + content(channel, props, body, chunk)


HEADER = pheader.ProtocolHeader().marshal()
START_OK = m(
    commands.Connection.StartOk(
        client_properties={"product": "test", "capabilities": {"publisher_confirms": True}},
        mechanism="PLAIN",
        response="\x00guest\x00guest",
    )
)


def tune_ok(frame_max: int = 131072, channel_max: int = 2047, heartbeat: int = 30) -> bytes:
    return m(commands.Connection.TuneOk(channel_max=channel_max, frame_max=frame_max, heartbeat=heartbeat))


OPEN = m(commands.Connection.Open(virtual_host="/"))


def handshake(frame_max: int = 131072) -> bytes:
    return HEADER + START_OK + tune_ok(frame_max) + OPEN


def decode_out(out: bytes | bytearray) -> list[tuple[int, Any]]:
    """Every frame the server wrote, as (channel, pamqp frame)."""
    data = bytes(out)
    frames = []
    pos = 0
    while pos < len(data):
        used, ch, fr = pframe.unmarshal(data[pos:])
        assert used > 0
        frames.append((ch, fr))
        pos += used
    return frames


def opened(*channels: int, frame_max: int = 131072, **kw: Any) -> Recorder:
    """A connection past the handshake with ``channels`` open and ``out``/``calls`` cleared."""
    c = Recorder(**kw)
    c.receive_data(handshake(frame_max))
    for ch in channels:
        c.receive_data(m(commands.Channel.Open(), ch))
    assert c.state == State.OPEN
    c.out.clear()
    c.calls.clear()
    return c


def connection_close_code(c: AMQPConnection) -> int:
    closes = [fr for ch, fr in decode_out(c.out) if ch == 0 and isinstance(fr, commands.Connection.Close)]
    assert len(closes) == 1, decode_out(c.out)
    return int(closes[0].reply_code)


# --------------------------------------------------------------- handshake
def test_full_handshake() -> None:
    c = Recorder(frame_max=131072, channel_max=2047, heartbeat=60)
    c.receive_data(HEADER)
    ((ch, start),) = decode_out(c.out)
    assert ch == 0 and isinstance(start, commands.Connection.Start)
    assert (start.version_major, start.version_minor) == (0, 9)
    assert "PLAIN" in start.mechanisms.split()
    assert c.state == State.START_OK
    c.out.clear()

    c.receive_data(START_OK)
    assert c.calls == [("authenticate", "PLAIN", b"\x00guest\x00guest")]
    ((ch, tune),) = decode_out(c.out)
    assert isinstance(tune, commands.Connection.Tune)
    assert (tune.frame_max, tune.channel_max, tune.heartbeat) == (131072, 2047, 60)
    assert c.username == "guest"
    assert c.capabilities == {"publisher_confirms": True}
    c.out.clear()

    c.receive_data(tune_ok(frame_max=65536, channel_max=100, heartbeat=15))
    assert c.out == b""
    assert (c.frame_max, c.channel_max, c.heartbeat) == (65536, 100, 15)
    assert c.state == State.OPEN_WAIT

    c.receive_data(OPEN)
    ((ch, open_ok),) = decode_out(c.out)
    assert isinstance(open_ok, commands.Connection.OpenOk)
    assert c.state == State.OPEN and c.vhost == "/"
    assert c.calls[-1] == ("open_vhost", "/")
    assert not c.want_close


def test_handshake_in_one_read() -> None:
    c = Recorder()
    c.receive_data(handshake())
    kinds = [type(fr) for _, fr in decode_out(c.out)]
    assert kinds == [commands.Connection.Start, commands.Connection.Tune, commands.Connection.OpenOk]
    assert c.state == State.OPEN


def test_bad_credentials_close_403() -> None:
    c = Recorder()
    c.receive_data(HEADER + m(commands.Connection.StartOk(mechanism="PLAIN", response="\x00guest\x00nope")))
    assert connection_close_code(c) == 403
    assert c.state == State.CLOSING


def test_unknown_vhost_close_530() -> None:
    c = Recorder()
    c.receive_data(HEADER + START_OK + tune_ok() + m(commands.Connection.Open(virtual_host="nope")))
    assert connection_close_code(c) == 530


@pytest.mark.parametrize("frame_max", [1024, 1 << 20])
def test_tune_ok_frame_max_out_of_range_closes_without_a_word(frame_max: int) -> None:
    """The spec (above the server's: no negotiated close) and RabbitMQ (both): the socket closes."""
    c = Recorder()
    c.receive_data(HEADER + START_OK)
    c.out.clear()
    c.receive_data(tune_ok(frame_max=frame_max))
    assert decode_out(c.out) == [] and c.want_close and c.state == State.CLOSED


def test_method_before_open_is_505() -> None:
    c = Recorder()
    c.receive_data(HEADER + START_OK + m(commands.Channel.Open(), 1))
    assert connection_close_code(c) == 505


@pytest.mark.parametrize(
    "header",
    [
        b"AMQP\x01\x01\x00\x09",
        b"AMQP\x00\x00\x08\x00",
        b"GET / HTTP/1.1\r\n\r\n",
        b"XYZ",
        b"AMQP\x00\x00\x09\x02",
    ],
)
def test_wrong_protocol_header(header: bytes) -> None:
    c = Recorder()
    c.receive_data(header)
    assert c.out == b"AMQP\x00\x00\x09\x01"
    assert c.want_close
    assert c.state == State.CLOSED
    c.receive_data(START_OK)  # anything after is ignored
    assert c.out == b"AMQP\x00\x00\x09\x01"


def test_protocol_header_prefix_waits() -> None:
    c = Recorder()
    c.receive_data(b"AMQ")
    assert c.out == b"" and not c.want_close
    c.receive_data(b"P\x00\x00\x09\x01")
    assert isinstance(decode_out(c.out)[0][1], commands.Connection.Start)


# ----------------------------------------------------------------- channels
def test_channel_open() -> None:
    c = opened()
    c.receive_data(m(commands.Channel.Open(), 1))
    ((ch, ok),) = decode_out(c.out)
    assert ch == 1 and isinstance(ok, commands.Channel.OpenOk)
    assert c.calls == [("channel_opened", 1)]


def test_second_channel_open_is_504() -> None:
    c = opened(1)
    c.receive_data(m(commands.Channel.Open(), 1))
    assert connection_close_code(c) == 504


def test_channel_max_bounds_open_channels_not_numbers() -> None:
    """As RabbitMQ: channel-max counts open channels (530 past it); any number is fine."""
    c = Recorder()
    c.receive_data(HEADER + START_OK + m(commands.Connection.TuneOk(2, 131072, 0)) + OPEN)
    c.receive_data(m(commands.Channel.Open(), 11) + m(commands.Channel.Open(), 300))
    assert sorted(c.channels) == [11, 300]
    c.receive_data(m(commands.Channel.Close(200, "bye", 0, 0), 11) + m(commands.Channel.Open(), 5))
    assert sorted(c.channels) == [5, 300]
    c.out.clear()
    c.receive_data(m(commands.Channel.Open(), 6))
    assert connection_close_code(c) == 530
    assert 6 not in c.channels


def test_connection_method_on_a_channel_is_503() -> None:
    c = opened(1)
    c.receive_data(m(commands.Connection.UpdateSecret(new_secret="x", reason="r"), 1))
    assert connection_close_code(c) == 503
    assert not any(call[0] == "method" for call in c.calls)


def test_client_channel_close() -> None:
    c = opened(1)
    c.receive_data(m(commands.Channel.Close(200, "bye", 0, 0), 1))
    ((ch, ok),) = decode_out(c.out)
    assert ch == 1 and isinstance(ok, commands.Channel.CloseOk)
    assert c.calls == [("channel_closed", 1)]
    assert 1 not in c.channels


def test_methods_reach_handle_method() -> None:
    c = opened(1)
    c.receive_data(m(commands.Basic.Qos(prefetch_count=10), 1) + m(commands.Queue.Declare(queue="q"), 1))
    assert c.calls == [("method", 1, "Basic.Qos"), ("method", 1, "Queue.Declare")]


def test_client_connection_close() -> None:
    c = opened(1, 2)
    c.receive_data(m(commands.Connection.Close(200, "bye", 0, 0)))
    ((ch, ok),) = decode_out(c.out)
    assert ch == 0 and isinstance(ok, commands.Connection.CloseOk)
    assert sorted(c.calls) == [("channel_closed", 1), ("channel_closed", 2), ("connection_closing",)]
    assert c.want_close and c.state == State.CLOSED


# ------------------------------------------------------------------ content
def test_publish_body_split_across_many_frames() -> None:
    c = opened(1)
    body = bytes(range(256)) * 40  # 10240 bytes
    props = commands.Basic.Properties(content_type="application/octet-stream", headers={"k": "v"})
    c.receive_data(
        publish(1, body, exchange="amq.direct", routing_key="key", mandatory=True, props=props, chunk=100)
    )
    assert c.calls == [("publish", 1, "amq.direct", "key", True, bytes(props.marshal()), body)]
    assert c.out == b""


def test_publish_body_in_one_frame() -> None:
    c = opened(1)
    c.receive_data(publish(1, b"hello"))
    ((name, ch, ex, rk, mandatory, props, body),) = c.calls
    assert (name, ch, ex, rk, mandatory, body) == ("publish", 1, "ex", "rk", False, b"hello")
    assert properties.delivery_mode(props) == 2


def test_publish_args_decoded_once_and_cache_stays_bounded() -> None:
    """Repeated publishes reuse one decoded PublishArgs; many distinct keys stay correct."""
    seen: list[PublishArgs] = []

    class Keep(Recorder):
        def handle_publish(self, channel: int, args: PublishArgs, props: bytes,
                           body: bytes | memoryview) -> None:
            seen.append(args)
            super().handle_publish(channel, args, props, body)

    c = opened(1)
    c.__class__ = Keep
    c.receive_data(publish(1, b"a") + publish(1, b"b") + publish(1, b"c", mandatory=True))
    assert seen[0] is seen[1] and seen[2] is not seen[0]
    assert (seen[2].exchange, seen[2].routing_key, seen[2].mandatory) == ("ex", "rk", True)
    assert seen[0].exrk == b"\x02ex\x02rk" and seen[0].routing_key_b == b"rk"
    # more distinct routing keys than the cache holds: every publish still decoded right
    c.calls.clear()
    n = _PUBLISH_ARGS_CACHE + 300
    c.receive_data(b"".join(publish(1, b"x", routing_key=f"k{i}") for i in range(n)))
    assert [call[3] for call in c.calls] == [f"k{i}" for i in range(n)]
    assert len(c._pub_args) <= _PUBLISH_ARGS_CACHE


def test_repeated_publishes_take_the_prefix_path_and_stay_exact() -> None:
    """Publishes that repeat the previous one byte for byte but for the body: every body
    arrives, in order, across read splits, prop changes and a refused publish that
    closes the channel (later repeats on it are dropped, other channels go on)."""
    class Refuse(Recorder):
        def handle_publish(self, channel: int, args: PublishArgs, props: bytes,
                           body: bytes | memoryview) -> None:
            if bytes(body) == b"bad!":
                raise errors.PreconditionFailed("refused", 60, 40)
            super().handle_publish(channel, args, props, body)

    c = opened(1, 2)
    c.__class__ = Refuse
    other = commands.Basic.Properties(message_id="x")
    stream = b"".join(publish(1, b"%04d" % i) for i in range(50))
    stream += publish(1, b"p-01", props=other) + publish(1, b"p-02", props=other)
    stream += publish(2, b"c2-1") + publish(1, b"0050")
    stream += publish(1, b"bad!") + publish(1, b"lost") + publish(2, b"c2-2")
    for cut in (len(stream) // 3, len(stream) // 3 + 5):  # split inside a body and a prefix
        c.receive_data(stream[:cut])
        c.receive_data(stream[cut:])
        got = [(call[1], call[6]) for call in c.calls if call[0] == "publish"]
        assert got == ([(1, b"%04d" % i) for i in range(50)] + [(1, b"p-01"), (1, b"p-02"), (2, b"c2-1"),
                                                               (1, b"0050"), (2, b"c2-2")])
        closes = [fr for ch, fr in decode_out(c.out) if isinstance(fr, commands.Channel.Close)]
        assert [int(fr.reply_code) for fr in closes] == [406]
        c.receive_data(m(commands.Channel.CloseOk(), 1) + m(commands.Channel.Open(), 1))
        c.calls.clear()
        c.out.clear()


def test_publish_empty_body_needs_no_body_frame() -> None:
    c = opened(1)
    c.receive_data(publish(1, b""))
    assert [x[0] for x in c.calls] == ["publish"]
    assert c.calls[0][-1] == b""


def test_publish_body_at_frame_max() -> None:
    c = opened(1, frame_max=4096)
    body = b"x" * (3 * (4096 - 8))
    c.receive_data(publish(1, body, chunk=4096 - 8))
    assert c.calls[-1][-1] == body
    assert c.out == b""


def test_two_channels_interleave_content() -> None:
    c = opened(1, 2)
    p = commands.Basic.Properties()
    b1, b2 = b"a" * 25, b"b" * 17
    data = (
        m(commands.Basic.Publish(exchange="e1", routing_key="r1"), 1)
        + m(commands.Basic.Publish(exchange="e2", routing_key="r2"), 2)
        + m(pheader.ContentHeader(0, len(b2), p), 2)
        + m(pheader.ContentHeader(0, len(b1), p), 1)
        + m(pbody.ContentBody(b1[:10]), 1)
        + m(pbody.ContentBody(b2[:5]), 2)
        + m(pbody.ContentBody(b1[10:]), 1)
        + m(pbody.ContentBody(b2[5:]), 2)
    )
    c.receive_data(data)
    assert c.calls == [
        ("publish", 1, "e1", "r1", False, bytes(p.marshal()), b1),
        ("publish", 2, "e2", "r2", False, bytes(p.marshal()), b2),
    ]


def test_fast_path_ack() -> None:
    c = opened(1)
    c.receive_data(m(commands.Basic.Ack(delivery_tag=7, multiple=True), 1) + m(commands.Basic.Ack(8), 1))
    assert c.calls == [("ack", 1, 7, True), ("ack", 1, 8, False)]


def test_message_larger_than_max_message_size_closes_channel_406() -> None:
    c = opened(1, max_message_size=100)
    c.receive_data(publish(1, b"x" * 101, chunk=50))
    frames = decode_out(c.out)
    assert [(ch, type(fr)) for ch, fr in frames] == [(1, commands.Channel.Close)]
    assert frames[0][1].reply_code == 406
    assert ("publish", 1) not in [x[:2] for x in c.calls]
    assert c.state == State.OPEN


def test_heartbeats_are_ignored() -> None:
    c = opened(1)
    hb = m(pheartbeat.Heartbeat(), 0)
    c.receive_data(hb + publish(1, b"abc")[:20])
    c.receive_data(publish(1, b"abc")[20:] + hb + hb)
    assert [x[0] for x in c.calls] == ["publish"]
    assert c.out == b"" and c.state == State.OPEN


def test_heartbeat_on_channel_is_501() -> None:
    c = opened(1)
    c.receive_data(b"\x08\x00\x01\x00\x00\x00\x00\xce")
    assert connection_close_code(c) == 501


# ------------------------------------------------------------ hard errors
def test_frame_larger_than_frame_max_is_501() -> None:
    # RabbitMQ's tolerance: a payload of frame_max (a frame 8 bytes over) passes, one more does not
    c = opened(1, frame_max=4096)
    c.receive_data(m(pbody.ContentBody(b"x" * (4096 + 1)), 1))
    assert connection_close_code(c) == 501
    assert c.state == State.CLOSING


def test_frame_larger_than_minimum_before_tune_is_501() -> None:
    c = Recorder()
    big = m(commands.Connection.StartOk(client_properties={"pad": "x" * 5000}, response="\x00guest\x00guest"))
    c.receive_data(HEADER + big)
    assert connection_close_code(c) == 501


def test_frame_at_frame_max_is_accepted() -> None:
    c = opened(1, frame_max=4096)
    body = b"y" * (4096 - 8)
    c.receive_data(publish(1, body, chunk=len(body)))
    assert c.calls[-1][-1] == body


def test_bad_frame_end_is_501() -> None:
    c = opened(1)
    frame = bytearray(m(commands.Basic.Qos(), 1))
    frame[-1] = 0x00
    c.receive_data(bytes(frame))
    assert connection_close_code(c) == 501
    assert c.calls == [("channel_closed", 1), ("connection_closing",)]


def test_unknown_frame_type_is_501() -> None:
    c = opened(1)
    c.receive_data(b"\x05\x00\x01\x00\x00\x00\x00\xce")
    assert connection_close_code(c) == 501


@pytest.mark.parametrize("class_id,method_id", [(99, 1), (60, 999), (10, 12)])
def test_unknown_class_or_method_is_540(class_id: int, method_id: int) -> None:
    c = opened(1)
    payload = struct.pack(">HH", class_id, method_id)
    c.receive_data(struct.pack(">BHI", 1, 1, len(payload)) + payload + b"\xce")
    assert connection_close_code(c) == 540
    close = decode_out(c.out)[0][1]
    assert (close.class_id, close.method_id) == (class_id, method_id)


def test_truncated_method_arguments_are_501() -> None:
    """As RabbitMQ: method arguments cut short are a frame error (illegal values stay 502)."""
    c = opened(1)
    payload = struct.pack(">HHHB", 50, 10, 0, 200) + b"abc"  # queue name runs off the end
    c.receive_data(struct.pack(">BHI", 1, 1, len(payload)) + payload + b"\xce")
    assert connection_close_code(c) == 501


def test_truncated_fast_path_publish_is_501() -> None:
    c = opened(1)
    payload = struct.pack(">IHB", codec.PUBLISH, 0, 50) + b"ex"
    c.receive_data(struct.pack(">BHI", 1, 1, len(payload)) + payload + b"\xce")
    assert connection_close_code(c) == 501


def test_body_frame_without_publish_is_505() -> None:
    c = opened(1)
    c.receive_data(m(pbody.ContentBody(b"stray"), 1))
    assert connection_close_code(c) == 505


def test_header_frame_without_publish_is_505() -> None:
    c = opened(1)
    c.receive_data(m(pheader.ContentHeader(0, 3, commands.Basic.Properties()), 1))
    assert connection_close_code(c) == 505


def test_method_while_expecting_content_header_is_505() -> None:
    c = opened(1)
    c.receive_data(m(commands.Basic.Publish(exchange="", routing_key="q"), 1) + m(commands.Basic.Qos(), 1))
    assert connection_close_code(c) == 505


def test_publish_while_expecting_content_header_is_505() -> None:
    c = opened(1)
    pub = m(commands.Basic.Publish(exchange="", routing_key="q"), 1)
    c.receive_data(pub + pub)
    assert connection_close_code(c) == 505


def test_method_on_unopened_channel_is_504() -> None:
    c = opened(1)
    c.receive_data(m(commands.Basic.Qos(), 2))
    assert connection_close_code(c) == 504
    assert ("method", 2, "Basic.Qos") not in c.calls


def test_hard_error_releases_channels_once_and_discards_until_close_ok() -> None:
    c = opened(1, 2)
    c.receive_data(m(pbody.ContentBody(b"stray"), 1))
    assert connection_close_code(c) == 505
    assert sorted(c.calls) == [("channel_closed", 1), ("channel_closed", 2), ("connection_closing",)]
    c.calls.clear()
    out_before = bytes(c.out)
    c.receive_data(m(commands.Basic.Qos(), 1) + publish(2, b"x") + m(commands.Channel.Open(), 3))
    assert c.calls == [] and bytes(c.out) == out_before
    assert not c.want_close
    c.receive_data(m(commands.Connection.CloseOk()))
    assert c.want_close and c.state == State.CLOSED
    assert bytes(c.out) == out_before


def test_soft_error_on_channel_zero_escalates() -> None:
    c = opened(1)
    c.receive_data(m(commands.Channel.Open(), 0))
    assert connection_close_code(c) in HARD_CODES


# ------------------------------------------------------------ soft errors
def test_soft_error_closes_only_the_channel() -> None:
    c = opened(1, 2)
    c.fail["missing"] = errors.NotFound("no queue 'missing' in vhost '/'")
    c.receive_data(m(commands.Queue.Declare(queue="missing", passive=True), 1))
    ((ch, close),) = decode_out(c.out)
    assert ch == 1 and isinstance(close, commands.Channel.Close)
    assert close.reply_code == 404
    assert close.reply_text.startswith("NOT_FOUND - ")
    assert (close.class_id, close.method_id) == (50, 10)
    assert c.calls[-1] == ("channel_closed", 1)
    assert c.state == State.OPEN
    c.out.clear()
    c.calls.clear()

    # Until close-ok, everything on channel 1 is dropped; channel 2 keeps working.
    c.receive_data(
        m(commands.Basic.Qos(), 1)
        + publish(1, b"dropped", chunk=3)
        + m(commands.Basic.Ack(1), 1)
        + m(pbody.ContentBody(b"stray"), 1)
        + publish(2, b"kept")
        + m(commands.Queue.Declare(queue="q2"), 2)
    )
    assert c.out == b""
    assert [x[:2] for x in c.calls] == [("publish", 2), ("method", 2)]
    assert c.calls[0][-1] == b"kept"
    c.calls.clear()

    c.receive_data(m(commands.Channel.CloseOk(), 1))
    assert 1 not in c.channels
    assert c.out == b"" and c.calls == []
    c.receive_data(m(commands.Channel.Open(), 1) + m(commands.Basic.Qos(), 1))
    assert [type(fr) for _, fr in decode_out(c.out)] == [commands.Channel.OpenOk]
    assert c.calls == [("channel_opened", 1), ("method", 1, "Basic.Qos")]


def test_soft_error_during_content_discards_rest_of_message() -> None:
    c = opened(1)
    c.fail["q"] = errors.PreconditionFailed("x")
    data = publish(1, b"0123456789", chunk=4)
    c.receive_data(m(commands.Queue.Declare(queue="q"), 1) + data)
    assert [type(fr) for _, fr in decode_out(c.out)] == [commands.Channel.Close]
    assert all(x[0] != "publish" for x in c.calls)


# ------------------------------------------------- split-point invariance
def script() -> bytes:
    """A valid client conversation touching every path of the parser."""
    props = commands.Basic.Properties(headers={"h": 1}, delivery_mode=1)
    return (
        handshake()
        + m(commands.Channel.Open(), 1)
        + m(commands.Channel.Open(), 2)
        + publish(1, b"abcdefghij" * 30, chunk=64, props=props)
        + m(pheartbeat.Heartbeat(), 0)
        + publish(2, b"")
        + m(commands.Basic.Ack(3, True), 1)
        + m(commands.Basic.Publish(exchange="a", routing_key="b"), 2)
        + m(commands.Queue.Declare(queue="q"), 1)
        + content(2, props, b"z" * 77, 20)
        + m(commands.Channel.Close(200, "ok", 0, 0), 2)
        + m(commands.Connection.Close(200, "bye", 0, 0))
    )


def run(chunks: list[bytes]) -> tuple[bytes, list[tuple[Any, ...]], State, bool]:
    c = Recorder()
    for chunk in chunks:
        c.receive_data(chunk)
    return bytes(c.out), c.calls, c.state, c.want_close


def test_one_byte_at_a_time_equals_all_at_once() -> None:
    data = script()
    whole = run([data])
    assert whole[2] == State.CLOSED and whole[3]
    assert sum(1 for x in whole[1] if x[0] == "publish") == 3
    assert run([data[i : i + 1] for i in range(len(data))]) == whole


@HYPO
@given(cuts=st.lists(st.integers(min_value=0, max_value=len(script())), max_size=60))
def test_random_split_points(cuts: list[int]) -> None:
    data = script()
    points = [0, *sorted(set(cuts)), len(data)]
    chunks = [data[a:b] for a, b in zip(points, points[1:], strict=False)]
    assert run(chunks) == run([data])


def run_in_turns(chunks: list[bytes]) -> tuple[tuple[bytes, list[tuple[Any, ...]], State, bool], int]:
    """``run`` with a turn budget of 0: the connection stops after every method that is not a
    publish or an ack (module doc of broker/amqp/connection.py, "Turns") and the caller goes on
    with ``receive_data(b"")``, as the network layer does after the loop's turn. Also: how many
    turns were given back."""
    c = Recorder()
    c.turn_budget = 0.0
    turns = 0
    for chunk in chunks:
        c.receive_data(chunk)
        while c.yielded:
            c.yielded = False
            turns += 1
            c.receive_data(b"")
    return (bytes(c.out), c.calls, c.state, c.want_close), turns


@HYPO
@given(cuts=st.lists(st.integers(min_value=0, max_value=len(script())), max_size=20))
def test_turns_given_back_mid_read_change_nothing(cuts: list[int]) -> None:
    data = script()
    points = [0, *sorted(set(cuts)), len(data)]
    in_turns, turns = run_in_turns([data[a:b] for a, b in zip(points, points[1:], strict=False)])
    assert in_turns == run([data])
    if not cuts:  # one read: stopped after each method but the last two (the closes end it)
        assert turns >= 3


def test_split_after_hard_error_equals_all_at_once() -> None:
    # After a 504 the framing is intact, so the client's close-ok in the same
    # read must be honoured exactly as if it had arrived in a later read.
    data = handshake() + m(commands.Basic.Qos(), 5) + m(commands.Connection.CloseOk())
    whole = run([data])
    bytewise = run([data[i : i + 1] for i in range(len(data))])
    assert bytewise[2] == State.CLOSED and bytewise[3]
    assert whole == bytewise


# ----------------------------------------------------------------- garbage
frame_garbage = st.builds(
    lambda ftype, ch, mid, tail, end: struct.pack(">BHI", ftype, ch, len(mid) + len(tail)) + mid + tail + end,
    st.sampled_from([1, 1, 1, 2, 3, 8, 0, 4, 255]),
    st.sampled_from([0, 1, 2, 3, 65535]),
    st.one_of(
        st.sampled_from([struct.pack(">I", idx) for idx in sorted(commands.INDEX_MAPPING)]),
        st.binary(max_size=4),
    ),
    st.binary(max_size=64),
    st.sampled_from([b"\xce", b"\xce", b"\xce", b"\x00"]),
)


@settings(HYPO, max_examples=300)
@given(garbage=st.lists(st.one_of(st.binary(min_size=1, max_size=64), frame_garbage), min_size=1, max_size=8))
def test_garbage_after_handshake_never_raises(garbage: list[bytes]) -> None:
    c = opened(1)
    for chunk in garbage:
        c.receive_data(chunk)  # must not raise
    frames = decode_out(c.out)  # whatever we wrote is well-formed
    closes = [fr for ch, fr in frames if ch == 0 and isinstance(fr, commands.Connection.Close)]
    assert len(closes) <= 1
    if closes:
        assert closes[0].reply_code in HARD_CODES
        assert c.state in (State.CLOSING, State.CLOSED)
    if c.state == State.CLOSED and not closes:
        # Only a client connection.close gets us here without our own close.
        assert isinstance(frames[-1][1], commands.Connection.CloseOk)


def test_deeply_nested_field_table_does_not_escape() -> None:
    # queue.declare whose arguments nest 2000 tables deep: pamqp recurses once
    # per level, so the decoder must turn the recursion failure into an AMQP error.
    inner = b""
    for _ in range(2000):
        inner = b"\x01kF" + struct.pack(">I", len(inner)) + inner
    payload = struct.pack(">HHH", 50, 10, 0) + b"\x01q\x00" + struct.pack(">I", len(inner)) + inner
    c = opened(1)
    c.receive_data(struct.pack(">BHI", 1, 1, len(payload)) + payload + b"\xce")
    assert connection_close_code(c) in HARD_CODES


def test_timestamp_out_of_range_is_502() -> None:
    args = b"\x01tT" + struct.pack(">Q", 2**63 - 1)
    payload = struct.pack(">HHH", 50, 10, 0) + b"\x01q\x00" + struct.pack(">I", len(args)) + args
    c = opened(1)
    c.receive_data(struct.pack(">BHI", 1, 1, len(payload)) + payload + b"\xce")
    assert connection_close_code(c) == 502


def test_publish_runs_form_over_repeats_and_per_message_properties() -> None:
    """After one publish parsed in full, the ones that repeat its method frame come as
    runs: exact repeats and ones with other properties or body sizes alike (``same``
    tells which). A run ends at another channel or routing key, an empty or large body,
    or a publish cut by the end of the read; nothing is lost or reordered."""
    runs: list[tuple[int, int, bool]] = []

    class Runs(Recorder):
        def handle_publish_run(self, channel: int, args: PublishArgs, props: list[bytes], bodies: list[bytes],
                               same: bool) -> None:
            runs.append((channel, len(bodies), same))
            super().handle_publish_run(channel, args, props, bodies, same)

    c = opened(1, 2)
    c.__class__ = Runs
    ids = [commands.Basic.Properties(message_id=f"m{i}") for i in range(30)]
    parts = [publish(1, b"first")]
    parts += [publish(1, b"b%04d" % i) for i in range(20)]  # exact repeats: body size 5
    parts += [publish(1, b"x%04d" % i, props=ids[i]) for i in range(10)]  # per-message properties
    parts += [publish(1, b"size-differs")]  # exact otherwise, another body size
    parts += [publish(2, b"ch2")]  # another channel: parsed in full
    parts += [publish(1, b"c%04d" % i) for i in range(5)]
    parts += [publish(1, b"")]  # an empty body: the general path
    parts += [publish(1, b"d%04d" % i) for i in range(5)]
    parts += [publish(1, b"L" * 20000)]  # a large body: the general path
    parts += [publish(1, b"e%04d" % i) for i in range(5)]
    stream = b"".join(parts)
    cut = len(stream) - 7  # the last publish arrives in the next read
    c.receive_data(stream[:cut])
    c.receive_data(stream[cut:])
    want_bodies = [b"first"] + [b"b%04d" % i for i in range(20)] + [b"x%04d" % i for i in range(10)] \
        + [b"size-differs", b"ch2"] + [b"c%04d" % i for i in range(5)] + [b""] \
        + [b"d%04d" % i for i in range(5)] + [b"L" * 20000] + [b"e%04d" % i for i in range(5)]
    got = [call for call in c.calls if call[0] == "publish"]
    assert [call[6] for call in got] == want_bodies
    ids_seen = [properties.decode(call[5]).message_id for call in got[21:31]]
    assert ids_seen == [f"m{i}" for i in range(10)]
    assert runs[0] == (1, 31, False)  # 20 exact + 10 with their own message-id + 1 of another size
    assert (1, 4, True) in runs and runs[-1] == (1, 4, True)  # e0000-e0003; e0004 came in the next read
    assert all(r[0] == 1 for r in runs)
