"""The ledger shipper: spool segments -> ledger topic, keyed by row identity, with markers and re-shipping.

A scripted in-memory producer stands in for librdkafka here (what it acknowledges, fails or refuses
is the point of each test); tests/test_ingest_topic.py and tests/test_fleet.py ship to real brokers.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException

from audit.clients.ledger import LedgerWriter, sealed_segments
from audit.clients.ledger_ship import (
    LedgerShipper,
    TransactionShipped,
    is_shipped,
    row_key,
    ship_spool,
    stem_of,
    txn_key,
)
from audit.core import config as config_mod
from audit.core.errors import BrokerError, ConfigError

pytestmark = pytest.mark.unit


class _Msg:
    def __init__(self, topic: str) -> None:
        self._topic = topic

    def topic(self) -> str:
        return self._topic


class FakeProducer:
    """Records produced (topic, key, value); acknowledges on poll/flush. `mode`: 'ok' acknowledges,
    'fail' reports a delivery error, 'full' raises BufferError at produce (queue full), 'down'
    also makes list_topics fail."""

    def __init__(self, conf: dict[str, Any] | None = None) -> None:
        self.conf = conf or {}
        self.mode = "ok"
        self.pending: list[tuple[Any, str]] = []
        self.log: list[tuple[str, str, str]] = []  # delivered (topic, key, value)

    def produce(self, topic: str, value: bytes, key: bytes, on_delivery: Any) -> None:
        if self.mode == "full":
            raise BufferError("queue full")
        self.pending.append((on_delivery, topic))
        if self.mode == "ok":
            self.log.append((topic, key.decode(), value.decode()))

    def poll(self, timeout: float = 0) -> int:
        pending, self.pending = self.pending, []
        for cb, topic in pending:
            err = None if self.mode == "ok" else KafkaError(KafkaError._MSG_TIMED_OUT)
            cb(err, _Msg(topic))
        return len(pending)

    def flush(self, timeout: float = 0) -> int:
        self.poll()
        return 0

    def list_topics(self, topic: str, timeout: float = 0) -> None:
        if self.mode != "ok":
            raise KafkaException(KafkaError(KafkaError._TRANSPORT))


def _wait(cond: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached")
        time.sleep(0.02)


def _rows(n: int, start: int = 0) -> list[dict[str, Any]]:
    return [{"pid": "p1", "seq": i, "topic": "orders", "status": "acked", "produce_ts": 1_700_000_000_000 + i}
            for i in range(start, start + n)]


def _shipper(fake: FakeProducer, kind: str = "producer", retry_s: float = 0.05) -> LedgerShipper:
    return LedgerShipper({"bootstrap.servers": "x:1"}, "ledger", kind, retry_interval_s=retry_s,
                         producer_factory=lambda conf: fake)


def _expected(segment: Path, kind: str = "producer") -> list[tuple[str, str, str]]:
    lines = segment.read_text().splitlines()
    return [("ledger", row_key(kind, segment, i).decode(), line) for i, line in enumerate(lines)]


def test_every_row_is_shipped_with_its_segment_and_line_as_key_and_the_segment_is_marked(tmp_path: Path) -> None:
    fake = FakeProducer()
    shipper = _shipper(fake)
    with LedgerWriter(tmp_path, "producer", max_bytes=300, observer=shipper) as w:
        for i in range(0, 12, 4):
            w.extend(_rows(4, start=i))
            w.flush()
    shipper.close(5)
    segs = sealed_segments(tmp_path)
    assert len(segs) > 1  # rotation: keys restart at line 0 in each segment
    expected = [e for s in segs for e in _expected(s)]
    assert sorted(fake.log) == sorted(expected) and len(fake.log) == 12
    assert {json.loads(v)["seq"] for _, _, v in fake.log} == set(range(12))
    assert all(is_shipped(s) for s in segs)
    assert shipper.stats.shipped == 12 and shipper.stats.not_shipped_live == 0


def test_rows_the_topic_did_not_take_are_reshipped_from_the_spool_with_the_same_keys(tmp_path: Path) -> None:
    fake = FakeProducer()
    shipper = _shipper(fake)
    w = LedgerWriter(tmp_path, "producer", observer=shipper)
    w.extend(_rows(3))
    w.flush()
    _wait(lambda: len(fake.log) == 3)  # shipped live
    fake.mode = "fail"  # the topic goes down: the next rows time out
    w.extend(_rows(4, start=3))
    w.close()
    seg = sealed_segments(tmp_path)[0]
    _wait(lambda: shipper.stats.not_shipped_live >= 4)
    assert not is_shipped(seg)
    time.sleep(0.3)  # retries while down queue nothing: list_topics fails first
    assert len(fake.log) == 3
    fake.mode = "ok"  # back: the whole segment goes again, rows 0-2 a second time under the same keys
    _wait(lambda: is_shipped(seg))
    shipper.close(5)
    assert fake.log[3:] == _expected(seg)
    assert fake.log[:3] == _expected(seg)[:3]
    assert shipper.stats.reshipped_segments == 1


def test_a_full_queue_never_blocks_the_writer_and_the_segment_is_shipped_later(tmp_path: Path) -> None:
    fake = FakeProducer()
    fake.mode = "full"
    shipper = _shipper(fake, retry_s=3600)  # no retry inside the client: left for `msgaudit ship`
    t0 = time.monotonic()
    with LedgerWriter(tmp_path, "producer", observer=shipper) as w:
        w.extend(_rows(50))
    assert time.monotonic() - t0 < 5
    shipper.close(0.5)
    seg = sealed_segments(tmp_path)[0]
    assert not is_shipped(seg) and fake.log == [] and shipper.unshipped() == [seg]
    assert len(seg.read_text().splitlines()) == 50  # the spool has every row
    fake.mode = "ok"
    result = ship_spool(tmp_path.parent / "x", {"bootstrap.servers": "x:1"}, "ledger",
                        producer_factory=lambda conf: fake)
    assert result.segments == 0  # wrong ledger_dir: nothing there
    spool = tmp_path.parent / "spool"
    (spool / "producer").mkdir(parents=True)
    os.rename(seg, spool / "producer" / seg.name)
    result = ship_spool(spool, {"bootstrap.servers": "x:1"}, "ledger", producer_factory=lambda conf: fake)
    moved = spool / "producer" / seg.name
    assert (result.segments, result.rows, result.already, result.failed) == (1, 50, 0, 0)
    assert fake.log == _expected(moved) and is_shipped(moved)


def test_ship_spool_seals_dead_writers_skips_marked_and_transaction_segments(tmp_path: Path) -> None:
    spool = tmp_path / "ledger"
    fake = FakeProducer()
    # producer/: one segment shipped live (marked), one never shipped, one left open by a "killed" writer
    shipper = _shipper(fake)
    with LedgerWriter(spool / "producer", "producer", observer=shipper) as w:
        w.extend(_rows(2))
    shipper.close(5)
    with LedgerWriter(spool / "producer", "producer") as w:
        w.extend(_rows(3, start=2))
    dead = spool / "producer" / "producer-20261124T000000000000Z-1-deadbeef.jsonl.open"
    dead.write_text("".join(json.dumps(r) + "\n" for r in _rows(2, start=5)) + '{"pid": "p1", "se')
    # consumer/: an exactly_once_kafka consumer's spool: its rows went in transactions
    with LedgerWriter(spool / "consumer", "g-c", observer=TransactionShipped()) as w:
        w.extend([{"group": "g", "consume_seq": 0}])
    fake.log.clear()
    result = ship_spool(spool, {"bootstrap.servers": "x:1"}, "ledger", producer_factory=lambda conf: fake)
    assert (result.segments, result.rows, result.already, result.recovered, result.failed) == (2, 5, 2, 1, 0)
    sealed = sealed_segments(spool / "producer")
    assert all(is_shipped(s) for s in sealed) and all(is_shipped(s) for s in sealed_segments(spool / "consumer"))
    recovered = spool / "producer" / (stem_of(dead) + ".jsonl")
    assert [k for _, k, _ in fake.log if k.startswith(f"producer/{stem_of(dead)}:")] == [
        f"producer/{stem_of(dead)}:0", f"producer/{stem_of(dead)}:1"]  # the unfinished line is cut, not shipped
    assert recovered.exists()
    again = ship_spool(spool, {"bootstrap.servers": "x:1"}, "ledger", producer_factory=lambda conf: fake)
    assert (again.segments, again.already) == (0, 4)


def test_ship_spool_reports_segments_it_could_not_ship(tmp_path: Path) -> None:
    with LedgerWriter(tmp_path / "producer", "producer") as w:
        w.extend(_rows(2))
    fake = FakeProducer()
    fake.mode = "fail"
    with pytest.raises(BrokerError, match="1 segments could not be shipped"):
        ship_spool(tmp_path, {"bootstrap.servers": "x:1"}, "ledger", timeout=1, producer_factory=lambda conf: fake)
    assert not any(is_shipped(s) for s in sealed_segments(tmp_path / "producer"))


def test_keys_name_the_ledger_and_the_row() -> None:
    assert row_key("consumer", Path("/s/g-c-20261124T000000000001Z-7-0a0b0c0d.jsonl.open"), 41) == \
        b"consumer/g-c-20261124T000000000001Z-7-0a0b0c0d:41"
    assert txn_key("loader:ab12", 9) == b"consumer/txn:loader:ab12:9"


def test_ledger_config_defaults_to_the_data_cluster_or_names_its_own(tmp_path: Path) -> None:
    base = {"kafka": {"bootstrap.servers": "data:9092", "security.protocol": "SASL_SSL"}}
    same = config_mod.from_dict({**base, "ledger": {"topic": "msgaudit.ledger"}}, base=tmp_path)
    assert same.ledger_topic == "msgaudit.ledger"
    assert same.ledger is not None and dict(same.ledger.kafka) == base["kafka"]
    other = config_mod.from_dict({**base, "ledger": {"topic": "l", "kafka": {"bootstrap.servers": "ledger:9092",
                                                                              "message.timeout.ms": 5000}}},
                                 base=tmp_path)
    assert other.ledger is not None and dict(other.ledger.kafka) == {"bootstrap.servers": "ledger:9092",
                                                                     "message.timeout.ms": "5000"}
    assert config_mod.from_dict({}, base=tmp_path).ledger is None
    with pytest.raises(ConfigError, match=r"ledger\.topic"):
        config_mod.from_dict({"ledger": {"kafka": {}}}, base=tmp_path)
    with pytest.raises(ConfigError, match="ledger"):
        config_mod.from_dict({"ledger": {"topic": "l", "cluster": "x"}}, base=tmp_path)
