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
    mgo = [] if target_committed is None else [MirrorGroupOffset("dr", GROUP, p, target_committed, at(45))]
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

    from audit.oracle import Inputs, reconcile_window
    from spark_jobs.reconcile import reconcile_frames
    from tests.reconcile_cases import norm_rows, sorted_anomalies, window_inputs

    # one history: partition 0 went back, 1 went forward, 2 went forward with the target's snapshot
    parts = [_inputs(range(0, 6), range(4, 10), 6), _inputs(range(0, 6), range(8, 10), 6, p=1),
             _inputs(range(0, 6), range(8, 10), 6, target_committed=107, p=2)]
    def merged(name: str) -> list[Any]:
        return [r for i in parts for r in getattr(i, name)]

    inputs = Inputs(ledger=merged("ledger"), log=merged("log"), consumed=merged("consumed"),
                    group_offsets=merged("group_offsets"), watermarks=merged("watermarks"),
                    mirror_log=merged("mirror_log"), mirror_group_offsets=merged("mirror_group_offsets"))
    tc = _topic_config()
    want = reconcile_window(tc, T0, AS_OF_FINAL, inputs)
    assert sorted((a["anomaly"], a["partition"]) for a in want.anomalies if a["stage"] == STAGE) == [
        ("missed", 1), ("missed", 1), ("missed", 2), ("overdue", 2), ("redelivered", 0), ("redelivered", 0)]
    wi = replace(window_inputs(spark, inputs, tc), mirror_group_offsets=spark.createDataFrame(
        [asdict(r) for r in inputs.mirror_group_offsets],
        "mirror string, group string, partition int, committed_offset bigint, captured_at timestamp, topic string"))
    report, anomalies, _, _ = reconcile_frames(spark, wi, tc, T0, AS_OF_FINAL)
    assert sorted_anomalies(r.asDict() for r in anomalies.collect()) == sorted_anomalies(want.anomalies)
    key = lambda r: (r["stage"], r["partition"])  # noqa: E731
    assert sorted(norm_rows(report), key=key) == sorted(norm_rows(want.report), key=key)
