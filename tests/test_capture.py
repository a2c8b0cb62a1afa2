"""Log capture: offset planning and option mapping (unit), header parsing against the Python
definition (spark), and capture from a real broker with transactions and garbage headers (kafka)."""

from __future__ import annotations

import hashlib
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from audit.core import headers as H
from audit.core.config import from_dict
from audit.core.errors import ConfigError, InputError
from audit.core.windows import from_millis, to_millis
from spark_jobs import capture as C
from spark_jobs.io.schemas import LOG_RECORDS

# --------------------------------------------------------------------------------------------
# unit: planning


@pytest.mark.unit
@pytest.mark.parametrize(
    ("args", "expected"),
    [
        # partition, log_start, high, lso, at_from, at_to -> start, end, time_end
        ((0, 0, 100, 100, 10, 50), (10, 50, 50)),
        ((0, 0, 100, 100, 10, -1), (10, 100, 100)),  # nothing at/after the range end: to the HW
        ((0, 0, 100, 100, -1, -1), (100, 100, 100)),  # nothing at/after the range start: empty
        ((0, 30, 100, 100, 10, 50), (30, 50, 50)),  # retention moved the log start past the range start
        ((0, 30, 100, 100, 10, 20), (30, 30, 30)),  # the whole range is gone
        ((0, 0, 100, 40, 10, 50), (10, 40, 50)),  # open transaction at 40: 10 offsets deferred
        ((0, 0, 100, 5, 10, 50), (10, 10, 50)),  # LSO before the range: read nothing, defer all
        ((0, 0, 0, 0, -1, -1), (0, 0, 0)),  # empty partition
    ],
)
def test_plan_partition(args: tuple[int, ...], expected: tuple[int, int, int]) -> None:
    r = C.plan_partition(*args)
    assert (r.start, r.end, r.time_end) == expected
    assert r.deferred == expected[2] - expected[1]
    assert (r.log_start_offset, r.high_watermark, r.last_stable_offset) == (args[1], args[2], args[3])


@pytest.mark.unit
def test_time_range_adds_lookback_grace_and_skew() -> None:
    cfg = from_dict({"topics": {"a": {"window": "1h", "grace": "15m"}, "b": {"window": "15m", "lookback": "2h"}}})
    start = datetime(2026, 11, 21, 10, 30, tzinfo=UTC)
    end = datetime(2026, 11, 21, 12, 0, tzinfo=UTC)
    assert C.time_range(cfg.topic("a"), start, end) == (
        datetime(2026, 11, 21, 8, 55, tzinfo=UTC), datetime(2026, 11, 21, 12, 20, tzinfo=UTC))
    assert C.time_range(cfg.topic("b"), start, end) == (
        datetime(2026, 11, 21, 8, 25, tzinfo=UTC), datetime(2026, 11, 21, 12, 20, tzinfo=UTC))


@pytest.mark.unit
def test_offsets_json() -> None:
    ranges = [C.plan_partition(0, 0, 9, 9, 2, 7), C.plan_partition(3, 0, 9, 9, 4, -1)]
    assert C.offsets_json({"orders": ranges}, "start") == '{"orders": {"0": 2, "3": 4}}'
    assert C.offsets_json({"orders": ranges}, "end") == '{"orders": {"0": 7, "3": 9}}'
    both = {"orders": ranges, "refunds": [C.plan_partition(1, 3, 5, 5, -1, -1)]}
    assert C.offsets_json(both, "start") == '{"orders": {"0": 2, "3": 4}, "refunds": {"1": 5}}'


@pytest.mark.unit
def test_java_options_map_security_settings() -> None:
    opts = C.java_kafka_options({
        "bootstrap.servers": "b1:9093,b2:9093", "security.protocol": "sasl_ssl", "sasl.mechanisms": "SCRAM-SHA-512",
        "sasl.username": "audit", "sasl.password": 'p"w', "ssl.ca.location": "/etc/ca.pem",
        "ssl.endpoint.identification.algorithm": "none", "linger.ms": "5",
    })
    assert opts == {
        "kafka.bootstrap.servers": "b1:9093,b2:9093",
        "kafka.security.protocol": "SASL_SSL",
        "kafka.sasl.mechanism": "SCRAM-SHA-512",
        "kafka.sasl.jaas.config": 'org.apache.kafka.common.security.scram.ScramLoginModule required '
                                  'username="audit" password="p\\"w";',
        "kafka.ssl.truststore.type": "PEM",
        "kafka.ssl.truststore.location": "/etc/ca.pem",
        "kafka.ssl.endpoint.identification.algorithm": "",
    }


