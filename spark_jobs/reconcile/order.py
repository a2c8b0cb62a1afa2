"""The log-stage checks that need neighbouring messages: `reordered_in_log` (`reordered_in_log`, a
window per (pid, partition)), `seq_gap` (`seq_gaps`, bitmaps of present seqs per pid) and
`content_duplicate` (`content_duplicates`, one shuffle by the fingerprint's hash), over one narrow
row per message from either path (`narrow_units`). Codes and detail texts come from the vocabulary
(`anomaly_sql`).

`ORDER_CHECK_SQL` and `CONTENT_DUPLICATE_SQL` are the SQL text alone. This module must not read
or write tables, collect rows, or apply the per-unit rules (`classify.py`).
"""

from __future__ import annotations

from pyspark.sql import DataFrame, Window
from pyspark.sql import functions as F

from audit.core.vocabulary import LOG, MAX_GAP_ROWS
from spark_jobs.reconcile.params import Shape, with_params
from spark_jobs.reconcile.sql import EMPTY_X, _opt, _q, anomaly_sql
from spark_jobs.reconcile.units import _fp_hash, unit_keys


def narrow_units(typed: DataFrame | None, units: DataFrame, params: DataFrame, shape: Shape) -> DataFrame:
    """One narrow row per message (unit of ktype 0: only messages can be out of order, follow a gap
    or repeat a content), simple (typed; None when no typed path ran) or not (described): what the
    order and content checks read -- pid (k1), seq (k2), produce time, the original copy's
    position, presence, the fingerprint's hashes, and whether the message is in the window
    (`in_w`). The clean blocks' units are not among them: their rows come from their log records
    (`blocks.clean_narrow` + `narrow_rows`)."""
    fph, fph2 = _fp_hash(F.col("orig.fingerprint"))
    general = units.select(
        "topic", "ktype", "k1", "k2", "pt_us", F.col("orig.partition").alias("o_part"),
        F.col("orig.offset").alias("o_off"), F.col("orig").isNotNull().alias("has_orig"),
        ((F.size("L") > 0) | (F.size("R") > 0)).alias("present"), fph, fph2)
    # a clean block's unit reaches the typed path without its log record: its row is `clean_narrow`'s
    out = general if typed is None else typed.where("simple AND NOT cb").select(*unit_keys(typed)).unionByName(general)
    return narrow_rows(out.where("ktype = 0"), params, shape)


def narrow_rows(units: DataFrame, params: DataFrame, shape: Shape) -> DataFrame:
    """Narrow rows of messages (ktype 0, e.g. `blocks.clean_narrow`'s) as `narrow_units` gives them:
    with whether the message is in the window (`in_w`)."""
    return (with_params(units, params, shape, "ws_us", "we_us")
            .withColumn("in_w", F.expr("coalesce(pt_us >= ws_us AND pt_us < we_us, false)"))
            .drop("ktype", "ws_us", "we_us"))


_LOG = _q(LOG)
# A message's `reordered_in_log` X row, given rl_high (the highest seq of its pid at lower offsets of
# its partition).
REORDERED_SQL = anomaly_sql(_LOG, LOG, "reordered_in_log", "o_part", "k1", "k2", "o_off", late_seq="k2",
                            high_seq="rl_high")
# The `seq_gap` X rows before a present seq k2 whose highest present predecessor is gap_prev
# (k2 - gap_prev > 1): one per missing seq, or one "wide" row past MAX_GAP_ROWS.
GAP_SQL = "concat(" + ", ".join([
    _opt(f"k2 - gap_prev - 1 > {MAX_GAP_ROWS}",
         anomaly_sql(_LOG, LOG, "seq_gap", "-1", "k1", "gap_prev + 1", "null", "wide",
                     missing="k2 - gap_prev - 1", first="gap_prev + 1", last="k2 - 1")),
    f"CASE WHEN k2 - gap_prev - 1 <= {MAX_GAP_ROWS} THEN "
    "transform(sequence(gap_prev + 1, k2 - 1), s -> " + anomaly_sql(_LOG, LOG, "seq_gap", "-1", "k1", "s", "null")
    + f") ELSE {EMPTY_X} END",
]) + ")"
ORDER_CHECK_SQL = REORDERED_SQL + "\n" + GAP_SQL  # the SQL text of both checks (the vocabulary test reads it)

# seq_gap works on bitmaps of 2^GAP_BITS consecutive seqs of a pid instead of sorting every unit.
GAP_BITS = 6
_BIT = f"(shiftright({{bits}}, cast({{s}} & {(1 << GAP_BITS) - 1} as int)) & 1) = 1"
# A gap block's present seqs paired with their highest present predecessor (prev_hi for the first),
# kept where the seq is in the window and follows a gap.
_GAP_PAIRS_SQL = (
    "filter(zip_with(p, concat(array(prev_hi), slice(p, 1, size(p) - 1)), "
    "(s, q) -> named_struct('k2', s, 'gap_prev', q)), "
    "x -> x.k2 - x.gap_prev > 1 AND " + _BIT.format(bits="wbits", s="x.k2") + ")")


