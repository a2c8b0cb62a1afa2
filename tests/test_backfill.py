"""Backfill: every window of a range, resumable (finished windows skipped), idempotent (a forced
rerun gives the same rows), one bad window reported without stopping the others."""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from audit.core.config import Config
from audit.core.errors import InputError
from spark_jobs.pipeline.backfill import BackfillState, backfill_range, state_key
from tests.reconcile_cases import (
    GROUP,
    T0,
    TOPIC,
    TWO_WINDOWS_REPORT,
    at,
    norm_rows,
    write_two_windows_one_lost,
)

NOW = T0 + timedelta(days=1)


def _cfg(make_config: Callable[..., Config], tmp_path: Path) -> Config:
    return make_config(tmp_path, topics={
        TOPIC: {"window": "1h", "grace": "15m", "groups": [GROUP],
                "sla": {"max_lost": 0},
                "sinks": [{"name": "s1", "format": "delta", "location": "sinks/s1", "group": GROUP}]},
        "u": {"window": "30m", "grace": "5m"}})


class Recorder:
    """A step that records its calls (and fails for chosen windows)."""

    def __init__(self, fail: set[tuple[str, datetime]] | None = None) -> None:
        self.calls: list[tuple[str, datetime, datetime]] = []
        self.fail = fail or set()

    def __call__(self, spark: Any, cfg: Config, topic: str, ws: datetime, we: datetime, as_of: datetime) -> None:
        if (topic, ws) in self.fail:
            raise InputError(f"no data for {topic}")
        self.calls.append((topic, ws, as_of))


@pytest.mark.unit
def test_every_window_of_every_topic_once_then_skipped_on_rerun(make_config: Callable[..., Config],
                                                                tmp_path: Path) -> None:
    cfg = _cfg(make_config, tmp_path)
    step = Recorder()
    r1 = backfill_range(None, cfg, T0, T0 + timedelta(hours=2), steps=[("x", step)], progress=False, now=NOW)
    assert step.calls == [
        ("t", T0, T0 + timedelta(minutes=75)), ("t", T0 + timedelta(hours=1), T0 + timedelta(minutes=135)),
        ("u", T0, T0 + timedelta(minutes=35)), ("u", T0 + timedelta(minutes=30), T0 + timedelta(minutes=65)),
        ("u", T0 + timedelta(minutes=60), T0 + timedelta(minutes=95)),
        ("u", T0 + timedelta(minutes=90), T0 + timedelta(minutes=125)),
    ]
    assert len(r1.done) == 6 and r1.skipped == [] and r1.failed == []
    r2 = backfill_range(None, cfg, T0, T0 + timedelta(hours=2), steps=[("x", step)], progress=False, now=NOW)
    assert len(step.calls) == 6 and len(r2.skipped) == 6 and r2.done == []
    r3 = backfill_range(None, cfg, T0, T0 + timedelta(hours=2), topics=["t"], steps=[("x", step)],
                        progress=False, now=NOW, force=True)
    assert len(step.calls) == 8 and len(r3.done) == 2


@pytest.mark.unit
def test_a_failing_window_is_reported_not_marked_and_redone_on_rerun(make_config: Callable[..., Config],
                                                                     tmp_path: Path) -> None:
    cfg = _cfg(make_config, tmp_path)
    bad = Recorder(fail={("t", T0)})
    r1 = backfill_range(None, cfg, T0, T0 + timedelta(hours=2), topics=["t"], steps=[("x", bad)],
                        progress=False, now=NOW)
    assert r1.failed == [("t", T0, "InputError: no data for t")]
    assert r1.done == [("t", T0 + timedelta(hours=1))]
    good = Recorder()
    r2 = backfill_range(None, cfg, T0, T0 + timedelta(hours=2), topics=["t"], steps=[("x", good)],
                        progress=False, now=NOW)
    assert [c[:2] for c in good.calls] == [("t", T0)] and r2.skipped == [("t", T0 + timedelta(hours=1))]


@pytest.mark.unit
def test_explicit_as_of_is_part_of_the_key_and_windows_not_yet_final_are_refused(
        make_config: Callable[..., Config], tmp_path: Path) -> None:
    cfg = _cfg(make_config, tmp_path)
    step = Recorder()
    # The second window of t, [11:00, 12:00), is final at 12:15 (grace 15m); "now" 12:00 is before that.
    with pytest.raises(InputError, match=r"window \[2026-11-21T11:00:00\+00:00, 2026-11-21T12:00:00\+00:00\) of t "
                                         r"is not final until 2026-11-21T12:15:00\+00:00; backfill past windows"):
        backfill_range(None, cfg, T0, T0 + timedelta(hours=2), None, ["t"], steps=[("x", step)], progress=False,
                       now=at(120))
    assert step.calls == []
    backfill_range(None, cfg, T0, T0 + timedelta(hours=1), at(80), ["t"], steps=[("x", step)], progress=False)
    backfill_range(None, cfg, T0, T0 + timedelta(hours=1), at(90), ["t"], steps=[("x", step)], progress=False)
    assert [c[2] for c in step.calls] == [at(80), at(90)]
    state = json.loads((cfg.home / "backfill-state.json").read_text())
    assert sorted(state["done"]) == [state_key("t", T0, at(80)), state_key("t", T0, at(90))]


@pytest.mark.unit
def test_corrupt_state_file_is_one_clear_error(tmp_path: Path) -> None:
    p = tmp_path / "state.json"
    p.write_text("{not json")
    with pytest.raises(InputError, match="backfill state is not valid JSON; delete it"):
        BackfillState(p)


@pytest.mark.spark
def test_backfill_reconcile_and_sla_for_real_is_resumable_and_idempotent(
        spark: Any, make_config: Callable[..., Config], tmp_path: Path) -> None:
    from audit.serving.report_store import ANOMALIES, PARTITION_REPORT, SLA_RESULTS, ReportStore
    from spark_jobs.pipeline.backfill import reconcile_step, sla_step

    cfg = _cfg(make_config, tmp_path)
    write_two_windows_one_lost(spark, cfg.lake, tmp_path / "sinks" / "s1")
    steps = [("reconcile", reconcile_step), ("sla", sla_step)]

    r1 = backfill_range(spark, cfg, T0, T0 + timedelta(hours=2), topics=[TOPIC], steps=steps,
                        progress=False, now=NOW)
    assert r1.done == [(TOPIC, T0), (TOPIC, T0 + timedelta(hours=1))] and r1.failed == []
    assert r1.sla_errors == 1  # max_lost 0 fails for the second window only

    def snapshot() -> tuple[list[dict[str, Any]], ...]:
        with ReportStore(cfg.report_store) as store:
            return tuple(norm_rows(store.read(t, TOPIC)) for t in (PARTITION_REPORT, ANOMALIES, SLA_RESULTS))

    first = snapshot()
    assert sorted((r["window_start"], r["stage"], r["expected"], r["lost"]) for r in first[0]) == TWO_WINDOWS_REPORT
    assert [(a["anomaly"], a["seq"]) for a in first[1]] == [("lost_acked", 3)]

    r2 = backfill_range(spark, cfg, T0, T0 + timedelta(hours=2), topics=[TOPIC], steps=steps,
                        progress=False, now=NOW)
    assert r2.done == [] and len(r2.skipped) == 2
    assert r2.sla_errors == 1  # skipped, the second window still counts the SLA failure it recorded
    r3 = backfill_range(spark, cfg, T0, T0 + timedelta(hours=2), topics=[TOPIC], steps=steps,
                        progress=False, now=NOW, force=True)
    assert len(r3.done) == 2
    assert snapshot() == first
