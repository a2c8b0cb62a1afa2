"""Log capture (docs/design.md §2, §4): what the Kafka log holds for a window range -> Delta.

For every configured topic, `capture` plans an offset range per partition in the driver
(confluent_kafka AdminClient: describe_topics, list_offsets), batch-reads those ranges twice with
Spark's Kafka source (read_uncommitted for every record, read_committed to tell which records
belong to aborted transactions), parses the audit headers with Spark expressions that mirror
`audit.core.headers.parse` rule for rule, computes the content fingerprint and MERGEs the rows into
`log_records` keyed on (topic, partition, offset), so a rerun changes nothing. Up to BATCH_TOPICS
topics share each read and the MERGE (one Delta commit), so many small topics cost about what one
does; their mirrors' copies (docs/design.md §5.5) are read the same way, the copies on one target
cluster together, into `mirror_records` (`capture_mirrors`, `Landing`). It also appends snapshots
of the configured groups' committed offsets (`group_offsets`) and of every partition's watermarks
(`partition_watermarks`, with the offset range this capture read: `captured_from`/`captured_to`,
which is what reconcile takes as "covered by a capture"), and of the configured share groups'
share-partition start offsets (`share_offsets`, read by `audit.runtime.share_admin`: one Java
subprocess per batch of topics, as no Python client has share group admin calls).

Offset planning (`plan_partition`):
* The time range read is [first window start - lookback - SKEW, last window end + grace + SKEW)
  by *Kafka* timestamp. Window membership is decided later by produce time (audit.ts), and a
  producer's CreateTime or a topic's LogAppendTime can differ from audit.ts (clock skew,
  retries, broker-side append time), so SKEW (5 minutes) widens the range on both sides.
  Reading more than the window is harmless: rows are keyed by offset and MERGEd.
* Offsets come from ListOffsets-for-timestamp (first offset whose timestamp >= t; none -> the
  high watermark) and are clamped to [log_start_offset, high_watermark].
* Both passes end at min(planned end, last stable offset). Records at or past the LSO belong to,
  or follow, a transaction that is still open: their fate (committed or aborted) is not decided
  yet, a read_committed read of them would block until the transaction ends, and marking them
  either way would be a guess. They are left for a later capture (the next window's capture
  re-reads them through its lookback) and counted as `deferred` in the result. So for every row
  in `log_records`, `committed` is final: false means the record's transaction was aborted.

Kafka client settings: the driver uses cfg.kafka as is (librdkafka names). Spark's Kafka source is
the Java client, so `java_kafka_options` maps the settings it needs (see its docstring); a
security setting it cannot map is a ConfigError, never silently dropped.

This module must not decide anomalies (reconcile does), write any table other than the ones
above (and the mirrors' `mirror_watermarks`, `mirror_group_offsets`), or commit offsets for any
consumer group (Spark's Kafka source never commits).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from functools import reduce
from typing import Any

from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F

from audit.core import headers as H
from audit.core.config import Config, MirrorConfig, TopicConfig
from audit.core.errors import BrokerError, InputError
from audit.core.kafka_conf import access_line, authentication_line, denied_line, java_client_settings
from audit.core.windows import to_millis, windows
from spark_jobs.io.schemas import (
    DEAD_LETTER_RECORDS,
    GROUP_OFFSETS,
    LOG_RECORDS,
    MIRROR_GROUP_OFFSETS,
    MIRROR_RECORDS,
    MIRROR_WATERMARKS,
    PART_HOUR,
    PART_HOUR_FORMAT,
    PARTITION_WATERMARKS,
    SHARE_OFFSETS,
)
from spark_jobs.io.session import local_frame

# How far Kafka timestamps may sit from audit.ts (see module docstring).
SKEW = timedelta(minutes=5)
ADMIN_TIMEOUT_S = 30.0
LOG_TABLE = "log_records"
GROUP_OFFSETS_TABLE = "group_offsets"
WATERMARKS_TABLE = "partition_watermarks"
SHARE_OFFSETS_TABLE = "share_offsets"
LOG_PARTITION_COLUMNS = ("topic", PART_HOUR)
DATA_COLUMNS = tuple(f.name for f in LOG_RECORDS.fields if f.name != "captured_at")
# Topics read from Kafka and MERGEd into log_records together: one read per isolation level and one
# Delta commit per batch, not per topic, so a capture's fixed cost does not grow with its topics
# (docs/benchmarks.md). The cap keeps the MERGE's literal range condition (every partition's offset
# bounds) of a bounded size.
BATCH_TOPICS = 50
# How long the broker may hold a fetch of Spark's Kafka source for data to arrive. The Java client's
# default (500 ms) held every partition's task of a bounded read about that long, although the
# range it reads is already in the log: 20 partitions of 500 records took 5.7 s to read, 0.85 s
# with 10 ms (docs/benchmarks.md).
FETCH_MAX_WAIT_MS = 10



# --------------------------------------------------------------------------------------------
# Results


@dataclass(frozen=True)
class PartitionRange:
    """The planned read of one partition: offsets [start, end) in both passes."""

    partition: int
    start: int
    end: int
    log_start_offset: int
    high_watermark: int
    last_stable_offset: int
    time_end: int  # where the time range ended before the LSO cut; end..time_end is deferred

    @property
    def offsets(self) -> int:
        return self.end - self.start

    @property
    def deferred(self) -> int:
        return self.time_end - self.end


@dataclass(frozen=True)
class TopicCapture:
    topic: str
    partitions: int
    offsets_read: int  # sum of planned range sizes (control markers take offsets too)
    records: int  # data records captured (both committed and aborted)
    aborted: int  # records of aborted transactions (committed = false)
    header_errors: int  # records whose audit headers are missing or malformed
    written: int  # rows inserted or updated in log_records (0 on a rerun over the same log)
    deferred: int  # offsets past the last stable offset, left for a later capture
    groups: int  # group offset rows snapshotted
    ranges: tuple[PartitionRange, ...] = ()


@dataclass(frozen=True)
class MirrorCapture:
    """One source topic's copy on a mirror's target cluster (stage mirror:<m>, §5.5), as captured."""

    topic: str  # the source topic
    mirror: str
    target_topic: str
    bootstrap: str
    captured: TopicCapture

    def line(self) -> str:
        r = self.captured
        return (f"{self.topic} mirror {self.mirror} ({self.target_topic} at {self.bootstrap}): {r.records} records "
                f"({r.written} new or changed), {r.aborted} aborted, {r.header_errors} header errors, "
                f"{r.offsets_read} offsets")


@dataclass(frozen=True)
class DeadLetterCapture:
    """A dead-letter topic (a sink connector's or a share group's), as captured into `dead_letter_records`."""

    topic: str  # the DLQ topic
    users: tuple[str, ...]  # who names it: `sink <name>`, `share group <name>`
    records: int  # records it holds
    unplaced: int  # records without the topic/partition/offset headers of either kind

    def line(self) -> str:
        text = f"dead-letter topic {self.topic} ({', '.join(self.users)}): {self.records} records"
        if self.unplaced:
            fix = ("counted as quarantined: set errors.deadletterqueue.context.headers.enable=true on the connector"
                   if any(u.startswith("sink ") for u in self.users)
                   else "not used: a share group's broker always writes them, so another writer shares the topic")
            text += (f", {self.unplaced} without __connect.errors.* or __dlq.errors.* topic/partition/offset "
                     f"headers ({fix})")
        return text


@dataclass(frozen=True)
class CaptureResult:
    captured_at: datetime
    start: datetime
    end: datetime
    topics: Mapping[str, TopicCapture] = field(default_factory=dict)
    mirrors: tuple[MirrorCapture, ...] = ()  # in the configuration's order
    dead_letters: tuple[DeadLetterCapture, ...] = ()  # the sinks' dead-letter topics
    notes: tuple[str, ...] = ()  # what could not be snapshotted (share groups' start offsets), one line each

    def summary(self) -> str:
        """What `msgaudit capture` prints: the range, a total over the topics when there are several,
        then a line per topic followed by its mirrors' copies (`capture` itself prints nothing)."""
        lines = [f"captured {self.start.isoformat()} .. {self.end.isoformat()} at {self.captured_at.isoformat()}"]
        ts = list(self.topics.values())
        if len(ts) > 1:
            lines[0] += (f": {len(ts)} topics, {sum(t.records for t in ts)} records, "
                         f"{sum(t.written for t in ts)} new or changed, {sum(t.aborted for t in ts)} aborted, "
                         f"{sum(t.header_errors for t in ts)} header errors, {sum(t.deferred for t in ts)} deferred")
        copies: dict[str, list[MirrorCapture]] = {}
        for m in self.mirrors:
            copies.setdefault(m.topic, []).append(m)
        for t in ts:
            lines.append(
                f"  {t.topic}: {t.records} records in {t.offsets_read} offsets over {t.partitions} partitions, "
                f"{t.written} new or changed, {t.aborted} aborted, {t.header_errors} header errors, "
                f"{t.deferred} deferred (open transaction)"
            )
            lines.extend(f"    {m.line()}" for m in copies.get(t.topic, ()))
        lines.extend(f"  {d.line()}" for d in self.dead_letters)
        lines.extend(f"  {n}" for n in self.notes)
        return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# Pure planning


