"""Spark fixtures: one shared local SparkSession for every test in ``tests/spark``.

Skipped cleanly when pyspark/pyarrow (the ``spark`` extra) or Java are missing. The session
is ``local[2]`` with the UI off, two shuffle partitions, a JVM tuned for short jobs
(spark_jvm.py) and Python filter pushdown on;
``SPARK_LOCAL_IP`` and ``PYSPARK_PYTHON`` pin it to loopback and this interpreter.

Budgets: starting Spark (a JVM) takes from seconds to minutes on a loaded machine, so it is
not charged to whichever test happens to run first. The session-scoped ``spark_session``
starts it in a thread with its own deadline (``SPARK_START_TIMEOUT``), and every Spark test's
pytest-timeout covers only the test function (``func_only``). The function-scoped ``spark``
hands out the shared session and starts a new one if a previous test left it stopped, so one
test's timeout does not fail every later Spark test.
"""

from __future__ import annotations

import os
import shutil
import sys
import threading
from collections.abc import Iterator
from typing import Any

import pytest

SPARK_START_TIMEOUT = 600.0  # seconds for the JVM and the SparkSession to come up, under load
SPARK_TEST_TIMEOUT = 300  # seconds per Spark test function, fixture setup excluded


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "spark: needs pyspark + pyarrow + a Java runtime")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = os.path.dirname(__file__)
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(pytest.mark.spark)
            if item.get_closest_marker("timeout") is None:
                item.add_marker(pytest.mark.timeout(SPARK_TEST_TIMEOUT, func_only=True))


def _start_session() -> Any:
    """A new local SparkSession, or pytest.fail when it does not come up within the budget."""
    from spark_jvm import builder

    from broker.spark import register

    result: dict[str, Any] = {}

    def start() -> None:
        try:
            session = (builder("skred-tests")
                       .config("spark.sql.python.filterPushdown.enabled", "true")
                       .config("spark.sql.session.timeZone", "UTC")
                       .getOrCreate())
            session.sparkContext.setLogLevel("ERROR")
            register(session)
            result["session"] = session
        except BaseException as exc:  # noqa: BLE001 - reported to the waiting test below
            result["error"] = exc

    thread = threading.Thread(target=start, name="spark-start", daemon=True)
    thread.start()
    thread.join(SPARK_START_TIMEOUT)
    if thread.is_alive():
        pytest.fail(f"Spark did not start within {SPARK_START_TIMEOUT:g} s")
    if "error" in result:
        raise result["error"]
    return result["session"]


@pytest.fixture(scope="session")
def spark_session() -> Iterator[dict[str, Any]]:
    """Holder of the shared session ({"session": ...}); ``spark`` may replace a stopped one."""
    pytest.importorskip("pyarrow")
    pytest.importorskip("pyspark.sql.datasource")
    if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
        pytest.skip("no Java runtime")
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    holder = {"session": _start_session()}
    yield holder
    holder["session"].stop()


@pytest.fixture
def spark(spark_session: dict[str, Any]) -> Any:
    """The shared SparkSession; a new one if an earlier test (say, a timed-out one) stopped it."""
    session = spark_session["session"]
    if session.sparkContext._jsc is None or session.sparkContext._jsc.sc().isStopped():
        session.stop()
        spark_session["session"] = session = _start_session()
    # The active session is per thread (py4j pins each Python thread to a JVM thread, and Spark
    # reads session settings such as filterPushdown through the thread's active session): the
    # session was started in another thread, so make it the active one of this thread too.
    session._jvm.SparkSession.setActiveSession(session._jsparkSession)
    return session
