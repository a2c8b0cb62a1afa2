"""The lab's MirrorMaker 2 scenarios on one broker behind the fault proxy, a second local cluster
as the mirror's target, audited in one run: the audit's rows equal each scenario's ground truth
(the checks of tests/test_lab_scenarios.py), and the mirror stage's report counts follow the faults."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from audit.lab.runner import LabResult
from audit.lab.scenarios import MIRROR_SCENARIOS
from tests.test_lab_scenarios import _check, proxied_run


@pytest.fixture(scope="module")
def mirror_result(tmp_path_factory: pytest.TempPathFactory, spark: Any) -> Iterator[LabResult]:
    yield from proxied_run(tmp_path_factory, spark, MIRROR_SCENARIOS)


@pytest.mark.e2e
@pytest.mark.kafka
@pytest.mark.spark
@pytest.mark.parametrize("name", MIRROR_SCENARIOS)
def test_audit_reports_exactly_the_ground_truth(mirror_result: LabResult, name: str) -> None:
    _check(mirror_result, name)


@pytest.mark.e2e
@pytest.mark.kafka
@pytest.mark.spark
def test_mirror_stage_report_counts_follow_the_faults(mirror_result: LabResult) -> None:
    """The mirror stage is in the report like the others: 20 messages expected per topic, the
    re-copied ones duplicated, the ones deleted during MM2's outage (at the source, or on the target
    by its retention) lost, a latency for what arrived."""
    runs = {r.name: r for r in mirror_result.runs}
    (kill_topic,) = runs["mirror_kill"].topics
    (ret_topic,) = runs["mirror_retention"].topics
    (tret_topic,) = runs["mirror_target_retention"].topics
    (fo_topic,) = runs["mirror_failover"].topics
    mirror_rows = [r for r in mirror_result.report if r["stage"] == "mirror:dr"]
    keys = ("expected", "delivered", "lost", "duplicated", "reordered")
    topics = (kill_topic, ret_topic, tret_topic, fo_topic)
    totals = {t: [sum(int(r[k]) for r in mirror_rows if r["topic"] == t) for k in keys] for t in topics}
    assert totals == {kill_topic: [20, 20, 0, 10, 0], ret_topic: [20, 10, 10, 0, 0], tret_topic: [20, 10, 10, 0, 0],
                      fo_topic: [20, 20, 0, 0, 0]}
    assert {r["topic"] for r in mirror_rows} == set(topics)
    # LogAppendTime copies: the target's append time; the CreateTime copy of mirror_target_retention
    # carries the source's timestamp, so its latency is only the producer's clock rounding (ms)
    assert all(r["latency_p50_ms"] is not None and r["latency_p50_ms"] > 0
               for r in mirror_rows if r["delivered"] and r["topic"] != tret_topic)
    tret_rows = [r for r in mirror_rows if r["delivered"] and r["topic"] == tret_topic]
    assert tret_rows and all(r["latency_p50_ms"] is not None and abs(r["latency_p50_ms"]) < 1000 for r in tret_rows)
    # the failed-over group: every record delivered (10 on the source, the rest on the target), 9 twice
    fo_group = [r for r in mirror_result.report if r["topic"] == fo_topic and r["stage"].startswith("group:")]
    assert [sum(int(r[k]) for r in fo_group) for k in keys] == [20, 20, 0, 9, 0]
