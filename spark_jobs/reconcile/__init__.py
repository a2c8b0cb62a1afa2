"""`msgaudit reconcile`: classify one (topic, window) at the log, every group and every sink stage
(docs/design.md §5) and publish `audit_partition_report` + `audit_anomalies` (Delta and the report store).

The rules are stated once, readably, in `audit/oracle.py` (its docstring lists every decision
docs/design.md leaves open); this package is the same rules as Spark transforms, and a property test
holds the two equal row for row. A batch small enough (`reconcile.driver_rows`) is collected and
classified by the oracle in the driver instead (`driver`, docs/design.md §5.8): a Spark plan's fixed
cost is most of a small window's time. A larger one, up to `reconcile.columnar_rows`, is read as
Arrow columns and settled there (`columnar`, §5.10): the ordinary messages by vectorised passes, the
others by the oracle; a larger one the same way in chunks, split by message, two settled at once
holding at most that many rows (`classify_columnar_chunks`; a window of more than
`columnar.SPLIT_ROWS` rows is chunked even within `columnar_rows`, so that it settles on both
cores). Apart from `driver` and `columnar`, this package never imports the oracle (an import
contract checks it): what the two share -- codes,
statuses and detail texts (`audit.core.vocabulary`), read ranges and run ids
(`audit.core.windows`), percentiles and report assembly (`audit.core.percentiles`,
`audit.core.report`) -- lives in `audit.core`.

Many topics, one plan: every row of every tier carries its `topic`, and everything a topic's rules
need beyond its rows -- its groups and sinks, their stage names, its constants -- is looked up per
row (`params.Shape`, `params.batch_params`: one row per topic), so `classify_batch` classifies all
topics of a window (those with the same read ranges, at most MAX_TOPICS_PER_PLAN) with the same
few Spark jobs one topic needs; `reconcile_range` reads each table's Delta log once per run and
publishes each batch with one commit per output table. Shape of the computation, for one window:

1. `reordered_processings`: one shuffle of a narrow projection of the processings by (partition,
   group, topic) and one sort of each, by offset from the highest down, then in consume order,
   finds the first processings of an offset after a processing of a higher one
   (`reordered_in_consumption`). Only those few rows are kept: their units go to the general
   path, and `with_reorder` marks them there with a broadcast lookup.
2. Summary first (`blocks`, docs/design.md §5.9): `block_digests` reduces every audited tier row
   to a few fixed-width values per block of 2^BLOCK_BITS consecutive seqs of a pid -- counts, the
   bitmap of seqs present, XORs of hashes of (seq, partition, offset, produce time) -- combined on
   the map side, so only digests cross the shuffle. A clean block (every tier holds each of its
   seqs once, at the same place; no processing backwards) holds only ordinary messages:
   `split_by_block` keeps its rows out of the paths below. A clean block reaching into the window
   whose group and sink rows carry the ledger's produce time (§4.2, checked by the digests) gets
   its latencies from each row alone (`local_latencies`, counted per distinct latency where the
   rows are read, so only the counts are kept); the other clean ones' ledger, group and
   sink rows go to the typed path (marked `cb`: simple by the digests) for their latencies.
   `clean_narrow` gives their narrow rows from their log records. Every other row -- dirty
   blocks, unaudited records -- takes steps 3 and 4 unchanged; when those blocks are few
   (`blocks.direct`), step 3 is skipped and `collect_blocks` gathers all their units for step 4.
3. Typed path, for every other unit: `typed_tiers` + `typed_units` key every tier (ledger, log,
   consumption, sinks) by its unit (topic, pid, seq) -- or (partition, offset) for unaudited
   records -- and ONE shuffle, hashed by the unit key, reduces each unit to fixed-width aggregates (counts,
   the single partition/offset/times, two hashes of the fingerprint): a compiled hash aggregation,
   no arrays. `simple` marks the ordinary delivered messages (one acked ledger row, its one
   committed log record at the acked offset, processed once by each group -- in order, unless
   flagged in step 1 --, one row in each sink) -- the vast majority. An ordinary message has no
   anomaly of its own and is expected and delivered at every stage: `simple_latencies` gives its
   latency per stage from the aggregates, four narrow fields per row, and `summarise_delivered`
   sums them per (stage, partition, latency bucket) straight into the summary (step 6).
4. General path, for the other units only: their key hashes (a broadcast of one long per unit,
   unless there are millions) semi-join the tiers before the shuffle of `unit_tiers` +
   `collect_units`, which gathers each unit's rows into arrays (the direct way, `collect_blocks`,
   looks each table's rows up before `unit_tiers` builds their tier structs); `describe_units` + `classify`
   apply every rule of docs/design.md §5 with array expressions. The property test holds both paths,
   together, equal to the oracle.
5. `narrow_units` puts one narrow row per message (either path) together, kept, beside the clean
   blocks' (`clean_narrow` + `narrow_rows`, from their log records), for the checks that need
   neighbours: `reordered_in_log` (one sort per (pid, partition) of the log records'
   seq and offset), `seq_gap` (each pid's present seqs as bitmaps of 64 reduced map-side; only a
   bitmap with a hole, or not following on from the one before, is decoded) and
   `content_duplicates` (one shuffle by the fingerprint's 96-bit hash -- a collision would need
   ~2^48 distinct fingerprints in one window's reach -- of only the units whose 64-bit hash
   another unit holds, `repeated_hashes`, when the narrow rows are not too many).
6. One small aggregation turns facts into per-(stage, partition, latency bucket) counts and keeps
   anomaly rows as they are; that result is small and is persisted, so the heavy part runs once
   (rebalanced first: few partitions, so each small job that reads it runs a task or two, not one per
   shuffle partition).
   Exact percentiles (`stage_stats`): the bucket counts locate each wanted rank; a bucket whose
   smallest and largest latency are equal holds one value (clients stamp whole milliseconds, so
   most do), and only the latencies of the other wanted buckets are read again and sorted --
   bounded memory, unlike Spark's `percentile`.
   What more than one step reads (the flagged processings, the block digests and lookup, the
   local blocks' latency counts, the typed units, the general path's keys, the described units,
   the narrow rows), and the repeated fingerprint hashes (their count decides the broadcast), is
   kept as a local checkpoint (`materialise`) and freed (`release`) once the summary is in. Steps that do not read each
   other's results are kept side by side, from two more driver threads: the order of consumption
   beside the digests, the local blocks' latencies and the clean blocks' narrow rows beside the
   general path. One job's last tasks, and the driver's planning of the next, leave a core idle
   that the other's tasks take (docs/benchmarks.md). The first two start before the window's
   watermarks, group offsets and commits are collected (`window_lookups`): neither reads them, and
   those small jobs run between their tasks. Every job is named after the window and its step
   (`job_label`, `session.described`; the Spark UI's Description, docs/design.md §9).

Modules, by concern (each docstring says what it must not do):

- `inputs`: what one window reads (`read_window_inputs`, I/O) and its exact visibility (`restrict`);
- `params`: the window's constants and per-partition lookups, one broadcast row per topic, and
  `Shape` (the topics of one plan);
- `blocks`: the digests of blocks of seqs, the split into clean blocks and the rest, and the clean
  blocks' narrow rows;
- `units`: keying every tier by unit, the typed path (`typed_tiers`, `typed_units`) and the
  general path's gathering (`unit_tiers`, `collect_units`, `describe_units`);
- `classify`: the per-unit rules of docs/design.md §5 as SQL (`classify`, `simple_latencies`);
- `order`: the checks that need neighbours (`order_checks`, `content_duplicates`);
- `stats`: the summary, latency buckets and exact percentiles;
- `sql`: the SQL text helpers (X rows, literals, detail texts from the vocabulary's templates);
- `outputs`: publishing a window (`write_outputs`, I/O);
- `driver`: small batches, collected and counted (`collect_inputs`, I/O) and classified by the oracle;
  medium ones read as Arrow columns (`collect_tables`, I/O), larger ones split into chunks spilled to
  Arrow IPC files (`spill_tables`, I/O);
- `columnar`: medium batches settled on Arrow columns, the messages that are not ordinary classified
  by the oracle; larger ones split by message (`Split`) and settled chunk by chunk (`classify_chunks`);
- this module: one window end to end (`classify_window`, `reconcile_window`), ranges and the CLI.

Transforms take and return DataFrames and never read or write tables; `inputs.read_window_inputs`
and `outputs.write_outputs` are the only I/O (with `spark_jobs/io/sinks_read.py` for sinks).
"""

