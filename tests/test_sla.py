"""SLA check with Great Expectations: exact `sla_results` rows for pass and fail of every rule,
provisional rows only warning, stage applicability, idempotent window replacement, and the CLI's
table and exit codes. Report rows are hand-written into a Delta table of the test's lake."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml

from audit import cli
from audit.core import config as config_mod
from audit.core import vocabulary as v
from audit.core.config import Config
from audit.core.errors import InputError
from audit.core.vocabulary import REPORT_CODE_COLUMNS
from audit.serving.report_store import ReportStore
from spark_jobs.sla import SlaOutcome, check_sla, format_table, same_sla, with_sla_observations

W0 = datetime(2026, 11, 21, 10, tzinfo=UTC)
W1 = W0 + timedelta(hours=1)
W2 = W0 + timedelta(hours=2)
CHECKED = datetime(2026, 11, 21, 12, 30, tzinfo=UTC)

TOPICS: dict[str, Any] = {
    "orders": {"window": "1h", "grace": "15m", "groups": ["g"],
               "sinks": [{"name": "s", "format": "delta", "location": "sinks/s", "group": "g"}],
               "sla": {"max_lost": 0, "max_duplicate_ratio": 0.01,
                       "max_reordered": {"threshold": 0, "severity": "warn"},
                       "max_p99_latency_ms": 1000, "min_completeness": 0.99}},
    "payments": {"sla": {"max_lost": {"threshold": 5, "severity": "warn"}}},
    "refunds": {"sla": {"max_lost": {"threshold": 5, "severity": "warn"}}},  # payments' SLA: one validation
    "quiet": {},  # no SLA: nothing is written for it
}


def report(window_start: datetime, topic: str, partition: int, stage: str, expected: int, delivered: int,
           lost: int = 0, duplicated: int = 0, reordered: int = 0, p99: float | None = 10.0,
           status: str = "final", **codes: int) -> dict[str, Any]:
    row: dict[str, Any] = {
        "window_start": window_start, "window_end": window_start + timedelta(hours=1), "topic": topic,
        "partition": partition, "stage": stage, "expected": expected, "delivered": delivered, "lost": lost,
        "duplicated": duplicated, "reordered": reordered, "pending": 0,
        "latency_p50_ms": None if p99 is None else 1.0, "latency_p95_ms": p99, "latency_p99_ms": p99,
        "latency_max_ms": p99, "status": status, "run_id": "r1", "computed_at": W2,
    }
    row.update({c: codes.get(c) for c in REPORT_CODE_COLUMNS})
    return row


REPORT_ROWS = [
    report(W0, "orders", 0, "log", 100, 100, duplicated=1, p99=900.0),  # every rule passes; ratio on the bound
    report(W0, "orders", 1, "log", 100, 98, lost=2, duplicated=2, reordered=1, p99=1000.0),  # latency on the bound
    report(W0, "orders", 0, "group:g", 100, 98, lost=1, p99=1500.0, dead_lettered=1),  # completeness 0.99 passes
    report(W0, "orders", 0, "sink:s", 0, 0, p99=None),  # nothing expected: completeness and latency pass
    report(W0, "orders", 1, "sink:s", 0, 0, duplicated=1, reordered=4),  # copies of nothing fail; no order in a sink
    report(W1, "orders", 0, "log", 10, 7, lost=3, p99=5.0, status="provisional"),  # can only warn
    report(W2, "orders", 0, "log", 10, 0, lost=10),  # outside [W0, W2): not checked
    report(W0, "payments", 0, "log", 10, 4, lost=6),
    report(W0, "payments", 1, "log", 10, 5, lost=5),
    report(W0, "refunds", 0, "log", 10, 3, lost=7),
    report(W0, "refunds", 1, "log", 10, 10),
    report(W0, "quiet", 0, "log", 10, 0, lost=10),
]


def sla(window_start: datetime, topic: str, partition: int, stage: str, rule: str, observed: float | None,
        threshold: float, passed: bool, severity: str = "error") -> dict[str, Any]:
    return {"window_start": window_start, "topic": topic, "partition": partition, "stage": stage, "rule": rule,
            "observed": observed, "threshold": threshold, "passed": passed, "severity": severity,
            "checked_at": CHECKED}


def orders_rules(w: datetime, partition: int, stage: str, *, dup: tuple[float, bool], lost: tuple[float, bool],
                 p99: tuple[float | None, bool], reord: tuple[float, bool] | None,
                 compl: tuple[float | None, bool], provisional: bool = False) -> list[dict[str, Any]]:
    """The orders topic's rows for one report row, given (observed, passed) per rule, in rule order."""
    sev = "warn" if provisional else "error"
    rows = [sla(w, "orders", partition, stage, "max_duplicate_ratio", dup[0], 0.01, dup[1], sev),
            sla(w, "orders", partition, stage, "max_lost", lost[0], 0.0, lost[1], sev),
            sla(w, "orders", partition, stage, "max_p99_latency_ms", p99[0], 1000.0, p99[1], sev)]
    if reord is not None:  # configured as warn
        rows.append(sla(w, "orders", partition, stage, "max_reordered", reord[0], 0.0, reord[1], "warn"))
    rows.append(sla(w, "orders", partition, stage, "min_completeness", compl[0], 0.99, compl[1], sev))
    return rows


