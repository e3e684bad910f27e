"""RabbitMQ's Grafana "RabbitMQ-Overview" dashboard against Skred, through a real Prometheus.

A real ``prometheus`` server (Debian's package, which ``.ci/run`` installs) scrapes Skred's open
metrics port every second; every query of the dashboard (its panels' PromQL, with the template
variables filled as Grafana fills them from ``rabbitmq_identity_info``) must return data. The
queries are the dashboard's own shapes: a sum joined on ``instance`` with the identity info, per
node (``by(rabbitmq_node)``), and rates over 60 s. Also: ``/metrics/per-object`` and the
``/metrics/detailed`` query shape, and the capability RabbitMQ clients read.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pika
import pytest

from ._support import SkredProcess, connect, free_port, unique, wait_until
from .test_mgmt_api import Api, metrics_port, pytestmark, start_mgmt_broker

__all__ = ["pytestmark"]

PROMETHEUS = shutil.which("prometheus")

JOIN = ('* on(instance) group_left({labels}) rabbitmq_identity_info'
        '{{rabbitmq_cluster="$rabbitmq_cluster", namespace="$namespace"}}')
CLUSTER_JOIN = JOIN.format(labels="rabbitmq_cluster")
NODE_JOIN = JOIN.format(labels="rabbitmq_cluster, rabbitmq_node")

# Singlestat panels: one number for the cluster.
SINGLESTATS = [
    f"sum(rabbitmq_queue_messages_ready {CLUSTER_JOIN})",
    f"sum(rate(rabbitmq_channel_messages_published_total[60s]) {CLUSTER_JOIN})",
    f"sum(rabbitmq_channels {CLUSTER_JOIN}) - sum(rabbitmq_channel_consumers {CLUSTER_JOIN})",
    f"sum(rabbitmq_connections {CLUSTER_JOIN})",
    f"sum(rabbitmq_queues {CLUSTER_JOIN})",
    f"sum(rabbitmq_queue_messages_unacked {CLUSTER_JOIN})",
    " +\n".join(f"sum(rate({m}[60s]) {CLUSTER_JOIN})" for m in (
        "rabbitmq_channel_messages_redelivered_total", "rabbitmq_channel_messages_delivered_total",
        "rabbitmq_channel_messages_delivered_ack_total", "rabbitmq_channel_get_total",
        "rabbitmq_channel_get_ack_total")),
    f"sum(rabbitmq_channel_consumers {CLUSTER_JOIN})",
    f"sum(rabbitmq_channels {CLUSTER_JOIN})",
    f"sum(rabbitmq_build_info {CLUSTER_JOIN})",
]
# The NODES row: one series per node.
NODES = [
    f"rabbitmq_build_info {NODE_JOIN}",
    f"(rabbitmq_resident_memory_limit_bytes {NODE_JOIN}) -\n"
    f"(rabbitmq_process_resident_memory_bytes {NODE_JOIN})",
    f"rabbitmq_disk_space_available_bytes {NODE_JOIN}",
    f"(rabbitmq_process_max_fds {NODE_JOIN}) -\n(rabbitmq_process_open_fds {NODE_JOIN})",
    f"(rabbitmq_process_max_tcp_sockets {NODE_JOIN}) -\n(rabbitmq_process_open_tcp_sockets {NODE_JOIN})",
]
# Graph panels, stacked per node: gauges, and counters as rates.
PER_NODE_GAUGES = ["rabbitmq_queue_messages_ready", "rabbitmq_queue_messages_unacked", "rabbitmq_queues",
                   "rabbitmq_channels", "rabbitmq_connections"]
PER_NODE_RATES = [
    "rabbitmq_channel_messages_published_total", "rabbitmq_channel_messages_confirmed_total",
    "rabbitmq_queue_messages_published_total", "rabbitmq_channel_messages_unconfirmed",
    "rabbitmq_channel_messages_unroutable_dropped_total",
    "rabbitmq_channel_messages_unroutable_returned_total",
    "rabbitmq_channel_messages_delivered_total", "rabbitmq_channel_messages_delivered_ack_total",
    "rabbitmq_channel_messages_redelivered_total", "rabbitmq_channel_messages_acked_total",
    "rabbitmq_channel_get_ack_total", "rabbitmq_channel_get_total", "rabbitmq_channel_get_empty_total",
    "rabbitmq_queues_declared_total", "rabbitmq_queues_created_total", "rabbitmq_queues_deleted_total",
    "rabbitmq_channels_opened_total", "rabbitmq_channels_closed_total",
    "rabbitmq_connections_opened_total", "rabbitmq_connections_closed_total",
]
GRAPHS = ([f"sum({m} {NODE_JOIN}) by(rabbitmq_node)" for m in PER_NODE_GAUGES]
          + [f"sum(rate({m}[60s]) {NODE_JOIN}) by(rabbitmq_node)" for m in PER_NODE_RATES])
DASHBOARD = SINGLESTATS + NODES + GRAPHS


class Prometheus:
    def __init__(self, tmp: Path, target_port: int) -> None:
        assert PROMETHEUS is not None
        self.port = free_port()
        config = tmp / "prometheus.yml"
        config.write_text(
            "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n"
            "scrape_configs:\n  - job_name: rabbitmq\n    static_configs:\n"
            f"      - targets: ['127.0.0.1:{target_port}']\n")
        self.log = open(tmp / "prometheus.log", "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={tmp / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)

    def query(self, expr: str) -> list[dict[str, Any]]:
        url = f"http://127.0.0.1:{self.port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        with urllib.request.urlopen(url, timeout=10) as resp:
            doc = json.load(resp)
        assert doc["status"] == "success", doc
        result: list[dict[str, Any]] = doc["data"]["result"]
        return result

    def label_values(self, label: str) -> list[str]:
        url = f"http://127.0.0.1:{self.port}/api/v1/label/{label}/values"
        with urllib.request.urlopen(url, timeout=10) as resp:
            values: list[str] = json.load(resp)["data"]
        return values

    def ready(self) -> bool:
        try:
            return len(self.query('count_over_time(rabbitmq_connections{job="rabbitmq"}[1m]) >= 3')) == 1
        except OSError:
            return False

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        self.log.close()


@pytest.fixture
def mb(tmp_path: Path) -> Iterator[SkredProcess]:
    b = start_mgmt_broker(tmp_path)
    yield b
    b.close()


def _traffic(b: SkredProcess) -> pika.BlockingConnection:
    """A connection left open with a consumer, after publishes, confirms, gets and a return."""
    conn = connect(b)
    ch = conn.channel()
    ch.confirm_delivery()
    qn = unique("q")
    ch.queue_declare(qn)
    for _ in range(5):
        ch.basic_publish("", qn, b"x")
    method, _props, _body = ch.basic_get(qn)
    ch.basic_ack(method.delivery_tag)
    with pytest.raises(pika.exceptions.UnroutableError):
        ch.basic_publish("", unique("nowhere"), b"x", mandatory=True)
    ch.basic_consume(qn, lambda c, m, p, body: c.basic_ack(m.delivery_tag))
    conn.process_data_events(0.5)
    return conn


@pytest.mark.skipif(PROMETHEUS is None, reason="prometheus (Debian package) is not installed")
@pytest.mark.timeout(120)
def test_rabbitmq_overview_dashboard_queries_return_data(mb: SkredProcess, tmp_path: Path) -> None:
    conn = _traffic(mb)
    prom = Prometheus(tmp_path, metrics_port(mb))
    try:
        wait_until(prom.ready, 60, "three scrapes of Skred in Prometheus")
        clusters = prom.label_values("rabbitmq_cluster")
        assert len(clusters) == 1, clusters  # the dashboard's $rabbitmq_cluster variable
        empty = []
        for expr in DASHBOARD:
            filled = expr.replace("$rabbitmq_cluster", clusters[0]).replace("$namespace", "")
            if not prom.query(filled):
                empty.append(expr)
        assert not empty, f"{len(empty)} of {len(DASHBOARD)} dashboard queries return nothing: {empty}"
        nodes = prom.query(f"sum(rabbitmq_queue_messages_ready {NODE_JOIN.replace('$namespace', '')}"
                           .replace("$rabbitmq_cluster", clusters[0]) + ") by(rabbitmq_node)")
        assert nodes[0]["metric"]["rabbitmq_node"] == Api(mb.mgmt_port).get("/api/overview")["node"]
        published = prom.query("rabbitmq_channel_messages_published_total")
        assert float(published[0]["value"][1]) >= 5
    finally:
        prom.stop()
        conn.close()


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
