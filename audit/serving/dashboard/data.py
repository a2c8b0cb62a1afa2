"""What the dashboard pages show, read from the report store with SQL aggregation.

The overview needs one row per (topic, window) -- never one per anomaly -- so its size and cost
grow with topics x windows, not with how broken the pipeline was. A topic page reads that topic's
report and SLA rows, its anomaly counts per code, and at most `MAX_ANOMALY_ROWS` anomaly rows
(newest first), all filtered in SQL.

Status levels of a cell, worst wins: 0 `no_rules` (report rows, no SLA checked), 1 `pass`,
2 `warn` (a warn-severity rule failed), 3 `fail` (an error-severity rule failed).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import sqlalchemy as sa

from audit.core.errors import InputError
from audit.core.explain import SETTINGS_CODES, producer_lines
from audit.core.vocabulary import ERROR, LOG, REPORT_CODE_COLUMNS, SLA_CHECK_STATUSES, WARN, stage_kind
from audit.serving.report_store import ReportStore
from audit.serving.report_store import anomalies as anomalies_t
from audit.serving.report_store import partition_report as report_t
from audit.serving.report_store import sla_results as sla_t

STATUS_LEVELS = ("no_rules", *SLA_CHECK_STATUSES)
MAX_ANOMALY_ROWS = 2000
MAX_SLA_FAILURE_ROWS = 1000


@dataclass(frozen=True)
class Scope:
    """Windows starting in [start, end) (None: unbounded), of `topics` (None: every topic)."""

    start: datetime | None = None
    end: datetime | None = None
    topics: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.start is not None and self.end is not None and self.end <= self.start:
            raise InputError(f"--end ({self.end.isoformat()}) must be after --start ({self.start.isoformat()})")

    def where(self, t: sa.Table) -> list[sa.ColumnElement[bool]]:
        conds: list[sa.ColumnElement[bool]] = []
        if self.start is not None:
            conds.append(t.c.window_start >= self.start)
        if self.end is not None:
            conds.append(t.c.window_start < self.end)
        if self.topics is not None:
            conds.append(t.c.topic.in_(self.topics))
        return conds


def _level(t: sa.Table) -> sa.ColumnElement[int]:
    """SQL: the status level of one sla_results row."""
    return sa.case((t.c.passed, 1), (t.c.severity == ERROR, 3), else_=2)


def _failed(t: sa.Table, severity: str) -> sa.ColumnElement[Any]:
    return sa.func.sum(sa.case((sa.and_(sa.not_(t.c.passed), t.c.severity == severity), 1), else_=0))


@dataclass
class Cell:
    """One (topic, window) of the overview matrix."""

    level: int = 0
    lost: int = 0
    duplicated: int = 0
    reordered: int = 0
    sla_errors: int = 0
    sla_warnings: int = 0
    anomalies: int = 0
    worst: str = ""  # "p<partition> <stage>" of the worst partition/stage, '' when all is well

    @property
    def status(self) -> str:
        return STATUS_LEVELS[self.level]


@dataclass
class TopicSummary:
    """One topic over the whole range: the ranking table's row."""

    topic: str
    windows: int = 0
    level: int = 0
    lost: int = 0
    duplicated: int = 0
    reordered: int = 0
    sla_errors: int = 0
    sla_warnings: int = 0
    anomalies: int = 0
    bad_windows: int = 0  # windows with a failed rule or a lost/duplicated/reordered message
    first_bad: datetime | None = None
    last_bad: datetime | None = None

    @property
    def status(self) -> str:
        return STATUS_LEVELS[self.level]

    def rank_key(self) -> tuple[Any, ...]:
        """Worst first: a failed error rule, then a failed warn rule, then lost, duplicated, reordered,
        failed rules, bad windows; then the name. `pass` and `no_rules` are one tier: a topic with no
        rules that lost messages is not better than one whose rules passed."""
        return (-max(self.level, 1), -self.lost, -self.duplicated, -self.reordered,
                -(self.sla_errors + self.sla_warnings), -self.bad_windows, self.topic)


@dataclass
class Overview:
    windows: list[datetime] = field(default_factory=list)
    topics: list[TopicSummary] = field(default_factory=list)  # ranked, worst first
    cells: dict[tuple[str, datetime], Cell] = field(default_factory=dict)

    @property
    def totals(self) -> dict[str, int]:
        ts = self.topics
        return {"topics": len(ts), "windows": len(self.windows), "topic windows": len(self.cells),
                "lost": sum(t.lost for t in ts), "duplicated": sum(t.duplicated for t in ts),
                "reordered": sum(t.reordered for t in ts), "anomaly rows": sum(t.anomalies for t in ts),
                "SLA failures (error)": sum(t.sla_errors for t in ts),
                "SLA failures (warn)": sum(t.sla_warnings for t in ts),
                "failing topics": sum(1 for t in ts if t.level == 3)}


