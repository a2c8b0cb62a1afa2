"""The acceptance suite: every lab scenario on a real broker, audited by the real pipeline (ingest,
capture, reconcile, SLA), and the audit's anomaly rows must equal the scenario's ground truth
exactly -- no miss, no false alarm.

Two checks per scenario: (1) the ground truth is what the scenario was designed to cause (so the
fault really happened and the equality below cannot pass vacuously), (2) the audit's rows for the
scenario's topics == that ground truth, as multisets of (stage, anomaly, partition, pid, seq, offset).

The single-broker scenarios run in three groups, each on one broker behind the fault proxy with
one audit run (the JVMs are the expensive part): the producer and consumer ones here, the
MirrorMaker 2 ones (tests/test_lab_mirror.py, with a second local cluster as the mirror's target)
and the share-group ones (tests/test_lab_share.py), so the test workers run the groups side by
side. `lost_acked` runs on its own local 3-node cluster.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import pytest

from audit.core import config as config_mod
from audit.core.errors import InputError
from audit.lab import demo
from audit.lab.env import LocalCluster, ProxiedBroker
from audit.lab.runner import LabResult, run_scenarios
from audit.lab.scenarios import CONNECT_SCENARIOS, MIRROR_SCENARIOS, PROXY_SCENARIOS, SCENARIOS
from audit.lab.share import SHARE_SCENARIOS
from audit.lab.truth import Truth, compare

# What each scenario is designed to cause: anomaly -> rows.
DESIGNED: dict[str, dict[str, int]] = {
    "lost_response": {"duplicate_in_log": 10},  # 2 dropped responses x batches of 5
    "lost_response_idempotent": {},
    "reorder": {"reordered_in_log": 5},  # one batch of 5 failed in flight
    "producer_restart": {"content_duplicate": 5},
    "at_most_once": {"missed": 5},  # the batch committed before the kill
    "at_least_once": {"redelivered": 10, "duplicate_in_sink": 5},  # 2 groups x 5; only the insert sink duplicates
    # killed after the timer committed a batch of 10 it had processed 5 of, then 5 records after a
    # commit of offset 20 it processed 15 past (the next life redoes them)
    "auto_commit": {"missed": 5, "redelivered": 15},
    "exactly_once_kafka": {},
    "exactly_once_sink": {},
    "aborted": {"aborted": 5, "aborted_read": 5},
    "retention": {"expired_unconsumed": 15},  # 20 produced, 5 consumed before the stall
    "poison": {"dead_lettered": 1},
    "unaudited": {"unaudited": 5},
    "lost_acked": {"lost_acked": 10},  # acked while the follower was frozen
    "mirror_kill": {"duplicate_in_mirror": 10},  # the 10 copied before the SIGKILL, copied again
    "mirror_retention": {"lost_in_mirror": 10},  # produced during MM2's outage, deleted by retention
    # produced during MM2's outage, copied with their old timestamps, deleted by the target's retention
    "mirror_target_retention": {"lost_in_mirror": 10},
    # 10 processed on the source; MM2 (offset.lag.max=100: one offset sync, at offset 0) translated
    # the committed 10 to 1 on the target, where the group processed 1..9 again
    "mirror_failover": {"redelivered": 9},
    # share groups (audit.lab.share): the 10 records the killed member held, handed again
    "share_kill": {"redelivered": 10},
    "share_poison": {"rejected": 1},
    "share_archive": {"redelivered": 2, "archived_unprocessed": 1},  # delivery limit 3
    "share_slow": {"redelivered": 1, "processed_twice": 1},
    "share_clean": {},
    "share_missed": {"missed": 4},  # the group's start offset moved to 4 before any member joined
    # the broker wrote the rejected record and the one archived at the limit (3) to the group's DLQ
    "share_dlq": {"redelivered": 2, "dead_lettered": 2},
}


def _config(work: Any) -> config_mod.Config:
    return config_mod.from_dict({"home": str(work / ".msgaudit")}, source="<lab test>", base=work)


CORE_SCENARIOS = tuple(n for n in PROXY_SCENARIOS if n not in MIRROR_SCENARIOS and n not in SHARE_SCENARIOS)


def proxied_run(tmp_path_factory: pytest.TempPathFactory, spark: Any, names: tuple[str, ...], *,
                sink_url: str | None = None) -> Iterator[LabResult]:
    """`names` on one broker behind the fault proxy, audited in one run."""
    work = tmp_path_factory.mktemp("lab")
    with ProxiedBroker(work / "kafka") as lab:
        yield run_scenarios(names, lab, _config(work), work, lambda: spark, sink_url=sink_url)


@pytest.fixture(scope="module")
def proxied_result(tmp_path_factory: pytest.TempPathFactory, spark: Any, pg_url: str) -> Iterator[LabResult]:
    """exactly_once_sink writes to the real PostgreSQL (its kill matrix: rows, offsets and
    consumption rows in one PostgreSQL transaction)."""
    yield from proxied_run(tmp_path_factory, spark, CORE_SCENARIOS, sink_url=pg_url)


@pytest.fixture(scope="module")
def cluster_result(tmp_path_factory: pytest.TempPathFactory, spark: Any) -> Iterator[LabResult]:
    work = tmp_path_factory.mktemp("lab-cluster")
    with LocalCluster(work / "kafka") as lab:
        yield run_scenarios(["lost_acked"], lab, _config(work), work, lambda: spark)


def _check(result: LabResult, name: str, designed: Mapping[str, dict[str, int] | None] = DESIGNED) -> None:
    """The scenario ran, caused what it was designed to (unless its design is None: whatever it
    really did), and the audit reported exactly its ground truth."""
    run = next(r for r in result.runs if r.name == name)
    assert run.error is None, f"scenario {name} failed to run: {run.error}"
    assert run.truth is not None and run.topics
    if designed[name] is not None:
        assert run.truth.counts() == designed[name], f"{name}: the fault did not happen as designed: {run.truth.facts}"
    problems = [result.comparisons[t].describe() for t in run.topics if not result.comparisons[t].exact]
    assert not problems, "\n".join(problems)


@pytest.mark.e2e
@pytest.mark.kafka
@pytest.mark.spark
@pytest.mark.postgres
@pytest.mark.parametrize("name", CORE_SCENARIOS)
def test_audit_reports_exactly_the_ground_truth(proxied_result: LabResult, name: str) -> None:
    _check(proxied_result, name)


@pytest.mark.e2e
@pytest.mark.kafka
@pytest.mark.spark
def test_lost_acked_write_on_a_three_node_cluster(cluster_result: LabResult) -> None:
    _check(cluster_result, "lost_acked")
    run = cluster_result.runs[0]
    assert run.truth is not None
    (topic,) = run.topics
    # The writes lost are exactly those acked while the follower could not fetch (seqs 20..29).
    assert sorted(e.seq for e in run.truth.rows[topic] if e.seq is not None) == list(range(20, 30))
    log_rows = [r for r in cluster_result.report if r["topic"] == topic and r["stage"] == "log"]
    assert sum(r["lost"] for r in log_rows) == 10
    assert sum(r["expected"] for r in log_rows) == 45


@pytest.mark.e2e
@pytest.mark.kafka
@pytest.mark.spark
@pytest.mark.postgres
def test_report_counts_follow_the_faults(proxied_result: LabResult) -> None:
    """The per-partition report's lost/duplicated/reordered counts (what the SLA judges) per scenario."""
    by_topic: dict[str, dict[str, int]] = {}
    for r in proxied_result.report:
        t = by_topic.setdefault(r["topic"], {"lost": 0, "duplicated": 0, "reordered": 0})
        for k in t:
            t[k] += int(r[k] or 0)
    runs = {r.name: r for r in proxied_result.runs}
    (dup_topic,) = runs["lost_response"].topics
    (idem_topic,) = runs["lost_response_idempotent"].topics
    (reorder_topic,) = runs["reorder"].topics
    (amo_topic,) = runs["at_most_once"].topics
    assert by_topic[dup_topic] == {"lost": 0, "duplicated": 10, "reordered": 0}
    assert by_topic[idem_topic] == {"lost": 0, "duplicated": 0, "reordered": 0}
    assert by_topic[reorder_topic] == {"lost": 0, "duplicated": 0, "reordered": 5}
    assert by_topic[amo_topic] == {"lost": 5, "duplicated": 0, "reordered": 0}
    # The producers of the duplicating and reordering scenarios recorded idempotence off at start;
    # reconcile copied those settings to the report store, and the explanation names them.
    from audit.core.explain import SETTINGS_CODES, producer_lines
    from audit.serving.report_store import ReportStore

    with ReportStore(proxied_result.cfg.report_store) as store:
        rows = store.anomaly_pids([dup_topic, idem_topic, reorder_topic], None, None, SETTINGS_CODES)
        settings = store.settings_of(r["pid"] for r in rows)
    assert sorted({(r["topic"], r["anomaly"]) for r in rows}) == sorted(
        [(dup_topic, "duplicate_in_log"), (reorder_topic, "reordered_in_log")])
    assert {s["pid"] for s in settings} == {r["pid"] for r in rows}
    assert [(s["acks"], s["enable_idempotence"]) for s in settings] == [("all", False)] * len(settings)
    expected = []
    for code, topic in (("duplicate_in_log", dup_topic), ("reordered_in_log", reorder_topic)):
        for s in settings:
            n = sum(r["rows"] for r in rows if r["pid"] == s["pid"] and r["anomaly"] == code and r["topic"] == topic)
            if n:
                who = f"producer {s['producer']} (session {s['pid']})" if s["producer"] else f"producer session {s['pid']}"
                expected.append((n, code, f"{code} ({n} row{'' if n == 1 else 's'}): {who} ran with "
                                 f"enable.idempotence=false (retries={s['retries']}, max.in.flight={s['max_in_flight']}): "
                                 "set enable.idempotence=true"))
    assert sum(n for n, code, _ in expected if code == "duplicate_in_log") == 10
    assert sum(n for n, code, _ in expected if code == "reordered_in_log") == 5
    assert producer_lines(rows, settings) == [line for _, _, line in sorted(expected, key=lambda e: (-e[0], e[1]))]


