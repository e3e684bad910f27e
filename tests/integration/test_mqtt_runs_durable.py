"""MQTT publish runs into a persistent session's durable queue, on a single node, the cluster's
leader and through a follower (``cluster_modes``): a burst of QoS 0 PUBLISHes (taken as runs,
broker/mqtt/server.py ``_run``) for an offline persistent session is kept in its queue and
delivered, whole and in order, when the session comes back."""

from __future__ import annotations

from typing import Any

import pytest

from ._support import is_external
from .conformance._mqtt_wire import MRun
from .test_mqtt_runs import encode

pytestmark = [pytest.mark.skipif(is_external(), reason="needs the broker's MQTT port"),
              pytest.mark.cluster_modes]


def _mqtt_port(b: Any) -> int:
    node = getattr(b, "node", None)  # a cluster-mode target: the node's own MQTT port
    return int(node.mqtt_port if node is not None else b.mqtt_port)


def test_a_burst_for_an_offline_persistent_session_is_kept_whole(shared_broker: Any) -> None:
    run = MRun("skred", shared_broker.host, _mqtt_port(shared_broker), 4)
    try:
        cid = run.client_id("sess")
        sub = run.client("sub", client_id=cid, clean=False)
        sub.subscribe(run.topic("burst/#"), qos=1)
        sub.sock.close()  # offline: the session's queue keeps what comes
        pub = run.client("pub")
        msgs = [("burst/t", b"b%03d" % i, 0, False, False) for i in range(60)]
        pub.send(b"".join(encode(run, m, 0) for m in msgs))
        pub.publish(run.topic("burst/t"), b"<last>", qos=1)  # acknowledged: the burst is in before it
        back = run.client("back", client_id=cid, clean=False)
        assert back.connack[2] == 1, back.connack  # session present
        got = [back.next(log=False) for _ in range(61)]
        assert [r[3] for r in got] == [m[1] for m in msgs] + [b"<last>"]
        assert [r[4] for r in got] == [0] * 60 + [1]  # QoS 0 stays QoS 0
        back.send(bytes((0xE0, 0)))  # DISCONNECT; then the session goes with a clean login
        run.client("clear", client_id=cid, clean=True)
    finally:
        run.close()
