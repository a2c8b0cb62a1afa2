"""`msgaudit backfill`: capture -> reconcile -> SLA for every (topic, window) of a past range, with a
progress bar; resumable and idempotent. Each window's topics run together (one capture, one
reconcile plan, one SLA check per window), so the fixed cost is paid per window, not per topic.

Resumable: every finished (topic, window_start, as_of) is recorded in a small JSON state file
(`<home>/backfill-state.json`, replaced atomically after each window), and a rerun skips those
unless forced -- still counting the SLA failures they recorded, so a rerun ends as the first run
did (exit 3 when an error-severity rule failed in the range). Idempotent: every step replaces its
window's rows, so redoing a window (forced, or after a crash between a step and the state write)
gives the same rows.

as_of: an explicit `--as-of` is used for every window. Without one, each window is judged exactly as
the schedule judges it (`plan.final_as_of`: window end + grace), so a backfill writes the rows a
scheduled run writes and a rerun resumes instead of starting over. A window that is not final yet
(its as_of still ahead) is refused: it belongs to the schedule. The wall clock is read only for
that check, never as data.

This module orchestrates through `steps.run_step`; it classifies nothing itself and writes only
the state file.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from audit.core.config import Config
from audit.core.errors import InputError, MsgauditError
from audit.core.windows import parse_instant
from spark_jobs.pipeline.plan import WINDOW_STEPS, WindowRun, not_final, plan_windows
from spark_jobs.pipeline.steps import StepRange, run_step

STATE_FILE = "backfill-state.json"
Step = Callable[[Any, Config, Any, datetime, datetime, datetime], Any]  # topic, or a per_window step's topics


@dataclass
class BackfillResult:
    done: list[tuple[str, datetime]] = field(default_factory=list)
    skipped: list[tuple[str, datetime]] = field(default_factory=list)
    failed: list[tuple[str, datetime, str]] = field(default_factory=list)
    sla_errors: int = 0
    # what each window done by this run recorded in the state (anomalies, report rows, SLA failures)
    described: dict[tuple[str, datetime], dict[str, Any]] = field(default_factory=dict)


def state_key(topic: str, window_start: datetime, as_of: datetime) -> str:
    return f"{topic}|{window_start.isoformat()}|{as_of.isoformat()}"


def write_json(path: Path, data: Any) -> None:
    """`data` as JSON in `path`, atomically: a sibling is written, then renamed over it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True), encoding="utf-8")
    os.replace(tmp, path)


