"""Shipping ledger rows from a host's spool to the ledger topic (docs/design.md §4.2, "Ledger transport").

The local segment files (audit.clients.ledger) are the spool: a row is on disk before it is
shipped, and what the topic could not take is shipped again later from the files, so an outage
of the ledger topic loses nothing.

Row identity. Every shipped row is one Kafka record whose key names the row:

    <kind>/<segment stem>:<line number>     kind = producer | consumer | producer_settings (the spool subfolder)
    consumer/txn:<consumer instance>:<consume_seq>   exactly_once_kafka rows sent in the transaction
    producer/txn:<pid>:<topic>:<seq>                 its output producer's rows, sent in the same transaction

and whose value is the row's JSON line, unchanged. A segment's name never changes (sealing and
orphan recovery only rename `.jsonl.open` to `.jsonl`; recovery cuts only an unfinished last
line, which was never shipped), so a row shipped twice - live and again from the spool - has the
same key, and `msgaudit ingest` lands it once (spark_jobs/ingest_topic.py).

Markers. When every line of a sealed segment is acknowledged by the topic, the shipper writes
`<segment stem>.shipped` beside it. A segment without a marker is shipped again, whole, by the
client itself once the topic is back (every `retry_interval_s`), and by `msgaudit ship`
(`ship_spool`: a host's whole spool, including segments of killed processes, which it seals
first). Segments whose rows went to the topic inside a Kafka transaction get their marker when
they are opened (`TransactionShipped`): nothing in them is shipped from the spool.

Nothing here may block the ledger writer: a row the producer cannot queue marks its segment for
re-shipping instead of waiting.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from confluent_kafka import KafkaError, KafkaException, Message, Producer

from audit.clients.ledger import OPEN_SUFFIX, SEALED_SUFFIX, recover_orphans, sealed_segments
from audit.core.errors import BrokerError, ConfigError
from audit.core.kafka_conf import access_line, internal_client_conf

log = logging.getLogger(__name__)

KINDS = ("producer", "consumer", "producer_settings")  # spool subfolders = ingest's ledger sources
SHIPPED_SUFFIX = ".shipped"
TXN_PREFIX = "txn:"

# Shipper producer defaults: every acknowledged row is on all in-sync replicas; a row that cannot
# be delivered within two minutes fails and its segment is shipped again later from the spool.
# Idempotence is off: duplicates are harmless (the key identifies the row) and an idempotent
# producer can turn a long outage into a fatal error.
SHIPPER_DEFAULTS: Mapping[str, Any] = {"acks": "all", "enable.idempotence": False, "linger.ms": 20,
                                       "message.timeout.ms": 120_000, "compression.type": "lz4"}


def stem_of(segment: Path) -> str:
    name = segment.name
    for suffix in (OPEN_SUFFIX, SEALED_SUFFIX):
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def row_key(kind: str, segment: Path | str, line: int) -> bytes:
    """The Kafka key (= identity) of line `line` (from 0) of a spool segment."""
    stem = segment if isinstance(segment, str) else stem_of(segment)
    return f"{kind}/{stem}:{line}".encode()


def txn_key(consumer_instance: str, consume_seq: int) -> bytes:
    """The key of an exactly_once_kafka consumption row sent inside the consumer's transaction."""
    return f"consumer/{TXN_PREFIX}{consumer_instance}:{consume_seq}".encode()


def producer_txn_key(pid: str, topic: str, seq: int) -> bytes:
    """The key of a transactional producer's ledger row sent inside its transaction (the output
    producer of an exactly_once_kafka consumer): a message is (pid, topic, seq)."""
    return f"producer/{TXN_PREFIX}{pid}:{topic}:{seq}".encode()


def marker(segment: Path) -> Path:
    return segment.with_name(stem_of(segment) + SHIPPED_SUFFIX)


def is_shipped(segment: Path) -> bool:
    return marker(segment).exists()


def _write_marker(segment: Path) -> None:
    fd = os.open(marker(segment), os.O_WRONLY | os.O_CREAT, 0o644)
    os.close(fd)


_CONNECTION_PREFIXES = ("bootstrap.", "security.", "sasl.", "ssl.", "socket.", "client.dns", "broker.")


