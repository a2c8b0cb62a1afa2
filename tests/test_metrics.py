"""Prometheus metrics of the report store: the exposition (names, labels, values) of known published
rows; the textfile and Pushgateway outputs; the shipped alerting rules (promtool) and Grafana
dashboard; and a real Prometheus scraping `msgaudit follow`'s /metrics, asserted with PromQL."""

from __future__ import annotations

import json
import subprocess
import time
import urllib.request
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from audit.core import config as config_mod
from audit.core.config import Config
from audit.core.errors import ConfigError
from audit.core.vocabulary import REPORT_CODE_COLUMNS
from audit.runtime.local_kafka import free_port
from audit.serving import metrics
from audit.serving.report_store import ReportStore
from tests.support.monitoring import binary, prometheus, pushgateway, query, samples

ROOT = Path(__file__).resolve().parent.parent
RULES = ROOT / "audit" / "serving" / "monitoring" / "prometheus" / "msgaudit-rules.yml"
DASHBOARD = ROOT / "audit" / "serving" / "monitoring" / "grafana" / "msgaudit-dashboard.json"
W0 = datetime(2026, 11, 21, 10, tzinfo=UTC)
W1 = W0 + timedelta(hours=1)
LOG_CODES = ("lost_acked", "unverifiable", "ghost_write", "duplicate_in_log", "reordered_in_log", "unledgered",
             "seq_gap", "unaudited", "content_duplicate", "aborted")


def report(ws: datetime, partition: int, stage: str, expected: int, delivered: int, *, lost: int = 0,
           duplicated: int = 0, p99: float | None = 20.0, status: str = "final", **codes: int) -> dict[str, Any]:
    """An `audit_partition_report` row as reconcile publishes it: the stage kind's codes 0 unless given,
    the other kinds' null."""
    kind_codes = LOG_CODES if stage == "log" else ("missed", "redelivered")
    row: dict[str, Any] = {
        "window_start": ws, "window_end": ws + timedelta(hours=1), "topic": "orders", "partition": partition,
        "stage": stage, "expected": expected, "delivered": delivered, "lost": lost, "duplicated": duplicated,
        "reordered": 0, "pending": 0, "latency_p50_ms": None if p99 is None else 5.0,
        "latency_p95_ms": None if p99 is None else 10.0, "latency_p99_ms": p99,
        "latency_max_ms": None if p99 is None else 2 * p99, "status": status, "run_id": "r", "computed_at": ws + timedelta(hours=1, minutes=15)}
    row.update({c: (codes.get(c, 0) if c in kind_codes else None) for c in REPORT_CODE_COLUMNS})
    return row


def sla(ws: datetime, partition: int, stage: str, rule: str, passed: bool) -> dict[str, Any]:
    return {"window_start": ws, "topic": "orders", "partition": partition, "stage": stage, "rule": rule,
            "observed": 0.0 if passed else 1.0, "threshold": 0.0, "passed": passed, "severity": "error",
            "checked_at": ws + timedelta(hours=1, minutes=15)}


def publish_known(store_url: str) -> None:
    """Two final windows and a provisional one, through the report store's publish (`replace_window`):
    window 10:00 lost one acknowledged message at the log in partition 1; window 11:00 had a group
    redelivery; window 12:00 is provisional (not counted)."""
    w2 = W1 + timedelta(hours=1)
    with ReportStore(store_url) as store:
        store.replace_window("audit_partition_report", "orders", W0, [
            report(W0, 0, "log", 5, 5), report(W0, 1, "log", 4, 3, lost=1, lost_acked=1, p99=250.0),
            report(W0, 0, "group:loader", 5, 5), report(W0, 1, "group:loader", 3, 3)])
        store.replace_window("audit_partition_report", "orders", W1, [
            report(W1, 0, "log", 2, 2, p99=40.0), report(W1, 0, "group:loader", 2, 2, duplicated=1, redelivered=1,
                                                         p99=1500.0)])
        store.replace_window("audit_partition_report", "orders", w2, [report(w2, 0, "log", 7, 7, status="provisional")])
        store.replace_window("sla_results", "orders", W0, [
            sla(W0, 0, "log", "max_lost", True), sla(W0, 1, "log", "max_lost", False)])
        store.replace_window("sla_results", "orders", W1, [
            sla(W1, 0, "log", "max_lost", True), sla(W1, 0, "group:loader", "max_lost", True),
            sla(W1, 0, "group:loader", "max_duplicate_ratio", False)])


