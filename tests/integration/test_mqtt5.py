"""MQTT 5 end to end: paho-mqtt (protocol 5) and raw sockets against a real broker.

Properties cross to AMQP and back (request/response between an MQTT 5 requester and an AMQP
responder), reason codes answer refusals, subscription options and identifiers apply per
delivery, topic aliases, session expiry as the queue's expiry, and the will delay.
"""

from __future__ import annotations

import queue
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import paho.mqtt.client as mqtt
import pika
import pytest
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from broker.mqtt import packets as P
from broker.mqtt import props as PR

from ._support import SkredProcess, connect, is_external, wait_until
from .test_features_extra import http
from .test_mqtt import Raw, add_user, cid

pytestmark = pytest.mark.skipif(is_external(), reason="needs the broker's MQTT port")


class Paho5:
    def __init__(self, b: SkredProcess, client_id: str, clean_start: bool = True,
                 expiry: int | None = None, user: str = "guest", password: str = "guest",
                 will: tuple[str, bytes, int] | None = None) -> None:
        self.c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id, protocol=mqtt.MQTTv5)
        self.c.username_pw_set(user, password)
        self.got: queue.Queue[Any] = queue.Queue()
        self.acks: queue.Queue[Any] = queue.Queue()
        self.connected = threading.Event()
        self.flags: Any = None
        self.connack_props: Any = None
        self.subacks: queue.Queue[list[Any]] = queue.Queue()
        self.disconnects: queue.Queue[Any] = queue.Queue()
        self.c.on_message = lambda _c, _u, msg: self.got.put(msg)
        self.c.on_subscribe = lambda _c, _u, _mid, codes, _p: self.subacks.put(list(codes))
        self.c.on_publish = lambda _c, _u, mid, rc, _p: self.acks.put((mid, rc))
        self.c.on_disconnect = lambda _c, _u, _f, rc, _p: self.disconnects.put(rc)
        self.c.on_connect = self._on_connect
        if will is not None:
            wp = Properties(PacketTypes.WILLMESSAGE)
            wp.WillDelayInterval = will[2]
            self.c.will_set(will[0], will[1], 1, properties=wp)
        cp = Properties(PacketTypes.CONNECT)
        if expiry is not None:
            cp.SessionExpiryInterval = expiry
        self.c.connect(b.host, b.mqtt_port, keepalive=30, clean_start=clean_start,
                       properties=cp if expiry is not None else None)
        self.c.loop_start()
        assert self.connected.wait(15), "no CONNACK"

    def _on_connect(self, _c: Any, _u: Any, flags: Any, rc: Any, props: Any) -> None:
        assert not rc.is_failure, rc
        self.flags, self.connack_props = flags, props
        self.connected.set()

    def subscribe(self, topic: str, qos: int, sub_id: int | None = None, **options: Any) -> list[Any]:
        props = None
        if sub_id is not None:
            props = Properties(PacketTypes.SUBSCRIBE)
            props.SubscriptionIdentifier = sub_id
        self.c.subscribe((topic, mqtt.SubscribeOptions(qos=qos, **options)), properties=props)
        return self.subacks.get(timeout=10)

    def publish(self, topic: str, payload: bytes, qos: int = 1, retain: bool = False,
                props: Properties | None = None) -> Any:
        info = self.c.publish(topic, payload, qos, retain=retain, properties=props)
        info.wait_for_publish(10)
        assert info.is_published()
        return info

    def take(self, n: int, timeout: float = 15) -> list[Any]:
        deadline = time.monotonic() + timeout
        return [self.got.get(timeout=max(0.01, deadline - time.monotonic())) for _ in range(n)]

    def close(self) -> None:
        self.c.disconnect()
        self.c.loop_stop()


@pytest.fixture
def mq(broker_factory: Any) -> Iterator[SkredProcess]:
    yield broker_factory([])


def test_connack_properties_and_an_assigned_client_id(mq: SkredProcess) -> None:
    c = Paho5(mq, "")
    try:
        props = c.connack_props
        assert props.AssignedClientIdentifier.startswith("skred-")
        assert props.TopicAliasMaximum == 64
        assert props.MaximumPacketSize > 1_000_000
    finally:
        c.close()


