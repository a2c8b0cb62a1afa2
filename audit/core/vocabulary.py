"""The vocabulary of msgaudit (docs/design.md §5, §7), as data, in one place: stages, anomaly codes (with
their report column, the totals they count in and their detail text), ledger statuses, consume
outcomes, SLA rules, report statuses and exit codes.

The oracle (`audit/oracle.py`), the Spark classifier (`spark_jobs/reconcile/`), the report store,
the SLA check, the dashboard and the alerts read these names from here; `tests/test_vocabulary.py`
fails when one of them disagrees. Detail texts are templates (`str.format` fields): the oracle
renders them in Python, the Spark classifier turns the same template into a SQL expression
(`spark_jobs/reconcile/sql.py`), so each text is written once.

This module must stay plain data and pure functions: no imports beyond the standard library.
"""

from __future__ import annotations

import string
from dataclasses import dataclass
from enum import IntEnum

# ---------------------------------------------------------------------------- stages
LOG, GROUP, SINK, MIRROR, SHARE = "log", "group", "sink", "mirror", "share"
STAGE_KINDS: tuple[str, ...] = (LOG, GROUP, SINK, MIRROR, SHARE)


def stage_kind(stage: str) -> str:
    """'log' | 'group:<g>' | 'sink:<s>' | 'mirror:<m>' | 'share:<g>' -> 'log' | 'group' | ... | 'share'."""
    return stage.split(":", 1)[0]


def group_stage(group: str) -> str:
    return f"{GROUP}:{group}"


def sink_stage(sink: str) -> str:
    return f"{SINK}:{sink}"


def mirror_stage(mirror: str) -> str:
    return f"{MIRROR}:{mirror}"


def share_stage(group: str) -> str:
    return f"{SHARE}:{group}"


def stage_names(groups: tuple[str, ...] | list[str], sinks: tuple[str, ...] | list[str],
                mirrors: tuple[str, ...] | list[str] = (), shares: tuple[str, ...] | list[str] = ()) -> list[str]:
    """A topic's stages in report order: log, then each group, each sink, each mirror, each share group."""
    return [LOG, *(group_stage(g) for g in groups), *(sink_stage(s) for s in sinks),
            *(mirror_stage(m) for m in mirrors), *(share_stage(g) for g in shares)]


# ---------------------------------------------------------------------------- anomaly codes
# The totals of a report row that anomaly rows count in (`pending` at the log stage is not a code:
# it is counted from the units, see audit/core/report.py).
LOST, DUPLICATED, REORDERED, PENDING = "lost", "duplicated", "reordered", "pending"
TOTALS: tuple[str, ...] = (LOST, DUPLICATED, REORDERED, PENDING)

# A run of more than this many missing seqs is one `seq_gap` row (its "wide" detail says how many).
MAX_GAP_ROWS = 1000


@dataclass(frozen=True)
class AnomalyCode:
    """One anomaly code at one stage kind (`pending` and `dead_lettered` exist at two: group and sink).

    `detail` is a `str.format` template; `variants` are other templates of the same code (by
    variant name); `detail_from` names an input value that, when not null, is the detail instead
    of the template (the header parser's own error for `unaudited`)."""

    name: str
    stage_kind: str
    report_column: str | None
    counts_in: tuple[str, ...]
    detail: str
    variants: tuple[tuple[str, str], ...] = ()
    detail_from: str | None = None

    def template(self, variant: str | None = None) -> str:
        if variant is None:
            return self.detail
        return dict(self.variants)[variant]

    def fields(self, variant: str | None = None) -> tuple[str, ...]:
        """The template's field names, in order."""
        return tuple(f for _, f, _, _ in string.Formatter().parse(self.template(variant)) if f)

    def render(self, variant: str | None = None, **values: object) -> str:
        """The detail text (the value of `detail_from`, when given and not None)."""
        if self.detail_from is not None and values.get(self.detail_from) is not None:
            return str(values[self.detail_from])
        return self.template(variant).format(**{k: v for k, v in values.items() if k != self.detail_from})


