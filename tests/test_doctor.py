"""`msgaudit doctor` against the real local broker (docs/design.md §9): an unsafely configured topic
with a stalled group reports exactly its risks, a safe topic none."""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

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


@pytest.mark.kafka
@pytest.mark.spark
def test_doctor_reports_producers_without_acks_all_or_idempotence(
        spark: Any, kafka_bootstrap: str, make_config: Callable[..., Config], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch, libmsgaudit: Path) -> None:
    """Each AuditedProducer records its settings at start, on both paths; ingest lands them in
    producer_settings; doctor reports the unsafe session (acks=1, no idempotence) and not the safe one."""
    from audit import AuditedProducer
    from audit.clients.doctor import producer_risks
    from spark_jobs.ingest import ingest
    from spark_jobs.trace import producer_sessions

    monkeypatch.setenv("MSGAUDIT_PLUGIN", str(libmsgaudit))
    topic = new_topic(kafka_bootstrap, prefix="producers")
    cfg = make_config(tmp_path, topics={topic: {}})
    t0 = datetime.now(UTC)
    ledger = cfg.ledger_dir / "producer"
    with AuditedProducer(dict(cfg.kafka), producer_name="safe", ledger_dir=ledger) as safe:
        assert safe.mode == "plugin"
        safe.produce(topic, value=b"a")
        safe.flush(30)
    risky = AuditedProducer({**cfg.kafka, "acks": "1", "retries": 3, "max.in.flight.requests.per.connection": 5},
                            producer_name="risky", ledger_dir=ledger, use_plugin=False)
    with risky:
        risky.produce(topic, value=b"b")
        risky.flush(30)
    ingest(spark, cfg)
    rows, topics_of = producer_sessions(spark, cfg, t0 - timedelta(minutes=1))
    got = sorted(({k: v for k, v in r.items() if k != "start_ts"} for r in rows), key=lambda r: r["producer"])
    assert got == [
        {"producer": "risky", "pid": risky.pid, "acks": "1", "enable_idempotence": False, "retries": 3,
         "max_in_flight": 5, "transactional_id": None, "mode": "python"},
        {"producer": "safe", "pid": safe.pid, "acks": "all", "enable_idempotence": True, "retries": 2147483647,
         "max_in_flight": 1000000, "transactional_id": None, "mode": "plugin"}]
    assert all(t0 - timedelta(seconds=1) <= r["start_ts"].replace(tzinfo=UTC) <= datetime.now(UTC) for r in rows)
    assert topics_of == {risky.pid: [topic], safe.pid: [topic]}
    risks = producer_risks(rows, topics_of)
    assert [(r.severity, r.risk, r.topic, r.subject) for r in risks] == [
        ("error", "producer_acks", topic, f"producer:risky ({risky.pid})"),
        ("warn", "producer_idempotence", topic, f"producer:risky ({risky.pid})")]
    assert risks[1].detail == ("enable.idempotence=false (retries=3, max.in.flight=5): a retried batch is written "
                               "twice or out of order; set enable.idempotence=true")


@pytest.mark.kafka
def test_a_growing_dead_letter_topic_is_reported_and_the_run_stored(
        kafka_bootstrap: str, make_config: Callable[..., Config], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    """The first run samples `<group>.dlq`; the next run after two dead letters reports them; each
    `msgaudit doctor` run is stored in the report store (the dashboard shows the latest)."""
    from confluent_kafka import Producer

    from audit import cli
    from audit.serving.report_store import ReportStore

    topic = new_topic(kafka_bootstrap, prefix="dlqsrc", min_insync_replicas="2")
    group = f"{topic}-loader"
    from confluent_kafka.admin import AdminClient, NewTopic

    dlq = f"{group}.dlq"
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})  # held: a collected client fails its futures
    admin.create_topics([NewTopic(dlq, 2, 1)])[dlq].result(timeout=30)
    deadline = time.monotonic() + 60  # the first doctor run must see it, or it takes no sample
    while time.monotonic() < deadline:
        t = admin.list_topics(dlq, timeout=10).topics.get(dlq)
        if t is not None and t.error is None and len(t.partitions) == 2 and all(
                pm.leader >= 0 for pm in t.partitions.values()):
            break
        time.sleep(0.5)
    cfg = make_config(tmp_path, topics={topic: {"groups": [group]}})
    args = cli.build_parser().parse_args(["doctor", "--min-replication-factor", "1", "--producer-hours", "0"])
    assert cli.COMMANDS["doctor"](args, cfg) == 0
    assert capsys.readouterr().out == "doctor: 0 risk(s), 0 error\n"
    p = Producer({"bootstrap.servers": kafka_bootstrap})
    for i in range(2):
        p.produce(dlq, value=b"dead%d" % i, partition=i)
    p.flush(30)
    assert cli.COMMANDS["doctor"](args, cfg) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 2 and out[1] == "doctor: 1 risk(s), 0 error"
    assert out[0].startswith(f"WARN   {topic}  group:{group}  dlq_growing: {group}.dlq grew by 2 records since ")
    assert out[0].endswith("(2 in all): messages keep failing processing")
    with ReportStore(cfg.report_store) as store:
        at, risks = store.latest_risks()
    assert at is not None and [(r["severity"], r["topic"], r["subject"], r["risk"]) for r in risks] == [
        ("warn", topic, f"group:{group}", "dlq_growing")]


