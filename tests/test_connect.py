"""A real Kafka Connect worker (audit.runtime.local_connect, `msgaudit connect`) running Iceberg's sink
connector with KafkaMetadataTransform into a Hadoop-catalog table, read back through the iceberg sink
reader (spark_jobs.io.sinks_read); and the iceberg sink's config and error lines (docs/design.md §8)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from audit.core import config as config_mod
from audit.core.config import SinkConfig
from audit.core.errors import ConfigError, InputError
from tests.conftest import new_topic


def iceberg_connector(topic: str, table: str, warehouse: Path, control_topic: str) -> dict[str, str]:
    """Iceberg's sink connector into a Hadoop-catalog table, each row stamped with its Kafka
    coordinates by KafkaMetadataTransform (flat `_kafka_metadata_*` columns)."""
    return {
        "connector.class": "org.apache.iceberg.connect.IcebergSinkConnector",
        "tasks.max": "1",
        "topics": topic,
        "iceberg.tables": table,
        "iceberg.tables.auto-create-enabled": "true",
        "iceberg.catalog.type": "hadoop",
        "iceberg.catalog.warehouse": str(warehouse),
        "iceberg.control.topic": control_topic,
        "iceberg.control.commit.interval-ms": "1000",
        "consumer.override.auto.offset.reset": "earliest",
        "transforms": "kafka",
        "transforms.kafka.type": "org.apache.iceberg.connect.transforms.KafkaMetadataTransform",
    }


@pytest.mark.kafka
@pytest.mark.spark
def test_iceberg_connector_rows_carry_the_logs_coordinates_and_audit_by_them(
        spark: Any, kafka_bootstrap: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, make_config: Any,
        capsys: pytest.CaptureFixture[str]) -> None:
    """A real Connect worker runs two Iceberg sink connectors, audited together by their rows'
    coordinates: one writes every record of its topic; the other (errors.tolerance=all, a
    dead-letter topic with context headers) cannot convert one record, which goes to its DLQ, and
    the audit with the sink's `dead_letter_topic` reports exactly that message `dead_lettered`."""
    from datetime import UTC, datetime, timedelta

    from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

    from audit import cli
    from audit.clients.producer import AuditedProducer
    from audit.runtime.local_kafka import free_port
    from spark_jobs.io.sinks_read import read_iceberg

    monkeypatch.chdir(tmp_path)
    topic = new_topic(kafka_bootstrap, partitions=2, prefix="ice")
    control = f"{topic}-control"  # `connect submit` creates it (the connector does not)
    bad_topic = new_topic(kafka_bootstrap, partitions=1, prefix="icedlq")
    dlq = f"{bad_topic}-dlq"
    t0 = datetime.now(UTC)
    with AuditedProducer({"bootstrap.servers": kafka_bootstrap, "log_level": 0}, producer_name="ice",
                         ledger_dir=tmp_path / "ledger" / "producer") as p:
        for i in range(6):
            p.produce(topic, json.dumps({"id": i, "item": f"sku-{i}"}).encode(), key=f"k{i}".encode(), partition=i % 2)
        for i in range(5):  # offset 2 is not JSON: the connector's converter cannot read it
            value = b"not json {" if i == 2 else json.dumps({"id": i, "item": f"sku-{i}"}).encode()
            p.produce(bad_topic, value, key=f"k{i}".encode(), partition=0)
        assert p.flush(30) == 0
    # the ground truth: what the log holds, read back with a plain consumer
    consumer = Consumer({"bootstrap.servers": kafka_bootstrap, "group.id": f"{topic}-truth", "log_level": 0,
                         "enable.auto.commit": False})
    consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in (0, 1)])
    log: list[tuple[Any, ...]] = []
    deadline = time.monotonic() + 30
    while len(log) < 6 and time.monotonic() < deadline:
        m = consumer.poll(0.5)
        if m is not None and m.error() is None:
            v = json.loads(m.value() or b"{}")
            log.append((m.topic(), m.partition(), m.offset(), m.timestamp()[1], v["id"], v["item"]))
    consumer.close()
    assert len(log) == 6 and len({r[1] for r in log}) == 2  # both partitions hold records

    worker_dir, warehouse, port = tmp_path / "connect", tmp_path / "warehouse", free_port()
    spec = tmp_path / "iceberg-orders.json"
    spec.write_text(json.dumps({"name": f"{topic}-sink",
                                "config": iceberg_connector(topic, "audit.orders", warehouse, control)}))
    dlq_spec = tmp_path / "iceberg-dlq.json"
    dlq_spec.write_text(json.dumps({"name": f"{bad_topic}-sink", "config": {
        **iceberg_connector(bad_topic, "audit.orders_dlq", warehouse, f"{bad_topic}-control"),
        "errors.tolerance": "all", "errors.deadletterqueue.topic.name": dlq,
        "errors.deadletterqueue.topic.replication.factor": "1",
        "errors.deadletterqueue.context.headers.enable": "true"}}))
    args = ["--dir", str(worker_dir), "--port", str(port)]
    try:
        assert cli.main(["connect", "start", "--bootstrap", kafka_bootstrap, *args]) == 0
        assert capsys.readouterr().out.startswith(f"connect: worker ready at http://127.0.0.1:{port} on {kafka_bootstrap}")
        assert cli.main(["connect", "submit", str(spec), *args]) == 0
        assert capsys.readouterr().out == f"connect: connector {topic}-sink running, 1 task(s)\n"
        assert cli.main(["connect", "status", *args]) == 0
        assert capsys.readouterr().out == f"connect: running at http://127.0.0.1:{port}; connectors: {topic}-sink RUNNING\n"
        assert cli.main(["connect", "submit", str(dlq_spec), *args]) == 0
        assert capsys.readouterr().out == f"connect: connector {bad_topic}-sink running, 1 task(s)\n"

        sink = SinkConfig(name="orders_iceberg", format="iceberg", warehouse=str(warehouse), table="audit.orders")
        rows: list[tuple[Any, ...]] = []
        deadline = time.monotonic() + 60
        while len(rows) < 6 and time.monotonic() < deadline:  # the connector commits every second
            try:
                rows = [tuple(r) for r in read_iceberg(spark, sink).select(
                    "_kafka_metadata_topic", "_kafka_metadata_partition", "_kafka_metadata_offset",
                    "_kafka_metadata_timestamp", "id", "item").collect()]
            except InputError:  # the table is not committed yet
                time.sleep(1)
        assert sorted(rows) == sorted(log)
        dlq_sink = SinkConfig(name="orders_dlq", format="iceberg", warehouse=str(warehouse), table="audit.orders_dlq")
        written: list[int] = []
        while len(written) < 4 and time.monotonic() < deadline:
            try:
                written = sorted(r[0] for r in read_iceberg(spark, dlq_sink).select("_kafka_metadata_offset").collect())
            except InputError:
                time.sleep(1)
        assert written == [0, 1, 3, 4]
    finally:
        assert cli.main(["connect", "stop", *args]) == 0
    assert capsys.readouterr().out == "connect: stopped\n"
    assert cli.main(["connect", "status", *args]) == 1
    # the DLQ holds the bad record, naming its source by the context headers
    consumer = Consumer({"bootstrap.servers": kafka_bootstrap, "group.id": f"{dlq}-truth", "log_level": 0,
                         "enable.auto.commit": False})
    consumer.assign([TopicPartition(dlq, 0, OFFSET_BEGINNING)])
    m, deadline = None, time.monotonic() + 20
    while m is None and time.monotonic() < deadline:
        got = consumer.poll(0.5)
        m = got if got is not None and got.error() is None else None
    consumer.close()
    assert m is not None and m.value() == b"not json {"
    raw = m.headers() or []
    named = dict(raw.items() if isinstance(raw, dict) else raw)
    assert (named["__connect.errors.topic"], named["__connect.errors.partition"],
            named["__connect.errors.offset"]) == (bad_topic.encode(), b"0", b"2")

    # the audit of the tables by their rows' coordinates (design §4.2 `identity: coordinates`): every
    # message of the first log is in its table once, so the sink stage expects and has all six, with
    # no anomaly; of the second, four are delivered and the one in the DLQ is dead_lettered
    from spark_jobs.capture import capture
    from spark_jobs.ingest import ingest
    from spark_jobs.io.lake import read_table
    from spark_jobs.reconcile import reconcile_range

    coordinates = {"topic": "_kafka_metadata_topic", "partition": "_kafka_metadata_partition",
                   "offset": "_kafka_metadata_offset"}
    cfg = make_config(tmp_path, topics={
        topic: {"window": "1h", "grace": "1m", "sinks": [
            {"name": "orders_iceberg", "format": "iceberg", "warehouse": str(warehouse), "table": "audit.orders",
             "identity": "coordinates", "columns": coordinates}]},
        bad_topic: {"window": "1h", "grace": "1m", "sinks": [
            {"name": "orders_dlq", "format": "iceberg", "warehouse": str(warehouse), "table": "audit.orders_dlq",
             "identity": "coordinates", "columns": coordinates, "dead_letter_topic": dlq}]}})
    start = t0.replace(minute=0, second=0, microsecond=0)
    end = datetime.now(UTC) + timedelta(minutes=1)
    ingest(spark, cfg)
    captured = capture(spark, cfg, start, end)
    assert [d.line() for d in captured.dead_letters] == [f"dead-letter topic {dlq} (sink orders_dlq): 1 records"]
    results = reconcile_range(spark, cfg, start, end, end + timedelta(hours=2))
    sink_rows = [r for res in results for r in res.report if r["stage"] == "sink:orders_iceberg" and r["expected"]]
    assert sorted((r["partition"], r["expected"], r["delivered"], r["lost"], r["duplicated"]) for r in sink_rows) == [
        (0, 3, 3, 0, 0), (1, 3, 3, 0, 0)]
    anomalies = read_table(spark, cfg, "audit_anomalies")
    assert anomalies.where(f"topic = '{topic}'").count() == 0
    dlq_rows = [r for res in results for r in res.report if r["stage"] == "sink:orders_dlq" and r["expected"]]
    assert [(r["partition"], r["expected"], r["delivered"], r["lost"], r["dead_lettered"], r["missing_in_sink"])
            for r in dlq_rows] == [(0, 5, 4, 0, 1, 0)]
    assert [tuple(r) for r in anomalies.where(f"topic = '{bad_topic}'").select(
        "stage", "anomaly", "partition", "offset").collect()] == [("sink:orders_dlq", "dead_lettered", 0, 2)]



