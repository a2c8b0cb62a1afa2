"""The Airflow DAGs (dags/) and their alerting (audit/serving/alerts.py).

* unit + airflow: every DAG file imports in a fresh interpreter without errors, quickly, with no
  database query, no file written and none of Spark/Kafka/GE loaded.
* unit: the pure parts of audit.serving.alerts (argument parsing, exit codes, failed SLA rules, alerts).
* airflow: `dag.test()` runs with the Spark steps marked successful, to check what each run hands
  to spark-submit (topics, window, as_of, environment) and which windows a backfill runs.
* airflow + e2e: real `dag.test()` runs against the local broker, Spark with Delta and the report
  store -- known injected anomalies, backfill == scheduled runs, SLA breach -> failed run + alert.

Airflow lives in a tmp AIRFLOW_HOME with a SQLite metadata db (tests/support/airflow_env.py).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml

from audit.core.vocabulary import explanation
from audit.serving import alerts
from tests.support import airflow_env

DAG_FILES = {
    "msgaudit_window.py": ["msgaudit_window_1h", "msgaudit_window_1m"],
    "msgaudit_backfill.py": ["msgaudit_backfill"],
    "msgaudit_downstream_example.py": ["msgaudit_downstream_example"],
}
WINDOWS = "1m,1h"  # MSGAUDIT_WINDOWS for every test: 1m keeps the e2e waits short
FORBIDDEN_AT_IMPORT = ("pyspark", "delta", "confluent_kafka", "great_expectations", "spark_jobs",
                       "audit.serving.report_store", "audit.clients.producer")
# The DAGs declare through the pipeline's light modules; every other spark_jobs module is heavy.
ALLOWED_AT_IMPORT = ("spark_jobs", "spark_jobs.pipeline", "spark_jobs.pipeline.airflow", "spark_jobs.pipeline.plan")

# --------------------------------------------------------------------------------------------
# unit + airflow: imports

_IMPORT_PROBE = textwrap.dedent("""
    import importlib.util, json, os, sys, time
    t0 = time.perf_counter()
    import pendulum
    import airflow.sdk
    from airflow.providers.apache.spark.operators.spark_submit import SparkSubmitOperator
    from airflow.providers.standard.sensors.date_time import DateTimeSensorAsync
    from airflow.timetables.interval import CronDataIntervalTimetable
    baseline = time.perf_counter() - t0
    from sqlalchemy import event
    from sqlalchemy.engine import Engine
    queries = []
    event.listen(Engine, "before_cursor_execute", lambda conn, cur, stmt, *a: queries.append(stmt))
    path = sys.argv[1]
    spec = importlib.util.spec_from_file_location("dag_under_test", path)
    module = importlib.util.module_from_spec(spec)
    t1 = time.perf_counter()
    spec.loader.exec_module(module)
    elapsed = time.perf_counter() - t1
    from airflow.sdk import DAG
    dags = {v.dag_id: v for v in vars(module).values() if isinstance(v, DAG)}
    print(json.dumps({
        "baseline_s": baseline, "import_s": elapsed, "queries": queries,
        "modules": sorted(sys.modules),
        "dags": {d: {"tasks": {t.task_id: sorted(t.upstream_task_ids) for t in dag.tasks},
                     "timetable": getattr(dag.timetable, "summary", None),
                     "timetable_type": type(dag.timetable).__name__,
                     "params": sorted(dag.params.keys()),
                     "max_active_runs": dag.max_active_runs,
                     "teardowns": sorted(t.task_id for t in dag.tasks if t.is_teardown),
                     "retry": {t.task_id: [t.retries, t.retry_delay.total_seconds(), t.retry_exponential_backoff,
                                           t.max_retry_delay and t.max_retry_delay.total_seconds(),
                                           type(t.retry_policy).__name__,
                                           [c.__name__ for c in t.on_failure_callback or []]]
                               for t in dag.tasks}}
                 for d, dag in dags.items()},
    }))
