"""The checks that need other messages' rows (docs/design.md §5.1, §5.2), vectorised: each takes a
table holding every row it needs and returns what it found, as the oracle's `emit_neighbour_rows`
and `reordered_in_consumption` state it.

- `consumption_order`: per (group, partition), the processings in (consume time, consume seq,
  consumer, offset) order; each first processing of an offset below the highest offset processed
  before it (`reordered_in_consumption`).
- `log_order`: per (partition, pid), the originals in (offset, seq) order; each one of the window
  whose seq is below the highest before it (`reordered_in_log`).
- `gaps`: per pid, consecutive present seqs with seqs missing between them, the later in the window
  (`seq_gap`).
- `content`: originals sharing a fingerprint, in (produce time, pid, seq) order; each one of the
  window but the first (`content_duplicate`). Fingerprints are compared by two 64-bit hashes of
  different bases (`FINGERPRINT_BASES`): equal strings always match, different ones would need
  both hashes to collide.
- `resent`: a failed send whose fingerprint an original holds, produced at or after it, was resent
  by the application (no `failed_send`); `latest_by_content` gives each fingerprint's latest
  original.

The narrow rows (`NARROW`) are one per message: its pid and seq, whether it has a ledger row or a
log record (`present`), its original copy's partition (-1: none) and offset, its produce time
(microseconds), whether it is in the window, and its original's fingerprint hashes (null: none).
A Spark task calls these on the rows of its group (a partition, a pid, a range of hashes); the
driver on a whole small window. Pure functions: no pyspark, no I/O.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from audit.rules.columns import bools, codes_in, hash64, ints, prev_max, sorted_distinct

NARROW = pa.schema([("pid", pa.string()), ("seq", pa.int64()), ("present", pa.bool_()), ("partition", pa.int64()),
                    ("offset", pa.int64()), ("pt", pa.int64()), ("win", pa.bool_()), ("fp1", pa.int64()),
                    ("fp2", pa.int64())])
FINGERPRINT_BASES = (0x100000001B3, 0x9E3779B97F4A7C15 | 1)
_NO_CSEQ = -(2**62)  # a missing consume seq sorts first, as the oracle's key puts it


def fingerprint_hashes(fps: Any) -> tuple[pa.Array, pa.Array]:
    """The two hashes of each fingerprint (null where it is null), as int64 columns of NARROW."""
    fps = fps.combine_chunks() if isinstance(fps, pa.ChunkedArray) else fps
    valid = pc.is_valid(fps)
    out = []
    for base in FINGERPRINT_BASES:
        h = hash64(fps, base).view(np.int64)
        out.append(pc.if_else(valid, pa.array(h, pa.int64()), pa.scalar(None, pa.int64())))
    return out[0], out[1]


def _codes(strings: Any) -> tuple[np.ndarray, list[str]]:
    """Each string's place among the distinct ones in sorted order (-1: null), and those strings."""
    names = sorted_distinct(strings)
    return codes_in(strings, names), names.to_pylist()


def _firsts(*keys: np.ndarray) -> np.ndarray:
    """For rows sorted by `keys`, whether each starts a run of equal keys."""
    n = len(keys[0])
    first = np.ones(n, dtype=bool)
    if n:
        first[1:] = np.logical_or.reduce([k[1:] != k[:-1] for k in keys])
    return first


def consumption_order(rows: pa.Table) -> np.ndarray:
    """A mask over `rows` (processings: group, partition, consumer, consume_seq, offset, consume_ts
    in microseconds or as timestamps; perhaps topic) flagging each first processing of an offset below the highest
    offset its (group, partition) processed before it."""
    from audit.rules.columns import us

    out = np.zeros(rows.num_rows, dtype=bool)
    if not rows.num_rows:
        return out
    group, _ = _codes(rows["group"])
    if "topic" in rows.column_names:  # rows of several topics: a (group, partition) of each
        topic, _ = _codes(rows["topic"])
        group = topic * (int(group.max()) + 1) + group
    consumer, _ = _codes(rows["consumer"])
    part, off = ints(rows["partition"]), ints(rows["offset"])
    cseq = ints(rows["consume_seq"], _NO_CSEQ)
    ts = us(rows["consume_ts"]) if pa.types.is_timestamp(rows.schema.field("consume_ts").type) else ints(rows["consume_ts"])
    order = np.lexsort((off, consumer, cseq, ts, part, group))
    g, p, o = group[order], part[order], off[order]
    seg = np.cumsum(_firsts(g, p)) - 1
    back = np.flatnonzero((o < prev_max(seg, np.maximum(o, 0))) & (o >= 0))
    if not len(back):
        return out
    # only the first processing of each (group, partition, offset) counts: looked at among the rows
    # of the offsets that went back
    at = np.flatnonzero(np.isin(o, o[back]))
    by_off = at[np.lexsort((at, o[at], seg[at]))]
    head = _firsts(seg[by_off], o[by_off])
    first = np.zeros(len(order), dtype=bool)
    first[by_off[head]] = True
    out[order[back[first[back]]]] = True
    return out