EXPECTED = [
    *orders_rules(W0, 0, "group:g", dup=(0.0, True), lost=(1.0, False), p99=(1500.0, False), reord=(0.0, True),
                  compl=(99 / 100, True)),
    *orders_rules(W0, 0, "log", dup=(1 / 100, True), lost=(0.0, True), p99=(900.0, True), reord=(0.0, True),
                  compl=(1.0, True)),
    *orders_rules(W0, 0, "sink:s", dup=(0.0, True), lost=(0.0, True), p99=(None, True), reord=None,
                  compl=(None, True)),
    *orders_rules(W0, 1, "log", dup=(2 / 100, False), lost=(2.0, False), p99=(1000.0, True), reord=(1.0, False),
                  compl=(98 / 100, False)),
    *orders_rules(W0, 1, "sink:s", dup=(1.0, False), lost=(0.0, True), p99=(10.0, True), reord=None,
                  compl=(None, True)),
    sla(W0, "payments", 0, "log", "max_lost", 6.0, 5.0, False, "warn"),
    sla(W0, "payments", 1, "log", "max_lost", 5.0, 5.0, True, "warn"),
    sla(W0, "refunds", 0, "log", "max_lost", 7.0, 5.0, False, "warn"),
    sla(W0, "refunds", 1, "log", "max_lost", 0.0, 5.0, True, "warn"),
    *orders_rules(W1, 0, "log", dup=(0.0, True), lost=(3.0, False), p99=(5.0, True), reord=(0.0, True),
                  compl=(7 / 10, False), provisional=True),
]


def write_report(spark: Any, cfg: Config, rows: list[dict[str, Any]]) -> None:
    from spark_jobs.io.lake import write_table
    from spark_jobs.io.schemas import AUDIT_PARTITION_REPORT

    write_table(spark.createDataFrame(rows, schema=AUDIT_PARTITION_REPORT), cfg, "audit_partition_report",
                mode="overwrite")


def make_cfg(root: Path, topics: dict[str, Any]) -> Config:
    return config_mod.from_dict({"home": str(root / ".msgaudit"), "lake": str(root / "lake"),
                                 "report_store": f"sqlite:///{root / 'report.db'}", "topics": topics},
                                source="<test>", base=root)


@dataclass
class Checked:
    cfg: Config
    outcome: SlaOutcome
    stored: list[dict[str, Any]]


def _anomaly(partition: int, code: str, pid: str, seq: int) -> dict[str, Any]:
    return {"window_start": W0, "topic": "orders", "partition": partition, "stage": "log", "anomaly": code,
            "pid": pid, "seq": seq, "offset": seq, "detail": "", "run_id": "r1", "computed_at": W2}


# The published anomaly rows of orders' log at W0 and the settings of their producer sessions (as
# reconcile publishes them): p-3 ran without idempotence, p-4 with acks=1, p-5 recorded no settings;
# partition 0's duplicate passes its rule, so p-9 is not named.
ANOMALY_ROWS = [_anomaly(1, "duplicate_in_log", "p-3", 1), _anomaly(1, "duplicate_in_log", "p-3", 2),
                _anomaly(1, "reordered_in_log", "p-3", 3), _anomaly(1, "lost_acked", "p-4", 0),
                _anomaly(1, "lost_acked", "p-5", 0), _anomaly(0, "duplicate_in_log", "p-9", 0)]
