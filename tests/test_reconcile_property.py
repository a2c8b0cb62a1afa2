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

from audit.oracle import (
    ConsumedRow,
    GroupOffset,
    Inputs,
    LedgerRow,
    LogRecord,
    SinkRow,
    Watermark,
    reconcile_window,
)
from tests.reconcile_cases import T0, norm_rows, sorted_anomalies, spark_classify, topic_config

TC = topic_config(groups=("g1",), sinks=(("s1", "g1"), ("s2", None)))
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
                ledger.append(LedgerRow(pid, seq, p if status == "acked" else -1,
                                        offs_ack if status == "acked" else None, status, _at(t),
                                        _at(t) + timedelta(milliseconds=draw(st.integers(1, 50)))
                                        if status == "acked" else None))
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
    if draw(st.booleans()):
        sinks["s1"].append(SinkRow(1, 99, "ghost-pid", 0, _at(draw(st.integers(0, 3599)))))
    watermarks = []
    offsets = []
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
    as_of = _at(draw(st.sampled_from([2400, 3840, 3900, 4500, 4800, 20000])))
    return Inputs(ledger, log, consumed, offsets, watermarks, sinks), as_of


def _merge(parts: list[tuple[Inputs, datetime]]) -> tuple[Inputs, datetime]:
    """Histories side by side in one window: history i on partitions 2i and 2i + 1, its pids and
    fingerprints prefixed by `h<i>-`; as of the first one's as_of."""
    out = Inputs([], [], [], [], [], {"s1": [], "s2": []})
    for i, (h, _) in enumerate(parts):
        def pid(v: str | None, i: int = i) -> str | None:
            return None if v is None else f"h{i}-{v}"

        def part(p: int, i: int = i) -> int:
            return p if p < 0 else 2 * i + p

        out.ledger = [*out.ledger, *(replace(r, pid=f"h{i}-{r.pid}", partition=part(r.partition)) for r in h.ledger)]
        out.log = [*out.log, *(replace(r, partition=part(r.partition), pid=pid(r.pid), fingerprint=pid(r.fingerprint))
                               for r in h.log)]
        out.consumed = [*out.consumed, *(replace(c, partition=part(c.partition), pid=pid(c.pid)) for c in h.consumed)]
        out.group_offsets = [*out.group_offsets, *(replace(g, partition=part(g.partition)) for g in h.group_offsets)]
        out.watermarks = [*out.watermarks, *(replace(w, partition=part(w.partition)) for w in h.watermarks)]
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
@given(batches())
def test_spark_equals_the_oracle_row_for_row(spark: Any, history: tuple[Inputs, datetime]) -> None:
    inputs, as_of = history
    oracle = reconcile_window(TC, T0, as_of, inputs)
    report, anomalies, quarantined, ignored = spark_classify(spark, TC, T0, as_of, inputs)
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
    r = reconcile_window(TC, T0, as_of, inputs)
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
@given(batches())
def test_the_columnar_path_equals_the_oracle_row_for_row(history: tuple[Inputs, datetime]) -> None:
    """The medium windows' path (`spark_jobs/reconcile/columnar.py`: ordinary messages settled on
    Arrow columns, the rest by the oracle, the checks that need neighbours vectorised) gives the
    oracle's report and anomaly rows."""
    from spark_jobs.reconcile import columnar
    from tests.reconcile_cases import arrow_tables

    inputs, as_of = history
    want = reconcile_window(TC, T0, as_of, inputs)
    got = columnar.classify(TC, T0, as_of, arrow_tables(inputs))
    assert got is not None
    assert sorted_anomalies(got.anomalies) == sorted_anomalies(want.anomalies)
    assert norm_rows(got.report) == norm_rows(want.report)
    assert got.quarantined_ledger_rows == want.quarantined_ledger_rows
    assert got.ignored_mirror_rows == want.ignored_mirror_rows


