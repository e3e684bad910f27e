"""deploy/docker-compose.yml brought up for real in a container engine, the way a user would.

Theory of operation: ``docker-compose build`` (the session's ``skred_image``, tests/deploy/conftest.py)
builds the image from the Dockerfile (``pip install .``, nothing else), then ``up`` (with the
``monitoring`` profile) starts etcd, three
clustered nodes and Prometheus, every host port moved to a free loopback port through the
compose file's ``*_HOST_PORT`` variables and the project named after this process, so runs
never collide. Then, in file order:

1. every node accepts the compose default user over AMQP (followers after their first sync),
   and every service (etcd, the nodes, Prometheus) reports ``healthy``: its healthcheck runs in
   this engine as written (docker-compose 1.29 on podman's API once split it into words);
2. exactly one node is leader (``skred_is_leader`` on each metrics port) and the example
   on_leader_elected hook ran there (its line in that container's log);
3. Prometheus scrapes all three nodes (its targets API says ``up`` for each);
4. persistent messages published with confirms through the leader survive ``SIGKILL`` of the
   leader's container: another node is elected (its hook runs) and every confirmed message is
   read back through a surviving node.

The engine comes from ``_engine`` (CI: podman's API service); without one the module skips
with the reason, in CI it fails. ``down -v`` removes containers, network and volumes.
"""

from __future__ import annotations

import json
import os
import re
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass

import pika
import pytest

from ._engine import UP_TIMEOUT, Compose, amqp_login, image_env, serves
from ._tools import free_port, poll

pytestmark = pytest.mark.timeout(UP_TIMEOUT + 300)

NODES = ("skred-1", "skred-2", "skred-3")
USER = PASSWORD = "skred"  # the compose file's defaults (SKRED_DEFAULT_USER/PASSWORD unset)
READY_DEADLINE = 180.0  # seconds from `up` returning to every node serving AMQP (first sync included)
HEALTHY_DEADLINE = 240.0  # every service healthy: start_period 60 s, 10 s intervals, a loaded machine
FAILOVER_DEADLINE = 90.0  # lease TTL 10 s + election + the survivors' re-sync, under load
MESSAGES = 300


@dataclass
class Node:
    service: str
    amqp_port: int
    metrics_port: int


@dataclass
class Cluster:
    compose: Compose
    nodes: dict[str, Node]
    prometheus_port: int


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, skred_image: str) -> Iterator[Cluster]:
    for var in ("SKRED_DEFAULT_USER", "SKRED_DEFAULT_PASSWORD"):
        if os.environ.get(var):
            pytest.skip(f"{var} is set in the environment; this test logs in with the compose defaults")
    env = {**image_env(), "SKRED_IMAGE": skred_image}  # built by the compose file (conftest.py)
    compose = Compose(f"skredtest{os.getpid()}", env, tmp_path_factory.mktemp("compose"))
    nodes = {}
    for index, service in enumerate(NODES, start=1):
        node = Node(service, free_port(), free_port())
        env[f"SKRED_{index}_AMQP_HOST_PORT"] = str(node.amqp_port)
        env[f"SKRED_{index}_METRICS_HOST_PORT"] = str(node.metrics_port)
        for port in ("MGMT", "AMQPS", "HTTPS"):
            env[f"SKRED_{index}_{port}_HOST_PORT"] = str(free_port())
        nodes[service] = node
    env["PROMETHEUS_HOST_PORT"] = prometheus_port = str(free_port())
    compose.env.update(env)
    try:
        compose.run("up", "-d", "--no-build", timeout=UP_TIMEOUT)
        yield Cluster(compose, nodes, int(prometheus_port))
    finally:
        print(f"compose logs: {compose.save_logs()}")
        # SIGKILL first: the containers and their volumes are thrown away, so a graceful stop
        # (up to --timeout per container) would only cost time.
        compose.run("kill", "-s", "SIGKILL", timeout=120, check=False)
        compose.run("down", "-v", "--timeout", "1", timeout=300, check=False)


def connect(port: int) -> pika.BlockingConnection:
    conn = amqp_login(port, USER, PASSWORD)
    assert conn is not None, f"no AMQP login on port {port}"
    return conn


def is_leader(node: Node) -> bool | None:
    """The node's ``skred_is_leader`` gauge (None while its metrics port does not answer)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{node.metrics_port}/metrics", timeout=5) as r:
            text = r.read().decode()
    except OSError:
        return None
    match = re.search(r"^skred_is_leader (\S+)$", text, re.MULTILINE)
    return match is not None and float(match.group(1)) == 1.0


def the_leader(nodes: list[Node]) -> Node | None:
    leaders = [node for node in nodes if is_leader(node)]
    return leaders[0] if len(leaders) == 1 else None


def hook_lines(cluster: Cluster, node: Node) -> int:
    """Lines deploy/hooks/on-leader-elected.sh wrote to the node's container log."""
    return sum("skred hook:" in line and "leader-elected" in line
               for line in cluster.compose.logs(node.service).splitlines())


def test_every_node_serves_the_default_user(cluster: Cluster) -> None:
    for node in cluster.nodes.values():
        poll(lambda node=node: serves(node.amqp_port, USER, PASSWORD), READY_DEADLINE,
             f"{node.service} to serve AMQP", 1.0)


