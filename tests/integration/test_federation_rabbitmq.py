"""Federation between Skred and a real RabbitMQ 3.10 (Debian's ``rabbitmq-server``, with its own
``rabbitmq_federation`` plugin enabled): Skred federating from RabbitMQ (exchange and queue), and
RabbitMQ's own plugin federating from Skred.

One RabbitMQ node and one Skred for the module, booted in parallel (the node takes 5-15 s). Without
RabbitMQ installed the module skips with the reason, unless ``SKRED_REQUIRE_RABBITMQ`` is set
(``.ci/run`` sets it): then it fails, so CI cannot pass by skipping.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pika
import pytest

from ._support import SkredProcess, is_external, stop_group, unique, wait_until
from .conformance._rabbit import RabbitProcess, booted_beside, require
from .test_federation import LINK_DEADLINE, consume_n, count, drain, links, policy
from .test_mgmt_api import Api


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
    require()
    root: Path = tmp_path_factory.mktemp("fedrabbit")
    rabbit = FederatingRabbit(root / "rabbitmq", name="skredfed")
    with booted_beside(rabbit, root) as (skred,):
        yield rabbit, skred


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
        # through RabbitMQ's own x-federation-upstream exchange, which counts the hops up there
        bound = [b for b in _rabbit_api(rabbit).get(f"/api/exchanges/%2F/{x}/bindings/source")
                 if b["routing_key"] == "k"]
        assert bound[0]["destination_type"] == "exchange", bound
        helper = _rabbit_api(rabbit).get(f"/api/exchanges/%2F/{quote(bound[0]['destination'], safe='')}")
        assert (helper["type"], helper["internal"], helper["arguments"]["x-max-hops"]) == \
            ("x-federation-upstream", True, 1), helper
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
        assert consume_n(sc, sch, qn, 10, prefetch=4) == [f"q{i}".encode() for i in range(10)]
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
        assert consume_n(rc, rch, qn, 10, prefetch=4) == [f"s{i}".encode() for i in range(10)]
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


# ------------------------------------------- migration (docs/migrating-from-rabbitmq.md)
MIGRATING_TASKS = '''
import os, time
from celery import Celery

app = Celery("migrating", broker=os.environ["MIGRATE_BROKER"])
app.conf.update(task_acks_late=True, worker_prefetch_multiplier=1, task_ignore_result=True,
                broker_connection_retry_on_startup=True, broker_heartbeat=0,
                worker_hijack_root_logger=False)


@app.task
def work(tag):
    time.sleep(0.05)
    with open(os.environ["MIGRATE_LOG"], "a") as fh:
        fh.write(f"{tag} {os.environ['MIGRATE_WORKER']}\\n")
'''


class CeleryWorker:
    def __init__(self, tmp: Path, url: str, name: str) -> None:
        self.tmp, self.url, self.name = tmp, url, name
        self.proc: subprocess.Popen[bytes] | None = None

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update({"MIGRATE_BROKER": self.url, "MIGRATE_LOG": str(self.tmp / "done.log"),
                    "MIGRATE_WORKER": self.name, "PYTHONPATH": str(self.tmp)})
        return env

    def start(self) -> None:
        log = open(self.tmp / f"{self.name}.log", "wb")  # noqa: SIM115 - owned by the child
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "migrating", "worker", "-c", "1", "-P", "solo",
             "-l", "INFO", "--without-gossip", "--without-mingle", "--without-heartbeat",
             "-n", f"{self.name}@%h"],
            cwd=self.tmp, env=self.env(), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True)
        log.close()

    def stop(self) -> None:
        """A warm shutdown (SIGTERM): the task running finishes and is acked, the rest goes back."""
        stop_group(self.proc, 30)


def produce(tmp: Path, url: str, tags: list[str]) -> None:
    env = dict(os.environ, MIGRATE_BROKER=url, MIGRATE_LOG=str(tmp / "done.log"), MIGRATE_WORKER="-",
               PYTHONPATH=str(tmp))
    code = f"from migrating import work\nfor t in {tags!r}:\n    work.delay(t)\n"
    subprocess.run([sys.executable, "-c", code], cwd=tmp, env=env, check=True, timeout=60,
                   capture_output=True)


def consumers(api: Api, queue: str) -> int:
    status, body, _ = api.call("GET", f"/api/queues/%2F/{queue}")
    return int(body.get("consumers", 0)) if status == 200 else 0


def done(tmp: Path) -> list[tuple[str, str]]:
    path = tmp / "done.log"
    if not path.exists():
        return []
    return [(w[0], w[1]) for w in (line.split() for line in path.read_text().splitlines()) if len(w) == 2]


@pytest.mark.timeout(240)
def test_celery_moves_from_rabbitmq_to_skred_by_queue_federation(
        pair: tuple[FederatingRabbit, SkredProcess], tmp_path: Path) -> None:
    """The how-to of docs/migrating-from-rabbitmq.md, end to end: producers and workers of one
    Celery app move from RabbitMQ to Skred one by one while queue federation pulls what is left
    on RabbitMQ to Skred's workers. Every task runs, none twice, nothing stays behind."""
    rabbit, skred = pair
    api = Api(skred.mgmt_port)
    (tmp_path / "migrating.py").write_text(MIGRATING_TASKS)
    on_rabbit = f"amqp://guest:guest@{rabbit.host}:{rabbit.port}//"
    on_skred = f"amqp://guest:guest@{skred.host}:{skred.port}//"
    old, new = CeleryWorker(tmp_path, on_rabbit, "old"), CeleryWorker(tmp_path, on_skred, "new")
    try:
        # 1. all on RabbitMQ: a backlog, and a worker draining it
        produce(tmp_path, on_rabbit, [f"a{i}" for i in range(20)])
        old.start()
        wait_until(lambda: len(done(tmp_path)) >= 3, 60, "the old worker running tasks")
        # 2. Skred federates the app's queue from RabbitMQ (the queue as Celery declares it)
        set_upstream(api, "old-rabbit", f"amqp://guest:guest@{rabbit.host}:{rabbit.port}/%2F",
                     **{"prefetch-count": 5})
        policy(api, "/", {"federation-upstream": "old-rabbit"}, pattern="^celery$", apply_to="queues")
        # 3. a worker on Skred: its queue pulls from RabbitMQ whenever the worker has room
        new.start()
        wait_until(lambda: consumers(api, "celery") >= 1, 60, "the new worker consuming on Skred")
        # 4. producers switch one by one: one still publishes to RabbitMQ, one to Skred already
        produce(tmp_path, on_rabbit, [f"b{i}" for i in range(20)])
        produce(tmp_path, on_skred, [f"c{i}" for i in range(10)])
        wait_until(lambda: any(w == "new" and t[0] in "ab" for t, w in done(tmp_path)), 60,
                   "a task published to RabbitMQ run by the worker on Skred")
        # 5. the old worker stops (warm shutdown); what is left on RabbitMQ moves to Skred
        old.stop()
        want = {f"{p}{i}" for p, n in (("a", 20), ("b", 20), ("c", 10)) for i in range(n)}
        wait_until(lambda: {t for t, _ in done(tmp_path)} >= want, 120, "every task run")
        ran = [t for t, _ in done(tmp_path)]
        assert sorted(ran) == sorted(want), "a task ran twice"
        assert {w for _, w in done(tmp_path)} == {"old", "new"}
        # 6. nothing left behind on either broker
        rc, rch = channel(rabbit.host, rabbit.port)
        try:
            assert count(rch, "celery") == 0
        finally:
            rc.close()
        sc, sch = channel(skred.host, skred.port)
        try:
            wait_until(lambda: count(sch, "celery") == 0, LINK_DEADLINE, "Skred's queue empty")
        finally:
            sc.close()
        api.call("DELETE", "/api/policies/%2F/federate")
    finally:
        old.stop()
        new.stop()
