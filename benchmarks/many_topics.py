"""Fixed cost of `msgaudit reconcile`: one small topic vs many small topics in one window.

Generates K topics (default 50) of M messages each (default 1,000) in one 1-hour window, over the
four tiers (producer ledger, log, one consumer group, one Delta sink table shared by all topics,
as a deployment's sink often is), with one injected `missed` per topic. In one Spark session it
then times, interleaved, each both ways a window can be settled (`reconcile.engine`, docs/design.md
§5.8): in the driver (`engine: driver`, where `auto` settles windows this small) and in Spark tasks
(`engine: spark`):

- `one`: `reconcile_range` over the window for ONE topic (publishing both outputs and the report
  store), i.e. the per-(topic, window) cost;
- `all`: `reconcile_range` over the same window for all K topics in one call;

and prints the four medians, the ratios driver/spark and K topics/one topic (target: K topics <= 5x
one topic; one small window <= 4 s) and whether every injected anomaly was found exactly (one
`missed` per topic, nothing else) in all four. Then it times the SLA check of the window (every
topic has `max_lost: 0`, which each topic's `missed` fails once) for one topic and for all K. With
`--against REV`, the driver side is also timed with `spark_jobs/reconcile` and the rules it runs
(`audit/oracle.py`, `audit/rules/`) as of git revision REV (018fe3b or later: an older package
reads config keys this checkout no longer has), publishing into its own copy of the generated lake
(so the output tables keep the layout each package writes), and the SLA check with
`spark_jobs/sla.py` as of REV, alternating with this checkout's, and the ratios `this checkout /
REV` are printed.

    .venv/bin/python benchmarks/many_topics.py --topics 50 --messages 1000
    .venv/bin/python benchmarks/many_topics.py --reps 8 --against HEAD   # the checkout vs its last commit

This is a measurement script, not a test: it asserts nothing about time, it prints ratios.
"""

from __future__ import annotations

import argparse
import importlib
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from audit.core import config as config_mod  # noqa: E402
from audit.core.config import Config  # noqa: E402

WINDOW = datetime(2026, 11, 21, 10, 0, tzinfo=UTC)
HOUR = timedelta(hours=1)
GROUP = "loader"
PARTITIONS = 2
MISSED_AT = 7  # the message number (inside its topic) that its group skips


def topic_name(k: int) -> str:
    return f"small{k:03d}"


