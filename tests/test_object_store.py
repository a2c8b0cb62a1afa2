"""The lake and every checkpoint on an S3-compatible object store, reached through s3a exactly as a
cloud bucket would be: endpoint, path-style access and credentials come from the config's `spark:`
section (credentials through `${ENV}`), and ingest, capture, reconcile and SLA run end to end.

Reconcile settles each window in Spark tasks (`reconcile.engine: spark`), and the tasks read the
lake's Parquet files on the store themselves, with pyarrow and the same S3A settings.

The store is moto's server mode (a separate process serving the S3 HTTP API on 127.0.0.1): light
to start, and the S3A connector talks to it over HTTP like to any bucket."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from audit.core import config as config_mod
from audit.lab.env import ProxiedBroker
from audit.lab.runner import LabResult, run_scenarios
from spark_jobs.io.session import build_spark
from tests.support.services import S3Server, s3_server, s3a_settings

# The lab's designed faults of these scenarios (the same as tests/test_lab_scenarios.py).
DESIGNED = {"at_least_once": {"redelivered": 10, "duplicate_in_sink": 5}}


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Server]:
    with s3_server() as server:
        yield server


@pytest.fixture(scope="module")
def s3_result(tmp_path_factory: pytest.TempPathFactory, spark: Any, s3: S3Server) -> Iterator[LabResult]:
    work = tmp_path_factory.mktemp("s3-lab")
    mp = pytest.MonkeyPatch()
    mp.setenv("MSGAUDIT_TEST_S3_ACCESS_KEY", s3.access_key)
    mp.setenv("MSGAUDIT_TEST_S3_SECRET_KEY", s3.secret_key)
    cfg = config_mod.from_dict({
        "home": str(work / ".msgaudit"),
        "lake": f"s3a://{s3.bucket}/prod/lake/",
        "reconcile": {"engine": "spark"},  # the windows settled in Spark tasks, which read the lake's files
        "spark": s3a_settings(s3.endpoint, "${MSGAUDIT_TEST_S3_ACCESS_KEY}", "${MSGAUDIT_TEST_S3_SECRET_KEY}"),
    }, source="<s3 test>", base=work)
    mp.undo()
    session = build_spark(cfg)  # the shared session, with the config's Hadoop settings applied
    with ProxiedBroker(work / "kafka") as lab:
        yield run_scenarios(list(DESIGNED), lab, cfg, work, lambda: session)


@pytest.mark.e2e
@pytest.mark.kafka
@pytest.mark.spark
def test_pipeline_on_an_s3_lake_equals_the_ground_truth(s3_result: LabResult, s3: S3Server) -> None:
    result = s3_result
    assert result.cfg.lake == f"s3a://{s3.bucket}/prod/lake"
    for run in result.runs:
        assert run.error is None, f"{run.name}: {run.error}"
        assert run.truth is not None
        assert run.truth.counts() == DESIGNED[run.name], run.truth.facts
        problems = [result.comparisons[t].describe() for t in run.topics if not result.comparisons[t].exact]
        assert not problems, "\n".join(problems)
    # Every table and checkpoint is in the bucket, none in the local home.
    tops = {k.split("/")[2] for k in s3.keys("prod/lake/")}
    assert tops == {"_checkpoints", "producer_ledger", "consumed_records", "producer_settings", "ledger_quarantine", "log_records",
                    "group_offsets", "partition_watermarks", "audit_partition_report", "audit_anomalies"}, tops
    assert {k.split("/")[3] for k in s3.keys("prod/lake/_checkpoints/")} == {
        "ingest_producer_ledger", "ingest_consumed_records", "ingest_producer_settings"}
    assert not (result.cfg.home / "lake").exists()


@pytest.mark.e2e
@pytest.mark.kafka
@pytest.mark.spark
def test_report_and_sla_rows_from_the_s3_lake(s3_result: LabResult) -> None:
    result = s3_result
    (topic,) = result.runs[0].topics
    # 25 messages; each group redelivered the 5 of its uncommitted batch; only the insert sink
    # wrote them twice (the upsert sink overwrote them).
    # The run may straddle a window boundary: sum each stage's counts over the windows.
    sums: dict[tuple[str, int], list[int]] = {}
    for r in result.report:
        assert r["status"] == "final", r
        acc = sums.setdefault((r["stage"].replace(topic, "T"), r["partition"]), [0, 0, 0, 0, 0])
        for i, c in enumerate(("expected", "delivered", "lost", "duplicated", "reordered")):
            acc[i] += r[c]
    rows = sorted((stage, part, *acc) for (stage, part), acc in sums.items())
    assert rows == [("group:T-insert", 0, 25, 25, 0, 5, 0),
                    ("group:T-upsert", 0, 25, 25, 0, 5, 0),
                    ("log", 0, 25, 25, 0, 0, 0),
                    ("sink:plain_insert", 0, 25, 25, 0, 5, 0),
                    ("sink:upsert", 0, 25, 25, 0, 0, 0)], rows
    failed = sorted((r["stage"].replace(topic, "T"), r["rule"], r["observed"]) for r in result.sla.rows
                    if not r["passed"])
    assert failed == [("group:T-insert", "max_duplicate_ratio", 0.2), ("group:T-upsert", "max_duplicate_ratio", 0.2),
                      ("sink:plain_insert", "max_duplicate_ratio", 0.2)], failed
    # Running ingest again lands nothing new: the checkpoints on S3 remember what was read.
    from spark_jobs.pipeline.steps import StepRange, run_step

    again = run_step(build_spark(result.cfg), result.cfg, "ingest", StepRange())
    assert again.landed == 0


@pytest.mark.spark
def test_the_tasks_read_the_lakes_files_on_the_store_themselves(s3_result: LabResult, s3: S3Server,
                                                                spark: Any) -> None:
    """A pinned scan of a lake table on the store is a `FileTable` on that store (its files' keys,
    the settings of the session's S3A connector, no secret in its repr), and pyarrow reads from it
    exactly the rows Spark reads."""
    import pyarrow as pa

    from spark_jobs.io.lake import pin_scans, read_table
    from spark_jobs.reconcile.read import file_table, object_store
    from spark_jobs.reconcile.settle import FEW_VALUES, Chunks, read_files

    store = object_store(spark)
    assert store is not None and store.secret_key is not None and store.access_key is not None
    assert store.secret_key not in repr(store) and store.access_key not in repr(store)
    cols = ["topic", "partition", "offset", "pid", "seq"]
    df = pin_scans(read_table(spark, s3_result.cfg, "log_records").select(*cols))
    ft = file_table(df, cols, store)
    assert ft is not None and ft.store == store and ft.paths
    assert all(p.startswith(f"{s3.bucket}/prod/lake/log_records/") for p in ft.paths), ft.paths
    got = read_files(ft, Chunks((), ()), 0)
    want = sorted(tuple(r) for r in df.collect())
    assert want and sorted(zip(*(got[c].to_pylist() for c in cols), strict=True)) == want
    # as the settling tasks read it: the topic (a partition directory) and the pid dictionary encoded
    coded = read_files(ft, Chunks((), ()), 0, dictionary=FEW_VALUES)
    assert [coded.schema.field(c).type for c in ("topic", "pid")] == [pa.dictionary(pa.int32(), pa.string())] * 2
    assert sorted(zip(*(coded[c].to_pylist() for c in cols), strict=True)) == want
    assert file_table(df, cols) is None  # without the store's settings: Spark's to read
