"""The docs/design.md §5 rules on hand-written histories, through the pure-Python oracle (no JVM)."""

from __future__ import annotations

from datetime import timedelta

import pytest

from audit.core.percentiles import spark_percentile
from audit.core.windows import run_id_for
from audit.oracle import (
    LedgerRow,
    OracleResult,
    reconcile_window,
)
from tests.reconcile_cases import (
    AS_OF_FINAL,
    GROUP,
    SINK,
    T0,
    G,
    History,
    S,
    at,
    brief,
    build_cases,
    report_row,
    topic_config,
)

pytestmark = pytest.mark.unit

CASES_HISTORY, CASES = build_cases()


@pytest.fixture(scope="module")
def final_result() -> OracleResult:
    return reconcile_window(topic_config(), T0, AS_OF_FINAL, CASES_HISTORY.inputs())


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_anomaly_code_on_its_hand_written_case(final_result: OracleResult, case: str) -> None:
    expected = CASES[case]
    code = case if case != "clean" else None
    got = brief(a for a in final_result.anomalies if a["anomaly"] == code)
    assert got == sorted(expected, key=lambda t: tuple("" if v is None else str(v) for v in t))


def test_no_anomaly_beyond_the_injected_ones(final_result: OracleResult) -> None:
    injected = sorted({t for rows in CASES.values() for t in rows},
                      key=lambda t: tuple("" if v is None else str(v) for v in t))
    assert brief(final_result.anomalies) == injected
    assert len(final_result.anomalies) == 29


def test_every_code_of_every_stage_is_covered_by_a_case() -> None:
    from audit.core.vocabulary import ANOMALY_CODES
    from tests.reconcile_cases import build_mirror_cases, build_share_cases

    mirror_cases = build_mirror_cases()[1]  # tests/test_mirror.py
    share_codes = {row[1] for rows in build_share_cases()[1].values() for row in rows}  # tests/test_share.py
    assert set(ANOMALY_CODES) - set(CASES) - set(mirror_cases) - share_codes == {"pending"}  # pending: see the grace tests below


def test_report_rows_of_clean_lost_duplicate_and_missing_partitions(final_result: OracleResult) -> None:
    rows = {(r["stage"], r["partition"]): r for r in final_result.report}
    lat: dict[str, object] = {"latency_p50_ms": 5.0, "latency_p95_ms": 5.0, "latency_p99_ms": 5.0, "latency_max_ms": 5.0}
    assert rows[("log", 0)] == report_row("log", 0, expected=3, delivered=3, **lat)
    assert rows[(G, 0)] == report_row(G, 0, expected=3, delivered=3, latency_p50_ms=1000.0, latency_p95_ms=1000.0,
                                      latency_p99_ms=1000.0, latency_max_ms=1000.0)
    assert rows[(S, 0)] == report_row(S, 0, expected=3, delivered=3, latency_p50_ms=2000.0,
                                      latency_p95_ms=2000.0, latency_p99_ms=2000.0, latency_max_ms=2000.0)
    assert rows[("log", 1)] == report_row("log", 1, expected=2, delivered=1, lost=1, lost_acked=1, **lat)
    assert rows[("log", 4)] == report_row("log", 4, expected=1, delivered=1, duplicated=1, duplicate_in_log=1, **lat)
    # both copies are records the group had to process: one at +1 s, the extra one at +6 s
    assert rows[(G, 4)] == report_row(G, 4, expected=2, delivered=2, latency_p50_ms=3500.0, latency_p95_ms=5750.0,
                                      latency_p99_ms=5950.0, latency_max_ms=6000.0)
    assert rows[(S, 17)] == report_row(S, 17, expected=1, lost=1, missing_in_sink=1)
    assert rows[(G, 11)]["lost"] == 1 and rows[(G, 11)]["missed"] == 1
    assert rows[(G, 13)]["duplicated"] == 1 and rows[(G, 14)]["reordered"] == 1
    assert rows[("log", 5)]["reordered"] == 2 and rows[(S, 18)]["duplicated"] == 1
    # seq gaps and failed sends without a partition get their own row; a failed send is not expected
    assert rows[("log", -1)] == report_row("log", -1, seq_gap=2, failed_send=3)
    # a sink row from a sink g1 feeds counts as g1's processing (no consumption row, no latency)
    assert rows[(G, 20)] == report_row(G, 20, expected=2, delivered=2)
    assert rows[(S, 20)] == report_row(S, 20)
    # only failed outcomes, past grace: not lost (not `missed`), not delivered
    assert rows[(G, 21)] == report_row(G, 21, expected=1, retry_overdue=1)
    # one row per stage for each of the 22 captured partitions, plus the seq_gap row
    assert len(final_result.report) == 3 * 22 + 1


