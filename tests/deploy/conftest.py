"""Deployment fixtures: the Skred image, built once per test session.

Theory of operation: the image is built the way ``deploy/docker-compose.yml`` builds it (its
``build`` section: the Dockerfile on ``SKRED_BASE_IMAGE``), by ``docker-compose build skred-1``
with ``SKRED_IMAGE`` naming a tag of this session, and removed at the end. The compose cluster
(``up --no-build``), the chart's pod (``image.repository``/``image.tag``) and the single
container of test_image.py all run that one image: built per module, as before, the same
``pip install .`` ran three times (and compose built it once per node service). tests/deploy
runs on one xdist worker (``SHARED_GROUPS`` in tests/conftest.py), so one build serves it all.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from ._engine import UP_TIMEOUT, Compose, image_env, require_engine

BUILT_SERVICE = "skred-1"  # the three node services share one image and build section


@pytest.fixture(scope="session")
def skred_image(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``repository:tag`` of the image built from the Dockerfile through the compose file."""
    require_engine()
    tag = f"localhost/skred-test:{uuid.uuid4().hex[:12]}"  # the engine's store is shared: unique
    compose = Compose(f"skredimage{uuid.uuid4().hex[:8]}", {**image_env(), "SKRED_IMAGE": tag},
                      tmp_path_factory.mktemp("image"))
    compose.run("build", BUILT_SERVICE, timeout=UP_TIMEOUT)
    try:
        yield tag
    finally:
        import docker

        client = docker.from_env(timeout=60)
        try:
            client.images.remove(tag, force=True)
        except docker.errors.APIError:
            pass  # already gone, or still in use by a container a failed test left: not ours to fail
        finally:
            client.close()