def connection_settings(kafka: Mapping[str, Any]) -> dict[str, Any]:
    """Only how to reach and authenticate to a cluster, from a client's settings (the shipper
    keeps its own delivery settings rather than, say, a data producer's idempotence)."""
    return {k: v for k, v in kafka.items() if k.startswith(_CONNECTION_PREFIXES)}


def shipper_conf(kafka: Mapping[str, Any]) -> dict[str, Any]:
    conf = internal_client_conf({**SHIPPER_DEFAULTS,
                                 **{k: v for k, v in kafka.items() if k not in ("transactional.id", "group.id")}})
    if "bootstrap.servers" not in conf:
        raise ConfigError("ledger topic: no 'bootstrap.servers' in the ledger's kafka settings")
    return conf


@dataclass
class _Segment:
    path: Path  # sealed path (also the path-to-be while open)
    handed: int = 0  # lines produced
    delivered: int = 0  # lines acknowledged
    dirty: bool = False  # a line could not be produced or was not delivered
    rows: int | None = None  # set when sealed


@dataclass
class ShipperStats:
    shipped: int = 0  # rows acknowledged by the topic (live and re-shipped)
    not_shipped_live: int = 0  # rows the live path could not ship (their segment is re-shipped)
    segments_marked: int = 0
    reshipped_segments: int = 0
    errors: list[str] = field(default_factory=list)