def test_detail_and_identity_columns_of_anomaly_rows(final_result: OracleResult) -> None:
    by = {(a["anomaly"], a["pid"]): a for a in final_result.anomalies}
    assert by[("redelivered", "redel")]["detail"] == "processing 2 of 2 by c2"
    assert by[("content_duplicate", "cd")]["detail"] == "same content as cd:0"
    assert by[("duplicate_in_sink", "dsk")]["detail"] == "copy 2 of 2"
    assert by[("unaudited", "bad")]["detail"] == "audit.seq: not an integer"
    assert by[("missed", "miss")]["detail"] == "never processed, below committed offset 2"
    assert by[("retry_overdue", "retry")]["detail"] == \
        "only failed outcomes, past grace; last: attempt 2 by c2: KeyError: 'price'"
    assert [a["detail"] for a in final_result.anomalies if a["anomaly"] == "failed_send"] == [
        "ledger says failed, no copy in the log"] * 3
    assert {a["run_id"] for a in final_result.anomalies} == {run_id_for("t", T0, AS_OF_FINAL)}
    assert {a["computed_at"] for a in final_result.anomalies} == {AS_OF_FINAL}


def _grace_history() -> History:
    """Two messages at 10:50: one never processed, one processed but not yet in the sink."""
    h = History()
    h.captured(0, 0, 100, at(55), group_committed=0)
    h.produce("p", 0, 0, 0, at(50))
    h.record("p", 0, 0, 0, at(50))
    h.produce("p", 1, 0, 1, at(50))
    h.record("p", 1, 0, 1, at(50))
    h.consume("p", 1, 0, 1, at(51))
    return h


@pytest.mark.parametrize(("as_of_min", "expected", "status"), [
    (64.99, [(G, "pending", 0, "p", 0, 0), (S, "pending", 0, "p", 1, 1)], "provisional"),
    (65, [(G, "overdue", 0, "p", 0, 0), (S, "missing_in_sink", 0, "p", 1, 1)], "provisional"),
    (74.99, [(G, "overdue", 0, "p", 0, 0), (S, "missing_in_sink", 0, "p", 1, 1)], "provisional"),
    (75, [(G, "overdue", 0, "p", 0, 0), (S, "missing_in_sink", 0, "p", 1, 1)], "final"),
])
def test_pending_until_produce_time_plus_grace_and_final_after_window_end_plus_grace(
        as_of_min: float, expected: list[tuple[object, ...]], status: str) -> None:
    as_of = at(as_of_min)
    r = reconcile_window(topic_config(), T0, as_of, _grace_history().inputs())
    assert brief(r.anomalies) == expected
    assert {row["status"] for row in r.report} == {status}
    group_row = next(row for row in r.report if row["stage"] == G)
    assert group_row["pending"] == (1 if as_of_min < 65 else 0)
    assert group_row["overdue"] == (0 if as_of_min < 65 else 1)


@pytest.mark.parametrize(("as_of_min", "expected"), [
    (64.99, []),  # within grace a retry of the producer's own may still land: nothing yet
    (65, [("log", "failed_send", -1, "f", 0, None)]),
])
def test_a_failed_send_without_a_copy_is_reported_after_grace_and_one_with_a_copy_is_a_ghost_write(
        as_of_min: float, expected: list[tuple[object, ...]]) -> None:
    h = History()
    h.captured(0, 0, 100, at(55))
    h.produce("f", 0, -1, None, at(50), status="failed")
    h.produce("g", 0, -1, None, at(50), status="failed")
    h.record("g", 0, 0, 0, at(50))
    h.produce("g", 1, 0, 1, at(50))  # failed then acked (a retry of the same message): acked wins
    h.produce("g", 1, -1, None, at(50), status="failed")
    h.record("g", 1, 0, 1, at(50))
    r = reconcile_window(topic_config(groups=(), sinks=()), T0, at(as_of_min), h.inputs())
    assert brief(r.anomalies) == [*expected, ("log", "ghost_write", 0, "g", 0, 0)]
    rows = {(row["stage"], row["partition"]): row for row in r.report}
    assert (rows[("log", 0)]["expected"], rows[("log", 0)]["delivered"], rows[("log", 0)]["failed_send"]) == (1, 1, 0)
    assert rows.get(("log", -1), {}).get("failed_send", 0) == len(expected)


