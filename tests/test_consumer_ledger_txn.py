"""exactly_once_kafka consumption rows ride in the consumer's transaction to the ledger topic: a crash
just after the commit loses none of them (no false `missed`), an aborted batch's rows never land.
Real broker, real consumer processes killed with os._exit, real Spark ingest of the ledger topic."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from spark_jobs.ingest_topic import land_topic
from spark_jobs.io import lake
from tests.conftest import new_topic
from tests.test_consumer import N, crash_case, processed_offsets, read_committed

pytestmark = [pytest.mark.kafka, pytest.mark.spark]


def _consumption(records: list[Any]) -> list[Any]:
    return [m for m in records if (m.key() or b"").startswith(b"consumer/")]


def test_rows_committed_with_the_transaction_survive_a_kill_just_after_commit(
        tmp_path: Path, kafka_bootstrap: str, spark: Any, make_config: Any) -> None:
    out = new_topic(kafka_bootstrap)
    ledger_topic = new_topic(kafka_bootstrap, prefix="ledger")
    _, batch, spool_rows = crash_case(tmp_path, kafka_bootstrap, "exactly_once_kafka", "txn_committed",
                                      sink_url=None, output_topic=out, ledger_topic=ledger_topic)
    # The batch it died in was committed (outputs + offsets): the rerun did not redo it ...
    assert sorted(json.loads(m.value() or b"{}")["n"] for m in read_committed(kafka_bootstrap, out, N)) == \
        list(range(N))
    # ... and the local spool never got its rows (the process died before writing them) ...
    assert processed_offsets(spool_rows) == Counter(o for o in range(N) if o not in batch)
    # ... but the ledger topic did, in the same transaction: every offset processed exactly once.
    # (the topic also gets the output producer's ledger rows: all but those of the killed batch)
    records = _consumption(read_committed(kafka_bootstrap, ledger_topic, 2 * N - len(batch)))
    rows = [json.loads(m.value() or b"{}") for m in records]
    assert processed_offsets(rows) == Counter(range(N))
    keys = [(m.key() or b"").decode() for m in records]
    assert len(set(keys)) == N and all(k.startswith("consumer/txn:") for k in keys)

    cfg = make_config(tmp_path / "lake-side", ledger={"topic": ledger_topic})
    result = land_topic(spark, cfg)
    assert (result.tables["consumed_records"].landed, result.replayed) == (N, 0)
    landed = lake.read_table(spark, cfg, "consumed_records").select("offset", "outcome").collect()
    assert sorted((r["offset"], r["outcome"]) for r in landed) == [(o, "processed") for o in range(N)]


def test_an_aborted_batch_leaves_no_rows_in_the_ledger_topic(tmp_path: Path, kafka_bootstrap: str) -> None:
    out = new_topic(kafka_bootstrap)
    ledger_topic = new_topic(kafka_bootstrap, prefix="ledger")
    _, batch, spool_rows = crash_case(tmp_path, kafka_bootstrap, "exactly_once_kafka", "txn_before_commit",
                                      sink_url=None, output_topic=out, ledger_topic=ledger_topic)
    records = _consumption(read_committed(kafka_bootstrap, ledger_topic, 2 * N))
    rows = [json.loads(m.value() or b"{}") for m in records]
    assert processed_offsets(rows) == Counter(range(N)) == processed_offsets(spool_rows)
    assert len(batch) >= 1
