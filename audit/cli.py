"""The `msgaudit` command line (DESIGN §9).

Every command takes --config, turns every MsgauditError into one line on stderr and a non-zero
exit code, and shows progress on long work. Spark jobs are imported only inside the command
that runs them, so `msgaudit --help` and the broker commands start fast and without a JVM.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from importlib import import_module
from typing import Any

from audit import __version__
from audit.core.errors import MsgauditError

# command -> "module:function"; each function takes (args, config) and returns an exit code.
COMMANDS: dict[str, str] = {
    "setup": "audit.runtime.jars:cli_setup",
    "kafka": "audit.runtime.local_kafka:cli_kafka",
    "ingest": "spark_jobs.ingest:cli_ingest",
    "capture": "spark_jobs.capture:cli_capture",
    "reconcile": "spark_jobs.reconcile:cli_reconcile",
    "backfill": "spark_jobs.pipeline.backfill:cli_backfill",
    "sla": "spark_jobs.sla:cli_sla",
    "dashboard": "audit.serving.dashboard:cli_dashboard",
    "demo": "audit.lab.demo:cli_demo",
}

EXAMPLES: dict[str, str] = {
    "setup": "msgaudit setup            # fetch the Delta, Kafka-connector and broker jars once",
    "kafka": "msgaudit kafka start --port 9092 && msgaudit kafka status",
    "ingest": "msgaudit ingest --config msgaudit.yaml",
    "capture": "msgaudit capture --start 2026-11-21T10:00Z --end 2026-11-21T12:00Z",
    "reconcile": "msgaudit reconcile --start 2026-11-21T10:00Z --end 2026-11-21T11:00Z --as-of 2026-11-21T11:15Z",
    "backfill": "msgaudit backfill --start 2026-11-20T00:00Z --end 2026-11-21T00:00Z",
    "sla": "msgaudit sla --start 2026-11-21T00:00Z --end 2026-11-21T12:00Z",
    "dashboard": "msgaudit dashboard --out report.html",
    "demo": "msgaudit demo             # broker + faults + reconcile + SLA + dashboard, on embedded defaults",
}


def _range_args(p: argparse.ArgumentParser, as_of: bool = False) -> None:
    p.add_argument("--start", required=True, help="window range start, ISO 8601 UTC (e.g. 2026-11-21T10:00Z)")
    p.add_argument("--end", required=True, help="window range end (exclusive), ISO 8601 UTC")
    p.add_argument("--topic", action="append", dest="topics", metavar="TOPIC",
                   help="only this topic (repeatable; default: every configured topic)")
    if as_of:
        p.add_argument("--as-of", default="now",
                       help="judge as of this instant (default: now); same inputs + same as-of = same rows")


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--config", default=None, metavar="FILE",
                        help="config file (default: ./msgaudit.yaml if present, else embedded defaults)")
    parser = argparse.ArgumentParser(
        prog="msgaudit",
        description="Prove, per topic-partition and window, that every Kafka message reached the log, "
        "every consumer group and every sink exactly once and in order.",
        epilog="Example: msgaudit demo",
    )
    parser.add_argument("--version", action="version", version=f"msgaudit {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def add(name: str, help_: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, parents=[common], help=help_, description=help_,
                              epilog=f"Example:\n  {EXAMPLES[name]}",
                              formatter_class=argparse.RawDescriptionHelpFormatter)

    add("setup", "Fetch the JVM jars (Delta, Spark's Kafka source, JDBC drivers, Kafka broker) into .msgaudit/jars.")
    k = add("kafka", "Run a local KRaft Kafka broker (or a small cluster) from the cached jars.")
    k.add_argument("action", choices=["start", "stop", "status"])
    k.add_argument("--port", type=int, default=9092, help="first client port (default 9092)")
    k.add_argument("--nodes", type=int, default=1, help="number of brokers (default 1; 3 for replication faults)")
    k.add_argument("--data-dir", default=None, help="broker data folder (default .msgaudit/kafka)")
    add("ingest", "Land producer and consumer ledger segments into the Delta ledger tables, exactly once.")
    _range_args(add("capture", "Capture what the Kafka log holds for a window range into Delta (log_records, offsets, watermarks)."))
    _range_args(add("reconcile", "Reconcile a window range and publish the report (audit_partition_report, audit_anomalies)."),
                as_of=True)
    bf = add("backfill", "Run capture + reconcile + SLA for every window in a past range (resumable, idempotent). "
             "With --as-of left at 'now', each window is judged at its end + grace (capped at now), so a "
             "rerun skips finished windows and gives the same rows.")
    _range_args(bf, as_of=True)
    bf.add_argument("--force", action="store_true", help="redo windows already finished by an earlier run")
    sla = add("sla", "Check each topic's SLA on the report for a window range; exit 3 if an error-severity rule fails.")
    _range_args(sla)
    sla.add_argument("--data-docs", default=None, metavar="DIR",
                     help="also build Great Expectations Data Docs (HTML) into DIR")
    d = add("dashboard", "Write a self-contained HTML dashboard from the report store.")
    d.add_argument("--out", default="report.html", help="output HTML file (default report.html)")
    d.add_argument("--start", default=None, help="first window to show (default: all)")
    d.add_argument("--end", default=None, help="end of the last window to show (default: all)")
    demo = add("demo", "Run an end-to-end audited pipeline with injected faults on embedded defaults and report it.")
    demo.add_argument("--scenario", default="mixed", help="fault scenario to run (default: mixed; 'list' lists them)")
    demo.add_argument("--out", default="report.html", help="dashboard file to write (default report.html)")
    return parser


def _resolve(target: str) -> Callable[[argparse.Namespace, Any], int]:
    module, func = target.split(":")
    return getattr(import_module(module), func)  # type: ignore[no-any-return,unused-ignore]


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        from audit.core import config as config_mod

        cfg = config_mod.load(args.config)
        return int(_resolve(COMMANDS[args.command])(args, cfg) or 0)
    except MsgauditError as e:
        print(f"msgaudit {args.command}: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print(f"msgaudit {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