def _log_highs(orig: pa.Table) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[str], np.ndarray]:
    """For originals (partition >= 0): their (partition, pid, offset, seq) order; per row, whether
    its (partition, pid) has rows at lower positions and the highest seq among them; the pids'
    names and codes."""
    pid, names = _codes(orig["pid"])
    part, off, seq = ints(orig["partition"]), ints(orig["offset"]), ints(orig["seq"])
    order = np.lexsort((seq, off, pid, part))
    low = int(seq.min())
    h = prev_max(np.cumsum(_firsts(part[order], pid[order])) - 1, seq[order] - low)
    has, high = np.zeros(len(order), dtype=bool), np.zeros(len(order), dtype=np.int64)
    has[order], high[order] = h >= 0, h + low
    return order, has, high, names, pid


def log_order(narrow: pa.Table) -> list[tuple[str, int, int, int, int]]:
    """(pid, seq, partition, offset, the highest seq before it) of each original of the window
    whose seq is below the highest seq of its (partition, pid) at lower positions."""
    orig = narrow.filter(pc.greater_equal(narrow["partition"], 0))
    if not orig.num_rows:
        return []
    order, has, high, names, pid = _log_highs(orig)
    seq, win = ints(orig["seq"]), bools(orig["win"])
    late = order[(has & (seq < high) & win)[order]]
    part, off = ints(orig["partition"]), ints(orig["offset"])
    return [(names[c], q, pp, o, h) for c, q, pp, o, h in
            zip(pid[late].tolist(), seq[late].tolist(), part[late].tolist(), off[late].tolist(), high[late].tolist(),
                strict=True)]


def gaps(narrow: pa.Table) -> list[tuple[str, int, int]]:
    """(pid, a, b) for consecutive present seqs a < b of a pid with b - a > 1, b in the window."""
    present = narrow.filter(narrow["present"])
    if not present.num_rows:
        return []
    pid, names = _codes(present["pid"])
    seq, win = ints(present["seq"]), bools(present["win"])
    order = np.lexsort((seq, pid))
    c, s, w = pid[order], seq[order], win[order]
    at = np.flatnonzero((c[1:] == c[:-1]) & (s[1:] - s[:-1] > 1) & w[1:])
    return [(names[k], a, b) for k, a, b in zip(c[at].tolist(), s[at].tolist(), s[at + 1].tolist(), strict=True)]


# ---------------------------------------------------------------------------- a window in chunks
# A window cut into chunks by seq range (chunk k's seqs all below chunk k + 1's, for every pid) has
# its log order and gaps found chunk by chunk: each chunk alone (`alone`), plus what crosses the
# cuts, from each chunk's bounds and the few rows they point at (`log_order_part`), in the few
# chunks whose offsets reach into another's (`crossing`).
BOUNDS = pa.schema([("chunk", pa.int64()), ("pid", pa.string()), ("partition", pa.int64()), ("lo", pa.int64()),
                    ("hi", pa.int64()), ("win", pa.bool_())])
_FAR = 2**62
FLAGGED = pa.schema([("pid", pa.string()), ("seq", pa.int64()), ("partition", pa.int64()), ("offset", pa.int64()),
                     ("high", pa.int64())])


