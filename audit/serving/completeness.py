"""Completeness events: what a final window says to the jobs downstream of its topic (docs/design.md §6.5).

When a window is final, the window DAG and the backfill DAG emit one Airflow Asset event per topic
(`spark_jobs.pipeline.airflow`), and `msgaudit follow` posts one to Airflow's REST API
(`audit.serving.airflow_events`), on the topic's asset `asset_uri(cfg, topic)`, with
`window_extra(...)` as its extra -- all built by `window_events`: the window's counts per stage (summed over partitions), its
anomaly counts by code, and whether each stage -- and the window -- was complete and exactly once.
A downstream DAG scheduled on the asset gates on `all_exactly_once(extras)`.

No Airflow here: the extras are plain JSON, built from the report store's rows.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any

from audit.core.vocabulary import REPORT_CODE_COLUMNS

if TYPE_CHECKING:
    from audit.core.config import Config

SCHEME = "msgaudit"
COUNTS = ("expected", "delivered", "lost", "duplicated", "reordered", "pending")


def asset_uri(bootstrap_servers: str, topic: str) -> str:
    """`msgaudit://<first bootstrap server>/<topic>`: one asset per topic and Kafka cluster.

    The cluster is named by the first entry of the config's `kafka.bootstrap.servers`, as written
    (a `SCHEME://` prefix dropped, lower-cased), e.g. `msgaudit://kafka-1:9092/orders`."""
    first = (bootstrap_servers.split(",")[0].strip() or "localhost").lower()
    return f"{SCHEME}://{first.rsplit('://', 1)[-1]}/{topic}"


def _stage_summary(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {c: sum(int(r.get(c) or 0) for r in rows) for c in COUNTS}
    codes = {c: sum(int(r.get(c) or 0) for r in rows) for c in REPORT_CODE_COLUMNS}
    out["anomalies"] = {c: n for c, n in sorted(codes.items()) if n}
    final = all(r.get("status") == "final" for r in rows)
    reached = out["delivered"] + codes.get("dead_lettered", 0)
    out["complete"] = final and out["pending"] == 0 and out["lost"] == 0 and reached >= out["expected"]
    out["exactly_once"] = out["complete"] and out["duplicated"] == 0
    return out


def window_extra(rows: Iterable[Mapping[str, Any]], topic: str, window_start: datetime, window_end: datetime,
                 as_of: datetime) -> dict[str, Any]:
    """The extra of one topic's completeness event, from its `audit_partition_report` rows of the window.

    Per stage: `expected`, `delivered`, `lost`, `duplicated`, `reordered`, `pending` (docs/design.md
    §5.6), `anomalies` (code -> rows, codes with none left out), `complete` (final, nothing pending or
    lost, every expected unit delivered or dead-lettered) and `exactly_once` (complete, nothing
    duplicated). The window is complete / exactly once when every stage is; a window without rows
    (nothing produced) is both."""
    by_stage: dict[str, list[Mapping[str, Any]]] = {}
    for r in rows:
        if r["topic"] == topic and r["window_start"] == window_start:
            by_stage.setdefault(str(r["stage"]), []).append(r)
    stages = {s: _stage_summary(by_stage[s]) for s in sorted(by_stage)}
    return {"topic": topic, "window_start": window_start.isoformat(), "window_end": window_end.isoformat(),
            "as_of": as_of.isoformat(),
            "complete": all(s["complete"] for s in stages.values()),
            "exactly_once": all(s["exactly_once"] for s in stages.values()),
            "stages": stages}


def window_extras(report_store: str, topics: Sequence[str], window_start: datetime, window_end: datetime,
                  as_of: datetime) -> dict[str, dict[str, Any]]:
    """topic -> `window_extra` of the window, read from the report store."""
    from audit.serving.report_store import ReportStore

    with ReportStore(report_store) as store:
        return {t: window_extra(store.read("audit_partition_report", topic=t, start=window_start, end=window_end),
                                t, window_start, window_end, as_of) for t in topics}


def window_events(cfg: Config, topics: Sequence[str], window_start: datetime, window_end: datetime,
                  as_of: datetime) -> list[tuple[str, dict[str, Any]]]:
    """The completeness events of one final window: (asset URI, extra) per topic, in `topics`' order.
    What every emitter sends (the DAGs' `publish` tasks, `msgaudit follow`)."""
    extras = window_extras(cfg.report_store, topics, window_start, window_end, as_of)
    return [(asset_uri(cfg.kafka.get("bootstrap.servers", ""), t), extras[t]) for t in topics]


def sla_breached(report_store: str, topics: Sequence[str], window_start: datetime, window_end: datetime,
            as_of: datetime) -> bool:
    """Whether the window's SLA check at `as_of` failed an error-severity rule: the step that fails a
    window run on purpose (exit 3) after its report is final."""
    from audit.serving.report_store import ReportStore

    with ReportStore(report_store) as store:
        rows = [r for t in topics for r in store.read("sla_results", topic=t, start=window_start, end=window_end)]
    return any(r["checked_at"] == as_of and not r["passed"] and r["severity"] == "error" for r in rows)


def all_exactly_once(extras: Iterable[Mapping[str, Any]]) -> bool:
    """The downstream gate: every window event handed over was complete and exactly once (and there was one)."""
    seen = list(extras)
    return bool(seen) and all(bool(e.get("exactly_once")) for e in seen)
