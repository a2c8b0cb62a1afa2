"""Config parsing: typed objects, ${ENV} interpolation, errors that name the bad key and file."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest

from audit.core import config
from audit.core.config import SlaRule
from audit.core.errors import ConfigError

pytestmark = pytest.mark.unit

GOOD = """
lake: ./lake
report_store: sqlite:///report.db
kafka: {bootstrap.servers: "127.0.0.1:9092", sasl.password: "${MSGAUDIT_TEST_SECRET}"}
spark: {master: "local[2]"}
topics:
  orders:
    window: 1h
    grace: 15m
    sla: {max_lost: 0, max_duplicate_ratio: 0, max_reordered: 0,
          max_p99_latency_ms: {threshold: 60000, severity: warn}}
    groups: [orders-loader]
    sinks:
      - {name: orders_table, format: delta, location: ./sinks/orders, group: orders-loader}
      - {name: orders_sql, format: sql, url: "sqlite:///sink.db", table: orders, columns: {seq: my_seq}}
"""


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "msgaudit.yaml"
    p.write_text(text)
    return p


def test_full_example_parses_into_typed_objects(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MSGAUDIT_TEST_SECRET", "s3cret")
    cfg = config.load(write(tmp_path, GOOD))
    assert cfg.lake == str((tmp_path / "lake").resolve())
    assert cfg.report_store == f"sqlite:///{(tmp_path / 'report.db').resolve()}"
    assert cfg.kafka == {"bootstrap.servers": "127.0.0.1:9092", "sasl.password": "s3cret"}
    assert cfg.spark_master == "local[2]"
    t = cfg.topic("orders")
    assert (t.window, t.grace, t.lookback_or_window) == (timedelta(hours=1), timedelta(minutes=15), timedelta(hours=1))
    assert t.sla == (
        SlaRule("max_lost", 0.0, "error"),
        SlaRule("max_duplicate_ratio", 0.0, "error"),
        SlaRule("max_reordered", 0.0, "error"),
        SlaRule("max_p99_latency_ms", 60000.0, "warn"),
    )
    assert t.groups == ("orders-loader",)
    delta, sql = t.sinks
    assert (delta.name, delta.format, delta.group, delta.location) == (
        "orders_table", "delta", "orders-loader", str((tmp_path / "sinks/orders").resolve()))
    assert (sql.table, sql.column("seq"), sql.column("offset")) == ("orders", "my_seq", "audit_offset")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("lakes: ./x\n", "unknown key 'lakes'"),
        ("topics: {orders: {windw: 1h}}\n", "topics.orders: unknown key 'windw'"),
        ("topics: {orders: {window: soon}}\n", "topics.orders.window: expected a duration"),
        ("topics: {orders: {window: 7m}}\n", "must divide a day evenly"),
        ("topics: {orders: {sla: {max_lots: 0}}}\n", "topics.orders.sla: unknown key 'max_lots'"),
        ("topics: {orders: {sla: {max_lost: {threshold: 0, severity: fatal}}}}\n", "severity: expected 'error' or 'warn'"),
        ("topics: {orders: {sinks: [{name: s, format: csv}]}}\n", "sinks[0].format: expected 'delta', 'sql' or 'iceberg'"),
        ("topics: {orders: {sinks: [{name: s, format: delta}]}}\n", "a delta sink needs 'location'"),
        ("topics: {orders: {groups: [g], sinks: [{name: s, format: delta, location: x, group: h}]}}\n",
         "fed by group 'h', which is not in groups"),
        ("kafka: {sasl.password: '${MSGAUDIT_SURELY_UNSET_VAR}'}\n", "${MSGAUDIT_SURELY_UNSET_VAR} is not set"),
        ("report_store: nowhere\n", "expected a SQLAlchemy URL"),
        ("- a\n- b\n", "expected a mapping at the top level"),
        ("topics: [\n", "not valid YAML"),
        ("reconcile: {driver_rows: 10}\n", "reconcile: unknown key 'driver_rows' (allowed: engine)"),
        ("reconcile: {engine: columnar}\n",
         "reconcile.engine: expected one of auto, driver, spark (auto: the driver for small windows"),
        ("reconcile: {engine: true}\n", "reconcile.engine: expected one of auto, driver, spark"),
        ("airflow: {host: x}\n", "airflow: unknown key 'host' (allowed: url, token, username, password, timeout)"),
        ("airflow: {url: airflow:8080}\n", "airflow.url: expected an http:// or https:// URL"),
        ("airflow: {token: abc}\n", "airflow: token set without url; add airflow.url"),
        ("airflow: {url: 'http://a:8080', token: t, username: u, password: p}\n",
         "airflow: set either token or username + password, not both"),
        ("airflow: {url: 'http://a:8080', username: u}\n", "airflow: username and password go together"),
        ("airflow: {url: 'http://a:8080', token: ''}\n", "airflow.token: expected a non-empty string"),
        ("airflow: {url: 'http://a:8080', timeout: soon}\n", "airflow.timeout: expected a duration"),
    ],
)
def test_bad_config_names_file_and_key(tmp_path: Path, text: str, message: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        config.load(path)
    assert message in str(err.value)
    assert str(path) in str(err.value)


def test_airflow_section_reads_url_and_credentials_and_never_shows_the_password(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MSGAUDIT_TEST_AIRFLOW_PASSWORD", "hunter2")
    cfg = config.load(write(tmp_path, "airflow: {url: 'http://airflow:8080/', username: msgaudit, "
                                      "password: '${MSGAUDIT_TEST_AIRFLOW_PASSWORD}', timeout: 3s}\n"))
    a = cfg.airflow
    assert (a.url, a.token, a.username, a.password, a.timeout) == (
        "http://airflow:8080", None, "msgaudit", "hunter2", timedelta(seconds=3))
    assert "hunter2" not in repr(cfg)
    assert config.load(write(tmp_path, "topics: {}\n")).airflow == config.AirflowConfig()  # off by default


def test_missing_explicit_file_is_an_error_but_no_file_means_defaults(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match="config file not found"):
        config.load(tmp_path / "nope.yaml")
    monkeypatch.chdir(tmp_path)
    cfg = config.load(None)
    assert cfg.source == "<defaults>"
    assert cfg.lake == str((tmp_path / ".msgaudit" / "lake").resolve())
    assert cfg.kafka == {"bootstrap.servers": "127.0.0.1:9092"}
    assert dict(cfg.topics) == {}
    assert cfg.engine == "auto"
    assert [config.from_dict({"reconcile": {"engine": e}}).engine for e in config.ENGINES] == ["auto", "driver", "spark"]


def test_unknown_topic_lists_the_configured_ones(tmp_path: Path) -> None:
    cfg = config.load(write(tmp_path, "topics: {a: {}, b: {}}\n"))
    with pytest.raises(ConfigError, match=r"unknown topic 'c' \(configured: a, b\)"):
        cfg.topic("c")


@pytest.mark.parametrize(("spark", "memory", "gc"), [
    ("{}", "4g", "Parallel"),  # local[2]: the driver's JVM runs the tasks
    ("{master: 'local[*]'}", "4g", "Parallel"),
    ("{master: 'spark://10.0.0.5:7077'}", "2g", "Serial"),  # a cluster's driver runs none
    ("{master: 'spark://10.0.0.5:7077', spark.driver.memory: 6g}", "6g", "Serial"),
    ("{master: 'spark://10.0.0.5:7077', spark.driver.extraJavaOptions: '-XX:+UseG1GC'}", "2g", "G1"),
    ("{master: 'local[2]', spark.driver.memory: 1g}", "1g", "Parallel"),
])
def test_the_driver_jvm_defaults_by_master_and_a_set_one_is_kept(tmp_path: Path, spark: str, memory: str,
                                                                  gc: str) -> None:
    cfg = config.load(write(tmp_path, f"spark: {spark}\n"))
    assert cfg.driver_jvm == {"spark.driver.memory": memory, "spark.driver.extraJavaOptions": f"-XX:+Use{gc}GC"}


@pytest.mark.unit
def test_lake_and_delta_sinks_are_hadoop_uris_or_local_folders(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MSGAUDIT_TEST_S3_KEY", "AKIA-test")
    cfg = config.from_dict({
        "lake": "s3a://audit-bucket/lake/",
        "spark": {"spark.hadoop.fs.s3a.access.key": "${MSGAUDIT_TEST_S3_KEY}"},
        "topics": {"orders": {"groups": ["g"], "sinks": [
            {"name": "a", "format": "delta", "location": "abfss://c@acct.dfs.core.windows.net/orders"},
            {"name": "b", "format": "delta", "location": "tables/orders"},
            {"name": "c", "format": "delta", "location": "file:///srv/orders"}]}},
    }, base=tmp_path)
    assert cfg.lake == "s3a://audit-bucket/lake"
    assert cfg.spark["spark.hadoop.fs.s3a.access.key"] == "AKIA-test"
    assert [s.location for s in cfg.topic("orders").sinks] == [
        "abfss://c@acct.dfs.core.windows.net/orders", str((tmp_path / "tables" / "orders").resolve()),
        "/srv/orders"]  # file:///p is the plain local path (one spelling for Delta)
    assert config.join_location(cfg.lake, "_checkpoints", "ingest_x") == "s3a://audit-bucket/lake/_checkpoints/ingest_x"
    with pytest.raises(ConfigError, match=r"lake: 's3a://' names no bucket"):
        config.from_dict({"lake": "s3a://"}, base=tmp_path)
