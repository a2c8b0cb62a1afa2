"""Sinks whose rows name their message by Kafka coordinates or a packed audit.id (docs/design.md
§4.2, §8 `identity`): the config, the reader's resolution through the captured log, and the sink
codes that follow from it."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from audit.core.config import SinkConfig, TopicConfig, from_dict
from audit.core.errors import ConfigError, InputError
from audit.oracle import SinkRow, reconcile_window
from tests.reconcile_cases import (
    AS_OF_FINAL,
    T0,
    TOPIC,
    History,
    at,
    brief,
    frame,
    norm_rows,
    sorted_anomalies,
    table_rows,
)

S = "sink:s1"


def _sink(identity: str = "coordinates", **columns: str) -> dict[str, Any]:
    return {"name": "s1", "format": "delta", "location": "/data/s1", "identity": identity, "columns": columns}


def _parse(sink: dict[str, Any]) -> SinkConfig:
    return from_dict({"topics": {"orders": {"sinks": [sink]}}}, source="m.yaml").topic("orders").sinks[0]


# ---------------------------------------------------------------------------- config
@pytest.mark.unit
def test_identity_forms_parse_with_their_mappings() -> None:
    assert _parse({"name": "s1", "format": "delta", "location": "/data/s1"}).identity == "audit"
    c = _parse(_sink(partition="_kafka_metadata.partition", offset="_kafka_metadata.offset",
                     record_ts="RECORD_METADATA:CreateTime"))
    assert (c.identity, c.topic, dict(c.columns)) == ("coordinates", "orders", {
        "partition": "_kafka_metadata.partition", "offset": "_kafka_metadata.offset",
        "record_ts": "RECORD_METADATA:CreateTime"})
    p = _parse(_sink("packed_id", id="audit_id", sink_ts="written_at"))
    assert (p.identity, dict(p.columns)) == ("packed_id", {"id": "audit_id", "sink_ts": "written_at"})


@pytest.mark.unit
@pytest.mark.parametrize(("sink", "error"), [
    (_sink("offsets"), r"m.yaml: topics.orders.sinks\[0\].identity: expected one of audit, coordinates, "
                       r"packed_id .* got 'offsets'$"),
    (_sink(partition="p"), r"sinks\[0\].columns: missing key 'offset' \(identity coordinates needs partition "
                           r"and offset mapped"),
    (_sink(partition="p", offset="o", pid="x"), r"sinks\[0\].columns: unknown key 'pid' for identity coordinates "
                                                r"\(allowed: topic, partition, offset, sink_ts, record_ts\)$"),
    (_sink("packed_id", offset="o"), r"sinks\[0\].columns: missing key 'id' \(identity packed_id needs id and "
                                     r"sink_ts"),
    (_sink("packed_id", id="i"), r"sinks\[0\].columns: missing key 'sink_ts' \(identity packed_id"),
    (_sink(partition="p", offset="a..b"), r"sinks\[0\].columns.offset: expected a column name, a nested field "
                                          r"\(a.b\) or a field of a JSON or variant column \(c:f\), got 'a..b'$"),
    (_sink("audit", id="x"), r"sinks\[0\].columns: unknown key 'id' for identity audit"),
])
def test_a_wrong_identity_key_is_one_line_naming_it(sink: dict[str, Any], error: str) -> None:
    with pytest.raises(ConfigError, match=error) as e:
        _parse(sink)
    assert "\n" not in str(e.value)


# ---------------------------------------------------------------------------- resolution
def _coordinates_sink(**columns: str) -> SinkConfig:
    cols = {"partition": "partition", "offset": "offset", "record_ts": "timestamp", **columns}
    return SinkConfig(name="s1", format="delta", location="/unused", identity="coordinates", columns=cols,
                      topic=TOPIC)


def _history() -> History:
    """Partition 0: p/0 @0, p/1 @1, a transaction marker @2 (the log never holds it), p/2 @3, p/3 @4,
    an unaudited record @5; captured up to 6."""
    h = History()
    h.captured(0, 0, 6, at(60))
    for seq, offset in enumerate((0, 1, 3, 4)):
        h.produce("p", seq, 0, offset, at(10 + seq))
        h.record("p", seq, 0, offset, at(10 + seq))
    h.record(None, None, 0, 5, at(15), header_error="missing audit headers")
    return h


# The Structured Streaming job's columns: the Kafka source's topic, partition, offset, timestamp.
_SINK_ROWS = [(TOPIC, 0, 0, at(10)), (TOPIC, 0, 1, at(11)), (TOPIC, 0, 1, at(11)),  # p/1 written twice
              (TOPIC, 0, 3, at(12)),  # no row at the marker's offset 2: never expected
              (TOPIC, 0, 9, at(20)),  # an offset the log never held
              (TOPIC, 0, 5, at(15)),  # the unaudited record
              (TOPIC, 0, None, at(30)),  # null coordinates
              (TOPIC, 0, 8, None)]  # never held, and no time to place it by
# p/3 @4 has no row: missing_in_sink


def _sink_frame(spark: Any, rows: list[tuple[Any, ...]] = _SINK_ROWS) -> Any:
    return spark.createDataFrame([(t, p, o, ts and ts.replace(tzinfo=None)) for t, p, o, ts in rows],
                                 "topic STRING, partition INT, offset BIGINT, timestamp TIMESTAMP")


def _naive(t: datetime) -> datetime:
    return t.astimezone(UTC).replace(tzinfo=None)


@pytest.mark.spark
def test_coordinates_resolve_through_the_log_to_the_audit_rows(spark: Any) -> None:
    from spark_jobs.io.sinks_read import identity_rows, resolve_coordinates

    sink = _coordinates_sink()
    log = frame(spark, "log_records", table_rows(_history().inputs())["log_records"])
    got = resolve_coordinates(identity_rows(_sink_frame(spark), sink), log).collect()
    pt = {seq: _naive(at(10 + seq)) for seq in range(4)}
    assert sorted((tuple(r) for r in got), key=lambda r: (r[2] is None, r[2] or 0, str(r))) == [
        (TOPIC, 0, 0, "p", 0, None, pt[0]),
        (TOPIC, 0, 1, "p", 1, None, pt[1]),
        (TOPIC, 0, 1, "p", 1, None, pt[1]),
        (TOPIC, 0, 3, "p", 2, None, pt[2]),
        # the unaudited record: no identity, matched by its offset; placed by its Kafka timestamp
        (TOPIC, 0, 5, None, None, None, _naive(at(15) + timedelta(milliseconds=2))),
        # never held: no message, placed by the Kafka timestamp the row recorded
        (TOPIC, 0, 9, None, None, _naive(at(20)), _naive(at(20))),
        # null coordinates, or never held with no time: names nothing (the rules count it as quarantined)
        (TOPIC, None, None, None, None, None, None),
        (TOPIC, None, None, None, None, None, _naive(at(30))),
    ]


@pytest.mark.spark
def test_coordinate_rows_give_every_sink_code_in_spark_and_in_the_oracle(spark: Any) -> None:
    """Reconciled in Spark tasks and by the oracle from the same resolved rows: one duplicate, the
    position the log never held unexpected, the missing message missing, the marker never expected,
    the rows naming nothing placeable quarantined, and no sink latency (no sink time is mapped)."""
    from spark_jobs.io.sinks_read import identity_rows, resolve_coordinates
    from spark_jobs.reconcile import classify_window
    from tests.reconcile_cases import window_inputs

    sink = _coordinates_sink()
    tc = TopicConfig(name=TOPIC, sinks=(sink,))
    h = _history()
    inputs = window_inputs(spark, h.inputs(), tc)
    resolved = resolve_coordinates(identity_rows(_sink_frame(spark), sink), inputs.log)
    inputs.sinks = {"s1": resolved}
    c = classify_window(spark, inputs, tc, T0, AS_OF_FINAL, engine="spark", chunks=3)
    anomalies = sorted_anomalies(r.asDict() for r in c.anomalies.collect())
    assert [a for a in brief(anomalies) if a[0] == S] == [
        (S, "duplicate_in_sink", 0, "p", 1, 1),
        (S, "missing_in_sink", 0, "p", 3, 4),
        (S, "unexpected_in_sink", 0, None, None, 9),
    ]
    sink_report = [r for r in norm_rows(c.report) if r["stage"] == S]
    assert [(r["partition"], r["expected"], r["delivered"], r["lost"], r["duplicated"], r["latency_p99_ms"])
            for r in sink_report] == [(0, 5, 4, 1, 1, None)]
    assert c.quarantined == 2
    # the oracle, from the same rows
    h.sinks["s1"] = [SinkRow(r["partition"], r["offset"], r["pid"], r["seq"],
                             None if r["sink_ts"] is None else r["sink_ts"].replace(tzinfo=UTC), TOPIC,
                             None if r["produce_ts"] is None else r["produce_ts"].replace(tzinfo=UTC))
                     for r in (x.asDict() for x in resolved.collect())]
    oracle = reconcile_window(tc, T0, AS_OF_FINAL, h.inputs())
    assert anomalies == sorted_anomalies(oracle.anomalies)
    assert norm_rows(c.report) == norm_rows(oracle.report)
    assert oracle.quarantined_ledger_rows == 2


@pytest.mark.spark
def test_nested_json_and_packed_id_fields_are_read(spark: Any) -> None:
    from spark_jobs.io.sinks_read import identity_rows

    df = spark.createDataFrame(
        [(("orders", 1, 7), '{"topic": "orders", "partition": 1, "offset": 7, "CreateTime": 1795290000123}',
          "svc:a/b/41/1795290000123"),
         (("orders", None, 8), '{"topic": "orders", "partition": "x", "offset": 8}', "not-an-id")],
        "_kafka_metadata STRUCT<topic: STRING, partition: INT, offset: BIGINT>, RECORD_METADATA STRING, "
        "audit_id STRING")
    nested = SinkConfig(name="n", format="delta", identity="coordinates", topic="orders", columns={
        "topic": "_kafka_metadata.topic", "partition": "_kafka_metadata.partition", "offset": "_kafka_metadata.offset"})
    assert [tuple(r)[:3] for r in identity_rows(df, nested).collect()] == [("orders", 1, 7), ("orders", None, None)]
    js = SinkConfig(name="j", format="delta", identity="coordinates", topic="orders", columns={
        "topic": "RECORD_METADATA:topic", "partition": "RECORD_METADATA:partition", "offset": "RECORD_METADATA:offset",
        "record_ts": "RECORD_METADATA:CreateTime"})
    got = [tuple(r) for r in identity_rows(df, js).collect()]
    ts = datetime(2026, 11, 21, 19, 40, 0, 123000)  # 1795290000123 ms
    assert got == [("orders", 1, 7, None, None, None, None, ts), ("orders", None, None, None, None, None, None, None)]
    packed = SinkConfig(name="p", format="delta", identity="packed_id", topic="orders", columns={"id": "audit_id"})
    assert [tuple(r) for r in identity_rows(df, packed).collect()] == [
        ("orders", None, None, "svc:a/b", 41, None, ts, None), ("orders", None, None, None, None, None, None, None)]


@pytest.mark.spark
@pytest.mark.parametrize(("columns", "error"), [
    ({"offset": "_kafka_metadata.ofset"}, r"^sink 's1' has no column or field 'ofset' in '_kafka_metadata' "
                                          r"\(for offset\): map sinks\[\].columns.offset to one the table has$"),
    ({"offset": "off"}, r"^sink 's1' has no column or field 'off' \(for offset\)"),
    ({"offset": "note"}, r"^sink 's1': sinks\[\].columns.offset \('note'\) is double, expected tinyint or "
                         r"smallint or int or bigint or string: map it"),
    ({"offset": "_kafka_metadata:offset"}, r"^sink 's1': '_kafka_metadata' is struct<.*>, not a JSON string or "
                                           r"a variant \(for offset\)"),
])
def test_a_mapping_to_a_missing_field_or_a_wrong_type_is_one_line(spark: Any, columns: dict[str, str],
                                                                   error: str) -> None:
    from spark_jobs.io.sinks_read import identity_rows

    df = spark.createDataFrame([((1, 7), 1.5)], "_kafka_metadata STRUCT<partition: INT, offset: BIGINT>, note DOUBLE")
    sink = SinkConfig(name="s1", format="delta", identity="coordinates", topic="orders",
                      columns={"partition": "_kafka_metadata.partition", **columns})
    with pytest.raises(InputError, match=error) as e:
        identity_rows(df, sink)
    assert "\n" not in str(e.value)


# ---------------------------------------------------------------------------- Kafka Connect's dead-letter queue
@pytest.mark.unit
def test_a_dead_letter_topic_is_a_sink_key_and_a_bad_one_is_one_line() -> None:
    assert _parse({**_sink(partition="p", offset="o"), "dead_letter_topic": "dlq-s1"}).dead_letter_topic == "dlq-s1"
    assert _parse(_sink(partition="p", offset="o")).dead_letter_topic is None
    with pytest.raises(ConfigError, match=r"^m.yaml: topics.orders.sinks\[0\].dead_letter_topic: expected the "
                                          r"connector's errors.deadletterqueue.topic.name, got ''$"):
        _parse({**_sink(partition="p", offset="o"), "dead_letter_topic": ""})


def _dlq_frame(spark: Any) -> Any:
    """Records of a DLQ topic as Spark's Kafka source reads them (headers as key/binary pairs)."""
    def ctx(offset: str) -> list[tuple[str, bytes]]:
        return [("__connect.errors.topic", TOPIC.encode()), ("__connect.errors.partition", b"0"),
                ("__connect.errors.offset", offset.encode()),
                ("__connect.errors.exception.class.name", b"org.apache.kafka.connect.errors.DataException"),
                ("__connect.errors.exception.message", b"Converting byte[] to Kafka Connect data failed")]
    rows = [("dlq", 0, 0, _naive(at(14)), ctx("4")),  # p/3 @4: the connector could not convert it
            ("dlq", 0, 1, _naive(at(21)), ctx("7")),  # a position the log never held
            ("dlq", 0, 2, _naive(at(22)), [("other", b"x")])]  # no context headers: names nothing
    return spark.createDataFrame(rows, "topic STRING, partition INT, offset BIGINT, timestamp TIMESTAMP, "
                                       "headers ARRAY<STRUCT<key: STRING, value: BINARY>>")