def retry_history() -> History:
    """A record at 10:50 whose handler failed (attempt 1, c1); g1 committed past it (offset 5)."""
    h = History()
    h.captured(0, 0, 100, at(55), group_committed=5)
    h.produce("r", 0, 0, 0, at(50))
    h.record("r", 0, 0, 0, at(50))
    h.consume("r", 0, 0, 0, at(50.5), outcome="failed")
    return h


@pytest.mark.parametrize(("as_of_min", "code", "pending"), [(64.99, "pending", 1), (65, "retry_overdue", 0)])
def test_only_failed_outcomes_are_pending_in_grace_then_retry_overdue_never_missed(
        as_of_min: float, code: str, pending: int) -> None:
    r = reconcile_window(topic_config(), T0, at(as_of_min), retry_history().inputs())
    assert brief(r.anomalies) == [(G, code, 0, "r", 0, 0)]
    row = next(row for row in r.report if row["stage"] == G)
    assert (row["expected"], row["delivered"], row["lost"], row["pending"], row["missed"], row["retry_overdue"]) \
        == (1, 0, 0, pending, 0, 1 - pending)


def test_lost_acked_waits_for_grace_and_counts_as_pending_in_the_log_row() -> None:
    h = History()
    h.captured(0, 0, 10, at(55))
    h.produce("p", 0, 0, 3, at(50))
    early = reconcile_window(topic_config(groups=(), sinks=()), T0, at(60), h.inputs())
    assert early.anomalies == []
    assert early.report == [report_row("log", 0, at(60), expected=1, pending=1, latency_p50_ms=5.0,
                                       latency_p95_ms=5.0, latency_p99_ms=5.0, latency_max_ms=5.0)]
    late = reconcile_window(topic_config(groups=(), sinks=()), T0, at(80), h.inputs())
    assert brief(late.anomalies) == [("log", "lost_acked", 0, "p", 0, 3)]


def test_acked_offset_no_capture_reached_yet_stays_pending() -> None:
    h = History()
    h.captured(0, 0, 3, at(55))  # high watermark 3: offset 3 not covered
    h.produce("p", 0, 0, 3, at(50))
    r = reconcile_window(topic_config(groups=(), sinks=()), T0, at(200), h.inputs())
    assert r.anomalies == []
    assert r.report[0]["pending"] == 1 and r.report[0]["lost"] == 0


def test_messages_outside_the_window_are_context_only() -> None:
    h = History()
    h.captured(0, 0, 100, at(70), group_committed=100)
    h.clean("p", 0, 0, 0, at(-30))  # previous window: context for order and gaps
    h.clean("p", 2, 0, 1, at(-20))
    h.clean("p", 3, 0, 2, at(10))   # reveals nothing new: seq 1's gap belongs to the previous window
    h.clean("p", 5, 0, 3, at(70))   # next window, within grace: context for the order check only
    h.clean("p", 6, 0, 4, at(80))   # past grace: not read at all
    r = reconcile_window(topic_config(), T0, AS_OF_FINAL, h.inputs())
    assert r.anomalies == []
    assert [(row["stage"], row["expected"]) for row in r.report] == [("log", 1), (G, 1), (S, 1)]


def test_gap_belongs_to_the_window_of_the_seq_that_reveals_it() -> None:
    h = History()
    h.captured(0, 0, 100, at(70), group_committed=100)
    h.clean("p", 0, 0, 0, at(-30))
    h.clean("p", 3, 0, 1, at(10))
    r = reconcile_window(topic_config(), T0, AS_OF_FINAL, h.inputs())
    assert brief(r.anomalies) == [("log", "seq_gap", -1, "p", 1, None), ("log", "seq_gap", -1, "p", 2, None)]


def test_a_huge_gap_is_one_row_that_says_how_many() -> None:
    h = History()
    h.captured(0, 0, 100, at(70), group_committed=100)
    h.clean("p", 0, 0, 0, at(5))
    h.clean("p", 5000, 0, 1, at(6))
    r = reconcile_window(topic_config(), T0, AS_OF_FINAL, h.inputs())
    assert [(a["anomaly"], a["seq"], a["detail"]) for a in r.anomalies] == [
        ("seq_gap", 1, "4999 seqs missing (1..4999)")]


