"""Settling a batch of windows with the rules' kernel (`audit.rules`, docs/design.md §5.8): in the
driver for a small batch, in Spark tasks for a large one -- the same functions on the same rows.

The batch's rows of every tier (ledger, log, consumption, sinks, mirror copies) are one frame,
`tiers`, each row tagged with its tier (`_tag`) and holding its tier's columns. A small batch is
collected as Arrow columns and settled here (`in_driver`). A larger one is settled in Spark tasks
(`in_tasks`): in one task, whole, as the driver would, when it is one chunk; else split by message
into chunks, one Spark task each:

1. the order of consumption is a property of each (group, partition)'s processings, not of one
   message: one pass, partitioned by (topic, group, partition), finds the processings that go
   backwards (`neighbours.consumption_order`); they are few (each one a `reordered_in_consumption`
   of its record), collected, and every task marks its consumption rows with them (`_flag`);
2. the window is cut into chunks by seq (`Chunks`: ranges at the ledger's quantiles; rows without
   a message identity, and every row of a mirrored topic, in chunk 0), one task each. A task reads
   its chunk's rows of every table that is plain Parquet on the local file system (or on an S3
   store whose credentials the session's S3A settings hold: `read.ObjectStore`) itself, with
   pyarrow (`read_files`: the row groups whose seq statistics meet its range); the other tables
   (a JDBC sink, a Delta table Spark must read) are shuffled by Spark to the same tasks. Each task
   settles its rows with `kernel.settle`, given the window's small inputs (watermarks, group
   offsets, the consumer interceptor's `committed` rows), and writes `OUT` rows: anomalies,
   counts, latency histograms and one narrow row per message;
3. the log order and the gaps are found chunk by chunk, since a chunk holds a range of every pid's
   seqs: each task looks at its chunk alone (`neighbours.alone`) for its gaps and the originals its
   own rows flag, and emits its bounds (per pid and partition: lowest and highest
   offset; per pid: lowest and highest present seq), which the driver collects. The gaps across
   cuts come from the bounds alone. Only a chunk whose offsets reach into another's
   (`neighbours.crossing`: a reordering across a cut, rare) has more to find: such chunks are
   settled again, given the others' bounds, for their flagged originals and the rows an earlier
   chunk's flagged ones may find before them, and the driver joins them
   (`neighbours.log_order_across`);
4. content duplicates are found by the same job's second stage: the settling tasks' output is
   shuffled to `n` tasks, each a bucket of the first fingerprint hash (`_routed`). The originals
   with a fingerprint travel packed as Arrow IPC, a few blobs per chunk and bucket: Spark moves
   bytes, not a row per message. A `failed_send` row whose send's fingerprint is known carries its
   hashes and goes to its fingerprint's bucket, where a resend at or after the failed send takes
   the row back. Every other row passes through (the latencies summed per distinct value);
5. that job's output is persisted; the driver collects all of it but the anomaly rows -- the
   counts, each content-pass task's count of anomaly rows per (stage, partition, code) (`CODES`),
   the latency histograms, the chunks' bounds and flagged originals -- and assembles each topic's
   report (`kernel.report_rows`). The anomaly rows stay with the executors (`anomaly_frame`) until
   they are published and the result is released.

The driver never holds a column of every message: only the rows named above, which grow with the
distinct latencies, not with the traffic (a batch settled in one task or in the driver hands it its
anomaly rows too, as Arrow columns: `anomaly_table`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, fields
from datetime import datetime
from functools import reduce
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pyspark import StorageLevel
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.types import (
    BinaryType,
    BooleanType,
    DoubleType,
    LongType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)

from audit import oracle
from audit.core.config import TopicConfig
from audit.core.vocabulary import COMMITTED, PROCESSING_OUTCOMES
from audit.core.windows import run_id_for
from audit.rules import kernel, neighbours
from audit.rules.columns import among, bools, equals, ints, row_maker, values
from spark_jobs.io.schemas import AUDIT_ANOMALIES, AUDIT_ANOMALIES_ARROW
from spark_jobs.io.session import described, local_frame, side_by_side
from spark_jobs.reconcile.plan import Shape
from spark_jobs.reconcile.read import (
    CONSTANTS,
    NULL_SOURCE,
    FileTable,
    ObjectStore,
    WindowInputs,
    file_table,
    object_store,
    sink_rows,
)

# each tier's columns the rules read (the oracle's row fields; a sink's row carries its sink's name)
TIERS: dict[str, tuple[type, tuple[str, ...]]] = {
    "ledger": (oracle.LedgerRow, tuple(f.name for f in fields(oracle.LedgerRow)
                                       if f.name not in {"producer", "error", "txn_id"})),
    "log": (oracle.LogRecord, tuple(f.name for f in fields(oracle.LogRecord))),
    "consumed": (oracle.ConsumedRow, tuple(f.name for f in fields(oracle.ConsumedRow) if f.name != "produce_ts")),
    "sink": (oracle.SinkRow, (*(f.name for f in fields(oracle.SinkRow) if f.name != "produce_ts"), "sink")),
    "mirror_log": (oracle.MirrorRecord, tuple(f.name for f in fields(oracle.MirrorRecord))),
}

OUT = StructType([StructField(n, t, True) for n, t in (
    ("topic", StringType()), ("kind", StringType()), ("stage", StringType()), ("partition", LongType()),
    ("anomaly", StringType()), ("pid", StringType()), ("seq", LongType()), ("offset", LongType()),
    ("detail", StringType()), ("value", DoubleType()), ("n", LongType()), ("present", BooleanType()),
    ("pt", LongType()), ("win", BooleanType()), ("fp1", LongType()), ("fp2", LongType()), ("lo", LongType()),
    ("hi", LongType()), ("blob", BinaryType()), ("to", LongType()))])
_OUT_ARROW = pa.schema([
    ("topic", pa.string()), ("kind", pa.string()), ("stage", pa.string()), ("partition", pa.int64()),
    ("anomaly", pa.string()), ("pid", pa.string()), ("seq", pa.int64()), ("offset", pa.int64()),
    ("detail", pa.string()), ("value", pa.float64()), ("n", pa.int64()), ("present", pa.bool_()),
    ("pt", pa.int64()), ("win", pa.bool_()), ("fp1", pa.int64()), ("fp2", pa.int64()), ("lo", pa.int64()),
    ("hi", pa.int64()), ("blob", pa.binary()), ("to", pa.int64())])
# OUT's kinds: an anomaly row, a count per (stage, partition) (`anomaly`: expected / delivered /
# pending), a latency and how many have it, quarantined ledger rows, rows read on a mirror their
# group does not fail over to (`stage`: the group, `anomaly`: the cluster), a narrow row (`n`: its
# chunk); in several chunks also a chunk's bounds (`neighbours.BOUNDS`: `n` the chunk, `lo`, `hi`,
# `win`), and its part of the log order: a flagged original (`hi`: its chunk's highest seq before
# it) or a row at an offset an earlier chunk passed (`neighbours.log_order_part`); and, packed as
# Arrow IPC in `blob` (Spark moves bytes, not cells), its originals with a fingerprint for the
# content pass (`n`: their bucket of fingerprint hashes); `to`: the content pass's task a row goes to
# (`_routed`)
ANOMALY, COUNT, LATENCY, QUARANTINED, IGNORED, NARROW = "A", "C", "L", "Q", "I", "N"
CODES = "K"  # how many anomaly rows a content-pass task kept of one (stage, partition, code): `n`
BOUND, FLAGGED, STAIR, BY_CONTENT = "B", "F", "S", "H"
# the columns of few distinct values a settling task reads dictionary encoded (`read_files`)
FEW_VALUES = ("topic", "pid", "status", "group", "consumer", "outcome", "cluster", "error", "header_error")
_BLOB_ROWS = 65536  # narrow rows per blob: a chunk's come in several
_CONTENT_COLUMNS = ("topic", "pid", "seq", "partition", "offset", "pt", "win", "fp1", "fp2")


def tiers(vis: WindowInputs) -> DataFrame:
    """Every row of the batch's tiers in one frame, each with its tier (`_tag`) and its tier's columns."""
    frames = {"ledger": vis.ledger, "log": vis.log, "consumed": vis.consumed, "sink": sink_rows(vis),
              "mirror_log": vis.mirror_log}
    parts = [df.select(*[c for c in (*TIERS[tag][1], "_flag") if c in df.columns], F.lit(tag).alias("_tag"))
             for tag, df in frames.items() if df is not None]
    return reduce(lambda a, b: a.unionByName(b, allowMissingColumns=True), parts)


@dataclass
class Small:
    """The window's small inputs, as the oracle's rows: every task gets all of them."""

    watermarks: list[oracle.Watermark]
    group_offsets: list[oracle.GroupOffset]
    mirror_watermarks: list[oracle.MirrorWatermark]
    mirror_group_offsets: list[oracle.MirrorGroupOffset]
    share_offsets: list[oracle.ShareOffset]
    commits: pa.Table | None = None  # the consumer interceptor's `committed` rows (Spark tasks only)


def _rows_of(df: DataFrame | None, cls: type) -> list[Any]:
    if df is None:
        return []
    table = df.select(*[f.name for f in fields(cls) if f.name in df.columns]).toArrow()
    make = row_maker(cls, table.column_names)
    return [make(*v) for v in zip(*(values(table.column(c)) for c in table.column_names), strict=True)]


def small_inputs(spark: SparkSession, vis: WindowInputs, label: str = "lookups") -> Small:
    """The window's small inputs, each collected by its own Spark job (named `label`), side by side."""
    frames = ((vis.watermarks, oracle.Watermark), (vis.group_offsets, oracle.GroupOffset),
              (vis.mirror_watermarks, oracle.MirrorWatermark), (vis.mirror_group_offsets, oracle.MirrorGroupOffset),
              (vis.share_offsets, oracle.ShareOffset))
    return Small(*side_by_side(spark, *[(label, lambda df=df, cls=cls: _rows_of(df, cls)) for df, cls in frames]))


