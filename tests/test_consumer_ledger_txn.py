"""exactly_once_kafka consumption rows, and the output producer's rows of what the batch produced, ride
in the consumer's transaction to the ledger topic: a crash just after the commit loses none of them
(no false `missed`, no `unledgered` output), an aborted batch's rows never land.
Real broker, real consumer processes killed with os._exit, real Spark ingest of the ledger topic."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from audit.clients.sinks import Position, SqlSink
from spark_jobs.ingest import SINK_EVIDENCE
from spark_jobs.ingest_topic import land_topic
from spark_jobs.io import lake
from tests.conftest import new_topic
from tests.test_consumer import N, crash_case, processed_offsets, read_committed
from tests.test_ingest import crow

pytestmark = [pytest.mark.kafka, pytest.mark.spark]


def _consumption(records: list[Any]) -> list[Any]:
    return [m for m in records if (m.key() or b"").startswith(b"consumer/")]


def _produced(records: list[Any]) -> list[Any]:
    return [m for m in records if (m.key() or b"").startswith(b"producer/")]


def test_rows_committed_with_the_transaction_survive_a_kill_just_after_commit(
        tmp_path: Path, kafka_bootstrap: str, spark: Any, make_config: Any) -> None:
    out = new_topic(kafka_bootstrap)
    ledger_topic = new_topic(kafka_bootstrap, prefix="ledger")
    source, batch, spool_rows = crash_case(tmp_path, kafka_bootstrap, "exactly_once_kafka", "txn_committed",
                                           sink_url=None, output_topic=out, ledger_topic=ledger_topic)
    # The batch it died in was committed (outputs + offsets): the rerun did not redo it ...
    assert sorted(json.loads(m.value() or b"{}")["n"] for m in read_committed(kafka_bootstrap, out, N)) == \
        list(range(N))
    # ... and the local spool never got its rows (the process died before writing them) ...
    assert processed_offsets(spool_rows) == Counter(o for o in range(N) if o not in batch)
    # ... but the ledger topic did, in the same transaction: every offset processed exactly once,
    # and every output message has its producer row (acked at its offset), the killed batch's too.
    everything = read_committed(kafka_bootstrap, ledger_topic, 2 * N)
    records = _consumption(everything)
    rows = [json.loads(m.value() or b"{}") for m in records]
    assert processed_offsets(rows) == Counter(range(N))
    keys = [(m.key() or b"").decode() for m in records]
    assert len(set(keys)) == N and all(k.startswith("consumer/txn:") for k in keys)
    outputs = {(m.partition(), m.offset()) for m in read_committed(kafka_bootstrap, out, N)}
    produced = [json.loads(m.value() or b"{}") for m in _produced(everything)]
    assert sorted((r["partition"], r["offset"]) for r in produced) == sorted(outputs)
    assert {(r["topic"], r["status"]) for r in produced} == {(out, "acked")}
    assert all((m.key() or b"").startswith(b"producer/txn:") for m in _produced(everything))
    assert len(everything) == 2 * N  # nothing else: no spool copy was shipped a second time

    # The same ingest also lands an exactly_once_sink consumer's evidence kept in its sink database.
    url = f"sqlite:///{tmp_path / 'sink.db'}"
    with SqlSink(url, "orders_out") as sink:
        sink.write([], group="loader", positions=[Position("orders", 0, 1)], consumption=[crow(0)])
    cfg = make_config(tmp_path / "lake-side", ledger={"topic": ledger_topic}, topics={"orders": {
        "groups": ["loader"], "sinks": [{"name": "db", "format": "sql", "url": url, "table": "orders_out"}]}})
    result = land_topic(spark, cfg)
    assert (result.tables["consumed_records"].landed, result.tables["producer_ledger"].landed,
            result.tables[SINK_EVIDENCE].landed, result.replayed) == (N, N, 1, 0)
    landed = lake.read_table(spark, cfg, "consumed_records").select("topic", "offset", "outcome").collect()
    assert sorted((r["topic"], r["offset"], r["outcome"]) for r in landed) == sorted(
        [(source, o, "processed") for o in range(N)] + [("orders", 0, "processed")])


def test_an_aborted_batch_leaves_no_rows_in_the_ledger_topic(tmp_path: Path, kafka_bootstrap: str) -> None:
    out = new_topic(kafka_bootstrap)
    ledger_topic = new_topic(kafka_bootstrap, prefix="ledger")
    _, batch, spool_rows = crash_case(tmp_path, kafka_bootstrap, "exactly_once_kafka", "txn_before_commit",
                                      sink_url=None, output_topic=out, ledger_topic=ledger_topic)
    records = _consumption(read_committed(kafka_bootstrap, ledger_topic, 2 * N))
    rows = [json.loads(m.value() or b"{}") for m in records]
    assert processed_offsets(rows) == Counter(range(N)) == processed_offsets(spool_rows)
    assert len(batch) >= 1