@pytest.mark.unit
@pytest.mark.parametrize(
    ("kafka", "message"),
    [
        ({"bootstrap.servers": "b:1", "ssl.keystore.location": "/k.p12"}, "ssl.keystore.location cannot be passed"),
        ({"bootstrap.servers": "b:1", "ssl.certificate.location": "/c.pem", "ssl.key.location": "/k.pem"},
         "one PEM file"),
        ({"bootstrap.servers": "b:1", "sasl.mechanism": "OAUTHBEARER", "sasl.username": "u", "sasl.password": "p"},
         "PLAIN or SCRAM"),
        ({"bootstrap.servers": "b:1", "ssl.key.pem": "K"}, "set together"),
    ],
)
def test_java_options_refuse_what_they_cannot_map(kafka: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        C.java_kafka_options(kafka)


@pytest.mark.unit
def test_unknown_configured_topic_is_a_config_error() -> None:
    cfg = from_dict({"topics": {"orders": {}}}, source="m.yaml")
    with pytest.raises(ConfigError, match=r"^m.yaml: unknown topic 'nope' \(configured: orders\)$"):
        C.selected_topics(cfg, ["nope"])
    assert C.selected_topics(cfg, None) == ["orders"]
    with pytest.raises(InputError, match="no topics configured"):
        C.selected_topics(from_dict({}), None)


# --------------------------------------------------------------------------------------------
# spark: header parsing and fingerprint against the Python definitions

HEADERS_TYPE = "array<struct<key:string,value:binary>>"
_names = st.sampled_from([*H.AUDIT_HEADERS, "app.trace"])
# Mostly plausible values, some garbage; text kept below U+0800 where Java's and Python's Unicode
# tables agree on printability.
_text = st.text(st.characters(max_codepoint=0x7FF), max_size=70)
_value = st.one_of(
    st.none(),
    st.builds(lambda n: str(n).encode(), st.integers(min_value=0, max_value=2**64)),
    st.builds(lambda s: s.encode(), _text),
    st.binary(max_size=8),
    # the packed form <pid>/<seq>/<ts>, mostly well formed
    st.builds(lambda p, q, t: f"{p}/{q}/{t}".encode(), _text, st.one_of(st.integers(-1, 2**64), _text),
              st.integers(-1, 2**64)),
)
_headers = st.one_of(st.none(), st.lists(st.tuples(_names, _value), max_size=6))


def _valid(pid: str = "p:1", seq: int = 7, ts: int = 1_700_000_000_000, key: str | None = None) -> list[Any]:
    return H.stamp(None, pid, seq, ts, key)


HAND_CASES: list[list[tuple[str, bytes | None]] | None] = [
    None,
    [],
    [("app.trace", b"x")],
    _valid(),
    _valid(key="order-1"),
    [*_valid(), ("audit.seq", b"8")],
    [("audit.pid", None), ("audit.seq", b"1")],
    [("audit.pid", b"\xff\xfe"), ("audit.seq", b"x"), ("audit.ts", b"1")],
    [("audit.ts", b"1"), ("audit.key", b"k"), ("audit.key", b"k"), ("audit.pid", None)],
    [("audit.seq", b"1"), ("audit.ts", b"2")],
    [("audit.pid", b""), ("audit.seq", b"1"), ("audit.ts", b"2")],
    [("audit.pid", ("p" * 65).encode()), ("audit.seq", b"1"), ("audit.ts", b"2")],
    [("audit.pid", ("\u00e9" * 64).encode()), ("audit.seq", b"1"), ("audit.ts", b"2")],
    [("audit.pid", b"p"), ("audit.seq", b"-1"), ("audit.ts", b"2")],
    [("audit.pid", b"p"), ("audit.seq", b" 1"), ("audit.ts", b"2")],
    [("audit.pid", b"p"), ("audit.seq", b"1\n"), ("audit.ts", b"2")],
    [("audit.pid", b"p"), ("audit.seq", "\u0661".encode()), ("audit.ts", b"2")],
    [("audit.pid", b"p"), ("audit.seq", b""), ("audit.ts", b"2")],
    [("audit.pid", b"p"), ("audit.seq", b"9223372036854775807"), ("audit.ts", b"2")],
    [("audit.pid", b"p"), ("audit.seq", b"9223372036854775808"), ("audit.ts", b"2")],
    [("audit.pid", b"p"), ("audit.seq", b"00000000000000000000000000000000000000000001"), ("audit.ts", b"2")],
    [("audit.pid", b"p"), ("audit.seq", b"1"), ("audit.ts", "it's \"q\"\t\\ \x00\x7f\u00a0\u2028é".encode())],
    [("audit.pid", b"p"), ("audit.seq", b"1"), ("audit.ts", ("x" * 39 + "'").encode())],
    [("audit.pid", b"p"), ("audit.seq", b"1"), ("audit.ts", ("x" * 40 + "'").encode())],
    [("audit.pid", b"p"), ("audit.seq", b"1"), ("audit.ts", "\U0001f600\ufeff".encode())],
    [("audit.pid", b"p"), ("audit.seq", b"1"), ("audit.ts", b"2"), ("audit.key", b"")],
    [("audit.pid", b"\xed\xa0\x80"), ("audit.seq", b"1"), ("audit.ts", b"\xc0\xaf")],  # surrogate, overlong
    [("audit.pid", b"p"), ("audit.seq", b"1"), ("audit.ts", b"253402300799999")],
    [("audit.pid", b"p"), ("audit.seq", b"1"), ("audit.ts", b"253402300800000")],
    [("audit.pid", b"p"), ("audit.seq", b"1"), ("audit.ts", b"9223372036854775808")],
]


def _spark_parse(spark: Any, cases: list[Any]) -> list[tuple[Any, ...]]:
    df = spark.createDataFrame([(i, h) for i, h in enumerate(cases)], f"i int, headers {HEADERS_TYPE}")
    out = C.with_audit_headers(df).orderBy("i").select("pid", "seq", "ts_ms", "audit_key", "header_error")
    return [tuple(r) for r in out.collect()]


def _python_parse(cases: list[Any]) -> list[tuple[Any, ...]]:
    return [(p.pid, p.seq, p.ts_ms, p.key, p.error) for p in map(H.parse, cases)]


@pytest.mark.spark
def test_header_parsing_matches_python_on_hand_cases(spark: Any) -> None:
    got = _spark_parse(spark, HAND_CASES)
    want = _python_parse(HAND_CASES)
    # The Python side is the definition; spot-check that it says what these cases are about.
    assert want[0][4] == want[1][4] == want[2][4] == "no audit headers"
    assert want[3] == ("p:1", 7, 1_700_000_000_000, None, None)
    assert want[5][4] == "duplicate audit header: audit.seq"
    assert want[21][4].startswith("audit.ts not an integer: ")
    assert want[-3] == ("p", 1, 253_402_300_799_999, None, None)  # the last millisecond of year 9999
    assert [w[4] for w in want[-2:]] == ["audit.ts out of range: '253402300800000'",
                                         "audit.ts out of range: '9223372036854775808'"]
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g == w, f"case {i}: {HAND_CASES[i]!r}"


PACKED_CASES: list[Any] = [
    H.stamp(None, "p:1", 7, 1_700_000_000_000, form=H.PACKED),
    H.stamp([("app.trace", b"x")], "a/b:1", 0, 5, key="k", form=H.PACKED),
    [("audit.id", b"p:1/7")],
    [("audit.id", b"p:1/7/17"), ("audit.pid", b"p:1")],
    [("audit.id", b"p:1/7/17"), ("audit.seq", None)],
    [("audit.id", b"p:1/7/17"), ("audit.id", b"p:1/7/17")],
    [("audit.id", None), ("audit.ts", b"1")],
    [("audit.id", b"\xff/1/2")],
    [("audit.id", b"/x/17")],
    [("audit.id", b"p/7/253402300800000")],
    [("audit.id", ("\u00e9" * 65).encode() + b"/1/2")],
    [("audit.id", b"p/7/17"), ("audit.key", b"")],
    [("audit.id", b"//")],
    [("audit.id", b"it's/\t/x")],
]


@pytest.mark.spark
def test_packed_header_parsing_matches_python(spark: Any) -> None:
    want = _python_parse(PACKED_CASES)
    assert want[0] == ("p:1", 7, 1_700_000_000_000, None, None)
    assert want[1] == ("a/b:1", 0, 5, "k", None)
    assert [w[4] for w in want[2:4]] == ["audit.id is not <pid>/<seq>/<ts>: 'p:1/7'", "audit.id together with audit.pid"]
    assert _spark_parse(spark, PACKED_CASES) == want


@pytest.mark.spark
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                HealthCheck.too_slow, HealthCheck.data_too_large])
@given(cases=st.lists(_headers, min_size=40, max_size=40))
def test_header_parsing_matches_python_on_generated_headers(spark: Any, cases: list[Any]) -> None:
    assert _spark_parse(spark, cases) == _python_parse(cases)


