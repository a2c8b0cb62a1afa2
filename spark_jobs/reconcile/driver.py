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
columns, a lake table pinned to plain Parquet files read by pyarrow (`parquet_reader`), the rest
handed over by Spark. None of them writes anything.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import fields
from datetime import datetime
from functools import reduce
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from audit import oracle
from audit.core.config import TopicConfig
from spark_jobs.io.lake import OPTIONAL_COLUMNS
from spark_jobs.reconcile import columnar
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


# Inputs whose files hold at most this many bytes are collected at once and counted as collected
# (about what `reconcile.driver_rows` rows take in Parquet: collecting a larger input only to find it
# goes to the Spark plan would cost more than the count it saves); larger ones are counted first.
COLLECT_FIRST_MAX_BYTES = 16 << 20


def collect_within(df: DataFrame, limit: int) -> tuple[pa.Table | None, int]:
    """(`df`'s rows as Arrow, or None when it holds more than `limit` rows; how many rows it holds),
    all on the one plan whose size estimate chose how -- planning a query over Delta tables lists
    each table's files (a Spark job per table). Files of at most COLLECT_FIRST_MAX_BYTES (the
    estimate; for a Delta scan, the files it keeps): one job, the collect, counted as it arrives.
    Larger, or of unknown size: first a count that reads no column on top of that optimised plan,
    whose scans keep the files they listed (`count_rows`), then the collect on the same plan."""
    if int(df._jdf.queryExecution().optimizedPlan().stats().sizeInBytes()) <= COLLECT_FIRST_MAX_BYTES:
        table = df.toArrow()
        count = table.num_rows
    else:
        count = count_rows(df)
        table = df.toArrow() if count <= limit else None
    return (table if count <= limit else None), count


def count_rows(df: DataFrame) -> int:
    """How many rows `df` holds, counted without reading a column, on top of `df`'s optimised plan
    (never a new one: a Delta scan's files are listed once, when `df` is planned)."""
    session = df.sparkSession
    jvm: Any = session.sparkContext._jvm
    planned = jvm.org.apache.spark.sql.classic.Dataset.ofRows(session._jsparkSession,
                                                              df._jdf.queryExecution().optimizedPlan())
    return int(planned.count())


def _maker(cls: type, cols: list[str]) -> Any:
    """Builds a `cls` from the values of `cols`, in that order: positionally when they are its
    leading positional fields (most tags), else by keyword."""
    positional = [f.name for f in fields(cls) if f.init and not f.kw_only]
    if cols == positional[:len(cols)]:
        return cls
    return lambda *values: cls(**dict(zip(cols, values, strict=True)))


def collect_inputs(spark: SparkSession, inputs: WindowInputs,
                   limit: int) -> tuple[oracle.Inputs | None, int, DataFrame]:
    """(every row of the window's inputs as the oracle's rows, or None when they hold more than
    `limit` rows; how many rows they hold; the union of the inputs that was planned, whose Delta
    scans listed the files: `inputs.pinned` takes them from it). One Spark job beside the files'
    listing for small inputs (the rows), two for larger ones (a count, then the rows unless there
    are too many: `collect_within`)."""
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
        make = _maker(_TYPES[tag], cols)
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


def collect_tables(inputs: WindowInputs, shape: Shape, ws: datetime) -> columnar.Tables:
    """The window's rows as Arrow columns for the columnar path (`columnar`, docs/design.md §5.10):
    each lake table's own columns (the oracle's row fields) as read, by pyarrow where it can
    (`parquet_reader`), else in one Spark job each; the sinks' visible rows (a sink is a user's
    table of every window: its rows outside the window's range are not handed over), split by sink;
    the watermarks and group offsets (small) as the oracle's rows."""
    def arrow(df: DataFrame, cls: type, extra: Sequence[str] = ()) -> pa.Table:
        return df.select(*[f.name for f in fields(cls) if f.name in df.columns], *extra).toArrow()

    def direct(df: DataFrame, cls: type, table: str) -> pa.Table:
        """`arrow(df, cls)`, read by pyarrow from the files of a pinned plain-Parquet scan when `df`
        is one (four to five times faster than Spark's scan and hand-over), else by Spark."""
        columns = [f.name for f in fields(cls) if f.name in df.columns]
        read = parquet_reader(df, columns, OPTIONAL_COLUMNS.get(table, ()))
        return read() if read is not None else arrow(df, cls)

    def small(df: DataFrame | None, cls: type) -> list[Any]:
        if df is None:
            return []
        table = arrow(df, cls)
        make = _maker(cls, table.column_names)
        return [make(*v) for v in zip(*(_values(table.column(c)) for c in table.column_names), strict=True)]

    sinks: dict[str, pa.Table] = {}
    every_sink = sink_rows(restrict(inputs, shape, ws))
    if every_sink is not None:
        rows = arrow(every_sink, oracle.SinkRow, ["sink"])
        for name in pc.unique(rows["sink"]).to_pylist():
            sinks[name] = rows.filter(pc.equal(rows["sink"], name)).drop_columns(["sink"])
    return columnar.Tables(ledger=direct(inputs.ledger, oracle.LedgerRow, "producer_ledger"),
                           log=direct(inputs.log, oracle.LogRecord, "log_records"),
                           consumed=None if inputs.consumed is None else direct(inputs.consumed, oracle.ConsumedRow,
                                                                               "consumed_records"),
                           sinks=sinks, group_offsets=small(inputs.group_offsets, oracle.GroupOffset),
                           watermarks=small(inputs.watermarks, oracle.Watermark))


