"""Publishing one window: `write_outputs` replaces the window's rows of `audit_partition_report` and
`audit_anomalies` in the Delta lake and in the report store.

With `read.py` this is the only I/O of the reconciliation; it must not change or classify the
rows it is given.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from audit.core.config import Config
from spark_jobs.io.lake import sql_string
from spark_jobs.io.session import local_frame, side_by_side

log = logging.getLogger("msgaudit")


def _to_df(spark: SparkSession, rows: Sequence[Mapping[str, Any]], schema: Any) -> DataFrame:
    return local_frame(spark, [tuple(r[f.name] for f in schema.fields) for r in rows], schema)


def write_outputs(spark: SparkSession, cfg: Config, topic: str, ws: datetime,
                  report: Sequence[Mapping[str, Any]], anomalies: DataFrame, held: pa.Table | None = None,
                  count: int | None = None) -> None:
    """Replace one topic's window rows in both Delta tables and the report store (`held`, `count`:
    `anomalies`' rows where the caller holds them, or how many they are, as `write_window_outputs`
    takes them)."""
    write_window_outputs(spark, cfg, ws, {topic: report}, anomalies, held,
                         counts=None if count is None else {topic: count})


# the report store is given a window's anomaly rows the executors hold in parts of about this many
# rows, each collected by a Spark job of its own: the driver never holds more of them at once
STORE_PART_ROWS = 500_000


def write_window_outputs(spark: SparkSession, cfg: Config, ws: datetime,
                         reports: Mapping[str, Sequence[Mapping[str, Any]]],
                         anomalies: DataFrame, held: pa.Table | None = None, label: str = "published",
                         counts: Mapping[str, int] | None = None) -> None:
    """Replace the window's rows of every topic of `reports` in both Delta tables (one commit per
    table for all of them) and the report store. `anomalies` holds the rows of those topics only;
    `held`, where the caller holds them, the same rows as Arrow columns (else they are collected, in
    parts of about STORE_PART_ROWS rows; `counts`, where the caller knows them, how many rows each
    topic has, else they are counted). The two Delta commits and the report store's write run side
    by side (each commit is mostly the driver waiting on the table's log); `label` names their Spark
    jobs."""
    from audit.serving.report_store import ANOMALIES, PARTITION_REPORT, ReportStore
    from spark_jobs.io.schemas import AUDIT_ANOMALIES, AUDIT_ANOMALIES_ARROW, AUDIT_PARTITION_REPORT

    topics = sorted(reports)
    which = (f"topic = {sql_string(topics[0])}" if len(topics) == 1
             else f"topic IN ({', '.join(sql_string(t) for t in topics)})")
    where = f"{which} AND window_start = to_timestamp('{ws.strftime('%Y-%m-%d %H:%M:%S')}')"
    report_df = _to_df(spark, [r for t in topics for r in reports[t]], AUDIT_PARTITION_REPORT)
    anomaly_df = anomalies.select(*[F.col(f.name).cast(f.dataType) for f in AUDIT_ANOMALIES.fields])

    def arrow(rows: pa.Table) -> pa.Table:
        return rows.select(AUDIT_ANOMALIES_ARROW.names).cast(AUDIT_ANOMALIES_ARROW)

    def stored() -> None:
        parts_of = _parts_of(anomalies, held, arrow, counts)
        pids: set[str] = set()

        def named(parts: Iterable[pa.Table]) -> Iterator[pa.Table]:
            for part in parts:
                pids.update(_settings_pids(part))
                yield part

        with ReportStore(cfg.report_store) as store:
            for t in topics:
                store.replace_window(PARTITION_REPORT, t, ws, reports[t])
                store.replace_window_columns(ANOMALIES, t, ws, named(parts_of(t)))
            store.record_settings(_settings_of(spark, cfg, pids))

    side_by_side(spark, *[(label, lambda df=df, name=name: replace_rows(spark, cfg, name, df, where))
                          for df, name in ((report_df, "audit_partition_report"), (anomaly_df, "audit_anomalies"))],
                 (label, stored))


# Both output tables are partitioned by (topic, window_start), so a window's publish replaces whole
# partitions: Delta drops their files from its log, reading and rewriting none (docs/design.md §4.3).
OUTPUT_PARTITION_BY = ("topic", "window_start")


def replace_rows(spark: SparkSession, cfg: Config, name: str, rows: DataFrame, where: str) -> None:
    """Replace the rows of output table `name` that match `where` (whole (topic, window_start)
    partitions) with `rows`, in one commit; columns a table written by an older version lacks are
    added (null in its other rows). A table of another layout (earlier versions partitioned the
    output tables by topic alone) is rewritten in this one, in the same commit: its other rows kept
    as they are (columns `rows` lacks kept too, null in the new rows), with one warning."""
    from spark_jobs.io.lake import partition_columns, read_table, table_path, write_table

    layout = partition_columns(spark, cfg, name)
    if layout is None or layout == OUTPUT_PARTITION_BY:
        write_table(rows, cfg, name, mode="overwrite", partition_by=OUTPUT_PARTITION_BY, replace_where=where,
                    add_columns=True)
        return
    log.warning("table %r at %s is %s: rewriting it partitioned by (%s) in this window's commit, once, so "
                "that each publish replaces whole partitions (docs/design.md §4.3)", name, table_path(cfg, name),
                f"partitioned by ({', '.join(layout)})" if layout else "not partitioned", ", ".join(OUTPUT_PARTITION_BY))
    kept = read_table(spark, cfg, name).where(f"NOT ({where})")
    write_table(kept.unionByName(rows, allowMissingColumns=True), cfg, name, mode="overwrite",
                partition_by=OUTPUT_PARTITION_BY, new_layout=True)


def _parts_of(anomalies: DataFrame, held: pa.Table | None, arrow: Callable[[pa.Table], pa.Table],
              known: Mapping[str, int] | None) -> Callable[[str], Iterable[pa.Table]]:
    """A topic's rows of `anomalies` in parts, as `arrow` makes them: in one part when the driver
    holds them (`held`) or they are at most STORE_PART_ROWS in all (collected at once); else each
    topic's in parts of about that many rows (a part by the hash of a row's identity). `known`: each
    topic's count of rows, where the caller has it (else one Spark job counts them)."""
    counts = None if held is not None else known if known is not None else \
        {r["topic"]: r["count"] for r in anomalies.groupBy("topic").count().collect()}
    if counts is None or sum(counts.values()) <= STORE_PART_ROWS:
        rows = arrow(held if held is not None else anomalies.toArrow())
        return lambda t: [rows.filter(pc.equal(rows["topic"], t))]

    def parts(topic: str) -> Iterator[pa.Table]:
        assert counts is not None
        k = -(-counts.get(topic, 0) // STORE_PART_ROWS)
        mine = anomalies.where(F.col("topic") == topic)
        part = F.pmod(F.xxhash64("stage", "partition", "anomaly", "pid", "seq", "offset", "detail"), F.lit(k))
        for i in range(k):
            yield arrow(mine.where(part == i).toArrow())

    return parts


def _settings_pids(anomalies: pa.Table) -> set[str]:
    """The pids named by log anomalies their producer settings decide (`audit.core.explain.SETTINGS_CODES`)."""
    from audit.core.explain import SETTINGS_CODES
    from audit.core.vocabulary import LOG, stage_kind

    named = anomalies.filter(pc.is_in(anomalies["anomaly"], pa.array(sorted(SETTINGS_CODES), pa.string())))
    return {r["pid"] for r in named.group_by(["stage", "pid"]).aggregate([]).to_pylist()
            if stage_kind(r["stage"]) == LOG and r["pid"] is not None}


def _settings_of(spark: SparkSession, cfg: Config, named: set[str]) -> list[dict[str, Any]]:
    """The lake's `producer_settings` rows of the pids `named` (`_settings_pids`), for the report
    store: the SLA step, the alerts and the dashboard name the setting behind an anomaly from there.
    None named: no read."""
    from spark_jobs.io.lake import read_table, table_exists

    pids = sorted(named)
    if not pids or not table_exists(spark, cfg, "producer_settings"):
        return []
    rows = read_table(spark, cfg, "producer_settings").where(F.col("pid").isin(pids)).drop("part_hour").collect()
    return sorted((_aware(r.asDict()) for r in rows), key=lambda r: (r["pid"], r["start_ts"]))


def _aware(row: dict[str, Any]) -> dict[str, Any]:
    """Spark hands back naive datetimes in the session time zone (UTC): make them aware."""
    return {k: (v.replace(tzinfo=UTC) if isinstance(v, datetime) and v.tzinfo is None else v)
            for k, v in row.items()}
