"""`AuditedConsumer`: a processing loop around `confluent_kafka.Consumer` with explicit delivery
semantics, retries and dead letters, and a consumption ledger (docs/design.md §4 `consumed_records`).

Semantics (`semantics=`), per batch of polled records:

- `at_most_once`: commit the batch's offsets, then process. A crash after the commit loses the
  batch (the group stage reports it `missed`).
- `at_least_once` (default): process, write the sink, make the ledger rows durable, then commit.
  A crash before the commit redelivers the batch (`redelivered`; `duplicate_in_sink` with a
  plain-insert sink, none with an upsert sink).
- `exactly_once_kafka`: consume-transform-produce in one Kafka transaction per batch: the
  handler produces through `consumer.producer` (a transactional `AuditedProducer`), the input
  offsets go in with `send_offsets_to_transaction`, the input is read `read_committed`. A crash
  inside the transaction aborts it; the rerun (same `name`, so the same transactional.id fences
  the dead instance) redoes the batch. A handler that raises should do so before it produces:
  outputs produced before the exception stay in the (committed) transaction while the record
  goes to the retry topic.
- `exactly_once_sink`: the batch's rows and the consumer's next offsets are written in one sink
  transaction (`Sink.write(..., positions=...)`); on partition assignment the positions are read
  back from the sink (`Sink.read_positions`) and the consumer seeks there. Kafka offsets are
  committed too, after the sink commit, but only so that lag tools and capture see progress.

Rebalances: records are handled synchronously between polls, so when a revoke arrives the
batch is complete; the revoke commits whatever was processed but not yet committed, the assign
restores positions (exactly_once_sink) and resets retry state.

Retries and dead letters (`retry=RetryPolicy(...)`): a handler exception sends a copy of the
record to the retry topic (default `<group>.retry`, created if missing) with backoff, and the
source partition moves on (a poison message never blocks it). The retry topic is consumed by
the same loop; a copy that is not due yet pauses only its retry partition. After
`max_attempts` handler attempts the copy goes to the dead-letter topic (default `<group>.dlq`).
Without a RetryPolicy a handler exception stops the loop with `HandlerFailed` after the records
before it are finished and a `failed` row is written; the failed record is redelivered on the
next run (at-least-once) — it is never dropped silently.

Headers on retry and dead-letter copies (the record's own headers, audit ones included, are
kept, so the copy is still audited as the same message (topic, pid, seq)):

    audit.src.topic       original topic
    audit.src.partition   original partition (decimal)
    audit.src.offset      original offset (decimal)
    audit.attempt         retry copy: the attempt it is for (2, 3, ...); DLQ copy: attempts made
    audit.retry.at        retry copy: epoch ms before which it is not handled (backoff)
    audit.error           the last handler error, "<ExceptionType>: <message>" (<= 1000 chars)
    audit.group           the consumer group that failed the record

Consumption ledger: one JSON row per processing outcome in `<ledger_dir>/consumer`, columns
group, consumer, consume_seq, topic, partition, offset, pid, seq, outcome {processed, failed,
dead_lettered}, attempt, consume_ts (epoch ms), error (the handler's "<ExceptionType>: <message>"
for failed and dead_lettered, else null), produce_ts (epoch ms: the message's audit.ts; absent for
an unaudited record, and not kept in the evidence a sink stores). Rows are always written against the ORIGINAL
(topic, partition, offset), so the group stage sees every source record's attempts and exactly
one final outcome; retry-topic coordinates never appear. `consumer` is the instance id
`<name>:<random>` (new per process start), `consume_seq` counts that instance's rows from 0.
The rows of a batch are durable before its Kafka commit (at_least_once). In exactly_once_sink
with a sink that stores them (`Sink.stores_consumption`: SqlSink, DeltaSink) they are written in
the sink's transaction with the rows and offsets (SqlSink: table `msgaudit_consumed_records`;
DeltaSink: the commit's userMetadata; both landed by `msgaudit ingest`), not to the ledger
files: a crash at any point leaves all three or none. In
exactly_once_kafka (and exactly_once_sink on a sink that cannot store them) they are written
after the transaction commits (a crash between those two points loses only ledger rows, never
sink rows or offsets) - except exactly_once_kafka with a ledger topic on the consumer's cluster:
there the rows are also produced to the ledger topic inside the transaction (keys
`consumer/txn:<instance>:<consume_seq>`), so the commit that makes the outputs and offsets
visible makes their evidence visible too; the spool copy written after the commit is never
shipped (audit.clients.ledger_ship.TransactionShipped). With `ledger_topic` (or cfg.ledger) the
other modes ship their spool rows to the topic (audit.clients.ledger_ship.LedgerShipper).

This module must not import pyspark or airflow, must not commit an offset before the records
below it are accounted for (except at_most_once, by definition), and never swallows a handler
error without a ledger row and a retry/DLQ copy or an exception.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, cast

from confluent_kafka import Consumer, KafkaError, KafkaException, Message, Producer, TopicPartition

from audit.clients.ledger import LedgerWriter, encode_row
from audit.clients.ledger_ship import LedgerShipper, TransactionShipped, connection_settings, txn_key
from audit.clients.sinks import Position, Sink, SinkRecord
from audit.core import headers as audit_headers
from audit.core.errors import BrokerError, ConfigError, MsgauditError
from audit.core.headers import AuditHeaders
from audit.core.kafka_conf import access_line, authentication_line
from audit.core.vocabulary import CONSUME_OUTCOMES

if TYPE_CHECKING:
    from audit.clients.producer import AuditedProducer
    from audit.core.config import Config

log = logging.getLogger(__name__)

SEMANTICS = ("at_most_once", "at_least_once", "exactly_once_kafka", "exactly_once_sink")
OUTCOMES = CONSUME_OUTCOMES

SRC_TOPIC = "audit.src.topic"
SRC_PARTITION = "audit.src.partition"
SRC_OFFSET = "audit.src.offset"
ATTEMPT = "audit.attempt"
RETRY_AT = "audit.retry.at"
ERROR = "audit.error"
GROUP = "audit.group"
RETRY_HEADERS = (SRC_TOPIC, SRC_PARTITION, SRC_OFFSET, ATTEMPT, RETRY_AT, ERROR, GROUP)
_MAX_ERROR_CHARS = 1000

# Stage names passed to `on_stage`, in loop order.
STAGES = ("committed_before_processing", "handled", "sink_txn_open", "sink_written",
          "txn_before_commit", "txn_committed", "ledger_flushed", "committed")

_REBALANCE_COMMIT_ERRORS = {
    KafkaError.REBALANCE_IN_PROGRESS, KafkaError.ILLEGAL_GENERATION, KafkaError.UNKNOWN_MEMBER_ID,
    KafkaError._NO_OFFSET, KafkaError._STATE,
}

TP = tuple[str, int]
Handler = Callable[["ConsumedRecord"], Any]
StageHook = Callable[[str, Sequence["ConsumedRecord"]], None]


class HandlerFailed(MsgauditError):
    """The handler raised and no RetryPolicy was configured; the loop stopped (see __cause__)."""


@dataclass(frozen=True)
class RetryPolicy:
    """Retry then dead-letter failing records.

    max_attempts: handler attempts in all (1 = straight to the DLQ on the first failure).
    backoff_ms * multiplier**(attempt-2), capped at max_backoff_ms, is the wait before attempt
    2, 3, ... Topics default to `<group>.retry` and `<group>.dlq` and are created (with
    `partitions` partitions) when missing.
    """

    max_attempts: int = 3
    backoff_ms: int = 1000
    multiplier: float = 2.0
    max_backoff_ms: int = 60_000
    retry_topic: str | None = None
    dlq_topic: str | None = None
    partitions: int = 1
    replication_factor: int = -1  # broker default

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ConfigError(f"RetryPolicy.max_attempts: expected >= 1, got {self.max_attempts}")
        if self.backoff_ms < 0 or self.max_backoff_ms < 0 or self.multiplier < 1:
            raise ConfigError("RetryPolicy: backoff_ms and max_backoff_ms must be >= 0 and multiplier >= 1")

    def delay_ms(self, attempt: int) -> int:
        """Wait before handler attempt `attempt` (2, 3, ...)."""
        return int(min(self.max_backoff_ms, self.backoff_ms * self.multiplier ** max(0, attempt - 2)))


@dataclass(frozen=True)
class ConsumedRecord:
    """What the handler gets. topic/partition/offset are the ORIGINAL log coordinates, also for a
    retry copy (then `message` is the copy and `attempt` > 1)."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: list[tuple[str, bytes | None]]
    timestamp_ms: int | None
    audit: AuditHeaders
    attempt: int
    message: Message = field(repr=False)

    @property
    def via(self) -> TP:
        """(topic, partition) the record was actually read from (the retry topic for a copy)."""
        return (str(self.message.topic()), int(self.message.partition() or 0))


