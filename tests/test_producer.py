"""AuditedProducer: headers on the wire, seq continuity, ledger rows versus delivery reports,
failure paths, transactions, stats. Real broker (`kafka`) unless marked `unit`."""

from __future__ import annotations

import hashlib
import json
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Consumer, KafkaException, TopicPartition

from audit.clients.ledger import sealed_segments
from audit.clients.producer import AuditedProducer, _kafka_conf
from audit.core import headers as h
from tests.conftest import new_topic

LEDGER_COLUMNS = ["producer", "pid", "seq", "topic", "partition", "offset", "status", "error", "txn_id",
                  "produce_ts", "ack_ts"]


def ledger_lines(directory: Path) -> list[dict[str, Any]]:
    """Every line of the sealed segments, parsed; close() must have sealed them all."""
    lines = []
    for seg in sealed_segments(directory):
        for line in seg.read_text().splitlines():
            row = json.loads(line)
            # a failed send outside a transaction also carries its content's fingerprint
            assert list(row) in (LEDGER_COLUMNS, [*LEDGER_COLUMNS, "run"], [*LEDGER_COLUMNS, "fingerprint"])
            lines.append(row)
    assert not list(directory.glob("*.open")), "close() must seal every segment"
    return lines


def ledger_rows(directory: Path) -> list[dict[str, Any]]:
    """The table rows of the segments: a line with `"run": k` is k rows (docs/design.md §4.2)."""
    rows: list[dict[str, Any]] = []
    for row in ledger_lines(directory):
        run = row.pop("run", None)
        assert run is None or run >= 2  # a writer leaves out "run" for a single record
        run = run or 1
        rows.extend({**row, "seq": row["seq"] + i, "offset": None if row["offset"] is None else row["offset"] + i}
                    for i in range(run))
    return rows


def consume_all(bootstrap: str, topic: str, expected: int, isolation: str = "read_committed",
                timeout: float = 30.0) -> list[Any]:
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": f"g-{uuid.uuid4().hex[:8]}",
                  "auto.offset.reset": "earliest", "enable.auto.commit": False, "isolation.level": isolation})
    parts = c.list_topics(topic, timeout=10).topics[topic].partitions
    c.assign([TopicPartition(topic, p, 0) for p in parts])
    out: list[Any] = []
    deadline = time.monotonic() + timeout
    try:
        while len(out) < expected and time.monotonic() < deadline:
            m = c.poll(0.2)
            if m is not None and m.error() is None:
                out.append(m)
        # Anything beyond `expected` would be a bug too: read a little longer.
        end = time.monotonic() + 0.5
        while time.monotonic() < end:
            m = c.poll(0.1)
            if m is not None and m.error() is None:
                out.append(m)
    finally:
        c.close()
    return out


