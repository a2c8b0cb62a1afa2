"""Scale benchmark of `msgaudit reconcile` on one window (issue 5, item 6).

Generates N messages for one 1-hour window over the four tiers (producer ledger, log, consumption,
a Delta sink) with a known 0.1 % of each injected anomaly, reconciles that window on `--master`
(default local[2]) with `--engine` (`reconcile.engine`: auto, the default, settles a window of at
most `plan.DRIVER_ROWS` input rows in the driver and a larger one in Spark tasks; driver / spark
force one) and prints:
- messages/s of the reconciliation (classification + writing both outputs and the report store);
- the ratio to a scan-only baseline: the same pruned inputs read and every used column hashed and
  counted, in the same session (target <= 2.5);
- the ratio of reconciling the same window with the tables holding 1x history (the window and the
  lookback hour it reads) versus 24x (23 more hours of the same traffic before it) (target <= 1.3);
- whether every injected anomaly was found, exactly (count per code);
- peak RSS of the driver JVM, of the Python driver and of the Python workers still alive at the end;
- with `--cpu`, where the driver JVM's CPU went during each timed 1x reconcile, by thread: the
  tasks, the JIT compilers, the garbage collector, the driver's own threads (planning) and the
  rest (Linux only; the Python workers that settle a window's chunks are not in it);
- with `--against REV`, `reconcile(current) / reconcile(REV)`: the window classified by this
  checkout's `spark_jobs/reconcile` and by that package as of git revision REV (copied into a
  temporary package with the rules of REV, `audit/oracle.py` and `audit/rules/`; everything else
  is this checkout's), alternately in one session, medians. REV must have `reconcile.engine`
  (commit 018fe3b or later): an older package reads config keys this checkout no longer has.

The same window on two masters side by side (local[1] against local[2]): `parallelism.py`.

    .venv/bin/python benchmarks/reconcile_scale.py --n 1000000
    .venv/bin/python benchmarks/reconcile_scale.py --n 10000000 --engine spark --master local[2]
    .venv/bin/python benchmarks/reconcile_scale.py --n 1000000 --reps 3 --against HEAD   # the checkout vs its last commit

This is a measurement script, not a test: it asserts nothing about time, it prints ratios.
"""

from __future__ import annotations

import argparse
import importlib
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# first, as msgaudit's commands import it: its allocator setting must precede pyarrow's loading
import spark_jobs  # noqa: E402, F401, I001
from audit.core import config as config_mod  # noqa: E402
from audit.core.config import ENGINES, Config  # noqa: E402

TOPIC = "bench"
GROUP = "loader"
WINDOW = datetime(2026, 11, 21, 10, 0, tzinfo=UTC)
HOUR = timedelta(hours=1)
AS_OF = WINDOW + HOUR + timedelta(minutes=75)  # 75 minutes after the window ends: final (grace 15 minutes)

# Injected anomaly -> residue of the global message number m (m % MOD; MOD = 1000 is a rate of 0.1 %
# of each code, `--anomaly-rate` changes it and scales the residues alike). Residues are far apart so
# that the neighbours an injection touches (m - 1, m - partitions) are always ordinary messages.
RESIDUES = {"lost_acked": 100, "ghost_write": 150, "duplicate_in_log": 200, "unledgered": 250,
            "seq_gap": 300, "content_duplicate": 350, "aborted": 400, "missed": 450, "redelivered": 500,
            "dead_lettered": 550, "missing_in_sink": 600, "duplicate_in_sink": 650, "reordered_in_log": 700,
            "unaudited": 750, "unexpected_in_sink": 800}


MOD = 1000
BASE_RESIDUES = dict(RESIDUES)