from __future__ import annotations

import contextlib
import json
import tempfile
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from pyspark import StorageLevel
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from audit.core.config import Config, TopicConfig
from audit.core.errors import InputError, ResultReleased
from audit.core.failover import Failover, ignored_rows_lines
from audit.core.report import assemble_report
from audit.core.vocabulary import ANOMALY_COLUMNS
from audit.core.windows import run_id_for, windows
from audit.oracle import Inputs as OracleInputs
from audit.oracle import OracleResult
from spark_jobs.io.session import described, local_frame
from spark_jobs.reconcile import blocks, columnar
from spark_jobs.reconcile.blocks import (
    block_digests,
    block_lookup,
    clean_narrow,
    local_latencies,
    split_by_block,
)
from spark_jobs.reconcile.classify import classify, simple_latencies, with_stage_names
from spark_jobs.reconcile.driver import (
    classify_collected,
    collect_inputs,
    collect_tables,
    spill_held,
    spill_tables,
)
from spark_jobs.reconcile.failover import failover_lookups, ignored_x, translate
from spark_jobs.reconcile.inputs import (
    WindowInputs,
    batches,
    check_window_inputs,
    ledger_is_valid,
    pinned,
    read_batch_inputs,
    read_window_inputs,
    restrict,
    sink_rows,
    sinks_in_range,
)
from spark_jobs.reconcile.mirror import mirror_x
from spark_jobs.reconcile.order import (
    content_duplicates,
    narrow_rows,
    narrow_units,
    order_checks,
    repeated_hashes,
)
from spark_jobs.reconcile.outputs import write_outputs, write_window_outputs
from spark_jobs.reconcile.params import Lookups, Shape, batch_params, collect_lookups
from spark_jobs.reconcile.sql import X_FIELDS, _q
from spark_jobs.reconcile.stats import stage_stats, summarise, summarise_delivered
from spark_jobs.reconcile.units import (
    KEY,
    collect_units,
    describe_units,
    flag_consumption_order,
    reordered_processings,
    typed_tiers,
    typed_units,
    unit_tiers,
    with_reorder,
)

