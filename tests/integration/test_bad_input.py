"""Bad input over raw sockets gets a clear answer and harms no one else.

Each test sends something wrong on its own socket, checks the broker's answer
(reply code of connection.close, or the socket being closed where the spec says
so), then checks that a well-behaved pika client still works. A hypothesis test
throws random and mutated frames at fresh connections while a long-lived good
client keeps publishing and consuming.
"""

from __future__ import annotations

import struct
from collections.abc import Callable

import pika
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pamqp import commands

from ._raw import PROTOCOL_HEADER, Closed, NoAnswer, RawConn, frame_bytes, header_payload, method_bytes
from ._support import Broker, SkredProcess, assert_healthy, channel_error, connect, is_external


def _open(b: Broker, **kw: int) -> RawConn:
    c = RawConn(b.host, b.port, timeout=5)
    c.handshake(**kw)  # type: ignore[arg-type]
    c.open_channel(1)
    return c


@pytest.mark.parametrize(
    "header",
    [
        b"AMQP\x00\x00\x09\x00",
        b"AMQP\x01\x01\x00\x0a",
        b"AMQP\x00\x01\x00\x00",
        b"GET / HTTP/1.1\r\n\r\n",
        b"XXXXXXXX",
    ],
    ids=["0-9-0", "0-10", "amqp-1.0", "http", "junk"],
)
def test_wrong_protocol_header(shared_broker: Broker, header: bytes) -> None:
    with RawConn(shared_broker.host, shared_broker.port) as c:
        c.send(header)
        assert c.read_exact(8) == PROTOCOL_HEADER
        assert c.wait_eof(), "server did not close after a wrong protocol header"
    assert_healthy(shared_broker)


def test_bad_credentials_pika(shared_broker: Broker) -> None:
    p = pika.URLParameters(shared_broker.url)
    p.credentials = pika.PlainCredentials("guest", "wrong-password")
    p.connection_attempts = 1
    p.socket_timeout = 5
    with pytest.raises((pika.exceptions.ProbableAuthenticationError, pika.exceptions.AuthenticationError)):
        pika.BlockingConnection(p)
    p.credentials = pika.PlainCredentials("no-such-user", "guest")
    with pytest.raises((pika.exceptions.ProbableAuthenticationError, pika.exceptions.AuthenticationError)):
        pika.BlockingConnection(p)
    assert_healthy(shared_broker)


def test_bad_credentials_raw_403(shared_broker: Broker) -> None:
    with RawConn(shared_broker.host, shared_broker.port) as c:
        c.send(PROTOCOL_HEADER)
        c.expect(commands.Connection.Start, 0)
        c.send_method(
            0,
            commands.Connection.StartOk(
                client_properties={"capabilities": {"authentication_failure_close": True}},
                mechanism="PLAIN",
                response="\0guest\0bad",
                locale="en_US",
            ),
        )
        closed = c.wait_connection_close()
        assert closed is not None and closed[0] == 403, closed
        assert "ACCESS_REFUSED" in closed[1]
    assert_healthy(shared_broker)


def test_unsupported_mechanism_closes(shared_broker: Broker) -> None:
    with RawConn(shared_broker.host, shared_broker.port) as c:
        c.send(PROTOCOL_HEADER)
        c.expect(commands.Connection.Start, 0)
        c.send_method(
            0,
            commands.Connection.StartOk(client_properties={}, mechanism="NOPE", response="x", locale="en_US"),
        )
        # Spec: the server closes the socket; a connection.close (403/503/530/540) first is also fine.
        closed = c.wait_connection_close()
        assert closed is None or closed[0] in (403, 503, 530, 540), closed
    assert_healthy(shared_broker)