_ARROW_TYPES = {"string": pa.string(), "bigint": pa.int64(), "int": pa.int32(), "boolean": pa.bool_(),
                "timestamp": pa.timestamp("us", "UTC")}


def parquet_reader(df: DataFrame, columns: Sequence[str], may_lack: Sequence[str] = ()) -> Any:
    """A function reading `columns` of `df`'s rows with pyarrow, or None unless `df` is one local table's
    rows as they are in its files: a filter over a scan of plain Parquet files (a pinned Delta scan,
    `inputs.pinned`) whose directories name its partition values, each column the table's own
    (`may_lack`: the optional ones `lake.read_input_table` reads as null where the table lacks them,
    and pyarrow where a file does). Its filters (topic, hours) are not applied: the columnar path
    applies the exact visibility, and rows of other topics or hours are left out there."""
    plan = df._jdf.queryExecution().optimizedPlan()
    leaves = _seq_of(plan.collectLeaves())
    if len(leaves) != 1:
        return None
    leaf = leaves[0]
    if leaf.getClass().getSimpleName() == "LocalRelation":  # rows handed over from Python, or no file kept
        if not leaf.data().isEmpty():
            return None
        schema = {c: t for c, t in df.dtypes}
        if any(schema.get(c) not in _ARROW_TYPES for c in columns):
            return None
        empty = pa.schema([(c, _ARROW_TYPES[schema[c]]) for c in columns])
        return lambda: empty.empty_table()
    if leaf.getClass().getName() != "org.apache.spark.sql.execution.datasources.LogicalRelation":
        return None
    relation = leaf.relation()
    if relation.getClass().getName() != "org.apache.spark.sql.execution.datasources.HadoopFsRelation":
        return None  # a Delta scan (deletion vectors, column mapping) or another source: Spark reads it
    if relation.fileFormat().getClass().getSimpleName() != "ParquetFileFormat":
        return None
    # each column must be the file column of its name, passed through (the same attribute id), or an
    # optional one the table lacks: a column the frame computes (a sink's renamed audit columns) is
    # Spark's to read
    own = {a.name(): a.exprId().id() for a in _seq_of(leaf.output())}
    out = {a.name(): a.exprId().id() for a in _seq_of(plan.output())}
    if any(out.get(c) != own[c] if c in own else c not in may_lack for c in columns):
        return None
    files = [str(f) for f in relation.location().inputFiles()]
    if not all(f.startswith("file:") for f in files):
        return None
    types = dict(df.dtypes)
    if any(types.get(c) not in _ARROW_TYPES for c in columns):
        return None
    partition_columns = [f.name() for f in relation.partitionSchema().fields()]
    base = relation.options().get("basePath")
    if partition_columns and not base.isDefined():
        return None
    root = _local_path(str(base.get())) if partition_columns else None
    schema = pa.schema([(c, _ARROW_TYPES[types[c]]) for c in columns])

    def read() -> pa.Table:
        import pyarrow.dataset as ds

        paths = [_local_path(f) for f in files]
        parts = ds.partitioning(pa.schema([(c, pa.string()) for c in partition_columns]), flavor="hive") \
            if partition_columns else None
        data = ds.dataset(paths, format="parquet", partitioning=parts, partition_base_dir=root)
        present = set(data.schema.names)
        got = data.to_table(columns=[c for c in columns if c in present])
        out = []
        for field in schema:
            col = got.column(field.name) if field.name in present else pa.nulls(got.num_rows, field.type)
            out.append(pc.cast(col, field.type))
        return pa.Table.from_arrays(out, schema=schema)

    return read


def _local_path(uri: str) -> str:
    """A `file:` URI (or a plain path) as a local path."""
    from urllib.parse import unquote, urlparse

    return unquote(urlparse(uri).path) if uri.startswith("file:") else uri


def _seq_of(xs: Any) -> list[Any]:
    return [xs.apply(i) for i in range(xs.size())]
