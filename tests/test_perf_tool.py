"""Unit tests for skred-perf's codec, scanner and handshake, checked against pamqp (no sockets)."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pamqp import body as pbody
from pamqp import commands as C
from pamqp import frame as pframe
from pamqp import header as pheader

from broker.perf import codec
from broker.perf.cli import build_parser
from broker.perf.codec import CodecError, Reader
from broker.perf.handshake import Handshake, PerfError
from broker.perf.scanner import Confirms, FrameScanner
from broker.perf.stats import bucket_of, bucket_value, new_histogram, percentiles


def unmarshal_all(data: bytes) -> list[tuple[int, object]]:
    """Split ``data`` into frames with pamqp; fails if any byte is left over."""
    out = []
    while data:
        used, channel, value = pframe.unmarshal(data)
        out.append((channel, value))
        data = data[used:]
    return out


# --- encoders: byte-for-byte equal to pamqp ---------------------------------------------------


@pytest.mark.parametrize(
    ("ours", "theirs"),
    [
        (codec.connection_open("/"), C.Connection.Open(virtual_host="/")),
        (codec.connection_open("my vhost"), C.Connection.Open(virtual_host="my vhost")),
        (codec.tune_ok(2047, 131072, 0), C.Connection.TuneOk(2047, 131072, 0)),
        (codec.connection_close(200, "Goodbye"), C.Connection.Close(200, "Goodbye", 0, 0)),
        (codec.connection_close_ok(), C.Connection.CloseOk()),
        (codec.queue_declare(1, "q1"), C.Queue.Declare(queue="q1")),
        (
            codec.queue_declare(1, "q2", durable=True, passive=True, auto_delete=True, exclusive=True),
            C.Queue.Declare(queue="q2", durable=True, passive=True, auto_delete=True, exclusive=True),
        ),
        (codec.queue_delete(1, "q1"), C.Queue.Delete(queue="q1")),
        (codec.queue_bind(1, "q", "ex", "rk"), C.Queue.Bind(queue="q", exchange="ex", routing_key="rk")),
        (
            codec.exchange_declare(1, "ex", "fanout", durable=True),
            C.Exchange.Declare(exchange="ex", exchange_type="fanout", durable=True),
        ),
        (codec.exchange_delete(1, "ex"), C.Exchange.Delete(exchange="ex")),
        (codec.basic_qos(1, 1000), C.Basic.Qos(prefetch_count=1000)),
        (
            codec.basic_consume(1, "q", "tag-1", no_ack=True),
            C.Basic.Consume(queue="q", consumer_tag="tag-1", no_ack=True),
        ),
        (
            codec.basic_consume(1, "q", "tag-2", no_ack=False),
            C.Basic.Consume(queue="q", consumer_tag="tag-2", no_ack=False),
        ),
        (codec.basic_ack(1, 2**40 + 7, multiple=True), C.Basic.Ack(2**40 + 7, True)),
        (codec.basic_ack(1, 5, multiple=False), C.Basic.Ack(5, False)),
        (codec.confirm_select(1), C.Confirm.Select()),
        (codec.channel_flow_ok(1, True), C.Channel.FlowOk(True)),
    ],
)
def test_method_frames_match_pamqp(ours: bytes, theirs: object) -> None:
    channel = 0 if ours[1:3] == b"\x00\x00" else 1
    assert ours == pframe.marshal(theirs, channel)  # type: ignore[arg-type]


@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("size", [0, 1, 16, 131072 - 8, 131072 - 7, 300000])
def test_encode_message_matches_pamqp(persistent: bool, size: int) -> None:
    body = bytes(range(256)) * (size // 256 + 1)
    body = body[:size]
    frame_max = 131072
    ours = codec.encode_message(1, "ex", "rk", body, frame_max, persistent=persistent)
    props = C.Basic.Properties(delivery_mode=2) if persistent else C.Basic.Properties()
    theirs = pframe.marshal(C.Basic.Publish(exchange="ex", routing_key="rk"), 1)
    theirs += pframe.marshal(pheader.ContentHeader(0, size, props), 1)
    chunk = frame_max - 8
    for off in range(0, size, chunk):
        theirs += pframe.marshal(pbody.ContentBody(body[off : off + chunk]), 1)
    assert ours == theirs
    frames = unmarshal_all(ours)
    assert sum(len(v.value) for _, v in frames if isinstance(v, pbody.ContentBody)) == size  # type: ignore[attr-defined]
    assert all(len(v.value) <= chunk for _, v in frames if isinstance(v, pbody.ContentBody))  # type: ignore[attr-defined]


@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize(("exchange", "key"), [("", "q"), ("amq.direct", "routing-key-é")])
def test_body_offset_points_at_the_body(persistent: bool, exchange: str, key: str) -> None:
    body = b"\x01\x02\x03\x04\x05\x06\x07\x08rest"
    msg = codec.encode_message(1, exchange, key, body, 4096, persistent=persistent)
    off = codec.body_offset(1, exchange, key, persistent=persistent)
    assert msg[off : off + len(body)] == body


def test_channel_open() -> None:
    # pamqp insists on sending "0" for the reserved out-of-band field; brokers ignore it.
    assert codec.channel_open(7) == b"\x01\x00\x07\x00\x00\x00\x05\x00\x14\x00\x0a\x00\xce"


def test_start_ok_decodes_with_pamqp() -> None:
    data = codec.start_ok("guest", "s3cret", {"product": "skred-perf", "capabilities": {"x": True}, "n": 7})
    ((channel, value),) = unmarshal_all(data)
    assert channel == 0
    assert isinstance(value, C.Connection.StartOk)
    assert value.mechanism == "PLAIN"
    assert value.response == "\x00guest\x00s3cret"
    assert value.client_properties == {"product": "skred-perf", "capabilities": {"x": True}, "n": 7}


def test_shortstr_rejects_long_names() -> None:
    with pytest.raises(ValueError):
        codec.queue_declare(1, "x" * 256)


def test_reader_decodes_pamqp_tables() -> None:
    from pamqp import encode

    table = {"s": "text", "i": 42, "neg": -5, "big": 2**40, "b": True, "f": False, "t": {"nested": "yes"}}
    data = encode.field_table(table)
    assert Reader(data).table() == table


# --- handshake ----------------------------------------------------------------------------------


def _method_payload(value: object) -> tuple[int, int, int, bytes]:
    raw = pframe.marshal(value, 0)  # type: ignore[arg-type]
    cls, meth = struct.unpack_from(">HH", raw, 7)
    return 0, cls, meth, raw[11:-1]


def test_handshake_against_pamqp_frames() -> None:
    hs = Handshake("user", "pw", "vh", frame_max=131072)
    assert hs.initial() == b"AMQP\x00\x00\x09\x01"
    start = C.Connection.Start(
        server_properties={"product": "TestMQ", "version": "9.9"},
        mechanisms="AMQPLAIN PLAIN",
        locales="en_US",
    )
    out = hs.on_method(*_method_payload(start))
    ((_, start_ok),) = unmarshal_all(out)
    assert isinstance(start_ok, C.Connection.StartOk)
    assert start_ok.response == "\x00user\x00pw"
    assert hs.server_version == "TestMQ 9.9"
    out = hs.on_method(*_method_payload(C.Connection.Tune(channel_max=0, frame_max=4096, heartbeat=60)))
    tune_ok, open_ = (v for _, v in unmarshal_all(out))
    assert isinstance(tune_ok, C.Connection.TuneOk)
    assert (tune_ok.frame_max, tune_ok.heartbeat) == (4096, 0)
    assert isinstance(open_, C.Connection.Open) and open_.virtual_host == "vh"
    assert hs.frame_max == 4096
    assert not hs.done
    assert hs.on_method(*_method_payload(C.Connection.OpenOk())) == b""
    assert hs.done


def test_handshake_reports_refusal() -> None:
    hs = Handshake("user", "bad", "/")
    hs.on_method(*_method_payload(C.Connection.Start(mechanisms="PLAIN")))
    with pytest.raises(PerfError, match="403"):
        hs.on_method(*_method_payload(C.Connection.Close(403, "ACCESS_REFUSED - login refused", 0, 0)))


def test_handshake_requires_plain() -> None:
    hs = Handshake("u", "p", "/")
    with pytest.raises(PerfError, match="PLAIN"):
        hs.on_method(*_method_payload(C.Connection.Start(mechanisms="EXTERNAL")))


# --- scanner ------------------------------------------------------------------------------------


def delivery(tag: int, body: bytes, frame_max: int = 131072, ctag: str = "ctag-1") -> bytes:
    out = pframe.marshal(C.Basic.Deliver(ctag, tag, False, "", "queue-name"), 1)
    out += pframe.marshal(pheader.ContentHeader(0, len(body), C.Basic.Properties()), 1)
    chunk = frame_max - 8
    for off in range(0, len(body), chunk):
        out += pframe.marshal(pbody.ContentBody(body[off : off + chunk]), 1)
    return out


def scan_in_pieces(scanner: FrameScanner, data: bytes, cuts: list[int]) -> int:
    """Feed ``data`` as a consumer would: arrival boundaries at ``cuts``; returns bytes consumed."""
    buf = bytearray(data)
    pos = 0
    for end in sorted({c for c in cuts if 0 < c < len(data)} | {len(data)}):
        pos = scanner.scan(buf, pos, end)
    return pos


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(min_value=0, max_value=600), min_size=1, max_size=60),
    cuts=st.lists(st.integers(min_value=0, max_value=40000), max_size=30),
    frame_max=st.sampled_from([4096, 256, 131072]),
)
def test_scanner_counts_pamqp_deliveries(sizes: list[int], cuts: list[int], frame_max: int) -> None:
    data = b"".join(delivery(i + 1, bytes([i % 251]) * n, frame_max) for i, n in enumerate(sizes))
    scanner = FrameScanner(track_tags=True)
    assert scan_in_pieces(scanner, data, cuts) == len(data)
    assert scanner.completed == len(sizes)
    assert scanner.delivered == len(sizes)
    assert scanner.body_bytes == sum(sizes)
    assert scanner.last_tag == len(sizes)
    assert scanner.other == []


@settings(max_examples=40, deadline=None)
@given(
    count=st.integers(min_value=1, max_value=3000),
    cuts=st.lists(st.integers(min_value=0, max_value=400000), max_size=20),
    size=st.sampled_from([0, 8, 16, 1000]),
)
def test_scanner_fast_path_counts_uniform_streams(count: int, cuts: list[int], size: int) -> None:
    data = b"".join(delivery(i + 1, b"b" * size) for i in range(count))
    scanner = FrameScanner(track_tags=True)
    assert scan_in_pieces(scanner, data, cuts) == len(data)
    assert (scanner.completed, scanner.delivered, scanner.last_tag) == (count, count, count)
    assert scanner.body_bytes == count * size


def test_scanner_fast_path_is_taken_and_agrees_with_slow_walk() -> None:
    data = b"".join(delivery(i + 1, b"0123456789abcdef") for i in range(5000))
    fast = FrameScanner(track_tags=True)
    assert fast.scan(bytearray(data), 0, len(data)) == len(data)
    assert fast._tmpl_len > 0  # the template was learned, i.e. the fast path ran
    slow = FrameScanner(track_tags=True, track_latency=True)  # latency mode walks every frame
    slow.scan(bytearray(data), 0, len(data))
    assert (fast.completed, fast.last_tag) == (slow.completed, slow.last_tag)
    assert fast.body_bytes == slow.body_bytes == 5000 * 16


def test_scanner_fast_path_stops_at_a_different_frame() -> None:
    good = [delivery(i + 1, b"x" * 16) for i in range(100)]
    cancel = pframe.marshal(C.Basic.Cancel("ctag-1"), 1)
    longer = delivery(101, b"y" * 17)
    data = b"".join(good[:50]) + cancel + b"".join(good[50:]) + longer + delivery(102, b"x" * 16)
    scanner = FrameScanner(track_tags=True)
    assert scanner.scan(bytearray(data), 0, len(data)) == len(data)
    assert scanner.completed == 102
    assert scanner.body_bytes == 101 * 16 + 17
    assert scanner.last_tag == 102
    assert [(c, m) for _, c, m, _ in scanner.other] == [(60, 30)]


def test_scanner_fast_path_does_not_count_a_short_body() -> None:
    good = b"".join(delivery(i + 1, b"x" * 16) for i in range(20))
    # A broker bug: header announces 16 bytes, body frame carries 15 - then the next message.
    bad = bytearray(delivery(21, b"x" * 16))
    bad_header_end = len(bad) - (7 + 16 + 1)
    broken = bytes(bad[:bad_header_end]) + pframe.marshal(pbody.ContentBody(b"x" * 15), 1)
    data = good + broken + delivery(22, b"x" * 16)
    scanner = FrameScanner()
    with pytest.raises(CodecError):
        scanner.scan(bytearray(data), 0, len(data))
    assert scanner.completed == 20


def test_scanner_rejects_bad_frame_end() -> None:
    data = bytearray(delivery(1, b"abc"))
    data[-1] = 0
    with pytest.raises(CodecError, match="end octet"):
        FrameScanner().scan(data, 0, len(data))


def test_scanner_waits_for_incomplete_frames() -> None:
    data = delivery(1, b"x" * 100)
    scanner = FrameScanner()
    assert scanner.scan(bytearray(data), 0, len(data) - 1) < len(data)
    assert scanner.completed == 0


def test_scanner_settles_confirms_from_pamqp_acks() -> None:
    frames = [
        C.Basic.Ack(3, True),
        C.Basic.Ack(5, False),
        C.Basic.Nack(4, False, True),
        C.Basic.Ack(7, True),
        C.Basic.Ack(2, True),  # stale: already settled
    ]
    data = b"".join(pframe.marshal(f, 1) for f in frames)
    scanner = FrameScanner()
    assert scanner.scan(bytearray(data), 0, len(data)) == len(data)
    assert scanner.confirms.acked == 6
    assert scanner.confirms.nacked == 1
    assert scanner.confirms.upto == 7 and not scanner.confirms.singles


def test_confirms_out_of_order_singles() -> None:
    c = Confirms()
    for tag in (2, 4, 1):
        c.settle(tag, False, False)
    assert (c.upto, c.singles, c.acked) == (2, {4}, 3)
    c.settle(3, False, True)
    assert (c.upto, c.singles, c.acked, c.nacked) == (4, set(), 3, 1)
    c.settle(10, True, False)
    assert (c.settled, c.upto) == (10, 10)


def test_scanner_collects_other_methods_with_channel() -> None:
    data = pframe.marshal(C.Channel.Close(404, "NOT_FOUND - no queue 'x'", 60, 20), 1)
    scanner = FrameScanner()
    scanner.scan(bytearray(data), 0, len(data))
    ((channel, cls, meth, payload),) = scanner.other
    assert (channel, cls, meth) == (1, 20, 40)
    r = Reader(payload)
    assert (r.short(), r.shortstr()) == (404, "NOT_FOUND - no queue 'x'")


def test_scanner_latency_from_body_timestamp() -> None:
    sent = 1_000_000_000
    bodies = [struct.pack(">Q", sent) + b"pad" for _ in range(10)]
    data = b"".join(delivery(i + 1, b) for i, b in enumerate(bodies))
    scanner = FrameScanner(track_latency=True)
    scanner.scan(bytearray(data), 0, len(data), now_ns=sent + 2_500_000)  # 2.5 ms later
    assert scanner.latency is not None
    result = percentiles(scanner.latency, (50, 99))
    assert result["p50"] == pytest.approx(2500, rel=0.07)
    assert sum(scanner.latency) == 10


# --- stats / cli --------------------------------------------------------------------------------


@given(st.integers(min_value=0, max_value=2**50))
def test_histogram_buckets_are_monotonic_and_close(us: int) -> None:
    b = bucket_of(us)
    assert bucket_of(us + 1) >= b
    assert abs(bucket_value(b) - us) <= max(1.0, us / 16)


def test_percentiles() -> None:
    hist = new_histogram()
    for us in range(1, 101):
        hist[bucket_of(us)] += 1
    p = percentiles(hist, (50, 95, 99))
    assert p["p50"] == pytest.approx(50, rel=0.07)
    assert p["p99"] == pytest.approx(99, rel=0.07)
    assert percentiles(new_histogram(), (50,)) == {}


def test_cli_parses_lavinmqperf_style_flags() -> None:
    args = build_parser().parse_args(
        [
            "throughput",
            "-x",
            "2",
            "-y",
            "3",
            "-s",
            "64",
            "-z",
            "5",
            "-C",
            "100",
            "-a",
            "10",
            "-P",
            "50",
            "-c",
            "1000",
            "-p",
            "-u",
            "q",
            "-e",
            "ex",
            "-k",
            "rk",
            "-t",
            "topic",
            "-l",
            "-j",
        ]
    )
    assert (args.producers, args.consumers, args.size, args.seconds, args.count) == (2, 3, 64, 5.0, 100)
    assert (args.ack_every, args.prefetch, args.confirm, args.persistent) == (10, 50, 1000, True)
    assert (args.queue, args.exchange, args.routing_key, args.exchange_type) == ("q", "ex", "rk", "topic")
    assert args.latency and args.json


def test_cli_help_explains_every_option(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["throughput", "--help"])
    text = capsys.readouterr().out
    for flag in (
        "--uri",
        "-x",
        "-y",
        "-s",
        "-z",
        "-C",
        "-a",
        "-P",
        "-c",
        "-p",
        "-u",
        "-e",
        "-k",
        "-t",
        "--fanout-queues",
        "--prefill",
        "-l",
        "-j",
    ):
        assert flag in text


def test_amqps_uri_with_rabbitmq_query_parameters() -> None:
    from broker.perf.client import AmqpUri

    uri = AmqpUri.parse("amqps://u:p@localhost/v?cacertfile=/tmp/ca.crt")
    assert (uri.tls, uri.port, uri.cafile, uri.verify, uri.vhost) == (True, 5671, "/tmp/ca.crt", True, "v")
    assert not AmqpUri.parse("amqps://h:1/?verify=verify_none").verify
    assert not AmqpUri.parse("amqp://h").tls and AmqpUri.parse("amqp://h").port == 5672