SETTINGS_ROWS = [{"pid": pid, "producer": producer, "start_ts": W0, "acks": acks, "enable_idempotence": idem,
                  "retries": 5, "max_in_flight": 5, "transactional_id": None, "mode": "librdkafka"}
                 for pid, producer, acks, idem in (("p-3", "orders-svc", "all", False), ("p-4", None, "1", True),
                                                   ("p-9", None, "all", False))]
PRODUCER_LINES = [
    "duplicate_in_log (2 rows): producer orders-svc (session p-3) ran with enable.idempotence=false (retries=5, "
    "max.in.flight=5): set enable.idempotence=true",
    "lost_acked (1 row): producer session p-4 ran with acks=1: set acks=all (and min.insync.replicas >= 2)",
    "reordered_in_log (1 row): producer orders-svc (session p-3) ran with enable.idempotence=false (retries=5, "
    "max.in.flight=5): set enable.idempotence=true",
]

STALE_IN_RANGE = sla(W0, "orders", 9, "log", "max_lost", 9.0, 0.0, False)
KEPT_OUT_OF_RANGE = sla(W2, "orders", 0, "log", "max_lost", 10.0, 0.0, False)


@pytest.fixture(scope="module")
def checked(spark: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Checked]:
    """One check over [W0, W2) of a report covering every rule's pass and fail (one GE run per SLA:
    payments and refunds share theirs)."""
    root = tmp_path_factory.mktemp("sla")
    cfg = make_cfg(root, TOPICS)
    write_report(spark, cfg, REPORT_ROWS)
    store = ReportStore(cfg.report_store)
    store.replace_window("sla_results", "orders", W0, [STALE_IN_RANGE])  # from an older run: must go
    store.replace_window("sla_results", "orders", W2, [KEPT_OUT_OF_RANGE])  # another range: must stay
    store.replace_window("audit_anomalies", "orders", W0, ANOMALY_ROWS)
    store.record_settings(SETTINGS_ROWS)
    outcome = check_sla(spark, cfg, W0, W2, checked_at=CHECKED, data_docs_dir=root / "docs")
    yield Checked(cfg, outcome, store.read("sla_results"))
    store.close()


@pytest.mark.spark
def test_rows_per_rule_pass_and_fail(checked: Checked) -> None:
    assert checked.outcome.rows == EXPECTED


@pytest.mark.spark
def test_rows_are_stored_replacing_the_range_only(checked: Checked) -> None:
    assert checked.stored == sorted([*EXPECTED, KEPT_OUT_OF_RANGE],
                                    key=lambda r: (r["window_start"], r["topic"], r["partition"], r["stage"], r["rule"]))


@pytest.mark.spark
def test_counts_of_failures_by_severity(checked: Checked) -> None:
    # error: group lost + p99; p1 log dup + lost + completeness; p1 sink dup. warn: p1 log reordered,
    # provisional lost + completeness, payments p0 lost, refunds p0 lost.
    assert (checked.outcome.failed_errors, checked.outcome.failed_warnings) == (6, 5)
    assert checked.outcome.report_rows == 11  # quiet's row is read too, it just has no rules


@pytest.mark.spark
def test_data_docs_are_built(checked: Checked) -> None:
    docs = checked.cfg.home.parent / "docs"
    assert (docs / "index.html").is_file()
    pages = sorted(p.name for p in (docs / "expectations").rglob("*.html"))
    assert pages == ["sla_orders.html", "sla_payments_and_1_more.html"]  # payments' suite is refunds' too


