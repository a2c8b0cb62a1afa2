"""From X rows to numbers: `summarise` (anomaly rows kept, facts summed per stage, partition and
latency bucket), `latency_bucket`, and exact percentiles (`stage_stats`, `latency_at_ranks`) with
the same interpolation as Spark's `percentile` (`audit.core.percentiles`) without holding every
latency in memory.

This module must not read or write tables, or decide anomaly codes; its only actions collect the
small per-(stage, partition) sums and the latencies at the wanted ranks.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from pyspark.sql import DataFrame, SparkSession, Window
from pyspark.sql import functions as F

from audit.core.percentiles import PERCENTILES, interpolate, percentile_position
from spark_jobs.io.session import local_frame


def latency_bucket(latency: Any) -> Any:
    """An int that never decreases as the latency grows (`log2` is monotone): 256 buckets per power
    of two, each spanning 0.27 % of its values; 0 holds 0, negative latencies (clock skew) get
    negative buckets. Used to find, without keeping every value, where a percentile's ranks are."""
    mag = F.floor(F.log2(F.abs(latency)) * 256) + (1 << 20)
    return F.when(latency > 0, mag).when(latency < 0, -mag).when(latency == 0, 0).cast("int")


def summarise(x: DataFrame) -> DataFrame:
    """X rows -> anomaly rows kept as they are (n = copies) and facts summed per (stage, partition,
    latency bucket): counts, how many latencies (`n_lat`), the smallest and the largest. Exact
    percentiles come from these counts -- a bucket whose smallest and largest latency are equal
    holds one value, which is then the value at each of its ranks -- and, for ranks in buckets of
    several values, one more look at the facts (`latency_at_ranks`), not from Spark's
    `percentile`, which holds every distinct latency of a (stage, partition) in a hash map outside
    Spark's memory manager (one entry per message at a stage: millions per window)."""
    keys = ["topic", "kind", "stage", "partition", "anomaly", "pid", "seq", "offset", "detail"]
    return x.withColumn("bucket", latency_bucket(F.col("latency"))).groupBy(*keys, "bucket").agg(
        F.count(F.lit(1)).alias("n"),
        F.sum("expected").alias("expected"), F.sum("delivered").alias("delivered"),
        F.sum("pending").alias("pending"), F.count("latency").alias("n_lat"),
        F.min("latency").alias("latency_min_ms"), F.max("latency").alias("latency_max_ms"))


def summarise_delivered(latencies: DataFrame) -> DataFrame:
    """Per-stage latencies of ordinary delivered messages (topic, si, partition, latency, n: `n`
    messages with that latency, each one expected and delivered, none pending) -> summary rows of
    kind 'F' per (stage index, partition, latency bucket), as `summarise` makes them; the stage
    index is still to be named."""
    return (latencies.withColumn("bucket", latency_bucket(F.col("latency")))
            .groupBy("topic", "si", "partition", "bucket")
            .agg(F.sum("n").alias("n"), F.sum(F.when(F.col("latency").isNotNull(), F.col("n"))).alias("n_lat"),
                 F.min("latency").alias("latency_min_ms"), F.max("latency").alias("latency_max_ms"))
            .select("topic", F.lit("F").alias("kind"), "si", "partition", *[F.lit(None).cast(t).alias(c) for c, t in (
                ("anomaly", "string"), ("pid", "string"), ("seq", "bigint"), ("offset", "bigint"), ("detail", "string"))],
                "bucket", "n", F.col("n").alias("expected"), F.col("n").alias("delivered"),
                F.lit(0).cast("bigint").alias("pending"), F.coalesce("n_lat", F.lit(0).cast("bigint")).alias("n_lat"),
                "latency_min_ms", "latency_max_ms"))


def with_count(facts: DataFrame) -> DataFrame:
    """`facts` with `n`, how many latencies each row stands for: its own column, or 1 per row."""
    return facts if "n" in facts.columns else facts.withColumn("n", F.lit(1).cast("bigint"))


def rank_buckets(summary: DataFrame, ranks: DataFrame) -> DataFrame:
    """(topic, stage, partition, rank) -> the bucket holding that 0-based rank of the (topic, stage,
    partition)'s sorted latencies, the rank's place inside it (`off`) and the bucket's smallest and
    largest latency (`lo`, `hi`): the summary's bucket counts, added up in bucket order. Reads the
    summary alone."""
    grp = ["topic", "stage", "partition"]
    upto = Window.partitionBy(*grp).orderBy("bucket").rowsBetween(Window.unboundedPreceding, 0)
    return (summary.where("kind = 'F' AND bucket IS NOT NULL").groupBy(*grp, "bucket")
            .agg(F.sum("n_lat").alias("c"), F.min("latency_min_ms").alias("lo"),
                 F.max("latency_max_ms").alias("hi"))
            .withColumn("end", F.sum("c").over(upto))
            .join(F.broadcast(ranks), grp).where("rank >= end - c AND rank < end")
            .select(*grp, "bucket", "rank", (F.col("rank") - F.col("end") + F.col("c")).alias("off"), "lo", "hi"))


