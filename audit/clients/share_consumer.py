"""`AuditedShareConsumer`: a member of a Kafka share group (KIP-932, "Queues for Kafka") on
confluent-kafka's `ShareConsumer`, writing the consumption ledger (docs/design.md §4.2, §5.9).

A share group hands each record to one member at a time under an acquisition lock; the member
acknowledges it ACCEPT (done), RELEASE (deliver it again) or REJECT (give up); the broker counts
deliveries and archives a record whose count reaches `group.share.delivery.count.limit`. The
member runs in explicit acknowledgement mode and writes, to the same ledger as `AuditedConsumer`
(`<ledger_dir>/consumer`, rows of `consumed_records`):

- one `acquired` row per delivery: `consumer` = this member's instance id, `attempt` = the broker's
  delivery count of the record (1 when the client does not say), `consume_ts` = when poll() handed
  it over; poll() flushes them before it returns (a member killed while holding records leaves
  the evidence of those deliveries);
- one row per acknowledgement, `accepted`, `released` or `rejected`, written when the broker's
  answer arrives (the acknowledgement commit callback, served by poll(), commit() and close()):
  `error` null when the broker took it, else its error name (`INVALID_RECORD_STATE`: the lock had
  expired, the record was handed on); `consume_ts` = when the member acknowledged it. An
  acknowledgement the broker never answered before close() gets `error` `unconfirmed`.

`run(handler)` acknowledges each record by what the handler did: ACCEPT when it returns (or
returns `"accept"`), `"release"` / `"reject"` when it returns that, RELEASE when it raises (the
error is logged; the record is delivered again, up to the group's limit).

This module must not import pyspark or airflow.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

from confluent_kafka import AcknowledgeType, KafkaException, Message, ShareConsumer

from audit.clients.consumer import (
    ConsumedRecord,
    _msg_headers,
    _now_ms,
    consumption_ledger,
    consumption_row,
)
from audit.clients.ledger import LedgerWriter
from audit.clients.ledger_ship import LedgerShipper, connection_settings
from audit.core import headers as audit_headers
from audit.core.errors import ConfigError, MsgauditError
from audit.core.vocabulary import ACCEPTED, ACQUIRED, REJECTED, RELEASED

if TYPE_CHECKING:
    from audit.core.config import Config

log = logging.getLogger(__name__)

ACK_TYPES: dict[str, AcknowledgeType] = {ACCEPTED: AcknowledgeType.ACCEPT, RELEASED: AcknowledgeType.RELEASE,
                                         REJECTED: AcknowledgeType.REJECT}
_BY_ANSWER = {"accept": ACCEPTED, "release": RELEASED, "reject": REJECTED}
UNCONFIRMED = "unconfirmed"
Key = tuple[str, int, int]


class AuditedShareConsumer:
    """One member of share group `group` reading `topics` (see the module's docstring)."""

    def __init__(self, config: Mapping[str, Any] | None = None, *, topics: Sequence[str], group: str,
                 name: str | None = None, cfg: Config | None = None,
                 ledger_dir: str | os.PathLike[str] | None = None, ledger: LedgerWriter | None = None,
                 ledger_topic: str | None = None, ledger_kafka: Mapping[str, Any] | None = None,
                 poll_timeout_s: float = 0.5) -> None:
        if isinstance(topics, str) or not topics or not all(isinstance(t, str) and t for t in topics):
            raise ConfigError(f"AuditedShareConsumer topics: expected a non-empty list of topic names, got {topics!r}")
        if not group:
            raise ConfigError("AuditedShareConsumer: give group= (the share group)")
        base: dict[str, Any] = dict(cfg.kafka) if cfg is not None else {}
        base.update(config or {})
        if "bootstrap.servers" not in base:
            raise ConfigError("AuditedShareConsumer: no 'bootstrap.servers' (pass config= or cfg=)")
        self.group, self.topics = str(group), tuple(topics)
        self.name = name or f"{socket.gethostname()}-{os.getpid()}"
        self.instance = audit_headers.new_pid(self.name)
        self.poll_timeout_s = poll_timeout_s
        conf = {**base, "group.id": self.group, "share.acknowledgement.mode": "explicit"}
        conf.setdefault("client.id", self.instance)
        try:
            self.consumer = ShareConsumer(conf)
        except KafkaException as e:
            raise ConfigError(f"AuditedShareConsumer: librdkafka rejected the config: {e}") from e
        self.consumer.set_acknowledgement_commit_callback(self._answered)
        if ledger_topic is None and cfg is not None and cfg.ledger is not None:
            ledger_topic, ledger_kafka = cfg.ledger.topic, cfg.ledger.kafka
        self._shipper = LedgerShipper(dict(ledger_kafka) if ledger_kafka is not None else connection_settings(base),
                                      ledger_topic, "consumer") if ledger_topic and ledger is None else None
        if ledger is None:
            root = Path(ledger_dir) if ledger_dir is not None else (
                Path(cfg.ledger_dir) if cfg is not None else Path(".msgaudit") / "ledger")
            ledger = consumption_ledger(root, self.group, self.name, self._shipper)
        self.ledger = ledger
        self._consume_seq = 0
        self._awaiting: dict[Key, list[tuple[ConsumedRecord, str, int]]] = {}  # acks the broker has not answered
        self._subscribed = self._closed = False
        self.stats: dict[str, int] = dict.fromkeys((ACQUIRED, ACCEPTED, RELEASED, REJECTED, "refused"), 0)

    @classmethod
    def from_config(cls, cfg: Config, *, topics: Sequence[str], group: str, **kwargs: Any) -> AuditedShareConsumer:
        """A member for a loaded msgaudit Config: its kafka settings and its ledger_dir."""
        return cls(kwargs.pop("config", None), cfg=cfg, topics=topics, group=group, **kwargs)

    # -- the ledger ---------------------------------------------------------------------------
    def _write(self, rec: ConsumedRecord, outcome: str, ts: int, error: str | None) -> None:
        self.ledger.append(consumption_row(self.group, self.instance, self._consume_seq, rec, outcome, ts, error))
        self._consume_seq += 1
        self.stats[outcome] += 1
        if error is not None:
            self.stats["refused"] += 1

    def _answered(self, offsets: Mapping[Any, set[int]], err: KafkaException | None) -> None:
        """The broker's answer to acknowledgements: one ledger row per acknowledged record."""
        for tp, offs in offsets.items():
            problem = tp.error if tp.error is not None else (err.args[0] if err is not None and err.args else err)
            error = None if problem is None else (problem.name() if hasattr(problem, "name") else str(problem))
            for off in sorted(offs):
                waiting = self._awaiting.get((tp.topic, tp.partition, off))
                if not waiting:
                    log.warning("share consumer %s: the broker answered an acknowledgement of %s[%s]@%s this "
                                "member did not send", self.instance, tp.topic, tp.partition, off)
                    continue
                rec, outcome, ts = waiting.pop(0)
                if not waiting:
                    del self._awaiting[(tp.topic, tp.partition, off)]
                self._write(rec, outcome, ts, error)

    # -- the client's calls ---------------------------------------------------------------------
    def poll(self, timeout: float | None = None) -> list[ConsumedRecord]:
        """The records the broker handed this member (an `acquired` row each). Acknowledge each
        (`acknowledge`) before the next poll."""
        if self._closed:
            raise MsgauditError("AuditedShareConsumer is closed; create a new one")
        if not self._subscribed:
            self.consumer.subscribe(list(self.topics))
            self._subscribed = True
        msgs = self.consumer.poll(self.poll_timeout_s if timeout is None else timeout)
        now = _now_ms()
        out = []
        for m in msgs:
            if m.error() is not None:
                log.warning("share consumer %s: %s", self.instance, m.error())
                continue
            rec = self._record(m)
            self._write(rec, ACQUIRED, now, None)
            out.append(rec)
        if out:  # durable before the application sees them: a member killed now leaves its deliveries
            self.ledger.flush()
        return out

    @staticmethod
    def _record(m: Message) -> ConsumedRecord:
        headers = _msg_headers(m)
        ts_type, ts = m.timestamp()
        return ConsumedRecord(str(m.topic()), int(m.partition() or 0), int(m.offset() or 0), m.key(), m.value(),
                              headers, ts if ts_type else None, audit_headers.parse(headers),
                              m.delivery_count() or 1, m)

    def acknowledge(self, rec: ConsumedRecord, outcome: str = ACCEPTED) -> None:
        """Acknowledge a polled record: `accepted`, `released` or `rejected`. The ledger row is
        written when the broker answers (poll, commit, close)."""
        if outcome not in ACK_TYPES:
            raise ConfigError(f"AuditedShareConsumer.acknowledge: expected one of {', '.join(ACK_TYPES)}, "
                              f"got {outcome!r}")
        self.consumer.acknowledge(rec.message, ACK_TYPES[outcome])
        self._awaiting.setdefault((rec.topic, rec.partition, rec.offset), []).append((rec, outcome, _now_ms()))

    def commit(self, timeout: float = 30.0) -> None:
        """Send the acknowledgements and wait for the broker's answers; make the rows durable."""
        if self._awaiting:
            self.consumer.commit_sync(timeout)
        self.ledger.flush()

    def run(self, handler: Callable[[ConsumedRecord], Any], *, max_messages: int | None = None,
            idle_timeout_s: float | None = None) -> dict[str, int]:
        """Poll, hand each record to `handler`, acknowledge it by what the handler did (module
        docstring), commit after each batch; until `max_messages` records or `idle_timeout_s`
        without one. Returns the member's counts per ledger outcome (and `refused`)."""
        handled, idle_since = 0, time.monotonic()
        while max_messages is None or handled < max_messages:
            records = self.poll()
            if not records:
                if idle_timeout_s is not None and time.monotonic() - idle_since >= idle_timeout_s:
                    break
                continue
            idle_since = time.monotonic()
            for rec in records:
                try:
                    answer = handler(rec)
                except Exception as e:  # the record goes back to the group: delivered again
                    log.warning("share consumer %s: handler failed on %s[%s]@%s (released): %s: %s", self.instance,
                                rec.topic, rec.partition, rec.offset, type(e).__name__, e)
                    answer = "release"
                outcome = _BY_ANSWER.get(answer, ACCEPTED) if isinstance(answer, str) else ACCEPTED
                self.acknowledge(rec, outcome)
                handled += 1
            self.commit()
        return dict(self.stats)

    # -- lifecycle ----------------------------------------------------------------------------
    def close(self) -> None:
        """Send what is acknowledged, leave the group, seal the ledger. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._awaiting:
                try:
                    self.consumer.commit_sync(30)
                except KafkaException as e:
                    log.warning("share consumer %s: acknowledging at close failed: %s", self.instance, e)
            self.consumer.close()
        finally:
            for waiting in self._awaiting.values():
                for rec, outcome, ts in waiting:
                    self._write(rec, outcome, ts, UNCONFIRMED)
            self._awaiting.clear()
            self.ledger.close()
            if self._shipper is not None:
                self._shipper.close()

    def __enter__(self) -> AuditedShareConsumer:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"AuditedShareConsumer(group={self.group!r}, topics={list(self.topics)!r}, instance={self.instance!r})"


__all__ = ["ACK_TYPES", "AuditedShareConsumer", "UNCONFIRMED"]