def overview_data(store: ReportStore, scope: Scope) -> Overview:
    """Per (topic, window) aggregates of all three tables, and the ranked topics."""
    r, s, a = report_t, sla_t, anomalies_t
    problems = r.c.lost + r.c.duplicated + r.c.reordered
    report_q = (sa.select(r.c.topic, r.c.window_start, sa.func.sum(r.c.lost), sa.func.sum(r.c.duplicated),
                          sa.func.sum(r.c.reordered))
                .where(*scope.where(r)).group_by(r.c.topic, r.c.window_start))
    sla_q = (sa.select(s.c.topic, s.c.window_start, sa.func.max(_level(s)), _failed(s, ERROR), _failed(s, WARN))
             .where(*scope.where(s)).group_by(s.c.topic, s.c.window_start))
    anomaly_q = (sa.select(a.c.topic, a.c.window_start, sa.func.count())
                 .where(*scope.where(a)).group_by(a.c.topic, a.c.window_start))
    # The worst (partition, stage) of each cell: highest SLA level, most failed rules, most problems.
    per_ps = (sa.select(s.c.topic, s.c.window_start, s.c.partition, s.c.stage,
                        sa.func.max(_level(s)).label("lvl"),
                        sa.func.sum(sa.case((s.c.passed, 0), else_=1)).label("nfail"))
              .where(*scope.where(s)).group_by(s.c.topic, s.c.window_start, s.c.partition, s.c.stage).subquery())
    joined = sa.outerjoin(r, per_ps, sa.and_(per_ps.c.topic == r.c.topic, per_ps.c.window_start == r.c.window_start,
                                             per_ps.c.partition == r.c.partition, per_ps.c.stage == r.c.stage))
    lvl = sa.func.coalesce(per_ps.c.lvl, 0)
    nfail = sa.func.coalesce(per_ps.c.nfail, 0)
    ranked = (sa.select(r.c.topic, r.c.window_start, r.c.partition, r.c.stage, lvl.label("lvl"),
                        nfail.label("nfail"), problems.label("problems"),
                        sa.func.row_number().over(partition_by=(r.c.topic, r.c.window_start),
                                                  order_by=(lvl.desc(), nfail.desc(), problems.desc(),
                                                            r.c.partition, r.c.stage)).label("rn"))
              .select_from(joined).where(*scope.where(r)).subquery())
    worst_q = (sa.select(ranked.c.topic, ranked.c.window_start, ranked.c.partition, ranked.c.stage)
               .where(ranked.c.rn == 1, sa.or_(ranked.c.lvl >= 2, ranked.c.nfail > 0, ranked.c.problems > 0)))

    cells: dict[tuple[str, datetime], Cell] = {}
    with store.engine.connect() as conn:
        for topic, w, lost, dup, reord in conn.execute(report_q):
            cells[(topic, w)] = Cell(lost=int(lost or 0), duplicated=int(dup or 0), reordered=int(reord or 0))
        for topic, w, level, errors, warnings in conn.execute(sla_q):
            c = cells.setdefault((topic, w), Cell())
            c.level, c.sla_errors, c.sla_warnings = int(level), int(errors or 0), int(warnings or 0)
        for topic, w, n in conn.execute(anomaly_q):
            cells.setdefault((topic, w), Cell()).anomalies = int(n)
        for topic, w, partition, stage in conn.execute(worst_q):
            cells[(topic, w)].worst = f"p{partition} {stage}"

    summaries: dict[str, TopicSummary] = {}
    for (topic, w), c in cells.items():
        t = summaries.setdefault(topic, TopicSummary(topic))
        t.windows += 1
        t.level = max(t.level, c.level)
        t.lost += c.lost
        t.duplicated += c.duplicated
        t.reordered += c.reordered
        t.sla_errors += c.sla_errors
        t.sla_warnings += c.sla_warnings
        t.anomalies += c.anomalies
        if c.level >= 2 or c.lost or c.duplicated or c.reordered:
            t.bad_windows += 1
            t.first_bad = w if t.first_bad is None else min(t.first_bad, w)
            t.last_bad = w if t.last_bad is None else max(t.last_bad, w)
    return Overview(windows=sorted({w for _, w in cells}),
                    topics=sorted(summaries.values(), key=TopicSummary.rank_key), cells=cells)


