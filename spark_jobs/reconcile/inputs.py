"""What one window reads: `read_window_inputs` reads only the Delta partitions (topic, part_hour)
the window and its lookback need (with `spark_jobs/io/sinks_read.py` for sinks), `restrict`
applies the oracle's exact visibility rules (`audit.core.windows.read_ranges`) and
`ledger_is_valid` the quarantine rule for malformed ledger rows.

With `outputs.py` this is the only I/O of the reconciliation; it must not classify anything or
write anything.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from datetime import datetime, timedelta
from typing import Any

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from audit.core.config import Config, TopicConfig
from audit.core.vocabulary import ACKED, COMMITTED, HANDED, LEDGER_STATUSES, PROCESSED
from audit.core.windows import read_ranges
from spark_jobs.reconcile.failover import ignored_rows, target_rows
from spark_jobs.reconcile.params import Shape
from spark_jobs.reconcile.sql import _q


@dataclass
class WindowInputs:
    """The DataFrames one window reads (already limited to the topics' partitions of the lake).

    Sinks are normalised to (topic, partition, offset, pid, seq, sink_ts) by sinks_read: `sinks`
    maps a sink's name to its rows (one topic), `sink_rows` holds the rows of several topics'
    sinks with their sink's name in a `sink` column (a batch, `read_batch_inputs`)."""

    ledger: DataFrame
    log: DataFrame
    consumed: DataFrame | None
    group_offsets: DataFrame | None
    watermarks: DataFrame | None
    sinks: Mapping[str, DataFrame] = field(default_factory=dict)
    mirror_log: DataFrame | None = None  # mirror_records of the topic (stage mirror:<m>), visibility in mirror.py
    mirror_watermarks: DataFrame | None = None
    # the consumer interceptor's `committed` rows (set by `restrict`; `consumed` then holds none)
    commits: DataFrame | None = None
    # every sink's rows in one DataFrame with the sink's name in `sink` (a batch's read, see `batches`)
    sink_rows: DataFrame | None = None
    # consumption rows of failover groups on their mirrors' target copies (set by `restrict`, failover.py)
    failover: DataFrame | None = None
    # the groups' committed offsets on the mirrors' target clusters (§5.5), when captured
    mirror_group_offsets: DataFrame | None = None
    # consumption rows read on a mirror their group does not fail over to (set by `restrict`; counted)
    ignored: DataFrame | None = None


def sink_rows(inputs: WindowInputs) -> DataFrame | None:
    """Every sink row of the inputs with its sink's name in `sink`, or None without sinks."""
    parts = [df.withColumn("sink", F.lit(name)) for name, df in inputs.sinks.items()]
    if inputs.sink_rows is not None:
        parts.append(inputs.sink_rows)
    # the optional produce time (docs/design.md §4.2): null for a sink that lacks it
    parts = [p if "produce_ts" in p.columns else p.withColumn("produce_ts", F.lit(None).cast("timestamp"))
             for p in parts]
    if not parts:
        return None
    out = parts[0]
    for p in parts[1:]:
        out = out.unionByName(p)
    return out


def _as_shape(topics: TopicConfig | Shape) -> Shape:
    return topics if isinstance(topics, Shape) else Shape((topics,))


def restrict(inputs: WindowInputs, topics: TopicConfig | Shape, ws: datetime) -> WindowInputs:
    """Exact visibility rules of the oracle (the I/O edge prunes Delta partitions coarsely first),
    for one topic or a batch of topics with the same read ranges (`batches`)."""
    shape = _as_shape(topics)
    ranges = {read_ranges(tc, ws) for tc in shape.topics}
    if len(ranges) != 1:
        raise ValueError("a batch's topics must have the same read ranges (see `batches`)")
    rr = ranges.pop()
    names = shape.names
    topic = F.col("topic") == names[0] if len(names) == 1 else F.col("topic").isin(names)

    def between(col: Any, lo: datetime, hi: datetime) -> Any:
        return (col >= F.lit(lo)) & (col < F.lit(hi))

    ledger = inputs.ledger.where(topic & between(F.col("produce_ts"), rr.message_lo, rr.message_hi))
    natural = F.coalesce("produce_ts", "kafka_ts", "captured_at")
    log = inputs.log.where(topic & between(natural, rr.message_lo, rr.message_hi))
    consumed = failover = ignored = None
    if inputs.consumed is not None and shape.max_groups:
        consumed = inputs.consumed.where(topic & shape.group_index().isNotNull()
                                         & between(F.col("consume_ts"), rr.event_lo, rr.event_hi))
        # rows consumed on a mirror's target copy are judged by the failover rule (failover.py), not
        # as the source records at their (target) partition and offset
        failover = target_rows(consumed, shape)
        if failover is not None:
            failover = failover.withColumn("outcome", F.when(F.col("outcome") == HANDED, F.lit(PROCESSED))
                                           .otherwise(F.col("outcome")))
        ignored = ignored_rows(consumed, shape)
        consumed = consumed.where(F.col("cluster").isNull())
    commits = None
    if consumed is not None:
        # The consumer interceptor's rows (§5.3): `committed` rows only give g's committed offset;
        # a `handed` outcome is evidence of processing, as `processed` is.
        commits = consumed.where(F.col("outcome") == COMMITTED)
        consumed = (consumed.where(F.col("outcome") != COMMITTED)
                    .withColumn("outcome", F.when(F.col("outcome") == HANDED, F.lit(PROCESSED))
                                .otherwise(F.col("outcome"))))
    window = F.col("sink_ts").isNull() | between(F.col("sink_ts"), rr.event_lo, rr.event_hi)
    sinks = {name: df.where(topic & window) for name, df in inputs.sinks.items()}
    rows = inputs.sink_rows.where(topic & window) if inputs.sink_rows is not None else None
    return WindowInputs(ledger, log, consumed, inputs.group_offsets, inputs.watermarks, sinks,
                        inputs.mirror_log, inputs.mirror_watermarks, commits=commits, sink_rows=rows,
                        failover=failover, mirror_group_offsets=inputs.mirror_group_offsets, ignored=ignored)


def batches(topics: Sequence[TopicConfig], ws: datetime, cap: int) -> list[Shape]:
    """The topics of one window start, in batches that one plan classifies together: topics with
    the same read ranges (window size, lookback, grace: docs/design.md §6.3), at most `cap` each,
    so a window's Spark jobs do not grow with its topic count (only the batch count does)."""
    by_range: dict[Any, list[TopicConfig]] = {}
    for tc in topics:
        by_range.setdefault(read_ranges(tc, ws), []).append(tc)
    return [Shape(tuple(tcs[i:i + cap])) for tcs in by_range.values() for i in range(0, len(tcs), cap)]


def ledger_is_valid() -> Any:
    return (F.col("status").isin(list(LEDGER_STATUSES))
            & ~((F.col("status") == ACKED) & (F.col("offset").isNull() | (F.col("partition") < 0))))


def _hours(lo: datetime, hi: datetime) -> tuple[str, str]:
    """part_hour bounds (inclusive) of the instants [lo, hi)."""
    return lo.strftime("%Y-%m-%dT%H"), (hi - timedelta(microseconds=1)).strftime("%Y-%m-%dT%H")


def read_window_inputs(spark: SparkSession, cfg: Config, tc: TopicConfig, ws: datetime) -> WindowInputs:
    """Read only the Delta partitions (topic, part_hour) the window and its lookback need."""
    return read_batch_inputs(spark, cfg, Shape((tc,)), ws)


def read_batch_inputs(spark: SparkSession, cfg: Config, shape: Shape, ws: datetime,
                      tables: dict[str, tuple[DataFrame, bool]] | None = None) -> WindowInputs:
    """Read only the Delta partitions (topic, part_hour) a batch's window and lookback need (the
    batch's topics share their read ranges). `tables` caches each table's frame for the run: the
    Delta log of a table is read once per run, not once per (topic, window); each physical sink
    is read once for all the topics that write it."""
    from spark_jobs.io.lake import read_input_table, table_exists
    from spark_jobs.io.sinks_read import read_sink

    cache = {} if tables is None else tables
    tc0 = shape.topics[0]
    rr = read_ranges(tc0, ws)
    m_lo, m_hi = _hours(rr.message_lo, rr.message_hi)
    e_lo, e_hi = _hours(rr.event_lo, rr.event_hi)
    names = shape.names
    topic = F.col("topic") == names[0] if len(names) == 1 else F.col("topic").isin(names)

    def table(name: str) -> tuple[DataFrame, bool]:
        if name not in cache:
            cache[name] = read_input_table(spark, cfg, name)
        return cache[name]

    def pruned(name: str, lo: str, hi: str) -> DataFrame:
        df, partitioned = table(name)
        df = df.where(topic)
        if not partitioned:  # written by another tool without part_hour: read whole (`restrict` is exact)
            return df
        return df.where((F.col("part_hour") >= lo) & (F.col("part_hour") <= hi))

    def small(name: str) -> DataFrame:
        return table(name)[0].where(topic)

    ledger = pruned("producer_ledger", m_lo, m_hi)
    log = pruned("log_records", m_lo, m_hi)
    watermarks = small("partition_watermarks")
    consumed = group_offsets = None
    if shape.max_groups:
        consumed = pruned("consumed_records", e_lo, e_hi)
        group_offsets = small("group_offsets")
    else:
        if "?group_offsets" not in cache:
            cache["?group_offsets"] = (spark.range(0), table_exists(spark, cfg, "group_offsets"))
        if cache["?group_offsets"][1]:
            group_offsets = small("group_offsets")
    mirror_log = mirror_watermarks = None
    if any(tc.mirrors for tc in shape.topics):
        mirror_log = pruned("mirror_records", m_lo, m_hi) if table_exists(spark, cfg, "mirror_records") else None
        if table_exists(spark, cfg, "mirror_watermarks"):
            mirror_watermarks = small("mirror_watermarks")
    mirror_groups = None
    if any(m.failover_groups for tc in shape.topics for m in tc.mirrors) and table_exists(
            spark, cfg, "mirror_group_offsets"):
        mirror_groups = small("mirror_group_offsets")
    if len(shape.topics) == 1:
        sinks = {}
        for s in tc0.sinks:
            key = f"sink:{_sink_identity(s)!r}"
            if key not in cache:
                cache[key] = (read_sink(spark, s, None), True)
            sinks[s.name] = cache[key][0].where(F.col("topic") == tc0.name)
        return WindowInputs(ledger, log, consumed, group_offsets, watermarks, sinks, mirror_log, mirror_watermarks,
                            mirror_group_offsets=mirror_groups)
    # one read per physical sink; a row goes to every sink (of its topic) that names that table
    users: dict[Any, list[tuple[str, Any]]] = {}
    for tc in shape.topics:
        for s in tc.sinks:
            users.setdefault(_sink_identity(s), []).append((tc.name, s))
    rows: DataFrame | None = None
    for ident, named in users.items():
        key = f"sink:{ident!r}"
        if key not in cache:
            cache[key] = (read_sink(spark, named[0][1], None), True)
        by_topic: dict[str, list[str]] = {}
        for t, s in named:
            by_topic.setdefault(t, []).append(s.name)
        lookup = "map(" + ", ".join(f"{_q(t)}, array({', '.join(_q(n) for n in ns)})"
                                    for t, ns in sorted(by_topic.items())) + ")"
        part = (cache[key][0].where(F.col("topic").isin(sorted(by_topic)))
                .withColumn("sink", F.explode(F.expr(f"try_element_at({lookup}, topic)"))))
        rows = part if rows is None else rows.unionByName(part)
    return WindowInputs(ledger, log, consumed, group_offsets, watermarks, {}, mirror_log, mirror_watermarks,
                        sink_rows=rows, mirror_group_offsets=mirror_groups)


def map_frames(inputs: WindowInputs, f: Callable[[DataFrame], DataFrame]) -> WindowInputs:
    """`inputs` with `f` applied to every frame they hold, each sink's too: every DataFrame field of
    `WindowInputs`, so a frame added there is never left out."""
    changes: dict[str, Any] = {}
    for fd in fields(inputs):
        value = getattr(inputs, fd.name)
        if isinstance(value, DataFrame):
            changes[fd.name] = f(value)
        elif fd.name == "sinks":
            changes[fd.name] = {name: f(df) for name, df in value.items()}
    return replace(inputs, **changes)


def sinks_in_range(inputs: WindowInputs, topics: TopicConfig | Shape, ws: datetime) -> WindowInputs:
    """`inputs` with each sink's rows restricted to the window's (`restrict`), the lake tables as read.
    A sink is a user's table of every window: a window's inputs are counted, and its scans pinned,
    over these (Delta skips the files of the sink's other days by their statistics)."""
    visible = restrict(inputs, topics, ws)
    return replace(inputs, sinks=visible.sinks, sink_rows=visible.sink_rows)


def pinned(inputs: WindowInputs, planned: DataFrame | None = None) -> WindowInputs:
    """Each frame of a batch's inputs over the files its Delta tables' scans keep (`lake.pin_scans`,
    docs/design.md §6.3): every query of the batch then reads one snapshot of each table and lists
    no files. `planned`: a query over all the frames, already planned (the inputs' count or collect,
    `driver.collect_inputs`), whose listings are taken instead of listing each frame's again."""
    from spark_jobs.io.lake import pin_scans, scan_files

    kept = None if planned is None else scan_files(planned)
    return map_frames(inputs, lambda df: pin_scans(df, kept))


def _sink_identity(s: Any) -> tuple[Any, ...]:
    """What makes two sink configs read the same rows: the table and its column mapping."""
    return (s.format, s.location, s.url, s.table, tuple(sorted((s.columns or {}).items())))


def check_window_inputs(spark: SparkSession, cfg: Config, tc: TopicConfig,
                        tables: dict[str, tuple[DataFrame, bool]] | None = None) -> None:
    """Check the schema of every input and sink table the topic's windows read, before any window
    runs: a missing column is one InputError naming the table, the column and what writes it.
    With `tables` (the run's cache, see `read_batch_inputs`) each table is opened once per run."""
    from spark_jobs.io.lake import read_input_table, table_exists
    from spark_jobs.io.sinks_read import read_sink

    cache = {} if tables is None else tables
    names = ["producer_ledger", "log_records", "partition_watermarks"]
    if tc.groups:
        names += ["consumed_records", "group_offsets"]
    elif table_exists(spark, cfg, "group_offsets"):
        names.append("group_offsets")
    for name in names:
        if name not in cache:
            cache[name] = read_input_table(spark, cfg, name)
    for s in tc.sinks:
        key = f"sink:{_sink_identity(s)!r}"
        if key not in cache:
            cache[key] = (read_sink(spark, s, None), True)
