"""`msgaudit trace` (docs/design.md §9): one message's journey, from a hand-written lake reconciled
by the real job; golden timelines for a few anomaly codes, and the JSON form through the CLI."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from audit.core.config import Config
from audit.core.errors import InputError
from audit.core.vocabulary import explanation
from audit.serving.trace_view import format_timeline
from tests.reconcile_cases import AS_OF_FINAL, GROUP, T0, TOPIC, build_cases, write_delta_sink, write_lake


@pytest.fixture
def traced_lake(spark: Any, make_config: Callable[..., Config], tmp_path: Path) -> Config:
    from spark_jobs.reconcile import reconcile_window

    cfg = make_config(tmp_path, topics={TOPIC: {
        "window": "1h", "grace": "15m", "groups": [GROUP],
        "sinks": [{"name": "s1", "format": "delta", "location": "sinks/s1", "group": GROUP}]}})
    h, _ = build_cases()
    write_lake(spark, cfg.lake, h.inputs())
    write_delta_sink(spark, tmp_path / "sinks" / "s1", h.sinks["s1"])
    reconcile_window(spark, cfg, TOPIC, T0, AS_OF_FINAL)
    return cfg


def _why(kind: str, code: str) -> list[str]:
    e = explanation(kind, code)
    return [f"      cause: {e.cause}", f"      fix: {e.remedy}"]


@pytest.mark.unit
def test_a_message_is_named_one_way() -> None:
    from spark_jobs.trace import TraceQuery

    for bad in ({}, {"pid": "p"}, {"pid": "p", "seq": 1, "partition": 0, "offset": 1}, {"offset": 3}):
        with pytest.raises(InputError, match="name one message"):
            TraceQuery(TOPIC, **bad)


@pytest.mark.spark
def test_trace_shows_the_journey_and_the_anomalies_with_their_explanation(
        spark: Any, traced_lake: Config, capsys: pytest.CaptureFixture[str]) -> None:
    from audit import cli
    from spark_jobs.trace import TraceQuery, trace_message

    cfg = traced_lake
    dup = format_timeline(trace_message(spark, cfg, TraceQuery(TOPIC, pid="dup", seq=0)))
    assert dup.splitlines() == [
        "trace t message dup:0, log position(s) 4@0, 4@1",
        "  2026-11-21T10:05:00.000Z  produce  dup:0 -> partition 4: acked at offset 0 (ack +5 ms)",
        "  2026-11-21T10:05:00.002Z  log      4@0 dup:0 committed",
        "  2026-11-21T10:05:00.002Z  log      4@1 dup:0 committed",
        "  2026-11-21T10:05:01.000Z  group    g1: processed 4@0 attempt 1 by c1 (consume_seq 7)",
        "  2026-11-21T10:05:02.000Z  sink     s1: row 4@0 dup:0",
        "  2026-11-21T10:05:06.000Z  group    g1: processed 4@1 attempt 1 by c1 (consume_seq 8)",
        "",
        "anomalies: 1",
        "  [2026-11-21T10:00Z] log duplicate_in_log at 4@1: extra copy of offset 4:0",
        *_why("log", "duplicate_in_log"),
    ]
    # by position: the offset the group committed past without processing it
    miss = format_timeline(trace_message(spark, cfg, TraceQuery(TOPIC, partition=11, offset=1)))
    assert miss.splitlines() == [
        "trace t message miss:1, log position(s) 11@1",
        "  2026-11-21T10:06:00.000Z  produce  miss:1 -> partition 11: acked at offset 1 (ack +5 ms)",
        "  2026-11-21T10:06:00.002Z  log      11@1 miss:1 committed",
        "",
        "anomalies: 1",
        "  [2026-11-21T10:00Z] group:g1 missed at 11@1: never processed, below committed offset 2",
        *_why("group", "missed"),
    ]
    redel = format_timeline(trace_message(spark, cfg, TraceQuery(TOPIC, pid="redel", seq=0)))
    assert redel.splitlines() == [
        "trace t message redel:0, log position(s) 13@0",
        "  2026-11-21T10:05:00.000Z  produce  redel:0 -> partition 13: acked at offset 0 (ack +5 ms)",
        "  2026-11-21T10:05:00.002Z  log      13@0 redel:0 committed",
        "  2026-11-21T10:05:01.000Z  group    g1: processed 13@0 attempt 1 by c1 (consume_seq 20)",
        "  2026-11-21T10:05:02.000Z  sink     s1: row 13@0 redel:0",
        "  2026-11-21T10:05:30.000Z  group    g1: processed 13@0 attempt 1 by c2 (consume_seq 21)",
        "",
        "anomalies: 1",
        "  [2026-11-21T10:00Z] group:g1 redelivered at 13@0: processing 2 of 2 by c2",
        *_why("group", "redelivered"),
    ]

    args = cli.build_parser().parse_args(["trace", "--topic", TOPIC, "--pid", "nobody", "--seq", "0", "--json"])
    capsys.readouterr()
    assert cli.COMMANDS["trace"](args, cfg) == 0
    got = json.loads(capsys.readouterr().out)
    assert got == {"topic": TOPIC, "ids": [["nobody", 0]], "positions": [], "missing": [], "ledger": [],
                   "log": [], "consumed": [], "anomalies": [], "sinks": {"s1": []}}