class BackfillState:
    """Finished windows, in a JSON file written atomically (write a sibling, then rename)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.done: dict[str, dict[str, Any]] = {}
        if path.exists():
            try:
                self.done = dict(json.loads(path.read_text(encoding="utf-8")).get("done", {}))
            except (ValueError, AttributeError):
                raise InputError(f"{path}: backfill state is not valid JSON; delete it to start over") from None

    def __contains__(self, key: str) -> bool:
        return key in self.done

    def mark(self, key: str, info: dict[str, Any]) -> None:
        self.done[key] = info
        self._write()

    def _write(self) -> None:
        write_json(self.path, {"done": self.done})

    def forget_before(self, instant: datetime) -> int:
        """Drops the entries of windows that start before `instant` (`msgaudit follow` keeps the file to
        the windows it may still run); how many were dropped. A backfill of those windows redoes them,
        which gives the same rows."""
        old = [k for k in self.done if datetime.fromisoformat(k.split("|")[1]) < instant]
        for k in old:
            del self.done[k]
        if old:
            self._write()
        return len(old)


def _window_step(step: str) -> Step:
    def run(spark: Any, cfg: Config, topic: str | tuple[str, ...], ws: datetime, we: datetime,
            as_of: datetime) -> Any:
        topics = (topic,) if isinstance(topic, str) else tuple(topic)
        return run_step(spark, cfg, step, StepRange(ws, we, topics, as_of))

    run.__name__ = f"{step}_step"
    run.per_window = True  # type: ignore[attr-defined]  # takes every topic of a window at once
    return run


capture_step, reconcile_step, sla_step = (_window_step(s) for s in WINDOW_STEPS)
DEFAULT_STEPS: tuple[tuple[str, Step], ...] = tuple(zip(WINDOW_STEPS, (capture_step, reconcile_step, sla_step),
                                                        strict=True))


def backfill_range(spark: Any, cfg: Config, start: datetime, end: datetime, as_of: datetime | None = None,
                   topics: Sequence[str] | None = None, *, force: bool = False,
                   steps: Sequence[tuple[str, Step]] = DEFAULT_STEPS, progress: bool = True,
                   now: datetime | None = None) -> BackfillResult:
    """Run `steps` for every (topic, window) overlapping [start, end); skip windows already done.
    The pipeline's own steps (`DEFAULT_STEPS`) run once per window for all its topics not done yet
    (one capture, one reconcile plan, one SLA check: the fixed cost is shared); other steps run
    per (topic, window)."""
    names = list(topics) if topics else sorted(cfg.topics)
    runs = plan_windows(cfg, start, end, names, as_of=as_of)
    jobs = sorted(((t, run.start, run.end, run.as_of) for run in runs for t in run.topics),
                  key=lambda j: (j[0], j[1]))
    if as_of is None:
        early = not_final([WindowRun(ws, we, (t,), a) for t, ws, we, a in jobs], now or datetime.now(UTC))
        if early:
            w = early[0]
            raise InputError(f"window [{w.start.isoformat()}, {w.end.isoformat()}) of {w.topics[0]} is not final "
                             f"until {w.as_of.isoformat()}; backfill past windows only (the schedule judges "
                             "the rest), or pass --as-of")
    state = BackfillState(cfg.home / STATE_FILE)
    result = BackfillResult()
    from tqdm import tqdm

    per_window = all(getattr(step, "per_window", False) for _, step in steps)
    units: list[tuple[tuple[str, ...], datetime, datetime, datetime]] = (
        [(run.topics, run.start, run.end, run.as_of) for run in runs] if per_window
        else [((t,), ws, we, a) for t, ws, we, a in jobs])
    bar = tqdm(total=len(jobs), desc="backfill", unit="window", disable=not progress)
    for unit_topics, ws, we, w_as_of in units:
        todo = []
        for t in unit_topics:
            key = state_key(t, ws, w_as_of)
            if key in state and not force:
                result.skipped.append((t, ws))
                # a rerun reports what the finished window found: its SLA failures still count
                result.sla_errors += int(state.done[key].get("sla", {}).get("failed_errors", 0))
                bar.update(1)
            else:
                todo.append(t)
        if not todo:
            continue
        bar.set_postfix_str(f"{todo[0] if len(todo) == 1 else f'{len(todo)} topics'} {ws:%Y-%m-%dT%H:%M}")
        info: dict[str, Any] = {}
        try:
            for name, step in steps:
                out = step(spark, cfg, tuple(todo) if per_window else todo[0], ws, we, w_as_of)
                info[name] = out
        except MsgauditError as e:
            # One window's bad input must not stop the others; it is reported and not marked done.
            for t in todo:
                result.failed.append((t, ws, f"{type(e).__name__}: {e}"))
            bar.update(len(todo))
            continue
        for t in todo:
            described = {name: _describe(name, out, t) for name, out in info.items()}
            result.sla_errors += int(described.get("sla", {}).get("failed_errors", 0))
            state.mark(state_key(t, ws, w_as_of), described)
            result.described[(t, ws)] = described
            result.done.append((t, ws))
            bar.update(1)
    bar.close()
    result.done.sort(key=lambda d: (d[0], d[1]))
    result.skipped.sort(key=lambda d: (d[0], d[1]))
    return result


def _describe(step: str, out: Any, topic: str | None = None) -> dict[str, Any]:
    if step == "reconcile" and out:
        mine = [r for r in out if topic is None or r.topic == topic] or list(out)
        return {"anomalies": sum(r.anomaly_count for r in mine), "report_rows": sum(len(r.report) for r in mine),
                "run_id": mine[0].run_id}
    if step == "sla" and out is not None:
        from audit.core.vocabulary import ERROR, WARN

        return {"failed_errors": out.failed(ERROR, topic), "failed_warnings": out.failed(WARN, topic)}
    return {}


def run_backfill(spark: Any, cfg: Config, start: datetime, end: datetime, as_of: datetime | None = None,
                 topics: Sequence[str] | None = None, *, force: bool = False,
                 say: Callable[[str], None] = print) -> BackfillResult:
    """`backfill_range` with its summary line, then the outcome as the CLI and spark-submit report it
    (both check the range and the topics before they start Spark):
    a window that failed raises `InputError` (exit 2: fix and rerun, finished windows are skipped),
    an error-severity SLA failure raises `SlaFailed` (exit 3: alert, do not retry)."""
    from audit.core.errors import SlaFailed

    result = backfill_range(spark, cfg, start, end, as_of, topics, force=force)
    say(f"backfill: {len(result.done)} windows done, {len(result.skipped)} already done (skipped), "
        f"{len(result.failed)} failed")
    if result.failed:
        t, ws, why = result.failed[0]
        raise InputError(f"{len(result.failed)} window(s) failed, first {t} {ws.isoformat()}: {why} "
                         "(fix it and rerun: finished windows are skipped)")
    if result.sla_errors:
        raise SlaFailed(f"{result.sla_errors} error-severity SLA rule(s) failed in the range "
                        "(see `msgaudit dashboard`)")
    return result


def cli_backfill(args: argparse.Namespace, cfg: Config) -> int:
    from spark_jobs.io.session import build_spark

    start = parse_instant(args.start, "--start")
    end = parse_instant(args.end, "--end")
    as_of = parse_instant(args.as_of, "--as-of") if getattr(args, "as_of", None) else None
    topics = args.topics or None
    for t in topics or []:
        cfg.topic(t)
    if end <= start:
        raise InputError(f"--end ({end.isoformat()}) must be after --start ({start.isoformat()})")
    spark = build_spark(cfg, app_name="msgaudit-backfill")
    run_backfill(spark, cfg, start, end, as_of, topics, force=bool(getattr(args, "force", False)))
    return 0
