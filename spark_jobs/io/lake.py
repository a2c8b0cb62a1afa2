"""Where the Delta tables live, and the few primitives every job uses to read and write them.

Every location is a Hadoop filesystem URI (`s3a://bucket/lake/producer_ledger`) or an absolute
local path, joined with '/' and handed to Spark as is: nothing Spark reads or writes goes through
pathlib or the local filesystem, so the lake can be on any store Hadoop has a connector for.
`read_text`/`write_text` do the few small non-Delta files (an ingest app id, the writer
lease, see `writer_lease`) through Hadoop's FileSystem API for the same reason.

Only this module and the job modules' I/O edges touch storage; transforms never do.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from audit.core.config import Config, is_uri, join_location
from audit.core.errors import InputError, LakeBusy

log = logging.getLogger("msgaudit")


def table_path(cfg: Config, name: str) -> str:
    return join_location(cfg.lake, name)


def lake_location(cfg: Config, *names: str) -> str:
    """A location under the lake (checkpoints, the writer lease)."""
    return join_location(cfg.lake, *names)


def _fs(spark: SparkSession, location: str) -> tuple[Any, Any]:
    """(Hadoop FileSystem, Hadoop Path) of a location, with the session's Hadoop settings
    (the `spark.hadoop.*` keys of the config's `spark:` section)."""
    jvm = spark.sparkContext._jvm
    assert jvm is not None  # a classic (non-Connect) session
    path = jvm.org.apache.hadoop.fs.Path(location)
    return path.getFileSystem(spark.sparkContext._jsc.hadoopConfiguration()), path


def _local_path(location: str) -> str | None:
    """The local path of a plain path or a file:// URI; None for any other filesystem."""
    if location.startswith("file://"):
        return location[len("file://"):] or None
    return None if is_uri(location) else location


def exists(spark: SparkSession, location: str) -> bool:
    fs, path = _fs(spark, location)
    return bool(fs.exists(path))


def read_text(spark: SparkSession, location: str) -> str | None:
    """A small UTF-8 file's text, or None if it does not exist."""
    fs, path = _fs(spark, location)
    if not fs.exists(path):
        return None
    jvm = spark.sparkContext._jvm
    assert jvm is not None
    stream = fs.open(path)
    try:
        data = jvm.org.apache.commons.io.IOUtils.toByteArray(stream)
    finally:
        stream.close()
    return bytes(data).decode("utf-8")


def write_text(spark: SparkSession, location: str, text: str, *, overwrite: bool = True) -> bool:
    """Write a small UTF-8 file. With overwrite=False, False when it already exists (create is
    exclusive on HDFS and local files; on object stores it is only as exclusive as the store)."""
    local = _local_path(location)
    if local is not None and not overwrite:
        # Hadoop's local create checks, then opens: not atomic. O_EXCL is.
        os.makedirs(os.path.dirname(local), exist_ok=True)
        try:
            fd = os.open(local, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        return True
    fs, path = _fs(spark, location)
    try:
        stream = fs.create(path, overwrite)
    except Exception as e:  # py4j wraps FileAlreadyExistsException
        if not overwrite and "FileAlreadyExists" in str(e):
            return False
        raise
    try:
        stream.write(bytearray(text.encode("utf-8")))
    finally:
        stream.close()
    return True


def delete(spark: SparkSession, location: str) -> None:
    fs, path = _fs(spark, location)
    fs.delete(path, True)


def table_exists(spark: SparkSession, cfg: Config, name: str) -> bool:
    from delta.tables import DeltaTable

    return bool(DeltaTable.isDeltaTable(spark, table_path(cfg, name)))


def read_table(spark: SparkSession, cfg: Config, name: str) -> DataFrame:
    """Read a Delta table of the lake; InputError naming it (and what produces it) if it is missing."""
    if not table_exists(spark, cfg, name):
        raise InputError(
            f"Delta table {name!r} not found at {table_path(cfg, name)} "
            f"(run {PRODUCED_BY.get(name, 'the step that writes it')} first)"
        )
    return spark.read.format("delta").load(table_path(cfg, name))


def scan_files(planned: DataFrame) -> dict[int, Any]:
    """The Delta scans of `planned`'s plan that read plain Parquet files (`pin_scans`), each with a
    Parquet read of the files it keeps: {scan key: that read's plan, or None when it keeps no
    file}. The plan is `planned`'s optimised one: made once, and already made (its files listed)
    when `planned` has run."""
    from pyspark.sql.types import StructType

    session = planned.sparkSession
    kept: dict[int, Any] = {}
    for leaf in scala_items(planned._jdf.queryExecution().optimizedPlan().collectLeaves()):
        location = _delta_location(leaf, "org.apache.spark.sql.delta.stats.PreparedDeltaFileIndex")
        files = None if location is None else _plain_parquet_files(location)
        if files is None:
            continue
        schema = StructType.fromJson(json.loads(leaf.schema().json()))
        kept[_leaf_key(leaf)] = (session.read.schema(schema).option("basePath", location.dataPath().toString())
                                 .parquet(*files)._jdf.queryExecution().analyzed() if files else None)
    return kept


def kept_rows(planned: DataFrame) -> int | None:
    """How many rows the files `planned`'s scans keep hold, from their Parquet footers: no Spark job,
    on the plan `planned` already made (its files listed). Its filters on data columns aside, so at
    least as many as its rows. None unless every leaf of its plan is a Delta scan of plain Parquet
    files (`pin_scans`) on the local file system."""
    import pyarrow.parquet as pq

    total = 0
    for leaf in scala_items(planned._jdf.queryExecution().optimizedPlan().collectLeaves()):
        if leaf.getClass().getSimpleName() == "LocalRelation":
            if not leaf.data().isEmpty():
                return None  # rows handed over from Python
            continue
        location = _delta_location(leaf, "org.apache.spark.sql.delta.stats.PreparedDeltaFileIndex")
        files = None if location is None else _plain_parquet_files(location)
        if files is None or not all(f.startswith("file:") for f in files):
            return None
        total += sum(pq.read_metadata(local_path(f)).num_rows for f in files)
    return total


def local_path(uri: str) -> str:
    """A `file:` URI (or a plain path) as a local path."""
    from urllib.parse import unquote, urlparse

    return unquote(urlparse(uri).path) if uri.startswith("file:") else uri


def pin_scans(df: DataFrame, kept: dict[int, Any] | None = None) -> DataFrame:
    """`df` with each Delta table it reads replaced by the Parquet files its scan keeps, at the
    snapshot that scan read: `kept` (`scan_files` of a query `df` is part of, already planned), by
    default `scan_files(df)`. Planning a query over a Delta table lists the table's files anew (a
    Spark job per scan, "Filtering files for query"), and a window's settling runs several
    queries over the same few tables; no query on the result lists them. Every query on the result
    also reads one snapshot of each table, whatever is committed meanwhile. What a later query
    filters on is still pushed down to the Parquet row groups; what it would have skipped by
    Delta's file statistics is no longer skipped by file.

    Only a table that is plain Parquet files is read so: reader version 1 (no column mapping, no
    deletion vectors), string partition columns, each file a relative path under the directories
    its partition values name. Any other Delta table keeps its Delta scan, as does anything that
    is not a Delta table (a JDBC sink)."""
    if kept is None:
        kept = scan_files(df)
    if not kept:
        return df
    session = df.sparkSession
    jvm: Any = session.sparkContext._jvm
    logical = jvm.org.apache.spark.sql.catalyst.plans.logical

    def rebuilt(node: Any) -> Any | None:
        """`node` with the kept scans under it replaced; None when there is none under it."""
        if _delta_location(node, "org.apache.spark.sql.delta.files.TahoeLogFileIndex") is not None:
            key = _leaf_key(node)
            if key not in kept:
                return None
            if kept[key] is None:  # every file pruned: no rows, the same columns
                return logical.LocalRelation(node.output(), _scala_seq(jvm, []), False, jvm.scala.Option.empty())
            files = kept[key]
            # the files' columns under the ids the plan above refers to, in the table's order
            ids = {a.name(): a.exprId() for a in scala_items(node.output())}
            output = [a.withExprId(ids[a.name()]) for a in scala_items(files.output())]
            scan = files.copy(files.relation(), _scala_seq(jvm, output), files.catalogTable(), files.isStreaming(),
                              files.stream())
            return logical.Project(node.output(), scan)
        children = scala_items(node.children())
        out = [rebuilt(c) for c in children]
        if all(c is None for c in out):
            return None
        return node.withNewChildren(_scala_seq(jvm, [c if n is None else n for c, n in zip(children, out, strict=True)]))

    plan = rebuilt(df._jdf.queryExecution().analyzed())
    if plan is None:
        return df
    return DataFrame(jvm.org.apache.spark.sql.classic.Dataset.ofRows(session._jsparkSession, plan), session)


_HIVE_NULL = "__HIVE_DEFAULT_PARTITION__"  # a null partition value's directory name


def _plain_parquet_files(location: Any) -> list[str] | None:
    """The files a prepared Delta scan keeps, as paths Spark's Parquet source reads with the
    partition values Delta gives them; None when the table is not plain Parquet (`pin_scans`)."""
    from urllib.parse import unquote

    scan = location.preparedScan()
    snapshot = scan.scannedSnapshot()
    if snapshot.protocol().minReaderVersion() > 1:
        return None
    fields = list(snapshot.metadata().partitionSchema().fields())  # a Java array
    if any(f.dataType().typeName() != "string" for f in fields):
        return None
    columns = [f.name() for f in fields]
    root = location.dataPath().toString().rstrip("/")
    paths = []
    for add in scala_items(scan.files()):
        action = json.loads(add.json())["add"]  # one round trip a file
        relative = action["path"]
        if action.get("deletionVector") or ":" in relative.split("/", 1)[0] or relative.startswith("/"):
            return None  # deleted rows, or an absolute path (a URI with a scheme, or rooted)
        relative = unquote(relative)  # Delta's paths are URI-encoded
        dirs = relative.split("/")[:-1]
        if len(dirs) != len(columns):
            return None
        values = action.get("partitionValues") or {}
        for col, segment in zip(columns, dirs, strict=True):
            name, eq, raw = segment.partition("=")
            want = values.get(col)
            if name != col or not eq or _hive_unescape(raw) != (_HIVE_NULL if want is None else want):
                return None
        paths.append(f"{root}/{relative}")
    return paths


def _hive_unescape(raw: str) -> str:
    """A partition directory's value as Spark reads it back (`%XX` escapes)."""
    return re.sub(r"%([0-9A-Fa-f]{2})", lambda m: chr(int(m.group(1), 16)), raw)


def scala_items(xs: Any) -> list[Any]:
    """A Scala sequence handed over by py4j as a Python list."""
    return [xs.apply(i) for i in range(xs.size())]


def _scala_seq(jvm: Any, items: list[Any]) -> Any:
    return jvm.scala.jdk.javaapi.CollectionConverters.asScala(items).toSeq()


def _delta_location(node: Any, kind: str) -> Any:
    """The file index of `node` when it is a scan of a Delta table whose index is of class `kind`."""
    if node.getClass().getName() != "org.apache.spark.sql.execution.datasources.LogicalRelation":
        return None
    relation = node.relation()
    # Delta's relation is an anonymous subclass of HadoopFsRelation
    fs = relation.getClass().getClassLoader().loadClass("org.apache.spark.sql.execution.datasources.HadoopFsRelation")
    if not fs.isInstance(relation):
        return None
    location = relation.location()
    return location if location.getClass().getName() == kind else None


def _leaf_key(leaf: Any) -> int:
    """A scan's identity across the analyzed and the optimised plan: its first column's id."""
    return int(leaf.output().head().exprId().id())


def partition_columns(spark: SparkSession, cfg: Config, name: str) -> tuple[str, ...] | None:
    """The partition columns of lake table `name` (None: no such table), as the table's Delta log,
    last read by this process, gives them: Delta's `DeltaLog` through the JVM runs no Spark job, where
    `DeltaTable.detail()` runs about fifteen. A table first read here is read at its latest version."""
    jvm: Any = spark.sparkContext._jvm
    delta_log = jvm.org.apache.spark.sql.delta.DeltaLog.forTable(spark._jsparkSession, table_path(cfg, name))
    snapshot = delta_log.unsafeVolatileSnapshot()
    if snapshot is None or snapshot.version() < 0:
        return None
    cols = snapshot.metadata().partitionColumns()
    return tuple(str(cols.apply(i)) for i in range(cols.size()))


def sql_string(s: str) -> str:
    """A SQL string literal."""
    return "'" + s.replace("\\", "\\\\").replace("'", "\\'") + "'"


def by_seq(df: DataFrame, partition_by: Sequence[str]) -> DataFrame:
    """`df`'s rows sorted by seq (nulls first) within each file a write of it makes (partitioned by
    `partition_by`): row groups of narrow seq ranges (docs/internals.md). A table without seq is
    written as it is."""
    if "seq" not in df.columns:
        return df
    return df.sortWithinPartitions(*partition_by, F.col("seq").asc_nulls_first())


def rewrite_by_seq(spark: SparkSession, cfg: Config, name: str, where: str) -> None:
    """Rewrite the rows of lake table `name` that match `where` (whole partitions of it) in seq order,
    nulls first, in one commit that changes no data (Delta's `dataChange=false`: a reader of the
    table's changes sees nothing new): files range partitioned by seq, each sorted, so that a row
    group holds a narrow range of seqs (docs/internals.md, "The lake's row groups")."""
    path = table_path(cfg, name)
    columns = partition_columns(spark, cfg, name) or ()
    rows = spark.read.format("delta").load(path).where(where)
    ranged = rows.repartitionByRange(spark.sparkContext.defaultParallelism, *columns, F.col("seq").asc_nulls_first())
    (by_seq(ranged, columns).write.format("delta").mode("overwrite").partitionBy(*columns)
     .option("replaceWhere", where).option("dataChange", "false").save(path))


def write_table(df: DataFrame, cfg: Config, name: str, *, mode: str = "append",
                partition_by: Sequence[str] = (), replace_where: str | None = None,
                add_columns: bool = False, new_layout: bool = False) -> None:
    """Append to / overwrite (optionally only the rows matching `replace_where`) a lake table.
    `add_columns` lets an append or a replace add columns a table written by an older version lacks;
    `new_layout` lets an overwrite of the whole table change its columns and partitioning."""
    writer = df.write.format("delta").mode(mode)
    if add_columns:
        writer = writer.option("mergeSchema", "true")
    if new_layout:
        writer = writer.option("overwriteSchema", "true")
    if partition_by:
        writer = writer.partitionBy(*partition_by)
    if replace_where is not None:
        writer = writer.option("replaceWhere", replace_where)
    writer.save(table_path(cfg, name))


PRODUCED_BY = {
    "producer_ledger": "`msgaudit ingest`",
    "ledger_quarantine": "`msgaudit ingest`",
    "consumed_records": "`msgaudit ingest`",
    "log_records": "`msgaudit capture`",
    "group_offsets": "`msgaudit capture`",
    "share_offsets": "`msgaudit capture` (topics with `share_groups`)",
    "partition_watermarks": "`msgaudit capture`",
    "mirror_records": "`msgaudit capture` (topics with `mirrors:`)",
    "mirror_watermarks": "`msgaudit capture` (topics with `mirrors:`)",
    "mirror_group_offsets": "`msgaudit capture` (mirrors with `failover_groups`)",
    "dead_letter_records": "`msgaudit capture` (sinks and share groups with `dead_letter_topic`)",
    "audit_partition_report": "`msgaudit reconcile`",
    "audit_anomalies": "`msgaudit reconcile`",
}


LEASE_NAME = "_msgaudit_writer.lease"
DEFAULT_LEASE_TTL_S = 6 * 3600.0


def lease_location(cfg: Config) -> str:
    return lake_location(cfg, LEASE_NAME)


@contextmanager
def writer_lease(spark: SparkSession, cfg: Config, what: str, *, ttl_s: float = DEFAULT_LEASE_TTL_S,
                 wait_s: float = 0.0) -> Iterator[dict[str, Any]]:
    """Hold the lake's one writer lease while the block runs (`msgaudit ingest` takes it).

    The lease is a small file in the lake, created exclusively (create without overwrite: atomic
    on local files and HDFS; on S3 a conditional put). A second writer waits up to `wait_s`, then
    gets `LakeBusy` naming the holder. A lease older than `ttl_s` belongs to a writer that died
    without releasing it and is taken over. Released (deleted) when the block ends."""
    where = lease_location(cfg)
    me = {"what": what, "host": socket.gethostname(), "pid": os.getpid(), "token": uuid.uuid4().hex,
          "acquired_at": time.time()}
    deadline = time.monotonic() + wait_s
    while not write_text(spark, where, json.dumps(me), overwrite=False):
        held = _read_lease(spark, where)
        if held is not None and time.time() - float(held.get("acquired_at", 0)) > ttl_s:
            delete(spark, where)  # a dead writer's lease
            continue
        if held is None:
            continue  # released between our create and our read
        if time.monotonic() >= deadline:
            since = datetime.fromtimestamp(float(held.get("acquired_at", 0)), UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
            raise LakeBusy(
                f"the lake {cfg.lake} is being written by {held.get('what')} on {held.get('host')} "
                f"(pid {held.get('pid')}) since {since}; one writer per lake: wait for it, or remove "
                f"{where} if that process is gone (it expires after {ttl_s / 3600:g}h)")
        time.sleep(min(1.0, max(0.05, deadline - time.monotonic())))
    try:
        yield me
    finally:
        held = _read_lease(spark, where)
        if held is not None and held.get("token") == me["token"]:
            delete(spark, where)


def _read_lease(spark: SparkSession, where: str) -> dict[str, Any] | None:
    text = read_text(spark, where)
    if text is None:
        return None
    try:
        data = json.loads(text)
    except ValueError:
        return {"what": "an unreadable lease", "acquired_at": 0}
    return data if isinstance(data, dict) else {"what": "an unreadable lease", "acquired_at": 0}


# Columns of the contract a table written by an older version (or another writer) may lack: they are
# nullable and read as null (docs/design.md §4.2, partition_watermarks).
OPTIONAL_COLUMNS: dict[str, tuple[str, ...]] = {"partition_watermarks": ("captured_from", "captured_to"),
                                                "consumed_records": ("error", "cluster", "produce_ts"), "log_records": ("key",),
                                                "producer_ledger": ("fingerprint",),
                                                "dead_letter_records": ("group", "delivery_count")}
_UNPRUNED_WARNED: set[str] = set()


def read_input_table(spark: SparkSession, cfg: Config, name: str) -> tuple[DataFrame, bool]:
    """Read an input table of the lake, checked against its contract (docs/design.md §4): every
    column of `spark_jobs.io.schemas.TABLES[name]` must be there (InputError naming the table, the
    column and what writes it, before any Spark job runs); an optional column that is absent is
    read as null. Returns (frame, partitioned): `partitioned` is False when the table has no
    `part_hour` column -- a table written by another tool is read whole (filtered by topic only),
    with a warning, instead of refused."""
    from spark_jobs.io.schemas import PART_HOUR, TABLES

    df = read_table(spark, cfg, name)
    present = set(df.columns)
    optional = OPTIONAL_COLUMNS.get(name, ())
    for field in TABLES[name].fields:
        if field.name in present:
            continue
        if field.name in optional:
            df = df.withColumn(field.name, F.lit(None).cast(field.dataType))
            continue
        raise InputError(
            f"table {name!r} at {table_path(cfg, name)} has no column {field.name!r} "
            f"({field.dataType.simpleString()}, docs/design.md §4.2); it is written by "
            f"{PRODUCED_BY.get(name, 'the step that writes it')} -- a table written by another tool must have "
            f"the contract's columns")
    partitioned = PART_HOUR in present
    if not partitioned and name in PARTITIONED_BY_HOUR:
        path = table_path(cfg, name)
        if path not in _UNPRUNED_WARNED:
            _UNPRUNED_WARNED.add(path)
            log.warning("table %r at %s has no %r column: it is read whole, without partition pruning "
                        "(every window reads all of it; see docs/design.md §4.1)", name, path, PART_HOUR)
    return df, partitioned


# The input tables partitioned by (topic, part_hour) (docs/design.md §4.1).
PARTITIONED_BY_HOUR = ("producer_ledger", "log_records", "consumed_records", "mirror_records")
