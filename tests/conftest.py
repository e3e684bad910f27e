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
# temp dir and ports (tests/deploy builds and runs the same container images), or a session
# fixture too costly to boot twice (tests/spark: one Spark JVM). Ports never clash
# between workers: integration._support.free_port gives each worker its own residue class.
SHARED_GROUPS = ("tests/deploy/", "tests/spark/")


# Scopes that take minutes start first, heaviest first, so that neither worker is left alone
# with one at the end; the rest keep their collection order (the unit-test files, last, fill in).
# Seconds of one run on a loaded 2-core machine (2026-11-27): only the order matters. tests/spark
# outweighs tests/deploy (CI's slowest items: ~270 s against ~200 s; on one heavily loaded machine
# 1,395 s against 792 s), so it starts first.
SLOW_FIRST = {
    "tests/spark/": 900, "tests/deploy/": 810, "tests/integration/test_shovel.py": 290,
    "tests/integration/test_cluster_chaos.py": 140, "tests/integration/test_tls.py": 165,
    "tests/integration/test_web_ui.py": 135, "tests/integration/conformance/test_conformance.py": 110,
    "tests/integration/test_durability.py": 95,
    # one 3-node shard-servers cluster through seven trials (three kill -9s): ~130 s loaded
    "tests/integration/test_cluster_shard_servers.py": 120,
    # Since stop 39 most of their tests share one broker, scaled by the measured ratio (a loaded
    # machine, old and new side by side): test_mqtt 145 -> ~90, test_lmq 140 -> ~85;
    # test_features_ttl_dlx.py (200 -> ~45) left the list.
    "tests/integration/test_mqtt.py": 90, "tests/integration/test_lmq.py": 85,
    # mypy --strict and ruff over the package: half a minute of one core; among the unit-test
    # files at the end it could leave one worker finishing alone.
    "tests/test_static.py": 60,
}


def _scope_of(nodeid: str) -> str:
    path = nodeid.split("::", 1)[0]
    return next((group for group in SHARED_GROUPS if path.startswith(group)), path)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Order whole scopes by SLOW_FIRST (every worker sorts alike: the collections must match)."""
    first: dict[str, int] = {}
    for i, item in enumerate(items):
        first.setdefault(_scope_of(item.nodeid), i)

    def key(item: pytest.Item) -> tuple[int, int]:
        scope = _scope_of(item.nodeid)
        return -SLOW_FIRST.get(scope, 0), first[scope]

    items.sort(key=key)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    from xdist.scheduler import LoadScopeScheduling

    class FileScheduling(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            return _scope_of(nodeid)

    config.option.loadscopereorder = False  # keep the order pytest_collection_modifyitems made
    return FileScheduling(config, log)


# --- What the schedule did, at the end of every run on workers ------------------------------
# SLOW_FIRST is tuned from real CI runs: the summary gives each worker's finish time and the
# heaviest scopes (first start to last stop, on which worker), so an idle worker at the end or a
# scope misplaced in the order shows in any CI log, -q included, at no cost to the run.
_SCOPES: dict[str, list[Any]] = {}  # scope -> [worker, first start, last stop]
SUMMARY_SCOPES = 25


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    node = getattr(report, "node", None)  # set by xdist on the controller, absent in a worker
    if node is None or not report.start:
        return
    worker = getattr(getattr(node, "gateway", None), "id", "?")
    seen = _SCOPES.setdefault(_scope_of(report.nodeid), [worker, report.start, report.stop])
    seen[1], seen[2] = min(seen[1], report.start), max(seen[2], report.stop)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not _SCOPES:
        return
    t0 = min(start for _, start, _ in _SCOPES.values())
    ends: dict[str, float] = {}
    for worker, _, stop in _SCOPES.values():
        ends[worker] = max(ends.get(worker, t0), stop)
    write = terminalreporter.write_line
    terminalreporter.write_sep("=", "schedule: workers' finish, heaviest scopes (s from the first test)")
    for worker, end in sorted(ends.items()):
        write(f"{worker} finished at {end - t0:7.1f}")
    heaviest = sorted(_SCOPES.items(), key=lambda kv: kv[1][1] - kv[1][2])[:SUMMARY_SCOPES]
    for scope, (worker, start, stop) in heaviest:
        write(f"{stop - start:7.1f}  {worker}  {start - t0:7.1f} -> {stop - t0:7.1f}  {scope}")
