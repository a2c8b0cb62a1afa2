"""`msgaudit follow`: the schedule in one long-lived Spark application.

A scheduled DAG run submits one Spark application per window (`submit.py window`), so every window
pays a JVM and Spark session start, a cold JIT and the first read of each Delta log again: at 1M
messages the first window in a JVM takes about three times a warm one (docs/benchmarks.md).
`follow` keeps one application up and runs each window when it becomes final, as the schedule
would: ingest (every sealed ledger segment), then capture, reconcile and SLA of every window whose
as_of (`plan.final_as_of`: its end + grace) has passed, judged at that as_of -- never at the wall
clock -- so it writes the rows a scheduled run of the window writes. Between ticks it sleeps until
the next window is final.

Where it starts: `since` when given; else where the last run stopped (its cursor, in
`<home>/follow-state.json`); else the first window not final yet (windows final before it started
are `msgaudit backfill`'s). After an outage it catches up every window since its cursor in one tick.
The cursor is the start of the earliest window not done: a window that failed on bad input (a
missing table, an unreachable broker) holds it there and is retried every `RETRY` until it is
fixed, while the windows after it still run. Finished windows are recorded in the backfill's state
(`backfill.BackfillState`), so `follow` and `backfill` never redo each other's windows; entries of
windows before the cursor are dropped, so the file holds only the windows `follow` may still run.

Before each tick it reads its config file again (`ConfigWatch`): a topic added is followed from the
cursor on (its earlier windows are `msgaudit backfill`'s), a topic removed is no longer run, changed
windows, sinks, SLA rules, brokers and reconcile settings apply to the windows of that tick. `home`,
`lake` and `spark` hold follow's state and its session, so a change to them is one line and applies
when follow is restarted. A file that no longer loads is one line; the config last read stays in use.

When ingest fails, no window of that tick runs (a window judged without its ledger rows would
report them lost); the tick is retried after `RETRY`. An unexpected error is one line and the tick
is retried after `RETRY`; the `MAX_FAILED_TICKS`-th in a row is raised (exit 1: a supervisor
starts a fresh JVM). An error-severity SLA failure is one line on stderr and, with `alert_log`,
one JSON line (`audit.serving.alerts.Alert`, what the DAGs' failure callback builds) appended to
that file; `follow` goes on.

With `airflow.url` set (or events still pending from an earlier run), every window done is a
completeness event per topic (`audit.serving.completeness.window_events`, the DAGs' events), added
to `<home>/airflow-events.json` at once and posted to Airflow's REST API at the end of the tick
(`audit.serving.airflow_events.Outbox`). An Airflow that is missing, unreachable or refuses the
credentials is one line; the events stay pending (`Tick.events_failed`) and are sent again by the
next tick, which then comes after `RETRY` at most.

This module orchestrates through `steps.run_step` and `backfill.backfill_range`; it classifies
nothing itself and writes only its state file and the alert log; with `metrics.port` it serves the
report store's figures at `/metrics` while it runs (`audit/serving/metrics.py`).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from audit.core import config as config_mod
from audit.core.config import Config
from audit.core.errors import InputError, MsgauditError, SlaFailed
from audit.serving.airflow_events import OUTBOX_FILE, Outbox
from spark_jobs.pipeline.backfill import (
    DEFAULT_STEPS,
    BackfillState,
    Step,
    backfill_range,
    state_key,
    write_json,
)
from spark_jobs.pipeline.backfill import STATE_FILE as BACKFILL_STATE
from spark_jobs.pipeline.plan import WindowRun, plan_windows
from spark_jobs.pipeline.steps import StepRange, run_step

STATE_FILE = "follow-state.json"
RETRY = timedelta(minutes=5)  # a failed window, or a failed tick, is tried again after this long
MAX_FAILED_TICKS = 3  # unexpected errors in a row before follow gives up (exit 1)

Ingest = Callable[[Any, Config], Any]
Say = Callable[[str], None]


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _say(line: str) -> None:
    print(line, flush=True)


@dataclass
class Tick:
    """What one tick ran, and where the next one starts."""

    cursor: datetime  # the start of the earliest window not done
    next_due: datetime  # when the next window not final yet becomes final
    done: list[tuple[str, datetime]] = field(default_factory=list)
    failed: list[tuple[str, datetime, str]] = field(default_factory=list)
    sla_errors: int = 0
    events_sent: int = 0  # completeness events Airflow accepted in this tick
    events_failed: int = 0  # completeness events still pending after it (sent again by the next tick)


@dataclass
class FollowResult:
    ticks: int = 0
    done: list[tuple[str, datetime]] = field(default_factory=list)
    failed: list[tuple[str, datetime, str]] = field(default_factory=list)  # of the last tick
    sla_errors: int = 0
    events_sent: int = 0
    events_failed: int = 0  # of the last tick


class FollowState:
    """The cursor, in a JSON file written atomically (write a sibling, then rename)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.cursor: datetime | None = None
        if path.exists():
            try:
                self.cursor = datetime.fromisoformat(json.loads(path.read_text(encoding="utf-8"))["cursor"])
            except (ValueError, KeyError, TypeError):
                raise InputError(f"{path}: follow state is not valid; delete it (follow then starts at the first "
                                 "window not final yet) or pass --since") from None

    def save(self, cursor: datetime) -> None:
        self.cursor = cursor
        write_json(self.path, {"cursor": cursor.isoformat()})


