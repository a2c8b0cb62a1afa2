"""The Connect and Structured Streaming lab scenarios (audit.lab.connect) on the session broker: one
Connect worker (started and stopped with `msgaudit connect`), Iceberg's sink connector with
KafkaMetadataTransform, a Structured Streaming job, one audit run by the rows' Kafka coordinates;
the audit's anomaly rows == the truth computed from the tables and the log, exactly."""

from __future__ import annotations

import io
from collections.abc import Iterator
from contextlib import redirect_stdout
from typing import Any

import pytest

from audit.core import config as config_mod
from audit.lab.connect import CONNECT
from audit.lab.env import Lab
from audit.lab.runner import LabResult, run_scenarios
from audit.lab.scenarios import CONNECT_SCENARIOS
from tests.test_lab_scenarios import _check

# What each scenario is designed to cause (anomaly -> rows); connect_kill: whatever the restart did.
DESIGNED: dict[str, dict[str, int] | None] = {
    "connect_dlq": {"dead_lettered": 1},
    "connect_drop": {"missing_in_sink": 1},
    "connect_kill": None,
    "streaming_restart": {"duplicate_in_sink": 6},  # every record of the log written twice
}


def _cli(*argv: str) -> tuple[int, str]:
    from audit import cli

    out = io.StringIO()
    with redirect_stdout(out):
        code = cli.main(list(argv))
    return code, out.getvalue()


@pytest.fixture(scope="module")
def connect_lab(tmp_path_factory: pytest.TempPathFactory, spark: Any,
                kafka_bootstrap: str) -> Iterator[tuple[LabResult, dict[str, tuple[int, str]]]]:
    """The worker is started with `msgaudit connect start --dir <work>/connect`: the scenarios use
    it (and restart it after the SIGKILL), and leave it running for `connect status` and `stop`."""
    from audit.runtime.local_kafka import free_port

    work = tmp_path_factory.mktemp("connect-lab")
    port = free_port()
    args = ("--dir", str(work / "connect"), "--port", str(port))
    cli: dict[str, tuple[int, str]] = {"start": _cli("connect", "start", "--bootstrap", kafka_bootstrap, *args)}
    try:
        cfg = config_mod.from_dict({"home": str(work / ".msgaudit")}, source="<lab test>", base=work)
        result = run_scenarios(CONNECT_SCENARIOS, Lab(kafka_bootstrap), cfg, work, lambda: spark)
        cli["status"] = _cli("connect", "status", *args)
    finally:
        cli["stop"] = _cli("connect", "stop", *args)
    cli["status_after"] = _cli("connect", "status", *args)
    cli["port"] = (port, "")
    yield result, cli


@pytest.mark.e2e
@pytest.mark.kafka
@pytest.mark.spark
@pytest.mark.parametrize("name", CONNECT_SCENARIOS)
def test_audit_by_coordinates_reports_exactly_the_ground_truth(
        connect_lab: tuple[LabResult, dict[str, tuple[int, str]]], name: str) -> None:
    _check(connect_lab[0], name, DESIGNED)


@pytest.mark.e2e
@pytest.mark.kafka
@pytest.mark.spark
def test_connect_kill_killed_the_worker_mid_commit(connect_lab: tuple[LabResult, dict[str, tuple[int, str]]]) -> None:
    """The kill landed inside a commit (its data files written and in the coordinator's hands, the
    commit not completed), and after the restart the table covers the log but for what the truth says."""
    result, _ = connect_lab
    run = next(r for r in result.runs if r.name == "connect_kill")
    assert run.truth is not None
    facts = run.truth.facts
    assert facts["commit_completed_before_kill"] is False and facts["data_files_at_kill"] > 0, facts
    assert facts["messages"] == 30
    (topic,) = run.topics
    sink = [r for r in result.report if r["topic"] == topic and r["stage"] == "sink:iceberg"]
    assert sum(r["expected"] for r in sink) == 30
    assert sum(r["delivered"] for r in sink) == 30 - facts.get("missing_in_sink", 0)
    assert sum(r["duplicated"] for r in sink) == facts.get("duplicate_in_sink", 0)


