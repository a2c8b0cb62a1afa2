"""The lab's fault proxy: its wire parser on hand-made bytes, and its faults against a real broker
(the broker writes, the answer is lost, the client retries)."""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from audit.lab.env import Lab, ProxiedBroker
from audit.lab.proxy import (
    WirePartitionResult,
    WireRecord,
    parse_produce_request,
    parse_produce_response,
    parse_record_batches,
)

NOT_LEADER_OR_FOLLOWER = 6

# -- hand-made wire bytes -----------------------------------------------------------------------


def _zigzag(n: int) -> bytes:
    v = (n << 1) ^ (n >> 63)
    out = bytearray()
    while True:
        b = v & 0x7F
        v >>= 7
        if v:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _record(offset_delta: int, headers: list[tuple[str, bytes]]) -> bytes:
    body = b"\x00" + _zigzag(0) + _zigzag(offset_delta) + _zigzag(-1) + _zigzag(2) + b"v!"
    body += _zigzag(len(headers))
    for k, v in headers:
        body += _zigzag(len(k)) + k.encode() + _zigzag(len(v)) + v
    return _zigzag(len(body)) + body


def _batch(records: list[bytes], producer_id: int = -1, base_sequence: int = -1, attributes: int = 0) -> bytes:
    after_length = (struct.pack(">ib", 0, 2) + b"\0\0\0\0" + struct.pack(">hiqqqhii", attributes, len(records) - 1,
                                                                         0, 0, producer_id, 0, base_sequence,
                                                                         len(records)) + b"".join(records))
    return struct.pack(">qi", 0, len(after_length)) + after_length


def _produce_v3(topic: str, partition: int, records: bytes, corr: int = 7) -> bytes:
    frame = struct.pack(">hhi", 0, 3, corr) + struct.pack(">h", 3) + b"cli"
    frame += struct.pack(">h", -1) + struct.pack(">hi", -1, 30000)  # no transactional id, acks=all
    frame += struct.pack(">i", 1) + struct.pack(">h", len(topic)) + topic.encode()
    frame += struct.pack(">i", 1) + struct.pack(">i", partition) + struct.pack(">i", len(records)) + records
    return frame


@pytest.mark.unit
def test_parse_produce_request_reads_audit_identity_of_every_record() -> None:
    recs = [_record(0, [("audit.pid", b"p:1"), ("audit.seq", b"41")]),
            _record(1, [("other", b"x"), ("audit.pid", b"p:1"), ("audit.seq", b"42")]),
            _record(2, [])]
    version, corr, batches = parse_produce_request(_produce_v3("orders", 3, _batch(recs, producer_id=9, base_sequence=5)))
    assert (version, corr) == (3, 7)
    assert len(batches) == 1
    b = batches[0]
    assert (b.topic, b.partition, b.producer_id, b.base_sequence) == ("orders", 3, 9, 5)
    assert b.records == (WireRecord(0, "p:1", 41), WireRecord(1, "p:1", 42), WireRecord(2, None, None))


@pytest.mark.unit
def test_compressed_batches_are_recognised_but_not_parsed() -> None:
    batches = parse_record_batches("t", 0, _batch([_record(0, [])], attributes=1) + _batch([_record(0, [])]))
    assert [b.records is None for b in batches] == [True, False]


@pytest.mark.unit
def test_parse_produce_response_v7() -> None:
    body = struct.pack(">i", 11) + struct.pack(">i", 1) + struct.pack(">h", 1) + b"t"
    body += struct.pack(">i", 2)
    body += struct.pack(">ihqqq", 0, 0, 100, -1, 0) + struct.pack(">ihqqq", 1, 6, -1, -1, -1)
    body += struct.pack(">i", 0)  # throttle
    assert parse_produce_response(body, 7) == [WirePartitionResult("t", 0, 0, 100), WirePartitionResult("t", 1, 6, -1)]


@pytest.mark.unit
def test_a_refused_request_is_answered_with_its_error_for_each_partition() -> None:
    from audit.lab.proxy import WireBatch, produce_error_response

    batches = (WireBatch("t", 0, -1, -1, ()), WireBatch("t", 2, -1, -1, ()), WireBatch("u", 1, -1, -1, ()))
    expected = [WirePartitionResult("t", 0, 6, -1), WirePartitionResult("t", 2, 6, -1),
                WirePartitionResult("u", 1, 6, -1)]
    assert produce_error_response(11, 7, batches, 6) == (
        struct.pack(">i", 11) + struct.pack(">i", 2) + struct.pack(">h", 1) + b"t" + struct.pack(">i", 2)
        + struct.pack(">ihqqq", 0, 6, -1, -1, -1) + struct.pack(">ihqqq", 2, 6, -1, -1, -1)
        + struct.pack(">h", 1) + b"u" + struct.pack(">i", 1) + struct.pack(">ihqqq", 1, 6, -1, -1, -1)
        + struct.pack(">i", 0))
    for version in (3, 7, 8, 9, 12):  # v8 adds record errors, v9 is flexible
        assert parse_produce_response(produce_error_response(11, version, batches, 6), version) == expected
    with pytest.raises(ValueError, match="cannot answer Produce v13"):
        produce_error_response(11, 13, batches, 6)


