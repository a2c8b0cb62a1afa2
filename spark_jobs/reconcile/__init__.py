"""`msgaudit reconcile`: classify one (topic, window) at the log, every group and every sink stage
(DESIGN §5) and publish `audit_partition_report` + `audit_anomalies` (Delta and the report store).

The rules are stated once, readably, in `audit/oracle.py` (its docstring lists every decision
DESIGN leaves open); this module is the same rules as Spark transforms, and a property test
holds the two equal row for row. Shape of the computation, for one window:

1. `flag_consumption_order` (through `reordered_processings`): one shuffle of a narrow projection of
   the consumption rows by (group, partition) finds the first processings that go backwards in
   offset (`reordered_in_consumption`). Only those few rows are kept: their units go to the
   general path, and `with_reorder` marks them there with a broadcast lookup.
2. Typed path, for every unit: `typed_tiers` + `typed_units` key every tier (ledger, log,
   consumption, sinks) by its unit (topic, pid, seq) -- or (partition, offset) for unaudited
   records -- and ONE shuffle, hashed by the unit key, reduces each unit to fixed-width aggregates (counts,
   the single partition/offset/times, two hashes of the fingerprint): a compiled hash aggregation,
   no arrays. `simple` marks the ordinary delivered messages (one acked ledger row, its one
   committed log record at the acked offset, processed once by each group -- in order, unless
   flagged in step 1 --, one row in each sink) -- the vast majority -- and `simple_facts` computes their per-stage facts from the
   aggregates. An ordinary message has no anomaly of its own.
3. General path, for the other units only: their key hashes (a broadcast of one long per unit,
   unless there are millions) semi-join the tiers before the shuffle of `unit_tiers` +
   `collect_units`, which gathers each unit's rows into arrays; `describe_units` + `classify`
   apply every rule of DESIGN §5 with array expressions. The property test holds both paths,
   together, equal to the oracle.
4. `narrow_units` puts one narrow row per unit (either path) together for the checks that need
   neighbours: `order_checks` (`reordered_in_log` per (pid, partition), `seq_gap` per pid: window
   functions over one exchange by pid) and `content_duplicates` (one shuffle by the fingerprint's
   96-bit hash; a collision would need ~2^48 distinct fingerprints in one window's reach).
5. One small aggregation turns facts into per-(stage, partition, latency bucket) counts and keeps
   anomaly rows as they are; that result is small and is persisted, so the heavy part runs once.
   Exact percentiles (`stage_stats`): the bucket counts locate each wanted rank, and only the facts
   in those few buckets are sorted -- bounded memory, unlike Spark's `percentile`.
   What more than one step reads (the flagged processings, the typed units, the described units) is
   kept as a local checkpoint (`materialise`) and freed (`release`) once the summary is in.

Transforms here take and return DataFrames and never read or write tables; `read_window_inputs`
and `write_outputs` at the bottom are the only I/O (with `spark_jobs/io/sinks_read.py` for sinks).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from pyspark import StorageLevel
from pyspark.sql import DataFrame, SparkSession, Window
from pyspark.sql import functions as F

from audit.core.config import Config, TopicConfig
from audit.core.errors import InputError
from audit.core.windows import parse_instant, windows
from audit.oracle import (
    LEDGER_STATUSES,
    MAX_GAP_ROWS,
    PERCENTILES,
    assemble_report,
    interpolate,
    percentile_position,
    read_ranges,
    run_id_for,
)

_MIN = -(2**62)
X_FIELDS = (("kind", "string"), ("stage", "string"), ("anomaly", "string"), ("partition", "int"),
            ("pid", "string"), ("seq", "bigint"), ("offset", "bigint"), ("detail", "string"),
            ("expected", "int"), ("delivered", "int"), ("pending", "int"), ("latency", "double"))
X_TYPE = "struct<" + ",".join(f"{n}:{t}" for n, t in X_FIELDS) + ">"
EMPTY_X = f"cast(array() as array<{X_TYPE}>)"
ANOMALY_COLUMNS = ("window_start", "topic", "partition", "stage", "anomaly", "pid", "seq", "offset",
                   "detail", "run_id", "computed_at")


# ---------------------------------------------------------------------------- inputs
@dataclass
class WindowInputs:
    """The DataFrames one window reads (already limited to the topic's partitions of the lake).

    Sinks are normalised to (topic, partition, offset, pid, seq, sink_ts) by sinks_read."""

    ledger: DataFrame
    log: DataFrame
    consumed: DataFrame | None
    group_offsets: DataFrame | None
    watermarks: DataFrame | None
    sinks: Mapping[str, DataFrame] = field(default_factory=dict)


@dataclass
class Lookups:
    """Small per-partition facts collected to the driver and inlined as literal maps."""

    coverage: dict[int, list[tuple[int, int]]]  # merged captured ranges, each within [log start, high watermark)
    max_lso: dict[int, int]
    committed: dict[str, dict[int, int | None]]  # group -> partition -> latest committed offset
    partitions: set[int]


@dataclass
class WindowResult:
    topic: str
    window_start: datetime
    as_of: datetime
    run_id: str
    report: list[dict[str, Any]]
    anomalies: DataFrame
    anomaly_count: int
    quarantined_ledger_rows: int
    empty: bool
    cached: list[DataFrame] = field(default_factory=list)

    def release(self) -> None:
        """Drop the cached summary (the anomalies DataFrame is recomputed if used afterwards)."""
        for df in self.cached:
            df.unpersist()
        self.cached.clear()


def _micros(t: datetime) -> int:
    return (t - datetime(1970, 1, 1, tzinfo=UTC)) // timedelta(microseconds=1)


def _q(s: str) -> str:
    """A SQL string literal."""
    return "'" + s.replace("\\", "\\\\").replace("'", "\\'") + "'"


def collect_lookups(watermarks: Sequence[Mapping[str, Any]], group_offsets: Sequence[Mapping[str, Any]],
                    groups: Sequence[str]) -> Lookups:
    """Same semantics as the oracle: coverage by any capture, highest log start, latest commit."""
    raw: dict[int, list[tuple[int, int]]] = {}
    max_lso: dict[int, int] = {}
    for w in watermarks:
        p = int(w["partition"])
        lo, hi = int(w["log_start_offset"]), int(w["high_watermark"])
        if w.get("captured_from") is not None:  # rows written before these columns: the whole log
            lo = max(lo, int(w["captured_from"]))
        if w.get("captured_to") is not None:
            hi = min(hi, int(w["captured_to"]))
        raw.setdefault(p, []).append((lo, hi))
        max_lso[p] = max(max_lso.get(p, int(w["log_start_offset"])), int(w["log_start_offset"]))
    coverage: dict[int, list[tuple[int, int]]] = {}
    for p, ivs in raw.items():
        merged: list[list[int]] = []
        for lo, hi in sorted(i for i in ivs if i[0] < i[1]):
            if merged and lo <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], hi)
            else:
                merged.append([lo, hi])
        coverage[p] = [(a, b) for a, b in merged]
    committed: dict[str, dict[int, int | None]] = {g: {} for g in groups}
    for go in sorted(group_offsets, key=lambda r: (r["captured_at"], -1 if r["committed_offset"] is None
                                                   else r["committed_offset"])):
        if go["group"] in committed:
            co = go["committed_offset"]
            committed[go["group"]][int(go["partition"])] = None if co is None else int(co)
    return Lookups(coverage, max_lso, committed, set(max_lso))


def _map_sql(entries: Mapping[int, str], value_type: str) -> str:
    if not entries:
        return f"cast(null as map<int,{value_type}>)"
    return "map(" + ", ".join(f"{k}, {v}" for k, v in sorted(entries.items())) + ")"


# ---------------------------------------------------------------------------- transforms
def flag_consumption_order(consumed: DataFrame) -> DataFrame:
    """Adds `reorder`: the first processing of an offset lower than one its group already processed
    in that partition, in (consume_ts, consume_seq, consumer) order."""
    order = ["consume_ts", "consume_seq", "consumer"]
    is_proc = F.col("outcome") == "processed"
    w = Window.partitionBy("group", "partition").orderBy(*order)
    first = Window.partitionBy("group", "partition", "offset", "_proc").orderBy(*order)
    return (consumed.withColumn("_proc", is_proc)
            .withColumn("_high", F.max(F.when(is_proc, F.col("offset"))).over(
                w.rowsBetween(Window.unboundedPreceding, -1)))
            .withColumn("_rn", F.row_number().over(first))
            .withColumn("reorder", F.coalesce(
                F.col("_proc") & (F.col("_rn") == 1) & (F.col("offset") < F.col("_high")), F.lit(False)))
            .drop("_proc", "_high", "_rn"))


ORDER_COLUMNS = ("group", "partition", "offset", "consume_ts", "consume_seq", "consumer")


def reordered_processings(consumed: DataFrame) -> DataFrame:
    """The processings `flag_consumption_order` flags -- few -- by their identifying columns and unit
    key. The window runs over a narrow projection; only its flagged rows leave it."""
    cols = [*ORDER_COLUMNS, "outcome", "pid", "seq"]
    return (flag_consumption_order(consumed.select(*cols)).where("reorder")
            .select(*ORDER_COLUMNS, *_key("pid", "seq", "partition", "offset")).distinct())


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


TIER_TYPES = {
    "L": "struct<partition:int,offset:bigint,status:string,produce_ts:timestamp,ack_ts:timestamp>",
    "R": "struct<partition:int,offset:bigint,committed:boolean,pid:string,seq:bigint,produce_ts:timestamp,"
         "kafka_ts:timestamp,fingerprint:string,header_error:string,captured_at:timestamp>",
    "C": "struct<consume_ts:timestamp,consume_seq:bigint,consumer:string,group:string,partition:int,"
         "offset:bigint,outcome:string,reorder:boolean>",
    "S": "struct<sink:string,sink_ts:timestamp,offset:bigint,partition:int,pid:string,seq:bigint>",
}


def unit_tiers(ledger: DataFrame, log: DataFrame, consumed: DataFrame | None,
               sinks: Mapping[str, DataFrame]) -> DataFrame:
    """Every tier's rows as (ktype, k1, k2, L|R|C|S struct), ready to be gathered per unit."""

    def shape(df: DataFrame, key: list[Any], tier: str, struct: Any) -> DataFrame:
        return df.select(*key, *[(struct if c == tier else F.lit(None)).cast(t).alias(c)
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
                                    "outcome", "reorder")))
    for name, df in sinks.items():
        parts.append(shape(df.withColumn("sink", F.lit(name)), _key("pid", "seq", "partition", "offset"), "S",
                           F.struct("sink", "sink_ts", "offset", "partition", "pid", "seq")))
    out = parts[0]
    for p in parts[1:]:
        out = out.unionByName(p)
    return out


