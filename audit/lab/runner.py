"""Run lab scenarios, then the real audit pipeline over what they did, and compare.

`run_scenarios` drives the scenarios on a `Lab`, then runs the product's pipeline exactly as a
scheduler would, through `spark_jobs.pipeline.steps.run_step`: ingest (ledger segments -> Delta),
capture (the Kafka log -> Delta), reconcile (per topic and window), sla; finally it reads
`audit_anomalies` back from the report store and compares them with each scenario's ground truth
(`audit.lab.truth.compare`).

as_of: the pipeline's rule (`spark_jobs.pipeline.plan.final_as_of`) for the last window of the
range, used for every window of it. `wait_final=True` (the demo) waits in real time until that
instant has passed; `wait_final=False` (the tests) judges at it without waiting, which gives the
same rows because nothing happens in the lab after the scenarios end (every producer and
consumer has stopped).

Spark is imported only inside functions: `audit` must stay importable without a JVM.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from audit.core.config import Config
from audit.core.windows import floor_window, windows
from audit.lab.env import Lab
from audit.lab.scenarios import SCENARIOS, Context, with_bootstrap
from audit.lab.truth import Comparison, Truth, compare


@dataclass
class ScenarioRun:
    name: str
    truth: Truth | None
    seconds: float
    error: str | None = None
    topics: tuple[str, ...] = ()
    first: datetime | None = None
    last: datetime | None = None


@dataclass
class LabResult:
    cfg: Config
    runs: list[ScenarioRun]
    comparisons: dict[str, Comparison] = field(default_factory=dict)  # topic -> comparison
    anomalies: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # topic -> rows
    report: list[dict[str, Any]] = field(default_factory=list)
    sla: Any = None
    timings: dict[str, float] = field(default_factory=dict)
    as_of: datetime | None = None
    start: datetime | None = None
    end: datetime | None = None
    ledger_topics: list[str] = field(default_factory=list)  # landed besides the ledger files

    def scenario_exact(self, name: str) -> bool:
        run = next(r for r in self.runs if r.name == name)
        return run.error is None and all(self.comparisons[t].exact for t in run.topics)

    @property
    def all_exact(self) -> bool:
        return all(self.scenario_exact(r.name) for r in self.runs)


def _now() -> datetime:
    return datetime.now(UTC)


def run_scenarios(names: Sequence[str], lab: Lab, cfg: Config, work: Path, spark_factory: Callable[[], Any],
                  *, say: Callable[[str], None] = print, window: timedelta = timedelta(minutes=1),
                  grace: timedelta = timedelta(seconds=5), wait_final: bool = False,
                  progress: bool = False, on_scenario_done: Callable[[str], None] | None = None,
                  sink_url: str | None = None) -> LabResult:
    """Run `names` (keys of SCENARIOS) on `lab`, audit them, compare with their ground truth.
    `sink_url`: the database of the exactly_once_sink scenario (default: SQLite under `work`)."""
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        from audit.core.errors import InputError

        raise InputError(f"unknown scenario(s) {unknown}; known: {', '.join(SCENARIOS)}")
    work.mkdir(parents=True, exist_ok=True)
    cfg = with_bootstrap(cfg, lab.bootstrap)
    t_start = _now()
    ctx = Context(lab, cfg, work, window=window, grace=grace, say=say, sink_url=sink_url,
                  spark=spark_factory)

    def capture_now(topic: str) -> None:
        from spark_jobs.pipeline.steps import StepRange, run_step

        c = cfg.with_topics({topic: ctx.topics[topic]})
        run_step(spark_factory(), c, "capture",
                 StepRange(floor_window(t_start, window) - window, _now() + window, (topic,)))

    ctx.capture_now = capture_now
    result = LabResult(cfg, [])
    for name in names:
        fn, _ = SCENARIOS[name]
        before = set(ctx.topics)
        t0 = time.monotonic()
        first = _now()
        try:
            truth: Truth | None = fn(ctx)
            error = None
        except Exception as e:  # noqa: BLE001 - one broken scenario must not hide the others' results
            truth, error = None, f"{type(e).__name__}: {e}"
            say(f"{name}: FAILED to run: {error}")
            say(traceback.format_exc(limit=3))
        new = tuple(t for t in ctx.topics if t not in before)
        if truth is not None:
            for t in new:
                truth.topic(t)
        result.runs.append(ScenarioRun(name, truth, time.monotonic() - t0, error, new, first, _now()))
        if on_scenario_done is not None:
            on_scenario_done(name)

    audited = {t: tc for t, tc in ctx.topics.items()
               if any(t in r.topics and r.truth is not None for r in result.runs)}
    cfg = cfg.with_topics(audited)
    result.cfg = cfg
    result.ledger_topics = list(ctx.ledger_topics)
    try:
        if not audited:
            return result
        start = floor_window(min(r.first for r in result.runs if r.first), window)
        end = floor_window(_now(), window) + window
        result.start, result.end = start, end
        _audit(result, spark_factory, start, end, window, wait_final=wait_final, say=say, progress=progress)
    finally:
        for stop in reversed(ctx.cleanups):  # e.g. the mirror scenarios' MM2 and target cluster
            stop()
    return result


def _audit(result: LabResult, spark_factory: Callable[[], Any], start: datetime, end: datetime,
           window: timedelta, *, wait_final: bool, say: Callable[[str], None], progress: bool) -> None:
    from audit.serving.report_store import ReportStore
    from spark_jobs.pipeline.plan import final_as_of
    from spark_jobs.pipeline.steps import StepRange, run_step

    cfg = result.cfg
    spark = spark_factory()
    t0 = time.monotonic()
    say("audit: ingesting producer and consumer ledgers into Delta")
    run_step(spark, cfg, "ingest", StepRange())
    for topic in result.ledger_topics:
        from dataclasses import replace

        from audit.core.config import LedgerTopicConfig
        from spark_jobs.ingest_topic import land_topic

        say(f"audit: landing the ledger topic {topic}")
        # The sinks' exactly-once evidence was landed by the ingest above.
        land_topic(spark, replace(cfg, ledger=LedgerTopicConfig(topic, cfg.kafka)), sink_evidence=False)
    result.timings["ingest_s"] = time.monotonic() - t0
    t0 = time.monotonic()
    say(f"audit: capturing the Kafka log of {len(cfg.topics)} topics")
    run_step(spark, cfg, "capture", StepRange(start, end))
    result.timings["capture_s"] = time.monotonic() - t0
    as_of = final_as_of(cfg, window, end)
    if wait_final:
        wait = (as_of - _now()).total_seconds()
        if wait > 0:
            say(f"audit: waiting {wait:.0f}s for the last window to close (+ grace) so the results are final")
            _sleep_with_bar(wait, progress)
    result.as_of = as_of
    t0 = time.monotonic()
    # Scenarios whose traffic falls in the same windows are reconciled in one call: their topics
    # share each window's plan (docs/design.md §2), and every topic gets exactly its own windows.
    together: dict[tuple[datetime, datetime], list[ScenarioRun]] = {}
    for run in result.runs:
        if run.truth is None or not run.topics or run.first is None or run.last is None:
            continue
        spans = list(windows(run.first, run.last, window))
        together.setdefault((spans[0][0], spans[-1][1]), []).append(run)
    for (first, last), runs in together.items():
        say(f"audit: reconciling {', '.join(r.name for r in runs)}")
        try:
            run_step(spark, cfg, "reconcile", StepRange(first, last, tuple(t for r in runs for t in r.topics), as_of),
                     progress=progress)
        except Exception:  # noqa: BLE001 - a reconcile bug on one scenario must not hide the others
            for run in runs:  # one by one, to name the scenario that fails
                try:
                    run_step(spark, cfg, "reconcile", StepRange(first, last, run.topics, as_of), progress=progress)
                except Exception as e:  # noqa: BLE001
                    run.error = f"reconcile failed: {type(e).__name__}: {str(e)[:500]}"
                    say(f"{run.name}: {run.error}")
    result.timings["reconcile_s"] = time.monotonic() - t0
    t0 = time.monotonic()
    result.sla = run_step(spark, cfg, "sla", StepRange(start, end, None, as_of))
    result.timings["sla_s"] = time.monotonic() - t0
    store = ReportStore(cfg.report_store)
    try:
        for run in result.runs:
            if run.truth is None or run.error is not None:
                continue
            for t in run.topics:
                rows = store.read("audit_anomalies", topic=t)
                result.anomalies[t] = rows
                result.comparisons[t] = compare(t, run.truth.rows.get(t, []), rows)
            result.report.extend(r for t in run.topics for r in store.read("audit_partition_report", topic=t))
    finally:
        store.close()


def _sleep_with_bar(seconds: float, progress: bool) -> None:
    if not progress:
        time.sleep(seconds)
        return
    from tqdm import tqdm

    steps = max(1, int(seconds))
    for _ in tqdm(range(steps), desc="window close", unit="s", leave=False):
        time.sleep(seconds / steps)
