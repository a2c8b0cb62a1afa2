"""Failover of a consumer group to a MirrorMaker 2 copy (docs/design.md §5.5): the rule in the
oracle on hand-written histories, with exact rows; the config key `mirrors[].failover_groups`."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from tests.reconcile_cases import AS_OF_FINAL, T0, at

GROUP = "g1"
STAGE = f"group:{GROUP}"
PID = "p:000000000001"


def _topic_config(failover: bool = True) -> Any:
    from audit.core.config import MirrorConfig, TopicConfig

    mirror = MirrorConfig(name="dr", kafka={"bootstrap.servers": "dc2:9092"}, topic="dc1.t", source_alias="dc1",
                          failover_groups=(GROUP,) if failover else ())
    return TopicConfig(name="t", window=timedelta(hours=1), grace=timedelta(minutes=5), groups=(GROUP,),
                       mirrors=(mirror,))


def _inputs(source_processed: range, target_processed: range, committed: int,
            target_committed: int | None = None, p: int = 0) -> Any:
    """Ten messages (seq = offset 0..9) in partition 0, copied by MM2 to target partition 0 at the
    offsets 100 + seq. g processes `source_processed` on the source (committing `committed`), then
    the copies of `target_processed` on the target from 10:30. `p`: the partition (and pid) to use."""
    from audit.oracle import (
        ConsumedRow,
        GroupOffset,
        Inputs,
        LedgerRow,
        LogRecord,
        MirrorGroupOffset,
        MirrorRecord,
        Watermark,
    )

    pid = PID[:-1] + str(p + 1)
    ledger = [LedgerRow(pid, s, p, s, "acked", at(s), at(s) + timedelta(milliseconds=5)) for s in range(10)]
    log = [LogRecord(p, s, pid, s, at(s), at(s), at(20)) for s in range(10)]
    copies = [MirrorRecord(p, 100 + s, pid, s, at(s), at(s) + timedelta(seconds=1), at(40), mirror="dr") for s in range(10)]
    consumed = [ConsumedRow(GROUP, "c:src", 100 * p + i, p, s, pid, s, "processed", at(12) + timedelta(seconds=i))
                for i, s in enumerate(source_processed)]
    consumed += [ConsumedRow(GROUP, "c:dst", 100 * p + i, p, 100 + s, pid, s, "processed",
                             at(30) + timedelta(seconds=i), cluster="dr") for i, s in enumerate(target_processed)]
    mgo = [] if target_committed is None else [MirrorGroupOffset(GROUP, p, target_committed, at(45), mirror="dr")]
    return Inputs(ledger=ledger, log=log, consumed=consumed,
                  group_offsets=[GroupOffset(GROUP, p, committed, at(20))],
                  watermarks=[Watermark(p, 0, 10, at(20))], mirror_log=copies,
                  mirror_watermarks=[], mirror_group_offsets=mgo)


def _group_rows(result: Any) -> list[tuple[Any, ...]]:
    return sorted((a["anomaly"], a["offset"], a["detail"]) for a in result.anomalies if a["stage"] == STAGE)


def _group_report(result: Any) -> tuple[int, int, int, int]:
    (row,) = [r for r in result.report if r["stage"] == STAGE]
    return row["expected"], row["delivered"], row["lost"], row["duplicated"]


@pytest.mark.unit
def test_a_translation_that_went_back_gives_one_redelivered_row_per_record_processed_again() -> None:
    from audit.oracle import reconcile_window

    # processed 0..5 on the source (committed 6); MM2 translated to target offset 104: 4 and 5 again
    r = reconcile_window(_topic_config(), T0, AS_OF_FINAL, _inputs(range(0, 6), range(4, 10), 6))
    after = "on mirror dr after the failover at 2026-11-21T10:30:00.000000Z"
    assert _group_rows(r) == [("redelivered", 4, f"processing 2 of 2 by c:dst {after}"),
                              ("redelivered", 5, f"processing 2 of 2 by c:dst {after}")]
    assert _group_report(r) == (10, 10, 0, 2)


@pytest.mark.unit
def test_a_translation_that_went_forward_gives_one_missed_row_per_record_skipped() -> None:
    from audit.oracle import reconcile_window

    # processed 0..5 on the source (committed 6); resumed on the target at 108: 6 and 7 never processed
    r = reconcile_window(_topic_config(), T0, AS_OF_FINAL, _inputs(range(0, 6), range(8, 10), 6))
    skipped = ("never processed, skipped by the failover to mirror dr at 2026-11-21T10:30:00.000000Z: "
               "resumed at target offset 108")
    assert _group_rows(r) == [("missed", 6, skipped), ("missed", 7, skipped)]
    assert _group_report(r) == (10, 8, 2, 0)


@pytest.mark.unit
def test_the_target_groups_committed_offset_says_where_it_resumed_when_it_processed_nothing_below_it() -> None:
    from audit.oracle import reconcile_window

    # the target group's snapshot (committed 107) is below its first processing (108): 7 lies at or
    # above the resume point, so only 6 is skipped and 7 is overdue
    r = reconcile_window(_topic_config(), T0, AS_OF_FINAL, _inputs(range(0, 6), range(8, 10), 6, target_committed=107))
    assert [(code, off) for code, off, _ in _group_rows(r)] == [("missed", 6), ("overdue", 7)]
    assert _group_rows(r)[0][2].endswith("resumed at target offset 107")


@pytest.mark.unit
def test_rows_on_a_target_copy_are_not_evidence_for_a_group_not_declared_to_fail_over() -> None:
    from audit.oracle import reconcile_window

    r = reconcile_window(_topic_config(failover=False), T0, AS_OF_FINAL, _inputs(range(0, 6), range(4, 10), 6))
    assert [(code, off) for code, off, _ in _group_rows(r)] == [("overdue", 6), ("overdue", 7), ("overdue", 8),
                                                                ("overdue", 9)]
    assert _group_report(r) == (6 + 4, 6, 0, 0)
    # ... but they are not dropped without a word: counted, for the run summary
    assert r.ignored_mirror_rows == {(GROUP, "dr"): 6}


@pytest.mark.unit
def test_rows_read_on_a_mirror_the_group_does_not_fail_over_to_are_counted_and_said_with_the_fix() -> None:
    from dataclasses import replace

    from audit.core.failover import ignored_rows_lines
    from audit.oracle import ConsumedRow, reconcile_window

    tc = _topic_config()  # g1 fails over to dr; g2 does not
    tc = replace(tc, groups=(GROUP, "g2"))
    inputs = _inputs(range(0, 6), range(4, 10), 6)
    extra = [ConsumedRow("g2", "c:x", 500 + s, 0, 100 + s, PID, s, "processed", at(31), cluster="dr") for s in range(3)]
    extra += [ConsumedRow(GROUP, "c:eu", 600 + s, 0, 200 + s, PID, s, outcome, at(32), cluster="eu")
              for s, outcome in enumerate(["processed", "failed", "committed", "handed"])]
    extra += [ConsumedRow("g9", "c:x", 700, 0, 100, PID, 0, "processed", at(31), cluster="dr")]  # not a group of t
    extra += [ConsumedRow("g2", "c:x", 800, 0, 100, PID, 0, "processed", at(130), cluster="dr")]  # after the read range
    r = reconcile_window(tc, T0, AS_OF_FINAL, replace(inputs, consumed=[*inputs.consumed, *extra]))
    assert r.ignored_mirror_rows == {("g2", "dr"): 3, (GROUP, "eu"): 4}
    # g1's rows on dr are used as before (4 and 5 processed again), g2's are not evidence of anything
    assert _group_rows(r) == [("redelivered", 4, "processing 2 of 2 by c:dst on mirror dr after the failover at "
                                                 "2026-11-21T10:30:00.000000Z"),
                              ("redelivered", 5, "processing 2 of 2 by c:dst on mirror dr after the failover at "
                                                 "2026-11-21T10:30:00.000000Z")]
    assert sorted((a["anomaly"], a["offset"]) for a in r.anomalies if a["stage"] == "group:g2") == [
        ("overdue", s) for s in range(10)]
    assert ignored_rows_lines(tc, r.ignored_mirror_rows) == [
        "ignored 4 consumption rows of group 'g1' read on cluster 'eu' (no mirror of topic 't' has that name; "
        "its mirrors: 'dr'): name the mirror as configured under topics.t.mirrors, with 'g1' in its "
        "failover_groups, or drop the cluster setting",
        "ignored 3 consumption rows of group 'g2' read on mirror 'dr' (not in its failover_groups): "
        "add 'g2' to mirrors[dr].failover_groups, or drop the cluster setting"]


@pytest.mark.unit
def test_failover_groups_must_be_groups_of_the_topic(tmp_path: Path) -> None:
    from audit.core.config import from_dict
    from audit.core.errors import ConfigError

    mirror = {"name": "dr", "kafka": {"bootstrap.servers": "dc2:9092"}, "failover_groups": ["g1"]}
    cfg = from_dict({"topics": {"orders": {"groups": ["g1"], "mirrors": [mirror]}}}, base=tmp_path)
    assert cfg.topic("orders").mirrors[0].failover_groups == ("g1",)
    with pytest.raises(ConfigError, match=r"topics.orders.mirrors\[0\].failover_groups: group 'g1' is not in the topic's groups"):
        from_dict({"topics": {"orders": {"mirrors": [mirror]}}})
    with pytest.raises(ConfigError, match=r"mirrors\[1\].failover_groups: group 'g1' already fails over to another"):
        from_dict({"topics": {"orders": {"groups": ["g1"], "mirrors": [mirror, {**mirror, "name": "eu"}]}}})
    with pytest.raises(ConfigError, match=r"mirrors\[0\].failover_groups: expected a list of group names"):
        from_dict({"topics": {"orders": {"groups": ["g1"], "mirrors": [{**mirror, "failover_groups": "g1"}]}}})


@pytest.mark.spark
def test_the_spark_rule_equals_the_oracle_on_the_same_histories(spark: Any) -> None:
    from dataclasses import asdict, replace

    from audit.core.failover import ignored_rows_lines
    from audit.oracle import ConsumedRow, Inputs, reconcile_window
    from spark_jobs.reconcile import classify_window
    from tests.reconcile_cases import norm_rows, sorted_anomalies, window_inputs

    # one history: partition 0 went back, 1 went forward, 2 went forward with the target's snapshot;
    # g2 (not a failover group) read 3 copies on dr, g1 read 2 records on a cluster no mirror is named
    parts = [_inputs(range(0, 6), range(4, 10), 6), _inputs(range(0, 6), range(8, 10), 6, p=1),
             _inputs(range(0, 6), range(8, 10), 6, target_committed=107, p=2)]
    def merged(name: str) -> list[Any]:
        return [r for i in parts for r in getattr(i, name)]

    ignored = [ConsumedRow("g2", "c:x", 900 + s, 0, 100 + s, PID, s, "processed", at(31), cluster="dr") for s in range(3)]
    ignored += [ConsumedRow(GROUP, "c:eu", 950 + s, 1, 100 + s, PID, s, "processed", at(32), cluster="eu")
                for s in range(2)]
    inputs = Inputs(ledger=merged("ledger"), log=merged("log"), consumed=[*merged("consumed"), *ignored],
                    group_offsets=merged("group_offsets"), watermarks=merged("watermarks"),
                    mirror_log=merged("mirror_log"), mirror_group_offsets=merged("mirror_group_offsets"))
    tc = replace(_topic_config(), groups=(GROUP, "g2"))
    want = reconcile_window(tc, T0, AS_OF_FINAL, inputs)
    assert sorted((a["anomaly"], a["partition"]) for a in want.anomalies if a["stage"] == STAGE) == [
        ("missed", 1), ("missed", 1), ("missed", 2), ("overdue", 2), ("redelivered", 0), ("redelivered", 0)]
    assert want.ignored_mirror_rows == {("g2", "dr"): 3, (GROUP, "eu"): 2}
    wi = replace(window_inputs(spark, inputs, tc), mirror_group_offsets=spark.createDataFrame(
        [asdict(r) for r in inputs.mirror_group_offsets],
        "mirror string, group string, partition int, committed_offset bigint, captured_at timestamp, topic string"))
    got = classify_window(spark, wi, tc, T0, AS_OF_FINAL, engine="spark", chunks=2)
    assert sorted_anomalies(r.asDict() for r in got.anomalies.collect()) == sorted_anomalies(want.anomalies)
    key = lambda r: (r["stage"], r["partition"])  # noqa: E731
    assert sorted(norm_rows(got.report), key=key) == sorted(norm_rows(want.report), key=key)
    assert got.ignored == {("g2", "dr"): 3, (GROUP, "eu"): 2}
    assert got.notes == ignored_rows_lines(tc, want.ignored_mirror_rows) and len(got.notes) == 2


@pytest.mark.unit
def test_the_run_summary_says_what_was_ignored_on_a_mirror_one_line_each() -> None:
    from spark_jobs.reconcile import WindowResult, summary_line

    report = [{"stage": STAGE, "expected": 10, "status": "final"}]
    r = WindowResult("t", T0, AS_OF_FINAL, "run", report, None, 0, 0, False,  # type: ignore[arg-type]
                     ignored_mirror_rows={("g2", "dr"): 3}, notes=["ignored 3 consumption rows of group 'g2' ..."])
    assert summary_line(r).splitlines() == [
        't 2026-11-21T10:00:00+00:00 [final] anomalies=0 expected={"group:g1": 10}',
        "t 2026-11-21T10:00:00+00:00: ignored 3 consumption rows of group 'g2' ..."]
