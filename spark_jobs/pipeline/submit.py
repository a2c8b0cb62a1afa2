"""The `spark-submit` entry point: one msgaudit Spark step per submission (Airflow's SparkSubmitOperator).

    spark-submit spark_jobs/pipeline/submit.py <ingest|capture|reconcile|sla> --config FILE \\
        --start S --end E [--topic T ...] [--as-of A]

It builds the session with `spark_jobs.io.session.build_spark` and calls the same library functions
the `msgaudit` CLI commands call: `ingest.ingest`, `capture.capture`, `reconcile.reconcile_range`
and `sla.check_sla`. Exit codes: 0 ok; 2 bad input (one line on stderr: config, topic, window,
missing table, broker); 3 an error-severity SLA rule failed (schedulers alert, and should not
retry); any other failure is a traceback and exit 1, which a scheduler may retry.

`ingest` lands every sealed ledger segment whatever the window, so it accepts and ignores
--start/--end/--topic (the DAGs pass the same argument shape to every step). `--as-of` is
required in spirit for scheduled reconcile runs (same inputs + same as-of = same rows); it
defaults to now only for hand-run submissions, like the CLI.

On a cluster the `audit` and `spark_jobs` packages must be importable by the driver (install
msgaudit, or ship them with --py-files); the JVM jars come from build_spark's jar cache.
This module parses arguments and dispatches; it must not hold any audit logic of its own.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    # Run as a file (`spark-submit spark_jobs/pipeline/submit.py`): Python puts spark_jobs/ itself on the
    # path, not the checkout that holds the packages.
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from audit.core.errors import InputError, MsgauditError  # noqa: E402

STEPS = ("ingest", "capture", "reconcile", "sla")
SLA_EXIT_CODE = 3


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="spark_jobs/pipeline/submit.py",
        description="Run one msgaudit Spark step (for spark-submit / Airflow's SparkSubmitOperator).",
    )
    p.add_argument("step", choices=STEPS)
    p.add_argument("--config", default=None, metavar="FILE",
                   help="config file (default: ./msgaudit.yaml if present, else embedded defaults)")
    p.add_argument("--start", default=None, help="window range start, ISO 8601 UTC (not used by ingest)")
    p.add_argument("--end", default=None, help="window range end (exclusive), ISO 8601 UTC (not used by ingest)")
    p.add_argument("--topic", action="append", dest="topics", metavar="TOPIC",
                   help="only this topic (repeatable; default: every configured topic)")
    p.add_argument("--as-of", default=None, help="reconcile: judge as of this instant (default: now)")
    return p


def _range(args: argparse.Namespace) -> tuple[Any, Any]:
    from audit.core.windows import parse_instant

    if args.start is None or args.end is None:
        raise InputError(f"{args.step} needs --start and --end (ISO 8601 UTC, e.g. 2026-11-21T10:00Z)")
    start, end = parse_instant(args.start, "--start"), parse_instant(args.end, "--end")
    if end <= start:
        raise InputError(f"--end ({end.isoformat()}) must be after --start ({start.isoformat()})")
    return start, end


def run_step(spark: Any, cfg: Any, args: argparse.Namespace) -> int:
    """Run one step on an existing session; return the exit code (SLA failure -> 3)."""
    from audit.core.windows import parse_instant

    topics = args.topics or None
    if args.step == "ingest":
        from spark_jobs.ingest import ingest

        result = ingest(spark, cfg)
        for t in result.tables.values():
            print(f"ingest {t.table}: {t.landed} rows landed from {t.segments} segments, "
                  f"{t.quarantined} lines quarantined")
        return 0
    start, end = _range(args)
    for name in topics or ():
        cfg.topic(name)  # ConfigError naming an unknown topic
    if args.step == "capture":
        from spark_jobs.capture import capture

        print(capture(spark, cfg, start, end, topics, progress=True).summary())
        return 0
    if args.step == "reconcile":
        from spark_jobs.reconcile import reconcile_range, summary_line

        as_of = parse_instant(args.as_of or "now", "--as-of")
        for r in reconcile_range(spark, cfg, start, end, as_of, topics, progress=True):
            print(summary_line(r))
        return 0
    from spark_jobs.sla import check_sla, format_table

    outcome = check_sla(spark, cfg, start, end, topics)
    print(format_table(outcome))
    if outcome.failed_errors:
        print(f"sla: {outcome.failed_errors} error-severity SLA check(s) failed for windows in "
              f"{start.isoformat()} .. {end.isoformat()}", file=sys.stderr)
        return SLA_EXIT_CODE
    return 0


def main(argv: Sequence[str] | None = None, spark: Any = None) -> int:
    """Parse, load the config, build (or reuse `spark`) and run the step; errors -> one line + exit code.

    A session passed in is left running (tests share one); a session built here is stopped.
    """
    args = build_parser().parse_args(argv)
    own = spark is None
    try:
        from audit.core import config as config_mod

        cfg = config_mod.load(args.config)
        if own:
            from spark_jobs.io.session import build_spark

            spark = build_spark(cfg, app_name=f"msgaudit-{args.step}")
        return run_step(spark, cfg, args)
    except MsgauditError as e:
        print(f"msgaudit {args.step}: error: {e}", file=sys.stderr)
        return e.exit_code
    finally:
        if own and spark is not None:
            spark.stop()


if __name__ == "__main__":
    sys.exit(main())