@pytest.mark.spark
def test_table_summarises_and_lists_failures(checked: Checked) -> None:
    text = format_table(checked.outcome)
    lines = text.splitlines()
    assert lines[0] == ("SLA 2026-11-21T10:00:00+00:00 .. 2026-11-21T12:00:00+00:00: 32 checks on 11 report rows, "
                        "6 failed (error), 5 failed (warn)")
    summary = {tuple(line.split()[:3]): line.split()[3:] for line in lines[3:lines.index("Failed checks:") - 1]}
    assert summary[("orders", "log", "max_lost")] == ["0", "3", "2", "3", "FAIL"]  # threshold checks failed worst
    assert summary[("orders", "log", "min_completeness")] == ["0.99", "3", "2", "0.7", "FAIL"]
    assert summary[("orders", "log", "max_reordered")] == ["0", "3", "1", "1", "WARN"]
    assert summary[("payments", "log", "max_lost")] == ["5", "2", "1", "6", "WARN"]
    assert summary[("refunds", "log", "max_lost")] == ["5", "2", "1", "7", "WARN"]
    assert summary[("orders", "sink:s", "max_lost")] == ["0", "2", "0", "0", "PASS"]
    assert len(summary) == 16
    failures = lines[lines.index("Failed checks:") + 1:lines.index("Likely causes (docs/design.md §5):") - 1]
    assert len(failures) == 11
    assert ("  ERROR  2026-11-21T10:00:00+00:00  orders[1]  log  min_completeness: 0.98 (expected >= 0.99)"
            in failures)
    producers = "Producer settings behind them (producer_settings):"
    assert checked.outcome.producer_lines == PRODUCER_LINES
    assert lines[lines.index(producers) - 1:] == ["", producers, *(f"  {line}" for line in PRODUCER_LINES)]
    causes = lines[lines.index("Likely causes (docs/design.md §5):") + 1:lines.index(producers) - 1]
    failed = sorted({(r["stage"].split(":")[0], r["rule"]) for r in checked.outcome.rows if not r["passed"]})
    assert [line.split(":")[0].strip() for line in causes[::2]] == [
        f"{kind} {rule} <- {code}" for kind, rule in failed for code, _ in v.rule_explanations(rule, kind)]
    assert ("  log max_lost <- lost_acked: " + v.explanation("log", "lost_acked").cause) in causes
    assert ("      fix: " + v.explanation("group", "missed").remedy) in causes


@pytest.mark.spark
def test_observations_transform(spark: Any) -> None:
    from spark_jobs.io.schemas import AUDIT_PARTITION_REPORT

    rows = [report(W0, "orders", 0, "group:g", 4, 2, duplicated=3, dead_lettered=1, redelivered=1),
            report(W0, "orders", 0, "sink:s", 0, 0, duplicated=2),
            report(W0, "orders", 0, "share:q", 4, 3, redelivered=2)]
    got = (spark.createDataFrame(rows, schema=AUDIT_PARTITION_REPORT).transform(with_sla_observations)
           .select("stage_kind", "duplicate_ratio", "completeness", "redelivery_ratio", "sla_key").collect())
    key = "1795255200000000|orders|0|"
    assert [tuple(r) for r in got] == [("group", 0.75, 0.75, 0.25, key + "group:g"),
                                       ("sink", 2.0, None, 0.0, key + "sink:s"),
                                       ("share", 0.0, 0.75, 0.5, key + "share:q")]


def write_yaml(root: Path, topics: dict[str, Any]) -> Path:
    path = root / "msgaudit.yaml"
    path.write_text(yaml.safe_dump({"lake": "lake", "report_store": "sqlite:///report.db", "topics": topics}))
    return path