def order_checks(narrow: DataFrame) -> DataFrame:
    """`reordered_in_log` and `seq_gap` X rows, the checks that need a unit's neighbours."""
    return reordered_in_log(narrow).unionByName(seq_gaps(narrow))


def reordered_in_log(msgs: DataFrame) -> DataFrame:
    """A message is reordered when its pid has a higher seq at a lower offset of its partition: one
    sort per (pid, partition) of the log records' (seq, offset), six narrow columns per record. The
    sort's key is the pid and partition, so a window's few pids spread over all tasks."""
    by_pid_part = (Window.partitionBy("k1", "o_part", "topic").orderBy("o_off")
                   .rowsBetween(Window.unboundedPreceding, -1))
    return (msgs.where("has_orig").select("topic", "k1", "k2", "o_part", "o_off", "in_w")
            .withColumn("rl_high", F.max("k2").over(by_pid_part))
            .where("in_w AND k2 < rl_high")
            .select(F.expr(REORDERED_SQL).alias("x")).select("x.*"))


def seq_gaps(msgs: DataFrame) -> DataFrame:
    """`seq_gap` rows without sorting the units: each pid's present seqs become bitmaps of
    2^GAP_BITS seqs (with the lowest and highest seq, and a second bitmap of the seqs in the
    window), reduced map-side; one small window over the bitmaps gives each its predecessor's
    highest seq. Only a bitmap with a hole, or that does not follow on from its predecessor, is
    decoded into (seq, highest present seq below it) pairs -- the same pairs a sort of every
    present seq would give."""
    bit = F.expr(f"shiftleft(1L, cast(k2 & {(1 << GAP_BITS) - 1} as int))")
    blocks = (msgs.where("present")
              .groupBy("topic", "k1", F.shiftright("k2", GAP_BITS).alias("gb"))
              .agg(F.min("k2").alias("lo"), F.max("k2").alias("hi"), F.bit_or(bit).alias("bits"),
                   F.bit_or(F.when(F.col("in_w"), bit).otherwise(F.lit(0).cast("bigint"))).alias("wbits")))
    by_pid = Window.partitionBy("topic", "k1").orderBy("gb")
    return (blocks.withColumn("prev_hi", F.lag("hi").over(by_pid))
            .where("(lo - prev_hi > 1 OR bit_count(bits) < hi - lo + 1) AND wbits != 0")
            .withColumn("p", F.expr("filter(sequence(lo, hi), s -> " + _BIT.format(bits="bits", s="s") + ")"))
            .select("topic", "k1", F.explode(F.expr(_GAP_PAIRS_SQL)).alias("g"))
            .select("topic", "k1", "g.k2", "g.gap_prev")
            .select(F.explode(F.expr(GAP_SQL)).alias("x")).select("x.*"))


# A later message's `content_duplicate` X row, given `first` (the first message's k1, k2).
CONTENT_DUPLICATE_SQL = anomaly_sql(_LOG, LOG, "content_duplicate", "p", "k1", "k2", "o", first_pid="first.k1",
                                    first_seq="first.k2")


def repeated_hashes(narrow: DataFrame) -> DataFrame:
    """The 64-bit fingerprint hashes (`fph`) held by two or more narrow units: one hash aggregation
    of a long per message, no sort. Every content duplicate's hash is among them (a 64-bit
    collision only lets a few more units through to `content_duplicates`' exact ranking)."""
    return narrow.where("has_orig AND fph IS NOT NULL").groupBy("fph").count().where("count > 1").select("fph")


def content_duplicates(narrow: DataFrame, repeated: DataFrame | None = None) -> DataFrame:
    """`content_duplicate` X rows: the narrow units ranked within their fingerprint's 96-bit hash
    (one shuffle by it). With `repeated` (`repeated_hashes`, few enough to broadcast) only the units
    holding one of those hashes are ranked: the rest have no other unit with their content."""
    # the 64-bit hash leads the sort: its prefix alone orders almost every pair of rows
    w = Window.partitionBy("fph", "fph2", "topic").orderBy("pt_us", "k1", "k2")
    narrow = narrow.where("has_orig AND fph IS NOT NULL")
    if repeated is not None:
        narrow = narrow.join(F.broadcast(repeated), "fph", "left_semi")
    narrow = (narrow
              .select("topic", "fph", "fph2", "pt_us", "k1", "k2", "in_w", F.col("o_part").alias("p"),
                      F.col("o_off").alias("o")))
    ranked = (narrow.withColumn("rn", F.row_number().over(w))
              .withColumn("first", F.first(F.struct("k1", "k2")).over(
                  w.rowsBetween(Window.unboundedPreceding, Window.unboundedFollowing))))
    return ranked.where("rn > 1 AND in_w").select(F.expr(CONTENT_DUPLICATE_SQL).alias("x")).select("x.*")
