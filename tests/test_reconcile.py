"""The Spark reconciliation on hand-written histories: every anomaly code with exact rows, equal to
the oracle; then the job's I/O (Delta lake in, Delta + report store out, sinks in Delta and in
SQL through Spark's JDBC source), reruns, and bad input."""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from audit.core.config import Config
from audit.core.errors import ConfigError, InputError, ResultReleased
from audit.oracle import reconcile_window as oracle_reconcile
from tests.reconcile_cases import (
    AS_OF_FINAL,
    GROUP,
    T0,
    TOPIC,
    G,
    History,
    S,
    at,
    brief,
    build_cases,
    norm_rows,
    sorted_anomalies,
    spark_reconcile,
    topic_config,
    write_delta_sink,
    write_lake,
)
from tests.support.jobs import job_descriptions, ours


@pytest.mark.spark
def test_every_anomaly_code_in_spark_equals_the_hand_written_expectation_and_the_oracle(spark: Any) -> None:
    history, cases = build_cases()
    tc = topic_config()
    report, anomalies, quarantined = spark_reconcile(spark, tc, T0, AS_OF_FINAL, history.inputs())
    injected = sorted({t for rows in cases.values() for t in rows},
                      key=lambda t: tuple("" if v is None else str(v) for v in t))
    assert brief(anomalies) == injected
    oracle = oracle_reconcile(tc, T0, AS_OF_FINAL, history.inputs())
    assert anomalies == sorted_anomalies(oracle.anomalies)
    assert report == norm_rows(oracle.report)
    assert len(report) == 67 and quarantined == 0


@pytest.mark.spark
@pytest.mark.parametrize(("as_of_min", "expected"), [
    (64.99, [(G, "pending", 0, "p", 0, 0), (S, "pending", 0, "p", 1, 1)]),
    (75, [(G, "overdue", 0, "p", 0, 0), (S, "missing_in_sink", 0, "p", 1, 1)]),
])
def test_pending_then_judged_around_the_grace_boundary_in_spark(
        spark: Any, as_of_min: float, expected: list[tuple[Any, ...]]) -> None:
    h = History()
    h.captured(0, 0, 100, at(55), group_committed=0)
    h.produce("p", 0, 0, 0, at(50))
    h.record("p", 0, 0, 0, at(50))
    h.produce("p", 1, 0, 1, at(50))
    h.record("p", 1, 0, 1, at(50))
    h.consume("p", 1, 0, 1, at(51))
    tc = topic_config()
    report, anomalies, _ = spark_reconcile(spark, tc, T0, at(as_of_min), h.inputs())
    assert brief(anomalies) == expected
    assert report == norm_rows(oracle_reconcile(tc, T0, at(as_of_min), h.inputs()).report)
    assert {r["status"] for r in report} == {"provisional" if as_of_min < 75 else "final"}


@pytest.mark.spark
def test_only_failed_outcomes_are_pending_then_retry_overdue_in_spark(spark: Any) -> None:
    from tests.test_oracle import retry_history

    tc, h = topic_config(), retry_history()
    for as_of_min, code in ((64.99, "pending"), (65, "retry_overdue")):
        report, anomalies, _ = spark_reconcile(spark, tc, T0, at(as_of_min), h.inputs())
        assert brief(anomalies) == [(G, code, 0, "r", 0, 0)]
        oracle = oracle_reconcile(tc, T0, at(as_of_min), h.inputs())
        assert anomalies == sorted_anomalies(oracle.anomalies)
        assert report == norm_rows(oracle.report)


@pytest.mark.spark
def test_a_reordering_across_a_chunk_cut_is_found_by_settling_both_chunks_again(spark: Any) -> None:
    """Eight messages of one pid cut into two chunks at seq 4; seq 2 and seq 5 swapped places in the
    log (offsets 5 and 2), so each chunk's offsets reach into the other's. Only then do the two
    chunks settle again for their part of the log order (its own Spark job): seqs 3, 4 and 2, each
    below seq 5 at a lower offset, are `reordered_in_log`, as the oracle says."""
    from spark_jobs.reconcile import classify_window
    from tests.reconcile_cases import window_inputs

    h = History()
    h.captured(0, 0, 100, at(70), group_committed=100)
    for seq in range(8):
        h.clean("p", seq, 0, {2: 5, 5: 2}.get(seq, seq), at(5 + seq))
    tc = topic_config()
    before = set(job_descriptions(spark))
    c = classify_window(spark, window_inputs(spark, h.inputs(), tc), tc, T0, AS_OF_FINAL, engine="spark", chunks=2)
    anomalies = sorted_anomalies(r.asDict() for r in c.anomalies.collect())
    assert [a for a in brief(anomalies) if a[1] == "reordered_in_log"] == [
        ("log", "reordered_in_log", 0, "p", 2, 5), ("log", "reordered_in_log", 0, "p", 3, 3),
        ("log", "reordered_in_log", 0, "p", 4, 4)]
    assert anomalies == sorted_anomalies(oracle_reconcile(tc, T0, AS_OF_FINAL, h.inputs()).anomalies)
    steps = [ours(d).rsplit(": ", 1)[-1] for i, d in job_descriptions(spark).items() if i not in before]
    assert "log order across cuts" in steps and "settled in 2 tasks" in steps


