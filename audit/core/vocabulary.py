"""Anomaly codes and stages (DESIGN §5), shared by the oracle, Spark jobs, report store and SLA."""

from __future__ import annotations

ANOMALY_CODES_BY_STAGE: dict[str, tuple[str, ...]] = {
    "log": ("lost_acked", "unverifiable", "ghost_write", "duplicate_in_log", "reordered_in_log",
            "unledgered", "seq_gap", "unaudited", "content_duplicate", "aborted"),
    "group": ("missed", "expired_unconsumed", "redelivered", "reordered_in_consumption",
              "dead_lettered", "aborted_read", "pending", "overdue"),
    "sink": ("missing_in_sink", "duplicate_in_sink", "unexpected_in_sink", "pending"),
}
ANOMALY_CODES: tuple[str, ...] = tuple(dict.fromkeys(c for cs in ANOMALY_CODES_BY_STAGE.values() for c in cs))

# Report columns named after codes (`pending` already is a base column of the report).
REPORT_CODE_COLUMNS: tuple[str, ...] = tuple(c for c in ANOMALY_CODES if c != "pending")


def stage_kind(stage: str) -> str:
    """'log' | 'group:<g>' | 'sink:<s>' -> 'log' | 'group' | 'sink'."""
    return stage.split(":", 1)[0]