@pytest.mark.spark
def test_cli_exits_3_with_table_when_an_error_rule_fails(spark: Any, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    topics = {"orders": {"sla": {"max_lost": 1}}}
    config_file = write_yaml(tmp_path, topics)
    write_report(spark, config_mod.load(config_file), REPORT_ROWS)
    code = cli.main(["sla", "--config", str(config_file), "--start", "2026-11-21T10:00Z", "--end", "2026-11-21T11:00Z"])
    out, err = capsys.readouterr()
    assert code == 3
    assert out.splitlines()[0] == ("SLA 2026-11-21T10:00:00+00:00 .. 2026-11-21T11:00:00+00:00: 5 checks on "
                                   "5 report rows, 1 failed (error), 0 failed (warn)")
    assert "  ERROR  2026-11-21T10:00:00+00:00  orders[1]  log  max_lost: 2 (expected <= 1)" in out
    assert err == ("msgaudit sla: error: 1 error-severity SLA check(s) failed for windows in "
                   "2026-11-21T10:00:00+00:00 .. 2026-11-21T11:00:00+00:00 (details above and in sla_results)\n")
    stored = ReportStore(f"sqlite:///{tmp_path / 'report.db'}").read("sla_results")
    assert [(r["partition"], r["stage"], r["observed"], r["passed"]) for r in stored] == [
        (0, "group:g", 1.0, True), (0, "log", 0.0, True), (0, "sink:s", 0.0, True),
        (1, "log", 2.0, False), (1, "sink:s", 0.0, True)]


@pytest.mark.spark
def test_cli_exits_0_when_only_warnings_fail(spark: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config_file = write_yaml(tmp_path, TOPICS)
    write_report(spark, config_mod.load(config_file), REPORT_ROWS)
    code = cli.main(["sla", "--config", str(config_file), "--start", "2026-11-21T10:00Z",
                     "--end", "2026-11-21T11:00Z", "--topic", "payments"])
    out, err = capsys.readouterr()
    assert (code, err) == (0, "")
    assert "  WARN   2026-11-21T10:00:00+00:00  payments[0]  log  max_lost: 6 (expected <= 5)" in out


@pytest.mark.spark
@pytest.mark.parametrize(("override", "message"), [
    ({"--topic": "nope"}, "unknown topic 'nope' (configured: orders)"),
    ({"--start": "yesterday"}, "--start: 'yesterday' is not an ISO 8601 time"),
    ({"--end": "2026-11-21T09:00Z"}, "must be after --start"),
    ({}, "Delta table 'audit_partition_report' not found"),  # nothing reconciled yet
])
def test_cli_bad_input_is_one_line(spark: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                   override: dict[str, str], message: str) -> None:
    config_file = write_yaml(tmp_path, {"orders": {"sla": {"max_lost": 0}}})
    args = {"--start": "2026-11-21T10:00Z", "--end": "2026-11-21T11:00Z", **override}
    code = cli.main(["sla", "--config", str(config_file), *[x for kv in args.items() for x in kv]])
    _, err = capsys.readouterr()
    assert code == 2
    assert err.startswith("msgaudit sla: error: ") and message in err and err.count("\n") == 1


@pytest.mark.unit
def test_naive_range_is_rejected(tmp_path: Path) -> None:
    cfg = make_cfg(tmp_path, {"orders": {"sla": {"max_lost": 0}}})
    with pytest.raises(InputError, match="start: expected a timezone-aware UTC datetime"):
        check_sla(None, cfg, datetime(2026, 11, 21, 10), W1)  # type: ignore[arg-type]


@pytest.mark.unit
def test_topics_with_the_same_rules_share_a_validation(tmp_path: Path) -> None:
    cfg = make_cfg(tmp_path, {
        "a": {"sla": {"max_lost": 0, "max_reordered": 1}},
        "b": {"sla": {"max_reordered": 1, "max_lost": 0}},  # a's rules in another order
        "c": {"sla": {"max_lost": 0, "max_reordered": {"threshold": 1, "severity": "warn"}}},  # another severity
        "d": {"sla": {"max_lost": 1, "max_reordered": 1}},  # another threshold
        "e": {"sla": {"max_lost": 0, "max_reordered": 1}}})
    groups = same_sla(cfg.topic(t) for t in "abcde")
    assert [[t.name for t in g] for g in groups] == [["a", "b", "e"], ["c"], ["d"]]


@pytest.mark.spark
def test_a_latency_rule_on_a_sink_without_a_sink_time_is_not_evaluable(spark: Any, tmp_path: Path) -> None:
    """A coordinates sink with no `columns.sink_ts` has no sink latency: its p99 rule is reported not
    evaluable (no sla_results row, never a pass); its other rules and a timed sink's are judged."""
    sinks = [{"name": "coords", "format": "delta", "location": "sinks/c", "identity": "coordinates",
              "columns": {"partition": "partition", "offset": "offset"}},
             {"name": "timed", "format": "delta", "location": "sinks/t", "identity": "coordinates",
              "columns": {"partition": "partition", "offset": "offset", "sink_ts": "written_at"}}]
    cfg = make_cfg(tmp_path, {"orders": {"sinks": sinks, "sla": {"max_lost": 0, "max_p99_latency_ms": 1000}}})
    write_report(spark, cfg, [report(W0, "orders", 0, "sink:coords", 5, 5, p99=None),
                              report(W0, "orders", 0, "sink:timed", 5, 5, p99=None)])
    outcome = check_sla(spark, cfg, W0, W1, checked_at=CHECKED)
    assert [(r["stage"], r["rule"], r["passed"]) for r in outcome.rows] == [
        ("sink:coords", "max_lost", True), ("sink:timed", "max_lost", True),
        ("sink:timed", "max_p99_latency_ms", True)]
    assert outcome.not_evaluable == {("orders", "sink:coords", "max_p99_latency_ms")}
    assert ("  NOT EVALUABLE  orders  sink:coords  max_p99_latency_ms: the sink's rows carry no sink time (map "
            "sinks[].columns.sink_ts to the time the writer stored the row)") in format_table(outcome).splitlines()
