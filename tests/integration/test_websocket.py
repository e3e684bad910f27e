"""AMQP 0-9-1 and MQTT over WebSocket on the management port (broker/http/websocket.py).

A real WebSocket client carries raw AMQP frames (pamqp) and paho-mqtt carries MQTT; both must
authenticate as on their own ports, reach the same queues as TCP clients, and bad input must
close only that WebSocket.
"""

from __future__ import annotations

import time
from typing import Any

import paho.mqtt.client as mqtt
import pytest
import websocket
from pamqp import commands

from ._raw import Closed, RawConn
from ._support import SkredProcess, connect, is_external
from .test_features_extra import wait_http
from .test_mqtt import Paho, cid

pytestmark = pytest.mark.skipif(is_external(), reason="needs the broker's management port")


class WSRawConn(RawConn):
    """``RawConn`` over a WebSocket: the AMQP byte stream in binary messages."""

    def __init__(self, url: str, subprotocols: list[str] | None = None) -> None:
        self.ws = websocket.create_connection(url, subprotocols=subprotocols, timeout=5)
        self._buf = b""
        self.frame_max = self.channel_max = self.heartbeat = 0

    def send(self, data: bytes) -> None:
        self.ws.send_binary(data)

    def _fill(self, n: int) -> None:
        while len(self._buf) < n:
            try:
                op, data = self.ws.recv_data()
            except (websocket.WebSocketConnectionClosedException, ConnectionError) as exc:
                raise Closed(str(exc)) from exc
            if op == websocket.ABNF.OPCODE_CLOSE:
                raise Closed("WebSocket closed")
            self._buf += data

    def close(self) -> None:
        self.ws.close()


@pytest.fixture
def b(broker_factory: Any) -> SkredProcess:
    broker = broker_factory([])
    wait_http(broker)
    return broker


def test_amqp_over_websocket_reaches_the_same_queues(b: SkredProcess) -> None:
    tcp = connect(b)
    ch = tcp.channel()
    q = ch.queue_declare("", exclusive=True).method.queue
    base = f"ws://127.0.0.1:{b.mgmt_port}"
    for url, proto in ((f"{base}/", ["amqp"]), (f"{base}/ws", None)):
        c = WSRawConn(url, proto)
        try:
            c.handshake()
            c.open_channel(1)
            c.publish(1, "", q, b"over websocket")
        finally:
            c.close()
        deadline = time.monotonic() + 5
        got = None
        while got is None and time.monotonic() < deadline:
            _, _, got = ch.basic_get(q, auto_ack=True)
            tcp.process_data_events(0.02)
        assert got == b"over websocket", url
    tcp.close()


def test_amqp_over_websocket_authenticates(b: SkredProcess) -> None:
    c = WSRawConn(f"ws://127.0.0.1:{b.mgmt_port}/", ["amqp"])
    try:
        c.send(b"AMQP\x00\x00\x09\x01")
        c.expect(commands.Connection.Start, 0)
        c.send_method(0, commands.Connection.StartOk(client_properties={}, mechanism="PLAIN",
                                                     response="\0guest\0wrong", locale="en_US"))
        with pytest.raises(Closed):  # refused as on the AMQP port: no tune, the socket closes
            while True:
                c.read_frame()
    finally:
        c.close()


def test_mqtt_over_websocket_meets_mqtt_over_tcp(b: SkredProcess) -> None:
    sub = Paho(b.host, b.mqtt_port, cid())
    ws = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=cid(), transport="websockets",
                     protocol=mqtt.MQTTv311)
    ws.ws_set_options(path="/mqtt")
    ws.username_pw_set("guest", "guest")
    try:
        assert sub.subscribe("web/#", 1) == [1]
        ws.connect("127.0.0.1", b.mgmt_port, keepalive=30)
        ws.loop_start()
        info = ws.publish("web/page", b"hello from a browser", 1)
        info.wait_for_publish(10)
        m = sub.take(1)[0]
        assert (m.topic, m.payload) == ("web/page", b"hello from a browser")
    finally:
        ws.disconnect()
        ws.loop_stop()
        sub.close()
    bad = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=cid(), transport="websockets")
    bad.ws_set_options(path="/ws/mqtt")
    bad.username_pw_set("guest", "wrong")
    codes: list[Any] = []
    bad.on_connect = lambda _c, _u, _f, rc, _p: codes.append(rc)
    bad.connect("127.0.0.1", b.mgmt_port, keepalive=30)
    bad.loop_start()
    try:
        deadline = time.monotonic() + 10
        while not codes and time.monotonic() < deadline:
            time.sleep(0.05)
        assert codes and codes[0].is_failure  # bad credentials, as on 1883
    finally:
        bad.loop_stop()


def test_bad_input_closes_only_that_websocket(b: SkredProcess) -> None:
    c = WSRawConn(f"ws://127.0.0.1:{b.mgmt_port}/", ["amqp"])
    c.ws.send("a text message")
    with pytest.raises(Closed):
        c.read_frame()
    c.close()
    with pytest.raises(websocket.WebSocketBadStatusException):  # a protocol nobody serves here
        websocket.create_connection(f"ws://127.0.0.1:{b.mgmt_port}/", subprotocols=["stomp"], timeout=5)
    c = WSRawConn(f"ws://127.0.0.1:{b.mgmt_port}/", ["amqp"])
    c.send(b"GARBAGE!")
    with pytest.raises(Closed):
        while True:
            c.read_frame()
    c.close()
    tcp = connect(b)  # the broker and its HTTP API are fine
    tcp.close()
    assert "Traceback" not in b.log_text()
