"""The log-stage checks that need neighbouring units: `reordered_in_log` and `seq_gap`
(`order_checks`, window functions per pid) and `content_duplicate` (`content_duplicates`, one
shuffle by the fingerprint's hash), over one narrow row per unit from either path
(`narrow_units`). Codes and detail texts come from the vocabulary (`anomaly_sql`).

`ORDER_CHECK_SQL` and `CONTENT_DUPLICATE_SQL` are the SQL text alone. This module must not read
or write tables, collect rows, or apply the per-unit rules (`classify.py`).
"""

from __future__ import annotations

from pyspark.sql import DataFrame, Window
from pyspark.sql import functions as F

from audit.core.vocabulary import LOG, MAX_GAP_ROWS
from spark_jobs.reconcile.sql import EMPTY_X, _opt, _q, anomaly_sql
from spark_jobs.reconcile.units import _fp_hash, unit_keys


def narrow_units(typed: DataFrame, units: DataFrame, params: DataFrame,
                 clean: DataFrame | None = None) -> DataFrame:
    """One narrow row per unit, simple (typed) or not (described), plus `clean` (the units of clean
    blocks, `blocks.clean_narrow`): what the order and content checks read -- key, produce time, the
    original copy's position, presence, the fingerprint's hashes."""
    fph, fph2 = _fp_hash(F.col("orig.fingerprint"))
    general = units.select(
        "topic", "ktype", "k1", "k2", "pid", "seq", "pt_us", F.col("orig.partition").alias("o_part"),
        F.col("orig.offset").alias("o_off"), F.col("orig").isNotNull().alias("has_orig"),
        ((F.col("ktype") == 0) & ((F.size("L") > 0) | (F.size("R") > 0))).alias("present"), fph, fph2)
    # a clean block's unit reaches the typed path without its log record: its row is in `clean`
    out = typed.where("simple AND NOT cb").select(*unit_keys(typed)).unionByName(general)
    if clean is not None:
        out = out.unionByName(clean)
    return (out.join(F.broadcast(params.select("topic", "ws_us", "we_us")), "topic")
            .withColumn("in_w", F.expr("coalesce(pt_us >= ws_us AND pt_us < we_us, false)"))
            .drop("ws_us", "we_us"))


_LOG = _q(LOG)
# A narrow unit's `reordered_in_log` and `seq_gap` X rows, given rl_high (the highest seq of its pid
# at lower offsets of its partition) and gap_prev (the highest present seq below its own).
ORDER_CHECK_SQL = "concat(" + ", ".join([
    _opt("ktype = 0 AND has_orig AND k2 < rl_high",
         anomaly_sql(_LOG, LOG, "reordered_in_log", "o_part", "pid", "seq", "o_off",
                     late_seq="k2", high_seq="rl_high")),
    _opt(f"present AND k2 - gap_prev - 1 > {MAX_GAP_ROWS}",
         anomaly_sql(_LOG, LOG, "seq_gap", "-1", "pid", "gap_prev + 1", "null", "wide",
                     missing="k2 - gap_prev - 1", first="gap_prev + 1", last="k2 - 1")),
    f"CASE WHEN present AND k2 - gap_prev > 1 AND k2 - gap_prev - 1 <= {MAX_GAP_ROWS} THEN "
    "transform(sequence(gap_prev + 1, k2 - 1), s -> " + anomaly_sql(_LOG, LOG, "seq_gap", "-1", "pid", "s", "null")
    + f") ELSE {EMPTY_X} END",
]) + ")"


# A later message's `content_duplicate` X row, given `first` (the first message's k1, k2).
CONTENT_DUPLICATE_SQL = anomaly_sql(_LOG, LOG, "content_duplicate", "p", "k1", "k2", "o", first_pid="first.k1",
                                    first_seq="first.k2")


def order_checks(narrow: DataFrame) -> DataFrame:
    """`reordered_in_log` and `seq_gap` X rows: the order-dependent checks, as window functions over
    the narrow units (`narrow_units`), so the two sorts they need move a few columns per unit."""
    # Only messages (ktype 0) can be out of order or follow a gap; an unaudited record is a unit of
    # its own. A sort compares its first key's prefix before whole rows: the pid leads, the
    # topic (one value for most windows) follows.
    by_pid_part = (Window.partitionBy("k1", "o_part", "topic").orderBy("o_off")
                   .rowsBetween(Window.unboundedPreceding, -1))
    by_pid = Window.partitionBy("k1", "topic").orderBy("k2").rowsBetween(Window.unboundedPreceding, -1)
    # hashed by pid once: both windows' partitions are unions of these (one exchange, two sorts)
    u = (narrow.where("ktype = 0").repartition("k1").withColumns({
             "rl_high": F.max(F.when(F.col("has_orig"), F.col("k2"))).over(by_pid_part),
             "gap_prev": F.max(F.when(F.col("present"), F.col("k2"))).over(by_pid)})
         .where("in_w"))
    return (u.where("(has_orig AND k2 < rl_high) OR (present AND k2 - gap_prev > 1)")
            .select(F.explode(F.expr(ORDER_CHECK_SQL)).alias("x")).select("x.*"))


def content_duplicates(narrow: DataFrame) -> DataFrame:
    """`content_duplicate` X rows: one shuffle of the narrow units by their fingerprint's 96-bit hash."""
    # the 64-bit hash leads the sort: its prefix alone orders almost every pair of rows
    w = Window.partitionBy("fph", "fph2", "topic").orderBy("pt_us", "k1", "k2")
    narrow = (narrow.where("ktype = 0 AND has_orig AND fph IS NOT NULL")
              .select("topic", "fph", "fph2", "pt_us", "k1", "k2", "in_w", F.col("o_part").alias("p"),
                      F.col("o_off").alias("o")))
    ranked = (narrow.withColumn("rn", F.row_number().over(w))
              .withColumn("first", F.first(F.struct("k1", "k2")).over(
                  w.rowsBetween(Window.unboundedPreceding, Window.unboundedFollowing))))
    return ranked.where("rn > 1 AND in_w").select(F.expr(CONTENT_DUPLICATE_SQL).alias("x")).select("x.*")
