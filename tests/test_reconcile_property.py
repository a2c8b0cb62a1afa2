"""Property: on generated histories with injected faults at every tier, the Spark reconciliation
equals the pure-Python oracle row for row (report and anomalies).

Each Spark example is one Spark run (seconds, mostly fixed cost), so it checks several independent
histories at once: `batches` puts up to BATCH of them side by side in one window, each on its
own partitions, pids and fingerprints, so they cannot interact and one run checks them all.

By default the Spark property runs SPARK_EXAMPLES runs (a couple of minutes on two cores) and the
oracle-only property UNIT_EXAMPLES histories. For a long search use the `soak` profile registered
in tests/conftest.py (`pytest --hypothesis-profile=soak tests/test_reconcile_property.py`), or set
MSGAUDIT_PROPERTY_EXAMPLES=N to choose the Spark run count.
"""

from __future__ import annotations

import os
from dataclasses import replace
from datetime import datetime, timedelta
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from audit.core.config import ShareGroupConfig
from audit.oracle import (
    ConsumedRow,
    GroupOffset,
    Inputs,
    LedgerRow,
    LogRecord,
    ShareOffset,
    SinkRow,
    Watermark,
    reconcile_window,
)
from tests.reconcile_cases import T0, norm_rows, sorted_anomalies, spark_classify, topic_config

TC = topic_config(groups=("g1",), sinks=(("s1", "g1"), ("s2", None)))
# the same topic with share group q1 (delivery limit 3) declared: the histories' q1 rows are judged
# (without it they are another topic's group's rows, never read)
TC_SHARE = replace(TC, share_groups=(ShareGroupConfig("q1", 3),))
BATCH = 6
SPARK_EXAMPLES, UNIT_EXAMPLES = 6, 300
SOAK_SPARK_EXAMPLES, SOAK_UNIT_EXAMPLES = 300, 20_000


def _soak() -> bool:
    """Whether the `soak` hypothesis profile (tests/conftest.py) is the loaded one."""
    try:
        soak = settings.get_profile("soak")
    except Exception:  # the profile is registered by tests/conftest.py
        return False
    current = settings.default
    return current is not None and current.max_examples == soak.max_examples


def _examples(default: int, soak: int) -> int:
    if _soak():
        return soak
    return default
FATES = ["ok"] * 6 + ["skip", "failed", "ghost", "aborted", "aborted_read", "noledger", "lost", "dup",
                      "badheader", "abort_acked"]  # abort_acked: ledgered acked by a client blind to the abort


def _at(seconds: int) -> datetime:
    return T0 + timedelta(seconds=seconds)