def _code(name: str, kind: str, detail: str, counts_in: tuple[str, ...] = (), column: bool = True,
          variants: tuple[tuple[str, str], ...] = (), detail_from: str | None = None) -> AnomalyCode:
    return AnomalyCode(name, kind, name if column else None, counts_in, detail, variants, detail_from)


# Order matters: it is the order of the report columns (the SQL DDL in sql/ is generated from it).
# A code of a later stage kind with the name of an earlier one's column (the share stage's
# `redelivered`, `missed`, `overdue`) counts in that column on its own stage's rows: no new column.


ANOMALIES: tuple[AnomalyCode, ...] = (
    # stage log
    _code("lost_acked", LOG, "acked, capture covered the offset, not in the log", (LOST,)),
    _code("unverifiable", LOG, "offset below log_start_offset before any capture"),
    _code("ghost_write", LOG, "ledger says failed, the log has it"),
    _code("failed_send", LOG, "ledger says failed, no copy in the log"),
    _code("duplicate_in_log", LOG, "extra copy of offset {orig_partition}:{orig_offset}", (DUPLICATED,)),
    _code("reordered_in_log", LOG, "seq {late_seq} after seq {high_seq}", (REORDERED,)),
    _code("unledgered", LOG, "no producer ledger row"),
    _code("seq_gap", LOG, "in neither ledger nor log",
          variants=(("wide", "{missing} seqs missing ({first}..{last})"),)),
    _code("unaudited", LOG, "missing audit headers", detail_from="header_error"),
    _code("content_duplicate", LOG, "same content as {first_pid}:{first_seq}"),
    _code("aborted", LOG, "record of an aborted transaction"),
    # stage group:<g>
    _code("missed", GROUP, "never processed, below committed offset {committed_offset}", (LOST,),
          variants=(("failover", "never processed, skipped by the failover to mirror {mirror} at {failover_at}: "
                                 "resumed at target offset {resume_offset}"),)),
    _code("expired_unconsumed", GROUP, "never processed, now below log_start_offset", (LOST,)),
    _code("redelivered", GROUP, "processing {k} of {n} by {consumer}", (DUPLICATED,),
          variants=(("failover", "processing {k} of {n} by {consumer} on mirror {mirror} after the failover "
                                 "at {failover_at}"),)),
    _code("reordered_in_consumption", GROUP, "first processed after a higher offset", (REORDERED,)),
    _code("dead_lettered", GROUP, "dead-lettered"),
    _code("aborted_read", GROUP, "processed a record of an aborted transaction"),
    _code("pending", GROUP, "not processed yet, within grace", (PENDING,), column=False),
    _code("overdue", GROUP, "not processed, past grace, at or above the committed offset"),
    _code("retry_overdue", GROUP, "only failed outcomes, past grace; last: attempt {attempt} by {consumer}",
          variants=(("error", "only failed outcomes, past grace; last: attempt {attempt} by {consumer}: {error}"),)),
    # stage sink:<s>
    _code("missing_in_sink", SINK, "processed by the group, not in the sink", (LOST,)),
    _code("duplicate_in_sink", SINK, "copy {k} of {n}", (DUPLICATED,)),
    _code("unexpected_in_sink", SINK, "no committed log record"),
    _code("dead_lettered", SINK, "in the connector's dead-letter topic, not in the sink"),
    _code("pending", SINK, "not in the sink yet, within grace", (PENDING,), column=False),
    # stage mirror:<m>
    _code("lost_in_mirror", MIRROR, "committed in the source log, not in {mirror_topic} after grace", (LOST,)),
    _code("duplicate_in_mirror", MIRROR, "extra copy of {orig_partition}:{orig_offset} in {mirror_topic}",
          (DUPLICATED,)),
    _code("reordered_in_mirror", MIRROR, "source offset {late_offset} copied after source offset {high_offset}",
          (REORDERED,)),
    _code("pending", MIRROR, "not in {mirror_topic} yet, within grace or not yet captured there", (PENDING,),
          column=False),
    # stage share:<g> (a share group, KIP-932; docs/design.md §5.9)
    _code("redelivered", SHARE, "delivery {k} of {n} to {consumer}"),
    _code("processed_twice", SHARE, "accept {k} of {n}, by {consumer}", (DUPLICATED,), column=False),
    _code("rejected", SHARE, "rejected by {consumer} at delivery {attempt}", column=False),
    _code("archived_unprocessed", SHARE, "delivery limit {limit} reached without an accept", (LOST,), column=False),
    _code("missed", SHARE, "never handed to a member, below the group's start offset {start_offset}", (LOST,)),
    _code("dead_lettered", SHARE, "in the group's dead-letter topic {dlq_topic}: {reason}"),
    _code("pending", SHARE, "not accepted yet, within grace", (PENDING,), column=False),
    _code("overdue", SHARE, "not accepted, past grace, delivery limit not reached"),
)