@pytest.mark.unit
def test_iceberg_sink_config_keys_and_their_errors(tmp_path: Path) -> None:
    def sink(**raw: Any) -> SinkConfig:
        cfg = config_mod.from_dict({"topics": {"orders": {"sinks": [{"name": "ice", "format": "iceberg", **raw}]}}},
                                   base=tmp_path)
        return cfg.topic("orders").sinks[0]

    s = sink(warehouse="wh", table="db.orders")
    assert (s.warehouse, s.table, dict(s.catalog)) == (str(tmp_path / "wh"), "db.orders", {})
    s = sink(catalog={"type": "rest", "uri": "http://127.0.0.1:8181"}, table="db.orders")
    assert (s.warehouse, dict(s.catalog)) == (None, {"type": "rest", "uri": "http://127.0.0.1:8181"})
    with pytest.raises(ConfigError, match=r"sinks\[0\]\.table: an iceberg sink needs its table as 'namespace.name'"):
        sink(warehouse="wh", table="orders")
    with pytest.raises(ConfigError, match=r"sinks\[0\]: an iceberg sink needs 'warehouse'"):
        sink(table="db.orders")
    with pytest.raises(ConfigError, match="'warehouse' and 'catalog' are keys of an iceberg sink, not of a delta one"):
        config_mod.from_dict({"topics": {"orders": {"sinks": [
            {"name": "d", "format": "delta", "location": "x", "warehouse": "wh"}]}}}, base=tmp_path)