@st.composite
def histories(draw: st.DrawFn) -> tuple[Inputs, datetime]:
    ledger: list[LedgerRow] = []
    records: list[dict[str, Any]] = []
    next_off = [0, 0]
    for pid in ("a", "b", "c")[: draw(st.integers(1, 3))]:
        t = draw(st.sampled_from([-3000, -600, 300, 2400, 3300]))
        for seq in range(draw(st.integers(0, 7))):
            t += draw(st.integers(0, 900))
            fate = draw(st.sampled_from(FATES))
            p = draw(st.integers(0, 1))
            fp = draw(st.sampled_from([None, None, None, "X", "Y"])) or f"{pid}-{seq}"
            if fate == "skip":
                continue
            copies = {"dup": 2, "lost": 0, "failed": 0}.get(fate, 1)
            offs = []
            for _ in range(copies):
                offs.append(next_off[p])
                next_off[p] += 1
            offs_ack: int | None
            if fate == "lost":
                next_off[p] += 1
                offs_ack = next_off[p] - 1
            else:
                offs_ack = offs[0] if offs else None
            status = {"failed": "failed", "ghost": "failed", "aborted": "aborted", "aborted_read": "aborted"}.get(
                fate, "acked")
            if fate != "noledger":
                # a failed send's fingerprint, where its client records it: perhaps that of another
                # message's original, produced before or after it (a resend)
                sent_fp = draw(st.sampled_from([None, "X", "Y", f"{pid}-{seq}"])) if status == "failed" else None
                ledger.append(LedgerRow(pid, seq, p if status == "acked" else -1,
                                        offs_ack if status == "acked" else None, status, _at(t),
                                        _at(t) + timedelta(milliseconds=draw(st.integers(1, 50)))
                                        if status == "acked" else None, fingerprint=sent_fp))
            for off in offs:
                records.append({"p": p, "off": off, "pid": pid, "seq": seq, "t": t, "fp": fp,
                                "committed": fate not in ("aborted", "aborted_read", "abort_acked"),
                                "bad": fate == "badheader"})
    # a few swaps of offsets inside a partition: reordering in the log
    for _ in range(draw(st.integers(0, 2))):
        if len(records) >= 2:
            i, j = draw(st.integers(0, len(records) - 1)), draw(st.integers(0, len(records) - 1))
            if records[i]["p"] == records[j]["p"]:
                records[i]["off"], records[j]["off"] = records[j]["off"], records[i]["off"]
                ledger = [_swap_ack(lr, records[i], records[j]) for lr in ledger]
    log: list[LogRecord] = []
    consumed: list[ConsumedRow] = []
    sinks: dict[str, list[SinkRow]] = {"s1": [], "s2": []}
    cseq = 0
    for r in records:
        rseq: int | None = None if r["bad"] else r["seq"]
        log.append(LogRecord(r["p"], r["off"], r["pid"], rseq, None if r["bad"] else _at(r["t"]),
                             _at(r["t"] + 1), _at(r["t"] + 60), r["fp"], r["committed"],
                             "audit.seq: not an integer" if r["bad"] else None))
        cpid, cseq_v = (None, None) if r["bad"] else (r["pid"], r["seq"])

        def carried(r: dict[str, Any] = r) -> Any:  # a row's optional produce time: right, absent or wrong
            kind = draw(st.sampled_from(["right", "right", "absent", "wrong"]))
            return None if r["bad"] or kind == "absent" else _at(r["t"] + (0 if kind == "right" else 1))
        for _ in range(draw(st.integers(0, 2))):
            cseq += 1
            outcome = draw(st.sampled_from(["processed", "processed", "processed", "failed", "dead_lettered",
                                            "handed"]))
            delay = draw(st.sampled_from([2, 30, 1200, 5400]))
            consumed.append(ConsumedRow("g1", draw(st.sampled_from(["c1", "c2"])), cseq, r["p"], r["off"],
                                        cpid, cseq_v, outcome, _at(r["t"] + delay), produce_ts=carried()))
        cseq = _share_rows(draw, consumed, cseq, r, cpid, cseq_v)
        if draw(st.integers(0, 5)) == 0:  # read on a cluster no mirror of the topic is named: ignored, counted
            cseq += 1
            consumed.append(ConsumedRow("g1", "c4", cseq, r["p"], 100 + r["off"], cpid, cseq_v,
                                        draw(st.sampled_from(["processed", "committed"])),
                                        _at(r["t"] + draw(st.sampled_from([2, 5400, 9000]))),
                                        cluster=draw(st.sampled_from(["dr", "eu"]))))
        for name in ("s1", "s2"):
            for _ in range(draw(st.integers(0, 2))):
                delay = draw(st.sampled_from([5, 40, 1500, 6000]))
                sinks[name].append(SinkRow(r["p"], r["off"], cpid, cseq_v,
                                           None if draw(st.integers(0, 9)) == 0 else _at(r["t"] + delay),
                                           produce_ts=carried()))
            if draw(st.integers(0, 4)) == 0:  # the connector's dead-letter topic names this record
                sinks[name].append(SinkRow(r["p"], r["off"], cpid, cseq_v, _at(r["t"] + draw(st.sampled_from([3, 1500]))),
                                           dead_letter=True))
    if draw(st.booleans()):
        sinks["s1"].append(SinkRow(1, 99, "ghost-pid", 0, _at(draw(st.integers(0, 3599)))))
    if draw(st.integers(0, 3)) == 0:  # a dead-letter record naming a position the log never held
        sinks[draw(st.sampled_from(["s1", "s2"]))].append(
            SinkRow(0, 97, None, None, _at(draw(st.integers(0, 3599))), dead_letter=True))
    watermarks = []
    offsets = []
    starts = []  # share group q1's start offsets: a record below the latest that q1 never acquired is missed
    for p in (0, 1):
        for _ in range(draw(st.integers(0, 2))):
            lso = draw(st.integers(0, 2))
            watermarks.append(Watermark(p, lso, max(lso, next_off[p] + draw(st.integers(-2, 1))),
                                        _at(draw(st.integers(3600, 4500)))))
        if draw(st.integers(0, 3)) == 0:  # the consumer interceptor's word on g's committed offset
            cseq += 1
            consumed.append(ConsumedRow("g1", "c3", cseq, p, draw(st.integers(0, next_off[p] + 1)), None, None,
                                        "committed", _at(draw(st.integers(0, 4500)))))
        if draw(st.booleans()):
            offsets.append(GroupOffset("g1", p, draw(st.one_of(st.none(), st.integers(0, next_off[p] + 1))),
                                       _at(draw(st.integers(3600, 4500)))))
        for _ in range(draw(st.integers(0, 2))):
            starts.append(ShareOffset("q1", p, draw(st.one_of(st.none(), st.integers(0, next_off[p] + 1))),
                                      _at(draw(st.integers(3600, 4500)))))
    as_of = _at(draw(st.sampled_from([2400, 3840, 3900, 4500, 4800, 20000])))
    return Inputs(ledger, log, consumed, offsets, watermarks, sinks, share_offsets=starts), as_of