def _parts(rows: pa.Table) -> dict[str, list[pa.Table]]:
    """Rows of `tiers`' columns (perhaps without some) as each tier's table, by their `_tag`."""
    parts: dict[str, list[pa.Table]] = {}
    for tag in pc.unique(rows["_tag"]).to_pylist() if rows.num_rows else []:
        one = rows.filter(pc.equal(rows["_tag"], tag))
        parts.setdefault(tag, []).append(one.select([c for c in TIERS[tag][1] if c in one.column_names]))
    return parts


def _table(rows: dict[str, list[Any]]) -> pa.Table:
    return pa.table({f.name: pa.array(rows.get(f.name, [None] * len(rows["kind"])), f.type) for f in _OUT_ARROW},
                    schema=_OUT_ARROW)


def _anomaly_rows(topic: str, anomalies: Sequence[dict[str, Any]]) -> dict[str, list[Any]]:
    return {"topic": [topic] * len(anomalies), "kind": [ANOMALY] * len(anomalies),
            **{c: [a[c] for a in anomalies] for c in ("stage", "partition", "anomaly", "pid", "seq", "offset", "detail")}}


def out_rows(topic: str, s: kernel.Settled) -> pa.Table:
    """What a task hands on of one topic's settled rows, as OUT rows."""
    f = s.facts
    anomalies = _table(_anomaly_rows(topic, f.anomalies))
    if f.resendable:  # a failed send a resend may take back carries its fingerprint and produce time
        at = {id(row): i for i, (row, _, _) in enumerate(f.resendable)}
        which = pa.array([at.get(id(a)) for a in f.anomalies], pa.int64())
        held = kernel.resendable(f)
        for c in ("fp1", "fp2", "pt"):
            anomalies = anomalies.set_column(anomalies.schema.get_field_index(c), c, pc.take(held[c], which))
    coded = s.coded
    parts = [anomalies, pa.table({"topic": pa.repeat(pa.scalar(topic), coded.num_rows),
                                  "kind": pa.repeat(pa.scalar(ANOMALY), coded.num_rows),
                                  **{c: coded[c] for c in coded.column_names}})]
    # a (stage, partition) the rules touched without counting anything still has its report row
    counts = [(stage, p, name, n) for (stage, p), cnt in f.counts.items() for name, n in (cnt or {"expected": 0}).items()]
    parts.append(_table({"topic": [topic] * len(counts), "kind": [COUNT] * len(counts),
                         "stage": [c[0] for c in counts], "partition": [c[1] for c in counts],
                         "anomaly": [c[2] for c in counts], "n": [c[3] for c in counts]}))
    for (stage, p), hists in kernel.merged_histograms([s]).items():
        xs, ns = np.concatenate([h[0] for h in hists]), np.concatenate([h[1] for h in hists])
        k = len(xs)
        parts.append(pa.table({"topic": pa.array([topic] * k, pa.string()), "kind": pa.array([LATENCY] * k, pa.string()),
                               "stage": pa.array([stage] * k, pa.string()), "partition": pa.array(np.full(k, p, np.int64)),
                               "value": pa.array(xs, pa.float64()), "n": pa.array(ns, pa.int64())})
                     .select([c for c in ("topic", "kind", "stage", "partition", "value", "n")]))
    extra: list[tuple[str, str | None, str | None, int]] = [(QUARANTINED, None, None, f.quarantined)] if f.quarantined else []
    extra += [(IGNORED, g, c, n) for (g, c), n in f.ignored.items()]
    parts.append(_table({"topic": [topic] * len(extra), "kind": [e[0] for e in extra], "stage": [e[1] for e in extra],
                         "anomaly": [e[2] for e in extra], "n": [e[3] for e in extra]}))
    nr = s.narrow
    k = nr.num_rows
    parts.append(pa.table({"topic": pa.array([topic] * k, pa.string()), "kind": pa.array([NARROW] * k, pa.string()),
                           **{c: nr[c] for c in nr.column_names}}))
    return pa.concat_tables([_full(p) for p in parts])


