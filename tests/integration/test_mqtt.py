"""MQTT 3.1.1 end to end: paho-mqtt and raw sockets against real brokers (one node and a cluster).

What must hold: the same users and permissions as AMQP, AMQP and MQTT clients meet on amq.topic,
QoS 1 is acknowledged only once durable, a persistent session's messages survive kill -9 and
reach the client through a follower, wills go out on an abnormal end only, and bad input closes
one connection and never the broker.
"""

from __future__ import annotations

import queue
import socket
import struct
import threading
import time
import urllib.parse
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import pika
import pytest

from broker.mqtt import packets as P
from broker.mqtt import props as PR

from ._support import Broker, SkredProcess, assert_healthy, connect, is_external, unique, wait_until
from .test_features_extra import http, wait_http

pytestmark = pytest.mark.skipif(is_external(), reason="needs the broker's MQTT port")


# ------------------------------------------------------------------ clients

class Paho:
    """A paho-mqtt 3.1.1 client on its own network thread; messages land in ``got``."""

    def __init__(self, host: str, port: int, client_id: str, clean: bool = True, user: str = "guest",
                 password: str = "guest") -> None:
        self.c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id, clean_session=clean,
                             protocol=mqtt.MQTTv311)
        self.c.username_pw_set(user, password)
        self.got: queue.Queue[Any] = queue.Queue()
        self.connected = threading.Event()
        self.present: bool | None = None
        self.subacks: queue.Queue[list[Any]] = queue.Queue()
        self.c.on_message = lambda _c, _u, msg: self.got.put(msg)
        self.c.on_connect = self._on_connect
        self.c.on_subscribe = lambda _c, _u, _mid, codes, _p: self.subacks.put(list(codes))
        self.c.connect(host, port, keepalive=30)
        self.c.loop_start()
        assert self.connected.wait(15), "no CONNACK"

    def _on_connect(self, _c: Any, _u: Any, flags: Any, rc: Any, _p: Any) -> None:
        assert not rc.is_failure, rc
        self.present = bool(flags.session_present)
        self.connected.set()

    def subscribe(self, topic: str, qos: int) -> list[Any]:
        self.c.subscribe(topic, qos)
        return self.subacks.get(timeout=10)

    def publish(self, topic: str, payload: bytes, qos: int) -> None:
        info = self.c.publish(topic, payload, qos)
        info.wait_for_publish(10)
        assert info.is_published()

    def take(self, n: int, timeout: float = 15) -> list[Any]:
        out = []
        deadline = time.monotonic() + timeout
        while len(out) < n:
            out.append(self.got.get(timeout=max(0.01, deadline - time.monotonic())))
        return out

    def close(self) -> None:
        self.c.disconnect()
        self.c.loop_stop()


