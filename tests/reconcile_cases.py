"""Shared fixtures for the reconcile tests: hand-written histories as oracle dataclasses, and the
adapters that turn them into the Spark job's DataFrames / Delta tables and normalise results."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from audit.core.config import MirrorConfig, ShareGroupConfig, SinkConfig, TopicConfig
from audit.oracle import (
    ConsumedRow,
    GroupOffset,
    Inputs,
    LedgerRow,
    LogRecord,
    MirrorRecord,
    MirrorWatermark,
    ShareOffset,
    SinkRow,
    Watermark,
)

T0 = datetime(2026, 11, 21, 10, 0, tzinfo=UTC)  # window under test: [10:00, 11:00)
TOPIC = "t"
GROUP = "g1"
SINK = "s1"


def at(minutes: float) -> datetime:
    return T0 + timedelta(minutes=minutes)


def topic_config(groups: Sequence[str] = (GROUP,), sinks: Sequence[tuple[str, str | None]] = ((SINK, GROUP),),
                 grace: timedelta = timedelta(minutes=15), window: timedelta = timedelta(hours=1),
                 lookback: timedelta | None = None) -> TopicConfig:
    return TopicConfig(name=TOPIC, window=window, grace=grace, lookback=lookback, groups=tuple(groups),
                       sinks=tuple(SinkConfig(name=n, format="delta", group=g, location=f"/unused/{n}")
                                   for n, g in sinks))


@dataclass
class History:
    """A mutable builder of one topic's history across the tiers."""

    ledger: list[LedgerRow] = field(default_factory=list)
    log: list[LogRecord] = field(default_factory=list)
    consumed: list[ConsumedRow] = field(default_factory=list)
    group_offsets: list[GroupOffset] = field(default_factory=list)
    watermarks: list[Watermark] = field(default_factory=list)
    sinks: dict[str, list[SinkRow]] = field(default_factory=dict)
    mirror_log: list[MirrorRecord] = field(default_factory=list)
    mirror_watermarks: list[MirrorWatermark] = field(default_factory=list)
    share_offsets: list[ShareOffset] = field(default_factory=list)
    _cseq: int = 0

    def inputs(self) -> Inputs:
        return Inputs(self.ledger, self.log, self.consumed, self.group_offsets, self.watermarks,
                      {k: list(v) for k, v in self.sinks.items()}, list(self.mirror_log), list(self.mirror_watermarks),
                      share_offsets=list(self.share_offsets))

    def mirrored(self, pid: str | None, seq: int | None, partition: int, offset: int, t: datetime,
                 copied_ms: int = 3000, mirror: str = "dr", committed: bool = True,
                 header_error: str | None = None) -> None:
        """A copy on the mirror's target at (partition, offset), appended `copied_ms` after t."""
        self.mirror_log.append(MirrorRecord(partition, offset, pid, seq, t if header_error is None else None,
                                            t + timedelta(milliseconds=copied_ms), t + timedelta(minutes=1),
                                            f"fp-{pid}-{seq}", committed, header_error, mirror=mirror))

    def mirror_captured(self, partition: int, lso: int, hw: int, t: datetime, mirror: str = "dr") -> None:
        self.mirror_watermarks.append(MirrorWatermark(partition, lso, hw, t, captured_from=lso,
                                                      captured_to=hw, mirror=mirror))

    def produce(self, pid: str, seq: int, partition: int, offset: int | None, t: datetime,
                status: str = "acked", ack_ms: int = 5) -> None:
        self.ledger.append(LedgerRow(pid, seq, partition if status == "acked" else partition, offset, status, t,
                                     t + timedelta(milliseconds=ack_ms) if status == "acked" else None))

    def record(self, pid: str | None, seq: int | None, partition: int, offset: int, t: datetime,
               fingerprint: str | None = None, committed: bool = True, header_error: str | None = None) -> None:
        self.log.append(LogRecord(partition, offset, pid, seq, t if header_error is None else None,
                                  t + timedelta(milliseconds=2), t + timedelta(minutes=1),
                                  fingerprint if fingerprint is not None else f"fp-{pid}-{seq}-{partition}",
                                  committed, header_error))

    def consume(self, pid: str | None, seq: int | None, partition: int, offset: int, t: datetime,
                outcome: str = "processed", group: str = GROUP, consumer: str = "c1", attempt: int = 1,
                error: str | None = None, produce_ts: datetime | None = None) -> None:
        """A consumption row; `produce_ts`: the message's produce time it carries (optional)."""
        self._cseq += 1
        self.consumed.append(ConsumedRow(group, consumer, self._cseq, partition, offset, pid, seq, outcome, t,
                                         attempt, error=error, produce_ts=produce_ts))

    def sink(self, pid: str | None, seq: int | None, partition: int | None, offset: int | None,
             t: datetime | None, name: str = SINK, produce_ts: datetime | None = None,
             dead_letter: bool = False) -> None:
        """A sink row, or (`dead_letter`) a record of the sink connector's dead-letter topic naming
        the source record at (partition, offset), resolved through the log as a coordinates sink's row."""
        self.sinks.setdefault(name, []).append(SinkRow(partition, offset, pid, seq, t, produce_ts=produce_ts,
                                                       dead_letter=dead_letter))

    def clean(self, pid: str, seq: int, partition: int, offset: int, t: datetime, carried: bool = True) -> None:
        """A message that went through every tier exactly once; its consumption and sink rows
        carry its produce time unless `carried` is false (clients that do not write it)."""
        self.produce(pid, seq, partition, offset, t)
        self.record(pid, seq, partition, offset, t)
        pt = t if carried else None
        self.consume(pid, seq, partition, offset, t + timedelta(seconds=1), produce_ts=pt)
        self.sink(pid, seq, partition, offset, t + timedelta(seconds=2), produce_ts=pt)

    def captured(self, partition: int, lso: int, hw: int, t: datetime, group_committed: int | None = None,
                 group: str = GROUP, read: tuple[int, int] | None = None) -> None:
        """A capture at t: watermarks, the offsets it read ([lso, hw) unless `read`), group offsets."""
        lo, hi = read if read is not None else (None, None)
        self.watermarks.append(Watermark(partition, lso, hw, t, captured_from=lo, captured_to=hi))
        if group_committed is not None:
            self.group_offsets.append(GroupOffset(group, partition, group_committed, t))