@pytest.mark.spark
def test_dead_letter_records_name_their_source_and_the_sink_stage_reports_it_dead_lettered(spark: Any) -> None:
    """Capture's rows of a DLQ topic (the position its context headers name, the error), read with
    the sink's rows: the message the connector dead-lettered is `dead_lettered`, not missing; the
    DLQ records naming a position the log never held, or nothing, are quarantined; Spark tasks and
    the oracle give the same rows."""
    from dataclasses import replace

    from pyspark.sql import functions as F

    from spark_jobs.capture import dead_letter_rows as captured_rows
    from spark_jobs.io.sinks_read import dead_letter_rows, identity_rows, resolve_coordinates
    from spark_jobs.reconcile import classify_window
    from tests.reconcile_cases import window_inputs

    cap = datetime(2026, 11, 21, 12, tzinfo=UTC)
    dl = captured_rows(_dlq_frame(spark), cap)
    err = "org.apache.kafka.connect.errors.DataException: Converting byte[] to Kafka Connect data failed"
    assert [tuple(r) for r in dl.orderBy("dlq_offset").collect()] == [
        ("dlq", 0, 0, TOPIC, 0, 4, err, _naive(at(14)), _naive(cap), None, None),
        ("dlq", 0, 1, TOPIC, 0, 7, err, _naive(at(21)), _naive(cap), None, None),
        ("dlq", 0, 2, None, None, None, None, _naive(at(22)), _naive(cap), None, None)]

    sink = replace(_coordinates_sink(), dead_letter_topic="dlq")
    tc = TopicConfig(name=TOPIC, sinks=(sink,))
    h = _history()
    inputs = window_inputs(spark, h.inputs(), tc)
    written = [*_SINK_ROWS[:4], (TOPIC, 0, 5, at(15))]  # every message but p/3, p/1 twice
    rows = resolve_coordinates(identity_rows(_sink_frame(spark, written), sink), inputs.log)
    both = rows.withColumn("dead_letter", F.lit(False)).unionByName(dead_letter_rows(dl, sink, inputs.log))
    inputs.sinks = {"s1": both}
    c = classify_window(spark, inputs, tc, T0, AS_OF_FINAL, engine="spark", chunks=3)
    anomalies = sorted_anomalies(r.asDict() for r in c.anomalies.collect())
    assert [a for a in brief(anomalies) if a[0] == S] == [
        (S, "dead_lettered", 0, "p", 3, 4),
        (S, "duplicate_in_sink", 0, "p", 1, 1),
    ]
    sink_report = [r for r in norm_rows(c.report) if r["stage"] == S]
    assert [(r["partition"], r["expected"], r["delivered"], r["lost"], r["dead_lettered"], r["missing_in_sink"])
            for r in sink_report] == [(0, 5, 4, 0, 1, 0)]
    assert c.quarantined == 2
    h.sinks["s1"] = [SinkRow(r["partition"], r["offset"], r["pid"], r["seq"],
                             None if r["sink_ts"] is None else r["sink_ts"].replace(tzinfo=UTC), TOPIC,
                             None if r["produce_ts"] is None else r["produce_ts"].replace(tzinfo=UTC),
                             dead_letter=r["dead_letter"])
                     for r in (x.asDict() for x in both.collect())]
    oracle = reconcile_window(tc, T0, AS_OF_FINAL, h.inputs())
    assert anomalies == sorted_anomalies(oracle.anomalies)
    assert norm_rows(c.report) == norm_rows(oracle.report)
    assert oracle.quarantined_ledger_rows == 2
