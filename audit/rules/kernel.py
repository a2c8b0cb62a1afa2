"""Settling a window, or one chunk of it, on Arrow columns (docs/design.md §5.8).

A message is *ordinary* when, in the rows at hand, it has exactly one ledger row (acked, with its
partition and offset), exactly one valid log record (committed, at that partition and offset), for
each group of the topic exactly one consumption row (a processing, at that partition and offset,
read on the audited cluster, not flagged by the order of consumption) and no other, or none at all;
for each share group exactly two rows, an acquisition and an accept the broker took, at that
position, on the audited cluster, or none at all; and in each sink exactly one row (not a
dead-letter row), or none. Every rule of §5 gives such a message: expected at every stage;
delivered at the log and wherever it has its rows; its ack, consume and sink latencies there; at a
group, share group or sink with no row of it, the code of a record never processed, never accepted
or never written, which follows from grace, the group's committed offsets, the log start offsets
and the share group's start offsets alone (an incident -- a group down for the hour -- is settled
on columns like a quiet hour); and its narrow row for the checks that need neighbours.
`settle` computes those facts for all ordinary messages at once; every other message -- with all
its rows --, every row without a message identity, the consumer interceptor's `committed` rows
and the rows read on a mirror go to `oracle.window_facts`, which classifies them exactly as it
classifies a whole window. A mirrored topic's messages all go to the oracle (its failover and
mirror rules read the whole window: such a window is settled as one chunk), and so do the messages
of a topic whose sink counts only what a share group consumed.

A chunk holds every row of its messages (the caller splits a window by message), the consumer
interceptor's `committed` rows of the window, and, in `consumed`'s `_flag` column when the window
is larger than the chunk, the order of consumption's flags computed over the whole window
(`neighbours.consumption_order`). The checks that need neighbours run over every chunk's narrow
rows (`Settled.narrow`), then `result` assembles the report.

Pure functions: no pyspark, no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from datetime import datetime, timedelta
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from audit import oracle
from audit.core.config import TopicConfig
from audit.core.report import assemble_report, code_counts
from audit.core.vocabulary import (
    ACCEPTED,
    ACKED,
    ACQUIRED,
    COMMITTED,
    LEDGER_STATUSES,
    LOG,
    PROCESSING_OUTCOMES,
    detail,
    group_stage,
    share_stage,
    sink_stage,
    stage_kind,
)
from audit.core.windows import read_ranges, run_id_for
from audit.rules import neighbours
from audit.rules.columns import (
    NONE,
    among,
    between,
    bools,
    codes_in,
    equals,
    histogram,
    ints,
    latency_columns,
    micros,
    oracle_rows,
    sorted_distinct,
    us,
    where,
)
from audit.rules.neighbours import NARROW, fingerprint_hashes

SEQ_BITS = 40  # a message's key is (pid code << SEQ_BITS) | seq when every seq and pid code fits
NO_ROW = -2  # a message's row in a tier that has none of it (-1: it has several)
# anomaly rows settled on columns: OUT's columns of an anomaly, the window's given apart
CODED = pa.schema([("stage", pa.string()), ("partition", pa.int64()), ("anomaly", pa.string()), ("pid", pa.string()),
                   ("seq", pa.int64()), ("offset", pa.int64()), ("detail", pa.string())])


@dataclass
class Tables:
    """Rows as Arrow tables whose columns are named as the oracle's row fields (`ledger`, `log`,
    `consumed`, `mirror_log`: `LedgerRow`, `LogRecord`, `ConsumedRow`, `MirrorRecord`; each sink:
    `SinkRow`), as read: the visibility is applied here. `consumed` may carry `_flag`, the order of
    consumption's flags over the whole window. The small inputs come as the oracle's rows."""

    ledger: pa.Table
    log: pa.Table
    consumed: pa.Table | None
    sinks: Mapping[str, pa.Table]
    group_offsets: Sequence[oracle.GroupOffset] = ()
    watermarks: Sequence[oracle.Watermark] = ()
    mirror_log: pa.Table | None = None
    mirror_watermarks: Sequence[oracle.MirrorWatermark] = ()
    mirror_group_offsets: Sequence[oracle.MirrorGroupOffset] = ()
    share_offsets: Sequence[oracle.ShareOffset] = ()


Histograms = dict[tuple[str, int], list[tuple[np.ndarray, np.ndarray]]]


@dataclass
class Settled:
    """One topic's facts in a window or a chunk: the oracle's (`narrow` empty: see `narrow` here),
    the ordinary messages' latencies as histograms per (stage, partition), and every message's
    narrow row (`neighbours.NARROW`)."""

    facts: oracle.Facts
    histograms: Histograms
    narrow: pa.Table
    coded: pa.Table = field(default_factory=lambda: CODED.empty_table())  # anomaly rows settled on columns


def is_processing(rows: Any) -> Any:
    """Whether each consumption row processed its message on the audited cluster."""
    return pc.and_(pc.is_null(rows["cluster"]), among(rows["outcome"], PROCESSING_OUTCOMES))


def consumed_seen(rows: Any, tc: TopicConfig, ws: datetime) -> Any:
    """The oracle's visibility of consumption rows for `tc`'s window: the topic's, of one of its
    groups, consumed within the event range."""
    rr = read_ranges(tc, ws)
    return pc.and_(pc.and_(equals(rows["topic"], tc.name), among(rows["group"], tc.consuming_groups)),
                   between(rows["consume_ts"], rr.event_lo, rr.event_hi))


def flag_processings(consumed: pa.Table, tc: TopicConfig, ws: datetime) -> np.ndarray:
    """The order of consumption's flags over `consumed`'s visible processings (a mask over its rows)."""
    seen = bools(pc.and_(consumed_seen(consumed, tc, ws), is_processing(consumed)))
    out = np.zeros(consumed.num_rows, dtype=bool)
    rows = np.flatnonzero(seen)
    if len(rows):
        out[rows[neighbours.consumption_order(consumed.take(pa.array(rows)))]] = True
    return out


@dataclass
class _Visible:
    ledger: pa.Table
    log: pa.Table
    consumed: pa.Table
    sinks: dict[str, pa.Table]


_ARROW_OF = {str: pa.string(), int: pa.int64(), bool: pa.bool_(), datetime: pa.timestamp("us", "UTC")}


def empty(cls: type) -> pa.Table:
    """A table of no row with the columns of the oracle's row type `cls`, each of its field's type."""
    import typing

    hints = typing.get_type_hints(cls)
    return pa.schema([(f.name, _ARROW_OF[next(a for a in typing.get_args(hints[f.name]) or (hints[f.name],)
                                              if a is not type(None))]) for f in fields(cls)]).empty_table()


def _visible(tc: TopicConfig, ws: datetime, t: Tables) -> _Visible:
    """The oracle's visibility for `tc`'s window of `ws` over `t` (other topics' rows left out)."""
    rr = read_ranges(tc, ws)

    def is_topic(tab: pa.Table) -> Any:
        return equals(tab["topic"], tc.name)

    led = where(t.ledger, pc.and_(is_topic(t.ledger), between(t.ledger["produce_ts"], rr.message_lo, rr.message_hi)))
    log_time = pc.coalesce(*(pc.cast(t.log[c], pa.timestamp("us", "UTC"), safe=False)
                             for c in ("produce_ts", "kafka_ts", "captured_at")))
    log = where(t.log, pc.and_(is_topic(t.log), between(log_time, rr.message_lo, rr.message_hi)))
    if tc.consuming_groups and t.consumed is not None and t.consumed.num_rows:
        con = where(t.consumed, consumed_seen(t.consumed, tc, ws))
    else:
        con = empty(oracle.ConsumedRow)
    sinks = {}
    for s in tc.sinks:
        st = t.sinks.get(s.name)
        if st is None:
            continue
        seen = pc.or_(pc.is_null(st["sink_ts"]), between(st["sink_ts"], rr.event_lo, rr.event_hi))
        sinks[s.name] = where(st, pc.and_(is_topic(st), pc.fill_null(seen, True)))
    return _Visible(led, log, con, sinks)


def _single(keys: np.ndarray, mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(the distinct keys with rows, among `keys` >= 0 under `mask`, and for each the index of its row
    when it has exactly one; -1 when it has several)."""
    idx = np.flatnonzero(mask & (keys >= 0))
    k = keys[idx]
    order = np.argsort(k, kind="stable")
    ks = k[order]
    start = np.flatnonzero(np.concatenate([[True], ks[1:] != ks[:-1]])) if len(ks) else np.empty(0, np.int64)
    count = np.diff(np.append(start, len(ks)))
    return ks[start], np.where(count == 1, idx[order[start]], -1)


def _lookup(uniq: np.ndarray, rows: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """For each of `keys`: its row in (`uniq`, `rows`), NO_ROW when it has none (-1: several)."""
    if not len(uniq):
        return np.full(len(keys), NO_ROW, dtype=np.int64)
    at = np.clip(np.searchsorted(uniq, keys), 0, len(uniq) - 1)
    return np.where(uniq[at] == keys, rows[at], NO_ROW)


class _Codes:
    """The anomaly rows of the messages settled on columns that some group, share group or sink
    has no row of (`CODED` columns; the codes as the oracle's group, share and sink stages give them
    to a record or message with no row there). `partition`, `offset`: each message's original copy's;
    `ledger`: its ledger row."""

    def __init__(self, partition: np.ndarray, offset: np.ndarray, ledger: pa.Table) -> None:
        self.partition, self.offset = partition, offset
        self.pid, self.seq = pc.cast(ledger["pid"], pa.string()), pc.cast(ledger["seq"], pa.int64())
        self.parts: list[pa.Table] = []

    def _below(self, values: Mapping[int, int]) -> np.ndarray:
        """Whether each message's offset is below its partition's value in `values`."""
        limit = np.full(len(self.partition), -1, dtype=np.int64)
        for p, v in values.items():
            limit[self.partition == p] = v
        return self.offset < limit

    def add(self, stage: str, code: str, mask: np.ndarray, **per_partition: Mapping[int, int]) -> None:
        rows = np.flatnonzero(mask)
        if not len(rows):
            return
        parts, inv = np.unique(self.partition[rows], return_inverse=True)
        texts = pa.array([detail(stage_kind(stage), code, None, **{k: v[p] for k, v in per_partition.items()})
                          for p in parts.tolist()], pa.string())
        taken = pa.array(rows, pa.int64())
        self.parts.append(pa.table([pa.repeat(pa.scalar(stage), len(rows)), pa.array(self.partition[rows]),
                                    pa.repeat(pa.scalar(code), len(rows)), pc.take(self.pid, taken),
                                    pc.take(self.seq, taken), pa.array(self.offset[rows]),
                                    pc.take(texts, pa.array(inv.reshape(-1)))], schema=CODED))

    def unprocessed(self, stage: str, missing: np.ndarray, late: np.ndarray, gone: Mapping[int, int],
                    name: str, below: Mapping[int, int]) -> None:
        """A group's (or share group's) codes for the messages of `missing` (not processed, or not
        accepted, and no row of the group): `pending` within grace; else `expired_unconsumed` below
        their partition's log start offset in `gone`; else `missed` below its offset in `below`
        (its detail's value `name`); else `overdue`."""
        self.add(stage, "pending", missing & ~late)
        rest = missing & late
        expired = rest & self._below(gone)
        self.add(stage, "expired_unconsumed", expired)
        rest &= ~expired
        missed = rest & self._below(below)
        self.add(stage, "missed", missed, **{name: below})
        self.add(stage, "overdue", rest & ~missed)

    def not_in_sink(self, stage: str, missing: np.ndarray, late: np.ndarray) -> None:
        """A sink's codes for the expected messages of `missing` (no row there, not even a dead-letter
        one): `pending` within grace, else `missing_in_sink`."""
        self.add(stage, "pending", missing & ~late)
        self.add(stage, "missing_in_sink", missing & late)

    def table(self) -> pa.Table:
        return pa.concat_tables(self.parts) if self.parts else CODED.empty_table()


def _message_keys(tiers: Sequence[tuple[Any, Any, np.ndarray]]) -> list[np.ndarray]:
    """A key per row of each tier (pid column, seq column, rows with a message identity), equal for
    rows of one (pid, seq), -1 for rows without one: (pid code << SEQ_BITS) | seq when every pid code
    and seq fits, else a dense number of the (pid, seq) pairs."""
    pids = sorted_distinct([p for p, _, _ in tiers])
    codes = [codes_in(p, pids) for p, _, _ in tiers]
    seqs = [ints(s, 0) for _, s, _ in tiers]
    has = [(c >= 0) & m & bools(pc.is_valid(s)) for c, (_, s, m) in zip(codes, tiers, strict=True)]
    fits = len(pids) < 2 ** (63 - SEQ_BITS) and all(
        not np.any(h & ((q < 0) | (q >= 1 << SEQ_BITS))) for h, q in zip(has, seqs, strict=True))
    if fits:
        return [np.where(h, (c << SEQ_BITS) | np.clip(q, 0, None), -1) for c, q, h in zip(codes, seqs, has, strict=True)]
    pairs = np.rec.fromarrays([np.concatenate([c[h] for c, h in zip(codes, has, strict=True)]),
                               np.concatenate([q[h] for q, h in zip(seqs, has, strict=True)])])
    _, dense = np.unique(pairs, return_inverse=True)
    out, at = [], 0
    for h in has:
        key = np.full(len(h), -1, dtype=np.int64)
        n = int(h.sum())
        key[h] = dense[at:at + n]
        at += n
        out.append(key)
    return out


def _no_narrow() -> pa.Table:
    return NARROW.empty_table()


def _narrow_of(rows: Sequence[oracle.Narrow]) -> pa.Table:
    """The oracle's narrow rows as a NARROW table."""
    fps = pa.array([n.fingerprint if n.partition is not None else None for n in rows], pa.string())
    fp1, fp2 = fingerprint_hashes(fps)
    return pa.table([pa.array([n.pid for n in rows], pa.string()), pa.array([n.seq for n in rows], pa.int64()),
                     pa.array([n.present for n in rows], pa.bool_()),
                     pa.array([-1 if n.partition is None else n.partition for n in rows], pa.int64()),
                     pa.array([-1 if n.offset is None else n.offset for n in rows], pa.int64()),
                     pa.array([NONE if n.produce_time is None else micros(n.produce_time) for n in rows], pa.int64()),
                     pa.array([n.in_window for n in rows], pa.bool_()), fp1, fp2], schema=NARROW)


def _oracle_rows(table: pa.Table | None, cls: type, topic: str) -> list[Any]:
    if table is None or not table.num_rows:
        return []
    return oracle_rows(table, cls, np.ones(table.num_rows, dtype=bool), topic)


def _all_by_oracle(tc: TopicConfig, ws: datetime, as_of: datetime, t: Tables, v: _Visible) -> Settled:
    """A mirrored topic, or one with a sink fed by a share group: every rule by the oracle, over the
    visible rows."""
    reordered: set[int] | None = None
    consumed = _oracle_rows(v.consumed, oracle.ConsumedRow, tc.name)
    if "_flag" in v.consumed.column_names and v.consumed.num_rows:
        reordered = {id(r) for r, f in zip(consumed, bools(v.consumed["_flag"]), strict=True) if f}
    inputs = oracle.Inputs(
        ledger=_oracle_rows(v.ledger, oracle.LedgerRow, tc.name), log=_oracle_rows(v.log, oracle.LogRecord, tc.name),
        consumed=consumed, group_offsets=list(t.group_offsets), watermarks=list(t.watermarks),
        sinks={name: _oracle_rows(st, oracle.SinkRow, tc.name) for name, st in v.sinks.items()},
        mirror_log=_oracle_rows(t.mirror_log, oracle.MirrorRecord, tc.name),
        mirror_watermarks=list(t.mirror_watermarks), mirror_group_offsets=list(t.mirror_group_offsets),
        share_offsets=list(t.share_offsets))
    facts = oracle.window_facts(tc, ws, as_of, inputs, reordered=reordered, neighbours=False)
    narrow = _narrow_of(facts.narrow)
    facts.narrow = []
    return Settled(facts, {}, narrow)


def settle(tc: TopicConfig, ws: datetime, as_of: datetime, t: Tables) -> Settled:
    """The facts of `tc`'s messages in `t` (a window, or one chunk of it: see the module's docstring)."""
    topic = tc.name
    v = _visible(tc, ws, t)
    shares = {sg.name for sg in tc.share_groups}
    if tc.mirrors or any(s.group in shares for s in tc.sinks):
        return _all_by_oracle(tc, ws, as_of, t, v)
    ws_us, we_us = micros(ws), micros(ws + tc.window)
    led, log, con, sinks = v.ledger, v.log, v.consumed, v.sinks

    # --- the order of consumption (given over the whole window, or computed here over a whole window)
    c_ts = np.empty(0, np.int64)  # no consumption rows: no message is ordinary in a topic with groups
    if con.num_rows:
        c_part, c_off, c_ts = ints(con["partition"]), ints(con["offset"]), us(con["consume_ts"])
        on_source = bools(pc.is_null(con["cluster"]))
        is_commit = bools(equals(con["outcome"], COMMITTED))
        processing = bools(is_processing(con))
        flagged = bools(con["_flag"]) if "_flag" in con.column_names else flag_processings(con, tc, ws)
    valid_log = bools(pc.and_(pc.is_null(log["header_error"]), pc.and_(pc.is_valid(log["pid"]), pc.is_valid(log["seq"]))))
    tiers = [(led["pid"], led["seq"], np.ones(led.num_rows, dtype=bool)), (log["pid"], log["seq"], valid_log)]
    if con.num_rows:
        tiers.append((con["pid"], con["seq"], np.ones(con.num_rows, dtype=bool)))
    names = list(sinks)
    tiers += [(sinks[n]["pid"], sinks[n]["seq"], np.ones(sinks[n].num_rows, dtype=bool)) for n in names]
    keys = _message_keys(tiers)
    kL, kR = keys[0], keys[1]
    kC = keys[2] if con.num_rows else np.empty(0, np.int64)
    kS = dict(zip(names, keys[3 if con.num_rows else 2:], strict=True))

    # --- the ledger: one acked row with a position, or the message is not ordinary
    status = led["status"]
    l_part, l_off = ints(led["partition"]), ints(led["offset"], NONE)
    acked = bools(equals(status, ACKED))
    quarantine = ~bools(among(status, LEDGER_STATUSES)) | (acked & ((l_off == NONE) | (l_part < 0)))
    uL, rowL = _single(kL, np.ones(len(kL), dtype=bool))
    # --- the log: one valid record, committed, at the acked position
    r_part, r_off = ints(log["partition"]), ints(log["offset"])
    committed = bools(log["committed"])
    uR, rowR = _single(kR, np.ones(len(kR), dtype=bool))
    cand = uL[rowL >= 0]
    li = rowL[rowL >= 0]
    ok = acked[li] & ~quarantine[li]
    cand, li = cand[ok], li[ok]
    ri = _lookup(uR, rowR, cand)
    ok = ri >= 0
    cand, li, ri = cand[ok], li[ok], ri[ok]
    ok = committed[ri] & (r_part[ri] == l_part[li]) & (r_off[ri] == l_off[li])
    cand, li, ri = cand[ok], li[ok], ri[ok]

    # --- each group: one processing at the record's position and no other row of the group, or no
    # row of the group at all (NO_ROW: the codes of a record never processed follow from grace and
    # the offsets: `_Codes.unprocessed`)
    at: dict[str, np.ndarray] = {}  # per group and sink: each candidate's row there (NO_ROW: none)
    for g in tc.groups:
        if not con.num_rows:
            gi = np.full(len(cand), NO_ROW, dtype=np.int64)
            ok = np.ones(len(cand), dtype=bool)
        else:
            uG, rowG = _single(kC, bools(equals(con["group"], g)) & on_source & ~is_commit)
            gi = _lookup(uG, rowG, cand)
            g_ok = np.where(gi >= 0, gi, 0)
            ok = (gi == NO_ROW) | ((gi >= 0) & processing[g_ok] & ~flagged[g_ok] & (c_part[g_ok] == r_part[ri])
                                   & (c_off[g_ok] == r_off[ri]))
        cand, li, ri = cand[ok], li[ok], ri[ok]
        at = {k: a[ok] for k, a in at.items()}
        at[g] = gi[ok]
    # --- each share group: one acquisition and one accept the broker took, at the record's
    # position, on the audited cluster, and no other row of the group (a record of its dead-letter
    # topic naming the message is a row of the group: such a message goes to the oracle), or no row
    # of the group at all
    for sg in tc.share_groups:
        ok = np.ones(len(cand), dtype=bool)
        ai = xi = np.full(len(cand), NO_ROW, dtype=np.int64)
        if con.num_rows:
            of_g = bools(equals(con["group"], sg.name))
            uA, rowA = _single(kC, of_g & on_source & bools(equals(con["outcome"], ACQUIRED)))
            uX, rowX = _single(kC, of_g & on_source & bools(pc.and_(equals(con["outcome"], ACCEPTED),
                                                                      pc.is_null(con["error"]))))
            ks, n = np.unique(kC[of_g & (kC >= 0)], return_counts=True)
            ai, xi = _lookup(uA, rowA, cand), _lookup(uX, rowX, cand)
            a_ok, x_ok = np.where(ai >= 0, ai, 0), np.where(xi >= 0, xi, 0)
            rows_of_g = _lookup(ks, n, cand)
            ok = (rows_of_g == NO_ROW) | ((ai >= 0) & (xi >= 0) & (rows_of_g == 2)
                                          & (c_part[a_ok] == r_part[ri]) & (c_off[a_ok] == r_off[ri])
                                          & (c_part[x_ok] == r_part[ri]) & (c_off[x_ok] == r_off[ri]))
        cand, li, ri = cand[ok], li[ok], ri[ok]
        at = {k: a[ok] for k, a in at.items()}
        at["share:" + sg.name], at["share-ack:" + sg.name] = ai[ok], xi[ok]
    # --- each sink: one row (not a dead-letter row), or no row at all
    for sc in tc.sinks:
        if sc.name not in sinks:
            si = np.full(len(cand), NO_ROW, dtype=np.int64)
            ok = np.ones(len(cand), dtype=bool)
        else:
            st = sinks[sc.name]
            uS, rowS = _single(kS[sc.name], np.ones(st.num_rows, dtype=bool))
            si = _lookup(uS, rowS, cand)
            ok = si >= 0
            if "dead_letter" in st.column_names and st.num_rows:  # a dead-letter row is not a sink row
                ok &= ~bools(pc.fill_null(st["dead_letter"], False))[np.where(ok, si, 0)]
            ok |= si == NO_ROW
        cand, li, ri = cand[ok], li[ok], ri[ok]
        at = {k: a[ok] for k, a in at.items()}
        at["sink:" + sc.name] = si[ok]

    # --- every other row goes to the oracle: an ordinary message's rows are exactly its ledger row,
    # its valid record, its processing in each group and its row in each sink (any other row with its
    # key is a commit, off the audited cluster or has no valid identity, and the oracle takes it)
    def other(n: int, *taken: np.ndarray) -> np.ndarray:
        mask = np.ones(n, dtype=bool)
        for rows in taken:
            mask[rows[rows >= 0]] = False
        return mask

    facts_rows = oracle.Inputs(
        ledger=oracle_rows(led, oracle.LedgerRow, other(led.num_rows, li), topic),
        log=oracle_rows(log, oracle.LogRecord, other(log.num_rows, ri), topic),
        consumed=[], group_offsets=list(t.group_offsets), watermarks=list(t.watermarks),
        sinks={name: oracle_rows(st, oracle.SinkRow, other(st.num_rows, at["sink:" + name]), topic)
               for name, st in sinks.items()}, share_offsets=list(t.share_offsets))
    reordered: set[int] = set()
    if con.num_rows:
        mask = other(con.num_rows, *(at[g] for g in tc.groups),
                     *(at[f"{kind}:{g}"] for g in shares for kind in ("share", "share-ack")))
        facts_rows.consumed = oracle_rows(con, oracle.ConsumedRow, mask, topic)
        for row, f in zip(facts_rows.consumed, flagged[mask], strict=True):
            if f:
                reordered.add(id(row))
    facts = oracle.window_facts(tc, ws, as_of, facts_rows, reordered=reordered, neighbours=False)

    # --- the ordinary messages' facts
    pt = us(led["produce_ts"])[li]
    in_window = (pt >= ws_us) & (pt < we_us)
    part = l_part[li]
    win = np.flatnonzero(in_window)
    hists: Histograms = {}
    pw, ow, ptw = part[win], r_off[ri][win], pt[win]
    late = micros(as_of) >= ptw + tc.grace // timedelta(microseconds=1)  # past grace
    codes = _Codes(pw, ow, led.take(pa.array(li[win], pa.int64())))

    def count(stage: str, expected: np.ndarray, delivered: np.ndarray, latencies: np.ndarray, has: np.ndarray) -> None:
        values, inv = np.unique(pw, return_inverse=True)
        n_exp = np.bincount(inv, weights=expected, minlength=len(values))
        n_del = np.bincount(inv, weights=delivered, minlength=len(values))
        for p, e, d in zip(values.tolist(), n_exp.tolist(), n_del.tolist(), strict=True):
            cnt = facts.counts.setdefault((stage, p), {})
            cnt["expected"] = cnt.get("expected", 0) + int(e)
            cnt["delivered"] = cnt.get("delivered", 0) + int(d)
        for p in np.unique(pw[has]).tolist():
            hists.setdefault((stage, p), []).append(histogram(latencies[has & (pw == p)]))

    def since_produced(rows: np.ndarray, ts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(each message's latency in ms from its produce time to `ts` at its row in `rows`, whether it
        has one: a row, and a time there)."""
        at_row = np.full(len(rows), NONE, dtype=np.int64)
        at_row[rows >= 0] = ts[rows[rows >= 0]]
        return (at_row - ptw) / 1000.0, at_row != NONE

    every = np.ones(len(win), dtype=bool)
    ack = us(led["ack_ts"])[li][win]
    count(LOG, every, every, (ack - ptw) / 1000.0, ack != NONE)
    committed_at = oracle.committed_offsets(topic, t.group_offsets, oracle_rows(con, oracle.ConsumedRow, is_commit & on_source, topic)
                                            if con.num_rows else [])
    log_start = oracle.log_start_offsets(topic, t.watermarks)
    for g in tc.groups:
        latency, processed = since_produced(at[g][win], c_ts)
        fed = np.zeros(len(win), dtype=bool)  # in a sink g feeds: processed, its consumption row never flushed
        for sc in tc.sinks:
            if sc.group == g:
                fed |= at["sink:" + sc.name][win] >= 0
        count(group_stage(g), every, processed | fed, latency, processed)
        codes.unprocessed(group_stage(g), ~(processed | fed), late, log_start, "committed_offset",
                          {p: co for (cg, p), co in committed_at.items() if cg == g and co is not None})
    share_start = oracle.start_offsets(topic, t.share_offsets)
    for g in sorted(shares):
        latency, accepted = since_produced(at["share:" + g][win], c_ts)
        count(share_stage(g), every, accepted, latency, accepted)
        codes.unprocessed(share_stage(g), ~accepted, late, {}, "start_offset",
                          {p: so for (sg, p), so in share_start.items() if sg == g})
    for sc in tc.sinks:
        rows = at["sink:" + sc.name][win]
        expected = every if sc.group is None else at[sc.group][win] >= 0
        latency, stamped = since_produced(rows, us(sinks[sc.name]["sink_ts"]) if sc.name in sinks else np.empty(0, np.int64))
        count(sink_stage(sc.name), expected, expected & (rows >= 0), latency, expected & stamped)
        codes.not_in_sink(sink_stage(sc.name), expected & (rows == NO_ROW), late)

    # --- the narrow rows of both kinds, for the checks that need neighbours
    taken = pa.array(li, pa.int64())
    fp1, fp2 = fingerprint_hashes(pc.cast(pc.take(log["fingerprint"], pa.array(ri, pa.int64())), pa.string()))
    ordinary = pa.table([pc.cast(pc.take(led["pid"], taken), pa.string()), pc.cast(pc.take(led["seq"], taken), pa.int64()),
                         pa.array(np.ones(len(li), dtype=bool)), pa.array(part), pa.array(r_off[ri]), pa.array(pt),
                         pa.array(in_window), fp1, fp2], schema=NARROW)
    narrow = pa.concat_tables([ordinary, _narrow_of(facts.narrow)]) if facts.narrow else ordinary
    facts.narrow = []
    return Settled(facts, hists, narrow, codes.table())


def resendable(facts: oracle.Facts) -> pa.Table:
    """The failed sends of `facts.resendable` as `neighbours.LATEST` rows: their fingerprint's hashes
    and produce time."""
    fp1, fp2 = fingerprint_hashes(pa.array([fp for _, fp, _ in facts.resendable], pa.string()))
    return pa.table([fp1, fp2, pa.array([micros(pt) for _, _, pt in facts.resendable], pa.int64())],
                    schema=neighbours.LATEST)


def found_by_neighbours(narrow: pa.Table) -> tuple[list[Any], list[Any], list[Any]]:
    """What the checks that need neighbours find over a whole window's narrow rows."""
    return neighbours.log_order(narrow), neighbours.gaps(narrow), neighbours.content(narrow)


def result(tc: TopicConfig, ws: datetime, as_of: datetime, partitions: Iterable[int],
           counts: Mapping[tuple[str, int], Mapping[str, int]], histograms: Histograms,
           anomalies: list[dict[str, Any]], quarantined: int, ignored: Mapping[tuple[str, str], int]) -> oracle.OracleResult:
    """The window's report from its counts and latency histograms per (stage, partition), and its anomaly rows."""
    report = report_rows(tc, ws, as_of, partitions, counts, histograms, code_counts(anomalies))
    return oracle.OracleResult(report, anomalies, quarantined, dict(ignored))


def report_rows(tc: TopicConfig, ws: datetime, as_of: datetime, partitions: Iterable[int],
                counts: Mapping[tuple[str, int], Mapping[str, int]], histograms: Histograms,
                codes: Mapping[tuple[str, int], Mapping[str, int]]) -> list[dict[str, Any]]:
    """The window's report rows from its counts and latency histograms per (stage, partition) and
    its anomaly rows' counts per (stage, partition) and code (`audit.core.report.code_counts`)."""
    stats: dict[tuple[str, int], dict[str, Any]] = {}
    for k, val in counts.items():
        parts = histograms.get(k, [])
        xs = np.concatenate([h[0] for h in parts]) if parts else np.empty(0, np.float64)
        n = np.concatenate([h[1] for h in parts]) if parts else np.empty(0, np.int64)
        stats[k] = {**val, **latency_columns(xs, n)}
    return assemble_report(tc, ws, as_of, partitions, stats, codes)


def merged_histograms(settled: Sequence[Settled]) -> Histograms:
    """Every part's latencies, the oracle's (one value each) and the ordinary messages' histograms."""
    out: Histograms = {}
    for s in settled:
        for k, xs in s.facts.latencies.items():
            if xs:
                out.setdefault(k, []).append((np.asarray(xs, dtype=np.float64), np.ones(len(xs), dtype=np.int64)))
        for k, hs in s.histograms.items():
            out.setdefault(k, []).extend(hs)
    return out


def merged_counts(settled: Sequence[Settled]) -> dict[tuple[str, int], dict[str, int]]:
    out: dict[tuple[str, int], dict[str, int]] = {}
    for s in settled:
        for k, cnt in s.facts.counts.items():
            into = out.setdefault(k, {})
            for name, n in cnt.items():
                into[name] = into.get(name, 0) + n
    return out


def classify(tc: TopicConfig, ws: datetime, as_of: datetime, t: Tables) -> oracle.OracleResult:
    """The oracle's result for one (topic, window) from all its rows at hand: settled as one chunk,
    the checks that need neighbours over its narrow rows, the report."""
    return classify_parts(tc, ws, as_of, [settle(tc, ws, as_of, t)])


def classify_parts(tc: TopicConfig, ws: datetime, as_of: datetime, parts: Sequence[Settled]) -> oracle.OracleResult:
    """The window's result from the settled parts of its chunks (each message in one of them; chunk
    k's seqs below chunk k + 1's), their log order and gaps found chunk by chunk (`neighbours.in_chunks`)."""
    given = {"window_start": ws, "topic": tc.name, "run_id": run_id_for(tc.name, ws, as_of), "computed_at": as_of}
    anomalies = [a for p in parts for a in p.facts.anomalies] + [{**given, **a} for p in parts for a in p.coded.to_pylist()]
    narrow = pa.concat_tables([p.narrow for p in parts]) if parts else _no_narrow()
    latest = neighbours.latest_by_content(narrow)
    for p in parts:
        again = neighbours.resent(resendable(p.facts), latest)
        anomalies = oracle.without(anomalies, (row for (row, _, _), r in zip(p.facts.resendable, again, strict=True) if r))
    reordered, gaps = neighbours.in_chunks([p.narrow for p in parts])
    oracle.emit_neighbour_rows(oracle.anomaly_emitter(anomalies, tc.name, ws, as_of), reordered, gaps,
                               neighbours.content(narrow))
    ignored: dict[tuple[str, str], int] = {}
    for p in parts:
        for k, n in p.facts.ignored.items():
            ignored[k] = ignored.get(k, 0) + n
    partitions = set().union(*(p.facts.partitions for p in parts)) if parts else set()
    return result(tc, ws, as_of, partitions, merged_counts(parts), merged_histograms(parts), anomalies,
                  sum(p.facts.quarantined for p in parts), ignored)