__all__ = [
    "ANOMALY_COLUMNS", "MAX_TOPICS_PER_PLAN", "X_FIELDS", "Classified", "Lookups", "Shape", "WindowInputs",
    "WindowResult", "classify_batch", "classify_window", "collect_lookups", "flag_consumption_order", "pinned",
    "read_window_inputs",
    "reconcile_batch", "reconcile_frames", "reconcile_range", "reconcile_window", "restrict", "stage_stats", "summarise",
    "sink_rows", "sinks_in_range", "summary_line", "typed_tiers", "typed_units", "write_outputs",
]


@dataclass
class WindowResult:
    topic: str
    window_start: datetime
    as_of: datetime
    run_id: str
    report: list[dict[str, Any]]
    _anomalies: DataFrame
    anomaly_count: int
    quarantined_ledger_rows: int
    empty: bool
    cached: list[DataFrame] = field(default_factory=list)
    released: bool = False
    # (group, cluster) -> consumption rows read on a mirror the group does not fail over to (§5.5)
    ignored_mirror_rows: dict[tuple[str, str], int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)  # said after the summary line: what was ignored, the fix

    @property
    def anomalies(self) -> DataFrame:
        """The window's anomaly rows, computed from the cached summary. Read (or collect) them before
        `release()`: the summary's lineage ends in checkpoints that were freed once it was computed,
        so after `release()` this raises ResultReleased instead of a Spark error about missing blocks."""
        if self.released:
            raise ResultReleased(
                f"reconcile result of topic {self.topic!r}, window {self.window_start.isoformat()}: anomalies "
                "read after release(); collect them before release(), or read the published rows "
                "(audit_anomalies)")
        return self._anomalies

    def release(self) -> None:
        """Drop the cached summary; `anomalies` raises ResultReleased from now on. Idempotent."""
        for df in self.cached:
            df.unpersist()
        self.cached.clear()
        self.released = True


def materialise(df: DataFrame) -> tuple[DataFrame, int]:
    """Computes `df` now and keeps its rows (memory, then local disk) for the steps that read it
    again; returns the kept frame and how many rows it holds. A local checkpoint stores the rows as
    they are; `persist()` would first encode them into compressed column batches, which cost a third
    of the typed path's time at scale. Its lineage is cut, so it must not be read after `release`.
    When computing them fails, the rows already kept are freed before the error is raised (an eager
    checkpoint would leave them to the context cleaner, whenever the JVM next collects garbage)."""
    kept = df.localCheckpoint(eager=False, storageLevel=StorageLevel.MEMORY_AND_DISK)
    rdd = _kept_rdd(kept)
    try:
        n = int(rdd.count())  # computes and keeps every partition; the job's end marks the rows checkpointed
    except BaseException:
        rdd.unpersist(False)
        raise
    return kept, n


def _kept_rdd(df: DataFrame) -> Any:
    """The JVM RDD holding a `materialise`d frame's rows, or None for any other frame."""
    plan = df._jdf.queryExecution().analyzed()
    return plan.rdd() if plan.getClass().getSimpleName() == "LogicalRDD" else None


def release(df: DataFrame) -> None:
    """Frees the rows of a `materialise`d frame now (the context cleaner would only do it once the
    frame is garbage-collected, which a backfill over many windows should not wait for)."""
    rdd = _kept_rdd(df)
    if rdd is not None:
        rdd.unpersist(False)


@dataclass
class Classified:
    report: list[dict[str, Any]]
    anomalies: DataFrame
    anomaly_count: int
    quarantined: int
    empty: bool
    summary: DataFrame  # persisted; `anomalies` reads it
    ignored: dict[tuple[str, str], int] = field(default_factory=dict)  # (group, cluster) -> rows (§5.5)
    notes: list[str] = field(default_factory=list)


