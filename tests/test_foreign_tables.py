"""Input tables written by another tool (docs/design.md §4): a Delta table with the contract's
columns only -- no `part_hour`, not partitioned -- reconciles to the oracle's report (read whole,
with a warning); a table missing a contract column is one InputError naming the table, the column
and what writes it, raised before any window runs."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from audit.core.config import Config
from audit.core.errors import InputError, ResultReleased
from audit.oracle import reconcile_window as oracle_reconcile
from tests.reconcile_cases import (
    AS_OF_FINAL,
    GROUP,
    T0,
    TOPIC,
    History,
    at,
    frame,
    norm_rows,
    sorted_anomalies,
    table_rows,
    write_delta_sink,
)


def _config(make_config: Callable[..., Config], tmp_path: Path) -> Config:
    return make_config(tmp_path, topics={TOPIC: {
        "window": "1h", "grace": "15m", "groups": [GROUP],
        "sinks": [{"name": "s1", "format": "delta", "location": "sinks/s1", "group": GROUP}]}})


def _history() -> History:
    h = History()
    h.captured(0, 0, 100, at(70), group_committed=100)
    for i in range(3):
        h.clean("p", i, 0, i, at(5 + i))
    h.produce("p", 3, 0, 3, at(9))  # acked, covered, not in the log: lost_acked
    h.produce("p", 4, 0, 4, at(10))
    h.record("p", 4, 0, 4, at(10))
    h.consume("p", 4, 0, 4, at(10.5), outcome="failed")  # retry never finished: retry_overdue
    return h


def _write_foreign_lake(spark: Any, cfg: Config, h: History, drop: tuple[str, str] | None = None) -> None:
    """Every input table as another writer would: the contract's columns only (no part_hour), one
    unpartitioned Delta table each; `drop` = (table, column) leaves one column out."""
    from spark_jobs.io.schemas import TABLES

    for table, rows in table_rows(h.inputs()).items():
        columns = [c for c in TABLES[table].fieldNames() if (table, c) != drop]
        frame(spark, table, rows).select(*columns).write.format("delta").mode("overwrite").save(
            str(Path(cfg.lake) / table))


@pytest.mark.spark
def test_tables_with_only_the_contract_columns_give_the_oracle_report_with_a_warning(
        spark: Any, make_config: Callable[..., Config], tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from spark_jobs.reconcile import reconcile_range

    cfg = _config(make_config, tmp_path)
    h = _history()
    _write_foreign_lake(spark, cfg, h)
    write_delta_sink(spark, tmp_path / "sinks" / "s1", h.sinks["s1"])
    with caplog.at_level(logging.WARNING, logger="msgaudit"):
        [result] = reconcile_range(spark, cfg, T0, at(60), AS_OF_FINAL)
    oracle = oracle_reconcile(cfg.topic(TOPIC), T0, AS_OF_FINAL, h.inputs())
    assert norm_rows(result.report) == norm_rows(oracle.report)
    from spark_jobs.io.lake import read_table

    published = read_table(spark, cfg, "audit_anomalies").collect()
    assert sorted_anomalies(r.asDict() for r in published) == sorted_anomalies(oracle.anomalies)
    # reconcile_range released the result: its Spark rows are gone, and reading them says so
    with pytest.raises(ResultReleased, match=r"anomalies read after release\(\)"):
        result.anomalies.count()
    assert [(a["stage"], a["anomaly"], a["seq"]) for a in sorted_anomalies(oracle.anomalies)] == [
        (f"group:{GROUP}", "retry_overdue", 4), ("log", "lost_acked", 3)]
    # one warning per table without part_hour (not one per window)
    warned = sorted(r.getMessage().split("'")[1] for r in caplog.records if "without partition pruning" in r.getMessage())
    assert warned == ["consumed_records", "log_records", "producer_ledger"]


@pytest.mark.spark
@pytest.mark.parametrize(("table", "column", "writer"), [
    ("consumed_records", "attempt", "`msgaudit ingest`"),
    ("log_records", "committed", "`msgaudit capture`"),
])
def test_a_table_missing_a_contract_column_is_one_line_naming_table_column_and_writer(
        spark: Any, make_config: Callable[..., Config], tmp_path: Path, table: str, column: str,
        writer: str) -> None:
    from spark_jobs.io.schemas import TABLES
    from spark_jobs.reconcile import reconcile_range

    cfg = _config(make_config, tmp_path)
    h = _history()
    _write_foreign_lake(spark, cfg, h, drop=(table, column))
    write_delta_sink(spark, tmp_path / "sinks" / "s1", h.sinks["s1"])
    with pytest.raises(InputError) as e:
        reconcile_range(spark, cfg, T0, at(60), AS_OF_FINAL)
    dtype = TABLES[table][column].dataType.simpleString()
    assert str(e.value) == (
        f"table {table!r} at {Path(cfg.lake) / table} has no column {column!r} ({dtype}, docs/design.md §4.2); "
        f"it is written by {writer} -- a table written by another tool must have the contract's columns")
    assert "\n" not in str(e.value) and e.value.exit_code == 2


@pytest.mark.spark
@pytest.mark.parametrize("drop", [("consumed_records", "cluster"), ("producer_ledger", "fingerprint")])
def test_a_table_without_an_optional_column_reads_it_as_null(
        spark: Any, make_config: Callable[..., Config], tmp_path: Path, drop: tuple[str, str]) -> None:
    """A table of an older version (a consumption table without `cluster`, a producer ledger without
    `fingerprint`: docs/design.md §4.2) is read with it null: every consumption row is the audited
    cluster's, no failed send is known to be resent, and the report is the oracle's."""
    from spark_jobs.reconcile import reconcile_range

    cfg = _config(make_config, tmp_path)
    h = _history()
    _write_foreign_lake(spark, cfg, h, drop=drop)
    write_delta_sink(spark, tmp_path / "sinks" / "s1", h.sinks["s1"])
    [result] = reconcile_range(spark, cfg, T0, at(60), AS_OF_FINAL)
    oracle = oracle_reconcile(cfg.topic(TOPIC), T0, AS_OF_FINAL, h.inputs())
    assert norm_rows(result.report) == norm_rows(oracle.report)
    assert [r for r in oracle.report if r["stage"] == f"group:{GROUP}" and r["delivered"]]
