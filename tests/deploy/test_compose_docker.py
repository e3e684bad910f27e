"""deploy/docker-compose.yml brought up for real with testcontainers, where a Docker engine
answers (``docker info`` succeeds) and ``docker compose`` (v2) exists; skipped with the reason
everywhere else (CI here has no engine). Builds the image from the Dockerfile, waits for every
healthcheck (``up --wait``), then checks the cluster the way a user would: the mounted
on_leader_elected hook ran on exactly one node, every published AMQP port accepts the default
user, and a message published through one node is read through another."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from typing import Any

import pika
import pytest

from ._tools import COMPOSE_FILE, DEPLOY_DIR, poll

AMQP_PORTS = {"skred-1": 5672, "skred-2": 5673, "skred-3": 5674}
USER = PASSWORD = "skred"  # the compose file's defaults (SKRED_DEFAULT_USER/PASSWORD unset)


def docker_unavailable_reason() -> str | None:
    docker = shutil.which("docker")
    if docker is None:
        return "no docker CLI on PATH, so no Docker engine to run the compose file"
    try:
        info = subprocess.run([docker, "info"], capture_output=True, text=True, timeout=20)
    except subprocess.TimeoutExpired:
        return "`docker info` timed out: no Docker engine answers"
    if info.returncode != 0:
        return f"`docker info` failed, no Docker engine answers: {info.stderr.strip()[:200]}"
    compose = subprocess.run([docker, "compose", "version"], capture_output=True, text=True, timeout=20)
    if compose.returncode != 0:
        return "the Docker engine answers but `docker compose` (v2, used by testcontainers) is missing"
    return None


_reason = docker_unavailable_reason()
pytestmark = pytest.mark.skipif(_reason is not None, reason=_reason or "")


@pytest.fixture(scope="module")
def compose_cluster() -> Iterator[Any]:
    from testcontainers.compose import DockerCompose

    for var in ("SKRED_DEFAULT_USER", "SKRED_DEFAULT_PASSWORD"):
        if os.environ.get(var):
            pytest.skip(f"{var} is set in the environment; this test logs in with the compose defaults")
    compose = DockerCompose(str(DEPLOY_DIR), compose_file_name=COMPOSE_FILE.name, build=True, wait=True)
    with compose:
        yield compose


def connect(port: int) -> pika.BlockingConnection:
    return pika.BlockingConnection(pika.ConnectionParameters(
        host="127.0.0.1", port=port, credentials=pika.PlainCredentials(USER, PASSWORD),
        socket_timeout=5, connection_attempts=1,
    ))


def test_the_example_hook_ran_on_exactly_one_node(compose_cluster: Any) -> None:
    def electing_nodes() -> list[str] | None:
        found = [name for name in AMQP_PORTS
                 if "leader-elected" in "".join(compose_cluster.get_logs(name))]
        return found or None

    assert len(poll(electing_nodes, 60.0, "the on_leader_elected hook in a node's log", 1.0)) == 1


def test_every_node_serves_and_they_share_queues(compose_cluster: Any) -> None:
    for port in AMQP_PORTS.values():
        connect(port).close()
    queue = "compose-docker-test"
    with connect(AMQP_PORTS["skred-2"]) as conn:
        channel = conn.channel()
        channel.confirm_delivery()
        channel.queue_declare(queue, durable=True)
        channel.basic_publish("", queue, b"hello", pika.BasicProperties(delivery_mode=2))
    with connect(AMQP_PORTS["skred-3"]) as conn:
        method, _, body = conn.channel().basic_get(queue, auto_ack=True)
    assert method is not None and body == b"hello"