def unit_hash() -> Any:
    """A unit key's 64-bit hash: what the shuffles by unit hash by and sort by first."""
    return F.xxhash64("ktype", "k1", "k2")


# Up to this many non-ordinary units, their key hashes are broadcast to filter the tiers (8 bytes
# and a slot each); beyond it (an outage can make every unit non-ordinary) the tiers are
# semi-joined by shuffle instead, which costs a shuffle of every row but no driver memory.
BROADCAST_KEYS_MAX = 2_000_000


def collect_units(tiers: DataFrame, keys: DataFrame) -> DataFrame:
    """The general path's shuffle, for the units in `keys` (ktype, k1, k2; one row each) only: the
    tiers' rows whose unit hash is one of the keys' pass a semi-join on those hashes (a broadcast
    of one long per unit, unless there are more than `BROADCAST_KEYS_MAX`), are hashed by k1 (the
    pid) and gathered per unit and tier; a unit that only shares a hash with one of `keys` is then
    dropped by an exact join on the whole key."""
    hashes = keys.select(unit_hash().alias("kh"))
    if keys.count() <= BROADCAST_KEYS_MAX:
        hashes = F.broadcast(hashes)
    # kh leads the grouping key: the aggregation sorts by it when its hash map spills (always, at
    # scale), and a long compares by its sort prefix alone where (ktype, k1) would compare strings.
    units = (tiers.withColumn("kh", unit_hash())
             .join(hashes, "kh", "left_semi")
             .repartition("k1")
             .groupBy("kh", "ktype", "k1", "k2")
             .agg(*[F.collect_list(c).alias(c) for c in ("L", "R", "C", "S")])
             .drop("kh"))
    return units.join(keys, [units[c].eqNullSafe(keys[c]) for c in ("ktype", "k1", "k2")], "left_semi")


def _fp_hash(fp: Any) -> list[Any]:
    """Two independent hashes of a fingerprint (96 bits together; null for a null fingerprint):
    the typed path compares fingerprints by them, so no string travels through its aggregation."""
    return [F.when(fp.isNotNull(), F.xxhash64(fp)).alias("fph"), F.when(fp.isNotNull(), F.hash(fp)).alias("fph2")]