@pytest.mark.spark
def test_fingerprint_is_audit_key_or_sha256_of_key_nul_value(spark: Any) -> None:
    from pyspark.sql import functions as F

    rows = [("k1", b"a", b"b"), (None, b"a", b"b"), (None, None, b"v"), (None, b"k", None), (None, None, None)]
    df = spark.createDataFrame(rows, "audit_key string, key binary, value binary")
    got = [r[0] for r in df.select(C.fingerprint(F.col("audit_key"), F.col("key"), F.col("value"))).collect()]
    sha = lambda k, v: hashlib.sha256((k or b"") + b"\x00" + (v or b"")).hexdigest()  # noqa: E731
    assert got == ["k1", sha(b"a", b"b"), sha(None, b"v"), sha(b"k", None), sha(None, None)]


@pytest.mark.spark
def test_to_log_records_marks_aborted_and_partitions_by_produce_hour(spark: Any) -> None:
    from chispa import assert_df_equality

    kafka_ts = datetime(2026, 11, 21, 10, 59, 59, tzinfo=UTC)
    produce = datetime(2026, 11, 21, 11, 0, 0, 500000, tzinfo=UTC)
    audited = H.stamp([("app", b"1")], "p:1", 3, to_millis(produce))
    src = spark.createDataFrame(
        [("t", 0, 5, kafka_ts, b"k", b"v", audited),
         ("t", 0, 6, kafka_ts, None, b"v", [("audit.pid", b"p:1")]),
         ("t", 1, 0, kafka_ts, b"k", b"v", None)],
        f"topic string, partition int, offset long, timestamp timestamp, key binary, value binary, headers {HEADERS_TYPE}",
    )
    committed = spark.createDataFrame([("t", 0, 5), ("t", 1, 0)], "topic string, partition int, offset long")
    captured_at = datetime(2026, 11, 21, 12, 0, tzinfo=UTC)
    got = C.to_log_records(src, committed, captured_at, spark.conf.get("spark.sql.session.timeZone"))
    fp = hashlib.sha256(b"k\x00v").hexdigest()
    fp6 = hashlib.sha256(b"\x00v").hexdigest()
    want = spark.createDataFrame(
        [("t", 0, 5, kafka_ts, "p:1", 3, produce, fp, True, None, captured_at, "k", "2026-11-21T11"),
         ("t", 0, 6, kafka_ts, "p:1", None, None, fp6, False, "missing audit.seq", captured_at, None,
          "2026-11-21T10"),
         ("t", 1, 0, kafka_ts, None, None, None, fp, True, "no audit headers", captured_at, "k", "2026-11-21T10")],
        C._table_schema(LOG_RECORDS),
    )
    assert [f.name for f in got.schema.fields] == [*LOG_RECORDS.fieldNames(), "part_hour"]
    assert_df_equality(got.orderBy("partition", "offset"), want, ignore_nullable=True)


@pytest.mark.spark
def test_a_log_table_captured_before_keys_were_recorded_gets_the_key_column(
        spark: Any, make_config: Any, tmp_path: Any) -> None:
    """log_records written without the `key` column (an older version) gets it, null in its rows,
    before the next capture's MERGE writes it."""
    from spark_jobs.io.lake import read_table, table_path

    cfg = make_config(tmp_path, topics={"t": {"window": "1h"}})
    old = [f for f in C._table_schema(LOG_RECORDS).fields if f.name != "key"]
    from pyspark.sql.types import StructType

    row = ("t", 0, 0, None, "p", 0, None, "fp", True, None, datetime(2026, 11, 21, 10, tzinfo=UTC), "2026-11-21T10")
    (spark.createDataFrame([row], StructType(old)).write.format("delta").partitionBy("topic", "part_hour")
     .save(table_path(cfg, "log_records")))
    C.ensure_log_table(spark, cfg)
    got = read_table(spark, cfg, "log_records")
    assert got.columns == [*[f.name for f in old], "key"]
    assert [(r["offset"], r["pid"], r["key"]) for r in got.collect()] == [(0, "p", None)]
    C.ensure_log_table(spark, cfg)  # a second time: nothing to add
    assert read_table(spark, cfg, "log_records").columns == got.columns


# --------------------------------------------------------------------------------------------
# kafka: capture from a real broker


def _producer(bootstrap: str, **extra: str) -> Any:
    from confluent_kafka import Producer

    return Producer({"bootstrap.servers": bootstrap, "linger.ms": "0", **extra})


