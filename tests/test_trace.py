"""`msgaudit trace` (docs/design.md §9): one message's journey, from a hand-written lake reconciled
by the real job; golden timelines for a few anomaly codes, and the JSON form through the CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from audit.core.config import Config
from audit.core.errors import InputError
from audit.core.vocabulary import explanation
from audit.serving.trace_view import format_timeline
from tests.reconcile_cases import AS_OF_FINAL, GROUP, T0, TOPIC, build_cases, write_delta_sink, write_lake

TOPICS = {TOPIC: {"window": "1h", "grace": "15m", "groups": [GROUP],
                  "sinks": [{"name": "s1", "format": "delta", "location": "sinks/s1", "group": GROUP}]}}


@pytest.fixture(scope="module")
def traced_lake(spark: Any, tmp_path_factory: pytest.TempPathFactory) -> Config:
    """The hand-written lake of tests/reconcile_cases.py, reconciled once for this module's tests."""
    from audit.core import config as config_mod
    from spark_jobs.reconcile import reconcile_window

    root = tmp_path_factory.mktemp("traced")
    cfg = config_mod.from_dict({"home": str(root / ".msgaudit"), "lake": str(root / "lake"),
                                "ledger_dir": str(root / "ledger"), "report_store": f"sqlite:///{root / 'report.db'}",
                                "topics": TOPICS}, source="<test>", base=root)
    h, _ = build_cases()
    write_lake(spark, cfg.lake, h.inputs())
    # Kafka keys (the hand-written history has none): "k-7" on both copies of dup:0, on miss:1 and on
    # the record without audit id at 8@0; "k-8" on ghost:0
    from delta.tables import DeltaTable
    from pyspark.sql import functions as F

    log = DeltaTable.forPath(spark, f"{cfg.lake}/log_records")
    for key, where in (("k-7", "(partition = 4 AND pid = 'dup') OR (partition = 11 AND offset = 1) OR partition = 8"),
                       ("k-8", "partition = 3")):
        log.update(F.expr(where), {"key": F.lit(key)})
    write_delta_sink(spark, root / "sinks" / "s1", h.sinks["s1"])
    # The settings two producer sessions recorded at start: reconcile copies them to the report store
    # for the log anomalies they explain (reo's reordering, lost's loss)
    from pyspark.sql.types import StringType, StructField, StructType

    from spark_jobs.io.schemas import PRODUCER_SETTINGS

    (spark.createDataFrame([(*row, "2026-11-21T09") for row in SETTINGS], StructType(
        [*PRODUCER_SETTINGS.fields, StructField("part_hour", StringType())]))
     .write.format("delta").partitionBy("part_hour").save(f"{cfg.lake}/producer_settings"))
    reconcile_window(spark, cfg, TOPIC, T0, AS_OF_FINAL)
    return cfg


SETTINGS = [("orders-svc", "reo", datetime(2026, 11, 21, 9, tzinfo=UTC), "all", False, 5, 5, None, "python"),
            ("orders-svc", "lost", datetime(2026, 11, 21, 9, tzinfo=UTC), "1", True, 3, 1, None, "librdkafka")]


def _why(kind: str, code: str) -> list[str]:
    e = explanation(kind, code)
    return [f"      cause: {e.cause}", f"      fix: {e.remedy}"]