class LedgerShipper:
    """A SegmentObserver that ships one spool folder's rows to the ledger topic as they are written.

    `kind` is `producer` or `consumer`. The producer runs on its own thread (poll + re-shipping of
    this writer's segments that missed rows); `close()` waits up to `timeout` for what is in flight;
    what is still unshipped then stays in the spool (no marker) for `msgaudit ship`.
    """

    def __init__(self, kafka: Mapping[str, Any], topic: str, kind: str, *, retry_interval_s: float = 5.0,
                 producer_factory: Callable[[dict[str, Any]], Any] = Producer) -> None:
        if kind not in KINDS:
            raise ConfigError(f"ledger shipper kind: expected one of {KINDS}, got {kind!r}")
        self.topic = topic
        self.kind = kind
        self.retry_interval_s = retry_interval_s
        self._kafka = dict(kafka)
        try:
            self.producer = producer_factory(shipper_conf(kafka))
        except KafkaException as e:
            raise ConfigError(f"ledger topic {topic}: librdkafka rejected the settings: {e}") from e
        self.stats = ShipperStats()
        self._lock = threading.Lock()
        self._segments: dict[str, _Segment] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"ledger-ship-{kind}", daemon=True)
        self._thread.start()

    # -- SegmentObserver (writer thread) ---------------------------------------------------------
    def opened(self, segment: Path) -> None:
        with self._lock:
            self._segments[stem_of(segment)] = _Segment(segment)

    def lines(self, segment: Path, first_line: int, lines: list[str]) -> None:
        stem = stem_of(segment)
        with self._lock:
            seg = self._segments.setdefault(stem, _Segment(segment))
            if seg.dirty:
                self.stats.not_shipped_live += len(lines)
                return  # the whole segment is shipped again from the file
        produced = 0
        for i, line in enumerate(lines):
            try:
                self.producer.produce(self.topic, line.encode(), row_key(self.kind, stem, first_line + i),
                                      on_delivery=partial(self._delivered, stem))
                produced += 1
            except (BufferError, KafkaException) as e:
                with self._lock:
                    seg.dirty = True
                    self.stats.not_shipped_live += len(lines) - i
                log.warning("ledger topic %s: %d rows of %s left for re-shipping (%s)", self.topic,
                            len(lines) - i, segment.name, e)
                break
        with self._lock:
            seg.handed += produced
        self.producer.poll(0)

    def sealed(self, segment: Path, rows: int) -> None:
        with self._lock:
            seg = self._segments.setdefault(stem_of(segment), _Segment(segment, dirty=True))
            seg.path = segment
            seg.rows = rows
            self._settle(seg)

    # -- delivery reports (shipper thread) -------------------------------------------------------
    def _delivered(self, stem: str, err: KafkaError | None, msg: Message) -> None:
        with self._lock:
            seg = self._segments.get(stem)
            if seg is None:
                return
            if err is not None:
                if not seg.dirty:
                    log.warning("ledger topic %s did not take a row of %s (%s); the segment will be shipped "
                                "again", self.topic, stem, write_error(self._kafka, self.topic, err))
                seg.dirty = True
                self.stats.not_shipped_live += 1
            else:
                seg.delivered += 1
                self.stats.shipped += 1
            self._settle(seg)

    def _settle(self, seg: _Segment) -> None:
        """Under the lock: mark a sealed segment whose every line is acknowledged."""
        if seg.rows is not None and not seg.dirty and seg.delivered == seg.rows:
            try:
                _write_marker(seg.path)
                self.stats.segments_marked += 1
            except OSError as e:
                log.error("ledger shipper: cannot write the marker of %s: %s", seg.path, e)
            self._segments.pop(stem_of(seg.path), None)

    def _run(self) -> None:
        next_retry = time.monotonic() + self.retry_interval_s
        backoff = self.retry_interval_s
        while not self._stop.is_set():
            try:
                self.producer.poll(0.2)
                if time.monotonic() >= next_retry:
                    done = self._reship_dirty(timeout=30.0)
                    # While the topic is down, try less often (each try queues whole segments).
                    backoff = self.retry_interval_s if done else min(backoff * 2, 120.0)
                    next_retry = time.monotonic() + backoff
            except Exception as e:  # noqa: BLE001 - the shipper must outlive any one failure
                log.error("ledger shipper for %s: %s", self.topic, e)
                self._stop.wait(1.0)

    def _reship_dirty(self, timeout: float) -> bool:
        """Ship again, from the files, this writer's sealed segments that missed rows. False when
        the topic is not reachable (nothing was queued then)."""
        with self._lock:
            todo = [s for s in self._segments.values() if s.dirty and s.rows is not None]
        if not todo:
            return True
        try:
            self.producer.list_topics(self.topic, timeout=min(timeout, 5.0))
        except KafkaException:
            return False
        for seg in todo:
            if self._stop.is_set():
                return True
            ok, rows = ship_segment(self.producer, self.topic, self.kind, seg.path, timeout=timeout, kafka=self._kafka)
            if not ok:
                return False
            with self._lock:
                self._segments.pop(stem_of(seg.path), None)
                self.stats.shipped += rows
                self.stats.reshipped_segments += 1
                self.stats.segments_marked += 1
        return True

    def unshipped(self) -> list[Path]:
        """Segments of this writer that are not (yet) known to be in the topic."""
        with self._lock:
            return [s.path for s in self._segments.values()]

    def close(self, timeout: float = 30.0) -> None:
        """Wait up to `timeout` for what is in flight, re-ship once what failed, and stop."""
        deadline = time.monotonic() + timeout
        with contextlib.suppress(Exception):
            self.producer.flush(max(0.0, deadline - time.monotonic()))
        self._stop.set()
        self._thread.join(timeout=max(1.0, deadline - time.monotonic()) + 35.0)
        with contextlib.suppress(Exception):
            self._reship_dirty(timeout=max(1.0, deadline - time.monotonic()))
        left = self.unshipped()
        if left:
            log.warning("ledger topic %s: %d segments not shipped yet; `msgaudit ship` ships them from %s",
                        self.topic, len(left), left[0].parent)


class TransactionShipped:
    """SegmentObserver of a spool whose rows reach the ledger topic inside Kafka transactions
    (exactly_once_kafka): each segment is marked shipped as soon as it exists, so neither the client
    nor `msgaudit ship` sends its rows a second time under another identity."""

    def opened(self, segment: Path) -> None:
        _write_marker(segment)

    def lines(self, segment: Path, first_line: int, lines: list[str]) -> None:
        return None

    def sealed(self, segment: Path, rows: int) -> None:
        return None


# -- shipping whole segments from the spool -----------------------------------------------------

def write_error(kafka: Mapping[str, Any], topic: str, err: KafkaError) -> str:
    """A delivery error to the ledger topic, as one line (an ACL denial names the grant it needs)."""
    return access_line(kafka, err.name(), {"topic": "WRITE", "cluster": "IDEMPOTENT_WRITE"},
                       {"topic": topic}) or err.str()


