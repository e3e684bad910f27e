"""Prometheus /metrics against a real Skred process: auth rules, values that move, promtool."""

from __future__ import annotations

import shutil
import subprocess
import urllib.request
from collections.abc import Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

from ._support import SkredProcess, connect, unique, wait_until
from .test_mgmt_api import Api, metrics_port, pytestmark, start_mgmt_broker  # noqa: F401

__all__ = ["pytestmark"]


@pytest.fixture(scope="module")
def mb(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SkredProcess]:
    b = start_mgmt_broker(tmp_path_factory.mktemp("metrics"))
    yield b
    b.close()


def scrape(b: SkredProcess, path: str = "/metrics") -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port(b)}{path}", timeout=10) as resp:
        assert resp.headers["Content-Type"].startswith("text/plain")
        return str(resp.read().decode())


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(text: str, name: str, **labels: str) -> float:
    return samples(text)[(name, tuple(sorted(labels.items())))]


def test_metrics_move_when_messages_flow(mb: SkredProcess) -> None:
    before = scrape(mb)
    published0 = value(before, "skred_global_messages_received_total")
    opened0 = value(before, "skred_connections_opened_total")
    assert value(before, "skred_process_resident_memory_bytes") > 0
    assert value(before, "skred_disk_space_available_bytes") > 0
    assert value(before, "skred_process_open_fds") > 0
    assert value(before, "skred_uptime_seconds") >= 0
    qn = unique("q")
    conn = connect(mb)
    try:
        ch = conn.channel()
        ch.queue_declare(qn)
        for _ in range(10):
            ch.basic_publish("", qn, b"m")
        wait_until(lambda: value(scrape(mb), "skred_global_messages_received_total") == published0 + 10, 5,
                   "published counter")
        during = scrape(mb)
        assert value(during, "skred_connections") >= 1 and value(during, "skred_channels") >= 1
        assert value(during, "skred_connections_opened_total") == opened0 + 1
        assert value(during, "skred_queue_messages_ready") >= 10
        detailed = scrape(mb, "/metrics/detailed?family=queue_coarse_metrics&family=queue_delivery_metrics"
                              "&vhost=%2F")
        assert value(detailed, "skred_detailed_queue_messages_ready", vhost="/", queue=qn) == 10
        assert value(detailed, "skred_detailed_queue_messages_published_total", vhost="/", queue=qn) == 10
        for _ in range(4):
            method, _props, _body = ch.basic_get(qn, auto_ack=False)
            assert method is not None
            ch.basic_ack(method.delivery_tag)
        wait_until(lambda: value(scrape(mb), "skred_global_messages_acknowledged_total") >= 4, 5, "acks")
        detailed = scrape(mb, "/metrics/detailed?family=queue_coarse_metrics")
        assert value(detailed, "skred_detailed_queue_messages_ready", vhost="/", queue=qn) == 6
        assert value(scrape(mb), "skred_global_messages_delivered_total") >= 4
        ch.queue_delete(qn)
    finally:
        conn.close()
    wait_until(lambda: value(scrape(mb), "skred_connections_closed_total") >= 1, 5, "closed counter")


def test_metrics_auth_on_management_port(mb: SkredProcess) -> None:
    api = Api(mb.mgmt_port)
    status, _, _ = api.call("GET", "/metrics", auth=False)
    assert status == 401
    status, body, _ = api.call("GET", "/metrics")
    assert status == 200 and "skred_queues" in body
    # a family Skred does not serve is left out (RabbitMQ's way), not the whole scrape refused
    status, body, _ = api.call("GET", "/metrics/detailed?family=nonsense")
    assert status == 200 and "rabbitmq_identity_info" in body and "_detailed_" not in body, body
    user = unique("u")
    api.ok("PUT", f"/api/users/{user}", {"password": "pw", "tags": "management"})
    assert api.as_user(user, "pw").call("GET", "/metrics")[0] == 401
    api.ok("PUT", f"/api/users/{user}", {"password": "pw", "tags": "monitoring"})
    assert api.as_user(user, "pw").call("GET", "/metrics")[0] == 200
    api.ok("DELETE", f"/api/users/{user}")


def test_promtool_accepts_output(mb: SkredProcess, tmp_path: pytest.TempPathFactory) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (Debian package 'prometheus')")
    for path in ("/metrics", "/metrics/detailed?family=queue_coarse_metrics&family=queue_consumer_count"
                 "&family=queue_delivery_metrics&family=vhost_status&family=vhost_coarse_metrics"):
        text = scrape(mb, path)
        result = subprocess.run([promtool, "check", "metrics"], input=text.encode(), capture_output=True,
                                timeout=30)
        assert result.returncode == 0, (path, result.stdout, result.stderr)