# -- the comparison and the demo's plumbing, without a broker ------------------------------------


@pytest.mark.unit
def test_compare_is_exact_on_multisets() -> None:
    truth = Truth("t")
    truth.expect("tp", "group:g", "redelivered", 0, "p:1", 3, 3)
    truth.expect("tp", "group:g", "redelivered", 0, "p:1", 3, 3)  # processed three times: two rows
    row = {"stage": "group:g", "anomaly": "redelivered", "partition": 0, "pid": "p:1", "seq": 3, "offset": 3}
    assert compare("tp", truth.rows["tp"], [row, dict(row)]).exact
    one = compare("tp", truth.rows["tp"], [row])
    assert not one.exact and one.missing == (("group:g", "redelivered", 0, "p:1", 3, 3),) and one.unexpected == ()
    extra = {**row, "anomaly": "missed"}
    three = compare("tp", truth.rows["tp"], [row, row, extra])
    assert three.missing == () and three.unexpected == (("group:g", "missed", 0, "p:1", 3, 3),)
    assert "false alarms (1)" in three.describe()


@pytest.mark.unit
def test_compare_treats_missing_identity_as_none() -> None:
    truth = Truth("t")
    truth.expect("tp", "log", "unaudited", 0, None, None, 7)
    assert compare("tp", truth.rows["tp"], [{"stage": "log", "anomaly": "unaudited", "partition": 0,
                                            "pid": None, "seq": None, "offset": 7}]).exact
    assert not compare("tp", truth.rows["tp"], [{"stage": "log", "anomaly": "unaudited", "partition": 0,
                                                "pid": None, "seq": None, "offset": 8}]).exact