def _full(t: pa.Table) -> pa.Table:
    """`t` with every OUT column, in order (the missing ones null)."""
    return pa.table([t[f.name] if f.name in t.column_names else pa.nulls(t.num_rows, f.type) for f in _OUT_ARROW],
                    schema=_OUT_ARROW)


def neighbour_rows(narrow: pa.Table, ws: datetime, as_of: datetime, checks: str = "log gaps content") -> pa.Table:
    """The anomaly rows (OUT) the checks that need neighbours find over `narrow` (OUT's narrow rows of
    one or more topics, each holding every row the checks named in `checks` need)."""
    parts = []
    for topic in pc.unique(narrow["topic"]).to_pylist():
        rows = narrow.filter(pc.equal(narrow["topic"], topic))
        found: list[dict[str, Any]] = []
        oracle.emit_neighbour_rows(oracle.anomaly_emitter(found, topic, ws, as_of),
                                   neighbours.log_order(rows) if "log" in checks else [],
                                   neighbours.gaps(rows) if "gaps" in checks else [],
                                   neighbours.content(rows) if "content" in checks else [])
        parts.append(_full(_table(_anomaly_rows(topic, found))))
    return pa.concat_tables(parts) if parts else _OUT_ARROW.empty_table()


@dataclass
class Result:
    """One topic's window, settled: its report rows and anomaly rows, `count` of them: those the
    driver holds (`AUDIT_ANOMALIES_ARROW`) and, settled in several tasks, those the executors keep
    (`kept`: OUT anomaly rows of a persisted frame, `cached`)."""

    report: list[dict[str, Any]]
    anomalies: pa.Table
    quarantined: int
    ignored: dict[tuple[str, str], int]  # (group, cluster) -> consumption rows read on a mirror (§5.5)
    count: int = 0
    kept: DataFrame | None = None
    cached: DataFrame | None = None


def anomaly_table(rows: pa.Table, topic: str, ws: datetime, as_of: datetime) -> pa.Table:
    """OUT anomaly rows of one topic as `audit_anomalies` rows (the window, topic, run and time given,
    the other columns OUT's): they stay Arrow columns to the Delta table and the report store (the
    driver holds no Python object per anomaly)."""
    given = {"window_start": ws, "topic": topic, "run_id": run_id_for(topic, ws, as_of), "computed_at": as_of}
    return pa.Table.from_arrays([pa.repeat(pa.scalar(given[f.name], f.type), rows.num_rows) if f.name in given
                                 else rows[f.name].cast(f.type) for f in AUDIT_ANOMALIES_ARROW], schema=AUDIT_ANOMALIES_ARROW)


def anomaly_frame(rows: DataFrame, topic: str, ws: datetime, as_of: datetime) -> DataFrame:
    """`anomaly_table` of OUT anomaly rows the executors hold: a frame of `AUDIT_ANOMALIES` columns."""
    given = {"window_start": F.lit(ws), "topic": F.lit(topic), "run_id": F.lit(run_id_for(topic, ws, as_of)),
             "computed_at": F.lit(as_of)}
    return rows.where(F.col("topic") == topic).select(
        *[(given[f.name] if f.name in given else F.col(f.name)).cast(f.dataType).alias(f.name)
          for f in AUDIT_ANOMALIES.fields])


def results(gathered: pa.Table, shape: Shape, ws: datetime, as_of: datetime, small: Small,
            cached: DataFrame | None = None) -> dict[str, Result]:
    """Each topic's report and anomaly rows from the gathered OUT rows (no narrow rows), all columns,
    and, settled in several tasks, the anomaly rows the executors keep (those of the persisted OUT
    frame `cached`, counted in the gathered CODES rows)."""
    kept = None if cached is None else cached.where(F.col("kind") == ANOMALY)
    out: dict[str, Result] = {}
    of_kind = {k: gathered.filter(pc.equal(gathered["kind"], k))
               for k in (ANOMALY, CODES, COUNT, LATENCY, QUARANTINED, IGNORED)}
    for tc in shape.topics:
        mine = {k: t.filter(pc.equal(t["topic"], tc.name)) for k, t in of_kind.items()}
        anomalies = mine[ANOMALY]
        codes: dict[tuple[str, int], dict[str, int]] = {}
        held = anomalies.group_by(["stage", "partition", "anomaly"]).aggregate([("anomaly", "count")]) \
            .rename_columns(["stage", "partition", "anomaly", "n"])
        for r in pa.concat_tables([held, mine[CODES].select(["stage", "partition", "anomaly", "n"])]).to_pylist():
            into = codes.setdefault((r["stage"], r["partition"]), {})
            into[r["anomaly"]] = into.get(r["anomaly"], 0) + r["n"]
        counts: dict[tuple[str, int], dict[str, int]] = {}
        for r in mine[COUNT].group_by(["stage", "partition", "anomaly"]).aggregate([("n", "sum")]).to_pylist():
            counts.setdefault((r["stage"], r["partition"]), {})[r["anomaly"]] = r["n_sum"]
        lat = mine[LATENCY]
        hists: kernel.Histograms = {}
        for key in lat.select(["stage", "partition"]).group_by(["stage", "partition"]).aggregate([]).to_pylist():
            one = lat.filter(pc.and_(pc.equal(lat["stage"], key["stage"]), pc.equal(lat["partition"], key["partition"])))
            hists[(key["stage"], key["partition"])] = [(one["value"].to_numpy().astype(np.float64),
                                                        ints(one["n"]))]
        quarantined = int(pc.sum(mine[QUARANTINED]["n"]).as_py() or 0)
        ignored = {(r["stage"], r["anomaly"]): r["n_sum"] for r in
                   mine[IGNORED].group_by(["stage", "anomaly"]).aggregate([("n", "sum")]).to_pylist()}
        partitions = {w.partition for w in small.watermarks if w.topic == tc.name}
        out[tc.name] = Result(kernel.report_rows(tc, ws, as_of, partitions, counts, hists, codes),
                              anomaly_table(anomalies, tc.name, ws, as_of), quarantined, ignored,
                              sum(n for cnt in codes.values() for n in cnt.values()),
                              None if kept is None else anomaly_frame(kept, tc.name, ws, as_of), cached)
    return out


