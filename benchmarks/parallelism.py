"""The parallelism question: the same window reconciled on two Spark masters side by side (by
default local[1] against local[2]), in one run.

Generates the window of `reconcile_scale.py` (N messages in one hour over the four tiers, its
lookback hour before it, the same injected anomalies) once, then, for each master in turn, starts a
SparkSession on it, times as `reconcile_scale.py` does (an untimed scan and `--warmups` untimed
reconciles, then `--reps` pairs of the scan baseline and the reconcile: classification + publish)
and stops that session before the next master's starts. With `--rounds R` each master gets R
sessions, in turns (A B B A ...), so that neither always runs on the JVM the other warmed up (the
sessions share one driver JVM: its JIT-compiled code outlives a session; the Python workers do not).

Prints, per master, the medians of the scan, the classification and the reconcile, where the window
was settled (the driver or N Spark tasks: `--engine`, `reconcile.engine`) and whether every
injected anomaly was found exactly; then `first / second` of the reconcile, the classification and
the scan seconds (local[1] / local[2]: how much the second core buys).

    .venv/bin/python benchmarks/parallelism.py --n 1000000
    .venv/bin/python benchmarks/parallelism.py --n 10000000 --anomaly-rate 0.0001 --engine spark --rounds 2
    .venv/bin/python benchmarks/parallelism.py --n 1000000 --masters local[2],local[4] --reps 3

This is a measurement script, not a test: it asserts nothing about time, it prints ratios.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import reconcile_scale as rs  # noqa: E402

from audit.core.config import ENGINES  # noqa: E402

WINDOW_ORDINAL = 1  # hour 0 is the lookback hour, hour 1 the window (reconcile_scale.py --history 1)


def session_run(cfg: Any, reps: int, warmups: int) -> tuple[list[tuple[float, float, float]], int, dict[str, int], str]:
    """One session on `cfg`'s master: [(scan, classify, reconcile) seconds per rep], the input rows the
    scan read, the anomalies found (by code) and where the window was settled. The session is stopped
    before this returns."""
    from spark_jobs.io.session import build_spark

    spark = build_spark(cfg, app_name="msgaudit-parallelism")
    try:
        rs.track_settling()
        rs.scan_baseline(spark, cfg)  # the JVM's first reads of these tables
        for _ in range(warmups):
            rs.reconcile_once(spark, cfg, rs.AS_OF)[2].release()
        runs = []
        rows, found = 0, {}
        for _ in range(reps):
            scan, rows = rs.scan_baseline(spark, cfg)
            cls, total, result = rs.reconcile_once(spark, cfg, rs.AS_OF)
            found = rs.found_counts(spark, result)
            result.release()
            runs.append((scan, cls, total))
        return runs, rows, found, rs.SETTLED[-1]
    finally:
        spark.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=1_000_000, help="messages in the window (default 1,000,000)")
    ap.add_argument("--partitions", type=int, default=8, help="topic partitions = producer pids (default 8)")
    ap.add_argument("--anomaly-rate", type=float, default=0.001,
                    help="share of messages injected with EACH anomaly code (default 0.001; at most 0.001, "
                         "1 / rate a multiple of 1000)")
    ap.add_argument("--masters", default="local[1],local[2]",
                    help="the two Spark masters, comma-separated (default local[1],local[2])")
    ap.add_argument("--engine", choices=ENGINES, default="auto", help="reconcile.engine (default auto)")
    ap.add_argument("--reps", type=int, default=1,
                    help="timed scan + reconcile pairs per session (default 1); medians are printed")
    ap.add_argument("--rounds", type=int, default=1,
                    help="sessions per master, the masters in turns (default 1)")
    ap.add_argument("--warmups", type=int, default=2,
                    help="untimed reconciles at the start of each session (default 2)")
    ap.add_argument("--shuffle-partitions", default="8")
    ap.add_argument("--conf", action="append", default=[], metavar="KEY=VALUE",
                    help="extra Spark setting of both sessions, repeatable (the masters are --masters)")
    ap.add_argument("--dir", default=None,
                    help="work folder, new or empty (default: a temporary one, removed at the end)")
    args = ap.parse_args(argv)
    masters = [m.strip() for m in args.masters.split(",") if m.strip()]
    if len(masters) != 2 or masters[0] == masters[1]:
        ap.error("--masters takes two different masters, e.g. local[1],local[2]")
    if any("=" not in c for c in args.conf):
        ap.error("--conf takes KEY=VALUE")
    if any(c.split("=", 1)[0] in ("master", "spark.master") for c in args.conf):
        ap.error("the masters are --masters, not --conf")
    rs.set_anomaly_rate(args.anomaly_rate)
    n, parts = args.n, args.partitions
    if n % parts or n % rs.MOD:
        ap.error(f"--n must be a multiple of {rs.MOD} (1 / --anomaly-rate) and of --partitions")
    if args.dir and Path(args.dir).exists() and any(Path(args.dir).iterdir()):
        ap.error(f"--dir {args.dir} is not empty: remove it or name a new folder")
    work = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="msgaudit-parallelism-"))
    cfgs = {m: rs.bench_config(work, args.shuffle_partitions, args.conf, m, args.engine) for m in masters}
    print(f"n={n:,} messages in the window, anomaly rate {1 / rs.MOD:g} of each code, {parts} partitions, "
          f"engine {rs.engine_note(args.engine)}, {' vs '.join(masters)}, {args.rounds} round(s) x "
          f"{args.reps} rep(s) (medians), work dir {work}")

    from spark_jobs.io.session import build_spark

    t = time.perf_counter()
    spark = build_spark(cfgs[masters[-1]], app_name="msgaudit-parallelism-generate")
    try:
        rs.generate(spark, cfgs[masters[-1]], work / "sink", n, parts, range(WINDOW_ORDINAL - 1, WINDOW_ORDINAL + 1),
                    WINDOW_ORDINAL)
        rs.write_snapshots(spark, cfgs[masters[-1]], n, parts, WINDOW_ORDINAL)
    finally:
        spark.stop()
    print(f"generated window + lookback hour on {masters[-1]} in {time.perf_counter() - t:.1f}s")

    runs: dict[str, list[tuple[float, float, float]]] = {m: [] for m in masters}
    found: dict[str, list[dict[str, int]]] = {m: [] for m in masters}
    settled: dict[str, set[str]] = {m: set() for m in masters}
    rows = 0
    for i in range(args.rounds):
        for m in (masters if i % 2 == 0 else masters[::-1]):
            got, rows, f, where = session_run(cfgs[m], args.reps, args.warmups)
            runs[m] += got
            found[m].append(f)
            settled[m].add(where)
            scan, cls, total = (statistics.median(x) for x in zip(*got, strict=True))
            print(f"round {i + 1} {m}: scan {scan:.2f}s, reconcile {cls:.2f}s + publish {total - cls:.2f}s "
                  f"= {total:.2f}s (settled in {where})", flush=True)

    expected = rs.expected_counts(n, parts, WINDOW_ORDINAL)
    med = {m: tuple(statistics.median(x) for x in zip(*runs[m], strict=True)) for m in masters}
    exact = {m: all(all(f.get(c, 0) == e for c, e in expected.items()) for f in found[m]) for m in masters}
    print()
    print(f"{rows:,} input rows read by the scan")
    for m in masters:
        scan, cls, total = med[m]
        print(f"{m:>10}: scan {scan:.2f}s, classify {cls:.2f}s, reconcile {total:.2f}s -> {n / total:,.0f} "
              f"messages/s, reconcile / scan {total / scan:.2f}, settled in {' / '.join(sorted(settled[m]))}, "
              f"anomalies found exactly: {'yes' if exact[m] else 'NO'}")
    a, b = masters
    print(f"{a} / {b}: reconcile {med[a][2] / med[b][2]:.2f}, classify {med[a][1] / med[b][1]:.2f}, "
          f"scan {med[a][0] / med[b][0]:.2f}  (medians of {args.rounds * args.reps} each)")
    ok = all(exact.values())
    if not ok:
        for code in sorted(set(expected).union(*(f.keys() for fs in found.values() for f in fs))):
            print(f"  {code:26s} expected {expected.get(code, 0):7,d}  found "
                  + ", ".join(f"{m} {found[m][-1].get(code, 0):,d}" for m in masters))
    if not args.dir:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