# Config fields read once, when follow starts: where its state and lake are, and its Spark session.
RESTART_FIELDS = ("home", "lake", "spark")


class ConfigWatch:
    """The config file read again before each tick; a change is said once, when it is first read."""

    def __init__(self, cfg: Config, load: Callable[[], Config], topics: Sequence[str] | None) -> None:
        self.load, self.topics = load, topics
        self.last = cfg  # the config as last read from the file (restart fields included)
        self.failing = ""  # the error last said, so a file that stays broken is said once

    def current(self, cfg: Config, say: Say, warn: Say) -> Config:
        """The config to run the next tick with: the file's when it loads (its restart fields as
        `cfg`'s), else `cfg`."""
        try:
            new = self.load()
            _span(new, self.topics)  # the selected topics are still configured, and there is one
        except MsgauditError as e:
            if str(e) != self.failing:
                warn(f"follow: {e} (the config last read stays in use; fix the file)")
            self.failing = str(e)
            return cfg
        self.failing = ""
        if new == self.last:
            return cfg
        kept = [f for f in RESTART_FIELDS if getattr(new, f) != getattr(self.last, f)]
        added = sorted(set(new.topics) - set(self.last.topics))
        removed = sorted(set(self.last.topics) - set(new.topics))
        changed = sorted(t for t in set(new.topics) & set(self.last.topics) if new.topics[t] != self.last.topics[t])
        self.last = new
        what = [f"{label} {', '.join(names)}" for label, names in
                (("topics added:", added), ("removed:", removed), ("changed:", changed)) if names]
        say(f"follow: {new.source} read again ({'; '.join(what) or 'settings changed'})")
        if kept:
            warn(f"follow: {', '.join(kept)} changed in {new.source}; that applies when follow is restarted")
        return replace(new, **{f: getattr(cfg, f) for f in RESTART_FIELDS})


def config_watch(cfg: Config, topics: Sequence[str] | None) -> ConfigWatch | None:
    """A watch on the file `cfg` was loaded from (None for the embedded defaults)."""
    if cfg.source == "<defaults>":
        return None
    return ConfigWatch(cfg, lambda: config_mod.load(cfg.source), topics)


def ingest_step(say: Say) -> Ingest:
    """The pipeline's ingest step, its summary lines said."""
    def run(spark: Any, cfg: Config) -> Any:
        return run_step(spark, cfg, "ingest", StepRange(), say=say)

    return run


def _span(cfg: Config, topics: Sequence[str] | None) -> timedelta:
    """The largest window size plus the largest grace among the selected topics."""
    selected = [cfg.topic(t) for t in topics] if topics else list(cfg.topics.values())
    if not selected:
        raise InputError(f"{cfg.source}: no topics configured; add one under `topics:`")
    return max(t.window for t in selected) + max(t.grace for t in selected)


def first_not_final(cfg: Config, now: datetime, topics: Sequence[str] | None = None) -> datetime:
    """The start of the earliest window (of the selected topics) not final at `now`."""
    span = _span(cfg, topics)
    runs = plan_windows(cfg, now - 2 * span, now + span, topics)
    return min(r.start for r in runs if r.as_of > now)


