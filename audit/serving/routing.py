"""Failed SLA rules routed to Alertmanager (API v2) and a generic webhook (docs/design.md §7.1).

After each SLA check (`spark_jobs/pipeline/steps.py`), `route_sla` turns the `sla_results` rows it
wrote into one notice per (topic, window, stage, rule) whose rule failed in some partition, keyed
by `dedup_key` = `msgaudit/<topic>/<window start>/<stage>/<rule>`. What was last sent to each
receiver is kept in the report store's `alert_notices`, so:

* a failure is sent once: a rerun or a backfill of the window that fails the same way sends the
  webhook nothing, and re-posts the same alert (the same labels: one alert) to Alertmanager,
  renewing its `endsAt` (`alerts.active_for` from now);
* a rerun that passes sends each receiver that had the failure a resolved notice (Alertmanager:
  `endsAt` now; webhook: `"status": "resolved"`), once;
* a receiver that cannot be reached is one line, and nothing is recorded for it: the next check of
  the window sends it again.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from audit.serving.report_store import ReportStore

if TYPE_CHECKING:
    from audit.core.config import Config

ALERTNAME = "MsgauditSlaFailed"
FIRING, RESOLVED = "firing", "resolved"
ALERTMANAGER, WEBHOOK = "alertmanager", "webhook"


def _z(t: datetime) -> str:
    return t.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def dedup_key(topic: str, window_start: datetime, stage: str, rule: str) -> str:
    """The stable key of one (topic, window, stage, rule)."""
    return f"msgaudit/{topic}/{_z(window_start)}/{stage}/{rule}"


@dataclass(frozen=True)
class Notice:
    """One failed rule of one window and stage, over its partitions."""

    topic: str
    window_start: datetime
    stage: str
    rule: str
    severity: str
    partitions: tuple[int, ...]  # the partitions that failed
    observed: float | None  # the worst failed partition's
    threshold: float

    @property
    def key(self) -> str:
        return dedup_key(self.topic, self.window_start, self.stage, self.rule)

    def labels(self) -> dict[str, str]:
        return {"alertname": ALERTNAME, "topic": self.topic, "window_start": _z(self.window_start),
                "stage": self.stage, "rule": self.rule, "severity": self.severity, "dedup_key": self.key}

    def summary(self) -> str:
        observed = "-" if self.observed is None else f"{self.observed:g}"
        return (f"{self.topic} {self.stage} {self.rule}: observed {observed} vs threshold {self.threshold:g} "
                f"in partition(s) {', '.join(map(str, self.partitions))} of window {_z(self.window_start)} "
                f"({self.severity})")


def notices(rows: Sequence[Mapping[str, Any]]) -> list[Notice]:
    """The failed rules of `sla_results` rows, one notice per (topic, window, stage, rule): the worst
    severity, the failed partitions, the worst observed value (the highest of a `max_` rule, the lowest
    of a `min_` one)."""
    failed: dict[tuple[str, datetime, str, str], list[Mapping[str, Any]]] = defaultdict(list)
    for r in rows:
        if not r["passed"]:
            failed[(r["topic"], r["window_start"], r["stage"], r["rule"])].append(r)
    out = []
    for (topic, ws, stage, rule), group in sorted(failed.items()):
        observed = [g["observed"] for g in group if g["observed"] is not None]
        worst = (min(observed) if rule.startswith("min_") else max(observed)) if observed else None
        out.append(Notice(topic=topic, window_start=ws, stage=stage, rule=rule,
                          severity="error" if any(g["severity"] == "error" for g in group) else "warn",
                          partitions=tuple(sorted({int(g["partition"]) for g in group})), observed=worst,
                          threshold=float(group[0]["threshold"])))
    return out


def _post(url: str, body: Any, timeout: float) -> None:
    req = urllib.request.Request(url, data=json.dumps(body).encode("utf-8"), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        resp.read()


def _alert(labels: Mapping[str, str], summary: str, starts: datetime, ends: datetime) -> dict[str, Any]:
    return {"labels": dict(labels), "annotations": {"summary": summary},
            "startsAt": starts.isoformat(), "endsAt": ends.isoformat()}


def _webhook_body(labels: Mapping[str, str], status: str, summary: str, notice: Notice | None,
                  at: datetime) -> dict[str, Any]:
    body: dict[str, Any] = {"dedup_key": labels["dedup_key"], "status": status,
                            **{k: labels[k] for k in ("topic", "window_start", "stage", "rule", "severity")},
                            "summary": summary, "sent_at": at.isoformat()}
    if notice is not None:
        body.update(partitions=list(notice.partitions), observed=notice.observed, threshold=notice.threshold)
    return body


def route_sla(cfg: Config, rows: Sequence[Mapping[str, Any]], topics: Sequence[str], start: datetime,
              end: datetime, warn: Callable[[str], None], now: datetime | None = None) -> dict[str, int]:
    """Send the notices of one SLA check of `topics` over windows starting in [start, end) (`rows`:
    the `sla_results` rows it wrote); returns how many firing and resolved notices were sent."""
    a = cfg.alerts
    receivers = [name for name, url in ((ALERTMANAGER, a.alertmanager), (WEBHOOK, a.webhook)) if url]
    sent = {FIRING: 0, RESOLVED: 0}
    if not receivers or not topics:
        return sent
    at = now or datetime.now(UTC)
    current = {n.key: n for n in notices(rows)}
    with ReportStore(cfg.report_store) as store:
        # a window starting before `start` is in the check when it overlaps it: every row's window counts
        first = min([start, *(r["window_start"] for r in rows)])
        prior = {(p["dedup_key"], p["receiver"]): p for p in store.notices(topics, first, end)}
        record: list[dict[str, Any]] = []
        for receiver in receivers:
            firing: list[tuple[dict[str, str], Notice | None, str]] = []  # (labels, notice, status)
            for key, n in current.items():
                before = prior.get((key, receiver))
                labels = n.labels()
                if before is not None and before["status"] == FIRING and json.loads(before["labels"]) != labels:
                    firing.append((json.loads(before["labels"]), None, RESOLVED))  # severity changed: a new alert
                if receiver == ALERTMANAGER or before is None or before["status"] != FIRING \
                        or json.loads(before["labels"]) != labels:
                    firing.append((labels, n, FIRING))
            for (key, rcv), before in prior.items():
                if rcv == receiver and before["status"] == FIRING and key not in current:
                    firing.append((json.loads(before["labels"]), None, RESOLVED))
            if not firing:
                continue
            try:
                if receiver == ALERTMANAGER:
                    assert a.alertmanager is not None
                    _post(f"{a.alertmanager}/api/v2/alerts",
                          [_alert(labels, note.summary() if note else f"{labels['dedup_key']}: passed on a rerun",
                                  at, at + a.active_for if status == FIRING else at)
                           for labels, note, status in firing], a.timeout.total_seconds())
                else:
                    assert a.webhook is not None
                    for labels, note, status in firing:
                        _post(a.webhook, _webhook_body(labels, status, note.summary() if note else
                                                       f"{labels['dedup_key']}: passed on a rerun", note, at),
                              a.timeout.total_seconds())
            except (OSError, urllib.error.URLError) as e:
                warn(f"alerts: cannot reach the {receiver} at {getattr(a, receiver)}: {e}; its notices are sent "
                     f"again by the next SLA check of the window (check alerts.{receiver} in {cfg.source})")
                continue
            for labels, _n, status in firing:
                sent[status] += 1
                record.append({"dedup_key": labels["dedup_key"], "receiver": receiver, "topic": labels["topic"],
                               "window_start": datetime.fromisoformat(labels["window_start"].replace("Z", "+00:00")),
                               "stage": labels["stage"], "rule": labels["rule"], "status": status,
                               "labels": json.dumps(labels, sort_keys=True), "sent_at": at})
        # a key resolved after a severity change and fired again keeps its last row: the firing one
        store.record_notices(list({(r["dedup_key"], r["receiver"]): r for r in record}.values()))
    return sent

