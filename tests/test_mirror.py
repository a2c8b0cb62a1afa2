"""MirrorMaker 2 between two real local KRaft clusters (audit.runtime.local_mirror), and the
`mirror:<name>` stage's config (docs/design.md §5.5, §8)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from audit.runtime.jvm_service import properties_text
from audit.runtime.local_kafka import LocalKafka
from audit.runtime.local_mirror import LocalMirrorMaker, mirrored_topic
from tests.conftest import new_topic


@pytest.fixture(scope="module")
def target_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalKafka]:
    """A second single-node KRaft cluster (its own data folder and ports): the mirror's target."""
    broker = LocalKafka(tmp_path_factory.mktemp("kafka-target"), port=None, nodes=1)
    broker.start()
    yield broker
    broker.stop()


@pytest.mark.kafka
def test_mm2_copies_a_record_with_its_audit_headers_to_the_target(
        tmp_path: Path, kafka_bootstrap: str, target_cluster: LocalKafka) -> None:
    from confluent_kafka import Consumer, Producer

    topic = new_topic(kafka_bootstrap, prefix="mm2")
    headers: list[tuple[str, str | bytes | None]] = [("app", b"x"), ("audit.pid", b"p:0123456789ab"), ("audit.seq", b"7"), ("audit.ts", b"1764000000000")]
    producer = Producer({"bootstrap.servers": kafka_bootstrap, "log_level": 0})
    producer.produce(topic, b"v", b"k", headers=headers)
    assert producer.flush(30) == 0
    mm2 = LocalMirrorMaker(tmp_path / "mm2", kafka_bootstrap, target_cluster.bootstrap_servers, [topic],
                           source_alias="dc1", target_alias="dc2")
    with mm2:
        assert mm2.wait_records(topic, 1, timeout=120) == 1
    assert not mm2.running()
    consumer = Consumer({"bootstrap.servers": target_cluster.bootstrap_servers, "group.id": "read-copy",
                         "auto.offset.reset": "earliest", "log_level": 0})
    consumer.subscribe([mirrored_topic("dc1", topic)])
    try:
        msg = None
        for _ in range(60):
            msg = consumer.poll(1.0)
            if msg is not None and msg.error() is None:
                break
        assert msg is not None and msg.error() is None
        assert (msg.topic(), msg.key(), msg.value()) == (f"dc1.{topic}", b"k", b"v")
        assert msg.headers() == headers
    finally:
        consumer.close()


# ---------------------------------------------------------------------------- config
@pytest.mark.unit
def test_mirror_config_defaults_to_mm2s_topic_name_and_rejects_a_mirror_without_a_target(tmp_path: Path) -> None:
    from audit.core.config import from_dict
    from audit.core.errors import ConfigError

    cfg = from_dict({"topics": {"orders": {"mirrors": [
        {"name": "dr", "kafka": {"bootstrap.servers": "dc2:9092"}, "source_alias": "dc1"},
        {"name": "eu", "kafka": {"bootstrap.servers": "eu:9092"}, "topic": "orders-copy"}]}}}, base=tmp_path)
    dr, eu = cfg.topic("orders").mirrors
    assert (dr.name, dr.topic, dr.source_alias, dict(dr.kafka)) == ("dr", "dc1.orders", "dc1",
                                                                    {"bootstrap.servers": "dc2:9092"})
    assert (eu.topic, eu.source_alias) == ("orders-copy", "source")
    with pytest.raises(ConfigError, match=r"topics.orders.mirrors\[0\].kafka: missing key 'bootstrap.servers'"):
        from_dict({"topics": {"orders": {"mirrors": [{"name": "dr", "kafka": {}}]}}})
    with pytest.raises(ConfigError, match=r"mirror names must be unique"):
        from_dict({"topics": {"orders": {"mirrors": [{"name": "dr", "kafka": {"bootstrap.servers": "a:1"}}] * 2}}})
    with pytest.raises(ConfigError, match=r"mirrors\[0\]: unknown key 'cluster'"):
        from_dict({"topics": {"orders": {"mirrors": [{"name": "dr", "cluster": "x"}]}}})