def tick(spark: Any, cfg: Config, cursor: datetime, now: datetime, topics: Sequence[str] | None = None, *,
         steps: Sequence[tuple[str, Step]] = DEFAULT_STEPS, ingest: Ingest | None = None,
         say: Say = _say, warn: Say = _stderr, alert_log: Path | None = None, outbox: Outbox | None = None) -> Tick:
    """Runs every window since `cursor` that is final at `now` and not done yet (ingest first, once,
    when there is one), oldest first, the topics sharing a window together; returns the new cursor
    and when the next window becomes final. A failure of ingest is raised before any window runs.
    `outbox`: each window done adds its completeness events; the pending ones are posted at the end."""
    runs = plan_windows(cfg, cursor, now + _span(cfg, topics), topics)
    state = BackfillState(cfg.home / BACKFILL_STATE)
    final = [r for r in runs if r.as_of <= now and any(state_key(t, r.start, r.as_of) not in state for t in r.topics)]
    out = Tick(cursor, min(r.as_of for r in runs if r.as_of > now))
    spent: dict[str, float] = {}  # seconds per step, said with the window (ingest's with the tick's first)
    if final:
        t0 = time.perf_counter()
        (ingest or ingest_step(say))(spark, cfg)
        spent["ingest"] = time.perf_counter() - t0
    timed = [(name, _timed(name, step, spent)) for name, step in steps]
    for run in final:
        t0 = time.perf_counter()
        res = backfill_range(spark, cfg, run.start, run.end, None, run.topics, steps=timed, progress=False, now=now)
        out.done += res.done
        out.failed += res.failed
        errors = sum(int(res.described[d].get("sla", {}).get("failed_errors", 0)) for d in res.done)
        if res.done:
            say(_window_line(run, res.done, res.described, errors,
                             time.perf_counter() - t0 + spent.get("ingest", 0.0), spent))
        spent.clear()
        for t, ws, why in res.failed:
            warn(f"follow: {t} {ws.isoformat()}: {why} (not done; tried again from {(now + RETRY).isoformat()})")
        out.sla_errors += errors
        if errors:
            _breach(cfg, run, [t for t, _ in res.done], errors, warn, alert_log)
        if outbox is not None and res.done:
            from audit.serving.completeness import window_events

            outbox.add(window_events(cfg, [t for t, _ in res.done], run.start, run.end, run.as_of))
    if outbox is not None:
        flushed = outbox.flush(cfg.airflow, warn)
        out.events_sent, out.events_failed = flushed.sent, flushed.failed
    undone = [r.start for r in runs if r.as_of > now] + [ws for _, ws, _ in out.failed]
    out.cursor = min(undone)
    return out