SHARE_ACKS = ["accepted", "accepted", "released", "rejected", None]  # None: no acknowledgement (lock expiry)


def _share_rows(draw: st.DrawFn, consumed: list[ConsumedRow], cseq: int, r: dict[str, Any], pid: str | None,
                seq: int | None) -> int:
    """Share group q1's deliveries of record `r` (0-3: acquisition, then an acknowledgement the
    broker took or refused, or none), now and then a row of an outcome no member writes, and now and
    then a record of q1's dead-letter topic naming `r`."""
    t = r["t"]
    for k in range(1, draw(st.integers(0, 3)) + 1):
        member = draw(st.sampled_from(["m1", "m2"]))
        t += draw(st.sampled_from([1, 20, 1000, 5000]))
        cseq += 1
        consumed.append(ConsumedRow("q1", member, cseq, r["p"], r["off"], pid, seq, "acquired", _at(t), k))
        ack = draw(st.sampled_from(SHARE_ACKS))
        if ack is not None:
            t += draw(st.sampled_from([1, 40]))
            cseq += 1
            refused = draw(st.integers(0, 4)) == 0
            consumed.append(ConsumedRow("q1", member, cseq, r["p"], r["off"], pid, seq, ack, _at(t), k,
                                        error="INVALID_RECORD_STATE" if refused else None))
    if draw(st.integers(0, 9)) == 0:
        cseq += 1
        consumed.append(ConsumedRow("q1", "m3", cseq, r["p"], r["off"], pid, seq, "renewed", _at(t + 3)))
    if draw(st.integers(0, 5)) == 0:  # a record of q1's dead-letter topic naming it (KIP-1191)
        cseq += 1
        consumed.append(ConsumedRow("q1", "dlq.q1", cseq, r["p"], r["off"], pid, seq, "dead_lettered", _at(t + 5),
                                    draw(st.integers(1, 3)), error=draw(st.sampled_from(
                                        ["Offset rejected by client.", None]))))
    return cseq


def _merge(parts: list[tuple[Inputs, datetime]]) -> tuple[Inputs, datetime]:
    """Histories side by side in one window: history i on partitions 2i and 2i + 1, its pids and
    fingerprints prefixed by `h<i>-`; as of the first one's as_of."""
    out = Inputs([], [], [], [], [], {"s1": [], "s2": []})
    for i, (h, _) in enumerate(parts):
        def pid(v: str | None, i: int = i) -> str | None:
            return None if v is None else f"h{i}-{v}"

        def part(p: int, i: int = i) -> int:
            return p if p < 0 else 2 * i + p

        out.ledger = [*out.ledger, *(replace(r, pid=f"h{i}-{r.pid}", partition=part(r.partition),
                                             fingerprint=pid(r.fingerprint)) for r in h.ledger)]
        out.log = [*out.log, *(replace(r, partition=part(r.partition), pid=pid(r.pid), fingerprint=pid(r.fingerprint))
                               for r in h.log)]
        out.consumed = [*out.consumed, *(replace(c, partition=part(c.partition), pid=pid(c.pid)) for c in h.consumed)]
        out.group_offsets = [*out.group_offsets, *(replace(g, partition=part(g.partition)) for g in h.group_offsets)]
        out.watermarks = [*out.watermarks, *(replace(w, partition=part(w.partition)) for w in h.watermarks)]
        out.share_offsets = [*out.share_offsets, *(replace(so, partition=part(so.partition)) for so in h.share_offsets)]
        out.sinks = {name: [*rows, *(replace(r, partition=None if r.partition is None else part(r.partition),
                                             pid=pid(r.pid)) for r in h.sinks.get(name, ()))]
                     for name, rows in out.sinks.items()}
    return out, parts[0][1]