@pytest.mark.unit
@settings(max_examples=_examples(UNIT_EXAMPLES, SOAK_UNIT_EXAMPLES), deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(batches(), st.integers(min_value=2, max_value=4), st.sampled_from([1, 2, 3, 1 << 20]), st.booleans())
def test_the_columnar_path_in_chunks_equals_the_oracle_row_for_row(history: tuple[Inputs, datetime],
                                                                    n: int, block: int, packed: bool) -> None:
    """A window split into chunks by message (`columnar.Split`, a few rows of each table at a time)
    and settled chunk by chunk (`columnar.classify_chunks`) gives the oracle's report and anomaly
    rows: the order of consumption, the committed offsets and the checks that need neighbours are
    the whole window's, whatever the blocks those checks' passes take and whether the log order's
    key is packed in 64 bits or sorted on two columns."""
    import unittest.mock

    from spark_jobs.reconcile import columnar
    from tests.reconcile_cases import arrow_tables, classify_in_chunks

    inputs, as_of = history
    want = reconcile_window(TC, T0, as_of, inputs)
    with unittest.mock.patch.object(columnar, "_BLOCK", block), \
            unittest.mock.patch.object(columnar, "_KEY_BITS", 64 if packed else 0):
        got = classify_in_chunks([TC], T0, as_of, arrow_tables(inputs), n)
    assert got is not None
    r = got[TC.name]
    assert sorted_anomalies(r.anomalies) == sorted_anomalies(want.anomalies)
    assert norm_rows(r.report) == norm_rows(want.report)
    assert r.quarantined_ledger_rows == want.quarantined_ledger_rows
    assert r.ignored_mirror_rows == want.ignored_mirror_rows


@pytest.mark.unit
def test_the_columnar_path_on_the_hand_written_cases() -> None:
    """Every hand-written case of tests/reconcile_cases.py (one per code), before and after grace:
    the columnar path gives the oracle's rows; it declines a mirrored topic (the Spark plan takes it)."""
    from spark_jobs.reconcile import columnar
    from tests.reconcile_cases import (
        AS_OF_FINAL,
        GROUP,
        TOPIC,
        arrow_tables,
        build_cases,
        build_mirror_cases,
        classify_in_chunks,
        mirror_topic_config,
    )

    history, _ = build_cases()
    inputs = history.inputs()
    tc = topic_config()
    for as_of in (T0 + timedelta(minutes=61), AS_OF_FINAL):
        want = reconcile_window(tc, T0, as_of, inputs)
        got = columnar.classify(tc, T0, as_of, arrow_tables(inputs))
        assert got is not None
        assert sorted_anomalies(got.anomalies) == sorted_anomalies(want.anomalies)
        assert norm_rows(got.report) == norm_rows(want.report)
        assert (got.quarantined_ledger_rows, got.ignored_mirror_rows) == (want.quarantined_ledger_rows,
                                                                          want.ignored_mirror_rows)
        for n in (2, 3, 7):  # in chunks, a row or two of each table at a time
            chunked = classify_in_chunks([tc], T0, as_of, arrow_tables(inputs), n, batch_rows=2)
            assert chunked is not None
            r = chunked[tc.name]
            assert sorted_anomalies(r.anomalies) == sorted_anomalies(want.anomalies), n
            assert norm_rows(r.report) == norm_rows(want.report), n
            assert (r.quarantined_ledger_rows, r.ignored_mirror_rows) == (want.quarantined_ledger_rows,
                                                                          want.ignored_mirror_rows)
    # a consumer's `committed` rows past every offset (the interceptor's word on its committed
    # offset): in every chunk, a message the group never processed is `missed`, not `overdue`
    high = max(r.offset for r in inputs.log) + 1
    commits = [ConsumedRow(GROUP, "c9", 10**6 + p, p, high, None, None, "committed", T0 + timedelta(minutes=30),
                           topic=TOPIC) for p in sorted({r.partition for r in inputs.log})]
    with_commits = replace(inputs, consumed=[*inputs.consumed, *commits])
    want = reconcile_window(tc, T0, AS_OF_FINAL, with_commits)
    missed = {(a["pid"], a["seq"]) for a in want.anomalies if a["anomaly"] == "missed"}
    assert len(missed) >= 2
    for n in (2, 3, 7):
        chunked = classify_in_chunks([tc], T0, AS_OF_FINAL, arrow_tables(with_commits), n, batch_rows=2)
        assert chunked is not None
        assert sorted_anomalies(chunked[tc.name].anomalies) == sorted_anomalies(want.anomalies), n
    mirrored, _ = build_mirror_cases()
    assert columnar.classify(mirror_topic_config(), T0, AS_OF_FINAL, arrow_tables(mirrored.inputs())) is None
    assert classify_in_chunks([mirror_topic_config()], T0, AS_OF_FINAL, arrow_tables(mirrored.inputs()), 2) is None


@pytest.mark.unit
def test_the_columnar_path_declines_more_producer_sessions_than_its_keys_hold(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A pid code and a seq share one int64 key: with more sessions than the code's bits hold (here
    made 2: at most 3 sessions, with 61 bits of seq), the path declines and the Spark plan classifies
    the window."""
    from spark_jobs.reconcile import columnar
    from tests.reconcile_cases import arrow_tables, build_cases

    history, _ = build_cases()
    inputs = history.inputs()
    assert len({r.pid for r in inputs.ledger}) >= 4
    assert columnar.classify(topic_config(), T0, T0 + timedelta(hours=2), arrow_tables(inputs)) is not None
    monkeypatch.setattr(columnar, "SEQ_BITS", 61)
    assert columnar.classify(topic_config(), T0, T0 + timedelta(hours=2), arrow_tables(inputs)) is None


@pytest.mark.unit
@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(st.none(), st.text(alphabet="ab\u00e9", max_size=4)), max_size=40), st.booleans())
def test_shared_fingerprints_are_found_exactly_whatever_their_hashes_collide(
        strings: list[str | None], collide: bool) -> None:
    """The content check's fingerprints (`columnar._shared_strings`): the rows whose non-null string
    another row shares, with codes equal exactly for equal strings, also when every hash collides."""
    import numpy as np
    import pyarrow as pa

    from spark_jobs.reconcile import columnar

    arr = pa.array(strings, pa.string())
    rows = np.arange(len(strings), dtype=np.int64)[::2] if len(strings) % 3 == 0 else np.arange(len(strings))
    want = sorted(int(i) for i in rows if strings[i] is not None
                  and sum(strings[j] == strings[i] for j in rows) > 1)
    hashes = np.zeros(len(strings), dtype=np.uint64) if collide else columnar._hash64(arr)
    codes, shared = columnar._shared_strings(arr, rows, hashes)
    assert sorted(shared.tolist()) == want
    for i in shared.tolist():
        for j in shared.tolist():
            assert (codes[i] == codes[j]) == (strings[i] == strings[j])
    assert len(set(columnar._hash64(pa.array(["fp1", "fp2", "", "1pf", "fp10"])).tolist())) == 5


@pytest.mark.unit
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.one_of(st.none(), st.text(alphabet="0ab\u00e9", max_size=30)), max_size=40),
       st.integers(0, 3), st.integers(0, 2), st.booleans())
def test_a_strings_hash_is_its_words_sum_whatever_the_slice_it_is_hashed_in(
        monkeypatch: pytest.MonkeyPatch, strings: list[str | None], skip: int, length: int, uniform: bool) -> None:
    """`columnar._hash64` is the function its docstring states of each string alone (a null: its
    empty string's), whether its slice holds strings of one length as they lie, of several, nulls
    holding bytes, or is cut for long strings; the array a slice of another."""
    import numpy as np
    import pyarrow as pa

    from spark_jobs.reconcile import columnar

    if uniform:  # every string of one length: their bytes one after another
        strings = [None if s is None else (s.encode() * 30)[:length * 5].decode("latin-1") for s in strings]
    base = columnar._HASH_BASE

    def stated(s: str | None) -> int:
        data = b"" if s is None else s.encode()
        padded = data + bytes(-len(data) % 8)
        words = [int.from_bytes(padded[i:i + 8], "little") for i in range(0, len(padded), 8)]
        return (len(data) + sum(w * pow(base, i + 1, 2**64) for i, w in enumerate(words))) % 2**64

    arr = pa.array(strings, pa.string())
    if any(s is None for s in strings):  # a null that holds bytes: its offsets span some
        offsets = np.frombuffer(arr.buffers()[1], dtype=np.int32)[:len(arr) + 1]
        data = b"".join(b"#" if s is None else s.encode() for s in strings)
        held = np.cumsum([0, *(1 if s is None else len(s.encode()) for s in strings)]).astype(np.int32)
        assert len(offsets) == len(held)
        arr = pa.Array.from_buffers(pa.string(), len(arr), [arr.buffers()[0], pa.py_buffer(held.tobytes()),
                                                            pa.py_buffer(data)], null_count=arr.null_count)
    arr = arr.slice(min(skip, len(arr)))
    monkeypatch.setattr(columnar, "_HASH_SLICE", 7)
    monkeypatch.setattr(columnar, "_HASH_BYTES", 64)  # slices of strings of up to 30 bytes are cut
    assert columnar._hash64(arr).tolist() == [stated(s) for s in arr.to_pylist()]


@pytest.mark.unit
@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["p", "q", "r"]), st.integers(0, 12), st.booleans(),
                          st.one_of(st.none(), st.integers(0, 2)), st.integers(0, 9),
                          st.sampled_from([None, "x", "y"]), st.integers(0, 3), st.booleans()),
                unique_by=lambda r: (r[0], r[1]), max_size=40),
       st.lists(st.integers(0, 40), max_size=3), st.sampled_from([1, 2, 3, 1 << 20]), st.booleans())
def test_the_checks_that_need_neighbours_in_chunks_equal_the_oracle(
        rows: list[tuple[str, int, bool, int | None, int, str | None, int, bool]], cuts: list[int], block: int,
        packed: bool) -> None:
    """`columnar._neighbour_rows` over narrow rows cut into chunks, its sorted keys passed in blocks of
    `block` rows, the log order's key packed in 64 bits or sorted on two columns: the oracle's
    reordered messages, gaps and content duplicates on the same rows; None exactly when two originals
    of a pid share a (partition, offset) (the oracle's order is then the order of its rows)."""
    import unittest.mock
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np
    import pyarrow as pa

    from audit.oracle import Narrow, content_duplicates, reordered_in_log, seq_gaps
    from spark_jobs.reconcile import columnar

    narrow = [Narrow(pid, seq, present, part, None if part is None else off, fp, T0 + timedelta(minutes=minute), win)
              for pid, seq, present, part, off, fp, minute, win in rows]
    names = sorted({n.pid for n in narrow})
    minutes = {(r[0], r[1]): r[6] for r in rows}
    bounds = [0, *sorted(c for c in cuts if c < len(narrow)), len(narrow)]

    def chunk(ns: list[Narrow]) -> Any:
        fps = pa.array([n.fingerprint for n in ns], pa.string())
        part = np.array([-1 if n.partition is None else n.partition for n in ns], dtype=np.int64)
        return columnar._Narrow(
            np.array([names.index(n.pid) for n in ns], dtype=np.int64), np.array([n.seq for n in ns], dtype=np.int64),
            np.array([n.present for n in ns], dtype=bool), part,
            np.array([-1 if n.offset is None else n.offset for n in ns], dtype=np.int64),
            np.array([columnar._micros(T0 + timedelta(minutes=minutes[n.pid, n.seq])) for n in ns], dtype=np.int64),
            np.array([n.in_window for n in ns], dtype=bool), fps, columnar._fingerprint_hashes(fps, part))

    chunks = [chunk(narrow[a:b]) for a, b in zip(bounds, bounds[1:], strict=False)]
    with unittest.mock.patch.object(columnar, "_BLOCK", block), \
            unittest.mock.patch.object(columnar, "_KEY_BITS", 64 if packed else 0), \
            ThreadPoolExecutor(max_workers=2) as beside:
        got = columnar._neighbour_rows(chunks, names, beside)
    positions = [(n.partition, n.pid, n.offset) for n in narrow if n.partition is not None]
    if len(set(positions)) < len(positions):
        assert got is None
        return
    assert got is not None
    reordered, gaps, content = got
    assert sorted(reordered) == sorted((n.pid, n.seq, n.partition, n.offset, high) for n, high in reordered_in_log(narrow))
    assert gaps == sorted(seq_gaps(narrow))
    assert sorted(content) == sorted((n.pid, n.seq, n.partition, n.offset, first.pid, first.seq)
                                     for n, first in content_duplicates(narrow))


@pytest.mark.unit
@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["g1", "g2"]), st.integers(0, 2), st.integers(0, 6), st.integers(0, 5),
                          st.integers(0, 3), st.sampled_from(["c1", "c2"])), max_size=40),
       st.sampled_from([0, 2**61]))
