"""``skredctl stop_app`` / ``start_app`` against a real node (issue 32): stop_app closes every
client listener and every client connection with its protocol's close (AMQP connection.close
320 CONNECTION_FORCED, MQTT 5 DISCONNECT 0x8B server shutting down) while the management API
answers and the data stays; start_app opens the listeners again and every message confirmed
before the stop is still there. One broker for the module; skredctl runs as a real process."""

from __future__ import annotations

import contextlib
import http.client
import io
import json
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import paho.mqtt.client as mqtt
import pika
import pika.exceptions
import pytest

from broker.ctl import main as ctl_main

from ._support import REPO_ROOT, SkredProcess, amqp_answers, is_external, unique, wait_until
from .test_mgmt_api import Api

pytestmark = pytest.mark.skipif(is_external(), reason="starts its own broker")


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SkredProcess]:
    # two workers: stop_app and start_app reach every worker's listeners (broker/shards/fanout.py)
    b = SkredProcess(Path(tmp_path_factory.mktemp("ctlapp")) / "data", ["--workers", "2"])
    b.start()
    try:
        yield b
    finally:
        b.close()


def ctl(b: SkredProcess, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "broker.ctl", "--url", f"http://127.0.0.1:{b.mgmt_port}", *args],
        capture_output=True, text=True, timeout=30, cwd=str(REPO_ROOT),
    )


def ctl_here(url: str, *args: str) -> str:
    """skredctl's ``main`` in this process (for the reads: a process costs a second each)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert ctl_main(["--url", url, *args]) == 0
    return out.getvalue()


def websocket_upgrade(port: int, subprotocol: str) -> int:
    """The status of a WebSocket upgrade asking for ``subprotocol`` on the management port."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", "/ws", headers={
            "Upgrade": "websocket", "Connection": "Upgrade", "Sec-WebSocket-Version": "13",
            "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ==", "Sec-WebSocket-Protocol": subprotocol,
            "Authorization": "Basic Z3Vlc3Q6Z3Vlc3Q="})
        return conn.getresponse().status
    finally:
        conn.close()


def refused_at(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=2).close()
    except ConnectionRefusedError:
        return True
    return False


def refused(port: int) -> bool:
    return refused_at("127.0.0.1", port)


class Mqtt5:
    """A paho MQTT 5 client that records the server's DISCONNECT reason code."""

    def __init__(self, port: int) -> None:
        self.c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=unique("app"),
                             protocol=mqtt.MQTTv5)
        self.c.username_pw_set("guest", "guest")
        self.connected, self.gone = threading.Event(), threading.Event()
        self.reason: Any = None
        self.c.on_connect = lambda *_a: self.connected.set()

        def on_disconnect(_c: Any, _u: Any, _flags: Any, rc: Any, _p: Any) -> None:
            self.reason = rc
            self.gone.set()

        self.c.on_disconnect = on_disconnect
        self.c.connect("127.0.0.1", port, keepalive=30)
        self.c.loop_start()
        assert self.connected.wait(15), "no CONNACK"

    def close(self) -> None:
        self.c.disconnect()
        self.c.loop_stop()


