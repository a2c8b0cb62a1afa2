"""The rules docs/design.md §5.1 and §5.3 add for clients audited by configuration only: a group
whose members run the Java consumer interceptor (`handed` and `committed` rows), and producers
that cannot see a transaction's abort (Java interceptor, librdkafka plugin: rows stay `acked`).
Hand-written histories, through the oracle and (marked spark) through the Spark reconcile."""

from __future__ import annotations

from typing import Any

import pytest

from audit.oracle import reconcile_window
from tests.reconcile_cases import AS_OF_FINAL, T0, G, History, at, brief, spark_reconcile, topic_config

TC = topic_config(sinks=())


def interceptor_group_history() -> History:
    """Partition 0, offsets 0-6 of pid "j": instance c1 is handed 0-2 and commits 3, then is handed
    3 and 4 and killed before committing; its restart c2 is handed 3 and 4 again, commits 6
    without ever being handed 5 (a skip), then is handed 6. No capture snapshotted the group: only
    the interceptor's `committed` rows tell its committed offset."""
    h = History()
    for o in range(7):
        h.produce("j", o, 0, o, at(10 + o))
        h.record("j", o, 0, o, at(10 + o))
    h.captured(0, 0, 7, at(70))
    for o in (0, 1, 2):
        h.consume("j", o, 0, o, at(20), outcome="handed", consumer="c1")
    h.consume(None, None, 0, 3, at(21), outcome="committed", consumer="c1")
    h.consume("j", 3, 0, 3, at(22), outcome="handed", consumer="c1")
    h.consume("j", 4, 0, 4, at(22), outcome="handed", consumer="c1")
    # restarted: 3 and 4 again, 5 never handed yet 6 committed; 6 handed after the commit
    h.consume("j", 3, 0, 3, at(30), outcome="handed", consumer="c2")
    h.consume("j", 4, 0, 4, at(30), outcome="handed", consumer="c2")
    h.consume(None, None, 0, 6, at(31), outcome="committed", consumer="c2")
    h.consume("j", 6, 0, 6, at(32), outcome="handed", consumer="c2")
    return h


EXPECTED_GROUP = [(G, "missed", 0, "j", 5, 5), (G, "redelivered", 0, "j", 3, 3), (G, "redelivered", 0, "j", 4, 4)]


def abort_blind_history() -> History:
    """pid "t" (transactional, blind to the abort): seq 0-1 acked and committed; seq 2-3 acked in
    a transaction that aborted (their records are in the log uncommitted); seq 4 acked, committed."""
    h = History()
    for s, committed in [(0, True), (1, True), (2, False), (3, False), (4, True)]:
        h.produce("t", s, 0, s, at(10 + s))
        h.record("t", s, 0, s, at(10 + s), committed=committed)
    h.captured(0, 0, 5, at(70))
    return h


EXPECTED_ABORT = [("log", "aborted", 0, "t", 2, 2), ("log", "aborted", 0, "t", 3, 3)]


@pytest.mark.unit
def test_handed_is_processing_and_committed_rows_give_the_committed_offset() -> None:
    r = reconcile_window(TC, T0, AS_OF_FINAL, interceptor_group_history().inputs())
    assert brief(r.anomalies) == EXPECTED_GROUP
    details = {a["offset"]: a["detail"] for a in r.anomalies if a["anomaly"] == "redelivered"}
    assert details == {3: "processing 2 of 2 by c2", 4: "processing 2 of 2 by c2"}
    row = next(x for x in r.report if x["stage"] == G)
    assert (row["expected"], row["delivered"], row["lost"], row["duplicated"], row["missed"], row["overdue"]) == \
        (7, 6, 1, 2, 1, 0)


@pytest.mark.unit
def test_a_captured_snapshot_below_the_interceptors_commit_does_not_hide_a_skip() -> None:
    h = interceptor_group_history()
    h.captured(0, 0, 7, at(71), group_committed=3)  # a snapshot older than the last commit
    r = reconcile_window(TC, T0, AS_OF_FINAL, h.inputs())
    assert brief(r.anomalies) == EXPECTED_GROUP


@pytest.mark.unit
def test_without_the_committed_rows_the_skipped_record_is_only_overdue() -> None:
    h = interceptor_group_history()
    h.consumed = [c for c in h.consumed if c.outcome != "committed"]
    r = reconcile_window(TC, T0, AS_OF_FINAL, h.inputs())
    assert brief(r.anomalies) == [(G, "overdue", 0, "j", 5, 5), *EXPECTED_GROUP[1:]]


@pytest.mark.unit
def test_acked_rows_of_an_aborted_transaction_end_aborted_not_lost() -> None:
    r = reconcile_window(topic_config(groups=(), sinks=()), T0, AS_OF_FINAL, abort_blind_history().inputs())
    assert brief(r.anomalies) == EXPECTED_ABORT
    row = next(x for x in r.report if x["stage"] == "log")
    assert (row["expected"], row["delivered"], row["lost"], row["aborted"], row["lost_acked"]) == (3, 3, 0, 2, 0)


@pytest.mark.spark
def test_spark_applies_the_same_rules(spark: Any) -> None:
    _, anomalies, _ = spark_reconcile(spark, TC, T0, AS_OF_FINAL, interceptor_group_history().inputs())
    assert brief(anomalies) == EXPECTED_GROUP
    report, anomalies, _ = spark_reconcile(spark, topic_config(groups=(), sinks=()), T0, AS_OF_FINAL,
                                           abort_blind_history().inputs())
    assert brief(anomalies) == EXPECTED_ABORT
    row = next(x for x in report if x["stage"] == "log")
    assert (row["expected"], row["delivered"], row["lost"], row["aborted"]) == (3, 3, 0, 2)