@pytest.mark.spark
def test_only_offsets_a_capture_read_can_be_lost(spark: Any) -> None:
    """An acked offset inside [log start, high watermark) that no capture read (it was past the
    last stable offset, or outside the planned time range) stays pending, never lost_acked."""
    h = History()
    h.captured(0, 0, 100, at(70), read=(0, 5))
    h.captured(1, 0, 100, at(70), read=(0, 5))
    h.captured(1, 0, 100, at(80), read=(5, 9))  # a later capture read further
    for p in (0, 1):
        h.produce("p", 2 * p, p, 4, at(10))  # read, not in the log: lost
        h.produce("p", 2 * p + 1, p, 6, at(10))  # read only on partition 1
    tc = topic_config()
    report, anomalies, _ = spark_reconcile(spark, tc, T0, AS_OF_FINAL, h.inputs())
    assert brief(anomalies) == [("log", "lost_acked", 0, "p", 0, 4), ("log", "lost_acked", 1, "p", 2, 4),
                                ("log", "lost_acked", 1, "p", 3, 6)]
    log = {r["partition"]: (r["expected"], r["lost"], r["pending"]) for r in report if r["stage"] == "log"}
    assert log == {0: (2, 1, 1), 1: (2, 2, 0)}
    oracle = oracle_reconcile(tc, T0, AS_OF_FINAL, h.inputs())
    assert anomalies == sorted_anomalies(oracle.anomalies) and report == norm_rows(oracle.report)


# ---------------------------------------------------------------------------- the job, with I/O
# Where a published window is settled (`reconcile.engine`): in the driver (`driver`; `auto` for these
# few rows) or in Spark tasks (`spark`). The other engine is made to fail, so each case proves which
# one ran.
# `tasks`: engine spark with the window cut in two chunks (its few rows would make one).
PATHS = {"auto": {}, "driver": {"reconcile": {"engine": "driver"}}, "spark": {"reconcile": {"engine": "spark"}},
         "tasks": {"reconcile": {"engine": "spark"}}}


def _only_path(monkeypatch: pytest.MonkeyPatch, path: str) -> None:
    """Makes every engine but `path`'s fail."""
    import spark_jobs.reconcile.settle as settle

    def refuse(what: str) -> Callable[..., Any]:
        def refused(*_: Any, **__: Any) -> Any:
            raise AssertionError(f"the {what} ran")
        return refused

    if path in ("spark", "tasks"):
        monkeypatch.setattr(settle, "in_driver", refuse("driver engine"))
        if path == "tasks":
            import spark_jobs.reconcile as reconcile

            monkeypatch.setattr(reconcile, "chunk_count", lambda rows, parallelism: 2)
    else:
        monkeypatch.setattr(settle, "in_tasks", refuse("Spark-task engine"))


def _config(make_config: Callable[..., Config], tmp_path: Path, path: str = "driver") -> Config:
    return make_config(tmp_path, **PATHS[path], topics={TOPIC: {
        "window": "1h", "grace": "15m", "groups": [GROUP],
        "sinks": [{"name": "s1", "format": "delta", "location": "sinks/s1", "group": GROUP},
                  {"name": "s2", "format": "sql", "url": "sqlite:///sinks/s2.db", "table": "orders",
                   "group": GROUP}]}})


def _io_history() -> History:
    h = History()
    h.captured(0, 0, 100, at(70), group_committed=100)
    for i in range(3):
        h.clean("p", i, 0, i, at(5 + i))
    h.produce("p", 3, 0, 3, at(9))  # lost_acked
    # s2 (SQL) holds seq 0 twice and lacks seq 2
    h.sinks["s2"] = [h.sinks["s1"][0], h.sinks["s1"][0], h.sinks["s1"][1]]
    return h


def _fixed(t: datetime) -> Callable[[], datetime]:
    return lambda: t


def _write_sql_sink(url: str, rows: list[Any]) -> None:
    from audit.clients.sinks import SinkRecord, SqlSink

    for r in rows:
        with SqlSink(url, "orders", "insert", now=_fixed(r.sink_ts)) as sink:
            sink.write([SinkRecord({"amount": 1}, TOPIC, r.partition, r.offset, r.pid, r.seq)])


def _delta_rows(spark: Any, cfg: Config, table: str) -> list[dict[str, Any]]:
    from spark_jobs.io.lake import read_table

    rows = norm_rows(r.asDict() for r in read_table(spark, cfg, table).collect())
    return sorted(rows, key=lambda r: tuple("" if r[k] is None else str(r[k]) for k in sorted(r)))


def _our_persisted_rdds(spark: Any) -> set[int]:
    """Ids of the RDDs kept in the block manager, except Delta's own cached table states."""
    rdds = spark.sparkContext._jsc.getPersistentRDDs()
    return {int(k) for k, r in rdds.items() if not str(r.name() or "").startswith("Delta Table State")}


# The steps a window's Spark jobs are named after (Spark UI: "msgaudit reconcile <topic> <window>:
# <step>"), on each engine, for `_io_history` (the tests' session has two cores: two tasks).
STEPS = {
    "auto": {"inputs counted / collected", "lookups", "published"},
    "driver": {"inputs counted / collected", "lookups", "published"},
    "spark": {"inputs counted / collected", "lookups", "settled in one task", "published"},
    "tasks": {"inputs counted / collected", "lookups", "committed offsets", "order of consumption", "chunks",
              "settled in 2 tasks", "published"},
}