# What those rows expose: (name, labels) -> value.
EXPECTED: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}


def _add(name: str, value: float, **labels: str) -> None:
    EXPECTED[(name, tuple(sorted(labels.items())))] = value


for _stage, _exp, _dlv, _lost, _dup in (("log", 11, 10, 1, 0), ("group:loader", 10, 10, 0, 1)):
    _add("msgaudit_messages_expected_total", _exp, topic="orders", stage=_stage)
    _add("msgaudit_messages_delivered_total", _dlv, topic="orders", stage=_stage)
    _add("msgaudit_messages_lost_total", _lost, topic="orders", stage=_stage)
    _add("msgaudit_messages_duplicated_total", _dup, topic="orders", stage=_stage)
    _add("msgaudit_messages_reordered_total", 0, topic="orders", stage=_stage)
for _code in LOG_CODES:
    _add("msgaudit_anomalies_total", 1 if _code == "lost_acked" else 0, topic="orders", stage="log", code=_code)
_add("msgaudit_anomalies_total", 0, topic="orders", stage="group:loader", code="missed")
_add("msgaudit_anomalies_total", 1, topic="orders", stage="group:loader", code="redelivered")
_add("msgaudit_window_final_timestamp_seconds", (W1 + timedelta(hours=1)).timestamp(), topic="orders")
for _stage, _p99 in (("log", 0.04), ("group:loader", 1.5)):
    for _q, _v in (("0.5", 0.005), ("0.95", 0.01), ("0.99", _p99), ("1", 2 * _p99)):
        _add("msgaudit_latency_seconds", _v, topic="orders", stage=_stage, quantile=_q)
_add("msgaudit_sla_ok", 1, topic="orders", stage="log", rule="max_lost")
_add("msgaudit_sla_ok", 1, topic="orders", stage="group:loader", rule="max_lost")
_add("msgaudit_sla_ok", 0, topic="orders", stage="group:loader", rule="max_duplicate_ratio")
_add("msgaudit_report_store_up", 1)


def make_cfg(tmp_path: Path, **metrics_conf: Any) -> Config:
    return config_mod.from_dict({"report_store": f"sqlite:///{tmp_path / 'report.db'}", "metrics": metrics_conf,
                                 "topics": {"orders": {"window": "1h", "grace": "15m"}}}, base=tmp_path)


@pytest.mark.unit
def test_the_exposition_of_known_published_rows(tmp_path: Path) -> None:
    cfg = make_cfg(tmp_path)
    publish_known(cfg.report_store)
    text = metrics.exposition(cfg)
    assert samples(text) == EXPECTED
    assert "# TYPE msgaudit_messages_expected_total counter" in text
    assert "# TYPE msgaudit_sla_ok gauge" in text
    assert sorted({name for name, _ in EXPECTED}) == sorted(metrics.METRIC_NAMES)


@pytest.mark.unit
def test_partition_is_an_opt_in_label_of_the_counters(tmp_path: Path) -> None:
    cfg = make_cfg(tmp_path, partition_label=True)
    publish_known(cfg.report_store)
    got = samples(metrics.exposition(cfg))
    lost = {labels: v for (name, labels), v in got.items() if name == "msgaudit_messages_lost_total"}
    assert lost == {(("partition", "0"), ("stage", "group:loader"), ("topic", "orders")): 0,
                    (("partition", "1"), ("stage", "group:loader"), ("topic", "orders")): 0,
                    (("partition", "0"), ("stage", "log"), ("topic", "orders")): 0,
                    (("partition", "1"), ("stage", "log"), ("topic", "orders")): 1}
    assert got[("msgaudit_anomalies_total", (("code", "lost_acked"), ("partition", "1"), ("stage", "log"),
                                             ("topic", "orders")))] == 1
    # the gauges keep their labels
    assert ("msgaudit_sla_ok", (("rule", "max_lost"), ("stage", "log"), ("topic", "orders"))) in got


