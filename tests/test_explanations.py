"""Every anomaly code carries a cause and a remedy (docs/design.md §5 "Explanations"), and the SLA
table and the alerts show them."""

from __future__ import annotations

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
    assert set(v.SLA_RULE_TOTALS) <= set(v.SLA_RULES)
