"""Medium windows on Arrow columns (docs/design.md §5.10): the window's rows, read once as Arrow
tables, are settled message by message with vectorised passes, and only the messages that are not
ordinary go to the rules' plain statement, `audit.oracle`.

A message is *ordinary* when, in the rows the window sees, it has exactly one ledger row (acked,
with its partition and offset), exactly one valid log record (committed, at that partition and
offset), for each group of the topic exactly one consumption row (a processing, at that partition
and offset, read on the audited cluster, not flagged by the order of consumption) and no other, and
exactly one row in each sink. Every rule of §5 gives such a message nothing but: expected and
delivered at every stage, its ack, consume and sink latencies, and its narrow row for the checks
that need neighbours. Those facts are computed here for all ordinary messages at once; every other
message -- with all its rows --, every row without a message identity, the consumer interceptor's
`committed` rows and the rows read on a mirror go to `oracle.window_facts`, which classifies them
exactly as it classifies a whole window, given the consumption order's flags computed here over
all processings. The checks that need neighbours (log order, gaps, content duplicates) run here,
vectorised, over the narrow rows of both kinds; their rows are made by the oracle's
`emit_neighbour_rows`. The unit test holds each pass to the oracle's functions on narrow rows, and
the property test holds the whole path equal to the oracle.

A window larger than the driver should hold at once is split by message into chunks as it is read
(`Split`: every row of a message in one chunk) and settled chunk by chunk (`classify_chunks`): the
order of consumption and the pids are gathered over the whole window while the rows pass, and the
checks that need neighbours run once over every chunk's narrow rows.

The path declines (`None`) what it does not cover -- mirrored topics, sequence numbers outside
[0, 2^40), 2^23 or more producer sessions in one window, ties the oracle breaks by the order it was
handed the rows -- and the caller then runs the Spark plan. Transforms only: no I/O, no Spark.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, fields
from datetime import datetime, timedelta
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from audit import oracle
from audit.core.config import TopicConfig
from audit.core.percentiles import LATENCY_COLUMNS, PERCENTILES, interpolate, percentile_position
from audit.core.report import assemble_report, code_counts
from audit.core.vocabulary import (
    ACKED,
    COMMITTED,
    LEDGER_STATUSES,
    LOG,
    PROCESSING_OUTCOMES,
    group_stage,
    sink_stage,
)
from audit.core.windows import EPOCH, read_ranges

SEQ_BITS = 40  # a message's key is (pid code << SEQ_BITS) | seq
_NONE = np.iinfo(np.int64).min


@dataclass
class Tables:
    """A window's rows as Arrow tables whose columns are named as the oracle's row fields (`ledger`,
    `log`, `consumed`: `LedgerRow`, `LogRecord`, `ConsumedRow`; each sink: `SinkRow`), as read:
    the visibility is applied here. The small inputs come as the oracle's rows."""

    ledger: pa.Table
    log: pa.Table
    consumed: pa.Table | None
    sinks: Mapping[str, pa.Table]
    group_offsets: Sequence[oracle.GroupOffset] = ()
    watermarks: Sequence[oracle.Watermark] = ()


def declines(tc: TopicConfig) -> str | None:
    """Why this path does not take the topic's windows, or None."""
    return "a mirrored topic" if tc.mirrors else None


def _us(col: Any) -> np.ndarray:
    """A timestamp column as int64 microseconds since the epoch, nulls as _NONE."""
    arr = pc.cast(col, pa.timestamp("us", "UTC"), safe=False).cast(pa.int64())
    return pc.fill_null(arr, _NONE).to_numpy()


def _int(col: Any, null: int = -1) -> np.ndarray:
    return pc.fill_null(pc.cast(col, pa.int64()), null).to_numpy()


def _bool(col: Any) -> np.ndarray:
    return pc.fill_null(col, False).to_numpy(zero_copy_only=False)


def _between(col: Any, lo: datetime, hi: datetime) -> Any:
    t = pa.timestamp("us", "UTC")
    c = pc.cast(col, t, safe=False)
    return pc.and_(pc.greater_equal(c, pa.scalar(lo, t)), pc.less(c, pa.scalar(hi, t)))


_HASH_BASE = 0x100000001B3  # odd: a polynomial hash of 8-byte words modulo 2^64
_HASH_SLICE = 1 << 18  # strings hashed at a time (few numpy calls: each takes the interpreter lock again)
_HASH_BYTES = 1 << 24  # at most this many bytes of padded strings at a time (a slice of long ones is cut)