def generate(spark: Any, cfg: Config, sink_dir: Path, topics: int, m: int) -> None:
    """Every tier of `topics` topics x `m` messages in the window, one `missed` per topic."""
    from pyspark.sql import functions as F

    from spark_jobs.io.lake import table_path

    base = (spark.range(0, topics * m, numPartitions=2).withColumnRenamed("id", "g")
            .withColumn("tk", (F.col("g") / m).cast("int"))
            .withColumn("i", F.col("g") % m)
            .withColumn("topic", F.concat(F.lit("small"), F.lpad(F.col("tk").cast("string"), 3, "0")))
            .withColumn("partition", (F.col("i") % PARTITIONS).cast("int"))
            .withColumn("pid", F.concat(F.lit("p"), F.col("tk").cast("string"), F.lit("-"),
                                        F.col("partition").cast("string")))
            .withColumn("seq", (F.col("i") / PARTITIONS).cast("long"))
            .withColumn("offset", F.col("seq"))
            .withColumn("pt", F.lit(WINDOW).cast("timestamp")
                        + F.make_dt_interval(secs=(F.col("i") * 3000.0 / m).cast("decimal(18,6)")))
            .withColumn("part_hour", F.date_format("pt", "yyyy-MM-dd'T'HH")))
    ledger = base.select(F.lit("bench").alias("producer"), "pid", "seq", "topic", "partition", "offset",
                         F.lit("acked").alias("status"), F.lit(None).cast("string").alias("error"),
                         F.lit(None).cast("string").alias("txn_id"), F.col("pt").alias("produce_ts"),
                         (F.col("pt") + F.expr("INTERVAL 3 MILLISECONDS")).alias("ack_ts"), "part_hour")
    captured = F.lit(WINDOW + 2 * HOUR).cast("timestamp")
    log = base.select("topic", "partition", "offset", (F.col("pt") + F.expr("INTERVAL 1 MILLISECOND"))
                      .alias("kafka_ts"), "pid", "seq", F.col("pt").alias("produce_ts"),
                      F.concat(F.lit("fp"), F.col("g").cast("string")).alias("fingerprint"),
                      F.lit(True).alias("committed"), F.lit(None).cast("string").alias("header_error"),
                      captured.alias("captured_at"), "part_hour")
    consumed = (base.where(F.col("i") != MISSED_AT)
                .select(F.lit(GROUP).alias("group"), F.lit("c1").alias("consumer"),
                        F.col("i").alias("consume_seq"), "topic", "partition", "offset", "pid", "seq",
                        F.lit("processed").alias("outcome"), F.lit(1).alias("attempt"),
                        (F.col("pt") + F.expr("INTERVAL 1 SECOND")).alias("consume_ts"))
                .withColumn("part_hour", F.date_format("consume_ts", "yyyy-MM-dd'T'HH")))
    sink = (base.where(F.col("i") != MISSED_AT)
            .select(F.col("topic").alias("audit_topic"), F.col("partition").alias("audit_partition"),
                    F.col("offset").alias("audit_offset"), F.col("pid").alias("audit_pid"),
                    F.col("seq").alias("audit_seq"), (F.col("pt") + F.expr("INTERVAL 2 SECONDS"))
                    .alias("audit_sink_ts"), F.lit(1.5).alias("amount")))
    for df, name in ((ledger, "producer_ledger"), (log, "log_records"), (consumed, "consumed_records")):
        df.write.format("delta").mode("overwrite").partitionBy("topic", "part_hour").save(table_path(cfg, name))
    sink.write.format("delta").mode("overwrite").save(str(sink_dir))
    hw = m // PARTITIONS
    at = WINDOW + 2 * HOUR
    hour = at.strftime("%Y-%m-%dT%H")
    wm = [(topic_name(k), p, 0, hw, at, hour) for k in range(topics) for p in range(PARTITIONS)]
    spark.createDataFrame(wm, "topic string, partition int, log_start_offset long, high_watermark long, "
                              "captured_at timestamp, part_hour string") \
        .write.format("delta").mode("overwrite").partitionBy("topic", "part_hour") \
        .save(table_path(cfg, "partition_watermarks"))
    go = [(GROUP, topic_name(k), p, hw, at, hour) for k in range(topics) for p in range(PARTITIONS)]
    spark.createDataFrame(go, "group string, topic string, partition int, committed_offset long, "
                              "captured_at timestamp, part_hour string") \
        .write.format("delta").mode("overwrite").partitionBy("topic", "part_hour") \
        .save(table_path(cfg, "group_offsets"))


def run(spark: Any, cfg: Config, topics: list[str], as_of: datetime) -> tuple[float, dict[str, int]]:
    from spark_jobs.pipeline.steps import StepRange, run_step

    t = time.perf_counter()
    results = run_step(spark, cfg, "reconcile", StepRange(WINDOW, WINDOW + HOUR, tuple(topics), as_of))
    elapsed = time.perf_counter() - t
    found: dict[str, int] = {}
    for r in results:
        for row in r.report:
            found["lost"] = found.get("lost", 0) + int(row["lost"])
        found["anomalies"] = found.get("anomalies", 0) + r.anomaly_count
    return elapsed, found