def test_unknown_vhost_530(shared_broker: Broker) -> None:
    with RawConn(shared_broker.host, shared_broker.port) as c:
        c.send(PROTOCOL_HEADER)
        c.expect(commands.Connection.Start, 0)
        c.send_method(
            0,
            commands.Connection.StartOk(
                client_properties={}, mechanism="PLAIN", response="\0guest\0guest", locale="en_US"
            ),
        )
        tune = c.expect(commands.Connection.Tune, 0)
        c.send_method(0, commands.Connection.TuneOk(tune.channel_max, tune.frame_max, 0))
        c.send_method(0, commands.Connection.Open(virtual_host="/no-such-vhost-skredtest"))
        closed = c.wait_connection_close()
        assert closed is not None and closed[0] == 530, closed
    assert_healthy(shared_broker)


def _declare_payload() -> bytes:
    return method_bytes(1, commands.Queue.Declare(queue="x", passive=True))[7:-1]


# (name, bytes to send after handshake+channel.open, accepted reply codes; None = socket close allowed)
BAD_FRAMES: list[tuple[str, bytes, tuple[int | None, ...]]] = [
    ("bad-frame-end", frame_bytes(1, 1, _declare_payload(), end=0x00), (501, None)),
    ("unknown-frame-type", frame_bytes(7, 1, b"abc"), (501,)),
    ("size-beyond-frame-max", b"\x01\x00\x01\xff\xff\xff\xff", (501,)),
    ("body-without-publish", frame_bytes(3, 1, b"hello"), (505,)),
    ("header-without-publish", frame_bytes(2, 1, header_payload(5, commands.Basic.Properties())), (505,)),
    (
        "method-instead-of-header",
        method_bytes(1, commands.Basic.Publish(exchange="", routing_key="x"))
        + method_bytes(1, commands.Basic.Qos(prefetch_count=1)),
        (505,),
    ),
    ("truncated-method-args", frame_bytes(1, 1, struct.pack(">HH", 50, 10) + b"\x00"), (501, 502)),
    ("method-on-unopened-channel", method_bytes(7, commands.Queue.Declare(queue="", exclusive=True)), (504,)),
    ("second-channel-open", method_bytes(1, commands.Channel.Open()), (504,)),
    (
        "queue-declare-on-channel-0",
        method_bytes(0, commands.Queue.Declare(queue="", exclusive=True)),
        (503, 504),
    ),
    # Spec 4.2.3: heartbeat frames must use channel 0; RabbitMQ answers 505, 501 is also fine.
    ("heartbeat-on-channel-1", frame_bytes(8, 1, b""), (501, 503, 505)),
]


@pytest.mark.parametrize("name,data,codes", BAD_FRAMES, ids=[b[0] for b in BAD_FRAMES])
def test_bad_frames_close_connection(
    shared_broker: Broker, name: str, data: bytes, codes: tuple[int | None, ...]
) -> None:
    with _open(shared_broker) as c:
        c.send(data)
        closed = c.wait_connection_close()
        got = None if closed is None else closed[0]
        assert got in codes, f"{name}: expected one of {codes}, got {closed}"
    assert_healthy(shared_broker)


def test_oversized_body_frame_beyond_negotiated_frame_max_501(shared_broker: Broker) -> None:
    with _open(shared_broker, frame_max=4096) as c:
        c.send(method_bytes(1, commands.Basic.Publish(exchange="", routing_key="nowhere")))
        c.send(frame_bytes(2, 1, header_payload(10_000, commands.Basic.Properties())))
        c.send(frame_bytes(3, 1, b"x" * 10_000))  # one 10 KB frame although frame_max is 4096
        closed = c.wait_connection_close()
        assert closed is not None and closed[0] == 501, closed
    assert_healthy(shared_broker)


@pytest.mark.parametrize(
    "cls_method",
    [(99, 99), (60, 99), (10, 99)],
    ids=["unknown-class", "unknown-basic-method", "unknown-connection-method"],
)
def test_unknown_class_or_method_540(shared_broker: Broker, cls_method: tuple[int, int]) -> None:
    with _open(shared_broker) as c:
        c.send(frame_bytes(1, 1, struct.pack(">HH", *cls_method)))
        closed = c.wait_connection_close()
        if closed is None:
            # RabbitMQ 3.10 deviates: it drops the socket without connection.close.
            assert is_external(), "Skred must answer an unknown class/method with 540"
        else:
            assert closed[0] == 540, closed
    assert_healthy(shared_broker)


