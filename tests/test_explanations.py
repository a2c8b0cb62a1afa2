"""Every anomaly code carries a cause and a remedy (docs/design.md §5 "Explanations"), and the SLA
table and the alerts show them."""

from __future__ import annotations

from typing import Any

import pytest

from audit.core import vocabulary as v


@pytest.mark.unit
def test_every_anomaly_code_has_a_one_line_cause_and_remedy() -> None:
    keys = {(a.stage_kind, a.name) for a in v.ANOMALIES}
    assert set(v.EXPLANATIONS) == keys
    for key in keys:
        e = v.explanation(*key)
        assert e.cause.strip() and e.remedy.strip(), key
        assert "\n" not in e.cause + e.remedy, key
    with pytest.raises(KeyError, match="no anomaly code 'nope'"):
        v.explanation(v.LOG, "nope")


@pytest.mark.unit
def test_explanations_name_the_settings_the_failures_come_from() -> None:
    assert "enable.idempotence=true" in v.explanation(v.LOG, "duplicate_in_log").remedy
    assert "commit" in v.explanation(v.GROUP, "missed").cause
    lost = v.explanation(v.LOG, "lost_acked")
    assert "acks" in lost.cause and "unclean leader election" in lost.cause
    assert "unclean.leader.election.enable=false" in lost.remedy
    assert "retention" in v.explanation(v.GROUP, "expired_unconsumed").cause


@pytest.mark.unit
def test_rule_explanations_are_the_codes_counting_in_the_rules_total() -> None:
    assert [c for c, _ in v.rule_explanations("max_lost", v.GROUP)] == ["missed", "expired_unconsumed"]
    assert [c for c, _ in v.rule_explanations("max_duplicate_ratio", v.LOG)] == ["duplicate_in_log"]
    assert [c for c, _ in v.rule_explanations("max_reordered", v.GROUP)] == ["reordered_in_consumption"]
    assert v.rule_explanations("max_p99_latency_ms", v.LOG) == ()
    assert [c for c, _ in v.rule_explanations("max_failed_sends", v.LOG)] == ["failed_send"]
    assert v.rule_explanations("max_failed_sends", v.GROUP) == ()
    assert set(v.SLA_RULE_TOTALS) <= set(v.SLA_RULES)


def _settings(pid: str, producer: str | None = "orders-svc", acks: str = "all", idempotence: bool = True,
              retries: int = 5, in_flight: int = 5) -> dict[str, Any]:
    from datetime import UTC, datetime

    return {"pid": pid, "producer": producer, "start_ts": datetime(2026, 11, 21, 9, tzinfo=UTC), "acks": acks,
            "enable_idempotence": idempotence, "retries": retries, "max_in_flight": in_flight,
            "transactional_id": None, "mode": "python"}


@pytest.mark.unit
def test_the_settings_a_producer_ran_with_name_the_setting_to_change() -> None:
    from audit.core.explain import setting_remedy, settings_remedy

    off = _settings("p-3", idempotence=False, acks="1")
    assert settings_remedy("duplicate_in_log", off) == (
        "this producer ran with enable.idempotence=false (retries=5, max.in.flight=5): set enable.idempotence=true")
    assert settings_remedy("reordered_in_log", off, "producer p-3") == (
        "producer p-3 ran with enable.idempotence=false (retries=5, max.in.flight=5): set enable.idempotence=true")
    assert settings_remedy("lost_acked", off) == "this producer ran with acks=1: set acks=all (and min.insync.replicas >= 2)"
    safe = _settings("p-1")
    assert settings_remedy("duplicate_in_log", safe) == (
        "this producer was idempotent: the copies come from separate sends or producer sessions")
    assert settings_remedy("lost_acked", safe) == (
        "this producer used acks=all: look for an unclean leader election or min.insync.replicas=1 (msgaudit doctor)")
    assert settings_remedy("missed", off) is None  # a consumer's code: producer settings say nothing
    assert setting_remedy("lost_acked", []) is None