def compare(spark: Any, cfg: Config, sides: dict[str, list[str]], as_of: datetime, reps: int,
            other: Any, other_cfg: Config) -> dict[str, tuple[float, float]]:
    """Per side, the median seconds of `reconcile_range` over the window (publishing) with this
    checkout's package and with `other`, alternating, `reps` times each, each publishing into its
    own lake (`cfg`, `other_cfg`); raises if either finds other than one `missed` per topic."""
    import spark_jobs.reconcile as current

    lakes = {current: cfg, other: other_cfg}
    times: dict[tuple[str, Any], list[float]] = {}
    for i in range(reps):
        for side, topics in sides.items():
            for m in ((current, other) if i % 2 == 0 else (other, current)):
                t = time.perf_counter()
                results = m.reconcile_range(spark, lakes[m], WINDOW, WINDOW + HOUR, as_of, topics)
                times.setdefault((side, m), []).append(time.perf_counter() - t)
                if sum(r.anomaly_count for r in results) != len(topics):
                    raise SystemExit(f"--against: {m.__name__} found {[r.anomaly_count for r in results]}")
    return {side: (statistics.median(times[(side, current)]), statistics.median(times[(side, other)]))
            for side in sides}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--topics", type=int, default=50, help="small topics in the window (default 50)")
    ap.add_argument("--messages", type=int, default=1000, help="messages per topic (default 1,000)")
    ap.add_argument("--reps", type=int, default=2, help="interleaved (one, all) pairs; medians are printed")
    ap.add_argument("--dir", default=None, help="work folder (default: a temporary one, removed at the end)")
    ap.add_argument("--conf", action="append", default=[], metavar="KEY=VALUE",
                    help="extra Spark setting, repeatable")
    ap.add_argument("--against", metavar="REV", default=None,
                    help="also time the driver side with spark_jobs/reconcile, audit/oracle.py and audit/rules/ "
                         "as of git revision REV (018fe3b or later), alternating with this checkout's (--reps "
                         "times each), and print the ratio")
    args = ap.parse_args(argv)
    if args.messages % PARTITIONS or args.messages <= MISSED_AT:
        ap.error(f"--messages must be even and above {MISSED_AT}")
    work = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="msgaudit-many-"))
    names = [topic_name(k) for k in range(args.topics)]
    sink = {"name": "table", "format": "delta", "location": str(work / "sink"), "group": GROUP}
    cfg = config_mod.from_dict({
        "home": str(work / "home"), "lake": str(work / "lake"), "report_store": f"sqlite:///{work / 'report.db'}",
        "spark": {"master": "local[2]", **dict(c.split("=", 1) for c in args.conf)},
        "topics": {t: {"window": "1h", "grace": "15m", "groups": [GROUP], "sinks": [sink], "sla": {"max_lost": 0}}
                   for t in names}},
        source="<benchmark>", base=work)
    from spark_jobs.io.session import build_spark

    t0 = time.perf_counter()
    spark = build_spark(cfg, app_name="msgaudit-many-topics")
    print(f"{args.topics} topics x {args.messages:,} messages in one window, local[2]; session up in "
          f"{time.perf_counter() - t0:.1f}s, work dir {work}")
    t = time.perf_counter()
    generate(spark, cfg, work / "sink", args.topics, args.messages)
    print(f"generated in {time.perf_counter() - t:.1f}s")
    if args.against:  # REV publishes into its own copy of the lake: the output tables' layout may differ
        shutil.copytree(work / "lake", work / "lake-against")
    as_of = WINDOW + HOUR + timedelta(minutes=15)
    from spark_jobs.reconcile.plan import DRIVER_ROWS

    ways = {"driver": replace(cfg, engine="driver"), "spark": replace(cfg, engine="spark")}
    for c in ways.values():
        run(spark, c, names[:1], as_of)  # warm-up: compiles the plans once, starts the Python workers
    rows = args.topics * (args.messages * 4)  # ledger, log, consumption, sink
    if rows > DRIVER_ROWS:
        print(f"note: {args.topics} topics hold about {rows:,} input rows, more than plan.DRIVER_ROWS "
              f"({DRIVER_ROWS:,}): `engine: auto` would settle them in Spark tasks; the `driver` side "
              "collects them all the same")
    times: dict[tuple[str, str], list[float]] = {}
    found: dict[tuple[str, str], dict[str, int]] = {}
    sides = {"one": names[:1], "all": names}
    for _ in range(args.reps):
        for side, topics in sides.items():
            for way, c in ways.items():
                s, found[(side, way)] = run(spark, c, topics, as_of)
                times.setdefault((side, way), []).append(s)
    against = None
    if args.against:
        from revisions import package_at, ship

        pkg = package_at(args.against, work / "against")
        ship(spark, work / "against", pkg)
        other = importlib.import_module(pkg)
        cfg = ways["driver"]  # both packages settle in the driver
        other_cfg = replace(cfg, lake=str(work / "lake-against"))
        for topics in sides.values():  # warm-up: the other package's plans compiled once
            other.reconcile_range(spark, other_cfg, WINDOW, WINDOW + HOUR, as_of, topics)
        against = compare(spark, cfg, sides, as_of, args.reps, other, other_cfg)
    sla_modules: dict[str, Any] = {"this checkout": importlib.import_module("spark_jobs.sla")}
    if args.against:
        from revisions import module_at

        sla_modules[args.against] = module_at(args.against, "spark_jobs/sla.py", work / "against")
    sla_times: dict[tuple[str, str], list[float]] = {}
    for i in range(args.reps + 1):  # the first round compiles the plans: not timed
        for side, topics in sides.items():
            for name, module in (sla_modules.items() if i % 2 == 0 else reversed(sla_modules.items())):
                t = time.perf_counter()
                outcome = module.check_sla(spark, cfg, WINDOW, WINDOW + HOUR, topics, checked_at=as_of)
                if i:
                    sla_times.setdefault((side, name), []).append(time.perf_counter() - t)
                if outcome.failed_errors != len(topics):
                    raise SystemExit(f"sla ({name}): {outcome.failed_errors} failed checks, {len(topics)} expected")
    med = {k: statistics.median(v) for k, v in times.items()}
    # per topic: one `missed` in the group stage (lost there); the sink does not expect what its group
    # never processed, so nothing else
    want = {"one": {"lost": 1, "anomalies": 1}, "all": {"lost": args.topics, "anomalies": args.topics}}
    ok = all(found[(side, way)] == want[side] for side in sides for way in ways)
    for side in sides:
        label = "one topic" if side == "one" else f"{args.topics} topics"
        for way in ways:
            runs = ", ".join(f"{x:.2f}" for x in times[(side, way)])
            print(f"{label:<10} {way:<6}: {med[(side, way)]:.2f}s  (runs: {runs})")
    print(f"injected anomalies found exactly: {'yes' if ok else 'NO'} ({found})")
    if against is not None:
        for side, (mine, theirs) in against.items():
            label = "one topic" if side == "one" else f"{args.topics} topics"
            print(f"{label:<10} driver: {mine:.2f}s with this checkout, {theirs:.2f}s with {args.against} "
                  f"(medians of {args.reps} alternating)")
    for (side, name), v in sla_times.items():
        label = "one topic" if side == "one" else f"{args.topics} topics"
        print(f"{label:<10} sla ({name}): {statistics.median(v):.2f}s  (runs: {', '.join(f'{x:.2f}' for x in v)})")
    spark.stop()
    if not args.dir:
        shutil.rmtree(work, ignore_errors=True)
    one, every = med[("one", "driver")], med[("all", "driver")]
    print(f"ratio driver/spark: one topic {one / med[('one', 'spark')]:.2f}, {args.topics} topics "
          f"{every / med[('all', 'spark')]:.2f}")
    print(f"ratio {args.topics} topics / one topic: driver {every / one:.2f}, spark "
          f"{med[('all', 'spark')] / med[('one', 'spark')]:.2f}  (target <= 5; one small window {one:.2f}s in the "
          f"driver, {med[('one', 'spark')]:.2f}s in Spark tasks, target <= 4 s)")
    sla_med = {k: statistics.median(v) for k, v in sla_times.items()}
    print(f"ratio sla {args.topics} topics / one topic: "
          f"{sla_med[('all', 'this checkout')] / sla_med[('one', 'this checkout')]:.2f}")
    if args.against:
        print(f"ratio sla this checkout / {args.against}: one topic "
              f"{sla_med[('one', 'this checkout')] / sla_med[('one', args.against)]:.2f}, {args.topics} topics "
              f"{sla_med[('all', 'this checkout')] / sla_med[('all', args.against)]:.2f}")
    if against is not None:
        print(f"ratio this checkout / {args.against} (driver): one topic {against['one'][0] / against['one'][1]:.2f}, "
              f"{args.topics} topics {against['all'][0] / against['all'][1]:.2f}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