class Raw:
    """A hand-driven MQTT connection: send bytes, read the server's packets as (type, flags, body)."""

    def __init__(self, host: str, port: int, connect: P.Connect | None = None) -> None:
        self.s = socket.create_connection((host, port), timeout=10)
        self.buf = b""
        if connect is not None:
            self.s.sendall(P.encode_connect(connect))

    def read(self, timeout: float = 10) -> tuple[int, int, bytes] | None:
        """The next packet; None once the server closed the connection."""
        self.s.settimeout(timeout)
        while True:
            if len(self.buf) >= 2:
                length, shift, i = 0, 0, 1
                while i < len(self.buf):
                    b = self.buf[i]
                    i += 1
                    length |= (b & 127) << shift
                    shift += 7
                    if not b & 128:
                        if len(self.buf) - i >= length:
                            first, body = self.buf[0], self.buf[i:i + length]
                            self.buf = self.buf[i + length:]
                            return first >> 4, first & 15, body
                        break
            try:
                chunk = self.s.recv(65536)
            except ConnectionResetError:
                return None
            if not chunk:
                return None
            self.buf += chunk

    def connack(self) -> tuple[int, int]:
        pkt = self.read()
        assert pkt is not None and pkt[0] == P.CONNACK, pkt
        return pkt[2][0], pkt[2][1]

    def closed_within(self, seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            try:
                if self.read(timeout=max(0.01, deadline - time.monotonic())) is None:
                    return True
            except TimeoutError:
                return False
        return False

    def close(self) -> None:
        self.s.close()


def login(client_id: str, user: str | None = "guest", password: bytes | None = b"guest", clean: bool = True,
          keepalive: int = 30, will: P.Will | None = None) -> P.Connect:
    return P.Connect("MQTT", 4, clean, keepalive, client_id, will, user, password)


def add_user(b: Broker, configure: str, write: str, read: str) -> str:
    wait_http(b)
    user = unique("mqttuser")
    uq = urllib.parse.quote(user, safe="")
    assert http(b, "PUT", f"/api/users/{uq}", {"password": "pw", "tags": ""})[0] in (201, 204)
    assert http(b, "PUT", f"/api/permissions/%2F/{uq}",
                {"configure": configure, "write": write, "read": read})[0] in (201, 204)
    return user


def cid() -> str:
    return "t-" + uuid.uuid4().hex[:10]


@pytest.fixture
def mq(broker_factory: Any) -> Iterator[SkredProcess]:
    """A broker of the test's own: for tests that kill it, fuzz it (junk could be retained) or
    send wrong passwords (the login throttle is per source address)."""
    b = broker_factory(["--mqtt-connect-timeout", "2"])
    yield b


@pytest.fixture(scope="module")
def shared_mq(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SkredProcess]:
    """The module's broker, for the tests that leave nothing another could see (their own
    client ids and users, no retained messages, topics of their own)."""
    b = SkredProcess(tmp_path_factory.mktemp("mqtt") / "data", ["--mqtt-connect-timeout", "2"])
    try:
        b.start()
        yield b
    finally:
        b.close()


# ------------------------------------------------------------------ tests

def test_credentials_are_required_and_checked(mq: SkredProcess) -> None:
    cases = [(None, None, P.NOT_AUTHORIZED), ("guest", b"wrong", P.BAD_CREDENTIALS),
             ("nobody", b"x", P.BAD_CREDENTIALS), ("novhost:guest", b"guest", P.NOT_AUTHORIZED),
             ("guest", b"guest", P.ACCEPTED), ("/:guest", b"guest", P.ACCEPTED)]
    for user, password, code in cases:
        r = Raw(mq.host, mq.mqtt_port, login(cid(), user, password))
        assert r.connack() == (0, code), (user, password)
        if code != P.ACCEPTED:
            assert r.closed_within(5)
        r.close()
    r = Raw(mq.host, mq.mqtt_port, P.Connect("MQTT", 6, True, 30, "v6", None, "guest", b"guest"))
    assert r.connack() == (0, P.BAD_PROTOCOL_VERSION)
    r.close()
    r = Raw(mq.host, mq.mqtt_port, login("", clean=False))
    assert r.connack() == (0, P.IDENTIFIER_REJECTED)
    r.close()


def test_the_listener_shows_in_the_management_api(shared_mq: SkredProcess) -> None:
    wait_http(shared_mq)
    status, overview = http(shared_mq, "GET", "/api/overview")
    assert status == 200
    assert {"node": overview["node"], "protocol": "mqtt", "ip_address": "127.0.0.1",
            "port": shared_mq.mqtt_port} in overview["listeners"]
    assert http(shared_mq, "GET", "/api/health/checks/protocol-listener/mqtt")[0] == 200
    assert http(shared_mq, "GET", f"/api/health/checks/port-listener/{shared_mq.mqtt_port}")[0] == 200


def test_mqtt_and_amqp_meet_on_amq_topic(shared_mq: SkredProcess) -> None:
    sub = Paho(shared_mq.host, shared_mq.mqtt_port, cid())
    conn = connect(shared_mq)
    try:
        assert sub.subscribe("sensors/+/temp", 1) == [1]
        ch = conn.channel()
        ch.basic_publish("amq.topic", "sensors.k1.temp", b"21.5", pika.BasicProperties(delivery_mode=2))
        ch.basic_publish("amq.topic", "sensors.k1.hum", b"no")
        msg = sub.take(1)[0]
        assert (msg.topic, msg.payload, msg.qos) == ("sensors/k1/temp", b"21.5", 1)
        # MQTT to AMQP: '/' and '.' swap, QoS in a header, QoS 1 persistent
        q = ch.queue_declare("", exclusive=True).method.queue
        ch.queue_bind(q, "amq.topic", "cmd.dev/1")
        sub.publish("cmd/dev.1", b"on", 1)
        m, props, body = ch.basic_get(q, auto_ack=True)
        assert body == b"on" and m.routing_key == "cmd.dev/1"
        assert props.delivery_mode == 2 and props.headers == {"x-mqtt-publish-qos": 1}
        sub.publish("cmd/dev.1", b"off", 0)
        wait_until(lambda: ch.queue_declare(q, passive=True).method.message_count == 1, 5, "QoS 0 publish")
        m, props, body = ch.basic_get(q, auto_ack=True)
        assert body == b"off" and props.delivery_mode == 1
    finally:
        sub.close()
        conn.close()


def test_qos_levels_between_mqtt_clients(shared_mq: SkredProcess) -> None:
    sub = Paho(shared_mq.host, shared_mq.mqtt_port, cid())
    pub = Paho(shared_mq.host, shared_mq.mqtt_port, cid())
    try:
        assert sub.subscribe("q/#", 2) == [1]  # QoS 2 granted as 1, as RabbitMQ does
        for qos in (0, 1, 2):
            pub.publish(f"q/{qos}", f"m{qos}".encode(), qos)
        got = sorted((m.topic, m.payload, m.qos) for m in sub.take(3))
        assert got == [("q/0", b"m0", 0), ("q/1", b"m1", 1), ("q/2", b"m2", 1)]
        time.sleep(0.3)  # no duplicate of the QoS 2 message follows
        assert sub.got.empty()
    finally:
        sub.close()
        pub.close()


def test_persistent_session_survives_kill9(mq: SkredProcess) -> None:
    client_id = cid()
    a = Paho(mq.host, mq.mqtt_port, client_id, clean=False)
    assert a.present is False
    assert a.subscribe("p/#", 1) == [1]
    a.close()
    pub = Paho(mq.host, mq.mqtt_port, cid())
    for i in range(50):
        pub.publish(f"p/{i}", str(i).encode(), 1)  # each answered only once durable
    pub.close()
    mq.kill9()
    mq.start()
    a = Paho(mq.host, mq.mqtt_port, client_id, clean=False)
    try:
        assert a.present is True
        got = sorted(int(m.payload) for m in a.take(50))
        assert got == list(range(50))
    finally:
        a.close()
    # a clean session with the same id starts afresh: the durable queue goes
    a = Paho(mq.host, mq.mqtt_port, client_id, clean=True)
    assert a.present is False
    a.close()
    conn = connect(mq)
    ch = conn.channel()
    with pytest.raises(pika.exceptions.ChannelClosedByBroker):
        ch.queue_declare(f"mqtt-subscription-{client_id}qos1", passive=True)
    conn.close()


def test_retained_messages_match_wildcards_clear_and_survive_kill9(mq: SkredProcess) -> None:
    pub = Paho(mq.host, mq.mqtt_port, cid())
    for topic, body in (("r/a", b"A"), ("r/b", b"B"), ("r/b/deep", b"D"), ("$SYS/x", b"S")):
        info = pub.c.publish(topic, body, 1, retain=True)
        info.wait_for_publish(10)
    pub.c.publish("r/c", b"not kept", 1, retain=False).wait_for_publish(10)
    sub = Paho(mq.host, mq.mqtt_port, cid())
    try:
        assert sub.subscribe("r/+", 1) == [1]
        got = sorted((m.topic, m.payload, m.retain, m.qos) for m in sub.take(2))
        assert got == [("r/a", b"A", True, 1), ("r/b", b"B", True, 1)]
        assert sub.subscribe("#", 0) == [0]  # '#' does not match $SYS/..., as the spec says
        got = sorted((m.topic, m.payload, m.qos) for m in sub.take(3))
        assert got == [("r/a", b"A", 0), ("r/b", b"B", 0), ("r/b/deep", b"D", 0)]
        time.sleep(0.3)
        assert sub.got.empty()
        pub.c.publish("r/a", b"", 1, retain=True).wait_for_publish(10)  # clears r/a
        live = sorted(m.topic for m in sub.take(2))  # delivered normally, to both filters
        assert live == ["r/a", "r/a"]
    finally:
        sub.close()
        pub.close()
    mq.kill9()
    mq.start()
    sub = Paho(mq.host, mq.mqtt_port, cid())
    try:
        assert sub.subscribe("r/#", 1) == [1]
        assert sorted((m.topic, m.payload) for m in sub.take(2)) == [("r/b", b"B"), ("r/b/deep", b"D")]
    finally:
        sub.close()


def test_will_goes_out_on_an_abnormal_end_only(shared_mq: SkredProcess) -> None:
    watcher = Paho(shared_mq.host, shared_mq.mqtt_port, cid())
    try:
        watcher.subscribe("wills/#", 1)
        polite = Raw(shared_mq.host, shared_mq.mqtt_port,
                     login(cid(), will=P.Will("wills/polite", b"bye", 1, False)))
        assert polite.connack() == (0, 0)
        polite.s.sendall(bytes((P.DISCONNECT << 4, 0)))
        assert polite.closed_within(5)
        rude = Raw(shared_mq.host, shared_mq.mqtt_port,
                   login(cid(), will=P.Will("wills/rude", b"lost", 1, False)))
        assert rude.connack() == (0, 0)
        rude.s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        rude.close()  # a reset, no DISCONNECT
        msg = watcher.take(1)[0]
        assert (msg.topic, msg.payload) == ("wills/rude", b"lost")
        time.sleep(0.3)
        assert watcher.got.empty()
    finally:
        watcher.close()


def test_permissions_are_amqps(shared_mq: SkredProcess) -> None:
    reader = add_user(shared_mq, ".*", "^$", ".*")  # may subscribe (its queues are written by binding)...
    writer = add_user(shared_mq, "^$", "^amq\\.topic$", "^$")
    # a user who may not write to amq.topic is closed when it publishes
    r = Raw(shared_mq.host, shared_mq.mqtt_port, login(cid(), reader, b"pw"))
    assert r.connack() == (0, 0)
    r.s.sendall(P.encode_publish("x/y", b"no", 0, False, False, 0))
    assert r.closed_within(5)
    # a user who may not configure or read queues gets SUBACK's failure code, and may publish
    r = Raw(shared_mq.host, shared_mq.mqtt_port, login(cid(), writer, b"pw"))
    assert r.connack() == (0, 0)
    r.s.sendall(P.encode_subscribe(P.Subscribe(1, (("x/#", 1),))))
    pkt = r.read()
    assert pkt is not None and pkt[0] == P.SUBACK and pkt[2] == b"\x00\x01\x80"
    r.s.sendall(P.encode_publish("x/y", b"ok", 1, False, False, 5))
    pkt = r.read()
    assert pkt is not None and pkt[0] == P.PUBACK and pkt[2] == b"\x00\x05"
    r.close()
    # the reader cannot bind either (write on its queue is '^$'): refused per filter
    r = Raw(shared_mq.host, shared_mq.mqtt_port, login(cid(), reader, b"pw"))
    assert r.connack() == (0, 0)
    r.s.sendall(P.encode_subscribe(P.Subscribe(2, (("x/#", 0),))))
    pkt = r.read()
    assert pkt is not None and pkt[2] == b"\x00\x02\x80"
    r.close()


def test_bad_input_closes_one_connection_and_timeouts_hold(shared_mq: SkredProcess) -> None:
    bystander = Paho(shared_mq.host, shared_mq.mqtt_port, cid())
    try:
        bystander.subscribe("alive", 0)
        for garbage in (b"\x10\xff\xff\xff\xff\x01", b"GET / HTTP/1.1\r\n\r\n", b"\x30\x03\x00\x01+"):
            r = Raw(shared_mq.host, shared_mq.mqtt_port)
            r.s.sendall(garbage)
            assert r.closed_within(5), garbage
            r.close()
        r = Raw(shared_mq.host, shared_mq.mqtt_port, login(cid()))
        assert r.connack() == (0, 0)
        r.s.sendall(b"\x82\x02\x00\x01")  # SUBSCRIBE without a filter
        assert r.closed_within(5)
        r.close()
        big = Raw(shared_mq.host, shared_mq.mqtt_port)  # before its login a client may send 256 KiB at most
        try:
            big.s.sendall(bytes((P.CONNECT << 4,)) + PR.varint(300_000) + b"\x00" * 100_000)
        except OSError:
            pass  # closed while it still sent: refused too
        assert big.closed_within(5)
        big.close()
        wait_until(lambda: "over the limit of 262144" in shared_mq.log_text(), 5, "the refusal in the log")
        r = Raw(shared_mq.host, shared_mq.mqtt_port, login(cid()))  # after it, the configured maximum holds
        assert r.connack() == (0, 0)
        r.s.sendall(P.encode_publish("alive", b"y" * 300_000, 0, False, False, 0))
        assert bystander.take(1)[0].payload == b"y" * 300_000
        r.close()
        silent = Raw(shared_mq.host, shared_mq.mqtt_port)  # no CONNECT within --mqtt-connect-timeout 2
        assert silent.closed_within(8)
        idle = Raw(shared_mq.host, shared_mq.mqtt_port, login(cid(), keepalive=1))
        assert idle.connack() == (0, 0)
        started = time.monotonic()
        assert idle.closed_within(8)
        assert time.monotonic() - started >= 1.0  # 1.5 x keepalive, not at once
        bystander.publish("alive", b"yes", 0)
        assert bystander.take(1)[0].payload == b"yes"
        assert_healthy(shared_mq)
        assert "Traceback" not in shared_mq.log_text()
    finally:
        bystander.close()


def test_a_second_connection_with_the_same_client_id_takes_over(shared_mq: SkredProcess) -> None:
    client_id = cid()
    first = Raw(shared_mq.host, shared_mq.mqtt_port, login(client_id))
    assert first.connack() == (0, 0)
    second = Raw(shared_mq.host, shared_mq.mqtt_port, login(client_id))
    assert second.connack() == (0, 0)
    assert first.closed_within(5)
    second.s.sendall(bytes((P.PINGREQ << 4, 0)))
    assert second.read() == (P.PINGRESP, 0, b"")
    second.close()


def test_through_a_follower_and_after_failover(tmp_path: Path) -> None:
    """A persistent session's QoS 1 messages, published through a follower, survive the loss of
    the leader and reach the client through the new leader."""
    from .test_cluster import Cluster, start_cluster, wait_for

    c = Cluster(tmp_path)
    try:
        leader, followers = start_cluster(c)
        f = followers[0]
        client_id = cid()
        a = Paho(f.ip, f.mqtt_port, client_id, clean=False)
        assert a.subscribe("fo/#", 1) == [1]
        a.close()
        pub = Paho(f.ip, f.mqtt_port, cid())
        for i in range(30):
            pub.publish(f"fo/{i}", str(i).encode(), 1)
        pub.c.publish("status/fo", b"kept", 1, retain=True).wait_for_publish(10)
        pub.close()
        leader.kill9()
        new = wait_for(lambda: (n := c.leader()) is not None and n is not leader and n, 30, "a new leader")
        wait_for(new.answers, 20, "the new leader's AMQP port")
        a = Paho(new.ip, new.mqtt_port, client_id, clean=False)
        try:
            assert a.present is True
            assert sorted(int(m.payload) for m in a.take(30, timeout=30)) == list(range(30))
            assert a.subscribe("status/+", 1) == [1]  # the retained message moved with the leader
            m = a.take(1)[0]
            assert (m.topic, m.payload, m.retain) == ("status/fo", b"kept", True)
        finally:
            a.close()
    finally:
        c.close()


@pytest.mark.chaos
def test_mutated_packets_of_both_versions_never_take_the_broker_down(mq: SkredProcess) -> None:
    """Valid sessions of 3.1.1 and 5 with bytes flipped, cut and repeated: each connection gets
    an answer or a close, the broker logs no traceback and keeps serving."""
    import random

    rng = random.Random(28)
    v5 = {PR.USER_PROPERTY: [("k", "v")], PR.CONTENT_TYPE: "t"}
    fuzzer = add_user(mq, ".*", ".*", ".*")  # its mangled logins slow only itself in the throttle
    for level in (4, 5):
        is5 = level == 5
        will = P.Will("w", b"x", 1, False)
        script = (P.encode_connect(P.Connect("MQTT", level, True, 30, "fz", will, fuzzer, b"pw"))
                  + P.encode_subscribe(P.Subscribe(1, (("a/#", 1), ("+/b", 0))), v5=is5)
                  + P.encode_publish("a/b", b"payload", 1, True, False, 2, v5 if is5 else None, v5=is5)
                  + P.encode_unsubscribe(P.Unsubscribe(3, ("a/#",)), v5=is5)
                  + bytes((P.PINGREQ << 4, 0)))
        for _ in range(60):
            data = bytearray(script)
            for _ in range(rng.randint(1, 6)):
                i = rng.randrange(len(data))
                op = rng.randrange(3)
                if op == 0:
                    data[i] = rng.randrange(256)
                elif op == 1:
                    del data[i:i + rng.randint(1, 8)]
                else:
                    data[i:i] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
            r = Raw(mq.host, mq.mqtt_port)
            try:
                r.s.sendall(bytes(data))
                r.s.shutdown(socket.SHUT_WR)
                assert r.closed_within(10), "a connection that sent garbage and EOF stays open"
            except OSError:
                pass  # reset by the broker: an answer too
            finally:
                r.close()
    assert_healthy(mq)
    ok = Paho(mq.host, mq.mqtt_port, cid())
    ok.close()
    assert "Traceback" not in mq.log_text()


def test_topic_permissions_apply_to_mqtt(shared_mq: SkredProcess) -> None:
    """RabbitMQ's topic authorisation on amq.topic holds for MQTT topics (as routing keys)."""
    user = add_user(shared_mq, ".*", ".*", ".*")
    uq = urllib.parse.quote(user, safe="")
    assert http(shared_mq, "PUT", f"/api/topic-permissions/%2F/{uq}",
                {"exchange": "amq.topic", "write": "^allowed\\.", "read": "^allowed\\."})[0] in (201, 204)
    r = Raw(shared_mq.host, shared_mq.mqtt_port, login(cid(), user, b"pw"))
    assert r.connack() == (0, 0)
    r.s.sendall(P.encode_subscribe(P.Subscribe(1, (("allowed/#", 1), ("denied/#", 1)))))
    pkt = r.read()
    assert pkt is not None and pkt[0] == P.SUBACK and pkt[2] == b"\x00\x01\x01\x80"
    r.s.sendall(P.encode_publish("allowed/x", b"ok", 1, False, False, 2))
    kinds = set()
    for _ in range(2):  # the PUBACK and the delivery to its own subscription, in either order
        pkt = r.read()
        assert pkt is not None
        kinds.add(pkt[0])
    assert kinds == {P.PUBACK, P.PUBLISH}
    r.s.sendall(P.encode_publish("denied/x", b"no", 0, False, False, 0))
    assert r.closed_within(5)
    r.close()
