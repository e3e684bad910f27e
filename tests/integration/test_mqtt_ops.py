"""MQTT for operators: connections in the management API and the metrics, closable; limits.

One broker for the module (its tests share it and use their own client ids); real paho and raw
MQTT clients, the real management API and Prometheus endpoint.
"""

from __future__ import annotations

import os
import re
import socket
import ssl
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import websocket
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from broker.mqtt import packets as P
from broker.mqtt import props as PR

from ._support import SkredProcess, assert_healthy, free_port, is_external, wait_until
from ._tls import make_pki, tls_args
from .test_features_extra import http, wait_http
from .test_mgmt_api import Api
from .test_mqtt import Paho, Raw, add_user, cid

pytestmark = pytest.mark.skipif(is_external(), reason="needs the broker's MQTT port")


@pytest.fixture(scope="module")
def mq(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SkredProcess]:
    b = SkredProcess(tmp_path_factory.mktemp("mqttops") / "data",
                     ["--mqtt-connect-timeout", "2", "--mqtt-max-subscriptions", "50"])
    try:
        b.start()
        wait_http(b)
        yield b
    finally:
        b.close()


def _mine(b: SkredProcess, client_id: str) -> dict[str, Any] | None:
    status, conns = http(b, "GET", "/api/connections")
    assert status == 200
    found = [c for c in conns if c.get("client_properties", {}).get("client_id") == client_id]
    return found[0] if found else None


def _metrics(b: SkredProcess) -> str:
    with urllib.request.urlopen(f"http://{b.host}:{b.metrics_port}/metrics", timeout=10) as r:
        return str(r.read().decode())


def _sample(text: str, name: str, labels: str = "") -> float:
    m = re.search(rf"^{re.escape(name)}{re.escape(labels)} ([0-9.e+]+)$", text, re.M)
    assert m is not None, f"{name}{labels} not in the metrics"
    return float(m.group(1))


def test_connections_are_listed_counted_and_closable(mq: SkredProcess) -> None:
    v3_id, v5_id = cid(), cid()
    v3 = Paho(mq.host, mq.mqtt_port, v3_id, clean=False)
    v5 = Raw(mq.host, mq.mqtt_port, P.Connect("MQTT", 5, True, 30, v5_id, None, "guest", b"guest"))
    try:
        assert v5.connack()[1] == 0
        assert v3.subscribe("ops/#", 1) == [1]
        v3.publish("ops/a", b"x", 1)
        assert v3.take(1)[0].payload == b"x"
        wait_until(lambda: _mine(mq, v5_id) is not None, 10, "the MQTT 5 connection listed")
        c3, c5 = _mine(mq, v3_id), _mine(mq, v5_id)
        assert c3 is not None and c5 is not None
        assert (c3["protocol"], c5["protocol"]) == ("MQTT 3.1.1", "MQTT 5.0")
        assert (c3["user"], c3["vhost"], c3["peer_host"], c3["channels"]) == ("guest", "/", "127.0.0.1", 0)
        assert c3["port"] == mq.mqtt_port and c3["timeout"] == 30  # its listener and keepalive
        assert c3["recv_oct"] > 0 and c3["send_oct"] > 0 and "recv_oct_details" in c3
        quoted = urllib.parse.quote(c3["name"], safe="")
        assert http(mq, "GET", f"/api/connections/{quoted}")[1]["protocol"] == "MQTT 3.1.1"
        assert http(mq, "GET", f"/api/connections/{quoted}/channels") == (200, [])
        # the persistent session's queue shows like any other
        status, q = http(mq, "GET", f"/api/queues/%2F/mqtt-subscription-{v3_id}qos1")
        assert status == 200 and q["durable"] is True and q["consumers"] == 1
        text = _metrics(mq)
        assert _sample(text, "rabbitmq_global_messages_received_total", '{protocol="mqtt311"}') >= 1
        assert _sample(text, "rabbitmq_global_messages_confirmed_total", '{protocol="mqtt311"}') >= 1
        assert _sample(text, "rabbitmq_global_consumers", '{protocol="mqtt311"}') >= 1
        assert _sample(text, "rabbitmq_global_publishers", '{protocol="mqtt50"}') == 0
        assert _sample(text, "rabbitmq_connections") >= 2
        # closed from the API: MQTT 5 hears why (0x98 administrative action), then the socket goes
        assert http(mq, "DELETE", f"/api/connections/{urllib.parse.quote(c5['name'], safe='')}")[0] == 204
        pkt = v5.read()
        assert pkt is not None and pkt[0] == P.DISCONNECT
        assert pkt[2][:1] == bytes((P.RC_ADMINISTRATIVE_ACTION,))
        assert v5.closed_within(5)
        wait_until(lambda: _mine(mq, v5_id) is None, 10, "the closed connection gone from the list")
        assert http(mq, "DELETE", f"/api/connections/{v3_id}")[0] == 204  # by client id too
        wait_until(lambda: _mine(mq, v3_id) is None, 10, "the 3.1.1 connection closed")
    finally:
        v3.close()
        v5.close()
    assert "Traceback" not in mq.log_text()