@pytest.mark.e2e
@pytest.mark.kafka
@pytest.mark.spark
def test_sink_report_rows_of_the_connectors_and_the_streaming_job(
        connect_lab: tuple[LabResult, dict[str, tuple[int, str]]]) -> None:
    """Per-scenario sink stage sums: the DLQ'd record is accounted for, the dropped one lost; the
    streaming job's 6 records (2 partitions, a transaction marker's offset on partition 0 never
    expected) each delivered and duplicated once, with no sink latency (no sink time mapped)."""
    result, _ = connect_lab
    keys = ("expected", "delivered", "lost", "duplicated", "dead_lettered", "missing_in_sink")
    got = {}
    for run in result.runs:
        (topic,) = run.topics
        rows = [r for r in result.report if r["topic"] == topic and r["stage"].startswith("sink:")]
        got[run.name] = [sum(int(r[k] or 0) for r in rows) for k in keys]
        if run.name == "streaming_restart":
            assert rows and all(r["latency_p99_ms"] is None for r in rows)
            assert run.truth is not None and run.truth.facts["offsets_without_record_on_p0"] == 1
    assert got["connect_dlq"] == [6, 5, 0, 0, 1, 0]
    assert got["connect_drop"] == [6, 5, 1, 0, 0, 1]
    assert got["streaming_restart"] == [6, 6, 0, 6, 0, 0]


@pytest.mark.e2e
@pytest.mark.kafka
@pytest.mark.spark
def test_msgaudit_connect_starts_reports_and_stops_the_worker_the_lab_used(
        connect_lab: tuple[LabResult, dict[str, tuple[int, str]]], kafka_bootstrap: str) -> None:
    _, cli = connect_lab
    port = cli["port"][0]
    assert cli["start"][0] == 0
    assert cli["start"][1].startswith(f"connect: worker ready at http://127.0.0.1:{port} on {kafka_bootstrap}")
    # every scenario deleted its connector once its table was final
    assert cli["status"] == (0, f"connect: running at http://127.0.0.1:{port}; connectors: none\n")
    assert cli["stop"] == (0, "connect: stopped\n")
    assert cli["status_after"] == (1, "connect: not running\n")


@pytest.mark.unit
def test_connect_scenarios_are_registered_apart_from_the_proxy_ones() -> None:
    from audit.lab.scenarios import PROXY_SCENARIOS, SCENARIOS

    assert CONNECT_SCENARIOS == tuple(CONNECT) == tuple(DESIGNED)
    assert all(SCENARIOS[n] == CONNECT[n] for n in CONNECT_SCENARIOS)
    assert not set(CONNECT_SCENARIOS) & set(PROXY_SCENARIOS)


@pytest.mark.e2e
@pytest.mark.kafka
@pytest.mark.spark
def test_trace_shows_a_coordinate_sinks_rows_and_its_dead_letter_record(
        connect_lab: tuple[LabResult, dict[str, tuple[int, str]]], spark: Any) -> None:
    """`trace` of the dead-lettered record shows its one DLQ record as a sink row (dead_letter true),
    and of a record the streaming job wrote twice its two rows, both resolved by coordinates."""
    from spark_jobs.trace import TraceQuery, trace_messages

    result, _ = connect_lab
    wanted = {"connect_dlq": "dead_lettered", "streaming_restart": "duplicate_in_sink"}
    queries, stages = [], []
    for run in result.runs:
        if run.name in wanted:
            (topic,) = run.topics
            row = next(a for a in result.anomalies[topic] if a["anomaly"] == wanted[run.name])
            queries.append(TraceQuery(topic, partition=row["partition"], offset=row["offset"]))
            stages.append(row["stage"].removeprefix("sink:"))
    dlq, twice = trace_messages(spark, result.cfg, queries)
    assert [r["dead_letter"] for r in dlq["sinks"][stages[0]]] == [True]
    assert [r["dead_letter"] for r in twice["sinks"][stages[1]]] == [False, False]
    assert [len(dlq["log"]), len(twice["log"])] == [1, 1]
