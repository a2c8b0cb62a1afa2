"""From X rows to numbers: `summarise` (anomaly rows kept, facts summed per stage, partition and
latency bucket), `latency_bucket`, and exact percentiles (`stage_stats`, `latency_at_ranks`) with
the same interpolation as Spark's `percentile` (`audit.core.percentiles`) without holding every
latency in memory.

This module must not read or write tables, or decide anomaly codes; its only actions collect the
small per-(stage, partition) sums and the latencies at the wanted ranks.
"""

from __future__ import annotations

from typing import Any

from pyspark.sql import DataFrame, SparkSession, Window
from pyspark.sql import functions as F

from audit.core.percentiles import PERCENTILES, interpolate, percentile_position


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
    keys = ["topic", "kind", "stage", "partition", "anomaly", "pid", "seq", "offset", "detail"]
    return x.withColumn("bucket", latency_bucket(F.col("latency"))).groupBy(*keys, "bucket").agg(
        F.count(F.lit(1)).alias("n"),
        F.sum("expected").alias("expected"), F.sum("delivered").alias("delivered"),
        F.sum("pending").alias("pending"), F.count("latency").alias("n_lat"),
        F.max("latency").alias("latency_max_ms"))


def latency_at_ranks(summary: DataFrame, facts: DataFrame, ranks: DataFrame) -> DataFrame:
    """(topic, stage, partition, rank) -> (topic, stage, partition, rank, latency): the latency at that
    0-based rank of the (topic, stage, partition)'s sorted latencies. The summary's bucket counts, added up in bucket
    order, say which bucket holds each rank and at which place inside it; only the facts of those
    few buckets are sorted."""
    grp = ["topic", "stage", "partition"]
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


def stage_stats(spark: SparkSession, summary: DataFrame,
                facts: DataFrame) -> dict[str, dict[tuple[str, int], dict[str, Any]]]:
    """Per topic, per (stage, partition): expected/delivered/pending sums and exact latency
    percentiles (Spark's `percentile`: linear interpolation between closest ranks) and maximum."""
    sums = (summary.where("kind = 'F'").groupBy("topic", "stage", "partition")
            .agg(F.sum("expected").alias("expected"), F.sum("delivered").alias("delivered"),
                 F.sum("pending").alias("pending"), F.sum("n_lat").alias("n_lat"),
                 F.max("latency_max_ms").alias("latency_max_ms")).collect())
    ranks = sorted({(r["topic"], r["stage"], r["partition"], rank) for r in sums if r["n_lat"]
                    for p in PERCENTILES for rank in percentile_position(r["n_lat"], p)[1:]})
    values: dict[tuple[str, str, int, int], float] = {}
    if ranks:
        rdf = spark.createDataFrame(ranks, "topic string, stage string, partition int, rank bigint")
        values = {(r["topic"], r["stage"], r["partition"], r["rank"]): r["latency"]
                  for r in latency_at_ranks(summary, facts, rdf).collect()}
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
