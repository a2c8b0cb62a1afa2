"""sql/: the generated DDL matches the code, builds a working store, and every BI view returns the
expected rows on SQLite and on a real PostgreSQL (whose session time zone is not UTC)."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from audit.serving.report_store import SUPPORTED_DIALECTS, VIEW_NAMES, ReportStore, ddl
from tests.test_report_store import anomaly_row, fresh_pg_url, report_row, sla_row

SQL_DIR = Path(__file__).resolve().parent.parent / "sql"

W0 = datetime(2026, 11, 21, 10, tzinfo=UTC)
W1 = datetime(2026, 11, 21, 11, tzinfo=UTC)
W2 = datetime(2026, 11, 22, 0, tzinfo=UTC)
DAY1 = datetime(2026, 11, 21, tzinfo=UTC)
DAY2 = datetime(2026, 11, 22, tzinfo=UTC)


def lat(p50: float | None, p95: float | None, p99: float | None, mx: float | None) -> dict[str, Any]:
    return {"latency_p50_ms": p50, "latency_p95_ms": p95, "latency_p99_ms": p99, "latency_max_ms": mx}


def load_fixture_rows(store: ReportStore) -> None:
    """Two topics, three windows over two UTC days, a log and a group stage, faults in both."""
    report = {
        ("orders", W0): [
            report_row(W0, partition=0, expected=100, delivered=99, lost=1, lost_acked=1, **lat(5, 9, 12, 40)),
            report_row(W0, partition=1, expected=50, delivered=50, duplicated=2, reordered=1,
                       duplicate_in_log=2, reordered_in_log=1, **lat(6, 8, 30, 35)),
            report_row(W0, partition=0, stage="group:g", expected=99, delivered=97, dead_lettered=2,
                       **lat(50, 80, 100, 120)),
        ],
        ("orders", W1): [report_row(W1, expected=10, delivered=10, status="provisional", **lat(1, 2, 5, 6))],
        ("orders", W2): [report_row(W2, expected=20, delivered=20, **lat(2, 3, 5, 7))],
        ("payments", W0): [report_row(W0, topic="payments", expected=0, delivered=0, **lat(None, None, None, None))],
    }
    anomalies = {
        ("orders", W0): [
            anomaly_row(W0, partition=0, anomaly="lost_acked", pid="p:1", seq=5, offset=40),
            anomaly_row(W0, partition=1, anomaly="duplicate_in_log", pid="p:2", seq=1, offset=7),
            anomaly_row(W0, partition=1, anomaly="duplicate_in_log", pid="p:2", seq=2, offset=9),
            anomaly_row(W0, partition=1, anomaly="reordered_in_log", pid="p:2", seq=0, offset=10),
            anomaly_row(W0, partition=0, stage="group:g", anomaly="dead_lettered", pid="p:1", seq=6, offset=41),
            anomaly_row(W0, partition=0, stage="group:g", anomaly="dead_lettered", pid="p:1", seq=7, offset=42),
        ],
        ("orders", W2): [anomaly_row(W2, anomaly="unaudited", pid=None, seq=None, offset=3, detail="no audit.pid")],
    }
    sla = {
        ("orders", W0): [
            sla_row(W0, partition=0, rule="max_lost", observed=1, threshold=0, passed=False),
            sla_row(W0, partition=1, rule="max_lost", observed=0, threshold=0, passed=True),
            sla_row(W0, partition=1, rule="max_reordered", observed=1, threshold=0, passed=False, severity="warn"),
            sla_row(W0, partition=0, stage="group:g", rule="max_lost", observed=0, threshold=0, passed=True),
        ],
        ("orders", W1): [sla_row(W1, rule="max_lost", observed=0, threshold=0, passed=True, severity="warn")],
    }
    for table, by_window in (("audit_partition_report", report), ("audit_anomalies", anomalies),
                             ("sla_results", sla)):
        for (topic, w), rows in by_window.items():
            store.replace_window(table, topic, w, rows)


def health(bucket: datetime, topic: str, stage: str, partitions: int, report_rows: int, provisional: int,
           expected: int, delivered: int, lost: int, duplicated: int, reordered: int, dead_lettered: int,
           completeness: float | None, p99: float | None, checks: int, errors: int, warnings: int,
           verdict: str) -> dict[str, Any]:
    return {"bucket_start": bucket, "topic": topic, "stage": stage, "partitions": partitions,
            "report_rows": report_rows, "provisional_rows": provisional, "expected": expected,
            "delivered": delivered, "lost": lost, "duplicated": duplicated, "reordered": reordered,
            "pending": 0, "dead_lettered": dead_lettered, "completeness": completeness,
            "worst_latency_p99_ms": p99, "sla_checks": checks, "sla_errors": errors,
            "sla_warnings": warnings, "health": verdict}


EXPECTED_VIEWS: dict[str, list[dict[str, Any]]] = {
    "v_topic_health_hourly": [
        health(W0, "orders", "group:g", 1, 1, 0, 99, 97, 0, 0, 0, 2, 1.0, 100.0, 1, 0, 0, "ok"),
        health(W0, "orders", "log", 2, 2, 0, 150, 149, 1, 2, 1, 0, 149 / 150, 30.0, 3, 1, 1, "failing"),
        health(W0, "payments", "log", 1, 1, 0, 0, 0, 0, 0, 0, 0, None, None, 0, 0, 0, "ok"),
        health(W1, "orders", "log", 1, 1, 1, 10, 10, 0, 0, 0, 0, 1.0, 5.0, 1, 0, 0, "provisional"),
        health(W2, "orders", "log", 1, 1, 0, 20, 20, 0, 0, 0, 0, 1.0, 5.0, 0, 0, 0, "ok"),
    ],
    "v_topic_health_daily": [
        health(DAY1, "orders", "group:g", 1, 1, 0, 99, 97, 0, 0, 0, 2, 1.0, 100.0, 1, 0, 0, "ok"),
        health(DAY1, "orders", "log", 2, 3, 1, 160, 159, 1, 2, 1, 0, 159 / 160, 30.0, 4, 1, 1, "failing"),
        health(DAY1, "payments", "log", 1, 1, 0, 0, 0, 0, 0, 0, 0, None, None, 0, 0, 0, "ok"),
        health(DAY2, "orders", "log", 1, 1, 0, 20, 20, 0, 0, 0, 0, 1.0, 5.0, 0, 0, 0, "ok"),
    ],
    "v_worst_partitions": [
        {"problem_rank": rank, "topic": t, "partition": p, "stage": st, "windows": n, "expected": e, "lost": lo,
         "duplicated": d, "reordered": r, "problems": lo + d + r, "sla_failures": f, "worst_latency_p99_ms": p99,
         "last_window_start": last}
        for rank, t, p, st, n, e, lo, d, r, f, p99, last in [
            (1, "orders", 1, "log", 1, 50, 0, 2, 1, 1, 30.0, W0),
            (2, "orders", 0, "log", 3, 130, 1, 0, 0, 1, 12.0, W2),
            (3, "orders", 0, "group:g", 1, 99, 0, 0, 0, 0, 100.0, W0),  # ties share a rank
            (3, "payments", 0, "log", 1, 0, 0, 0, 0, 0, None, W0),
        ]
    ],
    "v_anomaly_breakdown": [
        {"day_start": day, "topic": "orders", "stage_kind": kind, "stage": st, "anomaly": code,
         "occurrences": n, "partitions": 1, "first_window_start": w, "last_window_start": w}
        for day, kind, st, code, n, w in [
            (DAY1, "group", "group:g", "dead_lettered", 2, W0),
            (DAY1, "log", "log", "duplicate_in_log", 2, W0),
            (DAY1, "log", "log", "lost_acked", 1, W0),
            (DAY1, "log", "log", "reordered_in_log", 1, W0),
            (DAY2, "log", "log", "unaudited", 1, W2),
        ]
    ],
    "v_latency_trend": [
        {"window_start": w, "topic": t, "stage": st, "partitions": n, "delivered": d, **lat(*ps)}
        for w, t, st, n, d, ps in [
            (W0, "orders", "group:g", 1, 97, (50.0, 80.0, 100.0, 120.0)),
            (W0, "orders", "log", 2, 149, (6.0, 9.0, 30.0, 40.0)),  # worst partition per percentile
            (W0, "payments", "log", 1, 0, (None, None, None, None)),
            (W1, "orders", "log", 1, 10, (1.0, 2.0, 5.0, 6.0)),
            (W2, "orders", "log", 1, 20, (2.0, 3.0, 5.0, 7.0)),
        ]
    ],
    "v_sla_pass_rate": [
        {"day_start": DAY1, "topic": "orders", "rule": rule, "severity": sev, "checks": n,
         "passed_checks": ok, "failed_checks": n - ok, "pass_rate": ok / n}
        for rule, sev, n, ok in [("max_lost", "error", 3, 2), ("max_lost", "warn", 1, 1),
                                 ("max_reordered", "warn", 1, 0)]
    ],
}


def run_sql_file(url: str, dialect: str) -> None:
    """Build a store's schema the way a DBA would: by running sql/<dialect>/report_store.sql."""
    text = (SQL_DIR / dialect / "report_store.sql").read_text(encoding="utf-8")
    statements = [s for s in text.split(";\n") if s.strip() and not all(
        line.startswith("--") for line in s.strip().splitlines())]
    engine = sa.create_engine(url)
    with engine.begin() as conn:
        for statement in statements:
            conn.exec_driver_sql(statement)
    engine.dispose()


