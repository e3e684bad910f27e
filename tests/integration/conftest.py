"""Integration fixtures: ``broker``, ``shared_broker``, ``broker_factory``, ``pika_conn``, ``aio_run``.

Theory of operation: see ``_support.py``. Function-scoped ``broker`` may be
stopped, killed and restarted; module-scoped ``shared_broker`` must not be.
Every test gets a default pytest-timeout so a hung broker fails fast.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pika
import pytest

from ._cluster_modes import MODES, ClusterTarget, SessionCluster
from ._support import (
    CALL_FAILED,
    DEFAULT_TEST_TIMEOUT,
    EXTERNAL_URL,
    Broker,
    Cleanup,
    ExternalBroker,
    SkredProcess,
    connect,
    run_async,
)

T = TypeVar("T")


def _make(tmp: Path, extra_args: list[str] | None = None) -> Broker:
    if EXTERNAL_URL:
        return ExternalBroker(EXTERNAL_URL)
    b = SkredProcess(tmp / f"data-{uuid.uuid4().hex[:6]}", extra_args)
    try:
        b.start()
    except BaseException:
        b.close()
        raise
    return b


@pytest.fixture
def broker_factory(tmp_path: Path) -> Iterator[Callable[..., Broker]]:
    """Start extra brokers (e.g. with extra CLI args); all are killed at teardown."""
    made: list[Broker] = []

    def factory(extra_args: list[str] | None = None) -> Broker:
        b = _make(tmp_path, extra_args)
        made.append(b)
        return b

    yield factory
    for b in made:
        b.close()


@pytest.fixture
def broker(broker_factory: Callable[..., Broker]) -> Broker:
    """A broker of this test's own (restart/kill allowed)."""
    return broker_factory()


@pytest.fixture(scope="session")
def session_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SessionCluster]:
    """The session's 3-node cluster (real etcd), booted on first use; see ``_cluster_modes``.
    Its teardown fails the session when the tests left any node unable to serve durable work."""
    if EXTERNAL_URL:
        pytest.skip("cluster modes start their own cluster")
    c = SessionCluster(tmp_path_factory.mktemp("session-cluster"))
    try:
        yield c
        problems = c.problems()
        assert not problems, "the cluster-mode tests left the cluster broken:\n" + "\n".join(problems)
    finally:
        c.close()


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Tests marked ``cluster_modes`` that use the module's shared broker run once per mode."""
    if "shared_broker" in metafunc.fixturenames and metafunc.definition.get_closest_marker("cluster_modes"):
        metafunc.parametrize("broker_mode", MODES, indirect=True, scope="module")


@pytest.fixture(scope="module")
def broker_mode(request: pytest.FixtureRequest) -> str:
    """``single`` unless the test is parametrized over ``_cluster_modes.MODES``."""
    return str(getattr(request, "param", "single"))


@pytest.fixture(scope="module")
def shared_broker(tmp_path_factory: pytest.TempPathFactory, broker_mode: str,
                  request: pytest.FixtureRequest) -> Iterator[Broker | ClusterTarget]:
    """One broker for a whole module; tests using it must not stop or restart it. In a cluster
    mode it is the session cluster's leader or a follower."""
    if broker_mode != "single":
        yield request.getfixturevalue("session_cluster").target(broker_mode)
        return
    b = _make(tmp_path_factory.mktemp("shared"))
    yield b
    b.close()


@pytest.fixture
def pika_conn(shared_broker: Broker) -> Iterator[pika.BlockingConnection]:
    conn = connect(shared_broker)
    yield conn
    if conn.is_open:
        conn.close()


@pytest.fixture
def aio_run() -> Callable[[Coroutine[Any, Any, T]], T]:
    """The aio-pika helper: ``aio_run(coro)`` runs it on a fresh loop with a deadline."""
    return run_async


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # pytest passes every collected item of the session, not only this directory's.
    here = Path(__file__).parent
    for item in items:
        if item.path.is_relative_to(here) and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(DEFAULT_TEST_TIMEOUT))


@pytest.fixture
def cleanup(shared_broker: Broker) -> Iterator[Cleanup]:
    """Register queue/exchange names to delete after the test (brokers persist between runs)."""
    c = Cleanup(shared_broker)
    yield c
    c.run()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """A fixture's teardown reads ``item.stash[CALL_FAILED]`` (a test's exception never reaches
    its fixtures): the shard servers trial keeps the nodes' logs of a failed run by it."""
    if call.when == "call":
        item.stash[CALL_FAILED] = call.excinfo is not None
    return (yield)
