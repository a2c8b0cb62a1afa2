"""The `spark-submit` entry point: one msgaudit Spark step per submission (Airflow's SparkSubmitOperator).

    spark-submit spark_jobs/pipeline/submit.py <ingest|capture|reconcile|sla> --config FILE \\
        --start S --end E [--topic T ...] [--as-of A]
    spark-submit spark_jobs/pipeline/submit.py window --config FILE --start S --end E \\
        [--topic T ...] [--as-of A]
    spark-submit spark_jobs/pipeline/submit.py backfill --config FILE --start S --end E \\
        [--topic T ...] [--as-of A] [--force]
    spark-submit spark_jobs/pipeline/submit.py follow --config FILE [--start SINCE] [--topic T ...] [--once] \\
        [--alert-log FILE]

It builds the session with `spark_jobs.io.session.build_spark` and runs the step through
`spark_jobs.pipeline.steps.run_step`, exactly as the `msgaudit` CLI commands do. Exit codes:
0 ok; 2 bad input (one line on stderr: config, topic, window, missing table, broker); 3 an
error-severity SLA rule failed (schedulers alert, and should not retry); any other failure is a traceback and exit 1, which a scheduler may retry.

`window` runs the four steps in order in this one application, as the scheduled DAGs do for their
window (a JVM and session start, and a cold JIT, cost more than a small window's work): the
lines and exit code are those of the four steps run one by one, and the first failing step stops
it.

`backfill` is `msgaudit backfill` (`spark_jobs.pipeline.backfill`): capture, reconcile and SLA of
every window of the range in this one application, each window judged at its end + grace unless
--as-of is given, finished windows skipped unless --force (so a retry resumes). It exits 3 when an
error-severity SLA rule failed in any window, after every window has run; 2 when a window failed
on bad input, after the others have run.

`follow` is `msgaudit follow` (`spark_jobs.pipeline.follow`): every window as soon as it is final,
in this one application, which stays up (--start: the first window, as `msgaudit follow --since`;
--once: the windows final by now, then exit, with backfill's exit codes; --alert-log: one JSON line
per error-severity SLA failure appended to that file).

`ingest` lands every sealed ledger segment whatever the window, so it accepts and ignores
--start/--end/--topic (the DAGs pass the same argument shape to every step). The DAGs always
pass `--as-of` (the window's end + grace, `plan.final_as_of`) to reconcile and sla, so a rerun
gives the same rows; only a hand-run submission without it is judged now, like the CLI.

On a cluster the `audit` and `spark_jobs` packages must be importable by the driver (install
msgaudit) and reach the executors as `--py-files` (`audit.runtime.bundle.python_bundle`); the JVM
jars go on `--jars` from the jar cache. `cluster_submit` builds that whole command for a local
standalone cluster (`msgaudit cluster submit`).
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

from audit.core.errors import MsgauditError  # noqa: E402
from audit.core.vocabulary import ExitCode  # noqa: E402
from spark_jobs.pipeline.plan import STEPS, SUBMIT_STEPS  # noqa: E402
from spark_jobs.pipeline.steps import StepRange, run_step, sla_breach_message  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="spark_jobs/pipeline/submit.py",
        description="Run one msgaudit Spark step, the four steps of a window (`window`) or the backfill of a "
                    "past range (`backfill`) in one Spark application (for spark-submit / Airflow's "
                    "SparkSubmitOperator).",
        epilog="example: spark-submit spark_jobs/pipeline/submit.py reconcile --config msgaudit.yaml "
               "--start 2026-11-20T10:00Z --end 2026-11-20T11:00Z --as-of 2026-11-20T11:10Z",
    )
    p.add_argument("step", choices=SUBMIT_STEPS)
    p.add_argument("--config", default=None, metavar="FILE",
                   help="config file (default: ./msgaudit.yaml if present, else embedded defaults)")
    p.add_argument("--start", default=None, help="window range start, ISO 8601 UTC (not used by ingest; follow: "
                   "its first window, default where the last follow stopped)")
    p.add_argument("--end", default=None, help="window range end (exclusive), ISO 8601 UTC (not used by ingest)")
    p.add_argument("--topic", action="append", dest="topics", metavar="TOPIC",
                   help="only this topic (repeatable; default: every configured topic)")
    p.add_argument("--as-of", default=None,
                   help="reconcile: judge as of this instant; sla: its checked_at; window: both "
                        "(default: now); "
                        "backfill: judge every window as of this instant (default: its end + grace)")
    p.add_argument("--force", action="store_true", help="backfill: redo windows finished by an earlier run")
    p.add_argument("--once", action="store_true", help="follow: run the windows final by now, then exit")
    p.add_argument("--alert-log", default=None, metavar="FILE",
                   help="follow: append one JSON line per error-severity SLA failure (the DAGs' alert) to FILE")
    return p


def step_range(args: argparse.Namespace) -> StepRange:
    """The parsed --start/--end/--topic/--as-of (ISO 8601, one clear line when malformed)."""
    from audit.core.windows import parse_instant

    def instant(value: str | None, what: str) -> Any:
        return parse_instant(value, what) if value is not None else None

    return StepRange(instant(args.start, "--start"), instant(args.end, "--end"),
                     tuple(args.topics) if args.topics else None, instant(args.as_of, "--as-of"))


def main(argv: Sequence[str] | None = None, spark: Any = None) -> int:
    """Parse, load the config, build (or reuse `spark`) and run the step; errors -> one line + exit code.

    A session passed in is left running (tests share one); a session built here is stopped.
    """
    args = build_parser().parse_args(argv)
    own = spark is None
    try:
        from audit.core import config as config_mod

        cfg = config_mod.load(args.config)
        rng = step_range(args)
        if args.step not in ("ingest", "follow"):  # follow's --start is optional, it has no --end
            rng.window_range(args.step)
        if args.step != "ingest":
            for name in rng.topics or ():
                cfg.topic(name)  # an unknown topic fails before any JVM starts
        if own:
            from spark_jobs.io.session import build_spark

            spark = build_spark(cfg, app_name=f"msgaudit-{args.step}")
        if args.step == "backfill":
            from spark_jobs.pipeline.backfill import run_backfill

            start, end = rng.window_range("backfill")
            run_backfill(spark, cfg, start, end, rng.as_of, rng.topics, force=args.force)
            return int(ExitCode.OK)
        if args.step == "follow":
            from spark_jobs.pipeline.follow import run_follow

            run_follow(spark, cfg, since=rng.start, topics=rng.topics, once=args.once,
                       alert_log=Path(args.alert_log) if args.alert_log else None)
            return int(ExitCode.OK)
        for step in STEPS if args.step == "window" else (args.step,):
            result = run_step(spark, cfg, step, rng, progress=True, say=print)
        breach = sla_breach_message(result, *rng.window_range("sla")) if args.step in ("sla", "window") else None
        if breach:
            print(f"sla: {breach}", file=sys.stderr)
            return int(ExitCode.SLA_FAILED)
        return int(ExitCode.OK)
    except MsgauditError as e:
        print(f"msgaudit {args.step}: error: {e}", file=sys.stderr)
        return e.exit_code
    finally:
        if own and spark is not None:
            spark.stop()


def cluster_submit(cfg: Any, state: Any, step_argv: Sequence[str]) -> tuple[list[str], dict[str, str]]:
    """The spark-submit argv + environment running `submit.py <step_argv>` on the standalone cluster
    `state` (`audit.runtime.local_spark.ClusterState`): jars from the cache, this code as a zip, the
    config's driver-JVM settings."""
    from audit.runtime import jars
    from audit.runtime.bundle import python_bundle
    from audit.runtime.local_spark import submit_command

    return submit_command(state, str(Path(__file__).resolve()), list(step_argv),
                          jars=[str(p) for p in jars.jars("spark-deps")], py_files=[str(python_bundle())],
                          conf=cfg.driver_jvm)