def time_range(tc: TopicConfig, start: datetime, end: datetime) -> tuple[datetime, datetime]:
    """Kafka-timestamp range to read for the windows of [start, end): lookback, grace and SKEW added."""
    ws = list(windows(start, end, tc.window))
    return ws[0][0] - tc.lookback_or_window - SKEW, ws[-1][1] + tc.grace + SKEW


def plan_partition(partition: int, log_start: int, high: int, lso: int,
                   offset_at_from: int, offset_at_to: int) -> PartitionRange:
    """Offsets to read for one partition.

    `offset_at_from` / `offset_at_to` are ListOffsets-for-timestamp answers (first offset whose
    timestamp >= t, or -1 when there is none, meaning "past the end").
    """
    def at(offset: int) -> int:
        return high if offset < 0 else offset

    start = min(max(at(offset_at_from), log_start), high)
    time_end = min(max(at(offset_at_to), start), high)
    end = max(start, min(time_end, lso))
    return PartitionRange(partition, start, end, log_start, high, lso, time_end)


def offsets_json(ranges: Mapping[str, Iterable[PartitionRange]], which: str) -> str:
    """Spark's startingOffsets / endingOffsets JSON for every topic's ranges ('start' or 'end')."""
    return json.dumps({topic: {str(r.partition): getattr(r, which) for r in rs} for topic, rs in ranges.items()})


def java_kafka_options(kafka: Mapping[str, str]) -> dict[str, str]:
    """cfg.kafka (librdkafka names) -> Spark Kafka source options (`kafka.` + the Java client's names,
    as audit.core.kafka_conf.java_client_settings maps them)."""
    return {f"kafka.{k}": v for k, v in java_client_settings(kafka, "Spark's Kafka source").items()}


# --------------------------------------------------------------------------------------------
# Transforms: Kafka source rows -> log_records rows (no I/O)

_NON_PRINTABLE = r"(?s)\A[\p{C}\p{Z}&&[^ ]]\z"  # str.isprintable() is False for C* and Z* but ' '
_DIGITS = r"\A[0-9]+\z"


def py_repr(text: Column, max_chars: int = 40) -> Column:
    """Spark mirror of `audit.core.headers._quote`: repr() of the text, cut to `max_chars` + '...'.

    Python's rule for repr(str): quote with " only when the text holds ' and no ", else with ';
    escape the quote and backslash, \\t \\n \\r, and every non-printable character as \\xhh,
    \\uhhhh or \\Uhhhhhhhh. "Printable" comes from the JVM's Unicode tables, which can lag
    Python's by a version for characters assigned in the newest Unicode release.
    """
    cut = F.when(F.char_length(text) <= max_chars, text).otherwise(
        F.concat(F.substring(text, 1, max_chars), F.lit("...")))
    quote = F.when(F.contains(cut, F.lit("'")) & ~F.contains(cut, F.lit('"')), F.lit('"')).otherwise(F.lit("'"))

    def hex_escape(cp: Column) -> Column:
        h = F.lower(F.hex(cp))
        return (F.when(cp < 0x100, F.concat(F.lit("\\x"), F.lpad(h, 2, "0")))
                .when(cp < 0x10000, F.concat(F.lit("\\u"), F.lpad(h, 4, "0")))
                .otherwise(F.concat(F.lit("\\U"), F.lpad(h, 8, "0"))))

    def escape(c: Column) -> Column:
        return (F.when((c == quote) | (c == F.lit("\\")), F.concat(F.lit("\\"), c))
                .when(c == F.lit("\t"), F.lit("\\t"))
                .when(c == F.lit("\n"), F.lit("\\n"))
                .when(c == F.lit("\r"), F.lit("\\r"))
                .when(c.rlike(_NON_PRINTABLE), hex_escape(F.ascii(c)))
                .otherwise(c))

    chars = F.regexp_extract_all(cut, F.lit("(?s)."), F.lit(0))  # one element per code point
    return F.concat(quote, F.array_join(F.transform(chars, escape), ""), quote)


def _first(*options: tuple[Column, Column | str]) -> Column:
    """CASE WHEN c1 THEN v1 WHEN c2 THEN v2 ... END (null when nothing matches)."""
    expr: Any = F
    for cond, value in options:
        expr = expr.when(cond, value if isinstance(value, Column) else F.lit(value))
    return expr


def _key_is(name: str) -> Any:
    # A one-argument function: F.filter reads a second parameter as the element index.
    return lambda h: h["key"] == F.lit(name)