def _hash64(strings: pa.Array) -> np.ndarray:
    """A 64-bit hash of each string (a null's is its empty string's): its length in bytes plus the sum
    of its 8-byte words (the last padded with zeros), word i times BASE^(i + 1), modulo 2^64. Equal
    strings hash equal, different ones rarely (`_shared_strings` checks; two strings that differ in
    one word never). A slice of strings is hashed as a matrix of words, each string padded to the
    longest in the slice (zero words add nothing), its rows their bytes as they lie when they all
    have one length: for strings of one length (digests), several times faster than a dictionary of
    them; about as fast for mixed lengths (`benchmarks/fingerprint_hash.py`)."""
    strings = strings.cast(pa.large_string())
    n = len(strings)
    out = np.zeros(n, dtype=np.uint64)
    if not n:
        return out
    bounds = np.frombuffer(strings.buffers()[1], dtype=np.int64)[strings.offset:strings.offset + n + 1]
    lengths = np.diff(bounds)
    if strings.null_count:
        lengths = np.where(strings.is_null().to_numpy(zero_copy_only=False), 0, lengths)
    longest = int(lengths.max())
    if not longest:
        return out
    raw = np.frombuffer(strings.buffers()[2], dtype=np.uint8)
    powers = np.cumprod(np.full((longest + 7) // 8, _HASH_BASE, dtype=np.uint64))
    lo = 0
    with np.errstate(over="ignore"):
        while lo < n:
            hi = min(n, lo + _HASH_SLICE)
            width = (int(lengths[lo:hi].max()) + 7) & ~7
            if (hi - lo) * width > _HASH_BYTES:  # long strings: fewer at a time
                hi = lo + max(1, _HASH_BYTES // width)
            size = lengths[lo:hi]
            wide = int(size.max())
            width = (wide + 7) & ~7
            if not wide:  # empty strings and nulls: their lengths alone
                lo = hi
                continue
            if int(size.min()) == wide and bounds[hi] - bounds[lo] == (hi - lo) * wide:  # one length, as they lie
                block = raw[bounds[lo]:bounds[hi]].reshape(hi - lo, wide)
                if wide != width:
                    block = np.pad(block, ((0, 0), (0, width - wide)))
            else:  # each string's bytes put at the start of its row
                flat = np.zeros((hi - lo) * width, dtype=np.uint8)
                starts = np.arange(0, (hi - lo) * width, width) - (bounds[lo:hi] - bounds[lo])
                held = np.diff(bounds[lo:hi + 1])  # a null's bytes, if it has any, are left out
                taken = np.repeat(size == held, held) if strings.null_count else slice(None)
                flat[(np.repeat(starts, held) + np.arange(bounds[hi] - bounds[lo]))[taken]] = raw[bounds[lo]:bounds[hi]][taken]
                block = flat.reshape(hi - lo, width)
            words = np.ascontiguousarray(block).view(np.uint64)
            out[lo:hi] = (words * powers[:width // 8]).sum(axis=1, dtype=np.uint64)
            lo = hi
    return out + lengths.astype(np.uint64)


def _fingerprint_hashes(fps: pa.Array, part: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(each of some messages' fingerprints' `_hash64`; those of the originals' (partition >= 0) not-null
    fingerprints, sorted): a chunk's part of the content check, its hashes' runs merged at the end."""
    hashes = _hash64(fps)
    originals = (part >= 0) & pc.is_valid(fps).to_numpy(zero_copy_only=False)
    held = hashes[originals]
    held.sort()
    return hashes, held


def _repeated(ordered: np.ndarray) -> pa.Array:
    """The values of sorted `ordered` held more than once."""
    return pa.array(np.unique(ordered[1:][ordered[1:] == ordered[:-1]]))


def _shared_strings(strings: pa.Array | pa.ChunkedArray, rows: np.ndarray, hashes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(a code per row of `strings`, equal for equal strings, defined on the rows returned; the rows
    among `rows` whose string, not null, another of `rows` shares), exactly: the rows whose hash
    repeats are the candidates (`hashes`: each string's `_hash64`), and only their strings are
    compared (`_shared_among`)."""
    h = hashes[rows]
    return _shared_among(strings, rows[_bool(pc.is_in(pa.array(h), value_set=_repeated(np.sort(h))))])


def _shared_among(strings: pa.Array | pa.ChunkedArray, candidates: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`_shared_strings` of the `candidates` rows, every row whose string may be shared."""
    codes = np.full(len(strings), -1, dtype=np.int64)
    if not len(candidates):
        return codes, candidates
    taken = strings.take(pa.array(candidates, pa.int64()))
    taken = taken.combine_chunks() if isinstance(taken, pa.ChunkedArray) else taken
    exact = _int(pc.dictionary_encode(taken).indices)
    candidates, exact = candidates[exact >= 0], exact[exact >= 0]  # a null shares nothing
    codes[candidates] = exact
    shared = candidates[np.bincount(exact, minlength=int(exact.max(initial=0)) + 1)[exact] > 1]
    return codes, shared


def _where(table: pa.Table, mask: Any) -> pa.Table:
    """`table`'s rows where `mask` is true (a null is false); `table` itself when that is every row
    (a window's files often hold nothing else: no copy)."""
    if pc.all(mask, skip_nulls=False).as_py() is True:
        return table
    return table.filter(mask)


_FEW_SEGMENTS = 4096  # `_prev_max` runs segment by segment up to this many


def _sorted_distinct(values: Any) -> pa.Array:
    """The distinct non-null strings of `values` (an array, or a list of them), in order."""
    chunks: list[Any] = []
    for col in values if isinstance(values, list) else [values]:
        col = pc.cast(pc.drop_null(col), pa.string())
        chunks.extend(col.chunks if isinstance(col, pa.ChunkedArray) else [col])
    distinct = pc.unique(pa.chunked_array(chunks, pa.string()))
    return pc.take(distinct, pc.sort_indices(distinct))


def _prev_max(segment: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Per row of rows sorted by `segment`, the largest of `values` (all >= 0) over the rows before it
    in its segment; -1 for a segment's first row."""
    out = np.full(len(values), -1, dtype=np.int64)
    if not len(values):
        return out
    first = np.ones(len(segment), dtype=bool)
    first[1:] = segment[1:] != segment[:-1]
    starts = np.flatnonzero(first)
    run = np.maximum.accumulate
    if len(starts) <= _FEW_SEGMENTS:  # a running maximum per segment: no temporaries of every row
        for lo, hi in zip(starts.tolist(), [*starts[1:].tolist(), len(values)], strict=True):
            out[lo + 1:hi] = run(values[lo:hi - 1])
        return out
    # a running maximum restarted at each segment: values offset by the segment's rank times a span
    # larger than any value, so an earlier segment never outweighs a later one
    span = int(values.max()) + 1
    dense = np.cumsum(first) - 1
    if (int(dense[-1]) + 1) * span >= 2**62:  # too wide for one pass: segment by segment
        for a, b in zip(starts, [*starts[1:], len(values)], strict=True):
            r = run(values[a:b])
            out[a + 1:b] = r[:-1]
        return out
    shifted = run(dense * span + values)
    out[1:] = shifted[:-1] - dense[1:] * span
    out[first] = -1
    return out


class _Keys:
    """Message keys: (pid code << SEQ_BITS) | seq, pid codes in the pids' sorted order; -1 for a row
    without a valid identity (no pid or seq, or a seq outside [0, 2^SEQ_BITS)). `pids`: every pid of
    the window, sorted, when the rows at hand are one chunk of it (`Split`)."""

    def __init__(self, pid_columns: list[Any], pids: pa.Array | None = None) -> None:
        self.pids = _sorted_distinct(pid_columns) if pids is None else pids
        # a pid code must leave SEQ_BITS for the seq in a non-negative int64 (`classify` declines)
        self.fits = len(self.pids) < 2 ** (63 - SEQ_BITS)

    def code(self, pid: Any) -> np.ndarray:
        return _int(pc.index_in(pid, value_set=self.pids))

    def of(self, pid: Any, seq: Any) -> tuple[np.ndarray, bool]:
        """(each row's key, whether some row has a pid and a seq out of range: the path declines)."""
        code, s = self.code(pid), _int(seq)
        has = (code >= 0) & (s != -1) & pc.is_valid(seq).to_numpy(zero_copy_only=False)
        wide = bool(np.any(has & ((s < 0) | (s >= 1 << SEQ_BITS))))
        return np.where(has, (code << SEQ_BITS) | np.clip(s, 0, None), -1), wide


def _single(keys: np.ndarray, where: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(the distinct keys with rows, among `keys` >= 0, and for each the index of its row when it has
    exactly one; -1 when it has several)."""
    idx = np.flatnonzero(where & (keys >= 0))
    k = keys[idx]
    order = np.argsort(k, kind="stable")
    ks = k[order]
    start = np.flatnonzero(np.concatenate([[True], ks[1:] != ks[:-1]])) if len(ks) else np.empty(0, np.int64)
    count = np.diff(np.append(start, len(ks)))
    return ks[start], np.where(count == 1, idx[order[start]], -1)


def _lookup(uniq: np.ndarray, rows: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """For each of `keys`: its row in (`uniq`, `rows`), -2 when it has none (-1: several)."""
    if not len(uniq):
        return np.full(len(keys), -2, dtype=np.int64)
    at = np.clip(np.searchsorted(uniq, keys), 0, len(uniq) - 1)
    return np.where(uniq[at] == keys, rows[at], -2)


def np_latency_columns(values: np.ndarray, counts: np.ndarray | None = None) -> dict[str, float | None]:
    """`audit.core.percentiles.latency_columns` of a numpy array (`counts`: how many times each of
    `values` occurs, when it is a histogram): the same arithmetic on the same ranks, so the same floats."""
    if counts is None:
        xs, below = np.sort(values), None
        n = len(xs)
    else:
        order = np.argsort(values, kind="stable")
        xs, below = values[order], np.cumsum(counts[order])
        n = int(below[-1]) if len(below) else 0

    def at(rank: int) -> Any:
        return xs[rank if below is None else int(np.searchsorted(below, rank, side="right"))]
    if not n:
        return dict.fromkeys(LATENCY_COLUMNS)
    out: dict[str, float | None] = {}
    for name, p in zip(LATENCY_COLUMNS, PERCENTILES, strict=False):
        position, lower, higher = percentile_position(n, p)
        out[name] = interpolate(position, lower, higher, float(at(lower)), float(at(higher)))
    out["latency_max_ms"] = float(xs[-1])
    return out


def _histogram(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(the distinct `values`, how many times each occurs): a stage's latencies kept in a window's
    chunks (clients stamp whole milliseconds: few distinct values)."""
    xs, n = np.unique(values, return_counts=True)
    return xs, n.astype(np.int64)


_UTC_NAMES = {"UTC", "Etc/UTC", "+00:00", "Z", "GMT"}


def values(col: pa.ChunkedArray) -> list[Any]:
    """A column's values as Python objects, as `to_pylist` gives them. A UTC timestamp column is
    converted from its microseconds (about 5x faster than pyarrow's conversion of aware timestamps,
    which took most of a collect whose rows carry three or four times each)."""
    if not (pa.types.is_timestamp(col.type) and col.type.tz in _UTC_NAMES):
        return col.to_pylist()
    micros = col.cast(pa.timestamp("us", tz=col.type.tz)).cast(pa.int64())
    if not micros.null_count:
        return [EPOCH + timedelta(microseconds=v) for v in micros.to_numpy().tolist()]
    return [None if v is None else EPOCH + timedelta(microseconds=v) for v in micros.to_pylist()]


def _micros(t: datetime) -> int:
    """An aware datetime as microseconds since the epoch, exactly."""
    return (t - EPOCH) // timedelta(microseconds=1)


def row_maker(cls: type, cols: list[str]) -> Any:
    """Builds a `cls` from the values of `cols`, in that order: positionally when they are its
    leading positional fields (most tables' columns, read in the fields' order), else by keyword."""
    positional = [f.name for f in fields(cls) if f.init and not f.kw_only]
    if cols == positional[:len(cols)]:
        return cls
    return lambda *values: cls(**dict(zip(cols, values, strict=True)))


def _rows(table: pa.Table, cls: type, mask: np.ndarray, topic: str) -> list[Any]:
    """The rows of `table` under `mask` as the oracle's `cls` rows (`topic` where it has no such column)."""
    part = table.filter(pa.array(mask))
    names = [f.name for f in fields(cls) if f.name in part.column_names]
    cols = [values(part.column(n)) for n in names]
    if "topic" not in names:
        names.append("topic")
        cols.append([topic] * part.num_rows)
    make = row_maker(cls, names)
    return [make(*v) for v in zip(*cols, strict=True)]


def _group_names(tc: TopicConfig) -> pa.Array:
    """`tc`'s consumer groups, sorted: a group's code is its place here (the order of consumption's
    segments, over a window and over the split alike)."""
    return pa.array(sorted(set(tc.groups)), pa.string())


def _processing(rows: Any) -> Any:
    """Whether each consumption row (of a table or a batch) processed its message on the audited
    cluster: the rows of the order of consumption (`oracle.reordered_in_consumption`)."""
    return pc.and_(pc.is_null(rows["cluster"]), pc.is_in(rows["outcome"], pa.array(sorted(PROCESSING_OUTCOMES))))


def _lacks_order(rows: Any) -> bool:
    """Whether a consumption row of `rows` lacks a key of the order of consumption (its consume_seq
    or consumer): the oracle then orders those rows as handed, which the passes do not."""
    return bool(pc.any(pc.is_null(rows["consume_seq"])).as_py() or pc.any(pc.is_null(rows["consumer"])).as_py())


def _reordered_processings(con: pa.Table, tc: TopicConfig, processing: np.ndarray, c_part: np.ndarray,
                           c_off: np.ndarray, c_ts: np.ndarray) -> np.ndarray | None:
    """`oracle.reordered_in_consumption` over the visible processings (`processing`) of `con`: per
    (group, partition), in (consume time, consume seq, consumer) order, each first processing of an
    offset below the highest offset processed before it; a mask over `con`'s rows. None when two
    processings equal in every sort key hold different offsets (the oracle orders them as handed)."""
    flagged = np.zeros(con.num_rows, dtype=bool)
    if _lacks_order(con):
        return None
    q = np.flatnonzero(processing)
    g_code = _int(pc.index_in(con["group"], value_set=_group_names(tc)))
    cons = _int(pc.index_in(con["consumer"], value_set=_sorted_distinct(con["consumer"])))
    back = _backwards(g_code[q], cons[q], _int(con["consume_seq"])[q], c_part[q], c_off[q], c_ts[q])
    if back is None:
        return None
    flagged[q[back]] = True
    return flagged


def _backwards(group: np.ndarray, consumer: np.ndarray, cseq: np.ndarray, part: np.ndarray, off: np.ndarray,
               ts: np.ndarray) -> np.ndarray | None:
    """`oracle.reordered_in_consumption` over processings given by their columns (group and consumer
    as codes in their names' order): per (group, partition), in (consume time, consume seq,
    consumer) order, each first processing of an offset below the highest offset processed before
    it, as a mask; None on a tie in every sort key between different offsets."""
    out = np.zeros(len(off), dtype=bool)
    if not len(off):
        return out
    lowest = int(part.min())
    seg = group * (int(part.max()) - lowest + 1) + (part - lowest)  # one per (group, partition)
    order = np.lexsort((consumer, cseq, ts, seg))
    seg_o, off_o = seg[order], off[order]
    tied = np.flatnonzero((seg_o[1:] == seg_o[:-1]) & (ts[order][1:] == ts[order][:-1]))
    if len(tied):  # equal times are rare: the other keys are compared there only
        a, b = order[tied], order[tied + 1]
        if np.any((cseq[a] == cseq[b]) & (consumer[a] == consumer[b]) & (off[a] != off[b])):
            return None
    # below the highest offset processed before it (any processing); then only those that are the
    # first processing of their (group, partition, offset) count
    back = np.flatnonzero((off_o < _prev_max(seg_o, np.maximum(off_o, 0))) & (off_o >= 0))
    if not len(back):
        return out
    span = int(off_o.max()) + 2
    if (int(seg_o.max()) + 1) * span >= 2**62:  # too wide for one key: the first of every offset
        by_off = np.lexsort((np.arange(len(order)), off_o, seg_o))
        head = np.ones(len(by_off), dtype=bool)
        head[1:] = (seg_o[by_off][1:] != seg_o[by_off][:-1]) | (off_o[by_off][1:] != off_o[by_off][:-1])
        first = np.zeros(len(order), dtype=bool)
        first[by_off[head]] = True
        out[order[back[first[back]]]] = True
        return out
    key = seg_o * span + (off_o + 1)
    wanted = np.unique(key[back])
    at = np.clip(np.searchsorted(wanted, key), 0, len(wanted) - 1)
    rows = np.flatnonzero(wanted[at] == key)  # every processing of those offsets, in consume order
    k = key[rows]
    by = np.argsort(k, kind="stable")
    head = np.ones(len(by), dtype=bool)
    head[1:] = k[by][1:] != k[by][:-1]
    firsts = rows[by[head]]
    out[order[back[np.isin(back, firsts)]]] = True
    return out


@dataclass
class _Visible:
    """The rows of one (topic, window) the oracle sees, in the scan's terms."""

    ledger: pa.Table
    log: pa.Table
    consumed: pa.Table
    sinks: dict[str, pa.Table]


def _consumed_seen(rows: Any, tc: TopicConfig, rr: Any) -> Any:
    """The oracle's visibility of consumption rows (a table or a batch) for `tc`'s window of read
    ranges `rr`: the topic's, of one of its groups, consumed within the event range."""
    return pc.and_(pc.and_(pc.equal(rows["topic"], tc.name), pc.is_in(rows["group"], _group_names(tc))),
                   _between(rows["consume_ts"], rr.event_lo, rr.event_hi))


def _visible(tc: TopicConfig, ws: datetime, t: Tables) -> _Visible:
    """The oracle's visibility for `tc`'s window of `ws` over `t` (other topics' rows left out)."""
    rr = read_ranges(tc, ws)

    def is_topic(tab: pa.Table) -> Any:
        return pc.equal(tab["topic"], tc.name)

    led = _where(t.ledger, pc.and_(is_topic(t.ledger), _between(t.ledger["produce_ts"], rr.message_lo, rr.message_hi)))
    log_time = pc.coalesce(*(pc.cast(t.log[c], pa.timestamp("us", "UTC"), safe=False)
                             for c in ("produce_ts", "kafka_ts", "captured_at")))
    log = _where(t.log, pc.and_(is_topic(t.log), _between(log_time, rr.message_lo, rr.message_hi)))
    if tc.groups and t.consumed is not None:
        con = _where(t.consumed, _consumed_seen(t.consumed, tc, rr))
    else:
        con = pa.table({f.name: pa.array([], type=pa.string()) for f in fields(oracle.ConsumedRow)})
    sinks = {}
    for s in tc.sinks:
        st = t.sinks.get(s.name)
        if st is None:
            continue
        seen = pc.or_(pc.is_null(st["sink_ts"]), _between(st["sink_ts"], rr.event_lo, rr.event_hi))
        sinks[s.name] = _where(st, pc.and_(is_topic(st), pc.fill_null(seen, True)))
    return _Visible(led, log, con, sinks)


@dataclass
class _Consumption:
    """The visible consumption rows' columns the passes use, and the order of consumption's flags."""

    part: np.ndarray
    off: np.ndarray
    ts: np.ndarray
    on_source: np.ndarray
    is_commit: np.ndarray
    processing: np.ndarray
    flagged: np.ndarray


def _consumption(con: pa.Table, tc: TopicConfig,
                 flags: np.ndarray | Future[np.ndarray | None] | None = None) -> _Consumption | None:
    """The columns of `con` (visible) the passes use and the order of consumption over every
    processing of the audited cluster (`oracle.reordered_in_consumption`); None when the oracle
    breaks a tie in that order by the rows' order (`_reordered_processings`). `flags`: that order's
    flags computed over the whole window (`Split.flags`), by `con`'s `_row`, when `con` is one chunk."""
    if not con.num_rows:
        none, no = np.empty(0, np.int64), np.empty(0, bool)
        return _Consumption(none, none, none, no, no, no, no)
    part, off, ts = _int(con["partition"]), _int(con["offset"]), _us(con["consume_ts"])
    on_source = _bool(pc.is_null(con["cluster"]))
    is_commit = _bool(pc.equal(con["outcome"], COMMITTED))
    processing = _bool(_processing(con))
    if flags is None:
        flagged = _reordered_processings(con, tc, processing, part, off, ts)
    else:
        window = flags.result() if isinstance(flags, Future) else flags
        flagged = None if window is None else window[_int(con["_row"])]
    return None if flagged is None else _Consumption(part, off, ts, on_source, is_commit, processing, flagged)


_BLOCK = 1 << 20  # sorted keys a pass over them takes at a time: bounds its temporaries
_KEY_BITS = 64  # the bits of the log order's packed key ((segment, offset, row) when they fit)


def _starts(narrow: Sequence[_Narrow]) -> np.ndarray:
    """The first global row of each chunk's narrow rows, then their number."""
    return np.cumsum([0, *(len(n.seq) for n in narrow)])


def _take(narrow: Sequence[_Narrow], starts: np.ndarray, name: str, rows: np.ndarray) -> np.ndarray:
    """The column `name` of the narrow rows at global `rows` (a few: the rows an anomaly names)."""
    which = np.searchsorted(starts, rows, side="right") - 1
    out = np.empty(len(rows), dtype=getattr(narrow[0], name).dtype)
    for k in np.unique(which).tolist():
        at = which == k
        out[at] = getattr(narrow[k], name)[rows[at] - starts[k]]
    return out


def _gaps(narrow: Sequence[_Narrow], pid_names: list[str]) -> list[Any]:
    """Per pid, consecutive present seqs the later of which is in the window: (pid, seq, in the
    window) packed in one unsigned key per present message (its (pid, seq) is unique), built chunk
    by chunk and sorted by value; then a pass over the sorted keys in blocks."""
    key = np.empty(sum(int(np.count_nonzero(n.present)) for n in narrow), dtype=np.uint64)
    shift, at = np.uint64(SEQ_BITS + 1), 0
    for n in narrow:
        every = bool(n.present.all())
        pid, seq, win = (n.pid, n.seq, n.win) if every else (n.pid[n.present], n.seq[n.present], n.win[n.present])
        out = key[at:at + len(pid)]
        np.left_shift(pid.astype(np.uint64), shift, out=out)
        out |= seq.astype(np.uint64) << np.uint64(1)
        out |= win
        at += len(pid)
    key.sort(kind="stable")  # a merge sort: each chunk's ordinary keys come sorted, a run it merges
    mask = (1 << SEQ_BITS) - 1
    found = []
    for lo in range(0, max(len(key) - 1, 0), _BLOCK):
        block = key[lo:lo + _BLOCK + 1]
        # within a pid the step from one key to the next is 2 * (seq step) + (window bit change): 4 or
        # more when a seq is skipped and the later row is in the window, 3 or less for the next seq
        step = np.flatnonzero(block[1:] - block[:-1] >= np.uint64(4))
        before, after = block[step], block[step + 1]
        gap = ((before >> shift) == (after >> shift)) & (after & np.uint64(1)).astype(bool)
        found += [(pid_names[b >> (SEQ_BITS + 1)], (b >> 1) & mask, (a >> 1) & mask)
                  for b, a in zip(before[gap].tolist(), after[gap].tolist(), strict=True)]
    return found


def _log_order(narrow: Sequence[_Narrow], starts: np.ndarray, segments: int) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """The originals (partition >= 0) in (segment, offset) order (segment: partition * `segments` +
    pid code), in blocks of (global rows, segments, offsets). One in-place sort of (segment, offset,
    row) packed in an unsigned key built chunk by chunk when they fit in `_KEY_BITS`, else a sort of
    the whole columns on two keys."""
    originals = [np.flatnonzero(n.part >= 0) for n in narrow]
    total = sum(len(o) for o in originals)
    if not total:
        return
    ranges = [(int(off.min()), int(off.max()), int(n.part[o].max()))
              for n, o in zip(narrow, originals, strict=True) if len(o) for off in (n.off[o],)]
    low, high, top = min(r[0] for r in ranges), max(r[1] for r in ranges), max(r[2] for r in ranges)
    row_bits, off_bits = int(starts[-1]).bit_length(), (high - low).bit_length()
    seg_bits = ((top + 1) * segments).bit_length()
    if row_bits + off_bits + seg_bits <= _KEY_BITS:
        key = np.empty(total, dtype=np.uint64)
        at = 0
        for n, o, first in zip(narrow, originals, starts[:-1].tolist(), strict=True):
            out = key[at:at + len(o)]
            np.multiply(n.part[o], segments, out=out, casting="unsafe")
            out += n.pid[o].astype(np.uint64)
            out <<= np.uint64(off_bits)
            out |= (n.off[o] - low).astype(np.uint64)
            out <<= np.uint64(row_bits)
            out |= (o + first).astype(np.uint64)
            at += len(o)
        key.sort(kind="stable")  # a merge sort: a producer's messages in a chunk mostly come in runs
        rows_mask, off_mask = np.uint64((1 << row_bits) - 1), np.uint64((1 << off_bits) - 1)
        for lo in range(0, total, _BLOCK):
            block = key[lo:lo + _BLOCK]
            yield ((block & rows_mask).astype(np.int64), (block >> np.uint64(row_bits + off_bits)).astype(np.int64),
                   ((block >> np.uint64(row_bits)) & off_mask).astype(np.int64) + low)
        return
    rows = np.concatenate([o + first for o, first in zip(originals, starts[:-1].tolist(), strict=True)])
    seg = np.concatenate([n.part[o] * segments + n.pid[o] for n, o in zip(narrow, originals, strict=True)])
    off = np.concatenate([n.off[o] for n, o in zip(narrow, originals, strict=True)])
    order = np.lexsort((off, seg))
    for lo in range(0, total, _BLOCK):
        taken = order[lo:lo + _BLOCK]
        yield rows[taken], seg[taken], off[taken]


def _reordered(narrow: Sequence[_Narrow], starts: np.ndarray, pid_names: list[str], seq: np.ndarray,
               win: np.ndarray) -> list[Any] | None:
    """Per (partition, pid), the originals in offset order whose seq is below the highest before
    them (and in the window), with that highest; None when two originals share a position. `seq`
    and `win`: every narrow row's, by global row."""
    segments = len(pid_names) + 1
    found: list[Any] = []
    last_seg, last_off, carried = -1, -1, -1  # the previous block's last position and highest seq
    for rows, seg, off in _log_order(narrow, starts, segments):
        if (seg[0] == last_seg and off[0] == last_off) or np.any((seg[1:] == seg[:-1]) & (off[1:] == off[:-1])):
            return None
        seq_by = seq[rows]
        high = _prev_max(seg, seq_by)
        if seg[0] == last_seg:  # the block goes on with the previous block's last segment
            lead = seg == last_seg
            high[lead] = np.maximum(high[lead], carried)
        carried = max(int(high[-1]), int(seq_by[-1]))  # the last segment's highest so far
        last_seg, last_off = int(seg[-1]), int(off[-1])
        late = np.flatnonzero((high >= 0) & (seq_by < high) & win[rows])
        found += [(pid_names[s % segments], q, s // segments, o, h) for s, q, o, h in
                  zip(seg[late].tolist(), seq_by[late].tolist(), off[late].tolist(), high[late].tolist(), strict=True)]
    return found


def _content(narrow: Sequence[_Narrow], starts: np.ndarray, pid_names: list[str], seq: np.ndarray,
             win: np.ndarray) -> list[Any]:
    """Originals sharing a fingerprint, ordered by (produce time, pid, seq): the later ones in the
    window, each with the first."""
    fps = pa.chunked_array([n.fps for n in narrow], pa.string())
    hashes = [n.hashes.result() if isinstance(n.hashes, Future) else n.hashes for n in narrow]
    ordered = np.concatenate([held for _, held in hashes])
    ordered.sort(kind="stable")  # a merge sort: each chunk's hashes come sorted, a run it merges
    twice = _repeated(ordered)
    del ordered
    # the candidates: originals whose hash repeats; only their fingerprints are compared
    candidates = [np.flatnonzero(_bool(pc.is_in(pa.array(h), value_set=twice)) & (n.part >= 0)) + first
                  for (h, _), n, first in zip(hashes, narrow, starts[:-1].tolist(), strict=True)]
    fp_idx, shared = _shared_among(fps, np.concatenate(candidates))
    del hashes, candidates
    pid, pt = _take(narrow, starts, "pid", shared), _take(narrow, starts, "pt", shared)
    by = np.lexsort((seq[shared], pid, pt, fp_idx[shared]))
    rows = shared[by]
    first_row = np.ones(len(rows), dtype=bool)
    first_row[1:] = fp_idx[rows][1:] != fp_idx[rows][:-1]
    first_of = np.maximum.accumulate(np.where(first_row, np.arange(len(rows)), 0)) if len(rows) else rows
    later = np.flatnonzero(~first_row)
    later = later[win[rows][later]]
    dup, first = rows[later], rows[first_of[later]]
    return [(pid_names[p], s, part, off, pid_names[fp], fs) for p, s, part, off, fp, fs in
            zip(_take(narrow, starts, "pid", dup).tolist(), seq[dup].tolist(),
                _take(narrow, starts, "part", dup).tolist(), _take(narrow, starts, "off", dup).tolist(),
                _take(narrow, starts, "pid", first).tolist(), seq[first].tolist(), strict=True)]


def _neighbour_rows(narrow: Sequence[_Narrow], pid_names: list[str],
                    beside: ThreadPoolExecutor | None = None) -> tuple[list[Any], list[Any], list[Any]] | None:
    """The checks that need neighbours over the narrow rows of every message, chunk by chunk, as
    `oracle.emit_neighbour_rows` takes them: (reordered in the log, gaps, content duplicates); None
    when two originals share a position (the oracle's order is then the rows' order). Only the seqs
    and the window flags are put together over all chunks; the rest is read from each chunk's
    rows. The gaps and the content check run on `beside` when given, beside the log order."""
    starts = _starts(narrow)
    seq = np.concatenate([n.seq for n in narrow])
    win = np.concatenate([n.win for n in narrow])
    found_gaps = beside.submit(_gaps, narrow, pid_names) if beside is not None else None
    found_content = beside.submit(_content, narrow, starts, pid_names, seq, win) if beside is not None else None
    reordered = _reordered(narrow, starts, pid_names, seq, win)
    gaps = found_gaps.result() if found_gaps is not None else _gaps(narrow, pid_names)
    content = found_content.result() if found_content is not None else _content(narrow, starts, pid_names, seq, win)
    return None if reordered is None else (reordered, gaps, content)


def classify(tc: TopicConfig, ws: datetime, as_of: datetime, t: Tables) -> oracle.OracleResult | None:
    """The oracle's result for one (topic, window), or None when the path declines it (`declines`,
    or data whose order the oracle takes from how its rows were handed over). Two passes run beside
    the others, on a thread of their own (numpy and pyarrow let go of the interpreter while they
    work): the order of consumption, and the hashes of the ordinary messages' fingerprints while
    the oracle classifies the rest."""
    if declines(tc) is not None:
        return None
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="msgaudit-columnar") as beside:
        part = _settle(tc, ws, as_of, t, beside)
        return None if part is None else _finish(tc, ws, as_of, [part], beside)


CHUNKS_AT_ONCE = 2  # chunks settled side by side (numpy and pyarrow let go of the interpreter)
# A window of more than SPLIT_ROWS rows is settled in chunks even when it fits `columnar_rows`: up to
# SPLIT_CHUNKS of about SPLIT_ROWS rows, so that its settling takes both cores (docs/benchmarks.md)
SPLIT_ROWS = 2_000_000
SPLIT_CHUNKS = 4


def chunk_count(rows: int, columnar_rows: int) -> int:
    """The chunks a window of `rows` input rows is settled in (1: whole): enough that the chunks
    settled at once hold at most `columnar_rows` rows, and up to SPLIT_CHUNKS above SPLIT_ROWS rows."""
    n = -(-rows * CHUNKS_AT_ONCE // columnar_rows)
    return max(n, min(SPLIT_CHUNKS, -(-rows // SPLIT_ROWS))) if rows > SPLIT_ROWS else max(n, 1)


def classify_chunks(topics: Sequence[TopicConfig], ws: datetime, as_of: datetime, split: Split,
                    chunk: Callable[[int], Tables]) -> dict[str, oracle.OracleResult] | None:
    """`classify` of each of `topics` over a window `split` cut into chunks by message (`chunk(k)`:
    the rows of chunk k, read when asked): each chunk's messages are settled as `classify` settles a
    whole window's, given the order of consumption's flags and the pids computed over all chunks;
    the checks that need neighbours run once, over every chunk's narrow rows. CHUNKS_AT_ONCE
    chunks are settled side by side, each on its own thread. None when the path declines one topic
    (the Spark plan runs then)."""
    if split.declined or any(declines(tc) is not None for tc in topics):
        return None
    pids = split.pids()
    with ThreadPoolExecutor(max_workers=2, thread_name_prefix="msgaudit-columnar") as beside, \
            ThreadPoolExecutor(max_workers=CHUNKS_AT_ONCE, thread_name_prefix="msgaudit-chunk") as chunks:
        flags = beside.submit(split.flags)  # beside the first chunks' keys and joins

        def settled(k: int) -> list[_Part | None]:
            t = chunk(k)
            return [_settle(tc, ws, as_of, t, beside, flags, pids) for tc in topics]

        parts: dict[str, list[_Part]] = {tc.name: [] for tc in topics}
        for done in [chunks.submit(settled, k) for k in range(split.n)]:  # the pool holds CHUNKS_AT_ONCE
            for tc, part in zip(topics, done.result(), strict=True):
                if part is None:
                    return None
                parts[tc.name].append(part)
        out = {}
        for tc in topics:
            r = _finish(tc, ws, as_of, parts.pop(tc.name), beside)
            if r is None:
                return None
            out[tc.name] = r
        return out


@dataclass
class _Narrow:
    """Narrow rows of messages, as `_neighbour_rows` takes them (`hashes`: `_fingerprint_hashes` of
    `fps`, perhaps still being computed beside)."""

    pid: np.ndarray
    seq: np.ndarray
    present: np.ndarray
    part: np.ndarray
    off: np.ndarray
    pt: np.ndarray
    win: np.ndarray
    fps: pa.Array
    hashes: tuple[np.ndarray, np.ndarray] | Future[tuple[np.ndarray, np.ndarray]]


@dataclass
class _Part:
    """One topic's facts in one chunk of its window: the oracle's (for the messages that are not
    ordinary), the ordinary messages' latencies as histograms per (stage, partition), and the narrow
    rows of both kinds."""

    facts: oracle.Facts
    latencies: dict[tuple[str, int], list[tuple[np.ndarray, np.ndarray]]]
    narrow: list[_Narrow]
    pid_names: list[str]


def _settle(tc: TopicConfig, ws: datetime, as_of: datetime, t: Tables, beside: ThreadPoolExecutor,
            flags: Future[np.ndarray | None] | None = None, pids: pa.Array | None = None) -> _Part | None:
    """The facts of `tc`'s messages in `t` (a window, or one chunk of it given the window's `flags`
    and `pids`), or None when the path declines."""
    topic = tc.name
    ws_us, we_us = _micros(ws), _micros(ws + tc.window)
    v = _visible(tc, ws, t)
    led, log, con, sinks = v.ledger, v.log, v.consumed, v.sinks
    consumption = beside.submit(_consumption, con, tc, flags)

    keys = _Keys([led["pid"], log["pid"], con["pid"] if con.num_rows else pa.array([], pa.string()),
                  *(x["pid"] for x in sinks.values())], pids)
    if not keys.fits:
        return None
    kL, w1 = keys.of(led["pid"], led["seq"])
    valid_log = _bool(pc.and_(pc.is_null(log["header_error"]), pc.and_(pc.is_valid(log["pid"]), pc.is_valid(log["seq"]))))
    kR, w2 = keys.of(log["pid"], log["seq"])
    kR = np.where(valid_log, kR, -1)
    kC, w3 = keys.of(con["pid"], con["seq"]) if con.num_rows else (np.empty(0, np.int64), False)
    kS = {}
    wide = w1 or w2 or w3
    for name, st in sinks.items():
        kS[name], w = keys.of(st["pid"], st["seq"])
        wide = wide or w
    if wide:
        return None

    # --- the ledger: one acked row with a position, or the message is not ordinary
    status = led["status"]
    l_part, l_off = _int(led["partition"]), _int(led["offset"], _NONE)
    acked = _bool(pc.equal(status, ACKED))
    quarantine = ~_bool(pc.is_in(status, pa.array(sorted(LEDGER_STATUSES)))) | (acked & ((l_off == _NONE) | (l_part < 0)))
    uL, rowL = _single(kL, np.ones(len(kL), dtype=bool))
    # --- the log: one valid record, committed, at the acked position
    r_part, r_off = _int(log["partition"]), _int(log["offset"])
    committed = _bool(log["committed"])
    uR, rowR = _single(kR, np.ones(len(kR), dtype=bool))

    # candidates: keys with a single ledger row (acked, not quarantined) and a single valid record
    cand = uL[rowL >= 0]
    li = rowL[rowL >= 0]
    ok = acked[li] & ~quarantine[li]
    cand, li = cand[ok], li[ok]
    ri = _lookup(uR, rowR, cand)
    ok = ri >= 0
    cand, li, ri = cand[ok], li[ok], ri[ok]
    ok = committed[ri] & (r_part[ri] == l_part[li]) & (r_off[ri] == l_off[li])
    cand, li, ri = cand[ok], li[ok], ri[ok]

    c = consumption.result()
    if c is None:
        return None
    # --- each group: one processing at the record's position, no other row of the group
    at: dict[str, np.ndarray] = {}  # per group and sink: each candidate's row there
    for g in tc.groups:
        if not con.num_rows:
            gi, ok = np.full(len(cand), -2, dtype=np.int64), np.zeros(len(cand), dtype=bool)
        else:
            uG, rowG = _single(kC, _bool(pc.equal(con["group"], g)) & c.on_source & ~c.is_commit)
            gi = _lookup(uG, rowG, cand)
            gi_ok = np.where(gi >= 0, gi, 0)
            ok = ((gi >= 0) & c.processing[gi_ok] & ~c.flagged[gi_ok] & (c.part[gi_ok] == r_part[ri])
                  & (c.off[gi_ok] == r_off[ri]))
        cand, li, ri = cand[ok], li[ok], ri[ok]
        at = {k: v[ok] for k, v in at.items()}
        at[g] = gi[ok]
    # --- each sink: one row
    for sc in tc.sinks:
        if sc.name not in sinks:
            ok = np.zeros(len(cand), dtype=bool)
        else:
            uS, rowS = _single(kS[sc.name], np.ones(sinks[sc.name].num_rows, dtype=bool))
            si = _lookup(uS, rowS, cand)
            ok = si >= 0
        cand, li, ri = cand[ok], li[ok], ri[ok]
        at = {k: v[ok] for k, v in at.items()}
        if sc.name in sinks:
            at["sink:" + sc.name] = si[ok]
    ordinary = cand  # sorted keys of the ordinary messages
    ordinary_fps = pc.cast(pc.take(log["fingerprint"], pa.array(ri, pa.int64())), pa.string()).combine_chunks()
    ordinary_hashes = beside.submit(_fingerprint_hashes, ordinary_fps, l_part[li])

    # --- every other row goes to the oracle: an ordinary message's rows are exactly its ledger row,
    # its valid record, its processing in each group and its row in each sink (any other row with its
    # key is a commit, off the audited cluster or has no valid identity, and the oracle takes it)
    def other(n: int, *taken: np.ndarray) -> np.ndarray:
        mask = np.ones(n, dtype=bool)
        for rows in taken:
            mask[rows] = False
        return mask

    facts_rows = oracle.Inputs(
        ledger=_rows(led, oracle.LedgerRow, other(led.num_rows, li), topic),
        log=_rows(log, oracle.LogRecord, other(log.num_rows, ri), topic),
        consumed=[], group_offsets=list(t.group_offsets), watermarks=list(t.watermarks),
        sinks={name: _rows(st, oracle.SinkRow, other(st.num_rows, at["sink:" + name]), topic)
               for name, st in sinks.items()})
    reordered: set[int] = set()
    if con.num_rows:
        mask = other(con.num_rows, *(at[g] for g in tc.groups))
        facts_rows.consumed = _rows(con, oracle.ConsumedRow, mask, topic)
        for row, f in zip(facts_rows.consumed, c.flagged[mask], strict=True):
            if f:
                reordered.add(id(row))
    facts = oracle.window_facts(tc, ws, as_of, facts_rows, reordered=reordered, neighbours=False)

    # --- the ordinary messages' facts
    pt = _us(led["produce_ts"])[li]
    in_window = (pt >= ws_us) & (pt < we_us)
    part = l_part[li]
    win = np.flatnonzero(in_window)
    lat: dict[tuple[str, int], list[np.ndarray]] = {}

    def count(stage: str, parts: np.ndarray, latencies: tuple[np.ndarray, np.ndarray]) -> None:
        values, n = np.unique(parts, return_counts=True)
        for p, k in zip(values.tolist(), n.tolist(), strict=True):
            cnt = facts.counts.setdefault((stage, p), {})
            cnt["expected"] = cnt.get("expected", 0) + k
            cnt["delivered"] = cnt.get("delivered", 0) + k
        values_ms, has = latencies
        for p in np.unique(parts[has]).tolist():
            lat.setdefault((stage, p), []).append(values_ms[has & (parts == p)])

    ack = _us(led["ack_ts"])[li][win]
    count(LOG, part[win], ((ack - pt[win]) / 1000.0, ack != _NONE))
    for g in tc.groups:
        consumed_at = c.ts[at[g][win]]
        count(group_stage(g), part[win], ((consumed_at - pt[win]) / 1000.0, np.ones(len(win), dtype=bool)))
    for sc in tc.sinks:
        sink_at = _us(sinks[sc.name]["sink_ts"])[at["sink:" + sc.name][win]]
        count(sink_stage(sc.name), part[win], ((sink_at - pt[win]) / 1000.0, sink_at != _NONE))

    # --- the narrow rows of both kinds, for the checks that need neighbours (`_finish`)
    dirty = facts.narrow
    facts.narrow = []
    dirty_fps = pa.array([n.fingerprint for n in dirty], pa.string())
    dirty_part = np.array([-1 if n.partition is None else n.partition for n in dirty], dtype=np.int64)
    narrow = [
        _Narrow(ordinary >> SEQ_BITS, ordinary & ((1 << SEQ_BITS) - 1), np.ones(len(ordinary), dtype=bool), part,
                r_off[ri], pt, in_window, ordinary_fps, ordinary_hashes),
        _Narrow(keys.code(pa.array([n.pid for n in dirty], pa.string())) if dirty else np.empty(0, np.int64),
                np.array([n.seq for n in dirty], dtype=np.int64), np.array([n.present for n in dirty], dtype=bool),
                dirty_part, np.array([-1 if n.offset is None else n.offset for n in dirty], dtype=np.int64),
                np.array([_NONE if n.produce_time is None else _micros(n.produce_time) for n in dirty], dtype=np.int64),
                np.array([n.in_window for n in dirty], dtype=bool), dirty_fps,
                _fingerprint_hashes(dirty_fps, dirty_part))]
    return _Part(facts, {k: [_histogram(np.concatenate(v))] for k, v in lat.items()}, narrow, keys.pids.to_pylist())


def _merged(parts: Sequence[_Part]) -> oracle.Facts:
    """The facts of a window's chunks as one window's (counts and tallies added, rows put together)."""
    if len(parts) == 1:
        return parts[0].facts
    counts: dict[tuple[str, int], dict[str, int]] = {}
    latencies: dict[tuple[str, int], list[float]] = {}
    ignored: dict[tuple[str, str], int] = {}
    for p in parts:
        for k, cnt in p.facts.counts.items():
            into = counts.setdefault(k, {})
            for name, n in cnt.items():
                into[name] = into.get(name, 0) + n
        for k, xs in p.facts.latencies.items():
            latencies.setdefault(k, []).extend(xs)
        for where, n in p.facts.ignored.items():
            ignored[where] = ignored.get(where, 0) + n
    return oracle.Facts([a for p in parts for a in p.facts.anomalies], counts, latencies,
                        set().union(*(p.facts.partitions for p in parts)), sum(p.facts.quarantined for p in parts),
                        ignored, [])


def _finish(tc: TopicConfig, ws: datetime, as_of: datetime, parts: Sequence[_Part],
            beside: ThreadPoolExecutor) -> oracle.OracleResult | None:
    """The window's result from its chunks' facts: the checks that need neighbours over all their
    narrow rows, then the report; None when the path declines (`_neighbour_rows`)."""
    facts = _merged(parts)
    narrow = [n for p in parts for n in p.narrow]
    for p in parts:
        p.narrow = []
    found = _neighbour_rows(narrow, parts[0].pid_names, beside)
    if found is None:
        return None
    oracle.emit_neighbour_rows(oracle.anomaly_emitter(facts.anomalies, tc.name, ws, as_of), *found)

    stats: dict[tuple[str, int], dict[str, Any]] = {}
    for k, val in facts.counts.items():
        hists = [h for p in parts for h in p.latencies.get(k, [])]
        own = np.asarray(facts.latencies.get(k, []), dtype=np.float64)
        xs = np.concatenate([own, *(h[0] for h in hists)])
        n = np.concatenate([np.ones(len(own), dtype=np.int64), *(h[1] for h in hists)])
        stats[k] = {**val, **np_latency_columns(xs, n)}
    report = assemble_report(tc, ws, as_of, facts.partitions, stats, code_counts(facts.anomalies))
    return oracle.OracleResult(report, facts.anomalies, facts.quarantined, dict(facts.ignored))


# ---------------------------------------------------------------------------- windows in chunks
_MIX = np.uint64(0x9E3779B97F4A7C15)  # Fibonacci hashing: spreads (pid hash ^ seq) over the chunks


def _segments(group: np.ndarray, part: np.ndarray) -> tuple[list[int], np.ndarray, np.ndarray]:
    """The (group, partition) segments of some rows (a group's code, at least 0; a partition, -1 when
    null): each segment's key, `(group << 32) | (partition & 0xFFFFFFFF)`; an order of the rows
    that puts each segment's rows together, in the order given; and each segment's bounds in it.
    A batch holds a few groups and partitions: as one 16-bit code they sort by radix, with a count
    per code, where `np.unique` of the keys sorted them twice (most of the split's time); wider
    partitions take that way."""
    lo, hi = int(part.min()), int(part.max())
    span = hi - lo + 1
    if int(group.min()) >= 0 and (int(group.max()) + 1) * span <= 1 << 16:
        code = (group * span + (part - lo)).astype(np.uint16)
        counts = np.bincount(code)
        present = np.flatnonzero(counts)
        order = np.argsort(code, kind="stable")
        bounds = np.concatenate(([0], np.cumsum(counts[present])))
        keys = (present // span << 32) | ((present % span + lo) & 0xFFFFFFFF)
        return keys.tolist(), order, bounds
    segment = (group << 32) | (part & 0xFFFFFFFF)
    distinct, inverse = np.unique(segment, return_inverse=True)
    order = np.argsort(inverse, kind="stable")
    return distinct.tolist(), order, np.searchsorted(inverse[order], np.arange(len(distinct) + 1))


def _coded(col: Any) -> Any:
    """`col`'s strings dictionary-coded: as read when they are (`driver.parquet_reader`'s `coded`),
    else coded here."""
    return col if pa.types.is_dictionary(col.type) else pc.dictionary_encode(pc.cast(col, pa.string()))


class Split:
    """A window's rows split into `n` chunks by message, batch by batch as they are read
    (docs/design.md §5.10): a row with a message identity (pid and seq; for a log record, valid)
    goes to the chunk of its seq (`cuts`: chunk k holds the seqs from cuts[k - 1] up to cuts[k]; without
    cuts, a hash of its pid and seq), so every row of a message -- in every tier and every topic -- is
    in one chunk; a row without one (the oracle keys it by partition and offset) goes to chunk 0, with
    all such rows; a consumer's `committed` row on the audited cluster goes to
    every chunk (each chunk's committed offsets are the window's). What needs rows of other messages
    is gathered here as the rows pass: the window's pids (`pids`: so each chunk codes them alike)
    and the narrow columns of every visible processing of each topic (`flags`: the order of
    consumption, per (group, partition), over the whole window). A consumed row gains `_row`, its
    place in the order read, which `flags` is indexed by. Tables may be noted on several threads at
    once, each table's batches on one, in order."""

    def __init__(self, n: int, topics: Sequence[TopicConfig], ws: datetime, cuts: np.ndarray | None = None) -> None:
        self.n = n
        self.cuts = cuts
        self._ids = np.uint8 if n < 255 else np.uint16 if n < 65535 else np.int64  # narrow: a radix sort
        self.declined: str | None = None
        self._topics = [(tc, read_ranges(tc, ws)) for tc in topics]
        self._pids: list[pa.Array] = []
        self._rows = 0  # consumed rows split so far
        # per topic: each (group, partition)'s processings, as pieces of the batches read (`_processed`)
        self._processings: dict[str, dict[int, list[tuple[Any, ...]]]] = {tc.name: {} for tc in topics}
        self._consumers: dict[str, list[pa.Array]] = {tc.name: [] for tc in topics}  # names, per piece's batch

    def note(self, kind: str, batch: pa.RecordBatch) -> pa.RecordBatch:
        """What the window needs of `batch`'s rows beyond their chunk: its pids; for consumption rows,
        each row's place in the order read (`_row`, appended) and the visible processings (`flags`)."""
        self._pids.append(_coded(batch.column("pid")).dictionary)
        if kind == "consumed":
            batch = batch.append_column("_row", pa.array(np.arange(self._rows, self._rows + batch.num_rows)))
            self._rows += batch.num_rows
            self._processed(batch)
        return batch

    def chunk_ids(self, kind: str, batch: pa.RecordBatch) -> np.ndarray:
        """Each row's chunk (`n`: every chunk, a consumer's committed row on the audited cluster)."""
        identified = pc.and_(pc.is_valid(batch.column("pid")), pc.is_valid(batch.column("seq")))
        if kind == "log":
            identified = pc.and_(identified, pc.is_null(batch.column("header_error")))
        chunk = self._chunks(batch, _bool(identified))
        if kind == "consumed":
            everywhere = _bool(pc.and_(pc.equal(batch.column("outcome"), COMMITTED), pc.is_null(batch.column("cluster"))))
            chunk[everywhere] = self.n
        return chunk

    def split(self, kind: str, batch: pa.RecordBatch) -> list[list[pa.RecordBatch]]:
        """The rows of `batch`, of the table `kind` ('ledger', 'log', 'consumed' or 'sink'), per chunk."""
        batch = self.note(kind, batch)
        chunk = self.chunk_ids(kind, batch)
        order = np.argsort(chunk, kind="stable")
        bounds = np.searchsorted(chunk[order], np.arange(self.n + 2, dtype=self._ids))
        rows = batch.take(pa.array(order))
        every = rows.slice(bounds[self.n], bounds[self.n + 1] - bounds[self.n])
        return [[rows.slice(bounds[k], bounds[k + 1] - bounds[k]), *([every] if every.num_rows else [])]
                for k in range(self.n)]

    def _chunks(self, batch: pa.RecordBatch, identified: np.ndarray) -> np.ndarray:
        if self.cuts is not None:
            seq = _int(batch.column("seq"))
            return np.where(identified, np.searchsorted(self.cuts, seq, side="right"), 0).astype(self._ids)
        encoded = _coded(batch.column("pid"))
        hashes = np.append(_hash64(encoded.dictionary), np.uint64(0))  # a null pid: the last
        with np.errstate(over="ignore"):
            mixed = (hashes[_int(encoded.indices)] ^ _int(batch.column("seq")).astype(np.uint64)) * _MIX
        return np.where(identified, (mixed >> np.uint64(32)) % np.uint64(self.n), 0).astype(self._ids)

    def _processed(self, batch: pa.RecordBatch) -> None:
        """Keeps the narrow columns of `batch`'s visible processings of each topic, by (group, partition):
        the order of consumption is per (group, partition), so `flags` settles one at a time."""
        processing = _bool(_processing(batch))
        for tc, rr in self._topics:
            if not tc.groups:
                continue
            seen = _bool(_consumed_seen(batch, tc, rr))
            if not seen.any():
                continue
            if _lacks_order(batch.select(["consume_seq", "consumer"]).filter(pa.array(seen))):
                self.declined = "a consumption row without its consume_seq or consumer"
            taken = pa.array(np.flatnonzero(seen & processing))
            if not len(taken):
                continue
            consumer = _coded(batch.column("consumer").take(taken))
            names = self._consumers[tc.name]
            names.append(consumer.dictionary)
            group = _int(pc.index_in(batch.column("group").take(taken), value_set=_group_names(tc)))
            columns = (_int(consumer.indices), _int(batch.column("consume_seq").take(taken)),
                       _int(batch.column("offset").take(taken)), _us(batch.column("consume_ts").take(taken)),
                       _int(batch.column("_row").take(taken)))
            keys, order, bounds = _segments(group, _int(batch.column("partition").take(taken)))
            for i, key in enumerate(keys):
                rows = order[bounds[i]:bounds[i + 1]]
                self._processings[tc.name].setdefault(key, []).append((len(names) - 1, *(c[rows] for c in columns)))

    def pids(self) -> pa.Array:
        """Every pid of the window's rows, sorted (`_Keys`)."""
        return _sorted_distinct(self._pids)

    def flags(self) -> np.ndarray | None:
        """Per consumed row (by `_row`): flagged by the order of consumption; None on a tie the
        oracle breaks by the rows' order (`_backwards`). One (group, partition) at a time, each
        freed as it is settled: no column of every processing at once."""
        out = np.zeros(self._rows, dtype=bool)
        for name in list(self._processings):
            segments, dictionaries = self._processings.pop(name), self._consumers.pop(name)
            if not segments:
                continue
            names = _sorted_distinct(dictionaries)  # a consumer's code: its place among the topic's names
            codes = [_int(pc.index_in(d, value_set=names)) for d in dictionaries]
            for key in list(segments):
                pieces = segments.pop(key)
                consumer = np.concatenate([codes[p[0]][p[1]] for p in pieces])
                cseq, off, ts, row = (np.concatenate([p[i] for p in pieces]) for i in range(2, 6))
                one = np.zeros(len(off), dtype=np.int64)  # one group, one partition
                back = _backwards(one, consumer, cseq, one, off, ts)
                if back is None:
                    return None
                out[row[back]] = True
        return out