def _send(producer: Any, topic: str, partition: int, value: bytes, headers: Any, key: bytes | None = None,
          timestamp: int = 0) -> None:
    """Produce and flush one record (`timestamp`: its CreateTime in ms, 0 = now), failing the test if
    the broker did not ack it."""
    errors: list[Any] = []
    producer.produce(topic, value=value, key=key, partition=partition, headers=headers, timestamp=timestamp,
                     on_delivery=lambda err, msg: errors.append(err))
    producer.flush(30)
    assert errors == [None]


@pytest.fixture(scope="module")
def audited_topic(kafka_bootstrap: str) -> dict[str, Any]:
    """A 2-partition topic holding, on partition 0, three plain audited records, an aborted
    transaction (2 records) and a committed one (1 record); on partition 1, a record with garbage
    audit headers and one without any. Group g1 committed offset 2 on partition 0."""
    from confluent_kafka import Consumer, TopicPartition

    from tests.conftest import new_topic

    topic = new_topic(kafka_bootstrap, partitions=2)
    t0 = datetime.now(UTC)
    base_ms = to_millis(t0)
    plain = _producer(kafka_bootstrap)
    for seq in range(3):  # offsets 0, 1, 2
        _send(plain, topic, 0, f"v{seq}".encode(), H.stamp(None, "plain:1", seq, base_ms + seq), key=b"k")
    tx = _producer(kafka_bootstrap, **{"transactional.id": f"tx-{topic}"})
    tx.init_transactions(30)
    tx.begin_transaction()  # offsets 3, 4, abort marker 5
    _send(tx, topic, 0, b"a0", H.stamp(None, "tx:1", 0, base_ms + 10, key="order-a0"))
    _send(tx, topic, 0, b"a1", H.stamp(None, "tx:1", 1, base_ms + 11, key="order-a1"))
    tx.abort_transaction(30)
    tx.begin_transaction()  # offset 6, commit marker 7
    _send(tx, topic, 0, b"c2", H.stamp(None, "tx:1", 2, base_ms + 12, key="order-c2"))
    tx.commit_transaction(30)
    _send(plain, topic, 1, b"g", [("audit.pid", b"plain:1"), ("audit.seq", b"\xff\xfe"), ("audit.ts", b"1")])
    _send(plain, topic, 1, b"n", None)
    c = Consumer({"bootstrap.servers": kafka_bootstrap, "group.id": "g1", "enable.auto.commit": "false"})
    c.commit(offsets=[TopicPartition(topic, 0, 2)], asynchronous=False)
    c.close()
    return {"topic": topic, "t0": t0, "base_ms": base_ms}


def _topic_cfg(make_config: Any, tmp_path: Any, topic: str, **extra: Any) -> Any:
    return make_config(tmp_path, topics={topic: {"window": "1h", "grace": "15m", "groups": ["g1", "g2"], **extra}})


def _rows(spark: Any, cfg: Any, table: str, topic: str, order: str) -> list[tuple[Any, ...]]:
    from spark_jobs.io.lake import read_table

    df = read_table(spark, cfg, table).where(f"topic = '{topic}'")
    # PySpark returns timestamps as naive local times; make them aware UTC to compare.
    return [tuple(v.astimezone(UTC) if isinstance(v, datetime) else v for v in r)
            for r in df.orderBy(*order.split(",")).collect()]