def batches() -> st.SearchStrategy[tuple[Inputs, datetime]]:
    """1..BATCH independent histories in one window (see the module docstring)."""
    return st.lists(histories(), min_size=1, max_size=BATCH).map(_merge)


def _swap_ack(lr: LedgerRow, a: dict[str, Any], b: dict[str, Any]) -> LedgerRow:
    if lr.status != "acked":
        return lr
    if (lr.pid, lr.seq, lr.partition, lr.offset) == (a["pid"], a["seq"], a["p"], b["off"]):
        return replace(lr, offset=a["off"])
    if (lr.pid, lr.seq, lr.partition, lr.offset) == (b["pid"], b["seq"], b["p"], a["off"]):
        return replace(lr, offset=b["off"])
    return lr


@pytest.mark.spark
@settings(max_examples=int(os.environ.get("MSGAUDIT_PROPERTY_EXAMPLES", 0))
          or _examples(SPARK_EXAMPLES, SOAK_SPARK_EXAMPLES), deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                 HealthCheck.function_scoped_fixture])
@given(batches(), st.sampled_from([TC, TC_SHARE]))
def test_spark_equals_the_oracle_row_for_row(spark: Any, history: tuple[Inputs, datetime], tc: Any) -> None:
    inputs, as_of = history
    oracle = reconcile_window(tc, T0, as_of, inputs)
    report, anomalies, quarantined, ignored = spark_classify(spark, tc, T0, as_of, inputs)
    assert anomalies == sorted_anomalies(oracle.anomalies)
    assert report == norm_rows(oracle.report)
    assert quarantined == oracle.quarantined_ledger_rows
    assert ignored == oracle.ignored_mirror_rows


@pytest.mark.unit
@settings(max_examples=_examples(UNIT_EXAMPLES, SOAK_UNIT_EXAMPLES), deadline=None)
@given(histories())
def test_generated_histories_exercise_the_rules(history: tuple[Inputs, datetime]) -> None:
    """The oracle never crashes on generated input, and its counts add up."""
    inputs, as_of = history
    r = reconcile_window(TC_SHARE, T0, as_of, inputs)
    for row in r.report:
        assert 0 <= row["delivered"] <= row["expected"]
        assert row["lost"] + row["pending"] <= row["expected"] or row["stage"] != "log"
    assert len({a["run_id"] for a in r.anomalies}) <= 1
    assert sum(r.ignored_mirror_rows.values()) <= sum(c.cluster is not None for c in inputs.consumed)
    if r.ignored_mirror_rows:
        event("ignored_mirror_rows")
    for code in sorted({a["anomaly"] for a in r.anomalies}):
        event(code)  # `pytest --hypothesis-show-statistics` shows how often each code was generated


