"""A Structured Streaming driver run as its own process by test_amqp.py (killed with SIGKILL).

Reads the streams named by argv[3] over AMQP and writes ``topic:offset`` rows to the exchange
argv[4] with the exactly-once sink, in 200 ms micro-batches of at most 100 offsets, until
killed. ``writer`` is the same query for the test's own SparkSession, which restarts it from
the checkpoint after the kill (another JVM, as a restarted driver is).
"""

from __future__ import annotations

import os
import sys
from typing import Any

from pyspark.sql import functions as F
from spark_jvm import builder

from broker.spark import register

RUN_BATCH = "100"  # offsets per micro-batch while running: the kill lands between batches' writes


def writer(spark: Any, url: str, ckpt: str, streams: str, target: str, max_per_trigger: str | None) -> Any:
    """The query's DataStreamWriter: ``topic:offset`` rows of ``streams`` to ``target``."""
    reader = (spark.readStream.format("skred").option("uri", url).option("subscribe", streams)
              .option("startingOffsets", "earliest"))
    if max_per_trigger is not None:
        reader = reader.option("maxOffsetsPerTrigger", max_per_trigger)
    out = reader.load().select(
        F.concat_ws(":", "topic", F.col("offset").cast("string")).cast("binary").alias("value"))
    return (out.writeStream.format("skred").option("uri", url).option("topic", target)
            .option("exactlyOnce", "true").option("checkpointLocation", ckpt))


def main() -> None:
    url, ckpt, streams, target = sys.argv[1:5]
    os.environ["PYSPARK_PYTHON"] = sys.executable
    spark = builder("skred-driver").getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    register(spark)
    print("started", flush=True)
    (writer(spark, url, ckpt, streams, target, RUN_BATCH).trigger(processingTime="200 milliseconds")
     .start().awaitTermination())


if __name__ == "__main__":
    main()