@pytest.fixture(params=[
    pytest.param(("sqlite", False), marks=pytest.mark.unit, id="sqlite-store"),
    pytest.param(("sqlite", True), marks=pytest.mark.unit, id="sqlite-sqlfile"),
    pytest.param(("postgresql", False), marks=pytest.mark.postgres, id="postgres-store"),
    pytest.param(("postgresql", True), marks=pytest.mark.postgres, id="postgres-sqlfile"),
])
def loaded_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[ReportStore]:
    dialect, from_file = request.param
    if dialect == "sqlite":
        url = f"sqlite:///{tmp_path / 'report.db'}"
    else:
        url = fresh_pg_url(request.getfixturevalue("pg_url"), "Asia/Kolkata")
    if from_file:
        run_sql_file(url, dialect)
    store = ReportStore(url)
    load_fixture_rows(store)
    yield store
    store.close()


@pytest.mark.parametrize("view", VIEW_NAMES)
def test_view_returns_expected_rows(loaded_store: ReportStore, view: str) -> None:
    assert loaded_store.read_view(view) == EXPECTED_VIEWS[view]


@pytest.mark.unit
def test_every_view_has_expected_rows_in_this_test() -> None:
    assert sorted(EXPECTED_VIEWS) == sorted(VIEW_NAMES)


