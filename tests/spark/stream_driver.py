"""A Structured Streaming driver run as its own process by test_amqp.py (killed with SIGKILL).

Reads the streams named by argv[3] over AMQP and writes ``topic:offset`` rows to the exchange
argv[4] with the exactly-once sink; argv[5] is ``run`` (200 ms micro-batches until killed) or
``finish`` (Trigger.AvailableNow, then exit).
"""

from __future__ import annotations

import os
import sys

from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from broker.spark import register


def main() -> None:
    url, ckpt, streams, target, mode = sys.argv[1:6]
    os.environ["PYSPARK_PYTHON"] = sys.executable
    spark = (SparkSession.builder.master("local[2]").appName("skred-driver")
             .config("spark.ui.enabled", "false").config("spark.driver.host", "127.0.0.1")
             .config("spark.sql.shuffle.partitions", "2").getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    register(spark)
    df = (spark.readStream.format("skred").option("uri", url).option("subscribe", streams)
          .option("startingOffsets", "earliest").option("maxOffsetsPerTrigger", "100").load())
    out = df.select(F.concat_ws(":", "topic", F.col("offset").cast("string")).cast("binary").alias("value"))
    writer = (out.writeStream.format("skred").option("uri", url).option("topic", target)
              .option("exactlyOnce", "true").option("checkpointLocation", ckpt))
    if mode == "finish":
        writer.trigger(availableNow=True).start().awaitTermination()
    else:
        print("started", flush=True)
        writer.trigger(processingTime="200 milliseconds").start().awaitTermination()


if __name__ == "__main__":
    main()