@pytest.mark.unit
def test_truncated_frame_is_an_error_not_a_guess() -> None:
    frame = _produce_v3("t", 0, _batch([_record(0, [("audit.seq", b"1")])]))
    with pytest.raises(ValueError):
        parse_produce_request(frame[:-3])


# -- against a real broker ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    broker = ProxiedBroker(tmp_path_factory.mktemp("proxied-kafka"))
    with broker as lab:
        yield lab


def _producer(lab: Lab, **conf: Any) -> Any:
    from confluent_kafka import Producer

    return Producer({"bootstrap.servers": lab.bootstrap, "acks": "all", "linger.ms": 0,
                     "retry.backoff.ms": 50, "log_level": 0, **conf})


def _read_all(lab: Lab, topic: str, expected: int) -> list[tuple[int, bytes]]:
    from confluent_kafka import Consumer, TopicPartition

    c = Consumer({"bootstrap.servers": lab.bootstrap, "group.id": f"read-{topic}", "enable.auto.commit": False,
                  "enable.partition.eof": True})
    c.assign([TopicPartition(topic, 0, 0)])
    out: list[tuple[int, bytes]] = []
    deadline = time.monotonic() + 20
    try:
        while time.monotonic() < deadline:
            m = c.poll(0.5)
            if m is None:
                continue
            if m.error():
                if len(out) >= expected:
                    break
                continue
            out.append((int(m.offset() or 0), bytes(m.value() or b"")))
    finally:
        c.close()
    return out


def _produce_one(p: Any, topic: str, value: bytes, seq: int) -> tuple[Any, int]:
    reports: list[tuple[Any, int]] = []
    p.produce(topic, value, headers=[("audit.pid", b"lab:1"), ("audit.seq", str(seq).encode())],
              on_delivery=lambda err, msg: reports.append((err, msg.offset())))
    assert p.flush(30) == 0
    assert len(reports) == 1
    return reports[0]


@pytest.mark.kafka
def test_dropped_response_makes_a_plain_producer_write_twice(lab: Lab) -> None:
    assert lab.proxy is not None
    topic = lab.create_topic("proxy-drop")
    p = _producer(lab, **{"enable.idempotence": False})
    assert _produce_one(p, topic, b"first", 0) == (None, 0)
    lab.proxy.drop_produce_responses(1)
    assert _produce_one(p, topic, b"second", 1) == (None, 2)  # the client only knows the retry's offset
    assert lab.proxy.armed == 0
    assert _read_all(lab, topic, 3) == [(0, b"first"), (1, b"second"), (2, b"second")]
    ex = lab.proxy.exchanges(topic)
    assert [(e.fate, e.messages(), [(r.error_code, r.base_offset) for r in e.results]) for e in ex] == [
        ("forwarded", [(topic, 0, "lab:1", 0)], [(0, 0)]),
        ("response_dropped", [(topic, 0, "lab:1", 1)], [(0, 1)]),  # written, answer lost
        ("forwarded", [(topic, 0, "lab:1", 1)], [(0, 2)]),  # the retry, written again
    ]


@pytest.mark.kafka
def test_dropped_response_is_deduplicated_by_the_idempotent_producer(lab: Lab) -> None:
    assert lab.proxy is not None
    topic = lab.create_topic("proxy-idem")
    p = _producer(lab, **{"enable.idempotence": True})
    assert _produce_one(p, topic, b"first", 0) == (None, 0)
    lab.proxy.drop_produce_responses(1)
    assert _produce_one(p, topic, b"second", 1) == (None, 1)
    assert _read_all(lab, topic, 2) == [(0, b"first"), (1, b"second")]
    ex = lab.proxy.exchanges(topic)
    assert [e.fate for e in ex] == ["forwarded", "response_dropped", "forwarded"]
    # The broker answered the retry with the first write's offset: no second copy.
    assert [r.base_offset for r in ex[2].results] == [1]


@pytest.mark.kafka
def test_failed_in_flight_request_is_retried_behind_later_batches(lab: Lab) -> None:
    assert lab.proxy is not None
    topic = lab.create_topic("proxy-reorder")
    p = _producer(lab, **{"enable.idempotence": False, "max.in.flight": 5, "linger.ms": 20})
    assert _produce_one(p, topic, b"warm", 0) == (None, 0)
    before = len(lab.proxy.exchanges(topic))
    lab.proxy.fail_next_produce_request(after_responses=1)
    for i in range(3):
        p.produce(topic, f"A{i}".encode())
    assert lab.proxy.wait_until(lambda: len(lab.proxy.exchanges(topic)) > before, 10)  # type: ignore[union-attr]
    for i in range(3):
        p.produce(topic, f"B{i}".encode())
    assert p.flush(30) == 0
    assert [v for _, v in _read_all(lab, topic, 7)] == [b"warm", b"B0", b"B1", b"B2", b"A0", b"A1", b"A2"]
    assert [e.fate for e in lab.proxy.exchanges(topic)] == ["forwarded", "request_failed", "forwarded", "forwarded"]


