"""`build_spark(cfg)`: a SparkSession with Delta Lake and Spark's Kafka source, from the jar cache.

The jars come from `msgaudit setup` (audit/runtime/jars.py), never from the network at run time. The
master and any extra Spark settings come from the config's `spark:` section. Under spark-submit
the driver JVM already exists, so the jars must be passed as `--jars` (see `spark_jar_paths`,
which the Airflow DAGs use) and the master is spark-submit's. This module only
builds sessions, names the jobs a thread starts (`described`) and turns the driver's own rows into a
DataFrame (`local_frame`); it reads and writes nothing.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.types import StructType

from audit.core.config import Config
from audit.runtime import jars, memory, quiet

DEFAULTS: Mapping[str, str] = {
    "spark.sql.extensions": "io.delta.sql.DeltaSparkSessionExtension",
    "spark.sql.catalog.spark_catalog": "org.apache.spark.sql.delta.catalog.DeltaCatalog",
    "spark.sql.session.timeZone": "UTC",
    # the executors run in UTC too: their JVMs' default zone, and any Python worker (utc_process_clock)
    "spark.executorEnv.TZ": "UTC",
    "spark.sql.shuffle.partitions": "8",
    # One window's reconcile generates a few hundred classes (whole-stage code, projections,
    # predicates); with Spark's default cache of 100 every run evicted the previous one's and
    # compiled them all again, most of a small window's executor time.
    "spark.sql.codegen.cache.maxEntries": "2000",
    # pyspark's DataFrame debugging wraps every DataFrame and Column call to record its Python call
    # site in the JVM: a walk of the Python stack and about ten gateway round trips per call. A
    # window's plan makes about a thousand such calls, about a second of its driver time
    # (docs/benchmarks.md); msgaudit's errors name their step themselves.
    "spark.python.sql.dataFrameDebugging.enabled": "false",
    "spark.ui.enabled": "false",
    "spark.ui.showConsoleProgress": "false",
    "spark.databricks.delta.snapshotPartitions": "2",
    "spark.databricks.delta.schema.autoMerge.enabled": "false",
    "spark.sql.sources.partitionOverwriteMode": "static",
    # Timestamps written as INT64 microseconds, not Spark's default INT96: Parquet keeps no usable
    # statistics for INT96, and a window's reads skip row groups by their produce times
    # (`lake.pin_scans`).
    "spark.sql.parquet.outputTimestampType": "TIMESTAMP_MICROS",
    # Row groups of about 4 MB (Parquet's default: 128 MB, one per file here): a file the ledgers'
    # ingest writes sorted by seq (`lake.by_seq`) then holds row groups of narrow seq ranges
    # (docs/internals.md). Only the Hadoop setting is honoured.
    "spark.hadoop.parquet.block.size": str(4 << 20),
    # One local machine: skip the Delta log's checksum round trips on every tiny commit.
    "spark.databricks.delta.stalenessLimit": "0",
}


def spark_jar_paths() -> list[str]:
    return [str(p) for p in jars.jars("spark-deps")]


def under_spark_submit() -> bool:
    """True when this Python was started by spark-submit (which hands it a running JVM gateway)."""
    return "PYSPARK_GATEWAY_PORT" in os.environ


def utc_process_clock() -> None:
    """Make this process's local time zone UTC. pyspark turns TIMESTAMP values into naive datetimes,
    and naive datetimes into TIMESTAMP values, in the Python process's local zone whatever
    `spark.sql.session.timeZone` says; every time msgaudit reads back is UTC, so a driver started
    with another TZ would shift them (failover instants, report windows) by its offset."""
    if os.environ.get("TZ") != "UTC":
        os.environ["TZ"] = "UTC"
        time.tzset()


def build_spark(cfg: Config, app_name: str = "msgaudit", extra: Mapping[str, str] | None = None) -> SparkSession:
    """A Delta- and Kafka-ready SparkSession (master from cfg.spark['master'], default local[2])."""
    utc_process_clock()  # before the JVM starts: local Python workers inherit the environment
    memory.keep_freed_memory()  # a job's driver: numpy's freed arrays stay for the next chunk
    # The Python workers must be this interpreter (the venv), not whatever `python3` is on PATH.
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    conf = {**DEFAULTS, **cfg.driver_jvm}
    conf.update({k: v for k, v in cfg.spark.items() if k not in ("master", "log_level")})
    conf.update(extra or {})
    conf.setdefault("spark.sql.warehouse.dir", str(cfg.home / "spark-warehouse"))
    builder = SparkSession.builder.appName(app_name)
    # Under spark-submit the master and the driver JVM's --jars are already chosen; setting them
    # here would be ignored (jars) or override the operator's choice (master).
    if not under_spark_submit():
        conf["spark.jars"] = ",".join(spark_jar_paths() + [p for p in conf.get("spark.jars", "").split(",") if p])
        java = conf["spark.driver.extraJavaOptions"]
        if "-Dderby.system.home=" not in java:
            conf["spark.driver.extraJavaOptions"] = f"{java} -Dderby.system.home={cfg.home / 'derby'}".strip()
        builder = builder.master(cfg.spark_master)
    for key, value in conf.items():
        builder = builder.config(key, value)
    with quiet.jvm_output(cfg.home):  # the JVM's own output goes to the log file (unless --verbose)
        spark = builder.getOrCreate()
    # Object-store settings (`spark.hadoop.fs.s3a.endpoint`, credentials, ...) reach Hadoop only when
    # a SparkContext starts; under spark-submit, or with a session that already exists, the context
    # is older than this config, so its Hadoop configuration gets them here.
    hadoop_conf = spark.sparkContext._jsc.hadoopConfiguration()
    for key, value in conf.items():
        if key.startswith("spark.hadoop."):
            hadoop_conf.set(key[len("spark.hadoop."):], value)
    spark.sparkContext.setLogLevel(cfg.spark.get("log_level", "WARN"))
    # reconcile releases its local checkpoints on purpose; RDD.unpersist warns about each one
    jvm = spark.sparkContext._jvm
    assert jvm is not None  # a classic (non-Connect) session
    jvm.org.apache.logging.log4j.core.config.Configurator.setLevel(
        "org.apache.spark.rdd.MapPartitionsRDD", jvm.org.apache.logging.log4j.Level.ERROR)
    return spark


@contextmanager
def described(spark: SparkSession, text: str) -> Iterator[None]:
    """Names the Spark jobs this thread starts inside the block -- `spark.job.description`, the
    Description column of the Spark UI and the history server -- then restores the name before it.
    Each Python thread has its own (pyspark pins one JVM thread to it)."""
    sc = spark.sparkContext
    before = sc.getLocalProperty("spark.job.description")
    sc.setJobDescription(text)
    try:
        yield
    finally:
        sc.setLocalProperty("spark.job.description", before)  # type: ignore[arg-type]  # None removes it


def side_by_side(spark: SparkSession, *steps: tuple[str, Callable[[], Any]]) -> list[Any]:
    """Runs each step (the name of its Spark jobs, `described`; what it does) in a thread of its own,
    so Spark runs their jobs side by side, and returns their results in order (the first failure is
    raised). For the small jobs of a window, each mostly the driver planning and waiting on a round
    trip: together they take about the time of the longest."""
    from concurrent.futures import ThreadPoolExecutor

    from pyspark.util import inheritable_thread_target

    def named(text: str, step: Callable[[], Any]) -> Callable[[], Any]:
        def run() -> Any:
            with described(spark, text):
                return step()
        return inheritable_thread_target(spark)(run)

    if len(steps) == 1:
        return [named(*steps[0])()]
    with ThreadPoolExecutor(max_workers=len(steps), thread_name_prefix="msgaudit-step") as pool:
        running = [pool.submit(named(text, step)) for text, step in steps]
        return [r.result() for r in running]


def local_frame(spark: SparkSession, rows: Iterable[Sequence[Any]], schema: StructType | str) -> DataFrame:
    """A DataFrame of rows the driver holds (tuples in the schema's order), decoded in the JVM: the
    rows travel as Arrow columns, so no Spark job reading them starts a Python worker.
    `spark.createDataFrame` of a Python list pickles the rows into an RDD that only Python workers
    decode: a Python process per executor core, started to decode a handful of report rows. Values
    are converted to the schema's types as `createDataFrame` converts them (a naive datetime is in
    the session's time zone, UTC); a None in a column the schema declares not nullable is refused, as
    `createDataFrame` refuses it."""
    import pyarrow as pa
    from pyspark.sql.pandas.types import to_arrow_schema
    from pyspark.sql.types import DataType

    struct = DataType.fromDDL(schema) if isinstance(schema, str) else schema
    assert isinstance(struct, StructType)
    arrow = to_arrow_schema(struct, timezone="UTC")
    data = list(rows)
    columns = [pa.array([r[i] for r in data], type=arrow.field(i).type) for i in range(len(struct.fields))]
    return arrow_frame(spark, pa.Table.from_arrays(columns, schema=arrow), struct)


def arrow_frame(spark: SparkSession, table: Any, struct: StructType) -> DataFrame:
    """A DataFrame of an Arrow table the driver holds (`struct`'s columns, as `to_arrow_schema` types
    them), decoded in the JVM like `local_frame`'s rows; a null in a column `struct` declares not
    nullable is refused."""
    for f in struct.fields:
        if not f.nullable and table[f.name].null_count:
            raise ValueError(f"column {f.name!r} is not nullable, but {table[f.name].null_count} of "
                             f"{table.num_rows} rows hold None")
    return spark.createDataFrame(table, struct)