def with_audit_headers(df: DataFrame, headers_col: str = "headers") -> DataFrame:
    """Add pid, seq, ts_ms, audit_key, header_error: `audit.core.headers.parse` as Spark expressions.

    The Python module is the definition; this mirrors its rules and their order exactly
    (tests compare the two on generated headers). `headers_col` is Spark's Kafka source column,
    array<struct<key: string, value: binary>>. Three selects keep the plan small: each field's
    text is computed once, then each field's error, then the first error.
    """
    hs = F.col(headers_col)
    tmp = {n: f"_audit_{n.split('.')[1]}" for n in H.AUDIT_HEADERS}  # _audit_pid, ...

    # 1. Per audit header: how often it occurs, its text if usable, and the rule 2/3 error.
    step1: list[Column] = []
    for name, col in tmp.items():
        matches = F.filter(hs, _key_is(name))
        n_ = F.coalesce(F.size(matches), F.lit(0))
        raw = F.when(n_ == 1, matches.getItem(0)["value"])
        as_text = raw.cast("string")
        valid = F.coalesce(F.is_valid_utf8(as_text), F.lit(False))
        step1 += [
            n_.alias(f"{col}_n"),
            F.when((n_ == 1) & valid, as_text).alias(f"{col}_text"),
            F.when(n_ > 1, F.lit(f"duplicate audit header: {name}")).alias(f"{col}_dup"),
            _first(((n_ == 1) & raw.isNull(), f"{name} has no value"),
                   ((n_ == 1) & ~valid, f"{name} is not UTF-8")).alias(f"{col}_bad"),
        ]
    staged = df.select("*", *step1)

    def c(name: str, part: str) -> Column:
        return F.col(f"{tmp[name]}_{part}")

    def broken_own(name: str) -> Column:
        return c(name, "dup").isNotNull() | c(name, "bad").isNotNull()

    # 1a. Rule 3a: with `audit.id` present, pid/seq/ts are its parts (split at the last two '/')
    # when it is alone and well formed, else broken; without it, the three headers' own texts.
    packed = c(H.ID, "text")
    id_any = c(H.ID, "n") > 0
    others = [(c(n, "n") > 0, n) for n in (H.PID, H.SEQ, H.TS)]
    form_ok = packed.rlike(r"(?s)\A.*/[^/]*/[^/]*\z")
    parts_broken = id_any & (broken_own(H.ID) | others[0][0] | others[1][0] | others[2][0] | ~form_ok)
    parts = {H.PID: F.regexp_extract(packed, r"(?s)\A(.*)/([^/]*)/([^/]*)\z", 1),
             H.SEQ: F.regexp_extract(packed, r"(?s)\A(.*)/([^/]*)/([^/]*)\z", 2),
             H.TS: F.regexp_extract(packed, r"(?s)\A(.*)/([^/]*)/([^/]*)\z", 3)}
    step1a: list[Column] = [
        _first(*[(packed.isNotNull() & cond, f"{H.ID} together with {n}") for cond, n in others],
               (packed.isNotNull() & ~form_ok,
                F.concat(F.lit(f"{H.ID} is not <pid>/<seq>/<ts>: "), py_repr(packed)))).alias(f"{tmp[H.ID]}_err"),
    ]
    for name in (H.PID, H.SEQ, H.TS):
        step1a += [
            F.when(id_any, F.when(~parts_broken, parts[name])).otherwise(c(name, "text")).alias(f"{tmp[name]}_eff"),
            F.when(id_any, parts_broken).otherwise(broken_own(name)).alias(f"{tmp[name]}_broken"),
        ]
    staged = staged.select("*", *step1a)

    def broken(name: str) -> Column:
        return c(name, "broken") if name in (H.PID, H.SEQ, H.TS) else broken_own(name)

    # 2. Field rules (4-7); a field broken by rule 2, 3 or 3a gets no further error.
    pid = c(H.PID, "eff")
    step2: list[Column] = [
        _first((broken(H.PID), F.lit(None).cast("string")),
               (pid.isNull(), f"missing {H.PID}"),
               (pid == "", f"{H.PID} is empty"),
               (F.char_length(pid) > H.MAX_PID_CHARS, f"{H.PID} longer than {H.MAX_PID_CHARS} chars"),
               ).alias(f"{tmp[H.PID]}_err"),
        F.when(c(H.KEY, "text") == "", F.lit(f"{H.KEY} is empty")).alias(f"{tmp[H.KEY]}_err"),
    ]
    for name in (H.SEQ, H.TS):
        t = c(name, "eff")
        value = t.try_cast("long")
        if name == H.TS:
            value = F.when(value <= H.MAX_TS_MS, value)
        step2 += [
            value.alias(f"{tmp[name]}_value"),
            _first((broken(name), F.lit(None).cast("string")),
                   (t.isNull(), f"missing {name}"),
                   (~t.rlike(_DIGITS) | value.isNull(),
                    F.concat(F.lit(f"{name} "),
                             F.when(~t.rlike(_DIGITS), F.lit("not an integer: ")).otherwise(F.lit("out of range: ")),
                             py_repr(t))),
                   ).alias(f"{tmp[name]}_err"),
        ]
    staged = staged.select("*", *step2)

    # 3. errors[0] of parse: duplicates first, then missing values / bad UTF-8, then field rules.
    any_present = F.greatest(*[c(n, "n") for n in H.AUDIT_HEADERS]) > 0
    error = F.coalesce(
        *[c(n, "dup") for n in H.AUDIT_HEADERS],
        *[c(n, "bad") for n in H.AUDIT_HEADERS],
        c(H.ID, "err"),
        *[c(n, "err") for n in H.AUDIT_HEADERS if n != H.ID],
    )
    ok = {n: any_present & c(n, "err").isNull() & ~broken(n) for n in H.AUDIT_HEADERS}
    out = staged.select(
        *[F.col(f"`{f}`") for f in df.columns],
        F.when(ok[H.PID], c(H.PID, "eff")).alias("pid"),
        F.when(ok[H.SEQ], c(H.SEQ, "value")).alias("seq"),
        F.when(ok[H.TS], c(H.TS, "value")).alias("ts_ms"),
        F.when(ok[H.KEY], c(H.KEY, "text")).alias("audit_key"),
        F.when(any_present, error).otherwise(F.lit("no audit headers")).alias("header_error"),
    )
    return out


def fingerprint(audit_key: Column, key: Column, value: Column) -> Column:
    """docs/design.md §3: audit.key when present, else SHA-256 hex of (key bytes, 0x00, value bytes)."""
    empty = F.lit(b"").cast("binary")
    raw = F.concat(F.coalesce(key, empty), F.lit(b"\x00").cast("binary"), F.coalesce(value, empty))
    return F.coalesce(audit_key, F.sha2(raw, 256))


def utc_hour(ts: Column, session_tz: str) -> Column:
    """'YYYY-MM-DDTHH' of an instant in UTC, whatever the session time zone is."""
    wall_utc = F.convert_timezone(F.lit(session_tz), F.lit("UTC"), ts.cast("timestamp_ntz"))
    return F.date_format(wall_utc, PART_HOUR_FORMAT)