def typed_tiers(ledger: DataFrame, log: DataFrame, consumed: DataFrame | None,
                sinks: Mapping[str, DataFrame], tc: TopicConfig) -> DataFrame:
    """Every tier's rows as narrow fixed-width columns keyed like `unit_tiers`: what `typed_units`
    needs to recognise an ordinary delivered message and compute its facts without arrays."""
    us = F.unix_micros
    none_l, none_i = F.lit(None).cast("bigint"), F.lit(None).cast("int")
    cols = ("t", "st", "part", "off", "ts1", "ts2", "ok", "gi", "fph", "fph2")

    def shape(df: DataFrame, key: list[Any], **c: Any) -> DataFrame:
        defaults = {"st": none_i, "part": none_i, "off": none_l, "ts1": none_l, "ts2": none_l,
                    "ok": F.lit(None).cast("boolean"), "gi": none_i, "fph": none_l, "fph2": none_i}
        defaults.update(c)
        return df.select(*key, *[defaults[n].alias(n) if n != "t" else F.lit(c["t"]).alias("t") for n in cols])

    st = (F.when(F.col("status") == "acked", 1).when(F.col("status") == "aborted", 3)
          .otherwise(2).cast("int"))
    parts = [shape(ledger, [F.lit(0).alias("ktype"), F.col("pid").alias("k1"), F.col("seq").cast("bigint").alias("k2")],
                   t=0, st=st, part=F.col("partition"), off=F.col("offset"), ts1=us("produce_ts"), ts2=us("ack_ts"))]
    valid = F.col("header_error").isNull() & F.col("pid").isNotNull() & F.col("seq").isNotNull()
    log_k = log.withColumn("_kpid", F.when(valid, F.col("pid"))).withColumn("_kseq", F.when(valid, F.col("seq")))
    fph, fph2 = _fp_hash(F.col("fingerprint"))
    parts.append(shape(log_k, _key("_kpid", "_kseq", "partition", "offset"), t=1, part=F.col("partition"),
                       off=F.col("offset"), ok=F.col("committed"), fph=fph, fph2=fph2))
    if consumed is not None and tc.groups:
        gi = F.lit(None).cast("int")
        for i, g in enumerate(tc.groups):
            gi = F.when(F.col("group") == g, i).otherwise(gi)
        parts.append(shape(consumed, _key("pid", "seq", "partition", "offset"), t=2, part=F.col("partition"),
                           off=F.col("offset"), ts1=us("consume_ts"), ok=F.col("outcome") == "processed", gi=gi))
    names = [x.name for x in tc.sinks]
    for name, df in sinks.items():
        parts.append(shape(df, _key("pid", "seq", "partition", "offset"), t=3, ts1=us("sink_ts"),
                           gi=F.lit(names.index(name) if name in names else None).cast("int")))
    out = parts[0]
    for p in parts[1:]:
        out = out.unionByName(p)
    return out


def typed_units(tiers: DataFrame, tc: TopicConfig) -> DataFrame:
    """The one wide shuffle of the typed path: per unit, counts and single values of every tier as
    fixed-width aggregates (a hash aggregation, compiled; no arrays). `simple` marks the ordinary
    delivered messages: one acked ledger row, its one committed log record at the acked offset,
    processed once by each group at that position (and, as the caller adds, not out of order), one
    row in each sink. Such a unit has no anomaly of its own (only the order/gap and content checks
    can still flag it), so its facts come from the aggregates (`simple_facts`). Only the other units
    are gathered into arrays, by the general path; the property test holds both paths to the oracle."""
    t = F.col("t")
    sink_names = [x.name for x in tc.sinks]

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
    for i in range(len(tc.groups)):
        c = (t == 2) & (F.col("gi") == i)
        aggs += [n(c & F.col("ok")).alias(f"c{i}_ok"), one(c, "ts1").alias(f"c{i}_ts")]
    for i in range(len(sink_names)):
        c = (t == 3) & (F.col("gi") == i)
        aggs += [n(c).alias(f"s{i}_n"), one(c, "ts1").alias(f"s{i}_ts")]
    simple = ((F.col("ktype") == 0) & (F.col("nL") == 1) & (F.col("nLa") == 1) & (F.col("nR") == 1)
              & (F.col("nRc") == 1) & (F.col("rp") == F.col("lp")) & (F.col("ro") == F.col("lo"))
              & (F.col("nC") == len(tc.groups)) & (F.col("nS") == len(sink_names)))
    if tc.groups:
        simple = (simple & (F.col("cp_lo") == F.col("rp")) & (F.col("cp_hi") == F.col("rp"))
                  & (F.col("co_lo") == F.col("ro")) & (F.col("co_hi") == F.col("ro")))
        for i in range(len(tc.groups)):
            simple = simple & (F.col(f"c{i}_ok") == 1)
    for i in range(len(sink_names)):
        simple = simple & (F.col(f"s{i}_n") == 1)
    # Hashed by kh, the unit key's hash, before the aggregation: units spread evenly (hashing by pid
    # leaves some tasks idle), and no map-side partial aggregation runs -- it has nothing to
    # combine (a unit's tiers come from different tables) and measured slower than none.
    return (tiers.withColumn("kh", unit_hash()).repartition("kh")
            .groupBy("kh", "ktype", "k1", "k2").agg(*aggs)
            .drop("kh")
            .withColumn("simple", F.coalesce(simple, F.lit(False))))


def simple_facts(typed: DataFrame, params: DataFrame, tc: TopicConfig) -> DataFrame:
    """X rows (facts only: an ordinary delivered message has no anomaly of its own) of the simple units."""
    stages = [_f("'log'", "lp", "1", "1", "0", "(lack - lpt) / 1000D")]
    stages += [_f(_q(f"group:{g}"), "rp", "1", "1", "0", f"(c{i}_ts - lpt) / 1000D") for i, g in enumerate(tc.groups)]
    stages += [_f(_q(f"sink:{s.name}"), "rp", "1", "1", "0", f"(s{i}_ts - lpt) / 1000D")
               for i, s in enumerate(tc.sinks)]
    return (typed.where("simple").crossJoin(F.broadcast(params))
            .where("lpt >= ws_us AND lpt < we_us")
            .select(F.explode(F.expr(f"array({', '.join(stages)})")).alias("x")).select("x.*"))


def unit_keys(units: DataFrame) -> list[Any]:
    """Narrow per-unit columns the order and content checks read, from a typed (simple) unit."""
    return [F.col("ktype"), F.col("k1"), F.col("k2"), F.col("k1").alias("pid"), F.col("k2").alias("seq"),
            F.col("lpt").alias("pt_us"), F.col("rp").alias("o_part"), F.col("ro").alias("o_off"),
            F.lit(True).alias("has_orig"), F.lit(True).alias("present"), "fph", "fph2"]


