"""Log capture: offset planning and option mapping (unit), header parsing against the Python
definition (spark), and capture from a real broker with transactions and garbage headers (kafka)."""

from __future__ import annotations

import hashlib
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from audit import headers as H
from audit.config import from_dict
from audit.errors import ConfigError, InputError
from audit.timeutil import to_millis
from spark_jobs import capture as C

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
    assert C.offsets_json("orders", ranges, "start") == '{"orders": {"0": 2, "3": 4}}'
    assert C.offsets_json("orders", ranges, "end") == '{"orders": {"0": 7, "3": 9}}'


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
        C._selected_topics(cfg, ["nope"])
    assert C._selected_topics(cfg, None) == ["orders"]
    with pytest.raises(InputError, match="no topics configured"):
        C._selected_topics(from_dict({}), None)


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
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g == w, f"case {i}: {HAND_CASES[i]!r}"


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

    from spark_jobs.schemas import LOG_RECORDS

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
        [("t", 0, 5, kafka_ts, "p:1", 3, produce, fp, True, None, captured_at, "2026-11-21T11"),
         ("t", 0, 6, kafka_ts, "p:1", None, None, fp6, False, "missing audit.seq", captured_at, "2026-11-21T10"),
         ("t", 1, 0, kafka_ts, None, None, None, fp, True, "no audit headers", captured_at, "2026-11-21T10")],
        C._log_table_schema(),
    )
    assert [f.name for f in got.schema.fields] == [*LOG_RECORDS.fieldNames(), "part_hour"]
    assert_df_equality(got.orderBy("partition", "offset"), want, ignore_nullable=True)
