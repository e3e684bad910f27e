"""RabbitMQ's own "RabbitMQ-Overview" Grafana dashboard, every panel, through a real Prometheus.

Theory of operation: ``data/rabbitmq-overview-dashboard.json`` is the dashboard file as
rabbitmq-server ships it (see ``data/README.md``). The test reads every panel's PromQL targets
from it and fills the template variables the way Grafana does: ``$namespace``,
``$rabbitmq_cluster`` and ``$endpoint`` from the label values of ``rabbitmq_identity_info``
(their ``label_values(...)`` variable queries), ``$__rate_interval`` as four scrape intervals
and more, ``$__range`` as the time the test has been scraping. A real ``prometheus`` (Debian's
package; ``.ci/run`` installs it, the test skips without it) scrapes Skred's open metrics port
every second while a load thread makes every kind of traffic the panels show (confirmed
publishes of several sizes, manual and automatic acknowledgement consumers, gets of both kinds
and empty ones, requeues, unroutable messages dropped and returned, queues, channels and
connections coming and going). Then each panel is queried at the current time (an instant
query, as Grafana's stat panels do; for the graphs that is their last point): a panel passes
when every one of its targets returns at least one series. The global counters the panels are
built on must also have counted the load, not only exist.

Against a cluster: Prometheus scrapes all three nodes (the leader and two followers), the load
goes through a follower (which proxies it to the leader, where the counters live), and every
panel still returns data, with all three nodes counted in the "Nodes" panel. Prometheus boots
while the brokers do (their ports are chosen first), so only answered scrapes are counted.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pika
import pytest

from ._support import SkredProcess, free_port, unique, wait_until
from .test_cluster import Cluster, cluster, start_cluster, wait_for

__all__ = ["cluster"]  # test_cluster's fixture: three real nodes and a real etcd, stopped by PID

PROMETHEUS = shutil.which("prometheus")
DASHBOARD = Path(__file__).parent / "data" / "rabbitmq-overview-dashboard.json"
SCRAPE_INTERVAL = 1  # seconds
RATE_INTERVAL = "15s"  # Grafana: max($__interval + scrape interval, 4 scrape intervals); room for a loaded CI
LOAD_SECONDS = 45.0  # the load thread's own bound (the test stops it much sooner)
# The global counters the dashboard's panels are built on, each of which the load must move.
COUNTED = (
    "received", "received_confirm", "routed", "confirmed", "acknowledged", "delivered",
    "delivered_consume_manual_ack", "delivered_consume_auto_ack", "delivered_get_manual_ack",
    "delivered_get_auto_ack", "redelivered", "get_empty", "unroutable_dropped", "unroutable_returned",
)

pytestmark = [pytest.mark.skipif(PROMETHEUS is None, reason="prometheus (Debian package) is not installed"),
              pytest.mark.timeout(180)]


# ------------------------------------------------------------------ the dashboard
def panels(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """Every panel that queries Prometheus (rows only group them; a collapsed row nests its own)."""
    out: list[dict[str, Any]] = []
    for p in doc["panels"]:
        if p.get("type") == "row":
            out += panels({"panels": p.get("panels", [])})
        elif p.get("targets"):
            out.append(p)
    return out


def fill(expr: str, variables: dict[str, str]) -> str:
    """Grafana's substitution of ``$name`` and ``${name}`` (longest names first)."""
    for name in sorted(variables, key=len, reverse=True):
        expr = expr.replace("${" + name + "}", variables[name]).replace("$" + name, variables[name])
    left = re.findall(r"\$\{?\w+", expr)
    assert not left, f"unfilled dashboard variables {left} in {expr}"
    return expr