@pytest.mark.kafka
@pytest.mark.spark
@pytest.mark.e2e
def test_capture_aborted_transaction_and_garbage_headers_then_rerun_changes_nothing(
        spark: Any, kafka_bootstrap: str, audited_topic: dict[str, Any], make_config: Any, tmp_path: Any) -> None:
    """The log, group offsets and watermarks as captured; share group `<topic>-q`, whose start offset was
    moved to 2 on partition 0 (none on 1), gets a share_offsets row per partition, share group
    `<topic>-none`, unknown to the broker, none and one line in the summary (docs/design.md §4.2)."""
    from audit.runtime.jars import interceptors_jar
    from audit.runtime.share_admin import alter_start_offsets

    topic, t0, base = audited_topic["topic"], audited_topic["t0"], audited_topic["base_ms"]
    interceptors_jar(build=True)  # the share group admin program is in it
    alter_start_offsets({"bootstrap.servers": kafka_bootstrap}, f"{topic}-q", topic, {0: 2})
    cfg = _topic_cfg(make_config, tmp_path, topic, share_groups=[f"{topic}-q", f"{topic}-none"])
    result = C.capture(spark, cfg, t0, t0 + timedelta(minutes=1))
    ca = result.captured_at

    got = result.topics[topic]
    assert (got.partitions, got.records, got.written, got.aborted, got.header_errors, got.offsets_read,
            got.deferred, got.groups) == (2, 8, 8, 2, 2, 10, 0, 4)

    def hour(ms: int) -> str:
        return from_millis(ms).strftime("%Y-%m-%dT%H")

    def sha(k: bytes | None, v: bytes) -> str:
        return hashlib.sha256((k or b"") + b"\x00" + v).hexdigest()

    log = _rows(spark, cfg, "log_records", topic, "partition,offset")
    kafka_ts = {(r[1], r[2]): r[3] for r in log}  # CreateTime set by the client: checked below
    want = [  # ..., the record's Kafka key
        (topic, 0, 0, "plain:1", 0, base + 0, sha(b"k", b"v0"), True, None, "k"),
        (topic, 0, 1, "plain:1", 1, base + 1, sha(b"k", b"v1"), True, None, "k"),
        (topic, 0, 2, "plain:1", 2, base + 2, sha(b"k", b"v2"), True, None, "k"),
        (topic, 0, 3, "tx:1", 0, base + 10, "order-a0", False, None, None),
        (topic, 0, 4, "tx:1", 1, base + 11, "order-a1", False, None, None),
        (topic, 0, 6, "tx:1", 2, base + 12, "order-c2", True, None, None),
        (topic, 1, 0, "plain:1", None, 1, sha(None, b"g"), True, "audit.seq is not UTF-8", None),
        (topic, 1, 1, None, None, None, sha(None, b"n"), True, "no audit headers", None),
    ]
    expected = [
        (t, p, o, kafka_ts[(p, o)], pid, seq, from_millis(ts) if ts is not None else None, fp, committed, err, ca,
         key, hour(ts) if ts is not None else kafka_ts[(p, o)].strftime("%Y-%m-%dT%H"))
        for t, p, o, pid, seq, ts, fp, committed, err, key in want
    ]
    assert [r[:3] for r in log] == [r[:3] for r in expected]
    assert log == expected
    for (_, _), ts in kafka_ts.items():
        assert abs(ts - t0) < timedelta(minutes=2)
    # each file of the log holds its rows in seq order, nulls first (the MERGE wrote them by offset:
    # seqs 0 1 2 0 1 2 on partition 0), so that a reconcile's task skips the row groups of other seqs
    import pyarrow.parquet as pq

    from spark_jobs.io.lake import local_path, read_table

    seqs = [pq.read_table(local_path(f), columns=["seq"])["seq"].to_pylist()
            for f in read_table(spark, cfg, "log_records").inputFiles()]
    assert sorted(s for file in seqs for s in file if s is not None) == [0, 0, 1, 1, 2, 2]
    assert all(file == sorted(file, key=lambda s: (s is not None, s or 0)) for file in seqs), seqs

    groups = _rows(spark, cfg, "group_offsets", topic, "group,partition")
    assert groups == [("g1", topic, 0, 2, ca), ("g1", topic, 1, None, ca),
                      ("g2", topic, 0, None, ca), ("g2", topic, 1, None, ca)]
    marks = _rows(spark, cfg, "partition_watermarks", topic, "partition")
    assert marks == [(topic, 0, 0, 8, ca, 0, 8), (topic, 1, 0, 2, ca, 0, 2)]  # ..., captured_from, captured_to
    assert _rows(spark, cfg, "share_offsets", topic, "group,partition") == [
        (f"{topic}-q", topic, 0, 2, ca), (f"{topic}-q", topic, 1, None, ca)]
    line = (f"share group '{topic}-none' has no start offsets on '{topic}' at {kafka_bootstrap} yet (it does not "
            "exist or has not read the topic): no share_offsets rows")
    assert result.notes == (line,)
    assert result.summary().splitlines()[-1] == f"  {line}"

    from delta.tables import DeltaTable

    from spark_jobs.io.lake import table_path

    def version() -> int:
        last = DeltaTable.forPath(spark, table_path(cfg, "log_records")).history(1).first()
        assert last is not None
        return int(last["version"])

    before = version()
    again = C.capture(spark, cfg, t0, t0 + timedelta(minutes=1))
    assert (again.topics[topic].records, again.topics[topic].aborted, again.topics[topic].written) == (8, 2, 0)
    assert _rows(spark, cfg, "log_records", topic, "partition,offset") == expected
    assert version() == before  # not even an empty commit
    # Snapshots are appended: the latest one per captured_at.
    assert len(_rows(spark, cfg, "partition_watermarks", topic, "partition")) == 4


