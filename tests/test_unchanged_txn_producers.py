"""Transactional producers audited by configuration only -- a Java producer with the interceptor
and a confluent-kafka Producer with the librdkafka plugin -- on the real broker: the messages of
their aborted transactions end `aborted` in the audit, never `lost_acked` (docs/design.md §3.3,
§3.4, §5.1)."""

from __future__ import annotations

import subprocess
from collections import Counter
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Producer

from tests.conftest import audit_topic, new_topic
from tests.test_plugin import plugin_conf
from tests.test_producer import ledger_rows

PER_TXN = 12


def plugin_transactions(so: Path, spool: Path, bootstrap: str, topic: str) -> None:
    """The same three transactions as tests/support/java/TxnProducer.java, from Python."""
    p = Producer(plugin_conf(so, spool, **{"bootstrap.servers": bootstrap, "transactional.id": "py-txn",
                                           "msgaudit.producer.name": "py-txn", "linger.ms": 3000}))
    p.init_transactions(30)
    for txn in (1, 2, 3):
        p.begin_transaction()
        for i in range(PER_TXN):
            p.produce(topic, f"py-txn{txn}-{i}".encode(), key=f"k{i % 3}".encode())  # not the Java values
        if txn == 1:
            assert p.flush(30) == 0
            p.abort_transaction(30)
        elif txn == 2:
            p.commit_transaction(30)
        else:
            p.abort_transaction(30)
    assert p.flush(30) == 0
    del p


@pytest.mark.spark
@pytest.mark.kafka
@pytest.mark.e2e
def test_aborted_transactions_of_unchanged_clients_end_aborted(
        libmsgaudit: Path, java_txn_producer: list[str], kafka_bootstrap: str, spark: Any, tmp_path: Path,
        make_config: Any) -> None:

    topic = new_topic(kafka_bootstrap, partitions=2)
    cfg = make_config(tmp_path, topics={topic: {"window": "1d", "grace": "1m"}})
    spool = cfg.ledger_dir / "producer"
    spool.mkdir(parents=True)
    start = datetime.now(UTC).replace(hour=0, minute=0, second=0, microsecond=0)

    j = subprocess.run([*java_txn_producer, topic, str(PER_TXN), f"bootstrap.servers={kafka_bootstrap}",
                        "transactional.id=java-txn", "linger.ms=3000",
                        "interceptor.classes=io.msgaudit.interceptors.AuditProducerInterceptor",
                        f"msgaudit.ledger.dir={spool}", "msgaudit.producer.name=java-txn"],
                       capture_output=True, text=True, timeout=120)
    assert j.returncode == 0 and j.stdout.strip() == "DONE", j.stderr
    plugin_transactions(libmsgaudit, spool, kafka_bootstrap, topic)

    rows = ledger_rows(spool)
    in_log_aborted: list[tuple[int, int]] = []  # (partition, offset) of the sent records of aborted transactions
    never_sent = 0
    for name, unsent_errors in (("java-txn", {"TransactionAbortedException"}),
                                ("py-txn", {"_PURGE_QUEUE", "_PURGE_INFLIGHT"})):
        mine = sorted((r for r in rows if r["producer"] == name), key=lambda r: r["seq"])
        assert [r["seq"] for r in mine] == list(range(3 * PER_TXN))
        assert {r["txn_id"] for r in mine} == {name}
        # transactions 1 (flushed, then aborted) and 2 (committed): acked
        assert [r["status"] for r in mine[:2 * PER_TXN]] == ["acked"] * (2 * PER_TXN)
        # 3: aborted at once. Its records are `aborted` (never sent), unless the client's sender
        # drained a batch in the instant the abort began: then they were sent and acked, and are in
        # the log uncommitted like transaction 1's
        third = mine[2 * PER_TXN:]
        unsent = [r for r in third if r["status"] == "aborted"]
        assert {(r["offset"], r["error"]) for r in unsent} <= {(None, e) for e in unsent_errors}
        assert all(r["status"] == "acked" and r["offset"] is not None for r in third if r not in unsent)
        never_sent += len(unsent)
        in_log_aborted += [(r["partition"], r["offset"]) for r in mine[:PER_TXN] + third if r not in unsent]
    assert never_sent > 0  # the path of records that never left the client is exercised
    flushed_aborted = sorted(in_log_aborted)
    end = start + timedelta(days=1)
    as_of = datetime.now(UTC) + timedelta(minutes=2)
    anomalies, report = audit_topic(spark, cfg, topic, start, end, as_of)
    # the sent records of the aborted transactions are in the log uncommitted: `aborted`
    assert Counter(a["anomaly"] for a in anomalies) == {"aborted": len(flushed_aborted)}
    assert sorted((a["partition"], a["offset"]) for a in anomalies) == flushed_aborted
    log_rows = [r for r in report if r["stage"] == "log"]
    assert sum(r["expected"] for r in log_rows) == sum(r["delivered"] for r in log_rows) == 2 * PER_TXN
    assert sum(r["lost"] + r["lost_acked"] + r["pending"] + r["unledgered"] for r in log_rows) == 0