def reconcile_frames(spark: SparkSession, inputs: WindowInputs, tc: TopicConfig, ws: datetime,
                     as_of: datetime) -> tuple[list[dict[str, Any]], DataFrame, int, bool]:
    """Classify one window: (report rows, anomaly DataFrame, quarantined ledger rows, empty?)."""
    w = classify_window(spark, inputs, tc, ws, as_of)
    return w.report, w.anomalies, w.quarantined, w.empty


def classify_window(spark: SparkSession, inputs: WindowInputs, tc: TopicConfig, ws: datetime,
                    as_of: datetime, rows: int | None = None) -> Classified:
    """Classify one topic's window (a batch of one); `rows`: as `classify_batch`."""
    return classify_batch(spark, inputs, Shape((tc,)), ws, as_of, rows)[tc.name]


# Up to this many narrow rows (one per message in a window's reach), the fingerprint hashes two
# units share are found first (`order.repeated_hashes`: a hash aggregation of one long per
# message, kept) and, up to BROADCAST_HASHES of them, broadcast to pick the only units
# `content_duplicates` ranks; otherwise every unit is ranked. At 2M narrow rows (1M messages, rate
# 1e-4) a window took 0.95-0.97 of the time of ranking them all, at 32,000 1.01; at 20M (10M
# messages, the benchmark's default mix) 1.03-1.04: the count of 20M hashes costs more than the
# ranking it spares (docs/benchmarks.md).
PREFILTER_MAX_ROWS = 4_000_000
BROADCAST_HASHES = 1_000_000

# At most this many topics share one plan: a window's Spark jobs are a handful per batch, whatever
# its topic count, and one plan's size (its union branches, the literal lookup maps) stays bounded.
MAX_TOPICS_PER_PLAN = 64


