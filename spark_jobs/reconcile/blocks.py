"""Summary first (docs/design.md §5.9): blocks of consecutive seqs whose tiers agree are settled from
digests; only their latencies still need a (narrower) per-unit aggregation.

A *block* is (topic, pid, seq >> BLOCK_BITS): up to 2^BLOCK_BITS consecutive messages of one
producer session. `block_digests` reduces every tier's rows of a block to a few fixed-width values
-- row counts, the bitmap of the seqs present (`bit_or`), the XOR of a 64-bit hash of each row's
(seq, partition, offset[, produce time]) -- in a hash aggregation whose map side combines the rows of
each input split before they move: what crosses the shuffle is a handful of rows per block, not
the block's rows. A block is *clean* when every tier holds each of its seqs exactly once and the
same way:

- the ledger: every row acked, no seq twice (count = bits set);
- the log: the same seqs, each once, committed, at the ledger's (partition, offset) with the
  ledger's produce time (equal hashes);
- each group of the topic: the same seqs, each processed once, at that (partition, offset), on the
  source cluster;
- each sink of the topic: the same seqs, each once;
- and none of its processings went backwards in offset (`flag_consumption_order`).

Those are, seq by seq, the conditions under which `units.typed_units` calls a unit `simple` (an
ordinary delivered message), so every unit of a clean block is one. Equal hashes stand for equal
(partition, offset, produce time): a dirty block passes for clean only when two 64-bit XOR sums
of different rows collide (the content check relies on 96-bit hashes the same way).

`block_lookup` + `split_by_block` send the rows of every other block (and every unaudited record)
to the exact paths unchanged. A clean block's units need only their latencies per stage and their
narrow rows for the order and content checks (only for the blocks that reach into the window).
The narrow rows come from their log records alone (`clean_narrow`, no shuffle). The latencies:

- of a *local* block -- every group's and sink's row carries the ledger's (partition, offset) and
  produce time (the optional `produce_ts` / `audit_produce_ts`, docs/design.md §4.2; equal hashes
  again) -- from each ledger, group and sink row alone (`local_latencies`, no shuffle);
- of the others, from the typed path's aggregation of their ledger, group and sink rows (marked
  `cb`, which makes them `simple` without the other conditions).

Transforms only: this module must not read or write tables, and decides no anomaly code.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from spark_jobs.reconcile.params import Shape
from spark_jobs.reconcile.units import gather_units, typed_tiers, unit_hash, unit_tiers

# 2^3 = 8 seqs a block: small enough that an anomaly dirties few ordinary neighbours (at 0.1 % of
# each of 16 codes, 9 % of the benchmark's blocks are dirty), large enough that the digests are an
# eighth of the units.
BLOCK_BITS = 3

# Up to this many blocks that are not settled here are broadcast (8 bytes and a slot each) to split
# the tiers; beyond it the split joins by shuffle.
BROADCAST_BLOCKS_MAX = 2_000_000

# When at most this share of the blocks is neither local nor out of the window (`block_lookup`), every
# unit of them -- ordinary ones too -- and every unaudited record go straight to the general path
# (`collect_blocks`), with no typed path: no scan and shuffle of the tiers to sort the few ordinary
# units of dirty blocks from the others. Direct / typed at 10M messages (docs/benchmarks.md): 0.96-1.01
# with 1 % of the blocks dirty, 0.99-1.05 with 2.4 %; at 1M, against the typed path without blocks,
# 1.29 with 9 % (the default mix): the crossover is near this share.
DIRECT_SHARE_MAX = 1 / 32

# A window whose inputs hold fewer rows than this (counted when `reconcile.driver_rows` is set)
# skips the blocks: every row takes the typed shuffle, which then costs less than the digests'
# extra read of every table. Blocks on / off, alternating in one session (docs/benchmarks.md): at
# anomaly rate 1e-4 2M input rows 1.07, 4M 0.95, 8M 0.89; at the benchmark's default mix (1.6 % of
# the messages anomalous) 2M 1.17, 4M 1.10, 8M 1.04, 24M 0.89. A healthy pipeline has far fewer
# anomalies than that mix, so the threshold follows the low-rate crossover.
BLOCKS_MIN_ROWS = 6_000_000


def block_hash() -> Any:
    """A typed tier row's block (topic, k1, k2 >> BLOCK_BITS) as one long (only meaningful for
    audited rows, ktype 0)."""
    return F.xxhash64("topic", "k1", F.shiftright("k2", BLOCK_BITS))


def _block_hash2() -> Any:
    """A second hash of the row's block, independent of `block_hash` (another seed): the digests are
    keyed by both, so two blocks are summed into one digest only if both hashes collide (~2^-128 a
    pair); `block_lookup` catches two blocks sharing `block_hash` alone."""
    return F.xxhash64(F.lit(BLOCK_BITS), "topic", "k1", F.shiftright("k2", BLOCK_BITS))


def block_digests(tiers: DataFrame, shape: Shape, params: DataFrame) -> DataFrame:
    """(topic, bh, settle) per block of the audited rows of `tiers` (`units.typed_tiers`): `settle` is
    'clean' for a clean block that reaches into the window (its facts are wanted), 'local' for one
    that is also local, 'out' for a clean one wholly outside it (nothing to compute but its narrow
    rows), 'outl' for one that is also local, 'dirty' otherwise -- before
    the blocks with a processing that went backwards are made dirty (`mark_backwards`). The blocks are
    grouped by their two hashes and the topic's index (`Shape.topic_index`), not by (topic, pid,
    block number): fixed-width keys keep the aggregation on Spark's fixed-width hash map (a fifth
    less time than with the two strings in the key, at 5M messages)."""
    t = F.col("t")
    bit = F.expr(f"shiftleft(1L, cast(k2 & {(1 << BLOCK_BITS) - 1} AS int))")
    h4 = F.xxhash64("k2", "part", "off", "ts1")
    h3 = F.xxhash64("k2", "part", "off")
    hp = F.xxhash64("k2", "part", "off", "ts2")  # a consumption or sink row with its carried produce time

    def n(cond: Any) -> Any:
        return F.count(F.when(cond, 1))

    def bits(cond: Any) -> Any:
        return F.bit_or(F.when(cond, bit))

    def xor(cond: Any, h: Any) -> Any:
        return F.bit_xor(F.when(cond, h))

    led, log = t == 0, t == 1
    aggs = [n(led).alias("nL"), n(led & (F.col("st") == 1)).alias("oL"), bits(led).alias("bL"),
            xor(led, h4).alias("hL4"), xor(led, h3).alias("hL3"),
            F.min(F.when(led, F.col("ts1"))).alias("ptlo"), F.max(F.when(led, F.col("ts1"))).alias("pthi"),
            n(log).alias("nR"), n(log & F.col("ok")).alias("oR"), bits(log).alias("bR"), xor(log, h4).alias("hR4"),
            n(t == 2).alias("nC"), n(t == 3).alias("nS")]
    for i in range(shape.max_groups):
        c = (t == 2) & (F.col("gi") == i)
        aggs += [n(c).alias(f"n{i}"), n(c & F.col("ok")).alias(f"o{i}"), bits(c).alias(f"b{i}"),
                 xor(c, h3).alias(f"h{i}"), xor(c, hp).alias(f"p{i}")]
    for i in range(shape.max_sinks):
        c = (t == 3) & (F.col("gi") == i)
        aggs += [n(c).alias(f"m{i}"), bits(c).alias(f"q{i}"), xor(c, hp).alias(f"r{i}")]
    col = F.col
    nL, bL, ng, ns = col("nL"), col("bL"), col("n_groups"), col("n_sinks")
    clean = ((nL == F.bit_count(bL)) & (col("oL") == nL) & (col("bR") == bL) & (col("nR") == nL)
             & (col("oR") == nL) & (col("hR4") == col("hL4"))
             & (col("nC") == ng * nL) & (col("nS") == ns * nL))
    for i in range(shape.max_groups):
        clean = clean & ((ng <= i) | ((col(f"n{i}") == nL) & (col(f"o{i}") == nL) & (col(f"b{i}") == bL)
                                      & (col(f"h{i}") == col("hL3"))))
    for i in range(shape.max_sinks):
        clean = clean & ((ns <= i) | ((col(f"m{i}") == nL) & (col(f"q{i}") == bL)))
    # every group's and sink's row carries the ledger's (partition, offset) and produce time: each
    # row alone gives its latency (`local_latencies`)
    local = F.lit(True)
    for i in range(shape.max_groups):
        local = local & ((ng <= i) | (col(f"p{i}") == col("hL4")))
    for i in range(shape.max_sinks):
        local = local & ((ns <= i) | (col(f"r{i}") == col("hL4")))
    local = F.coalesce(local, F.lit(False))
    inside = (col("pthi") >= col("ws_us")) & (col("ptlo") < col("we_us"))
    digests = (tiers.where("ktype = 0")
               .groupBy(block_hash().alias("bh"), _block_hash2().alias("bh2"), shape.topic_index().alias("ti"))
               .agg(*aggs)
               .join(F.broadcast(params.select("ti", "topic", "n_groups", "n_sinks", "ws_us", "we_us")), "ti")
               .select("topic", "bh",
                       F.when(F.coalesce(clean, F.lit(False)),
                              F.when(~inside, F.when(local, "outl").otherwise("out"))
                              .when(local, "local").otherwise("clean"))
                       .otherwise("dirty").alias("settle")))
    return digests


def mark_backwards(digests: DataFrame, flagged: DataFrame) -> DataFrame:
    """`digests` with every block holding a processing that went backwards (`flagged`:
    `units.reordered_processings`) made 'dirty': such a unit is not ordinary, so its block is not
    settled here. Separate from `block_digests` so the two can be computed at the same time."""
    marks = (flagged.where("ktype = 0").select(block_hash().alias("bh")).distinct()
             .withColumn("_back", F.lit(True)))
    return (digests.join(F.broadcast(marks), "bh", "left")
            .withColumn("settle", F.when(F.col("_back"), "dirty").otherwise(F.col("settle")))
            .drop("_back"))


def block_lookup(digests: DataFrame, counts: dict[str, int] | None = None) -> tuple[DataFrame, str]:
    """(lookup, default): (bh, settle) of the blocks `split_by_block` looks the tiers' rows up in,
    and the settle of a row whose block is not in it. The default is whichever of 'local' and
    'clean' more blocks have (a 'local' block counts as 'clean' when 'clean' is the default: its
    latencies then come from the typed path), so the lookup holds the other blocks: the dirty, the
    out-of-window and the minority. When 'local' is the default, an out-of-window block that is
    local ('outl') is left out too, and its rows pass for a local block's: its log records give
    narrow rows as every clean block's do, and none of its ledger, group or sink rows has a produce
    time in the window (each carries the ledger's), which is all `local_latencies` reads (at 10M
    messages a window's lookback hour alone is a million such blocks). Two blocks sharing a hash
    (odds ~2^-64 a pair) would share an entry: both are 'dirty'. `counts`: `block_counts(digests)`,
    if known."""
    counts = block_counts(digests) if counts is None else counts
    default = "local" if counts.get("local", 0) >= counts.get("clean", 0) else "clean"
    settle = (F.regexp_replace("settle", "^outl$", "local") if default == "local"
              else F.regexp_replace(F.regexp_replace("settle", "^local$", "clean"), "^outl$", "out"))
    per_hash = digests.groupBy("bh").agg(F.count(F.lit(1)).alias("_n"), F.min(settle).alias("settle"))
    lookup = per_hash.where(f"_n > 1 OR settle <> '{default}'").select(
        "bh", F.when(F.col("_n") > 1, F.lit("dirty")).otherwise(F.col("settle")).alias("settle"))
    return lookup, default


def lookup_bound(counts: dict[str, int], default: str) -> int:
    """At most how many rows `block_lookup(digests, counts)`'s lookup holds (`default`: its default):
    the blocks whose settle is not the default (blocks sharing a hash share a row). What decides
    whether the lookup is broadcast, without counting it."""
    settled_by_default = {default, "local"} if default == "clean" else {default, "outl"}
    return sum(n for settle, n in counts.items() if settle not in settled_by_default)


def block_counts(digests: DataFrame) -> dict[str, int]:
    """How many blocks each settle has (one small job; `digests` is kept)."""
    return {r["settle"]: int(r["n"]) for r in digests.groupBy("settle").agg(F.count(F.lit(1)).alias("n")).collect()}


def direct(counts: dict[str, int], default: str) -> bool:
    """Whether the blocks that are neither local nor out of the window (`block_counts`; `default`:
    `block_lookup`'s) are few enough (DIRECT_SHARE_MAX of all) to send all their units to the
    general path (`collect_blocks`)."""
    return (default == "local"
            and counts.get("dirty", 0) + counts.get("clean", 0) <= DIRECT_SHARE_MAX * sum(counts.values()))


def as_dirty(lookup: DataFrame) -> DataFrame:
    """`lookup` with its 'clean' blocks made 'dirty': every unit of them goes to the general path."""
    return lookup.withColumn("settle", F.regexp_replace("settle", "^clean$", "dirty"))


def collect_blocks(ledger: DataFrame, log: DataFrame, consumed: DataFrame | None, sinks: DataFrame | None,
                   lookup: DataFrame, bound: int) -> DataFrame:
    """The general path's units (`units.collect_units`' rows) for every unit of the 'dirty' blocks of
    `lookup` and every unaudited record, from the inputs of `units.unit_tiers`: each table's rows
    pass a broadcast lookup of the dirty blocks' hashes (unless the lookup may hold more than
    BROADCAST_BLOCKS_MAX blocks: `bound`, from `lookup_bound`) before their tier structs are built
    and the one shuffle. Two blocks sharing a hash are both dirty (`block_lookup`), so a unit is
    gathered here exactly when `split_by_block` keeps it from the other paths."""
    dirty = lookup.where("settle = 'dirty'").select("bh", F.lit(True).alias("_dirty"))
    if bound <= BROADCAST_BLOCKS_MAX:
        dirty = F.broadcast(dirty)

    def in_dirty_block(keyed: DataFrame) -> DataFrame:
        return (keyed.withColumn("bh", F.when(F.col("ktype") == 0, block_hash()))
                .join(dirty, "bh", "left").where("ktype = 1 OR _dirty").drop("bh", "_dirty"))

    return gather_units(unit_tiers(ledger, log, consumed, sinks, in_dirty_block).withColumn("kh", unit_hash()))


def split_by_block(tiers: DataFrame, lookup: DataFrame, default: str, bound: int,
                   local_tiers: DataFrame | None = None) -> tuple[DataFrame, DataFrame, DataFrame]:
    """(typed, clean_log, local) from `tiers`:

    - `typed`, the rows for `units.typed_units`: every row of the blocks that are not clean and every
      unaudited record (`cb` false), and the ledger, group and sink rows of the 'clean' blocks
      (`cb` true: the unit is ordinary without its log record, which only its latencies would have
      needed) -- one shuffle for both;
    - `clean_log`, the log records of every clean block (for `clean_narrow`);
    - `local`, the ledger, group and sink rows of the 'local' blocks (for `local_latencies`).

    `lookup`, `default`: `block_lookup`. The lookup is broadcast unless it may hold more than
    BROADCAST_BLOCKS_MAX blocks (`bound`: `lookup_bound`); every audited row's block is in the
    digests, so a row whose hash is not in it belongs to a block whose settle is the default.
    `local_tiers`: the tiers `local` is taken from, when not `tiers` (`window_tiers`: only the rows
    `local_latencies` counts)."""
    if bound <= BROADCAST_BLOCKS_MAX:
        lookup = F.broadcast(lookup)

    def settled(df: DataFrame) -> DataFrame:
        return (df.withColumn("bh", F.when(F.col("ktype") == 0, block_hash()))
                .join(lookup, "bh", "left")
                .withColumn("settle", F.when(F.col("ktype") == 0, F.coalesce("settle", F.lit(default))))
                .drop("bh"))

    rows = settled(tiers)
    typed = (rows.where("ktype = 1 OR settle = 'dirty' OR (settle = 'clean' AND t <> 1)")
             .withColumn("cb", F.coalesce(F.col("settle") == "clean", F.lit(False))).drop("settle"))
    local = rows if local_tiers is None else settled(local_tiers)
    return (typed, rows.where("ktype = 0 AND settle <> 'dirty' AND t = 1").drop("settle"),
            local.where("ktype = 0 AND settle = 'local' AND t <> 1").drop("settle"))


def window_tiers(ledger: DataFrame, consumed: DataFrame | None, sinks: DataFrame | None,
                 shape: Shape, ws: datetime, we: datetime) -> DataFrame:
    """`units.typed_tiers` of only the ledger, group and sink rows whose produce time -- the ledger's,
    or the one a consumer or sink carries -- lies in [ws, we): the rows `local_latencies` counts
    (it keeps the same condition). A literal range on each table's own column, so the scans skip
    the files of the lookback hour (Delta's per-file statistics) instead of reading and dropping
    them. Rows without a carried produce time have none to count; no log record is counted."""
    def within(df: DataFrame) -> DataFrame:
        return df.where((F.col("produce_ts") >= F.lit(ws)) & (F.col("produce_ts") < F.lit(we)))

    carried = consumed if consumed is not None and "produce_ts" in consumed.columns else None
    return typed_tiers(within(ledger), None, within(carried) if carried is not None else None,
                       within(sinks) if sinks is not None else None, shape)


def local_latencies(local: DataFrame, params: DataFrame, shape: Shape) -> DataFrame:
    """(topic, si, partition, latency, n) of the 'local' blocks' units: how many rows of `local` (their
    ledger, group and sink rows) whose message is in the window have each latency. Each row's is
    what `classify.simple_latencies` gives for a simple unit, from the row alone -- the ledger row's
    ack time, a group row's consume time, a sink row's write time, minus the produce time, which the
    digests hold equal to the ledger's in every row, as they hold its partition. Counted per
    distinct latency on the map side (clients stamp whole milliseconds: few distinct values), so
    what is kept is small and the exact percentiles' second look (`stats.latency_at_ranks`) reads
    the counts, not every row again."""
    si = (F.when(F.col("t") == 0, F.lit(0)).when(F.col("t") == 2, 1 + F.col("gi"))
          .otherwise(1 + shape.max_groups + F.col("gi")))
    pt = F.when(F.col("t") == 0, F.col("ts1")).otherwise(F.col("ts2"))
    done = F.when(F.col("t") == 0, F.col("ts2")).otherwise(F.col("ts1"))
    # counted per topic index, not name: a string in the key keeps the aggregation off Spark's
    # fixed-width hash map
    return (local.withColumn("ti", shape.topic_index())
            .join(F.broadcast(params.select("ti", "ws_us", "we_us")), "ti")
            .where((pt >= F.col("ws_us")) & (pt < F.col("we_us")))
            .groupBy("ti", si.cast("int").alias("si"), F.col("part").cast("int").alias("partition"),
                     ((done - pt) / 1000.0).cast("double").alias("latency"))
            .agg(F.count(F.lit(1)).alias("n"))
            .join(F.broadcast(params.select("ti", "topic")), "ti").drop("ti"))


def clean_narrow(clean_log: DataFrame) -> DataFrame:
    """The narrow rows (`order.narrow_units`' columns before `in_w`, which `order.narrow_rows`
    adds) of every clean block's units, from their one log record each: the position, the
    fingerprint's hashes and the produce time (the ledger's: the digests hold them equal)."""
    return clean_log.select(
        "topic", "ktype", "k1", "k2",
        F.col("ts1").alias("pt_us"), F.col("part").alias("o_part"), F.col("off").alias("o_off"),
        F.lit(True).alias("has_orig"), F.lit(True).alias("present"), "fph", "fph2")