@pytest.mark.spark
@pytest.mark.parametrize("path", sorted(PATHS))
def test_reconcile_job_reads_the_lake_and_both_sink_kinds_and_reruns_replace_the_window(
        spark: Any, make_config: Callable[..., Config], tmp_path: Path, path: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    from audit.serving.report_store import ANOMALIES, PARTITION_REPORT, ReportStore
    from spark_jobs.io.lake import partition_columns
    from spark_jobs.reconcile import reconcile_window

    cfg = _config(make_config, tmp_path, path)
    _only_path(monkeypatch, path)
    h = _io_history()
    write_lake(spark, cfg.lake, h.inputs())
    write_delta_sink(spark, tmp_path / "sinks" / "s1", h.sinks["s1"])
    (tmp_path / "sinks").mkdir(exist_ok=True)
    _write_sql_sink(f"sqlite:///{tmp_path / 'sinks' / 's2.db'}", h.sinks["s2"])
    oracle = oracle_reconcile(cfg.topic(TOPIC), T0, AS_OF_FINAL, h.inputs())
    assert brief(oracle.anomalies) == [
        ("log", "lost_acked", 0, "p", 3, 3),
        ("sink:s2", "duplicate_in_sink", 0, "p", 0, 0),
        ("sink:s2", "missing_in_sink", 0, "p", 2, 2),
    ]

    kept_before = _our_persisted_rdds(spark)
    jobs_before = set(job_descriptions(spark))
    first = reconcile_window(spark, cfg, TOPIC, T0, AS_OF_FINAL)
    assert norm_rows(first.report) == norm_rows(oracle.report)
    # every job of the window is named after it (Delta's file listings after the step they serve), and
    # its steps are the path's
    label = "msgaudit reconcile t 2026-11-21T10:00:00+00:00"
    named = [d for i, d in job_descriptions(spark).items() if i not in jobs_before]
    assert named and all(ours(d).startswith(label) for d in named), named
    assert {d.split(": ")[-1] for d in named if d.startswith(f"{label}: ")} == STEPS[path]
    # settled in several tasks, the anomaly rows stay with the executors until the result is released
    assert (_our_persisted_rdds(spark) != kept_before) == (path == "tasks")
    report_1 = _delta_rows(spark, cfg, "audit_partition_report")
    anomalies_1 = _delta_rows(spark, cfg, "audit_anomalies")
    assert [partition_columns(spark, cfg, t) for t in ("audit_partition_report", "audit_anomalies")] == [
        ("topic", "window_start")] * 2
    assert sorted_anomalies(anomalies_1) == sorted_anomalies(oracle.anomalies)
    assert len(report_1) == 4  # log, group:g1, sink:s1, sink:s2 for partition 0
    with ReportStore(cfg.report_store) as store:
        stored_1 = (store.read(PARTITION_REPORT, TOPIC), store.read(ANOMALIES, TOPIC))
    assert len(stored_1[0]) == 4 and len(stored_1[1]) == 3
    assert sorted_anomalies(r.asDict() for r in first.anomalies.collect()) == sorted_anomalies(oracle.anomalies)
    first.release()
    assert _our_persisted_rdds(spark) == kept_before  # nothing is left kept
    with pytest.raises(ResultReleased, match=r"topic 't', window 2026-11-21T10:00:00\+00:00: anomalies read after"):
        first.anomalies.collect()  # not a Spark error about a missing checkpoint block

    # Same inputs, same as_of: identical rows everywhere, nothing appended.
    reconcile_window(spark, cfg, TOPIC, T0, AS_OF_FINAL)
    assert _delta_rows(spark, cfg, "audit_partition_report") == report_1
    assert _delta_rows(spark, cfg, "audit_anomalies") == anomalies_1
    with ReportStore(cfg.report_store) as store:
        assert (store.read(PARTITION_REPORT, TOPIC), store.read(ANOMALIES, TOPIC)) == stored_1

    # A provisional run of the same window replaces the window's rows rather than adding to them.
    early = at(70)
    reconcile_window(spark, cfg, TOPIC, T0, early)
    report_2 = _delta_rows(spark, cfg, "audit_partition_report")
    assert {(r["status"], r["computed_at"]) for r in report_2} == {("provisional", early)}
    assert len(report_2) == 4
    assert sorted_anomalies(_delta_rows(spark, cfg, "audit_anomalies")) == sorted_anomalies(
        oracle_reconcile(cfg.topic(TOPIC), T0, early, h.inputs()).anomalies)


@pytest.mark.spark
def test_anomaly_rows_the_executors_hold_reach_the_report_store_in_parts(
        spark: Any, make_config: Callable[..., Config], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Settled in several tasks, a window's anomaly rows stay with the executors; the report store
    gets them in parts of about `STORE_PART_ROWS` rows, one Spark job each (here 1 row: three parts,
    split by a hash, so some may be empty), the same rows as the Delta table and the oracle."""
    import spark_jobs.reconcile.publish as publish
    from audit.serving.report_store import ANOMALIES, ReportStore
    from spark_jobs.reconcile import reconcile_window

    cfg = _config(make_config, tmp_path, "tasks")
    _only_path(monkeypatch, "tasks")
    monkeypatch.setattr(publish, "STORE_PART_ROWS", 1)
    h = _io_history()
    write_lake(spark, cfg.lake, h.inputs())
    write_delta_sink(spark, tmp_path / "sinks" / "s1", h.sinks["s1"])
    (tmp_path / "sinks").mkdir(exist_ok=True)
    _write_sql_sink(f"sqlite:///{tmp_path / 'sinks' / 's2.db'}", h.sinks["s2"])
    want = sorted_anomalies(oracle_reconcile(cfg.topic(TOPIC), T0, AS_OF_FINAL, h.inputs()).anomalies)
    parts: list[int] = []
    insert = ReportStore._insert_columns

    def counted(self: ReportStore, conn: Any, t: Any, topic: str, ws: Any, columns: Any, batch: int) -> int:
        parts.append(columns.num_rows)
        return insert(self, conn, t, topic, ws, columns, batch)

    monkeypatch.setattr(ReportStore, "_insert_columns", counted)
    r = reconcile_window(spark, cfg, TOPIC, T0, AS_OF_FINAL)
    assert (r.anomaly_count, r.anomaly_table) == (3, None)  # the driver holds none of them
    assert (len(parts), sum(parts)) == (3, 3)
    with ReportStore(cfg.report_store) as store:
        assert sorted_anomalies(store.read(ANOMALIES, TOPIC)) == want
    assert sorted_anomalies(_delta_rows(spark, cfg, "audit_anomalies")) == want
    r.release()


@pytest.mark.spark
@pytest.mark.parametrize("old_layout", [("topic",), ()], ids=["by-topic", "unpartitioned"])
def test_a_publish_replaces_whole_window_partitions_and_rewrites_an_older_layout_once(
        spark: Any, make_config: Callable[..., Config], tmp_path: Path, caplog: pytest.LogCaptureFixture,
        old_layout: tuple[str, ...]) -> None:
    """The output tables are partitioned by (topic, window_start): a window's publish drops whole
    partitions, no file is read or rewritten. A table partitioned by topic alone (as earlier versions
    wrote them) or not at all, here with a column another tool added, is rewritten in that layout by
    its first publish, every other row and column kept, with one warning."""
    import logging
    from datetime import timedelta

    from delta.tables import DeltaTable
    from pyspark.sql import functions as F

    from spark_jobs.io.lake import partition_columns, read_table, table_path, write_table
    from spark_jobs.io.schemas import AUDIT_ANOMALIES
    from spark_jobs.io.session import local_frame
    from spark_jobs.reconcile.publish import replace_rows

    cfg = make_config(tmp_path)
    name = "audit_anomalies"
    w0, w1 = T0, T0 + timedelta(hours=1)

    def frame(topic: str, ws: datetime, seqs: list[int], run: str) -> Any:
        return local_frame(spark, [(ws, topic, 0, "log", "lost_acked", "p", s, s, None, run, ws) for s in seqs],
                           AUDIT_ANOMALIES)

    def where(topic: str, ws: datetime) -> str:
        return f"topic = '{topic}' AND window_start = to_timestamp('{ws:%Y-%m-%d %H:%M:%S}')"

    def jobs_of(action: Callable[[], None]) -> list[str]:
        before = set(job_descriptions(spark))
        action()
        return [ours(d) for i, d in job_descriptions(spark).items() if i not in before]

    def table() -> list[tuple[Any, ...]]:
        return sorted((r["topic"], r["window_start"], r["seq"], r["run_id"], r["note"])
                      for r in read_table(spark, cfg, name).collect())

    def rewrites(jobs: list[str]) -> list[str]:
        return [d for d in jobs if "files to rewrite" in d or d.startswith("Rewriting ")]

    old = (frame("t", w0, [1, 2], "old").unionByName(frame("t", w1, [3], "old"))
           .unionByName(frame("u", w0, [4], "old")).withColumn("note", F.lit("kept")))
    write_table(old, cfg, name, mode="overwrite", partition_by=old_layout)
    # in the old layout a window's replace reads and rewrites its files (what the new layout saves)
    jobs = jobs_of(lambda: write_table(frame("t", w0, [1, 2], "old").withColumn("note", F.lit("kept")), cfg, name,
                                       mode="overwrite", partition_by=old_layout, replace_where=where("t", w0)))
    assert rewrites(jobs), jobs
    assert partition_columns(spark, cfg, name) == old_layout
    assert partition_columns(spark, cfg, "audit_partition_report") is None

    with caplog.at_level(logging.WARNING, logger="msgaudit"):
        replace_rows(spark, cfg, name, frame("t", w0, [5, 6], "new"), where("t", w0))
    assert [r.getMessage() for r in caplog.records] == [
        f"table 'audit_anomalies' at {table_path(cfg, name)} is "
        f"{'partitioned by (topic)' if old_layout else 'not partitioned'}: rewriting it partitioned by "
        "(topic, window_start) in this window's commit, once, so that each publish replaces whole partitions "
        "(docs/design.md §4.3)"]
    assert partition_columns(spark, cfg, name) == ("topic", "window_start")
    assert DeltaTable.forPath(spark, table_path(cfg, name)).detail().collect()[0]["partitionColumns"] == [
        "topic", "window_start"]
    n0, n1 = w0.replace(tzinfo=None), w1.replace(tzinfo=None)
    assert table() == [("t", n0, 5, "new", None), ("t", n0, 6, "new", None), ("t", n1, 3, "old", "kept"),
                       ("u", n0, 4, "old", "kept")]

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="msgaudit"):
        jobs = jobs_of(lambda: replace_rows(spark, cfg, name, frame("t", w0, [7], "again"), where("t", w0)))
    assert caplog.records == []
    assert jobs and rewrites(jobs) == [], jobs
    assert table() == [("t", n0, 7, "again", None), ("t", n1, 3, "old", "kept"), ("u", n0, 4, "old", "kept")]


@pytest.mark.spark
def test_a_publish_adds_the_columns_an_output_table_of_an_older_version_lacks(
        spark: Any, make_config: Callable[..., Config], tmp_path: Path) -> None:
    """A column the output table lacks (a newer version's, here `detail`) is added by the publish: the
    window's new rows hold it, the table's other rows read null there."""
    from datetime import timedelta

    from spark_jobs.io.lake import read_table, write_table
    from spark_jobs.io.schemas import AUDIT_ANOMALIES
    from spark_jobs.io.session import local_frame
    from spark_jobs.reconcile.publish import OUTPUT_PARTITION_BY, replace_rows

    cfg = make_config(tmp_path)
    w1 = T0 + timedelta(hours=1)
    rows = [(ws, "t", 0, "log", "lost_acked", "p", seq, seq, "why", "r", ws) for ws, seq in ((T0, 1), (w1, 2))]
    write_table(local_frame(spark, rows, AUDIT_ANOMALIES).drop("detail"), cfg, "audit_anomalies",
                mode="overwrite", partition_by=OUTPUT_PARTITION_BY)
    replace_rows(spark, cfg, "audit_anomalies", local_frame(spark, rows[:1], AUDIT_ANOMALIES),
                 f"topic = 't' AND window_start = to_timestamp('{T0:%Y-%m-%d %H:%M:%S}')")
    got = read_table(spark, cfg, "audit_anomalies")
    assert sorted(got.columns) == sorted(f.name for f in AUDIT_ANOMALIES.fields)
    assert sorted((r["seq"], r["detail"]) for r in got.collect()) == [(1, "why"), (2, None)]


@pytest.mark.spark
def test_small_inputs_are_collected_and_counted_at_once_larger_ones_counted_on_the_plan_already_made(
        spark: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from pyspark.sql import functions as F

    from spark_jobs.reconcile import read as driver

    path = str(tmp_path / "t")
    spark.range(0, 1000, numPartitions=4).withColumn("p", F.col("id") % 3).write.format("delta") \
        .partitionBy("p").save(path)
    sc = spark.sparkContext
    groups = itertools.count()

    def jobs(action: Callable[[], Any]) -> tuple[Any, int]:
        """(action's result, how many Spark jobs it ran)"""
        group = f"test-count-rows-{next(groups)}"
        sc.setJobGroup(group, group)
        try:
            out = action()
        finally:
            sc.setLocalProperty("spark.jobGroup.id", None)
        return out, len(sc.statusTracker().getJobIdsForGroup(group))

    def frame() -> Any:
        return spark.read.format("delta").load(path).where("p = 1").unionByName(
            spark.range(5000, 5001).withColumn("p", F.lit(1).cast("long")))

    frame().collect()  # the table's log is read once: from now on, planning a query only lists its files
    planned = frame()
    _, listing = jobs(lambda: planned._jdf.queryExecution().optimizedPlan().stats())
    assert listing >= 1
    # a few KB of files: collected at once, on the plan that listed them, and counted as collected
    (table, n_rows), n = jobs(lambda: driver.collect_within(frame(), 334))
    assert (table.num_rows, n_rows, n) == (334, 334, listing + 1)
    assert sorted(table.column("id").to_pylist()) == [*range(1, 1000, 3), 5000]
    assert jobs(lambda: driver.collect_within(frame(), 333)) == ((None, 334), listing + 1)  # one too many
    # larger files, or a scan of unknown size (a SQL sink's JDBC read is one; here rows handed over from
    # Python): first a count of no column, on the plan the size estimate made, whose scans keep their
    # files; then the collect on the same plan, only if the rows are few enough
    df = frame()
    jobs(lambda: df._jdf.queryExecution().optimizedPlan().stats())
    counted, n = jobs(lambda: driver.count_rows(df))
    sparks, m = jobs(df.count)  # Spark's own count plans the query again, and lists the files again
    assert counted == sparks == 334 and n == m - listing
    monkeypatch.setattr(driver, "COLLECT_FIRST_MAX_BYTES", 100)
    (table, n_rows), k = jobs(lambda: driver.collect_within(frame(), 334))
    assert (table.num_rows, n_rows, k) == (334, 334, listing + n + 1)  # the listing, the count, the collect
    assert jobs(lambda: driver.collect_within(frame(), 333)) == ((None, 334), listing + n)  # the count alone
    unknown = frame().unionByName(spark.createDataFrame([(6000, 1)], "id long, p long"))
    assert driver.collect_within(unknown, 10)[1] == 335
    # every scan a Delta table of plain Parquet files (string partition columns, as the lake's): counted
    # from the kept files' footers, with no job of its own; a filter on a data column aside (p = 1's
    # files hold 333 rows, 48 of them with id % 7 = 0)
    strings = str(tmp_path / "s")
    spark.range(0, 1000, numPartitions=4).withColumn("p", (F.col("id") % 3).cast("string")).write.format("delta") \
        .partitionBy("p").save(strings)

    def delta_only() -> Any:
        return spark.read.format("delta").load(strings).where("p = '1' AND id % 7 = 0")

    delta_only().collect()
    _, listed = jobs(lambda: delta_only()._jdf.queryExecution().optimizedPlan().stats())
    assert jobs(lambda: driver.collect_within(delta_only(), 47)) == ((None, 333), listed)
    (table, n_rows), k = jobs(lambda: driver.collect_within(delta_only(), 333))
    assert (table.num_rows, n_rows, k) == (48, 48, listed + 1)  # within the limit: collected, counted exactly


@pytest.mark.unit
def test_collected_columns_become_the_values_to_pylist_gives() -> None:
    """The driver way's fast conversion (UTC timestamps from their microseconds) gives what
    `to_pylist` gives, nulls included; other time zones and types take `to_pylist` itself."""
    from datetime import UTC

    import pyarrow as pa

    from audit import oracle
    from audit.rules.columns import row_maker, values

    micros = [0, -1, 1_764_590_400_123_456, None, 253_402_214_400_000_000]  # 9999-12-31 the last
    for unit, tz in (("us", "UTC"), ("ms", "UTC"), ("us", "Europe/Paris"), ("us", None)):
        scale = 1000 if unit == "ms" else 1
        col = pa.chunked_array([pa.array([None if m is None else m // scale for m in micros],
                                         type=pa.timestamp(unit, tz=tz))])
        got, want = values(col), col.to_pylist()
        assert got == want and [None if v is None else v.utcoffset() for v in got] == \
            [None if v is None else v.utcoffset() for v in want]
    no_nulls = pa.chunked_array([pa.array([5, 6], type=pa.timestamp("us", tz="UTC"))])
    assert values(no_nulls) == [datetime(1970, 1, 1, 0, 0, 0, 5, tzinfo=UTC), datetime(1970, 1, 1, 0, 0, 0, 6, tzinfo=UTC)]
    assert values(pa.chunked_array([pa.array(["a", None])])) == ["a", None]
    # positionally when the columns are the leading fields; by keyword otherwise (a field left out,
    # or a keyword-only one such as a mirror record's `mirror`)
    assert row_maker(oracle.SinkRow, ["partition", "offset", "pid", "seq", "sink_ts"]) is oracle.SinkRow
    by_keyword = row_maker(oracle.SinkRow, ["partition", "pid", "seq", "sink_ts", "offset"])
    assert by_keyword(1, "p", 2, None, 7) == oracle.SinkRow(1, 7, "p", 2, None)
    ts = datetime(2026, 1, 1, tzinfo=UTC)
    mirror = row_maker(oracle.MirrorRecord, ["partition", "offset", "pid", "seq", "produce_ts", "kafka_ts",
                                             "captured_at", "fingerprint", "committed", "header_error", "topic",
                                             "mirror"])
    assert mirror(0, 1, "p", 2, ts, ts, ts, "f", True, None, "t", "m") == oracle.MirrorRecord(
        0, 1, "p", 2, ts, ts, ts, "f", True, None, "t", mirror="m")


@pytest.mark.spark
def test_missing_input_table_is_one_clear_error(spark: Any, make_config: Callable[..., Config],
                                                tmp_path: Path) -> None:
    from spark_jobs.reconcile import reconcile_window

    cfg = _config(make_config, tmp_path)
    with pytest.raises(InputError, match=r"'producer_ledger' not found .*msgaudit ingest"):
        reconcile_window(spark, cfg, TOPIC, T0, AS_OF_FINAL)


@pytest.mark.spark
def test_sink_without_audit_columns_is_one_clear_error(spark: Any, make_config: Callable[..., Config],
                                                      tmp_path: Path) -> None:
    from spark_jobs.io.sinks_read import read_sink

    cfg = _config(make_config, tmp_path)
    location = tmp_path / "sinks" / "s1"
    spark.createDataFrame([(1, "x")], "id int, payload string").write.format("delta").save(str(location))
    with pytest.raises(InputError, match=r"sink 's1' has no audit column 'audit_topic'.*sinks\[\]\.columns\.topic"):
        read_sink(spark, cfg.topic(TOPIC).sinks[0], TOPIC)
    missing = cfg.topic(TOPIC).sinks[1]
    with pytest.raises(InputError, match=r"sink 's2': cannot read table 'orders' over JDBC"):
        read_sink(spark, missing, TOPIC)


@pytest.mark.unit
def test_unknown_topic_is_a_config_error_before_any_jvm(make_config: Callable[..., Config],
                                                        tmp_path: Path) -> None:
    from audit.cli import COMMANDS

    cfg = _config(make_config, tmp_path)
    args = argparse.Namespace(command="reconcile", start="2026-11-21T10:00Z", end="2026-11-21T11:00Z",
                              as_of="2026-11-21T11:30Z", topics=["nope"])
    with pytest.raises(ConfigError, match="unknown topic 'nope'"):
        COMMANDS["reconcile"](args, cfg)


@pytest.mark.unit
def test_jdbc_options_from_sqlalchemy_urls() -> None:
    from spark_jobs.io.sinks_read import jdbc_options

    assert jdbc_options("postgresql+psycopg://u:p%40ss@db:5433/audit") == {
        "url": "jdbc:postgresql://db:5433/audit", "driver": "org.postgresql.Driver", "user": "u",
        "password": "p@ss"}
    assert jdbc_options("sqlite:////data/s.db") == {"url": "jdbc:sqlite:/data/s.db", "driver": "org.sqlite.JDBC"}
    with pytest.raises(ConfigError, match="postgresql or sqlite"):
        jdbc_options("mysql://x/y")


def _retopic(inputs: Any, topic: str, sinks: dict[str, str]) -> Any:
    """The same history under another topic name; `sinks` maps each sink of the copy to the sink
    of the original whose rows it holds."""
    from dataclasses import replace

    from audit.oracle import Inputs

    def mv(rows: Any) -> list[Any]:
        return [replace(r, topic=topic) for r in rows]

    return Inputs(mv(inputs.ledger), mv(inputs.log), mv(inputs.consumed), mv(inputs.group_offsets),
                  mv(inputs.watermarks), {s: mv(inputs.sinks.get(src, [])) for s, src in sinks.items()})


@pytest.mark.spark
@pytest.mark.parametrize("path", ["driver", "tasks"])
def test_many_topics_in_one_plan_each_equal_the_oracle(spark: Any, make_config: Callable[..., Config],
                                                       tmp_path: Path, path: str,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """`reconcile_range` classifies all topics of a window in one batch (in the driver or in Spark tasks):
    three topics with different groups and sinks (none; one group and its sink; two groups, two
    sinks reading one physical table) over one lake and one shared Delta sink table each give
    exactly the oracle's rows for that topic alone, published with one commit per output table."""
    from audit.oracle import Inputs
    from spark_jobs.reconcile import reconcile_range

    history, _ = build_cases()
    base = history.inputs()
    loc = str(tmp_path / "sinks" / "shared")
    _only_path(monkeypatch, path)
    cfg = make_config(tmp_path, **PATHS[path], topics={
        "t": {"window": "1h", "grace": "15m", "groups": [GROUP],
              "sinks": [{"name": "s1", "format": "delta", "location": loc, "group": GROUP}]},
        "u": {"window": "1h", "grace": "15m", "sinks": [{"name": "s1", "format": "delta", "location": loc}]},
        "v": {"window": "1h", "grace": "15m", "groups": [GROUP, "g2"],
              "sinks": [{"name": "s1", "format": "delta", "location": loc, "group": GROUP},
                        {"name": "s2", "format": "delta", "location": loc}]},
    })
    per_topic = {"t": _retopic(base, "t", {"s1": "s1"}), "u": _retopic(base, "u", {"s1": "s1"}),
                 "v": _retopic(base, "v", {"s1": "s1", "s2": "s1"})}
    def merged(f: str) -> list[Any]:
        return [r for i in per_topic.values() for r in getattr(i, f)]

    everything = Inputs(ledger=merged("ledger"), log=merged("log"), consumed=merged("consumed"),
                        group_offsets=merged("group_offsets"), watermarks=merged("watermarks"))
    write_lake(spark, cfg.lake, everything)
    write_delta_sink(spark, Path(loc), [r for t in ("t", "u", "v") for r in per_topic[t].sinks["s1"]])
    results = reconcile_range(spark, cfg, T0, T0 + (at(60) - T0), AS_OF_FINAL)
    assert [r.topic for r in results] == ["t", "u", "v"]
    published = _delta_rows(spark, cfg, "audit_anomalies")
    for r in results:
        oracle = oracle_reconcile(cfg.topic(r.topic), T0, AS_OF_FINAL, per_topic[r.topic])
        assert norm_rows(r.report) == norm_rows(oracle.report), r.topic
        assert sorted_anomalies(a for a in published if a["topic"] == r.topic) == sorted_anomalies(
            oracle.anomalies), r.topic
        assert r.anomaly_count == len(oracle.anomalies) > 0
    assert {a["topic"] for a in published} == {"t", "u", "v"}


@pytest.mark.spark
def test_a_window_counts_and_reads_only_the_rows_of_a_sinks_range(
        spark: Any, make_config: Callable[..., Config], tmp_path: Path) -> None:
    """A sink is a user's table of every window: a window's inputs are counted and settled over the
    sink's rows of the window's range (sink_ts in it, or null), not the table's other days."""
    import pyarrow.compute as pc

    from audit.oracle import SinkRow
    from spark_jobs.reconcile import Shape, read_batch_inputs, settle
    from spark_jobs.reconcile.read import collect_within, sinks_in_range, visible

    cfg = make_config(tmp_path, topics={TOPIC: {"window": "1h", "grace": "15m", "groups": [GROUP], "sinks": [
        {"name": "s1", "format": "delta", "location": str(tmp_path / "s1"), "group": GROUP}]}})
    h = _io_history()
    write_lake(spark, cfg.lake, h.inputs())
    old = [SinkRow(0, 100 + i, "old", i, at(-24 * 60 + i)) for i in range(5)]  # a day before the window
    write_delta_sink(spark, tmp_path / "s1", old)
    write_delta_sink(spark, tmp_path / "s1", [*h.sinks["s1"], SinkRow(0, 200, "nots", 0, None)], mode="append")
    shape = Shape((cfg.topic(TOPIC),))
    inputs = read_batch_inputs(spark, cfg, shape, T0)
    everything = settle.tiers(inputs)
    counted = settle.tiers(visible(sinks_in_range(inputs, shape, T0), shape, T0))
    all_rows, rows = collect_within(everything, 10**6)[1], collect_within(counted, 10**6)[1]
    assert all_rows - rows >= len(old)
    table, _ = collect_within(counted, 10**6)
    assert table is not None
    sinks = table.filter(pc.equal(table["_tag"], "sink"))
    want = sorted([(r.pid, r.seq) for r in h.sinks["s1"]] + [("nots", 0)], key=repr)
    assert sorted(zip(sinks["pid"].to_pylist(), sinks["seq"].to_pylist(), strict=True), key=repr) == want


@pytest.mark.unit
def test_chunk_cuts_come_from_the_ledgers_row_group_statistics(tmp_path: Path) -> None:
    """A ledger written sorted by seq in small row groups is cut into chunks of about as many rows
    from its footers alone; a file without seq statistics leaves the cut to Spark's quantiles."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from spark_jobs.reconcile.read import FileTable
    from spark_jobs.reconcile.settle import footer_cuts

    seqs = pa.table({"seq": pa.array(range(10_000), pa.int64())})
    pq.write_table(seqs, tmp_path / "a.parquet", row_group_size=500)
    pq.write_table(seqs, tmp_path / "b.parquet", row_group_size=500, write_statistics=False)
    schema = pa.schema([("seq", pa.int64())])

    def table(*names: str) -> FileTable:
        return FileTable(tuple(str(tmp_path / n) for n in names), (), None, schema, (("seq", "seq"),), schema)

    cuts = footer_cuts(table("a.parquet"), 4)
    assert cuts is not None and len(cuts) == 3
    assert all(abs(c - want) <= 100 for c, want in zip(cuts, (2_500, 5_000, 7_500), strict=True)), cuts
    assert footer_cuts(table("a.parquet", "b.parquet"), 4) is None
    assert footer_cuts(None, 4) is None


@pytest.mark.unit
def test_rows_packed_for_the_content_pass_come_back_whole_and_leave_no_memory_held() -> None:
    """`settle._blobs` packs rows by bucket into OUT rows and `_unblobbed` gives them back, every
    row once; once the packed rows are dropped, the process holds no more Arrow memory than before
    (a Python worker settles many chunks in turn: memory a chunk left held would add up, until the
    executor's machine runs out)."""
    import gc

    import numpy as np
    import pyarrow as pa

    from spark_jobs.reconcile import settle

    n = 200_000
    rows = pa.table({"topic": pa.array(["t"] * n), "pid": pa.array(["p"] * n), "seq": pa.array(np.arange(n)),
                     "partition": pa.array(np.arange(n) % 3), "offset": pa.array(np.arange(n)),
                     "pt": pa.array(np.arange(n)), "win": pa.array(np.ones(n, dtype=bool)),
                     "fp1": pa.array(np.arange(n) * 7), "fp2": pa.array(np.arange(n) * 11)})
    bucket = np.arange(n) % 4
    packed = settle._blobs(rows, settle.BY_CONTENT, bucket)
    assert packed["n"].to_pylist() == [0, 1, 2, 3]
    back = settle._unblobbed(packed)
    assert sorted(back["seq"].to_pylist()) == list(range(n))
    assert back.sort_by("seq").equals(rows)
    del packed, back
    gc.collect()
    held = pa.total_allocated_bytes()
    for _ in range(3):
        packed = settle._blobs(rows, settle.BY_CONTENT, bucket)
        del packed
    gc.collect()
    assert pa.total_allocated_bytes() == held


@pytest.mark.unit
def test_a_batch_is_cut_into_whole_rounds_of_the_cores_while_each_chunk_keeps_its_minimum() -> None:
    """`plan.chunk_count`: about CHUNK_ROWS rows a chunk, raised to fill every core's last round,
    never so far that a chunk gets fewer than MIN_CHUNK_ROWS; one chunk for a batch too small to share."""
    from spark_jobs.reconcile.plan import CHUNK_ROWS, MIN_CHUNK_ROWS, chunk_count

    assert (CHUNK_ROWS, MIN_CHUNK_ROWS) == (3_000_000, 100_000)
    assert chunk_count(0, 2) == chunk_count(150_000, 2) == 1  # a second chunk would hold < 100,000 rows
    assert chunk_count(250_000, 2) == 2 and chunk_count(250_000, 8) == 2
    assert chunk_count(8_000_000, 2) == 4  # 3 chunks of CHUNK_ROWS, a fourth so the last round has no idle core
    assert chunk_count(8_000_000, 1) == 3
    assert chunk_count(80_000_000, 2) == 28 and chunk_count(80_000_000, 8) == 32
    assert chunk_count(1_000_001, 8) == 8
