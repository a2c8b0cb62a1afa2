"""Arrow and numpy helpers the kernel and the checks that need neighbours share: columns as numpy
arrays (nulls made explicit), Arrow rows as the oracle's rows, the strings' 64-bit hash, a running
maximum per segment, and exact percentiles of a histogram.

Pure functions: no pyspark, no I/O.
"""

from __future__ import annotations

from dataclasses import fields
from datetime import datetime, timedelta
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from audit.core.percentiles import LATENCY_COLUMNS, PERCENTILES, interpolate, percentile_position
from audit.core.windows import EPOCH

NONE = np.iinfo(np.int64).min  # a null timestamp or offset, as int64


def us(col: Any) -> np.ndarray:
    """A timestamp column as int64 microseconds since the epoch, nulls as NONE."""
    arr = pc.cast(col, pa.timestamp("us", "UTC"), safe=False).cast(pa.int64())
    return pc.fill_null(arr, NONE).to_numpy()


def ints(col: Any, null: int = -1) -> np.ndarray:
    return pc.fill_null(pc.cast(col, pa.int64()), null).to_numpy()


def bools(col: Any) -> np.ndarray:
    return pc.fill_null(col, False).to_numpy(zero_copy_only=False)


def between(col: Any, lo: datetime, hi: datetime) -> Any:
    t = pa.timestamp("us", "UTC")
    c = pc.cast(col, t, safe=False)
    return pc.and_(pc.greater_equal(c, pa.scalar(lo, t)), pc.less(c, pa.scalar(hi, t)))


def micros(t: datetime) -> int:
    """An aware datetime as microseconds since the epoch, exactly."""
    return (t - EPOCH) // timedelta(microseconds=1)


_HASH_BASE = 0x100000001B3  # odd: a polynomial hash of 8-byte words modulo 2^64
_HASH_SLICE = 1 << 18  # strings hashed at a time (few numpy calls: each takes the interpreter lock again)
_HASH_BYTES = 1 << 24  # at most this many bytes of padded strings at a time (a slice of long ones is cut)


def hash64(strings: pa.Array, base: int = _HASH_BASE) -> np.ndarray:
    """A 64-bit hash of each string (a null's is its empty string's): its length in bytes plus the sum
    of its 8-byte words (the last padded with zeros), word i times BASE^(i + 1), modulo 2^64. Equal
    strings hash equal, different ones rarely (two strings that differ in
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
    powers = np.cumprod(np.full((longest + 7) // 8, base, dtype=np.uint64))
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


def latency_columns(values: np.ndarray, counts: np.ndarray | None = None) -> dict[str, float | None]:
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


def histogram(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(the distinct `values`, how many times each occurs): a stage's latencies kept in a window's
    chunks (clients stamp whole milliseconds: few distinct values)."""
    xs, n = np.unique(values, return_counts=True)
    return xs, n.astype(np.int64)


_UTC_NAMES = {"UTC", "Etc/UTC", "+00:00", "Z", "GMT"}


def values(col: pa.ChunkedArray) -> list[Any]:
    """A column's values as Python objects, as `to_pylist` gives them. A UTC timestamp column is
    converted from its microseconds (about 5x faster than pyarrow's conversion of aware timestamps,
    which took most of a collect whose rows carry three or four times each). A dictionary encoded
    column is decoded first (pyarrow's own conversion of one takes about 25x as long)."""
    if pa.types.is_dictionary(col.type):
        return col.cast(col.type.value_type).to_pylist()
    if not (pa.types.is_timestamp(col.type) and col.type.tz in _UTC_NAMES):
        return col.to_pylist()
    micros = col.cast(pa.timestamp("us", tz=col.type.tz)).cast(pa.int64())
    if not micros.null_count:
        return [EPOCH + timedelta(microseconds=v) for v in micros.to_numpy().tolist()]
    return [None if v is None else EPOCH + timedelta(microseconds=v) for v in micros.to_pylist()]


