"""What one window reads: `read_batch_inputs` reads only the Delta partitions (topic, part_hour)
the window and its lookback need (with `spark_jobs/io/sinks_read.py` for sinks), and `visible`
keeps the rows the rules see (`audit.core.windows.read_ranges`; the kernel applies the same
ranges again, so this only spares the later steps the rows it leaves out).

With `publish.py` this is the only I/O of the reconciliation; it must not classify anything or
write anything.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from datetime import datetime, timedelta
from functools import reduce
from typing import Any

import pyarrow as pa
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from audit.core.config import Config, TopicConfig
from audit.core.windows import read_ranges
from spark_jobs.io.lake import kept_rows, sql_string
from spark_jobs.reconcile.plan import Shape


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
    mirror_log: DataFrame | None = None  # mirror_records of the topic (stage mirror:<m>)
    mirror_watermarks: DataFrame | None = None
    # every sink's rows in one DataFrame with the sink's name in `sink` (a batch's read, see `batches`)
    sink_rows: DataFrame | None = None
    # the groups' committed offsets on the mirrors' target clusters (§5.5), when captured
    mirror_group_offsets: DataFrame | None = None
    # the share groups' start offsets (§5.9, `missed`), when captured
    share_offsets: DataFrame | None = None


def sink_rows(inputs: WindowInputs) -> DataFrame | None:
    """Every sink row of the inputs with its sink's name in `sink`, or None without sinks."""
    parts = [df.withColumn("sink", F.lit(name)) for name, df in inputs.sinks.items()]
    if inputs.sink_rows is not None:
        parts.append(inputs.sink_rows)
    # the optional produce time (docs/design.md §4.2): null for a sink that lacks it
    parts = [p if "produce_ts" in p.columns else p.withColumn("produce_ts", F.lit(None).cast("timestamp"))
             for p in parts]
    parts = [p if "dead_letter" in p.columns else p.withColumn("dead_letter", F.lit(False)) for p in parts]
    if not parts:
        return None
    out = parts[0]
    for p in parts[1:]:
        out = out.unionByName(p)
    return out


