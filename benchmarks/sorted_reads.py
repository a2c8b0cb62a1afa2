"""The chunked path's spill (docs/design.md §5.10, "Windows in chunks") of the producer ledger, the log
and the consumption ledger, against reading each chunk, a range of seqs, from a copy of their files
sorted by seq in small row groups (as ingest now writes the ledgers): the two ways a large window
gets its chunks, on the same rows.

Two sides over the same rows, alternating in one process, each using both cores:

- spill: what the chunked path does with a table it cannot read by range -- each table read once by pyarrow a
  batch at a time (strings dictionary-coded but the fingerprint), every row sent to the chunk of a
  hash of its (pid, seq) (`columnar.Split`'s hash), each chunk's rows appended to a zstd-compressed
  Arrow IPC stream held in memory (`driver.SPILL_OPTIONS`), then every chunk read back. It leaves
  out what the product's split also does (the order of consumption's narrow columns, the pids, the
  re-coding of wide dictionaries), so it is a lower bound of the product's spill of these tables;
- sorted reads: the same files rewritten once (not timed; the landing's cost, printed apart) sorted
  by seq, nulls first, in row groups of `--row-group` rows; the chunks are seq ranges cut at
  quantiles of the ledger's row-group statistics, and each chunk's rows are read by pyarrow with a
  filter on seq, which skips the row groups whose statistics lie outside the range (chunk 0 also
  takes the rows without a seq).

A plain read of the original files (every row once, nothing kept) is timed beside them. Both sides
must hand over every row exactly once (the totals are checked). The sinks are left out: they are a
user's tables, which reconcile cannot ask to be sorted, so they would still be spilled.

    .venv/bin/python benchmarks/reconcile_scale.py --n 10000000 --anomaly-rate 0.0001 --history 2 --generate-only --dir DIR
    .venv/bin/python benchmarks/sorted_reads.py --dir DIR --reps 2

This is a measurement script, not a test: it asserts nothing about time, it prints ratios.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import reconcile_scale as rs  # noqa: E402

from spark_jobs.reconcile.columnar import _MIX, _coded, _hash64, _int  # noqa: E402
from spark_jobs.reconcile.driver import DENSE_STRINGS, SPILL_BATCH_ROWS, SPILL_OPTIONS  # noqa: E402

TABLES = ("producer_ledger", "log_records", "consumed_records")
PARTITION_COLUMNS = ("topic", "part_hour")


def files(root: Path, table: str) -> list[str]:
    return sorted(str(p) for p in (root / table / f"topic={rs.TOPIC}").glob("*/*.parquet"))


def dataset(paths: list[str]) -> tuple[Any, list[str]]:
    """The files as one dataset, their string columns but the dense ones read dictionary-coded."""
    schema = pq.read_schema(paths[0])
    columns = [f.name for f in schema if f.name not in PARTITION_COLUMNS]
    codes = [f.name for f in schema if f.name in columns and pa.types.is_string(f.type) and f.name not in DENSE_STRINGS]
    form = ds.ParquetFileFormat(read_options=ds.ParquetReadOptions(dictionary_columns=codes))
    return ds.dataset(paths, format=form), columns


def chunk_of(batch: pa.RecordBatch, n: int) -> np.ndarray:
    """`columnar.Split`'s chunk of each row: a hash of (pid, seq); rows without both, chunk 0."""
    encoded = _coded(batch.column("pid"))
    hashes = np.append(_hash64(encoded.dictionary), np.uint64(0))
    with np.errstate(over="ignore"):
        mixed = (hashes[_int(encoded.indices)] ^ _int(batch.column("seq")).astype(np.uint64)) * _MIX
    identified = pc.fill_null(pc.and_(pc.is_valid(batch.column("pid")), pc.is_valid(batch.column("seq"))), False)
    return np.where(identified.to_numpy(zero_copy_only=False), (mixed >> np.uint64(32)) % np.uint64(n), 0).astype(np.uint8)


def spill(lake: Path, n: int) -> int:
    """Every row of the three tables spilled into `n` chunks and read back; the rows handed over."""
    held: dict[tuple[str, int], Any] = {}

    def one(table: str) -> None:
        data, columns = dataset(files(lake, table))
        writers: dict[int, Any] = {}
        for batch in data.to_batches(columns=columns, batch_size=SPILL_BATCH_ROWS, batch_readahead=1, fragment_readahead=1):
            chunk = chunk_of(batch, n)
            order = np.argsort(chunk, kind="stable")
            bounds = np.searchsorted(chunk[order], np.arange(n + 1))
            rows = batch.take(pa.array(order))
            for k in range(n):
                piece = rows.slice(bounds[k], bounds[k + 1] - bounds[k])
                if k not in writers:
                    held[(table, k)] = pa.BufferOutputStream()
                    writers[k] = pa.ipc.new_stream(held[(table, k)], piece.schema, options=SPILL_OPTIONS)
                writers[k].write_batch(piece)
        for w in writers.values():
            w.close()

    def back(k: int) -> int:
        return sum(pa.ipc.open_stream(held.pop((t, k)).getvalue()).read_all().num_rows for t in TABLES)

    with ThreadPoolExecutor(max_workers=2) as pool:
        list(pool.map(one, TABLES))
        return sum(pool.map(back, range(n)))


