"""Units (docs/design.md §5: a message (topic, pid, seq), or an unaudited record by (partition, offset)) and
their tiers (ledger, log, consumption, sinks), keyed for the two paths of the classifier:

- the order of consumption (`flag_consumption_order`, `reordered_processings`, `with_reorder`);
- the typed path: `typed_tiers` + `typed_units`, fixed-width aggregates per unit, and `unit_keys`;
- the general path: `unit_tiers` + `collect_units` (each unit's rows as arrays) + `describe_units`
  (produce time, ledger status, committed copies, the original copy).

These are transforms (DataFrames in, DataFrames out) plus `collect_units`' one count. This module
must not read or write tables, and holds no rule deciding an anomaly code (`classify.py`,
`order.py`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pyspark.sql import DataFrame, Window
from pyspark.sql import functions as F

from audit.core.vocabulary import ABORTED, ACKED, LEDGER_STATUS_PRECEDENCE, PROCESSED
from spark_jobs.reconcile.params import Shape, with_params
from spark_jobs.reconcile.sql import _q

ORDER_COLUMNS = ("topic", "group", "partition", "offset", "consume_ts", "consume_seq", "consumer")


def reordered_processings(consumed: DataFrame) -> DataFrame:
    """The processings that go backwards (`reordered_in_consumption`) -- few -- by their
    identifying columns and unit key: per (topic, group, partition), the first processing of an
    offset lower than one the group already processed, in (consume_ts, consume_seq, consumer)
    order. Put the other way round, the first processing of an offset is flagged when a processing
    of a higher offset came before it; so one sort of the processings by offset, highest first, and
    consume order gives both tests in one pass: the running minimum of the consume order over the
    higher offsets, and whether the row before has the same offset. The narrow projection of the
    processings is hashed once by (topic, group, partition), so both windows share one exchange
    and one sort."""
    order = F.struct("consume_ts", "consume_seq", "consumer")
    part = ("partition", "group", "topic")  # the int first: the sort compares it before the strings
    earlier_above = Window.partitionBy(*part).orderBy(F.col("offset").desc()).rangeBetween(
        Window.unboundedPreceding, -1)  # the processings of strictly higher offsets
    in_order = Window.partitionBy(*part).orderBy(F.col("offset").desc(), "consume_ts", "consume_seq", "consumer")
    return (consumed.where(F.col("outcome") == PROCESSED)
            .select(*ORDER_COLUMNS, "pid", "seq").repartition(*part)
            .withColumn("_prev", F.lag("offset").over(in_order))
            .withColumn("_first_above", F.min(order).over(earlier_above))
            .where((F.col("_prev").isNull() | (F.col("_prev") != F.col("offset"))) & (F.col("_first_above") < order))
            .select(*ORDER_COLUMNS, *_key("pid", "seq", "partition", "offset")).distinct())


def flag_consumption_order(consumed: DataFrame) -> DataFrame:
    """Adds `reorder` to every consumption row: true for the processings `reordered_processings` flags."""
    return with_reorder(consumed, reordered_processings(consumed))


def with_reorder(consumed: DataFrame, flagged: DataFrame) -> DataFrame:
    """`consumed` plus `reorder`, looked up in the flagged processings (a small broadcast)."""
    marks = flagged.select(*ORDER_COLUMNS).distinct().withColumn("_flag", F.lit(True))
    return (consumed.join(F.broadcast(marks), list(ORDER_COLUMNS), "left")
            .withColumn("reorder", F.coalesce(F.col("_flag"), F.lit(False))).drop("_flag"))


def _key(pid: str, seq: str, partition: str, offset: str) -> list[Any]:
    audited = F.col(pid).isNotNull() & F.col(seq).isNotNull()
    return [F.when(audited, 0).otherwise(1).alias("ktype"),
            F.when(audited, F.col(pid)).otherwise(
                F.concat(F.lit("#"), F.col(partition).cast("string"), F.lit(":"), F.col(offset).cast("string"))
            ).alias("k1"),
            F.when(audited, F.col(seq)).otherwise(F.col(offset)).cast("bigint").alias("k2")]


KEY = ["topic", "ktype", "k1", "k2"]  # a unit: its topic, then docs/design.md §5.1's key

TIER_TYPES = {
    "L": "struct<partition:int,offset:bigint,status:string,produce_ts:timestamp,ack_ts:timestamp>",
    "R": "struct<partition:int,offset:bigint,committed:boolean,pid:string,seq:bigint,produce_ts:timestamp,"
         "kafka_ts:timestamp,fingerprint:string,header_error:string,captured_at:timestamp>",
    "C": "struct<consume_ts:timestamp,consume_seq:bigint,consumer:string,group:string,partition:int,"
         "offset:bigint,outcome:string,reorder:boolean,attempt:int,error:string,cluster:string>",
    "S": "struct<sink:string,sink_ts:timestamp,offset:bigint,partition:int,pid:string,seq:bigint>",
}


def unit_tiers(ledger: DataFrame, log: DataFrame, consumed: DataFrame | None,
               sinks: DataFrame | None, where: Callable[[DataFrame], DataFrame] | None = None) -> DataFrame:
    """Every tier's rows as (topic, ktype, k1, k2, L|R|C|S struct), ready to be gathered per unit.
    `sinks`: every sink's rows with their sink's name in `sink` (`sink_rows`). `where`: keeps only
    some rows, given each table's rows with their key (topic, ktype, k1, k2) beside their own
    columns -- applied before the tier structs are built, so the rows it drops cost no copy."""

    def shape(df: DataFrame, key: list[Any], tier: str, struct: Any) -> DataFrame:
        if where is not None:
            df = where(df.select("*", *key))
            key = ["ktype", "k1", "k2"]
        return df.select("topic", *key, *[(struct if c == tier else F.lit(None)).cast(t).alias(c)
                                 for c, t in TIER_TYPES.items()])

    parts = [
        shape(ledger, [F.lit(0).alias("ktype"), F.col("pid").alias("k1"), F.col("seq").cast("bigint").alias("k2")],
              "L", F.struct("partition", "offset", "status", "produce_ts", "ack_ts")),
    ]
    valid = F.col("header_error").isNull() & F.col("pid").isNotNull() & F.col("seq").isNotNull()
    log_k = log.withColumn("_kpid", F.when(valid, F.col("pid"))).withColumn("_kseq", F.when(valid, F.col("seq")))
    parts.append(shape(log_k, _key("_kpid", "_kseq", "partition", "offset"), "R",
                       F.struct("partition", "offset", "committed", "pid", "seq", "produce_ts", "kafka_ts",
                                "fingerprint", "header_error", "captured_at")))
    if consumed is not None:
        parts.append(shape(consumed, _key("pid", "seq", "partition", "offset"), "C",
                           F.struct("consume_ts", "consume_seq", "consumer", "group", "partition", "offset",
                                    "outcome", "reorder", "attempt", "error", "cluster")))
    if sinks is not None:
        parts.append(shape(sinks, _key("pid", "seq", "partition", "offset"), "S",
                           F.struct("sink", "sink_ts", "offset", "partition", "pid", "seq")))
    out = parts[0]
    for p in parts[1:]:
        out = out.unionByName(p)
    return out


def unit_hash() -> Any:
    """A unit key's 64-bit hash: what the shuffles by unit hash by and sort by first."""
    return F.xxhash64("topic", "ktype", "k1", "k2")