def _mirror_config(tmp_path: Path) -> Config:
    from audit.core.config import from_dict

    mirror = {"name": "dr", "kafka": {"bootstrap.servers": "127.0.0.1:1"}, "failover_groups": ["g1"]}
    return from_dict({"home": str(tmp_path / ".msgaudit"), "lake": str(tmp_path / "lake"),
                      "topics": {"t": {"groups": ["g1", "g2"], "mirrors": [mirror]}, "u": {"groups": ["g1"]}}},
                     base=tmp_path)


@pytest.mark.unit
def test_doctor_warns_of_rows_read_on_a_mirror_that_reconcile_ignores(tmp_path: Path) -> None:
    from audit.clients.doctor import mirror_risks

    cfg = _mirror_config(tmp_path)
    counts = {("t", "g1", "dr"): 5,  # a failover group on its mirror: used, no risk
              ("t", "g2", "dr"): 3, ("t", "g1", "eu"): 1, ("u", "g1", "dr"): 2,
              ("t", "g9", "dr"): 4,  # not a group of t: out of its judgement anyway
              ("x", "g1", "dr"): 7}  # not a configured topic
    risks = mirror_risks(cfg, counts)
    assert [r.line() for r in risks] == [
        "WARN   t  group:g1  mirror_rows_ignored: ignored 1 consumption row of group 'g1' read on cluster 'eu' "
        "(no mirror of topic 't' has that name; its mirrors: 'dr'): name the mirror as configured under "
        "topics.t.mirrors, with 'g1' in its failover_groups, or drop the cluster setting",
        "WARN   t  group:g2  mirror_rows_ignored: ignored 3 consumption rows of group 'g2' read on mirror 'dr' "
        "(not in its failover_groups): add 'g2' to mirrors[dr].failover_groups, or drop the cluster setting",
        "WARN   u  group:g1  mirror_rows_ignored: ignored 2 consumption rows of group 'g1' read on cluster 'dr' "
        "(no mirror of topic 'u' has that name; its mirrors: none): name the mirror as configured under "
        "topics.u.mirrors, with 'g1' in its failover_groups, or drop the cluster setting"]
    assert [r.topic for r in mirror_risks(cfg, counts, ["u"])] == ["u"]


@pytest.mark.unit
def test_the_doctor_command_prints_the_mirror_rows_it_was_given_after_the_broker_risks(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from audit import cli
    from audit.clients import doctor

    monkeypatch.setattr(doctor, "diagnose", lambda *a, **k: [])  # the broker's part is tested above, with a broker
    cfg = _mirror_config(tmp_path)
    args = cli.build_parser().parse_args(["doctor", "--topic", "t"])
    assert doctor.cli_doctor(args, cfg, None, None, {("t", "g2", "dr"): 3, ("u", "g1", "dr"): 2}) == 0
    assert capsys.readouterr().out.splitlines() == [
        "WARN   t  group:g2  mirror_rows_ignored: ignored 3 consumption rows of group 'g2' read on mirror 'dr' "
        "(not in its failover_groups): add 'g2' to mirrors[dr].failover_groups, or drop the cluster setting",
        "doctor: 1 risk(s), 0 error"]


@pytest.mark.spark
def test_doctor_counts_the_recent_rows_read_on_a_mirror_from_the_lake(spark: Any, tmp_path: Path) -> None:
    from audit.oracle import ConsumedRow, Inputs
    from spark_jobs.trace import mirror_consumption
    from tests.reconcile_cases import T0, at, frame, table_rows

    cfg = _mirror_config(tmp_path)
    consumed = [ConsumedRow("g1", "c", i, 0, i, "p", i, "processed", at(10)) for i in range(4)]  # the source
    consumed += [ConsumedRow("g2", "c", 10 + i, 0, 100 + i, "p", i, "processed", at(20), cluster="dr") for i in range(3)]
    consumed += [ConsumedRow("g1", "c", 20, 0, 100, "p", 0, "committed", at(90), cluster="eu")]
    consumed += [ConsumedRow("g2", "c", 30, 0, 100, "p", 0, "processed", at(-30), cluster="dr")]  # before `since`
    consumed += [ConsumedRow("g1", "c", 40, 0, 100, "p", 0, "processed", at(20), cluster="dr", topic="u")]
    rows = table_rows(Inputs(consumed=consumed))["consumed_records"]
    (frame(spark, "consumed_records", rows).write.format("delta").partitionBy("topic", "part_hour")
     .save(f"{cfg.lake}/consumed_records"))
    assert mirror_consumption(spark, cfg, T0) == {("t", "g2", "dr"): 3, ("t", "g1", "eu"): 1, ("u", "g1", "dr"): 1}
