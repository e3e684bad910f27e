"""MQTT subscribers in the management API's consumer lists, as RabbitMQ's MQTT plugin shows them.

A real paho client subscribes at QoS 0 and QoS 1 with a persistent session; ``/api/consumers``,
``/api/consumers/{vhost}`` and the session queue's ``consumer_details`` list one consumer per
subscription queue: tag ``mqtt``, ``ack_required`` for QoS 1 only, the prefetch that bounds its
deliveries, and channel details with no channel (number 0, RabbitMQ's shape for a connection
without channels) that name the MQTT connection and its client id. The module runs against a
single node, the cluster's leader and through a follower (``cluster_modes``): the session queues
are durable. The module also holds the check that a publishing client's write permission,
which the session remembers between PUBLISHes (a regex search per message was a fifth of QoS 0
fan-in's time), is taken away the moment an operator revokes it.
"""

from __future__ import annotations

import urllib.parse
from typing import Any

import pytest

from broker.mqtt import packets as P

from ._support import Broker, is_external, unique, wait_until
from .test_mgmt_api import Api
from .test_mqtt import Paho, Raw, cid

pytestmark = [pytest.mark.skipif(is_external(), reason="needs the broker's MQTT port"),
              pytest.mark.cluster_modes]


def _api(b: Any) -> Api:
    api = Api(b.mgmt_port)
    api.base = f"http://{b.host}:{b.mgmt_port}"
    return api


def _mqtt_port(b: Any) -> int:
    node = getattr(b, "node", None)  # a cluster-mode target: the node's own MQTT port
    return int(node.mqtt_port if node is not None else b.mqtt_port)


def _of(items: list[dict[str, Any]], client_id: str) -> list[dict[str, Any]]:
    return sorted((c for c in items if c["channel_details"].get("client_id") == client_id),
                  key=lambda c: c["queue"]["name"])


def test_mqtt_subscriptions_are_listed_as_consumers(shared_broker: Broker) -> None:
    b, api, client_id = shared_broker, _api(shared_broker), cid()
    sub = Paho(b.host, _mqtt_port(b), client_id, clean=False)
    try:
        assert sub.subscribe("cons/zero/#", 0) == [0]
        assert sub.subscribe("cons/one/+", 1) == [1]
        found: list[dict[str, Any]] = []

        def listed() -> bool:
            status, items, _ = api.call("GET", "/api/consumers")
            found[:] = _of(items, client_id) if status == 200 else []
            return len(found) == 2
        wait_until(listed, 10, f"two MQTT consumers of {client_id} listed (found {found})")
        zero, one = found
        assert zero["queue"] == {"name": f"mqtt-subscription-{client_id}qos0", "vhost": "/"}
        assert one["queue"] == {"name": f"mqtt-subscription-{client_id}qos1", "vhost": "/"}
        assert (zero["consumer_tag"], one["consumer_tag"]) == ("mqtt", "mqtt")
        assert (zero["ack_required"], one["ack_required"]) == (False, True)
        assert one["prefetch_count"] == 10 and zero["prefetch_count"] == 0  # [mqtt] prefetch; QoS 0: none
        assert not zero["exclusive"] and zero["active"] and zero["activity_status"] == "up"
        status, conns, _ = api.call("GET", "/api/connections")
        conn = next(c for c in conns if c.get("client_properties", {}).get("client_id") == client_id)
        details = one["channel_details"]
        assert details["connection_name"] == conn["name"] and details["number"] == 0
        assert (details["user"], details["peer_host"], details["peer_port"]) == (
            "guest", conn["peer_host"], conn["peer_port"])
        # the vhost's list and the session queue's own details agree
        status, in_vhost, _ = api.call("GET", "/api/consumers/%2F")
        assert status == 200 and _of(in_vhost, client_id) == found
        quoted = urllib.parse.quote(f"mqtt-subscription-{client_id}qos1", safe="")
        status, q, _ = api.call("GET", f"/api/queues/%2F/{quoted}")
        assert status == 200 and q["consumers"] == 1
        assert [c["consumer_tag"] for c in q["consumer_details"]] == ["mqtt"]
        assert q["consumer_details"][0]["channel_details"]["client_id"] == client_id
        # an unknown vhost has no list
        status, _, _ = api.call("GET", "/api/consumers/nosuchvhost")
        assert status == 404
    finally:
        sub.close()
    wait_until(lambda: not _of(api.call("GET", "/api/consumers")[1], client_id), 10,
               "the consumers gone with their connection")
    cleanup = Paho(b.host, _mqtt_port(b), client_id, clean=True)  # the persistent session goes
    cleanup.close()


def test_a_revoked_write_permission_stops_the_next_publish(shared_broker: Broker) -> None:
    b, api = shared_broker, _api(shared_broker)
    user = unique("mqttwriter")
    quoted = urllib.parse.quote(user, safe="")
    assert api.call("PUT", f"/api/users/{quoted}", {"password": "pw", "tags": ""})[0] in (201, 204)
    grant = {"configure": ".*", "write": ".*", "read": ".*"}
    assert api.call("PUT", f"/api/permissions/%2F/{quoted}", grant)[0] in (201, 204)
    sub = Paho(b.host, _mqtt_port(b), cid())
    pub = Raw(b.host, _mqtt_port(b), P.Connect("MQTT", 4, True, 30, cid(), None, user, b"pw"))
    try:
        assert pub.connack() == (0, 0)
        assert sub.subscribe("perm/#", 1) == [1]
        for i in range(3):  # QoS 0 then QoS 1: the permission is checked and remembered
            pub.s.sendall(P.encode_publish("perm/a", b"ok%d" % i, i % 2, False, False, i + 1))
        got = [m.payload for m in sub.take(3)]
        assert sorted(got) == [b"ok0", b"ok1", b"ok2"]
        assert api.call("PUT", f"/api/permissions/%2F/{quoted}", {**grant, "write": ""})[0] in (201, 204)
        pub.s.sendall(P.encode_publish("perm/a", b"refused", 0, False, False, 0))
        assert pub.closed_within(10), "a publish without write permission: the connection closes"
        sub.publish("perm/a", b"after", 1)
        assert [m.payload for m in sub.take(1)] == [b"after"], "the refused message was routed"
    finally:
        pub.close()
        sub.close()
        api.call("DELETE", f"/api/users/{quoted}")