@pytest.fixture(autouse=True, params=["plugin", "python"])
def producer_mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test runs on both paths: stamping and ledger in the libmsgaudit plugin, and the
    pure-Python fallback (transactional producers always take the Python path)."""
    if request.param == "plugin":
        monkeypatch.setenv("MSGAUDIT_PLUGIN", str(request.getfixturevalue("libmsgaudit")))
    else:
        monkeypatch.setenv("MSGAUDIT_PLUGIN", "off")
    return str(request.param)


# -- unit: config and seq continuity (librdkafka mock cluster / no broker) --------------------

@pytest.mark.unit
def test_defaults_idempotent_acks_all_and_user_settings_pass_through() -> None:
    assert _kafka_conf({"bootstrap.servers": "b:1"}) == {
        "bootstrap.servers": "b:1", "acks": "all", "enable.idempotence": True}
    assert _kafka_conf({"acks": "1", "linger.ms": 7}) == {"acks": "1", "linger.ms": 7}
    assert _kafka_conf({"request.required.acks": -1}) == {"request.required.acks": -1, "enable.idempotence": True}
    assert _kafka_conf({"enable.idempotence": False}) == {"enable.idempotence": False, "acks": "all"}


@pytest.mark.unit
def test_seq_is_per_topic_and_counts_failed_calls(tmp_path: Path, producer_mode: str) -> None:
    conf = {"test.mock.num.brokers": 1, "message.max.bytes": 2000, "log_level": 0}
    with AuditedProducer(conf, producer_name="seq", ledger_dir=tmp_path / "producer") as p:
        p.produce("a", b"a0")
        p.produce("b", b"b0")
        with pytest.raises(KafkaException, match="MSG_SIZE_TOO_LARGE"):
            p.produce("a", b"x" * 5000)  # a failed call still uses seq 1 of topic a
        p.produce("a", b"a2", headers=[("user", b"u")], audit_key="k-2")
        p.produce("b", b"b1")
        p.flush(10)
        stats = p.stats()
        assert p.mode == producer_mode
    rows = sorted(ledger_rows(tmp_path / "producer"), key=lambda r: (r["topic"], r["seq"]))
    # one settings row per producer, on both paths (on the plugin path the wrapper writes it and
    # the plugin, told so by msgaudit.settings.row=false, does not)
    settings = [json.loads(f.read_text()) for f in (tmp_path / "producer_settings").glob("*.jsonl")]
    assert settings == [{**p.settings, "mode": producer_mode}]
    assert [(r["topic"], r["seq"], r["status"], r["error"]) for r in rows] == [
        ("a", 0, "acked", None), ("a", 1, "failed", "MSG_SIZE_TOO_LARGE"), ("a", 2, "acked", None),
        ("b", 0, "acked", None), ("b", 1, "acked", None)]
    assert {r["pid"] for r in rows} == {p.pid} and p.pid.startswith("seq:")
    failed = rows[1]
    assert (failed["partition"], failed["offset"], failed["ack_ts"]) == (-1, None, None)
    assert failed["fingerprint"] == hashlib.sha256(b"\x00" + b"x" * 5000).hexdigest()
    assert (stats.sent, stats.acked, stats.failed, stats.in_flight) == (5, 4, 1, 0)


@pytest.mark.unit
@pytest.mark.parametrize(("headers", "reason"), [
    ([("audit.trace", b"x")], "unknown audit header 'audit.trace': audit.* names are reserved (audit.pid, "
     "audit.seq, audit.ts, audit.key, audit.id, audit.src.topic, audit.src.partition, audit.src.offset, audit.attempt, "
     "audit.retry.at, audit.error, audit.group)"),
    ({"user": "u", "audit.seq": "12a"}, "audit.seq not a decimal integer: '12a'"),
    ([("audit.seq", b"-3")], "audit.seq not a decimal integer: '-3'"),
    ([("audit.pid", "p" * 65)], "audit.pid longer than 64 chars: '" + "p" * 40 + "...'"),
    ([("audit.ts", b"")], "audit.ts not a decimal integer: ''"),
    (["not-a-pair"], "a header must be a (name, value) pair, got \"'not-a-pair'\""),
])
def test_headers_the_audit_cannot_stamp_are_one_error_at_produce_and_nothing_is_written(
        tmp_path: Path, headers: Any, reason: str) -> None:
    from audit.core.errors import InputError

    conf = {"test.mock.num.brokers": 1, "log_level": 0}
    with AuditedProducer(conf, producer_name="hdr", ledger_dir=tmp_path) as p:
        with pytest.raises(InputError) as e:
            p.produce("a", b"bad", headers=headers)
        assert str(e.value) == f"AuditedProducer.produce('a'): {reason}"
        assert p.stats().sent == 0  # no seq used, nothing sent
        # known audit.* headers pass: a retry copy's headers are kept, the audit identity is replaced
        p.produce("a", b"ok", headers=[("audit.attempt", b"2"), ("audit.seq", b"99"), ("u", b"1")])
        p.flush(10)
    assert [(r["seq"], r["status"]) for r in ledger_rows(tmp_path)] == [(0, "acked")]


@pytest.mark.unit
def test_retry_copy_headers_of_the_consumer_are_known_audit_headers() -> None:
    from audit.clients.consumer import RETRY_HEADERS

    assert set(RETRY_HEADERS) == set(h.COPY_HEADERS)


@pytest.mark.unit
def test_raw_producer_sends_without_identity_or_ledger_row(tmp_path: Path) -> None:
    conf = {"test.mock.num.brokers": 1, "log_level": 0}
    reports: list[Any] = []
    with AuditedProducer(conf, producer_name="raw", ledger_dir=tmp_path) as p:
        p.produce("a", b"audited")
        p.raw_producer.produce("a", b"copy", headers=[("audit.seq", b"7")],
                               on_delivery=lambda err, msg: reports.append((err, msg.value())))
        p.flush(10)
        stats = p.stats()
    assert reports == [(None, b"copy")]
    assert [(r["seq"], r["status"]) for r in ledger_rows(tmp_path)] == [(0, "acked")]
    assert (stats.sent, stats.acked) == (1, 1)


@pytest.mark.unit
def test_broker_unreachable_gives_failed_rows_with_the_error(tmp_path: Path) -> None:
    reports: list[tuple[str | None, int | None]] = []
    conf = {"bootstrap.servers": "127.0.0.1:1", "message.timeout.ms": 300, "log_level": 0}
    with AuditedProducer(conf, producer_name="down", ledger_dir=tmp_path) as p:
        for i, (key, audit_key) in enumerate([(b"k0", None), (None, None), (b"k2", 'order "2"')]):
            p.produce("t", b"%d" % i, key=key, audit_key=audit_key,
                      on_delivery=lambda e, m: reports.append((e.name() if e else None, m.offset())))
        assert p.flush(10) == 0
    assert [r[0] for r in reports] == ["_MSG_TIMED_OUT"] * 3
    rows = ledger_rows(tmp_path)
    assert sorted((r["seq"], r["status"], r["error"], r["partition"], r["offset"]) for r in rows) == [
        (i, "failed", "_MSG_TIMED_OUT", -1, None) for i in range(3)]
    # capture's fingerprint of each (docs/design.md §3): audit.key, else SHA-256 of key, 0x00, value
    assert [r["fingerprint"] for r in sorted(rows, key=lambda r: r["seq"])] == [
        hashlib.sha256(b"k0\x000").hexdigest(), hashlib.sha256(b"\x001").hexdigest(), 'order "2"']


# -- real broker ---------------------------------------------------------------------------

@pytest.mark.kafka
def test_ledger_rows_equal_delivery_reports_one_for_one(kafka_bootstrap: str, tmp_path: Path,
                                                       producer_mode: str) -> None:
    topic = new_topic(kafka_bootstrap, partitions=3)
    reports: dict[bytes, tuple[int, int]] = {}

    def on_delivery(err: Any, msg: Any) -> None:
        assert err is None
        reports[msg.value()] = (msg.partition(), msg.offset())

    n = 60
    t0 = int(time.time() * 1000)
    with AuditedProducer({"bootstrap.servers": kafka_bootstrap}, producer_name="orders-svc",
                         ledger_dir=tmp_path) as p:
        assert p.mode == producer_mode
        for i in range(n):
            p.produce(topic, b"v%d" % i, key=b"k%d" % (i % 7), on_delivery=on_delivery,
                      headers={"trace": b"t%d" % i})
        assert p.flush(30) == 0
        pid = p.pid
    t1 = int(time.time() * 1000)
    rows = ledger_rows(tmp_path)
    assert len(rows) == n == len(reports)
    by_seq = {r["seq"]: r for r in rows}
    assert sorted(by_seq) == list(range(n))
    for i in range(n):
        r = by_seq[i]
        assert (r["producer"], r["pid"], r["topic"], r["status"], r["error"], r["txn_id"]) == (
            "orders-svc", pid, topic, "acked", None, None)
        assert (r["partition"], r["offset"]) == reports[b"v%d" % i]
        assert t0 <= r["produce_ts"] <= r["ack_ts"] <= t1

    # What the broker holds: our headers after the user's, pointing at the same ledger rows.
    records = consume_all(kafka_bootstrap, topic, n)
    assert len(records) == n
    for m in records:
        hdrs = m.headers()
        assert hdrs[0] == ("trace", m.value().replace(b"v", b"t"))
        parsed = h.parse(hdrs)
        assert parsed.error is None and parsed.pid == pid
        row = by_seq[parsed.seq]
        assert (row["partition"], row["offset"], row["produce_ts"]) == (m.partition(), m.offset(), parsed.ts_ms)
        assert m.value() == f"v{parsed.seq}".encode()


@pytest.mark.kafka
def test_unknown_topic_gives_failed_rows_with_the_error(kafka_bootstrap: str, tmp_path: Path) -> None:
    topic = f"missing-{uuid.uuid4().hex[:8]}"  # the broker does not auto-create topics
    reports: list[str] = []
    conf = {"bootstrap.servers": kafka_bootstrap, "topic.metadata.propagation.max.ms": 500,
            "message.timeout.ms": 5000}
    with AuditedProducer(conf, producer_name="lost", ledger_dir=tmp_path) as p:
        for _ in range(2):
            p.produce(topic, b"v", on_delivery=lambda e, m: reports.append(e.name() if e else "ok"))
        assert p.flush(20) == 0
        assert p.stats().failed == 2
    assert reports == ["UNKNOWN_TOPIC_OR_PART"] * 2
    assert sorted((r["seq"], r["status"], r["error"], r["offset"]) for r in ledger_rows(tmp_path)) == [
        (0, "failed", "UNKNOWN_TOPIC_OR_PART", None), (1, "failed", "UNKNOWN_TOPIC_OR_PART", None)]


@pytest.mark.kafka
def test_aborted_transaction_gives_aborted_rows(kafka_bootstrap: str, tmp_path: Path) -> None:
    topic = new_topic(kafka_bootstrap, partitions=1)
    tid = f"txn-{uuid.uuid4().hex[:8]}"
    with AuditedProducer({"bootstrap.servers": kafka_bootstrap, "transactional.id": tid},
                         producer_name="tx", ledger_dir=tmp_path) as p:
        p.init_transactions(30)
        p.begin_transaction()
        for i in range(3):
            p.produce(topic, b"c%d" % i)
        p.commit_transaction(30)
        p.begin_transaction()
        for i in range(2):
            p.produce(topic, b"a%d" % i)
        p.flush(30)  # delivered (written to the log) before the abort
        p.abort_transaction(30)
        p.begin_transaction()
        p.produce(topic, b"c3")
        p.commit_transaction(30)
        stats = p.stats()
    assert (stats.acked, stats.failed, stats.aborted) == (6, 0, 2)
    rows = sorted(ledger_rows(tmp_path), key=lambda r: r["seq"])
    assert [(r["seq"], r["status"], r["txn_id"], r["error"]) for r in rows] == [
        (0, "acked", f"{tid}:1", None), (1, "acked", f"{tid}:1", None), (2, "acked", f"{tid}:1", None),
        (3, "aborted", f"{tid}:2", None), (4, "aborted", f"{tid}:2", None),
        (5, "acked", f"{tid}:3", None)]
    assert all(r["offset"] is not None and r["ack_ts"] is not None for r in rows)

    committed = consume_all(kafka_bootstrap, topic, 4, "read_committed")
    seqs = [h.parse(m.headers()).seq for m in committed]
    assert sorted(-1 if s is None else s for s in seqs) == [0, 1, 2, 5]
    everything = consume_all(kafka_bootstrap, topic, 6, "read_uncommitted")
    at = {(m.partition(), m.offset()): h.parse(m.headers()).seq for m in everything}
    assert {(r["partition"], r["offset"]): r["seq"] for r in rows} == at


@pytest.mark.kafka
def test_close_with_an_open_transaction_writes_aborted_rows(kafka_bootstrap: str, tmp_path: Path) -> None:
    topic = new_topic(kafka_bootstrap)
    p = AuditedProducer({"bootstrap.servers": kafka_bootstrap, "transactional.id": f"t-{uuid.uuid4().hex[:6]}"},
                        producer_name="tx", ledger_dir=tmp_path)
    p.init_transactions(30)
    p.begin_transaction()
    p.produce(topic, b"x")
    p.close()
    assert [(r["seq"], r["status"]) for r in ledger_rows(tmp_path)] == [(0, "aborted")]


@pytest.mark.kafka
def test_drop_in_callbacks_batch_len_and_ledger_topic(kafka_bootstrap: str, tmp_path: Path) -> None:
    topic = new_topic(kafka_bootstrap)
    ledger_topic = new_topic(kafka_bootstrap)
    global_reports: list[int | None] = []
    alias_reports: list[int | None] = []
    conf = {"bootstrap.servers": kafka_bootstrap, "linger.ms": 50,
            "on_delivery": lambda e, m: global_reports.append(m.offset())}
    with AuditedProducer(conf, producer_name="dropin", ledger_dir=tmp_path, ledger_topic=ledger_topic) as p:
        p.produce(topic, b"a")                                               # global callback
        p.produce(topic, b"b", callback=lambda e, m: alias_reports.append(m.offset()))  # alias
        assert len(p) >= 1
        msgs: list[dict[str, Any]] = [{"value": b"c"}, {"value": b"d", "key": b"k"}]
        assert p.produce_batch(topic, msgs) == 2
        p.flush(30)
        assert len(p) == 0
    assert (sorted(-1 if o is None else o for o in global_reports), alias_reports) == ([0, 2, 3], [1])
    rows = ledger_rows(tmp_path)
    assert sorted((r["seq"], r["offset"]) for r in rows) == [(0, 0), (1, 1), (2, 2), (3, 3)]
    mirrored = consume_all(kafka_bootstrap, ledger_topic, 4)
    assert sorted((json.loads(m.value()) for m in mirrored), key=lambda r: r["seq"]) == sorted(
        rows, key=lambda r: r["seq"])


@pytest.mark.kafka
def test_only_error_reports_reach_the_user_but_every_outcome_is_ledgered(kafka_bootstrap: str,
                                                                       tmp_path: Path) -> None:
    topic = new_topic(kafka_bootstrap)
    reports: list[Any] = []
    conf = {"bootstrap.servers": kafka_bootstrap, "delivery.report.only.error": True}
    with AuditedProducer(conf, producer_name="quiet", ledger_dir=tmp_path) as p:
        p.produce(topic, b"ok", on_delivery=lambda e, m: reports.append(e))
        p.flush(30)
    assert reports == []
    assert [r["status"] for r in ledger_rows(tmp_path)] == ["acked"]


@pytest.mark.kafka
def test_stats_and_prometheus_export(kafka_bootstrap: str, tmp_path: Path) -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    topic = new_topic(kafka_bootstrap)
    registry = CollectorRegistry()
    with AuditedProducer({"bootstrap.servers": kafka_bootstrap}, producer_name="metrics",
                         ledger_dir=tmp_path, metrics_registry=registry) as p:
        for _ in range(5):
            p.produce(topic, b"v")
        p.flush(30)
        text = generate_latest(registry).decode()
        labels = f'{{pid="{p.pid}",producer="metrics"}}'
        for line in (f"msgaudit_producer_sent_total{labels} 5.0", f"msgaudit_producer_acked_total{labels} 5.0",
                     f"msgaudit_producer_failed_total{labels} 0.0", f"msgaudit_producer_in_flight{labels} 0.0"):
            assert line in text.splitlines()
    assert "msgaudit_producer" not in generate_latest(registry).decode()  # unregistered at close


@pytest.mark.kafka
def test_from_config_uses_the_config_ledger_dir(kafka_bootstrap: str, tmp_path: Path, make_config: Any) -> None:
    cfg = make_config(tmp_path)
    topic = new_topic(kafka_bootstrap)
    with AuditedProducer.from_config(cfg, producer_name="cfg", **{"linger.ms": 1}) as p:
        p.produce(topic, b"v")
        p.flush(30)
    assert [r["producer"] for r in ledger_rows(cfg.ledger_dir / "producer")] == ["cfg"]
