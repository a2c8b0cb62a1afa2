"""The pipeline, declared once: its steps, their order, and when a window is judged (as_of).

    ingest -> capture -> reconcile -> sla

`ingest` lands every sealed ledger segment whatever the window; the other three run per window
for the topics that share it. Every caller -- the CLI, `spark-submit` (`submit.py`), both Airflow
DAGs, backfill, the lab and the demo, the benchmarks -- takes the steps and the as_of rule from
here; `steps.py` is the one place that runs them.

The as_of rule (docs/design.md §6): a window is judged at `window_end + grace`, where grace is the
largest grace among the configured topics with that window size (one scheduled run judges all of
them at one instant, and a run for a subset of them gives the rows of the full run). Scheduled and
backfill runs use exactly this instant, never the wall clock, so every rerun is row-identical;
the SLA results of a window carry it as `checked_at`. Only a hand-run `msgaudit reconcile`
without `--as-of` judges "now".

This module is light on purpose (the DAG files import it at parse time): no Spark, no Kafka,
no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING

from audit.core.errors import InputError
from audit.core.windows import windows

if TYPE_CHECKING:
    from audit.core.config import Config

STEPS: tuple[str, ...] = ("ingest", "capture", "reconcile", "sla")
WINDOW_STEPS: tuple[str, ...] = STEPS[1:]  # the steps that run per window
# What one spark-submit runs (`submit.py`): a step; `window` -- every step of one window in one
# application (the scheduled DAGs' one Spark task); or `backfill` -- the window steps of every window
# of a range in one application. A JVM and Spark session start costs more than a small window's
# work, so a scheduled window pays it once, not four times, and a range once, not 3 x windows; or
# `follow` -- every window as it becomes final, in one application that stays up (`follow.py`).
SUBMIT_STEPS: tuple[str, ...] = (*STEPS, "window", "backfill", "follow")


def grace_for(cfg: Config, size: timedelta) -> timedelta:
    """The largest grace among the configured topics whose window has this size."""
    graces = [t.grace for t in cfg.topics.values() if t.window == size]
    if not graces:
        raise InputError(f"{cfg.source}: no configured topic has a window of {size}")
    return max(graces)


def final_as_of(cfg: Config, size: timedelta, window_end: datetime) -> datetime:
    """The instant a window of `size` ending at `window_end` is judged: its end + grace."""
    return window_end + grace_for(cfg, size)


@dataclass(frozen=True)
class WindowRun:
    """One window of one size, the topics that share it, and the instant it is judged."""

    start: datetime
    end: datetime
    topics: tuple[str, ...]
    as_of: datetime

    def argv(self, step: str, config_path: str) -> list[str]:
        """`spark_jobs/pipeline/submit.py` arguments of one step of this window (or of `window`: all of them)."""
        if step == "ingest":  # ingest lands every segment, whatever the topic
            return range_argv(step, config_path, self.start, self.end)
        args = range_argv(step, config_path, self.start, self.end, self.topics)
        return args + ["--as-of", self.as_of.isoformat()] if step in ("reconcile", "sla", "window") else args


def range_argv(step: str, config_path: str, start: datetime, end: datetime,
               topics: Sequence[str] | None = None) -> list[str]:
    """`spark_jobs/pipeline/submit.py <step> --config F --start S --end E [--topic T ...]`."""
    return [step, "--config", config_path, "--start", start.isoformat(), "--end", end.isoformat(),
            *(a for t in topics or () for a in ("--topic", t))]


def backfill_argv(config_path: str, start: datetime, end: datetime, topics: Sequence[str] | None = None,
                  *, force: bool = False) -> list[str]:
    """`spark_jobs/pipeline/submit.py` arguments of a backfill of [start, end): every window judged
    by the rule above (no --as-of), finished windows skipped unless `force`."""
    args = range_argv("backfill", config_path, start, end, topics)
    return [*args, "--force"] if force else args


def plan_windows(cfg: Config, start: datetime, end: datetime, topics: Sequence[str] | None = None,
                 *, as_of: datetime | None = None) -> list[WindowRun]:
    """Every window overlapping [start, end) of the selected topics (default: all), topics that
    share a window grouped together, oldest first; judged at `as_of` if given, else by the rule."""
    selected = [cfg.topic(t) for t in topics] if topics else list(cfg.topics.values())
    if not selected:
        raise InputError(f"{cfg.source}: no topics configured; add one under `topics:`")
    by_window: dict[tuple[datetime, datetime], list[str]] = {}
    for tc in selected:
        for w in windows(start, end, tc.window):
            by_window.setdefault(w, []).append(tc.name)
    return [WindowRun(ws, we, tuple(sorted(names)), as_of if as_of is not None else final_as_of(cfg, we - ws, we))
            for (ws, we), names in sorted(by_window.items())]


def not_final(runs: Sequence[WindowRun], now: datetime) -> list[WindowRun]:
    """The windows whose as_of is still in the future: a backfill refuses them (the schedule's)."""
    return [r for r in runs if r.as_of > now]
