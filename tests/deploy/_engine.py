"""A container engine for the deployment tests: docker-compose and docker-py over ``DOCKER_HOST``.

CI (``.ci/run``) provides one: podman's Docker-compatible API service on a unix socket, with
``DOCKER_HOST`` pointing at it, the images built locally by ``.ci/images.sh`` (no registry is
reachable) and named by ``SKRED_BASE_IMAGE``, ``ETCD_IMAGE`` and ``PROMETHEUS_IMAGE``. Any
Docker engine works the same way. Where none answers, the tests skip with the reason, except
in CI, which must have one (``missing`` fails there).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from ._tools import COMPOSE_FILE, missing, poll, tool

ENGINE_HOW = "run .ci/run as root (podman system service, DOCKER_HOST) or start a Docker engine"
UP_TIMEOUT = 900.0  # seconds for `up --build`: image build (pip install of the dependencies) included


def engine_reason() -> str | None:
    """Why no engine answers (None when one does)."""
    try:
        import docker
    except ImportError:
        return "the docker Python package is missing (pip install -e '.[test]')"
    try:
        client = docker.from_env(timeout=20)
        client.ping()
        client.close()
    except Exception as exc:  # docker-py raises many kinds for "nothing there"
        where = os.environ.get("DOCKER_HOST") or "the default socket"
        return f"no container engine answers at {where}: {exc}"
    return None


def require_engine() -> None:
    reason = engine_reason()
    if reason is not None:
        missing("a container engine", f"{reason}; {ENGINE_HOW}")


def image_env() -> dict[str, str]:
    """The image variables the compose file reads, passed through from CI's environment."""
    names = ("SKRED_BASE_IMAGE", "ETCD_IMAGE", "PROMETHEUS_IMAGE", "DOCKER_HOST")
    return {name: os.environ[name] for name in names if os.environ.get(name)}


class Compose:
    """``docker-compose -p PROJECT -f deploy/docker-compose.yml --profile monitoring ...``."""

    def __init__(self, project: str, env: dict[str, str], log_dir: Path) -> None:
        self.exe = tool("docker-compose", "apt-get install docker-compose")
        self.project = project
        self.env = {**os.environ, **env}
        self.log_dir = log_dir

    def argv(self, *args: str) -> list[str]:
        return [self.exe, "-p", self.project, "-f", str(COMPOSE_FILE), "--profile", "monitoring", *args]

    def run(self, *args: str, timeout: float = 120.0, check: bool = True) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(self.argv(*args), env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode != 0:
            pytest.fail(f"docker-compose {' '.join(args)} exited {proc.returncode}:\n"
                        f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        return proc

    def logs(self, service: str) -> str:
        return self.run("logs", "--no-color", service, check=False).stdout

    def save_logs(self) -> Path:
        """Every service's log in one file under the test's temp dir (for a failed run)."""
        path = self.log_dir / f"{self.project}.log"
        path.write_text(self.run("logs", "--no-color", "-t", check=False, timeout=60).stdout)
        return path


def amqp_login(port: int, user: str, password: str) -> Any:
    """A pika connection to 127.0.0.1:port, or None while the node does not serve that user."""
    import pika

    try:
        return pika.BlockingConnection(pika.ConnectionParameters(
            host="127.0.0.1", port=port, credentials=pika.PlainCredentials(user, password),
            socket_timeout=10, blocked_connection_timeout=30, connection_attempts=1))
    except pika.exceptions.AMQPError:
        return None


def serves(port: int, user: str, password: str) -> bool:
    conn = amqp_login(port, user, password)
    if conn is None:
        return False
    conn.close()
    return True


def confirmed_round_trip(port: int, user: str, password: str, queue: str, body: bytes) -> bytes | None:
    """Publish ``body`` persistent with a confirm to a durable ``queue``, then get it back."""
    import pika

    conn = poll(lambda: amqp_login(port, user, password), 120.0, f"an AMQP login as {user!r}", 1.0)
    with conn:
        channel = conn.channel()
        channel.confirm_delivery()
        channel.queue_declare(queue, durable=True)
        channel.basic_publish("", queue, body, pika.BasicProperties(delivery_mode=2))
        method, _, got = channel.basic_get(queue, auto_ack=True)
    return got if method is not None else None