@dataclass
class RunStats:
    processed: int = 0
    failed: int = 0
    dead_lettered: int = 0
    batches: int = 0
    rebalances: int = 0

    @property
    def handled(self) -> int:
        return self.processed + self.failed + self.dead_lettered


def _safe_prefix(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", text).lstrip(".") or "consumer"


def _msg_headers(m: Message) -> list[tuple[str, bytes | None]]:
    # librdkafka hands out headers as a list of (str, bytes | None) tuples.
    return cast(list[tuple[str, bytes | None]], list(m.headers() or []))


def _due_ms(m: Message) -> int:
    return _int_header(_msg_headers(m), RETRY_AT) or 0


def _header(headers: Sequence[tuple[str, bytes | None]], name: str) -> str | None:
    for k, v in reversed(headers):
        if k == name and v is not None:
            try:
                return v.decode("utf-8")
            except UnicodeDecodeError:
                return None
    return None


def _int_header(headers: Sequence[tuple[str, bytes | None]], name: str) -> int | None:
    text = _header(headers, name)
    return int(text) if text is not None and text.isdigit() else None


def _error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:_MAX_ERROR_CHARS]


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


def _produce_ms(rec: ConsumedRecord) -> int | None:
    """The message's produce time from its audit headers (audit.ts, epoch ms); None for an
    unaudited record. The ledger row's optional `produce_ts`."""
    return rec.audit.ts_ms if rec.audit.valid else None


def _produce_time(rec: ConsumedRecord) -> datetime | None:
    """`_produce_ms` as a time, for the sink's optional audit_produce_ts column."""
    ms = _produce_ms(rec)
    return None if ms is None else datetime(1970, 1, 1, tzinfo=UTC) + timedelta(milliseconds=ms)