def test_subscriptions_beyond_the_cap_are_refused(mq: SkredProcess) -> None:
    """``--mqtt-max-subscriptions 50``: the 51st filter of a connection is refused (0x80 in 3.1.1,
    0x97 quota exceeded in 5), the ones before it hold, the connection stays, logged once."""
    for level in (4, 5):
        r = Raw(mq.host, mq.mqtt_port, P.Connect("MQTT", level, True, 30, cid(), None, "guest", b"guest"))
        try:
            assert r.connack()[1] == 0
            filters = tuple((f"cap/{i}", 1) for i in range(60))
            r.s.sendall(P.encode_subscribe(P.Subscribe(7, filters), v5=level == 5))
            pkt = r.read()
            assert pkt is not None and pkt[0] == P.SUBACK, pkt
            body = pkt[2]
            codes = body[3 + body[2]:] if level == 5 else body[2:]  # v5: after the property length
            refused = P.RC_QUOTA_EXCEEDED if level == 5 else P.SUBACK_FAILURE
            assert list(codes) == [1] * 50 + [refused] * 10
            r.s.sendall(bytes((P.PINGREQ << 4, 0)))
            assert r.read() == (P.PINGRESP, 0, b"")
        finally:
            r.close()
    assert len(re.findall("subscriptions refused: over the limit", mq.log_text())) == 2  # once each


def test_filters_with_thousands_of_levels_and_bad_utf8_get_the_protocols_answer(mq: SkredProcess) -> None:
    bystander = Paho(mq.host, mq.mqtt_port, cid())
    try:
        assert bystander.subscribe("deep/alive", 0) == [0]
        for level in (4, 5):
            r = Raw(mq.host, mq.mqtt_port, P.Connect("MQTT", level, True, 30, cid(), None, "guest", b"guest"))
            try:
                assert r.connack()[1] == 0
                deep = "/".join(["+"] * 5000) + "/#"
                r.s.sendall(P.encode_subscribe(P.Subscribe(3, ((deep, 1),)), v5=level == 5))
                pkt = r.read()
                assert pkt is not None and pkt[0] == P.SUBACK
                assert pkt[2][-1] == (P.RC_TOPIC_FILTER_INVALID if level == 5 else P.SUBACK_FAILURE)
                r.s.sendall(P.encode_publish("/".join(["l"] * 5000), b"x", 0, False, False, 0, v5=level == 5))
                assert r.closed_within(5)  # a topic name over the level limit: a protocol error
            finally:
                r.close()
            r = Raw(mq.host, mq.mqtt_port, P.Connect("MQTT", level, True, 30, cid(), None, "guest", b"guest"))
            try:
                assert r.connack()[1] == 0
                topic = b"bad/\xff\xfe"
                body = len(topic).to_bytes(2, "big") + topic + (b"\x00" if level == 5 else b"") + b"x"
                r.s.sendall(bytes((P.PUBLISH << 4,)) + PR.varint(len(body)) + body)
                if level == 5:
                    pkt = r.read()
                    assert pkt is not None and pkt[0] == P.DISCONNECT and pkt[2][0] == P.RC_MALFORMED, pkt
                assert r.closed_within(5)
            finally:
                r.close()
        bystander.publish("deep/alive", b"yes", 0)
        assert bystander.take(1)[0].payload == b"yes"
    finally:
        bystander.close()
    assert_healthy(mq)
    assert "Traceback" not in mq.log_text()