def rewrite(lake: Path, to: Path, row_group: int, by_seq: bool) -> None:
    """Every file of the three tables written again under `to`, sorted by seq (nulls first) or as it is."""
    for table in TABLES:
        for path in files(lake, table):
            out = to / Path(path).relative_to(lake)
            out.parent.mkdir(parents=True, exist_ok=True)
            rows = pq.read_table(path, partitioning=None)
            if by_seq:
                rows = rows.sort_by([("seq", "ascending", "at_start")])
            pq.write_table(rows, out, row_group_size=row_group, compression="snappy")


def seq_cuts(paths: list[str], n: int) -> list[int]:
    """n - 1 seqs cutting the rows of `paths` into n ranges of about as many rows, from their row
    groups' seq statistics (each row group's rows taken as spread evenly over its range)."""
    groups = []
    for path in paths:
        meta = pq.ParquetFile(path).metadata
        column = meta.schema.to_arrow_schema().get_field_index("seq")
        for g in range(meta.num_row_groups):
            stats = meta.row_group(g).column(column).statistics
            if stats is not None and stats.has_min_max:
                groups.append((stats.min, stats.max, meta.row_group(g).num_rows - stats.null_count))
    lo, hi = min(g[0] for g in groups), max(g[1] for g in groups) + 1
    grid = np.linspace(lo, hi, 4097)
    cdf = np.zeros(len(grid))
    for a, b, rows in groups:
        cdf += rows * np.clip((grid - a) / max(b - a, 1), 0, 1)
    return [int(x) for x in grid[np.searchsorted(cdf, np.arange(1, n) * cdf[-1] / n)]]


def sorted_reads(sorted_lake: Path, n: int) -> int:
    """Every chunk's rows of the three tables read from the sorted files by seq range; the rows handed over."""
    sets = {t: dataset(files(sorted_lake, t)) for t in TABLES}
    cuts = seq_cuts(files(sorted_lake, "producer_ledger"), n)

    def chunk(k: int) -> int:
        seq = ds.field("seq")
        where = None if k == 0 else seq >= cuts[k - 1]
        if k < n - 1:
            where = seq < cuts[k] if where is None else where & (seq < cuts[k])
        if k == 0:
            where = seq.is_null() | where
        return sum(data.to_table(columns=columns, filter=where, batch_readahead=1, fragment_readahead=1).num_rows
                   for data, columns in sets.values())

    with ThreadPoolExecutor(max_workers=2) as pool:
        return sum(pool.map(chunk, range(n)))


def plain_read(lake: Path) -> int:
    total = 0
    for table in TABLES:
        data, columns = dataset(files(lake, table))
        for batch in data.to_batches(columns=columns, batch_size=SPILL_BATCH_ROWS):
            total += batch.num_rows
    return total


def size(root: Path) -> int:
    return sum(p.stat().st_size for t in TABLES for p in (root / t).rglob("*.parquet"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", required=True, help="a work folder `reconcile_scale.py --generate-only --dir` generated")
    ap.add_argument("--chunks", type=int, default=16, help="chunks of the window (default 16: 10M messages' count)")
    ap.add_argument("--row-group", type=int, default=65536, help="rows of a row group in the sorted files")
    ap.add_argument("--reps", type=int, default=2, help="timed rounds of the sides, alternating (medians)")
    args = ap.parse_args(argv)
    lake = Path(args.dir) / "lake"
    if not all(files(lake, t) for t in TABLES):
        ap.error(f"{lake} holds no files of {', '.join(TABLES)} for topic {rs.TOPIC}: generate it first (see --help)")
    work = Path(args.dir) / "sorted-reads"
    shutil.rmtree(work, ignore_errors=True)
    t = time.perf_counter()
    rewrite(lake, work / "as-is", args.row_group, by_seq=False)
    as_is = time.perf_counter() - t
    t = time.perf_counter()
    rewrite(lake, work / "by-seq", args.row_group, by_seq=True)
    by_seq = time.perf_counter() - t
    shutil.rmtree(work / "as-is")
    print(f"files rewritten in row groups of {args.row_group:,} rows: as they are {as_is:.1f} s, sorted by seq "
          f"{by_seq:.1f} s (single-threaded); sorted files {size(work / 'by-seq') / 1e6:,.0f} MB against "
          f"{size(lake) / 1e6:,.0f} MB")
    sides: dict[str, Callable[[], int]] = {
        "spill": lambda: spill(lake, args.chunks),
        "sorted reads": lambda: sorted_reads(work / "by-seq", args.chunks),
        "plain read": lambda: plain_read(lake),
    }
    times: dict[str, list[float]] = {name: [] for name in sides}
    counts: set[int] = set()
    for side in sides.values():  # one untimed round
        counts.add(side())
    for r in range(args.reps):
        for name, side in (sides.items() if r % 2 == 0 else reversed(sides.items())):
            t, c = time.perf_counter(), os.times()
            counts.add(side())
            c1 = os.times()
            times[name].append(time.perf_counter() - t)
            print(f"round {r + 1} {name:12s} {times[name][-1]:6.2f} s (user {c1.user - c.user:.1f} s, "
                  f"system {c1.system - c.system:.1f} s)", flush=True)
    shutil.rmtree(work, ignore_errors=True)
    if len(counts) != 1:
        print(f"the sides handed over different row counts: {sorted(counts)}")
        return 1
    med = {name: statistics.median(ts) for name, ts in times.items()}
    print(f"rows of the three tables: {counts.pop():,}; {args.chunks} chunks; medians of {args.reps}")
    for name, m in med.items():
        print(f"  {name:12s} {m:6.2f} s")
    print(f"summary: sorted reads / spill {med['sorted reads'] / med['spill']:.2f}, "
          f"sorted reads / plain read {med['sorted reads'] / med['plain read']:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