def test_body_longer_than_announced(shared_broker: Broker) -> None:
    with _open(shared_broker) as c:
        c.send(method_bytes(1, commands.Basic.Publish(exchange="", routing_key="nowhere")))
        c.send(frame_bytes(2, 1, header_payload(3, commands.Basic.Properties())))
        c.send(frame_bytes(3, 1, b"x" * 10))
        try:
            closed = c.wait_connection_close(timeout=2.0)
        except NoAnswer:
            # RabbitMQ 3.10 deviates: it neither answers nor closes (the channel hangs).
            assert is_external(), "Skred must reject a body longer than the header announced"
            closed = None
        # A frame error / unexpected frame close, or the socket closed, are both clear.
        assert closed is None or closed[0] in (501, 502, 505), closed
    assert_healthy(shared_broker)


def test_frame_max_below_minimum_refused(shared_broker: Broker) -> None:
    with RawConn(shared_broker.host, shared_broker.port) as c:
        c.send(PROTOCOL_HEADER)
        c.expect(commands.Connection.Start, 0)
        c.send_method(
            0,
            commands.Connection.StartOk(
                client_properties={}, mechanism="PLAIN", response="\0guest\0guest", locale="en_US"
            ),
        )
        c.expect(commands.Connection.Tune, 0)
        c.send_method(0, commands.Connection.TuneOk(0, 1024, 0))  # spec minimum is 4096
        c.send_method(0, commands.Connection.Open(virtual_host="/"))
        # RabbitMQ 3.10 drops the socket; a connection.close with 501/503/530 is equally clear.
        closed = c.wait_connection_close()
        assert closed is None or closed[0] in (501, 503, 530), closed
    assert_healthy(shared_broker)


def test_bad_input_on_one_connection_leaves_others_alone(shared_broker: Broker) -> None:
    good = connect(shared_broker)
    try:
        ch = good.channel()
        q = ch.queue_declare("", exclusive=True).method.queue
        with _open(shared_broker) as c:
            c.send(frame_bytes(3, 1, b"orphan body"))
            assert c.wait_connection_close() is not None
        ch.basic_publish("", q, b"still here")
        m, _, body = ch.basic_get(q, auto_ack=True)
        assert body == b"still here"
    finally:
        good.close()


# ---------------------------------------------------------------- fuzzing


def _valid_frames() -> list[bytes]:
    props = commands.Basic.Properties(
        content_type="text/plain", headers={"a": 1, "b": [1, "x"]}, delivery_mode=2
    )
    return [
        method_bytes(1, commands.Basic.Publish(exchange="", routing_key="fuzz"))
        + frame_bytes(2, 1, header_payload(5, props))
        + frame_bytes(3, 1, b"hello"),
        method_bytes(1, commands.Queue.Declare(queue="", exclusive=True, arguments={"x-max-length": 5})),
        method_bytes(
            1,
            commands.Exchange.Declare(
                exchange="skredtest.fuzz", exchange_type="fanout", auto_delete=True, passive=True
            ),
        ),
        method_bytes(1, commands.Basic.Qos(prefetch_count=3)),
        method_bytes(1, commands.Basic.Consume(queue="", consumer_tag="f")),
        method_bytes(1, commands.Basic.Ack(delivery_tag=1, multiple=True)),
        method_bytes(1, commands.Tx.Select()) + method_bytes(1, commands.Tx.Commit()),
        method_bytes(1, commands.Confirm.Select()),
        method_bytes(1, commands.Channel.Close(reply_code=200, reply_text="bye", class_id=0, method_id=0)),
        method_bytes(0, commands.Connection.Close(reply_code=200, reply_text="bye", class_id=0, method_id=0)),
        frame_bytes(8, 0, b""),
    ]


