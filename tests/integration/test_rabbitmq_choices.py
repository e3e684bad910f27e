"""AMQP where clients are written against RabbitMQ's choices rather than the letter of the spec.

Each test pins one behaviour measured on RabbitMQ 3.10 (docs/compatibility.md lists them): body
frames up to 8 bytes over frame_max are accepted, unbinding from a queue or exchange that is gone
answers unbind-ok, deleting a consumed queue answers queue.delete-ok before the consumer's
basic.cancel, ``connection.update-secret`` is answered, and every connection or channel the broker
closes leaves a log line with the reply code and text.
"""

from __future__ import annotations

import socket

import pika
import pytest
from pamqp import commands

from ._raw import FRAME_BODY, FRAME_HEADER, RawConn, frame_bytes, header_payload, method_bytes
from ._support import Broker, connect, is_external, unique, wait_until


def test_body_frame_eight_bytes_over_frame_max_is_accepted(shared_broker: Broker) -> None:
    """RabbitMQ checks the payload against frame_max, not the whole frame; clients rely on it."""
    qn = unique("fm")
    with RawConn(shared_broker.host, shared_broker.port) as c:
        c.handshake(frame_max=4096)
        c.open_channel(1)
        c.send_method(1, commands.Queue.Declare(queue=qn, auto_delete=True))
        c.expect(commands.Queue.DeclareOk, 1)
        body = b"a" * 4096 + b"b" * 4096  # two payloads of frame_max bytes: frames of 4104
        out = method_bytes(1, commands.Basic.Publish(exchange="", routing_key=qn))
        out += frame_bytes(FRAME_HEADER, 1, header_payload(len(body), commands.Basic.Properties()))
        out += frame_bytes(FRAME_BODY, 1, body[:4096]) + frame_bytes(FRAME_BODY, 1, body[4096:])
        c.send(out)
        c.send_method(1, commands.Basic.Get(queue=qn, no_ack=True))
        c.expect(commands.Basic.GetOk, 1)
        _hp, got, _sizes = c.read_content()
        assert got == body
        # one byte more is still a frame error
        out = method_bytes(1, commands.Basic.Publish(exchange="", routing_key=qn))
        out += frame_bytes(FRAME_HEADER, 1, header_payload(4097, commands.Basic.Properties()))
        c.send(out + frame_bytes(FRAME_BODY, 1, b"x" * 4097))
        closed = c.wait_connection_close()
        assert closed is not None and closed[0] == 501, closed


def test_unbind_from_missing_queue_or_exchange_is_ok(pika_conn: pika.BlockingConnection) -> None:
    ch = pika_conn.channel()
    ex, qn = unique("ex"), unique("q")
    ch.exchange_declare(ex, "direct", auto_delete=False)
    ch.queue_declare(qn)
    ch.queue_bind(qn, ex, "k")
    ch.queue_delete(qn)
    ch.queue_unbind(qn, ex, "k")  # the queue is gone: unbind-ok
    ch.queue_unbind(unique("never"), ex, "k")
    ch.queue_unbind(unique("never"), unique("no-exchange"), "k")
    ch.exchange_unbind(unique("dst"), ex, "k")  # exchange-to-exchange, destination missing
    ch.exchange_delete(ex)
    assert ch.is_open


def test_delete_consumed_queue_answers_delete_ok_before_cancel(shared_broker: Broker) -> None:
    qn = unique("dq")
    with RawConn(shared_broker.host, shared_broker.port) as c:
        c.handshake(capabilities={"consumer_cancel_notify": True})
        c.open_channel(1)
        c.send_method(1, commands.Queue.Declare(queue=qn))
        c.expect(commands.Queue.DeclareOk, 1)
        c.send_method(1, commands.Basic.Consume(queue=qn, consumer_tag="ctag"))
        c.expect(commands.Basic.ConsumeOk, 1)
        c.send_method(1, commands.Queue.Delete(queue=qn))
        c.expect(commands.Queue.DeleteOk, 1)
        cancel = c.expect(commands.Basic.Cancel, 1)
        assert cancel.consumer_tag == "ctag"


def test_update_secret(shared_broker: Broker) -> None:
    with RawConn(shared_broker.host, shared_broker.port) as c:
        c.handshake()
        c.send_method(0, commands.Connection.UpdateSecret(new_secret="guest", reason="token refresh"))
        c.expect(commands.Connection.UpdateSecretOk, 0)
        c.open_channel(1)  # the connection goes on
        c.send_method(0, commands.Connection.UpdateSecret(new_secret="wrong", reason="token refresh"))
        closed = c.wait_connection_close()
        assert closed is not None and closed[0] == 530, closed


@pytest.mark.skipif(is_external(), reason="reads the Skred process log")
def test_broker_closes_are_logged_with_code_and_text(broker: Broker) -> None:
    conn = connect(broker)
    ch = conn.channel()
    missing = unique("missing")
    with pytest.raises(pika.exceptions.ChannelClosedByBroker):
        ch.basic_get(missing)
    conn.close()
    with RawConn(broker.host, broker.port) as c:
        c.handshake(frame_max=4096)
        c.open_channel(1)
        c.send(frame_bytes(FRAME_BODY, 1, b"x" * 5000))
        assert c.wait_connection_close() is not None

    def logged() -> bool:
        text = broker.log_text()
        return (f"404 NOT_FOUND - no queue '{missing}'" in text and "channel 1" in text
                and "501" in text and "frame" in text)
    wait_until(logged, 10, "both closes in the broker log")


