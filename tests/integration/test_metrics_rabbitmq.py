"""RabbitMQ's metric names and endpoints on Skred: ``/metrics/per-object``, ``/metrics/detailed``
(the families Skred serves, the others left out), counts by ack mode in RabbitMQ's channel and
global counters, node names, and the capability RabbitMQ clients read. RabbitMQ's Overview
dashboard itself, through a real Prometheus, is ``test_metrics_dashboard.py``.
"""

from __future__ import annotations

import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ._support import SkredProcess, connect, unique, wait_until
from .test_mgmt_api import Api, metrics_port, pytestmark, start_mgmt_broker

__all__ = ["pytestmark"]


@pytest.fixture
def mb(tmp_path: Path) -> Iterator[SkredProcess]:
    b = start_mgmt_broker(tmp_path)
    yield b
    b.close()


def _scrape(b: SkredProcess, path: str) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port(b)}{path}", timeout=10) as resp:
        text: str = resp.read().decode()
    return text


def test_per_object_detailed_and_capabilities(mb: SkredProcess) -> None:
    conn = connect(mb)
    try:
        ch = conn.channel()
        qn = unique("po")
        ch.queue_declare(qn)
        ch.basic_publish("", qn, b"x")
        assert conn._impl.server_capabilities["consumer_priorities"] is True
        per_object = _scrape(mb, "/metrics/per-object")
        assert f'rabbitmq_queue_messages_ready{{queue="{qn}",vhost="/"}} 1.0' in per_object
        assert "rabbitmq_identity_info{" in per_object
        detailed = _scrape(mb, "/metrics/detailed?family=queue_coarse_metrics&family=queue_consumer_count"
                               "&vhost=%2F")
        assert f'rabbitmq_detailed_queue_messages_ready{{queue="{qn}",vhost="/"}} 1.0' in detailed
        assert f'rabbitmq_detailed_queue_consumers{{queue="{qn}",vhost="/"}} 0.0' in detailed
        assert "skred_detailed_queue_messages_ready" in detailed  # Skred's own names stay
        # a family Skred does not serve is left out, as RabbitMQ leaves out the ones it lacks:
        # the scrape still answers 200 with the rest
        mixed = _scrape(mb, "/metrics/detailed?family=queue_coarse_metrics&family=exchange_metrics"
                            "&family=no_such_family&vhost=%2F")
        assert f'rabbitmq_detailed_queue_messages_ready{{queue="{qn}",vhost="/"}} 1.0' in mixed
        assert 'rabbitmq_endpoint="detailed"' in mixed
        assert 'rabbitmq_endpoint="per-object"' in per_object
        assert 'rabbitmq_endpoint="aggregated"' in _scrape(mb, "/metrics")
        other = _scrape(mb, "/metrics/detailed?family=queue_coarse_metrics&vhost=no-such-vhost")
        assert qn not in other
        aggregated = _scrape(mb, "/metrics")
        assert "skred_queue_messages_ready" in aggregated and "rabbitmq_queue_messages_ready " in aggregated
        api = Api(mb.mgmt_port)
        assert api.call("GET", "/metrics/per-object")[0] == 200
    finally:
        conn.close()