# Up to this many non-ordinary units, their key hashes are broadcast to filter the tiers (8 bytes
# and a slot each); beyond it (an outage can make every unit non-ordinary) the tiers are
# semi-joined by shuffle instead, which costs a shuffle of every row but no driver memory.
BROADCAST_KEYS_MAX = 2_000_000


def collect_units(tiers: DataFrame, keys: DataFrame) -> DataFrame:
    """The general path's shuffle, for the units in `keys` (topic, ktype, k1, k2; one row each) only: the
    tiers' rows whose unit hash is one of the keys' pass a semi-join on those hashes (a broadcast
    of one long per unit, unless there are more than `BROADCAST_KEYS_MAX`), are hashed by k1 (the
    pid) and gathered per unit and tier; a unit that only shares a hash with one of `keys` is then
    dropped by an exact join on the whole key."""
    hashes = keys.select(unit_hash().alias("kh"))
    if keys.count() <= BROADCAST_KEYS_MAX:
        hashes = F.broadcast(hashes)
    units = gather_units(tiers.withColumn("kh", unit_hash()).join(hashes, "kh", "left_semi"))
    return units.join(keys, [units[c].eqNullSafe(keys[c]) for c in KEY], "left_semi")


def gather_units(tiers: DataFrame) -> DataFrame:
    """`unit_tiers` rows (with their unit hash `kh`) gathered into one row per unit and tier arrays:
    hashed by k1 (the pid), one aggregation."""
    # kh leads the grouping key: the aggregation sorts by it when its hash map spills (always, at
    # scale), and a long compares by its sort prefix alone where (ktype, k1) would compare strings.
    return (tiers.repartition("k1")
            .groupBy("kh", *KEY)
            .agg(*[F.collect_list(c).alias(c) for c in ("L", "R", "C", "S")])
            .drop("kh"))


