"""What the summary-first design (docs/design.md §5.9) would cost run Arrow-native: the window of a
`reconcile_scale.py` lake read as Arrow columns and every pass the reconciliation makes over all of
its rows done vectorised, timed pass by pass, side by side with Spark's scan baseline and Spark's
classification of the same window in the same run: what a classifier built that way could reach.

The passes, over the same files Spark's plan reads (its Delta scans' file lists, then pyarrow):

- read: the columns the rules use, then the oracle's visibility ranges;
- digests: per tier and block of 8 seqs of a pid, counts, the sum of each seq's bit and the sum of a
  64-bit mix of (seq, partition, offset[, produce time]) -- multiset sums where Spark's digests use
  OR and XOR, which Arrow's hash aggregation lacks -- joined across tiers into clean / local / dirty
  exactly as `spark_jobs/reconcile/blocks.py` decides;
- consumption order: each (group, partition)'s processings in (consume time, consume seq,
  consumer) order, the first processing of an offset below a higher one processed before it;
- log order: each (partition, pid)'s originals in offset order, a seq below the highest before it;
- gaps: each pid's present seqs (ledger or log), the seqs strictly between two consecutive ones;
- content: the originals' fingerprints shared by more than one message (dictionary-encoded: exact);
- latencies: the window's ledger, consumption and sink rows counted per (partition, latency);
- the exact path: the rows of the dirty blocks and the unaudited records, picked out, made the
  oracle's rows and classified by `audit.oracle` (timed only: its neighbour checks see just these
  rows, so it also emits the gaps between them, which a real split of the rules would not compute).

What it leaves out, and a real classifier would add: the neighbour checks' anomaly rows with their
detail texts, the report rows assembled from the clean blocks' counts and the exact path's, the
publishing. The neighbour checks' flags in the window are checked against the injected anomalies,
so the passes are the real ones, not empty loops.

    .venv/bin/python benchmarks/reconcile_scale.py --n 1000000 --anomaly-rate 0.0001 --history 2 --dir DIR
    .venv/bin/python benchmarks/arrow_settle.py --dir DIR --anomaly-rate 0.0001 --reps 3

This is a measurement script, not a test: it asserts nothing about time, it prints ratios.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import reconcile_scale as rs  # noqa: E402

BLOCK_BITS = 3
PID_SHIFT = 40  # seqs and offsets below 2^40


def _us(col: Any) -> np.ndarray:
    """A timestamp column as int64 microseconds (nulls as the minimum)."""
    arr = pc.cast(col, pa.timestamp("us"), safe=False).cast(pa.int64())
    return arr.fill_null(np.iinfo(np.int64).min).to_numpy()


def _int(col: Any, null: int = -1) -> np.ndarray:
    return pc.cast(col, pa.int64()).fill_null(null).to_numpy()


def _mix(*cols: np.ndarray) -> np.ndarray:
    """A 64-bit mix of int64 columns (splitmix64 over a running combination)."""
    h = np.zeros(len(cols[0]), dtype=np.uint64)
    with np.errstate(over="ignore"):
        for c in cols:
            h = (h ^ c.astype(np.uint64)) * np.uint64(0x9E3779B97F4A7C15)
            h ^= h >> np.uint64(31)
            h = h * np.uint64(0xBF58476D1CE4E5B9)
            h ^= h >> np.uint64(29)
    return h


def _prev_max(segment: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Per row of rows sorted by `segment`, the maximum of `values` (>= 0) over the rows before it in
    its segment, -1 for a segment's first row: one running maximum over dense segment number * span
    + value (segments in ascending order, so a segment's rows outweigh every earlier one's)."""
    if not len(values):
        return values.copy()
    first = np.ones(len(segment), dtype=bool)
    first[1:] = segment[1:] != segment[:-1]
    dense = np.cumsum(first) - 1
    span = int(values.max()) + 1
    if int(dense[-1]) * span >= 2**62:
        raise OverflowError("too many segments for one running maximum")
    base = dense * span
    run = np.maximum.accumulate(base + values)
    prev = np.empty_like(run)
    prev[1:] = run[:-1] - base[1:]
    prev[first] = -1
    return prev


def files(df: Any) -> list[str]:
    return [f.removeprefix("file:") for f in df.inputFiles()]