# ---------------------------------------------------------------------------- in the driver
def in_driver(rows: pa.Table, shape: Shape, ws: datetime, as_of: datetime, small: Small) -> dict[str, Result]:
    """A batch settled here from all its rows (`tiers`, collected): one chunk."""
    return results(_with_neighbours(_settle_parts(_parts(rows), shape.topics, ws, as_of, small, None), ws, as_of),
                   shape, ws, as_of, small)


def _with_neighbours(out: pa.Table, ws: datetime, as_of: datetime) -> pa.Table:
    """The OUT rows of a whole batch (one chunk) with its narrow rows replaced by what the checks
    that need neighbours find over them."""
    is_narrow = pc.equal(out["kind"], NARROW)
    narrow = out.filter(is_narrow)
    return pa.concat_tables([_without_resent(out.filter(pc.invert(is_narrow)), narrow),
                             neighbour_rows(narrow, ws, as_of)])


def _resendable(rows: pa.Table) -> np.ndarray:
    """Which OUT rows are `failed_send` rows a resend may take back (they carry a fingerprint)."""
    return bools(pc.and_(pc.and_(pc.equal(rows["kind"], ANOMALY), pc.equal(rows["anomaly"], "failed_send")),
                         pc.is_valid(rows["fp1"])))


def _without_resent(rows: pa.Table, originals: pa.Table) -> pa.Table:
    """OUT rows without the `failed_send` rows whose send was resent (`neighbours.resent`): an
    original of `originals` (narrow rows: topic, partition, fp1, fp2, pt) of the same topic and
    fingerprint produced at or after it."""
    can = _resendable(rows)
    if not can.any():
        return rows
    keep = np.ones(rows.num_rows, dtype=bool)
    for topic in pc.unique(rows["topic"].filter(pa.array(can))).to_pylist():
        at = np.flatnonzero(can & bools(pc.equal(rows["topic"], topic)))
        latest = neighbours.latest_by_content(originals.filter(pc.equal(originals["topic"], topic)))
        keep[at[neighbours.resent(rows.take(pa.array(at)), latest)]] = False
    return rows.filter(pa.array(keep))


# ---------------------------------------------------------------------------- in Spark tasks
def _whole(batches: Iterator[pa.RecordBatch]) -> pa.Table | None:
    """A task's batches as one table, or None when it has no row."""
    got = [b for b in batches if b.num_rows]
    return pa.Table.from_batches(got) if got else None


_KEYS = ("topic", "group", "partition", "consumer", "consume_seq", "offset", "consume_ts")
_MARKER = "_marker"  # a row of no tier: tells each task its chunk (`_chunk`)


def _processings(rows: pa.Table) -> pa.Table:
    """The processings on the audited cluster among consumption rows, as the order of consumption's columns."""
    return rows.filter(pc.fill_null(kernel.is_processing(rows), False)).select(list(_KEYS))


def _bucket(rows: pa.Table, b: int) -> np.ndarray:
    """Each consumption row's bucket, one of `b`: its partition's (so a (topic, group, partition)'s
    processings share one; no string is hashed)."""
    return np.mod(ints(rows["partition"], 0), b)