def window_params(spark: SparkSession, tc: TopicConfig, ws: datetime, as_of: datetime, lk: Lookups) -> DataFrame:
    """One row of the window's constants (times in micros, the lookup maps). Joined to the units
    instead of inlined as literals, so the generated code is the same for every window of a topic
    and Spark's codegen cache serves later windows without recompiling."""
    # typed even when a partition has no interval (an empty capture): array() alone would be array<void>
    cov = _map_sql({p: "cast(array(" + ", ".join(f"named_struct('lo', {lo}L, 'hi', {hi}L)" for lo, hi in ivs)
                    + ") as array<struct<lo:bigint,hi:bigint>>)" for p, ivs in lk.coverage.items()},
                   "array<struct<lo:bigint,hi:bigint>>")
    lso = _map_sql({p: f"{v}L" for p, v in lk.max_lso.items()}, "bigint")
    cols = [F.lit(_micros(ws)).alias("ws_us"), F.lit(_micros(ws + tc.window)).alias("we_us"),
            F.lit(_micros(as_of)).alias("asof_us"), F.lit(tc.grace // timedelta(microseconds=1)).alias("grace_us"),
            F.expr(cov).alias("cov"), F.expr(lso).alias("lso")]
    for gi, g in enumerate(tc.groups):
        co = _map_sql({p: ("cast(null as bigint)" if v is None else f"{v}L")
                       for p, v in lk.committed.get(g, {}).items()}, "bigint")
        cols.append(F.expr(co).alias(f"co{gi}"))
    return spark.range(1).select(*cols)


def describe_units(units: DataFrame, params: DataFrame) -> DataFrame:
    """Unit-level facts every stage uses: produce time, ledger status, committed copies, original."""
    return (units.crossJoin(F.broadcast(params))
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
                "status": F.expr(
                    "CASE WHEN exists(L, x -> x.status = 'aborted') THEN 'aborted' "
                    "WHEN exists(L, x -> x.status = 'acked') THEN 'acked' "
                    "WHEN size(L) > 0 THEN 'failed' END"),
                "ack": F.expr("array_min(filter(L, x -> x.status = 'acked'))"),
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


def _a(stage: str, code: str, part: str, pid: str, seq: str, off: str, detail: str) -> str:
    return (f"named_struct('kind', 'A', 'stage', {stage}, 'anomaly', {code}, 'partition', cast({part} as int), "
            f"'pid', cast({pid} as string), 'seq', cast({seq} as bigint), 'offset', cast({off} as bigint), "
            f"'detail', cast({detail} as string), 'expected', 0, 'delivered', 0, 'pending', 0, "
            f"'latency', cast(null as double))")


def _f(stage: str, part: str, expected: str, delivered: str, pending: str, latency: str) -> str:
    return (f"named_struct('kind', 'F', 'stage', {stage}, 'anomaly', cast(null as string), "
            f"'partition', cast({part} as int), 'pid', cast(null as string), 'seq', cast(null as bigint), "
            f"'offset', cast(null as bigint), 'detail', cast(null as string), "
            f"'expected', cast({expected} as int), 'delivered', cast({delivered} as int), "
            f"'pending', cast({pending} as int), 'latency', cast({latency} as double))")


def _opt(cond: str, *structs: str) -> str:
    return f"CASE WHEN {cond} THEN array({', '.join(structs)}) ELSE {EMPTY_X} END"


def _s(x: str) -> str:
    return f"cast({x} as string)"


def classify(units: DataFrame, tc: TopicConfig) -> DataFrame:
    """Described units -> X rows: kind 'A' (one anomaly row) or 'F' (one unit's facts at a stage)."""
    due = "(asof_us >= pt_us + grace_us)"
    cov, lso = "cov", "lso"

    u = (units.where("in_w")
         .withColumns({
             "acked_missing": F.expr("status = 'acked' AND size(copies) = 0")})
         .withColumn("covered", F.expr(f"CASE WHEN acked_missing THEN coalesce(exists(try_element_at({cov}, "
                                       "ack.partition), w -> w.lo <= ack.offset AND ack.offset < w.hi), false) "
                                       "ELSE false END"))
         .withColumns({
             "lost": F.expr(f"acked_missing AND covered AND {due}"),
             "unverif": F.expr(f"acked_missing AND NOT covered AND "
                               f"coalesce(try_element_at({lso}, ack.partition), -1) > ack.offset")}))
    per_stage: dict[str, Any] = {}

    log = "'log'"
    log_anoms = [
        _opt("lost", _a(log, "'lost_acked'", "ack.partition", "pid", "seq", "ack.offset",
                        "'acked, capture covered the offset, not in the log'")),
        _opt("unverif", _a(log, "'unverifiable'", "ack.partition", "pid", "seq", "ack.offset",
                           "'offset below log_start_offset before any capture'")),
        _opt("ktype = 0 AND status = 'failed' AND orig IS NOT NULL",
             _a(log, "'ghost_write'", "orig.partition", "pid", "seq", "orig.offset",
                "'ledger says failed, the log has it'")),
        _opt("ktype = 0 AND status IS NULL AND orig IS NOT NULL",
             _a(log, "'unledgered'", "orig.partition", "pid", "seq", "orig.offset", "'no producer ledger row'")),
        "transform(extras, x -> " + _a(log, "'duplicate_in_log'", "x.partition", "pid", "seq", "x.offset",
                                       f"concat('extra copy of offset ', {_s('orig.partition')}, ':', "
                                       f"{_s('orig.offset')})") + ")",
        "transform(filter(R2, x -> NOT (x.header_error IS NULL AND x.pid IS NOT NULL AND x.seq IS NOT NULL)), "
        "x -> " + _a(log, "'unaudited'", "x.partition", "x.pid", "x.seq", "x.offset",
                     "coalesce(x.header_error, 'missing audit headers')") + ")",
        "transform(filter(R2, x -> NOT x.committed), x -> " + _a(
            log, "'aborted'", "x.partition", "x.pid", "x.seq", "x.offset", "'record of an aborted transaction'") + ")",
    ]
    facts = [_opt("ktype = 0 AND status = 'acked'", _f(
        log, "ack.partition", "1", "CASE WHEN size(copies) > 0 THEN 1 ELSE 0 END",
        "CASE WHEN acked_missing AND NOT lost AND NOT unverif THEN 1 ELSE 0 END",
        "(unix_micros(ack.ack_ts) - unix_micros(ack.produce_ts)) / 1000D"))]

    for gi, g in enumerate(tc.groups):
        stage = _q(f"group:{g}")
        gcol = f"_group{gi}"
        co = f"co{gi}"
        match = f"c.group = {_q(g)} AND c.partition = r.partition AND c.offset = r.offset"
        # a sink row from a sink g feeds is evidence that g processed the unit (exactly-once sinks
        # commit offsets with the rows; the consumption row may never have been flushed)
        fed = [s.name for s in tc.sinks if s.group == g]
        sunk = (f"exists(S, x -> x.sink IN ({', '.join(_q(name) for name in fed)}))" if fed else "false")
        per_stage[gcol] = F.expr(
            f"transform(R2, r -> named_struct('r', r, "
            f"'proc', array_sort(filter(C, c -> {match} AND c.outcome = 'processed')), "
            f"'dead', exists(C, c -> {match} AND c.outcome = 'dead_lettered'), 'sunk', {sunk}))")
        n = "size(x.proc)"
        unprocessed_code = (f"CASE WHEN x.dead THEN 'dead_lettered' WHEN NOT {due} THEN 'pending' "
                            f"WHEN x.r.offset < coalesce(try_element_at({lso}, x.r.partition), -1) "
                            "THEN 'expired_unconsumed' "
                            f"WHEN x.r.offset < try_element_at({co}, x.r.partition) THEN 'missed' "
                            "ELSE 'overdue' END")
        unprocessed_detail = (f"CASE WHEN x.dead THEN 'dead-lettered' WHEN NOT {due} THEN "
                              "'not processed yet, within grace' "
                              f"WHEN x.r.offset < coalesce(try_element_at({lso}, x.r.partition), -1) "
                              "THEN 'never processed, now below log_start_offset' "
                              f"WHEN x.r.offset < try_element_at({co}, x.r.partition) THEN "
                              f"concat('never processed, below committed offset ', "
                              f"{_s(f'try_element_at({co}, x.r.partition)')}) "
                              "ELSE 'not processed, past grace, at or above the committed offset' END")
        per_record = ", ".join([
            _opt(f"NOT x.r.committed AND {n} > 0", _a(stage, "'aborted_read'", "x.r.partition", "x.r.pid",
                                                    "x.r.seq", "x.r.offset",
                                                    "'processed a record of an aborted transaction'")),
            f"CASE WHEN x.r.committed AND {n} > 1 THEN transform(slice(x.proc, 2, {n} - 1), (c, i) -> "
            + _a(stage, "'redelivered'", "x.r.partition", "x.r.pid", "x.r.seq", "x.r.offset",
                 f"concat('processing ', {_s('i + 2')}, ' of ', {_s(n)}, ' by ', c.consumer)")
            + f") ELSE {EMPTY_X} END",
            _opt("x.r.committed AND exists(x.proc, c -> c.reorder)",
                 _a(stage, "'reordered_in_consumption'", "x.r.partition", "x.r.pid", "x.r.seq", "x.r.offset",
                    "'first processed after a higher offset'")),
            _opt(f"x.r.committed AND {n} = 0 AND (x.dead OR NOT x.sunk)", _a(stage, unprocessed_code, "x.r.partition", "x.r.pid", "x.r.seq",
                                                 "x.r.offset", unprocessed_detail)),
        ])
        log_anoms.append(f"flatten(transform({gcol}, x -> concat({per_record})))")
        facts.append(f"transform(filter({gcol}, x -> x.r.committed), x -> " + _f(
            stage, "x.r.partition", "1", f"CASE WHEN {n} > 0 OR (NOT x.dead AND x.sunk) THEN 1 ELSE 0 END", "0",
            f"CASE WHEN {n} > 0 THEN (unix_micros(get(x.proc, 0).consume_ts) - pt_us) / 1000D END") + ")")

    for si, s in enumerate(tc.sinks):
        stage = _q(f"sink:{s.name}")
        rows = f"filter(S, x -> x.sink = {_q(s.name)})"
        if s.group is None:
            expected = "true"
        else:
            expected = (f"exists(C, c -> c.group = {_q(s.group)} AND c.outcome = 'processed' AND "
                        "exists(copies, r -> r.partition = c.partition AND r.offset = c.offset))")
        scol = f"_sink{si}"
        per_stage[scol] = F.expr(
            f"named_struct('rows', {rows}, 'exp', {expected}, 'sorted', array_sort(transform({rows}, x -> "
            f"named_struct('a', coalesce(unix_micros(x.sink_ts), {_MIN}L), 'b', coalesce(x.offset, {_MIN}L), "
            f"'c', coalesce(cast(x.partition as bigint), {_MIN}L), 'row', x))))")
        n = f"size({scol}.rows)"
        log_anoms += [
            f"CASE WHEN orig IS NULL THEN transform({scol}.rows, x -> "
            + _a(stage, "'unexpected_in_sink'", "coalesce(x.partition, -1)", "x.pid", "x.seq", "x.offset",
                 "'no committed log record'") + f") ELSE {EMPTY_X} END",
            f"CASE WHEN orig IS NOT NULL AND {n} > 1 THEN transform(slice({scol}.sorted, 2, {n} - 1), (x, i) -> "
            + _a(stage, "'duplicate_in_sink'", "orig.partition", "pid", "seq", "x.row.offset",
                 f"concat('copy ', {_s('i + 2')}, ' of ', {_s(n)})") + f") ELSE {EMPTY_X} END",
            _opt(f"orig IS NOT NULL AND {scol}.exp AND {n} = 0",
                 _a(stage, f"CASE WHEN {due} THEN 'missing_in_sink' ELSE 'pending' END", "orig.partition",
                    "pid", "seq", "orig.offset",
                    f"CASE WHEN {due} THEN 'processed by the group, not in the sink' "
                    "ELSE 'not in the sink yet, within grace' END")),
        ]
        facts.append(_opt("orig IS NOT NULL", _f(
            stage, "orig.partition", f"CASE WHEN {scol}.exp THEN 1 ELSE 0 END",
            f"CASE WHEN {scol}.exp AND {n} > 0 THEN 1 ELSE 0 END", "0",
            f"CASE WHEN {scol}.exp AND {n} > 0 THEN (unix_micros(array_min(transform({scol}.rows, "
            "x -> x.sink_ts))) - pt_us) / 1000D END")))

    if per_stage:
        u = u.withColumns(per_stage)
    rows = f"concat({', '.join(log_anoms + facts)})"
    return u.select(F.explode(F.expr(rows)).alias("x")).select("x.*")


def narrow_units(typed: DataFrame, units: DataFrame, params: DataFrame) -> DataFrame:
    """One narrow row per unit, simple (typed) or not (described): what the order and content checks
    read -- key, produce time, the original copy's position, presence, the fingerprint's hashes."""
    fph, fph2 = _fp_hash(F.col("orig.fingerprint"))
    general = units.select(
        "ktype", "k1", "k2", "pid", "seq", "pt_us", F.col("orig.partition").alias("o_part"),
        F.col("orig.offset").alias("o_off"), F.col("orig").isNotNull().alias("has_orig"),
        ((F.col("ktype") == 0) & ((F.size("L") > 0) | (F.size("R") > 0))).alias("present"), fph, fph2)
    return (typed.where("simple").select(*unit_keys(typed)).unionByName(general)
            .crossJoin(F.broadcast(params.select("ws_us", "we_us")))
            .withColumn("in_w", F.expr("coalesce(pt_us >= ws_us AND pt_us < we_us, false)"))
            .drop("ws_us", "we_us"))


def order_checks(narrow: DataFrame) -> DataFrame:
    """`reordered_in_log` and `seq_gap` X rows: the order-dependent checks, as window functions over
    the narrow units (`narrow_units`), so the two sorts they need move a few columns per unit."""
    by_pid_part = (Window.partitionBy("ktype", "k1", "o_part").orderBy("o_off")
                   .rowsBetween(Window.unboundedPreceding, -1))
    by_pid = Window.partitionBy("ktype", "k1").orderBy("k2").rowsBetween(Window.unboundedPreceding, -1)
    # hashed by pid once: both windows' partitions are unions of these (one exchange, two sorts)
    u = (narrow.repartition("k1").withColumns({
             "rl_high": F.max(F.when((F.col("ktype") == 0) & F.col("has_orig"), F.col("k2"))).over(by_pid_part),
             "gap_prev": F.max(F.when(F.col("present"), F.col("k2"))).over(by_pid)})
         .where("in_w"))
    log = "'log'"
    anoms = [
        _opt("ktype = 0 AND has_orig AND k2 < rl_high",
             _a(log, "'reordered_in_log'", "o_part", "pid", "seq", "o_off",
                f"concat('seq ', {_s('k2')}, ' after seq ', {_s('rl_high')})")),
        _opt(f"present AND k2 - gap_prev - 1 > {MAX_GAP_ROWS}",
             _a(log, "'seq_gap'", "-1", "pid", "gap_prev + 1", "null",
                f"concat({_s('k2 - gap_prev - 1')}, ' seqs missing (', {_s('gap_prev + 1')}, '..', "
                f"{_s('k2 - 1')}, ')')")),
        f"CASE WHEN present AND k2 - gap_prev > 1 AND k2 - gap_prev - 1 <= {MAX_GAP_ROWS} THEN "
        "transform(sequence(gap_prev + 1, k2 - 1), s -> " + _a(log, "'seq_gap'", "-1", "pid", "s", "null",
                                                                 "'in neither ledger nor log'")
        + f") ELSE {EMPTY_X} END",
    ]
    return (u.where("(ktype = 0 AND has_orig AND k2 < rl_high) OR (present AND k2 - gap_prev > 1)")
            .select(F.explode(F.expr(f"concat({', '.join(anoms)})")).alias("x")).select("x.*"))


def content_duplicates(narrow: DataFrame) -> DataFrame:
    """`content_duplicate` X rows: one shuffle of the narrow units by their fingerprint's 96-bit hash."""
    w = Window.partitionBy("fph", "fph2").orderBy("pt_us", "k1", "k2")
    narrow = (narrow.where("ktype = 0 AND has_orig AND fph IS NOT NULL")
              .select("fph", "fph2", "pt_us", "k1", "k2", "in_w", F.col("o_part").alias("p"),
                      F.col("o_off").alias("o")))
    ranked = (narrow.withColumn("rn", F.row_number().over(w))
              .withColumn("first", F.first(F.struct("k1", "k2")).over(
                  w.rowsBetween(Window.unboundedPreceding, Window.unboundedFollowing))))
    return ranked.where("rn > 1 AND in_w").select(F.expr(
        _a("'log'", "'content_duplicate'", "p", "k1", "k2", "o",
           f"concat('same content as ', first.k1, ':', {_s('first.k2')})")).alias("x")).select("x.*")


def latency_bucket(latency: Any) -> Any:
    """An int that never decreases as the latency grows (`log2` is monotone): 256 buckets per power
    of two, each spanning 0.27 % of its values; 0 holds 0, negative latencies (clock skew) get
    negative buckets. Used to find, without keeping every value, where a percentile's ranks are."""
    mag = F.floor(F.log2(F.abs(latency)) * 256) + (1 << 20)
    return F.when(latency > 0, mag).when(latency < 0, -mag).when(latency == 0, 0).cast("int")


def summarise(x: DataFrame) -> DataFrame:
    """X rows -> anomaly rows kept as they are (n = copies) and facts summed per (stage, partition,
    latency bucket): counts, how many latencies (`n_lat`) and the largest. Exact percentiles come
    from these counts and one more look at the facts (`latency_at_ranks`), not from Spark's
    `percentile`, which holds every distinct latency of a (stage, partition) in a hash map outside
    Spark's memory manager (one entry per message at a stage: millions per window)."""
    keys = ["kind", "stage", "partition", "anomaly", "pid", "seq", "offset", "detail"]
    return x.withColumn("bucket", latency_bucket(F.col("latency"))).groupBy(*keys, "bucket").agg(
        F.count(F.lit(1)).alias("n"),
        F.sum("expected").alias("expected"), F.sum("delivered").alias("delivered"),
        F.sum("pending").alias("pending"), F.count("latency").alias("n_lat"),
        F.max("latency").alias("latency_max_ms"))


def latency_at_ranks(summary: DataFrame, facts: DataFrame, ranks: DataFrame) -> DataFrame:
    """(stage, partition, rank) -> (stage, partition, rank, latency): the latency at that 0-based rank
    of the (stage, partition)'s sorted latencies. The summary's bucket counts, added up in bucket
    order, say which bucket holds each rank and at which place inside it; only the facts of those
    few buckets are sorted."""
    grp = ["stage", "partition"]
    upto = Window.partitionBy(*grp).orderBy("bucket").rowsBetween(Window.unboundedPreceding, 0)
    wanted = (summary.where("kind = 'F' AND bucket IS NOT NULL").groupBy(*grp, "bucket")
              .agg(F.sum("n_lat").alias("c")).withColumn("end", F.sum("c").over(upto))
              .join(F.broadcast(ranks), grp).where("rank >= end - c AND rank < end")
              .select(*grp, "bucket", "rank", (F.col("rank") - F.col("end") + F.col("c")).alias("off")))
    place = Window.partitionBy(*grp, "bucket").orderBy("latency")
    return (facts.where("kind = 'F' AND latency IS NOT NULL").select(*grp, "latency")
            .withColumn("bucket", latency_bucket(F.col("latency")))
            .join(F.broadcast(wanted.select(*grp, "bucket").distinct()), [*grp, "bucket"], "left_semi")
            .withColumn("off", F.row_number().over(place) - 1)
            .join(F.broadcast(wanted), [*grp, "bucket", "off"]).select(*grp, "rank", "latency"))


def stage_stats(spark: SparkSession, summary: DataFrame, facts: DataFrame) -> dict[tuple[str, int], dict[str, Any]]:
    """Per (stage, partition): expected/delivered/pending sums and exact latency percentiles (Spark's
    `percentile`: linear interpolation between closest ranks) and maximum."""
    sums = (summary.where("kind = 'F'").groupBy("stage", "partition")
            .agg(F.sum("expected").alias("expected"), F.sum("delivered").alias("delivered"),
                 F.sum("pending").alias("pending"), F.sum("n_lat").alias("n_lat"),
                 F.max("latency_max_ms").alias("latency_max_ms")).collect())
    ranks = sorted({(r["stage"], r["partition"], rank) for r in sums if r["n_lat"]
                    for p in PERCENTILES for rank in percentile_position(r["n_lat"], p)[1:]})
    values: dict[tuple[str, int, int], float] = {}
    if ranks:
        rdf = spark.createDataFrame(ranks, "stage string, partition int, rank bigint")
        values = {(r["stage"], r["partition"], r["rank"]): r["latency"]
                  for r in latency_at_ranks(summary, facts, rdf).collect()}
    stats: dict[tuple[str, int], dict[str, Any]] = {}
    for r in sums:
        key = (r["stage"], r["partition"])
        pct: list[float | None] = [None] * len(PERCENTILES)
        if r["n_lat"]:
            for i, p in enumerate(PERCENTILES):
                position, lower, higher = percentile_position(r["n_lat"], p)
                pct[i] = interpolate(position, lower, higher, values[(*key, lower)], values[(*key, higher)])
        stats[key] = {"expected": r["expected"], "delivered": r["delivered"], "pending": r["pending"],
                      "latency_p50_ms": pct[0], "latency_p95_ms": pct[1], "latency_p99_ms": pct[2],
                      "latency_max_ms": r["latency_max_ms"]}
    return stats


def restrict(inputs: WindowInputs, tc: TopicConfig, ws: datetime) -> WindowInputs:
    """Exact visibility rules of the oracle (the I/O edge prunes Delta partitions coarsely first)."""
    rr = read_ranges(tc, ws)
    topic = F.col("topic") == tc.name

    def between(col: Any, lo: datetime, hi: datetime) -> Any:
        return (col >= F.lit(lo)) & (col < F.lit(hi))

    ledger = inputs.ledger.where(topic & between(F.col("produce_ts"), rr.message_lo, rr.message_hi))
    natural = F.coalesce("produce_ts", "kafka_ts", "captured_at")
    log = inputs.log.where(topic & between(natural, rr.message_lo, rr.message_hi))
    consumed = None
    if inputs.consumed is not None and tc.groups:
        consumed = inputs.consumed.where(topic & F.col("group").isin(list(tc.groups))
                                         & between(F.col("consume_ts"), rr.event_lo, rr.event_hi))
    sinks = {name: df.where(topic & (F.col("sink_ts").isNull()
                                     | between(F.col("sink_ts"), rr.event_lo, rr.event_hi)))
             for name, df in inputs.sinks.items()}
    return WindowInputs(ledger, log, consumed, inputs.group_offsets, inputs.watermarks, sinks)


def materialise(df: DataFrame) -> DataFrame:
    """Computes `df` now and keeps its rows (memory, then local disk) for the steps that read it
    again. A local checkpoint stores the rows as they are; `persist()` would first encode them into
    compressed column batches, which cost a third of the typed path's time at scale. Its lineage is
    cut, so it must not be read after `release`."""
    return df.localCheckpoint(eager=True, storageLevel=StorageLevel.MEMORY_AND_DISK)


def release(df: DataFrame) -> None:
    """Frees the rows of a `materialise`d frame now (the context cleaner would only do it once the
    frame is garbage-collected, which a backfill over many windows should not wait for)."""
    plan = df._jdf.queryExecution().analyzed()
    if plan.getClass().getSimpleName() == "LogicalRDD":
        plan.rdd().unpersist(False)


def ledger_is_valid() -> Any:
    return (F.col("status").isin(list(LEDGER_STATUSES))
            & ~((F.col("status") == "acked") & (F.col("offset").isNull() | (F.col("partition") < 0))))


@dataclass
class Classified:
    report: list[dict[str, Any]]
    anomalies: DataFrame
    anomaly_count: int
    quarantined: int
    empty: bool
    summary: DataFrame  # persisted; `anomalies` reads it


def reconcile_frames(spark: SparkSession, inputs: WindowInputs, tc: TopicConfig, ws: datetime,
                     as_of: datetime) -> tuple[list[dict[str, Any]], DataFrame, int, bool]:
    """Classify one window: (report rows, anomaly DataFrame, quarantined ledger rows, empty?)."""
    w = classify_window(spark, inputs, tc, ws, as_of)
    return w.report, w.anomalies, w.quarantined, w.empty


def classify_window(spark: SparkSession, inputs: WindowInputs, tc: TopicConfig, ws: datetime,
                    as_of: datetime) -> Classified:
    """Classify one window. The only actions are on small things: watermarks and group offsets
    (collected for the lookup maps), the quarantine count, and the persisted summary."""
    run_id = run_id_for(tc.name, ws, as_of)
    vis = restrict(inputs, tc, ws)
    wm_rows = [r.asDict() for r in vis.watermarks.where(F.col("topic") == tc.name).collect()] \
        if vis.watermarks is not None else []
    go_rows = [r.asDict() for r in vis.group_offsets.where(F.col("topic") == tc.name).collect()] \
        if vis.group_offsets is not None else []
    lk = collect_lookups(wm_rows, go_rows, tc.groups)
    quarantined = vis.ledger.where(~ledger_is_valid()).count()
    ledger = vis.ledger.where(ledger_is_valid())
    params = window_params(spark, tc, ws, as_of, lk)
    cached: list[DataFrame] = []

    def keep(df: DataFrame) -> DataFrame:
        cached.append(materialise(df))
        return cached[-1]

    # A unit one of whose processings went backwards is not ordinary: the order check runs once,
    # over the consumption rows alone, and only its flagged rows come back.
    flagged = keep(reordered_processings(vis.consumed)) if vis.consumed is not None else None
    # Typed path: every unit's tiers as fixed-width aggregates; ordinary messages end here.
    typed = typed_units(typed_tiers(ledger, vis.log, vis.consumed, vis.sinks, tc), tc)
    if flagged is not None:
        marks = flagged.select("ktype", "k1", "k2").distinct().withColumn("_reordered", F.lit(True))
        typed = (typed.join(F.broadcast(marks), ["ktype", "k1", "k2"], "left")
                 .withColumn("simple", F.col("simple") & F.col("_reordered").isNull()).drop("_reordered"))
    typed = keep(typed)
    # General path: only the other units' rows are gathered into arrays (a broadcast semi-join on
    # their key hashes before their shuffle, so the ordinary majority never reaches it).
    keys = typed.where("NOT simple").select("ktype", "k1", "k2")
    consumed = with_reorder(vis.consumed, flagged) if vis.consumed is not None and flagged is not None else None
    units = keep(describe_units(collect_units(unit_tiers(ledger, vis.log, consumed, vis.sinks), keys), params))
    narrow = narrow_units(typed, units, params)
    facts = simple_facts(typed, params, tc).unionByName(classify(units, tc))
    x = facts.unionByName(order_checks(narrow)).unionByName(content_duplicates(narrow))
    summary = summarise(x).persist(StorageLevel.MEMORY_AND_DISK)

    stats = stage_stats(spark, summary, facts)  # reads the checkpoints once more: before `release`
    codes: dict[tuple[str, int], dict[str, int]] = {}
    for r in (summary.where("kind = 'A'").groupBy("stage", "partition", "anomaly")
              .agg(F.sum("n").alias("n")).collect()):
        codes.setdefault((r["stage"], r["partition"]), {})[r["anomaly"]] = int(r["n"])
    for df in cached:  # the summary is materialised now; these are only needed to recompute it
        release(df)
    report = assemble_report(tc, ws, as_of, lk.partitions, stats, codes)
    anomalies = (summary.where("kind = 'A'")
                 .withColumn("_copy", F.explode(F.array_repeat(F.lit(1), F.col("n").cast("int"))))
                 .select(F.lit(ws).alias("window_start"), F.lit(tc.name).alias("topic"), "partition", "stage",
                         "anomaly", "pid", "seq", "offset", "detail", F.lit(run_id).alias("run_id"),
                         F.lit(as_of).alias("computed_at")))
    empty = not any(s.get("expected") for s in stats.values()) and not codes
    count = sum(n for c in codes.values() for n in c.values())
    return Classified(report, anomalies, count, quarantined, empty, summary)


# ---------------------------------------------------------------------------- I/O edge
def _hours(lo: datetime, hi: datetime) -> tuple[str, str]:
    """part_hour bounds (inclusive) of the instants [lo, hi)."""
    return lo.strftime("%Y-%m-%dT%H"), (hi - timedelta(microseconds=1)).strftime("%Y-%m-%dT%H")


def read_window_inputs(spark: SparkSession, cfg: Config, tc: TopicConfig, ws: datetime) -> WindowInputs:
    """Read only the Delta partitions (topic, part_hour) the window and its lookback need."""
    from spark_jobs.io.lake import read_table, table_exists
    from spark_jobs.io.sinks_read import read_sink

    rr = read_ranges(tc, ws)
    m_lo, m_hi = _hours(rr.message_lo, rr.message_hi)
    e_lo, e_hi = _hours(rr.event_lo, rr.event_hi)

    def pruned(name: str, lo: str, hi: str) -> DataFrame:
        return read_table(spark, cfg, name).where(
            (F.col("topic") == tc.name) & (F.col("part_hour") >= lo) & (F.col("part_hour") <= hi))

    def small(name: str) -> DataFrame:
        return read_table(spark, cfg, name).where(F.col("topic") == tc.name)

    ledger = pruned("producer_ledger", m_lo, m_hi)
    log = pruned("log_records", m_lo, m_hi)
    watermarks = small("partition_watermarks")
    consumed = group_offsets = None
    if tc.groups:
        consumed = pruned("consumed_records", e_lo, e_hi)
        group_offsets = small("group_offsets")
    elif table_exists(spark, cfg, "group_offsets"):
        group_offsets = small("group_offsets")
    sinks = {s.name: read_sink(spark, s, tc.name) for s in tc.sinks}
    return WindowInputs(ledger, log, consumed, group_offsets, watermarks, sinks)


def _to_df(spark: SparkSession, rows: Sequence[Mapping[str, Any]], schema: Any) -> DataFrame:
    return spark.createDataFrame([tuple(r[f.name] for f in schema.fields) for r in rows], schema)


def write_outputs(spark: SparkSession, cfg: Config, topic: str, ws: datetime,
                  report: Sequence[Mapping[str, Any]], anomalies: DataFrame) -> list[dict[str, Any]]:
    """Replace the window's rows in both Delta tables and the report store; returns anomaly rows.
    The two Delta commits run side by side (each is mostly the driver waiting on the table's log),
    while this thread collects the anomalies and writes the report store."""
    from concurrent.futures import ThreadPoolExecutor

    from audit.serving.report_store import ANOMALIES, PARTITION_REPORT, ReportStore
    from spark_jobs.io.lake import write_table
    from spark_jobs.io.schemas import AUDIT_ANOMALIES, AUDIT_PARTITION_REPORT

    where = f"topic = {_q(topic)} AND window_start = to_timestamp('{ws.strftime('%Y-%m-%d %H:%M:%S')}')"
    report_df = _to_df(spark, report, AUDIT_PARTITION_REPORT)
    anomaly_df = anomalies.select(*[F.col(f.name).cast(f.dataType) for f in AUDIT_ANOMALIES.fields])
    with ThreadPoolExecutor(max_workers=2, thread_name_prefix="msgaudit-publish") as pool:
        delta = [pool.submit(write_table, df, cfg, name, mode="overwrite", partition_by=["topic"],
                             replace_where=where)
                 for df, name in ((report_df, "audit_partition_report"), (anomaly_df, "audit_anomalies"))]
        anomaly_rows = [_aware(r.asDict()) for r in anomalies.collect()]
        with ReportStore(cfg.report_store) as store:
            store.replace_window(PARTITION_REPORT, topic, ws, report)
            store.replace_window(ANOMALIES, topic, ws, anomaly_rows)
        for f in delta:
            f.result()  # a failed commit raises here
    return anomaly_rows


def _aware(row: dict[str, Any]) -> dict[str, Any]:
    """Spark hands back naive datetimes in the session time zone (UTC): make them aware."""
    return {k: (v.replace(tzinfo=UTC) if isinstance(v, datetime) and v.tzinfo is None else v)
            for k, v in row.items()}


# ---------------------------------------------------------------------------- jobs and CLI
def reconcile_window(spark: SparkSession, cfg: Config, topic: str, ws: datetime, as_of: datetime,
                     publish: bool = True) -> WindowResult:
    tc = cfg.topic(topic)
    inputs = read_window_inputs(spark, cfg, tc, ws)
    w = classify_window(spark, inputs, tc, ws, as_of)
    if publish:
        write_outputs(spark, cfg, topic, ws, w.report, w.anomalies)
    return WindowResult(topic, ws, as_of, run_id_for(topic, ws, as_of), w.report, w.anomalies, w.anomaly_count,
                        w.quarantined, w.empty, [w.summary])


def reconcile_range(spark: SparkSession, cfg: Config, start: datetime, end: datetime, as_of: datetime,
                    topics: Sequence[str] | None = None, progress: bool = False) -> list[WindowResult]:
    """Every (topic, window) overlapping [start, end), as of `as_of` (spark-submit / Airflow entry)."""
    names = list(topics) if topics else sorted(cfg.topics)
    if not names:
        raise InputError(f"{cfg.source}: no topics configured; add one under `topics:`")
    jobs = [(t, ws) for t in names for ws, _ in windows(start, end, cfg.topic(t).window)]
    results = []
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(jobs), desc="reconcile", unit="window")
    for t, ws in jobs:
        r = reconcile_window(spark, cfg, t, ws, as_of)
        r.release()
        results.append(r)
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    return results


def summary_line(r: WindowResult) -> str:
    counts: dict[str, int] = {}
    for row in r.report:
        counts[row["stage"]] = counts.get(row["stage"], 0) + row["expected"]
    status = r.report[0]["status"] if r.report else "empty"
    extra = f", quarantined {r.quarantined_ledger_rows} malformed ledger rows" if r.quarantined_ledger_rows else ""
    empty = " (empty window: no messages)" if r.empty else ""
    return (f"{r.topic} {r.window_start.isoformat()} [{status}] anomalies={r.anomaly_count} "
            f"expected={json.dumps(counts)}{extra}{empty}")


def cli_reconcile(args: argparse.Namespace, cfg: Config) -> int:
    from spark_jobs.io.session import build_spark

    start = parse_instant(args.start, "--start")
    end = parse_instant(args.end, "--end")
    as_of = parse_instant(getattr(args, "as_of", None) or "now", "--as-of")
    topics = args.topics or None
    for t in topics or []:
        cfg.topic(t)  # unknown topic: one clear line before any JVM starts
    spark = build_spark(cfg, app_name="msgaudit-reconcile")
    for r in reconcile_range(spark, cfg, start, end, as_of, topics, progress=True):
        print(summary_line(r))
    return 0

