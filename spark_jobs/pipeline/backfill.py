"""`msgaudit backfill`: capture -> reconcile -> SLA for every (topic, window) of a past range, with a
progress bar; resumable and idempotent.

Resumable: every finished (topic, window_start, as_of) is recorded in a small JSON state file
(`<home>/backfill-state.json`, replaced atomically after each window), and a rerun skips those
unless forced. Idempotent: every step replaces its window's rows, so redoing a window (forced, or
after a crash between a step and the state write) gives the same rows.

as_of: an explicit `--as-of` is used for every window. Without one (the CLI default 'now'), each
window is judged as the schedule would have judged it, at window_end + grace (capped at now), so a
rerun of an interrupted backfill resumes instead of starting over with a new as_of.

This module orchestrates; it classifies nothing itself and writes only the state file.
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
from audit.core.windows import parse_instant, windows

STATE_FILE = "backfill-state.json"
Step = Callable[[Any, Config, str, datetime, datetime, datetime], Any]


@dataclass
class BackfillResult:
    done: list[tuple[str, datetime]] = field(default_factory=list)
    skipped: list[tuple[str, datetime]] = field(default_factory=list)
    failed: list[tuple[str, datetime, str]] = field(default_factory=list)
    sla_errors: int = 0


def state_key(topic: str, window_start: datetime, as_of: datetime) -> str:
    return f"{topic}|{window_start.isoformat()}|{as_of.isoformat()}"


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
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"done": self.done}, indent=1, sort_keys=True), encoding="utf-8")
        os.replace(tmp, self.path)


def window_as_of(explicit: datetime | None, window_end: datetime, grace: Any, now: datetime) -> datetime:
    return explicit if explicit is not None else min(now, window_end + grace)


def capture_step(spark: Any, cfg: Config, topic: str, ws: datetime, we: datetime, as_of: datetime) -> Any:
    from spark_jobs.capture import capture

    return capture(spark, cfg, ws, we, topics=[topic])


def reconcile_step(spark: Any, cfg: Config, topic: str, ws: datetime, we: datetime, as_of: datetime) -> Any:
    from spark_jobs.reconcile import reconcile_window

    result = reconcile_window(spark, cfg, topic, ws, as_of)
    result.release()
    return result


def sla_step(spark: Any, cfg: Config, topic: str, ws: datetime, we: datetime, as_of: datetime) -> Any:
    from spark_jobs.sla import check_sla

    return check_sla(spark, cfg, ws, we, topics=[topic], checked_at=as_of)


DEFAULT_STEPS: tuple[tuple[str, Step], ...] = (("capture", capture_step), ("reconcile", reconcile_step),
                                               ("sla", sla_step))


def backfill_range(spark: Any, cfg: Config, start: datetime, end: datetime, as_of: datetime | None = None,
                   topics: Sequence[str] | None = None, *, force: bool = False,
                   steps: Sequence[tuple[str, Step]] = DEFAULT_STEPS, progress: bool = True,
                   now: datetime | None = None) -> BackfillResult:
    """Run `steps` for every (topic, window) overlapping [start, end); skip windows already done."""
    names = list(topics) if topics else sorted(cfg.topics)
    if not names:
        raise InputError(f"{cfg.source}: no topics configured; add one under `topics:`")
    now = now or datetime.now(UTC)
    jobs = []
    for t in names:
        tc = cfg.topic(t)
        for ws, we in windows(start, end, tc.window):
            jobs.append((t, ws, we, window_as_of(as_of, we, tc.grace, now)))
    state = BackfillState(cfg.home / STATE_FILE)
    result = BackfillResult()
    from tqdm import tqdm

    bar = tqdm(jobs, desc="backfill", unit="window", disable=not progress)
    for t, ws, we, w_as_of in bar:
        key = state_key(t, ws, w_as_of)
        if key in state and not force:
            result.skipped.append((t, ws))
            continue
        bar.set_postfix_str(f"{t} {ws:%Y-%m-%dT%H:%M}")
        info: dict[str, Any] = {}
        try:
            for name, step in steps:
                out = step(spark, cfg, t, ws, we, w_as_of)
                info[name] = _describe(name, out)
        except MsgauditError as e:
            # One window's bad input must not stop the others; it is reported and not marked done.
            result.failed.append((t, ws, f"{type(e).__name__}: {e}"))
            continue
        result.sla_errors += int(info.get("sla", {}).get("failed_errors", 0))
        state.mark(key, info)
        result.done.append((t, ws))
    return result


def _describe(step: str, out: Any) -> dict[str, Any]:
    if step == "reconcile" and out is not None:
        return {"anomalies": out.anomaly_count, "report_rows": len(out.report), "run_id": out.run_id}
    if step == "sla" and out is not None:
        return {"failed_errors": out.failed_errors, "failed_warnings": out.failed_warnings}
    return {}


def cli_backfill(args: argparse.Namespace, cfg: Config) -> int:
    from audit.core.errors import SlaFailed
    from spark_jobs.io.session import build_spark

    start = parse_instant(args.start, "--start")
    end = parse_instant(args.end, "--end")
    raw_as_of = getattr(args, "as_of", None) or "now"
    as_of = None if raw_as_of == "now" else parse_instant(raw_as_of, "--as-of")
    topics = args.topics or None
    for t in topics or []:
        cfg.topic(t)
    if end <= start:
        raise InputError(f"--end ({end.isoformat()}) must be after --start ({start.isoformat()})")
    spark = build_spark(cfg, app_name="msgaudit-backfill")
    result = backfill_range(spark, cfg, start, end, as_of, topics, force=bool(getattr(args, "force", False)))
    print(f"backfill: {len(result.done)} windows done, {len(result.skipped)} already done (skipped), "
          f"{len(result.failed)} failed")
    if result.failed:
        t, ws, why = result.failed[0]
        raise InputError(f"{len(result.failed)} window(s) failed, first {t} {ws.isoformat()}: {why} "
                         "(fix it and rerun: finished windows are skipped)")
    if result.sla_errors:
        raise SlaFailed(f"{result.sla_errors} error-severity SLA rule(s) failed in the range "
                        "(see `msgaudit dashboard`)")
    return 0