def _counter(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in the scrape")


def test_deliveries_and_gets_counted_by_ack_mode(mb: SkredProcess) -> None:
    """As RabbitMQ: autoack consumer deliveries and gets in ``..._delivered_total`` and
    ``..._get_total``, manual-ack ones in the ``_ack_total`` variants."""
    names = ("rabbitmq_channel_messages_delivered_total", "rabbitmq_channel_messages_delivered_ack_total",
             "rabbitmq_channel_get_total", "rabbitmq_channel_get_ack_total")
    before = {n: _counter(_scrape(mb, "/metrics"), n) for n in names}
    conn = connect(mb)
    try:
        ch = conn.channel()
        qn = unique("am")
        ch.queue_declare(qn)
        for _ in range(10):
            ch.basic_publish("", qn, b"x")
        for no_ack in (True, True, True, False):  # 3 autoack gets, 1 manual
            method, _props, _body = ch.basic_get(qn, auto_ack=no_ack)
            if not no_ack:
                ch.basic_ack(method.delivery_tag)
        got: list[int] = []
        tag = ch.basic_consume(qn, lambda c, m, p, body: got.append(1), auto_ack=True)
        wait_until(lambda: (conn.process_data_events(0.05), len(got) == 6)[1], 15, "6 autoack deliveries")
        ch.basic_cancel(tag)
        for _ in range(2):
            ch.basic_publish("", qn, b"y")
        acked: list[int] = []
        ch.basic_consume(qn, lambda c, m, p, body: (c.basic_ack(m.delivery_tag), acked.append(1)))
        wait_until(lambda: (conn.process_data_events(0.05), len(acked) == 2)[1], 15, "2 acked deliveries")
        after = {n: _counter(_scrape(mb, "/metrics"), n) for n in names}
    finally:
        conn.close()
    delta = {n: after[n] - before[n] for n in names}
    assert delta == {"rabbitmq_channel_messages_delivered_total": 6,
                     "rabbitmq_channel_messages_delivered_ack_total": 2,
                     "rabbitmq_channel_get_total": 3, "rabbitmq_channel_get_ack_total": 1}, delta


def _identity(b: SkredProcess) -> str:
    for line in _scrape(b, "/metrics").splitlines():
        if line.startswith("rabbitmq_identity_info{"):
            labels = dict(part.split("=", 1) for part in line[line.index("{") + 1:line.index("}")].split(","))
            return labels["rabbitmq_node"].strip('"')
    raise AssertionError("no rabbitmq_identity_info")


def test_nodes_on_one_host_have_unique_names(mb: SkredProcess, tmp_path: Path) -> None:
    """RabbitMQ-style ``name@host`` node names, unique per node on one host (by AMQP port unless
    configured), the same in /api/nodes, /api/overview, the queue listing and metric labels."""
    other = start_mgmt_broker(tmp_path / "other", ["--node-name", "rabbit-b"])
    try:
        names = []
        for b in (mb, other):
            api = Api(b.mgmt_port)
            conn = connect(b)
            qn = unique("nn")
            conn.channel().queue_declare(qn)
            overview = api.get("/api/overview")["node"]
            nodes = [n["name"] for n in api.get("/api/nodes")]
            assert nodes == [overview]
            assert api.get(f"/api/nodes/{urllib.parse.quote(overview, safe='')}")["name"] == overview
            assert api.get(f"/api/queues/%2F/{qn}")["node"] == overview
            assert _identity(b) == overview
            # a lone node's cluster is named after the node (RabbitMQ's default cluster_name)
            assert api.get("/api/cluster-name")["name"] == overview
            conn.close()
            names.append(overview)
        host = names[0].split("@", 1)[1]
        assert names[0] == f"skred-{mb.port}@{host}"  # not the default port: the port tells them apart
        assert names[1] == f"rabbit-b@{host}"
    finally:
        other.close()


GLOBAL = "rabbitmq_global_messages_"


def test_global_counters_count_what_rabbitmq_counts(mb: SkredProcess) -> None:
    """``rabbitmq_global_*`` as RabbitMQ's ``rabbit_global_counters``: received (and with
    confirms), routed once per queue reached, unroutable dropped or returned, confirmed,
    deliveries and gets by ack mode, empty gets, redeliveries, acks; the publishers and
    consumers gauges; the body size histogram in RabbitMQ's buckets."""
    counters = ("received", "received_confirm", "routed", "unroutable_dropped", "unroutable_returned",
                "confirmed", "delivered", "delivered_consume_manual_ack", "delivered_consume_auto_ack",
                "delivered_get_manual_ack", "delivered_get_auto_ack", "get_empty", "redelivered",
                "acknowledged")
    sizes = ('rabbitmq_message_size_bytes_bucket{le="100.0",protocol="amqp091"}',
             'rabbitmq_message_size_bytes_bucket{le="1000.0",protocol="amqp091"}',
             'rabbitmq_message_size_bytes_bucket{le="+Inf",protocol="amqp091"}',
             'rabbitmq_message_size_bytes_sum{protocol="amqp091"}')

    def read() -> dict[str, float]:
        text = _scrape(mb, "/metrics")
        out = {c: _counter(text, f"{GLOBAL}{c}_total") for c in counters}
        out.update({s: _counter(text, s) for s in sizes})
        return out

    before = read()
    conn = connect(mb)
    try:
        plain = conn.channel()
        confirmed = conn.channel()
        confirmed.confirm_delivery()
        qn, fan, a, b = unique("gc"), unique("fan"), unique("fa"), unique("fb")
        plain.queue_declare(qn)
        plain.exchange_declare(fan, "fanout")
        for q in (a, b):
            plain.queue_declare(q, exclusive=True)
            plain.queue_bind(q, fan)
        for body in (b"x" * 10, b"x" * 200, b"x" * 2000):
            confirmed.basic_publish("", qn, body)  # 3 received with confirms, routed, confirmed
        plain.basic_publish(fan, "", b"y")  # 1 received, routed to 2 queues
        plain.basic_publish("", unique("nowhere"), b"z")  # dropped
        returned: list[int] = []
        plain.add_on_return_callback(lambda *a: returned.append(1))
        plain.basic_publish("", unique("nowhere"), b"z", mandatory=True)  # returned
        wait_until(lambda: (conn.process_data_events(0.05), bool(returned))[1], 10, "the basic.return")
        gauges = _scrape(mb, "/metrics")
        assert _counter(gauges, "rabbitmq_global_publishers") == 2  # both channels published
        method, _p, _b = plain.basic_get(qn, auto_ack=True)  # get, auto ack
        assert method is not None
        method, _p, _b = plain.basic_get(qn, auto_ack=False)  # get, manual ack ...
        assert method is not None
        plain.basic_nack(method.delivery_tag, requeue=True)  # ... requeued
        got: list[Any] = []
        plain.basic_consume(qn, lambda c, m, p, body: got.append(m), auto_ack=False)  # the redelivery
        wait_until(lambda: (conn.process_data_events(0.05), len(got) == 2)[1], 10, "2 manual-ack deliveries")
        assert sorted(m.redelivered for m in got) == [False, True]
        for m in got:
            plain.basic_ack(m.delivery_tag)  # 2 acks
        plain.basic_consume(a, lambda c, m, p, body: got.append(m), auto_ack=True)
        wait_until(lambda: (conn.process_data_events(0.05), len(got) == 3)[1], 10, "an auto-ack delivery")
        assert _counter(_scrape(mb, "/metrics"), "rabbitmq_global_consumers") == 2
        method, _p, _b = plain.basic_get(b, auto_ack=False)  # get, manual ack, acked
        assert method is not None
        plain.basic_ack(method.delivery_tag)
        assert plain.basic_get(b)[0] is None  # get-empty
        conn.process_data_events(0.1)
        after = read()
    finally:
        conn.close()
    delta = {k: after[k] - before[k] for k in before}
    assert delta == {
        "received": 6, "received_confirm": 3, "routed": 5, "unroutable_dropped": 1, "unroutable_returned": 1,
        "confirmed": 3, "delivered": 6, "delivered_consume_manual_ack": 2, "delivered_consume_auto_ack": 1,
        "delivered_get_manual_ack": 2, "delivered_get_auto_ack": 1, "get_empty": 1, "redelivered": 1,
        "acknowledged": 3,
        sizes[0]: 4, sizes[1]: 5, sizes[2]: 6, sizes[3]: 10 + 200 + 2000 + 1 + 1 + 1,
    }, delta