def consumption_row(group: str, instance: str, consume_seq: int, rec: ConsumedRecord, outcome: str, ts: int,
                    error: str | None, cluster: str | None = None) -> dict[str, Any]:
    """One consumption ledger row (docs/design.md §4.2 `consumed_records`) of `rec`: `ts` epoch ms,
    `rec.attempt` its attempt (a share group's delivery count)."""
    row = {
        "group": group, "consumer": instance, "consume_seq": consume_seq,
        "topic": rec.topic, "partition": rec.partition, "offset": rec.offset,
        "pid": rec.audit.pid, "seq": rec.audit.seq, "outcome": outcome, "attempt": rec.attempt,
        "consume_ts": ts, "error": error,
    }
    if cluster is not None:  # optional: a row without it is from the audited cluster
        row["cluster"] = cluster
    if (produced := _produce_ms(rec)) is not None:  # optional: the message's produce time (audit.ts)
        row["produce_ts"] = produced
    return row


def consumption_ledger(root: Path, group: str, name: str, observer: Any = None) -> LedgerWriter:
    """The consumption ledger writer of one consumer instance, under `<root>/consumer`."""
    return LedgerWriter(root / "consumer", _safe_prefix(f"{group}-{name}"), max_bytes=16 << 20, max_age_s=60.0,
                        observer=observer)