@pytest.mark.kafka
def test_delayed_response_arrives_late_but_once(lab: Lab) -> None:
    assert lab.proxy is not None
    topic = lab.create_topic("proxy-delay")
    p = _producer(lab, **{"enable.idempotence": False})
    lab.proxy.delay_produce_responses(700, 1)
    t0 = time.monotonic()
    assert _produce_one(p, topic, b"late", 0) == (None, 0)
    assert time.monotonic() - t0 >= 0.7
    assert _read_all(lab, topic, 1) == [(0, b"late")]
    assert [e.fate for e in lab.proxy.exchanges(topic)] == ["delayed"]


@pytest.mark.kafka
def test_kcat_first_request_resent_by_librdkafka_is_explained_as_the_sessions_first_messages(
        lab: Lab, libmsgaudit: Path, tmp_path: Path) -> None:
    """A new user's kcat with the plugin: keyless lines from stdin, idempotence off (kcat's
    default), the first lines read before kcat knows the topic's partitions. The session's first
    request is refused with NOT_LEADER_OR_FOLLOWER once a later batch has been written, as a
    topic created moments before refuses it (librdkafka's debug log showed that refusal behind a
    real run's reordering; the proxy makes it certain here, on the one partition it concerns),
    and librdkafka re-sends it by itself. kcat reports nothing, every ledger row is `acked`, yet
    the log holds the session's first messages after later ones: `reordered_in_log`, whose
    explanation names the client's own retry of its first requests, not a failed send."""
    from audit.core.explain import producer_lines
    from audit.oracle import Narrow, reordered_in_log
    from tests.test_producer import ledger_rows

    assert lab.proxy is not None
    exe = shutil.which("kcat")
    if exe is None:
        pytest.fail("kcat is not installed (Debian: apt-get install -y kcat; ./dev test installs it)")
    topic = lab.create_topic("kcat-first")
    spool = tmp_path / "producer"
    spool.mkdir()
    lab.proxy.refuse_next_produce_request(NOT_LEADER_OR_FOLLOWER, after_responses=1)
    kcat = subprocess.Popen([exe, "-X", f"plugin.library.paths={libmsgaudit}", "-X", f"msgaudit.ledger.dir={spool}",
                             "-X", "msgaudit.producer.name=kcat-new-user", "-b", lab.bootstrap, "-P", "-t", topic],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert kcat.stdin is not None
    # kcat reads stdin in blocks: its first request holds what it could read of the first lines.
    total, lines = 1500, [f"line-{i}\n" for i in range(1500)]
    kcat.stdin.write("".join(lines[:300]))
    kcat.stdin.flush()
    assert lab.proxy.wait_until(lambda: bool(lab.proxy.exchanges(topic)), 20)  # type: ignore[union-attr]
    _, err = kcat.communicate("".join(lines[300:]), timeout=60)
    assert kcat.returncode == 0, err
    assert "msgaudit" not in err

    failed = [e for e in lab.proxy.exchanges(topic) if e.fate == "refused"]
    assert len(failed) == 1 and failed[0] is lab.proxy.exchanges(topic)[0]  # the session's first request
    assert [r.error_code for r in failed[0].results] == [NOT_LEADER_OR_FOLLOWER]
    resent = sorted(s for _, _, _, s in failed[0].messages() if s is not None)
    assert resent[0] == 0 and resent == list(range(len(resent)))

    rows = ledger_rows(spool)
    assert len(rows) == total and {r["status"] for r in rows} == {"acked"}  # no send failed
    narrow = [Narrow(r["pid"], r["seq"], True, r["partition"], r["offset"], None, None, True) for r in rows]
    reordered = list(reordered_in_log(narrow))
    assert sorted(n.seq for n, _ in reordered) == resent  # the re-sent request's messages, and only they
    assert {n.partition for n, _ in reordered} == {0}
    late = [{"stage": "log", "anomaly": "reordered_in_log", "pid": n.pid, "seq": n.seq} for n, _ in reordered]

    settings = [json.loads(f.read_text()) for f in (tmp_path / "producer_settings").iterdir()]
    assert [(s["enable_idempotence"], s["max_in_flight"]) for s in settings] == [(False, 1000000)]
    s = settings[0]
    assert producer_lines(late, settings) == [
        f"reordered_in_log ({len(resent)} row{'' if len(resent) == 1 else 's'}): producer kcat-new-user (session {s['pid']}) ran with "
        f"enable.idempotence=false (retries={s['retries']}, max.in.flight=1000000) and the reordered messages are "
        f"among its first (seqs 0..{resent[-1]}): the client re-sent its first requests by itself, after "
        "later batches in flight had succeeded (a retriable error: typically NOT_LEADER_OR_FOLLOWER from a topic "
        "created moments before the producer started, whose partition leaders were not ready yet, or a broken "
        "connection); such retries leave no failed send in the ledger: set enable.idempotence=true (or "
        "max.in.flight.requests.per.connection=1), and create topics before their producers start"]
