"""`io.msgaudit.interceptors.AuditedShareConsumer`: a Java share group member (KIP-932) on
`KafkaShareConsumer`, which refuses `interceptor.classes`, writes the same consumption ledger rows
as the Python `AuditedShareConsumer` (docs/design.md §5.9). Real broker, real Spark."""

from __future__ import annotations

import subprocess
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import audit_topic, new_topic
from tests.test_consumer_interceptor import rows_of

ROW_KEYS = {"group", "consumer", "consume_seq", "topic", "partition", "offset", "pid", "seq", "outcome", "attempt",
            "consume_ts", "error", "produce_ts"}


@pytest.mark.kafka
def test_bad_configuration_stops_the_java_share_member_at_start(java_share_member: list[str], kafka_bootstrap: str,
                                                                tmp_path: Path) -> None:
    cases = [
        ([f"msgaudit.ledger.dir={tmp_path}"], "AuditedShareConsumer: set group.id (the share group)"),
        ([f"msgaudit.ledger.dir={tmp_path}", "group.id=q", "share.acknowledgement.mode=implicit"],
         "AuditedShareConsumer acknowledges explicitly: remove share.acknowledgement.mode=implicit"),
        ([f"msgaudit.ledger.dir={tmp_path}", "group.id=q", "msgaudit.consumer.nam=x"],
         'unknown msgaudit property "msgaudit.consumer.nam" (known: msgaudit.ledger.dir, '),
    ]
    for props, message in cases:
        r = subprocess.run([*java_share_member, "t", "1", "-1", "-1", "-1", "0", f"bootstrap.servers={kafka_bootstrap}", *props],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode != 0 and "GOT" not in r.stdout and "DONE" not in r.stdout
        assert message in r.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.kafka
def test_an_accept_after_the_lock_expired_is_ledgered_with_the_brokers_refusal(
        java_share_member: list[str], kafka_bootstrap: str, tmp_path: Path) -> None:
    """The member accepts offset 1 seven seconds after poll() handed it, past the group's 6 s lock:
    the broker refuses that accept (`INVALID_RECORD_STATE`) and hands the record again (delivery 2),
    which the member accepts in time. Every other row has `error` null. (The client fetches in the
    background, so delivery 2 may be acquired as soon as the first lock expires, while the member still
    sleeps: its lock runs from then. 6 s of lock against 7 s of work leaves 5 s to accept it, and
    a busy host still acknowledges offset 0 in time.)"""
    from audit import AuditedProducer
    from audit.lab.share import set_group_configs

    topic = new_topic(kafka_bootstrap, partitions=1)
    group = f"jq-{uuid.uuid4().hex[:8]}"
    set_group_configs(kafka_bootstrap, group, share_auto_offset_reset="earliest", share_record_lock_duration_ms=6000)
    with AuditedProducer({"bootstrap.servers": kafka_bootstrap}, producer_name="java-share",
                         ledger_dir=tmp_path / "ledger") as producer:
        for i in range(2):
            producer.produce(topic, value=f"v{i}".encode())
        assert producer.flush(30) == 0
    r = subprocess.run([*java_share_member, topic, "2", "-1", "-1", "1", "7000", f"bootstrap.servers={kafka_bootstrap}",
                        f"group.id={group}", f"msgaudit.ledger.dir={tmp_path}"],
                       capture_output=True, text=True, timeout=90)
    assert r.returncode == 0, r.stderr
    assert [line for line in r.stdout.splitlines() if line.startswith(("GOT ", "LOCK "))] == [
        "LOCK 6000", "GOT 0 0 1 ACCEPT", "GOT 0 1 1 ACCEPT", "GOT 0 1 2 ACCEPT"]
    rows = [x for x in rows_of(tmp_path) if x.get("group") == group]
    assert all(set(x) == ROW_KEYS for x in rows), rows
    assert sorted((x["offset"], x["outcome"], x["attempt"], x["error"]) for x in rows) == [
        (0, "accepted", 1, None), (0, "acquired", 1, None), (1, "accepted", 1, "INVALID_RECORD_STATE"),
        (1, "accepted", 2, None), (1, "acquired", 1, None), (1, "acquired", 2, None)]


@pytest.mark.spark
@pytest.mark.kafka
def test_java_share_member_rejects_one_releases_one_and_the_audit_reports_exactly_that(
        java_share_member: list[str], kafka_bootstrap: str, spark: Any, tmp_path: Path, make_config: Any) -> None:
    """Five audited records on one partition; the Java member rejects offset 3, releases offset 1
    once (it comes back at delivery 2 and is accepted) and accepts the rest. The ledger holds one
    row per delivery and per acknowledgement, the broker took every one (error null), and ingest +
    capture + reconcile report exactly: offset 1 redelivered, offset 3 rejected, four delivered."""
    from audit import AuditedProducer
    from audit.lab.share import set_group_configs

    topic = new_topic(kafka_bootstrap, partitions=1)
    group = f"jq-{uuid.uuid4().hex[:8]}"
    cfg = make_config(tmp_path, topics={topic: {"window": "1d", "grace": "1m", "share_groups": [group]}})
    start = datetime.now(UTC).replace(hour=0, minute=0, second=0, microsecond=0)
    set_group_configs(kafka_bootstrap, group, share_auto_offset_reset="earliest")
    with AuditedProducer.from_config(cfg, producer_name="java-share") as producer:
        for i in range(5):
            producer.produce(topic, key=f"k{i}".encode(), value=f"v{i}".encode())
        assert producer.flush(30) == 0
    spool = cfg.ledger_dir / "consumer"
    spool.mkdir(parents=True, exist_ok=True)
    r = subprocess.run([*java_share_member, topic, "5", "3", "1", "-1", "0", f"bootstrap.servers={kafka_bootstrap}",
                        f"group.id={group}", f"msgaudit.ledger.dir={spool}", "msgaudit.consumer.name=jmember"],
                       capture_output=True, text=True, timeout=90)
    assert r.returncode == 0, r.stderr
    assert sorted(line for line in r.stdout.splitlines() if line.startswith("GOT ")) == [
        "GOT 0 0 1 ACCEPT", "GOT 0 1 1 RELEASE", "GOT 0 1 2 ACCEPT", "GOT 0 2 1 ACCEPT", "GOT 0 3 1 REJECT",
        "GOT 0 4 1 ACCEPT"]
    assert r.stdout.splitlines()[-1] == "DONE"

    rows = [x for x in rows_of(spool) if x["group"] == group]
    assert all(set(x) == ROW_KEYS for x in rows), rows
    assert [x["consume_seq"] for x in rows] == list(range(12))
    assert {x["consumer"].split(":")[0] for x in rows} == {"jmember"}
    assert all(x["pid"].startswith("java-share:") and x["topic"] == topic and x["partition"] == 0 for x in rows)
    assert sorted((x["offset"], x["outcome"], x["attempt"], x["error"]) for x in rows) == sorted(
        [(o, "acquired", 1, None) for o in range(5)] + [(1, "acquired", 2, None)]
        + [(0, "accepted", 1, None), (1, "released", 1, None), (1, "accepted", 2, None), (2, "accepted", 1, None),
           (3, "rejected", 1, None), (4, "accepted", 1, None)])
    member = rows[0]["consumer"]

    as_of = datetime.now(UTC) + timedelta(minutes=2)
    end = start + timedelta(days=1)
    anomalies, report = audit_topic(spark, cfg, topic, start, end, as_of)
    stage = f"share:{group}"
    assert sorted((x["stage"], x["anomaly"], x["partition"], x["offset"], x["detail"]) for x in anomalies) == [
        (stage, "redelivered", 0, 1, f"delivery 2 of 2 to {member}"),
        (stage, "rejected", 0, 3, f"rejected by {member} at delivery 1")]
    share = [x for x in report if x["stage"] == stage]
    assert [(x["partition"], x["expected"], x["delivered"], x["redelivered"], x["lost"], x["duplicated"],
             x["pending"], x["overdue"]) for x in share] == [(0, 5, 4, 1, 0, 0, 0, 0)]