def _timed(name: str, step: Step, spent: dict[str, float]) -> Step:
    """`step`, its seconds added to `spent[name]`."""
    def run(*args: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return step(*args)
        finally:
            spent[name] = spent.get(name, 0.0) + time.perf_counter() - t0

    run.per_window = getattr(step, "per_window", False)  # type: ignore[attr-defined]
    return run


def _window_line(run: WindowRun, done: Sequence[tuple[str, datetime]], described: dict[tuple[str, datetime], Any],
                 errors: int, seconds: float, spent: dict[str, float]) -> str:
    names = [t for t, _ in done]
    who = ", ".join(names) if len(names) <= 3 else f"{names[0]} and {len(names) - 1} more topics"
    anomalies = sum(int(described[d].get("reconcile", {}).get("anomalies", 0)) for d in done)
    return (f"follow: window {run.start.isoformat()}..{run.end.isoformat()} (as of {run.as_of.isoformat()}) {who}: "
            f"done in {seconds:.1f} s ({', '.join(f'{k} {v:.1f} s' for k, v in spent.items())}), {anomalies} anomalies, "
            f"{errors} error-severity SLA failures")


def _breach(cfg: Config, run: WindowRun, topics: Sequence[str], errors: int, warn: Say,
            alert_log: Path | None) -> None:
    """An error-severity SLA failure: one line, and the DAGs' alert as a JSON line in `alert_log`."""
    line = (f"follow: sla: {errors} error-severity SLA check(s) failed for window {run.start.isoformat()} of "
            f"{', '.join(topics)} (see `msgaudit dashboard`)")
    warn(line)
    if alert_log is None:
        return
    from audit.serving.alerts import Alert, failed_rules, producer_failure_lines

    rules = failed_rules(cfg.report_store, run.start, run.end, topics)
    alert = Alert(dag_id="msgaudit-follow", run_id=f"follow {run.as_of.isoformat()}", task_id="sla", map_index=-1,
                  step="sla", window_start=run.start.isoformat(), window_end=run.end.isoformat(),
                  topics=tuple(topics), exit_code=int(SlaFailed.exit_code), sla_breach=True, error=line,
                  failed_rules=rules, producer_lines=producer_failure_lines(cfg.report_store, rules))
    alert_log.parent.mkdir(parents=True, exist_ok=True)
    with alert_log.open("a", encoding="utf-8") as f:
        f.write(alert.to_json() + "\n")


@contextmanager
def metrics_served(cfg: Config, say: Say) -> Iterator[None]:
    """`/metrics` on `metrics.port` while follow runs (docs/design.md §4.6), when it is set."""
    from audit.serving.metrics import serve

    server = serve(cfg)
    if server is not None:
        say(f"follow: metrics at http://{cfg.metrics.address}:{server.port}/metrics")
    try:
        yield
    finally:
        if server is not None:
            server.close()


def follow(spark: Any, cfg: Config, *, since: datetime | None = None, topics: Sequence[str] | None = None,
           once: bool = False, steps: Sequence[tuple[str, Step]] = DEFAULT_STEPS, ingest: Ingest | None = None,
           clock: Callable[[], datetime] = lambda: datetime.now(UTC), sleep: Callable[[float], None] = time.sleep,
           say: Say = _say, warn: Say = _stderr, alert_log: Path | None = None,
           max_ticks: int | None = None, watch: ConfigWatch | None = None) -> FollowResult:
    """Ticks until interrupted (or once, or `max_ticks` times), sleeping until the next window is
    final in between; see the module's docstring. `once`: a failing ingest or an unexpected error is
    raised at once. `watch`: the config file, read again before each tick but the first."""
    names = list(topics) if topics else None
    _span(cfg, names)  # no topics: one clear line before anything runs
    if since is not None and since > clock():
        raise InputError(f"--since {since.isoformat()} is in the future; follow starts at a past or present "
                         "instant (leave it out to start at the first window not final yet)")
    state = FollowState(cfg.home / STATE_FILE)
    outbox_path = cfg.home / OUTBOX_FILE
    outbox = Outbox(outbox_path) if cfg.airflow.url or outbox_path.exists() else None
    cursor = since or state.cursor or first_not_final(cfg, clock(), names)
    say(f"follow: windows from {cursor.isoformat()} of "
        f"{', '.join(names) if names else 'every configured topic'}, each when final (its end + grace)")
    result = FollowResult()
    failures = 0
    with metrics_served(cfg, say):
        while True:
            if watch is not None and result.ticks:
                cfg = watch.current(cfg, say, warn)
            now = clock()
            try:
                if outbox is None and cfg.airflow.url:  # set in the file since follow started
                    outbox = Outbox(outbox_path)
                t = tick(spark, cfg, cursor, now, names, steps=steps, ingest=ingest, say=say, warn=warn,
                         alert_log=alert_log, outbox=outbox)
            except MsgauditError as e:  # ingest's bad input, a busy lake: nothing of the tick ran
                if once:
                    raise
                warn(f"follow: {e} (no window run; tried again from {(now + RETRY).isoformat()})")
                wake = now + RETRY
            except Exception as e:
                failures += 1
                if once or failures >= MAX_FAILED_TICKS:
                    raise
                warn(f"follow: unexpected {type(e).__name__}: {e} ({failures} in a row; tried again from "
                     f"{(now + RETRY).isoformat()}, the {MAX_FAILED_TICKS}th stops follow)")
                wake = now + RETRY
            else:
                failures = 0
                cursor = t.cursor
                state.save(cursor)
                BackfillState(cfg.home / BACKFILL_STATE).forget_before(cursor)
                result.done += t.done
                result.failed = t.failed
                result.sla_errors += t.sla_errors
                result.events_sent += t.events_sent
                result.events_failed = t.events_failed
                wake = min(t.next_due, now + RETRY) if t.failed or t.events_failed else t.next_due
                if t.done and not once:
                    say(f"follow: next window final at {t.next_due.isoformat()}")
            result.ticks += 1
            if once or (max_ticks is not None and result.ticks >= max_ticks):
                return result
            sleep(max((wake - clock()).total_seconds(), 1.0))


def run_follow(spark: Any, cfg: Config, *, since: datetime | None = None, topics: Sequence[str] | None = None,
               once: bool = False, alert_log: Path | None = None) -> FollowResult:
    """`follow` as the CLI and spark-submit run it; with `once`, its outcome as `backfill` reports
    it: a window that failed raises `InputError` (exit 2), an error-severity SLA failure `SlaFailed`
    (exit 3)."""
    result = follow(spark, cfg, since=since, topics=topics, once=once, alert_log=alert_log,
                    watch=config_watch(cfg, topics))
    if result.failed:
        t, ws, why = result.failed[0]
        raise InputError(f"{len(result.failed)} window(s) failed, first {t} {ws.isoformat()}: {why} "
                         "(fix it and run follow again: it starts at that window)")
    if result.sla_errors:
        raise SlaFailed(f"{result.sla_errors} error-severity SLA rule(s) failed (see `msgaudit dashboard`)")
    return result
