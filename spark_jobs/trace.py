"""`msgaudit trace`: one message's journey through the lake (docs/design.md §9).

A message is named by its identity (`--pid P --seq N`) or by a position in the log
(`--partition P --offset O`); a Kafka key (`--key K`) names every message whose captured log copy
carries it (`messages_by_key` turns it into one query per message, in produce order). `resolve` turns each named message into the identities and log
positions that belong to it (a position's record gives its pid:seq; an identity's copies give its
positions), and `select` keeps, in each table, the rows matching one of them: ledger rows, every
copy in the log, every processing by every group, every sink row and the anomaly rows naming it.

Both work on many messages at once, by joins against a small table of the named messages (one
key `k` per message), so the dashboard traces every anomaly row it shows in one pass over the
lake (`trace_messages`), and `msgaudit trace` is the same pass with one message
(`trace_message`). Both are pure transforms of DataFrames; `trace_messages` does the reads (lake
tables through `spark_jobs.io.lake`, sinks through `spark_jobs.io.sinks_read`). The terminal and
JSON forms are in `audit/serving/trace_view.py`.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.types import IntegerType, LongType, StringType, StructField, StructType

from audit.core.config import Config
from audit.core.errors import InputError
from spark_jobs.io.session import local_frame

# lake table -> the key of the traced rows it contributes, in timeline order
TRACE_TABLES: tuple[tuple[str, str], ...] = (
    ("producer_ledger", "ledger"), ("log_records", "log"), ("consumed_records", "consumed"),
    ("audit_anomalies", "anomalies"),
)

_IDS = StructType([StructField("k", IntegerType(), False), StructField("topic", StringType(), False),
                   StructField("pid", StringType(), False), StructField("seq", LongType(), False)])
_POSITIONS = StructType([StructField("k", IntegerType(), False), StructField("topic", StringType(), False),
                         StructField("partition", IntegerType(), False), StructField("offset", LongType(), False)])


@dataclass(frozen=True)
class TraceQuery:
    """Which message: `pid` and `seq`, or `partition` and `offset`, of `topic`; or which messages:
    those with Kafka key `key` (resolved by `messages_by_key` into queries of the first two kinds)."""

    topic: str
    pid: str | None = None
    seq: int | None = None
    partition: int | None = None
    offset: int | None = None
    key: str | None = None

    def __post_init__(self) -> None:
        by_id = self.pid is not None and self.seq is not None
        by_pos = self.partition is not None and self.offset is not None
        by_key = self.key is not None
        if by_id + by_pos + by_key != 1 or (not by_id and (self.pid is not None or self.seq is not None)) \
                or (not by_pos and (self.partition is not None or self.offset is not None)):
            raise InputError("name one message: --pid P --seq N, or --partition P --offset O, or --key K")


@dataclass(frozen=True)
class Resolved:
    """Per named message k (its index in the query list): the identities (topic, pid, seq) and
    log positions (topic, partition, offset) that belong to it."""

    ids: frozenset[tuple[int, str, str, int]]
    positions: frozenset[tuple[int, str, int, int]]

    def frames(self, spark: SparkSession) -> tuple[DataFrame, DataFrame]:
        return (F.broadcast(local_frame(spark, sorted(self.ids), _IDS)),
                F.broadcast(local_frame(spark, sorted(self.positions), _POSITIONS)))


def _matching(df: DataFrame, ids: DataFrame, positions: DataFrame) -> DataFrame:
    """The rows of `df` matching a message's identity or one of its positions, each with the
    message's key `k`; a row matching both is kept once."""
    cols = [c for c in df.columns if c != "part_hour"]
    by_id = df.join(ids, ["topic", "pid", "seq"]).select("k", *cols)
    by_pos = (df.join(positions, ["topic", "partition", "offset"])
              .join(ids.select("k", "topic", "pid", "seq"), ["k", "topic", "pid", "seq"], "left_anti")
              .select("k", *cols))
    return by_id.unionByName(by_pos)


