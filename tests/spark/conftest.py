"""Spark fixtures: one shared local SparkSession for every test in ``tests/spark``.

Skipped cleanly when pyspark/pyarrow (the ``spark`` extra) or Java are missing. The session
is ``local[2]`` with the UI off, two shuffle partitions and Python filter pushdown on;
``SPARK_LOCAL_IP`` and ``PYSPARK_PYTHON`` pin it to loopback and this interpreter.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Iterator
from typing import Any

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "spark: needs pyspark + pyarrow + a Java runtime")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = os.path.dirname(__file__)
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(pytest.mark.spark)


@pytest.fixture(scope="session")
def spark() -> Iterator[Any]:
    pytest.importorskip("pyarrow")
    pytest.importorskip("pyspark.sql.datasource")
    if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
        pytest.skip("no Java runtime")
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    from pyspark.sql import SparkSession

    from broker.spark import register

    session = (SparkSession.builder.master("local[2]").appName("skred-tests")
               .config("spark.ui.enabled", "false")
               .config("spark.sql.shuffle.partitions", "2")
               .config("spark.driver.host", "127.0.0.1")
               .config("spark.sql.python.filterPushdown.enabled", "true")
               .config("spark.sql.session.timeZone", "UTC")
               .getOrCreate())
    session.sparkContext.setLogLevel("ERROR")
    register(session)
    yield session
    session.stop()