def _flagged(spark: SparkSession, consumed: DataFrame, n: int, store: ObjectStore | None) -> pa.Table:
    """The processings flagged by the order of consumption of their (topic, group, partition), over the
    window's processings on the audited cluster, in one pass of `b` tasks, each a share of the
    (topic, group, partition)s; collected (each one is a `reordered_in_consumption` of its record, or a
    processing of a record that has one). The tasks read the consumption rows themselves where they
    are plain local Parquet (`read.file_table`), else Spark shuffles them there."""
    cols = [c for c in (*_KEYS, "outcome", "cluster") if c in consumed.columns]
    ft = file_table(consumed.select(*cols), cols, store)
    if ft is None:
        processings = (consumed.where(F.col("cluster").isNull()
                                      & F.col("outcome").isin(sorted(PROCESSING_OUTCOMES))).select(*_KEYS))

        def flag(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
            rows = _whole(batches)
            if rows is not None:
                yield from rows.filter(pa.array(neighbours.consumption_order(rows))).to_batches()

        return (processings.repartition(n, "topic", "group", "partition").mapInArrow(flag, processings.schema)
                .toArrow())
    b = max(1, min(n, spark.sparkContext.defaultParallelism))
    whole = Chunks((), ())
    schema = StructType([StructField(k, StringType() if t == pa.string() else TimestampType() if k == "consume_ts"
                                     else LongType(), True) for k, t in _ARROW_OF.items()])

    def flag_bucket(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        got = _whole(batches)
        if got is None:
            return
        k = int(got["_chunk"][0].as_py())
        rows = _processings(read_files(ft, whole, 0, lambda t: _bucket(t, b) == k, FEW_VALUES))
        if rows.num_rows:
            flagged = rows.filter(pa.array(neighbours.consumption_order(rows)))
            yield from flagged.cast(pa.schema(list(_ARROW_OF.items()))).to_batches()

    keys = _chunk_keys(spark, b)
    markers = local_frame(spark, [(key, k) for k, key in enumerate(keys)], "_key bigint, _chunk int")
    return markers.repartition(b, "_key").mapInArrow(flag_bucket, schema).toArrow()


_ARROW_OF = {"topic": pa.string(), "group": pa.string(), "partition": pa.int64(), "consumer": pa.string(),
             "consume_seq": pa.int64(), "offset": pa.int64(), "consume_ts": pa.timestamp("us", "UTC")}


def _flag_key(rows: pa.Table) -> list[tuple[Any, ...]]:
    return list(zip(*(rows[k].cast(pa.int64()).to_pylist() if k == "consume_ts" else values(rows[k])
                      for k in _KEYS), strict=True))


def mark_flags(consumed: pa.Table, flagged: pa.Table | None) -> pa.Table:
    """`consumed` with `_flag`: whether each row is one of the `flagged` processings (few: only the
    rows at their offsets are compared whole)."""
    flag = np.zeros(consumed.num_rows, dtype=bool)
    if flagged is not None and flagged.num_rows and consumed.num_rows:
        at = np.flatnonzero(pc.fill_null(pc.is_in(consumed["offset"], value_set=flagged["offset"]), False)
                            .to_numpy(zero_copy_only=False))
        if len(at):
            wanted = set(_flag_key(flagged.cast(pa.schema([flagged.schema.field(k) for k in _KEYS]))))
            some = consumed.take(pa.array(at)).select(list(_KEYS))
            flag[at[[k in wanted for k in _flag_key(some)]]] = True
    return consumed.append_column("_flag", pa.array(flag))


@dataclass(frozen=True)
class Chunks:
    """How a window is cut into chunks by message: chunk k holds the seqs from cuts[k - 1] up to
    cuts[k] (of identified rows: pid and seq, and no header error); every other row, and every row
    of a mirrored topic, is chunk 0's."""

    cuts: tuple[int, ...]
    mirrored: tuple[str, ...]

    @property
    def n(self) -> int:
        return len(self.cuts) + 1

    def ids(self, rows: pa.Table) -> np.ndarray:
        identified = pc.and_(pc.is_valid(rows["pid"]), pc.is_valid(rows["seq"]))
        if "header_error" in rows.column_names:
            identified = pc.and_(identified, pc.is_null(rows["header_error"]))
        seq = pc.fill_null(rows["seq"], 0).to_numpy()
        ids = np.where(pc.fill_null(identified, False).to_numpy(zero_copy_only=False),
                       np.searchsorted(np.array(self.cuts, dtype=np.int64), seq, side="right"), 0)
        if self.mirrored:
            ids[bools(among(rows["topic"], self.mirrored))] = 0
        return ids

    def sql(self) -> Any:
        """`ids` as a Spark column over `tiers`' columns."""
        identified = F.col("pid").isNotNull() & F.col("seq").isNotNull() & F.col("header_error").isNull()
        chunk = F.size(F.filter(F.array(*[F.lit(c) for c in self.cuts]), lambda x: x <= F.col("seq"))) \
            if self.cuts else F.lit(0)
        out = F.when(identified, chunk).otherwise(F.lit(0))
        if self.mirrored:
            out = F.when(F.col("topic").isin(list(self.mirrored)), F.lit(0)).otherwise(out)
        return out

    def pushdown(self, ft: FileTable, k: int) -> Any:
        """A pyarrow filter keeping at least chunk k's rows of `ft` (row groups are skipped by their
        statistics): its seq range, and for chunk 0 also the rows without an identity or of a
        mirrored topic."""
        import pyarrow.dataset as ds

        src = dict(ft.sources)
        if not self.cuts or src.get("seq", NULL_SOURCE) in CONSTANTS:
            return None
        seq = ds.field(src["seq"])
        lo = seq >= self.cuts[k - 1] if k > 0 else None
        hi = seq < self.cuts[k] if k < len(self.cuts) else None
        keep = lo if hi is None else hi if lo is None else lo & hi
        if k == 0:
            keep = keep | seq.is_null()
            if src.get("pid"):
                keep = keep | ds.field(src["pid"]).is_null()
            if src.get("header_error"):
                keep = keep | ds.field(src["header_error"]).is_valid()
            if self.mirrored and src.get("topic"):
                keep = keep | ds.field(src["topic"]).isin(list(self.mirrored))
        return keep


def _coded(t: pa.DataType) -> pa.DataType:
    return pa.dictionary(pa.int32(), t)


def _partitioning(ft: FileTable, physical: pa.Schema) -> Any:
    """The hive partitioning of `ft`'s files, its columns typed as in `physical`: a dictionary encoded
    one's dictionary holds the values its files' directories name."""
    from urllib.parse import unquote

    import pyarrow.dataset as ds

    schema = pa.schema([physical.field(c) for c in ft.partitions])
    named: dict[str, set[str]] = {f.name: set() for f in schema if pa.types.is_dictionary(f.type)}
    for path in ft.paths if named else ():
        for part in path[len(ft.root or ""):].split("/")[:-1]:
            name, eq, value = part.partition("=")
            if eq and name in named:
                named[name].add(unquote(value))
    return ds.partitioning(schema, flavor="hive",
                           dictionaries={c: pa.array(sorted(v), pa.string()) for c, v in named.items()} or None)


def read_files(ft: FileTable, chunks: Chunks, k: int, keep: Callable[[pa.Table], np.ndarray] | None = None,
               dictionary: Sequence[str] = ()) -> pa.Table:
    """Chunk k's rows of a table read by this task itself (`read.FileTable`), as the frame's columns;
    with `keep`, only the rows it keeps, taken batch by batch as they are read (so the task holds
    those rows, not the whole read). The `dictionary` columns (strings of few distinct values) come
    dictionary encoded, as Parquet stores them (a hive partition column: as its directories name
    it): no string is copied per row."""
    import pyarrow.dataset as ds

    src_of = dict(ft.sources)
    coded = {src_of[c] for c in dictionary if src_of.get(c) in ft.physical.names}
    out = pa.schema([f.with_type(_coded(f.type)) if src_of[f.name] in coded else f for f in ft.out])
    if not ft.paths:
        return out.empty_table()
    physical = pa.schema([f.with_type(_coded(f.type)) if f.name in coded else f for f in ft.physical])
    form = ds.ParquetFileFormat(read_options=ds.ParquetReadOptions(
        dictionary_columns=sorted(coded - set(ft.partitions))))
    data = ds.dataset(list(ft.paths), schema=physical, format=form,
                      partitioning=_partitioning(ft, physical) if ft.partitions else None,
                      partition_base_dir=ft.root, filesystem=ft.filesystem())
    used = {src for _, src in ft.sources}  # a partition column no output needs is not read
    columns, where = [f.name for f in physical if f.name in used], chunks.pushdown(ft, k)

    def framed(got: pa.Table) -> pa.Table:
        return pa.table([_constant(src, got.num_rows, f.type) if src in CONSTANTS else got[src].cast(f.type)
                         for (_, src), f in zip(ft.sources, out, strict=True)], schema=out)

    if keep is None:
        rows = framed(data.to_table(columns=columns, filter=where))
    else:
        kept = [t.filter(pa.array(keep(t))) for t in
                (framed(pa.Table.from_batches([batch])) for batch in data.to_batches(columns=columns, filter=where))]
        rows = pa.concat_tables(kept) if kept else out.empty_table()
    if not chunks.cuts and not chunks.mirrored:  # one chunk: every row
        return rows
    return rows.filter(pa.array(chunks.ids(rows) == k))


def alike(tables: Sequence[pa.Table]) -> list[pa.Table]:
    """Parts of one tier's rows with each column of one type: a column some parts hold dictionary
    encoded (read from files) is encoded in the others too (handed over by Spark)."""
    coded = {f.name: f.type for t in tables for f in t.schema if pa.types.is_dictionary(f.type)}
    if not coded:
        return list(tables)
    return [t.cast(pa.schema([f.with_type(coded[f.name]) if f.name in coded and pa.types.is_string(f.type) else f
                              for f in t.schema])) for t in tables]


def _constant(source: str, n: int, type_: pa.DataType) -> pa.Array:
    """A column of `n` nulls, or of `n` falses, for a constant source (`read.CONSTANTS`)."""
    return pa.nulls(n, type_) if source == NULL_SOURCE else pa.array(np.zeros(n, dtype=bool)).cast(type_)


def footer_cuts(ft: FileTable | None, n: int) -> list[int] | None:
    """The seqs that cut a window into `n` chunks of about as many ledger rows, from the seq
    statistics of its files' row groups (ingest writes the ledger sorted by seq in small row groups;
    each group's rows are taken as spread evenly between its lowest and highest seq): no Spark job.
    None unless `ft` is local files whose every row group has them (then a quantile job cuts)."""
    import pyarrow.parquet as pq

    if ft is None or ft.store is not None or not ft.paths or dict(ft.sources).get("seq") in CONSTANTS:
        return None
    column = dict(ft.sources)["seq"]
    points, weights = [], []
    for path in ft.paths:
        meta = pq.read_metadata(path)
        at = next((i for i in range(meta.num_columns) if meta.row_group(0).column(i).path_in_schema == column),
                  None) if meta.num_row_groups else None
        for g in range(meta.num_row_groups):
            stats = None if at is None else meta.row_group(g).column(at).statistics
            if stats is None or not stats.has_min_max:
                return None
            rows = meta.row_group(g).num_rows
            m = max(1, min(rows, 64))
            points.append(np.linspace(int(stats.min), int(stats.max), m))
            weights.append(np.full(m, rows / m))
    if not points:
        return None
    xs, ws = np.concatenate(points), np.concatenate(weights)
    order = np.argsort(xs, kind="stable")
    xs, below = xs[order], np.cumsum(ws[order])
    at_rank = np.searchsorted(below, [below[-1] * k / n for k in range(1, n)], side="left")
    return sorted({int(round(xs[min(i, len(xs) - 1)])) for i in at_rank})


def _chunk_keys(spark: SparkSession, n: int) -> list[int]:
    """A key per chunk k that Spark's `repartition(n, key)` sends to partition k (pmod of its Murmur3
    hash, as `hash()` computes it), found among the first integers in one small job."""
    found: dict[int, int] = {}
    for r in spark.range(0, 64 * n + 64).selectExpr("id", f"pmod(hash(id), {n}) AS p").collect():
        found.setdefault(int(r["p"]), int(r["id"]))
    return [found[k] for k in range(n)]


def in_tasks(spark: SparkSession, vis: WindowInputs, shape: Shape, ws: datetime, as_of: datetime, small: Small,
             n: int, label: str) -> dict[str, Result]:
    """A batch settled in `n` Spark tasks (the module's docstring, steps 1 to 5)."""
    topics = shape.topics
    consumed = vis.consumed
    store = object_store(spark)  # an S3 lake's files are read by the tasks too, with these settings
    flagged = None
    cuts: list[int] = []
    keys = [0]  # one partition: any key
    if n > 1:  # the cuts, the committed offsets and the order of consumption side by side

        def cut() -> tuple[list[int], list[int]]:
            ledger = vis.ledger.where(F.col("pid").isNotNull() & F.col("seq").isNotNull())
            found = footer_cuts(file_table(ledger.select("seq"), ["seq"], store), n)
            at = found if found is not None else sorted(
                {int(c) for c in ledger.approxQuantile("seq", [k / n for k in range(1, n)], 0.001)})
            return at, _chunk_keys(spark, len(at) + 1)

        steps: list[tuple[str, Any]] = [(f"{label}: chunks", cut)]
        if consumed is not None:  # (one chunk holds every consumption row: its task orders them)
            is_commit = (F.col("outcome") == COMMITTED) & F.col("cluster").isNull()
            cols = [c for c in TIERS["consumed"][1] if c in consumed.columns]
            commits, consumed = consumed.where(is_commit).select(*cols), consumed.where(~is_commit)
            steps += [(f"{label}: committed offsets", commits.toArrow),
                      (f"{label}: order of consumption", lambda c=consumed: _flagged(spark, c, n, store))]
        got = side_by_side(spark, *steps)
        cuts, keys = got[0]
        if consumed is not None:
            small.commits, flagged = got[1], got[2]
    chunks = Chunks(tuple(cuts), tuple(shape.mirrored))
    # each tier's frame: read by the tasks themselves where it is plain local Parquet, else by Spark
    frames = {"ledger": vis.ledger, "log": vis.log, "consumed": consumed, "mirror_log": vis.mirror_log,
              **{f"sink:{name}": df for name, df in vis.sinks.items()}}
    if vis.sink_rows is not None:
        frames["sink:*"] = vis.sink_rows
    files: dict[str, FileTable] = {}
    by_spark = []
    for key, df in frames.items():
        if df is None:
            continue
        tag = key.split(":")[0]
        cols = [c for c in TIERS[tag][1] if c in df.columns]
        ft = file_table(df.select(*cols), cols, store)
        if ft is not None and key != "sink:*":
            files[key] = ft
        elif tag == "sink" and key != "sink:*":
            by_spark.append(df.select(*cols, F.lit(key[len("sink:"):]).alias("sink"), F.lit(tag).alias("_tag")))
        else:
            by_spark.append(df.select(*cols, F.lit(tag).alias("_tag")))
    markers = local_frame(spark, [(key, k, _MARKER) for k, key in enumerate(keys)],
                          "_key bigint, _chunk int, _tag string")
    rows = markers
    if by_spark:
        spark_rows = reduce(lambda a, b: a.unionByName(b, allowMissingColumns=True), by_spark)
        if "header_error" not in spark_rows.columns:
            spark_rows = spark_rows.withColumn("header_error", F.lit(None).cast("string"))
        spark_rows = spark_rows.withColumn("_chunk", chunks.sql())
        spark_rows = spark_rows.withColumn("_key", F.element_at(F.array(*[F.lit(k) for k in keys]), F.col("_chunk") + 1))
        rows = spark_rows.unionByName(markers, allowMissingColumns=True)

    b = max(n, 1)  # the content pass's tasks: each a bucket of fingerprint hashes

    def settler(again: dict[str, pa.Table] | None = None) -> Any:
        """The settling tasks' function; with `again` (each topic's `neighbours.around` rows of the
        chunks `neighbours.crossing` names), those chunks settled again for their part of the log order
        with those rows (FLAGGED and STAIR rows only), every other task ending before it reads a row."""
        again_chunks = set() if again is None else {int(c) for t in again.values() for c in ints(t["chunk"])}

        def settle(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
            got = _whole(batches)
            if got is None:
                return
            is_marker = pc.equal(got["_tag"], _MARKER)
            k = int(got.filter(is_marker)["_chunk"][0].as_py())
            if again is not None and k not in again_chunks:
                return
            parts = _parts(got.filter(pc.invert(is_marker)))
            for key, ft in files.items():
                read = read_files(ft, chunks, k, dictionary=FEW_VALUES)
                if key == "consumed" and small.commits is not None:  # every task is given these (`Small.commits`)
                    read = read.filter(pc.invert(pc.fill_null(pc.and_(equals(read["outcome"], COMMITTED),
                                                                       pc.is_null(read["cluster"])), False)))
                elif key.startswith("sink:"):
                    read = read.append_column("sink", pa.DictionaryArray.from_arrays(
                        pa.array(np.zeros(read.num_rows, dtype=np.int32)), pa.array([key[len("sink:"):]])))
                parts.setdefault(key.split(":")[0], []).append(read)
            out = _settle_parts(parts, topics, ws, as_of, small, flagged)
            if len(keys) == 1:
                yield from _with_neighbours(out, ws, as_of).to_batches()
                return
            is_narrow = pc.equal(out["kind"], NARROW)
            narrow = out.filter(is_narrow)
            if again is not None:
                yield from _again(narrow, k, again).to_batches()
                return
            held = narrow.filter(pc.and_(pc.greater_equal(narrow["partition"], 0), pc.is_valid(narrow["fp1"])))
            bucket = np.mod(ints(held["fp1"]), b)
            yield from _routed(pa.concat_tables([out.filter(pc.invert(is_narrow)), _alone(narrow, k, ws, as_of),
                                                 _blobs(held.select(list(_CONTENT_COLUMNS)), BY_CONTENT, bucket)]),
                               k, b).to_batches()

        return settle

    def by_content(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        """A task of the content pass: its buckets' originals checked for duplicate content, its
        failed sends taken back where resent, its latencies summed; every other row handed on."""
        got = _whole(batches)
        if got is None:
            return
        is_blob = pc.equal(got["kind"], BY_CONTENT)
        held = _unblobbed(got.filter(is_blob))
        rest = _without_resent(got.filter(pc.invert(is_blob)), held)  # a failed send resent at or after it
        is_latency = pc.equal(rest["kind"], LATENCY)
        latencies = rest.filter(is_latency).group_by(["topic", "kind", "stage", "partition", "value"]) \
            .aggregate([("n", "sum")]).rename_columns(["topic", "kind", "stage", "partition", "value", "n"])
        kept = pa.concat_tables([rest.filter(pc.invert(is_latency)), _full(latencies),
                                 neighbour_rows(held, ws, as_of, "content")])
        anomalies = kept.filter(pc.equal(kept["kind"], ANOMALY))  # stay with the executors: counted for the driver
        codes = anomalies.group_by(["topic", "stage", "partition", "anomaly"]).aggregate([("kind", "count")]) \
            .rename_columns(["topic", "stage", "partition", "anomaly", "n"])
        codes = codes.append_column("kind", pa.repeat(pa.scalar(CODES), codes.num_rows))
        yield from pa.concat_tables([kept, _full(codes)]).to_batches()

    columns = [c for c in OUT.names if c not in ("blob", "to")]
    schema = pa.schema([_OUT_ARROW.field(c) for c in columns])
    settled = rows.repartition(len(keys), "_key").mapInArrow(settler(), OUT)
    if len(keys) == 1:  # one task settled the batch whole, the checks that need neighbours too
        with described(spark, f"{label}: settled in one task"):
            return results(settled.toArrow().cast(_OUT_ARROW), shape, ws, as_of, small)
    # the settling tasks and the content pass are one job: the rows the driver needs (the counts,
    # latencies, every chunk's bounds and flagged originals, each code's count of anomaly rows) come
    # back through the content pass's tasks with what they find; the anomaly rows stay with the
    # executors (a persisted frame), read from there when they are published
    cached = settled.repartition(b, "to").mapInArrow(by_content, OUT).select(*columns) \
        .persist(StorageLevel.MEMORY_AND_DISK)
    with described(spark, f"{label}: settled in {len(keys)} tasks"):
        gathered = _full(cached.where(F.col("kind") != ANOMALY).toArrow().cast(schema))
    # the log order and the gaps: each chunk found its own; what crosses the cuts comes from every
    # chunk's bounds (a few rows per pid and chunk), and the chunks whose offsets reach into
    # another's are settled again for their part of the log order, given the others' bounds
    every = {t: _bounds_of(gathered, t) for t in pc.unique(
        gathered.filter(pc.equal(gathered["kind"], BOUND))["topic"]).to_pylist()}
    across = _out_anomalies({t: neighbours.gaps_across(b) for t, b in every.items()}, ws, as_of, "gaps")
    crossing = {t: neighbours.crossing(b) for t, b in every.items()}
    again_chunks = sorted({k for ks in crossing.values() for k in ks})
    if again_chunks:
        near = {t: neighbours.around(b) for t, b in every.items()}
        again = {t: a.filter(pc.is_in(a["chunk"], value_set=pa.array(again_chunks, pa.int64())))
                 for t, a in near.items()}
        with described(spark, f"{label}: log order across cuts"):
            parts = rows.repartition(len(keys), "_key").mapInArrow(settler(again), OUT) \
                .select(*columns).toArrow().cast(schema)
        own = pc.and_(pc.equal(gathered["kind"], FLAGGED), pc.is_in(gathered["n"], pa.array(again_chunks, pa.int64())))
        gathered = pa.concat_tables([gathered.filter(pc.invert(own)), _full(parts)])
    return results(pa.concat_tables([gathered, across, _log_order_across(gathered, ws, as_of)]), shape, ws, as_of,
                   small, cached)


def _routed(out: pa.Table, k: int, b: int) -> pa.Table:
    """Chunk k's OUT rows, each with the content pass's task it goes to (`to`): its originals by
    their bucket of fingerprint hashes (one of `b`), a failed send a resend may take back with the
    originals of its fingerprint, every other row by its chunk."""
    to = np.full(out.num_rows, k, np.int64)
    blob = bools(pc.equal(out["kind"], BY_CONTENT))
    to[blob] = ints(out["n"].filter(pa.array(blob)))
    can = _resendable(out)
    to[can] = np.mod(ints(out["fp1"].filter(pa.array(can))), b)
    return out.set_column(out.schema.get_field_index("to"), "to", pa.array(to))


def _alone(narrow: pa.Table, k: int, ws: datetime, as_of: datetime) -> pa.Table:
    """Chunk k looked at alone (`neighbours.alone`), each topic's: its bounds as BOUND rows, its gaps
    as anomaly rows, the originals its own rows flag as FLAGGED rows."""
    parts = []
    for topic in pc.unique(narrow["topic"]).to_pylist():
        b, found, flagged = neighbours.alone(narrow.filter(pc.equal(narrow["topic"], topic)), k)
        parts += [_full(pa.table({"topic": pa.array([topic] * b.num_rows, pa.string()),
                                  "kind": pa.array([BOUND] * b.num_rows, pa.string()), "n": b["chunk"],
                                  **{c: b[c] for c in ("pid", "partition", "lo", "hi", "win")}})),
                  _out_anomalies({topic: found}, ws, as_of, "gaps"), _log_part(topic, k, FLAGGED, flagged)]
    return pa.concat_tables(parts) if parts else _OUT_ARROW.empty_table()


def _bounds_of(rows: pa.Table, topic: str) -> pa.Table:
    """A topic's BOUND rows as `neighbours.BOUNDS`."""
    t = rows.filter(pc.and_(pc.equal(rows["topic"], topic), pc.equal(rows["kind"], BOUND)))
    return pa.table({"chunk": t["n"], **{c: t[c] for c in ("pid", "partition", "lo", "hi", "win")}},
                    schema=neighbours.BOUNDS)


def _out_anomalies(found: dict[str, list[Any]], ws: datetime, as_of: datetime, which: str) -> pa.Table:
    """The anomaly rows (OUT) of what `which` check ('log', 'gaps') found, per topic."""
    parts = []
    for topic, rows in found.items():
        out: list[dict[str, Any]] = []
        oracle.emit_neighbour_rows(oracle.anomaly_emitter(out, topic, ws, as_of), rows if which == "log" else [],
                                   rows if which == "gaps" else [], [])
        parts.append(_full(_table(_anomaly_rows(topic, out))))
    return pa.concat_tables(parts) if parts else _OUT_ARROW.empty_table()


def _blobs(rows: pa.Table, kind: str, n: np.ndarray) -> pa.Table:
    """`rows` packed as Arrow IPC streams in OUT rows of `kind`, one per value of `n` (one for each
    row of `rows`) and up to `_BLOB_ROWS` rows."""
    import pyarrow.ipc as ipc

    blobs, ns = [], []
    for value in np.unique(n).tolist():
        some = rows.filter(pa.array(n == value))
        for at in range(0, some.num_rows, _BLOB_ROWS):
            sink = pa.BufferOutputStream()
            with ipc.new_stream(sink, some.schema) as w:
                w.write_table(some.slice(at, _BLOB_ROWS))
            blobs.append(sink.getvalue())
            ns.append(value)
    # as bytes: an array built from memoryviews of Arrow buffers keeps every buffer allocated for as
    # long as the process lives (pyarrow 26), and a Python worker lives for many tasks
    return _full(pa.table({"kind": pa.array([kind] * len(blobs), pa.string()), "n": pa.array(ns, pa.int64()),
                           "blob": pa.array([b.to_pybytes() for b in blobs], pa.binary())}))


def _unblobbed(rows: pa.Table) -> pa.Table:
    """The rows packed in the `blob`s of OUT rows (`_blobs`), as one table (the content pass's
    columns; none: empty)."""
    import pyarrow.ipc as ipc

    got = [ipc.open_stream(pa.py_buffer(b)).read_all() for b in rows["blob"].to_pylist()]
    return pa.concat_tables(got) if got else _OUT_ARROW.empty_table().select(list(_CONTENT_COLUMNS))


def _log_part(topic: str, k: int, kind: str, t: pa.Table) -> pa.Table:
    """Chunk k's rows of `neighbours.FLAGGED` of one topic as OUT rows of `kind` (FLAGGED, STAIR)."""
    return _full(pa.table({"topic": pa.array([topic] * t.num_rows, pa.string()),
                           "kind": pa.array([kind] * t.num_rows, pa.string()),
                           "n": pa.array(np.full(t.num_rows, k, np.int64)), "hi": t["high"],
                           **{c: t[c] for c in ("pid", "seq", "partition", "offset")}}))


def _again(narrow: pa.Table, k: int, again: dict[str, pa.Table]) -> pa.Table:
    """Chunk k's part of the log order given the others' bounds (`again`: each topic's
    `neighbours.around` rows): its flagged originals and the rows an earlier chunk's flagged ones may
    find before them (`neighbours.log_order_part`), as FLAGGED and STAIR rows."""
    parts = []
    none = neighbours.around(neighbours.BOUNDS.empty_table())
    for topic in pc.unique(narrow["topic"]).to_pylist():
        near = again.get(topic)
        flagged, stairs = neighbours.log_order_part(narrow.filter(pc.equal(narrow["topic"], topic)),
                                                    none if near is None else near.filter(pc.equal(near["chunk"], k)))
        parts += [_log_part(topic, k, FLAGGED, flagged), _log_part(topic, k, STAIR, stairs)]
    return pa.concat_tables(parts) if parts else _OUT_ARROW.empty_table()


def _log_order_across(gathered: pa.Table, ws: datetime, as_of: datetime) -> pa.Table:
    """The `reordered_in_log` rows (OUT) from every chunk's FLAGGED and STAIR rows."""
    found = {}
    for topic in pc.unique(gathered["topic"]).to_pylist():
        of = gathered.filter(pc.equal(gathered["topic"], topic))

        def kind(k: str, t: pa.Table = of) -> pa.Table:
            x = t.filter(pc.equal(t["kind"], k))
            return pa.table({"pid": x["pid"], "seq": x["seq"], "partition": x["partition"], "offset": x["offset"],
                             "high": x["hi"], "chunk": x["n"]})
        flagged = kind(FLAGGED)
        if flagged.num_rows:
            found[topic] = neighbours.log_order_across(flagged, kind(STAIR))
    return _out_anomalies(found, ws, as_of, "log")


def _settle_parts(parts: dict[str, list[pa.Table]], topics: Sequence[TopicConfig], ws: datetime, as_of: datetime,
                  small: Small, flagged: pa.Table | None) -> pa.Table:
    """The OUT rows of a chunk's rows given per tier (a sink's rows with their sink's name in `sink`)."""
    def tier(tag: str) -> pa.Table | None:
        got = [t for t in parts.get(tag, []) if t is not None]
        if not got:
            return None
        return pa.concat_tables(alike(got), promote_options="permissive") if len(got) > 1 else got[0]

    consumed = tier("consumed")
    if small.commits is not None and small.commits.num_rows:
        consumed = small.commits if consumed is None else pa.concat_tables(alike([consumed, small.commits]),
                                                                           promote_options="permissive")
    if consumed is not None and flagged is not None:  # else the kernel orders the consumption itself
        consumed = mark_flags(consumed, flagged)
    sink = tier("sink")
    sinks = {name: sink.filter(equals(sink["sink"], name)) for name in pc.unique(sink["sink"]).to_pylist()} \
        if sink is not None and sink.num_rows else {}
    ledger, log = tier("ledger"), tier("log")
    t = kernel.Tables(ledger=kernel.empty(oracle.LedgerRow) if ledger is None else ledger,
                      log=kernel.empty(oracle.LogRecord) if log is None else log, consumed=consumed,
                      sinks=sinks, group_offsets=small.group_offsets, watermarks=small.watermarks,
                      mirror_log=tier("mirror_log"), mirror_watermarks=small.mirror_watermarks,
                      mirror_group_offsets=small.mirror_group_offsets, share_offsets=small.share_offsets)
    return pa.concat_tables([out_rows(tc.name, kernel.settle(tc, ws, as_of, t)) for tc in topics])
