"""The report store: the SQL copy of the audit outputs that BI tools, the SLA check and the dashboard read.

Three SQLAlchemy Core tables (docs/design.md §4) -- `audit_partition_report`, `audit_anomalies`,
`sla_results` -- plus `doctor_risks`, `alert_notices` (the notices sent per failed SLA rule) and
`producer_settings` (the settings of the producer sessions
the published log anomalies name), plus read-only views for BI tools (`VIEW_NAMES`), created on first use on any
SQLAlchemy URL (SQLite file by default, PostgreSQL in production). Writers replace one
(table, topic, window_start) at a time in a single transaction, so every publish is idempotent.

Datetimes are timezone-aware UTC in Python and stored as UTC (TIMESTAMP WITH TIME ZONE on
PostgreSQL, ISO text on SQLite); naive datetimes are refused rather than guessed at.

This module must not import pyspark (the CLI, the dashboard and Airflow use it without a JVM), and
it is the only place that knows the SQL schema: `sql/` holds the DDL generated from it
(`python -m audit.serving.report_store --write-ddl sql`), and a test keeps the two identical.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable, Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Dialect, Engine
from sqlalchemy.schema import CreateIndex, CreateTable

from audit.core.errors import ConfigError, InputError
from audit.core.vocabulary import ERROR, PROVISIONAL, REPORT_CODE_COLUMNS, WARN

PARTITION_REPORT = "audit_partition_report"
ANOMALIES = "audit_anomalies"
SLA_RESULTS = "sla_results"


class UtcDateTime(sa.types.TypeDecorator[datetime]):
    """Aware UTC datetimes in Python; UTC in the database whatever the dialect stores."""

    impl = sa.DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        # Callers are validated before this point (_check_datetime); this keeps ad-hoc queries honest too.
        value = value.astimezone(UTC)
        # SQLite has no time zone type: store the UTC wall clock so text ordering is time ordering.
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: Any, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if isinstance(value, str):  # e.g. an aggregate over a SQLite datetime column
            value = datetime.fromisoformat(value)
        if value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        return value.astimezone(UTC)


metadata = sa.MetaData()


def _c(name: str, type_: Any, nullable: bool = True, pk: bool = False) -> sa.Column[Any]:
    return sa.Column(name, type_, nullable=nullable and not pk, primary_key=pk)


_TEXT = sa.Text()
_LONG = sa.BigInteger()
_INT = sa.Integer()
_DOUBLE: sa.Double[float] = sa.Double()
_TS = UtcDateTime()

partition_report = sa.Table(
    PARTITION_REPORT, metadata,
    _c("window_start", _TS, pk=True),
    _c("window_end", _TS, nullable=False),
    _c("topic", _TEXT, pk=True),
    _c("partition", _INT, pk=True),
    _c("stage", _TEXT, pk=True),
    _c("expected", _LONG, nullable=False),
    _c("delivered", _LONG, nullable=False),
    _c("lost", _LONG, nullable=False),
    _c("duplicated", _LONG, nullable=False),
    _c("reordered", _LONG, nullable=False),
    _c("pending", _LONG, nullable=False),
    _c("latency_p50_ms", _DOUBLE),
    _c("latency_p95_ms", _DOUBLE),
    _c("latency_p99_ms", _DOUBLE),
    _c("latency_max_ms", _DOUBLE),
    _c("status", _TEXT, nullable=False),
    _c("run_id", _TEXT, nullable=False),
    _c("computed_at", _TS, nullable=False),
    *[_c(code, _LONG) for code in REPORT_CODE_COLUMNS],
)

anomalies = sa.Table(
    ANOMALIES, metadata,
    # No primary key: one message can have several rows of one code (e.g. one per extra redelivery).
    _c("window_start", _TS, nullable=False),
    _c("topic", _TEXT, nullable=False),
    _c("partition", _INT, nullable=False),
    _c("stage", _TEXT, nullable=False),
    _c("anomaly", _TEXT, nullable=False),
    _c("pid", _TEXT),
    _c("seq", _LONG),
    _c("offset", _LONG),
    _c("detail", _TEXT),
    _c("run_id", _TEXT, nullable=False),
    _c("computed_at", _TS, nullable=False),
)
sa.Index("ix_audit_anomalies_topic_window", anomalies.c.topic, anomalies.c.window_start)

sla_results = sa.Table(
    SLA_RESULTS, metadata,
    _c("window_start", _TS, pk=True),
    _c("topic", _TEXT, pk=True),
    _c("partition", _INT, pk=True),
    _c("stage", _TEXT, pk=True),
    _c("rule", _TEXT, pk=True),
    _c("observed", _DOUBLE),
    _c("threshold", _DOUBLE, nullable=False),
    _c("passed", sa.Boolean(), nullable=False),
    _c("severity", _TEXT, nullable=False),
    _c("checked_at", _TS, nullable=False),
)

TABLES: dict[str, sa.Table] = {t.name: t for t in (partition_report, anomalies, sla_results)}

DOCTOR_RISKS = "doctor_risks"
# One row per risk `msgaudit doctor` found, per run (checked_at); a run that found none stores one
# row with risk 'none' so the latest run is known. Not window-keyed: written by record_risks.
doctor_risks = sa.Table(
    DOCTOR_RISKS, metadata,
    _c("checked_at", _TS, pk=True),
    _c("topic", _TEXT, pk=True),
    _c("subject", _TEXT, pk=True),
    _c("risk", _TEXT, pk=True),
    _c("severity", _TEXT, nullable=False),
    _c("detail", _TEXT, nullable=False),
)

PRODUCER_SETTINGS = "producer_settings"
# The delivery settings of the producer sessions the published anomalies name (docs/design.md §4.4),
# copied from the lake's producer_settings by reconcile's publish, so the SLA step, the alerts and
# the dashboard can name the setting behind a log anomaly without the lake. One row per pid.
producer_settings = sa.Table(
    PRODUCER_SETTINGS, metadata,
    _c("pid", _TEXT, pk=True),
    _c("producer", _TEXT),
    _c("start_ts", _TS, nullable=False),
    _c("acks", _TEXT, nullable=False),
    _c("enable_idempotence", sa.Boolean(), nullable=False),
    _c("retries", _LONG),
    _c("max_in_flight", _LONG),
    _c("transactional_id", _TEXT),
    _c("mode", _TEXT),
)

ALERT_NOTICES = "alert_notices"
# The last notice sent to each receiver (`alertmanager`, `webhook`) for each (topic, window, stage,
# rule) of a failed SLA rule (docs/design.md §7.1), so a rerun or a backfill of the window does not
# notify twice and a passing rerun sends the resolved notice. Written by audit/serving/routing.py.
alert_notices = sa.Table(
    ALERT_NOTICES, metadata,
    _c("dedup_key", _TEXT, pk=True),
    _c("receiver", _TEXT, pk=True),
    _c("topic", _TEXT, nullable=False),
    _c("window_start", _TS, nullable=False),
    _c("stage", _TEXT, nullable=False),
    _c("rule", _TEXT, nullable=False),
    _c("status", _TEXT, nullable=False),
    _c("labels", _TEXT, nullable=False),
    _c("sent_at", _TS, nullable=False),
)
sa.Index("ix_alert_notices_topic_window", alert_notices.c.topic, alert_notices.c.window_start)

# Read order of each table: its identity, then the rest, so `read` is deterministic on every dialect.
_ORDER: dict[str, tuple[str, ...]] = {
    PARTITION_REPORT: ("window_start", "topic", "partition", "stage"),
    ANOMALIES: ("window_start", "topic", "partition", "stage", "anomaly", "pid", "seq", "offset", "detail"),
    SLA_RESULTS: ("window_start", "topic", "partition", "stage", "rule"),
}

# --------------------------------------------------------------------------------------------
# Views for BI tools. One template per view; the few dialect differences are filled in below.
# Timestamps bucket in UTC whatever the session time zone is. Sums are cast to BIGINT so that
# PostgreSQL returns integers (not NUMERIC) like SQLite does.
# --------------------------------------------------------------------------------------------

_DIALECT_SQL: dict[str, dict[str, str]] = {
    "sqlite": {
        "hour": "strftime('%Y-%m-%d %H:00:00.000000', {col})",
        "day": "strftime('%Y-%m-%d 00:00:00.000000', {col})",
        "stage_kind": "CASE WHEN instr(stage, ':') > 0 THEN substr(stage, 1, instr(stage, ':') - 1) ELSE stage END",
    },
    "postgresql": {
        "hour": "date_trunc('hour', {col}, 'UTC')",
        "day": "date_trunc('day', {col}, 'UTC')",
        "stage_kind": "split_part(stage, ':', 1)",
    },
}

_HEALTH = """
WITH r AS (
    SELECT {bucket_r} AS bucket_start, topic, stage,
           COUNT(DISTINCT "partition") AS partitions,
           COUNT(*) AS report_rows,
           CAST(SUM(CASE WHEN status = '""" + PROVISIONAL + """' THEN 1 ELSE 0 END) AS BIGINT) AS provisional_rows,
           CAST(SUM(expected) AS BIGINT) AS expected,
           CAST(SUM(delivered) AS BIGINT) AS delivered,
           CAST(SUM(lost) AS BIGINT) AS lost,
           CAST(SUM(duplicated) AS BIGINT) AS duplicated,
           CAST(SUM(reordered) AS BIGINT) AS reordered,
           CAST(SUM(pending) AS BIGINT) AS pending,
           CAST(SUM(COALESCE(dead_lettered, 0)) AS BIGINT) AS dead_lettered,
           MAX(latency_p99_ms) AS worst_latency_p99_ms
    FROM audit_partition_report
    GROUP BY {bucket_r}, topic, stage
), s AS (
    SELECT {bucket_s} AS bucket_start, topic, stage,
           COUNT(*) AS sla_checks,
           CAST(SUM(CASE WHEN NOT passed AND severity = '""" + ERROR + """' THEN 1 ELSE 0 END) AS BIGINT) AS sla_errors,
           CAST(SUM(CASE WHEN NOT passed AND severity = '""" + WARN + """' THEN 1 ELSE 0 END) AS BIGINT) AS sla_warnings
    FROM sla_results
    GROUP BY {bucket_s}, topic, stage
)
SELECT r.bucket_start, r.topic, r.stage, r.partitions, r.report_rows, r.provisional_rows,
       r.expected, r.delivered, r.lost, r.duplicated, r.reordered, r.pending, r.dead_lettered,
       CAST(r.delivered + r.dead_lettered AS DOUBLE PRECISION) / NULLIF(r.expected, 0) AS completeness,
       r.worst_latency_p99_ms,
       COALESCE(s.sla_checks, 0) AS sla_checks,
       COALESCE(s.sla_errors, 0) AS sla_errors,
       COALESCE(s.sla_warnings, 0) AS sla_warnings,
       CASE WHEN COALESCE(s.sla_errors, 0) > 0 THEN 'failing'
            WHEN COALESCE(s.sla_warnings, 0) > 0 OR r.lost + r.duplicated + r.reordered > 0 THEN 'degraded'
            WHEN r.provisional_rows > 0 THEN 'provisional'
            ELSE 'ok' END AS health
