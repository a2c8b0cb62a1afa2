"""Explanations made specific by the producers' recorded settings (docs/design.md §5 "Explanations").

The vocabulary gives each anomaly code a generic cause and remedy. Where the lake knows the delivery
settings a producer session started with (`producer_settings`: acks, enable.idempotence, retries,
max.in.flight per pid), the log codes those settings decide say which setting of which producer
caused them: `duplicate_in_log` / `reordered_in_log` with idempotence off, `lost_acked` with
acks other than all. One definition, used by `msgaudit trace` (`audit/serving/trace_view.py`), the
SLA step's failed checks (`spark_jobs/sla.py`), the alerts (`audit/serving/alerts.py`) and the
dashboard (`audit/serving/dashboard/topic.py`).

Pure functions over plain rows (mappings with the `producer_settings` / `audit_anomalies` columns):
no I/O.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from audit.core.vocabulary import ANOMALIES, LOG, explanation, rule_explanations, stage_kind

# The log codes a producer's delivery settings decide.
SETTINGS_CODES: tuple[str, ...] = ("duplicate_in_log", "reordered_in_log", "lost_acked")


def _bool(v: Any) -> str:
    return "true" if v else "false"


def session_start(rows: int, lowest_seq: int | None) -> bool:
    """Whether a session's `rows` reordered_in_log rows are among its first messages: their lowest
    seq is below their number (seqs start at 0 per session), so the batch the client re-sent held
    messages from the session's very beginning. A later retry (seqs 500..519 re-sent behind
    520..539) is not."""
    return lowest_seq is not None and lowest_seq < rows


def settings_remedy(code: str, s: Mapping[str, Any], subject: str = "this producer",
                    seqs: tuple[int, int, int] | None = None) -> str | None:
    """What one producer session's recorded settings `s` say about a log anomaly `code` (None: the
    settings do not bear on it), e.g. "this producer ran with enable.idempotence=false (retries=5,
    max.in.flight=5): set enable.idempotence=true". `seqs` (rows, lowest seq, highest seq) of the
    session's rows of `code`, when known, let a reordering of the session's first messages
    (`session_start`) name what re-sends those: the client's own retries of its first requests."""
    if code in ("duplicate_in_log", "reordered_in_log"):
        if not s["enable_idempotence"]:
            ran = (f"{subject} ran with enable.idempotence=false (retries={s['retries']}, "
                   f"max.in.flight={s['max_in_flight']})")
            if code == "reordered_in_log" and seqs is not None and session_start(seqs[0], seqs[1]):
                return (f"{ran} and the reordered messages are among its first (seqs {seqs[1]}..{seqs[2]}): "
                        "the client re-sent its first requests by itself, after later batches in flight had "
                        "succeeded (a retriable error: typically NOT_LEADER_OR_FOLLOWER from a topic created "
                        "moments before the producer started, whose partition leaders were not ready yet, or a "
                        "broken connection); such retries leave no failed send in the ledger: set "
                        "enable.idempotence=true (or max.in.flight.requests.per.connection=1), and create "
                        "topics before their producers start")
            return f"{ran}: set enable.idempotence=true"
        return f"{subject} was idempotent: the copies come from separate sends or producer sessions"
    if code == "lost_acked":
        if s["acks"] != "all":
            return f"{subject} ran with acks={s['acks']}: set acks=all (and min.insync.replicas >= 2)"
        return (f"{subject} used acks=all: look for an unclean leader election or min.insync.replicas=1 "
                "(msgaudit doctor)")
    return None


def setting_remedy(code: str, settings: Sequence[Mapping[str, Any]]) -> str | None:
    """`settings_remedy` for the first of a pid's settings rows (None without any)."""
    return settings_remedy(code, settings[0]) if settings else None


def producer_name(s: Mapping[str, Any]) -> str:
    """How the lines name a producer session: "producer NAME (session PID)", or "producer session PID"."""
    return f"producer {s['producer']} (session {s['pid']})" if s.get("producer") else f"producer session {s['pid']}"


