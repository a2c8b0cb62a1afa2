"""The Spark reconciliation on hand-written histories: every anomaly code with exact rows, equal to
the oracle; then the job's I/O (Delta lake in, Delta + report store out, sinks in Delta and in
SQL through Spark's JDBC source), reruns, and bad input."""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Callable, Collection
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
def test_general_path_without_the_broadcast_gives_the_same_rows(spark: Any,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Beyond BROADCAST_KEYS_MAX non-ordinary units the general path semi-joins by shuffle; with the
    limit at 0 (and Spark's own size-based broadcasts off) every hand-written case takes that path
    and must still equal the oracle."""
    from spark_jobs.reconcile import units

    monkeypatch.setattr(units, "BROADCAST_KEYS_MAX", 0)
    history, _ = build_cases()
    tc = topic_config()
    before = spark.conf.get("spark.sql.autoBroadcastJoinThreshold")
    spark.conf.set("spark.sql.autoBroadcastJoinThreshold", "-1")
    try:
        report, anomalies, _ = spark_reconcile(spark, tc, T0, AS_OF_FINAL, history.inputs())
    finally:
        spark.conf.set("spark.sql.autoBroadcastJoinThreshold", before)
    oracle = oracle_reconcile(tc, T0, AS_OF_FINAL, history.inputs())
    assert anomalies == sorted_anomalies(oracle.anomalies)
    assert report == norm_rows(oracle.report)


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
# Where a published window is classified: in the driver (small inputs, the default); on Arrow
# columns because the inputs hold more rows than `reconcile.driver_rows` (here 5) and at most
# `reconcile.columnar_rows`; on Arrow columns in chunks of at most `columnar_rows` (here 6) rows
# when they hold more, the chunks held in memory (a small spill) or, when memory is short, in files,
# or read from the lake's row groups by seq range (`chunked-ranged`: these tiny files' row groups
# span every chunk, so the test lets them be read that way whatever it costs); or by the Spark plan
# (`columnar_rows: 0`). The other paths are made to fail, so each case proves which one ran.
PATHS = {"driver": {}, "columnar": {"reconcile": {"driver_rows": 5}},
         "chunked": {"reconcile": {"driver_rows": 5, "columnar_rows": 6}},
         "chunked-files": {"reconcile": {"driver_rows": 5, "columnar_rows": 6}},
         "chunked-ranged": {"reconcile": {"driver_rows": 5, "columnar_rows": 6}},
         "spark": {"reconcile": {"driver_rows": 5, "columnar_rows": 0}}}


def _only_path(monkeypatch: pytest.MonkeyPatch, path: str) -> list[str]:
    """Makes every path but `path` fail; on a chunked path, the spill's kind, as each window spills
    ('memory' or 'files'), is appended to the list returned (files: no memory to spare), and each
    table read by seq range from its row groups ('ranged ledger', ...)."""
    import spark_jobs.reconcile as rec
    import spark_jobs.reconcile.driver as driver

    spills: list[str] = []
    if path.startswith("chunked"):
        spill = driver.spill_tables

        def recorded(*args: Any) -> Any:
            spills.append("memory" if args[-1] is None else "files")
            return spill(*args)
        monkeypatch.setattr(rec, "spill_tables", recorded)
        if path == "chunked-files":
            monkeypatch.setattr(driver, "_available_memory", lambda: 0)
        if path == "chunked-ranged":
            monkeypatch.setattr(driver, "RANGED_COST", float("inf"))
        note = driver.RowGroups.note

        def noted(self: Any, split: Any, kind: str) -> None:
            spills.append(f"ranged {kind}")
            note(self, split, kind)
        monkeypatch.setattr(driver.RowGroups, "note", noted)

    def refuse(what: str) -> Callable[..., Any]:
        def refused(*_: Any, **__: Any) -> Any:
            raise AssertionError(f"the {what} ran")
        return refused

    others = {"driver": {"classify_batch": "Spark plan", "classify_columnar": "columnar path",
                         "classify_columnar_chunks": "columnar path in chunks"},
              "columnar": {"classify_batch": "Spark plan", "classify_collected": "driver path",
                           "classify_columnar_chunks": "columnar path in chunks"},
              "chunked": {"classify_batch": "Spark plan", "classify_collected": "driver path",
                          "classify_columnar": "columnar path"},
              "chunked-files": {"classify_batch": "Spark plan", "classify_collected": "driver path",
                                "classify_columnar": "columnar path"},
              "chunked-ranged": {"classify_batch": "Spark plan", "classify_collected": "driver path",
                                 "classify_columnar": "columnar path"},
              "spark": {"classify_collected": "driver path", "classify_columnar": "columnar path",
                        "classify_columnar_chunks": "columnar path in chunks"}}[path]
    for name, what in others.items():
        monkeypatch.setattr(rec, name, refuse(what))
    return spills


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
# <step>"), on each path, for `_io_history` (few rows: no block digests, the typed path).
STEPS = {
    "driver": {"inputs counted / collected", "published"},
    "columnar": {"inputs counted / collected", "columnar", "published"},
    "chunked": {"inputs counted / collected", "columnar, in chunks", "published"},
    "chunked-files": {"inputs counted / collected", "columnar, in chunks", "published"},
    "chunked-ranged": {"inputs counted / collected", "columnar, in chunks", "published"},
    "spark": {"inputs counted / collected", "consumption order", "lookups", "typed path", "general path keys",
              "general path", "narrow rows", "repeated hashes", "summary", "published"},
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
    spills = _only_path(monkeypatch, path)
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
    # the summary the result holds, nothing else (the driver path holds its rows in the driver)
    assert len(_our_persisted_rdds(spark) - kept_before) == (1 if path == "spark" else 0)
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
    assert _our_persisted_rdds(spark) == kept_before  # the checkpoints and the summary are freed
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
    windows: list[list[str]] = []  # per window: its spill, then its ranged tables (noted side by side)
    for kind in spills:
        if kind.startswith("ranged"):
            windows[-1].append(kind)
        else:
            windows.append([kind])
    assert [[w[0], *sorted(w[1:])] for w in windows] == {
        "chunked": [["memory"]] * 3, "chunked-files": [["files"]] * 3,
        "chunked-ranged": [["memory", "ranged consumed", "ranged ledger", "ranged log"]] * 3}.get(path, [])


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
    from spark_jobs.reconcile.outputs import replace_rows

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
    from spark_jobs.reconcile.outputs import OUTPUT_PARTITION_BY, replace_rows

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

    from spark_jobs.reconcile import driver

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
    from spark_jobs.reconcile.columnar import row_maker, values

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
def test_a_spill_codes_a_column_of_many_values_per_chunk() -> None:
    """A coded column whose dictionary, repeated in each chunk's stream, would outweigh its rows (a
    value per row) is coded anew in each chunk's piece; one of few values is kept as read."""
    import pyarrow as pa

    from spark_jobs.reconcile.driver import _plain, _recoded, _wide_codes

    many = pa.array([f"v{i}" for i in range(8)]).dictionary_encode()
    few = pa.array(["a", "b"] * 4).dictionary_encode()
    batch = pa.RecordBatch.from_arrays([many, few, pa.array(range(8))], names=["many", "few", "n"])
    assert _wide_codes(batch, 2) == [0] and _wide_codes(batch, 1) == []
    piece = _recoded(batch.slice(2, 3), _wide_codes(batch, 2))
    assert piece.column(0).dictionary.to_pylist() == ["v2", "v3", "v4"]
    assert piece.column(1).dictionary.to_pylist() == ["a", "b"]
    assert piece.schema == batch.schema
    assert _plain(pa.Table.from_batches([piece])).to_pydict() == {
        "many": ["v2", "v3", "v4"], "few": ["a", "b", "a"], "n": [2, 3, 4]}


@pytest.mark.unit
def test_jdbc_options_from_sqlalchemy_urls() -> None:
    from spark_jobs.io.sinks_read import jdbc_options

    assert jdbc_options("postgresql+psycopg://u:p%40ss@db:5433/audit") == {
        "url": "jdbc:postgresql://db:5433/audit", "driver": "org.postgresql.Driver", "user": "u",
        "password": "p@ss"}
    assert jdbc_options("sqlite:////data/s.db") == {"url": "jdbc:sqlite:/data/s.db", "driver": "org.sqlite.JDBC"}
    with pytest.raises(ConfigError, match="postgresql or sqlite"):
        jdbc_options("mysql://x/y")



@pytest.mark.spark
def test_only_ordinary_messages_take_the_typed_path(spark: Any) -> None:
    """`typed_units` settles exactly the ordinary delivered messages; every unit with something to
    report goes to the general (array) path. Both paths together equal the oracle."""
    from datetime import timedelta

    from spark_jobs.reconcile import (
        Shape,
        collect_lookups,
        flag_consumption_order,
        restrict,
        sink_rows,
        typed_tiers,
        typed_units,
    )
    from spark_jobs.reconcile.params import batch_params
    from tests.reconcile_cases import window_inputs

    h = History()
    h.captured(0, 0, 100, at(70), group_committed=100)
    for seq in range(4):
        h.clean("p", seq, 0, seq, at(10 + seq))  # seq 0..3 ordinary
    h.consume("p", 1, 0, 1, at(30), consumer="c2")  # seq 1 redelivered
    h.sink("p", 2, 0, 2, at(31))  # seq 2 twice in the sink
    h.produce("p", 4, 0, 4, at(14))
    h.record("p", 4, 0, 4, at(14))  # seq 4 never consumed: missed
    h.produce("p", 5, 0, 5, at(15))
    h.record("p", 5, 0, 6, at(15))  # seq 5 in the log at another offset than acked
    h.consume("p", 5, 0, 6, at(15) + timedelta(seconds=1))
    h.sink("p", 5, 0, 6, at(15) + timedelta(seconds=2))
    tc = topic_config()
    vis = restrict(window_inputs(spark, h.inputs(), tc), tc, T0)
    assert vis.consumed is not None
    shape = Shape((tc,))
    params = batch_params(spark, shape, T0, AS_OF_FINAL, {tc.name: collect_lookups([], [], tc.groups)})
    typed = typed_units(typed_tiers(vis.ledger, vis.log, flag_consumption_order(vis.consumed), sink_rows(vis),
                                    shape), shape, params)
    assert sorted((r["k2"], r["simple"]) for r in typed.select("k2", "simple").collect()) == [
        (0, True), (1, False), (2, False), (3, True), (4, False), (5, False)]
    report, anomalies, _ = spark_reconcile(spark, tc, T0, AS_OF_FINAL, h.inputs())
    oracle = oracle_reconcile(tc, T0, AS_OF_FINAL, h.inputs())
    assert anomalies == sorted_anomalies(oracle.anomalies)
    assert report == norm_rows(oracle.report)
    assert sorted(a[1] for a in brief(anomalies)) == ["duplicate_in_sink", "missed", "redelivered"]


def _blocks_history(carried: bool = True, stray: bool = False) -> History:
    """Blocks of 8 seqs (BLOCK_BITS 3): p's first and third clean (the third holds two seqs), its
    second dirtied by one redelivery; q's first dirtied by seq 2 at another offset than acked, after
    seq 3 in the log and in the group (the same seqs everywhere: only the hashes differ); r's first clean but wholly before the window;
    s's first clean in every count, but one of its processings goes backwards in offset; u's first
    clean, but one sink row carries a produce time ten minutes off the ledger's, and v's first
    clean with no produce time carried: both get their latencies from the typed path; w's first
    clean, one seq before the window and one inside; z's two blocks clean, written in offset order
    but with seq 3 after seq 9 (across the blocks) and 13 before 12 (inside one), so both are
    reordered in the log although every tier agrees; a's two blocks clean, carrying no produce time,
    the first in the window, the second wholly after it (within grace: 'out'), its seq 7 retried and
    landed behind the whole second block (read in offset order by the group), so reordered in the
    log. `carried`: whether the other clean messages' consumption and sink rows carry their produce
    time (then p's, w's and z's blocks are 'local', and r's 'outl'). `stray`: with y's first block too, clean and wholly before the window, but one of
    its processings carries a produce time inside it (so the block is not local)."""
    from datetime import timedelta

    h = History()
    for part in range(6):
        h.captured(part, 0, 100, at(70), group_committed=100)
    for seq in range(18):
        h.clean("p", seq, 0, seq, at(10 + seq / 10), carried=carried)
    for seq in range(3):
        t = at(45 + seq / 10)
        h.produce("u", seq, 4, seq, t)
        h.record("u", seq, 4, seq, t)
        h.consume("u", seq, 4, seq, t + timedelta(seconds=1), produce_ts=t)
        h.sink("u", seq, 4, seq, t + timedelta(seconds=2 + 50 * seq),
               produce_ts=t - timedelta(minutes=10) if seq == 1 else t)
    for seq in range(2):
        h.clean("v", seq, 4, 3 + seq, at(50 + seq), carried=False)
    for seq, minute in enumerate((-1, 1)):
        h.clean("w", seq, 5, 10 + seq, at(minute), carried=carried)
    for pos, seq in enumerate((0, 1, 2, 4, 5, 6, 7, 8, 9, 3, 10, 11, 13, 12, 14, 15)):
        h.clean("z", seq, 5, 20 + pos, at(50 + pos / 10), carried=carried)
    for pos, seq in enumerate((0, 1, 2, 3, 4, 5, 6, 8, 9, 10, 11, 12, 13, 14, 15, 7)):
        t = at(59 + seq / 10) if seq < 8 else at(60 + (seq - 8) / 10)
        done = at(61) + timedelta(seconds=pos)
        h.produce("a", seq, 3, 10 + pos, t)
        h.record("a", seq, 3, 10 + pos, t)
        h.consume("a", seq, 3, 10 + pos, done)
        h.sink("a", seq, 3, 10 + pos, done + timedelta(seconds=1))
    h.consume("p", 9, 0, 9, at(30), consumer="c2")  # redelivered
    for seq in range(4):
        off = 10 if seq == 2 else seq
        h.produce("q", seq, 1, seq, at(20 + seq / 10))
        h.record("q", seq, 1, off, at(20 + seq / 10))
        h.consume("q", seq, 1, off, at(21 + seq / 10))
        h.sink("q", seq, 1, off, at(22 + seq / 10))
    for seq in range(3):
        h.clean("r", seq, 3, seq, at(-30 + seq / 10), carried=carried)
    for seq in range(2 if stray else 0):
        t = at(-20 + seq / 10)
        h.produce("y", seq, 3, 5 + seq, t)
        h.record("y", seq, 3, 5 + seq, t)
        h.consume("y", seq, 3, 5 + seq, t + timedelta(seconds=1), produce_ts=at(5) if seq == 0 else t)
        h.sink("y", seq, 3, 5 + seq, t + timedelta(seconds=2), produce_ts=t)
    for seq in range(2):
        h.produce("s", seq, 2, seq, at(40))
        h.record("s", seq, 2, seq, at(40))
        h.sink("s", seq, 2, seq, at(41))
    h.consume("s", 1, 2, 1, at(40) + timedelta(seconds=1))
    h.consume("s", 0, 2, 0, at(40) + timedelta(seconds=2))  # after offset 1: backwards
    return h


@pytest.mark.spark
def test_clean_blocks_are_settled_from_digests_and_the_rest_take_the_exact_path(spark: Any) -> None:
    """`block_digests` calls a block clean exactly when each of its units is an ordinary delivered
    message: 'out' when it is clean but wholly before the window ('outl' when also local: left out of
    the lookup when local is the default), 'local' when every consumption and sink row also
    carries the ledger's produce time; the window's result equals the oracle's,
    with the local blocks in the majority (their latencies from each row) and in the minority (from
    the typed path, as every clean block without a carried produce time)."""
    from spark_jobs.reconcile import Shape, collect_lookups, restrict, sink_rows, typed_tiers
    from spark_jobs.reconcile.blocks import (
        BLOCK_BITS,
        block_counts,
        block_digests,
        block_hash,
        block_lookup,
        lookup_bound,
        mark_backwards,
    )
    from spark_jobs.reconcile.params import batch_params
    from spark_jobs.reconcile.units import reordered_processings
    from tests.reconcile_cases import window_inputs

    assert BLOCK_BITS == 3
    tc = topic_config()
    shape = Shape((tc,))
    params = batch_params(spark, shape, T0, AS_OF_FINAL, {tc.name: collect_lookups([], [], tc.groups)})
    blocks = [("a", 0), ("a", 1), ("p", 0), ("p", 1), ("p", 2), ("q", 0), ("r", 0), ("s", 0), ("u", 0), ("v", 0),
              ("w", 0), ("y", 0), ("z", 0), ("z", 1)]
    # the digests name a block by its hash: the blocks (pid, block number) of the history by theirs
    named = {r["bh"]: (r["k1"], r["k2"] >> BLOCK_BITS) for r in spark.createDataFrame(
        [(tc.name, k1, blk << BLOCK_BITS) for k1, blk in blocks], "topic string, k1 string, k2 bigint")
        .select("k1", "k2", block_hash().alias("bh")).collect()}
    for carried, local in ((True, "local"), (False, "clean")):
        h = _blocks_history(carried, stray=True)
        vis = restrict(window_inputs(spark, h.inputs(), tc), tc, T0)
        assert vis.consumed is not None
        tiers = typed_tiers(vis.ledger, vis.log, vis.consumed, sink_rows(vis), shape)
        digests = mark_backwards(block_digests(tiers, shape, params), reordered_processings(vis.consumed))
        assert sorted((*named[r["bh"]], r["settle"]) for r in digests.collect()) == [
            ("a", 0, "clean"), ("a", 1, "out"), ("p", 0, local), ("p", 1, "dirty"), ("p", 2, local), ("q", 0, "dirty"),
            ("r", 0, "outl" if carried else "out"), ("s", 0, "dirty"), ("u", 0, "clean"), ("v", 0, "clean"),
            ("w", 0, local), ("y", 0, "out"), ("z", 0, local), ("z", 1, local)]
        lookup, default = block_lookup(digests)
        # five local blocks against three clean ones, or none against eight
        assert default == local
        settles = [r["settle"] for r in lookup.collect()]
        # r's block passes for a local one when local is the default; y's must not: its processing
        # carrying a produce time in the window would be counted, and the report below differ from
        # the oracle's
        assert sorted(settles) == sorted(["dirty"] * 3 + ["out"] * (2 if carried else 3)
                                         + ["clean"] * (3 if carried else 0))
        # what decides the broadcasts: the lookup's size from the counts, exact when no hashes collide
        assert lookup_bound(block_counts(digests), default) == len(settles)
        report, anomalies, _ = spark_reconcile(spark, tc, T0, AS_OF_FINAL, h.inputs())
        oracle = oracle_reconcile(tc, T0, AS_OF_FINAL, h.inputs())
        assert anomalies == sorted_anomalies(oracle.anomalies)
        assert report == norm_rows(oracle.report)
        assert sorted((a[1], a[3], a[4]) for a in brief(anomalies)) == [
            ("redelivered", "p", 9), ("reordered_in_consumption", "q", 3), ("reordered_in_consumption", "s", 0),
            ("reordered_in_log", "a", 7), ("reordered_in_log", "q", 2), ("reordered_in_log", "z", 3),
            ("reordered_in_log", "z", 12)]


@pytest.mark.spark
@pytest.mark.parametrize("bits", [0, 6])
def test_any_block_size_gives_the_oracles_rows(spark: Any, monkeypatch: pytest.MonkeyPatch, bits: int) -> None:
    """Blocks of one seq and of 64 settle different units from their digests; the hand-written
    cases and the blocks history still equal the oracle row for row."""
    from spark_jobs.reconcile import blocks

    monkeypatch.setattr(blocks, "BLOCK_BITS", bits)
    tc = topic_config()
    for history in (build_cases()[0], _blocks_history(), _blocks_history(carried=False)):
        report, anomalies, _ = spark_reconcile(spark, tc, T0, AS_OF_FINAL, history.inputs())
        oracle = oracle_reconcile(tc, T0, AS_OF_FINAL, history.inputs())
        assert anomalies == sorted_anomalies(oracle.anomalies)
        assert report == norm_rows(oracle.report)


@pytest.mark.spark
@pytest.mark.parametrize("direct_max, broadcast", [(0, True), (1, True), (1, False)])
def test_the_typed_path_runs_only_when_many_blocks_need_a_look(spark: Any, monkeypatch: pytest.MonkeyPatch,
                                                               direct_max: float, broadcast: bool) -> None:
    """Up to `DIRECT_SHARE_MAX` of the blocks neither local nor out of the window (and local ones in
    the majority), every unit of them goes to the general path and no typed aggregation runs;
    above it (here: any), the typed path sorts them first. Either way -- and with the block lookup
    joined by a shuffle, as when it may hold more than `BROADCAST_BLOCKS_MAX` blocks -- the
    hand-written cases and the blocks history, with and without carried produce times, equal the
    oracle."""
    import spark_jobs.reconcile as reconcile
    from spark_jobs.reconcile import blocks

    calls: list[int] = []
    real = reconcile.typed_units

    def counted(*args: Any) -> Any:
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(blocks, "DIRECT_SHARE_MAX", direct_max)
    monkeypatch.setattr(reconcile, "typed_units", counted)
    auto = spark.conf.get("spark.sql.autoBroadcastJoinThreshold")
    if not broadcast:  # no broadcast hint on the lookup, and Spark's own size rule off: a shuffle join
        monkeypatch.setattr(blocks, "BROADCAST_BLOCKS_MAX", -1)
        spark.conf.set("spark.sql.autoBroadcastJoinThreshold", "-1")
    tc = topic_config()
    try:
        for history, typed in ((_blocks_history(), direct_max == 0), (_blocks_history(carried=False), True),
                               (build_cases()[0], None)):
            calls.clear()
            report, anomalies, _ = spark_reconcile(spark, tc, T0, AS_OF_FINAL, history.inputs())
            oracle = oracle_reconcile(tc, T0, AS_OF_FINAL, history.inputs())
            assert anomalies == sorted_anomalies(oracle.anomalies)
            assert report == norm_rows(oracle.report)
            if typed is not None:
                assert bool(calls) == typed
    finally:
        spark.conf.set("spark.sql.autoBroadcastJoinThreshold", auto)


@pytest.mark.spark
def test_a_window_below_the_blocks_row_count_skips_the_digests_and_gives_the_oracles_rows(
        spark: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Inputs counted below `BLOCKS_MIN_ROWS` take the typed and general paths for every row, no
    digest computed; the hand-written cases and the blocks history still equal the oracle."""
    import spark_jobs.reconcile as reconcile
    from spark_jobs.reconcile import blocks
    from tests.reconcile_cases import window_inputs

    def no_digests(*_: Any) -> None:
        raise AssertionError("block digests computed below BLOCKS_MIN_ROWS")

    monkeypatch.setattr(blocks, "BLOCKS_MIN_ROWS", 10 ** 12)
    monkeypatch.setattr(reconcile, "block_digests", no_digests)
    tc = topic_config()
    for history in (build_cases()[0], _blocks_history()):
        c = reconcile.classify_window(spark, window_inputs(spark, history.inputs(), tc), tc, T0, AS_OF_FINAL,
                                      rows=10 ** 6)
        anomalies = sorted_anomalies(r.asDict() for r in c.anomalies.collect())
        report = norm_rows(c.report)
        c.summary.unpersist()
        oracle = oracle_reconcile(tc, T0, AS_OF_FINAL, history.inputs())
        assert anomalies == sorted_anomalies(oracle.anomalies)
        assert report == norm_rows(oracle.report)


@pytest.mark.spark
def test_a_kept_step_that_fails_leaves_no_rows_kept(spark: Any) -> None:
    """`materialise` of a frame whose computation fails raises the frame's error and keeps nothing:
    the RDD it had begun to fill is unpersisted at once, not left to the garbage collector. A frame
    that computes is kept, with its row count, until `release`."""
    from pyspark.sql import functions as F

    from spark_jobs.reconcile import materialise, release

    kept_before = _our_persisted_rdds(spark)
    for _ in range(3):
        failing = spark.range(0, 10_000, numPartitions=4).withColumn(
            "x", F.when(F.col("id") == 9_999, F.raise_error(F.lit("kept step failed on purpose"))).otherwise(1))
        with pytest.raises(Exception, match="kept step failed on purpose"):
            materialise(failing)
        assert _our_persisted_rdds(spark) == kept_before
    kept, rows = materialise(spark.range(0, 1_000, numPartitions=4).groupBy((F.col("id") % 7).alias("k")).count())
    assert rows == 7
    assert len(_our_persisted_rdds(spark) - kept_before) == 1
    assert sorted((r["k"], r["count"]) for r in kept.collect()) == [(k, 143 if k < 6 else 142) for k in range(7)]
    release(kept)
    assert _our_persisted_rdds(spark) == kept_before


@pytest.mark.spark
def test_a_step_failing_beside_another_raises_its_own_error_and_frees_what_was_kept(
        spark: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The local blocks' latencies are kept from a second driver thread, beside the general path:
    when that step fails, the window's classification raises that step's error, and every step
    already kept (the digests, the lookup, the flagged processings, ...) is freed."""
    from pyspark.sql import functions as F

    import spark_jobs.reconcile as reconcile
    from tests.reconcile_cases import window_inputs

    real = reconcile.local_latencies

    def failing(*args: Any) -> Any:
        return real(*args).withColumn("n", F.raise_error(F.lit("latency step failed on purpose")))

    monkeypatch.setattr(reconcile, "local_latencies", failing)
    tc = topic_config()
    history = _blocks_history()
    inputs = window_inputs(spark, history.inputs(), tc)
    kept_before = _our_persisted_rdds(spark)
    with pytest.raises(Exception, match="latency step failed on purpose"):
        reconcile.classify_window(spark, inputs, tc, T0, AS_OF_FINAL)
    assert _our_persisted_rdds(spark) == kept_before
    monkeypatch.setattr(reconcile, "local_latencies", real)  # the same inputs, without the failure
    c = reconcile.classify_window(spark, inputs, tc, T0, AS_OF_FINAL)
    assert sorted_anomalies(r.asDict() for r in c.anomalies.collect()) == sorted_anomalies(
        oracle_reconcile(tc, T0, AS_OF_FINAL, history.inputs()).anomalies)
    c.summary.unpersist()


@pytest.mark.spark
@pytest.mark.parametrize("counted", [False, True], ids=["one row each", "counted per value"])
@pytest.mark.parametrize("path", ["buckets", "driver sort"])
def test_percentiles_from_bucket_counts_equal_sparks_own_percentile(spark: Any, monkeypatch: Any, path: str,
                                                                   counted: bool) -> None:
    """`stage_stats` locates each rank through the latency buckets and sorts only those buckets (or,
    for few latencies, sorts them all on the driver); its p50/p95/p99 must be bit for bit Spark's
    exact `percentile` (and the oracle's) on ties, values either side of a bucket edge, negative and
    zero latencies, one value, none, and many -- also when the facts it reads again come counted
    per distinct latency (an `n` column, as the local blocks' latencies are kept)."""
    import math
    import random

    from pyspark.sql import functions as F

    from spark_jobs.reconcile import stats as stats_mod

    monkeypatch.setattr(stats_mod, "DRIVER_SORT_MAX", 0 if path == "buckets" else 1_000_000)

    from audit.core.percentiles import latency_columns
    from spark_jobs.reconcile import X_FIELDS, stage_stats, summarise

    rnd = random.Random(7)
    edge = 2.0 ** 3  # a power of two starts a bucket
    groups: dict[int, list[float | None]] = {
        0: [*[5.0] * 1000, 4.0, 6.0, 7.5],                        # ties across the wanted ranks
        1: [*[math.nextafter(edge, 0), edge, math.nextafter(edge, 9), edge * 2 ** (1 / 256)] * 7, *[edge] * 3],
        2: [-12.5, -0.001, 0.0, 0.0, 0.001, 3.0, -7.0, 250.0],    # clock skew: negative buckets
        3: [42.125],                                              # one value
        4: [None, None],                                          # facts without a latency (pending)
        5: [rnd.randrange(-2_000, 9_000_000) / 1000 for _ in range(20_000)],  # wide range, duplicates
        6: [1.0, 1.0 + 1e-9],                                     # interpolation inside one bucket
    }
    rows = [("t", "F", "group:g", None, p, None, None, None, None, 1, 1, 0, v)
            for p, vs in groups.items() for v in vs]
    rnd.shuffle(rows)
    facts = spark.createDataFrame(rows, ", ".join(f"{n} {t}" for n, t in X_FIELDS))
    anomaly = spark.createDataFrame([("t", "A", "log", "lost", 0, "p", 1, 1, "x", 0, 0, 0, None)],
                                    ", ".join(f"{n} {t}" for n, t in X_FIELDS))
    summary = summarise(facts.unionByName(anomaly)).persist()
    read = (facts.groupBy("topic", "kind", "stage", "partition", "latency").agg(F.count(F.lit(1)).alias("n"))
            if counted else facts)
    stats = stage_stats(spark, summary, read)["t"]
    summary.unpersist()
    sparks = {r["partition"]: r["pct"] for r in facts.groupBy("partition").agg(
        F.expr("percentile(latency, array(0.5, 0.95, 0.99))").alias("pct")).collect()}
    assert sorted(stats) == [("group:g", p) for p in sorted(groups)]
    for p, vs in groups.items():
        got = stats[("group:g", p)]
        assert (got["expected"], got["delivered"], got["pending"]) == (len(vs), len(vs), 0)
        lat = [v for v in vs if v is not None]
        assert [got["latency_p50_ms"], got["latency_p95_ms"], got["latency_p99_ms"]] == (sparks[p] or [None] * 3)
        assert {k: got[k] for k in latency_columns(lat)} == latency_columns(lat)
    assert stats[("group:g", 4)]["latency_p50_ms"] is None
    assert stats[("group:g", 0)]["latency_p99_ms"] == 5.0 and stats[("group:g", 3)]["latency_p50_ms"] == 42.125



@pytest.mark.spark
def test_percentiles_in_buckets_of_one_value_do_not_read_the_facts(spark: Any, monkeypatch: Any) -> None:
    """A wanted rank in a bucket whose smallest and largest latency are equal is that value: the
    percentiles come from the summary alone (the facts given to `stage_stats` fail if read), and
    equal the oracle's on ties, one value, zero and negative latencies."""
    from pyspark.sql import functions as F

    from audit.core.percentiles import latency_columns
    from spark_jobs.reconcile import X_FIELDS, stage_stats, summarise
    from spark_jobs.reconcile import stats as stats_mod

    monkeypatch.setattr(stats_mod, "DRIVER_SORT_MAX", 0)
    groups = {0: [*[5.0] * 500, *[250.0] * 300, 1000.0], 1: [42.125], 2: [-7.0, -7.0, -7.0, 0.0, 0.0]}
    rows = [("t", "F", "log", None, p, None, None, None, None, 1, 1, 0, v) for p, vs in groups.items() for v in vs]
    facts = spark.createDataFrame(rows, ", ".join(f"{n} {t}" for n, t in X_FIELDS))
    summary = summarise(facts).persist()
    poisoned = facts.withColumn("latency", F.when(F.col("latency").isNotNull(), F.raise_error(F.lit("facts read")))
                                .otherwise(F.col("latency")))
    stats = stage_stats(spark, summary, poisoned)["t"]
    summary.unpersist()
    for p, vs in groups.items():
        assert {k: stats[("log", p)][k] for k in latency_columns(vs)} == latency_columns(vs)
    assert stats[("log", 0)]["latency_p50_ms"] == 5.0 and stats[("log", 0)]["latency_p99_ms"] == 250.0

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
@pytest.mark.parametrize("path", sorted(set(PATHS) - {"chunked-files"}))  # the files: the test above
def test_many_topics_in_one_plan_each_equal_the_oracle(spark: Any, make_config: Callable[..., Config],
                                                       tmp_path: Path, path: str,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """`reconcile_range` classifies all topics of a window in one plan (or, small, in the driver):
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
def test_seq_gaps_from_bitmaps_equal_a_sort_of_every_present_seq(spark: Any) -> None:
    """`seq_gaps` decodes only the bitmaps with a hole; its rows must be those of walking every
    pid's present seqs in order: gaps inside a bitmap, at its edges (seq 63 is the sign bit), across
    empty bitmaps, wider than MAX_GAP_ROWS, before a seq outside the window (not reported), with a
    unit that is not present (it does not close a gap), and the same pid in two topics."""
    from audit.core.vocabulary import MAX_GAP_ROWS
    from spark_jobs.reconcile.order import seq_gaps

    out_of_window = {("t", "a", 12), ("t", "a", 2503)}
    seqs = {("t", "a"): [*range(11), 12, 63, 65, 66, 127, 128, 200, 1300, *range(2500, 2511)],
            ("t", "b"): [64, 66, 130],
            ("u", "a"): [0, 5]}
    rows = [(t, pid, s, True, (t, pid, s) not in out_of_window)
            for (t, pid), ss in seqs.items() for s in ss if s != 2505]
    rows.append(("t", "a", 70, False, True))  # only consumed: not present, inside the gap 67..126
    narrow = spark.createDataFrame(rows, "topic string, k1 string, k2 bigint, present boolean, in_w boolean")
    got = sorted((r["topic"], r["anomaly"], r["pid"], r["seq"], r["offset"])
                 for r in seq_gaps(narrow).collect())
    want: list[tuple[Any, ...]] = []
    for (t, pid), ss in seqs.items():
        present = sorted(s for s in ss if s != 2505)
        for q, s in itertools.pairwise(present):
            if s - q > 1 and (t, pid, s) not in out_of_window:
                missing = range(q + 1, s)
                want += [(t, "seq_gap", pid, q + 1, None)] if len(missing) > MAX_GAP_ROWS else [
                    (t, "seq_gap", pid, m, None) for m in missing]
    assert got == sorted(want)
    # counted by hand: t/a 13..62, 64, 67..126, 129..199, two wide rows, 2505; t/b 65, 67..129; u/a 1..4
    assert len(want) == 50 + 1 + 60 + 71 + 2 + 1 + 1 + 63 + 4


@pytest.mark.spark
def test_reordered_in_log_equals_a_walk_of_every_record_by_offset(spark: Any) -> None:
    """`reordered_in_log`'s rows must be those of walking each (pid, partition)'s records by offset
    with the highest seq seen so far (the detail names it): neighbours swapped, one early high seq
    making the next 22 late, a low seq appended 94 records late, an early high seq outside the
    window that still makes in-window ones late, a late record outside the window (not reported),
    a record without its log record (ignored), the same pid in two partitions and two topics, and
    random pids with a few records moved."""
    import random

    from spark_jobs.reconcile.order import reordered_in_log

    rng = random.Random(7)
    rows: list[tuple[str, str, int, int, int, bool, bool]] = []  # topic, pid, part, seq, off, has_orig, in_w

    def stream(topic: str, pid: str, part: int, seqs: list[int], start: int = 0,
               out: Collection[int] = frozenset(), orphan: Collection[int] = frozenset()) -> None:
        off = start
        for seq in seqs:
            off += rng.randint(1, 3)  # other pids' records in between
            rows.append((topic, pid, part, seq, off, seq not in orphan, seq not in out))

    stream("t", "a", 0, [0, 1, 3, 2, *range(4, 15), 16, 15, 17, 40, *range(18, 40), 41])
    stream("t", "a", 1, [*range(0, 30), 2000, *range(30, 50)], out={2000})
    stream("t", "b", 0, [5, *range(0, 5), *range(6, 20)], out={5, 0})
    stream("t", "c", 0, [*range(0, 10), 12, 11, 13], orphan={12})
    stream("t", "d", 0, [*range(0, 5), *range(6, 100), 5])
    stream("u", "a", 0, [1, 0, 2])
    for k in range(6):
        seqs = list(range(rng.randint(50, 400)))
        for _ in range(rng.randint(0, 4)):
            i, j = rng.randrange(len(seqs)), rng.randrange(len(seqs))
            seqs.insert(j, seqs.pop(i))
        stream("t", f"r{k}", k % 2, seqs, start=1000 * k, out={s for s in seqs if rng.random() < 0.05})
    narrow = spark.createDataFrame(
        rows, "topic string, k1 string, o_part int, k2 bigint, o_off bigint, has_orig boolean, in_w boolean")
    got = sorted((r["topic"], r["pid"], r["partition"], r["seq"], r["offset"], r["detail"])
                 for r in reordered_in_log(narrow).collect())
    want = []
    by_pair: dict[tuple[str, str, int], list[tuple[int, int, bool]]] = {}
    for topic, pid, part, seq, off, has_orig, in_w in rows:
        if has_orig:
            by_pair.setdefault((topic, pid, part), []).append((off, seq, in_w))
    for (topic, pid, part), recs in by_pair.items():
        high = None
        for off, seq, in_w in sorted(recs):
            if in_w and high is not None and seq < high:
                want.append((topic, pid, part, seq, off, high))
            high = seq if high is None else max(high, seq)
    assert [g[:5] for g in got] == sorted(w[:5] for w in want)
    assert all(f"seq {w[3]} after seq {w[5]}" in g[5] for g, w in zip(got, sorted(want), strict=True))
    # by hand: t/a/0 seqs 2, 15 and 18..39 (40 came before them); t/a/1 30..49 (2000 came first, out
    # of the window); t/b/0 1..4 (5 came first, out of the window: 0 is late too, and out); t/c/0
    # none (11 would follow 12, whose log record is not there); t/d/0 5, after 99
    assert {(g[0], g[1], g[2], g[3]) for g in got if g[1] in ("a", "b", "c", "d")} == {
        ("t", "a", 0, 2), ("t", "a", 0, 15), *(("t", "a", 0, s) for s in range(18, 40)),
        *(("t", "a", 1, s) for s in range(30, 50)), *(("t", "b", 0, s) for s in range(1, 5)), ("t", "d", 0, 5),
        ("u", "a", 0, 0)}
    assert len(want) > 40


@pytest.mark.spark
def test_content_duplicates_ranked_only_among_repeated_hashes_are_all_of_them(spark: Any) -> None:
    """`content_duplicates` given `repeated_hashes` ranks only the units whose 64-bit hash another
    unit holds; its rows must be those of ranking every unit: three copies of one content (the two
    later ones reported), a 64-bit collision whose second hash differs (no duplicate), one content
    in two topics (none), a later copy outside the window (not reported), a unit without its log
    record (ignored), and unique contents."""
    from spark_jobs.reconcile.order import content_duplicates, repeated_hashes

    cols = "topic string, fph bigint, fph2 int, pt_us bigint, k1 string, k2 bigint, in_w boolean, " \
           "o_part int, o_off bigint, has_orig boolean"
    rows = [("t", 1, 1, 10, "a", 0, True, 0, 100, True), ("t", 1, 1, 30, "b", 4, True, 1, 300, True),
            ("t", 1, 1, 20, "a", 1, True, 0, 200, True), ("t", 1, 1, 40, "c", 0, False, 2, 400, True),
            ("t", 1, 1, 5, "z", 0, True, 0, 50, False),
            ("t", 2, 5, 10, "a", 2, True, 0, 210, True), ("t", 2, 6, 20, "a", 3, True, 0, 220, True),
            ("t", 3, 3, 10, "a", 5, True, 0, 230, True), ("u", 3, 3, 20, "a", 0, True, 0, 10, True),
            *[("t", 100 + i, i, i, "d", i, True, 3, i, True) for i in range(20)]]
    narrow = spark.createDataFrame(rows, cols)

    def got(df: Any) -> list[tuple[Any, ...]]:
        return sorted((r["topic"], r["pid"], r["seq"], r["partition"], r["offset"], r["detail"]) for r in df.collect())

    repeated = repeated_hashes(narrow)
    assert sorted(r["fph"] for r in repeated.collect()) == [1, 2, 3]
    ranked = got(content_duplicates(narrow, repeated))
    assert ranked == got(content_duplicates(narrow))
    assert [r[:5] for r in ranked] == [("t", "a", 1, 0, 200), ("t", "b", 4, 1, 300)]
    assert all("same content as a:0" in r[5] for r in ranked)  # both name the first copy


@pytest.mark.spark
def test_every_input_frame_is_pinned_and_collected(spark: Any) -> None:
    """`inputs.map_frames` (what `pinned` rebuilds) reaches every DataFrame field of `WindowInputs`
    and every sink, and the driver collects every field its oracle has a row type for: a frame
    added to the inputs cannot be read unpinned, or left out of the driver's collect, by omission."""
    from dataclasses import fields, replace

    from pyspark.sql import DataFrame
    from pyspark.sql import functions as F

    from spark_jobs.reconcile.driver import _TYPES, _frames
    from spark_jobs.reconcile.inputs import WindowInputs, map_frames

    frame_fields = [fd.name for fd in fields(WindowInputs) if fd.name != "sinks"]
    one = spark.range(1)
    inputs = WindowInputs(**{n: one for n in frame_fields}, sinks={"a": one, "b": one})
    mapped = map_frames(inputs, lambda df: df.withColumn("mapped", F.lit(1)))
    for name in frame_fields:
        assert isinstance(getattr(mapped, name), DataFrame) and "mapped" in getattr(mapped, name).columns, name
    assert all("mapped" in df.columns for df in mapped.sinks.values()) and sorted(mapped.sinks) == ["a", "b"]
    # the driver's tags: each a field of the inputs, but 'sink', the sinks' rows in one frame
    assert set(_TYPES) - {"sink"} <= set(frame_fields)
    assert [tag for tag, _ in _frames(replace(inputs, sink_rows=None))] == list(_TYPES)


@pytest.mark.spark
def test_the_local_latencies_read_only_the_windows_files(spark: Any, make_config: Callable[..., Config],
                                                       tmp_path: Path) -> None:
    """`window_tiers` gives the ledger and group rows whose own produce time lies in the window --
    r's messages and w's first one, produced before it, are not among them, nor processings that
    carry no produce time -- and asks each table for that range, so the row groups holding only the
    lookback hour's rows are skipped by their Parquet statistics, not read and dropped."""
    from datetime import timedelta

    import pyarrow.parquet as pq

    from audit.core.windows import read_ranges
    from spark_jobs.reconcile import Shape, pinned, read_window_inputs, restrict
    from spark_jobs.reconcile.blocks import window_tiers
    from spark_jobs.reconcile.inputs import _hours

    cfg = make_config(tmp_path, topics={TOPIC: {"window": "1h", "grace": "15m", "groups": [GROUP]}})
    tc = cfg.topic(TOPIC)
    h = _blocks_history()
    write_lake(spark, cfg.lake, h.inputs())
    vis = restrict(pinned(read_window_inputs(spark, cfg, tc, T0)), tc, T0)  # as a window's Spark plan reads them
    assert vis.consumed is not None
    df = window_tiers(vis.ledger, vis.consumed, None, Shape((tc,)), T0, T0 + timedelta(hours=1))
    qe = df._jdf.queryExecution()
    got = sorted((r["t"], r["k1"], r["k2"]) for r in df.collect())
    window = [(T0 <= r.produce_ts < T0 + timedelta(hours=1), r.pid, r.seq) for r in h.inputs().ledger]
    carried = [(r.produce_ts is not None and T0 <= r.produce_ts < T0 + timedelta(hours=1), r.pid, r.seq)
               for r in h.inputs().consumed]
    assert got == sorted([(0, p, s) for ok, p, s in window if ok] + [(2, p, s) for ok, p, s in carried if ok])
    assert {k for _, k, _ in got} == {"a", "p", "q", "s", "u", "v", "w", "z"} and (0, "r", 0) not in got
    assert (0, "a", 7) in got and (0, "a", 8) not in got  # the block after the window: context only
    assert (0, "w", 0) not in got and (0, "w", 1) in got
    read: dict[str, tuple[int, int]] = {}  # table -> (files opened, rows read from them)
    leaves = qe.executedPlan().collectLeaves()
    for i in range(leaves.size()):
        leaf = leaves.apply(i)
        if leaf.getClass().getSimpleName() == "FileSourceScanExec":
            table = Path(leaf.relation().location().rootPaths().head().toUri().getPath()).parts[-4]
            metrics = leaf.metrics()
            read[table] = (metrics.get("numFiles").get().value(), metrics.get("numOutputRows").get().value())

    def files(table: str, hours: Callable[[str], bool]) -> list[Path]:
        return [f for d in (Path(cfg.lake) / table / f"topic={TOPIC}").glob("part_hour=*")
                if hours(d.name.split("=", 1)[1]) for f in d.glob("*.parquet")]

    def rows(paths: list[Path], lo: datetime, hi: datetime) -> int:
        """Rows of the row groups that may hold a produce time in [lo, hi): what a reader that skips
        row groups by their Parquet statistics reads."""
        n = 0
        for path in paths:
            meta = pq.read_metadata(path)
            col = meta.schema.names.index("produce_ts")
            for g in range(meta.num_row_groups):
                group = meta.row_group(g)
                st = group.column(col).statistics
                if st is not None and st.has_null_count and st.null_count == group.num_rows:
                    continue  # no produce time at all
                if st is None or not st.has_min_max or (st.min.replace(tzinfo=None) < hi.replace(tzinfo=None)
                                                        and st.max.replace(tzinfo=None) >= lo.replace(tzinfo=None)):
                    n += group.num_rows
        return n

    rr = read_ranges(tc, T0)
    hours = {"producer_ledger": (rr.message_lo, rr.message_hi), "consumed_records": (rr.event_lo, rr.event_hi)}
    lookback = (T0 - timedelta(hours=1)).strftime("%Y-%m-%dT%H")
    end = T0 + timedelta(hours=1)

    def within(lo: datetime, hi: datetime) -> Callable[[str], bool]:
        first, last = _hours(lo, hi)  # the part_hour bounds the window's reads prune to
        return lambda h: first <= h <= last

    # the files the window's inputs were pinned to: every file of the hours the window reads

    opened = {t: files(t, within(lo, hi)) for t, (lo, hi) in hours.items()}
    assert sorted(read) == sorted(hours)
    # the lookback hour has files and rows of its own in both tables (how many is up to the writer)
    assert min(rows(files(t, lambda h: h == lookback), T0 - timedelta(hours=1), T0) for t in read) >= 1
    assert min(rows(files(t, lambda h: h == lookback), T0, end) for t in read) == 0
    assert read == {t: (len(opened[t]), rows(opened[t], T0, end)) for t in read}


@pytest.mark.spark
def test_the_columnar_path_reads_a_pinned_lake_table_as_spark_does_and_leaves_the_rest_to_spark(
        spark: Any, make_config: Callable[..., Config], tmp_path: Path) -> None:
    """`driver.parquet_reader`: a lake table pinned to its Parquet files is read by pyarrow with the
    rows and values Spark hands over (its partition column from the directories; a column the files
    lack read as null; a column renamed, as a sink's audit columns are), filters aside; a Delta scan
    that is not pinned, a computed column, or rows handed over from Python are not read so; read for a
    spill, its strings dictionary-coded, the same rows made plain."""
    import pyarrow as pa
    from pyspark.sql import functions as F

    from spark_jobs.reconcile import Shape, pinned, read_batch_inputs
    from spark_jobs.reconcile.driver import _plain, collect_inputs, parquet_reader
    from tests.reconcile_cases import frame as table_frame
    from tests.reconcile_cases import table_rows

    cfg = make_config(tmp_path, topics={TOPIC: {"window": "1h", "grace": "15m", "groups": [GROUP]}})
    history, _ = build_cases()
    write_lake(spark, cfg.lake, history.inputs())
    # a consumption table written before `cluster` existed: read as null by Spark and by pyarrow
    older = table_frame(spark, "consumed_records", table_rows(history.inputs())["consumed_records"]).drop("cluster")
    (older.write.format("delta").mode("overwrite").option("overwriteSchema", "true")
     .partitionBy("topic", "part_hour").save(f"{cfg.lake}/consumed_records"))
    tc = cfg.topic(TOPIC)
    inputs = read_batch_inputs(spark, cfg, Shape((tc,)), T0)
    _, rows, planned = collect_inputs(spark, inputs, 5)
    assert rows > 5
    columns = ["topic", "group", "partition", "offset", "pid", "seq", "outcome", "consume_ts", "error", "cluster"]
    # not pinned yet: Delta's own scan (it may carry deletion vectors) is Spark's to read
    assert inputs.consumed is not None
    assert parquet_reader(inputs.consumed, columns) is None
    frame = pinned(inputs, planned).consumed
    assert frame is not None
    read = parquet_reader(frame, columns)
    assert read is not None
    got = read()
    want = frame.select(*columns).toArrow()
    assert got.schema == want.schema

    def ordered(t: Any) -> list[tuple[Any, ...]]:
        return sorted(zip(*(t.column(c).to_pylist() for c in columns), strict=True), key=repr)

    # the frame's filters are on the partition columns (topic, hours), so its files hold its rows alone
    assert ordered(got) == ordered(want) and got.num_rows > 5
    assert set(got.column("cluster").to_pylist()) == {None}
    # a column renamed (a sink's mapped audit columns) is the file column under its new name
    renamed = frame.withColumnRenamed("pid", "physical_pid").select(
        *[F.col("physical_pid").alias("pid") if c == "pid" else F.col(f"`{c}`") for c in columns])
    read = parquet_reader(renamed, columns)
    assert read is not None and ordered(read()) == ordered(want)
    # a column the frame computes, under a name the files also have, is Spark's to read
    assert parquet_reader(frame.withColumn("pid", F.upper(F.col("consumer"))), columns) is None
    # rows handed over from Python (a local relation with rows) are Spark's to hand over
    local = spark.createDataFrame(frame.select(*columns).collect(), frame.select(*columns).schema)
    assert parquet_reader(local, columns) is None
    # rows appended once `cluster` exists: each file read with the table's columns, the older files'
    # `cluster` null and the newer ones' as written, whichever file comes first
    newer = older.withColumn("offset", F.col("offset") + 1000).withColumn("cluster", F.lit("mirror-a"))
    (newer.write.format("delta").mode("append").option("mergeSchema", "true")
     .partitionBy("topic", "part_hour").save(f"{cfg.lake}/consumed_records"))
    inputs = read_batch_inputs(spark, cfg, Shape((tc,)), T0)
    _, _, planned = collect_inputs(spark, inputs, 5)
    frame = pinned(inputs, planned).consumed
    assert frame is not None
    read = parquet_reader(frame, columns)
    assert read is not None
    got, want = read(), frame.select(*columns).toArrow()
    assert ordered(got) == ordered(want)
    assert set(got.column("cluster").to_pylist()) == {None, "mirror-a"}
    # read for a spill, a batch at a time: the strings dictionary-coded (not the partition column,
    # from the directories), a file without `cluster` giving coded nulls; made plain, the same rows
    batches = list(read(3, coded=True))
    assert len(batches) > 1 and all(b.num_rows <= 3 for b in batches)
    coded = pa.Table.from_batches(batches)
    assert {f.name for f in coded.schema if pa.types.is_dictionary(f.type)} == {"group", "pid", "outcome", "error", "cluster"}
    assert _plain(coded).schema == want.schema and ordered(_plain(coded)) == ordered(want)


@pytest.mark.spark
def test_a_window_counts_and_reads_only_the_files_of_a_sinks_range(
        spark: Any, make_config: Callable[..., Config], tmp_path: Path) -> None:
    """A sink is a user's table of every window: a window's inputs are counted over the sink's rows of
    the window's range (sink_ts in it, or null), and the columnar path reads the files of that range
    only, not the table's other days (written before, in files of their own)."""
    from audit.oracle import SinkRow
    from spark_jobs.reconcile import Shape, pinned, read_batch_inputs, sinks_in_range
    from spark_jobs.reconcile.driver import collect_inputs, collect_tables

    cfg = make_config(tmp_path, topics={TOPIC: {"window": "1h", "grace": "15m", "groups": [GROUP], "sinks": [
        {"name": "s1", "format": "delta", "location": str(tmp_path / "s1"), "group": GROUP}]}})
    h = _io_history()
    write_lake(spark, cfg.lake, h.inputs())
    old = [SinkRow(0, 100 + i, "old", i, at(-24 * 60 + i)) for i in range(5)]  # a day before the window
    write_delta_sink(spark, tmp_path / "s1", old)
    write_delta_sink(spark, tmp_path / "s1", [*h.sinks["s1"], SinkRow(0, 200, "nots", 0, None)], mode="append")
    shape = Shape((cfg.topic(TOPIC),))
    inputs = read_batch_inputs(spark, cfg, shape, T0)
    counted = sinks_in_range(inputs, shape, T0)
    everything, all_rows, _ = collect_inputs(spark, inputs, 10**6)
    collected, rows, _ = collect_inputs(spark, counted, 10**6)
    assert everything is not None and collected is not None
    assert all_rows - rows == len(old)
    want = sorted([(r.pid, r.seq) for r in h.sinks["s1"]] + [("nots", 0)], key=repr)
    assert sorted([(r.pid, r.seq) for r in collected.sinks["s1"]], key=repr) == want
    _, _, planned = collect_inputs(spark, counted, 1)
    tables = collect_tables(pinned(inputs, planned), shape, T0)
    got = sorted(zip(tables.sinks["s1"].column("pid").to_pylist(), tables.sinks["s1"].column("seq").to_pylist(),
                     strict=True), key=repr)
    assert got == want