FIRST_MESSAGES = (
    "the client re-sent its first requests by itself, after later batches in flight had succeeded (a retriable "
    "error: typically NOT_LEADER_OR_FOLLOWER from a topic created moments before the producer started, whose "
    "partition leaders were not ready yet, or a broken connection); such retries leave no failed send in the "
    "ledger: set enable.idempotence=true (or max.in.flight.requests.per.connection=1), and create topics before "
    "their producers start")


@pytest.mark.unit
def test_a_reordering_of_the_sessions_first_messages_names_the_clients_own_retry_of_its_first_requests() -> None:
    from audit.core.explain import producer_lines, session_start, settings_remedy

    assert session_start(11, 2) and session_start(1, 0)
    assert not session_start(5, 5)  # seqs 5..9 re-sent behind 10..14: a later batch, not the first
    assert not session_start(3, None)
    off = _settings("p-7", producer="kcat", idempotence=False, retries=2147483647, in_flight=1000000)
    ran = "producer p-7 ran with enable.idempotence=false (retries=2147483647, max.in.flight=1000000)"
    assert settings_remedy("reordered_in_log", off, "producer p-7", (11, 2, 34)) == (
        f"{ran} and the reordered messages are among its first (seqs 2..34): {FIRST_MESSAGES}")
    assert settings_remedy("reordered_in_log", off, "producer p-7", (20, 500, 519)) == (
        f"{ran}: set enable.idempotence=true")
    assert settings_remedy("duplicate_in_log", off, "producer p-7", (2, 0, 1)) == f"{ran}: set enable.idempotence=true"
    assert settings_remedy("reordered_in_log", _settings("p-1"), seqs=(3, 0, 2)) == (
        "this producer was idempotent: the copies come from separate sends or producer sessions")

    # Rows one per anomaly (`seq`) or counted per partition (`rows`, `min_seq`, `max_seq`): the
    # session's rows over all partitions; a row without seqs leaves the evidence unknown.
    per_row = [{"stage": "log", "anomaly": "reordered_in_log", "pid": "p-7", "seq": s} for s in (4, 2, 9)]
    counted = [{"stage": "log", "anomaly": "reordered_in_log", "pid": "p-7", "rows": 7, "min_seq": 3, "max_seq": 30},
               {"stage": "log", "anomaly": "reordered_in_log", "pid": "p-7", "rows": 4, "min_seq": 1, "max_seq": 34}]
    who = "producer kcat (session p-7) ran with enable.idempotence=false (retries=2147483647, max.in.flight=1000000)"
    assert producer_lines(per_row, [off]) == [
        f"reordered_in_log (3 rows): {who} and the reordered messages are among its first (seqs 2..9): {FIRST_MESSAGES}"]
    assert producer_lines(counted, [off]) == [
        f"reordered_in_log (11 rows): {who} and the reordered messages are among its first (seqs 1..34): "
        f"{FIRST_MESSAGES}"]
    unknown = [*counted, {"stage": "log", "anomaly": "reordered_in_log", "pid": "p-7", "rows": 1}]
    assert producer_lines(unknown, [off]) == [f"reordered_in_log (12 rows): {who}: set enable.idempotence=true"]