@pytest.mark.kafka
@pytest.mark.spark
def test_topics_captured_together_equal_topics_captured_one_by_one(
        spark: Any, kafka_bootstrap: str, audited_topic: dict[str, Any], make_config: Any, tmp_path: Any,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Three topics -- the aborted transaction and garbage headers above, two plain audited records, and
    an empty topic -- in one read and one MERGE give the rows, snapshots and counts that one capture
    per topic (a batch of one) gives; a rerun of the batch writes nothing."""
    from tests.conftest import new_topic

    a, t0 = audited_topic["topic"], audited_topic["t0"]
    b, empty = new_topic(kafka_bootstrap, partitions=2), new_topic(kafka_bootstrap)
    plain = _producer(kafka_bootstrap)
    for seq in range(2):
        _send(plain, b, seq, f"b{seq}".encode(), H.stamp(None, "plain:2", seq, to_millis(t0) + seq))
    topics = {t: {"window": "1h", "grace": "15m", "groups": ["g1"]} for t in (a, b, empty)}
    span = (t0, t0 + timedelta(minutes=1))
    together_cfg = make_config(tmp_path / "together", topics=topics)
    together = C.capture(spark, together_cfg, *span)
    monkeypatch.setattr(C, "BATCH_TOPICS", 1)
    apart_cfg = make_config(tmp_path / "apart", topics=topics)
    apart = C.capture(spark, apart_cfg, *span)

    def counts(r: Any) -> dict[str, tuple[int, ...]]:
        return {t: (c.partitions, c.records, c.written, c.aborted, c.header_errors, c.offsets_read, c.deferred,
                    c.groups) for t, c in r.topics.items()}

    assert counts(together) == counts(apart) == {
        a: (2, 8, 8, 2, 2, 10, 0, 2), b: (2, 2, 2, 0, 0, 2, 0, 2), empty: (1, 0, 0, 0, 0, 0, 0, 1)}

    def rows(cfg: Any, table: str, order: str, drop: int) -> list[tuple[Any, ...]]:
        """Every topic's rows without the captured_at column (at index `drop`): the two captures ran
        at different times."""
        return [r[:drop] + r[drop + 1:] for t in (a, b, empty) for r in _rows(spark, cfg, table, t, order)]

    log = rows(together_cfg, "log_records", "partition,offset", 10)
    assert len(log) == 10 and {r[0] for r in log} == {a, b}
    assert log == rows(apart_cfg, "log_records", "partition,offset", 10)
    assert (rows(together_cfg, "partition_watermarks", "partition", 4)
            == rows(apart_cfg, "partition_watermarks", "partition", 4)
            == [(a, 0, 0, 8, 0, 8), (a, 1, 0, 2, 0, 2), (b, 0, 0, 1, 0, 1), (b, 1, 0, 1, 0, 1),
                (empty, 0, 0, 0, 0, 0)])
    assert (rows(together_cfg, "group_offsets", "group,partition", 4)
            == rows(apart_cfg, "group_offsets", "group,partition", 4)
            == [("g1", a, 0, 2), ("g1", a, 1, None), ("g1", b, 0, None), ("g1", b, 1, None), ("g1", empty, 0, None)])

    monkeypatch.setattr(C, "BATCH_TOPICS", 50)
    again = C.capture(spark, together_cfg, *span)
    assert {t: (c.records, c.written) for t, c in again.topics.items()} == {a: (8, 0), b: (2, 0), empty: (0, 0)}
    assert rows(together_cfg, "log_records", "partition,offset", 10) == log


@pytest.mark.kafka
@pytest.mark.spark
def test_mirror_copies_on_one_cluster_captured_together_equal_them_captured_one_by_one(
        spark: Any, kafka_bootstrap: str, audited_topic: dict[str, Any], make_config: Any, tmp_path: Any,
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Four mirrors' copies on one target cluster (the test broker): a's copy `ca` on mirror dr and its
    twin `ca2` (the same records at the same offsets) on mirror eu, b's copy `cb` on dr, and `ca`
    again as b's copy on eu (so it cannot share a read with a's). Read together (two batches) they
    give mirror_records rows under (mirror, source topic) and watermark rows equal to one batch per
    copy -- also when a's mirror eu is added after dr's rows are stored (the twin's rows are new, not
    the stored ones); a rerun writes nothing, not even an empty commit."""
    from delta.tables import DeltaTable
    from pyspark.sql import functions as F

    from spark_jobs.io.lake import table_path
    from tests.conftest import new_topic

    a, t0 = audited_topic["topic"], audited_topic["t0"]
    b, cb = new_topic(kafka_bootstrap), new_topic(kafka_bootstrap)
    ca, ca2 = new_topic(kafka_bootstrap, partitions=2), new_topic(kafka_bootstrap, partitions=2)
    plain = _producer(kafka_bootstrap)
    base = to_millis(t0)
    for seq in range(3):  # a's copies: partition seq % 2
        for copy in (ca, ca2):
            _send(plain, copy, seq % 2, f"a{seq}".encode(), H.stamp(None, "plain:1", seq, base + seq), key=b"k",
                  timestamp=base + seq)
    _send(plain, cb, 0, b"b0", H.stamp(None, "plain:2", 0, base))
    _send(plain, b, 0, b"b0", H.stamp(None, "plain:2", 0, base))
    target = {"bootstrap.servers": kafka_bootstrap}
    topics: dict[str, dict[str, Any]] = {
        a: {"groups": ["g1"], "mirrors": [{"name": "dr", "kafka": target, "topic": ca},
                                          {"name": "eu", "kafka": target, "topic": ca2}]},
        b: {"groups": ["g1"], "mirrors": [{"name": "dr", "kafka": target, "topic": cb},
                                          {"name": "eu", "kafka": target, "topic": ca}]}}
    cfg = make_config(tmp_path / "together", topics=topics)
    copies = [(cfg.topic(t), m) for t in (a, b) for m in cfg.topic(t).mirrors]
    assert [[(tc.name, m.name) for tc, m in batch] for batch in C.mirror_batches(copies)] == [
        [(a, "dr"), (a, "eu"), (b, "dr")], [(b, "eu")]]
    span = (t0, t0 + timedelta(minutes=1))
    first = {**topics, a: {"groups": ["g1"], "mirrors": topics[a]["mirrors"][:1]}}  # before eu was added
    C.capture(spark, make_config(tmp_path / "together", topics=first), *span)
    got = C.capture(spark, cfg, *span)
    assert capsys.readouterr().out == ""  # capture prints nothing itself; its caller prints the summary
    mirror_lines = [  # in the configuration's order; only eu's copy of a is new
        f"{a} mirror dr ({ca} at {kafka_bootstrap}): 3 records (0 new or changed), 0 aborted, 0 header errors, 3 offsets",
        f"{a} mirror eu ({ca2} at {kafka_bootstrap}): 3 records (3 new or changed), 0 aborted, 0 header errors, "
        "3 offsets",
        f"{b} mirror dr ({cb} at {kafka_bootstrap}): 1 records (0 new or changed), 0 aborted, 0 header errors, 1 offsets",
        f"{b} mirror eu ({ca} at {kafka_bootstrap}): 3 records (0 new or changed), 0 aborted, 0 header errors, 3 offsets"]
    assert [m.line() for m in got.mirrors] == mirror_lines
    # the summary: the two topics' totals, then each topic's line followed by its copies' lines
    summary = got.summary().splitlines()
    assert summary[0].endswith(": 2 topics, 9 records, 0 new or changed, 2 aborted, 2 header errors, 0 deferred")
    heads = [f"  {a}: 8 records", *(f"    {x}" for x in mirror_lines[:2]), f"  {b}: 1 records",
             *(f"    {x}" for x in mirror_lines[2:])]
    assert [line[:len(h)] for line, h in zip(summary[1:], heads, strict=True)] == heads
    monkeypatch.setattr(C, "BATCH_TOPICS", 1)
    apart_cfg = make_config(tmp_path / "apart", topics=topics)
    C.capture(spark, apart_cfg, *span)

    def rows(c: Any, table: str, columns: str, latest: bool = False) -> list[tuple[Any, ...]]:
        """`columns` of `table`'s rows, sorted; `latest`: of the last capture's snapshot only."""
        from spark_jobs.io.lake import read_table

        df = read_table(spark, c, table)
        if latest:
            df = df.where(F.col("captured_at") == df.agg(F.max("captured_at")).collect()[0][0])
        return [tuple(r) for r in df.selectExpr(*columns.split(",")).orderBy(*columns.split(",")).collect()]

    columns = "mirror,topic,partition,offset,pid,seq,fingerprint,committed,header_error,key,part_hour"
    together = rows(cfg, "mirror_records", columns)
    assert [r[:6] for r in together] == sorted([
        ("dr", a, 0, 0, "plain:1", 0), ("dr", a, 0, 1, "plain:1", 2), ("dr", a, 1, 0, "plain:1", 1),
        ("dr", b, 0, 0, "plain:2", 0),
        ("eu", a, 0, 0, "plain:1", 0), ("eu", a, 0, 1, "plain:1", 2), ("eu", a, 1, 0, "plain:1", 1),
        ("eu", b, 0, 0, "plain:1", 0), ("eu", b, 0, 1, "plain:1", 2), ("eu", b, 1, 0, "plain:1", 1)])
    # the twins' rows differ in their mirror alone
    assert [r[2:] for r in together if r[:2] == ("dr", a)] == [r[2:] for r in together if r[:2] == ("eu", a)]
    assert together == rows(apart_cfg, "mirror_records", columns)
    marks = "mirror,topic,partition,log_start_offset,high_watermark,captured_from,captured_to"
    assert rows(cfg, "mirror_watermarks", marks, latest=True) == rows(apart_cfg, "mirror_watermarks", marks) == sorted([
        ("dr", a, 0, 0, 2, 0, 2), ("dr", a, 1, 0, 1, 0, 1), ("dr", b, 0, 0, 1, 0, 1),
        ("eu", a, 0, 0, 2, 0, 2), ("eu", a, 1, 0, 1, 0, 1), ("eu", b, 0, 0, 2, 0, 2), ("eu", b, 1, 0, 1, 0, 1)])

    def version() -> int:
        last = DeltaTable.forPath(spark, table_path(cfg, "mirror_records")).history(1).first()
        assert last is not None
        return int(last["version"])

    monkeypatch.setattr(C, "BATCH_TOPICS", 50)
    before = version()
    C.capture(spark, cfg, *span)
    assert version() == before
    assert rows(cfg, "mirror_records", columns) == together


@pytest.mark.unit
def test_mirror_batches_share_a_cluster_never_a_copy_and_hold_at_most_batch_topics(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from audit.core.config import MirrorConfig, TopicConfig

    x, y = {"bootstrap.servers": "x:9092"}, {"bootstrap.servers": "y:9092"}
    copies = [(TopicConfig(t), MirrorConfig(name, cluster, copy)) for t, name, cluster, copy in (
        ("t1", "dr", x, "c1"), ("t2", "dr", x, "c2"), ("t3", "eu", y, "c3"), ("t4", "dr", x, "c1"),
        ("t5", "dr", x, "c5"), ("t6", "dr", x, "c6"))]
    monkeypatch.setattr(C, "BATCH_TOPICS", 3)
    assert [[tc.name for tc, _ in batch] for batch in C.mirror_batches(copies)] == [
        ["t1", "t2", "t5"], ["t3"], ["t4", "t6"]]
    assert C.mirror_batches([]) == []


@pytest.mark.kafka
@pytest.mark.spark
def test_open_transaction_is_deferred_then_captured_once_it_ends(
        spark: Any, kafka_bootstrap: str, make_config: Any, tmp_path: Any) -> None:
    from tests.conftest import new_topic

    topic = new_topic(kafka_bootstrap)
    t0 = datetime.now(UTC)
    plain = _producer(kafka_bootstrap)
    _send(plain, topic, 0, b"before", H.stamp(None, "p:1", 0, to_millis(t0)))  # offset 0
    tx = _producer(kafka_bootstrap, **{"transactional.id": f"tx-{topic}"})
    tx.init_transactions(30)
    tx.begin_transaction()
    _send(tx, topic, 0, b"open", H.stamp(None, "tx:1", 0, to_millis(t0)))  # offset 1, still open
    _send(plain, topic, 0, b"after", H.stamp(None, "p:1", 1, to_millis(t0)))  # offset 2, past the LSO
    cfg = make_config(tmp_path, topics={topic: {}})

    first = C.capture(spark, cfg, t0, t0 + timedelta(minutes=1)).topics[topic]
    assert (first.records, first.offsets_read, first.deferred, first.written) == (1, 1, 2, 1)
    assert [r[2] for r in _rows(spark, cfg, "log_records", topic, "offset")] == [0]

    tx.commit_transaction(30)  # commit marker at offset 3
    second = C.capture(spark, cfg, t0, t0 + timedelta(minutes=1)).topics[topic]
    assert (second.records, second.offsets_read, second.deferred, second.aborted, second.written) == (3, 4, 0, 0, 2)
    assert [(r[2], r[8]) for r in _rows(spark, cfg, "log_records", topic, "offset")] == [
        (0, True), (1, True), (2, True)]
    # What each capture read is what reconcile may call covered: not offsets 1-2 the first time.
    marks = sorted(_rows(spark, cfg, "partition_watermarks", topic, "partition"), key=lambda m: m[4])
    assert [(m[2], m[3], m[5], m[6]) for m in marks] == [(0, 3, 0, 1), (0, 4, 0, 4)]


@pytest.mark.kafka
def test_cli_unknown_topic_is_one_clear_line(kafka_bootstrap: str, tmp_path: Any,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    from audit.cli import main

    conf = tmp_path / "msgaudit.yaml"
    conf.write_text(f"kafka: {{bootstrap.servers: '{kafka_bootstrap}'}}\ntopics:\n  no-such-topic-x1: {{}}\n")
    code = main(["capture", "--config", str(conf), "--start", "2026-11-21T10:00Z", "--end", "2026-11-21T11:00Z"])
    err = capsys.readouterr().err
    assert code == 2
    assert err == (f"msgaudit capture: error: topic 'no-such-topic-x1': topic does not exist on the Kafka cluster "
                   f"at {kafka_bootstrap} (create it, or remove it from {conf})\n")
    code = main(["capture", "--config", str(conf), "--start", "2026-11-21T10:00Z", "--end", "2026-11-21T11:00Z",
                 "--topic", "orders"])
    assert code == 2
    assert capsys.readouterr().err == (f"msgaudit capture: error: {conf}: unknown topic 'orders' "
                                       "(configured: no-such-topic-x1)\n")


# --------------------------------------------------------------------------------------------
# spark_jobs/pipeline/submit.py: the spark-submit entry point (run in-process on the shared session)


@pytest.mark.unit
@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["capture", "--end", "2026-11-21T11:00Z"], "capture needs --start and --end"),
        (["reconcile", "--start", "2026-11-21T11:00Z", "--end", "2026-11-21T10:00Z"], "must be after --start"),
        (["sla", "--start", "yesterday", "--end", "2026-11-21T10:00Z"], "--start: 'yesterday' is not an ISO 8601"),
        (["capture", "--start", "2026-11-21T10:00Z", "--end", "2026-11-21T11:00Z", "--topic", "x"],
         "unknown topic 'x'"),
        (["window", "--start", "2026-11-21T10:00Z", "--end", "2026-11-21T11:00Z", "--topic", "x"],
         "unknown topic 'x'"),
        (["backfill", "--end", "2026-11-21T11:00Z"], "backfill needs --start and --end"),
        (["follow", "--topic", "x"], "unknown topic 'x'"),
        (["follow", "--start", "soon"], "--start: 'soon' is not an ISO 8601"),
    ],
)
def test_submit_bad_input_is_one_line_and_exit_2(argv: list[str], message: str, tmp_path: Any,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    from spark_jobs.pipeline import submit

    conf = tmp_path / "msgaudit.yaml"
    conf.write_text("topics:\n  orders: {}\n")
    never_used = object()  # the step must fail before it touches Spark
    assert submit.main([*argv, "--config", str(conf)], spark=never_used) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"msgaudit {argv[0]}: error: ") and message in err