def test_a_connect_flood_is_throttled_and_costs_no_one_else(mq: SkredProcess) -> None:
    """30 CONNECTs with a wrong password at once: each is answered (bad credentials, or server
    unavailable once the login throttle gives up on the name), the refusals are logged once per
    burst, and another user logs in meanwhile without waiting."""
    flooder = add_user(mq, ".*", ".*", ".*")
    socks = [Raw(mq.host, mq.mqtt_port, P.Connect("MQTT", 4, True, 30, cid(), None, flooder, b"wrong"))
             for _ in range(30)]
    try:
        started = time.monotonic()
        other = Raw(mq.host, mq.mqtt_port, P.Connect("MQTT", 4, True, 30, cid(), None, "guest", b"guest"))
        assert other.connack() == (0, 0)
        assert time.monotonic() - started < 3, "a bystander waited on the flood"
        other.close()
        codes = [r.connack()[1] for r in socks]
        assert set(codes) <= {P.BAD_CREDENTIALS, P.SERVER_UNAVAILABLE}, codes
        assert P.SERVER_UNAVAILABLE in codes, "the throttle never refused unchecked"
        assert all(r.closed_within(5) for r in socks)
    finally:
        for r in socks:
            r.close()
    # the throttle's free attempts are logged each, the rest of the burst in one line
    assert sum(flooder in line for line in mq.log_text().splitlines()) <= 8


def test_retained_messages_respect_the_receive_maximum(mq: SkredProcess) -> None:
    """Retained QoS 1 messages sent on SUBSCRIBE count against the client's receive maximum (and
    wait, like queued deliveries, while the client does not read): 2 in flight, the next after
    a PUBACK."""
    pub = Paho(mq.host, mq.mqtt_port, cid())
    for i in range(5):
        pub.c.publish(f"rm/{i}", b"r%d" % i, 1, retain=True).wait_for_publish(10)
    pub.close()
    r = Raw(mq.host, mq.mqtt_port, P.Connect("MQTT", 5, True, 30, cid(), None, "guest", b"guest",
                                             {PR.RECEIVE_MAXIMUM: 2}))
    try:
        assert r.connack()[1] == 0
        r.s.sendall(P.encode_subscribe(P.Subscribe(1, (("rm/#", 1),)), v5=True))
        _expect(r, P.SUBACK, 1)
        first = [_v5_publish(b) for b in _expect(r, P.PUBLISH, 2)]
        with pytest.raises(TimeoutError):
            r.read(timeout=1)  # a third would exceed the client's receive maximum
        got = first
        while len(got) < 5:  # each PUBACK lets the next one come
            for pid, _ in got[-2:]:
                r.s.sendall(P.encode_packet_id(P.PUBACK, pid))
            got += [_v5_publish(b) for b in _expect(r, P.PUBLISH, min(2, 5 - len(got)))]
        assert sorted(p for _, p in got) == [b"r%d" % i for i in range(5)]
        for i in range(5):  # clear them for the module's other tests
            r.s.sendall(P.encode_publish(f"rm/{i}", b"", 0, True, False, 0, v5=True))
    finally:
        r.close()


def _v5_publish(body: bytes) -> tuple[int, bytes]:
    """A QoS 1 MQTT 5 PUBLISH body: (packet id, payload)."""
    tlen = int.from_bytes(body[:2], "big")
    pid = int.from_bytes(body[2 + tlen:4 + tlen], "big")
    plen, pos = PR.read_varint(body, 4 + tlen)
    return pid, body[pos + plen:]


def _rss_kib(pid: int | None) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))


def test_a_subscriber_that_does_not_read_costs_one_buffer(mq: SkredProcess) -> None:
    """48 MiB published to a QoS 0 subscriber that never reads: the broker stops writing to it
    once its socket buffer is full (the messages wait in its queue, on disk), its memory grows
    far less than that, and another subscriber is served meanwhile."""
    slow = Raw(mq.host, mq.mqtt_port, P.Connect("MQTT", 4, True, 30, cid(), None, "guest", b"guest"))
    slow.s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    bystander = Paho(mq.host, mq.mqtt_port, cid())
    try:
        assert slow.connack() == (0, 0)
        slow.s.sendall(P.encode_subscribe(P.Subscribe(1, (("slow/#", 0),))))
        _expect(slow, P.SUBACK, 1)
        assert bystander.subscribe("slow/alive", 0) == [0]
        before = _rss_kib(mq.pid)
        pub = Raw(mq.host, mq.mqtt_port, P.Connect("MQTT", 4, True, 30, cid(), None, "guest", b"guest"))
        assert pub.connack() == (0, 0)
        packet = P.encode_publish("slow/a", b"x" * 16384, 0, False, False, 0)
        for _ in range(3072):
            pub.s.sendall(packet)
        pub.s.sendall(bytes((P.PINGREQ << 4, 0)))
        assert pub.read(timeout=60) == (P.PINGRESP, 0, b"")  # all of it read by the broker
        pub.close()
        bystander.publish("slow/alive", b"yes", 0)
        assert bystander.take(1)[0].payload == b"yes"
        grown = (_rss_kib(mq.pid) - before) // 1024
        assert grown < 24, f"the broker grew {grown} MiB for a client that does not read"
    finally:
        slow.close()
        bystander.close()