def test_request_response_between_mqtt5_and_amqp(mq: SkredProcess) -> None:
    """The requester is MQTT 5 (response topic, correlation data, user properties, content type);
    the responder is AMQP (reply_to, correlation_id, headers): RabbitMQ's mapping both ways."""
    conn = connect(mq)
    try:
        ch = conn.channel()
        q = ch.queue_declare("", exclusive=True).method.queue
        ch.queue_bind(q, "amq.topic", "svc.time")
        req = Paho5(mq, cid())
        assert req.subscribe("replies/+", 1) == [1]
        props = Properties(PacketTypes.PUBLISH)
        props.ResponseTopic = "replies/r1"
        props.CorrelationData = b"corr-42"
        props.ContentType = "text/plain"
        props.UserProperty = [("tenant", "acme"), ("trace", "t1")]
        props.MessageExpiryInterval = 60
        req.publish("svc/time", b"what time?", 1, props=props)
        m, p, body = ch.basic_get(q, auto_ack=True)
        assert body == b"what time?"
        assert (p.reply_to, p.correlation_id, p.content_type, p.expiration) == ("replies.r1", "corr-42",
                                                                              "text/plain", "60000")
        assert p.headers["tenant"] == "acme" and p.headers["trace"] == "t1"
        ch.basic_publish("amq.topic", p.reply_to, b"noon", pika.BasicProperties(
            correlation_id=p.correlation_id, content_type="text/plain", headers={"answered-by": "amqp"}))
        reply = req.take(1)[0]
        assert (reply.topic, reply.payload) == ("replies/r1", b"noon")
        rp = reply.properties
        assert rp.CorrelationData == b"corr-42" and rp.ContentType == "text/plain"
        assert ("answered-by", "amqp") in rp.UserProperty
        assert not any(k.startswith("x-mqtt") for k, _ in rp.UserProperty)
        req.close()
    finally:
        conn.close()


def test_reason_codes_answer_refusals(mq: SkredProcess) -> None:
    user = add_user(mq, "^mqtt-subscription-.*", "^mqtt-subscription-.*", "^mqtt-subscription-.*")
    c = Paho5(mq, cid(), user=user, password="pw")  # may not write to (or read) amq.topic
    try:
        codes = c.subscribe("a/#", 1)
        assert codes[0].value == P.RC_NOT_AUTHORIZED
        info = c.c.publish("a/b", b"x", 1)
        mid, rc = c.acks.get(timeout=10)
        assert mid == info.mid and rc.value == P.RC_NOT_AUTHORIZED
        assert c.subscribe("$share/g/a/#", 1)[0].value == P.RC_NOT_AUTHORIZED
    finally:
        c.close()
    c = Paho5(mq, cid())
    try:
        info = c.c.publish("nobody/listens", b"x", 1)
        mid, rc = c.acks.get(timeout=10)
        assert mid == info.mid and rc.value == P.RC_NO_MATCHING_SUBSCRIBERS
    finally:
        c.close()


def test_subscription_options_and_identifiers(mq: SkredProcess) -> None:
    pub = Paho5(mq, cid())
    me = Paho5(mq, cid())
    try:
        pub.publish("opt/kept", b"R", 1, retain=True)
        assert me.subscribe("opt/#", 1, sub_id=7, noLocal=True, retainAsPublished=True) == [1]
        first = me.take(1)[0]  # the retained message, with the retain flag and the id
        assert (first.topic, first.retain, first.properties.SubscriptionIdentifier) == ("opt/kept", 1, [7])
        assert me.subscribe("opt/+", 0, sub_id=9, retainHandling=2) == [0]  # no retained this time
        me.publish("opt/mine", b"own", 1)  # no-local: opt/# skips it; opt/+ (local allowed) sends it
        pub.publish("opt/theirs", b"T", 1, retain=True)
        # one copy per matching subscription's queue (QoS 0 and 1), each with its own options
        got = sorted((m.payload, m.properties.SubscriptionIdentifier, m.retain, m.qos) for m in me.take(3))
        assert got == [(b"T", [7], 1, 1),  # retain-as-published on opt/#
                       (b"T", [9], 0, 0),
                       (b"own", [9], 0, 0)]  # opt/# is no-local: only opt/+ sends it back
        time.sleep(0.3)
        assert me.got.empty()
        pub.publish("opt/kept", b"", 1, retain=True)
        pub.publish("opt/theirs", b"", 1, retain=True)
    finally:
        me.close()
        pub.close()


def test_shared_subscriptions_balance_over_the_group(mq: SkredProcess) -> None:
    members = [Paho5(mq, cid()) for _ in range(3)]
    loner = Paho5(mq, cid())
    pub = Paho5(mq, cid())
    try:
        for m in members:
            assert m.subscribe("$share/workers/jobs/#", 1, sub_id=5) == [1]
        assert loner.subscribe("jobs/#", 1) == [1]  # a plain subscription gets every message
        for i in range(30):
            pub.publish(f"jobs/{i}", str(i).encode(), 1)
        assert sorted(int(m.payload) for m in loner.take(30)) == list(range(30))
        counts = []
        got: list[int] = []
        deadline = time.monotonic() + 15
        while len(got) < 30 and time.monotonic() < deadline:
            time.sleep(0.05)
            got = []
            counts = []
            for m in members:
                seen = list(m.got.queue)
                counts.append(len(seen))
                got += [int(x.payload) for x in seen]
        assert sorted(got) == list(range(30)), "each message to exactly one member of the group"
        assert all(n >= 5 for n in counts), counts  # load-balanced (round robin: 10 each)
        first = members[0].got.queue[0]
        assert first.properties.SubscriptionIdentifier == [5]
        members[0].close()  # the group goes on without it
        for m in members[1:]:
            m.got = queue.Queue()
        pub.publish("jobs/after", b"x", 1)
        wait_until(lambda: sum(m.got.qsize() for m in members[1:]) == 1, 10, "one member to get it")
        time.sleep(0.3)
        assert sum(m.got.qsize() for m in members[1:]) == 1
        members[1].c.subscribe(("$share/workers/more", mqtt.SubscribeOptions(qos=1, noLocal=True)))
        assert members[1].disconnects.get(timeout=10).value == P.RC_PROTOCOL_ERROR  # no-local: refused
    finally:
        for c in (*members[1:], loner, pub):
            c.close()