# ---------------------------------------------------------------------------- Spark adapters
def _hour(t: datetime | None) -> str | None:
    return None if t is None else t.astimezone(UTC).strftime("%Y-%m-%dT%H")


def table_rows(inputs: Inputs) -> dict[str, list[dict[str, Any]]]:
    """Oracle inputs -> rows of the lake tables (docs/design.md §4 columns + part_hour)."""
    out: dict[str, list[dict[str, Any]]] = {}
    out["producer_ledger"] = [{**asdict(r), "part_hour": _hour(r.produce_ts)} for r in inputs.ledger]
    out["log_records"] = [{**asdict(r), "part_hour": _hour(r.produce_ts or r.kafka_ts or r.captured_at)}
                          for r in inputs.log]
    out["consumed_records"] = [{**asdict(r), "part_hour": _hour(r.consume_ts)} for r in inputs.consumed]
    out["group_offsets"] = [{**asdict(r), "part_hour": _hour(r.captured_at)} for r in inputs.group_offsets]
    out["partition_watermarks"] = [{**asdict(r), "part_hour": _hour(r.captured_at)} for r in inputs.watermarks]
    if inputs.share_offsets:
        out["share_offsets"] = [{**asdict(r), "part_hour": _hour(r.captured_at)} for r in inputs.share_offsets]
    if inputs.mirror_log or inputs.mirror_watermarks:
        out["mirror_records"] = [{**asdict(r), "part_hour": _hour(r.produce_ts or r.kafka_ts or r.captured_at)}
                                 for r in inputs.mirror_log]
        out["mirror_watermarks"] = [{**asdict(r), "part_hour": _hour(r.captured_at)} for r in inputs.mirror_watermarks]
    return out


def frame(spark: Any, table: str, rows: Iterable[Mapping[str, Any]]) -> Any:
    from pyspark.sql.types import StringType, StructField, StructType

    from spark_jobs.io.schemas import TABLES

    schema = StructType([*TABLES[table].fields, StructField("part_hour", StringType(), True)])
    return spark.createDataFrame([tuple(r.get(f.name) for f in schema.fields) for r in rows], schema)


def sink_frame(spark: Any, rows: Iterable[SinkRow], topic: str = TOPIC) -> Any:
    from pyspark.sql.types import (
        BooleanType,
        IntegerType,
        LongType,
        StringType,
        StructField,
        StructType,
        TimestampType,
    )

    schema = StructType([StructField("topic", StringType()), StructField("partition", IntegerType()),
                         StructField("offset", LongType()), StructField("pid", StringType()),
                         StructField("seq", LongType()), StructField("sink_ts", TimestampType()),
                         StructField("produce_ts", TimestampType()), StructField("dead_letter", BooleanType())])
    return spark.createDataFrame([(r.topic, r.partition, r.offset, r.pid, r.seq, r.sink_ts, r.produce_ts,
                                   r.dead_letter) for r in rows], schema)


def window_inputs(spark: Any, inputs: Inputs, tc: TopicConfig) -> Any:
    from spark_jobs.reconcile import WindowInputs

    t = table_rows(inputs)
    return WindowInputs(
        ledger=frame(spark, "producer_ledger", t["producer_ledger"]),
        log=frame(spark, "log_records", t["log_records"]),
        consumed=frame(spark, "consumed_records", t["consumed_records"]),
        group_offsets=frame(spark, "group_offsets", t["group_offsets"]),
        watermarks=frame(spark, "partition_watermarks", t["partition_watermarks"]),
        sinks={s.name: sink_frame(spark, inputs.sinks.get(s.name, [])) for s in tc.sinks},
        mirror_log=frame(spark, "mirror_records", t["mirror_records"]) if "mirror_records" in t else None,
        mirror_watermarks=frame(spark, "mirror_watermarks", t["mirror_watermarks"]) if "mirror_records" in t else None,
        share_offsets=frame(spark, "share_offsets", t["share_offsets"]) if "share_offsets" in t else None,
    )


def write_lake(spark: Any, lake: Path | str, inputs: Inputs) -> None:
    """Write the inputs as the lake's Delta tables (partitioned by topic, part_hour), replacing them."""
    for table, rows in table_rows(inputs).items():
        (frame(spark, table, rows).write.format("delta").mode("overwrite").partitionBy("topic", "part_hour")
         .save(f"{lake}/{table}"))


def write_delta_sink(spark: Any, location: Path, rows: Iterable[SinkRow], extra_col: bool = True,
                     mode: str = "overwrite") -> None:
    df = sink_frame(spark, rows)
    renamed = df.select(*[df[c].alias(f"audit_{c}") for c in df.columns])
    if extra_col:
        from pyspark.sql import functions as F

        renamed = renamed.withColumn("payload", F.lit("x"))
    renamed.write.format("delta").mode(mode).save(str(location))


def write_two_windows_one_lost(spark: Any, lake: Path | str, sink_location: Path) -> None:
    """Two windows of TOPIC, [10:00, 11:00) and [11:00, 12:00): three clean messages (10:10, 10:50,
    11:30) and one acked at 11:40 that the log never held (`lost_acked` in the second); its report is
    TWO_WINDOWS_REPORT. Backfill and follow run it through their steps."""
    h = History()
    h.captured(0, 0, 100, at(130), group_committed=100)
    for i in range(3):
        h.clean("p", i, 0, i, at(10 + 40 * i))
    h.produce("p", 3, 0, 3, at(100))
    write_lake(spark, lake, h.inputs())
    write_delta_sink(spark, sink_location, h.sinks[SINK])