def alone(narrow: pa.Table, chunk: int) -> tuple[pa.Table, list[tuple[str, int, int]], pa.Table]:
    """A chunk looked at alone, as its Spark task does, from one sort of its originals and one of its
    present messages: its bounds (BOUNDS: per (pid, partition) of its originals, the lowest and
    highest offset; per pid of its present messages (partition -1), the lowest seq (and whether it
    is in the window) and the highest), its gaps (`gaps`) and the originals of the window its own
    rows flag (FLAGGED: a seq below the highest before it in the chunk, `high`)."""
    pid, names = _codes(narrow["pid"])
    name = np.array([*names, None], dtype=object)  # a null pid (code -1) keeps its null
    seq, part, off = ints(narrow["seq"]), ints(narrow["partition"]), ints(narrow["offset"])
    win, present = bools(narrow["win"]), bools(narrow["present"])
    cols: dict[str, list[Any]] = {c: [] for c in BOUNDS.names}
    flagged = FLAGGED.empty_table()
    at = np.flatnonzero(part >= 0)
    if len(at):
        order = at[np.lexsort((seq[at], off[at], pid[at], part[at]))]
        first = _firsts(part[order], pid[order])
        last = np.append(first[1:], True)
        low = int(seq[order].min())
        high = prev_max(np.cumsum(first) - 1, seq[order] - low) + low
        late = (high >= low) & (seq[order] < high) & win[order]
        rows = order[late]
        flagged = pa.table({"pid": pa.array(name[pid[rows]], pa.string()), "seq": seq[rows], "partition": part[rows],
                            "offset": off[rows], "high": high[late]}, schema=FLAGGED)
        for col, v in (("pid", name[pid[order[first]]]), ("partition", part[order[first]]), ("lo", off[order[first]]),
                       ("hi", off[order[last]]), ("win", np.full(int(first.sum()), None))):
            cols[col].append(v)
    found: list[tuple[str, int, int]] = []
    at = np.flatnonzero(present)
    if len(at):
        order = at[np.lexsort((seq[at], pid[at]))]
        who, seqs, wins = pid[order], seq[order], win[order]
        first = _firsts(who)
        last = np.append(first[1:], True)
        gap = np.flatnonzero((who[1:] == who[:-1]) & (seqs[1:] - seqs[:-1] > 1) & wins[1:])
        found = [(names[k], a, b) for k, a, b in zip(who[gap].tolist(), seqs[gap].tolist(), seqs[gap + 1].tolist(),
                                                      strict=True)]
        for col, v in (("pid", name[who[first]]), ("partition", np.full(int(first.sum()), -1)), ("lo", seqs[first]),
                       ("hi", seqs[last]), ("win", wins[first])):
            cols[col].append(v)
    n = sum(len(v) for v in cols["pid"])
    cols["chunk"] = [np.full(n, chunk, np.int64)]
    return (pa.table({f.name: pa.array(np.concatenate(cols[f.name]) if cols[f.name] else [], f.type) for f in BOUNDS},
                     schema=BOUNDS), found, flagged)


def gaps_across(every: pa.Table) -> list[tuple[str, int, int]]:
    """(pid, a, b) of the gaps across cuts: a the highest present seq of a pid in one chunk, b its
    lowest in the next chunk that has one, b - a > 1, b in the window (`every`: all chunks' bounds)."""
    rows = every.filter(pc.equal(every["partition"], -1))
    if not rows.num_rows:
        return []
    pid, names = _codes(rows["pid"])
    chunk, lo, hi, win = ints(rows["chunk"]), ints(rows["lo"]), ints(rows["hi"]), bools(rows["win"])
    order = np.lexsort((chunk, pid))
    c, lo, hi, w = pid[order], lo[order], hi[order], win[order]
    at = np.flatnonzero((c[1:] == c[:-1]) & (lo[1:] - hi[:-1] > 1) & w[1:])
    return [(names[k], a, b) for k, a, b in zip(c[at].tolist(), hi[at].tolist(), lo[at + 1].tolist(), strict=True)]


def around(every: pa.Table) -> pa.Table:
    """Per chunk and (pid, partition) of its originals (from all chunks' bounds): the lowest offset
    in the later chunks (`after`) and the highest in the earlier ones (`before`), null where none."""
    rows = every.filter(pc.greater_equal(every["partition"], 0))
    if not rows.num_rows:
        return pa.table({"chunk": pa.array([], pa.int64()), "pid": pa.array([], pa.string()),
                         "partition": pa.array([], pa.int64()), "after": pa.array([], pa.int64()),
                         "before": pa.array([], pa.int64())})
    pid, _ = _codes(rows["pid"])
    chunk, part, lo, hi = ints(rows["chunk"]), ints(rows["partition"]), ints(rows["lo"]), ints(rows["hi"])
    order = np.lexsort((chunk, part, pid))
    seg = np.cumsum(_firsts(pid[order], part[order])) - 1
    before = prev_max(seg, hi[order])
    rev = order[::-1]
    seg_r = seg[::-1]
    after = prev_max(seg_r, _FAR - lo[rev])  # its segments run backwards: still each in one run
    after_r = np.where(after >= 0, _FAR - after, -1)[::-1]
    taken = rows.take(pa.array(order))
    return pa.table({"chunk": taken["chunk"], "pid": taken["pid"], "partition": taken["partition"],
                     "after": pc.if_else(pa.array(after_r >= 0), pa.array(after_r), pa.scalar(None, pa.int64())),
                     "before": pc.if_else(pa.array(before >= 0), pa.array(before), pa.scalar(None, pa.int64()))})


