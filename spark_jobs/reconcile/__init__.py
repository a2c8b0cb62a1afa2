"""`msgaudit reconcile`: classify one (topic, window) at the log, every group and every sink stage
(docs/design.md §5) and publish `audit_partition_report` + `audit_anomalies` (Delta and the report store).

The rules are the kernel's (`audit.rules`, with `audit.oracle` its plain statement); this package
only runs them, in four steps, each a module entered once per batch of windows:

- `plan`: which topics share a batch, where it is settled (the driver or Spark tasks) and in how
  many chunks;
- `read`: the Delta partitions a window needs, the rows its rules see, counted or collected;
- `settle`: the kernel in the driver on a small batch's collected rows, or in Spark tasks on the
  chunks of a large one, with the checks that need neighbours as Spark passes of their own;
- `publish`: the window's rows replaced in both Delta tables and the report store.

This module is one window end to end (`reconcile_batch`), ranges of windows and the CLI's summary.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import pyarrow as pa
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from audit.core.config import Config, TopicConfig
from audit.core.errors import InputError, ResultReleased
from audit.core.failover import ignored_rows_lines
from audit.core.windows import run_id_for, windows
from spark_jobs.io.lake import kept_rows
from spark_jobs.io.schemas import AUDIT_ANOMALIES, AUDIT_ANOMALIES_ARROW
from spark_jobs.io.session import arrow_frame, described, side_by_side
from spark_jobs.reconcile import settle
from spark_jobs.reconcile.plan import DRIVER_ROWS, MAX_TOPICS_PER_PLAN, Shape, batches, chunk_count, job_label
from spark_jobs.reconcile.publish import write_outputs, write_window_outputs
from spark_jobs.reconcile.read import (
    WindowInputs,
    check_window_inputs,
    collect_within,
    count_rows,
    pinned,
    read_batch_inputs,
    read_window_inputs,
    sinks_in_range,
    visible,
)

__all__ = [
    "MAX_TOPICS_PER_PLAN", "Classified", "Shape", "WindowInputs", "WindowResult", "classify_batch",
    "classify_window", "read_window_inputs", "reconcile_batch", "reconcile_range", "reconcile_window",
    "summary_line", "write_outputs",
]


@dataclass
class WindowResult:
    topic: str
    window_start: datetime
    as_of: datetime
    run_id: str
    report: list[dict[str, Any]]
    _anomalies: DataFrame
    anomaly_count: int
    quarantined_ledger_rows: int
    empty: bool
    released: bool = False
    # (group, cluster) -> consumption rows read on a mirror the group does not fail over to (§5.5)
    ignored_mirror_rows: dict[tuple[str, str], int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)  # said after the summary line: what was ignored, the fix
    # `anomalies`' rows, as the driver holds them (Arrow columns); None: the executors hold them
    anomaly_table: pa.Table | None = field(default_factory=AUDIT_ANOMALIES_ARROW.empty_table)
    cached: DataFrame | None = None  # the persisted frame `anomalies` reads, let go by `release()`

    @property
    def anomalies(self) -> DataFrame:
        """The window's anomaly rows. Read them before `release()`; after it this raises
        ResultReleased (read the published rows, audit_anomalies, instead)."""
        if self.released:
            raise ResultReleased(
                f"reconcile result of topic {self.topic!r}, window {self.window_start.isoformat()}: anomalies "
                "read after release(); collect them before release(), or read the published rows "
                "(audit_anomalies)")
        return self._anomalies

    def release(self) -> None:
        """Let go of the anomaly rows (the executors' too); `anomalies` raises ResultReleased from now
        on. Idempotent."""
        self.released = True
        if self.cached is not None:
            self.cached.unpersist()


@dataclass
class Classified:
    """One topic's window, classified: the report rows, the anomaly rows (a small local frame)."""

    report: list[dict[str, Any]]
    anomalies: DataFrame
    anomaly_count: int
    quarantined: int
    empty: bool
    ignored: dict[tuple[str, str], int] = field(default_factory=dict)  # (group, cluster) -> rows (§5.5)
    notes: list[str] = field(default_factory=list)
    # `anomalies`' rows, as the driver holds them (Arrow columns); None: the executors hold them
    anomaly_table: pa.Table | None = field(default_factory=AUDIT_ANOMALIES_ARROW.empty_table)
    cached: DataFrame | None = None  # the persisted frame `anomalies` reads


def _classified(spark: SparkSession, results: dict[str, settle.Result], shape: Shape) -> dict[str, Classified]:
    frame = arrow_frame(spark, pa.concat_tables([results[tc.name].anomalies for tc in shape.topics]), AUDIT_ANOMALIES)
    out: dict[str, Classified] = {}
    for tc in shape.topics:
        r = results[tc.name]
        anomalies = frame.where(F.col("topic") == tc.name) if len(shape.topics) > 1 else frame
        if r.kept is not None:  # settled in several tasks: most rows are the executors'
            anomalies = r.kept.unionByName(anomalies) if r.anomalies.num_rows else r.kept
        empty = not any(row["expected"] for row in r.report) and not r.count
        out[tc.name] = Classified(r.report, anomalies, r.count, r.quarantined, empty, r.ignored,
                                  ignored_rows_lines(tc, r.ignored), None if r.kept is not None else r.anomalies,
                                  r.cached)
    return out


def classify_batch(spark: SparkSession, inputs: WindowInputs, shape: Shape, ws: datetime, as_of: datetime,
                   engine: str = "auto", chunks: int | None = None) -> dict[str, Classified]:
    """Classify one window of every topic of `shape` (they share read ranges: `plan.batches`):
    `engine` 'driver' collects the rows and settles them here, 'spark' settles them in Spark tasks
    (`chunks` of them: by default `plan.chunk_count`), 'auto' chooses by the rows' count
    (`plan.in_driver`)."""
    label = job_label(shape, ws)
    seen = visible(inputs, shape, ws)
    rows = settle.tiers(seen)

    def counted() -> tuple[Any, int | None]:
        if engine == "driver":
            return rows.toArrow(), None
        if engine == "spark" or chunks is not None:
            count = kept_rows(rows)  # from the files' footers, where they tell
            return None, count if count is not None else count_rows(rows)
        return collect_within(rows, DRIVER_ROWS)

    (collected, count), small = side_by_side(spark, (f"{label}: inputs counted / collected", counted),
                                             (f"{label}: lookups", lambda: settle.small_inputs(spark, seen, f"{label}: lookups")))
    if collected is not None:
        results = settle.in_driver(collected, shape, ws, as_of, small)
    else:
        seen = visible(pinned(inputs, rows), shape, ws)  # the later queries list no file again
        n = chunks or chunk_count(count or 0, spark.sparkContext.defaultParallelism)
        results = settle.in_tasks(spark, seen, shape, ws, as_of, small, n, label)
    return _classified(spark, results, shape)


def classify_window(spark: SparkSession, inputs: WindowInputs, tc: TopicConfig, ws: datetime, as_of: datetime,
                    engine: str = "auto", chunks: int | None = None) -> Classified:
    """Classify one topic's window (a batch of one)."""
    return classify_batch(spark, inputs, Shape((tc,)), ws, as_of, engine, chunks)[tc.name]


def reconcile_window(spark: SparkSession, cfg: Config, topic: str, ws: datetime, as_of: datetime,
                     publish: bool = True) -> WindowResult:
    """One (topic, window): a batch of one."""
    return reconcile_batch(spark, cfg, Shape((cfg.topic(topic),)), ws, as_of, publish)[0]


def reconcile_batch(spark: SparkSession, cfg: Config, shape: Shape, ws: datetime, as_of: datetime,
                    publish: bool = True,
                    tables: dict[str, tuple[DataFrame, bool]] | None = None) -> list[WindowResult]:
    """One window of every topic of `shape`, settled where `reconcile.engine` says (docs/design.md
    §5.8), published with one commit per output table for the whole batch."""
    label = job_label(shape, ws)
    with described(spark, label):  # every job of the window is named after it, its steps after them
        inputs = sinks_in_range(read_batch_inputs(spark, cfg, shape, ws, tables), shape, ws)
        classified = classify_batch(spark, inputs, shape, ws, as_of, cfg.engine)
        if publish:
            anomalies = next(iter(classified.values())).anomalies if len(shape.topics) == 1 else \
                _all_anomalies(classified)
            held = [c.anomaly_table for c in classified.values()]
            write_window_outputs(spark, cfg, ws, {t: c.report for t, c in classified.items()}, anomalies,
                                 None if any(h is None for h in held) else pa.concat_tables(held),
                                 f"{label}: published", {t: c.anomaly_count for t, c in classified.items()})
    return [WindowResult(t, ws, as_of, run_id_for(t, ws, as_of), c.report, c.anomalies, c.anomaly_count,
                         c.quarantined, c.empty, ignored_mirror_rows=c.ignored, notes=c.notes,
                         anomaly_table=c.anomaly_table, cached=c.cached)
            for t, c in classified.items()]


def _all_anomalies(classified: dict[str, Classified]) -> DataFrame:
    frames = [c.anomalies for c in classified.values()]
    out = frames[0]
    for f in frames[1:]:
        out = out.unionByName(f)
    return out


def reconcile_range(spark: SparkSession, cfg: Config, start: datetime, end: datetime, as_of: datetime,
                    topics: Sequence[str] | None = None, progress: bool = False) -> list[WindowResult]:
    """Every (topic, window) overlapping [start, end), as of `as_of` (spark-submit / Airflow entry).
    All topics of a window start are classified together, in batches of topics with the same read
    ranges (`plan.batches`); each input table's Delta log is read once for the run."""
    names = list(topics) if topics else sorted(cfg.topics)
    if not names:
        raise InputError(f"{cfg.source}: no topics configured; add one under `topics:`")
    tables: dict[str, tuple[DataFrame, bool]] = {}  # each table opened once for the run
    for t in names:  # every input and sink table's columns, before the first window's Spark job
        check_window_inputs(spark, cfg, cfg.topic(t), tables)
    by_start: dict[datetime, list[TopicConfig]] = {}
    for t in names:
        for ws, _ in windows(start, end, cfg.topic(t).window):
            by_start.setdefault(ws, []).append(cfg.topic(t))
    jobs = [(ws, shape) for ws in sorted(by_start) for shape in batches(by_start[ws], ws, MAX_TOPICS_PER_PLAN)]
    results: dict[tuple[str, datetime], WindowResult] = {}
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=sum(len(s.topics) for _, s in jobs), desc="reconcile", unit="window")
    for ws, shape in jobs:
        for r in reconcile_batch(spark, cfg, shape, ws, as_of, tables=tables):
            r.release()
            results[(r.topic, ws)] = r
        if bar is not None:
            bar.update(len(shape.topics))
    if bar is not None:
        bar.close()
    return [results[(t, ws)] for t in names for ws, _ in windows(start, end, cfg.topic(t).window)]


def summary_line(r: WindowResult) -> str:
    """The window's line; then, one line each, the consumption rows read on a mirror that were
    ignored (§5.5) and the fix."""
    counts: dict[str, int] = {}
    for row in r.report:
        counts[row["stage"]] = counts.get(row["stage"], 0) + row["expected"]
    status = r.report[0]["status"] if r.report else "empty"
    extra = f", quarantined {r.quarantined_ledger_rows} malformed ledger rows or sink rows naming no message" if r.quarantined_ledger_rows else ""
    empty = " (empty window: no messages)" if r.empty else ""
    line = (f"{r.topic} {r.window_start.isoformat()} [{status}] anomalies={r.anomaly_count} "
            f"expected={json.dumps(counts)}{extra}{empty}")
    return "\n".join([line, *(f"{r.topic} {r.window_start.isoformat()}: {note}" for note in r.notes)])