def visible(inputs: WindowInputs, shape: Shape, ws: datetime) -> WindowInputs:
    """The rows of the batch's topics the rules see (docs/design.md §5: the message range for ledger
    and log rows, the event range for consumption and sink rows, a topic's own groups); the batch's
    topics share their read ranges (`plan.batches`)."""
    rr = read_ranges(shape.topics[0], ws)
    names = shape.names
    topic = F.col("topic") == names[0] if len(names) == 1 else F.col("topic").isin(names)

    def between(col: Any, lo: datetime, hi: datetime) -> Any:
        return (col >= F.lit(lo)) & (col < F.lit(hi))

    ledger = inputs.ledger.where(topic & between(F.col("produce_ts"), rr.message_lo, rr.message_hi))
    natural = F.coalesce("produce_ts", "kafka_ts", "captured_at")
    log = inputs.log.where(topic & between(natural, rr.message_lo, rr.message_hi))
    consumed = None
    if inputs.consumed is not None and shape.max_groups:
        own = [(F.col("topic") == tc.name) & F.col("group").isin(list(tc.consuming_groups))
               for tc in shape.topics if tc.consuming_groups]
        consumed = inputs.consumed.where(reduce(lambda a, b: a | b, own)
                                         & between(F.col("consume_ts"), rr.event_lo, rr.event_hi))
    window = F.col("sink_ts").isNull() | between(F.col("sink_ts"), rr.event_lo, rr.event_hi)
    sinks = {name: df.where(topic & window) for name, df in inputs.sinks.items()}
    rows = inputs.sink_rows.where(topic & window) if inputs.sink_rows is not None else None
    mirror_log = None
    if inputs.mirror_log is not None:
        mirror_log = inputs.mirror_log.where(topic & between(natural, rr.message_lo, rr.message_hi))
    return replace(inputs, ledger=ledger, log=log, consumed=consumed, sinks=sinks, sink_rows=rows,
                   mirror_log=mirror_log)


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
    from spark_jobs.io.sinks_read import read_sink, share_dead_letter_rows

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

    def sink_log(s: Any) -> DataFrame | None:
        """The whole captured log, for a sink whose rows name records by their coordinates (a sink
        row's record may lie in any hour)."""
        return table("log_records")[0] if s.identity == "coordinates" or s.dead_letter_topic else None

    def sink_dlq(s: Any) -> DataFrame | None:
        """The captured dead-letter records, for a sink that names its connector's DLQ topic."""
        return table("dead_letter_records")[0] if s.dead_letter_topic else None

    ledger = pruned("producer_ledger", m_lo, m_hi)
    log = pruned("log_records", m_lo, m_hi)
    watermarks = small("partition_watermarks")
    consumed = group_offsets = None
    if shape.max_groups:
        consumed = pruned("consumed_records", e_lo, e_hi)
        dlq_groups = [sg for tc in shape.topics for sg in tc.share_groups if sg.dead_letter_topic]
        if dlq_groups:  # the records of the share groups' dead-letter topics, as rows of the group (§5.9)
            dead = share_dead_letter_rows(table("dead_letter_records")[0], dlq_groups, small("log_records"))
            consumed = consumed.unionByName(dead.where(topic), allowMissingColumns=True)
    if any(tc.groups for tc in shape.topics):  # share groups commit no offsets
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
    shares = None
    if any(tc.share_groups for tc in shape.topics):
        if "?share_offsets" not in cache:
            cache["?share_offsets"] = (spark.range(0), table_exists(spark, cfg, "share_offsets"))
        if cache["?share_offsets"][1]:
            shares = small("share_offsets")
    if len(shape.topics) == 1:
        sinks = {}
        for s in tc0.sinks:
            key = f"sink:{_sink_identity(s)!r}"
            if key not in cache:
                cache[key] = (read_sink(spark, s, None, sink_log(s), sink_dlq(s)), True)
            sinks[s.name] = cache[key][0].where(F.col("topic") == tc0.name)
        return WindowInputs(ledger, log, consumed, group_offsets, watermarks, sinks, mirror_log, mirror_watermarks,
                            mirror_group_offsets=mirror_groups, share_offsets=shares)
    # one read per physical sink; a row goes to every sink (of its topic) that names that table
    users: dict[Any, list[tuple[str, Any]]] = {}
    for tc in shape.topics:
        for s in tc.sinks:
            users.setdefault(_sink_identity(s), []).append((tc.name, s))
    rows: DataFrame | None = None
    for ident, named in users.items():
        key = f"sink:{ident!r}"
        if key not in cache:
            cache[key] = (read_sink(spark, named[0][1], None, sink_log(named[0][1]), sink_dlq(named[0][1])), True)
        by_topic: dict[str, list[str]] = {}
        for t, s in named:
            by_topic.setdefault(t, []).append(s.name)
        lookup = "map(" + ", ".join(f"{sql_string(t)}, array({', '.join(sql_string(n) for n in ns)})"
                                    for t, ns in sorted(by_topic.items())) + ")"
        part = (cache[key][0].where(F.col("topic").isin(sorted(by_topic)))
                .withColumn("sink", F.explode(F.expr(f"try_element_at({lookup}, topic)"))))
        rows = part if rows is None else rows.unionByName(part)
    return WindowInputs(ledger, log, consumed, group_offsets, watermarks, {}, mirror_log, mirror_watermarks,
                        sink_rows=rows, mirror_group_offsets=mirror_groups, share_offsets=shares)


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


def sinks_in_range(inputs: WindowInputs, shape: Shape, ws: datetime) -> WindowInputs:
    """`inputs` with each sink's rows restricted to the window's (`visible`), the lake tables as read.
    A sink is a user's table of every window: a window's inputs are counted, and its scans pinned,
    over these (Delta skips the files of the sink's other days by their statistics)."""
    seen = visible(inputs, shape, ws)
    return replace(inputs, sinks=seen.sinks, sink_rows=seen.sink_rows)


def pinned(inputs: WindowInputs, planned: DataFrame | None = None) -> WindowInputs:
    """Each frame of a batch's inputs over the files its Delta tables' scans keep (`lake.pin_scans`,
    docs/design.md §6.3): every query of the batch then reads one snapshot of each table and lists
    no files. `planned`: a query over all the frames, already planned (the inputs' count or collect,
    `settle.count_rows`), whose listings are taken instead of listing each frame's again."""
    from spark_jobs.io.lake import pin_scans, scan_files

    kept = None if planned is None else scan_files(planned)
    return map_frames(inputs, lambda df: pin_scans(df, kept))


def _sink_identity(s: Any) -> tuple[Any, ...]:
    """What makes two sink configs read the same rows: the table, its column mapping and how its
    rows name their message (with the topic they get when no column names it)."""
    named = (s.identity, s.topic) if s.identity != "audit" and "topic" not in s.columns else (s.identity,)
    return (s.format, s.location, s.url, s.table, tuple(sorted((s.columns or {}).items())), *named,
            *((s.dead_letter_topic, s.topic) if s.dead_letter_topic else ()))