def log_order_part(narrow: pa.Table, near: pa.Table) -> tuple[pa.Table, pa.Table]:
    """One chunk's part of the log order, given its `around` rows (`near`): the originals of the
    window it flags (FLAGGED; `high` the highest seq before it in this chunk, null: none) -- a seq
    below that, or an offset above a later chunk's lowest -- and its rows at offsets below an earlier
    chunk's highest (FLAGGED's columns, `high` null): the only ones a flagged row of an earlier chunk
    can find before it."""
    orig = narrow.filter(pc.greater_equal(narrow["partition"], 0))
    if not orig.num_rows:
        return FLAGGED.empty_table(), FLAGGED.empty_table()
    orig = orig.select(["pid", "seq", "partition", "offset", "win"])
    _, has, high, _, _ = _log_highs(orig)
    orig = orig.append_column("high", pc.if_else(pa.array(has), pa.array(high), pa.scalar(None, pa.int64())))
    if near.num_rows:
        orig = orig.join(near.select(["pid", "partition", "after", "before"]), ["pid", "partition"])
    else:
        orig = orig.append_column("after", pa.nulls(orig.num_rows, pa.int64())) \
            .append_column("before", pa.nulls(orig.num_rows, pa.int64()))
    seq, off, win = ints(orig["seq"]), ints(orig["offset"]), bools(orig["win"])
    has, high = bools(pc.is_valid(orig["high"])), ints(orig["high"], 0)
    after, before = ints(orig["after"], _FAR), ints(orig["before"], -1)
    flagged = orig.filter(pa.array(win & ((has & (seq < high)) | (off > after))))
    stairs = orig.filter(pa.array(off < before))
    return (flagged.select(FLAGGED.names).cast(FLAGGED),
            stairs.select(FLAGGED.names[:4]).append_column("high", pa.nulls(stairs.num_rows, pa.int64())).cast(FLAGGED))


def log_order_across(flagged: pa.Table, stairs: pa.Table) -> list[tuple[str, int, int, int, int]]:
    """`log_order`'s rows from every chunk's `log_order_part` (each table with its `chunk`): a
    flagged row's highest seq before it is the larger of its chunk's and that of the later chunks'
    rows at lower offsets of its (partition, pid)."""
    later: dict[tuple[str, int], dict[int, tuple[np.ndarray, np.ndarray]]] = {}
    if stairs.num_rows:
        pid, names = _codes(stairs["pid"])
        part, off, seq, chunk = ints(stairs["partition"]), ints(stairs["offset"]), ints(stairs["seq"]), ints(stairs["chunk"])
        order = np.lexsort((off, chunk, part, pid))
        firsts = np.flatnonzero(_firsts(pid[order], part[order], chunk[order]))
        for a, b in zip(firsts.tolist(), [*firsts[1:].tolist(), len(order)], strict=True):
            at = order[a:b]
            later.setdefault((names[pid[at[0]]], int(part[at[0]])), {})[int(chunk[at[0]])] = (
                off[at], np.maximum.accumulate(seq[at]))
    out = []
    for r in sorted(flagged.to_pylist(), key=lambda r: (r["partition"], r["pid"], r["offset"], r["seq"])):
        highs = [] if r["high"] is None else [r["high"]]
        for c, (offs, runs) in later.get((r["pid"], r["partition"]), {}).items():
            k = int(np.searchsorted(offs, r["offset"]))  # the rows at lower offsets
            if c > r["chunk"] and k:
                highs.append(int(runs[k - 1]))
        out.append((r["pid"], r["seq"], r["partition"], r["offset"], max(highs)))
    return out


def crossing(every: pa.Table) -> list[int]:
    """The chunks (from all chunks' bounds) whose log order reaches into another chunk: some (pid,
    partition) of theirs has an offset above a later chunk's lowest or below an earlier chunk's
    highest. Only these need `log_order_part` with their `around` rows: every other chunk's own part
    (`log_order_part` with no `around` rows) is already the whole of it."""
    rows = every.filter(pc.greater_equal(every["partition"], 0))
    if not rows.num_rows:
        return []
    near = around(every).join(rows.select(["chunk", "pid", "partition", "lo", "hi"]), ["chunk", "pid", "partition"])
    lo, hi = ints(near["lo"]), ints(near["hi"])
    after, before = ints(near["after"], _FAR), ints(near["before"], -1)
    return sorted(set(ints(near["chunk"])[(hi > after) | (lo < before)].tolist()))


