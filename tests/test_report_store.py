"""Report store: schema on first use, replace-by-window in one transaction, reads, named errors.

Every behaviour runs on SQLite (unit) and on the real PostgreSQL of the `pg_url` fixture (postgres),
each test in its own fresh database / schema.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from audit.core.errors import ConfigError, InputError
from audit.core.vocabulary import REPORT_CODE_COLUMNS
from audit.serving.report_store import VIEW_NAMES, ReportStore

W0 = datetime(2026, 11, 21, 10, tzinfo=UTC)
W1 = W0 + timedelta(hours=1)
COMPUTED = datetime(2026, 11, 21, 11, 15, 30, 123456, tzinfo=UTC)


def fresh_pg_url(pg_url: str, timezone_name: str = "UTC") -> str:
    """A URL on a brand-new schema of the test PostgreSQL, so tests never see each other's rows.

    `timezone_name` sets the session time zone, to prove results do not depend on it."""
    schema = f"t_{uuid.uuid4().hex[:12]}"
    engine = sa.create_engine(pg_url)
    with engine.begin() as conn:
        conn.execute(sa.text(f"CREATE SCHEMA {schema}"))
    engine.dispose()
    url = sa.engine.make_url(pg_url)
    options = f"-csearch_path={schema} -ctimezone={timezone_name}"
    return url.update_query_dict({"options": options}).render_as_string(hide_password=False)


def store_url(kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if kind == "sqlite":
        return f"sqlite:///{tmp_path / 'store' / 'report.db'}"
    # A session time zone far from UTC (and not a whole hour off) so a missed conversion shows.
    return fresh_pg_url(request.getfixturevalue("pg_url"), "Asia/Kolkata")


BACKENDS = [pytest.param("sqlite", marks=pytest.mark.unit, id="sqlite"),
            pytest.param("postgres", marks=pytest.mark.postgres, id="postgres")]


@pytest.fixture(params=BACKENDS)
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[ReportStore]:
    s = ReportStore(store_url(request.param, request, tmp_path))
    yield s
    s.close()


def report_row(window_start: datetime = W0, topic: str = "orders", partition: int = 0, stage: str = "log",
               **over: Any) -> dict[str, Any]:
    """A complete audit_partition_report row (docs/design.md §4), every code column present."""
    row: dict[str, Any] = {
        "window_start": window_start, "window_end": window_start + timedelta(hours=1), "topic": topic,
        "partition": partition, "stage": stage, "expected": 100, "delivered": 100, "lost": 0,
        "duplicated": 0, "reordered": 0, "pending": 0, "latency_p50_ms": 5.0, "latency_p95_ms": 9.5,
        "latency_p99_ms": 12.25, "latency_max_ms": 40.0, "status": "final", "run_id": "run-1",
        "computed_at": COMPUTED,
    }
    row.update({code: None for code in REPORT_CODE_COLUMNS})
    row.update(over)
    return row


def anomaly_row(window_start: datetime = W0, topic: str = "orders", partition: int = 0, stage: str = "log",
                anomaly: str = "lost_acked", pid: str | None = "p:1", seq: int | None = 1,
                offset: int | None = 10, detail: str | None = None) -> dict[str, Any]:
    return {"window_start": window_start, "topic": topic, "partition": partition, "stage": stage,
            "anomaly": anomaly, "pid": pid, "seq": seq, "offset": offset, "detail": detail,
            "run_id": "run-1", "computed_at": COMPUTED}


def sla_row(window_start: datetime = W0, topic: str = "orders", partition: int = 0, stage: str = "log",
            rule: str = "max_lost", observed: float | None = 0.0, threshold: float = 0.0,
            passed: bool = True, severity: str = "error") -> dict[str, Any]:
    return {"window_start": window_start, "topic": topic, "partition": partition, "stage": stage,
            "rule": rule, "observed": observed, "threshold": threshold, "passed": passed,
            "severity": severity, "checked_at": COMPUTED}


def test_tables_and_views_are_created_on_first_use(store: ReportStore) -> None:
    inspector = sa.inspect(store.engine)
    assert sorted(inspector.get_table_names()) == ["alert_notices", "audit_anomalies", "audit_partition_report", "doctor_risks",
                                                   "producer_settings", "sla_results"]
    assert sorted(inspector.get_view_names()) == sorted(VIEW_NAMES)
    report_cols = [c["name"] for c in inspector.get_columns("audit_partition_report")]
    assert report_cols[:18] == ["window_start", "window_end", "topic", "partition", "stage", "expected",
                                "delivered", "lost", "duplicated", "reordered", "pending", "latency_p50_ms",
                                "latency_p95_ms", "latency_p99_ms", "latency_max_ms", "status", "run_id",
                                "computed_at"]
    assert report_cols[18:] == list(REPORT_CODE_COLUMNS)
    # A second store on the same database finds the schema and does not fail re-creating it.
    again = ReportStore(store.engine.url.render_as_string(hide_password=False))
    assert again.read("sla_results") == []
    again.close()


@pytest.mark.parametrize("kind", BACKENDS)
def test_a_table_an_older_version_created_gets_the_columns_added_since(
        kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    """The report table as an older version created it (without the last code column, and without the
    views): a newer publish adds the column, the older row reads null there, the new row keeps it."""
    from audit.serving.report_store import metadata

    url = store_url(kind, request, tmp_path)
    (tmp_path / "store").mkdir()  # the SQLite file's folder
    newest = REPORT_CODE_COLUMNS[-1]
    older = sa.MetaData()
    report = metadata.tables["audit_partition_report"]
    table = sa.Table(report.name, older, *[c._copy() for c in report.c if c.name != newest])
    engine = sa.create_engine(url)
    with engine.begin() as conn:
        older.create_all(conn)
        conn.execute(table.insert(), [{k: v for k, v in report_row(W0).items() if k != newest}])
    engine.dispose()
    s = ReportStore(url)
    row = report_row(W1)
    row[newest] = 3
    s.replace_window("audit_partition_report", "orders", W1, [row])
    assert [(r["window_start"], r[newest]) for r in s.read("audit_partition_report")] == [(W0, None), (W1, 3)]
    assert sorted(sa.inspect(s.engine).get_view_names()) == sorted(VIEW_NAMES)
    s.close()


@pytest.mark.unit
def test_a_second_process_upgrading_an_older_sqlite_store_at_once_waits_for_the_first(tmp_path: Path) -> None:
    """Two processes opening an older SQLite store at the same moment: the first (here a raw
    connection) has added the missing column but not yet committed; the second waits for the write
    lock before it looks at the schema, so it finds the column instead of adding it a second time
    (which SQLite refuses: 'duplicate column name', the store then reported unreachable)."""
    import sqlite3
    import threading

    from audit.serving.report_store import metadata

    path = tmp_path / "report.db"
    newest = REPORT_CODE_COLUMNS[-1]
    report = metadata.tables["audit_partition_report"]
    older = sa.MetaData()  # every table as now, but the report table without its last column
    for table in metadata.sorted_tables:
        sa.Table(table.name, older, *[c._copy() for c in table.c if (table.name, c.name) != (report.name, newest)])
    engine = sa.create_engine(f"sqlite:///{path}")
    with engine.begin() as conn:
        older.create_all(conn)
    engine.dispose()
    first = sqlite3.connect(path, isolation_level=None)
    first.execute("BEGIN IMMEDIATE")
    first.execute(f"ALTER TABLE {report.name} ADD COLUMN {newest} INTEGER")
    second = ReportStore(f"sqlite:///{path}")
    failed: list[BaseException] = []

    def open_second() -> None:
        try:
            second.read("audit_partition_report")
        except BaseException as e:  # noqa: BLE001 -- handed to the test's thread below
            failed.append(e)

    t = threading.Thread(target=open_second)
    t.start()
    t.join(0.5)  # by now the second store has read the schema (without the fix) or waits for the lock
    assert t.is_alive() and not failed
    first.execute("COMMIT")
    first.close()
    t.join(30)
    assert not failed, failed
    assert [c["name"] for c in sa.inspect(second.engine).get_columns(report.name)][-1] == newest
    second.close()


@pytest.mark.parametrize("kind", BACKENDS)
def test_a_table_without_a_required_column_is_one_error_naming_it(
        kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    url = store_url(kind, request, tmp_path)
    (tmp_path / "store").mkdir()  # the SQLite file's folder
    engine = sa.create_engine(url)
    with engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE sla_results (window_start TEXT, topic TEXT)"))
    engine.dispose()
    s = ReportStore(url)
    with pytest.raises(InputError) as e:
        s.read("sla_results")
    assert str(e.value) == (f"report store {s.url}: table sla_results has no column 'partition', which msgaudit "
                            "always writes; it was not created by msgaudit (docs/design.md §4.4): point "
                            "report_store at another database or drop the table")
    s.close()


def test_report_round_trip_keeps_every_column(store: ReportStore) -> None:
    rows = [report_row(partition=1, stage="group:g", missed=2, redelivered=1, dead_lettered=3,
                       latency_p99_ms=None, status="provisional"),
            report_row(partition=0, lost_acked=1, duplicate_in_log=0)]
    assert store.replace_window("audit_partition_report", "orders", W0, rows) == 2
    # Read order is (window_start, topic, partition, stage), whatever the insert order was.
    assert store.read("audit_partition_report") == [rows[1], rows[0]]


def test_non_utc_aware_datetimes_are_stored_and_returned_as_utc(store: ReportStore) -> None:
    plus2 = timezone(timedelta(hours=2))
    w_local = W0.astimezone(plus2)
    row = sla_row(window_start=w_local)
    row["checked_at"] = datetime(2026, 11, 21, 13, 0, tzinfo=plus2)
    store.replace_window("sla_results", "orders", w_local, [row])
    (got,) = store.read("sla_results")
    assert got["window_start"] == W0 and got["window_start"].tzinfo == UTC
    assert got["checked_at"] == datetime(2026, 11, 21, 11, 0, tzinfo=UTC) and got["checked_at"].tzinfo == UTC


def test_replace_window_replaces_only_that_topic_and_window(store: ReportStore) -> None:
    store.replace_window("audit_anomalies", "orders", W0,
                         [anomaly_row(seq=1), anomaly_row(seq=2), anomaly_row(seq=2)])  # a repeated row is legal
    store.replace_window("audit_anomalies", "orders", W1, [anomaly_row(window_start=W1, seq=7)])
    store.replace_window("audit_anomalies", "payments", W0, [anomaly_row(topic="payments", seq=8)])

    assert store.replace_window("audit_anomalies", "orders", W0, [anomaly_row(seq=3, detail="again")]) == 1

    assert store.read("audit_anomalies") == [
        anomaly_row(seq=3, detail="again"),
        anomaly_row(topic="payments", seq=8),
        anomaly_row(window_start=W1, seq=7),
    ]
    # Replacing with nothing clears the window (a rerun that found no anomalies).
    assert store.replace_window("audit_anomalies", "orders", W0, []) == 0
    assert [r["seq"] for r in store.read("audit_anomalies")] == [8, 7]


def test_replace_window_is_one_transaction(store: ReportStore) -> None:
    store.replace_window("sla_results", "orders", W0, [sla_row(rule="max_lost")])
    # The second row breaks the primary key, so the insert fails after the delete ran: both roll back.
    with pytest.raises(sa.exc.IntegrityError):
        store.replace_window("sla_results", "orders", W0, [sla_row(rule="max_reordered"), sla_row(rule="max_reordered")])
    assert store.read("sla_results") == [sla_row(rule="max_lost")]


def test_read_filters_by_topic_and_window_range(store: ReportStore) -> None:
    for w in (W0, W1, W1 + timedelta(hours=1)):
        for topic in ("orders", "payments"):
            store.replace_window("sla_results", topic, w, [sla_row(window_start=w, topic=topic)])
    got = store.read("sla_results", topic="payments", start=W1, end=W1 + timedelta(hours=1))
    assert got == [sla_row(window_start=W1, topic="payments")]
    assert [(r["window_start"], r["topic"]) for r in store.read("sla_results", end=W1)] == [
        (W0, "orders"), (W0, "payments")]
    assert store.windows("sla_results", topic="orders") == [W0, W1, W1 + timedelta(hours=1)]


def test_anomaly_nulls_sort_first_on_every_dialect(store: ReportStore) -> None:
    rows = [anomaly_row(anomaly="unaudited", pid=None, seq=None, offset=5, detail="missing audit.pid"),
            anomaly_row(anomaly="seq_gap", partition=0, pid="p:1", seq=4, offset=None),
            anomaly_row(anomaly="seq_gap", partition=0, pid="p:1", seq=3, offset=None)]
    store.replace_window("audit_anomalies", "orders", W0, rows)
    assert store.read("audit_anomalies") == [rows[2], rows[1], rows[0]]


def arrow_of(rows: list[dict[str, Any]]) -> Any:
    import pyarrow as pa

    return pa.Table.from_pylist(rows, schema=pa.schema([
        ("window_start", pa.timestamp("us", "UTC")), ("topic", pa.string()), ("partition", pa.int32()),
        ("stage", pa.string()), ("anomaly", pa.string()), ("pid", pa.string()), ("seq", pa.int64()),
        ("offset", pa.int64()), ("detail", pa.string()), ("run_id", pa.string()),
        ("computed_at", pa.timestamp("us", "UTC"))]))


def test_rows_held_as_columns_are_stored_as_the_same_rows_would_be(store: ReportStore) -> None:
    # nulls, a column of one value, a datetime column of several values (converted row by row), and
    # more rows than one insert batch
    rows = [anomaly_row(seq=s, offset=None if s % 3 else s * 10, pid=None if s == 4 else f"p:{s % 2}",
                        detail=f"d{s}" if s % 2 else None) for s in range(7)]
    rows[5]["computed_at"] = COMPUTED + timedelta(seconds=1)
    store.replace_window("audit_anomalies", "payments", W0, [anomaly_row(topic="payments", seq=9)])
    store.replace_window("audit_anomalies", "orders", W0, [anomaly_row(seq=99)])  # replaced below
    assert store.replace_window_columns("audit_anomalies", "orders", W0, arrow_of(rows), batch=3) == 7
    assert store.read("audit_anomalies", topic="orders") == sorted(
        rows, key=lambda r: (r["partition"], r["stage"], r["pid"] or "", r["seq"]))
    assert store.read("audit_anomalies", topic="payments") == [anomaly_row(topic="payments", seq=9)]
    assert store.replace_window_columns("audit_anomalies", "orders", W0, arrow_of([])) == 0
    assert store.read("audit_anomalies", topic="orders") == []


def test_rows_held_in_parts_are_stored_in_one_transaction(store: ReportStore) -> None:
    """A window's rows handed as parts (as publishing collects the rows the executors hold): all of
    them stored, each part read when the last is stored; a bad part leaves the window as it was."""
    rows = [anomaly_row(seq=s) for s in range(5)]
    store.replace_window("audit_anomalies", "orders", W0, [anomaly_row(seq=99)])
    read: list[int] = []

    def parts() -> Any:
        for part in (rows[:2], [], rows[2:]):
            read.append(len(part))
            yield arrow_of(part)

    assert store.replace_window_columns("audit_anomalies", "orders", W0, parts(), batch=2) == 5
    assert read == [2, 0, 3]
    assert store.read("audit_anomalies", topic="orders") == rows
    bad = (arrow_of(rows[:2]), arrow_of([anomaly_row(topic="payments")]))
    with pytest.raises(InputError, match="1 of 1 rows have a topic other than the replaced window's"):
        store.replace_window_columns("audit_anomalies", "orders", W0, iter(bad))
    assert store.read("audit_anomalies", topic="orders") == rows


@pytest.mark.unit
@pytest.mark.parametrize(("columns", "message"), [
    (lambda: arrow_of([anomaly_row(), anomaly_row(topic="payments")]),
     "audit_anomalies: 1 of 2 rows have a topic other than the replaced window's ('orders')"),
    (lambda: arrow_of([anomaly_row(window_start=W1)]),
     "audit_anomalies: 1 of 1 rows have a window_start other than the replaced window's (2026-11-21T10:00:00+00:00)"),
    (lambda: arrow_of([anomaly_row()]).append_column("colour", __import__("pyarrow").array(["red"])),
     "audit_anomalies: unknown column(s) colour"),
    (lambda: arrow_of([anomaly_row()]).drop_columns(["run_id"]), "audit_anomalies: column 'run_id' is required"),
    (lambda: arrow_of([anomaly_row()]).set_column(10, "computed_at", __import__("pyarrow").array(
        [datetime(2026, 1, 1)])), "audit_anomalies: column 'computed_at' is timestamp[us]; pass timestamps with a time zone"),
])
def test_bad_columns_are_a_named_error_and_write_nothing(tmp_path: Path, columns: Any, message: str) -> None:
    s = ReportStore(f"sqlite:///{tmp_path / 'r.db'}")
    s.replace_window("audit_anomalies", "orders", W0, [anomaly_row()])
    with pytest.raises(InputError) as e:
        s.replace_window_columns("audit_anomalies", "orders", W0, columns())
    assert message in str(e.value)
    assert s.read("audit_anomalies") == [anomaly_row()]
    s.close()


@pytest.mark.unit
@pytest.mark.parametrize(("call", "message"), [
    (lambda s: s.replace_window("nope", "orders", W0, []), "unknown report store table 'nope'"),
    (lambda s: s.read("audit_report"), "unknown report store table 'audit_report'"),
    (lambda s: s.replace_window("sla_results", "orders", datetime(2026, 11, 21, 10), []), "naive datetime"),
    (lambda s: s.replace_window("sla_results", "", W0, []), "topic must be a non-empty string"),
    (lambda s: s.replace_window("sla_results", "orders", W0, [sla_row(topic="payments")]),
     "sla_results row 0: topic 'payments' does not match the window's topic 'orders'"),
    (lambda s: s.replace_window("sla_results", "orders", W0, [sla_row(window_start=W1)]),
     "does not match the replaced window 2026-11-21T10:00:00+00:00"),
    (lambda s: s.replace_window("sla_results", "orders", W0, [{**sla_row(), "colour": "red"}]),
     "sla_results row 0: unknown column(s) colour"),
    (lambda s: s.replace_window("sla_results", "orders", W0, [{**sla_row(), "threshold": None}]),
     "sla_results row 0: column 'threshold' is required"),
    (lambda s: s.replace_window("sla_results", "orders", W0,
                                [{**sla_row(), "checked_at": datetime(2026, 1, 1)}]), "checked_at: naive datetime"),
    (lambda s: s.read("sla_results", start="2026-11-21"), "start: expected a timezone-aware UTC datetime"),
    (lambda s: s.read_view("v_nothing"), "unknown report store view 'v_nothing'"),
])
def test_bad_input_is_a_named_error_and_writes_nothing(tmp_path: Path, call: Any, message: str) -> None:
    s = ReportStore(f"sqlite:///{tmp_path / 'r.db'}")
    s.replace_window("sla_results", "orders", W0, [sla_row()])
    with pytest.raises(InputError) as e:
        call(s)
    assert message in str(e.value)
    assert s.read("sla_results") == [sla_row()]
    s.close()


@pytest.mark.unit
@pytest.mark.parametrize(("url", "message"), [
    ("not a url", "is not a SQLAlchemy URL"),
    ("mysql://u@h/db", "unsupported database 'mysql'"),
])
def test_bad_url_is_a_config_error(url: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        ReportStore(url)


@pytest.mark.unit
def test_unreachable_database_is_one_clear_error(tmp_path: Path) -> None:
    # Port 1 on localhost refuses connections; the password must not leak into the message.
    s = ReportStore("postgresql+psycopg://audit:s3cret@127.0.0.1:1/reports?connect_timeout=2")
    with pytest.raises(InputError) as e:
        s.read("sla_results")
    assert str(e.value).startswith("report store postgresql+psycopg://audit:***@127.0.0.1:1/reports")
    assert "s3cret" not in str(e.value) and "\n" not in str(e.value)


@pytest.mark.unit
def test_sqlite_parent_folder_is_created(tmp_path: Path) -> None:
    s = ReportStore(f"sqlite:///{tmp_path / 'a' / 'b' / 'report.db'}")
    assert s.read("audit_partition_report") == []
    assert (tmp_path / "a" / "b" / "report.db").is_file()
    s.close()


def test_producer_settings_are_stored_per_pid_and_name_the_producers_behind_failed_checks(
        store: ReportStore) -> None:
    """record_settings keeps one row per pid (a pid stored again is replaced), settings_of reads
    the asked pids only, a row without a required column is one clear error; anomaly_pids counts
    the settings-decided anomaly rows per pid, and failure_producer_lines names the sessions behind
    failed log checks."""
    t = datetime(2026, 11, 21, 9, tzinfo=UTC)
    row = {"pid": "p-3", "producer": "orders-svc", "start_ts": t, "acks": "1", "enable_idempotence": False,
           "retries": 5, "max_in_flight": 5, "transactional_id": None, "mode": "python"}
    assert store.record_settings([row, {**row, "pid": "p-4", "producer": None}]) == 2
    assert store.record_settings([{**row, "acks": "all"}]) == 1
    assert store.settings_of(["p-3", "nobody"]) == [{**row, "acks": "all"}]
    assert [r["pid"] for r in store.settings_of(["p-4", "p-3"])] == ["p-3", "p-4"]
    assert store.settings_of([]) == []
    with pytest.raises(InputError, match="producer_settings row 0: column 'acks' is required"):
        store.record_settings([{**row, "acks": None}])

    store.replace_window("audit_anomalies", "orders", W0, [
        anomaly_row(anomaly="duplicate_in_log", pid="p-3", seq=1), anomaly_row(anomaly="duplicate_in_log", pid="p-3", seq=2),
        anomaly_row(anomaly="lost_acked", pid="p-4"), anomaly_row(anomaly="unledgered", pid="p-3")])
    assert store.anomaly_pids(["orders"], W0, W0 + timedelta(hours=1), ["duplicate_in_log", "lost_acked"]) == [
        {"window_start": W0, "topic": "orders", "partition": 0, "stage": "log", "anomaly": "duplicate_in_log",
         "pid": "p-3", "rows": 2, "min_seq": 1, "max_seq": 2},
        {"window_start": W0, "topic": "orders", "partition": 0, "stage": "log", "anomaly": "lost_acked",
         "pid": "p-4", "rows": 1, "min_seq": 1, "max_seq": 1}]
    failed = {"window_start": W0, "topic": "orders", "partition": 0, "stage": "log", "rule": "max_duplicate_ratio"}
    assert store.failure_producer_lines([failed]) == [
        "duplicate_in_log (2 rows): producer orders-svc (session p-3) ran with enable.idempotence=false "
        "(retries=5, max.in.flight=5): set enable.idempotence=true"]
    assert store.failure_producer_lines([{**failed, "stage": "group:g", "rule": "max_lost"}]) == []