def resolve(spark: SparkSession, queries: Sequence[TraceQuery], ledger: DataFrame | None,
            log: DataFrame | None) -> Resolved:
    """The identities and positions of each message named (identity -> positions -> identities
    of those positions, two rounds; one small collect per round)."""
    ids = {(k, q.topic, q.pid, q.seq) for k, q in enumerate(queries) if q.pid is not None and q.seq is not None}
    positions = {(k, q.topic, q.partition, q.offset) for k, q in enumerate(queries)
                 if q.partition is not None and q.offset is not None}
    tables = [t.select("topic", "pid", "seq", "partition", "offset") for t in (ledger, log) if t is not None]
    if not tables:
        return Resolved(frozenset(ids), frozenset(positions))
    for _ in range(2):
        id_df, pos_df = Resolved(frozenset(ids), frozenset(positions)).frames(spark)
        found = [_matching(t, id_df, pos_df) for t in tables]
        for row in (found[0] if len(found) == 1 else found[0].unionByName(found[1])).distinct().collect():
            if row["pid"] is not None and row["seq"] is not None:
                ids.add((row["k"], row["topic"], row["pid"], int(row["seq"])))
            if row["offset"] is not None:
                positions.add((row["k"], row["topic"], int(row["partition"]), int(row["offset"])))
    return Resolved(frozenset(ids), frozenset(positions))


def _order(row: dict[str, Any]) -> tuple[str, ...]:
    return tuple("" if v is None else str(v) for v in row.values())


def select(df: DataFrame, ids: DataFrame, positions: DataFrame) -> dict[int, list[dict[str, Any]]]:
    """Per message key k: the rows of `df` that belong to it, without `part_hour`, in a stable order."""
    out: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for row in _matching(df, ids, positions).collect():
        d = row.asDict()
        out[d.pop("k")].append(d)
    for rows in out.values():
        rows.sort(key=_order)
    return out


def trace_messages(spark: SparkSession, cfg: Config, queries: Sequence[TraceQuery]) -> list[dict[str, Any]]:
    """Read the lake and the sinks of the queried topics once; per query (same order) the traced
    rows by kind (ledger, log, consumed -- a share group's dead-letter records among them, as the
    group's `dead_lettered` rows --, sinks {name: rows}, anomalies), the `settings` its
    producer sessions recorded at start (`producer_settings`), plus `missing` (lake tables not
    written yet). A topic the config does not name is traced without sinks (the CLI checks the
    name first)."""
    from spark_jobs.io.lake import read_table, table_exists
    from spark_jobs.io.sinks_read import read_sink, share_dead_letter_rows

    if any(q.key is not None for q in queries):
        raise ValueError("a query by key names messages: resolve it with messages_by_key first")
    topics = sorted({q.topic for q in queries})
    sinks = {t: cfg.topics[t].sinks if t in cfg.topics else () for t in topics}
    frames = {name: read_table(spark, cfg, name) if table_exists(spark, cfg, name) else None
              for name, _ in TRACE_TABLES}
    r = resolve(spark, queries, frames["producer_ledger"], frames["log_records"])
    id_df, pos_df = r.frames(spark)
    rows: dict[str, dict[int, list[dict[str, Any]]]] = {}
    for name, key in TRACE_TABLES:
        df = frames[name]
        rows[key] = {} if df is None else select(df, id_df, pos_df)
    # a sink's dead-letter records (dead_letter true) show beside its rows once capture has read them
    dlq = read_table(spark, cfg, "dead_letter_records") if table_exists(spark, cfg, "dead_letter_records") else None
    sink_rows = {(t, s.name): select(read_sink(spark, s if dlq is not None and frames["log_records"] is not None
                                               else replace(s, dead_letter_topic=None), t, frames["log_records"], dlq),
                                     id_df, pos_df)
                 for t in topics for s in sinks[t] if s.identity != "coordinates" or frames["log_records"] is not None}
    # a share group's dead-letter records show as the group's `dead_lettered` rows, as reconcile reads them
    share_dlq = {t: [g for g in cfg.topics[t].share_groups if g.dead_letter_topic] if t in cfg.topics else []
                 for t in topics}
    dead = {t: select(share_dead_letter_rows(dlq, share_dlq[t], frames["log_records"]), id_df, pos_df)
            for t in topics if share_dlq[t] and dlq is not None and frames["log_records"] is not None}
    # the settings each producer session recorded at start (a table of pids, not of messages)
    settings: dict[str, list[dict[str, Any]]] = defaultdict(list)
    pids = sorted({pid for _, _, pid, _ in r.ids})
    if pids and table_exists(spark, cfg, "producer_settings"):
        for row in read_table(spark, cfg, "producer_settings").where(F.col("pid").isin(pids)).drop("part_hour").collect():
            settings[row["pid"]].append(row.asDict())
    missing = [n for n, df in frames.items() if df is None]
    out = []
    for k, q in enumerate(queries):
        trace: dict[str, Any] = {
            "topic": q.topic, "ids": sorted((p, s) for kk, _, p, s in r.ids if kk == k),
            "positions": sorted((p, o) for kk, _, p, o in r.positions if kk == k), "missing": missing}
        for _, key in TRACE_TABLES:
            trace[key] = rows[key].get(k, [])
        if q.topic in dead:
            trace["consumed"] = sorted(trace["consumed"] + dead[q.topic].get(k, []), key=_order)
        trace["sinks"] = {s.name: sink_rows[(q.topic, s.name)].get(k, []) for s in sinks[q.topic]}
        trace["settings"] = sorted((x for _, pid in trace["ids"] for x in settings.get(pid, [])), key=_order)
        out.append(trace)
    return out