def read(spark: Any, cfg: Any) -> dict[str, list[str]]:
    """The files Spark's plan reads for the window, per table (Delta's snapshot, partitions pruned)."""
    from spark_jobs.reconcile import read_window_inputs

    tc = cfg.topic(rs.TOPIC)
    vis = read_window_inputs(spark, cfg, tc, rs.WINDOW)
    assert vis.consumed is not None
    return {"ledger": files(vis.ledger), "log": files(vis.log), "consumed": files(vis.consumed),
            "sink": files(next(iter(vis.sinks.values())))}


def settle(paths: dict[str, list[str]], cfg: Any, timer: Callable[[str], None]) -> dict[str, Any]:
    """The passes over the window's files (`read`), timed by `timer(pass)` as each ends; what they
    found. Each (topic) partition's rows are taken one partition at a time for the digests, the
    order of consumption and the latencies -- what one task per partition would hold -- and only
    narrow columns (block keys, the originals' positions, the present seqs) are kept for all."""
    from audit.core.windows import read_ranges

    tc = cfg.topic(rs.TOPIC)
    rr = read_ranges(tc, rs.WINDOW)
    ws, we = (int(t.timestamp() * 1e6) for t in (rs.WINDOW, rs.WINDOW + tc.window))

    def between(col: Any, lo: Any, hi: Any) -> Any:
        return (col >= pa.scalar(lo, pa.timestamp("us", "UTC"))) & (col < pa.scalar(hi, pa.timestamp("us", "UTC")))

    def table(name: str, cols: list[str], where: Any) -> pa.Table:
        return ds.dataset(paths[name], format="parquet").to_table(columns=cols, filter=where, use_threads=True)

    f = pc.field
    # the oracle's visibility, evaluated by the scan
    led = table("ledger", ["pid", "seq", "partition", "offset", "status", "produce_ts", "ack_ts"],
                between(f("produce_ts"), rr.message_lo, rr.message_hi))
    log = table("log", ["partition", "offset", "pid", "seq", "produce_ts", "kafka_ts", "captured_at",
                        "fingerprint", "committed", "header_error"],
                between(pc.coalesce(f("produce_ts"), f("kafka_ts"), f("captured_at")), rr.message_lo, rr.message_hi))
    con = table("consumed", ["group", "consumer", "consume_seq", "partition", "offset", "pid", "seq",
                             "outcome", "consume_ts", "produce_ts"], between(f("consume_ts"), rr.event_lo, rr.event_hi))
    snk = table("sink", ["audit_partition", "audit_offset", "audit_pid", "audit_seq", "audit_sink_ts",
                         "audit_produce_ts"], between(f("audit_sink_ts"), rr.event_lo, rr.event_hi))
    rows = led.num_rows + log.num_rows + con.num_rows + snk.num_rows
    timer("read")

    pids = pc.unique(pa.chunked_array(led["pid"].chunks + log["pid"].drop_null().chunks))
    groups, consumers = pc.unique(con["group"]), pc.unique(con["consumer"])
    tables = {"ledger": led, "log": log, "consumed": con, "sink": snk}
    part_col = {"ledger": "partition", "log": "partition", "consumed": "partition", "sink": "audit_partition"}
    # each table's row numbers by partition (a stable sort of the partition column)
    by_part: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
    for name, t in tables.items():
        part = _int(t[part_col[name]])
        order = np.argsort(part, kind="stable")
        values, starts = np.unique(part[order], return_index=True)
        by_part[name] = (order, values, np.append(starts, len(order)))
    partitions = sorted(set().union(*(set(v[1].tolist()) for v in by_part.values())))
    # per row of each table: its block key (-1: no audited pid), filled partition by partition
    block_of = {name: np.full(t.num_rows, -1, dtype=np.int64) for name, t in tables.items()}
    digests: dict[str, list[pa.Table]] = {"L": [], "R": [], "C": [], "S": []}
    latencies: list[pa.Table] = []
    c_in = 0
    narrow_log: list[np.ndarray] = []
    present: list[np.ndarray] = []
    present_pt: list[np.ndarray] = []

    def digest(t: dict[str, np.ndarray], keep: np.ndarray, h: np.ndarray, extra: dict[str, np.ndarray]) -> pa.Table:
        m = keep & (t["k"] >= 0)
        cols = {"k": t["k"][m], "bit": (np.int64(1) << (t["seq"][m] & ((1 << BLOCK_BITS) - 1))),
                "h": h[m].view(np.int64), **{c: v[m] for c, v in extra.items()}}
        aggs = [("bit", "count"), ("bit", "sum"), ("h", "sum")] + [(c, "sum") for c in extra]
        return pa.table(cols).group_by("k").aggregate(aggs).select(["k"] + [f"{c}_{fn}" for c, fn in aggs])

    def lat_counts(part: np.ndarray, pt: np.ndarray, done: np.ndarray, keep: np.ndarray, stage: int) -> pa.Table:
        m = keep & (pt >= ws) & (pt < we)
        t = pa.table({"s": np.full(int(m.sum()), stage), "p": part[m], "lat": done[m] - pt[m]})
        return t.group_by(["s", "p", "lat"]).aggregate([("lat", "count")])

    def code(col: Any) -> np.ndarray:
        return _int(pc.index_in(col, value_set=pids))

    def slice_of(name: str, p: int) -> tuple[np.ndarray, pa.Table]:
        order, values, bounds = by_part[name]
        i = np.searchsorted(values, p)
        if i == len(values) or values[i] != p:
            idx = np.empty(0, dtype=np.int64)
        else:
            idx = order[bounds[i]:bounds[i + 1]]
        return idx, tables[name].take(pa.array(idx))

    for p in partitions:
        li, lt = slice_of("ledger", p)
        ri, rt = slice_of("log", p)
        ci, ct = slice_of("consumed", p)
        si, st = slice_of("sink", p)
        timer("partition slices")

        L = {"pid": code(lt["pid"]), "seq": _int(lt["seq"]), "part": _int(lt["partition"]),
             "off": _int(lt["offset"]), "pt": _us(lt["produce_ts"]), "ack": _us(lt["ack_ts"])}
        acked = pc.equal(lt["status"], "acked").fill_null(False).to_numpy(zero_copy_only=False)
        valid = pc.and_(pc.is_valid(rt["pid"]), pc.is_null(rt["header_error"])).fill_null(False) \
            .to_numpy(zero_copy_only=False)
        R = {"pid": code(rt["pid"]), "seq": _int(rt["seq"]), "part": _int(rt["partition"]),
             "off": _int(rt["offset"]), "pt": _us(rt["produce_ts"])}
        ok = rt["committed"].fill_null(False).to_numpy(zero_copy_only=False)
        procd = pc.equal(ct["outcome"], "processed").fill_null(False).to_numpy(zero_copy_only=False)
        C = {"pid": code(ct["pid"]), "seq": _int(ct["seq"]), "part": _int(ct["partition"]),
             "off": _int(ct["offset"]), "pt": _us(ct["produce_ts"]), "ts": _us(ct["consume_ts"])}
        S = {"pid": code(st["audit_pid"]), "seq": _int(st["audit_seq"]), "part": _int(st["audit_partition"]),
             "off": _int(st["audit_offset"]), "pt": _us(st["audit_produce_ts"]), "ts": _us(st["audit_sink_ts"])}
        for t, name, idx in ((L, "ledger", li), (R, "log", ri), (C, "consumed", ci), (S, "sink", si)):
            t["k"] = np.where((t["pid"] >= 0) & (t["seq"] >= 0),
                              (t["pid"] << PID_SHIFT) | (np.maximum(t["seq"], 0) >> BLOCK_BITS), -1)
            block_of[name][idx] = t["k"]
        timer("columns and keys")

        # digests: partial per partition (they add up across partitions)
        everything = np.ones(len(L["seq"]), dtype=bool)
        digests["L"].append(digest(L, everything, _mix(L["seq"], L["part"], L["off"], L["pt"]),
                                   {"acked": acked.astype(np.int64),
                                    "h3": _mix(L["seq"], L["part"], L["off"]).view(np.int64)}))
        digests["R"].append(digest(R, valid, _mix(R["seq"], R["part"], R["off"], R["pt"]),
                                   {"ok": ok.astype(np.int64)}))
        digests["C"].append(digest(C, procd, _mix(C["seq"], C["part"], C["off"]),
                                   {"hp": _mix(C["seq"], C["part"], C["off"], C["pt"]).view(np.int64)}))
        digests["S"].append(digest(S, np.ones(len(S["seq"]), dtype=bool),
                                   _mix(S["seq"], S["part"], S["off"], S["pt"]), {}))
        timer("digests")

        # consumption order: per group of the partition, in (consume_ts, consume_seq, consumer) order
        q = np.flatnonzero(procd)
        seg = _int(pc.index_in(ct["group"], value_set=groups))[q]
        order = np.lexsort((_int(pc.index_in(ct["consumer"], value_set=consumers))[q],
                            _int(ct["consume_seq"])[q], C["ts"][q], seg))
        off_q = C["off"][q]
        seg_o, off_o = seg[order], off_q[order]
        rank = np.empty(len(order), dtype=np.int64)
        rank[order] = np.arange(len(order))
        by_off = np.lexsort((rank, off_q, seg))  # the first processing of each (group, offset) heads its run
        head = np.ones(len(by_off), dtype=bool)
        head[1:] = (seg[by_off][1:] != seg[by_off][:-1]) | (off_q[by_off][1:] != off_q[by_off][:-1])
        firsts = np.zeros(len(order), dtype=bool)
        firsts[rank[by_off[head]]] = True
        back = q[order[firsts & (off_o < _prev_max(seg_o, off_o))]]
        c_in += int(np.sum((C["pt"][back] >= ws) & (C["pt"][back] < we)))
        timer("consumption order")

        latencies.extend([lat_counts(L["part"], L["pt"], L["ack"], acked, 0),
                          lat_counts(C["part"], C["pt"], C["ts"], procd, 1),
                          lat_counts(S["part"], S["pt"], S["ts"], np.ones(len(S["pt"]), dtype=bool), 2)])
        timer("latencies")

        # narrow rows kept for all partitions: the log's valid committed copies, the present seqs
        v = np.flatnonzero(valid & ok)
        narrow_log.append(np.stack([R["pid"][v], R["seq"][v], R["part"][v], R["off"][v], R["pt"][v], ri[v]]))
        present += [(L["pid"] << PID_SHIFT) | L["seq"], (R["pid"][valid] << PID_SHIFT) | R["seq"][valid]]
        present_pt += [L["pt"], R["pt"][valid]]
        timer("narrow rows")

    def combined(parts: list[pa.Table], prefix: str) -> pa.Table:
        t = pa.concat_tables(parts)
        names = [c for c in t.column_names if c != "k"]
        t = t.group_by("k").aggregate([(c, "sum") for c in names]).select(["k"] + [f"{c}_sum" for c in names])
        return t.rename_columns(["k"] + [f"{prefix}{i}" for i in range(len(names))])

    dL, dR, dC, dS = (combined(digests[x], x) for x in "LRCS")
    j = dL.join(dR, "k", join_type="full outer").join(dC, "k", join_type="left outer").join(dS, "k", join_type="left outer")

    def col(name: str) -> np.ndarray:
        return _int(j[name], 0)

    nL, bL, hL, aL, h3L = (col(f"L{i}") for i in range(5))
    nR, bR, hR, oR = (col(f"R{i}") for i in range(4))
    nC, bC, hC, pC = (col(f"C{i}") for i in range(4))
    nS, bS, hS = (col(f"S{i}") for i in range(3))
    clean = ((aL == nL) & (nR == nL) & (bR == bL) & (hR == hL) & (oR == nL)
             & (nC == nL) & (bC == bL) & (hC == h3L) & (nS == nL) & (bS == bL))
    local = clean & (pC == hL) & (hS == hL)
    blocks = j.num_rows
    distinct = pa.concat_tables(latencies).group_by(["s", "p", "lat"]).aggregate([("lat_count", "sum")]).num_rows
    timer("digests")

    # --- originals: each (pid, seq)'s committed valid copy at the lowest (partition, offset); the log
    # order per (partition, pid), in offset order
    pid_, seq_, part_, off_, pt_, row_ = np.concatenate(narrow_log, axis=1)
    o = np.lexsort((off_, part_, seq_, pid_))
    first = np.ones(len(o), dtype=bool)
    first[1:] = (pid_[o][1:] != pid_[o][:-1]) | (seq_[o][1:] != seq_[o][:-1])
    orig = o[first]
    lo_ = orig[np.lexsort((off_[orig], pid_[orig], part_[orig]))]
    reord = seq_[lo_] < _prev_max((part_[lo_] << 24) | pid_[lo_], seq_[lo_])
    r_in = int(np.sum((pt_[lo_][reord] >= ws) & (pt_[lo_][reord] < we)))
    timer("log order")

    # --- gaps: per pid, between consecutive present seqs (ledger or log); a gap belongs to the window
    # of the next present seq (its produce time: the least of its ledger and log rows')
    keys, pts = np.concatenate(present), np.concatenate(present_pt)
    by_key = np.argsort(keys, kind="stable")
    ks = keys[by_key]
    starts = np.flatnonzero(np.concatenate([[True], ks[1:] != ks[:-1]]))
    uniq, pt_min = ks[starts], np.minimum.reduceat(pts[by_key], starts)
    nxt, cur = uniq[1:], uniq[:-1]
    gap = ((nxt >> PID_SHIFT) == (cur >> PID_SHIFT)) & (nxt - cur > 1) & (pt_min[1:] >= ws) & (pt_min[1:] < we)
    gaps = int(np.sum((nxt - cur - 1)[gap]))
    timer("gaps")

    # --- content duplicates: originals sharing a fingerprint, every message but the first in
    # (produce time, pid, seq) order
    idx = pc.dictionary_encode(log["fingerprint"].take(pa.array(row_[orig]))).combine_chunks() \
        .indices.to_numpy(zero_copy_only=False)
    shared = np.flatnonzero(np.bincount(idx)[idx] > 1)
    dup, sdx = orig[shared], idx[shared]
    oc = np.lexsort((seq_[dup], pid_[dup], pt_[dup], sdx))
    later = np.zeros(len(oc), dtype=bool)
    later[1:] = sdx[oc][1:] == sdx[oc][:-1]
    d_pt = pt_[dup[oc][later]]
    content = int(np.sum((d_pt >= ws) & (d_pt < we)))
    timer("content")

    # --- the exact path's rows: the dirty blocks' and the unaudited records'
    dirty_keys = pa.array(j["k"].to_numpy()[~clean])
    exact = {name: t.filter(pa.array(pc.is_in(pa.array(block_of[name]), value_set=dirty_keys)
                                     .to_numpy(zero_copy_only=False) | (block_of[name] < 0)))
             for name, t in tables.items()}
    exact_rows = sum(t.num_rows for t in exact.values())
    timer("dirty rows")

    # --- the exact path's per-unit rules: the oracle over those rows (timed only: its neighbour
    # checks see just these rows, where the passes above saw all)
    from audit import oracle
    from spark_jobs.reconcile.driver import _values

    topic = rs.TOPIC
    fields_of = {oracle.LedgerRow: exact["ledger"].column_names, oracle.LogRecord: exact["log"].column_names,
                 oracle.ConsumedRow: exact["consumed"].column_names,
                 oracle.SinkRow: [c.removeprefix("audit_") for c in exact["sink"].column_names]}

    def rows_of(tbl: pa.Table, cls: type) -> list[Any]:
        names = fields_of[cls]
        return [cls(**dict(zip(names, v, strict=True)), topic=topic)
                for v in zip(*(_values(tbl.column(c)) for c in tbl.column_names), strict=True)]

    inputs = oracle.Inputs(ledger=rows_of(exact["ledger"], oracle.LedgerRow),
                           log=rows_of(exact["log"], oracle.LogRecord),
                           consumed=rows_of(exact["consumed"], oracle.ConsumedRow),
                           sinks={tc.sinks[0].name: rows_of(exact["sink"], oracle.SinkRow)})
    anomalies = oracle.reconcile_window(tc, rs.WINDOW, rs.AS_OF, inputs).anomalies
    timer("exact path (oracle)")
    return {"rows": rows, "blocks": blocks, "dirty": blocks - int(np.sum(clean)), "local": int(np.sum(local)),
            "exact_rows": exact_rows, "reordered_in_consumption": c_in, "reordered_in_log": r_in,
            "seq_gap": gaps, "content_duplicate": content, "latency_counts": distinct,
            "oracle_anomalies": sum(a["anomaly"] != "seq_gap" for a in anomalies)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", required=True, help="a work folder `reconcile_scale.py --history 2 --generate-only --dir` generated")
    ap.add_argument("--n", type=int, required=True, help="messages in its window (its --n)")
    ap.add_argument("--partitions", type=int, default=8, help="its --partitions (default 8)")
    ap.add_argument("--anomaly-rate", type=float, default=0.001, help="the rate it was generated with")
    ap.add_argument("--reps", type=int, default=3, help="timed rounds of the three sides, alternating (medians)")
    ap.add_argument("--conf", action="append", default=[], metavar="KEY=VALUE", help="extra Spark setting")
    args = ap.parse_args(argv)
    rs.set_anomaly_rate(args.anomaly_rate)
    work = Path(args.dir)
    cfg = rs.bench_config(work, conf=args.conf)
    as_of = rs.AS_OF
    from spark_jobs.io.session import build_spark
    from spark_jobs.reconcile import reconcile_window

    spark = build_spark(cfg, app_name="msgaudit-arrow-settle")
    paths = read(spark, cfg)
    n = args.n
    print(f"{work}: {sum(map(len, paths.values()))} files; window of {n:,} messages; {args.reps} rounds")
    rs.scan_baseline(spark, cfg)
    reconcile_window(spark, cfg, rs.TOPIC, rs.WINDOW, as_of, publish=False).release()
    settle(paths, cfg, lambda _: None)

    scans: list[float] = []
    spark_cls: list[float] = []
    arrow: list[float] = []
    passes: dict[str, list[float]] = {}
    found: dict[str, Any] = {}
    spent: dict[str, float] = {}
    for _ in range(args.reps):
        scans.append(rs.scan_baseline(spark, cfg)[0])
        t = time.perf_counter()
        reconcile_window(spark, cfg, rs.TOPIC, rs.WINDOW, as_of, publish=False).release()
        spark_cls.append(time.perf_counter() - t)
        t0 = last = time.perf_counter()

        spent.clear()

        def timer(name: str) -> None:
            nonlocal last
            now = time.perf_counter()
            spent[name] = spent.get(name, 0.0) + now - last
            last = now

        found = settle(paths, cfg, timer)
        for name, secs in spent.items():
            passes.setdefault(name, []).append(secs)
        arrow.append(time.perf_counter() - t0)
    med = statistics.median
    print(f"input rows {found['rows']:,}; blocks {found['blocks']:,}, dirty {found['dirty']:,} "
          f"(local {found['local']:,}); rows of dirty blocks and unaudited records {found['exact_rows']:,}; "
          f"distinct (stage, partition, latency) {found['latency_counts']:,}; the oracle's anomaly rows on "
          f"those rows, gaps aside (the blocks between them are not there) {found['oracle_anomalies']:,}")
    print("Arrow-native passes (medians):")
    for name, ts in passes.items():
        print(f"  {name:20s} {med(ts):6.2f}s")
    expected = rs.expected_counts(n, args.partitions, 2)  # `--history 2`: hour 1 is the lookback, hour 2 the window
    ok = True
    for code_ in ("reordered_in_consumption", "reordered_in_log", "seq_gap", "content_duplicate"):
        good = found[code_] == expected[code_]
        ok &= good
        print(f"  {code_:26s} expected {expected[code_]:7,d}  found {found[code_]:7,d}")
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"peak RSS of this Python process (the Arrow side): {rss:,.0f} MB")
    print(f"Spark scan baseline {med(scans):.1f}s, Spark classification {med(spark_cls):.1f}s, "
          f"Arrow-native passes {med(arrow):.1f}s (medians of {args.reps})")
    print(f"arrow passes / spark scan      : {med(arrow) / med(scans):.2f}")
    print(f"spark classification / scan    : {med(spark_cls) / med(scans):.2f}")
    print(f"arrow passes / spark classify  : {med(arrow) / med(spark_cls):.2f}  "
          f"(order checks {'exact' if ok else 'NOT EXACT'})")
    spark.stop()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