def check_window_inputs(spark: SparkSession, cfg: Config, tc: TopicConfig,
                        tables: dict[str, tuple[DataFrame, bool]] | None = None) -> None:
    """Check the schema of every input and sink table the topic's windows read, before any window
    runs: a missing column is one InputError naming the table, the column and what writes it.
    With `tables` (the run's cache, see `read_batch_inputs`) each table is opened once per run."""
    from spark_jobs.io.lake import read_input_table, table_exists
    from spark_jobs.io.sinks_read import read_sink

    cache = {} if tables is None else tables
    names = ["producer_ledger", "log_records", "partition_watermarks"]
    if tc.consuming_groups:
        names.append("consumed_records")
    if tc.groups or table_exists(spark, cfg, "group_offsets"):  # share groups commit no offsets
        names.append("group_offsets")
    if tc.share_groups and table_exists(spark, cfg, "share_offsets"):
        names.append("share_offsets")
    for name in names:
        if name not in cache:
            cache[name] = read_input_table(spark, cfg, name)

    def sink_log(s: Any) -> DataFrame | None:
        return cache["log_records"][0] if s.identity == "coordinates" or s.dead_letter_topic else None

    if (any(s.dead_letter_topic for s in tc.sinks) or any(sg.dead_letter_topic for sg in tc.share_groups)) \
            and "dead_letter_records" not in cache:
        cache["dead_letter_records"] = read_input_table(spark, cfg, "dead_letter_records")
    for s in tc.sinks:
        key = f"sink:{_sink_identity(s)!r}"
        if key not in cache:
            cache[key] = (read_sink(spark, s, None, sink_log(s),
                                    cache["dead_letter_records"][0] if s.dead_letter_topic else None), True)


# Inputs that are not all plain local Parquet (a JDBC sink, an object store) and whose files hold at
# most this many bytes are collected at once and counted as collected (well within what the driver
# settles, `plan.DRIVER_ROWS`: collecting a larger input only to find it goes to Spark tasks would
# cost more than the count it saves); larger ones are counted first.
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


# ---------------------------------------------------------------------------- files a task reads itself
_ARROW_TYPES = {"string": pa.string(), "bigint": pa.int64(), "int": pa.int32(), "boolean": pa.bool_(),
                "timestamp": pa.timestamp("us", "UTC")}
NULL_SOURCE = ""  # a column that is a null literal (an optional column its table lacks)
FALSE_SOURCE = "=false"  # a column that is the literal false (a sink row's `dead_letter`)
CONSTANTS = (NULL_SOURCE, FALSE_SOURCE)  # the sources that are no file column


@dataclass(frozen=True)
class FileTable:
    """A frame's rows as they lie in plain Parquet files on the local file system, for a Spark task
    to read with pyarrow (`settle.read_files`) instead of having Spark hand them over: the files,
    their hive partition columns (under `root`), the file columns to read (`physical`, each as the
    frame's type), and each output column's source column (`NULL_SOURCE`: a null, `FALSE_SOURCE`: false). The frame's filters
    are not applied: the kernel applies the exact visibility."""

    paths: tuple[str, ...]
    partitions: tuple[str, ...]
    root: str | None
    physical: pa.Schema
    sources: tuple[tuple[str, str], ...]
    out: pa.Schema
    store: ObjectStore | None = None  # the files are keys of this S3 store (paths: bucket/key)

    def filesystem(self) -> Any:
        """The pyarrow file system the paths are on (None: the local one)."""
        return None if self.store is None else self.store.filesystem()


@dataclass(frozen=True)
class ObjectStore:
    """An S3-compatible store as Hadoop's S3A connector is configured for it (`spark.hadoop.fs.s3a.*`
    in the config), for pyarrow to read the same files; the secret never shows in a repr."""

    endpoint: str | None
    region: str | None
    access_key: str | None = field(repr=False)
    secret_key: str | None = field(repr=False)
    session_token: str | None = field(default=None, repr=False)
    endpoint_tls: bool = True  # `fs.s3a.connection.ssl.enabled`, for an endpoint without a scheme

    def filesystem(self) -> Any:
        from pyarrow import fs

        scheme, host = "https", self.endpoint
        if host and "://" in host:
            scheme, host = host.split("://", 1)
        elif host and not self.endpoint_tls:
            scheme = "http"
        return fs.S3FileSystem(access_key=self.access_key, secret_key=self.secret_key,
                               session_token=self.session_token, region=self.region or "us-east-1",
                               endpoint_override=host, scheme=scheme)


