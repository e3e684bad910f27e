"""Suite-wide settings.

Brokers started by the tests run ONE worker unless a test asks for more (``--workers 2``: a
flag beats the environment): ``[main] workers`` defaults to one per core, so on CI's two
cores every existing test would otherwise run two workers, and the suite is the proof that
``workers = 1`` is today's broker unchanged. Multi-worker behaviour has its own tests
(tests/integration/test_workers.py). Set SKRED_MAIN_WORKERS yourself to run the suite on
more workers.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

os.environ.setdefault("SKRED_MAIN_WORKERS", "1")


# --- Running the suite on two pytest-xdist workers ------------------------------------------
# pyproject's addopts run the suite with ``-n 2``: CI has two cores, and most of a test's time is
# a broker process, etcd or RabbitMQ booting or waiting on a socket, so two test files side by
# side nearly halve the wall time. The unit of scheduling is the test FILE (module-scoped brokers
# and clusters are booted once, as in a serial run), except that the files under a directory in
# SHARED_GROUPS run on one worker one after another: they share something outside the test's own
# temp dir and ports (tests/deploy builds and runs the same container images). Ports never clash
# between workers: integration._support.free_port gives each worker its own residue class.
SHARED_GROUPS = ("tests/deploy/",)


def _scope_of(nodeid: str) -> str:
    path = nodeid.split("::", 1)[0]
    return next((group for group in SHARED_GROUPS if path.startswith(group)), path)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    from xdist.scheduler import LoadScopeScheduling

    class FileScheduling(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            return _scope_of(nodeid)

    return FileScheduling(config, log)
