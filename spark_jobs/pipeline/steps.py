"""Run one pipeline step (`plan.STEPS`) over a window range: the one place that calls the jobs.

The CLI commands, `spark-submit` (`submit.py`), backfill, the lab and the demo all come here, so
a step means the same thing whoever runs it. Each step returns its job's result and, when asked,
prints the job's own one-line summaries (the terminal output of the CLI and of spark-submit).

Spark and the jobs are imported inside the functions: the DAG files import this package at
parse time.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from audit.core.errors import InputError
from spark_jobs.pipeline.plan import STEPS

if TYPE_CHECKING:
    from audit.core.config import Config


@dataclass(frozen=True)
class StepRange:
    """What a step runs over: a window range, the topics (None: all configured), the as_of.

    `as_of` None means a hand run judged now (reconcile) / checked now (sla); the scheduled and
    backfill paths always pass the window's `plan.final_as_of`."""

    start: datetime | None = None
    end: datetime | None = None
    topics: tuple[str, ...] | None = None
    as_of: datetime | None = None

    def window_range(self, step: str) -> tuple[datetime, datetime]:
        if self.start is None or self.end is None:
            raise InputError(f"{step} needs --start and --end (ISO 8601 UTC, e.g. 2026-11-21T10:00Z)")
        if self.end <= self.start:
            raise InputError(f"--end ({self.end.isoformat()}) must be after --start ({self.start.isoformat()})")
        return self.start, self.end


def check_topics(cfg: Config, topics: Sequence[str] | None) -> None:
    """An unknown topic is one clear line, before any JVM starts."""
    for name in topics or ():
        cfg.topic(name)


def run_step(spark: Any, cfg: Config, step: str, rng: StepRange, *, progress: bool = False,
             say: Callable[[str], None] | None = None, data_docs: Path | None = None) -> Any:
    """Run `step` over `rng`; `say` (e.g. print) receives the step's summary lines. Its Spark jobs
    are named `msgaudit <step> <start>..<end>` in the Spark UI (reconcile's, more precisely, after
    their window and step: docs/design.md §9)."""
    if step not in STEPS:
        raise InputError(f"unknown step {step!r}; the steps are {', '.join(STEPS)}")
    from spark_jobs.io.session import described

    span = f" {rng.start.isoformat()}..{rng.end.isoformat()}" if rng.start and rng.end and step != "ingest" else ""
    with described(spark, f"msgaudit {step}{span}"):
        return _run_step(spark, cfg, step, rng, progress=progress, say=say, data_docs=data_docs)


def _run_step(spark: Any, cfg: Config, step: str, rng: StepRange, *, progress: bool,
              say: Callable[[str], None] | None, data_docs: Path | None) -> Any:
    out = say or (lambda _line: None)
    topics = list(rng.topics) if rng.topics else None
    if step == "ingest":
        from spark_jobs.ingest import ingest
        from spark_jobs.ingest_topic import land_topic

        # With a ledger topic the fleet's rows arrive through it (local segments are each host's spool).
        result = land_topic(spark, cfg) if cfg.ledger is not None else ingest(spark, cfg)
        for line in result.summary_lines(cfg):
            out(line)
        return result
    start, end = rng.window_range(step)
    check_topics(cfg, topics)
    if step == "capture":
        from spark_jobs.capture import capture

        captured = capture(spark, cfg, start, end, topics, progress=progress)
        out(captured.summary())
        if say is None:  # backfill, follow: what capture could not snapshot is still said, on stderr
            for note in captured.notes:
                _stderr(f"capture: {note}")
        return captured
    if step == "reconcile":
        from datetime import UTC

        from spark_jobs.reconcile import reconcile_range, summary_line

        as_of = rng.as_of or datetime.now(UTC)  # only a hand run without --as-of gets here without one
        results = reconcile_range(spark, cfg, start, end, as_of, topics, progress=progress)
        for r in results:
            out(summary_line(r))
        for line in explain_report(cfg, [row for r in results for row in r.report], start, end, topics):
            out(line)
        publish_metrics(cfg)
        return results
    from spark_jobs.sla import check_sla, format_table

    outcome = check_sla(spark, cfg, start, end, topics, checked_at=rng.as_of, data_docs_dir=data_docs)
    out(format_table(outcome))
    from audit.serving.routing import route_sla

    route_sla(cfg, outcome.rows, topics or sorted(cfg.topics), start, end, warn=_stderr)
    publish_metrics(cfg)
    return outcome


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def publish_metrics(cfg: Config) -> None:
    """The report store's figures to `metrics.textfile` / `metrics.pushgateway`, when configured
    (after each step that changes the report store: reconcile and SLA)."""
    from audit.serving.metrics import publish

    publish(cfg, warn=_stderr)


def explain_report(cfg: Config, report: Sequence[Mapping[str, Any]], start: datetime, end: datetime,
                   topics: Sequence[str] | None) -> list[str]:
    """What `msgaudit reconcile` prints after its summary lines: the cause and remedy of each code
    the report counts (`audit.core.explain.report_lines`), then the producer sessions whose recorded
    settings caused log anomalies of the range (from the report store, where reconcile published
    them)."""
    from audit.core.explain import SETTINGS_CODES, producer_lines, report_lines
    from audit.serving.report_store import ReportStore

    lines = report_lines(report)
    if not lines:
        return []
    out = ["", "Likely causes (docs/design.md §5):", *lines]
    if any(row.get(code) for row in report for code in SETTINGS_CODES):
        with ReportStore(cfg.report_store) as store:
            behind = store.anomaly_pids(topics, start, end, SETTINGS_CODES)
            named = producer_lines(behind, store.settings_of(b["pid"] for b in behind))
        if named:
            out += ["", "Producer settings behind them (producer_settings):", *[f"  {line}" for line in named]]
    return out


def sla_breach_message(outcome: Any, start: datetime, end: datetime) -> str | None:
    """The one line for error-severity SLA failures (exit code 3), or None when there are none."""
    if not outcome.failed_errors:
        return None
    return (f"{outcome.failed_errors} error-severity SLA check(s) failed for windows in "
            f"{start.isoformat()} .. {end.isoformat()}")