def classify_batch(spark: SparkSession, inputs: WindowInputs, shape: Shape, ws: datetime,
                   as_of: datetime, rows: int | None = None) -> dict[str, Classified]:
    """Classify one window of every topic of `shape` in one plan (the topics share their read
    ranges: `inputs.batches`): every row carries its topic, so the Spark jobs -- the actions below
    and the materialised steps -- are the same few for one topic or for many. The only actions are
    on small things: watermarks and group offsets (collected for the lookup maps), the persisted
    summary (its per-code counts and quarantine counts, the per-stage sums, the latencies at the
    wanted ranks). `rows`: how many rows the inputs hold, when counted (`collect_inputs`); fewer
    than `blocks.BLOCKS_MIN_ROWS` skip the blocks (docs/design.md §5.9)."""
    vis = restrict(inputs, shape, ws)
    valid = ledger_is_valid()
    ledger = vis.ledger.where(valid)
    all_consumed = vis.consumed
    failover: dict[str, dict[str, Failover]] = {}  # topic -> group -> its failover
    if vis.failover is not None and vis.consumed is not None:  # §5.5: groups that failed over to a mirror
        failover = failover_lookups(vis.failover, ledger, vis.log, vis.mirror_log, vis.mirror_group_offsets, shape, ws)
        all_consumed = vis.consumed.unionByName(translate(vis.failover, ledger, vis.log, shape, vis.consumed.columns))
    sinks = sink_rows(vis)
    cached: list[DataFrame] = []

    label = job_label(shape, ws)

    def keep(df: DataFrame, step: str) -> tuple[DataFrame, int]:
        """`materialise`s `df` (the kept frame and its rows), its jobs named after `step`; the frame is
        freed with the window's other kept frames."""
        with described(spark, f"{label}: {step}"):
            kept, n = materialise(df)
        cached.append(kept)
        return kept, n

    try:
        with ThreadPoolExecutor(max_workers=2, thread_name_prefix="msgaudit-reconcile") as pool:
            # Steps that do not read each other's results are materialised side by side (`beside`):
            # one job's last tasks, and the driver's planning of the next, leave a core idle that the
            # other job's tasks take.
            def beside(df: DataFrame, step: str) -> Future[tuple[DataFrame, int]]:
                return pool.submit(keep, df, step)

            # The first two steps start before the window's small lookups are collected (their jobs
            # then run between those steps' tasks): neither reads them. A unit one of whose
            # processings went backwards is not ordinary: the order check runs once, over the
            # consumption rows alone, and only its flagged rows come back.
            flagged_f = beside(reordered_processings(vis.consumed), "consumption order") if vis.consumed is not None else None
            tiers = typed_tiers(ledger, vis.log, all_consumed, sinks, shape)
            # below the row threshold the shuffle the digests spare costs less than computing them
            blocks_on = rows is None or rows >= blocks.BLOCKS_MIN_ROWS
            digests_f = None
            if blocks_on:  # beside the flagging; the digests read the window's constants, not its lookups
                constants = batch_params(spark, shape, ws, as_of, {tc.name: collect_lookups([], [], tc.groups)
                                                                   for tc in shape.topics})
                digests_f = beside(block_digests(tiers, shape, constants), "block digests")
            with described(spark, f"{label}: lookups"):
                lookups = window_lookups(vis, shape)
            for t, per_group in failover.items():
                lookups[t].failover = per_group
            params = batch_params(spark, shape, ws, as_of, lookups)
            # Summary first: blocks of seqs whose tiers agree are settled from their digests; only the
            # rows of the other blocks (and unaudited records) go on to the exact paths below.
            local_f: Future[tuple[DataFrame, int]] | None = None
            clean_f: Future[tuple[DataFrame, int]] | None = None  # the clean blocks' narrow rows
            direct: DataFrame | None = None  # the block lookup, when every unit of its dirty blocks goes straight to step 4
            flagged = flagged_f.result()[0] if flagged_f is not None else None
            if digests_f is not None:
                digests, _ = digests_f.result()
                if flagged is not None:
                    digests = blocks.mark_backwards(digests, flagged)
                with described(spark, f"{label}: block lookup"):
                    counts = blocks.block_counts(digests)
                lookup, default = block_lookup(digests, counts)
                # few blocks to look at: all their units take the general path, and no typed path runs
                few = blocks.direct(counts, default)
                lookup, _ = keep(blocks.as_dirty(lookup) if few else lookup, "block lookup")
                direct = lookup if few else None
                bound = blocks.lookup_bound(counts, default)  # decides the broadcasts without a count
                local_tiers = None  # the local rows come from the window's files alone
                if default == "local":
                    window_end = ws + shape.topics[0].window
                    local_tiers = blocks.window_tiers(ledger, all_consumed, sinks, shape, ws, window_end)
                typed_rows, clean_log, local_rows = split_by_block(tiers, lookup, default, bound, local_tiers)
                if default == "local":  # a clean block's latencies from each of its rows alone
                    local_f = beside(local_latencies(local_rows, params, shape), "local latencies")
                clean_f = beside(narrow_rows(clean_narrow(clean_log), params, shape), "clean narrow rows")
            else:
                typed_rows = tiers.withColumn("cb", F.lit(False))
            consumed = with_reorder(all_consumed, flagged) if all_consumed is not None and flagged is not None else None
            typed: DataFrame | None = None
            if direct is not None:  # every unit of the dirty blocks, and every unaudited record
                units, _ = keep(describe_units(blocks.collect_blocks(ledger, vis.log, consumed, sinks, direct, bound), params), "general path")
            else:
                # Typed path: every other unit's tiers as fixed-width aggregates, and the clean blocks'
                # times for their latencies; ordinary messages end here.
                typed = typed_units(typed_rows, shape, params)
                if flagged is not None:
                    marks = flagged.select(*KEY).distinct().withColumn("_reordered", F.lit(True))
                    typed = (typed.join(F.broadcast(marks), KEY, "left")
                             .withColumn("simple", F.col("simple") & F.col("_reordered").isNull()).drop("_reordered"))
                typed, _ = keep(typed, "typed path")
                # General path: only the other units' rows are gathered into arrays (a broadcast semi-join
                # on their key hashes before their shuffle, so the ordinary majority never reaches it;
                # Spark pushes a semi-join below the union and the tier structs itself).
                keys, _ = keep(typed.where("NOT simple").select(*KEY), "general path keys")  # read thrice below: counted, broadcast, joined
                units, _ = keep(describe_units(collect_units(unit_tiers(ledger, vis.log, consumed, sinks), keys), params), "general path")
            # read by three checks: kept, so the clean blocks' log records are read once more, not thrice
            narrow, n_narrow = keep(narrow_units(typed, units, params, shape), "narrow rows")
            if clean_f is not None:
                clean, n_clean = clean_f.result()
                narrow, n_narrow = narrow.unionByName(clean), n_narrow + n_clean
            # the fingerprints more than one unit holds: only their units are ranked for content duplicates
            repeated, n_repeated = keep(repeated_hashes(narrow), "repeated hashes") if n_narrow <= PREFILTER_MAX_ROWS else (None, 0)
            local = local_f.result()[0] if local_f is not None else None
    except BaseException:
        for df in cached:  # a step failed: what the others kept is freed now, not left behind
            release(df)
        raise
    # the ordinary messages' facts: a latency per stage (in the direct case, those of the local blocks)
    parts = [df for df in (simple_latencies(typed, params, shape) if typed is not None else None, local)
             if df is not None]
    simple = parts[0] if len(parts) == 1 else parts[0].unionByName(parts[1])
    facts = classify(units, shape)
    for tc in shape.topics:  # stage mirror:<m>, its own module, per mirrored topic
        one = F.col("topic") == tc.name
        mirrored = mirror_x(ledger.where(one), vis.log.where(one), vis.mirror_log, vis.mirror_watermarks, tc, ws, as_of)
        if mirrored is not None:
            facts = facts.unionByName(mirrored)
    # malformed ledger rows travel as X rows of kind 'Q': counted by the summary, no job of their own
    nulls = {n: F.lit(None).cast(t) for n, t in X_FIELDS}
    quarantine = vis.ledger.where(~valid).select(
        *[F.col("topic") if n == "topic" else F.lit("Q").alias("kind") if n == "kind" else nulls[n].alias(n)
          for n, _ in X_FIELDS])
    few = repeated is not None and n_repeated <= BROADCAST_HASHES
    dups = content_duplicates(narrow, repeated if few else None)
    x = (facts.unionByName(order_checks(narrow)).unionByName(dups)
         .unionByName(quarantine))
    if vis.ignored is not None:  # rows read on a mirror the group does not fail over to: kind 'I', counted
        x = x.unionByName(ignored_x(vis.ignored))
    summary = (summarise(x).unionByName(with_stage_names(summarise_delivered(simple), params, shape))
               .hint("rebalance").persist(StorageLevel.MEMORY_AND_DISK))  # few partitions: see step 6

    latencies = (with_stage_names(simple, params, shape).withColumn("kind", F.lit("F"))
                 .unionByName(facts.select("topic", "kind", "stage", "partition", "latency",
                                           F.lit(1).cast("bigint").alias("n"))))
    with described(spark, f"{label}: summary"):  # the checks above run in its first job
        stats = stage_stats(spark, summary, latencies)  # may read the checkpoints once more: before `release`
        counted = (summary.where("kind IN ('A', 'Q', 'I')").groupBy("topic", "kind", "stage", "partition", "anomaly")
                   .agg(F.sum("n").alias("n")).collect())
    codes: dict[str, dict[tuple[str, int], dict[str, int]]] = {}
    quarantined: dict[str, int] = {}
    ignored: dict[str, dict[tuple[str, str], int]] = {}
    for r in counted:
        if r["kind"] == "Q":
            quarantined[r["topic"]] = quarantined.get(r["topic"], 0) + int(r["n"])
        elif r["kind"] == "I":
            ignored.setdefault(r["topic"], {})[(r["stage"], r["anomaly"])] = int(r["n"])
        else:
            codes.setdefault(r["topic"], {}).setdefault((r["stage"], r["partition"]), {})[r["anomaly"]] = int(r["n"])
    for df in cached:  # the summary is materialised now; these are only needed to recompute it
        release(df)
    out: dict[str, Classified] = {}
    for tc in shape.topics:
        run_id = run_id_for(tc.name, ws, as_of)
        t_stats, t_codes = stats.get(tc.name, {}), codes.get(tc.name, {})
        report = assemble_report(tc, ws, as_of, lookups[tc.name].partitions, t_stats, t_codes)
        anomalies = anomaly_rows(summary.where(F.col("topic") == tc.name), ws, {tc.name: run_id}, as_of)
        empty = not any(s.get("expected") for s in t_stats.values()) and not t_codes
        count = sum(n for c in t_codes.values() for n in c.values())
        t_ignored = ignored.get(tc.name, {})
        out[tc.name] = Classified(report, anomalies, count, quarantined.get(tc.name, 0), empty, summary,
                                  t_ignored, ignored_rows_lines(tc, t_ignored))
    return out