# ---------------------------------------------------------------------------------------------
# One topic
# ---------------------------------------------------------------------------------------------

@dataclass
class TopicData:
    topic: str
    report: list[dict[str, Any]] = field(default_factory=list)
    sla: list[dict[str, Any]] = field(default_factory=list)
    anomaly_total: int = 0
    anomaly_counts: list[tuple[str, str, int]] = field(default_factory=list)  # (stage, code, rows)
    anomalies: list[dict[str, Any]] = field(default_factory=list)  # newest first, at most MAX_ANOMALY_ROWS
    # The producer sessions whose recorded settings caused log anomalies (audit.core.explain.producer_lines).
    producer_lines: list[str] = field(default_factory=list)


def _grouped(rows: Iterator[Any]) -> Iterator[tuple[str, list[dict[str, Any]]]]:
    """Rows ordered by topic -> (topic, that topic's rows), one topic in memory at a time."""
    current: str | None = None
    bucket: list[dict[str, Any]] = []
    for row in rows:
        d = dict(row)
        if d["topic"] != current:
            if current is not None:
                yield current, bucket
            current, bucket = d["topic"], []
        bucket.append(d)
    if current is not None:
        yield current, bucket


def topics_data(store: ReportStore, scope: Scope, topics: Sequence[str],
                max_anomalies: int = MAX_ANOMALY_ROWS) -> Iterator[TopicData]:
    """TopicData for each of `topics`, in sorted topic order, streamed one topic at a time."""
    r, s, a = report_t, sla_t, anomalies_t
    wanted = sorted(set(topics))
    # Only the columns the pages show (fewer timestamps to convert: they dominate the cost).
    report_cols = [r.c[n] for n in ("topic", "window_start", "partition", "stage", "lost", "duplicated", "reordered",
                                    "pending", "latency_p50_ms", "latency_p95_ms", "latency_p99_ms",
                                    *REPORT_CODE_COLUMNS)]
    report_q = (sa.select(*report_cols).where(*scope.where(r))
                .order_by(r.c.topic, r.c.window_start, r.c.partition, r.c.stage))
    sla_cols = [s.c[n] for n in ("topic", "window_start", "partition", "stage", "rule", "observed", "threshold",
                                 "passed", "severity")]
    sla_q = (sa.select(*sla_cols).where(*scope.where(s))
             .order_by(s.c.topic, s.c.window_start, s.c.partition, s.c.stage, s.c.rule))
    engine = store.engine
    with engine.connect() as rconn, engine.connect() as sconn, engine.connect() as aconn:
        report_groups = _grouped(iter(rconn.execute(report_q).mappings()))
        sla_groups = _grouped(iter(sconn.execute(sla_q).mappings()))
        next_r = next(report_groups, None)
        next_s = next(sla_groups, None)
        for topic in wanted:
            data = TopicData(topic)
            while next_r is not None and next_r[0] < topic:
                next_r = next(report_groups, None)
            if next_r is not None and next_r[0] == topic:
                data.report = next_r[1]
                next_r = next(report_groups, None)
            while next_s is not None and next_s[0] < topic:
                next_s = next(sla_groups, None)
            if next_s is not None and next_s[0] == topic:
                data.sla = next_s[1]
                next_s = next(sla_groups, None)
            in_topic = [a.c.topic == topic, *Scope(scope.start, scope.end).where(a)]
            counts = aconn.execute(sa.select(a.c.stage, a.c.anomaly, sa.func.count()).where(*in_topic)
                                   .group_by(a.c.stage, a.c.anomaly).order_by(a.c.stage, a.c.anomaly)).all()
            data.anomaly_counts = [(st, code, int(n)) for st, code, n in counts]
            data.anomaly_total = sum(n for _, _, n in data.anomaly_counts)
            if data.anomaly_total:
                q = (sa.select(a).where(*in_topic)
                     .order_by(a.c.window_start.desc(), a.c.partition, a.c.stage, a.c.anomaly,
                               a.c.offset.asc().nulls_first(), a.c.pid.asc().nulls_first(),
                               a.c.seq.asc().nulls_first())
                     .limit(max_anomalies))
                data.anomalies = [dict(m) for m in aconn.execute(q).mappings()]
            if any(code in SETTINGS_CODES and stage_kind(st) == LOG for st, code, _ in data.anomaly_counts):
                behind = store.anomaly_pids([topic], scope.start, scope.end, SETTINGS_CODES)
                data.producer_lines = producer_lines(behind, store.settings_of(b["pid"] for b in behind))
            yield data
