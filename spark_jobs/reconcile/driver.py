"""Small windows in the driver: a batch whose inputs hold at most `reconcile.driver_rows` rows is
collected (one Spark job; inputs of more than a few MB are counted first) and classified in this
process by the rules' plain statement, `audit.oracle` (docs/design.md §5.8).

A Spark plan pays a fixed cost whatever its size: some forty jobs, a few hundred generated
classes, a checkpoint per shared step. For a window of a few thousand messages that fixed cost is
nearly all of the run; reading the rows once and applying the same rules in Python is several
times faster. The property test runs the Spark classifier itself and holds it equal to the oracle
row for row, so this path adds no third statement of the rules, only a second place where the
first one runs.

`collect_inputs` is I/O (the rows, and how many there are); `classify_collected` calls the oracle
once per topic. `collect_tables` is the medium windows' I/O (`columnar`, §5.10): the rows as Arrow
columns, a table pinned to plain Parquet files (a lake table, a Delta sink) read by pyarrow
(`parquet_reader`), the rest handed over by Spark. `spill_tables` is the large windows' I/O: the rows
split by message into chunks (ranges of seqs), a table whose files hold narrow seq ranges per row
group read chunk by chunk from them (`RowGroups`), the others read once and each chunk's rows
written to Arrow IPC files held in memory or in a temporary folder the caller owns (`spill_held`
chooses); it writes nothing else.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import fields
from datetime import datetime
from functools import reduce
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from audit import oracle
from audit.core.config import TopicConfig
from audit.core.vocabulary import COMMITTED
from spark_jobs.io.lake import kept_rows, local_path, scala_items
from spark_jobs.reconcile import columnar
from spark_jobs.reconcile.columnar import row_maker
from spark_jobs.reconcile.columnar import values as _values
from spark_jobs.reconcile.inputs import WindowInputs, restrict, sink_rows
from spark_jobs.reconcile.params import Shape

# tag of a collected row (the `WindowInputs` field it comes from) -> the oracle's row type
_TYPES: Mapping[str, type] = {
    "ledger": oracle.LedgerRow, "log": oracle.LogRecord, "consumed": oracle.ConsumedRow,
    "group_offsets": oracle.GroupOffset, "watermarks": oracle.Watermark, "sink": oracle.SinkRow,
    "mirror_log": oracle.MirrorRecord, "mirror_watermarks": oracle.MirrorWatermark,
    "mirror_group_offsets": oracle.MirrorGroupOffset,
}
_TAG = "_msgaudit_input"


def _frames(inputs: WindowInputs) -> list[tuple[str, DataFrame]]:
    """The window's input frames by tag (each tag of `_TYPES` is a field of `WindowInputs`, but
    'sink': every sink's rows in one frame), as read: the oracle applies the exact visibility itself."""
    named = [(tag, sink_rows(inputs) if tag == "sink" else getattr(inputs, tag)) for tag in _TYPES]
    return [(tag, df) for tag, df in named if df is not None]


# Inputs that are not all plain local Parquet (a JDBC sink, an object store) and whose files hold at
# most this many bytes are collected at once and counted as collected (about what
# `reconcile.driver_rows` rows take in Parquet: collecting a larger input only to find it goes to
# another path would cost more than the count it saves); larger ones are counted first.
COLLECT_FIRST_MAX_BYTES = 16 << 20


def collect_within(df: DataFrame, limit: int) -> tuple[pa.Table | None, int]:
    """(`df`'s rows as Arrow, or None when it holds more than `limit` rows; how many rows it holds),
    all on the one plan that listed the files -- planning a query over Delta tables lists each
    table's files (a Spark job per table). When every scan is a Delta table of plain local Parquet
    files, the rows those files hold are counted from their footers first (`lake.kept_rows`: no job;
    filters on data columns aside, so at least `df`'s rows): more than `limit`, nothing is read;
    else one job, the collect, counted as collected. Otherwise by the plan's size estimate: files of
    at most COLLECT_FIRST_MAX_BYTES, one job, the collect, counted as it arrives; larger, or of
    unknown size, Spark's count of no column on that plan (`count_rows`), then the collect when the
    count is within `limit`."""
    count = kept_rows(df)
    if count is None and int(df._jdf.queryExecution().optimizedPlan().stats().sizeInBytes()) > COLLECT_FIRST_MAX_BYTES:
        count = count_rows(df)
    if count is not None and count > limit:
        return None, count
    table = df.toArrow()
    return (table if table.num_rows <= limit else None), table.num_rows