def to_log_records(kafka_rows: DataFrame, committed_offsets: DataFrame, captured_at: datetime,
                   session_tz: str = "UTC") -> DataFrame:
    """Kafka source rows (read_uncommitted) + the offsets a read_committed pass saw -> log_records.

    `committed_offsets` has (topic, partition, offset) of the same range read with read_committed;
    a record missing from it belongs to an aborted transaction.
    """
    seen = committed_offsets.select("topic", "partition", "offset").distinct().withColumn("_c", F.lit(True))
    parsed = with_audit_headers(kafka_rows).join(seen, ["topic", "partition", "offset"], "left")
    produce_ts = F.timestamp_millis(F.col("ts_ms"))  # parse rejects audit.ts beyond year 9999
    return parsed.select(
        F.col("topic"),
        F.col("partition").cast("int").alias("partition"),
        F.col("offset").cast("long").alias("offset"),
        F.col("timestamp").alias("kafka_ts"),
        F.col("pid"),
        F.col("seq"),
        produce_ts.alias("produce_ts"),
        fingerprint(F.col("audit_key"), F.col("key"), F.col("value")).alias("fingerprint"),
        F.coalesce(F.col("_c"), F.lit(False)).alias("committed"),
        F.col("header_error"),
        F.lit(captured_at).cast("timestamp").alias("captured_at"),
        F.col("key").cast("string").alias("key"),
        utc_hour(F.coalesce(produce_ts, F.col("timestamp")), session_tz).alias(PART_HOUR),
    )


# --------------------------------------------------------------------------------------------
# Broker edge (driver side, confluent_kafka)


def _bootstrap(cfg: Config) -> str:
    return cfg.kafka.get("bootstrap.servers", "?")


def _admin(cfg: Config) -> Any:
    from confluent_kafka.admin import AdminClient

    from audit.core.kafka_conf import internal_client_conf

    return AdminClient(internal_client_conf(cfg.kafka))


def _result(future: Any, cfg: Config, what: str, topic: str = "") -> Any:
    from confluent_kafka import KafkaError, KafkaException

    try:
        return future.result(timeout=ADMIN_TIMEOUT_S)
    except KafkaException as e:
        err = e.args[0] if e.args else None
        if isinstance(err, KafkaError) and err.code() == KafkaError.UNKNOWN_TOPIC_OR_PART:
            raise InputError(f"{what}: topic does not exist on the Kafka cluster at {_bootstrap(cfg)} "
                             f"(create it, or remove it from {cfg.source})") from None
        line = access_line(cfg.kafka, err.name(), {"topic": "DESCRIBE"}, {"topic": topic}) \
            if isinstance(err, KafkaError) else None
        if line:
            raise BrokerError(f"{what}: {line}") from None
        raise BrokerError(f"{what}: Kafka at {_bootstrap(cfg)} answered: {err}") from None
    except TimeoutError:
        raise BrokerError(f"{what}: no answer from Kafka at {_bootstrap(cfg)} within "
                          f"{ADMIN_TIMEOUT_S:.0f}s (is the broker up? `msgaudit kafka status`)") from None


def _partitions(admin: Any, cfg: Config, topic: str) -> list[int]:
    from confluent_kafka import TopicCollection

    futures = admin.describe_topics(TopicCollection([topic]), request_timeout=ADMIN_TIMEOUT_S)
    desc = _result(futures[topic], cfg, f"topic {topic!r}", topic)
    return sorted(p.id for p in desc.partitions)


def _list_offsets(admin: Any, cfg: Config, topic: str, partitions: Sequence[int], spec: Any,
                  committed: bool = False) -> dict[int, int]:
    from confluent_kafka import IsolationLevel, TopicPartition

    level = IsolationLevel.READ_COMMITTED if committed else IsolationLevel.READ_UNCOMMITTED
    futures = admin.list_offsets({TopicPartition(topic, p): spec for p in partitions},
                                 isolation_level=level, request_timeout=ADMIN_TIMEOUT_S)
    return {tp.partition: _result(f, cfg, f"topic {topic!r} offsets", topic).offset for tp, f in futures.items()}


def plan_topic(admin: Any, cfg: Config, topic: str, partitions: Sequence[int],
               start: datetime, end: datetime) -> list[PartitionRange]:
    """Ask the broker for watermarks, LSOs and offsets-for-times; plan every partition's read."""
    from confluent_kafka.admin import OffsetSpec

    tc = cfg.topic(topic)
    t_from, t_to = time_range(tc, start, end)
    low = _list_offsets(admin, cfg, topic, partitions, OffsetSpec.earliest())
    high = _list_offsets(admin, cfg, topic, partitions, OffsetSpec.latest())
    lso = _list_offsets(admin, cfg, topic, partitions, OffsetSpec.latest(), committed=True)
    at_from = _list_offsets(admin, cfg, topic, partitions, OffsetSpec.for_timestamp(to_millis(t_from)))
    at_to = _list_offsets(admin, cfg, topic, partitions, OffsetSpec.for_timestamp(to_millis(t_to)))
    return [plan_partition(p, low[p], high[p], lso[p], at_from[p], at_to[p]) for p in partitions]


def group_offsets(cfg: Config, topic: str, partitions: Sequence[int]) -> list[tuple[str, int, int | None]]:
    """(group, partition, committed offset or None) for every group configured on the topic.

    Read with a consumer's OffsetFetch (`committed`), not the AdminClient's
    `list_consumer_group_offsets`: in confluent-kafka 2.16 the latter crashed the process
    (SIGSEGV) now and then when the coordinator answered "load in progress".
    """
    from confluent_kafka import KafkaException

    from audit.clients.doctor import committed_offsets

    rows: list[tuple[str, int, int | None]] = []
    for group in cfg.topic(topic).groups:
        try:
            answer = committed_offsets(cfg, group, topic, list(partitions))
        except KafkaException as e:
            raise BrokerError(f"group {group!r} offsets on {topic!r}: Kafka at {_bootstrap(cfg)} answered: "
                              f"{e.args[0] if e.args else e}") from None
        for tp in answer:
            if tp.error is not None:
                raise BrokerError(f"group {group!r} offsets on {topic!r}[{tp.partition}]: {tp.error}")
            rows.append((group, tp.partition, None if tp.offset < 0 else tp.offset))
    return sorted(rows, key=lambda r: (r[0], r[1]))


ShareRows = list[tuple[str, int, int | None]]  # (share group, partition, start offset or None)


def share_offsets(cfg: Config, partitions: Mapping[str, Sequence[int]]) -> tuple[dict[str, ShareRows], list[str]]:
    """Per topic of `partitions`, (share group, partition, start offset or None) of every share group
    configured on it (`topics.<t>.share_groups`), read in one run of the Java admin program; and the
    lines to say: a group the broker refused, or one with no state on the topic (it does not exist yet
    or has not read it), has no rows. A group with state on some of the topic's partitions has a row
    for each, None where it holds none."""
    from audit.runtime.share_admin import start_offsets

    wanted = {t: [g.name for g in cfg.topic(t).share_groups] for t in partitions}
    got = start_offsets(cfg.kafka, sorted({g for gs in wanted.values() for g in gs}))
    notes = list(got.notes)
    rows: dict[str, ShareRows] = {}
    for topic, groups in wanted.items():
        rows[topic] = []
        for g in groups:
            spso = {p: got.offsets.get((g, topic, p)) for p in partitions[topic]}
            if any((g, topic, p) in got.offsets for p in partitions[topic]):
                rows[topic] += [(g, p, off) for p, off in sorted(spso.items())]
            elif g not in got.unread:
                notes.append(f"share group {g!r} has no start offsets on {topic!r} at {_bootstrap(cfg)} yet "
                             "(it does not exist or has not read the topic): no share_offsets rows")
    return rows, notes


