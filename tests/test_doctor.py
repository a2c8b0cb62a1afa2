"""`msgaudit doctor` against the real local broker (docs/design.md §9): an unsafely configured topic
with a stalled group reports exactly its risks, a safe topic none."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import pytest

from audit.core.config import Config
from tests.conftest import new_topic


@pytest.mark.kafka
def test_doctor_reports_exactly_the_risks_of_the_unsafe_topic(
        kafka_bootstrap: str, make_config: Callable[..., Config], tmp_path: Path) -> None:
    from confluent_kafka import Producer

    from audit.clients.doctor import Risk, diagnose

    unsafe = new_topic(kafka_bootstrap, prefix="unsafe", min_insync_replicas="1",
                       unclean_leader_election_enable="true", retention_ms=str(3_600_000))
    safe = new_topic(kafka_bootstrap, prefix="safe", min_insync_replicas="2", retention_ms=str(3_600_000))
    p = Producer({"bootstrap.servers": kafka_bootstrap})
    for i in range(3):
        p.produce(unsafe, value=b"x%d" % i, partition=0)
    p.flush(30)
    cfg = make_config(tmp_path, topics={unsafe: {"groups": ["stalled"]}, safe: {"groups": ["stalled"]}})
    risks = diagnose(cfg, horizon=timedelta(hours=2), min_replication_factor=1)
    assert [(r.severity, r.risk, r.topic, r.subject) for r in risks] == [
        ("error", "unclean_leader_election", unsafe, "topic"),
        ("error", "min_insync_replicas", unsafe, "topic"),
        ("error", "at_risk_of_expiry", unsafe, "group:stalled"),
    ]
    assert risks[2].detail.startswith("partition 0: 3 unprocessed records, the oldest (offset 0) expires in 1.0 h")
    assert isinstance(risks[0], Risk)
    # the default requires replication factor 2: the single-broker topics are flagged (warn)
    rf = [r for r in diagnose(cfg, [safe]) if r.risk == "replication_factor"]
    assert [(r.severity, r.topic, r.detail) for r in rf] == [("warn", safe, "replication factor 1 < 2")]