def count_rows(df: DataFrame) -> int:
    """How many rows `df` holds, counted without reading a column, on top of `df`'s optimised plan
    (never a new one: a Delta scan's files are listed once, when `df` is planned)."""
    session = df.sparkSession
    jvm: Any = session.sparkContext._jvm
    planned = jvm.org.apache.spark.sql.classic.Dataset.ofRows(session._jsparkSession,
                                                              df._jdf.queryExecution().optimizedPlan())
    return int(planned.count())


def collect_inputs(spark: SparkSession, inputs: WindowInputs,
                   limit: int) -> tuple[oracle.Inputs | None, int, DataFrame]:
    """(every row of the window's inputs as the oracle's rows, or None when they hold more than
    `limit` rows; how many rows they hold; the union of the inputs that was planned, whose Delta
    scans listed the files: `inputs.pinned` takes them from it). At most two Spark jobs beside the
    files' listing: a count unless the files' footers give it, then the rows unless there are too
    many (`collect_within`)."""
    parts = []
    wanted: dict[str, list[str]] = {}
    for tag, df in _frames(inputs):
        cols = [f.name for f in fields(_TYPES[tag]) if f.name in df.columns]
        wanted[tag] = cols
        extra = ["sink"] if tag == "sink" else []  # the sink's name
        parts.append(df.select(*cols, *extra, F.lit(tag).alias(_TAG)))
    union = reduce(lambda a, b: a.unionByName(b, allowMissingColumns=True), parts)
    # Arrow hands the rows over several times faster than pickled Rows, with aware (UTC) timestamps;
    # each tag's rows are taken apart column by column, its own columns only (the union is as wide
    # as all tags together, and a Python dict of every column per row took most of the time)
    table, count = collect_within(union, limit)
    if table is None:
        return None, count, union
    tags = table.column(_TAG)
    out: dict[str, list[Any]] = {tag: [] for tag in _TYPES}
    sinks: dict[str, list[Any]] = {}
    for tag in wanted:
        part = table.filter(pc.equal(tags, tag))
        if not part.num_rows:
            continue
        cols = wanted[tag]
        make = row_maker(_TYPES[tag], cols)
        rows = [make(*values) for values in zip(*(_values(part.column(c)) for c in cols), strict=True)]
        if tag != "sink":
            out[tag] = rows
            continue
        for name, row in zip(part.column("sink").to_pylist(), rows, strict=True):
            sinks.setdefault(name, []).append(row)
    return oracle.Inputs(ledger=out["ledger"], log=out["log"], consumed=out["consumed"],
                         group_offsets=out["group_offsets"], watermarks=out["watermarks"], sinks=sinks,
                         mirror_log=out["mirror_log"], mirror_watermarks=out["mirror_watermarks"],
                         mirror_group_offsets=out["mirror_group_offsets"]), count, union


def classify_collected(inputs: oracle.Inputs, topics: Sequence[TopicConfig], ws: datetime,
                       as_of: datetime) -> dict[str, oracle.OracleResult]:
    """The oracle's result for each topic, each given only its own rows (one pass over the rows)."""
    split: dict[str, dict[str, Any]] = {tc.name: {"sinks": {}} for tc in topics}
    for name in ("ledger", "log", "consumed", "group_offsets", "watermarks", "mirror_log", "mirror_watermarks",
                 "mirror_group_offsets"):
        for r in getattr(inputs, name):
            if r.topic in split:
                split[r.topic].setdefault(name, []).append(r)
    for sink, rows in inputs.sinks.items():
        for r in rows:
            if r.topic in split:
                split[r.topic]["sinks"].setdefault(sink, []).append(r)
    return {tc.name: oracle.reconcile_window(tc, ws, as_of, oracle.Inputs(**split[tc.name])) for tc in topics}