@pytest.mark.skipif(is_external(), reason="reads the Skred process log")
def test_vanished_client_is_a_warning_and_channel_errors_name_the_method(broker: Broker) -> None:
    """As RabbitMQ words it: a client gone without connection.close is one warning line
    ('client unexpectedly closed TCP connection'), no error or traceback; a channel error's line
    names the operation that caused it."""
    missing = unique("missing")
    with RawConn(broker.host, broker.port) as c:
        c.handshake()
        c.open_channel(1)
        c.send_method(1, commands.Queue.Declare(queue=missing, passive=True))
        assert c.expect(commands.Channel.Close, 1).reply_code == 404
        c.sock.shutdown(socket.SHUT_RDWR)  # gone without a word

    def logged() -> bool:
        return "client unexpectedly closed TCP connection" in broker.log_text()
    wait_until(logged, 10, "the vanished client in the broker log")
    lines = broker.log_text().splitlines()
    vanished = [ln for ln in lines if "unexpectedly closed" in ln]
    assert len(vanished) == 1 and " WARNING " in vanished[0], vanished
    assert not [ln for ln in lines if " ERROR " in ln or "Traceback" in ln], broker.log_tail()
    closed = [ln for ln in lines if f"no queue '{missing}'" in ln]
    assert closed and "queue.declare" in closed[0], closed

    # a client that stops sending heartbeats: one warning, not a second "unexpectedly closed"
    with RawConn(broker.host, broker.port) as c:
        c.handshake(heartbeat=1)
        assert c.wait_eof(15), "the broker kept a connection that missed its heartbeats"
    wait_until(lambda: "missed heartbeats from client" in broker.log_text(), 10, "the heartbeat close logged")
    lines = broker.log_text().splitlines()
    assert [ln for ln in lines if "missed heartbeats" in ln and " WARNING " in ln]
    assert len([ln for ln in lines if "unexpectedly closed" in ln]) == 1, broker.log_tail()


# Found by the conformance harness (tests/integration/conformance), pinned here too so they hold
# where no RabbitMQ is installed to diff against.
def test_empty_queue_name_means_the_channels_last_declared_queue(pika_conn: pika.BlockingConnection) -> None:
    ch = pika_conn.channel()
    qn = ch.queue_declare("", exclusive=True).method.queue
    ch.queue_bind("", "amq.fanout")
    ch.basic_publish("amq.fanout", "", b"to the last declared queue")
    assert ch.basic_get("", auto_ack=True)[2] == b"to the last declared queue"
    assert ch.queue_purge("").method.message_count == 0
    ch.queue_delete("")
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as ei:
        pika_conn.channel().queue_declare(qn, passive=True)
    assert ei.value.reply_code == 404
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as ei:
        pika_conn.channel().queue_purge("")  # a fresh channel has declared nothing
    assert ei.value.reply_code == 404


def test_user_id_must_be_the_connections_user(pika_conn: pika.BlockingConnection) -> None:
    ch = pika_conn.channel()
    qn = ch.queue_declare("", exclusive=True).method.queue
    ch.basic_publish("", qn, b"mine", pika.BasicProperties(user_id="guest"))
    assert ch.basic_get(qn, auto_ack=True)[2] == b"mine"
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as ei:
        ch.basic_publish("", qn, b"forged", pika.BasicProperties(user_id="someone-else"))
        ch.basic_get(qn)
    assert ei.value.reply_code == 406, ei.value
    assert "user_id property set to 'someone-else'" in ei.value.reply_text


def test_access_request_and_headers_x_match_and_queue_mode(shared_broker: Broker) -> None:
    with RawConn(shared_broker.host, shared_broker.port) as c:
        c.handshake()
        c.open_channel(1)
        c.send(frame_bytes(1, 1, b"\x00\x1e\x00\x0a\x05/data\x00"))  # access.request (0-8)
        assert c.read_frame() == (1, 1, b"\x00\x1e\x00\x0b\x00\x01")  # access.request-ok, ticket 1
        qn = unique("xm")
        c.send_method(1, commands.Queue.Declare(queue=qn, exclusive=True))
        c.expect(commands.Queue.DeclareOk, 1)
        c.send_method(1, commands.Queue.Bind(queue=qn, exchange="amq.headers",
                                             arguments={"x-match": "bogus"}))
        closed = c.expect(commands.Channel.Close, 1)
        assert (closed.reply_code, closed.class_id, closed.method_id) == (406, 50, 20)
        c.send_method(1, commands.Channel.CloseOk())
        c.open_channel(1)
        c.send_method(1, commands.Queue.Declare(queue=unique("qm"), arguments={"x-queue-mode": "fast"}))
        assert c.expect(commands.Channel.Close, 1).reply_code == 406