def object_store(spark: SparkSession) -> ObjectStore | None:
    """The S3A settings of the session's Hadoop configuration as an `ObjectStore`, or None when
    credentials come from elsewhere (a provider chain pyarrow may not share: Spark reads the files)."""
    conf = spark.sparkContext._jsc.hadoopConfiguration()
    access, secret = conf.get("fs.s3a.access.key"), conf.get("fs.s3a.secret.key")
    if not access or not secret:
        return None
    return ObjectStore(endpoint=conf.get("fs.s3a.endpoint"), region=conf.get("fs.s3a.endpoint.region"),
                       access_key=access, secret_key=secret, session_token=conf.get("fs.s3a.session.token"),
                       endpoint_tls=(conf.get("fs.s3a.connection.ssl.enabled") or "true").lower() != "false")


def _sources(plan: Any, leaf: Any) -> dict[str, str] | None:
    """Each output column of `plan` that is a column of `leaf` passed through, perhaps renamed (a
    sink's mapped audit columns), as {output name: the leaf's column name}, or `NULL_SOURCE` for a null
    literal (an optional column the table lacks, `lake.read_input_table`), `FALSE_SOURCE` for the literal
    false; computed columns are left out. None when a node between them is not a projection or a filter."""
    from spark_jobs.io.lake import scala_items

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
            return NULL_SOURCE
        if kind == "Literal" and e.dataType().typeName() == "boolean" and e.value() is False:
            return FALSE_SOURCE
        return None

    for project in reversed(projects):
        step = {e.exprId().id(): source(e) for e in scala_items(project.projectList())}
        ids = {k: v for k, v in step.items() if v is not None}
    return {a.name(): ids[a.exprId().id()] for a in scala_items(plan.output()) if a.exprId().id() in ids}


def file_table(df: DataFrame, columns: Sequence[str], store: ObjectStore | None = None) -> FileTable | None:
    """`columns` of `df` as a `FileTable`, or None unless `df` is one table's rows as they are in its
    files: projections and filters over a scan of plain Parquet files (a pinned Delta scan, `pinned`)
    whose directories name its partition values, each column one of the table's, passed through or
    renamed, or null; the files local, or on the S3 store `store` (`s3a://`). Anything else (a Delta
    scan Spark must read itself -- deletion vectors, column mapping --, a JDBC sink, another object
    store) is Spark's to read."""
    from spark_jobs.io.lake import local_path, scala_items

    plan = df._jdf.queryExecution().optimizedPlan()
    leaves = scala_items(plan.collectLeaves())
    if len(leaves) != 1:
        return None
    leaf = leaves[0]
    types = dict(df.dtypes)
    if any(types.get(c) not in _ARROW_TYPES for c in columns):
        return None
    out = pa.schema([(c, _ARROW_TYPES[types[c]]) for c in columns])
    if leaf.getClass().getSimpleName() == "LocalRelation":  # no file kept (or rows from Python: Spark's)
        if not leaf.data().isEmpty():
            return None
        return FileTable((), (), None, pa.schema([]), tuple((c, NULL_SOURCE) for c in columns), out)
    if leaf.getClass().getName() != "org.apache.spark.sql.execution.datasources.LogicalRelation":
        return None
    relation = leaf.relation()
    if relation.getClass().getName() != "org.apache.spark.sql.execution.datasources.HadoopFsRelation":
        return None
    if relation.fileFormat().getClass().getSimpleName() != "ParquetFileFormat":
        return None
    sources = _sources(plan, leaf)
    if sources is None or any(c not in sources for c in columns):
        return None
    files = [str(f) for f in relation.location().inputFiles()]
    on_s3 = store is not None and bool(files) and all(f.startswith("s3a://") for f in files)
    if not on_s3 and not all(f.startswith("file:") for f in files):
        return None
    path = _key if on_s3 else local_path
    partitions = [f.name() for f in relation.partitionSchema().fields()]
    base = relation.options().get("basePath")
    if partitions and not base.isDefined():
        return None
    root = path(str(base.get())) if partitions else None
    # each file column read as the table's type; one schema for every file, so a file written before
    # a column was added reads it as null
    read_as = {sources[c]: _ARROW_TYPES[types[c]] for c in columns if sources[c] not in CONSTANTS}
    if any(p in read_as and read_as[p] != pa.string() for p in partitions):
        return None
    physical = pa.schema([*((p, t) for p, t in read_as.items() if p not in partitions),
                          *((p, pa.string()) for p in partitions)])
    return FileTable(tuple(path(f) for f in files), tuple(partitions), root, physical,
                     tuple((c, sources[c]) for c in columns), out, store if on_s3 else None)


def _key(uri: str) -> str:
    """An `s3a://bucket/key` URI as pyarrow's S3 path, `bucket/key`."""
    from urllib.parse import unquote

    return unquote(uri[len("s3a://"):])
