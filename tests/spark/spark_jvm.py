"""How the test Spark drivers (the session of conftest.py, the killed driver of stream_driver.py)
are built: ``local[2]``, UI off, two shuffle partitions, loopback, and a JVM tuned for short test
jobs.

The JVM options: the tests' jobs are small and each runs once, so C2's optimising compiler
(threads that compile hot code again, at top speed) costs CPU it never pays back; C1 alone
(``TieredStopAtLevel=1``, one compiler thread) and the serial collector (no parallel GC threads)
cut the JVM's CPU by a third to a half (tests/spark/jvm_cpu.py: 58 s to 37 s, 40 s to 21 s over
session start and a few small jobs, on a loaded 2-core machine). That CPU is what a loaded CI
machine lacks when Spark starts a Python worker and gives it a fixed 10 s to connect back
(``PythonWorkerFactory.createSimpleWorker``, not configurable in Spark 4): "Python worker failed
to connect back" was that deadline missed.
"""

from __future__ import annotations

from typing import Any

JVM_OPTIONS = "-XX:TieredStopAtLevel=1 -XX:CICompilerCount=1 -XX:+UseSerialGC"


def builder(app_name: str) -> Any:
    """A SparkSession builder with the settings every test driver shares."""
    from pyspark.sql import SparkSession

    return (SparkSession.builder.master("local[2]").appName(app_name)
            .config("spark.ui.enabled", "false")
            .config("spark.sql.shuffle.partitions", "2")
            .config("spark.driver.host", "127.0.0.1")
            .config("spark.driver.extraJavaOptions", JVM_OPTIONS))
