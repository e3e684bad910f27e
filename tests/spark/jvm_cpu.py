"""CPU seconds of a test Spark driver JVM with and without spark_jvm.JVM_OPTIONS, in one run.

``PYTHONPATH=$PWD python tests/spark/jvm_cpu.py`` (from the repository root): each setting starts
a local session in a child process, runs a few small jobs like the tests' (an aggregation, a
Python RDD map, a sort of a created DataFrame), and reports the JVM's user + system CPU from
/proc, which a loaded machine changes far less than wall time. Bounded: 150 s per child.
"""

from __future__ import annotations

import os
import subprocess
import sys

CHILD = "--child"


def child(with_options: bool) -> None:
    from spark_jvm import JVM_OPTIONS, builder

    os.environ["PYSPARK_PYTHON"] = sys.executable
    b = builder("jvm-cpu")
    if not with_options:
        b = b.config("spark.driver.extraJavaOptions", "")
    spark = b.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    spark.range(200_000).selectExpr("id % 7 as k").groupBy("k").count().collect()
    spark.sparkContext.parallelize(range(10_000), 2).map(lambda x: x * 2).sum()
    spark.createDataFrame([(i, str(i)) for i in range(2000)], "a long, b string").orderBy("b").collect()
    pid = spark._jvm.java.lang.ProcessHandle.current().pid()
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    print(f"{(JVM_OPTIONS if with_options else '(JVM defaults)'):<62} {cpu:7.1f}", flush=True)
    spark.stop()


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == CHILD:
        child(sys.argv[2] == "1")
        return
    print(f"{'driver JVM options':<62} {'CPU s':>7}")
    for flag in ("0", "1"):
        proc = subprocess.run([sys.executable, __file__, CHILD, flag], capture_output=True, text=True,
                              timeout=150)
        print(proc.stdout.strip() or proc.stderr[-2000:])


if __name__ == "__main__":
    main()
