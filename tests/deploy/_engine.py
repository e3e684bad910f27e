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

import pytest

from ._tools import COMPOSE_FILE, missing, tool

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