def trace_message(spark: SparkSession, cfg: Config, q: TraceQuery) -> dict[str, Any]:
    """One message's trace (see `trace_messages`)."""
    return trace_messages(spark, cfg, [q])[0]


def messages_by_key(spark: SparkSession, cfg: Config, topic: str, key: str) -> list[TraceQuery]:
    """The messages of `topic` whose captured log copies carry Kafka key `key`, one query each, in
    produce order (produce time, else Kafka time; then partition, offset): a message with an
    audit identity once however many copies the log holds (by pid and seq), a record without one
    by its position. Only `log_records` records keys: a message the log never held (lost, never
    written) or not captured yet is not found. InputError when `log_records` is missing or has no
    `key` column (captured before keys were recorded: capture the windows again)."""
    from spark_jobs.io.lake import read_table, table_exists, table_path

    if not table_exists(spark, cfg, "log_records"):
        raise InputError(f"no log_records table under {cfg.lake}: run `msgaudit capture` first "
                         "(keys are read from the captured log)")
    log = read_table(spark, cfg, "log_records")
    if "key" not in log.columns:
        raise InputError(f"table 'log_records' at {table_path(cfg, 'log_records')} has no 'key' column (captured "
                         "before msgaudit recorded keys): run `msgaudit capture` again for the windows to search")
    rows = (log.where((F.col("topic") == topic) & (F.col("key") == key))
            .select("partition", "offset", "pid", "seq", F.coalesce("produce_ts", "kafka_ts").alias("t"))
            .collect())
    far = datetime.max
    first: dict[tuple[Any, ...], tuple[Any, ...]] = {}  # message -> its earliest copy's sort key
    for r in rows:
        t = r["t"].replace(tzinfo=None) if r["t"] is not None else far
        msg: tuple[Any, ...] = (("id", r["pid"], int(r["seq"])) if r["pid"] is not None and r["seq"] is not None
                                else ("pos", int(r["partition"]), int(r["offset"])))
        order = (t, int(r["partition"]), int(r["offset"]))
        if msg not in first or order < first[msg]:
            first[msg] = order
    out = []
    for msg, _ in sorted(first.items(), key=lambda m: m[1]):
        out.append(TraceQuery(topic, pid=msg[1], seq=msg[2]) if msg[0] == "id"
                   else TraceQuery(topic, partition=msg[1], offset=msg[2]))
    return out