@pytest.mark.kafka
@pytest.mark.spark
def test_submit_capture_of_an_empty_window(spark: Any, kafka_bootstrap: str, audited_topic: dict[str, Any],
                                           make_config: Any, tmp_path: Any,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    """An empty window is fine: no records, an empty log_records table, fresh watermark snapshots."""
    from spark_jobs.pipeline import submit

    topic = audited_topic["topic"]
    conf = tmp_path / "msgaudit.yaml"
    conf.write_text(f"kafka: {{bootstrap.servers: '{kafka_bootstrap}'}}\nlake: lake\n"
                    f"topics:\n  {topic}: {{}}\n  other: {{}}\n")
    code = submit.main(["capture", "--config", str(conf), "--start", "2001-01-01T00:00Z",
                        "--end", "2001-01-01T01:00Z", "--topic", topic], spark=spark)
    assert code == 0
    assert f"  {topic}: 0 records in 0 offsets over 2 partitions, 0 new or changed" in capsys.readouterr().out
    cfg = make_config(tmp_path, lake=str(tmp_path / "lake"))
    assert _rows(spark, cfg, "log_records", topic, "offset") == []
    marks = _rows(spark, cfg, "partition_watermarks", topic, "partition")
    assert [m[:4] for m in marks] == [(topic, 0, 0, 8), (topic, 1, 0, 2)]


@pytest.mark.spark
def test_submit_sla_failure_exits_3(spark: Any, make_config: Any, tmp_path: Any,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    from spark_jobs.io.lake import write_table
    from spark_jobs.io.schemas import AUDIT_PARTITION_REPORT
    from spark_jobs.pipeline import submit

    conf = tmp_path / "msgaudit.yaml"
    conf.write_text("lake: lake\nreport_store: sqlite:///report.db\n"
                    "topics:\n  orders: {window: 1h, sla: {max_lost: 0}}\n")
    ws = datetime(2026, 11, 21, 10, tzinfo=UTC)
    row: dict[str, Any] = {f.name: None for f in AUDIT_PARTITION_REPORT.fields}
    row.update(window_start=ws, window_end=ws + timedelta(hours=1), topic="orders", partition=0, stage="log",
               expected=10, delivered=9, lost=1, duplicated=0, reordered=0, pending=0, status="final",
               run_id="r1", computed_at=ws + timedelta(hours=2))
    cfg = make_config(tmp_path, lake=str(tmp_path / "lake"))
    write_table(spark.createDataFrame([row], AUDIT_PARTITION_REPORT), cfg, "audit_partition_report", mode="overwrite")
    argv = ["sla", "--config", str(conf), "--start", "2026-11-21T10:00Z", "--end", "2026-11-21T11:00Z"]
    assert submit.main(argv, spark=spark) == 3
    captured = capsys.readouterr()
    assert "max_lost" in captured.out
    assert captured.err == ("sla: 1 error-severity SLA check(s) failed for windows in "
                            "2026-11-21T10:00:00+00:00 .. 2026-11-21T11:00:00+00:00\n")


@pytest.mark.spark
def test_watermark_snapshot_adds_the_captured_range_columns_to_an_older_table(
        spark: Any, make_config: Any, tmp_path: Any) -> None:
    """A partition_watermarks table written before captured_from/captured_to existed takes the new
    snapshot rows; its old rows read back with nulls there (reconcile: the whole log was covered)."""
    from spark_jobs.io.lake import write_table
    from spark_jobs.io.schemas import PARTITION_WATERMARKS

    cfg = make_config(tmp_path)
    from pyspark.sql.types import StructType

    old_schema = StructType(PARTITION_WATERMARKS.fields[:-2])
    assert old_schema.fieldNames()[-1] == "captured_at"
    t1 = datetime(2026, 5, 1, 10, 0, tzinfo=UTC)
    t2 = t1 + timedelta(hours=1)
    write_table(spark.createDataFrame([("t", 0, 0, 5, t1)], old_schema), cfg, C.WATERMARKS_TABLE,
                partition_by=("topic",))
    C._Snapshots(watermarks=[("t", 0, 0, 9, t2, 3, 9)]).write(spark, cfg)
    assert _rows(spark, cfg, C.WATERMARKS_TABLE, "t", "captured_at") == [
        ("t", 0, 0, 5, t1, None, None), ("t", 0, 0, 9, t2, 3, 9)]