def _arrow(df: DataFrame, cls: type, extra: Sequence[str] = ()) -> pa.Table:
    """`df`'s columns that are `cls`'s fields (and `extra`), handed over by Spark."""
    return df.select(*[f.name for f in fields(cls) if f.name in df.columns], *extra).toArrow()


def _direct(df: DataFrame, cls: type, batch_rows: int | None = None, coded: bool = False) -> Any:
    """`_arrow(df, cls)`, read by pyarrow from the files of a pinned plain-Parquet scan when `df` is
    one (four to five times faster than Spark's scan and hand-over), else by Spark; with
    `batch_rows`, as record batches. `coded`: read by pyarrow, the strings come dictionary-coded
    (`parquet_reader`'s `coded`; Spark's come plain)."""
    columns = [f.name for f in fields(cls) if f.name in df.columns]
    read = parquet_reader(df, columns)
    if read is not None:
        return read(batch_rows, coded=coded)
    table = _arrow(df, cls)
    return table if batch_rows is None else _batches(iter(table.to_batches(max_chunksize=batch_rows)), table.schema)


def _batches(batches: Iterator[pa.RecordBatch], schema: pa.Schema | None = None) -> Iterator[pa.RecordBatch]:
    """`batches`, or one empty batch of `schema` when there are none (so a reader of them learns the
    columns: `spill_tables` writes every chunk's file of every table)."""
    first = next(batches, None)
    if first is None:
        if schema is not None:
            yield pa.RecordBatch.from_pylist([], schema=schema)
        return
    yield first
    yield from batches


def _small(df: DataFrame | None, cls: type) -> list[Any]:
    """A small input's rows (watermarks, group offsets) as the oracle's rows."""
    if df is None:
        return []
    table = _arrow(df, cls)
    make = row_maker(cls, table.column_names)
    return [make(*v) for v in zip(*(_values(table.column(c)) for c in table.column_names), strict=True)]


def _sink_tables(inputs: WindowInputs, shape: Shape, ws: datetime, batch_rows: int | None = None,
                 coded: bool = False) -> dict[str, Any]:
    """Each sink's rows (`oracle.SinkRow` columns) as `_direct` gives them. A sink is a user's table
    of every window: its scan was pinned to the files whose sink_ts range meets the window's
    (`reconcile_batch` counts the inputs with the sinks restricted); a sink of one topic is read from
    them by pyarrow where it can be, several topics' sinks by Spark."""
    visible = restrict(inputs, shape, ws)
    sinks = {name: _direct(df, oracle.SinkRow, batch_rows, coded) for name, df in visible.sinks.items()}
    if visible.sink_rows is not None:
        rows = _arrow(visible.sink_rows, oracle.SinkRow, ["sink"])
        for name in pc.unique(rows["sink"]).to_pylist():
            one = rows.filter(pc.equal(rows["sink"], name)).drop_columns(["sink"])
            sinks[name] = one if batch_rows is None else _batches(iter(one.to_batches(max_chunksize=batch_rows)),
                                                                  one.schema)
    return sinks


def collect_tables(inputs: WindowInputs, shape: Shape, ws: datetime) -> columnar.Tables:
    """The window's rows as Arrow columns for the columnar path (`columnar`, docs/design.md §5.10):
    each lake table's own columns (the oracle's row fields) as read, by pyarrow where it can
    (`parquet_reader`), else in one Spark job each; each sink's rows the same way, from the files
    of the window's range (`_sink_tables`); the watermarks and group offsets (small) as the oracle's
    rows. The columnar path applies the exact visibility."""
    return columnar.Tables(ledger=_direct(inputs.ledger, oracle.LedgerRow),
                           log=_direct(inputs.log, oracle.LogRecord),
                           consumed=None if inputs.consumed is None else _direct(inputs.consumed, oracle.ConsumedRow),
                           sinks=_sink_tables(inputs, shape, ws), group_offsets=_small(inputs.group_offsets, oracle.GroupOffset),
                           watermarks=_small(inputs.watermarks, oracle.Watermark))