def trace_key(spark: SparkSession, cfg: Config, topic: str, key: str, limit: int) -> dict[str, Any]:
    """`msgaudit trace --key`: the messages key `key` names (`messages_by_key`) and the traces of
    the first `limit` of them, in produce order: {topic, key, messages (every one's name, in
    order: "pid:seq", or "partition@offset" for a record without audit id), traces}."""
    queries = messages_by_key(spark, cfg, topic, key)
    names = [f"{q.pid}:{q.seq}" if q.pid is not None else f"{q.partition}@{q.offset}" for q in queries]
    shown = queries[:limit]
    return {"topic": topic, "key": key, "messages": names,
            "traces": trace_messages(spark, cfg, shown) if shown else []}


def lake_has_tables(cfg: Config, names: Sequence[str] = ("producer_ledger", "log_records")) -> bool:
    """Whether the lake holds one of these tables, checked without a JVM (a lake on another
    filesystem than the local one, s3a:// or hdfs://, is assumed to)."""
    from pathlib import Path

    lake = str(cfg.lake)
    if "://" in lake and not lake.startswith("file://"):
        return True
    root = Path(lake[len("file://"):] if lake.startswith("file://") else lake)
    return any((root / name / "_delta_log").is_dir() for name in names)


def producer_sessions(spark: SparkSession, cfg: Config, since: datetime
                      ) -> tuple[list[dict[str, Any]], dict[str, list[str]]]:
    """The `producer_settings` rows of producer sessions started since `since`, and per pid the
    topics its ledger rows name (for `msgaudit doctor`)."""
    from spark_jobs.io.lake import read_table, table_exists

    if not table_exists(spark, cfg, "producer_settings"):
        return [], {}
    rows = [r.asDict() for r in read_table(spark, cfg, "producer_settings").where(F.col("start_ts") >= since)
            .drop("part_hour").collect()]
    topics_of: dict[str, list[str]] = defaultdict(list)
    pids = sorted({r["pid"] for r in rows})
    if pids and table_exists(spark, cfg, "producer_ledger"):
        for r in (read_table(spark, cfg, "producer_ledger").where(F.col("pid").isin(pids))
                  .select("pid", "topic").distinct().collect()):
            topics_of[r["pid"]].append(r["topic"])
    return rows, {p: sorted(t) for p, t in topics_of.items()}


def mirror_consumption(spark: SparkSession, cfg: Config, since: datetime) -> dict[tuple[str, str, str], int]:
    """(topic, group, cluster) -> consumption rows read on a mirror (`cluster` set) since `since`, from
    the lake's `consumed_records` (for `msgaudit doctor`: rows of a group that does not fail over
    to that mirror are left out of the reconcile, docs/design.md §5.5). One small aggregation; the
    part_hour bound prunes older partitions."""
    from spark_jobs.io.lake import read_table, table_exists

    if not table_exists(spark, cfg, "consumed_records"):
        return {}
    rows = (read_table(spark, cfg, "consumed_records")
            .where((F.col("part_hour") >= since.strftime("%Y-%m-%dT%H")) & (F.col("consume_ts") >= since)
                   & F.col("cluster").isNotNull())
            .groupBy("topic", "group", "cluster").count().collect())
    return {(r["topic"], r["group"], r["cluster"]): int(r["count"]) for r in rows}


def lake_tracer(cfg: Config, spark: SparkSession | None = None) -> Callable[[Sequence[Any]], list[dict[str, Any]]]:
    """A dashboard tracer (`audit.serving.dashboard.Tracer`): the traces of the given messages
    (anything with topic, pid, seq, partition, offset) in one `trace_messages` pass. The Spark
    session is started on the first call only, so a dashboard without anomaly rows needs no JVM."""
    def tracer(refs: Sequence[Any]) -> list[dict[str, Any]]:
        nonlocal spark
        if spark is None:
            from spark_jobs.io.session import build_spark

            spark = build_spark(cfg, app_name="msgaudit-dashboard")
        queries = [TraceQuery(r.topic, r.pid, r.seq, r.partition, r.offset) for r in refs]
        return trace_messages(spark, cfg, queries)
    return tracer
