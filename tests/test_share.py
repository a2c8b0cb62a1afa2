"""Share groups (KIP-932): the `share:<group>` stage's rules (docs/design.md §5.9) in the oracle
and the kernel, its config, and an audited share group on the real broker end to end."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from audit.core import config as config_mod
from audit.core.errors import ConfigError
from tests.reconcile_cases import (
    AS_OF_FINAL,
    T0,
    Q,
    arrow_tables,
    at,
    brief,
    build_share_cases,
    classify_in_chunks,
    report_row,
    share_topic_config,
    sorted_anomalies,
)


def _expected(exp: dict[str, list[tuple[Any, ...]]]) -> list[tuple[Any, ...]]:
    return sorted((row for rows in exp.values() for row in rows),
                  key=lambda t: tuple("" if v is None else str(v) for v in t))


@pytest.mark.unit
def test_share_stage_in_the_oracle_gives_exactly_the_hand_written_rows_report_and_quarantine() -> None:
    from audit.oracle import reconcile_window

    h, exp = build_share_cases()
    r = reconcile_window(share_topic_config(), T0, AS_OF_FINAL, h.inputs())
    assert brief(r.anomalies) == _expected(exp)
    # the share row with the unknown outcome `renewed`, and the dead-letter record naming no record (p10)
    assert r.quarantined_ledger_rows == 2
    details = {(a["anomaly"], a["partition"], a["detail"]) for a in r.anomalies if a["stage"] == Q}
    assert details == {
        ("redelivered", 1, "delivery 2 of 2 to m2"),
        ("redelivered", 2, "delivery 2 of 2 to m2"),
        ("processed_twice", 2, "accept 2 of 2, by m1"),
        ("rejected", 3, "rejected by m1 at delivery 1"),
        ("redelivered", 4, "delivery 2 of 3 to m1"),
        ("redelivered", 4, "delivery 3 of 3 to m1"),
        ("archived_unprocessed", 4, "delivery limit 3 reached without an accept"),
        ("overdue", 5, "not accepted, past grace, delivery limit not reached"),
        ("overdue", 6, "not accepted, past grace, delivery limit not reached"),
        ("missed", 8, "never handed to a member, below the group's start offset 2"),
        ("overdue", 9, "not accepted, past grace, delivery limit not reached"),
        ("dead_lettered", 10, "in the group's dead-letter topic dlq.q1: Offset rejected by client."),
        ("redelivered", 11, "delivery 2 of 3 to m1"),
        ("redelivered", 11, "delivery 3 of 3 to m1"),
        ("dead_lettered", 11, "in the group's dead-letter topic dlq.q1: Offset delivery count exceeded the threshold."),
    }
    share = {row["partition"]: row for row in r.report if row["stage"] == Q}
    lat = {f"latency_{k}_ms": 6000.0 for k in ("p50", "p95", "p99", "max")}
    assert share[0] == report_row(Q, 0, expected=1, delivered=1, redelivered=0, overdue=0, **lat)
    assert share[1] == report_row(Q, 1, expected=1, delivered=1, redelivered=1, overdue=0, **lat)
    assert share[2] == report_row(Q, 2, expected=1, delivered=1, duplicated=1, redelivered=1, overdue=0, **lat)
    assert share[3] == report_row(Q, 3, expected=1, redelivered=0, overdue=0)
    assert share[4] == report_row(Q, 4, expected=1, lost=1, redelivered=2, overdue=0)
    assert share[5] == report_row(Q, 5, expected=1, redelivered=0, overdue=1)
    assert share[7] == report_row(Q, 7, redelivered=0, overdue=0)  # the aborted record: not expected
    assert share[8] == report_row(Q, 8, expected=3, delivered=1, lost=2, missed=2, redelivered=0, overdue=0, **lat)
    assert share[9] == report_row(Q, 9, expected=2, redelivered=0, overdue=2)
    # dead-lettered by the broker: accounted for (the dead_lettered column), neither lost nor delivered
    assert share[10] == report_row(Q, 10, expected=1, redelivered=0, overdue=0, dead_lettered=1)
    assert share[11] == report_row(Q, 11, expected=1, redelivered=2, overdue=0, dead_lettered=1)
    # the consumer group beside it is judged on its own rows only
    assert [row for row in r.report if row["stage"] == "group:g1" and row["delivered"] != row["expected"]] == []


@pytest.mark.unit
def test_share_stage_within_grace_is_pending_and_a_released_last_delivery_archives_at_once() -> None:
    from audit.oracle import reconcile_window

    h, _ = build_share_cases()
    r = reconcile_window(share_topic_config(), T0, at(12), h.inputs())
    got = {(a["anomaly"], a["partition"]) for a in r.anomalies if a["stage"] == Q and a["anomaly"] != "redelivered"}
    assert got == {("processed_twice", 2), ("rejected", 3), ("archived_unprocessed", 4), ("pending", 5),
                   ("pending", 6), ("pending", 8), ("pending", 9),  # missed waits for grace, as a group's
                   ("dead_lettered", 10), ("dead_lettered", 11)}  # a DLQ record: at once


@pytest.mark.unit
def test_share_stage_in_the_kernel_equals_the_oracle_whole_and_in_chunks() -> None:
    from audit.oracle import reconcile_window
    from audit.rules import kernel

    h, _ = build_share_cases()
    tc = share_topic_config()
    for as_of in (AS_OF_FINAL, at(12)):
        want = reconcile_window(tc, T0, as_of, h.inputs())
        tables = arrow_tables(h.inputs())
        for got in (kernel.classify(tc, T0, as_of, tables), classify_in_chunks([tc], T0, as_of, tables, 3)[tc.name]):
            assert sorted_anomalies(got.anomalies) == sorted_anomalies(want.anomalies)
            assert got.report == want.report
            assert got.quarantined_ledger_rows == want.quarantined_ledger_rows == 2


@pytest.mark.unit
def test_share_groups_config_and_a_group_listed_as_both_kinds_is_one_error_line() -> None:
    cfg = config_mod.from_dict({"topics": {"orders": {"groups": ["loader"], "share_groups": [
        "workers", {"name": "slow", "delivery_count_limit": 3}]}}})
    tc = cfg.topic("orders")
    assert [(g.name, g.delivery_count_limit) for g in tc.share_groups] == [("workers", 5), ("slow", 3)]
    assert tc.consuming_groups == ("loader", "workers", "slow")
    with pytest.raises(ConfigError) as e:
        config_mod.from_dict({"topics": {"orders": {"groups": ["loader"], "share_groups": ["loader"]}}})
    assert str(e.value) == ("<dict>: topics.orders.share_groups[0]: group 'loader' is in both groups and share_groups; "
                            "a group is a consumer group or a share group, list it once")
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match=r"delivery_count_limit: expected a whole number >= 1, got 0"):
        config_mod.from_dict({"topics": {"orders": {"share_groups": [{"name": "w", "delivery_count_limit": 0}]}}})
    # the group's dead-letter topic (KIP-1191): its errors.deadletterqueue.topic.name
    dlq = config_mod.from_dict({"topics": {"orders": {"share_groups": [
        {"name": "w", "dead_letter_topic": "dlq.orders"}, "v"]}}}).topic("orders")
    assert [(g.name, g.dead_letter_topic) for g in dlq.share_groups] == [("w", "dlq.orders"), ("v", None)]
    with pytest.raises(ConfigError) as e:
        config_mod.from_dict({"topics": {"orders": {"share_groups": [{"name": "w", "dead_letter_topic": " "}]}}})
    assert str(e.value) == ("<dict>: topics.orders.share_groups[0].dead_letter_topic: expected the group's "
                            "errors.deadletterqueue.topic.name, got ' '")


@pytest.mark.spark
def test_ingest_lands_share_rows_and_quarantines_an_unknown_acknowledgement_with_one_reason(spark: Any) -> None:
    import json

    from spark_jobs.ingest import SOURCES, parse_lines

    def row(outcome: str, error: str | None = None) -> str:
        return json.dumps({"group": "q", "consumer": "m:1", "consume_seq": 0, "topic": "orders", "partition": 0,
                           "offset": 7, "pid": "svc:0123456789ab", "seq": 7, "outcome": outcome, "attempt": 2,
                           "consume_ts": 1_795_000_000_000, "error": error})

    lines = [row("acquired"), row("accepted"), row("released", "INVALID_RECORD_STATE"), row("rejected"),
             row("renewed")]
    consumer = next(src for src in SOURCES if src.table == "consumed_records")
    df = spark.createDataFrame([(x, "f") for x in lines], "line string, source_file string")
    got = [(r["line"], r["reason"]) for r in df.transform(parse_lines(consumer)).select("line", "reason").collect()]
    assert got == [*((x, None) for x in lines[:4]), (lines[4], "bad outcome: renewed")]


def _earliest(bootstrap: str, group: str) -> None:
    """Share group `group` starts at the log start (a share group's default is the latest offset)."""
    from confluent_kafka.admin import AdminClient, AlterConfigOpType, ConfigEntry, ConfigResource

    admin = AdminClient({"bootstrap.servers": bootstrap})
    res = ConfigResource(ConfigResource.Type.GROUP, group, incremental_configs=[
        ConfigEntry("share.auto.offset.reset", "earliest", incremental_operation=AlterConfigOpType.SET)])
    for fut in admin.incremental_alter_configs([res]).values():
        fut.result(timeout=30)


@pytest.mark.spark
@pytest.mark.kafka
def test_two_share_members_release_and_reject_and_the_audit_reports_exactly_that(
        kafka_bootstrap: str, spark: Any, tmp_path: Any, make_config: Any) -> None:
    """Six audited records on one partition; member A of share group q accepts four and releases
    offsets 1 and 4; member B gets those two again (delivery 2), accepts 1 and rejects 4. The
    ledger holds one row per delivery and per acknowledgement the broker took, and ingest + capture
    + reconcile report exactly: offsets 1 and 4 redelivered to B, offset 4 rejected by B."""
    import time
    import uuid
    from datetime import UTC, datetime, timedelta

    from audit import AuditedProducer
    from audit.clients.share_consumer import AuditedShareConsumer
    from tests.conftest import audit_topic, new_topic
    from tests.test_consumer_interceptor import rows_of

    topic = new_topic(kafka_bootstrap, partitions=1)
    group = f"q-{uuid.uuid4().hex[:8]}"
    cfg = make_config(tmp_path, topics={topic: {"window": "1d", "grace": "1m", "share_groups": [group]}})
    start = datetime.now(UTC).replace(hour=0, minute=0, second=0, microsecond=0)
    _earliest(kafka_bootstrap, group)
    with AuditedProducer.from_config(cfg, producer_name="share-e2e") as producer:
        for i in range(6):
            producer.produce(topic, key=f"k{i}".encode(), value=f"v{i}".encode())
        assert producer.flush(30) == 0

    seen: list[tuple[str, int, int, str]] = []  # ground truth: (member, offset, delivery count, acknowledgement)
    with AuditedShareConsumer.from_config(cfg, topics=[topic], group=group, name="a") as a:
        deadline = time.monotonic() + 30
        while len({o for _, o, _, _ in seen}) < 6 and time.monotonic() < deadline:
            for rec in a.poll(1.0):
                ack = "released" if rec.offset in (1, 4) else "accepted"
                a.acknowledge(rec, ack)
                seen.append(("a", rec.offset, rec.attempt, ack))
            a.commit()
    b = AuditedShareConsumer.from_config(cfg, topics=[topic], group=group, name="b")

    def handle(rec: Any) -> str:
        ack = "reject" if rec.offset == 4 else "accept"
        seen.append(("b", rec.offset, rec.attempt, ack))
        return ack

    with b:
        b.run(handle, max_messages=2, idle_timeout_s=30)
    assert sorted(seen) == [("a", 0, 1, "accepted"), ("a", 1, 1, "released"), ("a", 2, 1, "accepted"),
                            ("a", 3, 1, "accepted"), ("a", 4, 1, "released"), ("a", 5, 1, "accepted"),
                            ("b", 1, 2, "accept"), ("b", 4, 2, "reject")]

    rows = [r for r in rows_of(cfg.ledger_dir / "consumer") if r["group"] == group]
    assert sorted((r["consumer"].split(":")[0], r["offset"], r["outcome"], r["attempt"], r["error"]) for r in rows) == sorted(
        [("a", o, "acquired", 1, None) for o in range(6)]
        + [("a", o, "released" if o in (1, 4) else "accepted", 1, None) for o in range(6)]
        + [("b", 1, "acquired", 2, None), ("b", 4, "acquired", 2, None),
           ("b", 1, "accepted", 2, None), ("b", 4, "rejected", 2, None)])

    as_of = datetime.now(UTC) + timedelta(minutes=2)
    end = start + timedelta(days=1)
    anomalies, report = audit_topic(spark, cfg, topic, start, end, as_of)
    stage = f"share:{group}"
    assert sorted((x["stage"], x["anomaly"], x["partition"], x["offset"], x["detail"]) for x in anomalies) == [
        (stage, "redelivered", 0, 1, f"delivery 2 of 2 to {b.instance}"),
        (stage, "redelivered", 0, 4, f"delivery 2 of 2 to {b.instance}"),
        (stage, "rejected", 0, 4, f"rejected by {b.instance} at delivery 2")]
    share = [r for r in report if r["stage"] == stage]
    assert [(r["partition"], r["expected"], r["delivered"], r["redelivered"], r["lost"], r["duplicated"],
             r["pending"], r["overdue"]) for r in share] == [(0, 6, 5, 2, 0, 0, 0, 0)]


@pytest.mark.unit
def test_share_lab_truth_from_the_members_own_record() -> None:
    """The lab's share scenarios expect rows by what the members' handlers saw (audit.lab.share),
    never by the audit's rules; and they run on the acceptance suite's broker."""
    from audit.lab.scenarios import PROXY_SCENARIOS
    from audit.lab.share import SHARE_SCENARIOS, observed

    lines = ["delivered a 0 0 1", "answered a 0 0 accept",  # clean
             "delivered doomed 0 1 1", "delivered s 0 1 2", "answered s 0 1 accept",  # killed holder
             "delivered a 0 2 1", "answered a 0 2 reject",  # poison
             *(f"delivered a 0 3 {n}\nanswered a 0 3 release" for n in (1, 2, 3)),  # released to the limit
             "delivered slow 0 4 1", "delivered quick 0 4 2", "answered quick 0 4 accept", "answered slow 0 4 accept",
             "delivered a 0 5 1", "answered a 0 5 release", "delivered a 0 5 2"]  # released once, not answered yet
    seen = observed("\n".join(lines).splitlines())
    assert {off: seen[(0, off)].expected(3) for off in range(6)} == {
        0: [], 1: ["redelivered"], 2: ["rejected"], 3: ["redelivered", "redelivered", "archived_unprocessed"],
        4: ["redelivered", "processed_twice"], 5: ["redelivered"]}
    with pytest.raises(ValueError, match="unknown truth line 'acked a 0 1 x'"):
        observed(["acked a 0 1 x"])
    assert set(SHARE_SCENARIOS) <= set(PROXY_SCENARIOS)


@pytest.mark.unit
def test_share_start_offsets_never_raise_for_what_the_broker_or_the_program_answers(monkeypatch: Any) -> None:
    """audit.runtime.share_admin: the Java program's lines become rows; a group the broker refused, a
    program that failed or cannot start is one line each and no rows (capture goes on)."""
    import subprocess

    from audit.core.errors import SetupError
    from audit.runtime import share_admin

    kafka = {"bootstrap.servers": "k:9092"}
    out = ('{"group": "q", "topic": "t", "partition": 0, "start_offset": 4}\n'
           '{"group": "q", "topic": "t", "partition": 1, "start_offset": null}\n'
           '{"group": "r", "error": "UnsupportedVersionException: The node does not support LIST_SHARE_GROUP_OFFSETS"}\n')
    answer = subprocess.CompletedProcess([], 0, out, "SLF4J: Failed to load class\n")
    monkeypatch.setattr(share_admin, "_run", lambda kafka, args: answer)
    got = share_admin.start_offsets(kafka, ["q", "r", "q"])
    assert got.offsets == {("q", "t", 0): 4, ("q", "t", 1): None}
    assert got.unread == {"r"}
    assert got.notes == ["share group 'r': start offsets not read from Kafka at k:9092: UnsupportedVersionException: "
                         "The node does not support LIST_SHARE_GROUP_OFFSETS (share groups need a Kafka 4.1+ "
                         "broker with share.version=1)"]
    answer = subprocess.CompletedProcess([], 2, "", "SLF4J: Failed to load class\nusage: ShareGroupOffsets ...\n")
    got = share_admin.start_offsets(kafka, ["q"])
    assert (got.offsets, got.unread) == ({}, {"q"})
    assert got.notes == ["share group start offsets not read (q) from Kafka at k:9092: "
                         "io.msgaudit.interceptors.ShareGroupOffsets exited 2: usage: ShareGroupOffsets ..."]

    def no_jar(kafka: Any, args: Any) -> Any:
        raise SetupError("the msgaudit-interceptors jar is not built in J; run `msgaudit setup`")
    monkeypatch.setattr(share_admin, "_run", no_jar)
    got = share_admin.start_offsets(kafka, ["q"])
    assert (got.offsets, got.unread, got.notes) == ({}, {"q"}, [
        "share group start offsets not read (q): the msgaudit-interceptors jar is not built in J; run `msgaudit setup`"])
    assert share_admin.start_offsets(kafka, []).notes == []


@pytest.mark.spark
def test_a_share_groups_dead_letter_records_captured_and_reconciled_by_spark_equal_the_oracle(spark: Any,
                                                                                             tmp_path: Path) -> None:
    """Capture's rows of a share group's DLQ topic (KIP-1191: the __dlq.errors.* headers), handed to the
    share stage as the group's `dead_lettered` rows (`share_dead_letter_rows`): Spark tasks give the
    oracle's rows on the hand-written cases (p10 rejected and p11 archived, both dead-lettered; p12 a
    position the log never held: quarantined); a record of another group in the same topic is not q1's.
    `trace` of p10's record shows its DLQ record as the group's `dead_lettered` row."""
    from dataclasses import replace
    from datetime import UTC, datetime

    from audit.oracle import reconcile_window
    from spark_jobs.capture import dead_letter_rows as captured_rows
    from spark_jobs.io.sinks_read import share_dead_letter_rows
    from spark_jobs.reconcile import classify_window
    from tests.reconcile_cases import SHARE_DLQ, TOPIC, norm_rows, window_inputs

    def naive(t: datetime) -> datetime:
        return t.astimezone(UTC).replace(tzinfo=None)

    def dlq(part: int, off: int, reason: str, count: int, group: str = "q1") -> list[tuple[str, bytes]]:
        return [("__dlq.errors.topic", TOPIC.encode()), ("__dlq.errors.partition", str(part).encode()),
                ("__dlq.errors.offset", str(off).encode()), ("__dlq.errors.group", group.encode()),
                ("__dlq.errors.delivery.count", str(count).encode()), ("__dlq.errors.message", reason.encode())]

    rejected, exceeded = "Offset rejected by client.", "Offset delivery count exceeded the threshold."
    frame = spark.createDataFrame(
        [(SHARE_DLQ, 0, 0, naive(at(9.3)), dlq(10, 0, rejected, 1)),
         (SHARE_DLQ, 0, 1, naive(at(10.4)), dlq(11, 0, exceeded, 3)),
         (SHARE_DLQ, 0, 2, naive(at(11)), dlq(12, 50, rejected, 1)),
         (SHARE_DLQ, 0, 3, naive(at(11)), dlq(0, 0, rejected, 1, group="other"))],
        "topic STRING, partition INT, offset BIGINT, timestamp TIMESTAMP, "
        "headers ARRAY<STRUCT<key: STRING, value: BINARY>>")
    cap = datetime(2026, 11, 21, 12, tzinfo=UTC)
    dl = captured_rows(frame, cap)
    assert [tuple(r) for r in dl.orderBy("dlq_offset").collect()][:2] == [
        (SHARE_DLQ, 0, 0, TOPIC, 10, 0, rejected, naive(at(9.3)), naive(cap), "q1", 1),
        (SHARE_DLQ, 0, 1, TOPIC, 11, 0, exceeded, naive(at(10.4)), naive(cap), "q1", 3)]

    h, _ = build_share_cases()
    want = reconcile_window(share_topic_config(), T0, AS_OF_FINAL, h.inputs())  # with its DLQ rows
    h.consumed = [c for c in h.consumed if c.outcome != "dead_lettered"]
    sg = replace(share_topic_config().share_groups[0], dead_letter_topic=SHARE_DLQ)
    tc = replace(share_topic_config(), share_groups=(sg,))
    inputs = window_inputs(spark, h.inputs(), tc)
    inputs.consumed = inputs.consumed.unionByName(share_dead_letter_rows(dl, [sg], inputs.log),
                                                  allowMissingColumns=True)  # as reconcile reads them
    c = classify_window(spark, inputs, tc, T0, AS_OF_FINAL, engine="spark", chunks=3)
    assert sorted_anomalies(r.asDict() for r in c.anomalies.collect()) == sorted_anomalies(want.anomalies)
    assert norm_rows(c.report) == norm_rows(want.report)
    assert c.quarantined == want.quarantined_ledger_rows == 2

    # `trace` shows the rejected record's DLQ record among the group's rows, as reconcile reads it
    from audit.serving.trace_view import format_timeline
    from spark_jobs.trace import TraceQuery, trace_message
    from tests.reconcile_cases import write_lake

    cfg = config_mod.from_dict({"home": str(tmp_path / ".msgaudit"), "lake": str(tmp_path / "lake"),
                                "topics": {TOPIC: {"share_groups": [{"name": sg.name, "dead_letter_topic": SHARE_DLQ}]}}},
                               source="<test>", base=tmp_path)
    write_lake(spark, cfg.lake, h.inputs())
    dl.write.format("delta").partitionBy("dlq_topic").save(f"{cfg.lake}/dead_letter_records")
    trace = trace_message(spark, cfg, TraceQuery(TOPIC, partition=10, offset=0))
    assert [(r["group"], r["outcome"], r["consumer"], r["attempt"], r["error"]) for r in trace["consumed"]
            if r["outcome"] == "dead_lettered"] == [(sg.name, "dead_lettered", SHARE_DLQ, 1, rejected)]
    assert (f"group    {sg.name}: dead_lettered 10@0 attempt 1 by {SHARE_DLQ} (consume_seq 0), error {rejected}"
            in format_timeline(trace))


@pytest.mark.unit
def test_capture_summary_line_of_a_dead_letter_topic_names_who_uses_it_and_how_to_fix_unplaced_records() -> None:
    from spark_jobs.capture import DeadLetterCapture

    assert DeadLetterCapture("dlq.orders", ("share group w",), 2, 0).line() == (
        "dead-letter topic dlq.orders (share group w): 2 records")
    assert DeadLetterCapture("dlq.orders", ("share group w",), 3, 1).line() == (
        "dead-letter topic dlq.orders (share group w): 3 records, 1 without __connect.errors.* or __dlq.errors.* "
        "topic/partition/offset headers (not used: a share group's broker always writes them, so another "
        "writer shares the topic)")
    assert DeadLetterCapture("dlq", ("sink s1",), 3, 1).line().endswith(
        "(counted as quarantined: set errors.deadletterqueue.context.headers.enable=true on the connector)")
