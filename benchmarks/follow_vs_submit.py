"""Scheduled windows: one `spark-submit` per window (what the window DAG runs) against `msgaudit follow`
(one long-lived application running each window when it becomes final), on the same windows.

Starts a local broker and produces N audited messages into each of W consecutive one-minute windows
(grace 10 s; a fresh producer per window, so each window's ledger segment is sealed), live. Then,
into two fresh lakes, window by window, side by side:

- `submit`: `spark-submit spark_jobs/pipeline/submit.py window --start ws --end we --as-of A` on
  `local[2]`, the DAG's task for that window: a JVM and session start, ingest, capture, reconcile
  and SLA (JVM start included, as a scheduled run pays it);
- `follow`: one tick of `spark_jobs.pipeline.follow.follow` in this process's session (started
  once, its start-up timed apart), on a simulated clock standing at the window's as_of -- the tick
  a follow that stays up runs when the window becomes final: ingest, capture, reconcile, SLA.

Prints each window's two times, the medians' ratio (submit / follow) without the first window
(the follow JVM's cold one) and with all of them, the follow session's start, and whether both
published the same report, anomaly and SLA rows.

    .venv/bin/python benchmarks/follow_vs_submit.py --n 20000 --windows 4

A measurement script, not a test: it asserts nothing about time.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cluster_vs_local import create_topic, local_argv, produce_messages  # noqa: E402

from audit.core import config as config_mod  # noqa: E402
from audit.core.windows import floor_window  # noqa: E402
from audit.runtime.local_kafka import LocalKafka  # noqa: E402
from audit.runtime.local_spark import DRIVER_LOG4J2  # noqa: E402

TOPIC = "bench-follow"
WINDOW = timedelta(minutes=1)
GRACE = timedelta(seconds=10)


def config_file(work: Path, bootstrap: str, ledger_dir: Path) -> Path:
    work.mkdir(parents=True)
    path = work / "msgaudit.yaml"
    path.write_text(yaml.safe_dump({
        "home": str(work / "home"), "lake": str(work / "lake"), "ledger_dir": str(ledger_dir),
        "report_store": f"sqlite:///{work / 'report.db'}",
        "kafka": {"bootstrap.servers": bootstrap},
        "topics": {TOPIC: {"window": "1m", "grace": "10s", "sla": {"max_lost": 0}}},
    }))
    return path


def submit_window(conf: Path, ws: datetime, as_of: datetime, log4j: Path) -> tuple[float, str]:
    """One `submit.py window` spark-submit on local[2]: (wall seconds, its last line)."""
    argv, env = local_argv(conf, ["window", "--config", str(conf), "--start", ws.isoformat(),
                                  "--end", (ws + WINDOW).isoformat(), "--topic", TOPIC, "--as-of", as_of.isoformat()],
                           log4j)
    t0 = time.perf_counter()
    out = subprocess.run(argv, env=env, cwd=conf.parent, capture_output=True, text=True)
    elapsed = time.perf_counter() - t0
    if out.returncode != 0:
        raise SystemExit(f"submit window {ws.isoformat()} failed ({out.returncode}):\n{out.stdout[-3000:]}\n"
                         f"{out.stderr[-2000:]}")
    lines = [line for line in out.stdout.splitlines() if line.startswith(TOPIC)]
    return elapsed, lines[-1] if lines else ""


class FollowSide:
    """A follow that stays up, driven one tick at a time: its clock stands at the window's as_of."""

    def __init__(self, conf: Path) -> None:
        from spark_jobs.io.session import build_spark

        self.cfg = config_mod.load(conf)
        t0 = time.perf_counter()
        self.spark = build_spark(self.cfg, app_name="bench-follow")
        self.spark.range(1).count()  # the session is up
        self.start_s = time.perf_counter() - t0
        self.lines: list[str] = []

    def window(self, ws: datetime, as_of: datetime) -> float:
        from spark_jobs.pipeline.follow import follow

        t0 = time.perf_counter()
        follow(self.spark, self.cfg, since=ws, clock=lambda: as_of, say=self.lines.append, warn=self.lines.append,
               max_ticks=1)
        return time.perf_counter() - t0

    def stop(self) -> None:
        self.spark.stop()


