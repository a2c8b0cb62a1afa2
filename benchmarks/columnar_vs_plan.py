"""The columnar path (docs/design.md §5.10) against the Spark plan on the same window: a lake
`reconcile_scale.py --generate-only` made, reconciled (classified, not published) alternately by
`msgaudit reconcile`'s default -- the columnar path, for a window within `reconcile.columnar_rows`
-- and by the Spark plan (`columnar_rows: 0`), in one session, each after the same scan baseline
`reconcile_scale.py` uses. Prints the medians, `columnar / plan`, each against the scan, whether
both published the same report and anomaly rows and found every injected anomaly exactly, and the
growth of this Python process's peak RSS during the columnar runs (the driver's memory for them).
With `--other driver` the other side is the oracle in the driver (`driver_rows` above the window's
rows, the columnar side at `driver_rows: 1`): where the columnar path should take over from it.
With `--other uncompressed` (a window above `columnar_rows`, settled in chunks) the other side is
the same path with its spill written uncompressed (`driver.SPILL_OPTIONS`); with `--other files`,
the same path with its spill in files in TMPDIR, where the columnar side holds it in memory when it
fits (`driver.spill_held`; `SPILL_HELD_MAX_BYTES` at 0 on the other side). With `--other whole` (a
window of more than `columnar.SPLIT_ROWS` rows within `columnar_rows`, which the columnar side settles
in chunks on both cores) the other side settles it whole (`SPLIT_ROWS` above its rows).

    .venv/bin/python benchmarks/reconcile_scale.py --n 1000000 --anomaly-rate 0.0001 --history 2 --generate-only --dir DIR
    .venv/bin/python benchmarks/columnar_vs_plan.py --dir DIR --n 1000000 --anomaly-rate 0.0001 --reps 3
    .venv/bin/python benchmarks/columnar_vs_plan.py --dir DIR --n 40000 --other driver --reps 5
    .venv/bin/python benchmarks/columnar_vs_plan.py --dir DIR --n 10000000 --anomaly-rate 0.0001 --other uncompressed --reps 2
    .venv/bin/python benchmarks/columnar_vs_plan.py --dir DIR --n 10000000 --anomaly-rate 0.0001 --other files --reps 2
    .venv/bin/python benchmarks/columnar_vs_plan.py --dir DIR --n 1000000 --other whole --reps 5

This is a measurement script, not a test: it asserts nothing about time, it prints ratios.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import reconcile_scale as rs  # noqa: E402


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", required=True, help="a work folder `reconcile_scale.py --generate-only --dir` made")
    ap.add_argument("--n", type=int, required=True, help="its --n: messages in the window")
    ap.add_argument("--partitions", type=int, default=8, help="its --partitions (default 8)")
    ap.add_argument("--history", type=int, default=2, help="its --history (default 2): the window is that hour")
    ap.add_argument("--anomaly-rate", type=float, default=0.001, help="the rate it was generated with")
    ap.add_argument("--reps", type=int, default=3, help="timed rounds, alternating (medians)")
    ap.add_argument("--other", choices=("plan", "driver", "uncompressed", "files", "whole"), default="plan",
                    help="the other side: the Spark plan (default), the oracle in the driver, the "
                         "columnar path spilling its chunks uncompressed, spilling them to files, or "
                         "settling a window within columnar_rows whole instead of in chunks")
    ap.add_argument("--conf", action="append", default=[], metavar="KEY=VALUE", help="extra Spark setting")
    args = ap.parse_args(argv)
    rs.set_anomaly_rate(args.anomaly_rate)
    cfg = rs.bench_config(Path(args.dir), conf=args.conf)
    import pyarrow as pa

    from spark_jobs.io.session import build_spark
    from spark_jobs.reconcile import columnar, driver, reconcile_window

    spark = build_spark(cfg, app_name="msgaudit-columnar-vs-plan")
    other = args.other
    # each side: its config, the spill's write options, the most bytes of it held in memory and the
    # rows above which a window within columnar_rows is settled in chunks
    spill, held, split = driver.SPILL_OPTIONS, driver.SPILL_HELD_MAX_BYTES, columnar.SPLIT_ROWS
    if other == "plan":
        sides = {"columnar": (cfg, spill, held, split), other: (replace(cfg, columnar_rows=0), spill, held, split)}
    elif other == "uncompressed":
        sides = {"columnar": (cfg, spill, held, split), other: (cfg, pa.ipc.IpcWriteOptions(), held, split)}
    elif other == "files":
        sides = {"columnar": (cfg, spill, held, split), other: (cfg, spill, 0, split)}
    elif other == "whole":
        sides = {"columnar": (cfg, spill, held, split), other: (cfg, spill, held, 10**15)}
    else:
        sides = {"columnar": (replace(cfg, driver_rows=1), spill, held, split),
                 other: (replace(cfg, driver_rows=10**12), spill, held, split)}

    def run(side: tuple[Any, Any, int, int]) -> tuple[float, list[Any], list[Any]]:
        c, options, most, above = side
        driver.SPILL_OPTIONS = options
        driver.SPILL_HELD_MAX_BYTES = most
        columnar.SPLIT_ROWS = above
        t = time.perf_counter()
        r = reconcile_window(spark, c, rs.TOPIC, rs.WINDOW, rs.AS_OF, publish=False)
        took = time.perf_counter() - t
        rows = sorted(tuple(x) for x in r.anomalies.collect())
        report = r.report
        r.release()
        return took, rows, report

    rss_before = _rss_mb()
    for side in sides.values():  # one untimed run of each: the JVM's and numpy's first use
        run(side)
    rss_columnar = _rss_mb() - rss_before
    times: dict[str, list[float]] = {s: [] for s in sides}
    scans: list[float] = []
    same = True
    rows: dict[str, list[Any]] = {}
    input_rows = 0
    for i in range(args.reps):
        scan, input_rows = rs.scan_baseline(spark, cfg)
        scans.append(scan)
        for name in (list(sides) if i % 2 == 0 else list(sides)[::-1]):
            took, anomaly_rows, report = run(sides[name])
            times[name].append(took)
            rows[name] = [anomaly_rows, report]
        same = same and rows["columnar"] == rows[other]
        print(f"round {i + 1}: scan {scan:.2f}s, columnar {times['columnar'][-1]:.2f}s, "
              f"{other} {times[other][-1]:.2f}s", flush=True)
    n = args.n
    expected = rs.expected_counts(n, args.partitions, args.history)
    found: dict[str, int] = {}
    for row in rows["columnar"][0]:
        found[row[4]] = found.get(row[4], 0) + 1
    exact = all(found.get(code, 0) == e for code, e in expected.items())
    med = statistics.median
    col, plan, scan = med(times["columnar"]), med(times[other]), med(scans)
    print(f"{args.dir}: {n:,} messages in the window, {input_rows:,} input rows, anomaly rate {args.anomaly_rate}")
    print(f"scan {scan:.2f}s, columnar {col:.2f}s, {other} {plan:.2f}s (medians of {args.reps})")
    print(f"columnar / scan: {col / scan:.2f}   {other} / scan: {plan / scan:.2f}")
    print(f"same rows on both sides: {same}; every injected anomaly found exactly: {exact} "
          f"({sum(found.values()):,} anomaly rows)")
    print(f"peak RSS of this Python process grew {rss_columnar:,.0f} MB over the first runs "
          f"({rss_columnar * 1e6 / max(input_rows, 1):,.0f} bytes an input row)")
    print(f"columnar / {other}: {col / plan:.2f}")
    spark.stop()
    return 0 if same and exact else 1


if __name__ == "__main__":
    sys.exit(main())