def _fp_hash(fp: Any) -> list[Any]:
    """Two independent hashes of a fingerprint (96 bits together; null for a null fingerprint):
    the typed path compares fingerprints by them, so no string travels through its aggregation."""
    return [F.when(fp.isNotNull(), F.xxhash64(fp)).alias("fph"), F.when(fp.isNotNull(), F.hash(fp)).alias("fph2")]


def typed_tiers(ledger: DataFrame, log: DataFrame | None, consumed: DataFrame | None,
                sinks: DataFrame | None, shape: Shape) -> DataFrame:
    """Every tier's rows as narrow fixed-width columns keyed like `unit_tiers`: what `typed_units`
    needs to recognise an ordinary delivered message and compute its facts without arrays. A
    consumption row's `gi` is its group's position in its topic's groups, a sink row's its sink's
    position in its topic's sinks (`Shape`: looked up per row, so topics share the plan). A
    consumption or sink row's `ts2` is the produce time it carries (null without one, §4.2). `log`
    None: no log records (`blocks.window_tiers` needs none)."""
    us = F.unix_micros
    none_l, none_i = F.lit(None).cast("bigint"), F.lit(None).cast("int")
    cols = ("t", "st", "part", "off", "ts1", "ts2", "ok", "gi", "fph", "fph2")

    def shape_(df: DataFrame, key: list[Any], **c: Any) -> DataFrame:
        defaults = {"st": none_i, "part": none_i, "off": none_l, "ts1": none_l, "ts2": none_l,
                    "ok": F.lit(None).cast("boolean"), "gi": none_i, "fph": none_l, "fph2": none_i}
        defaults.update(c)
        return df.select("topic", *key,
                         *[defaults[n].alias(n) if n != "t" else F.lit(c["t"]).alias("t") for n in cols])

    st = (F.when(F.col("status") == ACKED, 1).when(F.col("status") == ABORTED, 3)
          .otherwise(2).cast("int"))
    parts = [shape_(ledger, [F.lit(0).alias("ktype"), F.col("pid").alias("k1"), F.col("seq").cast("bigint").alias("k2")],
                    t=0, st=st, part=F.col("partition"), off=F.col("offset"), ts1=us("produce_ts"), ts2=us("ack_ts"))]
    if log is not None:
        valid = F.col("header_error").isNull() & F.col("pid").isNotNull() & F.col("seq").isNotNull()
        log_k = log.withColumn("_kpid", F.when(valid, F.col("pid"))).withColumn("_kseq", F.when(valid, F.col("seq")))
        fph, fph2 = _fp_hash(F.col("fingerprint"))
        parts.append(shape_(log_k, _key("_kpid", "_kseq", "partition", "offset"), t=1, part=F.col("partition"),
                            off=F.col("offset"), ts1=us("produce_ts"), ok=F.col("committed"), fph=fph, fph2=fph2))
    def produced(df: DataFrame) -> Any:  # the optional produce time a consumer or sink carries (§4.2)
        return us("produce_ts") if "produce_ts" in df.columns else none_l

    if consumed is not None and shape.max_groups:
        parts.append(shape_(consumed, _key("pid", "seq", "partition", "offset"), t=2, part=F.col("partition"),
                            off=F.col("offset"), ts1=us("consume_ts"), ts2=produced(consumed),
                            # a processing on a mirror's target copy (failover) is never ordinary
                            ok=(F.col("outcome") == PROCESSED) & F.col("cluster").isNull(),
                            gi=shape.group_index()))
    if sinks is not None and shape.max_sinks:
        parts.append(shape_(sinks, _key("pid", "seq", "partition", "offset"), t=3, part=F.col("partition"),
                            off=F.col("offset"), ts1=us("sink_ts"), ts2=produced(sinks), gi=shape.sink_index()))
    out = parts[0]
    for p in parts[1:]:
        out = out.unionByName(p)
    return out