SPILL_BATCH_ROWS = 1 << 20  # rows of a table split at a time (`spill_tables`)
# The strings a spill carries are read from Parquet dictionary-coded (`parquet_reader`'s `coded`)
# and made plain again as each chunk is read back (`_plain`): splitting and compressing then move
# small integer codes, not the strings (a pid, a group, an outcome: a few values repeated on every
# row), and the read skips decoding them. Not a fingerprint: a value per message, nothing to share.
DENSE_STRINGS = frozenset({"fingerprint"})
# the spill's buffers are compressed (as Spark compresses its own spills): under a quarter of the
# bytes to write, hold and map back, for some seconds of compression (docs/benchmarks.md)
SPILL_OPTIONS = pa.ipc.IpcWriteOptions(compression="zstd")
# A window's spill is held in this process's memory when it would take at most SPILL_HELD_MAX_BYTES
# and a quarter of the memory available (`spill_held`), else written to files in TMPDIR: held, it
# needs no room there and writes nothing to disk (about as fast as files in the page cache,
# docs/benchmarks.md). A row takes about 20 to 30 bytes compressed; the estimate is generous.
SPILL_BYTES_PER_ROW = 40
SPILL_HELD_MAX_BYTES = 4 << 30


def _available_memory() -> int:
    """The bytes of memory the system could give this process now (Linux: MemAvailable), or 0 when it
    does not say."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def spill_held(rows: int) -> bool:
    """Whether the spill of a window of `rows` input rows is held in memory (else in files)."""
    need = rows * SPILL_BYTES_PER_ROW
    return need <= SPILL_HELD_MAX_BYTES and need <= _available_memory() // 4


def spill_tables(inputs: WindowInputs, shape: Shape, ws: datetime, n: int,
                 folder: Path | None) -> tuple[columnar.Split, Callable[[int], columnar.Tables]] | None:
    """The window's rows split into `n` chunks by message (`columnar.Split`, docs/design.md §5.10), the
    chunks ranges of seqs cut at the ledger's quantiles (`_cuts`): a table whose files hold narrow
    seq ranges per row group (`RowGroups.read_cost`) is left where it is, each chunk's rows read
    from its row groups; each other table read once, a batch at a time, by pyarrow from the files of
    its pinned scan (`parquet_reader`; a sink Spark reads is handed over whole), each chunk's rows
    appended to an Arrow IPC file, in `folder` or, when it is None, in memory (`spill_held`); and
    `chunk(k)`, the rows of chunk k as `Tables` (a spilled table's read back from its files, each
    once, then let go). None when the ledger, the log or the consumption rows are not plain Parquet files pyarrow
    can read: the Spark plan classifies the window then."""
    readers: dict[str, Any] = {}
    for kind, df, cls in (("ledger", inputs.ledger, oracle.LedgerRow), ("log", inputs.log, oracle.LogRecord),
                          ("consumed", inputs.consumed, oracle.ConsumedRow)):
        if df is None:
            continue
        read = parquet_reader(df, [f.name for f in fields(cls) if f.name in df.columns])
        if read is None:
            return None
        readers[kind] = read
    # chunks are ranges of seqs cut at the ledger's quantiles; a table whose files hold them in row
    # groups of narrow seq ranges (`lake.by_seq`) is read chunk by chunk from those, not spilled
    groups = {kind: read(coded=True, by_row_group=True) for kind, read in readers.items()}
    cuts = _cuts(groups["ledger"].seqs(), n) if all(g is not None for g in groups.values()) else None
    split = columnar.Split(n, shape.topics, ws, cuts)
    ranged: dict[str, RowGroups] = {}
    sources: list[tuple[str, str, Any]] = []
    for kind, read in readers.items():
        rg = groups[kind]
        if cuts is not None and rg is not None and rg.read_cost(cuts) <= RANGED_COST:
            ranged[kind] = rg
        else:
            sources.append((kind, kind, read(SPILL_BATCH_ROWS, coded=True)))
    for name, batches in _sink_tables(inputs, shape, ws, batch_rows=SPILL_BATCH_ROWS, coded=True).items():
        sources.append(("sink", "sink:" + name, batches))
    held: dict[str, Any] = {}  # file name -> its buffer, when the spill is held in memory

    def target(name: str) -> Any:
        if folder is None:
            held[name] = pa.BufferOutputStream()
            return held[name]
        return str(folder / name)

    def spill(kind: str, key: str, batches: Iterator[pa.RecordBatch]) -> None:
        writers: dict[int, Any] = {}
        try:
            for batch in batches:  # at least one (`_batches`): every chunk has a file of every table
                wide = _wide_codes(batch, n)
                for k, pieces in enumerate(split.split(kind, batch)):
                    for piece in pieces:
                        piece = _recoded(piece, wide)
                        if k not in writers:  # a stream: each batch's dictionaries may differ
                            writers[k] = pa.ipc.new_stream(target(f"{key}.{k}.arrow"), piece.schema,
                                                           options=SPILL_OPTIONS)
                        writers[k].write_batch(piece)
        finally:
            for w in writers.values():
                w.close()

    # two tables at a time, a ranged table's pass (`RowGroups.note`) beside the spills: reading,
    # splitting and writing let go of the interpreter most of the time. The consumption rows first:
    # their pass is the longest (every column, in the order `_row` numbers them)
    with ThreadPoolExecutor(max_workers=2, thread_name_prefix="msgaudit-spill") as pool:
        noted = [pool.submit(rg.note, split, kind) for kind, rg in sorted(ranged.items(), key=lambda kv: kv[0] != "consumed")]
        for done in [*noted, *(pool.submit(spill, *source) for source in sources)]:
            done.result()

    group_offsets, watermarks = _small(inputs.group_offsets, oracle.GroupOffset), _small(inputs.watermarks, oracle.Watermark)

    def table(key: str, k: int) -> pa.Table:
        """Chunk k's rows of `key`, decompressed, strings plain; its file let go at once (each chunk
        is read once: a file's pages are not kept in the page cache, a held buffer is freed)."""
        name = f"{key}.{k}.arrow"
        if folder is None:
            return _plain(pa.ipc.open_stream(held.pop(name).getvalue()).read_all())
        rows = pa.ipc.open_stream(pa.memory_map(str(folder / name))).read_all()
        (folder / name).unlink()
        return _plain(rows)

    def table_of(kind: str, k: int) -> pa.Table:
        return _plain(ranged[kind].chunk(split, kind, k)) if kind in ranged else table(kind, k)

    def chunk(k: int) -> columnar.Tables:
        return columnar.Tables(
            ledger=table_of("ledger", k), log=table_of("log", k),
            consumed=None if inputs.consumed is None else table_of("consumed", k),
            sinks={key[5:]: table(key, k) for _, key, _ in sources if key.startswith("sink:")},
            group_offsets=group_offsets, watermarks=watermarks)

    return split, chunk