_BY_KEY: dict[tuple[str, str], AnomalyCode] = {(a.stage_kind, a.name): a for a in ANOMALIES}


def anomaly(kind: str, name: str) -> AnomalyCode:
    """The entry of code `name` at stage kind `kind` ('log' | 'group' | 'sink' | 'mirror')."""
    try:
        return _BY_KEY[(kind, name)]
    except KeyError:
        raise KeyError(f"no anomaly code {name!r} at stage kind {kind!r}") from None


def detail(kind: str, name: str, variant: str | None = None, **values: object) -> str:
    """The detail text of one anomaly row (see `AnomalyCode.render`)."""
    return anomaly(kind, name).render(variant, **values)


ANOMALY_CODES_BY_STAGE: dict[str, tuple[str, ...]] = {
    kind: tuple(a.name for a in ANOMALIES if a.stage_kind == kind) for kind in STAGE_KINDS
}
ANOMALY_CODES: tuple[str, ...] = tuple(dict.fromkeys(a.name for a in ANOMALIES))

# Report columns named after codes (`pending` already is a base column of the report).
# one column per code name: a name two stage kinds share (`dead_lettered`) is one column, each
# stage's row holding its own count
REPORT_CODE_COLUMNS: tuple[str, ...] = tuple(dict.fromkeys(a.report_column for a in ANOMALIES
                                                           if a.report_column is not None))


def codes_counting_in(kind: str, total: str) -> tuple[str, ...]:
    """The codes of a stage kind whose rows add up to one of a report row's `TOTALS`."""
    return tuple(a.name for a in ANOMALIES if a.stage_kind == kind and total in a.counts_in)


# ---------------------------------------------------------------------------- explanations
@dataclass(frozen=True)
class Explanation:
    """Why an anomaly code happens (`cause`, one line) and which setting or practice prevents it
    (`remedy`, one line), from Kafka's delivery semantics (docs/design.md §5 "Explanations")."""

    cause: str
    remedy: str