def job_label(shape: Shape, ws: datetime) -> str:
    """What a window's Spark jobs are called in the Spark UI (`<label>: <step>`, `session.described`)."""
    names = shape.names
    who = names[0] if len(names) == 1 else f"{names[0]} and {len(names) - 1} more topics"
    return f"msgaudit reconcile {who} {ws.isoformat()}"


def window_lookups(vis: WindowInputs, shape: Shape) -> dict[str, Lookups]:
    """Each topic's per-partition lookups (`params.collect_lookups`) from the window's watermarks,
    group offsets and the consumer interceptor's commits: three small collects."""
    wm_rows = [r.asDict() for r in vis.watermarks.collect()] if vis.watermarks is not None else []
    go_rows = [r.asDict() for r in vis.group_offsets.collect()] if vis.group_offsets is not None else []
    commit_rows = [r.asDict() for r in vis.commits.groupBy("topic", "group", "partition")
                   .agg(F.max("offset").alias("offset")).collect()] if vis.commits is not None else []
    return {tc.name: collect_lookups([r for r in wm_rows if r["topic"] == tc.name],
                                     [r for r in go_rows if r["topic"] == tc.name], tc.groups,
                                     [r for r in commit_rows if r["topic"] == tc.name])
            for tc in shape.topics}


def anomaly_rows(summary: DataFrame, ws: datetime, run_ids: Mapping[str, str], as_of: datetime) -> DataFrame:
    """The anomaly rows (audit_anomalies columns) of a summary's topics."""
    run_id = F.lit(next(iter(run_ids.values()))) if len(run_ids) == 1 else F.expr(
        "try_element_at(map(" + ", ".join(f"{_q(t)}, {_q(r)}" for t, r in sorted(run_ids.items())) + "), topic)")
    return (summary.where("kind = 'A'")
            .withColumn("_copy", F.explode(F.array_repeat(F.lit(1), F.col("n").cast("int"))))
            .select(F.lit(ws).alias("window_start"), "topic", "partition", "stage",
                    "anomaly", "pid", "seq", "offset", "detail", run_id.alias("run_id"),
                    F.lit(as_of).alias("computed_at")))