def test_malformed_ledger_rows_are_quarantined_and_counted() -> None:
    h = History()
    h.captured(0, 0, 100, at(70), group_committed=100)
    h.clean("p", 0, 0, 0, at(5))
    h.ledger.append(LedgerRow("p", 1, 0, 1, "weird", at(6)))
    h.ledger.append(LedgerRow("p", 2, 0, None, "acked", at(7)))  # acked without an offset
    h.clean("p", 3, 0, 1, at(8))
    r = reconcile_window(topic_config(), T0, AS_OF_FINAL, h.inputs())
    assert r.quarantined_ledger_rows == 2
    # the quarantined rows are counted, and their messages are not silently fine: they are a gap
    assert brief(r.anomalies) == [("log", "seq_gap", -1, "p", 1, None), ("log", "seq_gap", -1, "p", 2, None)]


def test_sink_without_a_group_is_judged_against_the_committed_log() -> None:
    h = History()
    h.captured(0, 0, 100, at(70))
    h.produce("p", 0, 0, 0, at(5))
    h.record("p", 0, 0, 0, at(5))
    r = reconcile_window(topic_config(groups=(), sinks=((SINK, None),)), T0, AS_OF_FINAL, h.inputs())
    assert brief(r.anomalies) == [(S, "missing_in_sink", 0, "p", 0, 0)]


def test_empty_window_reports_zero_rows_for_captured_partitions() -> None:
    h = History()
    h.captured(0, 0, 0, at(70), group_committed=0)
    h.captured(1, 0, 0, at(70), group_committed=0)
    r = reconcile_window(topic_config(), T0, AS_OF_FINAL, h.inputs())
    assert r.anomalies == []
    assert r.report == [report_row(st, p) for st in ("log", G, S) for p in (0, 1)]


def test_spark_percentile_interpolates_like_spark() -> None:
    assert spark_percentile([1000.0, 6000.0], 0.5) == 3500.0
    assert spark_percentile([1000.0, 6000.0], 0.95) == 5750.0
    assert spark_percentile([7.0], 0.99) == 7.0
    assert spark_percentile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.5


def test_run_id_is_stable_and_depends_on_window_topic_and_as_of() -> None:
    a = run_id_for("t", T0, AS_OF_FINAL)
    assert a == run_id_for("t", T0, AS_OF_FINAL)
    assert len({a, run_id_for("u", T0, AS_OF_FINAL), run_id_for("t", T0 + timedelta(hours=1), AS_OF_FINAL),
                run_id_for("t", T0, AS_OF_FINAL + timedelta(seconds=1))}) == 4


def test_groups_not_in_the_config_are_ignored() -> None:
    h = History()
    h.captured(0, 0, 100, at(70), group_committed=100)
    h.clean("p", 0, 0, 0, at(5))
    h.consume("p", 0, 0, 0, at(6), group="other")
    r = reconcile_window(topic_config(groups=(GROUP,)), T0, AS_OF_FINAL, h.inputs())
    assert r.anomalies == []


def test_the_checks_that_need_neighbours_on_narrow_rows() -> None:
    """The four checks that read one narrow row per message (or per processing), on hand-written rows:
    what a classifier settling most messages from summaries must hand them, and what they find."""
    from audit.oracle import (
        ConsumedRow,
        Narrow,
        content_duplicates,
        reordered_in_consumption,
        reordered_in_log,
        seq_gaps,
    )

    def n(pid: str, seq: int, part: int | None = 0, off: int | None = None, fp: str | None = None,
          minute: int = 1, in_window: bool = True, present: bool = True) -> Narrow:
        return Narrow(pid, seq, present, part, seq if off is None and part is not None else off, fp,
                      T0 + timedelta(minutes=minute), in_window)

    # log order per (partition, pid): p:2 lands behind p:3; an extra partition keeps its own order;
    # a message out of the window raises the maximum but is not flagged itself
    rows = [n("p", 1), n("p", 3, off=2), n("p", 2, off=3), n("p", 0, off=4, in_window=False), n("p", 1, part=1, off=9),
            n("q", 5, off=5), n("q", 4, off=6), n("r", 0, part=None)]
    assert [(x.pid, x.seq, x.offset, high) for x, high in reordered_in_log(rows)] == [("p", 2, 3, 3), ("q", 4, 6, 5)]

    # gaps per pid between present seqs, revealed by a seq in the window; absent seqs do not count
    rows = [n("p", 0), n("p", 3), n("p", 4, present=False), n("p", 7), n("q", 1, in_window=False), n("q", 5, in_window=False),
            n("q", 9)]
    assert list(seq_gaps(rows)) == [("p", 0, 3), ("p", 3, 7), ("q", 5, 9)]

    # content: the first in (produce time, pid, seq) is the original message; only the window's are flagged
    rows = [n("b", 1, fp="x", minute=2), n("a", 1, fp="x", minute=2), n("c", 1, fp="x", minute=1, in_window=False),
            n("d", 1, fp="y"), n("e", 1, fp="y", part=None), n("f", 1, fp=None), n("g", 1, fp=None)]
    assert [(x.pid, first.pid) for x, first in content_duplicates(rows)] == [("a", "c"), ("b", "c")]

    # consumption order per (group, partition): a first processing below the highest before it; the
    # redelivery of an offset already seen is not a reordering; ties broken by consume_seq, then consumer
    def c(group: str, part: int, off: int, second: int, cseq: int = 0, consumer: str = "c1") -> ConsumedRow:
        return ConsumedRow(group, consumer, cseq, part, off, "p", off, "processed", T0 + timedelta(seconds=second))

    procs = [c("g", 0, 5, 1), c("g", 0, 3, 2), c("g", 0, 5, 3), c("g", 0, 4, 3, cseq=1), c("g", 0, 3, 4),
             c("g", 1, 2, 1), c("g", 1, 1, 1, consumer="c2"), c("h", 0, 3, 5), c("h", 0, 5, 6)]
    assert [(x.group, x.partition, x.offset) for x in reordered_in_consumption(procs)] == [
        ("g", 0, 3), ("g", 0, 4), ("g", 1, 1)]