def test_the_order_of_consumption_on_columns_equals_the_oracle(
        rows: list[tuple[str, int, int, int, int, str]], base: int) -> None:
    """`columnar._backwards` (the order of consumption over a window's processings as columns, in
    one pass for a chunked window) flags exactly the processings `oracle.reordered_in_consumption`
    flags, with offsets small and offsets too wide for its one-key sort (`base` 2^61); it declines
    only where the oracle's order is the rows' order (equal in every sort key, different offsets)."""
    import numpy as np

    from audit.oracle import reordered_in_consumption
    from spark_jobs.reconcile import columnar

    processings = [ConsumedRow(g, c, cseq, p, base + off, "p", 0, "processed", _at(ts))
                   for g, p, off, ts, cseq, c in rows]
    got = columnar._backwards(np.array([["g1", "g2"].index(r.group) for r in processings], dtype=np.int64),
                              np.array([["c1", "c2"].index(r.consumer) for r in processings], dtype=np.int64),
                              np.array([r.consume_seq for r in processings], dtype=np.int64),
                              np.array([r.partition for r in processings], dtype=np.int64),
                              np.array([r.offset for r in processings], dtype=np.int64),
                              np.array([ts for _, _, _, ts, _, _ in rows], dtype=np.int64))
    keys = [(r.group, r.partition, r.consume_ts, r.consume_seq, r.consumer) for r in processings]
    tie = any(keys[i] == keys[j] and processings[i].offset != processings[j].offset
              for i in range(len(keys)) for j in range(i))
    if tie:
        assert got is None
        return
    assert got is not None
    want = {id(r) for r in reordered_in_consumption(processings)}
    assert [id(r) in want for r in processings] == got.tolist()