def reconcile_window(spark: SparkSession, cfg: Config, topic: str, ws: datetime, as_of: datetime,
                     publish: bool = True) -> WindowResult:
    """One (topic, window): a batch of one."""
    return reconcile_batch(spark, cfg, Shape((cfg.topic(topic),)), ws, as_of, publish)[0]


def reconcile_batch(spark: SparkSession, cfg: Config, shape: Shape, ws: datetime, as_of: datetime,
                    publish: bool = True,
                    tables: dict[str, tuple[DataFrame, bool]] | None = None) -> list[WindowResult]:
    """One window of every topic of `shape`, in one plan; published with one commit per output table
    for the whole batch. The results share one cached summary: `release()` of any frees it. A batch
    whose inputs hold at most `cfg.driver_rows` rows is classified in the driver instead
    (`driver`, docs/design.md §5.8)."""
    label = job_label(shape, ws)
    with described(spark, label):  # every job of the window is named after it, its steps after them
        inputs = read_batch_inputs(spark, cfg, shape, ws, tables)
        collected = rows = None
        if cfg.driver_rows:
            with described(spark, f"{label}: inputs counted / collected"):
                collected, rows, planned = collect_inputs(spark, sinks_in_range(inputs, shape, ws), cfg.driver_rows)
            if collected is None:  # the Spark plan's queries read the files the count listed
                inputs = pinned(inputs, planned)
        else:
            inputs = pinned(inputs)
        by_oracle: dict[str, Classified] | None = None
        if collected is not None:
            by_oracle = classify_in_driver(spark, collected, shape, ws, as_of)
        elif rows is not None and cfg.columnar_rows and not any(columnar.declines(tc) for tc in shape.topics):
            n = columnar.chunk_count(rows, cfg.columnar_rows)
            if n > 1:
                with described(spark, f"{label}: columnar, in chunks"):
                    by_oracle = classify_columnar_chunks(spark, inputs, shape, ws, as_of, n, spill_held(rows))
            if (n == 1 or by_oracle is None) and rows <= cfg.columnar_rows:  # whole (the chunks may decline files)
                with described(spark, f"{label}: columnar"):
                    by_oracle = classify_columnar(spark, collect_tables(inputs, shape, ws), shape, ws, as_of)
        if by_oracle is not None:
            classified = by_oracle
            anomalies = next(iter(classified.values())).summary
        else:
            classified = classify_batch(spark, inputs, shape, ws, as_of, rows)
            summary = next(iter(classified.values())).summary
            anomalies = anomaly_rows(summary, ws, {t: run_id_for(t, ws, as_of) for t in shape.names}, as_of)
        if publish:
            with described(spark, f"{label}: published"):
                write_window_outputs(spark, cfg, ws, {t: c.report for t, c in classified.items()}, anomalies)
    return [WindowResult(t, ws, as_of, run_id_for(t, ws, as_of), c.report, c.anomalies, c.anomaly_count,
                         c.quarantined, c.empty, [c.summary], ignored_mirror_rows=c.ignored, notes=c.notes)
            for t, c in classified.items()]


def classify_in_driver(spark: SparkSession, collected: OracleInputs, shape: Shape, ws: datetime,
                       as_of: datetime) -> dict[str, Classified]:
    """`classify_batch`'s result for inputs collected into the driver: the oracle's rows."""
    return _as_classified(spark, classify_collected(collected, shape.topics, ws, as_of), shape)


def classify_columnar(spark: SparkSession, tables: columnar.Tables, shape: Shape, ws: datetime,
                      as_of: datetime) -> dict[str, Classified] | None:
    """`classify_batch`'s result from the window's rows as Arrow columns (`columnar`, docs/design.md
    §5.10), or None when the columnar path declines one of the topics (the Spark plan runs then)."""
    results = {}
    for tc in shape.topics:
        r = columnar.classify(tc, ws, as_of, tables)
        if r is None:
            return None
        results[tc.name] = r
    return _as_classified(spark, results, shape)


