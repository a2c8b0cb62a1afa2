"""Where the Delta tables live, and the few primitives every job uses to read and write them.

Only this module and the job modules' I/O edges touch storage; transforms never do.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

from pyspark.sql import DataFrame, SparkSession

from audit.core.config import Config
from audit.core.errors import InputError

log = logging.getLogger("msgaudit")


def table_path(cfg: Config, name: str) -> str:
    return str(Path(cfg.lake) / name)


def table_exists(spark: SparkSession, cfg: Config, name: str) -> bool:
    from delta.tables import DeltaTable

    return bool(DeltaTable.isDeltaTable(spark, table_path(cfg, name)))


def read_table(spark: SparkSession, cfg: Config, name: str) -> DataFrame:
    """Read a Delta table of the lake; InputError naming it (and what produces it) if it is missing."""
    if not table_exists(spark, cfg, name):
        raise InputError(
            f"Delta table {name!r} not found at {table_path(cfg, name)} "
            f"(run {PRODUCED_BY.get(name, 'the step that writes it')} first)"
        )
    return spark.read.format("delta").load(table_path(cfg, name))


def write_table(df: DataFrame, cfg: Config, name: str, *, mode: str = "append",
                partition_by: Sequence[str] = (), replace_where: str | None = None,
                add_columns: bool = False) -> None:
    """Append to / overwrite (optionally only the rows matching `replace_where`) a lake table.
    `add_columns` lets an append add columns a table written by an older version lacks."""
    writer = df.write.format("delta").mode(mode)
    if add_columns:
        writer = writer.option("mergeSchema", "true")
    if partition_by:
        writer = writer.partitionBy(*partition_by)
    if replace_where is not None:
        writer = writer.option("replaceWhere", replace_where)
    writer.save(table_path(cfg, name))


PRODUCED_BY = {
    "producer_ledger": "`msgaudit ingest`",
    "ledger_quarantine": "`msgaudit ingest`",
    "consumed_records": "`msgaudit ingest`",
    "log_records": "`msgaudit capture`",
    "group_offsets": "`msgaudit capture`",
    "partition_watermarks": "`msgaudit capture`",
    "audit_partition_report": "`msgaudit reconcile`",
    "audit_anomalies": "`msgaudit reconcile`",
}


# Columns of the contract a table written by an older version (or another writer) may lack: they are
# nullable and read as null (docs/design.md §4.2, partition_watermarks).
OPTIONAL_COLUMNS: dict[str, tuple[str, ...]] = {"partition_watermarks": ("captured_from", "captured_to")}
_UNPRUNED_WARNED: set[str] = set()


def read_input_table(spark: SparkSession, cfg: Config, name: str) -> tuple[DataFrame, bool]:
    """Read an input table of the lake, checked against its contract (docs/design.md §4): every
    column of `spark_jobs.io.schemas.TABLES[name]` must be there (InputError naming the table, the
    column and what writes it, before any Spark job runs); an optional column that is absent is
    read as null. Returns (frame, partitioned): `partitioned` is False when the table has no
    `part_hour` column -- a table written by another tool is read whole (filtered by topic only),
    with a warning, instead of refused."""
    from pyspark.sql import functions as F

    from spark_jobs.io.schemas import PART_HOUR, TABLES

    df = read_table(spark, cfg, name)
    present = set(df.columns)
    optional = OPTIONAL_COLUMNS.get(name, ())
    for field in TABLES[name].fields:
        if field.name in present:
            continue
        if field.name in optional:
            df = df.withColumn(field.name, F.lit(None).cast(field.dataType))
            continue
        raise InputError(
            f"table {name!r} at {table_path(cfg, name)} has no column {field.name!r} "
            f"({field.dataType.simpleString()}, docs/design.md §4.2); it is written by "
            f"{PRODUCED_BY.get(name, 'the step that writes it')} -- a table written by another tool must have "
            f"the contract's columns")
    partitioned = PART_HOUR in present
    if not partitioned and name in PARTITIONED_BY_HOUR:
        path = table_path(cfg, name)
        if path not in _UNPRUNED_WARNED:
            _UNPRUNED_WARNED.add(path)
            log.warning("table %r at %s has no %r column: it is read whole, without partition pruning "
                        "(every window reads all of it; see docs/design.md §4.1)", name, path, PART_HOUR)
    return df, partitioned


# The input tables partitioned by (topic, part_hour) (docs/design.md §4.1).
PARTITIONED_BY_HOUR = ("producer_ledger", "log_records", "consumed_records")