_LOW, _HIGH = np.iinfo(np.int64).min, np.iinfo(np.int64).max


class RowGroups:
    """A table's files by row group, in the order `parquet_reader` reads them: each row group's first
    row in that order and the range of its seqs (the files' statistics), so that a chunk, a range of
    seqs, is read from the row groups that may hold its rows (docs/design.md §5.10). A row group that
    may hold a row of chunk 0 or of every chunk whatever its seq (a null pid or seq, a log record's
    header error, a consumer's `committed` row) or that lacks statistics is read for every chunk;
    each row's chunk is then `Split.chunk_ids`' own, so the rows read are exact either way."""

    def __init__(self, data: Any, columns: list[str], renamed: Callable[[pa.Table], pa.Table]) -> None:
        self._data, self._columns, self._renamed = data, columns, renamed
        self._units: list[tuple[Any, int]] = []  # (file fragment, row group)
        rows, lo, hi, odd = [], [], [], []
        for frag in data.get_fragments():
            meta = frag.metadata
            names = meta.schema.to_arrow_schema().names
            index = {c: names.index(c) for c in ("seq", "pid", "header_error", "outcome") if c in names}
            for g in range(meta.num_row_groups):
                group = meta.row_group(g)
                stats = {c: group.column(i).statistics for c, i in index.items()}
                self._units.append((frag, g))
                rows.append(group.num_rows)
                seq = stats.get("seq")
                if seq is not None and seq.has_min_max:
                    lo.append(seq.min)
                    hi.append(seq.max)
                    odd.append(_may_hold(stats, group.num_rows))
                else:
                    lo.append(_LOW)
                    hi.append(_HIGH)
                    odd.append(True)
        self._rows = np.array(rows, np.int64)
        self._starts = np.concatenate([[0], np.cumsum(self._rows)[:-1]]).astype(np.int64)
        self._lo, self._hi, self._odd = np.array(lo, np.int64), np.array(hi, np.int64), np.array(odd, bool)

    def seqs(self) -> np.ndarray:
        """Every row's seq (nulls left out)."""
        col = self._data.to_table(columns=["seq"]).column("seq")
        return pc.drop_null(col).to_numpy()

    def needed(self, cuts: np.ndarray, k: int) -> np.ndarray:
        """The row groups that may hold rows of chunk k (seqs from cuts[k - 1] up to cuts[k])."""
        lo = _LOW if k == 0 else cuts[k - 1]
        hi = _HIGH if k == len(cuts) else cuts[k]
        return np.flatnonzero(self._odd | ((self._lo < hi) & (self._hi >= lo)))

    def read_cost(self, cuts: np.ndarray) -> float:
        """The rows every chunk's read takes together, over the table's rows."""
        read = sum(int(self._rows[self.needed(cuts, k)].sum()) for k in range(len(cuts) + 1))
        return read / max(int(self._rows.sum()), 1)

    def _read(self, g: int) -> pa.Table:
        """Row group g's rows, as the reader's columns."""
        import pyarrow.dataset as ds

        frag, group = self._units[g]
        one = ds.FileSystemDataset([frag.subset(row_group_ids=[group])], schema=self._data.schema,
                                   format=self._data.format)
        return self._renamed(one.to_table(columns=self._columns))

    def _numbered(self, kind: str, g: int) -> pa.Table:
        """Row group g's rows; a consumption row with its place in the order read (`_row`)."""
        rows = self._read(g)
        if kind == "consumed":
            rows = rows.append_column("_row", pa.array(np.arange(self._starts[g], self._starts[g] + rows.num_rows)))
        return rows

    def note(self, split: columnar.Split, kind: str) -> None:
        """What `split` gathers of every row of the table as the rows pass (`Split.note`): the
        pids; for the consumption rows, each one's place in the order read and the processings."""
        if kind != "consumed":
            col = self._data.to_table(columns=["pid"]).column("pid")
            split.note(kind, pa.record_batch([pa.concat_arrays([c.dictionary if pa.types.is_dictionary(c.type) else c
                                                                for c in col.chunks]) if col.num_chunks
                                              else pa.array([], pa.string())], names=["pid"]))
            return
        for g in range(len(self._units)):  # the order read: row groups in order, each one's rows in order
            for batch in self._read(g).to_batches():
                split.note(kind, batch)

    def chunk(self, split: columnar.Split, kind: str, k: int) -> pa.Table:
        """Chunk k's rows (`Split.chunk_ids`), read from the row groups that may hold them."""
        assert split.cuts is not None
        pieces = []
        for g in self.needed(split.cuts, k):
            rows = self._numbered(kind, g)
            if not rows.num_rows:
                continue
            ids = split.chunk_ids(kind, rows.combine_chunks().to_batches()[0])
            pieces.append(rows.filter(pa.array((ids == k) | (ids == split.n))))
        if not pieces:
            empty = self._renamed(self._data.schema.empty_table().select(self._columns))
            return empty.append_column("_row", pa.array([], pa.int64())) if kind == "consumed" else empty
        return pa.concat_tables(pieces)