def classify_columnar_chunks(spark: SparkSession, inputs: WindowInputs, shape: Shape, ws: datetime,
                             as_of: datetime, n: int, held: bool = False) -> dict[str, Classified] | None:
    """`classify_columnar` of a window in `n` chunks by message (`columnar.chunk_count`, docs/design.md
    §5.10): the rows are read once and each chunk's written to Arrow IPC
    files (`driver.spill_tables`), held in memory when `held` (`driver.spill_held`), else in a
    temporary folder in the system's temporary directory (TMPDIR), removed when the window is
    classified. None when the path declines (the Spark plan runs then)."""
    with contextlib.nullcontext(None) if held else tempfile.TemporaryDirectory(prefix="msgaudit-chunks-") as folder:
        spilled = spill_tables(inputs, shape, ws, n, None if folder is None else Path(folder))
        if spilled is None:
            return None
        results = columnar.classify_chunks(shape.topics, ws, as_of, *spilled)
    return None if results is None else _as_classified(spark, results, shape)


def _as_classified(spark: SparkSession, results: Mapping[str, OracleResult], shape: Shape) -> dict[str, Classified]:
    """The oracle's results per topic as `classify_batch`'s, the anomalies as one small local
    DataFrame (the batch's `summary`)."""
    from spark_jobs.io.schemas import AUDIT_ANOMALIES

    rows = [a for r in results.values() for a in r.anomalies]
    frame = local_frame(spark, [tuple(a[f.name] for f in AUDIT_ANOMALIES.fields) for a in rows], AUDIT_ANOMALIES)
    out: dict[str, Classified] = {}
    for tc in shape.topics:
        r = results[tc.name]
        anomalies = frame.where(F.col("topic") == tc.name) if len(shape.topics) > 1 else frame
        empty = not any(row["expected"] for row in r.report) and not r.anomalies
        out[tc.name] = Classified(r.report, anomalies, len(r.anomalies), r.quarantined_ledger_rows, empty, frame,
                                  r.ignored_mirror_rows, ignored_rows_lines(tc, r.ignored_mirror_rows))
    return out


def reconcile_range(spark: SparkSession, cfg: Config, start: datetime, end: datetime, as_of: datetime,
                    topics: Sequence[str] | None = None, progress: bool = False) -> list[WindowResult]:
    """Every (topic, window) overlapping [start, end), as of `as_of` (spark-submit / Airflow entry).
    All topics of a window start are classified together, in batches of topics with the same read
    ranges (`inputs.batches`, at most MAX_TOPICS_PER_PLAN each); each input table's Delta log is read
    once for the run."""
    names = list(topics) if topics else sorted(cfg.topics)
    if not names:
        raise InputError(f"{cfg.source}: no topics configured; add one under `topics:`")
    tables: dict[str, tuple[DataFrame, bool]] = {}  # each table opened once for the run
    for t in names:  # every input and sink table's columns, before the first window's Spark job
        check_window_inputs(spark, cfg, cfg.topic(t), tables)
    by_start: dict[datetime, list[TopicConfig]] = {}
    for t in names:
        for ws, _ in windows(start, end, cfg.topic(t).window):
            by_start.setdefault(ws, []).append(cfg.topic(t))
    jobs = [(ws, shape) for ws in sorted(by_start) for shape in batches(by_start[ws], ws, MAX_TOPICS_PER_PLAN)]
    results: dict[tuple[str, datetime], WindowResult] = {}
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=sum(len(s.topics) for _, s in jobs), desc="reconcile", unit="window")
    for ws, shape in jobs:
        batch = reconcile_batch(spark, cfg, shape, ws, as_of, tables=tables)
        for r in batch:
            r.release()
            results[(r.topic, ws)] = r
        if bar is not None:
            bar.update(len(shape.topics))
    if bar is not None:
        bar.close()
    return [results[(t, ws)] for t in names for ws, _ in windows(start, end, cfg.topic(t).window)]


def summary_line(r: WindowResult) -> str:
    """The window's line; then, one line each, the consumption rows read on a mirror that were
    ignored (§5.5) and the fix."""
    counts: dict[str, int] = {}
    for row in r.report:
        counts[row["stage"]] = counts.get(row["stage"], 0) + row["expected"]
    status = r.report[0]["status"] if r.report else "empty"
    extra = f", quarantined {r.quarantined_ledger_rows} malformed ledger rows" if r.quarantined_ledger_rows else ""
    empty = " (empty window: no messages)" if r.empty else ""
    line = (f"{r.topic} {r.window_start.isoformat()} [{status}] anomalies={r.anomaly_count} "
            f"expected={json.dumps(counts)}{extra}{empty}")
    return "\n".join([line, *(f"{r.topic} {r.window_start.isoformat()}: {note}" for note in r.notes)])
