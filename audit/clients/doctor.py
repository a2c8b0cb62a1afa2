"""`msgaudit doctor`: the loss risks Kafka's delivery semantics describe, found before they cause
loss (docs/design.md §9): topic configs and group positions read through the AdminClient.

Risks (severity):
* `unclean_leader_election` (error): `unclean.leader.election.enable=true` on an audited topic --
  an out-of-sync replica may become leader and drop acked writes (`lost_acked`).
* `min_insync_replicas` (error): `min.insync.replicas` < 2 -- acks=all is then satisfied by a
  single copy.
* `replication_factor` (warn): replication factor below `min_replication_factor` (default 2).
* `producer_acks` (error) / `producer_idempotence` (warn): a producer session (from the lake's
  `producer_settings`, passed in by the caller) that runs with `acks` other than `all` (an acked
  write can be lost: `lost_acked`) or without idempotence (a retried batch is written twice or out
  of order: `duplicate_in_log`, `reordered_in_log`).
* `dlq_growing` (warn): a configured group's dead-letter topic (`<group>.dlq`, docs/design.md §11)
  holds more records than at the previous doctor run (end offsets kept in
  `$MSGAUDIT_HOME/doctor-dlq.json`): messages keep failing processing.
* `mirror_rows_ignored` (warn): a configured group's consumption rows read on a mirror (from the
  lake's `consumed_records`, counted by the caller) that the reconcile leaves out because the group
  is not in that mirror's `failover_groups`, or the `cluster` names no mirror of the topic
  (docs/design.md §5.5): its records there would turn `overdue`, then `missed`.
* `at_risk_of_expiry` (error): a group's oldest unprocessed record (at its committed offset) is so
  old that, if the group stays at its current position, retention deletes it within `horizon`
  (`expired_unconsumed`); the estimate is in the detail.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from audit.core.config import Config
from audit.core.errors import BrokerError
from audit.core.failover import failover_pairs, ignored_rows_line
from audit.core.kafka_conf import access_line, internal_client_conf
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


def denied(cfg: Config, e: Exception, ops: dict[str, str], names: dict[str, str]) -> BrokerError | None:
    """The BrokerError of one line for an ACL denial or a failed login in `e`, else None."""
    from confluent_kafka import KafkaError

    err = e.args[0] if e.args else None
    line = access_line(cfg.kafka, err.name(), ops, names) if isinstance(err, KafkaError) else None
    return BrokerError(line) if line else None


def _configs(cfg: Config, admin: Any, topic: str) -> dict[str, str]:
    from confluent_kafka import KafkaException
    from confluent_kafka.admin import ConfigResource, ResourceType

    res = ConfigResource(ResourceType.TOPIC, topic)
    try:
        entries = admin.describe_configs([res])[res].result(timeout=30)
    except KafkaException as e:
        raise denied(cfg, e, {"topic": "DESCRIBE_CONFIGS"}, {"topic": topic}) or e from None
    return {k: e.value for k, e in entries.items()}


def _missing(cfg: Config, admin: Any, topic: str) -> BrokerError:
    """Why `topic` is not in the cluster's metadata: absent, or hidden from this user by the ACLs."""
    try:
        md = admin.list_topics(topic, timeout=15).topics.get(topic)
    except Exception:  # noqa: BLE001 - the plain answer below stands
        md = None
    if md is not None and md.error is not None:
        line = access_line(cfg.kafka, md.error.name(), {"topic": "DESCRIBE"}, {"topic": topic})
        if line:
            return BrokerError(line)
    return BrokerError(f"topic {topic!r} does not exist on the broker")


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
    admin = AdminClient(internal_client_conf(cfg.kafka))
    names = topics or list(cfg.topics)
    try:
        meta = admin.list_topics(timeout=15)
    except Exception as e:
        raise denied(cfg, e, {}, {}) or BrokerError(f"cannot reach {cfg.kafka.get('bootstrap.servers', '?')}: "
                                                    f"{e}") from None
    risks: list[Risk] = []
    for name in names:
        if name not in meta.topics:
            raise _missing(cfg, admin, name)
    risks += dlq_risks(cfg, names, set(meta.topics), now)
    for name in names:
        tc = cfg.topic(name)
        if name not in meta.topics:
            raise BrokerError(f"topic {name!r} does not exist on the broker")
        parts = meta.topics[name].partitions
        conf = _configs(cfg, admin, name)
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


def producer_risks(settings: list[dict[str, Any]], topics_of: dict[str, list[str]]) -> list[Risk]:
    """Risks of producer sessions from their `producer_settings` rows; `topics_of` maps a pid to the
    topics its ledger rows name (a session that has not produced yet is shown with topic '-')."""
    risks: list[Risk] = []
    for row in sorted(settings, key=lambda r: (str(r.get("producer")), str(r["pid"]))):
        who = f"producer:{row.get('producer') or '?'} ({row['pid']})"
        for topic in topics_of.get(row["pid"]) or ["-"]:
            if str(row["acks"]) != "all":
                risks.append(Risk(ERROR, "producer_acks", topic, who,
                                  f"acks={row['acks']}: an acknowledged write can be lost when the leader "
                                  "fails; set acks=all"))
            if not row["enable_idempotence"]:
                risks.append(Risk(WARN, "producer_idempotence", topic, who,
                                  f"enable.idempotence=false (retries={row.get('retries')}, max.in.flight="
                                  f"{row.get('max_in_flight')}): a retried batch is written twice or out of "
                                  "order; set enable.idempotence=true"))
    return risks