def cli_cluster_submit(args: argparse.Namespace, cfg: Any) -> int:
    """`msgaudit cluster submit STEP [submit.py args]`: run one step on the local cluster (or print
    the command with --print); the step's exit code."""
    import shlex
    import subprocess

    from audit.core.errors import InputError
    from audit.runtime.local_spark import cluster_for, running_state

    if args.step not in SUBMIT_STEPS:
        raise InputError(f"cluster submit needs a step: one of {', '.join(SUBMIT_STEPS)}")
    step_argv = [args.step, "--config", str(Path(cfg.source).resolve())] if args.config else [args.step]
    for flag, value in (("--start", args.start), ("--end", args.end), ("--as-of", args.as_of)):
        if value is not None:
            step_argv += [flag, value]
    step_argv += [a for t in args.topics or () for a in ("--topic", t)]
    for flag, on, step in (("--force", args.force, "backfill"), ("--once", args.once, "follow"),
                           ("--alert-log", args.alert_log is not None, "follow")):
        if on and args.step != step:
            raise InputError(f"cluster submit {args.step}: {flag} is for `cluster submit {step}` only")
    step_argv += [flag for flag, on in (("--force", args.force), ("--once", args.once)) if on]
    if args.alert_log is not None:  # absolute: the driver does not run in the caller's directory
        step_argv += ["--alert-log", str(Path(args.alert_log).resolve())]
    step_range(build_parser().parse_args(step_argv))  # a malformed instant fails here, before any JVM
    argv, env = cluster_submit(cfg, running_state(cluster_for(args, cfg)), step_argv)
    if args.print:
        print(" ".join(shlex.quote(a) for a in argv))
        return 0
    # The step's own lines pass through; Spark's log lines are in the cluster's driver.log already,
    # and the JVM's one start-up notice about the incubator vector module is dropped.
    proc = subprocess.Popen(argv, env=env, stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    for line in proc.stderr:
        if not line.startswith("WARNING: Using incubator modules"):
            sys.stderr.write(line)
    return proc.wait()


if __name__ == "__main__":
    sys.exit(main())