@pytest.mark.unit
@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.sampled_from([0, 1, 7, 2**40, 2**61])), max_size=30),
       st.sampled_from([0, 4096]))
def test_the_running_maximum_per_segment_is_exact(rows: list[tuple[int, int]], few: int) -> None:
    """`columnar._prev_max` (the highest value before each row of its segment, -1 first): segment by
    segment (few segments) and in one pass over offset values (many), with values too wide for that
    pass (2^61) taken segment by segment again."""
    import unittest.mock

    import numpy as np

    from spark_jobs.reconcile import columnar

    rows = sorted(rows, key=lambda r: r[0])
    seg = np.array([r[0] for r in rows], dtype=np.int64)
    vals = np.array([r[1] for r in rows], dtype=np.int64)
    want = [max((v for s, v in rows[:i] if s == rows[i][0]), default=-1) for i in range(len(rows))]
    with unittest.mock.patch.object(columnar, "_FEW_SEGMENTS", few):
        assert columnar._prev_max(seg, vals).tolist() == want


@pytest.mark.unit
@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.sampled_from([-1, 0, 1, 5, 70_000, 2**31 - 1])), min_size=1, max_size=30),
       st.booleans())
def test_rows_are_grouped_by_group_and_partition_in_their_order(rows: list[tuple[int, int]], small: bool) -> None:
    """`columnar._segments`: each (group, partition) -- a null partition, -1, among them -- once, its
    rows together in their order; by a 16-bit code when the partitions are few, else by the keys."""
    import numpy as np

    from spark_jobs.reconcile import columnar

    if small:
        rows = [(g, p % 7 - 1) for g, p in rows]
    group = np.array([r[0] for r in rows], dtype=np.int64)
    part = np.array([r[1] for r in rows], dtype=np.int64)
    keys, order, bounds = columnar._segments(group, part)
    want = {(g << 32) | (p & 0xFFFFFFFF): [i for i, r in enumerate(rows) if r == (g, p)] for g, p in set(rows)}
    assert sorted(keys) == sorted(want) and len(bounds) == len(keys) + 1
    assert {k: order[bounds[i]:bounds[i + 1]].tolist() for i, k in enumerate(keys)} == want


