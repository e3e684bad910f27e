"""The image from the Dockerfile, built and run with testcontainers in a real container engine.

One container of the session's image (tests/deploy/conftest.py: ``pip install .`` on
``SKRED_BASE_IMAGE``, python:3.11-slim by default): it runs as the unprivileged ``skred`` user, its
HEALTHCHECK command passes inside it, and a persistent message published with a confirm through the
published AMQP port (bound on 127.0.0.1 only) is read back. Ryuk (testcontainers' reaper, an image
pulled from a registry) is off: the fixtures remove what they start. No engine: skipped with the
reason (failed in CI). """

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

from ._engine import UP_TIMEOUT, confirmed_round_trip, serves
from ._tools import free_port, poll
from .test_dockerfile import healthcheck_argv

pytestmark = pytest.mark.timeout(UP_TIMEOUT + 120)

USER, PASSWORD = "image-test", "s3cret"


@pytest.fixture(scope="module")
def container(skred_image: str) -> Iterator[tuple[Any, int]]:
    os.environ.setdefault("TESTCONTAINERS_RYUK_DISABLED", "true")
    from testcontainers.core.container import DockerContainer

    amqp_port = free_port()  # after the build: a port picked minutes earlier may be taken
    node = DockerContainer(skred_image, env={
        "SKRED_MAIN_DEFAULT_USER": USER, "SKRED_MAIN_DEFAULT_PASSWORD": PASSWORD})
    node.ports["5672/tcp"] = ("127.0.0.1", amqp_port)  # docker-py form: loopback only
    with node:
        yield node, amqp_port


def test_persistent_message_with_confirm_through_the_published_port(container: tuple[Any, int]) -> None:
    _, port = container
    assert confirmed_round_trip(port, USER, PASSWORD, "image-test", b"from the image") == b"from the image"


def test_runs_unprivileged_and_its_healthcheck_passes(container: tuple[Any, int]) -> None:
    node, port = container
    poll(lambda: serves(port, USER, PASSWORD), 60.0, "the container to serve AMQP", 0.5)
    uid = node.exec(["id", "-u"])
    assert uid.exit_code == 0 and uid.output.decode().strip() == "10001"
    health = node.exec(healthcheck_argv())
    assert health.exit_code == 0, health.output.decode()
