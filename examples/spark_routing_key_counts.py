"""Messages per routing key per minute of a Skred stream queue, with PySpark.

Reads the stream straight from a data directory (a stopped broker or a follower's copy, so the
leader is not loaded) or over AMQP from a running broker::

    python examples/spark_routing_key_counts.py --data-dir ./data --queue events
    python examples/spark_routing_key_counts.py --uri amqp://guest:guest@127.0.0.1:5672/%2F --queue events

Needs the ``spark`` extra (pyspark, pyarrow) and a Java runtime.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any


def routing_key_counts(df: Any) -> Any:
    """DataFrame (minute, routing_key, messages) ordered by minute then routing key."""
    from pyspark.sql import functions as F

    return (df.groupBy(F.date_trunc("minute", "timestamp").alias("minute"),
                       F.col("key").alias("routing_key"))
            .agg(F.count("*").alias("messages"))
            .orderBy("minute", "routing_key"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--data-dir", help="broker data directory (read-only)")
    src.add_argument("--uri", help="AMQP URI of a running broker")
    ap.add_argument("--vhost", default="/")
    ap.add_argument("--queue", required=True, help="stream queue name")
    ap.add_argument("--rows", type=int, default=50, help="rows to show")
    args = ap.parse_args(argv)

    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    from broker.spark import register

    spark = (SparkSession.builder.appName("skred-routing-key-counts")
             .config("spark.sql.python.filterPushdown.enabled", "true").getOrCreate())
    register(spark)
    reader = (spark.read.format("skred").option("vhost", args.vhost).option("queue", args.queue)
              .option("pushdown", "true"))
    reader = reader.option("data_dir", args.data_dir) if args.data_dir else reader.option("uri", args.uri)
    routing_key_counts(reader.load()).show(args.rows, truncate=False)
    spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