@pytest.mark.unit
@pytest.mark.parametrize("dialect", SUPPORTED_DIALECTS)
def test_sql_files_match_the_code(dialect: str) -> None:
    path = SQL_DIR / dialect / "report_store.sql"
    assert path.read_text(encoding="utf-8") == ddl(dialect), (
        f"{path} is stale: run `python -m audit.serving.report_store --write-ddl sql`")


@pytest.mark.unit
def test_sql_file_schema_equals_store_schema(tmp_path: Path) -> None:
    by_file = f"sqlite:///{tmp_path / 'file.db'}"
    run_sql_file(by_file, "sqlite")
    by_store = ReportStore(f"sqlite:///{tmp_path / 'store.db'}")

    def schema(engine: sa.Engine) -> dict[str, Any]:
        insp = sa.inspect(engine)
        return {name: [(c["name"], str(c["type"]), c["nullable"]) for c in insp.get_columns(name)]
                for name in insp.get_table_names() + insp.get_view_names()}

    file_engine = sa.create_engine(by_file)
    assert schema(file_engine) == schema(by_store.engine)
    file_engine.dispose()
    by_store.close()


@pytest.mark.unit
def test_window_start_offsets_do_not_change_buckets(tmp_path: Path) -> None:
    # 23:30 UTC is already the next day in most of Asia: the daily bucket must stay the UTC day.
    store = ReportStore(f"sqlite:///{tmp_path / 'r.db'}")
    late = datetime(2026, 11, 21, 23, 30, tzinfo=UTC)
    store.replace_window("audit_partition_report", "orders", late, [report_row(late, window_end=late + timedelta(minutes=30))])
    assert [r["bucket_start"] for r in store.read_view("v_topic_health_daily")] == [DAY1]
    assert [r["bucket_start"] for r in store.read_view("v_topic_health_hourly")] == [
        datetime(2026, 11, 21, 23, tzinfo=UTC)]
    store.close()