VALID = _valid_frames()


@st.composite
def _mutated(draw: st.DrawFn) -> bytes:
    base = bytearray(b"".join(draw(st.lists(st.sampled_from(VALID), min_size=1, max_size=3))))
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "set", "truncate", "insert", "delete"]))
        if not base:
            break
        i = draw(st.integers(0, len(base) - 1))
        if op == "flip":
            base[i] ^= 1 << draw(st.integers(0, 7))
        elif op == "set":
            base[i] = draw(st.sampled_from([0x00, 0x01, 0x7F, 0x80, 0xCE, 0xFF]))
        elif op == "truncate":
            del base[i:]
        elif op == "insert":
            base[i:i] = draw(st.binary(min_size=1, max_size=8))
        else:
            del base[i : i + draw(st.integers(1, 8))]
    return bytes(base)


FUZZ_INPUT = st.one_of(
    st.binary(min_size=1, max_size=300),
    _mutated(),
    st.tuples(st.sampled_from([1, 2, 3, 8, 0, 9, 0xCE]), st.integers(0, 3), st.binary(max_size=64)).map(
        lambda t: frame_bytes(t[0], t[1], t[2])
    ),
)


def _fuzz_once(b: Broker, data: bytes, before_handshake: bool) -> None:
    """Send data on a fresh connection, answer a connection.close if one comes quickly, hang up.

    The broker need not answer: a truncated frame legitimately leaves it waiting for
    more bytes. What matters is checked afterwards by the well-behaved client.
    """
    c = RawConn(b.host, b.port, timeout=5)
    try:
        if not before_handshake:
            c.handshake()
            c.open_channel(1)
        c.send(data)
        try:
            c.wait_connection_close(timeout=0.1)
        except NoAnswer:
            pass
    except (Closed, OSError):
        pass  # the broker closed before we finished; that is fine
    finally:
        c.close()


@pytest.mark.timeout(120)
def test_fuzz_frames_do_not_hurt_the_broker(shared_broker: Broker) -> None:
    good = connect(shared_broker)
    ch = good.channel()
    q = ch.queue_declare("", exclusive=True).method.queue
    count = [0]

    @settings(max_examples=120, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(data=FUZZ_INPUT, before_handshake=st.sampled_from([False, False, False, True]))
    def run(data: bytes, before_handshake: bool) -> None:
        _fuzz_once(shared_broker, data, before_handshake)
        count[0] += 1
        body = b"probe-%d" % count[0]
        ch.basic_publish("", q, body)
        m, _, got = ch.basic_get(q, auto_ack=True)
        assert got == body, "the well-behaved client stopped being served"
        if isinstance(shared_broker, SkredProcess):
            assert shared_broker.alive(), "broker process died:\n" + shared_broker.log_tail()

    try:
        run()
    finally:
        if good.is_open:
            good.close()
    assert count[0] >= 100
    assert_healthy(shared_broker)


def test_publish_over_max_message_size_is_406(broker_factory: Callable[..., Broker]) -> None:
    if is_external():
        pytest.skip("needs a broker started with a small --max-message-size (RabbitMQ's is server config)")
    b = broker_factory(["--max-message-size", "1024"])
    conn = connect(b)
    try:
        ch = conn.channel()
        q = ch.queue_declare("", exclusive=True).method.queue
        ch.basic_publish("", q, b"x" * 2000)
        with channel_error(406):
            ch.queue_declare(q, passive=True)  # surfaces the asynchronous channel.close
        assert conn.is_open
        ch = conn.channel()
        ch.basic_publish("", q, b"y" * 1024)  # exactly the limit is fine
        m, _, body = ch.basic_get(q, auto_ack=True)
        assert body == b"y" * 1024
    finally:
        if conn.is_open:
            conn.close()
