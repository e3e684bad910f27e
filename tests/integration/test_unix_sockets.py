"""AMQP, MQTT and HTTP on Unix sockets ([amqp], [mqtt], [mgmt] unix_path; [main] unix_mode).

The socket file's mode decides who may open it; the protocols still authenticate with the same
users. A Unix socket counts as a local connection (``guest`` may use it, as from loopback).
"""

from __future__ import annotations

import base64
import json
import os
import socket
import stat
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import pytest

from ._raw import RawConn
from ._support import connect, is_external, wait_until
from .test_mqtt import cid

pytestmark = pytest.mark.skipif(is_external(), reason="starts its own broker")


class UnixRawConn(RawConn):
    def __init__(self, path: str) -> None:  # noqa: D107 - RawConn over AF_UNIX
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(5)
        self.sock.connect(path)
        self._buf = b""
        self.frame_max = self.channel_max = self.heartbeat = 0


def http_get(path: str, url: str, auth: str) -> tuple[int, Any]:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(5)
        s.connect(path)
        token = base64.b64encode(auth.encode()).decode()
        s.sendall(f"GET {url} HTTP/1.1\r\nHost: localhost\r\nAuthorization: Basic {token}\r\n"
                  "Connection: close\r\n\r\n".encode())
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status = int(head.split()[1])
    return status, json.loads(body) if body.startswith(b"{") else body


def test_amqp_mqtt_and_http_on_unix_sockets(broker_factory: Any, tmp_path: Path) -> None:
    amqp, mq, web = (str(tmp_path / n) for n in ("amqp.sock", "mqtt.sock", "http.sock"))
    b = broker_factory(["--amqp-unix-path", amqp, "--mqtt-unix-path", mq, "--mgmt-unix-path", web,
                        "--unix-mode", "0600"])
    wait_until(lambda: all(os.path.exists(p) for p in (amqp, mq, web)), 10, "the socket files")
    for p in (amqp, mq, web):
        assert stat.S_IMODE(os.stat(p).st_mode) == 0o600
    tcp = connect(b)
    ch = tcp.channel()
    q = ch.queue_declare("", exclusive=True).method.queue
    ch.queue_bind(q, "amq.topic", "unix.#")
    # AMQP: a full login over the socket, then a publish the TCP client reads
    c = UnixRawConn(amqp)
    try:
        c.handshake()
        c.open_channel(1)
        c.publish(1, "amq.topic", "unix.amqp", b"via amqp socket")
    finally:
        c.close()
    # MQTT: paho's Unix transport
    m = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=cid(), transport="unix")
    m.username_pw_set("guest", "guest")
    m.connect(mq)
    m.loop_start()
    try:
        m.publish("unix/mqtt", b"via mqtt socket", 1).wait_for_publish(10)
    finally:
        m.disconnect()
        m.loop_stop()
    got = set()
    for _ in range(100):
        _, _, body = ch.basic_get(q, auto_ack=True)
        if body is not None:
            got.add(body)
        if len(got) == 2:
            break
        tcp.process_data_events(0.05)
    assert got == {b"via amqp socket", b"via mqtt socket"}
    tcp.close()
    # HTTP: the same API, the same authentication
    assert http_get(web, "/api/overview", "guest:guest")[0] == 200
    assert http_get(web, "/api/overview", "guest:wrong")[0] == 401
    # a bad login on the AMQP socket is refused as on TCP
    c = UnixRawConn(amqp)
    try:
        with pytest.raises(Exception):  # noqa: B017 - refused: the socket closes before tune
            c.handshake(password="wrong")
    finally:
        c.close()
    b.stop()
    assert not any(os.path.exists(p) for p in (amqp, mq, web))  # removed at a clean stop