def test_qos2_state_is_bounded_by_the_receive_maximum(mq: SkredProcess) -> None:
    """CONNACK tells an MQTT 5 client its receive maximum (1024); a client that leaves more QoS 2
    messages than that awaiting PUBREL is disconnected (0x93), so a session's QoS 2 state stays
    small. The messages go to a topic nobody subscribes to (nothing stored)."""
    r = Raw(mq.host, mq.mqtt_port, _v5(cid(), expiry=0, clean=True))
    try:
        pkt = r.read()
        assert pkt is not None and pkt[0] == P.CONNACK and pkt[2][1] == 0
        assert bytes((PR.RECEIVE_MAXIMUM, 4, 0)) in pkt[2][2:]  # 1024, in its properties
        data = b"".join(P.encode_publish("nobody/here", b"", 2, False, False, pid, v5=True)
                        for pid in range(1, 1026))
        r.s.sendall(data)
        recs = 0
        while (pkt := r.read()) is not None and pkt[0] == P.PUBREC:  # those answered before the end
            recs += 1
        assert recs <= 1024
        assert pkt is not None and pkt[0] == P.DISCONNECT and pkt[2][0] == P.RC_RECEIVE_MAXIMUM_EXCEEDED, pkt
        assert r.closed_within(5)
    finally:
        r.close()


# ------------------------------------------------------------------ durable session state
def _v5(client_id: str, expiry: int = 600, clean: bool = False, will: P.Will | None = None) -> P.Connect:
    return P.Connect("MQTT", 5, clean, 30, client_id, will, "guest", b"guest", {PR.SESSION_EXPIRY: expiry})


def _expect(r: Raw, kind: int, n: int) -> list[bytes]:
    """The next ``n`` packets, all of type ``kind``: their bodies."""
    out = []
    for _ in range(n):
        pkt = r.read(timeout=15)
        assert pkt is not None and pkt[0] == kind, (kind, pkt)
        out.append(pkt[2])
    return out


def _publishes(r: Raw, n: int) -> list[tuple[int, bytes]]:
    """``n`` PUBLISH packets of a 3.1.1 session at QoS 1: (packet id, payload), not acknowledged."""
    out = []
    for body in _expect(r, P.PUBLISH, n):
        tlen = int.from_bytes(body[:2], "big")
        out.append((int.from_bytes(body[2 + tlen:4 + tlen], "big"), body[4 + tlen:]))
    return out