def row_maker(cls: type, cols: list[str]) -> Any:
    """Builds a `cls` from the values of `cols`, in that order: positionally when they are its
    leading positional fields (most tables' columns, read in the fields' order), else by keyword."""
    positional = [f.name for f in fields(cls) if f.init and not f.kw_only]
    if cols == positional[:len(cols)]:
        return cls
    return lambda *values: cls(**dict(zip(cols, values, strict=True)))


def oracle_rows(table: pa.Table, cls: type, mask: np.ndarray, topic: str) -> list[Any]:
    """The rows of `table` under `mask` as the oracle's `cls` rows (`topic` where it has no such column)."""
    part = table.filter(pa.array(mask))
    names = [f.name for f in fields(cls) if f.name in part.column_names]
    cols = [values(part.column(n)) for n in names]
    if "topic" not in names:
        names.append("topic")
        cols.append([topic] * part.num_rows)
    make = row_maker(cls, names)
    return [make(*v) for v in zip(*cols, strict=True)]


def where(table: pa.Table, mask: Any) -> pa.Table:
    """`table`'s rows where `mask` is true (a null is false); `table` itself when that is every row
    (a window's files often hold nothing else: no copy)."""
    if pc.all(mask, skip_nulls=False).as_py() is True:
        return table
    return table.filter(mask)


_FEW_SEGMENTS = 4096  # `prev_max` runs segment by segment up to this many


def _pieces(col: Any) -> list[pa.Array]:
    """A column's arrays (a chunked column's chunks: each dictionary encoded one has a dictionary of its own)."""
    return list(col.chunks) if isinstance(col, pa.ChunkedArray) else [col]


def sorted_distinct(values: Any) -> pa.Array:
    """The distinct non-null strings of `values` (an array, or a list of them; strings or dictionary
    encoded strings), in order."""
    chunks: list[Any] = []
    for col in values if isinstance(values, list) else [values]:
        for part in _pieces(col):
            if pa.types.is_dictionary(part.type):  # the dictionary's values that rows use: no string decoded per row
                part = pc.take(part.dictionary, pc.unique(pc.drop_null(part.indices)))
            chunks.append(pc.cast(pc.drop_null(part), pa.string()))
    distinct = pc.unique(pa.chunked_array(chunks, pa.string()))
    return pc.take(distinct, pc.sort_indices(distinct))


def _by_value(col: Any, f: Any) -> Any:
    """`f` (a function of strings, row by row) over a column; over a dictionary encoded piece, `f` of
    its dictionary taken per row (pyarrow's kernels would decode the strings of every row first)."""
    def one(part: Any) -> Any:
        return pc.take(f(part.dictionary), part.indices) if pa.types.is_dictionary(part.type) else f(part)

    if isinstance(col, pa.ChunkedArray):
        return pa.chunked_array([one(p) for p in col.chunks], f(pa.array([], pa.string())).type)
    return one(col)


def equals(col: Any, value: str) -> Any:
    """Whether each string of `col` (strings, or dictionary encoded) is `value` (null: null)."""
    return _by_value(col, lambda x: pc.equal(x, value))


def among(col: Any, values: Any) -> Any:
    """Whether each string of `col` (strings, or dictionary encoded) is one of `values` (null: false)."""
    value_set = pa.array(sorted(set(values)), pa.string())
    return _by_value(col, lambda x: pc.is_in(x, value_set=value_set))


def codes_in(strings: Any, names: pa.Array) -> np.ndarray:
    """Each string's place in `names` (-1: null, or not there); of a dictionary encoded piece, its
    dictionary's values are looked up once, then taken per row (no string decoded per row)."""
    out = [ints(pc.take(pc.index_in(part.dictionary, value_set=names), part.indices))
           if pa.types.is_dictionary(part.type) else ints(pc.index_in(part, value_set=names))
           for part in _pieces(strings)]
    return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)


def prev_max(segment: np.ndarray, values: np.ndarray) -> np.ndarray:
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
