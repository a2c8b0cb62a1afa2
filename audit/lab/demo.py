"""`msgaudit demo`: the product end to end on embedded defaults, with real faults.

It starts its own local Kafka broker behind the lab's fault proxy (data under `<home>/kafka`,
port 9092 or the first free block), runs a mixed workload of lab scenarios -- lost produce
responses with and without idempotence, a reordering retry, a restarted producer, consumers
killed at the wrong moment, an aborted transaction, a poison message, unaudited records --
then runs the audit exactly as production would (ingest the ledgers, capture the log, wait for
the windows to close, reconcile, check SLAs), prints the per-partition report, the anomaly
summary and, for each scenario, whether the audit found exactly what the scenario did, and
writes the dashboard folder (see `msgaudit dashboard`).

`--scenario list` lists the scenarios; `--scenario NAME` runs one (`lost_acked` starts a local
3-node cluster instead); `--scenario all` runs every single-broker scenario; `--scenario connect`
the Kafka Connect and Structured Streaming ones (audit.lab.connect).
Exit code: 0 when the audit matched the ground truth of every scenario, 1 otherwise.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

from audit.core.config import Config
from audit.core.errors import InputError
from audit.lab.env import Lab, LocalCluster, ProxiedBroker
from audit.lab.runner import LabResult, run_scenarios
from audit.lab.scenarios import CLUSTER_SCENARIOS, CONNECT_SCENARIOS, PROXY_SCENARIOS, SCENARIOS

MIXED = ("lost_response", "lost_response_idempotent", "reorder", "producer_restart", "at_most_once",
         "at_least_once", "aborted", "poison", "unaudited")
WINDOW = timedelta(minutes=1)
GRACE = timedelta(seconds=5)


def _selection(name: str) -> list[str]:
    if name == "mixed":
        return list(MIXED)
    if name == "all":
        return list(PROXY_SCENARIOS)
    if name == "connect":
        return list(CONNECT_SCENARIOS)
    if name in SCENARIOS:
        return [name]
    raise InputError(f"--scenario: unknown scenario {name!r}; choose mixed, all, connect, list or one of: "
                     f"{', '.join(SCENARIOS)}")


def list_scenarios() -> str:
    width = max(len(n) for n in SCENARIOS)
    lines = ["scenarios (msgaudit demo --scenario NAME):", f"  {'mixed':<{width}}  {', '.join(MIXED)} (default)",
             f"  {'all':<{width}}  every scenario on one broker behind the proxy (the mirror ones add a second cluster)",
             f"  {'connect':<{width}}  {', '.join(CONNECT_SCENARIOS)} (a Kafka Connect worker and Spark)"]
    lines += [f"  {n:<{width}}  {desc}" for n, (_, desc) in SCENARIOS.items()]
    return "\n".join(lines)


def format_report(rows: Sequence[dict[str, Any]]) -> str:
    """The per-partition report, one line per (topic, partition, stage)."""
    head = ("topic", "part", "stage", "expected", "delivered", "lost", "dup", "reord", "pending", "p99 ms", "status")
    body = []
    for r in sorted(rows, key=lambda r: (r["topic"], r["window_start"], r["partition"], r["stage"])):
        p99 = r.get("latency_p99_ms")
        body.append((r["topic"], str(r["partition"]), r["stage"], str(r["expected"]), str(r["delivered"]),
                     str(r["lost"]), str(r["duplicated"]), str(r["reordered"]), str(r["pending"]),
                     "-" if p99 is None else f"{p99:.0f}", r["status"]))
    return _table(head, body)


def format_anomalies(rows_by_topic: dict[str, list[dict[str, Any]]]) -> str:
    counts: Counter[tuple[str, str, str]] = Counter()
    for topic, rows in rows_by_topic.items():
        for r in rows:
            counts[(topic, r["stage"], r["anomaly"])] += 1
    if not counts:
        return "(no anomalies)"
    return _table(("topic", "stage", "anomaly", "rows"),
                  [(t, s, a, str(n)) for (t, s, a), n in sorted(counts.items())])


def format_causes(report: Sequence[dict[str, Any]], anomalies: Sequence[dict[str, Any]],
                  settings: Sequence[dict[str, Any]]) -> str:
    """The cause and fix of each code the report counts, then the producer sessions whose recorded
    settings caused log anomalies (`audit.core.explain`); empty when the report counts none."""
    from audit.core.explain import producer_lines, report_lines

    lines = report_lines(report)
    if not lines:
        return ""
    named = producer_lines(anomalies, settings)
    return "\n".join(["Likely causes (docs/design.md §5)", *lines,
                      *(["Producer settings behind them (producer_settings)", *(f"  {x}" for x in named)]
                        if named else [])])


def _table(head: Sequence[str], body: Sequence[Sequence[str]]) -> str:
    widths = [max(len(head[i]), *(len(row[i]) for row in body)) if body else len(head[i]) for i in range(len(head))]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join([fmt.format(*head), fmt.format(*("-" * w for w in widths))] + [fmt.format(*r) for r in body])


def format_verdicts(result: LabResult) -> str:
    lines = []
    for run in result.runs:
        if run.error:
            lines.append(f"  {run.name:<26} DID NOT RUN: {run.error}")
            continue
        assert run.truth is not None
        exact = result.scenario_exact(run.name)
        expected = ", ".join(f"{a} x{n}" for a, n in run.truth.counts().items()) or "no anomaly"
        lines.append(f"  {run.name:<26} {'OK ' if exact else 'MISMATCH'}  ground truth: {expected}  "
                     f"({run.seconds:.1f}s)")
        if not exact:
            lines.extend("    " + result.comparisons[t].describe().replace("\n", "\n    ")
                         for t in run.topics if not result.comparisons[t].exact)
    return "\n".join(lines)


def _say(progress: Any) -> Callable[[str], None]:
    def say(line: str) -> None:
        if progress is not None:
            progress.write(line)
        else:
            print(line, flush=True)
    return say


def run_demo(cfg: Config, scenario: str, out: Path, *, say: Callable[[str], None] | None = None) -> tuple[int, LabResult]:
    names = _selection(scenario)
    from tqdm import tqdm

    say = say or _say(tqdm)
    home = Path(cfg.home)
    work = home / "lab"
    t_total = time.monotonic()
    spark_holder: dict[str, Any] = {}

    def spark() -> Any:
        if "spark" not in spark_holder:
            from spark_jobs.io.session import build_spark

            say("spark: starting a local Spark session (Delta + Kafka source)")
            spark_holder["spark"] = build_spark(cfg, app_name="msgaudit-demo")
        return spark_holder["spark"]

    cluster = any(n in CLUSTER_SCENARIOS for n in names)
    env: ProxiedBroker | LocalCluster
    if cluster:
        env = LocalCluster(home / "kafka-cluster")
        say("kafka: starting a local 3-node KRaft cluster ...")
    else:
        data_dir = home / "kafka"
        from audit.runtime.local_kafka import LocalKafka

        if LocalKafka(data_dir).running_nodes():  # `msgaudit kafka start` owns that one: leave it alone
            data_dir = home / "kafka-demo"
        env = ProxiedBroker(data_dir, port=9092)
        say(f"kafka: starting a local broker behind the fault proxy (data in {data_dir}) ...")
    t0 = time.monotonic()
    lab: Lab = env.start()
    try:
        say(f"kafka: ready at {lab.bootstrap} in {time.monotonic() - t0:.0f}s")
        bar = tqdm(total=len(names), desc="scenarios", unit="scenario", file=sys.stderr, disable=None)
        result = run_scenarios(names, lab, cfg, work, spark, say=say, window=WINDOW, grace=GRACE,
                               wait_final=True, progress=True, on_scenario_done=lambda _: bar.update(1))
        bar.close()
    finally:
        env.stop()
    if "spark" in spark_holder:
        from audit.serving.dashboard import render
        from spark_jobs.trace import lake_tracer

        out = render(result.cfg, out, tracer=lake_tracer(result.cfg, spark()))
    print()
    print("Per-partition report")
    print(format_report(result.report))
    print()
    print("Anomaly summary")
    print(format_anomalies(result.anomalies))
    rows = [r for topic_rows in result.anomalies.values() for r in topic_rows]
    from audit.serving.report_store import ReportStore

    with ReportStore(result.cfg.report_store) as store:
        causes = format_causes(result.report, rows, store.settings_of(r["pid"] for r in rows if r.get("pid")))
    if causes:
        print()
        print(causes)
    if result.sla is not None:
        from spark_jobs.sla import format_table

        print()
        print(format_table(result.sla))
    print()
    print("Audit vs ground truth (what each scenario actually did)")
    print(format_verdicts(result))
    print()
    timings = ", ".join(f"{k[:-2]} {v:.0f}s" for k, v in result.timings.items())
    print(f"demo finished in {time.monotonic() - t_total:.0f}s ({timings}); dashboard: {out}")
    return (0 if result.all_exact and result.runs else 1), result


def cli_demo(args: argparse.Namespace, cfg: Config) -> int:
    scenario = getattr(args, "scenario", "mixed") or "mixed"
    if scenario == "list":
        print(list_scenarios())
        return 0
    code, _ = run_demo(cfg, scenario, Path(getattr(args, "out", "dashboard") or "dashboard"))
    return code
