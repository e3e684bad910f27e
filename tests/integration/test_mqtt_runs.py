"""MQTT publish runs (broker/mqtt/server.py ``_run``): QoS 0 PUBLISHes in a row to one topic go to
the publish operation at once, and a QoS 0 subscriber takes them as a run. A differential test:
the same random sequence of PUBLISHes is sent once as one burst (one read: runs) and once one
packet at a time, each waited for at a subscriber (one by one: no runs), on a real broker over
real sockets; what every subscriber sees must be identical, and it must be what the spec says
(every message, in the publisher's order).
"""

from __future__ import annotations

import random
import socket
import struct
from collections.abc import Iterator

import pytest

from ._support import Broker, is_external
from .conformance._mqtt_wire import CONNECT, PUBACK, PUBLISH, MRun, Record, packet, s, varint

pytestmark = pytest.mark.skipif(is_external(), reason="needs the broker's MQTT port")

NO_LOCAL = 4
USER_PROPERTY = 0x26
TOPICS = ("a/x", "a/y", "b/z")
LENGTHS = (0, 5, 5, 5, 17, 300)

Message = tuple[str, bytes, int, bool, bool]  # topic, payload, qos, retain, with a user property


def sequence(seed: int, v5: bool, n: int = 120) -> list[Message]:
    """Runs of one topic (1-8 long) of mostly QoS 0 messages, with QoS 1, retained messages and
    (MQTT 5) user properties breaking them up, bodies of equal and differing lengths."""
    rnd = random.Random(seed)
    out: list[Message] = []
    while len(out) < n:
        topic = rnd.choice(TOPICS)
        for _ in range(rnd.randint(1, 8)):
            qos = 1 if rnd.random() < 0.1 else 0
            retain = rnd.random() < 0.04
            payload = bytes(rnd.randrange(256) for _ in range(rnd.choice(LENGTHS)))
            if retain and not payload:
                payload = b"r"  # (an empty retained publish clears: not what this test is about)
            out.append((topic, payload, qos, retain, v5 and rnd.random() < 0.05))
    return out[:n]


def encode(run: MRun, m: Message, pid: int) -> bytes:
    topic, payload, qos, retain, user_prop = m
    body = s(run.topic(topic)) + (struct.pack("!H", pid) if qos else b"")
    if run.v5:
        props = bytes((USER_PROPERTY,)) + s("k") + s("v") if user_prop else b""
        body += varint(len(props)) + props
    return packet((PUBLISH << 4) | (qos << 1) | int(retain), body + payload)


def transcript(broker: Broker, version: int, msgs: list[Message], burst: bool) -> list[Record]:
    """Send ``msgs`` from a publisher of MQTT ``version``; every subscriber's deliveries."""
    run = MRun("skred", "127.0.0.1", broker.mqtt_port, version)
    try:
        everything = run.client("all", version=4)  # 3.1.1, QoS 0, every topic
        everything.subscribe(run.topic("#"), qos=0)
        a_only = run.client("a", version=5)  # MQTT 5, QoS 1, with a subscription identifier
        a_only.subscribe(run.topic("a/#"), qos=1, sub_id=7)
        pub = run.client("pub")
        if run.v5:  # its own messages on a no-local subscription: never back to it
            pub.subscribe(run.topic("a/x"), qos=0, options=NO_LOCAL)
        data = [encode(run, m, i + 1) for i, m in enumerate(msgs)]
        got_all: list[Record] = []
        if burst:
            pub.send(b"".join(data))
            got_all = [everything.next(log=False) for _ in msgs]
            for _ in range(sum(1 for m in msgs if m[2])):
                assert pub.expect(PUBACK, log=False)[1] == "puback"
        else:
            for m, d in zip(msgs, data, strict=True):
                pub.send(d)
                if m[2]:
                    assert pub.expect(PUBACK, log=False)[1] == "puback"
                got_all.append(everything.next(log=False))  # taken before the next is sent
        n_a = sum(1 for m in msgs if m[0].startswith("a/"))
        got_a = [a_only.next(log=False) for _ in range(n_a)]
        everything.until_marker(a_only, run.topic("a/x"))  # nothing more for "all"
        mine: list[Record] = []
        if run.v5:  # nothing of its own for the publisher: the marker comes from another client
            marker = run.client("marker", version=4)
            marker.publish(run.topic("a/x"), b"<marker>", qos=1)
            mine = [pub.next(log=False)]
        return [run.norm(r) for r in got_all + got_a + mine + run.transcript]
    finally:
        run.close()


@pytest.fixture(scope="module")
def mqtt_broker(shared_broker: Broker) -> Iterator[Broker]:
    yield shared_broker


@pytest.mark.parametrize("version", [4, 5])
@pytest.mark.parametrize("seed", [1])
def test_bursts_and_single_packets_deliver_the_same(mqtt_broker: Broker, version: int, seed: int) -> None:
    msgs = sequence(seed * 10 + version, version == 5)
    burst = transcript(mqtt_broker, version, msgs, burst=True)
    single = transcript(mqtt_broker, version, msgs, burst=False)
    assert burst == single
    # and it is what the spec says: every message to "all" in order, QoS 0, no retain flag on a
    # live delivery (3.1.1 section 3.3.1.3)
    expected = [("all", "publish", f"<run>/{t}", p.decode(errors="replace"), 0, 0)
                for t, p, _q, _r, _u in msgs]
    assert burst[:len(msgs)] == expected


def test_publishes_sent_with_the_connect_are_taken_after_the_connack(mqtt_broker: Broker) -> None:
    """A client that writes CONNECT and its first PUBLISHes at once (before the CONNACK): they
    wait for the login and are published, in order."""
    run = MRun("skred", "127.0.0.1", mqtt_broker.mqtt_port, 4)
    try:
        sub = run.client("sub")
        sub.subscribe(run.topic("early/#"), qos=0)
        sock = socket.create_connection(("127.0.0.1", mqtt_broker.mqtt_port), timeout=10)
        connect = packet(CONNECT << 4, s("MQTT") + bytes((4, 2 | 128 | 64)) + struct.pack("!H", 60)
                         + s(run.client_id("early")) + s("guest") + s("guest"))
        sock.sendall(connect + b"".join(encode(run, ("early/t", b"m%d" % i, 0, False, False), 0)
                                        for i in range(5)))
        try:
            got = [sub.next(log=False) for _ in range(5)]
        finally:
            sock.close()
        assert [r[3] for r in got] == [b"m%d" % i for i in range(5)]
    finally:
        run.close()
