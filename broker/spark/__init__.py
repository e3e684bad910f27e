"""PySpark data source for Skred stream queues (install the ``skred[spark]`` extra).

Usage::

    from broker.spark import register
    register(spark)
    df = (spark.read.format("skred").option("data_dir", DIR).option("vhost", "/")
          .option("queue", "events").load())

See ``broker/spark/source.py`` for the modes (data dir, AMQP) and Structured Streaming.
"""

from __future__ import annotations

from typing import Any


def register(spark: Any) -> None:
    """Register the ``skred`` format with a SparkSession."""
    from broker.spark.source import SkredDataSource

    spark.dataSource.register(SkredDataSource)