# (stage kind, code) -> explanation; tests/test_vocabulary.py fails if a code of ANOMALIES lacks one.
EXPLANATIONS: dict[tuple[str, str], Explanation] = {
    (LOG, "lost_acked"): Explanation(
        "the broker acked a write it then lost: producer acks < all, or an unclean leader election "
        "made an out-of-sync replica leader",
        "producer acks=all; topic replication factor >= 3 with min.insync.replicas >= 2; "
        "unclean.leader.election.enable=false"),
    (LOG, "unverifiable"): Explanation(
        "retention deleted the offset before any capture read it",
        "capture more often than retention.ms, or raise retention.ms"),
    (LOG, "ghost_write"): Explanation(
        "the broker wrote the record but the producer never saw the ack (timeout, broken connection) "
        "and counted the send as failed",
        "enable.idempotence=true with retries, so the client retries the send instead of failing it; "
        "treat a failed send as unknown, not as absent"),
    (LOG, "failed_send"): Explanation(
        "the producer was told the send failed (delivery timeout, unknown topic, an error retries did not "
        "overcome) and the log has no copy: an application that ignores its delivery errors lost it",
        "handle delivery errors: resend the message or stop; create the topic before producing "
        "(brokers often run with auto.create.topics.enable=false)"),
    (LOG, "duplicate_in_log"): Explanation(
        "the producer retried a send whose ack was lost, without idempotence",
        "enable.idempotence=true (with acks=all, max.in.flight.requests.per.connection <= 5)"),
    (LOG, "reordered_in_log"): Explanation(
        "a failed batch was retried after a later batch succeeded: retries with "
        "max.in.flight.requests.per.connection > 1 and idempotence off; the client retries a retriable "
        "error by itself (NOT_LEADER_OR_FOLLOWER from a topic created moments before or a leader change, "
        "a broken connection), so the ledger shows no failed send",
        "enable.idempotence=true (keeps order with up to 5 in flight), or "
        "max.in.flight.requests.per.connection=1"),
    (LOG, "unledgered"): Explanation(
        "a producer wrote without the audit ledger (interceptor missing, or its ledger segment not ingested)",
        "install the audit interceptor on every producer of the topic; run `msgaudit ingest` before reconcile"),
    (LOG, "seq_gap"): Explanation(
        "the producer assigned seqs it never sent nor recorded (crash before the ledger write, lost ledger segment)",
        "look for the producer's crash and its ledger segments; close producers cleanly so the ledger flushes"),
    (LOG, "unaudited"): Explanation(
        "the record has no (or malformed) audit headers: a producer without the interceptor, or a "
        "proxy/mirror that dropped headers",
        "install the audit interceptor on every producer; keep headers when mirroring"),
    (LOG, "content_duplicate"): Explanation(
        "the application sent the same payload again under a new seq (an application-level resend, "
        "which producer idempotence cannot detect)",
        "resend through the producer's own retries, not the application; deduplicate downstream by a business key"),
    (LOG, "aborted"): Explanation(
        "a transactional producer aborted the transaction that wrote this record",
        "nothing to fix if every consumer reads with isolation.level=read_committed; find why the transaction aborted"),
    (GROUP, "missed"): Explanation(
        "the consumer committed the offset before processing the record (auto-commit, or commit then "
        "process) and crashed or rebalanced in between: at most once; or (detail names a mirror) the group "
        "failed over to a MirrorMaker 2 copy at a translated offset past the record",
        "enable.auto.commit=false and commit offsets after processing (at least once); after a failover, "
        "reset the group on the target to the offset the detail's skipped records start at"),
    (GROUP, "expired_unconsumed"): Explanation(
        "retention is shorter than the group's lag: the segment was deleted before the group read it",
        "raise retention.ms above the worst lag, or add consumers; `msgaudit doctor` warns before it happens"),
    (GROUP, "redelivered"): Explanation(
        "the group processed the record again after a crash, rebalance or retry before its offset was "
        "committed: at least once; or (detail names a mirror) after a failover to a MirrorMaker 2 copy, "
        "whose offset translation lands at its last offset sync (offset.lag.max), before the committed offset",
        "make processing idempotent (deduplicate by pid:seq), or commit offsets in the same transaction "
        "as the output"),
    (GROUP, "reordered_in_consumption"): Explanation(
        "a partition was processed out of order: parallel processing within a partition, or a retry "
        "or rebalance that went back to an older offset",
        "process each partition sequentially; retry in place, or through a retry topic keyed by the same key"),
    (GROUP, "dead_lettered"): Explanation(
        "processing failed past the retry limit and the record went to the dead-letter queue",
        "fix the failure recorded with the DLQ message and replay it; alert on a growing DLQ"),
    (GROUP, "aborted_read"): Explanation(
        "the consumer reads with isolation.level=read_uncommitted and so sees aborted transactions",
        "isolation.level=read_committed"),
    (GROUP, "pending"): Explanation(
        "the group has not reached the record yet (normal consumer lag, within grace)",
        "none yet; if it turns overdue, check the group's lag"),
    (GROUP, "retry_overdue"): Explanation(
        "every attempt to process the record failed and no retry finished within grace: the retry copy "
        "is stuck, was lost, or its consumer is down",
        "check the retry topic's consumer and the handler's error in its log; a bounded retry count ending "
        "in the dead-letter queue keeps a failing record from waiting forever"),
    (GROUP, "overdue"): Explanation(
        "the group is stalled or lags more than the grace: it has not committed past the record",
        "check that the group's consumers run, and their lag; add consumers"),
    (SINK, "missing_in_sink"): Explanation(
        "the group processed the record but its sink write was lost: offsets committed before the write "
        "was durable, or an unflushed asynchronous write",
        "commit offsets only after the sink write is durable (or in the same transaction); for a Kafka "
        "Connect sink, look for a dead-letter topic (errors.deadletterqueue.topic.name: name it in "
        "sinks[].dead_letter_topic) or errors.tolerance=all without one, which drops the records it "
        "cannot convert or write"),
    (SINK, "dead_lettered"): Explanation(
        "the sink connector could not convert or write the record and sent it to its dead-letter topic "
        "(errors.tolerance=all with errors.deadletterqueue.topic.name)",
        "read the error in the DLQ record's __connect.errors.* headers, fix the record or the "
        "connector's converter, and replay it; alert on a growing DLQ"),
    (SINK, "duplicate_in_sink"): Explanation(
        "the sink appends, so a redelivered record was written again",
        "write idempotently: upsert/merge by (topic, partition, offset) or pid:seq instead of append"),
    (SINK, "unexpected_in_sink"): Explanation(
        "the sink holds a record the log never committed: written from an aborted transaction or from "
        "another source",
        "read with isolation.level=read_committed; write only records read from the audited topic"),
    (SINK, "pending"): Explanation(
        "the sink has not received the record yet (within grace)",
        "none yet; if it turns missing, check the sink writer"),
    (MIRROR, "lost_in_mirror"): Explanation(
        "MirrorMaker 2 never copied the record: the source deleted it (retention) while MM2 was down or "
        "lagging, or the copy was deleted from the target (retention, topic reset) before a capture read it",
        "keep the source's retention.ms above MM2's worst outage and alert on MM2's replication lag; capture "
        "the target more often than its retention"),
    (MIRROR, "duplicate_in_mirror"): Explanation(
        "MirrorMaker 2 restarted (crash, kill, rebalance) after copying records whose source offsets it had "
        "not flushed yet, and copied them again: at least once",
        "exactly.once.source.support=enabled on the target cluster (MM2's exactly-once mode, Kafka 3.5+), "
        "or deduplicate downstream by pid:seq"),
    (MIRROR, "reordered_in_mirror"): Explanation(
        "the target partition holds the records in another order than the source partition: a mirror that "
        "does not keep the partition mapping, or several replication flows writing one topic",
        "keep MM2's default partition mapping and one flow per target topic"),
    (MIRROR, "pending"): Explanation(
        "MirrorMaker 2 has not copied the record yet, or no capture of the target has run since (within grace)",
        "none yet; if it turns lost, check MM2's status and replication lag"),
    (SHARE, "redelivered"): Explanation(
        "the share group handed the record out again: a member released it, or its acquisition lock "
        "(group.share.record.lock.duration.ms) expired before the member acknowledged it: normal queue behaviour",
        "acknowledge within the lock duration; bound redeliveries with the SLA rule max_redelivery_ratio"),
    (SHARE, "processed_twice"): Explanation(
        "two deliveries of the record were both accepted by the application: a member was slower than the "
        "acquisition lock, the broker gave the record to another member, and both processed it",
        "raise group.share.record.lock.duration.ms above the slowest processing, or make processing "
        "idempotent (deduplicate by pid:seq)"),
    (SHARE, "rejected"): Explanation(
        "a member acknowledged the record REJECT: the application gave up on it (a poison record); "
        "accounted for, not lost",
        "fix what the handler could not process and produce the record again; alert on rejections"),
    (SHARE, "archived_unprocessed"): Explanation(
        "the record's delivery count reached the group's limit (group.share.delivery.count.limit, default 5) "
        "without an accept: every delivery was released or its lock expired, and the broker archived it",
        "find why each delivery failed (the handler's errors, a member slower than the lock); a dead-letter "
        "topic (share.version=2, the group's errors.deadletterqueue.topic.name) keeps such records"),
    (SHARE, "missed"): Explanation(
        "no member of the share group was ever handed the record, and the group's share-partition start "
        "offset has moved past it, so the broker will never hand it out: the group's offsets were reset or "
        "moved (kafka-share-groups.sh --reset-offsets, Admin.alterShareGroupOffsets), retention or "
        "deleteRecords removed the record before a member got it, or the record predates the group "
        "(share.auto.offset.reset=latest, the default, starts a new group at the log end)",
        "check who reset the group's offsets (kafka-share-groups.sh --describe --offsets), keep the topic's "
        "retention above the group's worst lag, and set share.auto.offset.reset=earliest before the group's "
        "first member joins (or audit only windows after it first read the topic)"),
    (SHARE, "dead_lettered"): Explanation(
        "the broker wrote the record to the group's dead-letter topic (KIP-1191): a member rejected it, or "
        "its delivery count reached the limit; accounted for, not lost",
        "read the reason in the DLQ record's __dlq.errors.* headers, fix what the handler could not "
        "process and produce the record again; alert on a growing DLQ"),
    (SHARE, "pending"): Explanation(
        "the share group has not accepted the record yet (within grace)",
        "none yet; if it turns overdue, check the group's members"),
    (SHARE, "overdue"): Explanation(
        "no member accepted, rejected or exhausted the record within grace: the group has no running member, "
        "or lags behind",
        "check that the share group's members run (kafka-share-groups.sh --describe), and add members"),
}


