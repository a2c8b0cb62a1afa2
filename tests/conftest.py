"""Shared fixtures: one real Kafka broker, one Delta-enabled SparkSession and one real PostgreSQL per
test session (each started only when a test asks for it), and a config factory pointing at them."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings

from audit.core import config as config_mod
from audit.core.config import Config
from audit.runtime.local_kafka import LocalKafka

# `pytest --hypothesis-profile=soak`: a long search of the property tests (tests/test_reconcile_property.py
# reads the profile to pick its own, larger example counts; at least an hour on two cores).
settings.register_profile("soak", max_examples=20_000, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

# py4j says at INFO when a gateway connection is garbage-collected, which can be after pytest closed the
# stream a handler writes to: a "Logging error" traceback at the end of the run, about nothing.
logging.getLogger("py4j").setLevel(logging.WARNING)


# The files that take minutes, longest first (the suite's --durations). `./dev test` hands files to its
# worker processes in collection order (--no-loadscope-reorder), so these start first and the short
# files fill in around them instead of one long file starting last.
LONG_FILES = ("test_dags.py", "test_lab_scenarios.py", "test_cluster.py", "test_capture.py", "test_lab_share.py",
              "test_connect_lab.py", "test_lab_mirror.py", "test_object_store.py", "test_trace.py",
              "test_reconcile_property.py", "test_secured.py", "test_architecture.py", "test_fleet.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONG_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONG_FILES)))  # stable: the rest keep their order


@pytest.fixture(scope="session")
def kafka_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalKafka]:
    """A real single-node KRaft broker on a free loopback port, from the cached jars."""
    broker = LocalKafka(tmp_path_factory.mktemp("kafka"), port=None, nodes=1)
    broker.start(timeout=180)  # a loaded shared machine can take minutes to start a JVM
    yield broker
    broker.stop()


@pytest.fixture(scope="session")
def kafka_bootstrap(kafka_cluster: LocalKafka) -> str:
    return kafka_cluster.bootstrap_servers


def new_topic(bootstrap: str, partitions: int = 1, prefix: str = "t", **topic_config: str) -> str:
    """Create a uniquely named topic (replication 1) and return its name."""
    from confluent_kafka.admin import AdminClient, NewTopic

    name = f"{prefix}-{uuid.uuid4().hex[:10]}"
    admin = AdminClient({"bootstrap.servers": bootstrap})
    cfg = {k.replace("_", "."): str(v) for k, v in topic_config.items()}
    admin.create_topics([NewTopic(name, partitions, 1, config=cfg)])[name].result(timeout=30)
    return name


def audit_topic(spark: Any, cfg: Any, topic: str, start: Any, end: Any,
                as_of: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Ingest, capture `topic` over [start, end) and reconcile it as of `as_of`, as the pipeline does;
    its `audit_anomalies` and `audit_partition_report` rows from the report store."""
    from audit.serving.report_store import ReportStore
    from spark_jobs.pipeline.steps import StepRange, run_step

    run_step(spark, cfg, "ingest", StepRange())
    run_step(spark, cfg, "capture", StepRange(start, end, (topic,)))
    run_step(spark, cfg, "reconcile", StepRange(start, end, (topic,), as_of))
    store = ReportStore(cfg.report_store)
    try:
        return store.read("audit_anomalies", topic=topic), store.read("audit_partition_report", topic=topic)
    finally:
        store.close()


@pytest.fixture(scope="session")
def spark(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """One Delta- and Kafka-ready local[2] SparkSession for the whole test run."""
    from spark_jobs.io.session import build_spark

    home = tmp_path_factory.mktemp("spark-home")
    cfg = config_mod.from_dict({"home": str(home), "spark": {"spark.sql.shuffle.partitions": "2",
                                                             "spark.default.parallelism": "2"}})
    session = build_spark(cfg, app_name="msgaudit-tests")
    yield session
    session.stop()


@pytest.fixture(scope="session")
def pg_url() -> Iterator[str]:
    """SQLAlchemy URL of a real PostgreSQL database (a private server started for this run)."""
    from tests.support.services import postgres_server

    with postgres_server() as url:
        yield url


@pytest.fixture
def make_config(request: pytest.FixtureRequest) -> Callable[..., Config]:
    """Factory: a Config whose lake, ledgers and report store live under tmp_path.

    Kafka points at the session broker only when the test also uses `kafka_bootstrap` (so pure
    Spark tests never start a broker).
    """

    def make(tmp_path: Path, topics: Mapping[str, Any] | None = None, **overrides: Any) -> Config:
        data: dict[str, Any] = {
            "home": str(tmp_path / ".msgaudit"),
            "lake": str(tmp_path / "lake"),
            "ledger_dir": str(tmp_path / "ledger"),
            "report_store": f"sqlite:///{tmp_path / 'report.db'}",
            "topics": dict(topics or {}),
        }
        if "kafka_bootstrap" in request.fixturenames:
            data["kafka"] = {"bootstrap.servers": request.getfixturevalue("kafka_bootstrap")}
        data.update(overrides)
        return config_mod.from_dict(data, source="<test>", base=tmp_path)

    return make


@pytest.fixture(scope="session")
def libmsgaudit() -> Path:
    """The librdkafka plugin, built once per test session (make rebuilds only on change)."""
    from audit.clients.plugin import build

    return build()


@pytest.fixture(scope="session")
def java_producer(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """`java -cp ... PlainProducer` (tests/support/java) with kafka-clients and the
    msgaudit-interceptors jar on the class path; the jar is built once (stamped by its sources)."""
    return _java_program(tmp_path_factory, "PlainProducer")


def _java_program(tmp_path_factory: pytest.TempPathFactory, name: str) -> list[str]:
    """`java -cp ... <name>` for tests/support/java/<name>.java with kafka-clients and the
    msgaudit-interceptors jar on the class path."""
    import subprocess

    from audit.runtime.jars import interceptors_jar, jars

    out = tmp_path_factory.mktemp(name)
    clients = [j for j in jars("kafka-broker") if j.name.startswith(("kafka-clients-", "slf4j-api-", "lz4-",
                                                                      "snappy-", "zstd-"))]
    cp = ":".join(str(j) for j in [*clients, interceptors_jar(build=True)])
    src = Path(__file__).parent / "support" / "java" / f"{name}.java"
    subprocess.run(["javac", "-cp", cp, "-d", str(out), str(src)], check=True, capture_output=True)
    return ["java", "-cp", f"{cp}:{out}", name]


@pytest.fixture(scope="session")
def java_consumer(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """A plain consumer-group member (tests/support/java/PlainConsumer.java)."""
    return _java_program(tmp_path_factory, "PlainConsumer")


@pytest.fixture(scope="session")
def java_txn_producer(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """A plain transactional producer (tests/support/java/TxnProducer.java)."""
    return _java_program(tmp_path_factory, "TxnProducer")


@pytest.fixture(scope="session")
def java_share_member(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """A share group member on AuditedShareConsumer (tests/support/java/ShareMember.java)."""
    return _java_program(tmp_path_factory, "ShareMember")