@pytest.mark.unit
def test_producer_lines_name_each_session_whose_settings_caused_log_anomalies() -> None:
    from audit.core.explain import producer_lines

    rows: list[dict[str, Any]] = [{"stage": "log", "anomaly": "duplicate_in_log", "pid": "p-3", "rows": 2},
            {"stage": "log", "anomaly": "duplicate_in_log", "pid": "p-3"},
            {"stage": "log", "anomaly": "lost_acked", "pid": "p-4"},
            {"stage": "log", "anomaly": "lost_acked", "pid": "p-5"},  # no settings row: not named
            {"stage": "log", "anomaly": "unledgered", "pid": "p-3"},  # not a settings code
            {"stage": "group:g", "anomaly": "missed", "pid": "p-3"}]
    settings = [_settings("p-3", idempotence=False, retries=2147483647), _settings("p-4", producer=None, acks="1")]
    assert producer_lines(rows, settings) == [
        "duplicate_in_log (3 rows): producer orders-svc (session p-3) ran with enable.idempotence=false "
        "(retries=2147483647, max.in.flight=5): set enable.idempotence=true",
        "lost_acked (1 row): producer session p-4 ran with acks=1: set acks=all (and min.insync.replicas >= 2)",
    ]
    assert producer_lines(rows, settings, limit=1)[1:] == ["... and 1 more producer session(s)"]
    assert producer_lines(rows, []) == []


@pytest.mark.unit
def test_failure_anomalies_are_the_rows_counted_by_the_failed_rule_of_that_window() -> None:
    from datetime import UTC, datetime

    from audit.core.explain import failure_anomalies

    w10, w11 = datetime(2026, 11, 21, 10, tzinfo=UTC), datetime(2026, 11, 21, 11, tzinfo=UTC)
    fail = {"window_start": w10.isoformat(), "topic": "t", "partition": 1, "stage": "log", "rule": "max_lost"}
    rows = [{"window_start": w10, "topic": "t", "partition": 1, "stage": "log", "anomaly": "lost_acked", "pid": "a"},
            {"window_start": w10, "topic": "t", "partition": 1, "stage": "log", "anomaly": "duplicate_in_log",
             "pid": "b"},  # max_duplicate_ratio did not fail
            {"window_start": w11, "topic": "t", "partition": 1, "stage": "log", "anomaly": "lost_acked", "pid": "c"},
            {"window_start": w10, "topic": "t", "partition": 0, "stage": "log", "anomaly": "lost_acked", "pid": "d"}]
    assert [r["pid"] for r in failure_anomalies([fail], rows)] == ["a"]


@pytest.mark.unit
def test_report_lines_explain_each_code_the_report_counts() -> None:
    from audit.core.explain import report_lines

    report = [{"stage": "log", "duplicate_in_log": 2, "lost_acked": 0, "missed": None},
              {"stage": "log", "duplicate_in_log": 1},
              {"stage": "group:g", "missed": 1, "duplicate_in_log": None}]
    dup, missed = v.explanation(v.LOG, "duplicate_in_log"), v.explanation(v.GROUP, "missed")
    assert report_lines(report) == [f"  log duplicate_in_log (3): {dup.cause}", f"      fix: {dup.remedy}",
                                    f"  group missed (1): {missed.cause}", f"      fix: {missed.remedy}"]
    assert report_lines([{"stage": "log", "duplicate_in_log": 0}]) == []


@pytest.mark.unit
def test_the_demo_report_ends_with_the_causes_and_the_producers_behind_them() -> None:
    from audit.lab.demo import format_causes

    report = [{"stage": "log", "duplicate_in_log": 2}, {"stage": "group:g", "missed": 0}]
    anomalies = [{"stage": "log", "anomaly": "duplicate_in_log", "pid": "p-3"}] * 2
    dup = v.explanation(v.LOG, "duplicate_in_log")
    assert format_causes(report, anomalies, [_settings("p-3", idempotence=False)]).splitlines() == [
        "Likely causes (docs/design.md §5)", f"  log duplicate_in_log (2): {dup.cause}", f"      fix: {dup.remedy}",
        "Producer settings behind them (producer_settings)",
        "  duplicate_in_log (2 rows): producer orders-svc (session p-3) ran with enable.idempotence=false "
        "(retries=5, max.in.flight=5): set enable.idempotence=true"]
    assert format_causes(report, anomalies, []).splitlines()[-1] == f"      fix: {dup.remedy}"
    assert format_causes([{"stage": "log", "duplicate_in_log": 0}], [], []) == ""
