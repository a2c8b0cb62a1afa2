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

from audit.rules.columns import bools, hash64, ints, prev_max, sorted_distinct

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
    return ints(pc.index_in(strings, value_set=names)), names.to_pylist()


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
    # only the first processing of each (group, partition, offset) counts
    by_off = np.lexsort((np.arange(len(order)), o, seg))
    head = _firsts(seg[by_off], o[by_off])
    first = np.zeros(len(order), dtype=bool)
    first[by_off[head]] = True
    out[order[back[first[back]]]] = True
    return out


def log_order(narrow: pa.Table) -> list[tuple[str, int, int, int, int]]:
    """(pid, seq, partition, offset, the highest seq before it) of each original of the window whose
    seq is below the highest seq of its (partition, pid) at lower positions."""
    orig = narrow.filter(pc.greater_equal(narrow["partition"], 0))
    if not orig.num_rows:
        return []
    pid, names = _codes(orig["pid"])
    part, off, seq, win = ints(orig["partition"]), ints(orig["offset"]), ints(orig["seq"]), bools(orig["win"])
    order = np.lexsort((seq, off, pid, part))
    p, c, s = part[order], pid[order], seq[order]
    low = int(s.min())
    high = prev_max(np.cumsum(_firsts(p, c)) - 1, s - low)
    late = order[(high >= 0) & (s - low < high) & win[order]]
    highs = (high + low)[(high >= 0) & (s - low < high) & win[order]]
    return [(names[c_], q, pp, o, h) for c_, q, pp, o, h in
            zip(pid[late].tolist(), seq[late].tolist(), part[late].tolist(), off[late].tolist(), highs.tolist(),
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
