"""`msgaudit doctor`: the loss risks Kafka's delivery semantics describe, found before they cause
loss (docs/design.md §9): topic configs and group positions read through the AdminClient.

Risks (severity):
* `unclean_leader_election` (error): `unclean.leader.election.enable=true` on an audited topic --
  an out-of-sync replica may become leader and drop acked writes (`lost_acked`).
* `min_insync_replicas` (error): `min.insync.replicas` < 2 -- acks=all is then satisfied by a
  single copy.
* `replication_factor` (warn): replication factor below `min_replication_factor` (default 2).
* `at_risk_of_expiry` (error): a group's oldest unprocessed record (at its committed offset) is so
  old that, if the group stays at its current position, retention deletes it within `horizon`
  (`expired_unconsumed`); the estimate is in the detail.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from audit.core.config import Config
from audit.core.errors import BrokerError
from audit.core.vocabulary import ERROR, WARN


@dataclass(frozen=True)
class Risk:
    severity: str
    risk: str
    topic: str
    subject: str  # "topic" or "group:<g>"
    detail: str

    def line(self) -> str:
        return f"{self.severity.upper():5}  {self.topic}  {self.subject}  {self.risk}: {self.detail}"


def _configs(admin: Any, topic: str) -> dict[str, str]:
    from confluent_kafka.admin import ConfigResource, ResourceType

    res = ConfigResource(ResourceType.TOPIC, topic)
    entries = admin.describe_configs([res])[res].result(timeout=30)
    return {k: e.value for k, e in entries.items()}


def _oldest_unprocessed_ts(cfg: Config, topic: str, partition: int, offset: int) -> datetime | None:
    from confluent_kafka import Consumer, TopicPartition

    c = Consumer({**cfg.kafka, "group.id": "msgaudit-doctor", "enable.auto.commit": False, "log_level": 0})
    try:
        c.assign([TopicPartition(topic, partition, offset)])
        msg = c.poll(10)
        if msg is None or msg.error():
            return None
        return datetime.fromtimestamp(msg.timestamp()[1] / 1000, UTC)
    finally:
        c.close()


def diagnose(cfg: Config, topics: list[str] | None = None, horizon: timedelta = timedelta(hours=24),
             min_replication_factor: int = 2, now: datetime | None = None) -> list[Risk]:
    """The risks of the audited topics (all configured ones unless `topics`)."""
    from confluent_kafka.admin import AdminClient

    now = now or datetime.now(UTC)
    admin = AdminClient(dict(cfg.kafka))
    names = topics or list(cfg.topics)
    try:
        meta = admin.list_topics(timeout=15)
    except Exception as e:
        raise BrokerError(f"cannot reach {cfg.kafka.get('bootstrap.servers', '?')}: {e}") from None
    risks: list[Risk] = []
    for name in names:
        tc = cfg.topic(name)
        if name not in meta.topics:
            raise BrokerError(f"topic {name!r} does not exist on the broker")
        parts = meta.topics[name].partitions
        conf = _configs(admin, name)
        if conf.get("unclean.leader.election.enable") == "true":
            risks.append(Risk(ERROR, "unclean_leader_election", name, "topic",
                              "unclean.leader.election.enable=true; set it to false"))
        isr = int(conf.get("min.insync.replicas", "1"))
        if isr < 2:
            risks.append(Risk(ERROR, "min_insync_replicas", name, "topic",
                              f"min.insync.replicas={isr}; set >= 2 (with replication factor >= 3)"))
        rf = min(len(p.replicas) for p in parts.values())
        if rf < min_replication_factor:
            risks.append(Risk(WARN, "replication_factor", name, "topic",
                              f"replication factor {rf} < {min_replication_factor}"))
        retention_ms = int(conf.get("retention.ms", "-1"))
        if retention_ms < 0:
            continue
        for group in tc.groups:
            got = committed_offsets(cfg, group, name, sorted(parts))
            for tp in got:
                _, hw = admin_watermarks(cfg, name, tp.partition)
                start = tp.offset if tp.offset >= 0 else 0
                if start >= hw:
                    continue
                ts = _oldest_unprocessed_ts(cfg, name, tp.partition, start)
                if ts is None:
                    continue
                expires = ts + timedelta(milliseconds=retention_ms)
                if expires - now <= horizon:
                    hours = max((expires - now).total_seconds(), 0) / 3600
                    risks.append(Risk(ERROR, "at_risk_of_expiry", name, f"group:{group}",
                                      f"partition {tp.partition}: {hw - start} unprocessed records, the oldest "
                                      f"(offset {start}) expires in {hours:.1f} h at the group's current position "
                                      f"(retention.ms={retention_ms})"))
    return risks


def committed_offsets(cfg: Config, group: str, topic: str, partitions: list[int]) -> list[Any]:
    """The group's committed offsets (offset < 0: none), read as the group without joining it."""
    from confluent_kafka import Consumer, TopicPartition

    c = Consumer({**cfg.kafka, "group.id": group, "enable.auto.commit": False, "log_level": 0})
    try:
        return list(c.committed([TopicPartition(topic, p) for p in partitions], timeout=30))
    finally:
        c.close()


def admin_watermarks(cfg: Config, topic: str, partition: int) -> tuple[int, int]:
    from confluent_kafka import Consumer, TopicPartition

    c = Consumer({**cfg.kafka, "group.id": "msgaudit-doctor", "log_level": 0})
    try:
        lo, hi = c.get_watermark_offsets(TopicPartition(topic, partition), timeout=15)
        return int(lo), int(hi)
    finally:
        c.close()


def cli_doctor(args: Any, cfg: Config) -> int:
    """Print the risks; exit 3 if one is error severity."""
    from audit.core.errors import SlaFailed

    risks = diagnose(cfg, list(args.topics) if args.topics else None, timedelta(hours=args.horizon_hours),
                     args.min_replication_factor)
    for r in risks:
        print(r.line())
    print(f"doctor: {len(risks)} risk(s), {sum(r.severity == ERROR for r in risks)} error")
    if any(r.severity == ERROR for r in risks):
        raise SlaFailed("error-severity risks found (above)")
    return 0