def health(cluster: Cluster, services: list[str]) -> dict[str, str]:
    """Each service's container health: its status, with the last check's output unless healthy.

    'no container' / 'no healthcheck' where there is nothing to report; read through the same
    engine API docker-compose uses (DOCKER_HOST), so Docker and podman are asked alike. The
    project's containers are found by the labels docker-compose gives them, in one API call: a
    ``docker-compose ps`` per service and poll started a Python process per service every 3 s, CPU
    the booting containers needed.
    """
    import docker

    client = docker.from_env(timeout=20)
    try:
        ids: dict[str, list[str]] = {service: [] for service in services}
        for container in client.api.containers(
                all=True, filters={"label": f"com.docker.compose.project={cluster.compose.project}"}):
            service = (container.get("Labels") or {}).get("com.docker.compose.service", "?")
            ids.setdefault(service, []).append(container["Id"])
        result = {}
        for service in services:
            if len(ids[service]) != 1:
                result[service] = f"{len(ids[service])} containers"
                continue
            state = client.api.inspect_container(ids[service][0])["State"]
            checked = state.get("Health") or state.get("Healthcheck") or {}
            status = checked.get("Status") or "no healthcheck"
            log = checked.get("Log") or []
            if status != "healthy" and log:
                output = str(log[-1].get("Output", ""))[-300:]
                status += f" (last check: exit {log[-1].get('ExitCode')}, {output!r})"
            result[service] = status
        return result
    finally:
        client.close()


def test_every_service_becomes_healthy(cluster: Cluster) -> None:
    last: dict[str, str] = {}
    services = cluster.compose.run("config", "--services").stdout.split()
    assert set(services) >= {"etcd", *NODES, "prometheus"}, services

    def all_healthy() -> bool:
        last.clear()
        last.update(health(cluster, services))
        return all(status == "healthy" for status in last.values())

    try:
        poll(all_healthy, HEALTHY_DEADLINE, "every service healthy", 3.0)
    except pytest.fail.Exception:
        pytest.fail(f"not every service became healthy in {HEALTHY_DEADLINE:.0f} s: {last}")


def test_one_leader_and_its_hook_ran(cluster: Cluster) -> None:
    leader = poll(lambda: the_leader(list(cluster.nodes.values())), READY_DEADLINE, "exactly one leader", 1.0)
    poll(lambda: hook_lines(cluster, leader) >= 1, 60.0,
         f"the on_leader_elected hook in {leader.service}'s log")
    for node in cluster.nodes.values():
        if node is not leader:
            assert hook_lines(cluster, node) == 0, f"{node.service} ran on_leader_elected but does not lead"


def test_prometheus_scrapes_every_node(cluster: Cluster) -> None:
    def healthy_targets() -> set[str] | None:
        url = f"http://127.0.0.1:{cluster.prometheus_port}/api/v1/targets"
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                targets = json.loads(r.read())["data"]["activeTargets"]
        except (OSError, ValueError, KeyError):
            return None
        up = {t["labels"]["instance"] for t in targets if t["health"] == "up"}
        return up if up == {f"{name}:15692" for name in NODES} else None

    poll(healthy_targets, 120.0, "Prometheus to scrape skred-1, skred-2 and skred-3", 2.0)


def test_confirmed_messages_survive_killing_the_leaders_container(cluster: Cluster) -> None:
    leader = poll(lambda: the_leader(list(cluster.nodes.values())), READY_DEADLINE, "exactly one leader", 1.0)
    queue = "compose-failover"
    confirmed: list[bytes] = []
    with connect(leader.amqp_port) as conn:
        channel = conn.channel()
        channel.confirm_delivery()  # basic_publish now waits for the broker's ack (raises on nack)
        channel.queue_declare(queue, durable=True)
        for i in range(MESSAGES):
            body = f"message {i}".encode()
            channel.basic_publish("", queue, body, pika.BasicProperties(delivery_mode=2))
            confirmed.append(body)

    cluster.compose.run("kill", "-s", "SIGKILL", leader.service)
    survivors = [node for node in cluster.nodes.values() if node is not leader]
    new_leader = poll(lambda: the_leader(survivors), FAILOVER_DEADLINE,
                      "a new leader among the survivors", 1.0)
    poll(lambda: hook_lines(cluster, new_leader) >= 1, 60.0,
         f"the on_leader_elected hook in {new_leader.service}'s log")

    reader = next(node for node in survivors if node is not new_leader)  # proxies to the new leader
    poll(lambda: serves(reader.amqp_port, USER, PASSWORD), FAILOVER_DEADLINE,
         f"{reader.service} to serve again", 1.0)
    received: list[bytes] = []
    with connect(reader.amqp_port) as conn:
        channel = conn.channel()
        for _ in range(MESSAGES + 1):  # bounded: one get per message, then one that finds the queue empty
            method, _, body = channel.basic_get(queue, auto_ack=True)
            if method is None:
                break
            received.append(body)
    missing_bodies = set(confirmed) - set(received)
    lost = sorted(missing_bodies)
    assert not lost, f"{len(lost)} confirmed messages lost, e.g. {lost[:5]}"