def test_a_connect_sinks_dead_letter_records_account_for_their_messages() -> None:
    """A sink fed by the committed log (a Kafka Connect sink audited by coordinates): of three
    messages, one was written, one went to the connector's dead-letter topic (`dead_lettered` at
    the sink stage, counted as neither delivered nor lost), one was dropped without a trace
    (errors.tolerance=all and no DLQ: `missing_in_sink`). A DLQ record naming a position the log
    never held is one quarantined row, never `unexpected_in_sink`; before grace the dead-lettered
    message is already accounted for (not pending)."""
    h = History()
    h.captured(0, 0, 100, at(70))
    for i in range(3):
        h.produce("k", i, 0, i, at(5 + i))
        h.record("k", i, 0, i, at(5 + i))
    h.sink("k", 0, 0, 0, at(6))
    h.sink("k", 1, 0, 1, at(7), dead_letter=True)
    h.sink(None, None, 0, 42, at(8), dead_letter=True)  # the log never held offset 42
    tc = topic_config(groups=(), sinks=((SINK, None),))
    r = reconcile_window(tc, T0, AS_OF_FINAL, h.inputs())
    assert brief(a for a in r.anomalies if a["stage"] == S) == [(S, "dead_lettered", 0, "k", 1, 1),
                                                                (S, "missing_in_sink", 0, "k", 2, 2)]
    row = next(x for x in r.report if x["stage"] == S and x["partition"] == 0)
    assert (row["expected"], row["delivered"], row["lost"], row["pending"], row["dead_lettered"],
            row["missing_in_sink"], row["unexpected_in_sink"]) == (3, 1, 1, 0, 1, 1, 0)
    assert r.quarantined_ledger_rows == 1
    early = reconcile_window(tc, T0, at(9), h.inputs())
    assert brief(a for a in early.anomalies if a["stage"] == S) == [(S, "dead_lettered", 0, "k", 1, 1),
                                                                    (S, "pending", 0, "k", 2, 2)]


def test_the_dead_letter_hand_case_gives_its_exact_rows() -> None:
    """tests/reconcile_cases.py `build_dead_letter_case`: a sink fed by g1 with a dead-letter topic."""
    from tests.reconcile_cases import build_dead_letter_case

    h, expected = build_dead_letter_case()
    r = reconcile_window(topic_config(), T0, AS_OF_FINAL, h.inputs())
    assert brief(r.anomalies) == expected
    rows = {(x["stage"], x["partition"]): x for x in r.report}
    # accounted for at the sink (not delivered, not lost); the sibling written on a retry is delivered
    assert rows[(S, 0)] == report_row(S, 0, expected=2, delivered=1, dead_lettered=1, latency_p50_ms=2000.0,
                                      latency_p95_ms=2000.0, latency_p99_ms=2000.0, latency_max_ms=2000.0)
    assert rows[(G, 0)]["dead_lettered"] == 0 and rows[(G, 0)]["delivered"] == 2
    assert r.quarantined_ledger_rows == 1