def _may_hold(stats: Mapping[str, Any], rows: int) -> bool:
    """Whether a row group (its columns' statistics, None when a file lacks the column) may hold a row
    whose chunk is not its seq's: a null pid or seq, a header error, a consumer's `committed` row."""
    def nulls(c: str) -> bool:
        st = stats.get(c)
        return st is not None and (not st.has_null_count or st.null_count > 0)

    err, outcome = stats.get("header_error"), stats.get("outcome")
    return (nulls("seq") or nulls("pid") or "pid" not in stats
            or (err is not None and (not err.has_null_count or err.null_count < rows))
            or (outcome is not None and (not outcome.has_min_max or outcome.min <= COMMITTED <= outcome.max)))


# a table's chunks are read from its row groups when all of them together read at most this many
# times its rows (`RowGroups.read_cost`); else the table is spilled
RANGED_COST = 1.5


def _cuts(seqs: np.ndarray, n: int) -> np.ndarray | None:
    """n - 1 seqs cutting `seqs` into n ranges of about as many (None when there are none)."""
    if not len(seqs):
        return None
    ranks = [len(seqs) * k // n for k in range(1, n)]
    return np.partition(seqs, ranks)[ranks].astype(np.int64) if ranks else np.empty(0, np.int64)


def _wide_codes(batch: pa.RecordBatch, n: int) -> list[int]:
    """The dictionary-coded columns of `batch` whose dictionary, which each of `n` chunks' streams
    repeats, would take more than a value per row of the batch (a string column with a value per
    message): each chunk's piece of them is coded anew with its own values (`_recoded`), so the
    spill stays about as large as the rows."""
    return [i for i, f in enumerate(batch.schema)
            if pa.types.is_dictionary(f.type) and len(batch.column(i).dictionary) * n > batch.num_rows]


def _recoded(piece: pa.RecordBatch, columns: Sequence[int]) -> pa.RecordBatch:
    """`piece` with each of `columns` (dictionary-coded) coded anew: a dictionary of its own values."""
    for i in columns:
        f = piece.schema.field(i)
        piece = piece.set_column(i, f, pc.dictionary_encode(pc.cast(piece.column(i), f.type.value_type)))
    return piece


def _plain(table: pa.Table) -> pa.Table:
    """`table` with its dictionary-coded columns as plain ones (the columnar path's types)."""
    if not any(pa.types.is_dictionary(f.type) for f in table.schema):
        return table
    return table.cast(pa.schema([f.with_type(f.type.value_type) if pa.types.is_dictionary(f.type) else f
                                 for f in table.schema]))


_ARROW_TYPES = {"string": pa.string(), "bigint": pa.int64(), "int": pa.int32(), "boolean": pa.bool_(),
                "timestamp": pa.timestamp("us", "UTC")}


_NULL = ""  # `_sources`: a column that is a null literal (an optional column its table lacks)


def _sources(plan: Any, leaf: Any) -> dict[str, str] | None:
    """Each output column of `plan` that is a column of `leaf` passed through, perhaps renamed (a
    sink's mapped audit columns), as {output name: the leaf's column name}, or `_NULL` for a null
    literal (an optional column the table lacks, `lake.read_input_table`); other output columns
    are left out (computed: Spark's to read). None when a node between them is not a projection or
    a filter: filters do not change a column, the columnar path applies the exact visibility."""
    projects = []
    node = plan
    while not node.equals(leaf):
        kind = node.getClass().getSimpleName()
        if kind not in ("Project", "Filter"):
            return None
        if kind == "Project":
            projects.append(node)
        node = node.child()
    ids: dict[int, str] = {a.exprId().id(): a.name() for a in scala_items(leaf.output())}

    def source(e: Any) -> str | None:
        kind = e.getClass().getSimpleName()
        if kind == "AttributeReference":
            return ids.get(e.exprId().id())
        if kind == "Alias":
            return source(e.child())
        if kind == "Literal" and e.value() is None:
            return _NULL
        return None

    for project in reversed(projects):
        step = {e.exprId().id(): source(e) for e in scala_items(project.projectList())}
        ids = {k: v for k, v in step.items() if v is not None}
    return {a.name(): ids[a.exprId().id()] for a in scala_items(plan.output()) if a.exprId().id() in ids}


def parquet_reader(df: DataFrame, columns: Sequence[str]) -> Any:
    """A function reading `columns` of `df`'s rows with pyarrow, or None unless `df` is one local table's
    rows as they are in its files: projections and filters over a scan of plain Parquet files (a
    pinned Delta scan, `inputs.pinned`) whose directories name its partition values, each column one
    of the table's, passed through or renamed (a sink's audit columns), or null (an optional column
    the table lacks, `lake.read_input_table`). Its filters (topic, hours, a sink's range) are not
    applied: the columnar path applies the exact visibility, and rows of other topics or hours are
    left out there."""
    plan = df._jdf.queryExecution().optimizedPlan()
    leaves = scala_items(plan.collectLeaves())
    if len(leaves) != 1:
        return None
    leaf = leaves[0]
    types = dict(df.dtypes)
    if any(types.get(c) not in _ARROW_TYPES for c in columns):
        return None
    schema = pa.schema([(c, _ARROW_TYPES[types[c]]) for c in columns])
    if leaf.getClass().getSimpleName() == "LocalRelation":  # rows handed over from Python, or no file kept
        if not leaf.data().isEmpty():
            return None
        return lambda batch_rows=None, coded=False, by_row_group=False: \
            None if by_row_group else schema.empty_table() if batch_rows is None else _batches(iter(()), schema)
    if leaf.getClass().getName() != "org.apache.spark.sql.execution.datasources.LogicalRelation":
        return None
    relation = leaf.relation()
    if relation.getClass().getName() != "org.apache.spark.sql.execution.datasources.HadoopFsRelation":
        return None  # a Delta scan (deletion vectors, column mapping) or another source: Spark reads it
    if relation.fileFormat().getClass().getSimpleName() != "ParquetFileFormat":
        return None
    sources = _sources(plan, leaf)
    if sources is None or any(c not in sources for c in columns):
        return None
    files = [str(f) for f in relation.location().inputFiles()]
    if not all(f.startswith("file:") for f in files):
        return None
    partition_columns = [f.name() for f in relation.partitionSchema().fields()]
    base = relation.options().get("basePath")
    if partition_columns and not base.isDefined():
        return None
    root = local_path(str(base.get())) if partition_columns else None
    # each file column read as the table's type; one schema for every file, so a file written before
    # a column was added reads it as null (a schema taken from one file would drop it from all)
    read_as = {sources[c]: _ARROW_TYPES[types[c]] for c in columns if sources[c] != _NULL}
    if any(p in read_as and read_as[p] != pa.string() for p in partition_columns):
        return None
    physical = pa.schema([*((p, t) for p, t in read_as.items() if p not in partition_columns),
                          *((p, pa.string()) for p in partition_columns)])

    def read(batch_rows: int | None = None, coded: bool = False, by_row_group: bool = False) -> Any:
        """The rows as one table; with `batch_rows`, an iterator of record batches of at most that many;
        `by_row_group`: the files by row group (`RowGroups`). `coded`: the string columns in the files
        (but DENSE_STRINGS) as Parquet stores them, dictionary-coded (`pa.dictionary(int32, string)`;
        a batch's dictionary may differ from the last's)."""
        import pyarrow.dataset as ds

        codes = {c for c, t in read_as.items() if coded and t == pa.string() and c not in partition_columns
                 and c not in DENSE_STRINGS}

        def coding(f: pa.Field, name: str) -> pa.Field:
            return f.with_type(pa.dictionary(pa.int32(), f.type)) if name in codes else f

        paths = [local_path(f) for f in files]
        parts = ds.partitioning(pa.schema([(c, pa.string()) for c in partition_columns]), flavor="hive") \
            if partition_columns else None
        form = ds.ParquetFileFormat(read_options=ds.ParquetReadOptions(dictionary_columns=codes)) if codes else "parquet"
        data = ds.dataset(paths, schema=pa.schema([coding(f, f.name) for f in physical]), format=form,
                          partitioning=parts, partition_base_dir=root)
        out = pa.schema([coding(f, sources[f.name]) for f in schema])

        def renamed(got: Any, kind: Any) -> Any:
            return kind.from_arrays([pa.nulls(got.num_rows, f.type) if sources[f.name] == _NULL
                                     else got.column(sources[f.name]) for f in out], schema=out)

        if by_row_group:
            return RowGroups(data, list(read_as), lambda t: renamed(t, pa.Table))
        if batch_rows is None:
            return renamed(data.to_table(columns=list(read_as)), pa.Table)
        # one file and a batch ahead, not the dataset's default of many: memory of a batch or two
        return _batches((renamed(b, pa.RecordBatch) for b in data.to_batches(
            columns=list(read_as), batch_size=batch_rows, batch_readahead=1, fragment_readahead=1)), out)

    return read
