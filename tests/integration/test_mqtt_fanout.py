"""QoS 1 fan-out's fast paths (broker/mqtt/session.py ``_Shared``, ``publish_run`` at QoS 1;
broker/mqtt/server.py ``_pubacks``), on a real broker over real sockets: what a client sees must
be what the general paths give it.

- A burst of QoS 1 PUBLISHes in one read (runs of one topic, bodies of equal and differing
  lengths, a QoS 0 one and another topic breaking them up) is answered with one PUBACK per
  PUBLISH in the order sent (those that reached only clean sessions' queues are answered at
  once, the others after the group commit), and every subscriber (3.1.1 and 5, QoS 1 and 0) gets every message
  once, in order, at the lower of the two QoS levels, with distinct packet identifiers.
- PUBACKs that come in one read settle exactly the deliveries they name: a duplicate and an
  unknown identifier change nothing, and after an abrupt end the persistent session gets back
  exactly the unacknowledged ones, flagged DUP; a read that mixes a PUBACK with another packet
  (PINGREQ) takes the general way and settles it too.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from typing import Any

import pytest

from ._support import is_external
from .conformance._mqtt_wire import PINGREQ, PINGRESP, PUBACK, PUBLISH, Client, MRun, packet, s
from .test_mqtt_runs_durable import _mqtt_port

# on a single node, and on the session cluster's leader and through a follower (a persistent
# session's queue is durable state)
pytestmark = [pytest.mark.skipif(is_external(), reason="needs the broker's MQTT port"),
              pytest.mark.cluster_modes]


@pytest.fixture(scope="module")
def mqtt_broker(shared_broker: Any) -> Iterator[Any]:
    yield shared_broker


def deliveries(c: Client, n: int, ack: bool = False) -> list[tuple[int, int, str, bytes]]:
    """The next ``n`` PUBLISHes to ``c``: (flags, packet id or 0, topic, payload); ``ack``: each
    QoS 1 one acknowledged once read (at most ``[mqtt] prefetch`` are in flight)."""
    out = []
    while len(out) < n:
        pkt = c._read(10)
        assert pkt is not None, f"{c.name}: closed after {len(out)} of {n} deliveries"
        kind, flags, body = pkt
        if kind != PUBLISH:
            continue
        (tlen,) = struct.unpack_from("!H", body, 0)
        pos = 2 + tlen
        pid = 0
        if flags & 6:
            (pid,) = struct.unpack_from("!H", body, pos)
            pos += 2
            if ack:
                c.send(puback(pid))
        if c.version == 5:
            plen = body[pos]  # (short property lists only: one length octet)
            pos += 1 + plen
        out.append((flags, pid, body[2:2 + tlen].decode(), body[pos:]))
    return out


def puback(pid: int) -> bytes:
    return packet(PUBACK << 4, struct.pack("!H", pid))


def test_a_burst_of_qos1_publishes_is_answered_and_delivered_in_order(mqtt_broker: Any) -> None:
    run = MRun("skred", mqtt_broker.host, _mqtt_port(mqtt_broker), 4)
    try:
        subs = [run.client(f"s{i}", version=v) for i, v in enumerate((4, 4, 5))]
        for c in subs:
            c.subscribe(run.topic("f/#"), qos=1)
        low = run.client("low")
        low.subscribe(run.topic("f/#"), qos=0)
        # a persistent session on f/b: those messages' PUBACKs wait for the group commit, and
        # the ones after them (only in clean sessions' queues, answered at once otherwise) wait
        # behind them
        kept = run.client_id("kept")
        run.client("kept", client_id=kept, clean=False).subscribe(run.topic("f/b"), qos=1)
        pub = run.client("pub")
        msgs: list[tuple[str, bytes, int]] = []
        for i in range(40):
            topic = "f/b" if i in (17, 18) else "f/a"
            payload = b"m%02d" % i if i % 7 else b"long message %d" % i
            msgs.append((run.topic(topic), payload, 0 if i == 25 else 1))
        data, pids = [], []
        for i, (topic, payload, qos) in enumerate(msgs):
            pid = 100 + i
            if qos:
                pids.append(pid)
            data.append(packet(PUBLISH << 4 | qos << 1, s(topic) + (struct.pack("!H", pid) if qos else b"")
                               + payload))
        pub.send(b"".join(data))
        acks = [pub.expect(PUBACK, log=False) for _ in pids]
        assert [a[1:] for a in acks] == [("puback", pid, 0) for pid in pids]
        for c in subs:
            got = deliveries(c, len(msgs), ack=True)
            assert [(t, p, f >> 1 & 3) for f, _, t, p in got] == msgs, c.name
            assert all(not f & 8 for f, *_ in got)  # no DUP on a first delivery
            assert all(pid for f, pid, *_ in got if f & 6)
        got = deliveries(low, len(msgs))
        assert [(t, p, f >> 1 & 3) for f, _, t, p in got] == [(t, p, 0) for t, p, _ in msgs]
        run.client("gone", client_id=kept, clean=True).disconnect()  # its queue goes
    finally:
        run.close()


def test_pubacks_in_one_read_settle_exactly_what_they_name(mqtt_broker: Any) -> None:
    run = MRun("skred", mqtt_broker.host, _mqtt_port(mqtt_broker), 4)
    try:
        cid = run.client_id("keeper")
        sub = run.client("keeper", client_id=cid, clean=False)
        sub.subscribe(run.topic("k/#"), qos=1)
        pub = run.client("pub")
        for i in range(10):  # (the default [mqtt] prefetch: all of them in flight at once)
            pub.publish(run.topic("k/t"), b"k%02d" % i, qos=1)
        got = deliveries(sub, 10)
        ids = [pid for _, pid, _, _ in got]
        assert len(set(ids)) == 10
        # the first six acknowledged in one read, with a duplicate and an identifier never sent
        unknown = next(i for i in range(1, 65536) if i not in ids)
        sub.send(b"".join(puback(pid) for pid in ids[:6] + [ids[3], unknown]))
        # a PUBACK and a PINGREQ in one read: the general way, which settles it as well
        sub.send(puback(ids[6]) + packet(PINGREQ << 4, b""))
        assert sub.expect(PINGRESP, log=False)[1] == "pingresp"
        sub.sock.close()  # an abrupt end: what is unacknowledged goes back to the queue
        again = run.client("again", client_id=cid, clean=False)
        assert again.connack[2] == 1  # session present
        back = deliveries(again, 3)
        assert [p for _, _, _, p in back] == [b"k%02d" % i for i in range(7, 10)]
        assert all(f & 8 for f, *_ in back)  # redelivered: DUP
        again.send(b"".join(puback(pid) for _, pid, _, _ in back))
        again.until_marker(pub, run.topic("k/t"))  # nothing else comes back
        assert [r for r in run.transcript if r[0] == "again" and r[1] != "connack"] == []
        again.disconnect()
        gone = run.client("gone", client_id=cid, clean=True)  # clean: the session's queue goes
        gone.disconnect()
    finally:
        run.close()