# --------------------------------------------------------------------------------------------
# Spark / Delta edge


def _read_kafka(spark: SparkSession, cfg: Config, ranges: Mapping[str, Sequence[PartitionRange]],
                isolation: str) -> DataFrame:
    """One batch read of every topic's planned ranges (`ranges`: topic -> the partitions to read)."""
    return (
        spark.read.format("kafka")
        .options(**java_kafka_options(cfg.kafka))
        .option("assign", json.dumps({topic: [r.partition for r in rs] for topic, rs in ranges.items()}))
        .option("startingOffsets", offsets_json(ranges, "start"))
        .option("endingOffsets", offsets_json(ranges, "end"))
        .option("includeHeaders", "true")
        .option("kafka.isolation.level", isolation)
        .option("kafka.fetch.max.wait.ms", str(FETCH_MAX_WAIT_MS))
        .option("groupIdPrefix", "msgaudit-capture")
        .load()
    )


@contextlib.contextmanager
def _read_access(cfg: Config, topics: Iterable[str]) -> Iterator[None]:
    """Turn the Java client's ACL denial or failed login, raised by the Spark action inside, into one
    line naming the grant to add (the Spark error would be a page of Java stack)."""
    try:
        yield
    except Exception as e:  # noqa: BLE001 - Py4JJavaError or a pyspark error, re-raised unless it is access
        text = str(e)
        if "TopicAuthorizationException" in text:
            denied = [t for t in topics if t in text] or list(topics)
            raise BrokerError("capture: " + "; ".join(denied_line(cfg.kafka, "READ", "topic", t) for t in denied)) \
                from None
        if "SaslAuthenticationException" in text:
            raise BrokerError(f"capture: {authentication_line(cfg.kafka)}") from None
        raise


def _table_schema(schema: Any) -> Any:
    from pyspark.sql.types import StringType, StructField, StructType

    return StructType([*schema.fields, StructField(PART_HOUR, StringType(), False)])


def ensure_table(spark: SparkSession, cfg: Config, name: str, schema: Any) -> None:
    """Create table `name` (`schema` + part_hour, partitioned by topic and part_hour) unless it exists;
    add the columns of `schema` an older version of it lacks."""
    from delta.tables import DeltaTable

    from spark_jobs.io.lake import table_path

    path = table_path(cfg, name)
    (DeltaTable.createIfNotExists(spark).location(path)
     .addColumns(_table_schema(schema)).partitionedBy(*LOG_PARTITION_COLUMNS).execute())
    add_absent_columns(spark, path, schema)


def add_absent_columns(spark: SparkSession, path: str, schema: Any) -> None:
    """A table captured by an older version lacks the contract's later (nullable) columns: add them,
    so the MERGE can write them (its older rows read them as null)."""
    from delta.tables import DeltaTable

    present = set(DeltaTable.forPath(spark, path).toDF().columns)
    absent = [f for f in schema.fields if f.name not in present]
    if absent:
        columns = ", ".join(f"`{f.name}` {f.dataType.simpleString()}" for f in absent)
        spark.sql(f"ALTER TABLE delta.`{path}` ADD COLUMNS ({columns})")


def ensure_log_table(spark: SparkSession, cfg: Config) -> None:
    ensure_table(spark, cfg, LOG_TABLE, LOG_RECORDS)


@dataclass(frozen=True)
class Landing:
    """Where the records of one read go: `table` (`schema` + part_hour), keyed on `scope` + (partition,
    offset); `names`: each topic read -> the values of `scope` its rows are stored under. The log:
    `log_records` on (topic); a mirror's target cluster: `mirror_records` on (mirror, source topic)."""

    table: str
    schema: Any
    scope: tuple[str, ...]
    names: Mapping[str, tuple[str, ...]]

    @staticmethod
    def log(topics: Iterable[str]) -> Landing:
        return Landing(LOG_TABLE, LOG_RECORDS, ("topic",), {t: (t,) for t in topics})

    @staticmethod
    def mirror(copies: Iterable[tuple[TopicConfig, MirrorConfig]]) -> Landing:
        return Landing(MIRROR_TABLE, MIRROR_RECORDS, ("mirror", "topic"), {m.topic: (m.name, tc.name) for tc, m in copies})

    @property
    def is_log(self) -> bool:
        return self.table == LOG_TABLE

    def relabel(self, rows: DataFrame) -> DataFrame:
        """`rows` (to_log_records' columns, `topic` the topic read) under their stored names."""
        if self.is_log:
            return rows
        names = {c: F.create_map(*[F.lit(v) for t, names in self.names.items() for v in (t, names[i])])[F.col("topic")]
                 for i, c in enumerate(self.scope)}
        return rows.withColumns(names).select(*_table_schema(self.schema).fieldNames())


def _in_ranges(alias: str, scope: Sequence[str], ranges: Mapping[tuple[str, ...], Sequence[PartitionRange]]) -> Column:
    """`alias`'s rows inside the planned ranges of every key of `ranges` (the values of `scope`, which
    names `topic`): the topics as a literal list (Delta prunes the table's topic partitions), then
    each key's partitions and offset bounds (Delta skips files by their statistics)."""
    col = lambda c: F.col(f"{alias}.{c}")  # noqa: E731
    per_key = [reduce(lambda x, y: x & y, [col(c) == F.lit(v) for c, v in zip(scope, key, strict=True)])
               & reduce(lambda x, y: x | y, [(col("partition") == r.partition) & col("offset").between(r.start, r.end - 1)
                                             for r in rs])
               for key, rs in ranges.items()]
    topic = list(scope).index("topic")
    return col("topic").isin(sorted({key[topic] for key in ranges})) & reduce(lambda x, y: x | y, per_key)


