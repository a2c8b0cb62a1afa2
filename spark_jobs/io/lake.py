"""Where the Delta tables live, and the few primitives every job uses to read and write them.

Only this module and the job modules' I/O edges touch storage; transforms never do.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from pyspark.sql import DataFrame, SparkSession

from audit.core.config import Config
from audit.core.errors import InputError


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
