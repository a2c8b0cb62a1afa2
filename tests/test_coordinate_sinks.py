"""A real Spark Structured Streaming job (Kafka source -> Delta) that keeps only the Kafka source's
coordinates, audited with `identity: coordinates` (docs/design.md §4.2): run once, then again
without its checkpoint (every record written twice); the audit's sink rows equal the truth computed
from the table and the log independently."""

from __future__ import annotations

import json
from collections import Counter
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest


def _stream_once(spark: Any, bootstrap: str, topic: str, location: str, checkpoint: str) -> None:
    """The user's job: every record of `topic` with its Kafka coordinates, appended to a Delta table."""
    from pyspark.sql import functions as F

    source = (spark.readStream.format("kafka").option("kafka.bootstrap.servers", bootstrap)
              .option("subscribe", topic).option("startingOffsets", "earliest").load())
    query = (source.select("topic", "partition", "offset", "timestamp", F.col("value").cast("string").alias("value"))
             .writeStream.format("delta").option("checkpointLocation", checkpoint).trigger(availableNow=True)
             .start(location))
    query.awaitTermination(120)
    assert query.exception() is None


def _log(bootstrap: str, topic: str, n: int) -> dict[tuple[int, int], tuple[str, int]]:
    """The topic's records as a plain consumer reads them: (partition, offset) -> (pid, seq) of the
    audit.id header (split at its last two '/')."""
    from confluent_kafka import Consumer

    c = Consumer({"bootstrap.servers": bootstrap, "group.id": f"truth-{topic}", "auto.offset.reset": "earliest",
                  "enable.auto.commit": "false"})
    c.subscribe([topic])
    out: dict[tuple[int, int], tuple[str, int]] = {}
    try:
        deadline = datetime.now(UTC) + timedelta(seconds=30)
        while len(out) < n and datetime.now(UTC) < deadline:
            m = c.poll(0.5)
            if m is None or m.error():
                continue
            packed = dict(m.headers() or [])["audit.id"]
            assert isinstance(packed, bytes)
            pid, seq, _ = packed.decode().rsplit("/", 2)
            out[(int(m.partition() or 0), int(m.offset() or 0))] = (pid, int(seq))
    finally:
        c.close()
    return out


def _produce_in_transactions(bootstrap: str, topic: str, ledger_dir: Path) -> None:
    """Two audited messages on partition 0, each in its own committed transaction: the first one's
    commit marker takes an offset between them that no consumer ever sees (a gap a count of
    distinct offsets would call a loss)."""
    from audit.clients.producer import AuditedProducer

    with AuditedProducer({"bootstrap.servers": bootstrap, "transactional.id": f"tx-{topic}"},
                         producer_name="test-txn", ledger_dir=ledger_dir / "producer") as p:
        p.init_transactions(30)
        for i in (4, 5):
            p.begin_transaction()
            p.produce(topic, json.dumps({"n": i}).encode(), partition=0)
            p.commit_transaction(30)


@pytest.mark.spark
@pytest.mark.kafka
@pytest.mark.e2e
def test_a_streaming_job_rerun_without_its_checkpoint_is_audited_by_its_coordinates(
        spark: Any, kafka_bootstrap: str, make_config: Any, tmp_path: Path) -> None:
    from pyspark.sql import functions as F

    from spark_jobs.capture import capture
    from spark_jobs.ingest import ingest
    from spark_jobs.io.lake import read_table
    from spark_jobs.reconcile import reconcile_range
    from tests.conftest import new_topic
    from tests.test_consumer import produce_audited

    topic = new_topic(kafka_bootstrap, partitions=2)
    t0 = datetime.now(UTC)
    produce_audited(kafka_bootstrap, topic, [{"n": i} for i in range(4)], tmp_path / "ledger")
    _produce_in_transactions(kafka_bootstrap, topic, tmp_path / "ledger")  # 2 more, and marker offsets
    location = str(tmp_path / "stream_sink")
    _stream_once(spark, kafka_bootstrap, topic, location, str(tmp_path / "ck1"))
    _stream_once(spark, kafka_bootstrap, topic, location, str(tmp_path / "ck2"))  # the checkpoint was lost

    cfg = make_config(tmp_path, topics={topic: {"window": "1h", "grace": "1m", "sinks": [
        {"name": "stream", "format": "delta", "location": location, "identity": "coordinates",
         "columns": {"topic": "topic", "partition": "partition", "offset": "offset", "record_ts": "timestamp"}}]}})
    start = t0.replace(minute=0, second=0, microsecond=0)
    end = datetime.now(UTC) + timedelta(minutes=1)
    ingest(spark, cfg)
    capture(spark, cfg, start, end)
    results = reconcile_range(spark, cfg, start, end, end + timedelta(hours=2))
    published = read_table(spark, cfg, "audit_anomalies").where(F.col("stage") == "sink:stream").collect()
    got = sorted((r["stage"], r["anomaly"], r["partition"], r["pid"], r["seq"], r["offset"]) for r in published)
    sums: dict[int, Counter[str]] = {}
    for res in results:
        for r in res.report:
            if r["stage"] == "sink:stream":
                sums.setdefault(r["partition"], Counter()).update(
                    {k: r[k] for k in ("expected", "delivered", "duplicated", "lost")})
                assert r["latency_p99_ms"] is None  # no sink time is mapped: no sink latency

    # the truth, from the table and the log alone
    log = _log(kafka_bootstrap, topic, 6)
    rows = Counter((r["partition"], r["offset"]) for r in spark.read.format("delta").load(location).collect())
    assert len(log) == 6 and sum(rows.values()) == 12
    p0 = sorted(o for p, o in log if p == 0)
    assert len(p0) < p0[-1] - p0[0] + 1  # partition 0 has an offset no record holds (the marker)
    truth = sorted([("sink:stream", "duplicate_in_sink", p, *log[(p, o)], o)
                    for (p, o), n in rows.items() if (p, o) in log for _ in range(n - 1)]
                   + [("sink:stream", "missing_in_sink", p, *log[(p, o)], o) for (p, o) in log if (p, o) not in rows]
                   + [("sink:stream", "unexpected_in_sink", p, None, None, o) for (p, o) in rows if (p, o) not in log])
    assert got == truth and len(truth) == 6
    per_partition = Counter(p for p, _ in log)  # every message expected, delivered, duplicated once
    assert {p: dict(c) for p, c in sums.items() if c["expected"]} == {
        p: {"expected": n, "delivered": n, "duplicated": n, "lost": 0} for p, n in per_partition.items()}
