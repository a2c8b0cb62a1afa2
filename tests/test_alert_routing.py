"""Failed SLA rules routed to a real Alertmanager (API v2) and a webhook: one alert per (topic,
window, stage, rule) with its labels; a rerun or backfill of the same result sends nothing twice;
a rerun that passes resolves; an unreachable receiver is one line and is tried again next time."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from audit.core import config as config_mod
from audit.core.config import Config
from audit.core.errors import ConfigError
from audit.runtime.local_kafka import free_port
from audit.serving.report_store import ReportStore
from audit.serving.routing import dedup_key, notices, route_sla
from tests.support.monitoring import Webhook, alertmanager, get_json

W0 = datetime(2026, 11, 21, 10, tzinfo=UTC)
W1 = W0 + timedelta(hours=1)
NOW = datetime.now(UTC)  # Alertmanager judges startsAt and endsAt by its own clock


def sla(partition: int, stage: str, rule: str, observed: float | None, threshold: float, passed: bool,
        severity: str = "error", window_start: datetime = W0) -> dict[str, Any]:
    """An `sla_results` row as `spark_jobs.sla.check_sla` writes it."""
    return {"window_start": window_start, "topic": "orders", "partition": partition, "stage": stage, "rule": rule,
            "observed": observed, "threshold": threshold, "passed": passed, "severity": severity,
            "checked_at": W0 + timedelta(hours=1, minutes=15)}


def failing_rows() -> list[dict[str, Any]]:
    """Window 10:00: max_lost fails at the log in partitions 0 (2 lost) and 1 (1 lost); the group's
    max_reordered fails (warn) in partition 1; everything else passes. Window 11:00 passes."""
    return [sla(0, "log", "max_lost", 2, 0, False), sla(1, "log", "max_lost", 1, 0, False),
            sla(0, "group:loader", "max_lost", 0, 0, True), sla(1, "group:loader", "max_lost", 0, 0, True),
            sla(0, "group:loader", "max_reordered", 0, 0, True),
            sla(1, "group:loader", "max_reordered", 3, 0, False, "warn"),
            sla(0, "log", "max_lost", 0, 0, True, window_start=W1)]


def cfg_for(tmp_path: Path, **alerts: Any) -> Config:
    return config_mod.from_dict({"report_store": f"sqlite:///{tmp_path / 'report.db'}", "alerts": alerts,
                                 "topics": {"orders": {"sla": {"max_lost": 0}}}}, base=tmp_path)


@pytest.mark.unit
def test_one_notice_per_failed_rule_of_a_window_and_stage() -> None:
    got = notices(failing_rows())
    assert [(n.key, n.severity, n.partitions, n.observed, n.threshold) for n in got] == [
        ("msgaudit/orders/2026-11-21T10:00:00Z/group:loader/max_reordered", "warn", (1,), 3, 0.0),
        ("msgaudit/orders/2026-11-21T10:00:00Z/log/max_lost", "error", (0, 1), 2, 0.0)]
    assert got[1].labels() == {"alertname": "MsgauditSlaFailed", "topic": "orders",
                               "window_start": "2026-11-21T10:00:00Z", "stage": "log", "rule": "max_lost",
                               "severity": "error", "dedup_key": "msgaudit/orders/2026-11-21T10:00:00Z/log/max_lost"}
    assert got[1].summary() == ("orders log max_lost: observed 2 vs threshold 0 in partition(s) 0, 1 of window "
                                "2026-11-21T10:00:00Z (error)")
    # the lowest completeness is the worst
    low = notices([sla(0, "log", "min_completeness", 0.5, 0.9, False), sla(1, "log", "min_completeness", 0.7, 0.9, False)])
    assert [n.observed for n in low] == [0.5]
    assert dedup_key("orders", W0.astimezone(), "log", "max_lost") == got[1].key


@pytest.mark.unit
@pytest.mark.parametrize(("alerts", "message"), [
    ({"pagerduty": "x"}, "alerts: unknown key 'pagerduty' (allowed: alertmanager, webhook, active_for, timeout)"),
    ({"webhook": "hooks.example.com/x"}, "alerts.webhook: expected an http:// or https:// URL, got "
                                         "'hooks.example.com/x'"),
    ({"active_for": "soon"}, "alerts.active_for: expected a duration like 1h, 15m or 30s, got 'soon'"),
])
def test_bad_alerts_config_is_one_line(tmp_path: Path, alerts: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as e:
        cfg_for(tmp_path, **alerts)
    assert str(e.value) == f"<dict>: {message}"
    assert "\n" not in str(e.value)


@pytest.mark.unit
def test_an_unreachable_receiver_is_one_line_and_is_tried_again(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    cfg = cfg_for(tmp_path, webhook=url, timeout="2s")
    warned: list[str] = []
    assert route_sla(cfg, failing_rows(), ["orders"], W0, W1 + timedelta(hours=1), warned.append, NOW) == {
        "firing": 0, "resolved": 0}
    assert len(warned) == 1 and warned[0].startswith(f"alerts: cannot reach the webhook at {url}: ")
    assert warned[0].endswith("its notices are sent again by the next SLA check of the window "
                              "(check alerts.webhook in <dict>)")
    with ReportStore(cfg.report_store) as store:
        assert store.notices(["orders"], W0, W1 + timedelta(hours=1)) == []
    hook = Webhook()
    try:
        cfg = cfg_for(tmp_path, webhook=hook.url)
        assert route_sla(cfg, failing_rows(), ["orders"], W0, W1 + timedelta(hours=1), warned.append, NOW) == {
            "firing": 2, "resolved": 0}
    finally:
        hook.close()
    assert len(hook.received) == 2 and len(warned) == 1


def _alerts(am: str) -> list[tuple[str, dict[str, str]]]:
    """Alertmanager's active alerts: (fingerprint, labels), by dedup key."""
    got = get_json(f"{am}/api/v2/alerts")
    return sorted(((a["fingerprint"], a["labels"]) for a in got), key=lambda a: a[1]["dedup_key"])