def test_topic_aliases_in(mq: SkredProcess) -> None:
    sub = Paho5(mq, cid())
    r = Raw(mq.host, mq.mqtt_port, P.Connect("MQTT", 5, True, 30, cid(), None, "guest", b"guest"))
    try:
        assert sub.subscribe("alias/#", 0) == [0]
        pkt = r.read()
        assert pkt is not None and pkt[0] == P.CONNACK and pkt[2][1] == 0
        alias = {PR.TOPIC_ALIAS: 3}
        r.s.sendall(P.encode_publish("alias/long/name", b"1", 0, False, False, 0, alias, v5=True))
        r.s.sendall(P.encode_publish("", b"2", 0, False, False, 0, alias, v5=True))
        got = [(m.topic, m.payload) for m in sub.take(2)]
        assert got == [("alias/long/name", b"1"), ("alias/long/name", b"2")]
        r.s.sendall(P.encode_publish("", b"3", 0, False, False, 0, {PR.TOPIC_ALIAS: 4}, v5=True))
        pkt = r.read()  # an alias never set: DISCONNECT with protocol error, then the close
        assert pkt is not None and pkt[0] == P.DISCONNECT and pkt[2][0] == P.RC_PROTOCOL_ERROR
        assert r.closed_within(5)
    finally:
        r.close()
        sub.close()


def test_session_expiry_is_the_queues_expiry(mq: SkredProcess) -> None:
    client_id = cid()
    c = Paho5(mq, client_id, clean_start=False, expiry=3600)
    assert c.subscribe("exp/#", 1, sub_id=11, retainAsPublished=True) == [1]
    c.close()
    mq.kill9()  # the subscription's options and identifier live in its binding: they come back
    mq.start()
    c = Paho5(mq, client_id, clean_start=False, expiry=3600)
    assert c.flags.session_present
    pub = Paho5(mq, cid())
    pub.publish("exp/x", b"kept", 1, retain=True)
    pub.publish("exp/x", b"", 1, retain=True)
    pub.close()
    m = c.take(1)[0]
    assert (m.payload, m.retain, m.properties.SubscriptionIdentifier) == (b"kept", 1, [11])
    c.close()
    conn = connect(mq)
    ch = conn.channel()
    qname = f"mqtt-subscription-{client_id}qos1"
    ch.queue_declare(qname, passive=True)  # still there: the session outlives the connection
    status, q = http(mq, "GET", f"/api/queues/%2F/{qname}")
    assert status == 200 and q["durable"] and q["arguments"]["x-expires"] == 3_600_000
    c = Paho5(mq, client_id, clean_start=False, expiry=0)
    assert c.flags.session_present
    c.close()  # expiry 0: the session ends with this connection
    wait_until(lambda: not _exists(conn, qname), 5, "the session's queue to go")
    conn.close()


def _exists(conn: pika.BlockingConnection, name: str) -> bool:
    ch = conn.channel()
    try:
        ch.queue_declare(name, passive=True)
    except pika.exceptions.ChannelClosedByBroker:
        return False
    ch.close()
    return True


def test_will_delay_is_cancelled_by_a_quick_return(mq: SkredProcess) -> None:
    watcher = Paho5(mq, cid())
    try:
        assert watcher.subscribe("wd/#", 1) == [1]
        for name, come_back in (("back", True), ("gone", False)):
            client_id = "wd-" + uuid.uuid4().hex[:8]
            r = Raw(mq.host, mq.mqtt_port, P.Connect(
                "MQTT", 5, True, 30, client_id, P.Will(f"wd/{name}", b"w", 1, False, {PR.WILL_DELAY: 2}),
                "guest", b"guest", {PR.SESSION_EXPIRY: 60}))
            pkt = r.read()
            assert pkt is not None and pkt[0] == P.CONNACK
            r.close()  # abnormal end: the will waits 2 s
            if come_back:
                again = Paho5(mq, client_id, clean_start=False, expiry=60)
                again.close()
        m = watcher.take(1, timeout=10)[0]
        assert m.topic == "wd/gone"
        time.sleep(2.5)
        assert watcher.got.empty()
    finally:
        watcher.close()


def test_takeover_says_why(mq: SkredProcess) -> None:
    client_id = cid()
    first = Paho5(mq, client_id)
    second = Paho5(mq, client_id)
    try:
        rc = first.disconnects.get(timeout=10)
        assert rc.value == P.RC_SESSION_TAKEN_OVER
    finally:
        first.c.loop_stop()
        second.close()
