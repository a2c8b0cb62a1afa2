"""Stage `mirror:<m>` (docs/design.md §5.5): a topic copied by MirrorMaker 2 to another cluster,
captured there into `mirror_records` / `mirror_watermarks`, judged against the source's committed
log. `mirror_x` turns one window's visible inputs into X rows (`sql.X_FIELDS`: kind 'F' = one
message's facts at the stage, kind 'A' = one anomaly row) that the window's summary takes with the
other stages' rows; the rules are the oracle's (`audit/oracle.py`, stage mirror), restated here as
DataFrame steps:

- unit: each validly audited message (pid, seq) with a committed copy in the source log and its
  produce time in the window; its original copy (at the acked offset, else the lowest) gives the
  report partition; its produce time is the other stages' (ledger, else log audit.ts, kafka_ts,
  captured_at);
- its copies: committed, validly audited rows of `mirror_records` of that mirror with the same
  (pid, seq), in (partition, offset) order;
- facts: expected 1; delivered when it has a copy (latency = the earliest copy's `kafka_ts` minus
  produce time); otherwise `pending` within grace or while no capture of the target partition ran
  at or after produce time + grace, else `lost_in_mirror`;
- `duplicate_in_mirror` for every copy after the first; `reordered_in_mirror` per target
  partition over first copies (of messages from the same source partition) in target offset order.

This module must not read or write tables (`inputs.py` does) or spell out a detail text (they come
from the vocabulary through `sql.detail_sql`).
"""

from __future__ import annotations

from datetime import datetime, timedelta

from pyspark.sql import Column, DataFrame, Window
from pyspark.sql import functions as F

from audit.core.config import MirrorConfig, TopicConfig
from audit.core.vocabulary import ACKED, MIRROR, mirror_stage
from audit.core.windows import EPOCH, read_ranges
from spark_jobs.io.session import local_frame
from spark_jobs.reconcile.sql import _f, _q, anomaly_sql

_US = timedelta(microseconds=1)


def to_micros(t: datetime) -> int:
    return (t - EPOCH) // _US


def _between(col: Column, lo: datetime, hi: datetime) -> Column:
    return (col >= F.lit(lo)) & (col < F.lit(hi))


def _valid(df: DataFrame) -> DataFrame:
    return df.where(F.col("header_error").isNull() & F.col("pid").isNotNull() & F.col("seq").isNotNull())


def mirror_sql(m: MirrorConfig) -> dict[str, str]:
    """The X rows of one mirror as SQL over a unit row (`UNIT_X`) or a copy row (`DUPLICATE_X`,
    `REORDERED_X`); codes and detail texts from the vocabulary."""
    stage, mt = _q(mirror_stage(m.name)), _q(m.topic)
    lost = anomaly_sql(stage, MIRROR, "lost_in_mirror", "op", "pid", "seq", "oo", mirror_topic=mt)
    pending = anomaly_sql(stage, MIRROR, "pending", "op", "pid", "seq", "oo", mirror_topic=mt)
    fact = _f(stage, "op", "1", "CASE WHEN n > 0 THEN 1 ELSE 0 END", "0",
              "CASE WHEN n > 0 THEN (unix_micros(first_kts) - pt_us) / 1000D END")
    return {
        "UNIT_X": (f"CASE WHEN n > 0 THEN array({fact}) "
                   f"WHEN as_of_us < pt_us + grace_us OR NOT covered THEN array({fact}, {pending}) "
                   f"ELSE array({fact}, {lost}) END"),
        "DUPLICATE_X": anomaly_sql(stage, MIRROR, "duplicate_in_mirror", "partition", "pid", "seq", "offset",
                                   orig_partition="first_partition", orig_offset="first_offset", mirror_topic=mt),
        "REORDERED_X": anomaly_sql(stage, MIRROR, "reordered_in_mirror", "partition", "pid", "seq", "offset",
                                   late_offset="oo", high_offset="high"),
    }


def source_units(ledger: DataFrame, log: DataFrame) -> DataFrame:
    """(pid, seq, op, oo, pt_us) of every validly audited message with a committed copy in the
    visible source log: its original copy (op, oo) and its produce time (microseconds)."""
    vlog = _valid(log)
    times = vlog.groupBy("pid", "seq").agg(F.min("produce_ts").alias("g_pt"), F.min("kafka_ts").alias("g_kts"),
                                           F.min("captured_at").alias("g_cap"))
    led = ledger.groupBy("pid", "seq").agg(
        F.min("produce_ts").alias("l_pt"),
        F.min(F.when(F.col("status") == ACKED, F.struct("partition", "offset"))).alias("ack"))
    copies = vlog.where("committed").select("pid", "seq", "partition", "offset").distinct()
    at_ack = (F.col("ack.partition") == F.col("partition")) & (F.col("ack.offset") == F.col("offset"))
    orig = (copies.join(led.select("pid", "seq", "ack"), ["pid", "seq"], "left")
            .groupBy("pid", "seq")
            .agg(F.min(F.when(at_ack, F.struct("partition", "offset"))).alias("at_ack"),
                 F.min(F.struct("partition", "offset")).alias("lowest"))
            .select("pid", "seq", F.coalesce("at_ack", "lowest").alias("o")))
    pt = F.coalesce("l_pt", "g_pt", "g_kts", "g_cap")
    return (orig.join(times, ["pid", "seq"]).join(led.select("pid", "seq", "l_pt"), ["pid", "seq"], "left")
            .select("pid", "seq", F.col("o.partition").alias("op"), F.col("o.offset").alias("oo"),
                    F.unix_micros(pt).alias("pt_us")))