def latency_at_ranks(facts: DataFrame, wanted: DataFrame) -> DataFrame:
    """`wanted` (topic, stage, partition, bucket, rank, off: `rank_buckets`) -> (topic, stage,
    partition, rank, latency): only the facts of the wanted buckets are read, counted per distinct
    latency (`n`, `with_count`) and added up in latency order."""
    grp = ["topic", "stage", "partition"]
    upto = Window.partitionBy(*grp, "bucket").orderBy("latency").rowsBetween(Window.unboundedPreceding, 0)
    keys = (*grp, "bucket")
    w = wanted.select(*[F.col(c).alias(f"w_{c}") for c in (*keys, "rank", "off")])
    counted = (with_count(facts).where("kind = 'F' AND latency IS NOT NULL").select(*grp, "latency", "n")
               .withColumn("bucket", latency_bucket(F.col("latency")))
               .join(F.broadcast(wanted.select(*keys).distinct()), list(keys), "left_semi")
               .groupBy(*keys, "latency").agg(F.sum("n").alias("c"))
               .withColumn("end", F.sum("c").over(upto)))
    hit = [F.col(c) == F.col(f"w_{c}") for c in keys] + [F.col("w_off") >= F.col("end") - F.col("c"),
                                                       F.col("w_off") < F.col("end")]
    return counted.join(F.broadcast(w), hit).select(*grp, F.col("w_rank").alias("rank"), "latency")


# Up to this many latencies in a batch, the wanted ranks are read from the latencies themselves,
# collected in one job and sorted on the driver (same values, same interpolation); above it, the
# bucket counts locate the ranks (`rank_buckets`, from the summary alone); a rank in a bucket of one
# value is that value, and Spark sorts only the other wanted buckets' facts (`latency_at_ranks`).
# That costs a few small jobs -- most of a small window's time.
DRIVER_SORT_MAX = 100_000


def stage_stats(spark: SparkSession, summary: DataFrame,
                facts: DataFrame) -> dict[str, dict[tuple[str, int], dict[str, Any]]]:
    """Per topic, per (stage, partition): expected/delivered/pending sums and exact latency
    percentiles (Spark's `percentile`: linear interpolation between closest ranks) and maximum.
    `facts`: (topic, kind, stage, partition, latency[, n]), a row standing for `n` latencies when
    it has that column (`with_count`)."""
    sums = (summary.where("kind = 'F'").groupBy("topic", "stage", "partition")
            .agg(F.sum("expected").alias("expected"), F.sum("delivered").alias("delivered"),
                 F.sum("pending").alias("pending"), F.sum("n_lat").alias("n_lat"),
                 F.max("latency_max_ms").alias("latency_max_ms")).collect())
    ranks = sorted({(r["topic"], r["stage"], r["partition"], rank) for r in sums if r["n_lat"]
                    for p in PERCENTILES for rank in percentile_position(r["n_lat"], p)[1:]})
    values: dict[tuple[str, str, int, int], float] = {}
    if ranks and sum(r["n_lat"] or 0 for r in sums) <= DRIVER_SORT_MAX:
        by_key: dict[tuple[str, str, int], list[float]] = defaultdict(list)
        for r in (with_count(facts).where("kind = 'F' AND latency IS NOT NULL")
                  .select("topic", "stage", "partition", "latency", "n").collect()):
            by_key[(r[0], r[1], r[2])].extend([r[3]] * r[4])
        for xs in by_key.values():
            xs.sort()
        values = {(t, s, p, rank): by_key[(t, s, p)][rank] for t, s, p, rank in ranks}
    elif ranks:
        rdf = local_frame(spark, ranks, "topic string, stage string, partition int, rank bigint")
        located = rank_buckets(summary, rdf).collect()
        values = {(r["topic"], r["stage"], r["partition"], r["rank"]): r["lo"] for r in located if r["lo"] == r["hi"]}
        several = [(r["topic"], r["stage"], r["partition"], r["bucket"], r["rank"], r["off"])
                   for r in located if r["lo"] != r["hi"]]
        if several:  # buckets holding more than one value: their facts are read and sorted
            wanted = local_frame(spark, several, "topic string, stage string, partition int, bucket int, "
                                                 "rank bigint, off bigint")
            values.update({(r["topic"], r["stage"], r["partition"], r["rank"]): r["latency"]
                           for r in latency_at_ranks(facts, wanted).collect()})
    stats: dict[str, dict[tuple[str, int], dict[str, Any]]] = {}
    for r in sums:
        key = (r["topic"], r["stage"], r["partition"])
        pct: list[float | None] = [None] * len(PERCENTILES)
        if r["n_lat"]:
            for i, p in enumerate(PERCENTILES):
                position, lower, higher = percentile_position(r["n_lat"], p)
                pct[i] = interpolate(position, lower, higher, values[(*key, lower)], values[(*key, higher)])
        stats.setdefault(r["topic"], {})[key[1:]] = {
            "expected": r["expected"], "delivered": r["delivered"], "pending": r["pending"],
            "latency_p50_ms": pct[0], "latency_p95_ms": pct[1], "latency_p99_ms": pct[2],
            "latency_max_ms": r["latency_max_ms"]}
    return stats