def explanation(kind: str, name: str) -> Explanation:
    """The cause and remedy of code `name` at stage kind `kind` ('log' | 'group' | 'sink')."""
    anomaly(kind, name)  # KeyError naming an unknown code
    return EXPLANATIONS[(kind, name)]


# The report total an SLA rule judges, for the codes that can explain its failure.
SLA_RULE_TOTALS: dict[str, str] = {"max_lost": LOST, "max_duplicate_ratio": DUPLICATED,
                                   "max_reordered": REORDERED, "min_completeness": LOST}
# The rules that judge one code's column instead of a total.
SLA_RULE_CODES: dict[str, str] = {"max_failed_sends": "failed_send", "max_redelivery_ratio": "redelivered"}


def rule_explanations(rule: str, kind: str) -> tuple[tuple[str, Explanation], ...]:
    """(code, explanation) of the codes of a stage kind whose rows can fail `rule` (none for latency)."""
    code = SLA_RULE_CODES.get(rule)
    if code is not None:
        return ((code, EXPLANATIONS[(kind, code)]),) if (kind, code) in EXPLANATIONS else ()
    total = SLA_RULE_TOTALS.get(rule)
    if total is None:
        return ()
    return tuple((c, EXPLANATIONS[(kind, c)]) for c in codes_counting_in(kind, total))