class AuditedConsumer:
    """A consumer group member with explicit semantics, retries/DLQ and a consumption ledger.

    Args:
      config: librdkafka consumer settings (merged over `cfg.kafka` when `cfg` is given).
      group: the consumer group (or `group.id` in config).
      topics: source topics to subscribe to.
      semantics: one of SEMANTICS (module docstring).
      name: stable name of this consumer (ledger `consumer` prefix; the transactional.id of
        exactly_once_kafka is `msgaudit-<group>-<name>`, so give each member its own stable name).
      sink: where the handler's returned rows go (required for exactly_once_sink).
      retry: RetryPolicy, or None (a handler failure then stops the loop with HandlerFailed).
      cfg / ledger_dir: the ledger goes to `<ledger_dir>/consumer` (ledger_dir argument, else
        cfg.ledger_dir, else `.msgaudit/ledger`).
      producer_config: extra librdkafka settings for the producer (outputs, retry copies).
      ledger_topic / ledger_kafka: ship the consumption rows (and, in exactly_once_kafka, the output
        producer's rows) to this ledger topic on this cluster (default: cfg.ledger, if set; the
        cluster defaults to the consumer's). In exactly_once_kafka with the ledger topic on the
        consumer's own cluster, a batch's consumption rows go to the topic inside its transaction.
      batch_size, poll_timeout_s: records per poll and the poll wait.
      on_stage: called as on_stage(stage, records) at each point of STAGES (metrics, tests).
      cluster: the mirror's name (config `mirrors[].name`, docs/design.md §5.5) when this consumer
        reads a MirrorMaker 2 copy on the mirror's target cluster (a failed-over group); None (the
        default): the audited cluster. Written in every ledger row's `cluster`; the rows then carry
        the audited (source) topic and the target's partition and offset.
      source_topics: copy name -> audited topic, for `cluster`; default: the copies configured
        for that mirror in `cfg` (`mirrors[].topic`), else the copy's name after its first '.' (MM2's
        default replication policy, `<source_alias>.<topic>`).

    The handler gets a ConsumedRecord and returns None, a mapping (one sink row) or a sequence of
    mappings (rows for `sink`). In exactly_once_kafka it produces through `self.producer`.
    """

    def __init__(
        self,
        config: Mapping[str, Any] | None = None,
        *,
        topics: Sequence[str],
        group: str | None = None,
        semantics: str = "at_least_once",
        name: str | None = None,
        sink: Sink | None = None,
        retry: RetryPolicy | None = None,
        cfg: Config | None = None,
        ledger_dir: str | os.PathLike[str] | None = None,
        producer_config: Mapping[str, Any] | None = None,
        batch_size: int = 100,
        poll_timeout_s: float = 0.5,
        on_stage: StageHook | None = None,
        ledger: LedgerWriter | None = None,
        ledger_topic: str | None = None,
        ledger_kafka: Mapping[str, Any] | None = None,
        cluster: str | None = None,
        source_topics: Mapping[str, str] | None = None,
    ) -> None:
        if semantics not in SEMANTICS:
            raise ConfigError(f"AuditedConsumer semantics: expected one of {', '.join(SEMANTICS)}, got {semantics!r}")
        if isinstance(topics, str) or not topics or not all(isinstance(t, str) and t for t in topics):
            raise ConfigError(f"AuditedConsumer topics: expected a non-empty list of topic names, got {topics!r}")
        if semantics == "exactly_once_sink" and sink is None:
            raise ConfigError("AuditedConsumer: semantics 'exactly_once_sink' needs a sink= to store offsets in")
        if batch_size < 1:
            raise ConfigError(f"AuditedConsumer batch_size: expected >= 1, got {batch_size}")
        base: dict[str, Any] = dict(cfg.kafka) if cfg is not None else {}
        base.update(config or {})
        group = group or base.get("group.id")
        if not group:
            raise ConfigError("AuditedConsumer: give group= (or 'group.id' in the config)")
        if "bootstrap.servers" not in base:
            raise ConfigError("AuditedConsumer: no 'bootstrap.servers' (pass config= or cfg=)")
        if cluster is not None and not (isinstance(cluster, str) and cluster):
            raise ConfigError(f"AuditedConsumer cluster: expected a mirror name, got {cluster!r}")
        self.cluster = cluster
        # copy name -> audited topic: from the config's mirrors of that name (cfg=), then the caller's
        self._source_topics = {m.topic: tc.name for tc in (cfg.topics.values() if cfg and cluster else ())
                               for m in tc.mirrors if m.name == cluster}
        self._source_topics.update(source_topics or {})
        self.group = str(group)
        self.topics = tuple(topics)
        self.semantics = semantics
        self.name = name or f"{socket.gethostname()}-{os.getpid()}"
        self.instance = audit_headers.new_pid(self.name)
        self.sink = sink
        self.retry = retry
        self.batch_size = batch_size
        self.poll_timeout_s = poll_timeout_s
        self._on_stage = on_stage
        self.retry_topic = (retry.retry_topic or f"{self.group}.retry") if retry else None
        self.dlq_topic = (retry.dlq_topic or f"{self.group}.dlq") if retry else None
        if retry and (self.retry_topic in self.topics or self.dlq_topic in self.topics):
            raise ConfigError("RetryPolicy: the retry and dead-letter topics must differ from the source topics")

        self._kafka_common = {k: v for k, v in base.items() if k != "group.id"}
        conf = dict(base)
        conf.update({
            "group.id": self.group,
            # Offsets are committed by this loop only, at the point the semantics says.
            "enable.auto.commit": False,
            "enable.auto.offset.store": False,
        })
        conf.setdefault("auto.offset.reset", "earliest")
        conf.setdefault("client.id", self.instance)
        if semantics == "exactly_once_kafka":
            conf["isolation.level"] = "read_committed"
        # A failed SASL login reaches only the error callback (consume() keeps retrying): keep it for _poll.
        self._login_failed: str | None = None
        user_error_cb = conf.get("error_cb")

        def on_error(err: KafkaError) -> None:
            if err.code() == KafkaError._AUTHENTICATION:
                self._login_failed = authentication_line(base)
            if user_error_cb is not None:
                user_error_cb(err)

        conf["error_cb"] = on_error
        strategy = str(conf.get("partition.assignment.strategy", ""))
        self._incremental = "cooperative" in strategy or str(conf.get("group.protocol", "")) == "consumer"
        try:
            self.consumer = Consumer(conf)
        except KafkaException as e:
            raise ConfigError(f"AuditedConsumer: librdkafka rejected the config: {e}") from e

        self._producer_conf = {**self._kafka_common, **(producer_config or {})}
        self.producer: AuditedProducer | Producer | None = None
        self._raw_producer: Producer | None = None
        self._delivery_errors: list[str] = []

        if ledger_topic is None and cfg is not None and cfg.ledger is not None:
            ledger_topic, ledger_kafka = cfg.ledger.topic, cfg.ledger.kafka
        self.ledger_topic = ledger_topic
        self._ledger_kafka = dict(ledger_kafka) if ledger_kafka is not None else connection_settings(base)
        # exactly_once_kafka: the batch's consumption rows join its transaction when the ledger topic
        # is on the cluster the transaction runs on (a transaction cannot span two clusters).
        self._ledger_in_txn = bool(ledger_topic) and semantics == "exactly_once_kafka" and (
            str(self._ledger_kafka.get("bootstrap.servers")) == str(base.get("bootstrap.servers")))
        if ledger_topic and semantics == "exactly_once_kafka" and not self._ledger_in_txn:
            log.warning("consumer %s: the ledger topic is on another cluster, so the consumption rows are "
                        "shipped after each transaction commits, not inside it", self.instance)
        elif semantics == "exactly_once_kafka" and not ledger_topic:
            log.warning("consumer %s: exactly_once_kafka without a ledger topic: the consumption rows are written "
                        "after each transaction commits, so a crash in between shows that batch as missed; "
                        "set ledger: {topic: ...} (on this cluster) to commit them in the transaction", self.instance)
        self._shipper: LedgerShipper | None = None
        observer: LedgerShipper | TransactionShipped | None = None
        if ledger_topic and ledger is None:
            if self._ledger_in_txn:
                observer = TransactionShipped()
            else:
                observer = self._shipper = LedgerShipper(self._ledger_kafka, ledger_topic, "consumer")
        if ledger is None:
            root = Path(ledger_dir) if ledger_dir is not None else (
                Path(cfg.ledger_dir) if cfg is not None else Path(".msgaudit") / "ledger")
            self._ledger_root = root
            ledger = consumption_ledger(root, self.group, self.name, observer)
        else:
            self._ledger_root = Path(ledger.directory).parent
        self.ledger = ledger
        self._consume_seq = 0

        self._held: dict[TP, deque[Message]] = {}  # retry copies polled before they are due
        self._uncommitted: dict[TP, int] = {}  # processed, Kafka commit still owed
        self._assigned: set[TP] = set()
        self._stopping = False
        self._assigned_at = 0.0
        self._started = False
        self._closed = False
        self.stats = RunStats()

    @classmethod
    def from_config(cls, cfg: Config, *, topics: Sequence[str], group: str, **kwargs: Any) -> AuditedConsumer:
        """Consumer for a loaded msgaudit Config: its kafka settings and its ledger_dir."""
        return cls(kwargs.pop("config", None), cfg=cfg, topics=topics, group=group, **kwargs)

    # -- setup -----------------------------------------------------------------------------

    def _start(self) -> None:
        if self._started:
            return
        if self._closed:
            raise MsgauditError("AuditedConsumer is closed; create a new one")
        self._started = True
        if self.retry is not None:
            self._ensure_topics([t for t in (self.retry_topic, self.dlq_topic) if t])
        if self.semantics == "exactly_once_kafka":
            from audit.clients.producer import AuditedProducer

            tconf = {**self._producer_conf, "transactional.id": f"msgaudit-{self.group}-{self.name}"}
            producer = AuditedProducer(tconf, producer_name=f"{self.group}.{self.name}",
                                       ledger_dir=self._ledger_root / "producer", ledger_topic=self.ledger_topic,
                                       ledger_kafka=self._ledger_kafka if self.ledger_topic else None,
                                       ledger_in_transactions=self._ledger_in_txn)
            try:
                producer.init_transactions(30)
            except KafkaException as e:
                raise BrokerError(f"AuditedConsumer: init_transactions failed for group {self.group!r}: {e}") from e
            self.producer = producer
            # Retry copies ride in the same transaction but are plumbing, not audited messages of
            # their own: they go through the wrapped Producer so they get no new audit identity.
            self._raw_producer = producer.raw_producer
        elif self.retry is not None:
            self._raw_producer = Producer({**self._producer_conf, "enable.idempotence": True, "acks": "all"})
        subscription = list(self.topics) + ([self.retry_topic] if self.retry_topic else [])
        self.consumer.subscribe(subscription, on_assign=self._on_assign, on_revoke=self._on_revoke,
                                on_lost=self._on_lost)

    def _ensure_topics(self, names: Sequence[str]) -> None:
        from confluent_kafka.admin import AdminClient, NewTopic

        assert self.retry is not None
        admin = AdminClient(dict(self._kafka_common))
        try:
            existing = set(admin.list_topics(timeout=10).topics)
        except KafkaException as e:
            raise BrokerError(f"AuditedConsumer: cannot reach Kafka to check the retry topics: {e}") from e
        missing = [n for n in names if n not in existing]
        if not missing:
            return
        futures = admin.create_topics([NewTopic(n, self.retry.partitions, self.retry.replication_factor)
                                       for n in missing])
        for topic, fut in futures.items():
            try:
                fut.result(timeout=30)
            except KafkaException as e:
                if e.args[0].code() != KafkaError.TOPIC_ALREADY_EXISTS:
                    raise BrokerError(f"AuditedConsumer: cannot create retry/DLQ topic {topic!r}: {e}; "
                                      "create it yourself or set RetryPolicy(retry_topic=..., dlq_topic=...)") from e

    # -- rebalance callbacks (run inside consume()) ------------------------------------------

    def _on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self.stats.rebalances += 1
        keys = [(tp.topic, tp.partition) for tp in partitions]
        log.info("consumer %s: assigned %s", self.instance, sorted(keys))
        for k in keys:
            self._held.pop(k, None)
        self._assigned.update(keys)
        if self.semantics == "exactly_once_sink":
            assert self.sink is not None
            stored = self.sink.read_positions(self.group, keys)
            for tp in partitions:
                off = stored.get((tp.topic, tp.partition))
                if off is not None:
                    tp.offset = off
            log.info("consumer %s: positions restored from the sink: %s", self.instance, stored)
        if self._incremental:
            consumer.incremental_assign(partitions)
        else:
            consumer.assign(partitions)
        if partitions:
            # A partition paused for a pending retry by an earlier owner of this member starts fresh.
            consumer.resume(partitions)
        # After the (possibly slow) position restore: the idle clock starts once we can consume.
        self._assigned_at = time.monotonic()

    def _on_revoke(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        keys = {(tp.topic, tp.partition) for tp in partitions}
        log.info("consumer %s: revoked %s", self.instance, sorted(keys))
        self._commit_owed(keys)
        for k in keys:
            self._held.pop(k, None)  # not committed, so the next owner reads them again
        self._assigned.difference_update(keys)
        if self._incremental:
            consumer.incremental_unassign(partitions)

    def _on_lost(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        # Lost, not revoked: another member may own them already, so committing is pointless.
        keys = {(tp.topic, tp.partition) for tp in partitions}
        log.info("consumer %s: lost %s", self.instance, sorted(keys))
        for k in keys:
            self._held.pop(k, None)
            self._uncommitted.pop(k, None)
        self._assigned.difference_update(keys)
        if self._incremental:
            consumer.incremental_unassign(partitions)

    # -- the loop ----------------------------------------------------------------------------

    def stop(self) -> None:
        """Ask run() to return after the current batch (safe from signal handlers)."""
        self._stopping = True

    def run(self, handler: Handler, *, max_messages: int | None = None,
            idle_timeout_s: float | None = None, stop: Callable[[], bool] | None = None) -> RunStats:
        """Consume and handle until stop() / `stop()` returns True / `max_messages` records were
        handled / nothing arrived for `idle_timeout_s` (counted from the first assignment) with no
        retry pending. Returns the stats."""
        if not callable(handler):
            raise ConfigError(f"AuditedConsumer.run: handler must be callable, got {handler!r}")
        self._start()
        self._stopping = False
        handled_at_start = self.stats.handled
        last_activity = time.monotonic()
        while not self._stopping and not (stop is not None and stop()):
            done = self.stats.handled - handled_at_start
            if max_messages is not None and done >= max_messages:
                break
            want = self.batch_size if max_messages is None else min(self.batch_size, max_messages - done)
            batch = self._due_held()
            if len(batch) < want:
                timeout = 0.0 if batch else self._poll_timeout()
                batch += self._poll(want - len(batch), timeout)
            if batch:
                before = self.stats.handled
                self._process(handler, batch)
                if self.stats.handled != before:
                    last_activity = time.monotonic()
            elif (idle_timeout_s is not None and not self._held and self._assigned_at
                  and time.monotonic() - max(last_activity, self._assigned_at) >= idle_timeout_s):
                # Idle counts only once the group gave us partitions: waiting to join is not idle.
                break
        return self.stats

    def _poll_timeout(self) -> float:
        if not self._held:
            return self.poll_timeout_s
        due = min(_due_ms(q[0]) for q in self._held.values())
        return max(0.0, min(self.poll_timeout_s, (due - _now_ms()) / 1000))

    def _poll(self, n: int, timeout: float) -> list[Message]:
        msgs = self.consumer.consume(num_messages=n, timeout=timeout)
        if self._login_failed is not None:
            raise BrokerError(f"AuditedConsumer group {self.group!r}: {self._login_failed}")
        out = []
        for m in msgs:
            err = m.error()
            if err is None:
                out.append(m)
            elif err.code() == KafkaError._PARTITION_EOF:
                continue
            elif line := access_line(self._kafka_common, err.name(), {"topic": "READ", "group": "READ"},
                                     {"topic": m.topic() or ",".join(self.topics), "group": self.group}):
                raise BrokerError(f"AuditedConsumer group {self.group!r}: {line}")
            elif err.code() == KafkaError.UNKNOWN_TOPIC_OR_PART:
                raise BrokerError(f"AuditedConsumer group {self.group!r}: topic {m.topic()!r} does not exist on "
                                  f"{self._kafka_common.get('bootstrap.servers')}: create it (on the local broker, "
                                  "`msgaudit kafka start` creates the topics of msgaudit.yaml)")
            elif err.fatal() or err.code() in (KafkaError.TOPIC_AUTHORIZATION_FAILED,
                                               KafkaError.GROUP_AUTHORIZATION_FAILED):
                raise BrokerError(f"AuditedConsumer group {self.group!r}: {err.str()} (topic {m.topic()!r})")
            else:
                log.warning("consumer %s: %s", self.instance, err.str())
        return self._gate(out)

    def _due_held(self) -> list[Message]:
        """Held retry copies that are due now; partitions whose queue empties are resumed."""
        now = _now_ms()
        out: list[Message] = []
        for k in list(self._held):
            q = self._held[k]
            while q and _due_ms(q[0]) <= now:
                out.append(q.popleft())
            if not q:
                del self._held[k]
                self.consumer.resume([TopicPartition(k[0], k[1])])
        return out

    def _gate(self, msgs: list[Message]) -> list[Message]:
        """Hold retry copies that are not due (and everything after them in their partition),
        pausing that retry partition so the source partitions keep flowing."""
        now = _now_ms()
        out = []
        for m in msgs:
            k = (str(m.topic()), int(m.partition() or 0))
            if k in self._held:
                self._held[k].append(m)
            elif m.topic() == self.retry_topic and _due_ms(m) > now:
                self._held[k] = deque([m])
                self.consumer.pause([TopicPartition(k[0], k[1])])
            else:
                out.append(m)
        return out

    def _record(self, m: Message) -> ConsumedRecord:
        headers = _msg_headers(m)
        topic, partition, offset = str(m.topic()), int(m.partition() or 0), int(m.offset() or 0)
        attempt = 1
        if topic == self.retry_topic:
            src_topic = _header(headers, SRC_TOPIC)
            src_partition = _int_header(headers, SRC_PARTITION)
            src_offset = _int_header(headers, SRC_OFFSET)
            if src_topic is not None and src_partition is not None and src_offset is not None:
                topic, partition, offset = src_topic, src_partition, src_offset
            else:
                log.warning("consumer %s: retry copy %s[%s]@%s has no source headers; audited as itself",
                            self.instance, topic, partition, offset)
            attempt = _int_header(headers, ATTEMPT) or 2
        elif self.cluster is not None:
            # a mirror's copy: recorded against the audited topic, at the target's partition/offset
            topic = self._source_topics.get(topic) or topic.split(".", 1)[-1]
        ts_type, ts = m.timestamp()
        return ConsumedRecord(topic, partition, offset, m.key(), m.value(), headers,
                              ts if ts_type else None, audit_headers.parse(headers), attempt, m)

    def _stage(self, stage: str, records: Sequence[ConsumedRecord]) -> None:
        if self._on_stage is not None:
            self._on_stage(stage, records)

    def _process(self, handler: Handler, msgs: list[Message]) -> None:
        records = [self._record(m) for m in msgs]
        positions = self._positions(msgs)
        if self.semantics == "at_most_once":
            self._commit(positions)
            self._stage("committed_before_processing", records)
        eos_kafka = self.semantics == "exactly_once_kafka"
        if eos_kafka:
            assert self.producer is not None
            self.producer.begin_transaction()
        rows: list[tuple[ConsumedRecord, str, int, str | None]] = []  # (record, outcome, consume_ts, error)
        sink_records: list[SinkRecord] = []
        stop_error: BaseException | None = None
        for i, rec in enumerate(records):
            try:
                result = handler(rec)
            except Exception as e:  # noqa: BLE001 - every handler failure is accounted for below
                if self.retry is None:
                    # Finish the records before it, account for it, then stop.
                    rows.append((rec, "failed", _now_ms(), _error_text(e)))
                    log.error("consumer %s: handler failed on %s[%s]@%s: %s", self.instance,
                              rec.topic, rec.partition, rec.offset, _error_text(e))
                    stop_error = e
                    msgs = msgs[:i]
                    positions = self._positions(msgs)
                    break
                rows.append((rec, self._send_retry(rec, e), _now_ms(), _error_text(e)))
                continue
            rows.append((rec, "processed", _now_ms(), None))
            if self.sink is not None:
                sink_records.extend(self._sink_records(rec, result))
        handled = [r for r, _, _, _ in rows]
        self._stage("handled", handled)
        # exactly_once_sink with a sink that stores them: the ledger rows go into the sink's
        # commit, with the rows and the offsets (docs/design.md §11), not to the ledger files.
        in_sink = self.semantics == "exactly_once_sink" and bool(getattr(self.sink, "stores_consumption", False))
        ledger = [self._ledger_dict(rec, outcome, ts, error, self._consume_seq + i)
                  for i, (rec, outcome, ts, error) in enumerate(rows)]
        # Taken now: a seq written to the sink is never reused, even if a later step raises.
        self._consume_seq += len(ledger)

        try:
            if self.sink is not None and (sink_records or self.semantics == "exactly_once_sink"):
                eos_sink = self.semantics == "exactly_once_sink"
                self.sink.write(
                    sink_records, group=self.group,
                    positions=self._sink_positions(positions) if eos_sink else (),
                    before_commit=lambda: self._stage("sink_txn_open", handled),
                    **({"consumption": ledger} if in_sink else {}))
            self._stage("sink_written", handled)
            if eos_kafka:
                self._commit_transaction(positions, handled, ledger)
            elif self._raw_producer is not None and len(self._raw_producer):
                self._flush_retries()
        except BaseException:
            if eos_kafka:
                self._abort_and_rewind(msgs)
            raise

        for row in ledger:
            if not in_sink:
                self.ledger.append(row)
            self._count(row["outcome"])
        if not in_sink:
            self.ledger.flush()
        self._stage("ledger_flushed", handled)
        self.stats.batches += 1
        if self.semantics == "at_least_once":
            self._commit(positions)
        elif self.semantics == "exactly_once_sink":
            self._commit(positions, asynchronous=True)
        self._stage("committed", handled)
        if stop_error is not None:
            rec = rows[-1][0]
            raise HandlerFailed(f"handler failed on {rec.topic}[{rec.partition}]@{rec.offset} "
                                f"(group {self.group!r}): {_error_text(stop_error)}; it will be redelivered "
                                "on the next run (pass retry=RetryPolicy(...) to retry and dead-letter "
                                "instead)") from stop_error

    @staticmethod
    def _positions(msgs: Sequence[Message]) -> dict[TP, int]:
        pos: dict[TP, int] = {}
        for m in msgs:
            k = (str(m.topic()), int(m.partition() or 0))
            pos[k] = max(pos.get(k, -1), int(m.offset() or 0) + 1)
        return pos

    @staticmethod
    def _sink_positions(positions: Mapping[TP, int]) -> list[Position]:
        return [Position(t, p, o) for (t, p), o in sorted(positions.items())]

    def _sink_records(self, rec: ConsumedRecord, result: Any) -> Iterable[SinkRecord]:
        if result is None:
            return ()
        if isinstance(result, Mapping):
            result = [result]
        elif not isinstance(result, Sequence) or isinstance(result, str | bytes):
            raise ConfigError(f"AuditedConsumer: with a sink, the handler must return None, a mapping or a "
                              f"list of mappings (one per sink row), got {type(result).__name__}")
        out = []
        for row in result:
            if not isinstance(row, Mapping):
                raise ConfigError(f"AuditedConsumer: sink rows must be mappings, got {type(row).__name__}")
            out.append(SinkRecord(row, rec.topic, rec.partition, rec.offset, rec.audit.pid, rec.audit.seq,
                                  _produce_time(rec)))
        return out

    # -- retries and dead letters ------------------------------------------------------------

    def _send_retry(self, rec: ConsumedRecord, exc: BaseException) -> str:
        assert self.retry is not None and self._raw_producer is not None
        error = _error_text(exc)
        final = rec.attempt >= self.retry.max_attempts
        headers = [(k, v) for k, v in rec.headers if k not in RETRY_HEADERS]
        headers += [(SRC_TOPIC, rec.topic.encode()), (SRC_PARTITION, str(rec.partition).encode()),
                    (SRC_OFFSET, str(rec.offset).encode()), (ERROR, error.encode()),
                    (GROUP, self.group.encode())]
        if final:
            topic = self.dlq_topic
            headers.append((ATTEMPT, str(rec.attempt).encode()))
        else:
            topic = self.retry_topic
            nxt = rec.attempt + 1
            headers += [(ATTEMPT, str(nxt).encode()),
                        (RETRY_AT, str(_now_ms() + self.retry.delay_ms(nxt)).encode())]
        assert topic is not None
        log.warning("consumer %s: attempt %d of %s[%s]@%s failed (%s); -> %s", self.instance, rec.attempt,
                    rec.topic, rec.partition, rec.offset, error, topic)
        while True:
            try:
                self._raw_producer.produce(topic, rec.value, rec.key, headers=cast(Any, headers),
                                           on_delivery=self._delivered)
                break
            except BufferError:
                self._raw_producer.poll(0.1)
        return "dead_lettered" if final else "failed"

    def _delivered(self, err: KafkaError | None, msg: Message) -> None:
        if err is not None:
            self._delivery_errors.append(f"{msg.topic()}: {err.str()}")

    def _flush_retries(self) -> None:
        assert self._raw_producer is not None
        left = self._raw_producer.flush(30)
        if left or self._delivery_errors:
            errors, self._delivery_errors = self._delivery_errors, []
            # Not committing: the batch is redelivered and the copies are sent again.
            raise BrokerError(f"AuditedConsumer: {left} retry/DLQ copies undelivered, errors: {errors[:3]}; "
                              "offsets not committed")

    # -- transactions (exactly_once_kafka) ---------------------------------------------------

    def _commit_transaction(self, positions: Mapping[TP, int], handled: Sequence[ConsumedRecord],
                            ledger: Sequence[dict[str, Any]] = ()) -> None:
        assert self.producer is not None and self._raw_producer is not None
        # The batch's outputs reach the log (inside the open transaction) before its offsets join
        # it: commit_transaction would wait for them anyway, and a crash from here on leaves an
        # aborted transaction whose records are in the log, never records still in this process.
        # The flush also serves their delivery reports, so their ledger rows are known below.
        self._raw_producer.flush(30)
        if self._ledger_in_txn:
            # The batch's evidence joins its transaction and commits or aborts with it: the
            # consumption rows, and the output producer's rows of the messages it produced. The
            # spool gets the same rows after the commit (never shipped), so the spool copy and the
            # topic copy are one row; an aborted batch's consume_seqs are not reused.
            from audit.clients.producer import AuditedProducer

            assert self.ledger_topic is not None and isinstance(self.producer, AuditedProducer)
            evidence = [(txn_key(self.instance, row["consume_seq"]), encode_row(row)) for row in ledger]
            evidence += self.producer.transaction_rows()
            for key, line in evidence:
                while True:
                    try:
                        self._raw_producer.produce(self.ledger_topic, line.encode(), key, on_delivery=self._delivered)
                        break
                    except BufferError:
                        self._raw_producer.poll(0.1)
        offsets = [TopicPartition(t, p, o) for (t, p), o in positions.items()]
        self.producer.send_offsets_to_transaction(offsets, self.consumer.consumer_group_metadata(), 30)
        self._stage("txn_before_commit", handled)
        while True:
            try:
                self.producer.commit_transaction(30)
                break
            except KafkaException as e:
                if e.args[0].retriable():
                    continue
                raise
        self._stage("txn_committed", handled)

    def _abort_and_rewind(self, msgs: Sequence[Message]) -> None:
        """Abort the open transaction and seek back so the batch is read again."""
        assert self.producer is not None
        try:
            self.producer.abort_transaction(30)
        except KafkaException as e:
            raise BrokerError(f"AuditedConsumer: abort_transaction failed ({e}); restart the consumer") from e
        first: dict[TP, int] = {}
        for m in msgs:
            k = (str(m.topic()), int(m.partition() or 0))
            first[k] = min(first.get(k, 1 << 62), int(m.offset() or 0))
        for (t, p), o in first.items():
            self.consumer.seek(TopicPartition(t, p, o))

    # -- offsets and ledger ----------------------------------------------------------------

    def _commit(self, positions: Mapping[TP, int], asynchronous: bool = False) -> None:
        if not positions:
            return
        self._uncommitted.update(positions)
        self._commit_owed(set(positions), asynchronous)

    def _commit_owed(self, keys: set[TP], asynchronous: bool = False) -> None:
        owed = {k: o for k, o in self._uncommitted.items() if k in keys}
        if not owed:
            return
        offsets = [TopicPartition(t, p, o) for (t, p), o in owed.items()]
        try:
            if asynchronous:
                self.consumer.commit(offsets=offsets, asynchronous=True)
                result: list[TopicPartition] = []
            else:
                result = self.consumer.commit(offsets=offsets, asynchronous=False)
        except KafkaException as e:
            if e.args[0].code() in _REBALANCE_COMMIT_ERRORS:
                # The revoke callback that follows commits them again, or the next owner redoes them.
                log.warning("consumer %s: commit deferred by a rebalance: %s", self.instance, e)
                return
            raise BrokerError(f"AuditedConsumer: offset commit failed for group {self.group!r}: {e}") from e
        failed = [tp for tp in result if tp.error is not None]
        for k in owed:
            if not any((tp.topic, tp.partition) == k for tp in failed):
                self._uncommitted.pop(k, None)
        if failed:
            log.warning("consumer %s: commit failed for %s", self.instance,
                        [(tp.topic, tp.partition, tp.error) for tp in failed])

    def _ledger_dict(self, rec: ConsumedRecord, outcome: str, ts: int, error: str | None,
                     consume_seq: int) -> dict[str, Any]:
        return consumption_row(self.group, self.instance, consume_seq, rec, outcome, ts, error, self.cluster)

    def _count(self, outcome: str) -> None:
        if outcome == "processed":
            self.stats.processed += 1
        elif outcome == "failed":
            self.stats.failed += 1
        else:
            self.stats.dead_lettered += 1

    # -- lifecycle -----------------------------------------------------------------------------

    def close(self) -> None:
        """Commit what is owed, leave the group (revoke commits too), seal the ledger. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._started and self._uncommitted and self.semantics != "exactly_once_kafka":
                self._commit_owed(set(self._uncommitted))
            self.consumer.close()
        finally:
            try:
                if self.producer is not None:
                    self.producer.close()  # the AuditedProducer owns _raw_producer then
                elif self._raw_producer is not None:
                    self._raw_producer.flush(30)
                    self._raw_producer.close()
            finally:
                self.ledger.close()
                if self._shipper is not None:
                    self._shipper.close()

    def __enter__(self) -> AuditedConsumer:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"AuditedConsumer(group={self.group!r}, topics={list(self.topics)!r}, "
                f"semantics={self.semantics!r}, instance={self.instance!r})")


__all__ = ["AuditedConsumer", "ConsumedRecord", "HandlerFailed", "RetryPolicy", "RunStats", "SEMANTICS",
           "OUTCOMES", "STAGES", "SRC_TOPIC", "SRC_PARTITION", "SRC_OFFSET", "ATTEMPT", "RETRY_AT", "ERROR", "GROUP"]