def in_chunks(narrows: list[pa.Table]) -> tuple[list[Any], list[Any]]:
    """`log_order` and `gaps` of a window given as its chunks' narrow rows (chunk k's seqs below chunk
    k + 1's), as the Spark tasks find them: each chunk's gaps and own log order alone, then what
    crosses the cuts from every chunk's bounds, the chunks `crossing` names looked at again with their
    `around` rows."""
    if not narrows:
        return [], []
    seen = [alone(nr, k) for k, nr in enumerate(narrows)]
    every = pa.concat_tables([b for b, _, _ in seen])
    parts = [(f, FLAGGED.empty_table()) for _, _, f in seen]
    near = around(every)
    for k in crossing(every):
        parts[k] = log_order_part(narrows[k], near.filter(pc.equal(near["chunk"], k)))
    flagged = [f.append_column("chunk", pa.array(np.full(f.num_rows, k, np.int64))) for k, (f, _) in enumerate(parts)]
    stairs = [s.append_column("chunk", pa.array(np.full(s.num_rows, k, np.int64))) for k, (_, s) in enumerate(parts)]
    found_gaps = gaps_across(every) + [g for _, found, _ in seen for g in found]
    return log_order_across(pa.concat_tables(flagged), pa.concat_tables(stairs)), found_gaps


def content(narrow: pa.Table) -> list[tuple[str, int, int, int, str, int]]:
    """(pid, seq, partition, offset, the first one's pid and seq) of each original of the window
    that shares its fingerprint with an earlier one, in (produce time, pid, seq) order."""
    held = narrow.filter(pc.and_(pc.greater_equal(narrow["partition"], 0), pc.is_valid(narrow["fp1"])))
    if not held.num_rows:
        return []
    h1 = ints(held["fp1"])
    ordered = np.sort(h1)
    twice = np.unique(ordered[1:][ordered[1:] == ordered[:-1]])
    if not len(twice):
        return []
    at = np.clip(np.searchsorted(twice, h1), 0, len(twice) - 1)
    rows = held.filter(pa.array(twice[at] == h1))  # only the rows whose first hash repeats
    pid, names = _codes(rows["pid"])
    h1, h2 = ints(rows["fp1"]), ints(rows["fp2"])
    seq, pt, win = ints(rows["seq"]), ints(rows["pt"]), bools(rows["win"])
    part, off = ints(rows["partition"]), ints(rows["offset"])
    order = np.lexsort((seq, pid, pt, h2, h1))
    first = _firsts(h1[order], h2[order])
    first_of = order[np.maximum.accumulate(np.where(first, np.arange(len(order)), 0))]
    later = np.flatnonzero(~first & win[order])
    dup, one = order[later], first_of[later]
    return [(names[a], s, p, o, names[b], fs) for a, s, p, o, b, fs in
            zip(pid[dup].tolist(), seq[dup].tolist(), part[dup].tolist(), off[dup].tolist(), pid[one].tolist(),
                seq[one].tolist(), strict=True)]


LATEST = pa.schema([("fp1", pa.int64()), ("fp2", pa.int64()), ("pt", pa.int64())])


def latest_by_content(narrow: pa.Table) -> pa.Table:
    """(fp1, fp2, the latest produce time) of each fingerprint among the originals of `narrow` (or
    among rows already in `LATEST`'s shape, to merge them)."""
    held = narrow.filter(pc.is_valid(narrow["fp1"]))
    if "partition" in held.column_names:
        held = held.filter(pc.greater_equal(held["partition"], 0))
    got = held.select(["fp1", "fp2", "pt"]).group_by(["fp1", "fp2"]).aggregate([("pt", "max")])
    return pa.table([got["fp1"], got["fp2"], got["pt_max"]], schema=LATEST)


def resent(failed: pa.Table, latest: pa.Table) -> np.ndarray:
    """Whether each failed send of `failed` (fp1, fp2 of its fingerprint, pt its produce time) was
    resent: an original shares its fingerprint and was produced at or after it (`latest`:
    `latest_by_content` of the window's narrow rows)."""
    if not failed.num_rows or not latest.num_rows:
        return np.zeros(failed.num_rows, dtype=bool)
    keyed = failed.select(["fp1", "fp2", "pt"]).append_column("_i", pa.array(np.arange(failed.num_rows)))
    joined = keyed.join(latest.rename_columns(["fp1", "fp2", "_last"]), ["fp1", "fp2"], join_type="inner")
    out = np.zeros(failed.num_rows, dtype=bool)
    out[ints(joined["_i"])[ints(joined["_last"]) >= ints(joined["pt"])]] = True
    return out