def producer_lines(anomalies: Iterable[Mapping[str, Any]], settings: Iterable[Mapping[str, Any]],
                   limit: int = 10) -> list[str]:
    """One line per (code, producer session) among the log anomaly rows (stage, anomaly, pid) whose
    pid has a `producer_settings` row and whose code those settings decide, most rows first:
    "duplicate_in_log (3 rows): producer orders (session p1) ran with enable.idempotence=false
    (retries=5, max.in.flight=5): set enable.idempotence=true". Rows carry `seq`, or `min_seq` /
    `max_seq` with `rows` (`ReportStore.anomaly_pids`), for `settings_remedy`'s evidence of a
    reordered session start. At most `limit` lines, then one saying how many were left out.
    Sessions without a settings row are not named (their remedy is the generic one)."""
    by_pid: dict[str, Mapping[str, Any]] = {}
    for s in settings:
        by_pid.setdefault(s["pid"], s)
    counts: dict[tuple[str, str], int] = defaultdict(int)
    spans: dict[tuple[str, str], list[tuple[Any, Any]]] = defaultdict(list)
    for a in anomalies:
        if a["anomaly"] in SETTINGS_CODES and stage_kind(a["stage"]) == LOG and a.get("pid") in by_pid:
            key = (a["anomaly"], a["pid"])
            counts[key] += int(a.get("rows", 1))
            spans[key].append((a.get("min_seq", a.get("seq")), a.get("max_seq", a.get("seq"))))
    lines = []
    for (code, pid), n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
        span = spans[(code, pid)]
        known = all(lo is not None and hi is not None for lo, hi in span)
        seqs = (n, min(lo for lo, _ in span), max(hi for _, hi in span)) if known else None
        text = settings_remedy(code, by_pid[pid], producer_name(by_pid[pid]), seqs)
        if text:
            lines.append(f"{code} ({n} row{'' if n == 1 else 's'}): {text}")
    if len(lines) > limit:
        lines = [*lines[:limit], f"... and {len(lines) - limit} more producer session(s)"]
    return lines


def rule_codes(rule: str, stage: str) -> tuple[str, ...]:
    """The anomaly codes whose rows can fail SLA `rule` at `stage` (none for latency)."""
    return tuple(code for code, _ in rule_explanations(rule, stage_kind(stage)))


def failure_anomalies(failures: Iterable[Mapping[str, Any]], anomalies: Iterable[Mapping[str, Any]]
                      ) -> list[Mapping[str, Any]]:
    """The anomaly rows behind failed SLA checks (window_start, topic, partition, stage, rule): those
    of the same window, topic, partition and stage whose code counts in the rule's total."""
    wanted: dict[tuple[Any, ...], set[str]] = defaultdict(set)
    for f in failures:
        if f.get("stage"):
            wanted[(instant(f["window_start"]), f["topic"], f["partition"], f["stage"])].update(
                rule_codes(f["rule"], f["stage"]))
    return [a for a in anomalies
            if a["anomaly"] in wanted.get((instant(a["window_start"]), a["topic"], a["partition"], a["stage"]), ())]


def instant(v: datetime | str) -> datetime:
    """An aware UTC datetime from a datetime (naive: UTC) or ISO 8601 text (an alert's window_start)."""
    t = datetime.fromisoformat(v) if isinstance(v, str) else v
    return t.replace(tzinfo=UTC) if t.tzinfo is None else t.astimezone(UTC)


def report_lines(report: Iterable[Mapping[str, Any]]) -> list[str]:
    """For report rows (`audit_partition_report`): per (stage kind, code) with rows in them, in
    vocabulary order, "  log duplicate_in_log (3): CAUSE" and "      fix: REMEDY"."""
    counts: dict[tuple[str, str], int] = defaultdict(int)
    for row in report:
        kind = stage_kind(row["stage"])
        for a in ANOMALIES:
            if a.stage_kind == kind and a.report_column is not None and row.get(a.report_column):
                counts[(kind, a.name)] += int(row[a.report_column])
    lines = []
    for a in ANOMALIES:
        n = counts.get((a.stage_kind, a.name))
        if n:
            e = explanation(a.stage_kind, a.name)
            lines += [f"  {a.stage_kind} {a.name} ({n}): {e.cause}", f"      fix: {e.remedy}"]
    return lines