FROM r
LEFT JOIN s ON s.bucket_start = r.bucket_start AND s.topic = r.topic AND s.stage = r.stage
"""

_VIEW_TEMPLATES: dict[str, str] = {
    # Health per (topic, stage) per UTC hour / day: totals, completeness, SLA failures, a verdict.
    "v_topic_health_hourly": _HEALTH.replace("{bucket_r}", "{hour_window_start}")
                                    .replace("{bucket_s}", "{hour_window_start}"),
    "v_topic_health_daily": _HEALTH.replace("{bucket_r}", "{day_window_start}")
                                   .replace("{bucket_s}", "{day_window_start}"),
    # Every (topic, partition, stage) over all windows, ranked by lost + duplicated + reordered.
    "v_worst_partitions": """
WITH r AS (
    SELECT topic, "partition", stage,
           COUNT(*) AS windows,
           CAST(SUM(expected) AS BIGINT) AS expected,
           CAST(SUM(lost) AS BIGINT) AS lost,
           CAST(SUM(duplicated) AS BIGINT) AS duplicated,
           CAST(SUM(reordered) AS BIGINT) AS reordered,
           CAST(SUM(lost + duplicated + reordered) AS BIGINT) AS problems,
           MAX(latency_p99_ms) AS worst_latency_p99_ms,
           MAX(window_start) AS last_window_start
    FROM audit_partition_report
    GROUP BY topic, "partition", stage
), s AS (
    SELECT topic, "partition", stage,
           CAST(SUM(CASE WHEN passed THEN 0 ELSE 1 END) AS BIGINT) AS sla_failures
    FROM sla_results
    GROUP BY topic, "partition", stage
)
SELECT RANK() OVER (ORDER BY r.problems DESC, COALESCE(s.sla_failures, 0) DESC) AS problem_rank,
       r.topic, r."partition", r.stage, r.windows, r.expected, r.lost, r.duplicated, r.reordered,
       r.problems, COALESCE(s.sla_failures, 0) AS sla_failures, r.worst_latency_p99_ms, r.last_window_start