def test_stop_app_then_start_app(node: SkredProcess) -> None:
    api = Api(node.mgmt_port)
    q = unique("app")
    conn = pika.BlockingConnection(pika.URLParameters(node.url))
    ch = conn.channel()
    ch.confirm_delivery()
    ch.queue_declare(q, durable=True)
    bodies = [f"m{i}".encode() for i in range(5)]
    for body in bodies:  # each confirmed (BlockingChannel raises on a nack)
        ch.basic_publish("", q, body, pika.BasicProperties(delivery_mode=2))
    device = Mqtt5(node.mqtt_port)
    assert api.get("/api/overview")["app_running"] is True
    assert websocket_upgrade(node.mgmt_port, "mqtt") == 101

    r = ctl(node, "stop_app")
    assert r.returncode == 0, r.stderr

    with pytest.raises(pika.exceptions.ConnectionClosedByBroker) as closed:
        for _ in range(100):  # the close is already on its way: a few reads at most
            conn.process_data_events(time_limit=0.1)
    assert closed.value.reply_code == 320
    assert device.gone.wait(10) and device.reason is not None and device.reason.value == 0x8B
    device.c.loop_stop()
    for port in (node.port, node.mqtt_port, node.stream_port, node.lmq_http_port, node.lmq_rpc_port):
        assert refused(port), port
    overview = api.get("/api/overview")
    assert overview["app_running"] is False
    assert {x["protocol"] for x in overview["listeners"]} <= {"http", "http/prometheus"}
    status, body, _ = api.call("GET", "/api/health/checks/protocol-listener/amqp")
    assert status == 503, body
    status, body, _ = api.call("GET", "/api/healthchecks/node")
    assert status == 503 and body["status"] == "failed", body
    for sub in ("mqtt", "amqp"):  # AMQP and MQTT over WebSocket are refused too
        assert websocket_upgrade(node.mgmt_port, sub) == 400, sub
    here = f"http://127.0.0.1:{node.mgmt_port}"
    assert "app: stopped" in ctl_here(here, "status")
    ctl_here(here, "stop_app")  # already stopped: nothing to do (RabbitMQ's)

    r = ctl(node, "start_app")
    assert r.returncode == 0, r.stderr
    wait_until(lambda: amqp_answers("127.0.0.1", node.port), 10, "AMQP listening again")
    assert "app: running" in ctl_here(here, "status")
    assert json.loads(ctl_here(here, "-f", "json", "status"))["app_running"] is True
    conn = pika.BlockingConnection(pika.URLParameters(node.url))
    ch = conn.channel()
    got = []
    for _ in bodies:
        m, _p, body = ch.basic_get(q, auto_ack=True)
        assert m is not None, got
        got.append(body)
    assert got == bodies
    ch.queue_delete(q)
    conn.close()
    device = Mqtt5(node.mqtt_port)  # MQTT answers again
    device.close()


def test_stop_app_needs_an_administrator(node: SkredProcess) -> None:
    api = Api(node.mgmt_port)
    user = unique("mon")
    api.call("PUT", f"/api/users/{user}", {"password": "pw", "tags": "monitoring"})
    try:
        r = ctl(node, "-u", user, "-p", "pw", "stop_app")
        assert r.returncode == 1 and "Not administrator" in r.stderr, r.stderr
        assert amqp_answers("127.0.0.1", node.port)  # refused means not done
    finally:
        api.call("DELETE", f"/api/users/{user}")


def test_stop_app_on_a_cluster_follower(session_cluster: Any) -> None:
    """On a follower, stop_app closes the proxies of its client ports (the follower keeps
    following, a member of the cluster) and start_app opens them again; the leader serves
    throughout. The follower's own metrics port takes the request: its HTTP port is the
    leader's. Restored before the test ends: the session's cluster is shared."""
    f = session_cluster.followers[0]
    metrics = f"http://127.0.0.1:{f.metrics_port}"  # the default metrics bind, whatever the node's ip
    u = urlsplit(f.url)
    creds = ["-u", unquote(u.username or ""), "-p", unquote(u.password or "")]

    def fctl(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "broker.ctl", "--url", metrics, *creds, *args],
            capture_output=True, text=True, timeout=30, cwd=str(REPO_ROOT),
        )

    q = unique("app-follower")
    conn = pika.BlockingConnection(pika.URLParameters(f.url))
    ch = conn.channel()
    ch.confirm_delivery()
    ch.queue_declare(q, durable=True)
    for i in range(3):
        ch.basic_publish("", q, f"f{i}".encode(), pika.BasicProperties(delivery_mode=2))
    try:
        r = fctl("stop_app")
        assert r.returncode == 0, r.stderr
        with pytest.raises(pika.exceptions.AMQPConnectionError):
            for _ in range(100):  # the proxy closed the client's socket
                conn.process_data_events(time_limit=0.1)
        for port in (f.port, f.mqtt_port, f.stream_port):
            assert refused_at(f.ip, port), port
        assert "app: stopped" in ctl_here(metrics, *creds, "status")
        leader = session_cluster.leader
        assert amqp_answers(leader.ip, leader.port)  # the cluster serves on
    finally:
        r = fctl("start_app")
    assert r.returncode == 0, r.stderr
    wait_until(lambda: amqp_answers(f.ip, f.port), 10, "the follower's AMQP proxy again")
    assert "app: running" in ctl_here(metrics, *creds, "status")
    conn = pika.BlockingConnection(pika.URLParameters(f.url))
    ch = conn.channel()
    got = [ch.basic_get(q, auto_ack=True)[2] for _ in range(3)]
    assert got == [b"f0", b"f1", b"f2"]
    ch.queue_delete(q)
    conn.close()