""")


@pytest.fixture(scope="module")
def import_probe(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """Import each DAG file once in a fresh interpreter whose metadata db cannot be reached."""
    out: dict[str, dict[str, Any]] = {}
    for name in DAG_FILES:
        home = tmp_path_factory.mktemp("airflow-import")
        cwd = tmp_path_factory.mktemp("cwd")
        env = {**os.environ, **airflow_env.airflow_environ(home / "home"), "MSGAUDIT_WINDOWS": WINDOWS,
               # any query would fail: the db's folder does not exist
               "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{home / 'missing' / 'airflow.db'}",
               "PYTHONPATH": str(airflow_env.REPO)}
        proc = subprocess.run([sys.executable, "-c", _IMPORT_PROBE, str(airflow_env.DAGS_FOLDER / name)],
                              cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-3000:]
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        result["cwd_files"] = sorted(p.name for p in cwd.iterdir())
        out[name] = result
    return out


@pytest.mark.unit
@pytest.mark.airflow
@pytest.mark.parametrize("name", sorted(DAG_FILES))
def test_dag_file_imports_fast_without_db_or_heavy_modules(import_probe: dict[str, Any], name: str) -> None:
    r = import_probe[name]
    assert sorted(r["dags"]) == DAG_FILES[name]
    assert r["queries"] == []
    assert r["cwd_files"] == []
    assert [m for m in r["modules"] if m not in ALLOWED_AT_IMPORT
            and (m.split(".")[0] in FORBIDDEN_AT_IMPORT or m in FORBIDDEN_AT_IMPORT)] == []
    # On top of Airflow and the two providers themselves (measured in the same process): under 1 s, or
    # a tenth of Airflow's own import on a machine so loaded that Airflow alone takes over 10 s.
    limit = max(1.0, 0.1 * r["baseline_s"])
    assert r["import_s"] < limit, f"{name} took {r['import_s']:.2f}s to import (airflow: {r['baseline_s']:.2f}s)"


@pytest.mark.unit
@pytest.mark.airflow
def test_window_dag_shape(import_probe: dict[str, Any]) -> None:
    dags = import_probe["msgaudit_window.py"]["dags"]
    chain = {"plan": [], "wait_for_grace": ["plan"], "window": ["plan", "wait_for_grace"], "publish": ["window"]}
    assert dags["msgaudit_window_1m"]["tasks"] == chain
    assert dags["msgaudit_window_1h"]["tasks"] == chain
    assert dags["msgaudit_window_1m"]["timetable"] == "*/1 * * * *"
    assert dags["msgaudit_window_1h"]["timetable"] == "0 */1 * * *"
    assert dags["msgaudit_window_1m"]["params"] == ["topics"]
    assert dags["msgaudit_window_1m"]["max_active_runs"] == 1
    # publish runs whatever `window` did, and the run's state stays window's (an SLA breach fails it)
    assert dags["msgaudit_window_1m"]["teardowns"] == ["publish"]


@pytest.mark.unit
@pytest.mark.airflow
def test_backfill_dag_shape(import_probe: dict[str, Any]) -> None:
    dag = import_probe["msgaudit_backfill.py"]["dags"]["msgaudit_backfill"]
    assert dag["tasks"] == {"plan": [], "ingest": ["plan"], "backfill": ["ingest", "plan"], "publish": ["backfill"]}
    assert dag["params"] == ["end", "force", "start", "topics"]
    assert dag["timetable"] is None
    assert dag["teardowns"] == ["publish"]  # emits the finished windows' events whatever `backfill` did


@pytest.mark.unit
@pytest.mark.airflow
def test_downstream_example_dag_shape(import_probe: dict[str, Any]) -> None:
    dag = import_probe["msgaudit_downstream_example.py"]["dags"]["msgaudit_downstream_example"]
    assert dag["tasks"] == {"exactly_once": [], "load": ["exactly_once"]}
    assert dag["timetable_type"] == "AssetTriggeredTimetable"


@pytest.mark.unit
@pytest.mark.airflow
def test_every_task_retries_with_backoff_except_an_sla_breach_and_alerts(import_probe: dict[str, Any]) -> None:
    """spark_jobs.pipeline.airflow.default_args: 3 retries, 1 min doubling up to 30 min, SLA breach final."""
    expected = [3, 60.0, 2.0, 1800.0, "SlaBreachIsFinal", ["sla_failure_callback"]]
    for name, dag_ids in DAG_FILES.items():
        if name == "msgaudit_downstream_example.py":  # the user's DAG: Airflow's defaults
            continue
        for dag_id in dag_ids:
            retry = import_probe[name]["dags"][dag_id]["retry"]
            assert retry == {t: expected for t in import_probe[name]["dags"][dag_id]["tasks"]}


@pytest.mark.unit
@pytest.mark.airflow
def test_unsupported_window_size_is_a_clear_import_error(tmp_path: Path) -> None:
    env = {**os.environ, **airflow_env.airflow_environ(tmp_path / "home"), "MSGAUDIT_WINDOWS": "40m",
           "PYTHONPATH": str(airflow_env.REPO)}
    proc = subprocess.run([sys.executable, str(airflow_env.DAGS_FOLDER / "msgaudit_window.py")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert ("MSGAUDIT_WINDOWS: a scheduled window must divide an hour (1m..30m) or a day in whole hours "
            "(1h..12h, 1d); got 40m") in proc.stderr


# --------------------------------------------------------------------------------------------
# unit: audit.serving.alerts


@pytest.mark.unit
def test_parse_submit_args() -> None:
    args = ["reconcile", "--config", "/c/m.yaml", "--start", "2026-05-01T10:00:00+00:00",
            "--end", "2026-05-01T10:05:00+00:00", "--topic", "a", "--topic", "b", "--as-of", "X"]
    assert alerts.parse_submit_args(args) == {
        "step": "reconcile", "config": "/c/m.yaml", "start": "2026-05-01T10:00:00+00:00",
        "end": "2026-05-01T10:05:00+00:00", "as_of": "X", "topics": ["a", "b"]}
    assert alerts.parse_submit_args(None)["step"] is None


@pytest.mark.unit
def test_exit_code_of() -> None:
    class Proc:
        returncode = 3

    class Hook:
        _submit_sp = Proc()

    class Task:
        _hook = Hook()

    assert alerts.exit_code_of(RuntimeError("whatever"), Task()) == 3
    assert alerts.exit_code_of(RuntimeError("Cannot execute: spark-submit x. Error code is: 1."), None) == 1
    assert alerts.exit_code_of(RuntimeError("boom"), None) is None


def _sla_row(topic: str, ws: datetime, rule: str, observed: float, threshold: float, passed: bool,
             severity: str = "error", partition: int = 0, stage: str = "log") -> dict[str, Any]:
    return {"window_start": ws, "topic": topic, "partition": partition, "stage": stage, "rule": rule,
            "observed": observed, "threshold": threshold, "passed": passed, "severity": severity,
            "checked_at": ws + timedelta(minutes=20)}


@pytest.mark.unit
def test_build_alert_reads_the_failed_rules_of_its_window(tmp_path: Path) -> None:
    from audit.serving.report_store import ReportStore

    url = f"sqlite:///{tmp_path / 'report.db'}"
    (tmp_path / "m.yaml").write_text(yaml.safe_dump({"report_store": url, "topics": {"a": {}, "b": {}}}))
    w10, w11 = datetime(2026, 5, 1, 10, tzinfo=UTC), datetime(2026, 5, 1, 11, tzinfo=UTC)
    with ReportStore(url) as store:
        store.replace_window("sla_results", "a", w10, [
            _sla_row("a", w10, "max_lost", 2, 0, False),
            _sla_row("a", w10, "max_p99_latency_ms", 900, 1000, True),
            _sla_row("a", w10, "max_reordered", 1, 0, False, severity="warn"),
        ])
        store.replace_window("sla_results", "a", w11, [_sla_row("a", w11, "max_lost", 5, 0, False)])
        store.replace_window("sla_results", "b", w10, [_sla_row("b", w10, "max_lost", 7, 0, False)])
        # The anomaly rows behind the failures and the settings their producer sessions recorded:
        # p-3 (idempotence off) reordered twice (not among its first seqs), p-4 (acks=1) lost one; p-3's duplicate counts in no
        # failed rule and p-9's loss is in another window, so neither is named.
        def anomaly(ws: datetime, code: str, pid: str, seq: int) -> dict[str, Any]:
            return {"window_start": ws, "topic": "a", "partition": 0, "stage": "log", "anomaly": code, "pid": pid,
                    "seq": seq, "offset": seq, "detail": "", "run_id": "r", "computed_at": w11}
        store.replace_window("audit_anomalies", "a", w10, [
            anomaly(w10, "reordered_in_log", "p-3", 41), anomaly(w10, "reordered_in_log", "p-3", 42),
            anomaly(w10, "duplicate_in_log", "p-3", 3), anomaly(w10, "lost_acked", "p-4", 0)])
        store.replace_window("audit_anomalies", "a", w11, [anomaly(w11, "lost_acked", "p-9", 0)])
        settings = {"start_ts": w10, "retries": 2147483647, "max_in_flight": 5, "transactional_id": None,
                    "mode": "python"}
        assert store.record_settings([
            {**settings, "pid": "p-3", "producer": "orders-svc", "acks": "all", "enable_idempotence": False},
            {**settings, "pid": "p-4", "producer": None, "acks": "1", "enable_idempotence": True},
            {**settings, "pid": "p-9", "producer": None, "acks": "0", "enable_idempotence": True}]) == 3

    class TI:
        dag_id, run_id, task_id, map_index = "msgaudit_window_1h", "scheduled__x", "window", -1

    class Task:
        application_args = ["window", "--config", str(tmp_path / "m.yaml"), "--start", w10.isoformat(),
                            "--end", w11.isoformat(), "--topic", "a"]

    exc = RuntimeError("Cannot execute: spark-submit ... Error code is: 3.")
    alert = alerts.build_alert({"ti": TI(), "task": Task(), "exception": exc})
    assert alert.sla_breach and alert.exit_code == 3 and alert.step == "window"
    assert (alert.window_start, alert.window_end, alert.topics) == (w10.isoformat(), w11.isoformat(), ("a",))
    assert alert.failed_rules == (
        alerts.FailedRule(w10.isoformat(), "a", 0, "log", "max_lost", 2.0, 0.0, "error"),
        alerts.FailedRule(w10.isoformat(), "a", 0, "log", "max_reordered", 1.0, 0.0, "warn"),
    )
    assert alert.text().splitlines() == [
        "msgaudit SLA breach: msgaudit_window_1h [2026-05-01T10:00:00+00:00 .. 2026-05-01T11:00:00+00:00)",
        "run scheduled__x, task window, topics a",
        "  - a[0] log max_lost: observed 2 vs threshold 0 (error, window 2026-05-01T10:00:00+00:00)",
        "  - a[0] log max_reordered: observed 1 vs threshold 0 (warn, window 2026-05-01T10:00:00+00:00)",
        *(f"  why log {rule} <- {code}: {e.cause}; fix: {e.remedy}"
          for rule, code in (("max_lost", "lost_acked"), ("max_reordered", "reordered_in_log"))
          for e in [explanation("log", code)]),
        "  producer: reordered_in_log (2 rows): producer orders-svc (session p-3) ran with enable.idempotence=false "
        "(retries=2147483647, max.in.flight=5): set enable.idempotence=true",
        "  producer: lost_acked (1 row): producer session p-4 ran with acks=1: set acks=all "
        "(and min.insync.replicas >= 2)",
    ]
    other = alerts.build_alert({"ti": TI(), "task": Task(), "exception": RuntimeError("Error code is: 1.")})
    assert (other.sla_breach, other.failed_rules, other.error) == (False, (), "Error code is: 1.")
    assert other.subject.startswith("msgaudit window failed: ")


# --------------------------------------------------------------------------------------------
# unit: audit.serving.completeness (the extras of the window DAG's completeness events)


@pytest.mark.unit
def test_asset_uri_names_the_cluster_by_its_first_bootstrap_server() -> None:
    from audit.serving.completeness import asset_uri

    assert asset_uri("Kafka-1:9092, kafka-2:9092", "orders") == "msgaudit://kafka-1:9092/orders"
    assert asset_uri("SASL_SSL://b1.example.com:9093", "orders.v2") == "msgaudit://b1.example.com:9093/orders.v2"


@pytest.mark.unit
def test_window_extra_sums_partitions_per_stage_and_judges_complete_and_exactly_once() -> None:
    from audit.serving.completeness import all_exactly_once, window_extra

    ws, as_of = datetime(2026, 5, 1, 10, tzinfo=UTC), datetime(2026, 5, 1, 11, 15, tzinfo=UTC)
    rows = [
        _stage_row("t", ws, as_of, 0, "log", expected=4, delivered=4, reordered=1, reordered_in_log=1),
        _stage_row("t", ws, as_of, 1, "log", expected=2, delivered=2),
        # every committed record processed, one of them by dead-lettering: complete
        _stage_row("t", ws, as_of, 0, "group:g", expected=6, delivered=5, dead_lettered=1),
        _stage_row("t", ws, as_of, 0, "sink:db", expected=6, delivered=5, lost=1, missing_in_sink=1),
        _stage_row("t", ws, as_of, 0, "mirror:m", expected=6, delivered=6, pending=0, status="provisional"),
        _stage_row("t", ws, as_of, 0, "group:h", expected=6, delivered=5, pending=1),
        _stage_row("other", ws, as_of, 0, "log", expected=9, delivered=0, lost=9),  # another topic
        _stage_row("t", ws + timedelta(hours=1), as_of, 0, "log", expected=1, lost=1),  # another window
    ]
    extra = window_extra(rows, "t", ws, ws + timedelta(hours=1), as_of)
    judged = {s: (v["expected"], v["delivered"], v["anomalies"], v["complete"], v["exactly_once"])
              for s, v in extra["stages"].items()}
    assert judged == {
        "group:g": (6, 5, {"dead_lettered": 1}, True, True),
        "group:h": (6, 5, {}, False, False),
        "log": (6, 6, {"reordered_in_log": 1}, True, True),  # out of order is still exactly once
        "mirror:m": (6, 6, {}, False, False),  # not final yet
        "sink:db": (6, 5, {"missing_in_sink": 1}, False, False),
    }
    assert list(extra["stages"]) == sorted(extra["stages"])
    assert (extra["complete"], extra["exactly_once"]) == (False, False)
    assert (extra["window_start"], extra["as_of"]) == (ws.isoformat(), as_of.isoformat())
    empty = window_extra([], "t", ws, ws + timedelta(hours=1), as_of)  # nothing produced: nothing missing
    assert (empty["stages"], empty["complete"], empty["exactly_once"]) == ({}, True, True)
    dup = window_extra([_stage_row("t", ws, as_of, 0, "log", expected=2, delivered=2, duplicated=1,
                                   duplicate_in_log=1)], "t", ws, ws + timedelta(hours=1), as_of)
    assert (dup["complete"], dup["exactly_once"]) == (True, False)
    assert all_exactly_once([empty]) and not all_exactly_once([empty, dup]) and not all_exactly_once([])


@pytest.mark.unit
def test_window_events_are_one_asset_and_extra_per_topic_read_from_the_report_store(tmp_path: Path) -> None:
    """What every emitter sends (the DAGs' `publish`, `msgaudit follow`): one event per topic, in order."""
    from audit.core import config as config_mod
    from audit.serving.completeness import window_events
    from audit.serving.report_store import ReportStore

    cfg = config_mod.from_dict({"report_store": f"sqlite:///{tmp_path / 'r.db'}",
                                "kafka": {"bootstrap.servers": "K1:9092,k2:9092"}}, base=tmp_path)
    ws, as_of = datetime(2026, 5, 1, 10, tzinfo=UTC), datetime(2026, 5, 1, 11, 15, tzinfo=UTC)
    with ReportStore(cfg.report_store) as store:
        store.replace_window("audit_partition_report", "b", ws, [
            _stage_row("b", ws, as_of, 0, "log", expected=3, delivered=2, lost=1, lost_acked=1)])
    events = window_events(cfg, ["b", "a"], ws, ws + timedelta(hours=1), as_of)
    window = {"window_start": ws.isoformat(), "window_end": (ws + timedelta(hours=1)).isoformat(),
              "as_of": as_of.isoformat()}
    assert events == [
        ("msgaudit://k1:9092/b", {"topic": "b", **window, "complete": False, "exactly_once": False, "stages": {"log": {
            "expected": 3, "delivered": 2, "lost": 1, "duplicated": 0, "reordered": 0, "pending": 0,
            "anomalies": {"lost_acked": 1}, "complete": False, "exactly_once": False}}}),
        ("msgaudit://k1:9092/a", {"topic": "a", **window, "complete": True, "exactly_once": True, "stages": {}})]
    assert json.loads(json.dumps(events)) == [list(e) for e in events]  # plain JSON, as Airflow stores it


@pytest.mark.airflow
def test_backfill_publish_emits_only_the_windows_the_run_finished(airflow_home: Path, tmp_path: Path) -> None:
    """`publish_backfill`: a window in the backfill state after the run and not before it emits; one an
    earlier run finished (in `done_before`) or one the run did not finish (not in the state) does not."""
    from airflow.sdk import Asset, AssetAlias

    from spark_jobs.pipeline.airflow import backfill_alias, backfill_done, publish_backfill
    from spark_jobs.pipeline.backfill import STATE_FILE, BackfillState, state_key

    cfg_path = _write_config(tmp_path / "msgaudit.yaml", {
        "home": str(tmp_path / "home"), "report_store": f"sqlite:///{tmp_path / 'r.db'}",
        "topics": {"o": {"window": "1m", "grace": "5s"}, "p": {"window": "1m", "grace": "5s"}}})
    from audit.core import config as config_mod

    cfg = config_mod.load(cfg_path)
    w = [datetime(2026, 5, 1, 10, m, tzinfo=UTC) for m in range(3)]
    windows = [{"start": x.isoformat(), "end": (x + WINDOW).isoformat(), "topics": ["o", "p"],
                "as_of": (x + WINDOW + GRACE).isoformat()} for x in w]
    state = BackfillState(cfg.home / STATE_FILE)
    state.mark(state_key("o", w[0], w[0] + WINDOW + GRACE), {})  # an earlier run's
    before = backfill_done(cfg)
    for t, x in (("p", w[0]), ("o", w[1]), ("p", w[1])):  # this run's; w[2] did not finish
        state.mark(state_key(t, x, x + WINDOW + GRACE), {})

    class TI:
        def xcom_pull(self, task_ids: str, key: str = "return_value") -> Any:
            return {"return_value": windows, "config": str(cfg_path), "done_before": before}[key]

    class Events:
        def __init__(self) -> None:
            self.added: list[tuple[str, dict[str, Any]]] = []

        def add(self, asset: Asset, extra: dict[str, Any]) -> None:
            self.added.append((asset.uri, extra))

    events = Events()
    out = publish_backfill(backfill_alias(), {"ti": TI(), "outlet_events": {AssetAlias(backfill_alias()): events}})
    assert [(uri, e["window_start"]) for uri, e in events.added] == [
        ("msgaudit://127.0.0.1:9092/p", w[0].isoformat()), ("msgaudit://127.0.0.1:9092/o", w[1].isoformat()),
        ("msgaudit://127.0.0.1:9092/p", w[1].isoformat())]
    assert out == [{"asset": uri, "extra": e} for uri, e in events.added]


@pytest.mark.unit
def test_sla_breached_only_by_a_failed_error_rule_checked_at_the_runs_as_of(tmp_path: Path) -> None:
    from audit.serving.completeness import sla_breached
    from audit.serving.report_store import ReportStore

    url = f"sqlite:///{tmp_path / 'report.db'}"
    ws = datetime(2026, 5, 1, 10, tzinfo=UTC)
    as_of = ws + timedelta(minutes=75)
    with ReportStore(url) as store:
        store.replace_window("sla_results", "a", ws, [_sla_row("a", ws, "max_reordered", 1, 0, False, "warn")])
        store.replace_window("sla_results", "b", ws, [_sla_row("b", ws, "max_lost", 1, 0, False)])
    end = ws + timedelta(hours=1)
    assert not sla_breached(url, ["a"], ws, end, as_of)  # a warning does not fail the run
    assert not sla_breached(url, ["b"], ws, end, as_of)  # checked at another instant (20 min after the start)
    assert sla_breached(url, ["a", "b"], ws, end, ws + timedelta(minutes=20))


# --------------------------------------------------------------------------------------------
# airflow: a metadata db for in-process dag.test() runs


@pytest.fixture(scope="session")
def airflow_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    home = tmp_path_factory.mktemp("airflow") / "home"
    os.environ["MSGAUDIT_WINDOWS"] = WINDOWS
    airflow_env.setup(home, spark_master="local[2]")
    return home


@pytest.fixture(scope="session")
def dagbag(airflow_home: Path) -> Any:
    from airflow.dag_processing.dagbag import DagBag

    bag = DagBag(str(airflow_env.DAGS_FOLDER))
    assert bag.import_errors == {}
    return bag


MSGAUDIT_VARIABLES = ("msgaudit_config", "msgaudit_spark_application", "msgaudit_alert_log",
                      "msgaudit_alert_email", "msgaudit_alert_smtp_conn", "msgaudit_alert_slack_webhook_conn")
APPLICATION = "/opt/msgaudit/spark_jobs/submit.py"  # the Variable override, so these runs need no submit.py


@dataclass
class RunResult:
    state: str
    run_id: str
    states: dict[tuple[str, int], str]
    xcom: dict[tuple[str, int, str], Any]


def fresh_dag(dagbag: Any, dag_id: str) -> Any:
    """`dag_id` parsed anew from its file, as every Airflow task process parses it.

    Never hand one parsed DAG object to two dag.test() runs: Airflow's `process_params` copies the
    DAG's Param objects by reference and `Param.resolve(value)` stores the run's conf value in them,
    so a run's conf (e.g. `topics`) would become the default of every later run of that object."""
    from airflow.dag_processing.dagbag import DagBag

    bag = DagBag(dagbag.dags[dag_id].fileloc)
    assert bag.import_errors == {}
    return bag.dags[dag_id]


def run_dag(dagbag: Any, dag_id: str, variables: dict[str, str], logical_date: datetime | None = None,
            conf: dict[str, Any] | None = None, mark_success: str | None = None) -> RunResult:
    """One dag.test() run of a freshly parsed DAG; returns the run state, every task state and every XCom."""
    from airflow.models.xcom import XComModel
    from airflow.utils.session import create_session

    airflow_env.delete_variables([k for k in MSGAUDIT_VARIABLES if k not in variables])
    airflow_env.set_variables(variables)
    dag = fresh_dag(dagbag, dag_id)
    dr = dag.test(logical_date=logical_date, run_conf=conf, mark_success_pattern=mark_success)
    with create_session() as session:
        tis = dr.get_task_instances(session=session)
        states = {(ti.task_id, ti.map_index): str(ti.state) for ti in tis}
        rows = session.query(XComModel).filter(XComModel.dag_id == dag_id, XComModel.run_id == dr.run_id).all()
        xcom = {(r.task_id, r.map_index, r.key): XComModel.deserialize_value(r) for r in rows}
    return RunResult(str(dr.state), dr.run_id, states, xcom)


def _write_config(path: Path, data: dict[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    return path


SPARK_STEPS = "ingest|window|backfill|publish"  # the Spark tasks of both DAGs, and what reads their output


@pytest.mark.airflow
def test_window_run_hands_its_interval_topics_and_as_of_to_spark(dagbag: Any, tmp_path: Path) -> None:
    cfg = _write_config(tmp_path / "msgaudit.yaml", {
        "topics": {"orders": {"window": "1m", "grace": "5s"}, "payments": {"window": "1m", "grace": "20s"},
                   "hourly": {"window": "1h"}}})
    r = run_dag(dagbag, "msgaudit_window_1m", {"msgaudit_config": str(cfg), "msgaudit_spark_application": APPLICATION},
                logical_date=datetime(2026, 5, 1, 10, 7, 30, tzinfo=UTC), mark_success=SPARK_STEPS)
    assert r.state == "success"
    assert r.states == {(t, -1): "success" for t in ("plan", "wait_for_grace", "window", "publish")}
    window = ["--config", str(cfg), "--start", "2026-05-01T10:06:00+00:00", "--end", "2026-05-01T10:07:00+00:00"]
    plan = {k: v for (task, _, k), v in r.xcom.items() if task == "plan"}
    assert plan["topics"] == ["orders", "payments"]
    assert plan["as_of"] == "2026-05-01T10:07:20+00:00"
    # one submission runs ingest, capture, reconcile and sla; as_of is also the SLA results' checked_at
    assert plan["window"] == ["window", *window, "--topic", "orders", "--topic", "payments",
                              "--as-of", "2026-05-01T10:07:20+00:00"]
    assert plan["application"] == APPLICATION
    assert plan["env"]["PYSPARK_PYTHON"] == sys.executable
    # spark-submit starts the driver JVM: its heap and collector go as --conf (its own default heap is 1g)
    assert plan["conf"] == {"spark.driver.memory": "4g", "spark.driver.extraJavaOptions": "-XX:+UseParallelGC"}
    assert plan["env"]["PATH"].split(os.pathsep)[0] == str(Path(sys.executable).parent)


@pytest.mark.airflow
def test_window_run_on_a_spark_cluster_ships_the_code_and_the_jars(dagbag: Any, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """With `spark_default` pointing at a standalone master, each step's spark-submit names that master,
    ships the jar cache on --jars and `audit` + `spark_jobs` as a zip on --py-files, and runs the
    executors on this Python (tests/test_cluster.py runs the same command shape on a real cluster)."""
    import zipfile

    from airflow.providers.apache.spark.hooks.spark_submit import SparkSubmitHook

    from audit.runtime import jars

    cfg = _write_config(tmp_path / "msgaudit.yaml", {"topics": {"orders": {"window": "1m", "grace": "5s"}}})
    airflow_env.set_connection("spark_default", "spark", "spark://127.0.0.1:7077")
    try:
        r = run_dag(dagbag, "msgaudit_window_1m", {"msgaudit_config": str(cfg)},
                    logical_date=datetime(2026, 5, 1, 10, 7, 30, tzinfo=UTC), mark_success=SPARK_STEPS)
        plan = {k: v for (task, _, k), v in r.xcom.items() if task == "plan"}
        # Outside a task the hook reads connections from the environment, as a worker's task does.
        monkeypatch.setenv("AIRFLOW_CONN_SPARK_DEFAULT",
                           json.dumps({"conn_type": "spark", "host": "spark://127.0.0.1:7077"}))
        hook = SparkSubmitHook(conn_id="spark_default", conf=plan["conf"], jars=plan["jars"],
                               py_files=plan["py_files"], env_vars=plan["env"], name="msgaudit-window-1m",
                               application_args=plan["window"])
        argv = hook._build_spark_submit_command(plan["application"])
    finally:
        airflow_env.set_connection("spark_default", "spark", "local[2]")
    assert r.state == "success"
    assert argv[:3] == ["spark-submit", "--master", "spark://127.0.0.1:7077"]
    assert argv[argv.index("--jars") + 1].split(",") == [str(p) for p in jars.jars("spark-deps")]
    bundle = Path(argv[argv.index("--py-files") + 1])
    with zipfile.ZipFile(bundle) as zf:
        names = set(zf.namelist())
    assert {"audit/__init__.py", "spark_jobs/pipeline/submit.py", "spark_jobs/reconcile/__init__.py"} <= names
    assert not any("__pycache__" in n for n in names)
    assert argv[-len(plan["window"]) - 1:] == [plan["application"], *plan["window"]]
    assert plan["application"].endswith("spark_jobs/pipeline/submit.py")
    assert plan["env"]["PYSPARK_PYTHON"] == sys.executable  # the executors' Python


def _stage_row(topic: str, ws: datetime, as_of: datetime, partition: int, stage: str, status: str = "final",
               **counts: int) -> dict[str, Any]:
    base = {"expected": 0, "delivered": 0, "lost": 0, "duplicated": 0, "reordered": 0, "pending": 0}
    return {"window_start": ws, "window_end": ws + timedelta(minutes=1), "topic": topic, "partition": partition,
            "stage": stage, "status": status, "run_id": "r", "computed_at": as_of, **base, **counts}


@pytest.mark.airflow
def test_window_run_publishes_a_completeness_event_per_topic_that_starts_the_downstream_dag(
        dagbag: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`publish` reads the window's report rows and emits one event per topic on its asset; the
    example downstream DAG, scheduled on `orders`' asset, gets a run from the scheduler's own code
    with the event, and its gate stops it: the window was complete but not exactly once."""
    from audit.serving.report_store import ReportStore

    store = f"sqlite:///{tmp_path / 'report.db'}"
    cfg = _write_config(tmp_path / "msgaudit.yaml", {
        "report_store": store, "kafka": {"bootstrap.servers": "Kafka-1:9092,kafka-2:9092"},
        "topics": {"orders": {"window": "1m", "grace": "5s"}, "payments": {"window": "1m", "grace": "5s"}}})
    ws, as_of = datetime(2026, 5, 1, 10, 6, tzinfo=UTC), datetime(2026, 5, 1, 10, 7, 5, tzinfo=UTC)
    with ReportStore(store) as s:
        s.replace_window("audit_partition_report", "orders", ws, [
            _stage_row("orders", ws, as_of, 0, "log", expected=3, delivered=3),
            _stage_row("orders", ws, as_of, 1, "log", expected=2, delivered=2, unaudited=1),
            _stage_row("orders", ws, as_of, 0, "group:loader", expected=5, delivered=5, duplicated=2, redelivered=2)])
    orders, payments = "msgaudit://kafka-1:9092/orders", "msgaudit://kafka-1:9092/payments"
    monkeypatch.setenv("MSGAUDIT_DOWNSTREAM_ASSET", orders)
    r = run_dag(dagbag, "msgaudit_window_1m", {"msgaudit_config": str(cfg)},
                logical_date=datetime(2026, 5, 1, 10, 7, 30, tzinfo=UTC), mark_success="window")
    assert r.states[("publish", -1)] == "success", r.states
    window = {"window_start": ws.isoformat(), "window_end": (ws + timedelta(minutes=1)).isoformat(),
              "as_of": as_of.isoformat()}
    log = {"expected": 5, "delivered": 5, "lost": 0, "duplicated": 0, "reordered": 0, "pending": 0,
           "anomalies": {"unaudited": 1}, "complete": True, "exactly_once": True}
    group = {"expected": 5, "delivered": 5, "lost": 0, "duplicated": 2, "reordered": 0, "pending": 0,
             "anomalies": {"redelivered": 2}, "complete": True, "exactly_once": False}
    orders_extra = {"topic": "orders", **window, "complete": True, "exactly_once": False,
                    "stages": {"group:loader": group, "log": log}}
    payments_extra = {"topic": "payments", **window, "complete": True, "exactly_once": True, "stages": {}}
    assert airflow_env.asset_events(orders) == [
        {"dag_id": "msgaudit_window_1m", "run_id": r.run_id, "task_id": "publish", "extra": orders_extra}]
    assert airflow_env.asset_events(payments) == [
        {"dag_id": "msgaudit_window_1m", "run_id": r.run_id, "task_id": "publish", "extra": payments_extra}]
    assert r.xcom[("publish", -1, "return_value")] == [{"asset": orders, "extra": orders_extra},
                                                       {"asset": payments, "extra": payments_extra}]
    down = airflow_env.run_asset_triggered(fresh_dag(dagbag, "msgaudit_downstream_example"))
    assert down == {"state": "success", "run_type": "asset_triggered", "consumed": [orders_extra],
                    "states": {"exactly_once": "success", "load": "skipped"}, "returned": {}}
    assert airflow_env.run_asset_triggered(fresh_dag(dagbag, "msgaudit_downstream_example")) is None
    # The next window of orders is clean: its event lets the downstream run go on to `load`.
    ws2 = ws + timedelta(minutes=1)
    with ReportStore(store) as s:
        s.replace_window("audit_partition_report", "orders", ws2, [
            _stage_row("orders", ws2, as_of + timedelta(minutes=1), 0, "log", expected=4, delivered=4)])
    r2 = run_dag(dagbag, "msgaudit_window_1m", {"msgaudit_config": str(cfg)},
                 logical_date=datetime(2026, 5, 1, 10, 8, 30, tzinfo=UTC), mark_success="window")
    clean = {"topic": "orders", "window_start": ws2.isoformat(), "window_end": (ws2 + timedelta(minutes=1)).isoformat(),
             "as_of": (as_of + timedelta(minutes=1)).isoformat(), "complete": True, "exactly_once": True,
             "stages": {"log": {**log, "expected": 4, "delivered": 4, "anomalies": {}}}}
    assert [e["extra"] for e in airflow_env.asset_events(orders)] == [orders_extra, clean]
    down = airflow_env.run_asset_triggered(fresh_dag(dagbag, "msgaudit_downstream_example"))
    assert down == {"state": "success", "run_type": "asset_triggered", "consumed": [clean],
                    "states": {"exactly_once": "success", "load": "success"},
                    "returned": {"exactly_once": True, "load": [
                        {k: clean[k] for k in ("topic", "window_start", "window_end")}]}}
    assert r2.states[("publish", -1)] == "success", r2.states


@pytest.mark.airflow
def test_window_run_without_topics_of_its_size_is_skipped(dagbag: Any, tmp_path: Path) -> None:
    cfg = _write_config(tmp_path / "msgaudit.yaml", {"topics": {"hourly": {"window": "1h"}}})
    r = run_dag(dagbag, "msgaudit_window_1m", {"msgaudit_config": str(cfg)},
                logical_date=datetime(2026, 5, 1, 10, 7, 30, tzinfo=UTC), mark_success="window")
    assert r.states == {(t, -1): "skipped" for t in ("plan", "wait_for_grace", "window", "publish")}


@pytest.mark.airflow
def test_backfill_runs_the_range_in_one_submission_and_lists_its_windows(dagbag: Any, tmp_path: Path) -> None:
    cfg = _write_config(tmp_path / "msgaudit.yaml", {
        "spark": {"spark.driver.memory": "6g"},
        "topics": {"orders": {"window": "1m", "grace": "5s"}, "payments": {"window": "1m", "grace": "20s"},
                   "hourly": {"window": "1h", "grace": "10m"}}})
    r = run_dag(dagbag, "msgaudit_backfill", {"msgaudit_config": str(cfg), "msgaudit_spark_application": APPLICATION},
                conf={"start": "2026-05-01T10:06:30Z", "end": "2026-05-01T10:08:00Z", "topics": ["orders", "hourly"]},
                mark_success="ingest|backfill")
    assert r.state == "success"
    assert r.states == {("plan", -1): "success", ("ingest", -1): "success", ("backfill", -1): "success",
                        ("publish", -1): "success"}
    assert r.xcom[("publish", -1, "return_value")] == []  # nothing finished: `backfill` did not run
    plan = {k: v for (task, _, k), v in r.xcom.items() if task == "plan"}
    rng = ["--config", str(cfg), "--start", "2026-05-01T10:06:30+00:00", "--end", "2026-05-01T10:08:00+00:00"]
    w = ["2026-05-01T10:00:00+00:00", "2026-05-01T10:06:00+00:00", "2026-05-01T10:07:00+00:00",
         "2026-05-01T10:08:00+00:00", "2026-05-01T11:00:00+00:00"]
    assert plan["ingest"] == ["ingest", "--config", str(cfg), "--start", w[0], "--end", w[4]]
    assert plan["backfill"] == ["backfill", *rng, "--topic", "orders", "--topic", "hourly"]
    assert plan["env"]["PYSPARK_PYTHON"] == sys.executable
    assert plan["application"] == APPLICATION
    assert plan["conf"] == {"spark.driver.memory": "6g", "spark.driver.extraJavaOptions": "-XX:+UseParallelGC"}
    # the windows the backfill judges, each at its scheduled as_of: orders alone is judged with the
    # grace of all 1m topics (payments: 20s), as its scheduled run is
    assert plan["return_value"] == [
        {"start": w[0], "end": w[4], "topics": ["hourly"], "as_of": "2026-05-01T11:10:00+00:00"},
        {"start": w[1], "end": w[2], "topics": ["orders"], "as_of": "2026-05-01T10:07:20+00:00"},
        {"start": w[2], "end": w[3], "topics": ["orders"], "as_of": "2026-05-01T10:08:20+00:00"}]


@pytest.mark.airflow
def test_backfill_without_topics_covers_every_topic_after_a_run_with_topics(dagbag: Any, tmp_path: Path) -> None:
    """Each run's `topics` (and `force`) is its own: an earlier run's conf never becomes a later run's default."""
    cfg = _write_config(tmp_path / "msgaudit.yaml", {
        "topics": {"orders": {"window": "1m", "grace": "5s"}, "payments": {"window": "1m", "grace": "20s"}}})
    variables = {"msgaudit_config": str(cfg), "msgaudit_spark_application": APPLICATION}
    window = {"start": "2026-05-01T10:06:00Z", "end": "2026-05-01T10:07:00Z"}
    args = ["--config", str(cfg), "--start", "2026-05-01T10:06:00+00:00", "--end", "2026-05-01T10:07:00+00:00"]
    one = run_dag(dagbag, "msgaudit_backfill", variables, conf={**window, "topics": ["orders"], "force": True},
                  mark_success="ingest|backfill")
    every = run_dag(dagbag, "msgaudit_backfill", variables, conf=window, mark_success="ingest|backfill")
    expected = {"one": ["backfill", *args, "--topic", "orders", "--force"], "all": ["backfill", *args]}
    topics = {"one": ["orders"], "all": ["orders", "payments"]}
    for r, run in ((one, "one"), (every, "all")):
        assert (r.state, r.states[("plan", -1)]) == ("success", "success"), r.states
        assert r.xcom[("plan", -1, "backfill")] == expected[run]
        assert [x["topics"] for x in r.xcom[("plan", -1, "return_value")]] == [topics[run]]


@pytest.mark.airflow
def test_backfill_refuses_windows_that_are_not_final(dagbag: Any, tmp_path: Path) -> None:
    from audit.core.windows import floor_window

    cfg = _write_config(tmp_path / "msgaudit.yaml", {"topics": {"orders": {"window": "1h", "grace": "15m"}}})
    alert_log = tmp_path / "alerts.jsonl"
    before = datetime.now(UTC)
    r = run_dag(dagbag, "msgaudit_backfill", {"msgaudit_config": str(cfg), "msgaudit_alert_log": str(alert_log)},
                conf={"start": (before - timedelta(hours=3)).isoformat(), "end": before.isoformat()},
                mark_success="ingest|backfill")
    after = datetime.now(UTC)
    assert r.state == "failed"
    assert r.states == {("plan", -1): "failed", ("ingest", -1): "upstream_failed", ("backfill", -1): "upstream_failed",
                        ("publish", -1): "skipped"}  # nothing planned: no event

    def refusal(now: datetime) -> str:  # the first window whose as_of (end + 15m) is after `now`
        ws = floor_window(before - timedelta(hours=3), timedelta(hours=1))
        while ws + timedelta(minutes=75) <= now:
            ws += timedelta(hours=1)
        we = ws + timedelta(hours=1)
        return (f"window [{ws.isoformat()}, {we.isoformat()}) is not final until "
                f"{(we + timedelta(minutes=15)).isoformat()}; backfill past windows only "
                "(the scheduled msgaudit_window DAG handles the rest)")

    [alert] = [json.loads(line) for line in alert_log.read_text().splitlines()]
    assert (alert["dag_id"], alert["task_id"]) == ("msgaudit_backfill", "plan")
    # `plan` judges finality at the run's run_after (the trigger instant, not the wall clock at
    # plan time): an hour's 15-minute mark may pass between `before` and it
    assert alert["error"] in {refusal(before), refusal(after)}


@pytest.mark.airflow
def test_retry_policy_fails_an_sla_breach_at_once_and_retries_the_rest(airflow_home: Path) -> None:
    from airflow.sdk import RetryAction

    def task(step: str, code: int) -> Any:
        proc = type("Proc", (), {"returncode": code})()
        hook = type("Hook", (), {"_submit_sp": proc})()
        return type("Task", (), {"_hook": hook, "application_args": [step, "--config", "m.yaml"]})()

    policy = alerts.spark_submit_retry_policy()
    exc = RuntimeError("Cannot execute: spark-submit ...")
    assert policy.evaluate(exc, 1, 4, {"task": task("sla", 3)}).action == RetryAction.FAIL
    assert policy.evaluate(exc, 1, 4, {"task": task("window", 3)}).action == RetryAction.FAIL
    assert policy.evaluate(exc, 1, 4, {"task": task("backfill", 3)}).action == RetryAction.FAIL
    assert policy.evaluate(exc, 1, 4, {"task": task("sla", 1)}).action == RetryAction.DEFAULT
    assert policy.evaluate(exc, 1, 4, {"task": task("backfill", 2)}).action == RetryAction.DEFAULT
    assert policy.evaluate(exc, 1, 4, {"task": task("reconcile", 3)}).action == RetryAction.DEFAULT
    assert policy.evaluate(exc, 1, 4, None).action == RetryAction.DEFAULT


# --------------------------------------------------------------------------------------------
# airflow + e2e: real runs through spark-submit, the broker, Delta and the report store

WINDOW = timedelta(minutes=1)
GRACE = timedelta(seconds=5)
IGNORED = {"run_id", "computed_at", "checked_at", "latency_p50_ms", "latency_p95_ms", "latency_p99_ms",
           "latency_max_ms"}
# A rerun of the same window may change no column at all: run ids, computed_at and checked_at (both =
# as_of), latency and SLA observations are functions of the inputs and the as_of.
WALL_CLOCK: set[str] = set()


@dataclass
class Injected:
    """What the fixture produced: windows and the offsets of every injected fault."""

    topic: str
    windows: list[datetime]  # A (faults), B (clean), C (empty)
    pid: str
    resent_seqs: list[int]  # content_duplicate
    resent_offsets: list[int]
    forged_offset: int  # duplicate_in_log of seq 0
    unaudited_offsets: list[int]
    acked_a: int
    acked_b: int


def _wait_until(t: datetime) -> None:
    delay = (t - datetime.now(UTC)).total_seconds()
    if delay > 0:
        time.sleep(delay)


@pytest.fixture(scope="module")
def injected(kafka_bootstrap: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[Injected, Path]:
    """Window A: 6 messages + 2 resends (content_duplicate) + a hand-made copy of seq 0
    (duplicate_in_log) + 2 header-less records and 1 with garbage headers (unaudited).
    Window B: 3 clean messages. Returns the facts and the ledger folder once B's messages are in:
    each run waits for its own window's as_of, so window A's run overlaps B's grace."""
    from confluent_kafka import Producer

    from audit import AuditedProducer
    from audit.core import headers as H
    from audit.core.windows import floor_window
    from tests.conftest import new_topic

    root = tmp_path_factory.mktemp("e2e-data")
    ledger = root / "ledger"
    topic = new_topic(kafka_bootstrap, partitions=1, prefix="dags")
    if (datetime.now(UTC) - floor_window(datetime.now(UTC), WINDOW)) > WINDOW - timedelta(seconds=15):
        _wait_until(floor_window(datetime.now(UTC), WINDOW) + WINDOW)  # leave time to finish inside A
    a = floor_window(datetime.now(UTC), WINDOW)
    offsets: dict[str, int] = {}

    def on(name: str) -> Callable[[Any, Any], None]:
        def cb(err: Any, msg: Any) -> None:
            assert err is None, err
            offsets[name] = msg.offset()
        return cb

    producer = AuditedProducer({"bootstrap.servers": kafka_bootstrap}, producer_name="orders-svc",
                               ledger_dir=ledger / "producer")
    for i in range(6):
        producer.produce(topic, key=f"k{i}".encode(), value=f"v{i}".encode(), on_delivery=on(f"m{i}"))
    producer.flush()
    for i in (1, 2):  # the application re-sends two messages: new seqs 6 and 7
        producer.produce(topic, key=f"k{i}".encode(), value=f"v{i}".encode(), on_delivery=on(f"r{i}"))
    producer.flush()
    pid = producer.pid
    plain = Producer({"bootstrap.servers": kafka_bootstrap})
    ts0 = str(int(time.time() * 1000)).encode()
    plain.produce(topic, key=b"k0", value=b"v0", on_delivery=on("forged"),
                  headers=[(H.PID, pid.encode()), (H.SEQ, b"0"), (H.TS, ts0)])
    plain.flush()
    plain.produce(topic, key=b"x1", value=b"plain-1", on_delivery=on("plain1"))
    plain.produce(topic, key=b"x2", value=b"plain-2", on_delivery=on("plain2"))
    plain.flush()
    plain.produce(topic, key=b"x3", value=b"garbage", on_delivery=on("garbage"),
                  headers=[(H.PID, b"someone"), (H.SEQ, b"not-a-number"), (H.TS, b"yesterday")])
    plain.flush()
    assert datetime.now(UTC) < a + WINDOW, "window A closed before the faults were in"
    _wait_until(a + WINDOW + timedelta(milliseconds=200))
    for i in range(3):
        producer.produce(topic, key=f"b{i}".encode(), value=f"w{i}".encode(), on_delivery=on(f"b{i}"))
    producer.flush()
    producer.close()
    assert datetime.now(UTC) < a + 2 * WINDOW, "window B closed before its messages were in"
    facts = Injected(topic=topic, windows=[a, a + WINDOW], pid=pid, resent_seqs=[6, 7],
                     resent_offsets=[offsets["r1"], offsets["r2"]], forged_offset=offsets["forged"],
                     unaudited_offsets=[offsets["plain1"], offsets["plain2"], offsets["garbage"]],
                     acked_a=8, acked_b=3)
    return facts, ledger


def _e2e_config(root: Path, name: str, kafka_bootstrap: str, topic: str, ledger: Path) -> Path:
    return _write_config(root / name / "msgaudit.yaml", {
        "home": str(root / name / ".msgaudit"),
        "lake": str(root / name / "lake"),
        "ledger_dir": str(ledger),
        "report_store": f"sqlite:///{root / name / 'report.db'}",
        "kafka": {"bootstrap.servers": kafka_bootstrap},
        "spark": {"master": "local[2]", "spark.sql.shuffle.partitions": "2", "spark.driver.memory": "1g"},
        "topics": {topic: {"window": "1m", "grace": "5s", "sla": {"max_duplicate_ratio": 0}}},
    })


def _rows(report_store: str, table: str, topic: str, ignored: set[str] = IGNORED) -> list[dict[str, Any]]:
    from audit.serving.report_store import ReportStore

    with ReportStore(report_store) as store:
        return [{k: v for k, v in r.items() if k not in ignored} for r in store.read(table, topic=topic)]


@pytest.fixture(scope="module")
def submit_entry_point() -> Path:
    path = airflow_env.REPO / "spark_jobs" / "pipeline" / "submit.py"
    if not path.exists():
        pytest.fail("spark_jobs/pipeline/submit.py (the spark-submit entry point) does not exist yet")
    return path


@pytest.fixture(scope="module")
def e2e(submit_entry_point: Path, injected: tuple[Injected, Path], kafka_bootstrap: str, dagbag: Any,
        airflow_home: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """Two scheduled runs (A, B) on one lake + report store, one backfill over A..B on another
    (a scheduled run is one spark-submit, the backfill two: the empty window's zero rows are
    held by the reconcile tests); then one `msgaudit follow` tick over B posting its event to
    Airflow's REST API app on this metadata db (its Spark steps no-ops: the scheduled runs wrote the
    window's rows), and the downstream run it starts."""
    from dataclasses import replace

    from audit.core import config as config_mod
    from audit.core.config import AirflowConfig
    from audit.serving.completeness import asset_uri
    from spark_jobs.pipeline.follow import follow

    facts, ledger = injected
    root = tmp_path_factory.mktemp("e2e-runs")
    # Each side gets its own copy of the ledger, so ingest bookkeeping cannot leak between them.
    shutil.copytree(ledger, root / "ledger-scheduled")
    shutil.copytree(ledger, root / "ledger-backfill")
    scheduled = _e2e_config(root, "scheduled", kafka_bootstrap, facts.topic, root / "ledger-scheduled")
    backfill = _e2e_config(root, "backfill", kafka_bootstrap, facts.topic, root / "ledger-backfill")
    alert_log = root / "alerts.jsonl"
    variables = {"msgaudit_config": str(scheduled), "msgaudit_alert_log": str(alert_log)}
    runs, downstream = [], []
    asset = asset_uri(kafka_bootstrap, facts.topic)
    with pytest.MonkeyPatch.context() as mp:  # the example downstream DAG waits for this topic's events
        mp.setenv("MSGAUDIT_DOWNSTREAM_ASSET", asset)
        for w in facts.windows:  # each as soon as its window is final (as a scheduler would start it)
            _wait_until(w + WINDOW + GRACE + timedelta(seconds=1))
            runs.append(run_dag(dagbag, "msgaudit_window_1m", variables,
                                logical_date=w + WINDOW + timedelta(seconds=30)))
            # what the scheduler does with the window's event: a run of the DAG scheduled on the asset
            downstream.append(airflow_env.run_asset_triggered(fresh_dag(dagbag, "msgaudit_downstream_example")))
        events = airflow_env.asset_events(asset)
        alerts_after_scheduled = alert_log.read_text().splitlines() if alert_log.exists() else []
        bf = run_dag(dagbag, "msgaudit_backfill", {**variables, "msgaudit_config": str(backfill)},
                     conf={"start": facts.windows[0].isoformat(), "end": (facts.windows[1] + WINDOW).isoformat()})
        backfill_events = airflow_env.asset_events(asset)[len(events):]
        # the run the backfill's events start (how many of them it takes depends on when Airflow
        # queued it: the ones after that go to the next run)
        downstream.append(airflow_env.run_asset_triggered(fresh_dag(dagbag, "msgaudit_downstream_example")))
        follow_lines: list[str] = []
        with airflow_env.api_server(airflow_home) as url:
            cfg = replace(config_mod.load(scheduled), home=root / "follow-home", airflow=AirflowConfig(
                url=url, username=airflow_env.API_USER, password=airflow_env.API_PASSWORD))
            followed = follow(None, cfg, since=facts.windows[1], once=True, steps=[], ingest=lambda *_: None,
                              clock=lambda: facts.windows[1] + WINDOW + GRACE + timedelta(seconds=1),
                              say=follow_lines.append, warn=follow_lines.append)
        follow_events = airflow_env.asset_events(asset)[len(events) + len(backfill_events):]
        downstream.append(airflow_env.run_asset_triggered(fresh_dag(dagbag, "msgaudit_downstream_example")))
    yield {
        "facts": facts, "runs": runs, "backfill": bf, "events": events, "downstream": downstream,
        "backfill_events": backfill_events, "follow": followed, "follow_events": follow_events,
        "follow_lines": follow_lines,
        "scheduled_store": config_mod.load(scheduled).report_store,
        "backfill_store": config_mod.load(backfill).report_store,
        "alerts_scheduled": [json.loads(line) for line in alerts_after_scheduled],
        "alerts_all": [json.loads(line) for line in alert_log.read_text().splitlines()],
    }


def _report_row(facts: Injected, w: datetime, **counts: int) -> dict[str, Any]:
    from audit.core.vocabulary import ANOMALY_CODES_BY_STAGE, REPORT_CODE_COLUMNS

    row: dict[str, Any] = {"window_start": w, "window_end": w + WINDOW, "topic": facts.topic, "partition": 0,
                           "stage": "log", "lost": 0, "duplicated": 0, "reordered": 0, "pending": 0,
                           "status": "final"}
    row.update({c: (0 if c in ANOMALY_CODES_BY_STAGE["log"] else None) for c in REPORT_CODE_COLUMNS})
    row.update(counts)
    return row


@pytest.mark.airflow
@pytest.mark.e2e
def test_scheduled_run_reports_the_injected_anomalies(e2e: dict[str, Any]) -> None:
    facts: Injected = e2e["facts"]
    a, b = facts.windows
    report = _rows(e2e["scheduled_store"], "audit_partition_report", facts.topic)
    assert report == [
        _report_row(facts, a, expected=facts.acked_a, delivered=facts.acked_a, duplicated=1,
                    duplicate_in_log=1, content_duplicate=2, unaudited=3),
        _report_row(facts, b, expected=facts.acked_b, delivered=facts.acked_b),
    ]
    anomalies = sorted((r["window_start"], r["stage"], r["anomaly"], r["seq"], r["offset"])
                       for r in _rows(e2e["scheduled_store"], "audit_anomalies", facts.topic))
    assert anomalies == sorted(
        [(a, "log", "content_duplicate", s, o) for s, o in zip(facts.resent_seqs, facts.resent_offsets, strict=True)]
        + [(a, "log", "duplicate_in_log", 0, facts.forged_offset)]
        + [(a, "log", "unaudited", None, o) for o in facts.unaudited_offsets])


@pytest.mark.airflow
@pytest.mark.e2e
def test_sla_breach_fails_the_run_and_fires_one_alert(e2e: dict[str, Any]) -> None:
    facts: Injected = e2e["facts"]
    a = facts.windows[0]
    run_a, run_b = e2e["runs"]
    assert run_a.state == "failed"
    assert {k: v for k, v in run_a.states.items()} == {  # publish (a teardown) does not decide the run's state
        ("plan", -1): "success", ("wait_for_grace", -1): "success", ("window", -1): "failed",
        ("publish", -1): "success"}
    assert run_b.state == "success"
    [alert] = e2e["alerts_scheduled"]
    assert (alert["dag_id"], alert["task_id"], alert["step"], alert["sla_breach"], alert["exit_code"]) == (
        "msgaudit_window_1m", "window", "window", True, 3)
    assert (alert["window_start"], alert["window_end"]) == (a.isoformat(), (a + WINDOW).isoformat())
    assert alert["failed_rules"] == [{
        "window_start": a.isoformat(), "topic": facts.topic, "partition": 0, "stage": "log",
        "rule": "max_duplicate_ratio", "observed": 1 / facts.acked_a, "threshold": 0.0, "severity": "error"}]


@pytest.mark.airflow
@pytest.mark.e2e
def test_backfill_over_two_windows_equals_two_scheduled_runs(e2e: dict[str, Any]) -> None:
    facts: Injected = e2e["facts"]
    bf: RunResult = e2e["backfill"]
    new_alerts = e2e["alerts_all"][len(e2e["alerts_scheduled"]):]
    why = (bf.states, [(x["task_id"], x["map_index"], x["error"]) for x in new_alerts])
    # window A breaches its SLA here too: the one backfill submission runs both windows, then fails
    assert bf.state == "failed", why
    assert bf.states == {("plan", -1): "success", ("ingest", -1): "success", ("backfill", -1): "failed",
                         ("publish", -1): "success"}, why
    for table in ("audit_partition_report", "audit_anomalies", "sla_results"):
        scheduled = _rows(e2e["scheduled_store"], table, facts.topic, WALL_CLOCK)
        assert scheduled  # the comparison below must compare something
        assert _rows(e2e["backfill_store"], table, facts.topic, WALL_CLOCK) == scheduled, table
    sla = _rows(e2e["scheduled_store"], "sla_results", facts.topic, WALL_CLOCK)
    assert {r["checked_at"] for r in sla if r["window_start"] == facts.windows[0]} == {
        facts.windows[0] + WINDOW + GRACE}  # checked_at is the window's as_of, not the wall clock
    report = _rows(e2e["scheduled_store"], "audit_partition_report", facts.topic, WALL_CLOCK)
    assert all(r["latency_p99_ms"] is not None for r in report if r["expected"])  # latency compared too
    [alert] = new_alerts  # not retried: one alert, naming the range and the rule that failed in it
    assert (alert["dag_id"], alert["task_id"], alert["map_index"], alert["step"], alert["sla_breach"],
            alert["exit_code"]) == ("msgaudit_backfill", "backfill", -1, "backfill", True, 3)
    assert (alert["window_start"], alert["window_end"]) == (
        facts.windows[0].isoformat(), (facts.windows[1] + WINDOW).isoformat())
    assert [(r["window_start"], r["rule"]) for r in alert["failed_rules"]] == [
        (facts.windows[0].isoformat(), "max_duplicate_ratio")]


def _window_extras(facts: Injected) -> tuple[dict[str, Any], dict[str, Any]]:
    """The completeness events' extras of window A (its SLA breached: a duplicate in the log) and B (clean)."""
    def extra(w: datetime, acked: int, exactly_once: bool, **anomalies: int) -> dict[str, Any]:
        log = {"expected": acked, "delivered": acked, "lost": 0, "duplicated": anomalies.get("duplicate_in_log", 0),
               "reordered": 0, "pending": 0, "anomalies": anomalies, "complete": True, "exactly_once": exactly_once}
        return {"topic": facts.topic, "window_start": w.isoformat(), "window_end": (w + WINDOW).isoformat(),
                "as_of": (w + WINDOW + GRACE).isoformat(), "complete": True, "exactly_once": exactly_once,
                "stages": {"log": log}}

    a, b = facts.windows
    return (extra(a, facts.acked_a, False, content_duplicate=2, duplicate_in_log=1, unaudited=3),
            extra(b, facts.acked_b, True))


@pytest.mark.airflow
@pytest.mark.e2e
def test_backfill_and_follow_emit_the_scheduled_runs_events_and_follows_start_the_downstream_dag(
        e2e: dict[str, Any]) -> None:
    """The backfill DAG's `publish` emits A's and B's events with the scheduled runs' extras (through
    its own alias); one `msgaudit follow` tick posts B's to the real Airflow API (which marks it
    `from_rest_api`). The downstream runs after them consume each event once, in order, and the run
    that follow's event starts loads: B was complete and exactly once."""
    facts: Injected = e2e["facts"]
    b = facts.windows[1]
    extra_a, extra_b = _window_extras(facts)
    bf: RunResult = e2e["backfill"]
    assert e2e["backfill_events"] == [
        {"dag_id": "msgaudit_backfill", "run_id": bf.run_id, "task_id": "publish", "extra": x}
        for x in (extra_a, extra_b)]
    assert [x["extra"] for x in bf.xcom[("publish", -1, "return_value")]] == [extra_a, extra_b]
    rest_b = {**extra_b, "from_rest_api": True}
    assert e2e["follow_events"] == [{"dag_id": None, "run_id": None, "task_id": None, "extra": rest_b}]
    followed = e2e["follow"]
    assert (followed.done, followed.events_sent, followed.events_failed) == ([(facts.topic, b)], 1, 0)
    assert [line for line in e2e["follow_lines"] if "airflow" in line] == []
    after_backfill, after_follow = e2e["downstream"][2:]
    assert after_backfill["consumed"] + after_follow["consumed"] == [extra_a, extra_b, rest_b]
    assert after_follow["consumed"][-1] == rest_b
    assert {k: after_follow[k] for k in ("state", "run_type", "states")} == {
        "state": "success", "run_type": "asset_triggered", "states": {"exactly_once": "success", "load": "success"}}
    assert after_follow["returned"]["load"] == [{k: e[k] for k in ("topic", "window_start", "window_end")}
                                                for e in after_follow["consumed"]]


@pytest.mark.airflow
@pytest.mark.e2e
def test_each_final_window_emits_its_completeness_event_and_starts_the_downstream_dag(e2e: dict[str, Any]) -> None:
    """Window A (its SLA breached: a duplicate in the log) and window B (clean) each emit one event on
    the topic's asset with the window's exact counts; each starts a run of the example downstream DAG
    (made by the scheduler's own code), whose gate stops A's run and lets B's load."""
    facts: Injected = e2e["facts"]
    b = facts.windows[1]
    extra_a, extra_b = _window_extras(facts)
    run_a, run_b = e2e["runs"]
    assert (run_a.states[("publish", -1)], run_b.states[("publish", -1)]) == ("success", "success")
    assert e2e["events"] == [
        {"dag_id": "msgaudit_window_1m", "run_id": run.run_id, "task_id": "publish", "extra": x}
        for run, x in ((run_a, extra_a), (run_b, extra_b))]
    assert e2e["downstream"][:2] == [
        {"state": "success", "run_type": "asset_triggered", "consumed": [extra_a],
         "states": {"exactly_once": "success", "load": "skipped"}, "returned": {}},
        {"state": "success", "run_type": "asset_triggered", "consumed": [extra_b],
         "states": {"exactly_once": "success", "load": "success"},
         "returned": {"exactly_once": True, "load": [
             {"topic": facts.topic, "window_start": b.isoformat(), "window_end": (b + WINDOW).isoformat()}]}}]