@pytest.fixture
def receivers() -> Iterator[tuple[str, Webhook]]:
    hook = Webhook()
    try:
        with alertmanager() as am:
            yield am, hook
    finally:
        hook.close()


@pytest.mark.e2e
def test_alertmanager_and_webhook_get_each_failure_once_and_a_passing_rerun_resolves(
        tmp_path: Path, receivers: tuple[str, Webhook]) -> None:
    am, hook = receivers
    cfg = cfg_for(tmp_path, alertmanager=am, webhook=hook.url)
    warned: list[str] = []
    span = (["orders"], W0, W1 + timedelta(hours=1))
    assert route_sla(cfg, failing_rows(), *span, warned.append) == {"firing": 4, "resolved": 0}
    first = _alerts(am)
    assert [labels for _, labels in first] == [
        {"alertname": "MsgauditSlaFailed", "topic": "orders", "window_start": "2026-11-21T10:00:00Z",
         "stage": "group:loader", "rule": "max_reordered", "severity": "warn",
         "dedup_key": "msgaudit/orders/2026-11-21T10:00:00Z/group:loader/max_reordered"},
        {"alertname": "MsgauditSlaFailed", "topic": "orders", "window_start": "2026-11-21T10:00:00Z",
         "stage": "log", "rule": "max_lost", "severity": "error",
         "dedup_key": "msgaudit/orders/2026-11-21T10:00:00Z/log/max_lost"}]
    got = get_json(f"{am}/api/v2/alerts")
    assert sorted(a["annotations"]["summary"] for a in got) == [
        "orders group:loader max_reordered: observed 3 vs threshold 0 in partition(s) 1 of window "
        "2026-11-21T10:00:00Z (warn)",
        "orders log max_lost: observed 2 vs threshold 0 in partition(s) 0, 1 of window 2026-11-21T10:00:00Z (error)"]
    assert {a["status"]["state"] for a in got} == {"active"}
    assert sorted((h["dedup_key"], h["status"], h["partitions"], h["observed"]) for h in hook.received) == [
        ("msgaudit/orders/2026-11-21T10:00:00Z/group:loader/max_reordered", "firing", [1], 3),
        ("msgaudit/orders/2026-11-21T10:00:00Z/log/max_lost", "firing", [0, 1], 2)]

    # A rerun (or a backfill) with the same result: the same two alerts, no second webhook call.
    assert route_sla(cfg, failing_rows(), *span, warned.append) == {
        "firing": 2, "resolved": 0}
    assert _alerts(am) == first
    assert len(hook.received) == 2

    # A rerun where the log passes: max_lost is resolved at both receivers, max_reordered stays.
    passing = [dict(r, passed=True, observed=0) if r["rule"] == "max_lost" else r for r in failing_rows()]
    assert route_sla(cfg, passing, *span, warned.append) == {
        "firing": 1, "resolved": 2}
    assert _alerts(am) == first[:1]
    assert [(h["dedup_key"], h["status"]) for h in hook.received[2:]] == [
        ("msgaudit/orders/2026-11-21T10:00:00Z/log/max_lost", "resolved")]
    # resolved once: a further passing rerun sends nothing more
    route_sla(cfg, passing, *span, warned.append)
    assert len(hook.received) == 3 and _alerts(am) == first[:1]
    assert warned == []
    with ReportStore(cfg.report_store) as store:
        assert sorted((n["dedup_key"].rsplit("/", 1)[1], n["receiver"], n["status"])
                      for n in store.notices(["orders"], W0, W1)) == [
            ("max_lost", "alertmanager", "resolved"), ("max_lost", "webhook", "resolved"),
            ("max_reordered", "alertmanager", "firing"), ("max_reordered", "webhook", "firing")]