def merge_records(spark: SparkSession, cfg: Config, rows: DataFrame, landing: Landing,
                  ranges: Mapping[tuple[str, ...], Sequence[PartitionRange]]) -> dict[tuple[str, ...], int]:
    """MERGE rows into `landing.table` on (scope, partition, offset) in one commit; return how many
    rows of each scope key were written (`ranges`: scope key -> the ranges read).

    Rows already stored with the same content are dropped first (left anti join against the
    stored rows of the same offset ranges), so a rerun over the same log writes nothing, not
    even an empty Delta commit, and keeps the first captured_at. A stored row whose content
    differs (a topic deleted and recreated reuses offsets) is updated. The literal topics and
    offset bounds let Delta prune partitions and skip files by their statistics. The table exists
    (`ensure_table`). The log's hours the MERGE wrote are then rewritten in seq order, in a commit
    that changes no data (`lake.rewrite_by_seq`): a reconcile's task reads its chunk by the row
    groups' seq statistics.
    """
    from delta.tables import DeltaTable

    from spark_jobs.io.lake import rewrite_by_seq, sql_string, table_path

    t, s = "t", "s"
    in_ranges = _in_ranges(t, landing.scope, ranges)
    # the scope too: two mirrors' copies of one topic may hold the same records at the same offsets
    same = reduce(lambda x, y: x & y, [F.col(f"{t}.{c}").eqNullSafe(F.col(f"{s}.{c}"))
                                       for c in dict.fromkeys((*landing.scope, *DATA_COLUMNS, PART_HOUR))])
    table = DeltaTable.forPath(spark, table_path(cfg, landing.table))
    stored = table.toDF().alias(t).where(in_ranges)
    changes = rows.alias(s).join(stored, same, "left_anti").persist()
    try:
        per_hour = changes.groupBy(*landing.scope, PART_HOUR).agg(F.count(F.lit(1)).alias("n")).collect()
        written: dict[tuple[str, ...], int] = {}
        for r in per_hour:
            of = tuple(r[:len(landing.scope)])
            written[of] = written.get(of, 0) + int(r["n"])
        if written:
            key = in_ranges & reduce(lambda x, y: x & y, [F.col(f"{t}.{c}") == F.col(f"{s}.{c}")
                                                          for c in (*landing.scope, "partition", "offset")])
            columns = _table_schema(landing.schema).fieldNames()
            (table.alias(t).merge(changes.alias(s), key)
             .whenMatchedUpdate(condition=~same, set={c: F.col(f"{s}.{c}") for c in columns})
             .whenNotMatchedInsert(values={c: F.col(f"{s}.{c}") for c in columns})
             .execute())
            if landing.is_log:  # the MERGE leaves its rows in its join's order: the hours it wrote, in seq order
                rewrite_by_seq(spark, cfg, landing.table, " OR ".join(sorted(
                    {f"(topic = {sql_string(r['topic'])} AND {PART_HOUR} = {sql_string(r[PART_HOUR])})"
                     for r in per_hour})))
    finally:
        changes.unpersist()
    return written


def _append_snapshot(spark: SparkSession, cfg: Config, name: str, schema: Any, rows: list[tuple[Any, ...]]) -> None:
    from spark_jobs.io.lake import write_table

    if rows:
        write_table(local_frame(spark, rows, schema), cfg, name, mode="append", partition_by=("topic",),
                    add_columns=True)


