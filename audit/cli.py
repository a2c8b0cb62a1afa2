"""The `msgaudit` command line (docs/design.md §9): the top of the import levels.

Every command takes --config, turns every MsgauditError into one line on stderr and a non-zero
exit code, and shows progress on long work. Each command's module is imported only inside the
function that runs it (plain imports, no module names in strings), so `msgaudit --help` and the
broker commands start fast and without a JVM. The pipeline steps (ingest, capture, reconcile,
sla) run through `spark_jobs.pipeline.steps.run_step`, as spark-submit and the DAGs run them.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from audit import __version__
from audit.core.errors import MsgauditError

EXAMPLES: dict[str, str] = {
    "setup": "msgaudit setup            # fetch the Delta, Kafka-connector and broker jars once; build the librdkafka plugin",
    "kafka": "msgaudit kafka start --port 9092 && msgaudit kafka status\n"
             "  msgaudit kafka start --secure   # SASL_SSL + ACLs; the admin's settings in <home>/kafka/secure/admin.yaml",
    "connect": "msgaudit connect start --bootstrap 127.0.0.1:9092 && msgaudit connect submit iceberg-orders.json\n"
               "  msgaudit connect status   # the worker and its connectors' states\n"
               "  msgaudit connect stop",
    "cluster": "msgaudit cluster start --workers 2 && msgaudit cluster submit ingest --config msgaudit.yaml\n"
               "  msgaudit cluster submit capture --start 2026-11-21T10:00Z --end 2026-11-21T11:00Z --print\n"
               "  msgaudit cluster submit follow --alert-log alerts.jsonl   # the schedule, on the cluster\n"
               "  msgaudit cluster stop",
    "ingest": "msgaudit ingest --config msgaudit.yaml",
    "ship": "msgaudit ship --config msgaudit.yaml   # on each host, after a ledger-topic outage or from cron",
    "capture": "msgaudit capture --start 2026-11-21T10:00Z --end 2026-11-21T12:00Z",
    "reconcile": "msgaudit reconcile --start 2026-11-21T10:00Z --end 2026-11-21T11:00Z --as-of 2026-11-21T11:15Z",
    "backfill": "msgaudit backfill --start 2026-11-20T00:00Z --end 2026-11-21T00:00Z",
    "follow": "msgaudit follow --config msgaudit.yaml --alert-log alerts.jsonl   # under a supervisor; Ctrl-C stops it\n"
              "  msgaudit follow --since 2026-11-21T00:00Z --once   # the windows final by now, then exit",
    "sla": "msgaudit sla --start 2026-11-21T00:00Z --end 2026-11-21T12:00Z",
    "dashboard": "msgaudit dashboard --out dashboard --start 2026-11-20T00:00Z --end 2026-11-22T00:00Z\n"
                 "  msgaudit dashboard --out dashboard --timelines off   # rows show `msgaudit trace ...` instead\n"
                 "  msgaudit dashboard --out dashboard --topic orders   # then open dashboard/index.html",
    "doctor": "msgaudit doctor --horizon-hours 24   # exit 3 on an error-severity risk",
    "trace": "msgaudit trace --topic orders --pid 7f3a-p1 --seq 42    # or --partition 0 --offset 1234, --json\n"
             "  msgaudit trace --topic orders --key customer-1042   # every message with this Kafka key, in produce order",
    "demo": "msgaudit demo --out dashboard   # broker + faults + reconcile + SLA + dashboard, on embedded defaults\n"
            "  msgaudit demo --scenario mirror_kill   # MirrorMaker 2 between two local clusters (stage mirror:dr)\n"
            "  msgaudit demo --scenario mirror_target_retention   # the mirror's retention shorter than MM2's outage\n"
            "  msgaudit demo --scenario mirror_failover   # a group fails over to the MM2 copy (group stage)\n"
            "  msgaudit demo --scenario connect   # Kafka Connect (Iceberg sink) and Structured Streaming sinks",
}


def _range_args(p: argparse.ArgumentParser, as_of: str | None = None) -> None:
    p.add_argument("--start", required=True, help="window range start, ISO 8601 UTC (e.g. 2026-11-21T10:00Z)")
    p.add_argument("--end", required=True, help="window range end (exclusive), ISO 8601 UTC")
    p.add_argument("--topic", action="append", dest="topics", metavar="TOPIC",
                   help="only this topic (repeatable; default: every configured topic)")
    if as_of:
        p.add_argument("--as-of", default=None, help=as_of)


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--config", default=None, metavar="FILE",
                        help="config file (default: ./msgaudit.yaml if present, else embedded defaults)")
    common.add_argument("--verbose", action="store_true",
                        help="also show Spark/JVM output and warnings (default: they go to $MSGAUDIT_HOME/logs/msgaudit.log)")
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

    add("setup", "Fetch the JVM jars (Delta, Spark's Kafka source, JDBC drivers, Kafka broker) into the jar cache "
        "($MSGAUDIT_JARS, $MSGAUDIT_HOME/jars or ~/.cache/msgaudit/jars); build the librdkafka plugin "
        "(native/libmsgaudit) and the Java interceptor jar.")
    k = add("kafka", "Run a local KRaft Kafka broker (or a small cluster) from the cached jars; `start` creates the "
            "topics of the config (msgaudit.yaml) the broker lacks.")
    k.add_argument("action", choices=["start", "stop", "status"])
    k.add_argument("--port", type=int, default=9092, help="first client port (default 9092)")
    k.add_argument("--nodes", type=int, default=1, help="number of brokers (default 1; 3 for replication faults)")
    k.add_argument("--secure", action="store_true", help="start: serve SASL_SSL only (SCRAM-SHA-512, a local CA) with "
                   "ACLs enforced; the admin's client settings go to <data-dir>/secure/admin.yaml (a data folder "
                   "made secure stays secure)")
    k.add_argument("--data-dir", default=None, help="broker data folder (default <home>/kafka: the config's `home`, "
                   "./.msgaudit without a config)")
    cn = add("connect", "Run a local Kafka Connect worker (distributed mode, its config/offset/status topics on the "
             "cluster) from the cached jars, with Iceberg's sink connector and KafkaMetadataTransform on its class "
             "path; `submit FILE` creates or updates the connector of a JSON file {\"name\": ..., \"config\": {...}} "
             "and waits until its tasks run. The worker's log goes to <dir>/connect.log.")
    cn.add_argument("action", choices=["start", "stop", "status", "submit"])
    cn.add_argument("file", nargs="?", metavar="FILE", help="submit: the connector's JSON file")
    cn.add_argument("--bootstrap", default=None, metavar="HOST:PORT",
                    help="start: the Kafka cluster (default: the config's kafka.bootstrap.servers)")
    cn.add_argument("--port", type=int, default=None, help="REST port on 127.0.0.1 (default 8083)")
    cn.add_argument("--dir", default=None, help="worker folder: properties, state, log (default <home>/connect)")
    cl = add("cluster", "Run a local Spark standalone cluster (a master and workers, each its own JVM, bound to "
             "127.0.0.1) and submit pipeline steps to it with spark-submit (jars from the cache, this code "
             "as --py-files, the step's output on the terminal, Spark's logs in the cluster folder).")
    cl.add_argument("action", choices=["start", "stop", "status", "submit"])
    cl.add_argument("step", nargs="?", metavar="STEP",
                    help="submit: the pipeline step (ingest, capture, reconcile, sla), window (all four for "
                         "one window), backfill (every window of a past range) or follow (each window when "
                         "final, in an application that stays up)")
    for flag, what in (("--start", "window range start, ISO 8601 UTC"), ("--end", "window range end (exclusive)"),
                       ("--as-of", "reconcile: judge as of this instant; sla: its checked_at")):
        cl.add_argument(flag, default=None, help=f"submit: {what}")
    cl.add_argument("--topic", action="append", dest="topics", metavar="TOPIC", help="submit: only this topic (repeatable)")
    cl.add_argument("--port", type=int, default=7077, help="master port (default 7077)")
    cl.add_argument("--workers", type=int, default=2, help="start: number of worker JVMs (default 2)")
    cl.add_argument("--cores", type=int, default=1, help="start: cores per worker (default 1)")
    cl.add_argument("--memory", default="1g", help="start: memory per worker for its executors (default 1g)")
    cl.add_argument("--dir", default=None, help="cluster folder: state, logs, work dirs (default $MSGAUDIT_HOME/spark-cluster)")
    cl.add_argument("--force", action="store_true", help="submit backfill: redo windows finished by an earlier run")
    cl.add_argument("--once", action="store_true", help="submit follow: run the windows final by now, then exit")
    cl.add_argument("--alert-log", default=None, metavar="FILE",
                    help="submit follow: append one JSON line per error-severity SLA failure to FILE")
    cl.add_argument("--print", action="store_true", help="submit: print the spark-submit command instead of running it")
    add("ingest", "Land producer and consumer ledger segments into the Delta ledger tables, exactly once.")
    sh = add("ship", "Ship this host's ledger spool (<ledger_dir>/producer, <ledger_dir>/consumer) to the ledger "
             "topic of `ledger: {topic: ...}`: every sealed segment not yet marked shipped (dead writers' "
             "segments are sealed first); exit 2 when the topic cannot take them (run it again later).")
    sh.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for one segment's acknowledgements "
                    "(default 60)")
    _range_args(add("capture", "Capture what the Kafka log holds for a window range into Delta (log_records, offsets, "
                               "watermarks), and each configured mirror's copy on its target cluster (mirror_records)."))
    _range_args(add("reconcile", "Reconcile a window range and publish the report (audit_partition_report, audit_anomalies)."),
                as_of="judge as of this instant (default: now); same inputs + same as-of = same rows")
    bf = add("backfill", "Run capture + reconcile + SLA for every window in a past range (resumable, idempotent). "
             "Without --as-of, each window is judged as the schedule judges it, at its end + grace, so a "
             "rerun skips finished windows and gives the same rows; windows not final yet are refused.")
    _range_args(bf, as_of="judge every window as of this instant (default: each window's end + grace)")
    bf.add_argument("--force", action="store_true", help="redo windows already finished by an earlier run")
    fo = add("follow", "Run the schedule in one long-lived Spark application: ingest, then capture + reconcile + "
             "SLA of each window as soon as it is final (its end + grace), judged at that instant as the "
             "scheduled DAG judges it (the same rows); it sleeps in between. The JVM starts and warms up once, "
             "not once per window. Restarted, it resumes where it stopped and catches up the windows missed. "
             "It reads the config file again before each tick (a topic added is followed from then on). "
             "With metrics.port in the config it serves the report store's figures at /metrics.")
    fo.add_argument("--since", default=None, help="first window to run, ISO 8601 UTC (default: where the last "
                    "follow stopped, else the first window not final yet)")
    fo.add_argument("--topic", action="append", dest="topics", metavar="TOPIC",
                    help="only this topic (repeatable; default: every configured topic)")
    fo.add_argument("--once", action="store_true", help="run the windows final by now, then exit (exit 2 when a "
                    "window failed, 3 when an error-severity SLA rule failed)")
    fo.add_argument("--alert-log", default=None, metavar="FILE",
                    help="append one JSON line per error-severity SLA failure (the DAGs' alert) to FILE")
    sla = add("sla", "Check each topic's SLA on the report for a window range; exit 3 if an error-severity rule fails.")
    _range_args(sla, as_of="the SLA results' checked_at (default: now; the schedule passes the window's as_of)")
    sla.add_argument("--data-docs", default=None, metavar="DIR",
                     help="also build Great Expectations Data Docs (HTML) into DIR")
    d = add("dashboard", "Write the dashboard from the report store: a folder of static pages (index.html: "
            "overview of every topic; topics/<topic>.html: one page per topic) that opens from disk, no network.")
    d.add_argument("--out", default="dashboard", metavar="DIR", help="output folder (default ./dashboard)")
    d.add_argument("--start", default=None, help="first window to show, ISO 8601 UTC (default: all)")
    d.add_argument("--end", default=None, help="end (exclusive) of the windows to show (default: all)")
    d.add_argument("--topic", action="append", dest="topics", metavar="TOPIC",
                   help="only this topic (repeatable; default: every topic in the report store)")
    d.add_argument("--timelines", choices=["auto", "on", "off"], default="auto",
                   help="link each anomaly row to its message's timeline, read from the lake in one Spark pass "
                   "(auto: when the config's lake holds ledger or log tables; off: rows show the trace command)")
    doc = add("doctor", "Report the loss risks of the audited topics before they cause loss: unclean leader "
              "election, min.insync.replicas < 2, low replication factor, groups whose backlog expires soon, "
              "producers running with acks != all or without idempotence, consumption rows read on a mirror "
              "by a group not in its failover_groups (from the lake).")
    doc.add_argument("--topic", action="append", dest="topics", metavar="TOPIC", help="only this topic (repeatable)")
    doc.add_argument("--horizon-hours", type=float, default=24.0,
                     help="flag a group whose oldest unprocessed record expires within this many hours (default 24)")
    doc.add_argument("--min-replication-factor", type=int, default=2, help="warn below this (default 2)")
    doc.add_argument("--producer-hours", type=float, default=24.0,
                     help="check the settings (acks, idempotence) of producer sessions started within this many "
                     "hours, from the lake's producer_settings (default 24; 0: skip, no Spark)")
    doc.add_argument("--mirror-hours", type=float, default=24.0,
                     help="flag consumption rows read on a mirror within this many hours (lake's consumed_records) "
                     "that reconcile ignores: group not in the mirror's failover_groups (default 24; 0: skip)")
    tr = add("trace", "Show one message's journey from the lake: ledger rows, log copies, every processing, "
             "sink rows and the anomalies naming it, with their cause and remedy; with --key, the journey of "
             "every message whose captured log copy carries that Kafka key.")
    tr.add_argument("--topic", required=True, help="the message's topic")
    tr.add_argument("--pid", default=None, help="producer id of the message (with --seq)")
    tr.add_argument("--seq", type=int, default=None, help="sequence number of the message (with --pid)")
    tr.add_argument("--partition", type=int, default=None, help="log partition (with --offset)")
    tr.add_argument("--offset", type=int, default=None, help="log offset (with --partition)")
    tr.add_argument("--key", default=None, metavar="K",
                    help="the Kafka key (as text): trace every message whose captured log copy carries it, "
                    "in produce order")
    tr.add_argument("--limit", type=int, default=10, metavar="N",
                    help="with --key: show the timelines of the first N messages only (default 10; all are named)")
    tr.add_argument("--json", action="store_true", help="print JSON instead of the timeline")
    demo = add("demo", "Run an end-to-end audited pipeline with injected faults on embedded defaults and report it.")
    demo.add_argument("--scenario", default="mixed", help="fault scenario to run (default: mixed; 'list' lists them)")
    demo.add_argument("--out", default="dashboard", metavar="DIR",
                      help="dashboard folder to write (default ./dashboard; open DIR/index.html)")
    return parser


def _setup(args: argparse.Namespace, cfg: Any) -> int:
    """Fetch the jars of every manifest, build the librdkafka plugin and the Java interceptor jar."""
    from audit.clients import plugin
    from audit.runtime import jars

    for manifest in jars.MANIFESTS:
        d = jars.fetch(manifest)
        print(f"{manifest}: {len(list(d.glob('*.jar')))} jars in {d}")
    from audit.core.errors import SetupError

    try:  # the C source ships in the package (the wheel too)
        print(f"libmsgaudit: librdkafka plugin in {plugin.build()}")
    except SetupError as e:  # no gcc, make or librdkafka's header: one line, and the rest of the set-up
        print(f"libmsgaudit: {e}; AuditedProducer uses its pure-Python path")
    print(f"interceptors: Java interceptor jar in {jars.interceptors_jar(build=True)}")
    return 0


def _kafka(args: argparse.Namespace, cfg: Any) -> int:
    from audit.runtime.local_kafka import cli_kafka

    return cli_kafka(args, cfg)


def _connect(args: argparse.Namespace, cfg: Any) -> int:
    from audit.runtime.local_connect import cli_connect

    return cli_connect(args, cfg)


def _cluster(args: argparse.Namespace, cfg: Any) -> int:
    if args.action == "submit":
        from spark_jobs.pipeline.submit import cli_cluster_submit

        return cli_cluster_submit(args, cfg)
    from audit.runtime.local_spark import cli_cluster

    return cli_cluster(args, cfg)


def _step(args: argparse.Namespace, cfg: Any) -> int:
    """ingest / capture / reconcile / sla: one pipeline step over the given range."""
    from audit.core.errors import SlaFailed
    from audit.core.windows import parse_instant
    from spark_jobs.pipeline.steps import StepRange, check_topics, run_step, sla_breach_message

    def instant(name: str) -> Any:
        value = getattr(args, name, None)
        # --as-of now is the default (None); --start / --end now are this instant
        return parse_instant(value, "--" + name.replace("_", "-")) if value and (value != "now" or name != "as_of") else None

    rng = StepRange(instant("start"), instant("end"), tuple(args.topics) if getattr(args, "topics", None) else None,
                    instant("as_of"))
    if args.command != "ingest":
        rng.window_range(args.command)
        check_topics(cfg, rng.topics)
    if args.command == "capture":
        from spark_jobs.capture import selected_topics, topic_partitions

        topic_partitions(cfg, selected_topics(cfg, rng.topics))  # a missing topic fails before a JVM starts
    if args.command == "ingest":
        source = f"ledger topic {cfg.ledger.topic}" if cfg.ledger is not None else f"ledgers under {cfg.ledger_dir}"
        print(f"ingest: {source} -> Delta tables under {cfg.lake}", flush=True)
    from spark_jobs.io.session import build_spark

    spark = build_spark(cfg, app_name=f"msgaudit-{args.command}")
    data_docs = getattr(args, "data_docs", None)
    result = run_step(spark, cfg, args.command, rng, progress=True, say=print,
                      data_docs=Path(data_docs) if data_docs else None)
    if args.command == "sla":
        breach = sla_breach_message(result, *rng.window_range("sla"))
        if breach:
            raise SlaFailed(f"{breach} (details above and in sla_results)")
    return 0


def _ship(args: argparse.Namespace, cfg: Any) -> int:
    from audit.clients.ledger_ship import ship_spool
    from audit.core.errors import ConfigError

    if cfg.ledger is None:
        raise ConfigError(f"{cfg.source}: no ledger topic configured (add `ledger: {{topic: ..., kafka: {{...}}}}`)")
    print(f"ship: spool {cfg.ledger_dir} -> ledger topic {cfg.ledger.topic}", flush=True)
    result = ship_spool(cfg.ledger_dir, cfg.ledger.kafka, cfg.ledger.topic, timeout=args.timeout, progress=print)
    print(result.summary(cfg.ledger.topic))
    return 0


def _backfill(args: argparse.Namespace, cfg: Any) -> int:
    from spark_jobs.pipeline.backfill import cli_backfill

    return cli_backfill(args, cfg)


def _follow(args: argparse.Namespace, cfg: Any) -> int:
    from audit.core.windows import parse_instant
    from spark_jobs.io.session import build_spark
    from spark_jobs.pipeline.follow import run_follow
    from spark_jobs.pipeline.steps import check_topics

    since = parse_instant(args.since, "--since") if args.since else None
    check_topics(cfg, args.topics)
    spark = build_spark(cfg, app_name="msgaudit-follow")
    run_follow(spark, cfg, since=since, topics=args.topics, once=args.once,
               alert_log=Path(args.alert_log) if args.alert_log else None)
    return 0


def _dashboard(args: argparse.Namespace, cfg: Any) -> int:
    from audit.serving.dashboard import cli_dashboard

    tracer = None
    if args.timelines != "off":
        from spark_jobs.trace import lake_has_tables, lake_tracer

        if args.timelines == "on" or lake_has_tables(cfg):
            tracer = lake_tracer(cfg)
    return cli_dashboard(args, cfg, tracer)


def _doctor(args: argparse.Namespace, cfg: Any) -> int:
    from datetime import UTC, datetime, timedelta

    from audit.clients.doctor import cli_doctor

    producers = mirror_rows = None
    if args.producer_hours > 0 or args.mirror_hours > 0:
        from spark_jobs.trace import lake_has_tables

        def spark() -> Any:
            from spark_jobs.io.session import build_spark

            return build_spark(cfg, app_name="msgaudit-doctor")

        if args.producer_hours > 0 and lake_has_tables(cfg, ("producer_settings",)):
            from spark_jobs.trace import producer_sessions

            producers = producer_sessions(spark(), cfg, datetime.now(UTC) - timedelta(hours=args.producer_hours))
        if args.mirror_hours > 0 and lake_has_tables(cfg, ("consumed_records",)):
            from spark_jobs.trace import mirror_consumption

            mirror_rows = mirror_consumption(spark(), cfg, datetime.now(UTC) - timedelta(hours=args.mirror_hours))

    def record(risks: list[Any]) -> None:
        from dataclasses import asdict

        from audit.serving.report_store import ReportStore

        with ReportStore(cfg.report_store) as store:
            store.record_risks(datetime.now(UTC), [asdict(r) for r in risks])

    return cli_doctor(args, cfg, producers, record, mirror_rows)


def _trace(args: argparse.Namespace, cfg: Any) -> int:
    from audit.core.errors import InputError
    from audit.serving.trace_view import format_key_traces, format_timeline, key_traces_json, to_json
    from spark_jobs.io.session import build_spark
    from spark_jobs.trace import TraceQuery, trace_key, trace_message

    query = TraceQuery(args.topic, args.pid, args.seq, args.partition, args.offset, args.key)
    if args.limit < 1:
        raise InputError(f"--limit must be at least 1, got {args.limit}")
    cfg.topic(args.topic)  # an unknown topic fails before a JVM starts
    spark = build_spark(cfg, app_name="msgaudit-trace")
    if query.key is not None:
        result = trace_key(spark, cfg, args.topic, query.key, args.limit)
        print(key_traces_json(result) if args.json else format_key_traces(result))
        return 0
    trace = trace_message(spark, cfg, query)
    print(to_json(trace) if args.json else format_timeline(trace))
    return 0


def _demo(args: argparse.Namespace, cfg: Any) -> int:
    from audit.lab.demo import cli_demo

    return cli_demo(args, cfg)


# command -> function(args, config) -> exit code
COMMANDS: dict[str, Callable[[argparse.Namespace, Any], int]] = {
    "setup": _setup, "kafka": _kafka, "connect": _connect, "cluster": _cluster, "ingest": _step, "capture": _step, "reconcile": _step,
    "backfill": _backfill, "follow": _follow, "sla": _step, "dashboard": _dashboard, "demo": _demo,
    "trace": _trace, "doctor": _doctor, "ship": _ship,
}


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "verbose", False):
        import os

        from audit.runtime.quiet import ENV_VERBOSE

        os.environ[ENV_VERBOSE] = "1"
    home, log_offset = None, 0
    try:
        from audit.core import config as config_mod
        from audit.runtime import quiet

        cfg = config_mod.load(args.config)
        home = cfg.home
        log_offset = quiet.log_size(home)
        quiet.python_warnings_to_log(home)
        return int(COMMANDS[args.command](args, cfg) or 0)
    except MsgauditError as e:
        print(f"msgaudit {args.command}: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print(f"msgaudit {args.command}: interrupted", file=sys.stderr)
        return 130
    finally:
        if home is not None:
            from audit.runtime import quiet

            quiet.notice(home, log_offset, args.command)


if __name__ == "__main__":
    sys.exit(main())