@pytest.mark.unit
def test_an_unreadable_report_store_is_a_zero_not_a_failed_scrape(tmp_path: Path) -> None:
    cfg = config_mod.from_dict({"report_store": f"postgresql+psycopg://nobody@127.0.0.1:{free_port()}/none"})
    assert samples(metrics.exposition(cfg)) == {("msgaudit_report_store_up", ()): 0}


@pytest.mark.unit
def test_each_step_writes_the_textfile(tmp_path: Path) -> None:
    from spark_jobs.pipeline.steps import publish_metrics

    cfg = make_cfg(tmp_path, textfile="node/msgaudit.prom")
    assert cfg.metrics.textfile == tmp_path / "node" / "msgaudit.prom"
    publish_known(cfg.report_store)
    publish_metrics(cfg)
    assert samples(cfg.metrics.textfile.read_text()) == EXPECTED


@pytest.mark.e2e
def test_each_step_pushes_to_a_real_pushgateway(tmp_path: Path) -> None:
    from spark_jobs.pipeline.steps import publish_metrics

    with pushgateway() as gateway:
        cfg = make_cfg(tmp_path, pushgateway=gateway, job="msgaudit-test")
        publish_known(cfg.report_store)
        publish_metrics(cfg)
        with urllib.request.urlopen(f"{gateway}/metrics", timeout=5) as resp:
            pushed = samples(resp.read().decode())
    ours = {(name, tuple(kv for kv in labels if kv[0] not in ("job", "instance"))): v
            for (name, labels), v in pushed.items() if ("job", "msgaudit-test") in labels
            and name.startswith("msgaudit_")}
    assert ours == EXPECTED


@pytest.mark.unit
def test_a_metrics_port_in_use_is_one_line(tmp_path: Path) -> None:
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        cfg = make_cfg(tmp_path, port=port, address="127.0.0.1")
        with pytest.raises(ConfigError) as e:
            metrics.serve(cfg)
    assert str(e.value).startswith(f"<dict>: metrics.port: cannot listen on 127.0.0.1:{port}: ")
    assert str(e.value).endswith("(choose a free port)") and "\n" not in str(e.value)


