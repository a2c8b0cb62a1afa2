"""MirrorMaker 2 between two real local KRaft clusters (audit.runtime.local_mirror), and the
`mirror:<name>` stage's config (docs/design.md §5.5, §8)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from audit.runtime.local_kafka import LocalKafka, free_port_block
from audit.runtime.local_mirror import LocalMirrorMaker, mirrored_topic
from tests.conftest import new_topic


@pytest.fixture(scope="module")
def target_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalKafka]:
    """A second single-node KRaft cluster (its own data folder and ports): the mirror's target."""
    broker = LocalKafka(tmp_path_factory.mktemp("kafka-target"), port=free_port_block(2), nodes=1)
    broker.start()
    yield broker
    broker.stop()


@pytest.mark.kafka
def test_mm2_copies_a_record_with_its_audit_headers_to_the_target(
        tmp_path: Path, kafka_bootstrap: str, target_cluster: LocalKafka) -> None:
    from confluent_kafka import Consumer, Producer

    topic = new_topic(kafka_bootstrap, prefix="mm2")
    headers = [("app", b"x"), ("audit.pid", b"p:0123456789ab"), ("audit.seq", b"7"), ("audit.ts", b"1764000000000")]
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
