"""A job process that keeps the memory it frees (`audit/runtime/memory.py`) against one that hands it
back to the kernel (`MSGAUDIT_KEEP_FREED_MEMORY=0`), on one window of a lake `reconcile_scale.py
--generate-only` made. The settings are read when a process starts, so each side is a child
process: it reconciles the window (classified, not published) once untimed, then once timed, and
reports that time with the CPU time it spent in the kernel and its page faults. The sides
alternate; prints the medians and `kept / returned`.

`--engine` is `reconcile.engine` of both sides. With `spark` (what `auto` picks for a window above
`plan.DRIVER_ROWS` input rows, e.g. 10M) the window's chunks are settled in Spark's Python workers:
they inherit the environment, so Arrow's allocator setting (`MIMALLOC_PURGE_DELAY`) and
`MSGAUDIT_KEEP_FREED_MEMORY`, but glibc's thresholds are set by `build_spark`, in the driver only,
and the kernel time and page faults printed are the child's, not its workers'. With `driver` the
whole window is settled in the child itself, so all of it is counted.

    .venv/bin/python benchmarks/reconcile_scale.py --n 10000000 --history 2 --generate-only --dir DIR
    .venv/bin/python benchmarks/freed_memory.py --dir DIR --n 10000000 --reps 3
    .venv/bin/python benchmarks/freed_memory.py --dir DIR --n 10000000 --reps 3 --engine driver

This is a measurement script, not a test: it asserts nothing about time, it prints ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

SIDES = {"kept": "1", "returned": "0"}

_CHILD = """
import json, resource, sys, time
from pathlib import Path
sys.path.insert(0, {bench!r})
import reconcile_scale as rs
rs.set_anomaly_rate({rate!r})
cfg = rs.bench_config(Path({dir!r}), engine={engine!r})
from spark_jobs.io.session import build_spark
from spark_jobs.reconcile import reconcile_window
spark = build_spark(cfg, app_name="msgaudit-freed-memory")
for timed in (False, True):
    r0, t = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    reconcile_window(spark, cfg, rs.TOPIC, rs.WINDOW, rs.AS_OF, publish=False).release()
    took, r1 = time.perf_counter() - t, resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({{"s": took, "sys": r1.ru_stime - r0.ru_stime, "faults": r1.ru_minflt - r0.ru_minflt}}))
spark.stop()
"""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", required=True, help="a work folder `reconcile_scale.py --generate-only --dir` made")
    ap.add_argument("--n", type=int, required=True, help="its --n: messages in the window")
    ap.add_argument("--anomaly-rate", type=float, default=0.001, help="the rate it was generated with")
    ap.add_argument("--reps", type=int, default=3, help="timed rounds, alternating (medians)")
    ap.add_argument("--engine", choices=("auto", "driver", "spark"), default="auto",
                    help="reconcile.engine of both sides (default auto)")
    args = ap.parse_args(argv)
    bench = Path(__file__).resolve().parent
    code = _CHILD.format(bench=str(bench), rate=args.anomaly_rate, dir=str(Path(args.dir).resolve()),
                         engine=args.engine)
    runs: dict[str, list[dict[str, float]]] = {s: [] for s in SIDES}
    for i in range(args.reps):
        for side in (list(SIDES) if i % 2 == 0 else list(SIDES)[::-1]):
            env = {k: v for k, v in os.environ.items() if k != "MIMALLOC_PURGE_DELAY"}
            env["MSGAUDIT_KEEP_FREED_MEMORY"] = SIDES[side]
            out = subprocess.run([sys.executable, "-c", code], env=env, cwd=bench.parent, capture_output=True,
                                 text=True, check=False)
            if out.returncode:
                print(out.stderr[-2000:], file=sys.stderr)
                return 1
            runs[side].append(json.loads(out.stdout.strip().splitlines()[-1]))
            r = runs[side][-1]
            print(f"round {i + 1}: {side} {r['s']:.2f}s (kernel {r['sys']:.2f}s, {r['faults']:,.0f} page faults)",
                  flush=True)
    med = {s: {k: statistics.median(r[k] for r in rs) for k in ("s", "sys", "faults")} for s, rs in runs.items()}
    print(f"{args.dir}: {args.n:,} messages in the window, anomaly rate {args.anomaly_rate}, engine {args.engine} "
          f"(medians of {args.reps})")
    for s, m in med.items():
        print(f"{s}: {m['s']:.2f}s, kernel {m['sys']:.2f}s, {m['faults']:,.0f} page faults")
    print(f"kept / returned: {med['kept']['s'] / med['returned']['s']:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