def mirror_risks(cfg: Config, counts: dict[tuple[str, str, str], int], topics: list[str] | None = None) -> list[Risk]:
    """`mirror_rows_ignored` for each (topic, group, cluster) of `counts` (rows read on a mirror, from
    the lake) that the reconcile does not use: a group of the topic that does not fail over to
    that cluster's mirror, or a cluster no mirror of the topic is named."""
    risks: list[Risk] = []
    for (topic, group, cluster), n in sorted(counts.items()):
        if topic not in cfg.topics or (topics and topic not in topics):
            continue
        tc = cfg.topic(topic)
        if group in tc.groups and n and (cluster, group) not in failover_pairs(tc):
            risks.append(Risk(WARN, "mirror_rows_ignored", topic, f"group:{group}",
                              ignored_rows_line(tc, group, cluster, n)))
    return risks


DLQ_STATE = "doctor-dlq.json"


def dlq_risks(cfg: Config, topics: list[str], existing: set[str], now: datetime) -> list[Risk]:
    """`dlq_growing` for each configured group's `<group>.dlq` whose end offsets (summed over its
    partitions) grew since the previous run; records this run's offsets for the next one."""
    import json
    from pathlib import Path

    path = Path(cfg.home) / DLQ_STATE
    try:
        prev: dict[str, Any] = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    except (OSError, ValueError):
        prev = {}
    risks: list[Risk] = []
    current = dict(prev)
    for name in topics:
        for group in cfg.topic(name).groups:
            dlq = f"{group}.dlq"
            if dlq not in existing or dlq in current and current[dlq].get("at") == now.isoformat():
                continue
            parts = _partitions(cfg, dlq)
            end = sum(admin_watermarks(cfg, dlq, p)[1] for p in parts)
            current[dlq] = {"end": end, "at": now.isoformat()}
            before = prev.get(dlq)
            if before is not None and end > int(before["end"]):
                risks.append(Risk(WARN, "dlq_growing", name, f"group:{group}",
                                  f"{dlq} grew by {end - int(before['end'])} records since {before['at']} "
                                  f"({end} in all): messages keep failing processing"))
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(current, indent=1, sort_keys=True), encoding="utf-8")
    except OSError:
        pass  # the next run then compares with an older sample
    return risks


def _partitions(cfg: Config, topic: str) -> list[int]:
    from confluent_kafka.admin import AdminClient

    meta = AdminClient(internal_client_conf(cfg.kafka)).list_topics(topic, timeout=15)
    return sorted(meta.topics[topic].partitions)


def committed_offsets(cfg: Config, group: str, topic: str, partitions: list[int]) -> list[Any]:
    """The group's committed offsets (offset < 0: none), read as the group without joining it."""
    from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

    busy = (KafkaError.NOT_COORDINATOR, KafkaError.COORDINATOR_LOAD_IN_PROGRESS,
                         KafkaError.COORDINATOR_NOT_AVAILABLE)

    c = Consumer({**cfg.kafka, "group.id": group, "enable.auto.commit": False, "log_level": 0})
    deadline = time.monotonic() + 60
    try:
        while True:
            try:
                return list(c.committed([TopicPartition(topic, p) for p in partitions], timeout=30))
            except KafkaException as e:
                # A coordinator that is moving or still loading its offsets answers again shortly.
                err = e.args[0] if e.args else None
                if not (isinstance(err, KafkaError) and err.code() in busy) \
                        or time.monotonic() > deadline:
                    raise denied(cfg, e, {"group": "DESCRIBE", "topic": "DESCRIBE"},
                                 {"group": group, "topic": topic}) or e from None
                time.sleep(0.5)
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


def cli_doctor(args: Any, cfg: Config,
               producers: tuple[list[dict[str, Any]], dict[str, list[str]]] | None = None,
               record: Callable[[list[Risk]], None] | None = None,
               mirror_rows: dict[tuple[str, str, str], int] | None = None) -> int:
    """Print the risks; exit 3 if one is error severity. `producers`: the recent producer sessions'
    settings and their topics, from the lake (the CLI reads them; None: not known). `mirror_rows`:
    recent consumption rows read on a mirror per (topic, group, cluster), from the lake."""
    from audit.core.errors import SlaFailed

    risks = diagnose(cfg, list(args.topics) if args.topics else None, timedelta(hours=args.horizon_hours),
                     args.min_replication_factor)
    if producers is not None:
        wanted = set(args.topics or cfg.topics)
        risks += [r for r in producer_risks(*producers) if r.topic in wanted or r.topic == "-"]
    if mirror_rows:
        risks += mirror_risks(cfg, mirror_rows, list(args.topics) if args.topics else None)
    if record is not None:  # the CLI stores them in the report store (the dashboard shows the latest run)
        record(risks)
    for r in risks:
        print(r.line())
    print(f"doctor: {len(risks)} risk(s), {sum(r.severity == ERROR for r in risks)} error")
    if any(r.severity == ERROR for r in risks):
        raise SlaFailed("error-severity risks found (above)")
    return 0