@pytest.mark.unit
@settings(max_examples=_examples(UNIT_EXAMPLES, SOAK_UNIT_EXAMPLES), deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(batches(), st.integers(min_value=1, max_value=4))
def test_the_kernel_equals_the_oracle_row_for_row_whole_and_in_chunks(history: tuple[Inputs, datetime],
                                                                      n: int) -> None:
    """The kernel (`audit/rules/kernel.py`: ordinary messages settled on Arrow columns, the rest by the
    oracle; `neighbours.py`: the checks that need neighbours, vectorised) gives the oracle's report and
    anomaly rows on a whole window, and on the window split by message into `n` chunks as the Spark
    tasks split it (the order of consumption flagged over the whole window first); and so with the
    strings dictionary encoded as the tasks read them from files."""
    from audit.rules import kernel
    from tests.reconcile_cases import arrow_tables, classify_in_chunks

    inputs, as_of = history
    for tc in (TC, TC_SHARE):  # without a share group (the columnar path) and with one
        want = reconcile_window(tc, T0, as_of, inputs)
        whole = kernel.classify(tc, T0, as_of, arrow_tables(inputs))
        chunked = classify_in_chunks([tc], T0, as_of, arrow_tables(inputs), n)[tc.name]
        coded = classify_in_chunks([tc], T0, as_of, arrow_tables(inputs, coded=True), n)[tc.name]
        for got in (whole, chunked, coded):
            assert sorted_anomalies(got.anomalies) == sorted_anomalies(want.anomalies)
            assert norm_rows(got.report) == norm_rows(want.report)
            assert got.quarantined_ledger_rows == want.quarantined_ledger_rows
            assert got.ignored_mirror_rows == want.ignored_mirror_rows


@pytest.mark.unit
def test_the_kernel_on_the_hand_written_cases() -> None:
    """Every hand-written case of tests/reconcile_cases.py (one per code, mirrors, failovers and
    share groups included), before and after grace, whole and in chunks: the kernel gives the oracle's rows."""
    from audit.rules import kernel
    from tests.reconcile_cases import (
        AS_OF_FINAL,
        GROUP,
        TOPIC,
        arrow_tables,
        build_cases,
        build_dead_letter_case,
        build_mirror_cases,
        build_share_cases,
        classify_in_chunks,
        mirror_topic_config,
        share_topic_config,
    )

    history, _ = build_cases()
    inputs = history.inputs()
    mirrored, _ = build_mirror_cases()
    dead_letters, _ = build_dead_letter_case()
    shared, _ = build_share_cases()
    for tc, ins in ((topic_config(), inputs), (mirror_topic_config(), mirrored.inputs()),
                    (topic_config(), dead_letters.inputs()), (share_topic_config(), shared.inputs())):
        for as_of in (T0 + timedelta(minutes=61), AS_OF_FINAL):
            want = reconcile_window(tc, T0, as_of, ins)
            assert want.anomalies
            for got in (kernel.classify(tc, T0, as_of, arrow_tables(ins)),
                        *(classify_in_chunks([tc], T0, as_of, arrow_tables(ins), n)[tc.name] for n in (2, 3, 7))):
                assert sorted_anomalies(got.anomalies) == sorted_anomalies(want.anomalies)
                assert norm_rows(got.report) == norm_rows(want.report)
                assert (got.quarantined_ledger_rows, got.ignored_mirror_rows) == (want.quarantined_ledger_rows,
                                                                                  want.ignored_mirror_rows)
    # a consumer's `committed` rows past every offset (the interceptor's word on its committed
    # offset): in every chunk, a message the group never processed is `missed`, not `overdue`
    high = max(r.offset for r in inputs.log) + 1
    commits = [ConsumedRow(GROUP, "c9", 10**6 + p, p, high, None, None, "committed", T0 + timedelta(minutes=30),
                           topic=TOPIC) for p in sorted({r.partition for r in inputs.log})]
    with_commits = replace(inputs, consumed=[*inputs.consumed, *commits])
    want = reconcile_window(topic_config(), T0, AS_OF_FINAL, with_commits)
    missed = {(a["pid"], a["seq"]) for a in want.anomalies if a["anomaly"] == "missed"}
    assert len(missed) >= 2
    for n in (2, 3, 7):
        chunked = classify_in_chunks([topic_config()], T0, AS_OF_FINAL, arrow_tables(with_commits), n)
        assert sorted_anomalies(chunked[TOPIC].anomalies) == sorted_anomalies(want.anomalies), n


@pytest.mark.unit
def test_a_group_a_share_group_and_sinks_that_saw_nothing_are_settled_on_columns_as_the_oracle_settles_them() -> None:
    """An incident: group g2, share group q1 and sinks s2 (fed by the log) and s3 (fed by g1) have
    no row of the window's 30 messages; g1 processed every one; s1, fed by g2, holds every fifth
    (g2 processed those: its consumption rows were never flushed). The messages are otherwise
    ordinary, so the kernel settles them on columns -- no message goes to the per-message oracle --
    and gives the oracle's rows: grace (as_of 11:05, grace 15 min: produced after 10:50 is pending),
    g2's log start offset on p0 (3), its committed offsets on p1 (8, captured) and p2 (5, its
    interceptor's `committed` row), q1's start offset on p1 (6)."""
    from collections import Counter

    from audit.rules import kernel
    from tests.reconcile_cases import History, arrow_tables, at, classify_in_chunks

    tc = replace(topic_config(groups=("g1", "g2"), sinks=(("s1", "g2"), ("s2", None), ("s3", "g1"))),
                 share_groups=(ShareGroupConfig("q1", 3),))
    h = History()
    for i in range(30):  # message i: partition i % 3, offset i // 3, produced at 10:00 + 2i min
        p, off, t = i % 3, i // 3, at(2 * i)
        h.produce("a", i, p, off, t)
        h.record("a", i, p, off, t)
        h.consume("a", i, p, off, t + timedelta(seconds=1), group="g1")
        if i % 5 == 0:
            h.sink("a", i, p, off, t + timedelta(seconds=2), name="s1")
    h.consume(None, None, 2, 5, at(30), outcome="committed", group="g2", consumer="c9")
    h.captured(0, 3, 10, at(61))
    h.captured(1, 0, 10, at(61), group_committed=8, group="g2")
    h.captured(2, 0, 10, at(61))
    h.share_offsets.append(ShareOffset("q1", 1, 6, at(61)))
    as_of = at(65)
    inputs = h.inputs()
    want = reconcile_window(tc, T0, as_of, inputs)
    assert Counter((a["stage"], a["anomaly"]) for a in want.anomalies) == {
        ("group:g2", "pending"): 4, ("group:g2", "expired_unconsumed"): 2, ("group:g2", "missed"): 11,
        ("group:g2", "overdue"): 7,
        ("share:q1", "pending"): 4, ("share:q1", "missed"): 6, ("share:q1", "overdue"): 20,
        ("sink:s2", "pending"): 4, ("sink:s2", "missing_in_sink"): 26,
        ("sink:s3", "pending"): 4, ("sink:s3", "missing_in_sink"): 26}
    settled = kernel.settle(tc, T0, as_of, arrow_tables(inputs))
    assert (settled.facts.anomalies, settled.coded.num_rows) == ([], 114)
    for got in (kernel.classify(tc, T0, as_of, arrow_tables(inputs)),
                *(classify_in_chunks([tc], T0, as_of, arrow_tables(inputs), n)[tc.name] for n in (2, 3))):
        assert sorted_anomalies(got.anomalies) == sorted_anomalies(want.anomalies)
        assert norm_rows(got.report) == norm_rows(want.report)


@pytest.mark.unit
def test_the_kernel_takes_seqs_and_sessions_its_packed_key_cannot_hold(monkeypatch: pytest.MonkeyPatch) -> None:
    """A pid code and a seq share one int64 key while they fit; seqs beyond 2^40, negative seqs or
    more sessions than the code's bits hold (here made 2: at most 3 sessions) take a dense key of
    the (pid, seq) pairs instead: the same rows as the oracle either way."""
    from audit.rules import kernel
    from tests.reconcile_cases import arrow_tables, build_cases

    history, _ = build_cases()
    inputs = history.inputs()
    assert len({r.pid for r in inputs.ledger}) >= 4
    pid = inputs.ledger[0].pid  # every row of this session's messages moves beyond 2^40
    far = replace(inputs, ledger=[replace(r, seq=r.seq + 2**41) if r.pid == pid else r for r in inputs.ledger],
                  log=[replace(r, seq=r.seq + 2**41) if r.pid == pid and r.seq is not None else r for r in inputs.log],
                  consumed=[replace(c, seq=c.seq + 2**41) if c.pid == pid and c.seq is not None else c
                            for c in inputs.consumed],
                  sinks={k: [replace(r, seq=r.seq + 2**41) if r.pid == pid and r.seq is not None else r for r in v]
                         for k, v in inputs.sinks.items()})
    assert far.ledger != inputs.ledger
    as_of = T0 + timedelta(hours=2)
    for ins in (inputs, far):
        want = reconcile_window(topic_config(), T0, as_of, ins)
        got = kernel.classify(topic_config(), T0, as_of, arrow_tables(ins))
        assert want.anomalies and sorted_anomalies(got.anomalies) == sorted_anomalies(want.anomalies)
        assert norm_rows(got.report) == norm_rows(want.report)
    monkeypatch.setattr(kernel, "SEQ_BITS", 61)
    want = reconcile_window(topic_config(), T0, as_of, inputs)
    got = kernel.classify(topic_config(), T0, as_of, arrow_tables(inputs))
    assert sorted_anomalies(got.anomalies) == sorted_anomalies(want.anomalies)
    assert norm_rows(got.report) == norm_rows(want.report)


@pytest.mark.unit
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.one_of(st.none(), st.text(alphabet="0ab\u00e9", max_size=30)), max_size=40),
       st.sampled_from([1, 7, 1 << 18]))
