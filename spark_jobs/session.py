"""`build_spark(cfg)`: a SparkSession with Delta Lake and Spark's Kafka source, from the jar cache.

The jars come from `msgaudit setup` (audit/jars.py), never from the network at run time. The
master and any extra Spark settings come from the config's `spark:` section. This module only
builds sessions; it reads and writes nothing.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

from pyspark.sql import SparkSession

from audit import jars
from audit.config import Config

DEFAULTS: Mapping[str, str] = {
    "spark.sql.extensions": "io.delta.sql.DeltaSparkSessionExtension",
    "spark.sql.catalog.spark_catalog": "org.apache.spark.sql.delta.catalog.DeltaCatalog",
    "spark.sql.session.timeZone": "UTC",
    "spark.sql.shuffle.partitions": "8",
    "spark.ui.enabled": "false",
    "spark.ui.showConsoleProgress": "false",
    "spark.driver.memory": "4g",
    "spark.databricks.delta.snapshotPartitions": "2",
    "spark.databricks.delta.schema.autoMerge.enabled": "false",
    "spark.sql.sources.partitionOverwriteMode": "static",
    # One local machine: skip the Delta log's checksum round trips on every tiny commit.
    "spark.databricks.delta.stalenessLimit": "0",
}


def spark_jar_paths() -> list[str]:
    return [str(p) for p in jars.jars("spark-deps")]


def build_spark(cfg: Config, app_name: str = "msgaudit", extra: Mapping[str, str] | None = None) -> SparkSession:
    """A Delta- and Kafka-ready SparkSession (master from cfg.spark['master'], default local[2])."""
    # The Python workers must be this interpreter (the venv), not whatever `python3` is on PATH.
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    conf = dict(DEFAULTS)
    conf.update({k: v for k, v in cfg.spark.items() if k != "master"})
    conf.update(extra or {})
    conf["spark.jars"] = ",".join(spark_jar_paths() + [p for p in conf.get("spark.jars", "").split(",") if p])
    conf.setdefault("spark.sql.warehouse.dir", str(cfg.home / "spark-warehouse"))
    conf.setdefault("spark.driver.extraJavaOptions", f"-Dderby.system.home={cfg.home / 'derby'}")
    builder = SparkSession.builder.master(cfg.spark_master).appName(app_name)
    for key, value in conf.items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel(cfg.spark.get("log_level", "WARN"))
    return spark