@pytest.mark.unit
def test_demo_selection_and_listing() -> None:
    assert demo.list_scenarios().count("\n") == len(SCENARIOS) + 3
    assert demo._selection("mixed") == list(demo.MIXED)
    assert demo._selection("all") == list(PROXY_SCENARIOS)
    assert demo._selection("connect") == list(CONNECT_SCENARIOS)
    assert demo._selection("lost_acked") == ["lost_acked"]
    with pytest.raises(InputError, match="unknown scenario 'nope'"):
        demo._selection("nope")


@pytest.mark.unit
def test_demo_prints_the_report_and_summary() -> None:
    rows = [{"topic": "t", "window_start": 1, "partition": 0, "stage": "log", "expected": 40, "delivered": 40,
             "lost": 0, "duplicated": 10, "reordered": 0, "pending": 0, "latency_p99_ms": 12.4, "status": "final"}]
    table = demo.format_report(rows).splitlines()
    assert table[2].split() == ["t", "0", "log", "40", "40", "0", "10", "0", "0", "12", "final"]
    summary = demo.format_anomalies({"t": [{"stage": "log", "anomaly": "duplicate_in_log"}] * 3})
    assert summary.splitlines()[2].split() == ["t", "log", "duplicate_in_log", "3"]
    assert demo.format_anomalies({}) == "(no anomalies)"


@pytest.mark.e2e
@pytest.mark.kafka
@pytest.mark.spark
@pytest.mark.postgres
@pytest.mark.parametrize(("name", "point", "messages"), [("exactly_once_sink", "sink_written", 30),
                                                        ("exactly_once_kafka", "txn_committed", 35)])
def test_exactly_once_killed_just_after_the_commit_is_delivered_by_rows_committed_with_it(
        proxied_result: LabResult, name: str, point: str, messages: int) -> None:
    """The kill matrices hold a kill just after the commit: the PostgreSQL commit (`sink_written`;
    the sink is audited without `group`, so every record's evidence is the consumption rows of its
    commit) and the Kafka transaction's commit (`txn_committed`; the worker ships its ledger through
    a ledger topic, so the batch's consumption rows committed in its transaction). No false `missed`."""
    run = next(r for r in proxied_result.runs if r.name == name)
    assert run.truth is not None and point in str(run.truth.facts["kill_points"]).split(", ")
    (topic,) = run.topics
    group_rows = [r for r in proxied_result.report if r["topic"] == topic and r["stage"].startswith("group:")]
    assert (sum(r["expected"] for r in group_rows), sum(r["delivered"] for r in group_rows)) == (messages, messages)
    assert sum(r["lost"] + r["duplicated"] + r["pending"] for r in group_rows) == 0