# (window_start, stage, expected, lost) of each report row of `write_two_windows_one_lost`
TWO_WINDOWS_REPORT = [
    (T0, "group:g1", 2, 0), (T0, "log", 2, 0), (T0, "sink:s1", 2, 0),
    (T0 + timedelta(hours=1), "group:g1", 1, 0), (T0 + timedelta(hours=1), "log", 2, 1),
    (T0 + timedelta(hours=1), "sink:s1", 1, 0),
]


def aware(v: Any) -> Any:
    return v.replace(tzinfo=UTC) if isinstance(v, datetime) and v.tzinfo is None else v


def norm_rows(rows: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    return [{k: aware(v) for k, v in r.items()} for r in rows]


def anomaly_key(r: Mapping[str, Any]) -> tuple[Any, ...]:
    return tuple("" if r[k] is None else str(r[k]) for k in
                 ("stage", "anomaly", "partition", "pid", "seq", "offset", "detail"))


def sorted_anomalies(rows: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    return sorted(norm_rows(rows), key=anomaly_key)


def brief(rows: Iterable[Mapping[str, Any]]) -> list[tuple[Any, ...]]:
    """(stage, anomaly, partition, pid, seq, offset) of anomaly rows, sorted: for exact expectations."""
    return sorted(((r["stage"], r["anomaly"], r["partition"], r["pid"], r["seq"], r["offset"]) for r in rows),
                  key=lambda t: tuple("" if v is None else str(v) for v in t))


def spark_reconcile(spark: Any, tc: TopicConfig, ws: datetime, as_of: datetime,
                    inputs: Inputs) -> tuple[list[dict[str, Any]], list[dict[str, Any]], int]:
    report, anomalies, quarantined, _ = spark_classify(spark, tc, ws, as_of, inputs)
    return report, anomalies, quarantined


def spark_classify(spark: Any, tc: TopicConfig, ws: datetime, as_of: datetime, inputs: Inputs
                   ) -> tuple[list[dict[str, Any]], list[dict[str, Any]], int, dict[tuple[str, str], int]]:
    """`spark_reconcile`, and the consumption rows read on a mirror that were ignored, per (group, cluster):
    the window settled in three Spark tasks (so the checks that need neighbours meet rows of several)."""
    from spark_jobs.reconcile import classify_window

    c = classify_window(spark, window_inputs(spark, inputs, tc), tc, ws, as_of, engine="spark", chunks=3)
    return (norm_rows(c.report), sorted_anomalies(r.asDict() for r in c.anomalies.collect()), c.quarantined,
            c.ignored)


# ---------------------------------------------------------------------------- hand-written cases
# One history holding one case per partition (each with its own pid), reconciled for [10:00, 11:00)
# as of 11:30 (final). `CASES[name]` = the exact anomaly rows that case must produce, as
# (stage, anomaly, partition, pid, seq, offset).
AS_OF_FINAL = at(90)
G, S = f"group:{GROUP}", f"sink:{SINK}"


def build_dead_letter_case() -> tuple[History, list[tuple[Any, ...]]]:
    """A Kafka Connect sink fed by g1 with a dead-letter topic (docs/design.md §5.4): offset 0 the
    connector could not convert went to the DLQ (`dead_lettered`, not missing); offset 1 was
    dead-lettered on a first attempt and written on a retry (delivered); a DLQ record naming offset
    42, which the log never held, is one quarantined row. Kept apart from `build_cases`: tests
    write those cases' sink rows into real sink tables, and a DLQ record is no row of one."""
    h = History()
    h.captured(0, 0, 100, at(70), group_committed=100)
    h.produce("dlq", 0, 0, 0, at(5))
    h.record("dlq", 0, 0, 0, at(5))
    h.consume("dlq", 0, 0, 0, at(5.1))
    h.sink("dlq", 0, 0, 0, at(5.2), dead_letter=True)
    h.clean("dlq", 1, 0, 1, at(6))
    h.sink("dlq", 1, 0, 1, at(6), dead_letter=True)
    h.sink(None, None, 0, 42, at(7), dead_letter=True)
    return h, [(f"sink:{SINK}", "dead_lettered", 0, "dlq", 0, 0)]

def build_cases() -> tuple[History, dict[str, list[tuple[Any, ...]]]]:
    h = History()
    exp: dict[str, list[tuple[Any, ...]]] = {}
    for p in range(22):
        h.captured(p, 0, 100, at(70), group_committed=100)

    # p0: three clean messages
    for i in range(3):
        h.clean("clean", i, 0, i, at(1 + i))
    exp["clean"] = []

    # p1: acked at offset 1, the capture covered it, the log does not have it
    h.clean("lost", 0, 1, 0, at(5))
    h.produce("lost", 1, 1, 1, at(6))
    exp["lost_acked"] = [("log", "lost_acked", 1, "lost", 1, 1)]

    # p2: acked at offset 3, but retention (log_start_offset 5) removed it before any capture
    h.watermarks = [w for w in h.watermarks if w.partition != 2]
    h.captured(2, 5, 10, at(70), group_committed=10)
    h.produce("unver", 0, 2, 3, at(5))
    h.clean("unver", 1, 2, 5, at(6))
    exp["unverifiable"] = [("log", "unverifiable", 2, "unver", 0, 3)]

    # p3: the producer saw a failure, the broker kept the write
    h.produce("ghost", 0, -1, None, at(5), status="failed")
    h.record("ghost", 0, 3, 0, at(5))
    h.consume("ghost", 0, 3, 0, at(5.1))
    h.sink("ghost", 0, 3, 0, at(5.2))
    exp["ghost_write"] = [("log", "ghost_write", 3, "ghost", 0, 0)]

    # p4: a producer retry wrote seq 0 twice (offsets 0 and 1); the group processed both copies,
    # the (idempotent) sink kept one row
    h.clean("dup", 0, 4, 0, at(5))
    h.record("dup", 0, 4, 1, at(5))
    h.consume("dup", 0, 4, 1, at(5.1))
    exp["duplicate_in_log"] = [("log", "duplicate_in_log", 4, "dup", 0, 1)]

    # p5: seq 2 landed before seq 1
    h.clean("reo", 0, 5, 0, at(5))
    h.clean("reo", 2, 5, 1, at(5.1))
    h.clean("reo", 1, 5, 2, at(5.2))
    exp["reordered_in_log"] = [("log", "reordered_in_log", 5, "reo", 1, 2)]

    # p6: an audited record nobody ledgered
    h.record("unl", 0, 6, 0, at(5))
    h.consume("unl", 0, 6, 0, at(5.1))
    h.sink("unl", 0, 6, 0, at(5.2))
    exp["unledgered"] = [("log", "unledgered", 6, "unl", 0, 0)]

    # p7: seqs 1 and 2 of pid 'gap' are in neither ledger nor log
    h.clean("gap", 0, 7, 0, at(5))
    h.clean("gap", 3, 7, 1, at(6))
    exp["seq_gap"] = [("log", "seq_gap", -1, "gap", 1, None), ("log", "seq_gap", -1, "gap", 2, None)]

    # p8: a record with a malformed header, still followed through the group and the sink by offset
    h.record("bad", None, 8, 0, at(5), header_error="audit.seq: not an integer")
    h.consume(None, None, 8, 0, at(5.1))
    h.sink(None, None, 8, 0, at(5.2))
    exp["unaudited"] = [("log", "unaudited", 8, "bad", None, 0)]

    # p9: the application resent the same content as a new message
    h.clean("cd", 0, 9, 0, at(5))
    h.clean("cd", 1, 9, 1, at(6))
    h.log = [replace_fp(r, "same") if r.pid == "cd" else r for r in h.log]
    exp["content_duplicate"] = [("log", "content_duplicate", 9, "cd", 1, 1)]

    # p10: two records of an aborted transaction; the group read the second one and the sink has it
    h.produce("ab", 0, 10, 0, at(5), status="aborted")
    h.record("ab", 0, 10, 0, at(5), committed=False)
    h.produce("ab", 1, 10, 1, at(5), status="aborted")
    h.record("ab", 1, 10, 1, at(5), committed=False)
    h.consume("ab", 1, 10, 1, at(5.1))
    h.sink("ab", 1, 10, 1, at(5.2))
    exp["aborted"] = [("log", "aborted", 10, "ab", 0, 0), ("log", "aborted", 10, "ab", 1, 1)]
    exp["aborted_read"] = [(G, "aborted_read", 10, "ab", 1, 1)]
    exp["unexpected_in_sink"] = [(S, "unexpected_in_sink", 10, "ab", 1, 1)]

    # p11: the group committed past offset 1 without processing it (commit-before-process crash)
    h.group_offsets = [g for g in h.group_offsets if g.partition != 11]
    h.captured(11, 0, 100, at(70), group_committed=2)
    h.watermarks.pop()
    h.clean("miss", 0, 11, 0, at(5))
    h.produce("miss", 1, 11, 1, at(6))
    h.record("miss", 1, 11, 1, at(6))
    exp["missed"] = [(G, "missed", 11, "miss", 1, 1)]

    # p12: never processed, and retention has moved past it
    h.watermarks = [w for w in h.watermarks if w.partition != 12]
    h.captured(12, 1, 2, at(70))
    h.produce("exp", 0, 12, 0, at(5))
    h.record("exp", 0, 12, 0, at(5))
    exp["expired_unconsumed"] = [(G, "expired_unconsumed", 12, "exp", 0, 0)]

    # p13: processed twice (a rebalance replayed it on consumer c2)
    h.clean("redel", 0, 13, 0, at(5))
    h.consume("redel", 0, 13, 0, at(5.5), consumer="c2")
    exp["redelivered"] = [(G, "redelivered", 13, "redel", 0, 0)]

    # p14: offset 1 processed before offset 0
    h.produce("rc", 0, 14, 0, at(5))
    h.record("rc", 0, 14, 0, at(5))
    h.produce("rc", 1, 14, 1, at(5.01))
    h.record("rc", 1, 14, 1, at(5.01))
    h.consume("rc", 1, 14, 1, at(5.1))
    h.consume("rc", 0, 14, 0, at(5.2))
    h.sink("rc", 0, 14, 0, at(5.3))
    h.sink("rc", 1, 14, 1, at(5.3))
    exp["reordered_in_consumption"] = [(G, "reordered_in_consumption", 14, "rc", 0, 0)]

    # p15: failed, then dead-lettered
    h.produce("dl", 0, 15, 0, at(5))
    h.record("dl", 0, 15, 0, at(5))
    h.consume("dl", 0, 15, 0, at(5.1), outcome="failed")
    h.consume("dl", 0, 15, 0, at(5.2), outcome="dead_lettered")
    exp["dead_lettered"] = [(G, "dead_lettered", 15, "dl", 0, 0)]

    # p16: never processed, past grace, at the group's committed offset
    h.group_offsets = [g for g in h.group_offsets if g.partition != 16]
    h.captured(16, 0, 100, at(70), group_committed=0)
    h.watermarks.pop()
    h.produce("ovd", 0, 16, 0, at(5))
    h.record("ovd", 0, 16, 0, at(5))
    exp["overdue"] = [(G, "overdue", 16, "ovd", 0, 0)]

    # p17: processed, never written to the sink
    h.produce("mis", 0, 17, 0, at(5))
    h.record("mis", 0, 17, 0, at(5))
    h.consume("mis", 0, 17, 0, at(5.1))
    exp["missing_in_sink"] = [(S, "missing_in_sink", 17, "mis", 0, 0)]

    # p18: written to the sink twice
    h.clean("dsk", 0, 18, 0, at(5))
    h.sink("dsk", 0, 18, 0, at(5.5))
    exp["duplicate_in_sink"] = [(S, "duplicate_in_sink", 18, "dsk", 0, 0)]

    # p19: a sink row for a message the log never had
    h.sink("phantom", 0, 19, 7, at(5))
    exp["unexpected_in_sink"].append((S, "unexpected_in_sink", 19, "phantom", 0, 7))

    # p20: an exactly-once sink committed the rows and g1's offsets (100) together, and the consumer
    # died before flushing its consumption rows: the rows of s1 (fed by g1) are the evidence that g1
    # processed them -- an audited message (matched by pid/seq) and an unaudited record (by offset)
    h.produce("eos", 0, 20, 0, at(5))
    h.record("eos", 0, 20, 0, at(5))
    h.sink("eos", 0, 20, 0, at(5.2))
    h.record("eosbad", None, 20, 1, at(5), header_error="audit.seq: not an integer")
    h.sink(None, None, 20, 1, at(5.2))
    exp["unaudited"].append(("log", "unaudited", 20, "eosbad", None, 1))
    exp["sink_evidence"] = []  # no missed: g1 counts both as delivered (test_oracle checks the report)

    # p21: the handler failed twice (attempt 1 on c1, attempt 2 on c2 after a rebalance) and the retry
    # copy never reached a final outcome; g1 committed past it (100), yet it is not `missed`; the
    # detail carries the last attempt's error
    h.produce("retry", 0, 21, 0, at(5))
    h.record("retry", 0, 21, 0, at(5))
    h.consume("retry", 0, 21, 0, at(5.1), outcome="failed", error="TimeoutError: db down")
    h.consume("retry", 0, 21, 0, at(5.3), outcome="failed", consumer="c2", attempt=2,
              error="KeyError: 'price'")
    exp["retry_overdue"] = [(G, "retry_overdue", 21, "retry", 0, 0)]

    # p5 again, across the window's end: seq 0 (stamped in this window) was retried and landed behind
    # seq 1, stamped in the next one (within grace: read as context)
    h.clean("reob", 1, 5, 3, at(60.1))
    h.clean("reob", 0, 5, 4, at(59.9))
    exp["reordered_in_log"].append(("log", "reordered_in_log", 5, "reob", 0, 4))

    # partition -1: two sends the producer was told failed (the topic did not exist: no partition)
    # and that never reached the log
    h.produce("fsend", 0, -1, None, at(5), status="failed")
    h.ledger.append(LedgerRow("fsend", 1, -1, None, "failed", at(5.1), error="Broker: Unknown topic or partition"))
    # ... and two more whose content the ledger fingerprinted: the application resent seq 2's (a new
    # message, produced after it, holds its fingerprint), so it is not reported; seq 3's content is
    # that of a message produced before it, which cannot be its resend
    h.ledger.append(LedgerRow("fsend", 2, -1, None, "failed", at(6), fingerprint="fp-resent"))
    h.clean("resend", 0, 5, 5, at(60.2))  # in the grace after the window: read, not judged here
    h.log[-1] = replace_fp(h.log[-1], "fp-resent")
    h.ledger.append(LedgerRow("fsend", 3, -1, None, "failed", at(8), fingerprint="fp-clean-0-0"))
    exp["failed_send"] = [("log", "failed_send", -1, "fsend", 0, None), ("log", "failed_send", -1, "fsend", 1, None),
                          ("log", "failed_send", -1, "fsend", 3, None)]
    return h, exp


def replace_fp(r: LogRecord, fp: str) -> LogRecord:
    from dataclasses import replace

    return replace(r, fingerprint=fp)


def report_row(stage: str, partition: int, as_of: datetime = AS_OF_FINAL, /, **values: Any) -> dict[str, Any]:
    """An expected report row: zeros, no latency, this stage's code columns 0 and the others NULL."""
    from audit.core.vocabulary import ANOMALY_CODES_BY_STAGE, REPORT_CODE_COLUMNS, stage_kind
    from audit.core.windows import run_id_for

    row: dict[str, Any] = {
        "window_start": T0, "window_end": T0 + timedelta(hours=1), "topic": TOPIC, "partition": partition,
        "stage": stage, "expected": 0, "delivered": 0, "lost": 0, "duplicated": 0, "reordered": 0, "pending": 0,
        "latency_p50_ms": None, "latency_p95_ms": None, "latency_p99_ms": None, "latency_max_ms": None,
        "status": "final" if as_of >= T0 + timedelta(minutes=75) else "provisional",
        "run_id": run_id_for(TOPIC, T0, as_of), "computed_at": as_of,
    }
    own = ANOMALY_CODES_BY_STAGE[stage_kind(stage)]
    for code in REPORT_CODE_COLUMNS:
        row[code] = 0 if code in own else None
    row.update(values)
    return row


# ---------------------------------------------------------------------------- the mirror stage
MIRROR = "dr"
M = f"mirror:{MIRROR}"


def mirror_topic_config(grace: timedelta = timedelta(minutes=15)) -> TopicConfig:
    """Topic t with no group or sink, copied by MM2 to a target cluster as `dc1.t` (stage mirror:dr)."""
    return TopicConfig(name=TOPIC, window=timedelta(hours=1), grace=grace,
                       mirrors=(MirrorConfig(MIRROR, {"bootstrap.servers": "127.0.0.1:1"}, f"dc1.{TOPIC}", "dc1"),))


def build_mirror_cases() -> tuple[History, dict[str, list[tuple[Any, ...]]]]:
    """One case per partition, judged as of AS_OF_FINAL; a capture of the target at 11:10 covers
    every partition except p4 (captured only at 10:10)."""
    h = History()
    exp: dict[str, list[tuple[Any, ...]]] = {}
    for p in range(7):
        h.captured(p, 0, 100, at(70))
        if p != 4:
            h.mirror_captured(p, 0, 100, at(70))
    h.mirror_captured(4, 0, 100, at(10))

    # p0: three messages, each copied once, in order (mirror latency 3 s, 4 s, 5 s)
    for i in range(3):
        h.produce("mclean", i, 0, i, at(1 + i))
        h.record("mclean", i, 0, i, at(1 + i))
        h.mirrored("mclean", i, 0, i, at(1 + i), copied_ms=3000 + 1000 * i)
    exp["mirror_clean"] = []

    # p1: committed at the source, never copied, and a target capture ran after grace
    h.produce("mlost", 0, 1, 0, at(5))
    h.record("mlost", 0, 1, 0, at(5))
    h.mirrored("mlost", 0, 1, 0, at(5))
    h.produce("mlost", 1, 1, 1, at(6))
    h.record("mlost", 1, 1, 1, at(6))
    exp["lost_in_mirror"] = [(M, "lost_in_mirror", 1, "mlost", 1, 1)]

    # p2: MM2 restarted before flushing its source offsets and copied offsets 0-1 again (target 2, 3)
    for i in range(2):
        h.produce("mdup", i, 2, i, at(5 + i))
        h.record("mdup", i, 2, i, at(5 + i))
        h.mirrored("mdup", i, 2, i, at(5 + i))
        h.mirrored("mdup", i, 2, 2 + i, at(5 + i), copied_ms=9000)
    exp["duplicate_in_mirror"] = [(M, "duplicate_in_mirror", 2, "mdup", 0, 2), (M, "duplicate_in_mirror", 2, "mdup", 1, 3)]

    # p3: source offsets 0, 1 landed on the target as 1, 0
    for i in range(2):
        h.produce("mreo", i, 3, i, at(5 + i))
        h.record("mreo", i, 3, i, at(5 + i))
        h.mirrored("mreo", i, 3, 1 - i, at(5 + i))
    # and across the window's end: source offset 2 (stamped in this window) was copied after source
    # offset 3, stamped in the next one (within grace: read as context)
    for i, t in ((0, at(59.9)), (1, at(60.1))):
        h.produce("mreob", i, 3, 2 + i, t)
        h.record("mreob", i, 3, 2 + i, t)
        h.mirrored("mreob", i, 3, 3 - i, t)
    exp["reordered_in_mirror"] = [(M, "reordered_in_mirror", 3, "mreo", 0, 1),
                                  (M, "reordered_in_mirror", 3, "mreob", 0, 3)]

    # p4: never copied, but the last capture of the target partition ran before produce time + grace
    h.produce("mnocap", 0, 4, 0, at(5))
    h.record("mnocap", 0, 4, 0, at(5))
    exp["mirror_pending_uncovered"] = [(M, "pending", 4, "mnocap", 0, 0)]

    # p5: an unaudited record (not expected in the copy: no identity across clusters) and an
    # aborted record (never expected downstream); only the log stage reports them
    h.record("mbad", None, 5, 0, at(5), header_error="audit.seq: not an integer")
    h.produce("mab", 0, 5, 1, at(5), status="aborted")
    h.record("mab", 0, 5, 1, at(5), committed=False)
    exp["mirror_not_expected"] = [("log", "unaudited", 5, "mbad", None, 0), ("log", "aborted", 5, "mab", 0, 1)]

    # p6: beside a delivered message, a copy on the target of a message the source log does not hold
    # (written to the target by something else): the mirror stage judges source messages only
    h.produce("mok", 0, 6, 0, at(5))
    h.record("mok", 0, 6, 0, at(5))
    h.mirrored("mok", 0, 6, 0, at(5))
    h.mirrored("stranger", 0, 6, 1, at(5))
    exp["mirror_copy_without_source"] = []
    return h, exp


SHARE_GROUP = "q1"
SHARE_DLQ = "dlq.q1"  # q1's dead-letter topic: its records' rows have it as their consumer
Q = f"share:{SHARE_GROUP}"


def share_topic_config(grace: timedelta = timedelta(minutes=15), limit: int = 3) -> TopicConfig:
    """Topic t read by consumer group g1 and share group q1 (delivery limit `limit`), no sink."""
    return TopicConfig(name=TOPIC, window=timedelta(hours=1), grace=grace, groups=(GROUP,),
                       share_groups=(ShareGroupConfig(SHARE_GROUP, limit),))


def build_share_cases() -> tuple[History, dict[str, list[tuple[Any, ...]]]]:
    """One case per partition of share group q1 (limit 3), judged as of AS_OF_FINAL; group g1
    processed every record once (no group anomaly)."""
    h = History()
    exp: dict[str, list[tuple[Any, ...]]] = {}

    def msg(pid: str, p: int, o: int, t: datetime) -> None:
        h.produce(pid, 0, p, o, t)
        h.record(pid, 0, p, o, t)
        h.consume(pid, 0, p, o, t + timedelta(seconds=1))

    def share(pid: str | None, p: int, o: int, t: datetime, outcome: str, member: str = "m1", count: int = 1,
              error: str | None = None) -> None:
        h.consume(pid, None if pid is None else 0, p, o, t, outcome, group=SHARE_GROUP, consumer=member,
                  attempt=count, error=error)

    for p in range(13):
        h.captured(p, 0, 100, at(70))
    # p0: delivered once, accepted
    msg("sclean", 0, 0, at(1))
    share("sclean", 0, 0, at(1.1), "acquired")
    share("sclean", 0, 0, at(1.2), "accepted")
    exp["share_clean"] = []
    # p1: released by m1, delivered again to m2 and accepted
    msg("srel", 1, 0, at(2))
    share("srel", 1, 0, at(2.1), "acquired")
    share("srel", 1, 0, at(2.2), "released")
    share("srel", 1, 0, at(2.3), "acquired", "m2", 2)
    share("srel", 1, 0, at(2.4), "accepted", "m2", 2)
    exp["share_redelivered"] = [(Q, "redelivered", 1, "srel", 0, 0)]
    # p2: m1 was slower than the lock: its accept was refused, m2 got it again and accepted
    msg("stwice", 2, 0, at(3))
    share("stwice", 2, 0, at(3.1), "acquired")
    share("stwice", 2, 0, at(3.6), "acquired", "m2", 2)
    share("stwice", 2, 0, at(3.7), "accepted", "m2", 2)
    share("stwice", 2, 0, at(3.8), "accepted", "m1", 1, error="INVALID_RECORD_STATE")
    exp["share_processed_twice"] = [(Q, "redelivered", 2, "stwice", 0, 0), (Q, "processed_twice", 2, "stwice", 0, 0)]
    # p3: a poison record, rejected
    msg("srej", 3, 0, at(4))
    share("srej", 3, 0, at(4.1), "acquired")
    share("srej", 3, 0, at(4.2), "rejected")
    exp["share_rejected"] = [(Q, "rejected", 3, "srej", 0, 0)]
    # p4: released at every delivery until the limit (3): archived
    msg("sarc", 4, 0, at(5))
    for k in (1, 2, 3):
        share("sarc", 4, 0, at(5 + k / 10), "acquired", count=k)
        share("sarc", 4, 0, at(5.05 + k / 10), "released", count=k)
    exp["share_archived"] = [(Q, "redelivered", 4, "sarc", 0, 0), (Q, "redelivered", 4, "sarc", 0, 0),
                             (Q, "archived_unprocessed", 4, "sarc", 0, 0)]
    # p5: never handed to a member, past grace: overdue; a share row of an unknown outcome (not used)
    msg("snone", 5, 0, at(6))
    share("snone", 5, 0, at(6.1), "renewed")
    exp["share_overdue"] = [(Q, "overdue", 5, "snone", 0, 0)]
    # p6: acquired, the accept refused (lock expired), not delivered again yet: overdue
    msg("sref", 6, 0, at(7))
    share("sref", 6, 0, at(7.1), "acquired")
    share("sref", 6, 0, at(7.9), "accepted", error="INVALID_RECORD_STATE")
    exp["share_refused_only"] = [(Q, "overdue", 6, "sref", 0, 0)]
    # p7: an aborted record a member acquired: not expected at the share stage
    h.produce("sab", 0, 7, 0, at(8), status="aborted")
    h.record("sab", 0, 7, 0, at(8), committed=False)
    share("sab", 7, 0, at(8.1), "acquired")
    exp["share_aborted"] = [("log", "aborted", 7, "sab", 0, 0)]
    # p8: offsets 0 and 1 never handed to a member; the group's start offset was none (a capture
    # before the group read the partition), then 1, then 2 (the latest): both missed; offset 2, handed
    # and accepted, is delivered
    for o, pid in enumerate(("smissA", "smissB", "smissC")):
        msg(pid, 8, o, at(9 + o / 10))
    share("smissC", 8, 2, at(9.3), "acquired")
    share("smissC", 8, 2, at(9.4), "accepted")
    h.share_offsets += [ShareOffset(SHARE_GROUP, 8, None, at(40)), ShareOffset(SHARE_GROUP, 8, 1, at(50)),
                        ShareOffset(SHARE_GROUP, 8, 2, at(70))]
    exp["share_missed"] = [(Q, "missed", 8, "smissA", 0, 0), (Q, "missed", 8, "smissB", 0, 1)]
    # p9: below the start offset but handed (acquired, never answered): overdue, not missed; offset 1,
    # never handed but at the start offset: overdue; another share group's start offset is not g's
    msg("shandA", 9, 0, at(10))
    share("shandA", 9, 0, at(10.1), "acquired")
    msg("shandB", 9, 1, at(10.2))
    h.share_offsets += [ShareOffset(SHARE_GROUP, 9, 1, at(50)), ShareOffset("q2", 9, 5, at(70))]
    exp["share_handed_below_start"] = [(Q, "overdue", 9, "shandA", 0, 0), (Q, "overdue", 9, "shandB", 0, 1)]
    # p10: a poison record rejected, and the broker wrote it to the group's dead-letter topic
    # (KIP-1191): a record of that topic naming it, placed by its Kafka timestamp
    msg("sdlq", 10, 0, at(9))
    share("sdlq", 10, 0, at(9.1), "acquired")
    share("sdlq", 10, 0, at(9.2), "rejected")
    share("sdlq", 10, 0, at(9.3), "dead_lettered", SHARE_DLQ, 1, error="Offset rejected by client.")
    exp["share_dead_lettered_rejected"] = [(Q, "dead_lettered", 10, "sdlq", 0, 0)]
    # p11: released until the limit, then dead-lettered by the broker instead of lost
    msg("sdla", 11, 0, at(10))
    for k in (1, 2, 3):
        share("sdla", 11, 0, at(10 + k / 10), "acquired", count=k)
        share("sdla", 11, 0, at(10.05 + k / 10), "released", count=k)
    share("sdla", 11, 0, at(10.4), "dead_lettered", SHARE_DLQ, 3, error="Offset delivery count exceeded the threshold.")
    exp["share_dead_lettered_archived"] = [(Q, "redelivered", 11, "sdla", 0, 0), (Q, "redelivered", 11, "sdla", 0, 0),
                                           (Q, "dead_lettered", 11, "sdla", 0, 0)]
    # p12: a dead-letter record naming a position the log never held (no message): quarantined
    share(None, 12, 50, at(11), "dead_lettered", SHARE_DLQ, 1, error="Offset rejected by client.")
    return h, exp


def arrow_tables(inputs: Inputs, coded: bool = False) -> Any:
    """The oracle's inputs as the kernel's `Tables` (Arrow columns named as the row fields, times as
    UTC microseconds, as Spark hands them over); `coded`: every string column but the fingerprint
    dictionary encoded in two pieces, each with a dictionary of its own (as the settling tasks read
    them from Parquet files)."""
    import typing
    from dataclasses import fields as dc_fields

    import pyarrow as pa

    from audit import oracle
    from audit.rules.kernel import Tables

    kinds = {str: pa.string(), int: pa.int64(), bool: pa.bool_(), datetime: pa.timestamp("us", "UTC")}

    def table(cls: type, rows: Sequence[Any]) -> pa.Table:
        hints = typing.get_type_hints(cls)
        schema = pa.schema([(f.name, kinds[next(a for a in typing.get_args(hints[f.name]) or (hints[f.name],)
                                                 if a is not type(None))]) for f in dc_fields(cls)])
        t = pa.Table.from_pylist([{f.name: getattr(r, f.name) for f in dc_fields(cls)} for r in rows], schema)
        return pieces(t) if coded else t

    def pieces(t: pa.Table) -> pa.Table:
        half = t.num_rows // 2
        for i, f in enumerate(t.schema):
            if f.type == pa.string() and f.name != "fingerprint":
                col = t[f.name].combine_chunks()
                t = t.set_column(i, f.name, pa.chunked_array([col[:half].dictionary_encode(),
                                                             col[half:].dictionary_encode()]))
        return t

    return Tables(ledger=table(oracle.LedgerRow, inputs.ledger), log=table(oracle.LogRecord, inputs.log),
                  consumed=table(oracle.ConsumedRow, inputs.consumed),
                  sinks={name: table(oracle.SinkRow, rows) for name, rows in inputs.sinks.items()},
                  group_offsets=inputs.group_offsets, watermarks=inputs.watermarks,
                  mirror_log=table(oracle.MirrorRecord, inputs.mirror_log),
                  mirror_watermarks=inputs.mirror_watermarks, mirror_group_offsets=inputs.mirror_group_offsets,
                  share_offsets=inputs.share_offsets)


def classify_in_chunks(topics: Sequence[Any], ws: datetime, as_of: datetime, tables: Any, n: int) -> Any:
    """The kernel over `tables` split into `n` chunks by message as the Spark job splits a window
    (`spark_jobs/reconcile/settle.py`): a row with a message identity to the chunk of its seq (ranges
    cut at the ledger's seqs), a row without one to chunk 0, a consumer's `committed` row on the audited cluster to
    every chunk, a mirrored topic's rows to chunk 0; the order of consumption's flags computed over
    the whole window first (`_flag`). Each chunk settled alone, then `classify_parts`."""
    import bisect

    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    from audit.rules import kernel

    mirrored = {tc.name for tc in topics if tc.mirrors}
    consumed = tables.consumed
    if consumed is not None:
        flag = np.zeros(consumed.num_rows, dtype=bool)
        for tc in topics:
            flag |= kernel.flag_processings(consumed, tc, ws)
        consumed = consumed.append_column("_flag", pa.array(flag))

    # the cuts: the ledger's distinct seqs at n - 1 evenly spaced ranks
    seqs = sorted({s for s in tables.ledger["seq"].to_pylist() if s is not None})
    cuts = sorted({seqs[len(seqs) * k // n] for k in range(1, n)}) if seqs else []

    def chunks(t: Any, identified: Any, everywhere: Any = None) -> list[Any]:
        ids = []
        for r, ok in zip(t.to_pylist(), identified, strict=True):
            ids.append(0 if not ok or r["topic"] in mirrored else bisect.bisect_right(cuts, r["seq"]))
        ids_a = np.array(ids, dtype=np.int64)
        every = np.zeros(t.num_rows, dtype=bool) if everywhere is None else np.asarray(everywhere)
        return [t.filter(pa.array((ids_a == k) | every)) for k in range(n)]

    def ident(t: Any, extra: Any = None) -> Any:
        ok = pc.and_(pc.is_valid(t["pid"]), pc.is_valid(t["seq"]))
        return pc.fill_null(ok if extra is None else pc.and_(ok, extra), False).to_pylist()

    ledger = chunks(tables.ledger, ident(tables.ledger))
    log = chunks(tables.log, ident(tables.log, pc.is_null(tables.log["header_error"])))
    con = chunks(consumed, ident(consumed), pc.fill_null(pc.and_(pc.equal(consumed["outcome"], "committed"),
                                                                  pc.is_null(consumed["cluster"])), False)
                 .to_numpy(zero_copy_only=False)) if consumed is not None else [None] * n
    sinks = {name: chunks(t, ident(t)) for name, t in tables.sinks.items()}
    mlog = tables.mirror_log
    parts = [kernel.Tables(ledger=ledger[k], log=log[k], consumed=con[k], sinks={s: c[k] for s, c in sinks.items()},
                           group_offsets=tables.group_offsets, watermarks=tables.watermarks,
                           mirror_log=mlog if k == 0 else None, mirror_watermarks=tables.mirror_watermarks,
                           mirror_group_offsets=tables.mirror_group_offsets, share_offsets=tables.share_offsets)
             for k in range(n)]
    return {tc.name: kernel.classify_parts(tc, ws, as_of, [kernel.settle(tc, ws, as_of, p) for p in parts])
            for tc in topics}
