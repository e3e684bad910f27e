"""Values of the management API's statistics (the conformance harness compares only their keys).

A real broker and real pika clients: exchange publish_in/publish_out, per-vhost and node
get/redeliver, ``*_details`` rates sampled every 5 s (RabbitMQ's default interval), churn rates, connection
byte and packet counters, consumer utilisation, quorum queue leader/members/online.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pika
import pika.exceptions
import pytest

from ._support import SkredProcess, connect, unique, wait_until
from .test_mgmt_api import Api, q, start_mgmt_broker


@pytest.fixture(scope="module")
def sb(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SkredProcess]:
    b = start_mgmt_broker(tmp_path_factory.mktemp("stats"))
    yield b
    b.close()


def _vhost(api: Api) -> str:
    vh = unique("vh")
    api.ok("PUT", f"/api/vhosts/{q(vh)}", {})
    api.ok("PUT", f"/api/permissions/{q(vh)}/guest", {"configure": ".*", "write": ".*", "read": ".*"})
    return vh


def _eventually(api: Api, path: str, pred: Any, what: str) -> dict[str, Any]:
    seen: dict[str, Any] = {}

    def check() -> bool:
        seen.update(api.get(path))
        return bool(pred(seen))

    wait_until(check, 30, what)
    return seen


def test_counters_and_rates(sb: SkredProcess) -> None:
    api = Api(sb.mgmt_port)
    vh = _vhost(api)
    churn_before = api.get("/api/overview")["churn_rates"]
    conn = connect(sb, virtual_host=vh)
    try:
        ch = conn.channel()
        ch.exchange_declare("fan", "fanout", auto_delete=False)
        for name in ("a", "b"):
            ch.queue_declare(name)
            ch.queue_bind(name, "fan")
        ch.queue_declare("empty-one")
        for _ in range(10):
            ch.basic_publish("fan", "", b"x" * 100)
        ch.basic_publish("fan", "", b"y")
        # a get, a requeue, the same message again: a redelivery
        m, _, _ = ch.basic_get("a")
        assert m is not None
        ch.basic_nack(m.delivery_tag, requeue=True)
        m2, _, _ = ch.basic_get("a", auto_ack=True)
        assert m2 is not None and m2.redelivered
        assert ch.basic_get("b", auto_ack=True)[0] is not None
        assert ch.basic_get("empty-one", auto_ack=True)[0] is None
        ch.confirm_delivery()
        ch.basic_publish("amq.direct", "nowhere", b"dropped")
        with pytest.raises(pika.exceptions.UnroutableError):
            ch.basic_publish("amq.direct", "nowhere", b"returned", mandatory=True)

        ex = api.get(f"/api/exchanges/{q(vh)}/fan")["message_stats"]
        assert ex["publish_in"] == 11 and ex["publish_out"] == 22, ex
        # the rate: 11 messages within the 5 s window, shown after the next sample
        ex = _eventually(api, f"/api/exchanges/{q(vh)}/fan",
                         lambda e: e["message_stats"]["publish_in_details"]["rate"] > 0,
                         "a publish_in rate")["message_stats"]
        assert 11 / 10 <= ex["publish_in_details"]["rate"] <= 11.0 + 1e-9, ex
        rate_in = ex["publish_in_details"]["rate"]
        assert ex["publish_out_details"]["rate"] == pytest.approx(2 * rate_in, abs=0.02)

        stats = api.get(f"/api/vhosts/{q(vh)}")["message_stats"]
        assert (stats["publish"], stats["get"], stats["get_no_ack"], stats["redeliver"],
                stats["deliver_get"], stats["deliver"]) == (22, 1, 2, 1, 3, 0), stats
        assert (stats["confirm"], stats["drop_unroutable"], stats["return_unroutable"]) == (2, 1, 1)
        assert api.get(f"/api/queues/{q(vh)}/empty-one")["message_stats"]["get_empty"] == 1
        qa = api.get(f"/api/queues/{q(vh)}/a")
        assert (qa["message_stats"]["get"], qa["message_stats"]["get_no_ack"],
                qa["message_stats"]["redeliver"]) == (1, 1, 1)
        assert qa["messages"] == 10 and "rate" in qa["messages_details"]
        # the node's redelivered count is summed from the queues by the sampler's pass
        node = _eventually(api, "/api/overview", lambda o: o["message_stats"]["redeliver"] >= 1,
                           "the node's redeliver count")["message_stats"]
        assert node["get"] >= 1 and node["get_no_ack"] >= 2

        # a rate falls back to 0 once the window has passed without traffic
        _eventually(api, f"/api/exchanges/{q(vh)}/fan",
                    lambda e: e["message_stats"]["publish_in_details"]["rate"] == 0,
                    "the publish_in rate back at 0")

        c = next(c for c in api.get(f"/api/vhosts/{q(vh)}/connections"))
        assert c["recv_oct"] > 11 * 100 and c["recv_cnt"] >= 1
        assert c["send_oct"] > 0 and c["send_cnt"] >= 1
        v = api.get(f"/api/vhosts/{q(vh)}")
        assert v["recv_oct"] >= c["recv_oct"] and "rate" in v["recv_oct_details"]
    finally:
        conn.close()
    churn = _eventually(api, "/api/overview",
                        lambda o: o["churn_rates"]["connection_closed"]
                        > churn_before["connection_closed"], "connection_closed")["churn_rates"]
    assert churn["connection_created"] >= churn_before["connection_created"] + 1
    assert churn["channel_created"] >= churn_before["channel_created"] + 1
    assert churn["queue_created"] >= churn_before["queue_created"] + 2
    assert "rate" in churn["queue_created_details"]
    n = api.get("/api/nodes")[0]
    assert n["connection_created"] == churn["connection_created"] and "rate" in n["mem_used_details"]
    api.ok("DELETE", f"/api/vhosts/{q(vh)}")


def test_consumer_utilisation(sb: SkredProcess) -> None:
    api = Api(sb.mgmt_port)
    vh = _vhost(api)
    conn = connect(sb, virtual_host=vh)
    try:
        ch = conn.channel()
        ch.queue_declare("u")
        assert api.get(f"/api/queues/{q(vh)}/u")["consumer_utilisation"] is None  # no consumer
        ch.basic_qos(prefetch_count=1)
        ch.basic_consume("u", lambda *a: None)  # never acks: one message fills its prefetch
        _eventually(api, f"/api/queues/{q(vh)}/u", lambda x: x["consumer_utilisation"] == 1.0,
                    "utilisation 1 for a consumer with room")
        for _ in range(3):
            ch.basic_publish("", "u", b"x")
        conn.process_data_events(time_limit=0.5)
        _eventually(api, f"/api/queues/{q(vh)}/u", lambda x: x["consumer_utilisation"] == 0.0,
                    "utilisation 0 for a consumer held by its prefetch")
    finally:
        conn.close()
    api.ok("DELETE", f"/api/vhosts/{q(vh)}")


def test_quorum_queue_leader_and_members(sb: SkredProcess) -> None:
    api = Api(sb.mgmt_port)
    vh = _vhost(api)
    api.ok("PUT", f"/api/queues/{q(vh)}/qq", {"durable": True, "arguments": {"x-queue-type": "quorum"}})
    api.ok("PUT", f"/api/queues/{q(vh)}/cq", {"durable": True})
    node = api.get("/api/overview")["node"]
    qq = api.get(f"/api/queues/{q(vh)}/qq")
    assert (qq["leader"], qq["members"], qq["online"]) == (node, [node], [node])
    assert "leader" not in api.get(f"/api/queues/{q(vh)}/cq")
    api.ok("DELETE", f"/api/vhosts/{q(vh)}")