def ship_segment(producer: Any, topic: str, kind: str, segment: Path, *, timeout: float = 30.0,
                 kafka: Mapping[str, Any] | None = None, failures: list[str] | None = None) -> tuple[bool, int]:
    """Ship every line of a sealed segment (keys by line number), wait for the acknowledgements, and
    write its marker when all of them arrived. Returns (shipped, rows). `kafka`: the producer's
    settings, to name the user in an ACL denial; `failures` gets why a segment was not shipped."""
    stem = stem_of(segment)
    errors: list[str] = []

    def report(err: KafkaError | None, msg: Message) -> None:
        if err is not None:
            errors.append(write_error(kafka or {}, topic, err))

    deadline = time.monotonic() + timeout
    rows = 0
    with open(segment, "rb") as f:
        for n, raw in enumerate(f):
            line = raw.rstrip(b"\n")
            while True:
                try:
                    producer.produce(topic, line, row_key(kind, stem, n), on_delivery=report)
                    break
                except BufferError:
                    if time.monotonic() > deadline:
                        return False, rows
                    producer.poll(0.1)
            rows += 1
    left = producer.flush(max(0.0, deadline - time.monotonic()))
    if left or errors:
        why = errors[0] if errors else f"{left} rows still in flight"
        log.warning("ledger topic %s: %s not shipped (%s)", topic, segment.name, why)
        if failures is not None:
            failures.append(why)
        return False, rows
    _write_marker(segment)
    return True, rows


@dataclass(frozen=True)
class ShipResult:
    segments: int  # segments shipped now
    rows: int
    already: int  # segments that had their marker
    failed: int  # segments that could not be shipped (they stay unmarked)
    recovered: int  # `.open` segments of dead writers sealed first

    def summary(self, topic: str) -> str:
        return (f"ship: {self.rows} rows from {self.segments} segments to {topic}"
                f" ({self.already} already shipped, {self.recovered} recovered from dead writers,"
                f" {self.failed} failed)")


def ship_spool(ledger_dir: Path, kafka: Mapping[str, Any], topic: str, *, timeout: float = 60.0,
               progress: Callable[[str], None] | None = None,
               producer_factory: Callable[[dict[str, Any]], Any] = Producer) -> ShipResult:
    """`msgaudit ship`: seal the segments of dead writers and ship every sealed segment without a
    marker, from `<ledger_dir>/producer`, `/consumer` and `/producer_settings` (one-line files
    a producer writes at start; only this command ships them). Raises BrokerError when some
    segment could not be shipped (run it again when the topic is back: what was shipped is marked)."""
    producer = producer_factory(shipper_conf(kafka))
    shipped = rows = already = failed = recovered = 0
    why: list[str] = []
    try:
        for kind in KINDS:
            folder = Path(ledger_dir) / kind
            recovered += recover_orphans(folder)
            for seg in sealed_segments(folder):
                if is_shipped(seg):
                    already += 1
                    continue
                ok, n = ship_segment(producer, topic, kind, seg, timeout=timeout, kafka=kafka, failures=why)
                if ok:
                    shipped += 1
                    rows += n
                    if progress is not None:
                        progress(f"ship {kind}/{seg.name}: {n} rows")
                else:
                    failed += 1
                    if failed == 1:
                        # The topic is not taking rows: do not wait `timeout` for every segment.
                        timeout = min(timeout, 5.0)
    finally:
        producer.flush(5.0)
    result = ShipResult(shipped, rows, already, failed, recovered)
    if failed:
        raise BrokerError(f"ledger topic {topic}: {failed} segments could not be shipped ({why[0]}; "
                          f"{result.summary(topic)}); they stay in the spool unmarked - run `msgaudit ship` again "
                          "when the topic is reachable")
    return result


__all__ = ["KINDS", "LedgerShipper", "TransactionShipped", "ShipResult", "ship_segment", "ship_spool",
           "row_key", "txn_key", "producer_txn_key", "marker", "is_shipped", "stem_of"]
