"""`msgaudit ingest` from the ledger topic: every row lands once, also when a spool ships it again,
rows of aborted transactions never land, bad keys and bad lines are quarantined. Real broker, Spark, Delta."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Producer

from audit.clients.ledger import LedgerWriter, sealed_segments
from audit.clients.ledger_ship import marker, ship_spool, txn_key
from spark_jobs.ingest import QUARANTINE_TABLE
from spark_jobs.ingest_topic import IDS_TABLE, land_topic
from spark_jobs.io import lake
from spark_jobs.pipeline.steps import StepRange, run_step
from tests.conftest import new_topic
from tests.test_ingest import crow, prow

pytestmark = [pytest.mark.spark, pytest.mark.kafka]


def _segment(directory: Path, rows: list[dict[str, Any]], prefix: str = "producer") -> Path:
    with LedgerWriter(directory, prefix) as w:
        w.extend(rows)
    return w.sealed_segments[0]


def _landed(spark: Any, cfg: Any, table: str, *cols: str) -> list[tuple[Any, ...]]:
    return sorted(tuple(r) for r in lake.read_table(spark, cfg, table).select(*cols).collect())


def test_the_ledger_topic_lands_once_across_spool_replays_and_aborted_transactions(
        spark: Any, kafka_bootstrap: str, make_config: Any, tmp_path: Path) -> None:
    topic = new_topic(kafka_bootstrap, partitions=2, prefix="ledger")
    cfg = make_config(tmp_path, ledger={"topic": topic})
    spool = Path(cfg.ledger_dir)
    _segment(spool / "producer", [prow(i) for i in range(0, 5)])
    seg_b = _segment(spool / "producer", [prow(i) for i in range(5, 8)] + [prow(8, status="failed")])
    _segment(spool / "consumer", [crow(o) for o in range(4)], prefix="loader-c1")
    bad = spool / "producer" / "producer-20261118T110000000000Z-1-0badbad0.jsonl"
    bad.write_text(json.dumps(prow(9)) + "\n" + '{"pid": "svc:0123456789ab", "seq": "x"}\n')

    first = ship_spool(spool, cfg.ledger.kafka, topic)
    assert (first.segments, first.rows) == (4, 15)
    marker(seg_b).unlink()  # as if its acknowledgements were lost: the next ship sends it again
    assert ship_spool(spool, cfg.ledger.kafka, topic).rows == 4

    # exactly_once_kafka rows: one committed transaction, one aborted; plus a key naming no ledger
    txn = Producer({"bootstrap.servers": kafka_bootstrap, "transactional.id": f"t-{topic}"})
    txn.init_transactions(30)
    for committed, seq in ((True, 0), (False, 1)):
        txn.begin_transaction()
        row = {**crow(10 + seq), "consumer": "loader:eos1", "consume_seq": seq}
        txn.produce(topic, json.dumps(row).encode(), txn_key("loader:eos1", seq))
        txn.commit_transaction(30) if committed else txn.abort_transaction(30)
    plain = Producer({"bootstrap.servers": kafka_bootstrap})
    plain.produce(topic, json.dumps(prow(99)).encode(), b"no-kind-here")
    plain.flush(30)

    r1 = land_topic(spark, cfg)
    assert (r1.tables["producer_ledger"].landed, r1.tables["consumed_records"].landed) == (10, 5)
    assert (r1.replayed, r1.quarantined, r1.bad_keys) == (4, 1, 1)
    assert _landed(spark, cfg, "producer_ledger", "seq", "status") == [
        *[(i, "acked") for i in range(8)], (8, "failed"), (9, "acked")]
    assert _landed(spark, cfg, "consumed_records", "consumer", "consume_seq", "offset") == [
        *[("c-1", o, o) for o in range(4)], ("loader:eos1", 0, 10)]  # the aborted one (offset 11) never lands
    quarantined = _landed(spark, cfg, QUARANTINE_TABLE, "table", "reason")
    assert quarantined == [("producer_ledger", "not a JSON object of the producer_ledger schema"),
                           ("unknown", "ledger topic key is not producer/<id> or consumer/<id>: no-kind-here")]
    assert lake.read_table(spark, cfg, IDS_TABLE).count() == 16

    # A whole spool replayed after the first ingest (markers lost, `msgaudit ship` run from a backup):
    for seg in sealed_segments(spool / "producer") + sealed_segments(spool / "consumer"):
        marker(seg).unlink()
    assert ship_spool(spool, cfg.ledger.kafka, topic).rows == 15
    r2 = run_step(spark, cfg, "ingest", StepRange(None, None, None, None))  # the CLI's path
    assert (r2.landed, r2.replayed, r2.quarantined, r2.bad_keys) == (0, 15, 0, 0)
    assert lake.read_table(spark, cfg, "producer_ledger").count() == 10
    assert lake.read_table(spark, cfg, "consumed_records").count() == 5
    assert lake.read_table(spark, cfg, QUARANTINE_TABLE).count() == 2
    r3 = land_topic(spark, cfg)  # nothing new in the topic: nothing read
    assert (r3.landed, r3.replayed) == (0, 0)