class InFlight:
    """A persistent 3.1.1 subscriber holding QoS 1 deliveries unacknowledged, and an MQTT 5
    publisher with QoS 2 messages PUBREC'd, half of them PUBREL'd: then the node goes."""

    def __init__(self, host: str, port: int, n: int = 10) -> None:
        self.n = n
        self.sub_id, self.holder_id, self.pub_id = cid(), cid(), cid()
        sub = Paho(host, port, self.sub_id, clean=False)  # collects the QoS 2 messages afterwards
        assert sub.subscribe("k9/two/#", 2) == [1]
        sub.close()
        holder = Raw(host, port, P.Connect("MQTT", 4, False, 30, self.holder_id, None, "guest", b"guest"))
        assert holder.connack() == (0, 0)
        holder.s.sendall(P.encode_subscribe(P.Subscribe(1, (("k9/one/#", 1),))))
        _expect(holder, P.SUBACK, 1)
        pub = Raw(host, port, _v5(self.pub_id))
        assert pub.connack()[1] == 0
        for i in range(n):
            pub.s.sendall(P.encode_publish(f"k9/one/{i}", b"one%d" % i, 1, False, False, 100 + i, v5=True))
        _expect(pub, P.PUBACK, n)
        assert sorted(p for _, p in _publishes(holder, n)) == sorted(b"one%d" % i for i in range(n))
        for i in range(1, 2 * n + 1):
            pub.s.sendall(P.encode_publish(f"k9/two/{i}", b"two%d" % i, 2, False, False, i, v5=True))
        _expect(pub, P.PUBREC, 2 * n)
        for i in range(1, n + 1):
            pub.s.sendall(P.encode_packet_id(P.PUBREL, i))
        _expect(pub, P.PUBCOMP, n)
        self.holder, self.pub = holder, pub

    def resume(self, host: str, port: int) -> None:
        """After the node (or the leader) went: the publisher resends half of its open QoS 2
        messages as if their PUBREC was lost, releases all of them; nothing is lost, the QoS 2
        messages arrive once each."""
        n = self.n
        self.holder.close()
        self.pub.close()
        pub = Raw(host, port, _v5(self.pub_id))
        try:
            flags, code = pub.connack()
            assert (flags, code) == (1, 0), "the publisher's session (its QoS 2 state) was not kept"
            for i in range(n + 1, n + n // 2 + 1):
                pub.s.sendall(P.encode_publish(f"k9/two/{i}", b"two%d" % i, 2, False, True, i, v5=True))
            _expect(pub, P.PUBREC, n // 2)
            for i in range(n + 1, 2 * n + 1):
                pub.s.sendall(P.encode_packet_id(P.PUBREL, i))
            comps = _expect(pub, P.PUBCOMP, n)
            assert all(len(b) == 2 or b[2] == 0 for b in comps), "PUBREL of a PUBREC'd id not known"
        finally:
            pub.close()
        holder = Raw(host, port, P.Connect("MQTT", 4, False, 30, self.holder_id, None, "guest", b"guest"))
        try:
            assert holder.connack() == (1, 0)
            got = _publishes(holder, n)  # the unacknowledged QoS 1 deliveries, again: 0 lost
            assert sorted(p for _, p in got) == sorted(b"one%d" % i for i in range(n))
            for pid, _ in got:
                holder.s.sendall(P.encode_packet_id(P.PUBACK, pid))
        finally:
            holder.close()
        sub = Paho(host, port, self.sub_id, clean=False)
        try:
            got2 = [m.payload for m in sub.take(2 * n, timeout=30)]
            with pytest.raises(Exception):  # noqa: B017 - queue.Empty: nothing more (no duplicate)
                sub.take(1, timeout=1.5)
        finally:
            sub.close()
        assert sorted(got2) == sorted(b"two%d" % i for i in range(1, 2 * n + 1)), "QoS 2: lost or duplicated"


class WillAndShared:
    """A persistent MQTT 5 session with a shared subscription, a will due 3 s after its
    client's abnormal end, and two persistent sessions (3.1.1, and 5 with a 1 s will delay)
    still connected with their wills when the node goes: every will is published after it."""

    def __init__(self, host: str, port: int, log_text: Callable[[], str]) -> None:
        self.watcher_id, self.member_id, dying_id = cid(), cid(), cid()
        watcher = Paho(host, port, self.watcher_id, clean=False)
        assert watcher.subscribe("wd/#", 1) == [1]
        watcher.close()
        member = Raw(host, port, _v5(self.member_id))
        assert member.connack()[1] == 0
        member.s.sendall(P.encode_subscribe(P.Subscribe(1, (("$share/g1/sh/#", 1),)), v5=True))
        _expect(member, P.SUBACK, 1)
        member.close()
        will = P.Will("wd/gone", b"bye", 1, False, {PR.WILL_DELAY: 3})
        dying = Raw(host, port, _v5(dying_id, will=will))
        assert dying.connack()[1] == 0
        dying.close()  # an abnormal end: the will is due in 3 s
        ended = re.compile(rf"'{dying_id}' from \S+ closed the connection unexpectedly")
        wait_until(lambda: ended.search(log_text()) is not None, 10, "the abnormal end seen")
        # connected when the node dies: their wills are durable from CONNECT on (CONNACK waits)
        will3 = P.Will("wd/live3", b"v3", 1, False)
        will5 = P.Will("wd/live5", b"v5", 1, False, {PR.WILL_DELAY: 1})
        self.live = [Raw(host, port, P.Connect("MQTT", 4, False, 30, cid(), will3, "guest", b"guest")),
                     Raw(host, port, _v5(cid(), will=will5))]
        for r in self.live:
            assert r.connack()[1] == 0

    def resume(self, host: str, port: int) -> None:
        """The shared subscription is subscribed again as the session resumes; the will comes."""
        member = Raw(host, port, _v5(self.member_id))
        try:
            assert member.connack()[0] == 1
            pub = Paho(host, port, cid())
            pub.publish("sh/1", b"shared", 1)
            pub.close()
            pkt = member.read(timeout=15)
            assert pkt is not None and pkt[0] == P.PUBLISH and pkt[2].endswith(b"shared"), pkt
        finally:
            member.close()
        for r in self.live:
            r.close()
        watcher = Paho(host, port, self.watcher_id, clean=False)
        try:
            got = {(m.topic, m.payload) for m in watcher.take(3, timeout=20)}
            assert got == {("wd/gone", b"bye"), ("wd/live3", b"v3"), ("wd/live5", b"v5")}
        finally:
            watcher.close()


def test_an_expired_sessions_state_goes_with_it(mq: SkredProcess) -> None:
    """An MQTT 5 session with a 2 s expiry holding a QoS 2 identifier: back at once it is present;
    back after its expiry, the session (its QoS 2 state) is gone."""
    client_id = cid()

    def hold_one() -> tuple[int, int]:
        r = Raw(mq.host, mq.mqtt_port, _v5(client_id, expiry=2))
        try:
            ack = r.connack()
            r.s.sendall(P.encode_publish("nobody/x", b"q2", 2, False, False, 9, v5=True))
            _expect(r, P.PUBREC, 1)
            return ack
        finally:
            r.close()

    assert hold_one() == (0, 0)
    assert hold_one() == (1, 0)  # its QoS 2 identifier awaits PUBREL: the session is present
    time.sleep(3.5)  # the expiry is wall-clock time: nothing to poll for
    r = Raw(mq.host, mq.mqtt_port, _v5(client_id, expiry=2))
    try:
        assert r.connack() == (0, 0), "an expired session's state came back"
    finally:
        r.close()


def test_session_state_survives_kill9(mq: SkredProcess) -> None:
    """QoS 1 deliveries and QoS 2 messages in flight, a shared subscription and a will waiting out
    its delay, across kill -9: 0 lost, QoS 2 once each, the shared subscription back, the will
    published after the restart."""
    in_flight = InFlight(mq.host, mq.mqtt_port)
    kept = WillAndShared(mq.host, mq.mqtt_port, mq.log_text)
    mq.kill9()
    mq.start()
    in_flight.resume(mq.host, mq.mqtt_port)
    kept.resume(mq.host, mq.mqtt_port)
    assert "Traceback" not in mq.log_text()


# ------------------------------------------------------------------ through a follower
def _raw_on(sock: socket.socket, connect: P.Connect) -> Raw:
    """A ``Raw`` client on a socket of the test's own making (TLS, Unix)."""
    r = Raw.__new__(Raw)
    r.s, r.buf = sock, b""
    sock.sendall(P.encode_connect(connect))
    return r


def _listed_on(node: Any, peer: tuple[str, int], protocol: str) -> None:
    """The leader lists the connection with the client's own address and the protocol."""
    api = Api(node.mgmt_port)
    api.base = f"http://{node.ip}:{node.mgmt_port}"

    listed: list[Any] = []

    def seen() -> bool:
        status, conns, _ = api.call("GET", "/api/connections")
        listed[:] = [(c["peer_host"], c["peer_port"], c["protocol"]) for c in conns]
        return status == 200 and (*peer, protocol) in listed
    wait_until(seen, 10, f"{protocol} from {peer} listed on the leader (listed: {listed})")


def test_every_mqtt_transport_through_a_follower_and_a_leader_kill(tmp_path: Path) -> None:
    """MQTT, MQTTS, MQTT over WebSocket and over a Unix socket reach the leader through a
    follower with their real address; they are closed when the leader goes; persistent sessions
    with QoS 1 and QoS 2 messages in flight, a shared subscription and a delayed will, all made
    through a follower, come back whole through the follower of the new leader."""
    from .test_cluster import Cluster, start_cluster, wait_for

    pki = make_pki(tmp_path / "pki")
    c = Cluster(tmp_path)
    for n in c.nodes:
        n.mqtts_port = free_port()
        n.unix = str(tmp_path / f"{n.name}.mqtt.sock")
        n.argv += tls_args(pki, "--amqp-tls-port", "-1", "--mgmt-tls-port", "-1", "--mqtt-tls-port",
                           str(n.mqtts_port), "--mqtt-unix-path", n.unix,
                           "--amqp-unix-path", n.unix + ".amqp", "--mgmt-unix-path", n.unix + ".http")
    try:
        leader, followers = start_cluster(c)
        f = followers[0]
        plain = Raw(f.ip, f.mqtt_port, P.Connect("MQTT", 4, True, 30, cid(), None, "guest", b"guest"))
        assert plain.connack() == (0, 0)
        _listed_on(leader, plain.s.getsockname()[:2], "MQTT 3.1.1")
        ctx = ssl.create_default_context(cafile=str(pki.ca.cert_path))
        tls_sock = ctx.wrap_socket(socket.create_connection((f.ip, f.mqtts_port), timeout=10),
                                   server_hostname="localhost")
        tls = _raw_on(tls_sock, _v5(cid(), expiry=0, clean=True))
        assert tls.connack()[1] == 0
        _listed_on(leader, tls_sock.getsockname()[:2], "MQTT 5.0")
        ws = websocket.create_connection(f"ws://{f.ip}:{f.mgmt_port}/mqtt", subprotocols=["mqtt"], timeout=10)
        ws.send_binary(P.encode_connect(P.Connect("MQTT", 4, True, 30, cid(), None, "guest", b"guest")))
        assert ws.recv()[:2] == bytes((P.CONNACK << 4, 2))
        _listed_on(leader, ws.sock.getsockname()[:2], "Web MQTT 3.1.1")
        unix_sock = socket.socket(socket.AF_UNIX)
        unix_sock.settimeout(10)
        unix_sock.connect(f.unix)
        unix = _raw_on(unix_sock, P.Connect("MQTT", 4, True, 30, cid(), None, "guest", b"guest"))
        assert unix.connack() == (0, 0)
        _listed_on(leader, ("unix", 0), "MQTT 3.1.1")
        # the follower's AMQP and HTTP Unix sockets reach the leader too
        with socket.socket(socket.AF_UNIX) as amqp_unix:
            amqp_unix.settimeout(10)
            amqp_unix.connect(f.unix + ".amqp")
            amqp_unix.sendall(b"AMQP\x00\x00\x09\x01")
            assert amqp_unix.recv(7)[:1] == b"\x01"  # connection.start, a method frame
        with socket.socket(socket.AF_UNIX) as http_unix:
            http_unix.settimeout(10)
            http_unix.connect(f.unix + ".http")
            http_unix.sendall(b"GET /api/whoami HTTP/1.0\r\nAuthorization: Basic Z3Vlc3Q6Z3Vlc3Q=\r\n\r\n")
            assert http_unix.recv(12)[8:] == b" 200", "the leader's API over the Unix socket"
        in_flight = InFlight(f.ip, f.mqtt_port)
        kept = WillAndShared(f.ip, f.mqtt_port, leader.log_text)
        # the follower holds the sessions' state too before the leader goes
        wait_for(lambda: len(list(f.data_dir.glob("*/mqtt-sessions/*[0-9a-f]"))) >= 3, 10,
                 "the session state replicated")
        leader.kill9()
        for client in (plain, tls, unix):
            assert client.closed_within(30), "a client of the lost leader left hanging"
        ws.settimeout(30)
        with pytest.raises((websocket.WebSocketConnectionClosedException, ConnectionError, OSError)):
            while ws.recv():
                pass
        new = wait_for(lambda: (n := c.leader()) is not None and n is not leader and n, 30, "a new leader")
        rest = next(n for n in c.nodes if n is not leader and n is not new)
        wait_for(rest.answers, 30, "the remaining follower's proxy")
        in_flight.resume(rest.ip, rest.mqtt_port)
        kept.resume(rest.ip, rest.mqtt_port)
        for n in (new, rest):
            assert "Traceback" not in n.log_text()
    finally:
        c.close()


# ------------------------------------------------------------------ fuzz
FUZZ_EXAMPLES = int(os.environ.get("SKRED_CHAOS_FUZZ_EXAMPLES", "40"))
_TOPIC = st.text(st.sampled_from("ab/+#$\u00e9"), min_size=1, max_size=12)
_PAIRS = st.lists(st.tuples(st.text(max_size=4), st.text(max_size=4)), max_size=2)
_PROPS = st.fixed_dictionaries({}, optional={
    PR.CONTENT_TYPE: st.text(max_size=8), PR.USER_PROPERTY: _PAIRS,
    PR.MESSAGE_EXPIRY: st.integers(0, 2**32 - 1), PR.CORRELATION_DATA: st.binary(max_size=8)})


@st.composite
def _session(draw: st.DrawFn, level: int, user: str) -> bytes:
    """A well-formed session of ``level`` (4: 3.1.1, 5: 5.0): CONNECT, then a few packets."""
    v5 = level == 5
    will = draw(st.none() | st.builds(P.Will, _TOPIC.filter(lambda t: "+" not in t and "#" not in t),
                                      st.binary(max_size=8), st.integers(0, 2), st.booleans(),
                                      st.just({PR.WILL_DELAY: 1}) if v5 else st.just({})))
    props = {PR.SESSION_EXPIRY: draw(st.integers(0, 60))} if v5 else {}
    client_id = "fz" + draw(st.text("xyz", max_size=3))
    clean = draw(st.booleans())
    out = [P.encode_connect(P.Connect("MQTT", level, clean, 30, client_id, will, user, b"pw", props))]
    for pid in range(1, draw(st.integers(1, 6)) + 1):
        kind = draw(st.sampled_from(["pub", "sub", "unsub", "rel", "ping", "ack"]))
        if kind == "pub":
            qos = draw(st.integers(0, 2))
            out.append(P.encode_publish(draw(_TOPIC), draw(st.binary(max_size=16)), qos, draw(st.booleans()),
                                        False, pid if qos else 0, draw(_PROPS) if v5 else None, v5=v5))
        elif kind == "sub":
            filters = tuple(draw(st.lists(st.tuples(_TOPIC, st.integers(0, 0x2E)), min_size=1, max_size=3)))
            out.append(P.encode_subscribe(P.Subscribe(pid, filters), v5=v5))
        elif kind == "unsub":
            out.append(P.encode_unsubscribe(P.Unsubscribe(pid, (draw(_TOPIC),)), v5=v5))
        elif kind in ("rel", "ack"):
            out.append(P.encode_packet_id(P.PUBREL if kind == "rel" else P.PUBACK, pid))
        else:
            out.append(bytes((P.PINGREQ << 4, 0)))
    return b"".join(out)


@st.composite
def _mutated(draw: st.DrawFn, level: int, user: str) -> bytes:
    raw = bytearray(draw(_session(level, user)))
    for _ in range(draw(st.integers(1, 4))):
        i = draw(st.integers(0, len(raw) - 1))
        op = draw(st.sampled_from(["flip", "set", "cut", "insert", "length"]))
        if op == "flip":
            raw[i] ^= 1 << draw(st.integers(0, 7))
        elif op == "set":
            raw[i] = draw(st.sampled_from([0x00, 0x02, 0x7F, 0x80, 0xC0, 0xFF]))
        elif op == "cut":
            del raw[i:i + draw(st.integers(1, 8))]
        elif op == "insert":
            raw[i:i] = draw(st.binary(min_size=1, max_size=8))
        else:  # a remaining length or string length overwritten
            raw[i:i + 2] = draw(st.binary(min_size=2, max_size=2))
        if not raw:
            raw = bytearray(b"\x10")
    return bytes(raw)


@pytest.mark.chaos
@pytest.mark.parametrize("level", [4, 5], ids=["3.1.1", "5.0"])
def test_fuzzed_packets_get_an_answer_and_never_a_traceback(mq: SkredProcess, level: int) -> None:
    """Well-formed sessions of both versions, mutated (bits flipped, bytes set, cut, inserted,
    lengths overwritten): each connection is answered or closed once its client stops sending,
    the broker logs no traceback and serves a client afterwards."""
    user = add_user(mq, ".*", ".*", ".*")  # its mangled logins throttle only itself

    @settings(max_examples=FUZZ_EXAMPLES, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(data=_mutated(level, user))
    def trial(data: bytes) -> None:
        r = Raw(mq.host, mq.mqtt_port)
        try:
            r.s.sendall(data)
            r.s.shutdown(socket.SHUT_WR)
            assert r.closed_within(15), f"open after garbage and EOF: {data!r}"
        except OSError:
            pass  # reset by the broker: an answer too
        finally:
            r.close()

    trial()
    assert_healthy(mq)
    ok = Paho(mq.host, mq.mqtt_port, cid())
    ok.close()
    assert "Traceback" not in mq.log_text()