@pytest.mark.unit
@pytest.mark.parametrize(("conf", "message"), [
    ({"listen": 9464}, "metrics: unknown key 'listen' (allowed: port, address, textfile, pushgateway, job, "
                       "partition_label)"),
    ({"port": "9464x"}, "metrics.port: expected a TCP port (1-65535), got '9464x'"),
    ({"textfile": "m.txt"}, "metrics.textfile: expected a file name ending in .prom (node_exporter reads only "
                            "those), got 'm.txt'"),
    ({"pushgateway": "pushgw:9091"}, "metrics.pushgateway: expected an http:// or https:// URL, got 'pushgw:9091'"),
    ({"partition_label": "yes"}, "metrics.partition_label: expected true or false, got 'yes'"),
])
def test_bad_metrics_config_is_one_line(tmp_path: Path, conf: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as e:
        make_cfg(tmp_path, **conf)
    assert str(e.value) == f"<dict>: {message}"


@pytest.mark.e2e
def test_the_shipped_alerting_rules_pass_promtool_check_and_their_unit_tests() -> None:
    promtool = binary("promtool", "prometheus")
    check = subprocess.run([promtool, "check", "rules", str(RULES)], capture_output=True, text=True)
    assert check.returncode == 0 and "SUCCESS: 5 rules found" in check.stdout, check.stdout + check.stderr
    unit = subprocess.run([promtool, "test", "rules", RULES.with_suffix(".test.yml").name], capture_output=True,
                          text=True, cwd=RULES.parent)
    assert unit.returncode == 0 and "SUCCESS" in unit.stdout, unit.stdout + unit.stderr


def dashboard_queries() -> list[str]:
    """Every PromQL expression of the Grafana dashboard, its variables filled in."""
    dash = json.loads(DASHBOARD.read_text())
    assert [v["name"] for v in dash["templating"]["list"]] == ["datasource", "topic"]
    return [t["expr"].replace("$topic", ".*").replace("$__range", "1h")
            for p in dash["panels"] for t in p["targets"]]


def _wait(what: Callable[[], bool], seconds: float = 30.0) -> None:
    deadline = time.monotonic() + seconds
    while not what():
        if time.monotonic() > deadline:
            raise AssertionError(f"not true after {seconds:.0f} s")
        time.sleep(0.2)


@pytest.mark.e2e
def test_prometheus_scrapes_follow_and_promql_gives_the_published_figures(tmp_path: Path) -> None:
    """`msgaudit follow` (its steps replaced by the report store's publish of known rows) serves
    /metrics while it sleeps between windows; a real Prometheus scrapes it and evaluates the shipped
    rules; PromQL over its HTTP API returns exactly the published figures."""
    from spark_jobs.pipeline.follow import follow

    port = free_port()
    cfg = make_cfg(tmp_path, port=port, address="127.0.0.1")
    published: list[datetime] = []

    def step(spark: Any, c: Config, topics: tuple[str, ...], ws: datetime, we: datetime, as_of: datetime) -> None:
        if not published:
            publish_known(c.report_store)
        published.append(ws)

    step.per_window = True  # type: ignore[attr-defined]
    checked: list[str] = []
    now = [W1 + timedelta(hours=1, minutes=20)]

    def sleep(seconds: float) -> None:  # follow sleeps until the next window: Prometheus scrapes it now
        with prometheus(f"127.0.0.1:{port}", [RULES]) as prom:
            _wait(lambda: query(prom, "msgaudit_report_store_up") != [])

            def value(promql: str) -> float:
                (only,) = query(prom, promql)
                return float(only["value"][1])

            assert value('msgaudit_messages_expected_total{topic="orders",stage="log"}') == 11
            assert value('msgaudit_messages_delivered_total{topic="orders",stage="log"}') == 10
            assert value('sum(msgaudit_messages_lost_total{topic="orders"})') == 1
            assert value('msgaudit_anomalies_total{topic="orders",stage="log",code="lost_acked"}') == 1
            assert value('sum by (code) (msgaudit_anomalies_total{stage="group:loader",code="redelivered"})') == 1
            assert value('msgaudit_window_final_timestamp_seconds{topic="orders"}') == (W1 + timedelta(hours=1)).timestamp()
            assert value('msgaudit_latency_seconds{topic="orders",stage="group:loader",quantile="0.99"}') == 1.5
            assert sorted((r["metric"]["stage"], r["metric"]["rule"]) for r in query(prom, "msgaudit_sla_ok == 0")) == [
                ("group:loader", "max_duplicate_ratio")]
            assert len(query(prom, '{__name__=~"msgaudit_.*", job="msgaudit"}')) == len(EXPECTED)
            for promql in dashboard_queries():
                query(prom, promql)  # each parses and runs (status success)
            # the shipped rule fires on the failed SLA rule, with its labels
            def firing() -> list[dict[str, str]]:
                alerts = json.loads(urllib.request.urlopen(f"{prom}/api/v1/alerts").read())
                return [a["labels"] for a in alerts["data"]["alerts"] if a["state"] == "firing"]

            _wait(lambda: firing() != [])
            assert firing() == [{"alertname": "MsgauditSlaFailed", "instance": f"127.0.0.1:{port}", "job": "msgaudit",
                                 "rule": "max_duplicate_ratio", "severity": "error", "stage": "group:loader",
                                 "topic": "orders"}]
            checked.append("scraped")
        now[0] += timedelta(seconds=seconds)

    said: list[str] = []
    follow(None, cfg, since=W0, topics=["orders"], steps=[("x", step)], ingest=lambda s, c: None,
           clock=lambda: now[0], sleep=sleep, say=said.append, warn=said.append, max_ticks=2)
    assert checked == ["scraped"]
    assert said[1] == f"follow: metrics at http://127.0.0.1:{port}/metrics"
    with pytest.raises(OSError):  # follow stopped serving when it returned
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)