FROM r
LEFT JOIN s ON s.topic = r.topic AND s."partition" = r."partition" AND s.stage = r.stage
""",
    # Anomaly occurrences per UTC day, topic, stage and code.
    "v_anomaly_breakdown": """
SELECT {day_window_start} AS day_start, topic, {stage_kind} AS stage_kind, stage, anomaly,
       COUNT(*) AS occurrences,
       COUNT(DISTINCT "partition") AS partitions,
       MIN(window_start) AS first_window_start,
       MAX(window_start) AS last_window_start
FROM audit_anomalies
GROUP BY {day_window_start}, topic, stage, anomaly
""",
    # Per window, topic and stage: the worst partition's percentiles (percentiles do not add up).
    "v_latency_trend": """
SELECT window_start, topic, stage,
       COUNT(*) AS partitions,
       CAST(SUM(delivered) AS BIGINT) AS delivered,
       MAX(latency_p50_ms) AS latency_p50_ms,
       MAX(latency_p95_ms) AS latency_p95_ms,
       MAX(latency_p99_ms) AS latency_p99_ms,
       MAX(latency_max_ms) AS latency_max_ms
FROM audit_partition_report
GROUP BY window_start, topic, stage
""",
    # SLA checks per UTC day, topic, rule and severity.
    "v_sla_pass_rate": """
