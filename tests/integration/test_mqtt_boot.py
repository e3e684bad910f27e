"""MQTT at boot (issue 28): a client that connects the moment a restarted node's MQTT port
accepts sees its whole persistent session, while the node is still doing its per-session work.

The node restarts with a few hundred persistent sessions (each a durable subscription queue, so
the boot replays them) and one session holding QoS 1 messages that arrived while it was away.
The client does not wait for AMQP or anything else to answer: it polls the MQTT port itself and
connects at the first accept, then must get session present = 1 and every queued message.
"""

from __future__ import annotations

import socket
import time
from typing import Any

from broker.mqtt import packets as P

from ._support import SkredProcess
from .test_mqtt import Paho, Raw, cid, login

FILLER_SESSIONS = 300  # persistent sessions the boot replays besides the one under test
QUEUED = 40  # QoS 1 messages waiting in the session under test


def _filler_sessions(b: SkredProcess, n: int) -> str:
    """``n`` persistent sessions with one QoS 1 subscription each, made over raw sockets; their
    client ids' prefix."""
    prefix = cid()
    for i in range(n):
        r = Raw(b.host, b.mqtt_port, login(f"{prefix}-{i}", clean=False))
        assert r.connack() == (0, 0)
        r.s.sendall(P.encode_subscribe(P.Subscribe(1, ((f"filler/{i}", 1),))))
        pkt = r.read()
        assert pkt is not None and pkt[0] == P.SUBACK, pkt
        r.s.sendall(P.encode_disconnect(0))
        r.close()
    return prefix


def _connect_at_first_accept(b: SkredProcess, deadline_s: float = 60) -> float:
    """Seconds until the MQTT port accepted a TCP connection (the broker's own start polls AMQP)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < deadline_s:
        assert b.proc is not None and b.proc.poll() is None, b.log_tail()
        try:
            with socket.create_connection((b.host, b.mqtt_port), timeout=1):
                return time.monotonic() - t0
        except OSError:
            time.sleep(0.01)  # poll interval of a readiness loop with a deadline
    raise AssertionError(f"MQTT not accepting after {deadline_s} s:\n{b.log_tail()}")


def test_a_session_is_whole_for_a_client_connecting_at_the_first_accept(broker_factory: Any) -> None:
    b = broker_factory([])
    filler = _filler_sessions(b, FILLER_SESSIONS)
    client_id = cid()
    a = Paho(b.host, b.mqtt_port, client_id, clean=False)
    assert a.subscribe("boot/#", 1) == [1]
    a.close()
    pub = Paho(b.host, b.mqtt_port, cid())
    for i in range(QUEUED):
        pub.publish(f"boot/{i}", str(i).encode(), 1)  # each PUBACKed only once durable
    pub.close()
    for restart in ("stop", "kill9"):
        b.stop() if restart == "stop" else b.kill9()
        b.spawn()
        _connect_at_first_accept(b)
        a = Paho(b.host, b.mqtt_port, client_id, clean=False)
        try:
            assert a.present is True, restart
            got = sorted(int(m.payload) for m in a.take(QUEUED))
            assert got == list(range(QUEUED)), restart
        finally:
            a.close()
        # the next round needs them queued again
        pub = Paho(b.host, b.mqtt_port, cid())
        for i in range(QUEUED):
            pub.publish(f"boot/{i}", str(i).encode(), 1)
        pub.close()
    # a filler session came back too
    r = Raw(b.host, b.mqtt_port, login(f"{filler}-{FILLER_SESSIONS - 1}", clean=False))
    assert r.connack() == (1, 0)
    r.close()
    assert "Traceback" not in b.log_text()