def test_a_strings_hash_is_its_words_sum_whatever_the_slice_it_is_hashed_in(
        monkeypatch: pytest.MonkeyPatch, strings: list[str | None], slice_rows: int) -> None:
    """`columns.hash64` is the function its docstring states of each string alone (a null: its
    empty string's), whatever the slice of strings it is hashed with: one length or mixed, nulls
    among them, a slice cut short because its strings are long."""
    import pyarrow as pa

    from audit.rules import columns

    base = columns._HASH_BASE

    def stated(s: str | None) -> int:
        data = (s or "").encode()
        words = data + b"\0" * (-len(data) % 8)
        return (len(data) + sum(int.from_bytes(words[i:i + 8], "little") * base ** (i // 8 + 1)
                                for i in range(0, len(words), 8))) % 2**64

    arr = pa.array(strings, pa.string())
    monkeypatch.setattr(columns, "_HASH_SLICE", slice_rows)
    monkeypatch.setattr(columns, "_HASH_BYTES", 64)  # slices of strings of up to 30 bytes are cut
    assert columns.hash64(arr).tolist() == [stated(s) for s in arr.to_pylist()]


@pytest.mark.unit
@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["p", "q", "r"]), st.integers(-3, 12), st.booleans(),
                          st.one_of(st.none(), st.integers(0, 2)), st.integers(0, 9),
                          st.sampled_from([None, "x", "y"]), st.integers(0, 3), st.booleans()),
                unique_by=lambda r: (r[0], r[1]), max_size=40),
       st.sampled_from([0, 2**61]), st.lists(st.integers(-3, 12), max_size=4))