# ---------------------------------------------------------------------------- oracle and Spark
def _mirror_rows(anomalies: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    from tests.reconcile_cases import brief

    return brief(anomalies)


@pytest.mark.unit
def test_mirror_stage_in_the_oracle_gives_exactly_the_hand_written_rows_and_report() -> None:
    from audit.oracle import reconcile_window
    from tests.reconcile_cases import AS_OF_FINAL, T0, M, build_mirror_cases, mirror_topic_config, report_row

    h, exp = build_mirror_cases()
    r = reconcile_window(mirror_topic_config(), T0, AS_OF_FINAL, h.inputs())
    assert _mirror_rows(r.anomalies) == sorted((row for rows in exp.values() for row in rows),
                                               key=lambda t: tuple("" if v is None else str(v) for v in t))
    details = {(a["anomaly"], a["partition"], a["detail"]) for a in r.anomalies if a["stage"] == M}
    assert details == {
        ("lost_in_mirror", 1, "committed in the source log, not in dc1.t after grace"),
        ("duplicate_in_mirror", 2, "extra copy of 2:0 in dc1.t"),
        ("duplicate_in_mirror", 2, "extra copy of 2:1 in dc1.t"),
        ("reordered_in_mirror", 3, "source offset 0 copied after source offset 1"),
        ("reordered_in_mirror", 3, "source offset 2 copied after source offset 3"),
        ("pending", 4, "not in dc1.t yet, within grace or not yet captured there"),
    }
    mirror = {row["partition"]: row for row in r.report if row["stage"] == M}
    assert mirror[0] == report_row(M, 0, expected=3, delivered=3, latency_p50_ms=4000.0, latency_p95_ms=4900.0,
                                   latency_p99_ms=4980.0, latency_max_ms=5000.0)
    assert mirror[1] == report_row(M, 1, expected=2, delivered=1, lost=1, lost_in_mirror=1,
                                   latency_p50_ms=3000.0, latency_p95_ms=3000.0, latency_p99_ms=3000.0,
                                   latency_max_ms=3000.0)
    lat3 = {"latency_p50_ms": 3000.0, "latency_p95_ms": 3000.0, "latency_p99_ms": 3000.0, "latency_max_ms": 3000.0}
    assert mirror[2] == report_row(M, 2, expected=2, delivered=2, duplicated=2, duplicate_in_mirror=2, **lat3)
    assert mirror[3] == report_row(M, 3, expected=3, delivered=3, reordered=2, reordered_in_mirror=2, **lat3)
    assert mirror[4] == report_row(M, 4, expected=1, pending=1)
    assert mirror[5] == report_row(M, 5)
    assert mirror[6] == report_row(M, 6, expected=1, delivered=1, **lat3)
    assert sorted(mirror) == list(range(7))


@pytest.mark.spark
def test_mirror_stage_in_spark_equals_the_oracle_before_and_after_grace(spark: Any) -> None:
    from audit.oracle import reconcile_window
    from tests.reconcile_cases import (
        AS_OF_FINAL,
        T0,
        M,
        at,
        build_mirror_cases,
        mirror_topic_config,
        norm_rows,
        sorted_anomalies,
        spark_reconcile,
    )

    h, _ = build_mirror_cases()
    tc = mirror_topic_config()
    for as_of in (AS_OF_FINAL, at(19)):
        want = reconcile_window(tc, T0, as_of, h.inputs())
        report, anomalies, _ = spark_reconcile(spark, tc, T0, as_of, h.inputs())
        assert anomalies == sorted_anomalies(want.anomalies)
        key = lambda r: (r["stage"], r["partition"])  # noqa: E731
        assert sorted(report, key=key) == sorted(norm_rows(want.report), key=key)
    # at 10:19 the message of 10:05 is still within grace at p1: pending, not lost
    early = reconcile_window(tc, T0, at(19), h.inputs())
    assert [(a["anomaly"], a["partition"], a["seq"]) for a in early.anomalies if a["stage"] == M
            and a["partition"] == 1] == [("pending", 1, 1)]


@pytest.mark.unit
def test_mm2_takes_each_clusters_security_from_msgaudits_config_and_keeps_secrets_out_of_its_properties(
        tmp_path: Path) -> None:
    from audit.core.config import from_dict
    from audit.core.errors import ConfigError

    ca = str(tmp_path / "ca.pem")
    source = {"bootstrap.servers": "a:9093", "security.protocol": "sasl_ssl", "sasl.mechanism": "SCRAM-SHA-512",
              "sasl.username": "mm", "sasl.password": 'p"w', "ssl.ca.location": ca, "linger.ms": "5"}
    cfg = from_dict({"kafka": source, "topics": {"orders": {"mirrors": [
        {"name": "dr", "kafka": {"bootstrap.servers": "b:9092"}, "source_alias": "dc1"},
        {"name": "eu", "kafka": {"bootstrap.servers": "eu:9092"}, "topic": "orders-copy"}]}}}, base=tmp_path)
    mm2 = LocalMirrorMaker.for_mirror(tmp_path / "mm2", cfg, "orders", "dr")
    props = mm2.properties()
    ref = f"${{file:{mm2.secrets_file}:dc1.sasl.jaas.config}}"
    assert {k: v for k, v in props.items() if k.startswith(("dc1.", "dr.", "config.providers"))
            and not k.endswith(("plugin.discovery", "offset.flush.interval.ms"))} == {
        "dc1.bootstrap.servers": "a:9093", "dr.bootstrap.servers": "b:9092",
        "dc1.security.protocol": "SASL_SSL", "dc1.sasl.mechanism": "SCRAM-SHA-512", "dc1.sasl.jaas.config": ref,
        "dc1.ssl.truststore.type": "PEM", "dc1.ssl.truststore.location": ca,
        "config.providers": "file",
        "config.providers.file.class": "org.apache.kafka.common.config.provider.FileConfigProvider"}
    assert (props["clusters"], props["dc1->dr.enabled"], props["dc1->dr.topics"]) == ("dc1, dr", "true", "orders")
    assert not any('p"w' in v for v in props.values())
    assert mm2._security()[1] == {"dc1.sasl.jaas.config": 'org.apache.kafka.common.security.scram.ScramLoginModule '
                                                          'required username="mm" password="p\\"w";'}
    plain = LocalMirrorMaker(tmp_path / "plain", "a:9092", "b:9092", ["orders.x"])
    # Properties.load reads a backslash as an escape: the file doubles it so the regex stays `orders\.x`
    assert plain.properties()["source->target.topics"] == "orders\\.x"
    assert "source->target.topics=orders\\\\.x\n" in properties_text(plain.properties())
    assert properties_text({"k": "a\nb\\c"}) == "k=a\\nb\\\\c\n"
    assert not any(k.startswith("config.providers") for k in plain.properties()) and plain._security() == ({}, {})
    with pytest.raises(ConfigError, match=r"mirrors\[eu\]\.topic is 'orders-copy'; MM2's default replication "
                                          r"policy names the copy 'source.orders'"):
        LocalMirrorMaker.for_mirror(tmp_path / "mm2", cfg, "orders", "eu")
    with pytest.raises(ConfigError, match="topic 'orders' has no mirror 'nope'"):
        LocalMirrorMaker.for_mirror(tmp_path / "mm2", cfg, "orders", "nope")