# ---------------------------------------------------------------------------- report rows
# Base columns of `audit_partition_report`, before the code columns (REPORT_CODE_COLUMNS).
REPORT_BASE_COLUMNS: tuple[str, ...] = (
    "window_start", "window_end", "topic", "partition", "stage", "expected", "delivered", LOST, DUPLICATED,
    REORDERED, PENDING, "latency_p50_ms", "latency_p95_ms", "latency_p99_ms", "latency_max_ms", "status",
    "run_id", "computed_at",
)
REPORT_COLUMNS: tuple[str, ...] = REPORT_BASE_COLUMNS + REPORT_CODE_COLUMNS
ANOMALY_COLUMNS: tuple[str, ...] = ("window_start", "topic", "partition", "stage", "anomaly", "pid", "seq",
                                    "offset", "detail", "run_id", "computed_at")

# status of a report row: final once as_of >= window end + grace (its counts no longer change).
FINAL, PROVISIONAL = "final", "provisional"
REPORT_STATUSES: tuple[str, ...] = (FINAL, PROVISIONAL)

# ---------------------------------------------------------------------------- ledger and consumption
ACKED, FAILED, ABORTED = "acked", "failed", "aborted"
LEDGER_STATUSES: tuple[str, ...] = (ACKED, FAILED, ABORTED)
# A message with several ledger rows has the first of these statuses that one of them has.
LEDGER_STATUS_PRECEDENCE: tuple[str, ...] = (ABORTED, ACKED, FAILED)