def typed_units(tiers: DataFrame, shape: Shape, params: DataFrame) -> DataFrame:
    """The one wide shuffle of the typed path: per unit, counts and single values of every tier as
    fixed-width aggregates (a hash aggregation, compiled; no arrays). `simple` marks the ordinary
    delivered messages: one acked ledger row, its one committed log record at the acked offset,
    processed once by each group of its topic at that position (and, as the caller adds, not out
    of order), one row in each sink of its topic. Such a unit has no anomaly of its own (only the
    order/gap and content checks can still flag it), so its facts come from the aggregates
    (`simple_latencies`). Only the other units are gathered into arrays, by the general path; the
    property test holds both paths to the oracle. How many groups and sinks the unit's topic has
    (`n_groups`, `n_sinks`) comes from its row of `params` (a broadcast of one row per topic). A unit
    whose rows carry `cb` (its block is clean, `blocks.split_by_block`) is simple whatever its
    aggregates say: it arrives without its log record."""
    t = F.col("t")

    def n(cond: Any) -> Any:
        return F.sum(F.when(cond, 1).otherwise(0))

    def one(cond: Any, col: str) -> Any:
        return F.max(F.when(cond, F.col(col)))

    aggs = [n(t == 0).alias("nL"), n((t == 0) & (F.col("st") == 1)).alias("nLa"),
            one(t == 0, "part").alias("lp"), one(t == 0, "off").alias("lo"),
            one(t == 0, "ts1").alias("lpt"), one(t == 0, "ts2").alias("lack"),
            n(t == 1).alias("nR"), n((t == 1) & F.col("ok")).alias("nRc"),
            one(t == 1, "part").alias("rp"), one(t == 1, "off").alias("ro"),
            one(t == 1, "fph").alias("fph"), one(t == 1, "fph2").alias("fph2"),
            n(t == 2).alias("nC"), F.min(F.when(t == 2, F.col("part"))).alias("cp_lo"),
            one(t == 2, "part").alias("cp_hi"), F.min(F.when(t == 2, F.col("off"))).alias("co_lo"),
            one(t == 2, "off").alias("co_hi"), n(t == 3).alias("nS")]
    for i in range(shape.max_groups):
        c = (t == 2) & (F.col("gi") == i)
        aggs += [n(c & F.col("ok")).alias(f"c{i}_ok"), one(c, "ts1").alias(f"c{i}_ts")]
    for i in range(shape.max_sinks):
        c = (t == 3) & (F.col("gi") == i)
        aggs += [n(c).alias(f"s{i}_n"), one(c, "ts1").alias(f"s{i}_ts")]
    # `cb` (blocks.split_by_block): the unit's block is clean, its digests made it simple
    aggs.append(F.max("cb").alias("cb") if "cb" in tiers.columns else F.max(F.lit(False)).alias("cb"))
    ng, ns = F.col("n_groups"), F.col("n_sinks")
    simple = ((F.col("ktype") == 0) & (F.col("nL") == 1) & (F.col("nLa") == 1) & (F.col("nR") == 1)
              & (F.col("nRc") == 1) & (F.col("rp") == F.col("lp")) & (F.col("ro") == F.col("lo"))
              & (F.col("nC") == ng) & (F.col("nS") == ns))
    if shape.max_groups:
        simple = simple & ((ng == 0) | ((F.col("cp_lo") == F.col("rp")) & (F.col("cp_hi") == F.col("rp"))
                                        & (F.col("co_lo") == F.col("ro")) & (F.col("co_hi") == F.col("ro"))))
        for i in range(shape.max_groups):
            simple = simple & ((ng <= i) | (F.col(f"c{i}_ok") == 1))
    for i in range(shape.max_sinks):
        simple = simple & ((ns <= i) | (F.col(f"s{i}_n") == 1))
    # Hashed by kh, the unit key's hash, before the aggregation: units spread evenly (hashing by pid
    # leaves some tasks idle), and no map-side partial aggregation runs -- it has nothing to
    # combine (a unit's tiers come from different tables) and measured slower than none.
    units = tiers.withColumn("kh", unit_hash()).repartition("kh").groupBy("kh", *KEY).agg(*aggs).drop("kh")
    return (with_params(units, params, shape, "n_groups", "n_sinks")
            .withColumn("simple", F.col("cb") | F.coalesce(simple, F.lit(False)))
            .drop("n_groups", "n_sinks"))