# ------------------------------------------------------------------ Prometheus
class Prometheus:
    """A real Prometheus on a free loopback port, scraping ``targets`` (host:port) every second."""

    def __init__(self, tmp: Path, targets: list[str]) -> None:
        assert PROMETHEUS is not None
        self.port = free_port()
        config = tmp / "prometheus.yml"
        config.write_text(
            f"global:\n  scrape_interval: {SCRAPE_INTERVAL}s\n  scrape_timeout: {SCRAPE_INTERVAL}s\n"
            "scrape_configs:\n  - job_name: rabbitmq\n    static_configs:\n"
            f"      - targets: {json.dumps(targets)}\n")
        self.started = time.monotonic()
        self.log = open(tmp / "prometheus.log", "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={tmp / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)

    def _get(self, path: str, **query: str) -> Any:
        url = f"http://127.0.0.1:{self.port}{path}?" + urllib.parse.urlencode(query)
        with urllib.request.urlopen(url, timeout=10) as resp:
            doc = json.load(resp)
        assert doc["status"] == "success", doc
        return doc["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = self._get("/api/v1/query", query=expr)["result"]
        return result

    def label_values(self, label: str, match: str) -> list[str]:
        """Grafana's ``label_values(match, label)`` variable query."""
        values: list[str] = self._get(f"/api/v1/label/{label}/values", **{"match[]": match})
        return values

    def scraped(self, instances: int, samples: int) -> bool:
        """Each of ``instances`` targets scraped successfully at least ``samples`` times, all of
        them up now (Prometheus boots beside the brokers, so its first scrapes may find no one:
        ``up`` is 0 for those, and summing counts only the answered ones)."""
        try:
            up = self.query(f'sum_over_time(up{{job="rabbitmq"}}[5m]) >= {samples}')
            ok = self.query('up{job="rabbitmq"} == 1')
        except OSError:
            return False
        return len(up) == instances and len(ok) == instances

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()  # its database is this test's scratch: no clean shutdown needed
            self.proc.wait(15)
        self.log.close()


# ------------------------------------------------------------------ load
class Load:
    """A thread making every kind of traffic the dashboard shows, round after round, until
    stopped (or ``LOAD_SECONDS``, whichever first). Each round opens and closes a connection
    and a channel and declares and deletes a queue; ``rounds`` counts the finished ones."""

    SIZES = (10, 500, 5_000, 50_000)  # message bodies in several of the size panel's buckets

    def __init__(self, url: str) -> None:
        self.params = pika.URLParameters(url)
        self.queue = unique("dash")
        self.rounds = 0
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dashboard-load", daemon=True)
        # pika logs every basic.return as a warning; the returns here are on purpose
        logging.getLogger("pika.adapters.blocking_connection").setLevel(logging.ERROR)

    def start(self) -> Load:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)
        assert not self._thread.is_alive(), "the load thread did not stop"

    def _run(self) -> None:
        deadline = time.monotonic() + LOAD_SECONDS
        try:
            conn = pika.BlockingConnection(self.params)
            try:
                pub = conn.channel()
                pub.confirm_delivery()
                pub.queue_declare(self.queue)
                # a consumer left open: the Consumers and Unacknowledged panels
                held = conn.channel()
                held.basic_qos(prefetch_count=1)
                held.basic_consume(self.queue, lambda *a: None)
                while not self._stop.is_set() and time.monotonic() < deadline:
                    self._round(conn, pub)
                    self.rounds += 1
                    self._stop.wait(0.2)  # pacing between rounds, not synchronisation
            finally:
                conn.close()
        except BaseException as exc:  # reported by the test
            self.error = exc

    def _round(self, conn: pika.BlockingConnection, pub: Any) -> None:
        qn = self.queue
        for size in self.SIZES:
            pub.basic_publish("", qn, b"x" * size)  # confirmed (received, routed, confirmed)
        pub.basic_publish("", unique("nowhere"), b"dropped")  # unroutable, dropped
        with pytest.raises(pika.exceptions.UnroutableError):
            pub.basic_publish("", unique("nowhere"), b"returned", mandatory=True)  # returned
        for auto_ack in (True, False):  # gets of both kinds
            method, _props, _body = pub.basic_get(qn, auto_ack=auto_ack)
            assert method is not None
            if not auto_ack:
                pub.basic_nack(method.delivery_tag, requeue=True)  # a redelivery follows
        side = pika.BlockingConnection(self.params)  # connections, channels, queues come and go
        try:
            ch = side.channel()
            tmp = ch.queue_declare(unique("tmp"), exclusive=True).method.queue
            for _ in range(2):
                ch.basic_publish("", tmp, b"a")
            method, _props, _body = ch.basic_get(tmp, auto_ack=False)
            assert method is not None
            ch.basic_ack(method.delivery_tag)
            method, _props, _body = ch.basic_get(tmp, auto_ack=False)
            assert method is not None
            ch.basic_ack(method.delivery_tag)
            assert ch.basic_get(tmp)[0] is None  # get-empty
            got: list[int] = []
            tag = ch.basic_consume(qn, lambda c, m, p, b: (c.basic_ack(m.delivery_tag), got.append(1)))
            auto = ch.basic_consume(tmp, lambda c, m, p, b: got.append(1), auto_ack=True)
            ch.basic_publish("", tmp, b"auto")
            wait_until(lambda: (side.process_data_events(0.05), len(got) >= 2)[1], 10,
                       "a manual-ack and an auto-ack delivery")
            ch.basic_cancel(tag)
            ch.basic_cancel(auto)
            ch.queue_delete(tmp)
            ch.close()
        finally:
            side.close()


# ------------------------------------------------------------------ the check
def check_dashboard(prom: Prometheus, nodes: int) -> None:
    doc = json.loads(DASHBOARD.read_text())
    found = panels(doc)
    assert len(found) == 41, len(found)
    namespace = prom.label_values("namespace", "rabbitmq_identity_info")
    ns = namespace[0] if namespace else ""
    clusters = prom.label_values("rabbitmq_cluster", f'rabbitmq_identity_info{{namespace="{ns}"}}')
    assert len(clusters) == 1, clusters
    endpoints = prom.label_values(
        "rabbitmq_endpoint", f'rabbitmq_identity_info{{namespace="{ns}", rabbitmq_cluster="{clusters[0]}", '
                             'rabbitmq_endpoint!="memory-breakdown"}')
    scraped = f"{max(int(time.monotonic() - prom.started), 30)}s"
    endpoint = endpoints[0] if endpoints else ""  # Grafana: an empty variable when nothing matches
    variables = {"namespace": ns, "rabbitmq_cluster": clusters[0], "endpoint": endpoint,
                 "__rate_interval": RATE_INTERVAL, "__interval": f"{SCRAPE_INTERVAL}s", "__range": scraped}
    empty: list[str] = []
    for panel in found:
        for target in panel["targets"]:
            if target.get("hide"):
                continue
            if not prom.query(fill(target["expr"], variables)):
                empty.append(f'{panel["title"]!r}: {target["expr"]}')
    assert not empty, f"{len(empty)} dashboard queries return nothing:\n" + "\n".join(empty)
    assert endpoints == ["aggregated"], endpoints  # what RabbitMQ's /metrics says it is
    counted = {name: prom.query(f"sum(rabbitmq_global_messages_{name}_total)") for name in COUNTED}
    zero = [name for name, r in counted.items() if not r or float(r[0]["value"][1]) <= 0]
    assert not zero, f"global counters the load did not move: {zero}"
    nodes_panel = ('count(rabbitmq_identity_info{namespace="$namespace",rabbitmq_cluster="$rabbitmq_cluster",'
                   'rabbitmq_endpoint="$endpoint"})')
    count = prom.query(fill(nodes_panel, variables))
    assert float(count[0]["value"][1]) == nodes, count  # the "Nodes" panel


def run_dashboard(prom: Prometheus, targets: int, url: str) -> None:
    load = Load(url).start()
    try:
        # enough scrapes with the load running for every rate() and increase() to have two points
        wait_until(lambda: prom.scraped(targets, 6) and load.rounds >= 3 or load.error is not None,
                   90, "Prometheus scraping every target under load")
        assert load.error is None, repr(load.error)
        check_dashboard(prom, targets)
    finally:
        load.stop()
    assert load.error is None, repr(load.error)


def test_every_overview_panel_returns_data(tmp_path: Path) -> None:
    b = SkredProcess(tmp_path / "data")
    prom = Prometheus(tmp_path, [f"127.0.0.1:{b.metrics_port}"])  # boots while the broker does
    try:
        b.start()
        run_dashboard(prom, 1, b.url)
    finally:
        prom.stop()
        b.close()


def test_every_overview_panel_returns_data_on_a_cluster(cluster: Cluster, tmp_path: Path) -> None:
    """Scraping every node (which one leads is known only once they run), with the load through a
    follower."""
    prom = Prometheus(tmp_path, [f"127.0.0.1:{n.metrics_port}" for n in cluster.nodes])
    try:
        _leader, followers = start_cluster(cluster)
        follower = followers[0]
        wait_for(lambda: _answers(follower.metrics_port), 20, "the follower's metrics port")
        run_dashboard(prom, 3, follower.url)
    finally:
        prom.stop()


def _answers(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as resp:
            return bool(resp.status == 200)
    except OSError:
        return False