PROCESSED, CONSUME_FAILED, DEAD_LETTERED = "processed", "failed", "dead_lettered"
# Written by the Java consumer interceptor (docs/design.md §3.4, §5.3): `handed` -- poll() gave the
# record to the application; `committed` -- the group committed this offset (the next to read) for
# the row's partition; pid/seq null. Not a record's outcome: the group stage reads it as g's
# committed offset, never matches it to the record at that offset.
HANDED, COMMITTED = "handed", "committed"
# Written by a share group's members (AuditedShareConsumer, docs/design.md §4.2, §5.9): `acquired` --
# a delivery (`attempt` = the broker's delivery count); `accepted` / `released` / `rejected` -- the
# member's acknowledgement of it, with `error` null when the broker took it, else its refusal.
ACQUIRED, ACCEPTED, RELEASED, REJECTED = "acquired", "accepted", "released", "rejected"
SHARE_ACKS: tuple[str, ...] = (ACCEPTED, RELEASED, REJECTED)
SHARE_OUTCOMES: tuple[str, ...] = (ACQUIRED, *SHARE_ACKS)
# A share group's `dead_lettered` row is no member's: reconcile adds one per record of the group's
# dead-letter topic (`dead_letter_records`, docs/design.md §4.2) naming a record, placed by its
# Kafka timestamp (`consumer` = the DLQ topic, `attempt` = its delivery count, `error` = its reason).
SHARE_ROW_OUTCOMES: tuple[str, ...] = (*SHARE_OUTCOMES, DEAD_LETTERED)
CONSUME_OUTCOMES: tuple[str, ...] = (PROCESSED, CONSUME_FAILED, DEAD_LETTERED, HANDED, COMMITTED, *SHARE_OUTCOMES)
# Evidence that a group processed a record (a group audited by the interceptor only vouches for
# the handover: its `delivered` reads "handed to the application").
PROCESSING_OUTCOMES: tuple[str, ...] = (PROCESSED, HANDED)


# ---------------------------------------------------------------------------- SLA rules
@dataclass(frozen=True)
class SlaRuleSpec:
    """One SLA rule: the observed value (a column of the report plus the SLA check's derived
    columns) it judges, which way (`max`: observed <= threshold; `min`: observed >= threshold),
    at which stage kinds, and what that measures."""

    name: str
    observed_column: str
    bound: str
    stage_kinds: tuple[str, ...]
    measures: str


SLA_RULE_SPECS: tuple[SlaRuleSpec, ...] = (
    SlaRuleSpec("max_lost", LOST, "max", STAGE_KINDS, "lost messages (report column `lost`)"),
    SlaRuleSpec("max_duplicate_ratio", "duplicate_ratio", "max", STAGE_KINDS,
                "duplicated / max(expected, 1)"),
    SlaRuleSpec("max_reordered", REORDERED, "max", (LOG, GROUP, MIRROR), "reordered messages (a sink has no order)"),
    SlaRuleSpec("max_p99_latency_ms", "latency_p99_ms", "max", STAGE_KINDS,
                "p99 latency from produce time, ms; null (nothing delivered) passes"),
    SlaRuleSpec("min_completeness", "completeness", "min", STAGE_KINDS,
                "(delivered + dead_lettered) / expected; null (expected 0) passes"),
    SlaRuleSpec("max_failed_sends", "failed_send", "max", (LOG,),
                "sends the producer was told failed that have no copy in the log (report column `failed_send`)"),
    SlaRuleSpec("max_redelivery_ratio", "redelivery_ratio", "max", (GROUP, SHARE),
                "redelivered / max(expected, 1)"),
)
SLA_RULES: tuple[str, ...] = tuple(r.name for r in SLA_RULE_SPECS)

ERROR, WARN = "error", "warn"
SLA_SEVERITIES: tuple[str, ...] = (ERROR, WARN)
# The status of one SLA check (a dashboard cell shows the worst): passed, failed at warn severity,
# failed at error severity.
PASS, FAIL = "pass", "fail"
SLA_CHECK_STATUSES: tuple[str, ...] = (PASS, WARN, FAIL)


# ---------------------------------------------------------------------------- exit codes
class ExitCode(IntEnum):
    """Exit codes of the CLI and of the spark-submit entry point."""

    OK = 0
    UNEXPECTED = 1  # a traceback; a scheduler may retry
    INPUT = 2  # bad config, topic, window, table, broker: one line on stderr
    SLA_FAILED = 3  # an error-severity SLA rule failed: alert, do not retry
    LAKE_BUSY = 4  # another writer holds the lake's writer lease: retry later