@pytest.mark.unit
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.sampled_from(["ledger", "log", "consumed"]),
       st.lists(st.tuples(st.sampled_from([None, "p", "q", "p", "q", "q"]),
                          st.one_of(st.just(None), st.integers(0, 12), st.integers(0, 12), st.integers(0, 12)),
                          st.sampled_from([True, False, False, False]), st.sampled_from([True, False, False, False])),
                max_size=40),
       st.booleans(), st.integers(1, 6), st.integers(1, 5), st.lists(st.integers(0, 12), min_size=1, max_size=20))
def test_a_chunk_read_from_row_groups_holds_exactly_the_rows_the_split_sends_it(
        tmp_path_factory: pytest.TempPathFactory, kind: str, rows: list[tuple[Any, Any, bool, bool]],
        by_seq: bool, row_group: int, n: int, ledger_seqs: list[int]) -> None:
    """`driver.RowGroups.chunk`: from a file sorted by seq or not, in row groups of any size, chunk k
    reads exactly the rows `Split.chunk_ids` gives k (or every chunk: a `committed` row), a
    consumption row with its place in the file (`_row`); chunks are cut at `_cuts` of some seqs."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.dataset as ds
    import pyarrow.parquet as pq

    from spark_jobs.reconcile import columnar, driver

    columns = {"pid": pa.array([r[0] for r in rows], pa.string()), "seq": pa.array([r[1] for r in rows], pa.int64())}
    if kind == "log":
        columns["header_error"] = pa.array(["bad" if r[2] else None for r in rows], pa.string())
    if kind == "consumed":
        columns["outcome"] = pa.array(["committed" if r[3] else "processed" for r in rows], pa.string())
        columns["cluster"] = pa.array([None] * len(rows), pa.string())
    table = pa.table(columns)
    if by_seq:
        table = table.sort_by([("seq", "ascending", "at_start")])
    path = tmp_path_factory.mktemp("rg") / "t.parquet"
    pq.write_table(table, path, row_group_size=row_group)
    groups = driver.RowGroups(ds.dataset(str(path)), table.column_names, lambda t: t)
    cuts = driver._cuts(np.array(ledger_seqs, dtype=np.int64), n)
    assert cuts is not None and len(cuts) == n - 1 and np.all(np.diff(cuts) >= 0)
    split = columnar.Split(n, [], T0, cuts)
    ids = split.chunk_ids(kind, table.to_batches()[0]) if len(rows) else np.empty(0, np.uint8)
    for k in range(n):
        got = groups.chunk(split, kind, k)
        want = table.filter(pa.array((ids == k) | (ids == n))) if len(rows) else table
        if kind == "consumed":
            assert got.column("_row").to_pylist() == np.flatnonzero((ids == k) | (ids == n)).tolist()
            got = got.drop_columns(["_row"])
        assert got.to_pylist() == want.to_pylist()
    assert 1 <= groups.read_cost(cuts) <= n + 1 or not len(rows)


@pytest.mark.unit
def test_a_window_is_chunked_to_fit_columnar_rows_and_to_settle_on_both_cores() -> None:
    """`columnar.chunk_count`: whole up to SPLIT_ROWS rows; above, up to SPLIT_CHUNKS chunks of about
    SPLIT_ROWS rows even within `columnar_rows`; always enough that the chunks settled at once hold
    at most `columnar_rows` rows."""
    from spark_jobs.reconcile.columnar import CHUNKS_AT_ONCE, SPLIT_CHUNKS, SPLIT_ROWS, chunk_count

    assert (CHUNKS_AT_ONCE, SPLIT_ROWS, SPLIT_CHUNKS) == (2, 2_000_000, 4)
    limit = 12_000_000
    assert [chunk_count(rows, limit) for rows in (0, 1, 64_000, 2_000_000)] == [1, 1, 1, 1]
    assert [chunk_count(rows, limit) for rows in (2_000_001, 4_000_000, 4_000_001, 7_988_016, 12_000_000)] \
        == [2, 2, 3, 4, 4]
    assert [chunk_count(rows, limit) for rows in (24_000_001, 79_988_016)] == [5, 14]
    assert chunk_count(1_000_000, 300_000) == 7  # small `columnar_rows`: its own bound
    for rows in (2_500_000, 79_988_016, 1_000_000):
        n = chunk_count(rows, limit)
        assert -(-rows // n) * CHUNKS_AT_ONCE <= limit + CHUNKS_AT_ONCE
