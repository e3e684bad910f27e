"""Federation between Skred and a real RabbitMQ 3.10 (Debian's ``rabbitmq-server``, with its own
``rabbitmq_federation`` plugin enabled): Skred federating from RabbitMQ (exchange and queue), and
RabbitMQ's own plugin federating from Skred.

One RabbitMQ node and one Skred for the module, booted in parallel (the node takes 5-15 s). Without
RabbitMQ installed the module skips with the reason, unless ``SKRED_REQUIRE_RABBITMQ`` is set
(``.ci/run`` sets it): then it fails, so CI cannot pass by skipping.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pika
import pytest

from ._support import SkredProcess, free_port, is_external, unique, wait_until
from .conformance._rabbit import RabbitProcess, missing
from .test_federation import LINK_DEADLINE, count, drain, links, policy
from .test_mgmt_api import Api, http_ready


class FederatingRabbit(RabbitProcess):
    """A private RabbitMQ node with the federation plugin (and its management API) enabled."""

    def _write_config(self) -> dict[str, str]:
        env = super()._write_config()
        (self.root / "enabled_plugins").write_text(
            "[rabbitmq_management,rabbitmq_federation,rabbitmq_federation_management].\n")
        return env


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[FederatingRabbit, SkredProcess]]:
    if is_external():
        pytest.skip("starts its own brokers")
    why = missing()
    if why:
        if os.environ.get("SKRED_REQUIRE_RABBITMQ"):
            pytest.fail(f"SKRED_REQUIRE_RABBITMQ is set but {why}")
        pytest.skip(why)
    root: Path = tmp_path_factory.mktemp("fedrabbit")
    rabbit = FederatingRabbit(root / "rabbitmq", name="skredfed")
    skred = SkredProcess(root / "skred-data", ["--mgmt-metrics-port", str(free_port())])
    try:
        rabbit.spawn()
        skred.start()
        problem = rabbit.wait_ready()
        if problem:
            pytest.fail(problem)
        wait_until(lambda: http_ready(skred.mgmt_port), 30, "Skred's management listener")
        yield rabbit, skred
    finally:
        skred.close()
        rabbit.close()


def channel(host: str, port: int) -> tuple[pika.BlockingConnection, Any]:
    c = pika.BlockingConnection(pika.URLParameters(f"amqp://guest:guest@{host}:{port}/%2F"))
    return c, c.channel()


def set_upstream(api: Api, name: str, uri: str, **extra: Any) -> None:
    status, body, _ = api.call("PUT", f"/api/parameters/federation-upstream/%2F/{name}",
                               {"value": {"uri": uri, "reconnect-delay": 1, **extra}})
    assert status in (201, 204), body


def test_skred_federates_exchange_and_queue_from_rabbitmq(
        pair: tuple[FederatingRabbit, SkredProcess]) -> None:
    rabbit, skred = pair
    api = Api(skred.mgmt_port)
    x, qn = unique("fed.x"), unique("fed.q")
    rc, rch = channel(rabbit.host, rabbit.port)
    sc, sch = channel(skred.host, skred.port)
    try:
        rch.exchange_declare(x, "direct", durable=True)
        rch.queue_declare(qn, durable=True)
        sch.exchange_declare(x, "direct", durable=True)
        sch.queue_declare(qn, durable=True)
        sink = unique("sink")
        sch.queue_declare(sink, durable=True)
        sch.queue_bind(sink, x, "k")
        set_upstream(api, "rabbit", f"amqp://guest:guest@{rabbit.host}:{rabbit.port}/%2F")
        policy(api, "/", {"federation-upstream": "rabbit"}, pattern=f"^({x}|{qn})$")
        wait_until(lambda: sum(lk["status"] == "running" for lk in links(api, "/")) == 2, LINK_DEADLINE,
                   "both links running")
        # the upstream queue RabbitMQ holds for the exchange link is bound with the mirrored key
        wait_until(lambda: any(b["routing_key"] == "k" for b in _rabbit_api(rabbit).call(
            "GET", f"/api/exchanges/%2F/{x}/bindings/source")[1]), LINK_DEADLINE, "binding on RabbitMQ")
        rch.confirm_delivery()
        for i in range(10):
            rch.basic_publish(x, "k", f"x{i}".encode(), pika.BasicProperties(delivery_mode=2))
            rch.basic_publish("", qn, f"q{i}".encode(), pika.BasicProperties(delivery_mode=2))
        wait_until(lambda: count(sch, sink) == 10, LINK_DEADLINE, "exchange-federated messages")
        got = drain(sch, sink)
        assert [b for b, _ in got] == [f"x{i}".encode() for i in range(10)]
        assert got[0][1].headers["x-received-from"][0]["exchange"] == x
        # queue federation: nothing moves until a Skred consumer wants it
        assert count(sch, qn) == 0
        bodies: list[bytes] = []
        sch.basic_qos(prefetch_count=4)
        sch.basic_consume(qn, lambda ch, m, _p, body: (bodies.append(body), ch.basic_ack(m.delivery_tag)))
        deadline = time.monotonic() + LINK_DEADLINE
        while len(bodies) < 10 and time.monotonic() < deadline:
            sc.process_data_events(0.05)
        assert bodies == [f"q{i}".encode() for i in range(10)]
        wait_until(lambda: count(rch, qn) == 0, LINK_DEADLINE, "RabbitMQ's queue drained")
        api.call("DELETE", "/api/policies/%2F/federate")
        wait_until(lambda: not links(api, "/"), LINK_DEADLINE, "links stopped")
    finally:
        rc.close()
        sc.close()


def _rabbit_api(rabbit: FederatingRabbit) -> Api:
    assert rabbit.mgmt_port is not None
    return Api(rabbit.mgmt_port)


def test_rabbitmq_federation_plugin_federates_a_queue_from_skred(
        pair: tuple[FederatingRabbit, SkredProcess]) -> None:
    """RabbitMQ's own plugin, Skred as its upstream: a consumer on RabbitMQ drains Skred's queue."""
    rabbit, skred = pair
    rapi = _rabbit_api(rabbit)
    qn = unique("fed.rq")
    rc, rch = channel(rabbit.host, rabbit.port)
    sc, sch = channel(skred.host, skred.port)
    try:
        sch.queue_declare(qn, durable=True)
        sch.confirm_delivery()
        for i in range(10):
            sch.basic_publish("", qn, f"s{i}".encode(), pika.BasicProperties(delivery_mode=2))
        rch.queue_declare(qn, durable=True)
        set_upstream(rapi, "skred", f"amqp://guest:guest@{skred.host}:{skred.port}/%2F")
        policy(rapi, "/", {"federation-upstream": "skred"}, pattern=f"^{qn}$", apply_to="queues")
        wait_until(lambda: any(lk.get("status") == "running" for lk in rapi.call(
            "GET", "/api/federation-links/%2F")[1]), 60, "RabbitMQ's link running")
        bodies: list[bytes] = []
        rch.basic_qos(prefetch_count=4)
        rch.basic_consume(qn, lambda ch, m, _p, body: (bodies.append(body), ch.basic_ack(m.delivery_tag)))
        deadline = time.monotonic() + LINK_DEADLINE
        while len(bodies) < 10 and time.monotonic() < deadline:
            rc.process_data_events(0.05)
        assert bodies == [f"s{i}".encode() for i in range(10)]
        wait_until(lambda: count(sch, qn) == 0, LINK_DEADLINE, "Skred's queue drained")
        rapi.call("DELETE", "/api/policies/%2F/federate")
    finally:
        rc.close()
        sc.close()


def test_rabbitmq_federation_plugin_federates_an_exchange_from_skred(
        pair: tuple[FederatingRabbit, SkredProcess]) -> None:
    rabbit, skred = pair
    rapi = _rabbit_api(rabbit)
    x = unique("fed.rx")
    rc, rch = channel(rabbit.host, rabbit.port)
    sc, sch = channel(skred.host, skred.port)
    try:
        sch.exchange_declare(x, "topic", durable=True)
        rch.exchange_declare(x, "topic", durable=True)
        sink = unique("sink")
        rch.queue_declare(sink, durable=True)
        rch.queue_bind(sink, x, "t.#")
        set_upstream(rapi, "skredx", f"amqp://guest:guest@{skred.host}:{skred.port}/%2F")
        policy(rapi, "/", {"federation-upstream": "skredx"}, pattern=f"^{x}$", apply_to="exchanges")
        wait_until(lambda: any(lk.get("status") == "running" for lk in rapi.call(
            "GET", "/api/federation-links/%2F")[1]), 60, "RabbitMQ's link running")
        wait_until(lambda: any(b["routing_key"] == "t.#" for b in Api(skred.mgmt_port).call(
            "GET", f"/api/exchanges/%2F/{x}/bindings/source")[1]), LINK_DEADLINE, "binding on Skred")
        sch.confirm_delivery()
        for i in range(10):
            sch.basic_publish(x, "t.a", f"r{i}".encode(), pika.BasicProperties(delivery_mode=2))
        wait_until(lambda: count(rch, sink) == 10, LINK_DEADLINE, "messages on RabbitMQ")
        assert [b for b, _ in drain(rch, sink)] == [f"r{i}".encode() for i in range(10)]
        rapi.call("DELETE", "/api/policies/%2F/federate")
    finally:
        rc.close()
        sc.close()