def test_the_checks_that_need_neighbours_equal_the_oracle(
        rows: list[tuple[str, int, bool, int | None, int, str | None, int, bool]], base: int, cuts: list[int]) -> None:
    """`neighbours.log_order`, `gaps` and `content` over narrow rows (two originals of a pid at one
    position among them; seqs negative, small or beyond 2^61) find what the oracle's
    `reordered_in_log`, `seq_gaps` and `content_duplicates` find on the same messages; and
    `neighbours.in_chunks` finds the same log order and gaps in the rows cut into chunks by seq at
    `cuts` (some chunks empty), as the Spark tasks see them."""
    import bisect

    import pyarrow as pa
    import pyarrow.compute as pc

    from audit.oracle import Narrow, content_duplicates, reordered_in_log, seq_gaps
    from audit.rules import neighbours
    from audit.rules.kernel import _narrow_of

    narrow = [Narrow(pid, base + seq, present, part, None if part is None else off, fp,
                     T0 + timedelta(minutes=minute), win)
              for pid, seq, present, part, off, fp, minute, win in rows]
    table = _narrow_of(narrow)
    assert sorted(neighbours.log_order(table)) == sorted(
        (n.pid, n.seq, n.partition, n.offset, high) for n, high in reordered_in_log(narrow))
    assert sorted(neighbours.gaps(table)) == sorted(seq_gaps(narrow))
    at = sorted({base + c for c in cuts})
    chunk = pa.array([bisect.bisect_right(at, n.seq) for n in narrow], pa.int64())
    reordered, gaps = neighbours.in_chunks([table.filter(pc.equal(chunk, k)) for k in range(len(at) + 1)])
    assert sorted(reordered) == sorted((n.pid, n.seq, n.partition, n.offset, high) for n, high in reordered_in_log(narrow))
    assert sorted(gaps) == sorted(seq_gaps(narrow))
    assert sorted(neighbours.content(table)) == sorted((n.pid, n.seq, n.partition, n.offset, first.pid, first.seq)
                                                       for n, first in content_duplicates(narrow))