SELECT {day_window_start} AS day_start, topic, rule, severity,
       COUNT(*) AS checks,
       CAST(SUM(CASE WHEN passed THEN 1 ELSE 0 END) AS BIGINT) AS passed_checks,
       CAST(SUM(CASE WHEN passed THEN 0 ELSE 1 END) AS BIGINT) AS failed_checks,
       CAST(SUM(CASE WHEN passed THEN 1 ELSE 0 END) AS DOUBLE PRECISION) / COUNT(*) AS pass_rate
FROM sla_results
GROUP BY {day_window_start}, topic, rule, severity
""",
}
VIEW_NAMES: tuple[str, ...] = tuple(_VIEW_TEMPLATES)

# View columns that hold timestamps (typed on read so both dialects give aware UTC datetimes).
_VIEW_TIMESTAMPS = ("bucket_start", "day_start", "window_start", "first_window_start", "last_window_start")

SUPPORTED_DIALECTS = tuple(_DIALECT_SQL)


def view_sql(name: str, dialect: str) -> str:
    """The SELECT behind view `name` for 'sqlite' or 'postgresql'."""
    if dialect not in _DIALECT_SQL:
        raise ConfigError(f"report store: unsupported database {dialect!r} (supported: {', '.join(SUPPORTED_DIALECTS)})")
    if name not in _VIEW_TEMPLATES:
        raise InputError(f"unknown report store view {name!r} (known: {', '.join(VIEW_NAMES)})")
    d = _DIALECT_SQL[dialect]
    return _VIEW_TEMPLATES[name].strip().format(
        hour_window_start=d["hour"].format(col="window_start"),
        day_window_start=d["day"].format(col="window_start"),
        stage_kind=d["stage_kind"],
    )


def _dialect(name: str) -> Dialect:
    return {"sqlite": sqlite.dialect, "postgresql": postgresql.dialect}[name]()


def ddl(dialect: str) -> str:
    """The complete report store DDL (tables, indexes, views) for 'sqlite' or 'postgresql'."""
    if dialect not in _DIALECT_SQL:
        raise ConfigError(f"report store: unsupported database {dialect!r} (supported: {', '.join(SUPPORTED_DIALECTS)})")
    d = _dialect(dialect)
    parts = [f"-- msgaudit report store, {dialect}. Generated by `python -m audit.serving.report_store --write-ddl sql`;\n"
             "-- do not edit by hand (tests/test_sql_views.py checks it matches audit/serving/report_store.py).\n"]
    for table in metadata.sorted_tables:
        parts.append(str(CreateTable(table).compile(dialect=d)).strip() + ";\n")
        for index in sorted(table.indexes, key=lambda i: str(i.name)):
            parts.append(str(CreateIndex(index).compile(dialect=d)).strip() + ";\n")
    for name in VIEW_NAMES:
        parts.append(f"CREATE VIEW {name} AS\n{view_sql(name, dialect)};\n")
    # SQLAlchemy's DDL compiler leaves a space before each newline; keep the files diff-friendly.
    return "\n".join("\n".join(line.rstrip() for line in part.splitlines()) + "\n" for part in parts)


def _check_datetime(value: Any, what: str) -> datetime:
    if not isinstance(value, datetime):
        raise InputError(f"{what}: expected a timezone-aware UTC datetime, got {value!r}")
    if value.tzinfo is None or value.utcoffset() is None:
        raise InputError(f"{what}: naive datetime {value.isoformat()}; pass a timezone-aware UTC datetime")
    return value.astimezone(UTC)


def _table(name: str) -> sa.Table:
    try:
        return TABLES[name]
    except KeyError:
        raise InputError(f"unknown report store table {name!r} (known: {', '.join(TABLES)})") from None


def _bound(process: Any, values: list[Any]) -> list[Any]:
    return [None if v is None else process(v) for v in values] if process else values


class ReportStore:
    """The report store behind one SQLAlchemy URL. Tables and views are created on first use."""

    def __init__(self, url: str) -> None:
        try:
            parsed = sa.engine.make_url(url)
        except sa.exc.ArgumentError:
            raise ConfigError(f"report_store: {url!r} is not a SQLAlchemy URL "
                              "(e.g. sqlite:///.msgaudit/report.db or postgresql+psycopg://user@host/db)") from None
        self.url = parsed.render_as_string(hide_password=True)
        backend = parsed.get_backend_name()
        if backend not in _DIALECT_SQL:
            raise ConfigError(f"report_store: unsupported database {backend!r} in {self.url} "
                              f"(supported: {', '.join(SUPPORTED_DIALECTS)})")
        self.dialect = backend
        kwargs: dict[str, Any] = {}
        if backend == "sqlite":
            if parsed.database and parsed.database != ":memory:" and not parsed.database.startswith("file:"):
                Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
            # Writers from several processes (CLI, Airflow tasks) queue instead of failing at once.
            kwargs["connect_args"] = {"timeout": 30}
        if backend == "postgresql" and parsed.drivername == "postgresql":
            parsed = parsed.set(drivername="postgresql+psycopg")  # psycopg 3 is the pinned driver
        try:
            self._engine: Engine = sa.create_engine(parsed, **kwargs)
        except (sa.exc.ArgumentError, ImportError) as e:
            raise ConfigError(f"report_store: cannot use {self.url}: {e}") from None
        self._ready = False

    # ---- lifecycle ---------------------------------------------------------------------------

    @property
    def engine(self) -> Engine:
        """The engine, with the schema created (for ad-hoc queries and tests)."""
        self._ensure_schema()
        return self._engine

    def _ensure_schema(self) -> None:
        if self._ready:
            return
        try:
            with self._engine.begin() as conn:
                # Two processes starting at once must not both create the tables or add the same
                # column: each takes the database's write lock before it looks at the schema, so the
                # second one sees what the first did (SQLite's busy timeout waits for the lock).
                if self.dialect == "postgresql":
                    conn.execute(sa.text("SELECT pg_advisory_xact_lock(hashtext('msgaudit_report_store'))"))
                elif self.dialect == "sqlite":
                    conn.exec_driver_sql("BEGIN IMMEDIATE")
                metadata.create_all(conn, checkfirst=True)
                self._add_missing_columns(conn)
                existing = set(sa.inspect(conn).get_view_names())
                for name in VIEW_NAMES:
                    if name not in existing:
                        conn.execute(sa.text(f"CREATE VIEW {name} AS\n{view_sql(name, self.dialect)}"))
        except sa.exc.OperationalError as e:
            raise InputError(f"report store {self.url} is unreachable: {str(e.orig).strip().splitlines()[0]}") from None
        self._ready = True

    def _add_missing_columns(self, conn: sa.Connection) -> None:
        """A table an older version created lacks the columns added since (a newer anomaly code's
        count): each nullable one is added, its existing rows null there. A required column missing is
        a table msgaudit did not create: one InputError naming it."""
        inspector = sa.inspect(conn)
        quote = conn.dialect.identifier_preparer.quote
        for t in metadata.sorted_tables:
            have = {c["name"] for c in inspector.get_columns(t.name)}
            for col in t.c:
                if col.name in have:
                    continue
                if not col.nullable:
                    raise InputError(f"report store {self.url}: table {t.name} has no column {col.name!r}, which "
                                     "msgaudit always writes; it was not created by msgaudit (docs/design.md §4.4): "
                                     "point report_store at another database or drop the table")
                conn.execute(sa.text(f"ALTER TABLE {quote(t.name)} ADD COLUMN {quote(col.name)} "
                                     f"{col.type.compile(dialect=conn.dialect)}"))

    def close(self) -> None:
        self._engine.dispose()

    def __enter__(self) -> ReportStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- writing -----------------------------------------------------------------------------

    def replace_window(self, table: str, topic: str, window_start: datetime,
                       rows: Sequence[Mapping[str, Any]]) -> int:
        """Replace every row of (topic, window_start) in `table` by `rows`, in one transaction.

        Each row must belong to that topic and window. Missing nullable columns are stored as NULL.
        Returns the number of rows inserted.
        """
        t = _table(table)
        if not isinstance(topic, str) or not topic:
            raise InputError(f"{table}: topic must be a non-empty string, got {topic!r}")
        window_start = _check_datetime(window_start, f"{table}: window_start")
        clean = [self._clean_row(t, topic, window_start, row, i) for i, row in enumerate(rows)]
        self._ensure_schema()
        with self._engine.begin() as conn:
            conn.execute(t.delete().where(t.c.topic == topic, t.c.window_start == window_start))
            if clean:
                conn.execute(t.insert(), clean)
        return len(clean)

    def replace_window_columns(self, table: str, topic: str, window_start: datetime, columns: Any,
                               batch: int = 20_000) -> int:
        """`replace_window` of rows held as a pyarrow Table (`columns`, its timestamps in UTC), or as
        an iterable of them (a window's rows in parts, each read when the last is stored), checked
        column by column and inserted `batch` rows at a time, in one transaction: a window's many
        anomaly rows never become Python objects all at once. Returns the number of rows inserted."""
        import pyarrow as pa

        t = _table(table)
        if not isinstance(topic, str) or not topic:
            raise InputError(f"{table}: topic must be a non-empty string, got {topic!r}")
        window_start = _check_datetime(window_start, f"{table}: window_start")
        parts = [columns] if isinstance(columns, pa.Table) else columns
        self._ensure_schema()
        done = 0
        with self._engine.begin() as conn:
            conn.execute(t.delete().where(t.c.topic == topic, t.c.window_start == window_start))
            for part in parts:
                done += self._insert_columns(conn, t, topic, window_start, part, batch)
        return done

    def _insert_columns(self, conn: Any, t: sa.Table, topic: str, window_start: datetime, columns: Any,
                        batch: int) -> int:
        import pyarrow as pa
        import pyarrow.compute as pc

        table = t.name
        unknown = sorted(set(columns.column_names) - set(t.c.keys()))
        if unknown:
            raise InputError(f"{table}: unknown column(s) {', '.join(unknown)}")
        n = columns.num_rows
        for col in t.c:
            have = col.name in columns.column_names
            nulls = columns[col.name].null_count if have else n
            if nulls and not col.nullable:
                raise InputError(f"{table}: column {col.name!r} is required; {nulls} of {n} rows lack it")
            if have and isinstance(col.type, UtcDateTime) and n > nulls:
                kind = columns.schema.field(col.name).type
                if not pa.types.is_timestamp(kind) or kind.tz is None:
                    raise InputError(f"{table}: column {col.name!r} is {kind}; pass timestamps with a time zone")
        for name, want in (("topic", topic), ("window_start", window_start)):
            other = pc.sum(pc.invert(pc.equal(columns[name], pa.scalar(want, columns.schema.field(name).type)))).as_py()
            if n and other:
                raise InputError(f"{table}: {other} of {n} rows have a {name} other than the replaced window's "
                                 f"({want.isoformat() if isinstance(want, datetime) else repr(want)})")
        names = [c.name for c in t.c if c.name in columns.column_names]
        dialect = self._engine.dialect
        insert = t.insert().compile(dialect=dialect, column_keys=names)
        order = list(insert.positiontup or []) if insert.positional else names
        # each column's values as the driver binds them (SQLAlchemy's processors: an aware datetime as
        # the dialect stores it), a column of one value (window_start, run_id, ...) converted once
        one: dict[str, Any] = {}
        process: dict[str, Any] = {}
        for name in names:
            process[name] = t.c[name].type.dialect_impl(dialect).bind_processor(dialect)
            column = columns[name]
            if n and column.null_count == 0 and pc.count_distinct(column).as_py() == 1:
                value = column[0].as_py()
                one[name] = process[name](value) if process[name] else value
        for at in range(0, n, batch):
            k = min(batch, n - at)
            cols = [[one[name]] * k if name in one else _bound(process[name], columns[name].slice(at, k).to_pylist())
                    for name in order]
            rows = zip(*cols, strict=True)
            conn.exec_driver_sql(str(insert), list(rows) if insert.positional
                                 else [dict(zip(order, r, strict=True)) for r in rows])
        return n

    @staticmethod
    def _clean_row(t: sa.Table, topic: str, window_start: datetime, row: Mapping[str, Any],
                   i: int) -> dict[str, Any]:
        where = f"{t.name} row {i}"
        unknown = sorted(set(row) - set(t.c.keys()))
        if unknown:
            raise InputError(f"{where}: unknown column(s) {', '.join(unknown)}")
        out: dict[str, Any] = {}
        for col in t.c:
            value = row.get(col.name)
            if value is None:
                if not col.nullable:
                    raise InputError(f"{where}: column {col.name!r} is required")
            elif isinstance(col.type, UtcDateTime):
                value = _check_datetime(value, f"{where}: {col.name}")
            out[col.name] = value
        if out["topic"] != topic:
            raise InputError(f"{where}: topic {out['topic']!r} does not match the window's topic {topic!r}")
        if out["window_start"] != window_start:
            raise InputError(f"{where}: window_start {out['window_start'].isoformat()} does not match "
                             f"the replaced window {window_start.isoformat()}")
        return out

    # ---- reading -----------------------------------------------------------------------------

    def read(self, table: str, topic: str | None = None, start: datetime | None = None,
             end: datetime | None = None) -> list[dict[str, Any]]:
        """Rows of `table` (optionally one topic, windows starting in [start, end)), in a stable order."""
        t = _table(table)
        query = sa.select(t)
        if topic is not None:
            query = query.where(t.c.topic == topic)
        if start is not None:
            query = query.where(t.c.window_start >= _check_datetime(start, "start"))
        if end is not None:
            query = query.where(t.c.window_start < _check_datetime(end, "end"))
        order = [t.c[c].asc().nulls_first() if t.c[c].nullable else t.c[c].asc() for c in _ORDER[table]]
        self._ensure_schema()
        with self._engine.connect() as conn:
            return [dict(r) for r in conn.execute(query.order_by(*order)).mappings()]

    def read_view(self, name: str) -> list[dict[str, Any]]:
        """Every row of BI view `name` (see VIEW_NAMES), timestamps as aware UTC datetimes.

        Rows come ordered by all their columns, so results compare equal across dialects."""
        if name not in _VIEW_TEMPLATES:
            raise InputError(f"unknown report store view {name!r} (known: {', '.join(VIEW_NAMES)})")
        self._ensure_schema()
        with self._engine.connect() as conn:
            cols = [c["name"] for c in sa.inspect(conn).get_columns(name)]
            typed = {c: UtcDateTime() for c in cols if c in _VIEW_TIMESTAMPS}
            quoted = ", ".join(f'"{c}"' for c in cols)
            query = sa.text(f"SELECT {quoted} FROM {name} ORDER BY {quoted}").columns(**typed)
            return [dict(r) for r in conn.execute(query).mappings()]

    def record_risks(self, checked_at: datetime, risks: Sequence[Mapping[str, Any]]) -> int:
        """Store one doctor run's risks (topic, subject, risk, severity, detail); none -> one 'none' row."""
        at = _check_datetime(checked_at, f"{DOCTOR_RISKS}: checked_at")
        rows = [{"checked_at": at, **{k: r[k] for k in ("topic", "subject", "risk", "severity", "detail")}}
                for r in risks] or [{"checked_at": at, "topic": "-", "subject": "-", "risk": "none",
                                     "severity": "info", "detail": "no risk found"}]
        self._ensure_schema()
        with self._engine.begin() as conn:
            conn.execute(doctor_risks.delete().where(doctor_risks.c.checked_at == at))
            conn.execute(doctor_risks.insert(), rows)
        return len(risks)

    def latest_risks(self) -> tuple[datetime | None, list[dict[str, Any]]]:
        """The latest doctor run's time and its risks (errors first), or (None, []) if none ran."""
        t = doctor_risks
        self._ensure_schema()
        with self._engine.connect() as conn:
            last = conn.execute(sa.select(sa.func.max(t.c.checked_at))).scalar()
            if last is None:
                return None, []
            last = UtcDateTime().process_result_value(last, self._engine.dialect)
            rows = conn.execute(sa.select(t).where(t.c.checked_at == last, t.c.risk != "none")
                                .order_by(t.c.severity, t.c.topic, t.c.subject, t.c.risk)).mappings()
            return last, [dict(r) for r in rows]

    def record_settings(self, rows: Sequence[Mapping[str, Any]]) -> int:
        """Store producer sessions' settings (`producer_settings` rows; a pid already stored is
        replaced, the first of several rows of one pid kept). Returns the number of pids stored."""
        t = producer_settings
        clean: dict[str, dict[str, Any]] = {}
        for i, row in enumerate(rows):
            out = {c.name: row.get(c.name) for c in t.c}
            for c in t.c:
                if out[c.name] is None and not c.nullable:
                    raise InputError(f"{PRODUCER_SETTINGS} row {i}: column {c.name!r} is required")
            out["start_ts"] = _check_datetime(out["start_ts"], f"{PRODUCER_SETTINGS} row {i}: start_ts")
            clean.setdefault(str(out["pid"]), out)
        if not clean:
            return 0
        self._ensure_schema()
        with self._engine.begin() as conn:
            conn.execute(t.delete().where(t.c.pid.in_(sorted(clean))))
            conn.execute(t.insert(), [clean[p] for p in sorted(clean)])
        return len(clean)

    def settings_of(self, pids: Iterable[str]) -> list[dict[str, Any]]:
        """The stored `producer_settings` rows of these pids, by pid."""
        wanted = sorted({p for p in pids if p is not None})
        if not wanted:
            return []
        t = producer_settings
        self._ensure_schema()
        out: list[dict[str, Any]] = []
        with self._engine.connect() as conn:
            for i in range(0, len(wanted), 500):
                out += [dict(r) for r in conn.execute(sa.select(t).where(t.c.pid.in_(wanted[i:i + 500]))).mappings()]
        return sorted(out, key=lambda r: r["pid"])

    def anomaly_pids(self, topics: Sequence[str] | None, start: datetime | None, end: datetime | None,
                     codes: Sequence[str]) -> list[dict[str, Any]]:
        """Anomaly rows of windows starting in [start, end) (None: unbounded) with one of `codes`,
        counted per (window_start, topic, partition, stage, anomaly, pid) as `rows`, with their
        lowest and highest seq (`min_seq`, `max_seq`; one GROUP BY, not every row)."""
        t = anomalies
        keys = [t.c.window_start, t.c.topic, t.c.partition, t.c.stage, t.c.anomaly, t.c.pid]
        query = (sa.select(*keys, sa.func.count().label("rows"), sa.func.min(t.c.seq).label("min_seq"),
                           sa.func.max(t.c.seq).label("max_seq"))
                 .where(t.c.anomaly.in_(list(codes)), t.c.pid.is_not(None))
                 .group_by(*keys).order_by(*keys))
        if start is not None:
            query = query.where(t.c.window_start >= _check_datetime(start, "start"))
        if end is not None:
            query = query.where(t.c.window_start < _check_datetime(end, "end"))
        if topics:
            query = query.where(t.c.topic.in_(list(topics)))
        self._ensure_schema()
        with self._engine.connect() as conn:
            rows = [dict(r) for r in conn.execute(query).mappings()]
        for r in rows:
            r["window_start"] = UtcDateTime().process_result_value(r["window_start"], self._engine.dialect)
        return rows

    def failure_producer_lines(self, failures: Sequence[Mapping[str, Any]]) -> list[str]:
        """The producer sessions behind failed SLA checks (rows with window_start, topic, partition,
        stage, rule): `audit.core.explain.producer_lines` over the log anomaly rows those checks
        count, with the settings stored for their pids (none stored: no line)."""
        from datetime import timedelta

        from audit.core.explain import SETTINGS_CODES, failure_anomalies, instant, producer_lines
        from audit.core.vocabulary import LOG, stage_kind

        logs = [f for f in failures if f.get("stage") and stage_kind(f["stage"]) == LOG]
        if not logs:
            return []
        starts = [instant(f["window_start"]) for f in logs]
        rows = self.anomaly_pids(sorted({f["topic"] for f in logs}), min(starts),
                                 max(starts) + timedelta(microseconds=1), SETTINGS_CODES)
        behind = failure_anomalies(logs, rows)
        return producer_lines(behind, self.settings_of(a["pid"] for a in behind)) if behind else []

    def notices(self, topics: Sequence[str], start: datetime, end: datetime) -> list[dict[str, Any]]:
        """The `alert_notices` rows of these topics' windows starting in [start, end)."""
        t = alert_notices
        query = sa.select(t).where(t.c.topic.in_(list(topics)), t.c.window_start >= _check_datetime(start, "start"),
                                   t.c.window_start < _check_datetime(end, "end")).order_by(t.c.dedup_key, t.c.receiver)
        self._ensure_schema()
        with self._engine.connect() as conn:
            return [dict(r) for r in conn.execute(query).mappings()]

    def record_notices(self, rows: Sequence[Mapping[str, Any]]) -> None:
        """Store the notices sent (each replaces the row of its dedup_key and receiver)."""
        if not rows:
            return
        t = alert_notices
        clean = [{c.name: r[c.name] for c in t.c} for r in rows]
        for r in clean:
            r["window_start"] = _check_datetime(r["window_start"], f"{ALERT_NOTICES}: window_start")
            r["sent_at"] = _check_datetime(r["sent_at"], f"{ALERT_NOTICES}: sent_at")
        self._ensure_schema()
        with self._engine.begin() as conn:
            for r in clean:
                conn.execute(t.delete().where(t.c.dedup_key == r["dedup_key"], t.c.receiver == r["receiver"]))
            conn.execute(t.insert(), clean)

    def windows(self, table: str, topic: str | None = None) -> list[datetime]:
        """Distinct window starts present in `table` (optionally for one topic), ascending."""
        t = _table(table)
        query = sa.select(t.c.window_start).distinct()
        if topic is not None:
            query = query.where(t.c.topic == topic)
        self._ensure_schema()
        with self._engine.connect() as conn:
            return sorted(r[0] for r in conn.execute(query))


def write_ddl(folder: Path) -> list[Path]:
    """Write sql/<dialect>/report_store.sql for every supported dialect; returns the files."""
    written = []
    for dialect in SUPPORTED_DIALECTS:
        path = folder / dialect / "report_store.sql"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(ddl(dialect), encoding="utf-8")
        written.append(path)
    return written


def _main(argv: Iterable[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m audit.serving.report_store",
                                description="Regenerate the report store DDL files under sql/.")
    p.add_argument("--write-ddl", metavar="FOLDER", required=True, help="folder to write (the repo's sql/)")
    args = p.parse_args(list(argv) if argv is not None else None)
    for path in write_ddl(Path(args.write_ddl)):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(_main())