def mirror_copies(mirror_log: DataFrame, tc: TopicConfig, m: MirrorConfig, ws: datetime) -> DataFrame:
    """The visible committed, audited copies of one mirror, numbered per message in (partition,
    offset) order: (pid, seq, partition, offset, kafka_ts, k, n, first_partition, first_offset, first_kts)."""
    rr = read_ranges(tc, ws)
    natural = F.coalesce("produce_ts", "kafka_ts", "captured_at")
    rows = _valid(mirror_log.where((F.col("mirror") == m.name) & (F.col("topic") == tc.name)
                                   & _between(natural, rr.message_lo, rr.message_hi) & F.col("committed")))
    rows = rows.drop("captured_at").dropDuplicates()
    by_msg = Window.partitionBy("pid", "seq")
    ordered = by_msg.orderBy("partition", "offset")
    first = F.first(F.struct("partition", "offset", "kafka_ts")).over(
        ordered.rowsBetween(Window.unboundedPreceding, Window.unboundedFollowing))
    return rows.select("pid", "seq", "partition", "offset", "kafka_ts",
                       F.row_number().over(ordered).alias("k"), F.count(F.lit(1)).over(by_msg).alias("n"),
                       first.alias("first"))


def mirror_x(ledger: DataFrame, log: DataFrame, mirror_log: DataFrame | None, mirror_watermarks: DataFrame | None,
             tc: TopicConfig, ws: datetime, as_of: datetime) -> DataFrame | None:
    """X rows of every mirror stage of the topic for one window (None when it has no mirror).
    `ledger` is the valid visible ledger, `log` the visible source log (`inputs.restrict`)."""
    if not tc.mirrors:
        return None
    units = source_units(ledger, log)
    topic = F.lit(tc.name)  # X rows carry their topic (a window's topics share one plan)
    ws_us, we_us = to_micros(ws), to_micros(ws + tc.window)
    in_w = (F.col("pt_us") >= ws_us) & (F.col("pt_us") < we_us)
    out: list[DataFrame] = []
    for m in tc.mirrors:
        sql = mirror_sql(m)
        empty_copies = "pid string, seq bigint, partition int, offset bigint, kafka_ts timestamp, k int, n bigint, " \
                       "first struct<partition:int,offset:bigint,kafka_ts:timestamp>"
        copies = (mirror_copies(mirror_log, tc, m, ws) if mirror_log is not None
                  else local_frame(units.sparkSession, [], empty_copies))
        if mirror_watermarks is not None:
            last_capture = (mirror_watermarks.where((F.col("mirror") == m.name) & (F.col("topic") == tc.name))
                            .groupBy("partition").agg(F.unix_micros(F.max("captured_at")).alias("cap_us")))
        else:
            last_capture = local_frame(units.sparkSession, [], "partition int, cap_us bigint")
        firsts = copies.where("k = 1").select("pid", "seq", "n", F.col("kafka_ts").alias("first_kts"))
        per_unit = (units.where(in_w).join(firsts, ["pid", "seq"], "left")
                    .join(F.broadcast(last_capture.withColumnRenamed("partition", "op")), ["op"], "left")
                    .select("*", F.coalesce("n", F.lit(0)).alias("_n")).drop("n").withColumnRenamed("_n", "n")
                    .withColumns({"as_of_us": F.lit(to_micros(as_of)), "grace_us": F.lit(int(tc.grace / _US))})
                    .withColumn("covered", F.coalesce(F.col("cap_us") >= F.col("pt_us") + F.col("grace_us"),
                                                      F.lit(False))))
        out.append(per_unit.withColumn("topic", topic).select(F.explode(F.expr(sql["UNIT_X"])).alias("x")).select("x.*"))
        dups = (copies.where("k > 1").join(units.where(in_w).select("pid", "seq"), ["pid", "seq"], "left_semi")
                .select("*", F.col("first.partition").alias("first_partition"),
                        F.col("first.offset").alias("first_offset")))
        out.append(dups.withColumn("topic", topic).select(F.expr(sql["DUPLICATE_X"]).alias("x")).select("x.*"))
        # order: per target partition, first copies of messages of the same source partition, by target offset
        by_target = Window.partitionBy("partition").orderBy("offset").rowsBetween(Window.unboundedPreceding, -1)
        firsts_o = (copies.where("k = 1").join(units, ["pid", "seq"])
                    .where(F.col("op") == F.col("partition"))
                    .withColumn("high", F.max("oo").over(by_target)))
        late = firsts_o.where((F.col("oo") < F.col("high")) & in_w)
        out.append(late.withColumn("topic", topic).select(F.expr(sql["REORDERED_X"]).alias("x")).select("x.*"))
    result = out[0]
    for df in out[1:]:
        result = result.unionByName(df)
    return result