def report_rows(conf: Path) -> list[dict[str, Any]]:
    from audit.serving.report_store import ReportStore

    cfg = config_mod.load(conf)
    with ReportStore(cfg.report_store) as store:
        return [*store.read("audit_partition_report"), *store.read("audit_anomalies"), *store.read("sla_results")]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=20000, help="messages produced into each window (default 20000)")
    ap.add_argument("--windows", type=int, default=4, help="one-minute windows (default 4)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="msgaudit-bench-follow-") as tmp:
        root = Path(tmp)
        ledger = root / "ledger"
        log4j = root / "log4j2.properties"
        log4j.write_text(DRIVER_LOG4J2.format(log=root / "spark.log"))
        kafka = LocalKafka(root / "kafka", port=None)
        side: FollowSide | None = None
        try:
            kafka.start(300)
            create_topic(kafka.bootstrap_servers, TOPIC)
            starts: list[datetime] = []
            for k in range(args.windows):  # each window's messages inside its minute
                ws = floor_window(datetime.now(UTC), WINDOW) + WINDOW
                time.sleep(max((ws - datetime.now(UTC)).total_seconds() + 1.0, 0.0))
                t0 = time.perf_counter()
                produce_messages(kafka.bootstrap_servers, ledger, args.n, TOPIC, f"bench-{k}")
                if datetime.now(UTC) >= ws + WINDOW:
                    raise SystemExit(f"bench: producing {args.n} messages took more than a window; lower --n")
                starts.append(ws)
                print(f"window {ws:%H:%M}: produced {args.n} audited messages in {time.perf_counter() - t0:.1f}s",
                      flush=True)
            time.sleep(max((starts[-1] + WINDOW + GRACE - datetime.now(UTC)).total_seconds() + 1.0, 0.0))
            conf_submit = config_file(root / "submit", kafka.bootstrap_servers, ledger)
            conf_follow = config_file(root / "follow", kafka.bootstrap_servers, ledger)
            side = FollowSide(conf_follow)
            print(f"follow: session started in {side.start_s:.1f}s", flush=True)
            submit_s: list[float] = []
            follow_s: list[float] = []
            for ws in starts:  # side by side, window by window
                as_of = ws + WINDOW + GRACE
                s, line = submit_window(conf_submit, ws, as_of, log4j)
                f = side.window(ws, as_of)
                submit_s.append(s)
                follow_s.append(f)
                steps = next((x.split(" (", 2)[2].split(")")[0] for x in reversed(side.lines)
                              if x.startswith("follow: window ")), "")
                print(f"window {ws:%H:%M}: submit {s:6.1f}s   follow {f:6.1f}s ({steps})   submit/follow {s / f:5.2f}"
                      f"   {line}", flush=True)
            same = report_rows(conf_submit) == report_rows(conf_follow)
        finally:
            if side is not None:
                side.stop()
            kafka.stop()
    warm = statistics.median(submit_s[1:]) / statistics.median(follow_s[1:]) if len(starts) > 1 else float("nan")
    every = statistics.median(submit_s) / statistics.median(follow_s)
    print(f"\n{args.windows} one-minute windows of {args.n} messages (ingest, capture, reconcile, SLA):")
    print(f"  a spark-submit per window: median {statistics.median(submit_s):.1f}s, total {sum(submit_s):.1f}s")
    print(f"  follow, one tick per window: median {statistics.median(follow_s):.1f}s, total {sum(follow_s):.1f}s "
          f"(+ its session start {side.start_s if side else 0:.1f}s, once)")
    print(f"  same report, anomaly and SLA rows on both: {same}")
    print(f"submit / follow: {warm:.2f} (medians, windows after the first), {every:.2f} (every window); "
          f"totals with follow's start {sum(submit_s) / (sum(follow_s) + (side.start_s if side else 0)):.2f}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