@pytest.mark.unit
def test_a_missing_iceberg_table_or_unreachable_catalog_is_one_line_naming_the_sink_and_key(tmp_path: Path) -> None:
    from spark_jobs.io.sinks_read import iceberg_table

    missing = SinkConfig(name="ice", format="iceberg", warehouse=str(tmp_path), table="db.orders")
    with pytest.raises(InputError) as e:
        iceberg_table(missing)
    assert str(e.value) == (f"sink 'ice': no Iceberg table 'db.orders' at {tmp_path}/db/orders (has the connector "
                            "committed yet? check sinks[].warehouse and sinks[].table)")
    unreachable = SinkConfig(name="ice", format="iceberg", table="db.orders",
                             catalog={"type": "rest", "uri": "http://127.0.0.1:1"})
    with pytest.raises(InputError, match=r"^sink 'ice': cannot reach its Iceberg catalog: .*\(check sinks\[\]\.catalog\)$"):
        iceberg_table(unreachable)


@pytest.mark.unit
def test_connect_help_has_an_example(capsys: pytest.CaptureFixture[str]) -> None:
    from audit import cli

    with pytest.raises(SystemExit):
        cli.main(["connect", "--help"])
    assert "msgaudit connect start --bootstrap 127.0.0.1:9092" in capsys.readouterr().out


@pytest.mark.spark
def test_iceberg_reader_matches_columns_by_field_id_through_a_pyiceberg_catalog(spark: Any, tmp_path: Path) -> None:
    """A catalog sink (`catalog:`, here pyiceberg's SQL catalog on SQLite): an empty table reads as no
    rows with the table's columns; after a rename and an added column, older files still read under
    the new name and the added column reads null in them."""
    import pyarrow as pa
    from pyiceberg.catalog import load_catalog
    from pyiceberg.schema import Schema
    from pyiceberg.types import LongType, NestedField, StringType

    from spark_jobs.io.sinks_read import read_iceberg

    props = {"type": "sql", "uri": f"sqlite:///{tmp_path / 'catalog.db'}", "warehouse": f"file://{tmp_path / 'wh'}"}
    catalog = load_catalog("lab", **props)  # the SQL catalog keeps its tables under the catalog's name
    props["name"] = "lab"
    catalog.create_namespace("db")
    table = catalog.create_table("db.orders", Schema(NestedField(1, "offset", LongType(), required=False),
                                                    NestedField(2, "item", StringType(), required=False)))
    sink = SinkConfig(name="ice", format="iceberg", table="db.orders", catalog=props)
    empty = read_iceberg(spark, sink)
    assert (empty.columns, empty.count()) == (["offset", "item"], 0)
    table.append(pa.table({"offset": pa.array([0, 1], pa.int64()), "item": ["a", "b"]}))
    with table.update_schema() as update:
        update.rename_column("item", "sku")
        update.add_column("qty", LongType())
    table = catalog.load_table("db.orders")
    table.append(pa.table({"offset": pa.array([2], pa.int64()), "sku": ["c"], "qty": pa.array([5], pa.int64())}))
    rows = read_iceberg(spark, sink).orderBy("offset").collect()
    assert [tuple(r) for r in rows] == [(0, "a", None), (1, "b", None), (2, "c", 5)]