def set_anomaly_rate(rate: float) -> None:
    """Inject each code into one message in 1 / rate (residues scaled so neighbours stay ordinary)."""
    global MOD
    mod = round(1 / rate)
    if rate <= 0 or rate > 0.001 or mod % 1000:
        raise SystemExit(f"--anomaly-rate {rate}: must be at most 0.001 with 1 / rate a multiple of 1000")
    MOD = mod
    RESIDUES.update({k: v * (mod // 1000) for k, v in BASE_RESIDUES.items()})


def _count(lo: int, hi: int, residue: int) -> int:
    """How many m in [lo, hi) have m % MOD == residue."""
    def upto(x: int) -> int:
        return (x - residue + MOD - 1) // MOD if x > residue else 0
    return upto(hi) - upto(lo)


IDLE_GROUP = "idle"  # --idle-group: a group the config names that wrote no consumption row


def expected_counts(n: int, partitions: int, ordinal: int, idle: bool = False) -> dict[str, int]:
    """Exact anomaly counts the window (hour `ordinal`, messages [ordinal*n, (ordinal+1)*n)) must
    show; `idle`: with IDLE_GROUP configured, which has an `overdue` row of every committed record."""
    lo, hi = ordinal * n, (ordinal + 1) * n
    out = {code: _count(lo, hi, r) for code, r in RESIDUES.items()}
    # a gap is revealed by the pid's next seq (m + partitions), so it counts in that message's window
    out["seq_gap"] = _count(lo - partitions, hi - partitions, RESIDUES["seq_gap"])
    # a swap needs the pid's previous message in the same window; it shows in the log and in consumption
    out["reordered_in_log"] = _count(lo + partitions, hi, RESIDUES["reordered_in_log"])
    out["reordered_in_consumption"] = out["reordered_in_log"]
    out["content_duplicate"] = _count(lo + 1, hi, RESIDUES["content_duplicate"])
    if idle:  # a record of every message, but none of a lost or aborted one, and two of a duplicated one
        out["overdue"] = n - out["lost_acked"] - out["aborted"] + out["duplicate_in_log"]
    return out


# Whether consumption and sink rows carry the message's produce time (the optional `produce_ts` and
# `audit_produce_ts` columns, docs/design.md §4.2), as today's clients write them; --without-produce-ts
# generates the rows of clients that do not.
CARRY_PRODUCE_TS = True


def generate(spark: Any, cfg: Config, sink_dir: Path, n: int, partitions: int, ordinals: range,
             window_ordinal: int) -> None:
    """Append the tiers of the hours `ordinals` (window_ordinal = the window under test)."""
    from pyspark.sql import functions as F

    from spark_jobs.io.lake import table_path

    r = F.col("m") % MOD
    i = F.col("m") % n  # position inside its hour
    hour_start = F.lit(WINDOW).cast("timestamp") + F.make_dt_interval(
        hours=(F.floor(F.col("m") / n) - window_ordinal).cast("int"))
    base = (spark.range(ordinals.start * n, ordinals.stop * n, numPartitions=max(2, len(ordinals) * 2))
            .withColumnRenamed("id", "m")
            .withColumn("pt", hour_start + F.make_dt_interval(secs=(i * 3600.0 / n).cast("decimal(18,6)")))
            .withColumn("k", (F.col("m") % partitions).cast("int"))
            .withColumn("pid", F.concat(F.lit("bench-"), F.col("k").cast("string")))
            .withColumn("seq", (F.col("m") / partitions).cast("long"))
            .withColumn("offset", F.when((r == RESIDUES["reordered_in_log"]) & (i >= partitions),
                                         F.col("seq") * 2 - 2)
                        .when(((F.col("m") + partitions) % MOD == RESIDUES["reordered_in_log"])
                              & (i + partitions < n), F.col("seq") * 2 + 2)
                        .otherwise(F.col("seq") * 2))
            .withColumn("part_hour", F.date_format("pt", "yyyy-MM-dd'T'HH"))
            .withColumn("topic", F.lit(TOPIC))
            .withColumn("fp", F.when((r == RESIDUES["content_duplicate"]) & (i >= 1),
                                     F.concat(F.lit("fp"), (F.col("m") - 1).cast("string")))
                        .otherwise(F.concat(F.lit("fp"), F.col("m").cast("string")))))
    res = {k: (r == v) for k, v in RESIDUES.items()}

    ledger = (base.where(~(res["unledgered"] | res["seq_gap"]))
              .select(F.lit("bench").alias("producer"), "pid", "seq", "topic",
                      F.when(res["ghost_write"], -1).otherwise(F.col("k")).alias("partition"),
                      F.when(res["ghost_write"] | res["aborted"], None).otherwise(F.col("offset")).alias("offset"),
                      F.when(res["ghost_write"], "failed").when(res["aborted"], "aborted").otherwise("acked")
                      .alias("status"),
                      F.lit(None).cast("string").alias("error"), F.lit(None).cast("string").alias("txn_id"),
                      F.col("pt").alias("produce_ts"),
                      F.when(res["ghost_write"] | res["aborted"], None)
                      .otherwise(F.col("pt") + F.make_dt_interval(secs=(F.col("m") % 50 / 1000.0)
                                                                  .cast("decimal(18,6)"))).alias("ack_ts"),
                      "part_hour"))
    log_cols = ["topic", "partition", "offset", "kafka_ts", "pid", "seq", "produce_ts", "fingerprint",
                "committed", "header_error", "captured_at", "part_hour"]
    captured = F.lit(WINDOW + 3 * HOUR).cast("timestamp")
    log_main = (base.where(~(res["lost_acked"] | res["seq_gap"]))
                .select("topic", F.col("k").alias("partition"), "offset",
                        (F.col("pt") + F.expr("INTERVAL 1 MILLISECOND")).alias("kafka_ts"), "pid", "seq",
                        F.col("pt").alias("produce_ts"), F.col("fp").alias("fingerprint"),
                        (~res["aborted"]).alias("committed"), F.lit(None).cast("string").alias("header_error"),
                        captured.alias("captured_at"), "part_hour"))
    log_dup = base.where(res["duplicate_in_log"]).select(
            "topic", F.col("k").alias("partition"), (F.col("offset") + 1).alias("offset"),
            (F.col("pt") + F.expr("INTERVAL 5 MILLISECONDS")).alias("kafka_ts"), "pid", "seq",
            F.col("pt").alias("produce_ts"), F.col("fp").alias("fingerprint"), F.lit(True).alias("committed"),
            F.lit(None).cast("string").alias("header_error"), captured.alias("captured_at"), "part_hour")
    unaudited = base.where(res["unaudited"]).select(
        "topic", F.col("k").alias("partition"), (F.col("offset") + 1).alias("offset"),
        F.col("pt").alias("kafka_ts"), F.lit(None).cast("string").alias("pid"), F.lit(None).cast("long").alias("seq"),
        F.lit(None).cast("timestamp").alias("produce_ts"), F.concat(F.lit("u"), F.col("m").cast("string"))
        .alias("fingerprint"), F.lit(True).alias("committed"), F.lit("audit.pid: missing").alias("header_error"),
        captured.alias("captured_at"), "part_hour")
    log = log_main.unionByName(log_dup).unionByName(unaudited)

    # consumption: every committed record except the injected misses; times after produce
    cons_base = log.where("committed").withColumn(
        "rr", F.when(F.col("seq").isNull(), F.lit(-1)).otherwise(
            (F.col("seq") * partitions + F.col("partition")) % MOD))
    one = (cons_base.where(F.col("rr") != RESIDUES["missed"])
           .select(F.lit(GROUP).alias("group"), F.lit("c1").alias("consumer"), F.col("offset").alias("consume_seq"),
                   "topic", "partition", "offset", "pid", "seq",
                   F.when(F.col("rr") == RESIDUES["dead_lettered"], "dead_lettered").otherwise("processed")
                   .alias("outcome"), F.lit(1).alias("attempt"),
                   (F.coalesce("produce_ts", "kafka_ts") + F.expr("INTERVAL 1 SECOND")).alias("consume_ts"),
                   "produce_ts"))
    again = (cons_base.where(F.col("rr") == RESIDUES["redelivered"])
             .select(F.lit(GROUP).alias("group"), F.lit("c2").alias("consumer"), F.col("offset").alias("consume_seq"),
                     "topic", "partition", "offset", "pid", "seq", F.lit("processed").alias("outcome"),
                     F.lit(2).alias("attempt"), (F.col("produce_ts") + F.expr("INTERVAL 3 SECONDS")).alias("consume_ts"),
                     "produce_ts"))
    consumed = one.unionByName(again).withColumn("part_hour", F.date_format("consume_ts", "yyyy-MM-dd'T'HH"))
    if not CARRY_PRODUCE_TS:
        consumed = consumed.drop("produce_ts")

    # sink: one row per processed message (by offset for unaudited records), minus / plus injections
    processed = one.where("outcome = 'processed'")
    sink_one = (processed.where(F.col("pid").isNull() | (F.col("offset") % 2 == 0))
                .withColumn("rr", F.when(F.col("seq").isNull(), -1)
                            .otherwise((F.col("seq") * partitions + F.col("partition")) % MOD))
                .where(F.col("rr") != RESIDUES["missing_in_sink"]))
    sink_cols = [F.col("topic").alias("audit_topic"), F.col("partition").alias("audit_partition"),
                 F.col("offset").alias("audit_offset"), F.col("pid").alias("audit_pid"),
                 F.col("seq").alias("audit_seq"),
                 (F.col("consume_ts") + F.expr("INTERVAL 1 SECOND")).alias("audit_sink_ts"),
                 F.col("produce_ts").alias("audit_produce_ts"), F.lit(1.5).alias("amount")]
    sink = (sink_one.select(*sink_cols)
            .unionByName(sink_one.where(F.col("rr") == RESIDUES["duplicate_in_sink"]).select(*sink_cols))
            .unionByName(base.where(res["unexpected_in_sink"]).select(
                F.col("topic").alias("audit_topic"), F.col("k").alias("audit_partition"),
                F.lit(None).cast("long").alias("audit_offset"), F.lit("phantom").alias("audit_pid"),
                F.col("m").alias("audit_seq"), (F.col("pt") + F.expr("INTERVAL 2 SECONDS")).alias("audit_sink_ts"),
                F.col("pt").alias("audit_produce_ts"), F.lit(1.5).alias("amount"))))
    if not CARRY_PRODUCE_TS:
        sink = sink.drop("audit_produce_ts")

    from spark_jobs.io.lake import by_seq

    def append(df: Any, name: str) -> None:
        if name != "log_records":  # as ingest writes the ledgers; capture MERGEs the log
            df = by_seq(df, ("topic", "part_hour"))
        df.write.format("delta").mode("append").partitionBy("topic", "part_hour").save(table_path(cfg, name))

    append(ledger, "producer_ledger")
    append(log.select(*log_cols), "log_records")
    append(consumed, "consumed_records")
    # the user's sink is not partitioned; it is appended hour by hour, so its files are time-clustered
    for o in ordinals:
        lo = WINDOW + (o - window_ordinal) * HOUR
        sink.where((F.col("audit_sink_ts") >= F.lit(lo)) & (F.col("audit_sink_ts") < F.lit(lo + HOUR))) \
            .write.format("delta").mode("append").save(str(sink_dir))
    sink.where(F.col("audit_sink_ts") >= F.lit(WINDOW + (ordinals.stop - window_ordinal) * HOUR)) \
        .write.format("delta").mode("append").save(str(sink_dir))


def write_snapshots(spark: Any, cfg: Config, n: int, partitions: int, window_ordinal: int) -> None:
    from spark_jobs.io.lake import table_path

    hw = 2 * ((window_ordinal + 1) * n // partitions) + 4
    at = WINDOW + 3 * HOUR
    wm = spark.createDataFrame([(TOPIC, p, 0, hw, at, at.strftime("%Y-%m-%dT%H")) for p in range(partitions)],
                               "topic string, partition int, log_start_offset long, high_watermark long, "
                               "captured_at timestamp, part_hour string")
    wm.write.format("delta").mode("overwrite").partitionBy("topic", "part_hour").save(
        table_path(cfg, "partition_watermarks"))
    go = spark.createDataFrame([(GROUP, TOPIC, p, hw, at, at.strftime("%Y-%m-%dT%H")) for p in range(partitions)],
                               "group string, topic string, partition int, committed_offset long, "
                               "captured_at timestamp, part_hour string")
    go.write.format("delta").mode("overwrite").partitionBy("topic", "part_hour").save(
        table_path(cfg, "group_offsets"))


def scan_baseline(spark: Any, cfg: Config) -> tuple[float, int]:
    """Read the same pruned inputs the window reads and hash + count every column it uses."""
    from pyspark.sql import functions as F

    from spark_jobs.reconcile import Shape, read_window_inputs
    from spark_jobs.reconcile.read import visible

    t = time.perf_counter()
    tc = cfg.topic(TOPIC)
    vis = visible(read_window_inputs(spark, cfg, tc, WINDOW), Shape((tc,)), WINDOW)
    rows = 0
    frames = [vis.ledger, vis.log, vis.consumed, vis.watermarks, vis.group_offsets, *vis.sinks.values()]
    for df in frames:
        if df is not None:
            r = df.agg(F.count(F.lit(1)).alias("n"), F.max(F.xxhash64(*df.columns)).alias("h")).collect()[0]
            rows += int(r["n"])
    return time.perf_counter() - t, rows


def reconcile_once(spark: Any, cfg: Config, as_of: datetime) -> tuple[float, float, Any]:
    from spark_jobs.reconcile import reconcile_window, write_outputs

    t = time.perf_counter()
    result = reconcile_window(spark, cfg, TOPIC, WINDOW, as_of, publish=False)
    t_classify = time.perf_counter() - t
    write_outputs(spark, cfg, TOPIC, WINDOW, result.report, result.anomalies, result.anomaly_table,
                  result.anomaly_count)
    return t_classify, time.perf_counter() - t, result


def measure(spark: Any, cfg: Config, as_of: datetime, reps: int,
            cpu: list[dict[str, float]] | None = None) -> tuple[float, int, float, float, dict[str, int]]:
    """`reps` alternating (scan, reconcile) pairs: median scan, rows, median classify and total
    reconcile seconds, and the anomalies found (identical in every rep, or the run is reported).
    `cpu`: gets each reconcile's `cpu_split` (when the JVM's threads can be read)."""
    scans, classes, totals, founds = [], [], [], []
    rows = 0
    for _ in range(reps):
        scan, rows = scan_baseline(spark, cfg)
        before = jvm_thread_cpu(spark) if cpu is not None else None
        cls, total, result = reconcile_once(spark, cfg, as_of)
        if cpu is not None and before is not None:
            after = jvm_thread_cpu(spark)
            if after is not None:
                cpu.append({**cpu_split(before, after), "wall": total})
        founds.append(found_counts(spark, result))
        result.release()
        scans.append(scan)
        classes.append(cls)
        totals.append(total)
    if any(f != founds[0] for f in founds):
        print(f"anomalies differ between repetitions: {founds}")
    return (statistics.median(scans), rows, statistics.median(classes), statistics.median(totals),
            founds[0])


def compare(spark: Any, cfg: Config, as_of: datetime, reps: int, other: Any,
            expected: dict[str, int]) -> tuple[float, float, bool]:
    """Median classification seconds of this checkout's reconcile and of `other` (a package with the
    same `reconcile_window`), run alternately `reps` times each; and whether both found exactly
    the expected anomalies every time."""
    import spark_jobs.reconcile as current

    times: dict[Any, list[float]] = {current: [], other: []}
    exact = True
    for i in range(reps):
        for m in ((current, other) if i % 2 == 0 else (other, current)):
            t = time.perf_counter()
            result = m.reconcile_window(spark, cfg, TOPIC, WINDOW, as_of, publish=False)
            times[m].append(time.perf_counter() - t)
            exact = exact and all(found_counts(spark, result).get(c, 0) == e for c, e in expected.items())
            result.release()
    return statistics.median(times[current]), statistics.median(times[other]), exact


def found_counts(spark: Any, result: Any) -> dict[str, int]:
    return {r["anomaly"]: int(r["count"]) for r in result.anomalies.groupBy("anomaly").count().collect()}


# The driver JVM's threads by what they do, from their Linux names (at most 15 characters).
CPU_KINDS = (("tasks", ("Executor task",)), ("JIT compilers", ("C1 CompilerThre", "C2 CompilerThre")),
             ("GC", ("GC Thread", "G1 ", "VM Thread")), ("driver threads", ("Thread-",)))


def driver_jvm_pid(spark: Any) -> int | None:
    """The process id of the session's JVM, as the JVM itself reports it."""
    try:
        return int(spark.sparkContext._jvm.ProcessHandle.current().pid())
    except (AttributeError, ValueError):
        return None


def jvm_thread_cpu(spark: Any) -> dict[str, tuple[str, float]] | None:
    """CPU seconds used so far by each live thread of the driver JVM: {thread id: (name, seconds)}
    (Linux /proc; None where it cannot be read)."""
    pid = driver_jvm_pid(spark)
    if pid is None:
        return None
    try:
        tick = os.sysconf("SC_CLK_TCK")
        out = {}
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                name = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
                fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:  # the thread ended meanwhile
                continue
            out[tid] = (name, (int(fields[11]) + int(fields[12])) / tick)
        return out
    except (OSError, ValueError):
        return None


def cpu_split(before: dict[str, tuple[str, float]], after: dict[str, tuple[str, float]]) -> dict[str, float]:
    """CPU seconds per kind of thread (CPU_KINDS, the rest as 'other') between two `jvm_thread_cpu`
    snapshots. A thread that ended between them is not counted (Spark's task threads are pooled)."""
    split = {kind: 0.0 for kind, _ in CPU_KINDS} | {"other": 0.0}
    for tid, (name, secs) in after.items():
        used = secs - before.get(tid, (name, 0.0))[1]
        kind = next((k for k, prefixes in CPU_KINDS if name.startswith(prefixes)), "other")
        split[kind] += used
    return split


def step_profile(spark: Any, run: Any) -> tuple[float, list[tuple[str, int, float, float]], float, float]:
    """Runs `run()` and reads what its Spark jobs did from the driver's status store, by the step
    each job's description names (`<label>: <step>`, docs/design.md §9; Delta's file listings
    are "Delta: <label>: <step>: Filtering files for query", counted under "Delta file listing"):
    (wall seconds, [(step, jobs, seconds with one of its jobs running, task-seconds)] in the order
    the steps started, seconds with no job running, task-seconds in all)."""
    store = spark.sparkContext._jsc.sc().statusStore()

    def seq(xs: Any) -> list[Any]:
        return [xs.apply(i) for i in range(xs.size())]

    def ms(opt: Any) -> float:
        return opt.get().getTime() / 1000 if opt.isDefined() else float("nan")

    before = {j.jobId() for j in seq(store.jobsList(None))}
    t0 = time.time()
    run()
    t1 = time.time()
    jobs = sorted((j for j in seq(store.jobsList(None)) if j.jobId() not in before), key=lambda j: j.jobId())

    def task_seconds(stage_id: int) -> float:
        """The stage's task time, if it ran in this run (a skipped one ran before, or not at all)."""
        st = store.lastStageAttempt(stage_id)
        ran = st.status().toString() == "COMPLETE" and st.submissionTime().isDefined()
        return st.executorRunTime() / 1000 if ran and ms(st.submissionTime()) >= t0 else 0.0

    steps: dict[str, list[Any]] = {}
    counted: set[int] = set()
    for j in jobs:
        desc = j.description().get() if j.description().isDefined() else ""
        step = ("Delta file listing" if desc.startswith("Delta:")
                else desc.rsplit(": ", 1)[1] if ": " in desc else "(the window, no step)")
        stages = [s for s in seq(j.stageIds()) if s not in counted]
        task_s = sum(task_seconds(s) for s in stages)
        counted.update(stages)
        steps.setdefault(step, []).append((ms(j.submissionTime()), ms(j.completionTime()), task_s))

    def covered(spans: list[tuple[float, float]]) -> float:
        total, end = 0.0, float("-inf")
        for a, b in sorted(spans):
            if b > end:
                total += b - max(a, end)
                end = b
        return total

    rows = sorted(((name, len(v), covered([(a, b) for a, b, _ in v]), sum(t for *_, t in v), min(a for a, *_ in v))
                   for name, v in steps.items()), key=lambda r: r[4])
    busy = covered([(a, b) for v in steps.values() for a, b, _ in v])
    return t1 - t0, [r[:4] for r in rows], max(0.0, (t1 - t0) - busy), sum(r[3] for r in rows)


def jvm_peak_rss_mb(spark: Any) -> float | None:
    """VmHWM of the driver JVM (local mode: driver and executors are one JVM)."""
    pid = driver_jvm_pid(spark)
    if pid is None:
        return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def worker_peak_rss_mb(spark: Any) -> list[float]:
    """VmHWM of each Python worker the driver JVM's daemon has forked and that is still alive (a
    worker settles many tasks: a peak that grows from one reconcile to the next is held memory)."""
    jvm = driver_jvm_pid(spark)
    if jvm is None:
        return []
    parent: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parent[int(stat.parent.name)] = int(fields[1])

    def under_jvm(pid: int) -> bool:
        while pid > 1:
            pid = parent.get(pid, 1)
            if pid == jvm:
                return True
        return False

    peaks = []
    for pid in sorted(p for p in parent if under_jvm(p)):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        if b"pyspark" not in cmd:  # the daemon and the workers it forked run pyspark.daemon
            continue
        for line in status.splitlines():
            if line.startswith("VmHWM:"):
                peaks.append(int(line.split()[1]) / 1024)
    return peaks


def bench_config(work: Path, shuffle_partitions: str = "8", conf: list[str] | None = None,
                 master: str = "local[2]", engine: str = "auto", idle: bool = False) -> Config:
    """The benchmark's configuration over the work folder `work` (its lake, home, report store and
    Delta sink); `conf`: extra Spark settings as KEY=VALUE; `master`: the Spark master (`build_spark`
    takes it from the `spark:` mapping's `master`); `engine`: `reconcile.engine`; `idle`: the topic
    is read by IDLE_GROUP too."""
    return config_mod.from_dict({
        "home": str(work / "home"), "lake": str(work / "lake"), "report_store": f"sqlite:///{work / 'report.db'}",
        "spark": {"master": master, "spark.sql.shuffle.partitions": shuffle_partitions,
                  **dict(c.split("=", 1) for c in conf or ())},
        "reconcile": {"engine": engine},
        "topics": {TOPIC: {"window": "1h", "grace": "15m", "groups": [GROUP, *([IDLE_GROUP] if idle else [])],
                           "sinks": [{"name": "table", "format": "delta", "location": str(work / "sink"),
                                      "group": GROUP}]}}}, source="<benchmark>", base=work)


def engine_note(engine: str) -> str:
    """`--engine` as the header says it."""
    if engine != "auto":
        return engine
    from spark_jobs.reconcile.plan import DRIVER_ROWS

    return f"auto (the driver up to {DRIVER_ROWS:,} input rows, else Spark tasks)"


# Where each reconcile of this process settled its window, in order: "the driver" or "N Spark tasks"
# (`track_settling`).
SETTLED: list[str] = []


def track_settling() -> None:
    """Record in SETTLED where each window is settled: `classify_batch` calls `settle.in_driver` or
    `settle.in_tasks` (its chunk count the 7th argument) through the module, so wrapping them there
    sees every call."""
    from spark_jobs.reconcile import settle

    if getattr(settle, "_bench_tracked", False):
        return
    in_driver, in_tasks = settle.in_driver, settle.in_tasks

    def driver(*a: Any, **k: Any) -> Any:
        SETTLED.append("the driver")
        return in_driver(*a, **k)

    def tasks(*a: Any, **k: Any) -> Any:
        n = a[6] if len(a) > 6 else k.get("n")
        SETTLED.append(f"{n} Spark task{'' if n == 1 else 's'}")
        return in_tasks(*a, **k)

    settle.in_driver, settle.in_tasks = driver, tasks
    settle._bench_tracked = True  # type: ignore[attr-defined]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=10_000_000, help="messages in the window (default 10,000,000)")
    ap.add_argument("--history-n", type=int, default=None, help="messages per history hour (default: --n)")
    ap.add_argument("--partitions", type=int, default=8, help="topic partitions = producer pids (default 8)")
    ap.add_argument("--history", type=int, default=24, help="hours of history for the second run (default 24)")
    ap.add_argument("--dir", default=None,
                    help="work folder, new or empty (default: a temporary one, removed at the end)")
    ap.add_argument("--shuffle-partitions", default="8")
    ap.add_argument("--conf", action="append", default=[], metavar="KEY=VALUE",
                    help="extra Spark setting, repeatable (e.g. spark.driver.memory=8g; the master is --master)")
    ap.add_argument("--reps", type=int, default=1,
                    help="timed scan + reconcile pairs per history size, alternating; medians are printed")
    ap.add_argument("--engine", choices=ENGINES, default="auto",
                    help="reconcile.engine (default auto: the driver for a window of at most "
                         "plan.DRIVER_ROWS input rows, else Spark tasks; driver / spark: always there)")
    ap.add_argument("--master", default="local[2]",
                    help="Spark master (default local[2]); parallelism.py runs two side by side")
    ap.add_argument("--anomaly-rate", type=float, default=0.001,
                    help="share of messages injected with EACH anomaly code (default 0.001 = 0.1 %%; "
                         "at most 0.001, 1 / rate a multiple of 1000)")
    ap.add_argument("--against", metavar="REV", default=None,
                    help="also classify the 1x window with spark_jobs/reconcile (and audit/oracle.py, "
                         "audit/rules/) as of git revision REV (018fe3b or later), alternating with this "
                         "checkout's (--reps times each), and print the ratio")
    ap.add_argument("--without-produce-ts", action="store_true",
                    help="generate consumption and sink rows without the optional produce time (clients "
                         "that do not write it): the latencies then need the ledger's produce time")
    ap.add_argument("--warmups", type=int, default=2, metavar="K",
                    help="untimed reconciles before the timed 1x runs (default 2): the first compiles the "
                         "plans and starts the Python workers, the JIT compiles the generated code over the "
                         "next few, so with one the 1x runs are slower than the later 24x ones for the JVM alone")
    ap.add_argument("--cpu", action="store_true",
                    help="also print where the driver JVM's CPU went during the timed 1x reconciles, by "
                         "thread: tasks, JIT compilers, GC, the driver's own threads, the rest (Linux)")
    ap.add_argument("--steps", action="store_true",
                    help="also classify the 1x window once more and print where its time went by step: "
                         "each step's Spark jobs, the seconds one of them was running, their task-seconds, "
                         "and the seconds with no job running (the driver planning)")
    ap.add_argument("--no-warmup", action="store_true",
                    help="no untimed reconcile before the timed 1x run (--warmups 0): a cold JVM's figure")
    ap.add_argument("--idle-group", action="store_true",
                    help=f"configure a second group, {IDLE_GROUP!r}, that wrote no consumption row (an incident: "
                         "a group down for the hour): every committed record of the window is its `overdue` row")
    ap.add_argument("--generate-only", action="store_true",
                    help="generate the window and its lookback hour into --dir, then stop (the lake other "
                         "benchmarks read, e.g. history_side_by_side.py, freed_memory.py)")
    args = ap.parse_args(argv)
    n, parts = args.n, args.partitions
    if args.generate_only and not args.dir:
        ap.error("--generate-only needs --dir: the folder to keep the lake in")
    if any("=" not in c for c in args.conf):
        ap.error("--conf takes KEY=VALUE")
    if any(c.split("=", 1)[0] in ("master", "spark.master") for c in args.conf):
        ap.error("the master is --master, not --conf")
    set_anomaly_rate(args.anomaly_rate)
    global CARRY_PRODUCE_TS
    CARRY_PRODUCE_TS = not args.without_produce_ts
    if n % parts or n % MOD:
        ap.error(f"--n must be a multiple of {MOD} (1 / --anomaly-rate) and of --partitions")
    if args.history_n not in (None, n):
        ap.error("--history-n different from --n is not supported (seqs must stay contiguous per pid)")
    if args.dir and Path(args.dir).exists() and any(Path(args.dir).iterdir()):
        # the generator appends: a second run into the same folder would double every message
        ap.error(f"--dir {args.dir} is not empty: remove it or name a new folder")
    work = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="msgaudit-bench-"))
    cfg = bench_config(work, args.shuffle_partitions, args.conf, args.master, args.engine, args.idle_group)
    from spark_jobs.io.session import build_spark

    spark = build_spark(cfg, app_name="msgaudit-bench")
    window_ordinal = args.history  # hours 0 .. history-1 are history, `history` is the window
    as_of = AS_OF
    print(f"n={n:,} messages in the window, anomaly rate {1 / MOD:g} of each code, {parts} partitions, "
          f"{args.master}, engine {engine_note(args.engine)}, {args.reps} rep(s) (medians), work dir {work}"
          + (f", group {IDLE_GROUP!r} consumed nothing" if args.idle_group else ""))

    t = time.perf_counter()
    generate(spark, cfg, work / "sink", n, parts, range(window_ordinal - 1, window_ordinal + 1), window_ordinal)
    write_snapshots(spark, cfg, n, parts, window_ordinal)
    print(f"generated window + lookback hour in {time.perf_counter() - t:.1f}s")
    if args.generate_only:
        spark.stop()
        return 0

    track_settling()
    scan_baseline(spark, cfg)  # warms the JVM up
    for _ in range(0 if args.no_warmup else args.warmups):
        reconcile_once(spark, cfg, as_of)[2].release()
    cpu: list[dict[str, float]] | None = [] if args.cpu else None
    scan1, rows1, cls1, total1, found = measure(spark, cfg, as_of, args.reps, cpu)
    expected = expected_counts(n, parts, window_ordinal, args.idle_group)
    print(f"1x history : scan {scan1:.1f}s ({rows1:,} input rows), reconcile {cls1:.1f}s + publish "
          f"{total1 - cls1:.1f}s = {total1:.1f}s -> {n / total1:,.0f} messages/s (settled in {SETTLED[-1]})")

    if args.steps:
        from spark_jobs.reconcile import reconcile_window

        wall, steps, idle, task_s = step_profile(
            spark, lambda: reconcile_window(spark, cfg, TOPIC, WINDOW, as_of, publish=False).release())
        cores = spark.sparkContext.defaultParallelism
        print(f"1x classification once more, {wall:.1f}s by step (steps run side by side, so their seconds overlap):")
        print(f"  {'step':28s} {'jobs':>5s} {'running s':>10s} {'task-s':>8s}")
        for name, jobs, running, busy in steps:
            print(f"  {name:28s} {jobs:5d} {running:10.2f} {busy:8.2f}")
        print(f"  {'no job running':28s} {'':5s} {idle:10.2f}")
        print(f"  task-seconds {task_s:.1f} of {cores} cores x {wall:.1f}s = {cores * wall:.1f} core-seconds")

    against = None
    if args.against:
        from revisions import package_at, ship

        name = package_at(args.against, work / "against")
        ship(spark, work / "against", name)  # the Python workers that settle its chunks import it too
        other = importlib.import_module(name)
        if not args.no_warmup:
            other.reconcile_window(spark, cfg, TOPIC, WINDOW, as_of, publish=False).release()
        against = compare(spark, cfg, as_of, args.reps, other, expected_counts(n, parts, window_ordinal, args.idle_group))
        print(f"1x history : classify {against[0]:.1f}s with this checkout, {against[1]:.1f}s with "
              f"{args.against} (medians of {args.reps} alternating)")

    if args.history > 2:
        t = time.perf_counter()
        generate(spark, cfg, work / "sink", n, parts, range(window_ordinal - args.history + 1, window_ordinal - 1),
                 window_ordinal)
        print(f"generated {args.history - 2} more history hours in {time.perf_counter() - t:.1f}s")
    else:
        print(f"--history {args.history}: no more history hours, the second run reads the same tables")
    scan24, rows24, cls24, total24, found24 = measure(spark, cfg, as_of, args.reps)
    print(f"{args.history}x history: scan {scan24:.1f}s ({rows24:,} input rows), reconcile {cls24:.1f}s + "
          f"publish {total24 - cls24:.1f}s = {total24:.1f}s -> {n / total24:,.0f} messages/s "
          f"(settled in {SETTLED[-1]})")

    print()
    print(f"messages/s (1x)                      : {n / total1:,.0f}")
    print(f"reconcile / scan baseline (1x)       : {total1 / scan1:.2f}  (target <= 2.5 at 1M, <= 3 at 10M, <= 2 at rate 1e-4)")
    print(f"reconcile {args.history}x / 1x history          : {total24 / total1:.2f}  (target <= 1.2)")
    if cpu:
        med = {k: statistics.median(c[k] for c in cpu) for k in cpu[0]}
        cores = spark.sparkContext.defaultParallelism
        used = sum(v for k, v in med.items() if k != "wall")
        print(f"driver JVM CPU per 1x reconcile       : {used:.1f}s of {cores} cores x {med['wall']:.1f}s wall -- "
              + ", ".join(f"{k} {v:.1f}s" for k, v in med.items() if k != "wall") + f" (medians of {len(cpu)})")
    elif args.cpu:
        print("driver JVM CPU per 1x reconcile       : not measured (needs Linux /proc and a local driver JVM)")
    if against is not None:
        print(f"reconcile(current) / reconcile({args.against}) : {against[0] / against[1]:.2f}  "
              f"(classification only, same session, alternating)")
    ok = (all(found.get(c, 0) == e for c, e in expected.items()) and found == found24
          and (against is None or against[2]))
    print(f"injected anomalies found exactly     : {'yes' if ok else 'NO'}")
    for code in sorted(set(expected) | set(found)):
        print(f"  {code:26s} expected {expected.get(code, 0):7,d}  found {found.get(code, 0):7,d}"
              f"  ({args.history}x: {found24.get(code, 0):,d})")
    jvm = jvm_peak_rss_mb(spark)
    py = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"peak RSS: driver JVM {jvm:,.0f} MB, Python driver {py:,.0f} MB" if jvm else
          f"peak RSS: Python driver {py:,.0f} MB (JVM not visible)")
    workers = worker_peak_rss_mb(spark)
    if workers:
        print(f"peak RSS of the {len(workers)} Python worker processes alive now (daemon included): "
              + ", ".join(f"{w:,.0f} MB" for w in workers))
    spark.stop()
    if not args.dir:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