def unit_keys(units: DataFrame) -> list[Any]:
    """Narrow per-unit columns the order and content checks read, from a typed (simple) unit."""
    return [F.col("topic"), F.col("ktype"), F.col("k1"), F.col("k2"),
            F.col("lpt").alias("pt_us"), F.col("rp").alias("o_part"), F.col("ro").alias("o_off"),
            F.lit(True).alias("has_orig"), F.lit(True).alias("present"), "fph", "fph2"]


# A unit's ledger status: the first of the precedence its ledger rows have (the last one: any row).
STATUS_SQL = ("CASE " + " ".join(f"WHEN exists(L, x -> x.status = {_q(st)}) THEN {_q(st)}"
                                 for st in LEDGER_STATUS_PRECEDENCE[:-1])
              + f" WHEN size(L) > 0 THEN {_q(LEDGER_STATUS_PRECEDENCE[-1])} END")
# ... except that an acked message whose own record at the acked (partition, offset) is in the log
# uncommitted was aborted with its transaction (clients that cannot see the abort, §5.1).
_ACK_SQL = f"array_min(filter(L, x -> x.status = {_q(ACKED)}))"
UNIT_STATUS_SQL = (f"CASE WHEN ({STATUS_SQL}) = {_q(ACKED)} AND exists(R, r -> NOT r.committed AND "
                   f"r.partition = {_ACK_SQL}.partition AND r.offset = {_ACK_SQL}.offset) THEN {_q(ABORTED)} "
                   f"ELSE ({STATUS_SQL}) END")


def describe_units(units: DataFrame, params: DataFrame) -> DataFrame:
    """Unit-level facts every stage uses: produce time, ledger status, committed copies, original."""
    return (units.join(F.broadcast(params), "topic")
            .withColumns({
                "R2": F.expr(
                    "array_sort(array_distinct(transform(R, x -> named_struct('partition', x.partition, "
                    "'offset', x.offset, 'committed', x.committed, 'pid', x.pid, 'seq', x.seq, "
                    "'produce_ts', x.produce_ts, 'kafka_ts', x.kafka_ts, 'fingerprint', x.fingerprint, "
                    "'header_error', x.header_error))))"),
                "pt_us": F.expr(
                    "unix_micros(coalesce(array_min(transform(L, x -> x.produce_ts)), "
                    "array_min(transform(R, x -> x.produce_ts)), array_min(transform(R, x -> x.kafka_ts)), "
                    "array_min(transform(R, x -> x.captured_at)), array_min(transform(C, x -> x.consume_ts)), "
                    "array_min(transform(S, x -> x.sink_ts))))"),
                "status": F.expr(UNIT_STATUS_SQL),
                "ack": F.expr(_ACK_SQL),
            })
            .withColumns({
                "in_w": F.expr("coalesce(pt_us >= ws_us AND pt_us < we_us, false)"),
                "copies": F.expr("filter(R2, x -> x.committed)"),
            })
            .withColumn("orig", F.expr(
                "coalesce(get(filter(copies, x -> x.partition = ack.partition AND x.offset = ack.offset), 0), "
                "get(copies, 0))"))
            .withColumns({
                "extras": F.expr("filter(copies, x -> NOT (x.partition = orig.partition AND x.offset = orig.offset))"),
                "pid": F.expr("CASE WHEN ktype = 0 THEN k1 ELSE orig.pid END"),
                "seq": F.expr("CASE WHEN ktype = 0 THEN k2 ELSE orig.seq END"),
            }))
