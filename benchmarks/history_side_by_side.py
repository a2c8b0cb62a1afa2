"""The same window reconciled with 1x and with 24x history in the tables, alternately in one session:
two lakes `reconcile_scale.py --generate-only` made (`--history 2`: the window and its lookback
hour; `--history 24`: 22 more hours of the same traffic before them), each window reconciled
(classified and published, as `reconcile_scale.py` times it) after its own scan baseline, the two
lakes in turns, one untimed round first. Prints each round, the medians, `24x / 1x` (target <= 1.2)
and whether both found every injected anomaly exactly.

`reconcile_scale.py` itself times the 1x window, generates the history, then times the 24x window:
whatever changes in between (the JIT still warming, another process on the machine) lands in its
ratio; here both sides share every moment of the session.

    .venv/bin/python benchmarks/reconcile_scale.py --n 1000000 --anomaly-rate 0.0001 --history 2 --generate-only --dir ONE
    .venv/bin/python benchmarks/reconcile_scale.py --n 1000000 --anomaly-rate 0.0001 --history 24 --generate-only --dir DAY
    .venv/bin/python benchmarks/history_side_by_side.py --one ONE --day DAY --n 1000000 --anomaly-rate 0.0001 --reps 6

This is a measurement script, not a test: it asserts nothing about time, it prints ratios.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import reconcile_scale as rs  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--one", required=True, help="a lake generated with --history 2 (1x history)")
    ap.add_argument("--day", required=True, help="a lake generated with --history 24 (24x history)")
    ap.add_argument("--n", type=int, required=True, help="their --n: messages in the window")
    ap.add_argument("--partitions", type=int, default=8, help="their --partitions (default 8)")
    ap.add_argument("--anomaly-rate", type=float, default=0.001, help="the rate both were generated with")
    ap.add_argument("--reps", type=int, default=6, help="timed rounds, the lakes in turns (medians)")
    args = ap.parse_args(argv)
    rs.set_anomaly_rate(args.anomaly_rate)
    sides = {"1x": (rs.bench_config(Path(args.one)), 2), "24x": (rs.bench_config(Path(args.day)), 24)}
    from spark_jobs.io.session import build_spark

    spark = build_spark(sides["1x"][0], app_name="msgaudit-history-side-by-side")
    for cfg, _ in sides.values():  # one untimed round: the JVM's and numpy's first use
        rs.scan_baseline(spark, cfg)
        rs.reconcile_once(spark, cfg, rs.AS_OF)[2].release()
    totals: dict[str, list[float]] = {s: [] for s in sides}
    scans: dict[str, list[float]] = {s: [] for s in sides}
    exact = True
    for i in range(args.reps):
        for name in (list(sides) if i % 2 == 0 else list(sides)[::-1]):
            cfg, window_ordinal = sides[name]
            scan, _ = rs.scan_baseline(spark, cfg)
            _, total, result = rs.reconcile_once(spark, cfg, rs.AS_OF)
            found = rs.found_counts(spark, result)
            result.release()
            expected = rs.expected_counts(args.n, args.partitions, window_ordinal)
            exact = exact and all(found.get(code, 0) == e for code, e in expected.items()) \
                and sum(found.values()) == sum(expected.values())
            totals[name].append(total)
            scans[name].append(scan)
            print(f"round {i + 1} {name:>3}: scan {scan:.2f}s, reconcile {total:.2f}s", flush=True)
    med = {s: statistics.median(v) for s, v in totals.items()}
    scan_med = {s: statistics.median(v) for s, v in scans.items()}
    print(f"1x : scan {scan_med['1x']:.2f}s, reconcile {med['1x']:.2f}s (medians of {args.reps})")
    print(f"24x: scan {scan_med['24x']:.2f}s, reconcile {med['24x']:.2f}s")
    print(f"every injected anomaly found exactly, both sides, every round: {exact}")
    print(f"reconcile 24x / 1x history: {med['24x'] / med['1x']:.2f}  (target <= 1.2)")
    spark.stop()
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