@dataclass
class _Snapshots:
    """Offset snapshots of every topic (and mirror) of one capture, written together (a Delta commit per
    table)."""

    groups: list[tuple[Any, ...]] = field(default_factory=list)
    watermarks: list[tuple[Any, ...]] = field(default_factory=list)
    mirror_groups: list[tuple[Any, ...]] = field(default_factory=list)
    mirror_watermarks: list[tuple[Any, ...]] = field(default_factory=list)
    shares: list[tuple[Any, ...]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def add(self, landing: Landing, topic: str, groups: Iterable[tuple[str, int, int | None]],
            ranges: Iterable[PartitionRange], captured_at: datetime) -> None:
        """The group offsets and watermarks of `topic` read for `landing`: a mirror's rows lead with the
        mirror's name and name the source topic (`landing.names`)."""
        *lead, stored = landing.names[topic]
        g_rows = [(*lead, g, stored, p, off, captured_at) for g, p, off in groups]
        w_rows = [(*lead, stored, r.partition, r.log_start_offset, r.high_watermark, captured_at, r.start, r.end)
                  for r in ranges]
        if landing.is_log:
            self.groups += g_rows
            self.watermarks += w_rows
        else:
            self.mirror_groups += g_rows
            self.mirror_watermarks += w_rows

    def write(self, spark: SparkSession, cfg: Config) -> None:
        _append_snapshot(spark, cfg, GROUP_OFFSETS_TABLE, GROUP_OFFSETS, self.groups)
        _append_snapshot(spark, cfg, SHARE_OFFSETS_TABLE, SHARE_OFFSETS, self.shares)
        _append_snapshot(spark, cfg, WATERMARKS_TABLE, PARTITION_WATERMARKS, self.watermarks)
        _append_snapshot(spark, cfg, MIRROR_WATERMARKS_TABLE, MIRROR_WATERMARKS, self.mirror_watermarks)
        _append_snapshot(spark, cfg, MIRROR_GROUP_OFFSETS_TABLE, MIRROR_GROUP_OFFSETS, self.mirror_groups)


def read_and_merge(spark: SparkSession, cfg: Config, ranges: Mapping[str, Sequence[PartitionRange]],
                   captured_at: datetime, landing: Landing | None = None) -> dict[str, tuple[int, int, int, int]]:
    """Read the planned ranges of every topic of `ranges` (on `cfg`'s cluster) in one pass per isolation
    level and MERGE them in one commit where `landing` says (default: log_records): topic read ->
    (records, aborted, header errors, written), for the topics that had offsets to read."""
    landing = landing or Landing.log(ranges)
    to_read = {t: [r for r in rs if r.offsets > 0] for t, rs in ranges.items()}
    to_read = {t: rs for t, rs in to_read.items() if rs}
    if not to_read:
        return {}
    everything = _read_kafka(spark, cfg, to_read, "read_uncommitted")
    committed = _read_kafka(spark, cfg, to_read, "read_committed").select("topic", "partition", "offset")
    tz = spark.conf.get("spark.sql.session.timeZone") or "UTC"
    rows = landing.relabel(to_log_records(everything, committed, captured_at, tz)).persist()
    try:
        with _read_access(cfg, to_read):  # the first action reads Kafka
            counts = {tuple(r[:-3]): (int(r[-3]), int(r[-2]), int(r[-1])) for r in rows.groupBy(*landing.scope).agg(
                F.count(F.lit(1)).alias("records"),
                F.count(F.when(~F.col("committed"), 1)).alias("aborted"),
                F.count(F.col("header_error")).alias("header_errors"),
            ).collect()}
        written = (merge_records(spark, cfg, rows, landing, {landing.names[t]: rs for t, rs in to_read.items()})
                   if counts else {})
    finally:
        rows.unpersist()
    return {t: (*counts.get(landing.names[t], (0, 0, 0)), written.get(landing.names[t], 0)) for t in to_read}


def capture_batch(spark: SparkSession, cfg: Config, admin: Any, partitions: Mapping[str, Sequence[int]],
                  start: datetime, end: datetime, captured_at: datetime,
                  snapshots: _Snapshots, landing: Landing | None = None) -> dict[str, TopicCapture]:
    """Snapshot group offsets and watermarks of the topics of `partitions` (into `snapshots`), then
    read and MERGE all of them together (`read_and_merge`) where `landing` says (default: the log)."""
    landing = landing or Landing.log(partitions)
    # Group offsets first: a group cannot have committed past what the log read afterwards holds.
    groups = {topic: group_offsets(cfg, topic, ps) for topic, ps in partitions.items()}
    if landing.is_log and any(cfg.topic(t).share_groups for t in partitions):  # likewise their start offsets
        shares, notes = share_offsets(cfg, partitions)
        snapshots.shares += [(g, t, p, off, captured_at) for t, rows in shares.items() for g, p, off in rows]
        snapshots.notes += notes
    ranges = {topic: plan_topic(admin, cfg, topic, ps, start, end) for topic, ps in partitions.items()}
    for topic, rs in ranges.items():
        snapshots.add(landing, topic, groups[topic], rs, captured_at)
    read = read_and_merge(spark, cfg, ranges, captured_at, landing)
    results = {}
    for topic, rs in ranges.items():
        records, aborted, header_errors, written = read.get(topic, (0, 0, 0, 0))
        results[topic] = TopicCapture(
            topic=topic,
            partitions=len(rs),
            offsets_read=sum(r.offsets for r in rs),
            records=records,
            aborted=aborted,
            header_errors=header_errors,
            written=written,
            deferred=sum(r.deferred for r in rs),
            groups=len(groups[topic]),
            ranges=tuple(rs),
        )
    return results


def topic_partitions(cfg: Config, topics: Sequence[str], admin: Any = None) -> dict[str, list[int]]:
    """Partition ids of each topic on the broker; InputError naming the first topic that does not exist."""
    admin = admin or _admin(cfg)
    return {name: _partitions(admin, cfg, name) for name in topics}


def selected_topics(cfg: Config, topics: Sequence[str] | None) -> list[str]:
    if topics:
        return [cfg.topic(t).name for t in dict.fromkeys(topics)]
    if not cfg.topics:
        raise InputError(f"{cfg.source}: no topics configured; add a `topics:` section")
    return list(cfg.topics)


def capture(spark: SparkSession, cfg: Config, start: datetime, end: datetime,
            topics: Sequence[str] | None = None, progress: bool = False) -> CaptureResult:
    """Capture the log of every selected topic for the windows of [start, end) (see module doc)."""
    if start.tzinfo is None or end.tzinfo is None:
        raise InputError("capture: start and end must be timezone-aware (UTC) datetimes")
    if end <= start:
        raise InputError(f"--end ({end.isoformat()}) must be after --start ({start.isoformat()})")
    names = selected_topics(cfg, topics)
    now = datetime.now(UTC)
    captured_at = now.replace(microsecond=now.microsecond // 1000 * 1000)  # Delta keeps microseconds
    admin = _admin(cfg)
    partitions = topic_partitions(cfg, names, admin)  # an unknown topic fails before anything is written
    from tqdm import tqdm

    ensure_log_table(spark, cfg)  # an empty capture still leaves a readable (empty) table
    if any(cfg.topic(n).mirrors for n in names):
        ensure_table(spark, cfg, MIRROR_TABLE, MIRROR_RECORDS)
    results: dict[str, TopicCapture] = {}
    mirrors: list[MirrorCapture] = []
    snapshots = _Snapshots()
    # Nothing is printed per topic: a window of 200 topics in a backfill or follow would print 200
    # lines; the caller prints `CaptureResult.summary()` when it wants them.
    with tqdm(total=len(names), desc="capture", unit="topic", disable=not progress) as bar:
        for i in range(0, len(names), BATCH_TOPICS):
            batch = names[i:i + BATCH_TOPICS]
            bar.set_postfix_str(batch[0] if len(batch) == 1 else f"{batch[0]} .. {batch[-1]}")
            results.update(capture_batch(spark, cfg, admin, {n: partitions[n] for n in batch}, start, end,
                                         captured_at, snapshots))
            # stage mirror:<m>: the copies of the batch's topics on the mirrors' target clusters
            copies = [(cfg.topic(n), m) for n in batch for m in cfg.topic(n).mirrors]
            mirrors.extend(capture_mirrors(spark, cfg, copies, start, end, captured_at, snapshots))
            bar.update(len(batch))
    snapshots.write(spark, cfg)
    dead = capture_dead_letters(spark, cfg, names, captured_at, admin)
    return CaptureResult(captured_at=captured_at, start=start, end=end, topics=results, mirrors=tuple(mirrors),
                         dead_letters=dead, notes=tuple(snapshots.notes))


# --------------------------------------------------------------------------------------------
# Dead-letter topics (docs/design.md §4.2): a Kafka Connect sink's (sinks[].dead_letter_topic) and a
# share group's (share_groups[].dead_letter_topic, KIP-1191)

DEAD_LETTER_TABLE = "dead_letter_records"


@dataclass(frozen=True)
class DeadLetterHeaders:
    """The headers by which one kind of dead-letter record names its source record (text values)."""

    topic: str
    partition: str
    offset: str
    error: tuple[str, ...]  # joined by ': ' into `error` when the first is present
    group: str | None = None
    delivery_count: str | None = None


DLQ_HEADERS: tuple[DeadLetterHeaders, ...] = (
    # Kafka Connect, with errors.deadletterqueue.context.headers.enable=true (DeadLetterQueueReporter)
    DeadLetterHeaders("__connect.errors.topic", "__connect.errors.partition", "__connect.errors.offset",
                      ("__connect.errors.exception.class.name", "__connect.errors.exception.message")),
    # a share group's broker, share.version=2 (Kafka 4.4 ShareGroupDLQStateManager): written on every record;
    # the message is "Offset rejected by client." or "Offset delivery count exceeded the threshold."
    DeadLetterHeaders("__dlq.errors.topic", "__dlq.errors.partition", "__dlq.errors.offset",
                      ("__dlq.errors.message",), "__dlq.errors.group", "__dlq.errors.delivery.count"),
)


def _header(name: str) -> Column:
    """The text of the record's first header `name` (null when it has none)."""
    return F.expr(f"try_element_at(filter(headers, h -> h.key = '{name}'), 1).value").cast("string")


def dead_letter_rows(kafka_rows: DataFrame, captured_at: datetime) -> DataFrame:
    """A DLQ topic's records (Spark's Kafka source, with headers) as `dead_letter_records` rows: the
    source record its headers name -- the first kind of `DLQ_HEADERS` whose topic header it carries
    (written as text; a value that is not a number reads null, and the row names no record) -- its
    error, and for a share group's record its group and delivery count."""
    def first(pick: Callable[[DeadLetterHeaders], Column]) -> Column:
        out: Column = F.lit(None)
        for h in reversed(DLQ_HEADERS):
            out = F.when(_header(h.topic).isNotNull(), pick(h)).otherwise(out)
        return out

    def error(h: DeadLetterHeaders) -> Column:
        return F.when(_header(h.error[0]).isNotNull(), F.concat_ws(": ", *(_header(e) for e in h.error)))

    def optional(name: str | None) -> Column:
        return F.lit(None).cast("string") if name is None else _header(name)

    return kafka_rows.select(
        F.col("topic").alias("dlq_topic"), F.col("partition").alias("dlq_partition"),
        F.col("offset").alias("dlq_offset"), first(lambda h: _header(h.topic)).cast("string").alias("topic"),
        first(lambda h: _header(h.partition)).cast("string").try_cast("int").alias("partition"),
        first(lambda h: _header(h.offset)).cast("string").try_cast("bigint").alias("offset"),
        first(error).cast("string").alias("error"),
        F.col("timestamp").alias("kafka_ts"), F.lit(captured_at).alias("captured_at"),
        first(lambda h: optional(h.group)).cast("string").alias("group"),
        first(lambda h: optional(h.delivery_count)).cast("string").try_cast("int").alias("delivery_count"))


def capture_dead_letters(spark: SparkSession, cfg: Config, names: Sequence[str], captured_at: datetime,
                         admin: Any = None) -> tuple[DeadLetterCapture, ...]:
    """Read each dead-letter topic the selected topics' sinks and share groups name, whole, and MERGE its records into
    `dead_letter_records` on (dlq_topic, dlq_partition, dlq_offset) (a rerun adds nothing; a record
    the DLQ's retention deleted since stays). Only the position each record names is kept, not the
    record: a DLQ record carries its source's key, value and audit headers, and capturing it like a
    log would make it look like another copy of the message; reconcile needs only which source
    record it stands for. A DLQ is small (it holds failures) and has no windows: it is read from its
    log start to its end each time. A DLQ topic not created yet (no failure so far) holds nothing."""
    from delta.tables import DeltaTable

    from spark_jobs.io.lake import table_path

    dlqs: dict[str, list[str]] = {}
    for n in names:
        for s in cfg.topic(n).sinks:
            if s.dead_letter_topic:
                dlqs.setdefault(s.dead_letter_topic, []).append(f"sink {s.name}")
        for sg in cfg.topic(n).share_groups:
            if sg.dead_letter_topic:
                dlqs.setdefault(sg.dead_letter_topic, []).append(f"share group {sg.name}")
    dlqs = {t: list(dict.fromkeys(users)) for t, users in dlqs.items()}  # a group may read several topics
    if not dlqs:
        return ()
    admin = admin or _admin(cfg)
    existing = set(admin.list_topics(timeout=ADMIN_TIMEOUT_S).topics)
    path = table_path(cfg, DEAD_LETTER_TABLE)
    (DeltaTable.createIfNotExists(spark).location(path).addColumns(DEAD_LETTER_RECORDS)
     .partitionedBy("dlq_topic").execute())
    add_absent_columns(spark, path, DEAD_LETTER_RECORDS)
    out = []
    for dlq, sinks in dlqs.items():
        if dlq not in existing:
            out.append(DeadLetterCapture(dlq, tuple(sinks), 0, 0))
            continue
        with _read_access(cfg, [dlq]):
            rows = dead_letter_rows(
                spark.read.format("kafka").options(**java_kafka_options(cfg.kafka)).option("subscribe", dlq)
                .option("startingOffsets", "earliest").option("endingOffsets", "latest")
                .option("includeHeaders", "true").option("groupIdPrefix", "msgaudit-capture").load(),
                captured_at).persist()
        try:
            counts = rows.agg(F.count(F.lit(1)), F.count_if(F.col("topic").isNull() | F.col("partition").isNull()
                                                           | F.col("offset").isNull())).first()
            records, unplaced = (int(counts[0]), int(counts[1])) if counts is not None else (0, 0)
            if records:
                key = " AND ".join(f"t.{c} = s.{c}" for c in ("dlq_topic", "dlq_partition", "dlq_offset"))
                (DeltaTable.forPath(spark, path).alias("t").merge(rows.alias("s"), f"t.dlq_topic = '{dlq}' AND {key}")
                 .whenNotMatchedInsertAll().execute())
        finally:
            rows.unpersist()
        out.append(DeadLetterCapture(dlq, tuple(sinks), records, unplaced))
    return tuple(out)


# --------------------------------------------------------------------------------------------
# Mirrors (docs/design.md §5.5): the topic's copy on a MirrorMaker 2 target cluster


MIRROR_TABLE = "mirror_records"
MIRROR_WATERMARKS_TABLE = "mirror_watermarks"
MIRROR_GROUP_OFFSETS_TABLE = "mirror_group_offsets"


def mirror_config(cfg: Config, copies: Sequence[tuple[TopicConfig, MirrorConfig]]) -> Config:
    """`cfg` as seen from the target cluster of `copies` (source topic, mirror) -- every mirror of them
    on that cluster: its Kafka settings, and each copy's name as a topic (with its source topic's
    window, grace and lookback, and the mirror's `failover_groups` as its groups), so the log
    capture's planning, snapshots and reading apply unchanged."""
    kafka = dict(copies[0][1].kafka)
    where = ", ".join(f"topics.{tc.name}.mirrors[{m.name}]" for tc, m in copies)
    return replace(cfg, source=f"{cfg.source}: {where}", kafka=kafka,
                   topics={m.topic: replace(tc, name=m.topic, mirrors=(), groups=m.failover_groups)
                           for tc, m in copies})


def mirror_batches(copies: Sequence[tuple[TopicConfig, MirrorConfig]]) -> list[list[tuple[TopicConfig, MirrorConfig]]]:
    """`copies` in batches read together: the same target cluster (the same Kafka settings) and no copy
    named twice in a batch (two mirrors may name the same copy), at most BATCH_TOPICS each; in the
    order given."""
    batches: list[list[tuple[TopicConfig, MirrorConfig]]] = []
    open_: dict[tuple[tuple[str, str], ...], list[int]] = {}  # cluster -> its batches' indexes
    for tc, m in copies:
        cluster = tuple(sorted(m.kafka.items()))
        fits = [i for i in open_.get(cluster, [])
                if len(batches[i]) < BATCH_TOPICS and all(other.topic != m.topic for _, other in batches[i])]
        if fits:
            batches[fits[0]].append((tc, m))
        else:
            open_.setdefault(cluster, []).append(len(batches))
            batches.append([(tc, m)])
    return batches


def capture_mirrors(spark: SparkSession, cfg: Config, copies: Sequence[tuple[TopicConfig, MirrorConfig]],
                    start: datetime, end: datetime, captured_at: datetime,
                    snapshots: _Snapshots) -> list[MirrorCapture]:
    """Read the copies of (source topic, mirror) `copies` on their mirrors' target clusters like the log
    (same time range, both isolation levels, same header parsing) and MERGE them into
    `mirror_records` keyed on (mirror, topic, partition, offset), `topic` being the source topic --
    the copies on one cluster together (`mirror_batches`: one read per isolation level and one
    commit per batch); add their watermarks and the committed offsets of their `failover_groups` on
    the target to `snapshots` (§5.5). Returns what was captured of each copy, in the order given."""
    got: dict[tuple[str, str], MirrorCapture] = {}
    for batch in mirror_batches(copies):
        mcfg = mirror_config(cfg, batch)
        admin = _admin(mcfg)
        captured = capture_batch(spark, mcfg, admin, topic_partitions(mcfg, [m.topic for _, m in batch], admin),
                                 start, end, captured_at, snapshots, Landing.mirror(batch))
        for tc, m in batch:
            got[(tc.name, m.name)] = MirrorCapture(tc.name, m.name, m.topic, m.kafka.get("bootstrap.servers", "?"),
                                                   captured[m.topic])
    return [got[(tc.name, m.name)] for tc, m in copies]