DUP_TIMELINE = [
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
MISS_TIMELINE = [
    "trace t message miss:1, log position(s) 11@1",
    "  2026-11-21T10:06:00.000Z  produce  miss:1 -> partition 11: acked at offset 1 (ack +5 ms)",
    "  2026-11-21T10:06:00.002Z  log      11@1 miss:1 committed",
    "",
    "anomalies: 1",
    "  [2026-11-21T10:00Z] group:g1 missed at 11@1: never processed, below committed offset 2",
    *_why("group", "missed"),
]
UNAUDITED_TIMELINE = [  # a record with a malformed audit.seq: traced by its position
    "trace t message (no audit id), log position(s) 8@0",
    "  2026-11-21T10:05:00.002Z  log      8@0 (no audit id) committed, header error: audit.seq: not an integer",
    "  2026-11-21T10:05:06.000Z  group    g1: processed 8@0 attempt 1 by c1 (consume_seq 15)",
    "  2026-11-21T10:05:12.000Z  sink     s1: row 8@0 (no audit id)",
    "",
    "anomalies: 1",
    "  [2026-11-21T10:00Z] log unaudited at 8@0: audit.seq: not an integer",
    *_why("log", "unaudited"),
]
REDEL_TIMELINE = [
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


@pytest.mark.unit
def test_a_message_is_named_one_way() -> None:
    from spark_jobs.trace import TraceQuery

    for bad in ({}, {"pid": "p"}, {"pid": "p", "seq": 1, "partition": 0, "offset": 1}, {"offset": 3}):
        with pytest.raises(InputError, match="name one message"):
            TraceQuery(TOPIC, **bad)
    with_key: tuple[dict[str, Any], ...] = (
        {"key": "k", "pid": "p", "seq": 1}, {"key": "k", "partition": 0, "offset": 1}, {"key": "k", "seq": 1})
    for bad_key in with_key:
        with pytest.raises(InputError, match="name one message"):
            TraceQuery(TOPIC, **bad_key)


@pytest.mark.spark
def test_trace_shows_the_journey_and_the_anomalies_with_their_explanation(
        spark: Any, traced_lake: Config, capsys: pytest.CaptureFixture[str]) -> None:
    from audit import cli
    from spark_jobs.trace import TraceQuery, trace_message

    cfg = traced_lake
    dup = format_timeline(trace_message(spark, cfg, TraceQuery(TOPIC, pid="dup", seq=0)))
    assert dup.splitlines() == DUP_TIMELINE
    # by position: the offset the group committed past without processing it
    miss = format_timeline(trace_message(spark, cfg, TraceQuery(TOPIC, partition=11, offset=1)))
    assert miss.splitlines() == MISS_TIMELINE
    redel = format_timeline(trace_message(spark, cfg, TraceQuery(TOPIC, pid="redel", seq=0)))
    assert redel.splitlines() == REDEL_TIMELINE
    # a topic the config no longer names (a dashboard over an older report store): the same trace
    # from the lake, without sinks
    known = trace_message(spark, cfg, TraceQuery(TOPIC, pid="dup", seq=0))
    assert known["sinks"] == {"s1": [known["sinks"]["s1"][0]]}
    assert trace_message(spark, cfg.with_topics({}), TraceQuery(TOPIC, pid="dup", seq=0)) == {**known, "sinks": {}}

    args = cli.build_parser().parse_args(["trace", "--topic", TOPIC, "--pid", "nobody", "--seq", "0", "--json"])
    capsys.readouterr()
    assert cli.COMMANDS["trace"](args, cfg) == 0
    got = json.loads(capsys.readouterr().out)
    assert got == {"topic": TOPIC, "ids": [["nobody", 0]], "positions": [], "missing": [], "ledger": [],
                   "log": [], "consumed": [], "anomalies": [], "sinks": {"s1": []}, "settings": []}


TIMELINE_JS = """((rid) => { const s = document.getElementById(rid);
  return s === null ? null : [location.hash, s.matches(':target'), s.querySelector('pre.timeline').textContent]; })"""


@pytest.mark.e2e
@pytest.mark.spark
def test_dashboard_anomaly_rows_link_to_their_timeline(traced_lake: Config, tmp_path: Path) -> None:
    """`msgaudit dashboard` run as a user runs it, on a config whose lake has tables: its terminal
    shows only its own result (Spark's and the JVM's output went to the log file), and in headless
    Chromium a row's timeline link opens the (topic, window) page at that message's timeline."""
    from audit.runtime.quiet import log_path
    from audit.serving.dashboard.timeline import timeline_file
    from tests.support.browser import Browser

    cfg = traced_lake
    config = tmp_path / "msgaudit.yaml"
    topics = json.loads(json.dumps(TOPICS))  # the sink where the fixture wrote it (its location is relative)
    topics[TOPIC]["sinks"][0]["location"] = cfg.topic(TOPIC).sinks[0].location
    config.write_text(json.dumps({"home": str(cfg.home), "lake": str(cfg.lake), "ledger_dir": str(cfg.ledger_dir),
                                  "report_store": cfg.report_store, "topics": topics}))
    out = tmp_path / "dash"
    run = subprocess.run([sys.executable, "-m", "audit.cli", "dashboard", "--config", str(config), "--out", str(out)],
                         capture_output=True, text=True, timeout=900, cwd=tmp_path)
    log = log_path(cfg.home)
    assert (run.returncode, run.stdout) == (0, f"dashboard written to {out / 'index.html'}\n"), run.stderr
    # Nothing from Spark or the JVM on the terminal: at most the one line saying where it went.
    assert run.stderr in ("", f"msgaudit dashboard: Spark/JVM warnings were logged to {log} (--verbose shows them)\n")
    logged = log.read_text()
    # The log is shared by every process using this home (the test process's own Spark session wrote
    # to it first); each process opens its part with a header naming its command line.
    headers = [line for line in logged.splitlines() if line.startswith("--- ")]
    assert [h for h in headers if "dashboard --config" in h], headers
    print(f"\n{log}:\n{logged[:3000]}")
    assert sorted(p.name for p in (out / "timelines").iterdir()) == [timeline_file(TOPIC, T0)]
    page = out / "topics" / f"{TOPIC}.html"
    with Browser(tmp_path / "profile") as b:
        for pid, golden in (("dup", DUP_TIMELINE), ("redel", REDEL_TIMELINE)):
            b.open(page.resolve().as_uri())
            row = f'#anomalies tr[data-pid="{pid}"][data-seq="0"]'
            rid = b.evaluate(f"document.querySelector('{row}').id")
            url = b.click(f"{row} a.timeline")
            assert url == (out / "timelines" / timeline_file(TOPIC, T0)).resolve().as_uri() + f"#{rid}"
            assert b.evaluate(f"{TIMELINE_JS}({rid!r})") == [f"#{rid}", True, "\n".join(golden)]
            assert b.evaluate("document.querySelectorAll('script').length") == 2  # the CSP frame, no more
            assert {u.rsplit("/", 1)[-1] for u in b.requests if not u.startswith(("data:", "blob:"))} == {
                "plotly.min.js", f"{timeline_file(TOPIC, T0)}"}
        # on the topic page, under the codes table: the producer sessions whose recorded settings
        # caused log anomalies
        b.open(page.resolve().as_uri())
        assert b.evaluate("[...document.querySelectorAll('#producer-settings li')].map(e => e.textContent)") == [
            "lost_acked (1 row): producer orders-svc (session lost) ran with acks=1: set acks=all "
            "(and min.insync.replicas >= 2)",
            "reordered_in_log (1 row): producer orders-svc (session reo) ran with enable.idempotence=false "
            "(retries=5, max.in.flight=5): set enable.idempotence=true"]


@pytest.mark.unit
def test_the_explanation_uses_the_producer_settings_when_the_lake_has_them() -> None:
    """A producer session's recorded settings appear in the timeline and turn the generic remedy of
    a log anomaly into the one for this producer."""
    from datetime import datetime

    t = datetime(2026, 11, 21, 10, 5)
    settings = {"producer": "orders", "pid": "p1", "start_ts": datetime(2026, 11, 21, 10), "acks": "1",
                "enable_idempotence": False, "retries": 5, "max_in_flight": 5, "transactional_id": None,
                "mode": "python"}
    anomaly = {"window_start": datetime(2026, 11, 21, 10), "stage": "log", "partition": 0, "offset": 8,
               "pid": "p1", "seq": 3, "detail": "extra copy of offset 0:7", "anomaly": "duplicate_in_log"}
    trace = {"topic": "t", "ids": [("p1", 3)], "positions": [(0, 7), (0, 8)], "missing": [], "ledger": [],
             "log": [{"partition": 0, "offset": o, "pid": "p1", "seq": 3, "committed": True, "kafka_ts": t,
                      "header_error": None} for o in (7, 8)], "consumed": [], "sinks": {},
             "anomalies": [anomaly, {**anomaly, "anomaly": "lost_acked", "offset": 7, "detail": "gone"}],
             "settings": [settings]}
    assert format_timeline(trace).splitlines() == [
        "trace t message p1:3, log position(s) 0@7, 0@8",
        "  2026-11-21T10:00:00.000Z  producer orders session p1 started (python): acks=1, enable.idempotence=false, "
        "retries=5, max.in.flight=5",
        "  2026-11-21T10:05:00.000Z  log      0@7 p1:3 committed",
        "  2026-11-21T10:05:00.000Z  log      0@8 p1:3 committed",
        "",
        "anomalies: 2",
        "  [2026-11-21T10:00Z] log duplicate_in_log at 0@8: extra copy of offset 0:7",
        *_why("log", "duplicate_in_log"),
        "      this producer ran with enable.idempotence=false (retries=5, max.in.flight=5): set "
        "enable.idempotence=true",
        "  [2026-11-21T10:00Z] log lost_acked at 0@7: gone",
        *_why("log", "lost_acked"),
        "      this producer ran with acks=1: set acks=all (and min.insync.replicas >= 2)",
    ]


@pytest.mark.spark
def test_trace_by_key_shows_every_message_with_that_key_in_produce_order(
        spark: Any, traced_lake: Config, capsys: pytest.CaptureFixture[str]) -> None:
    from audit import cli

    def run(*extra: str) -> str:
        args = cli.build_parser().parse_args(["trace", "--topic", TOPIC, *extra])
        capsys.readouterr()
        assert cli.COMMANDS["trace"](args, traced_lake) == 0
        return capsys.readouterr().out

    # three messages: dup:0 (two copies in the log, one message), the record without audit id at
    # 8@0 (by its position) and miss:1, in produce order
    assert run("--key", "k-7").splitlines() == [
        "key 'k-7' on topic t: 3 messages in produce order: dup:0, 8@0, miss:1",
        "", *DUP_TIMELINE, "", *UNAUDITED_TIMELINE, "", *MISS_TIMELINE]
    assert run("--key", "k-7", "--limit", "1").splitlines() == [
        "key 'k-7' on topic t: 3 messages in produce order: dup:0, 8@0, miss:1",
        "", *DUP_TIMELINE,
        "", "2 more message(s) not shown (--limit 1): 8@0, miss:1"]
    got = json.loads(run("--key", "k-8", "--json"))
    assert (got["topic"], got["key"], got["messages"], len(got["traces"])) == (TOPIC, "k-8", ["ghost:0"], 1)
    ghost = got["traces"][0]
    assert (ghost["ids"], ghost["positions"], [r["key"] for r in ghost["log"]]) == ([["ghost", 0]], [[3, 0]], ["k-8"])
    assert [(a["anomaly"], a["cause"]) for a in ghost["anomalies"]] == [
        ("ghost_write", explanation("log", "ghost_write").cause)]
    assert run("--key", "nobody's").splitlines() == [
        "key \"nobody's\" on topic t: no captured log record carries this key (keys are read from the captured "
        "log: a message the log never held, or in windows not captured yet, is not found)"]
    assert json.loads(run("--key", "k-9", "--json")) == {"topic": TOPIC, "key": "k-9", "messages": [], "traces": []}


@pytest.mark.spark
def test_reconcile_publishes_the_settings_behind_its_log_anomalies_and_explains_its_report(traced_lake: Config) -> None:
    """Reconcile copied to the report store the settings of the sessions its settings-decided log
    anomalies name (reo, lost; not dup, which recorded none), and `msgaudit reconcile` ends with the
    cause and fix of each code its report counts, then the setting of each such producer."""
    from audit.core.explain import report_lines
    from audit.serving.report_store import PARTITION_REPORT, ReportStore
    from spark_jobs.pipeline.steps import explain_report

    with ReportStore(traced_lake.report_store) as store:
        stored = store.settings_of(["reo", "lost", "dup"])
        report = store.read(PARTITION_REPORT)
    assert [(r["pid"], r["producer"], r["acks"], r["enable_idempotence"], r["retries"], r["max_in_flight"], r["mode"])
            for r in stored] == [("lost", "orders-svc", "1", True, 3, 1, "librdkafka"),
                                 ("reo", "orders-svc", "all", False, 5, 5, "python")]
    lines = explain_report(traced_lake, report, T0, T0.replace(hour=11), None)
    # two reordered_in_log rows: reo's, and reob's across the window's end (no settings recorded)
    for kind, code, n in (("log", "lost_acked", 1), ("log", "reordered_in_log", 2), ("group", "missed", 1)):
        e = explanation(kind, code)
        assert lines[lines.index(f"  {kind} {code} ({n}): {e.cause}") + 1] == f"      fix: {e.remedy}"
    assert lines == ["", "Likely causes (docs/design.md §5):", *report_lines(report), "",
                     "Producer settings behind them (producer_settings):",
                     "  lost_acked (1 row): producer orders-svc (session lost) ran with acks=1: set acks=all "
                     "(and min.insync.replicas >= 2)",
                     "  reordered_in_log (1 row): producer orders-svc (session reo) ran with enable.idempotence=false "
                     "(retries=5, max.in.flight=5): set enable.idempotence=true"]