@pytest.mark.unit
def test_only_the_chunks_whose_offsets_reach_into_another_are_looked_at_again() -> None:
    """`neighbours.crossing`: in partition 0, chunk 0 holds offset 6 above chunk 1's lowest (3), so
    both are named; chunk 2's offsets (8, 9) lie above every earlier chunk's and partition 1 is in
    order, so neither adds a chunk. In order across every cut, none is."""
    import pyarrow as pa

    from audit.oracle import Narrow
    from audit.rules import neighbours
    from audit.rules.kernel import _narrow_of

    def chunk(k: int, offsets: list[int], part: int = 0) -> pa.Table:
        return _narrow_of([Narrow("p", 10 * k + i, True, part, off, None, T0, True) for i, off in enumerate(offsets)])

    def named(*chunks: pa.Table) -> list[int]:
        return neighbours.crossing(pa.concat_tables([neighbours.alone(c, k)[0] for k, c in enumerate(chunks)]))

    assert named(chunk(0, [0, 1, 2, 6]), chunk(1, [3, 4, 5, 7]), chunk(2, [8, 9])) == [0, 1]
    assert named(chunk(0, [0, 1, 2]), pa.concat_tables([chunk(1, [3, 4]), chunk(1, [0, 1], part=1)]),
                 chunk(2, [5, 6])) == []
    assert named(chunk(0, [0, 1]), chunk(1, [2, 3]), chunk(2, [9, 4])) == []  # within one chunk: its own part
    assert named(chunk(0, [0, 5]), chunk(1, [2, 3]), chunk(2, [9, 4])) == [0, 1, 2]


@pytest.mark.unit
@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["g1", "g2"]), st.integers(0, 2), st.integers(0, 6), st.integers(0, 5),
                          st.integers(0, 3), st.sampled_from(["c1", "c2"])), max_size=40),
       st.sampled_from([0, 2**61]))
def test_the_order_of_consumption_on_columns_equals_the_oracle(
        rows: list[tuple[str, int, int, int, int, str]], base: int) -> None:
    """`neighbours.consumption_order` flags exactly the processings `oracle.reordered_in_consumption`
    flags, with offsets small and wide (`base` 2^61), ties in time, consume seq and consumer among
    them (the order is total: the offset breaks them); and flags the same with the group and consumer
    columns dictionary encoded, each piece of the column with a dictionary of its own (as the order
    of consumption's pass reads them from Parquet)."""
    import pyarrow as pa

    from audit.oracle import reordered_in_consumption
    from audit.rules import neighbours

    processings = [ConsumedRow(g, c, cseq, p, base + off, "p", 0, "processed", _at(ts))
                   for g, p, off, ts, cseq, c in rows]
    table = pa.table({"group": [r.group for r in processings], "partition": [r.partition for r in processings],
                      "consumer": [r.consumer for r in processings],
                      "consume_seq": pa.array([r.consume_seq for r in processings], pa.int64()),
                      "offset": pa.array([r.offset for r in processings], pa.int64()),
                      "consume_ts": pa.array([r.consume_ts for r in processings], pa.timestamp("us", "UTC"))})
    got = neighbours.consumption_order(table)
    want = {id(r) for r in reordered_in_consumption(processings)}
    # equal rows (same offset) may be flagged in either order: compare per (group, partition, offset)
    flagged = {(r.group, r.partition, r.offset) for r, f in zip(processings, got.tolist(), strict=True) if f}
    assert flagged == {(r.group, r.partition, r.offset) for r in processings if id(r) in want}
    assert int(got.sum()) == len(want)
    half = len(processings) // 2

    def coded(name: str) -> pa.ChunkedArray:
        col = table[name].combine_chunks()
        return pa.chunked_array([col[:half].dictionary_encode(), col[half:].dictionary_encode()])

    pieces = table.set_column(0, "group", coded("group")).set_column(2, "consumer", coded("consumer"))
    assert neighbours.consumption_order(pieces).tolist() == got.tolist()


@pytest.mark.unit
@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.sampled_from([0, 1, 7, 2**40, 2**61])), max_size=30),
       st.sampled_from([0, 4096]))
def test_the_running_maximum_per_segment_is_exact(rows: list[tuple[int, int]], few: int) -> None:
    """`columns.prev_max` (the highest value before each row of its segment, -1 first): segment by
    segment (few segments) and in one pass over offset values (many), with values too wide for that
    pass (2^61) taken segment by segment again."""
    import unittest.mock

    import numpy as np

    from audit.rules import columns

    rows = sorted(rows, key=lambda r: r[0])
    seg = np.array([r[0] for r in rows], dtype=np.int64)
    vals = np.array([r[1] for r in rows], dtype=np.int64)
    want = [max((v for s, v in rows[:i] if s == rows[i][0]), default=-1) for i in range(len(rows))]
    with unittest.mock.patch.object(columns, "_FEW_SEGMENTS", few):
        assert columns.prev_max(seg, vals).tolist() == want
