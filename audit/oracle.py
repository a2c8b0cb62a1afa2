"""The reconciliation rules of docs/design.md §5, as plain Python: the readable statement of what each
anomaly code means, and the reference every engine is tested against row for row. Plain
dataclasses in, report rows + anomaly rows out.

This module must not import pyspark, read or write files, or look at the wall clock: it is a
pure function of its inputs and `as_of`. It imports only `audit.core` (the vocabulary -- codes,
statuses, detail texts --, read ranges, run ids, percentiles and report assembly). It is written
for clarity first, and it also runs in production: the kernel (`audit/rules/kernel.py`) settles
the ordinary messages of a window on Arrow columns and hands every other message to
`window_facts`, which classifies them exactly as it classifies a whole window; so its cost must
stay about linear in the rows.

Decisions where docs/design.md leaves a choice (the kernel implements exactly these):

Visibility (what one window's run reads; `L` = the topic's lookback, default one window)
- ledger rows: produce_ts in [window_start - L, window_end + grace); log records: natural time
  (produce_ts, else kafka_ts, else captured_at) in the same range. Copies of one message share
  their produce time, so a window always sees all its copies. Messages outside the window are
  context only: the lookback gives the order, gap and content-duplicate checks theirs; the grace
  after the window lets the order checks see a later batch a retried batch of the window landed
  behind.
- consumed_records: consume_ts in [window_start - L, window_end + grace + L); sink rows: sink_ts
  in the same range (or NULL). A message first processed later than that is judged unprocessed.
- group_offsets and partition_watermarks: every row of the topic (they are small).
- `as_of` does not filter inputs; it only decides grace (pending) and status (final/provisional).
- Log rows identical but for captured_at (a re-run capture) collapse into one record.

Units and windows
- A message is (topic, pid, seq); a record with missing/malformed audit headers is its own unit
  keyed by (partition, offset) at every stage (so unaudited records are still followed through
  groups and sinks; consumption and sink rows without pid/seq are matched to it by offset).
- Produce time of a unit: min ledger produce_ts, else min log produce_ts (header audit.ts), else
  min kafka_ts, else min captured_at, else min consume_ts, else min sink_ts. A unit belongs to the
  window containing its produce time; every anomaly of a unit is reported in that window.
- Ledger status of a message with several ledger rows: aborted > acked > failed; and a message
  whose acked row points at its own record in the log and that record is uncommitted is aborted
  (clients that cannot see a transaction's abort -- the Java interceptor, the librdkafka plugin --
  ledger such records `acked`; the log's abort marker says what became of them). Its acked row is
  the acked row with the lowest (partition, offset).
- The "original" copy of a message in the log is the committed copy at the acked (partition,
  offset) if there is one, else the lowest (partition, offset); every other committed copy is an
  extra (`duplicate_in_log`). Originals carry the message's partition/offset in group and sink
  anomalies.

Stage `log` (report partition: the acked partition for expected messages)
- expected = acked messages; delivered = acked messages with a committed copy.
- acked and no committed copy: `lost_acked` if some capture covered the offset (it read it:
  captured_from <= offset < captured_to, and log_start_offset <= offset < high_watermark; a
  snapshot without a captured range covers [log_start_offset, high_watermark)) and as_of >=
  produce time + grace;
  `unverifiable` if no capture covered it but a capture's log_start_offset is above it;
  otherwise it is counted as `pending` (report column only: the log stage has no pending code).
- a failed message (ledger status failed) with no committed copy: `failed_send` once as_of >=
  produce time + grace, on its first failed row's partition, offset null; none when its failed
  row's fingerprint is that of a message with a committed copy produced at or after it (a resend).
- `ghost_write` on the original copy of a failed message; `unledgered` on the original copy of a
  valid audited message without ledger row; `aborted` on every uncommitted record; `unaudited` on
  every record without valid headers (detail = header_error, or "missing audit headers").
- `reordered_in_log`: per (partition, pid), originals only (extras neither flagged nor raising
  the running maximum), in (offset, seq) order: seq lower than the maximum seq before it.
- `seq_gap`: per pid, seqs strictly between two consecutive seqs present in ledger or log; each
  missing seq belongs to the window of the next present seq (the one that reveals the gap).
  A gap of more than MAX_GAP_ROWS seqs is one row (seq = first missing, detail says how many).
- `content_duplicate`: among messages with a committed copy, grouped by the original copy's
  fingerprint and ordered by (produce time, pid, seq), every message but the first.
- ack latency = ack_ts - produce_ts of the acked row.

Stage `group:<g>` (unit: each distinct log record of the window; report partition: its own)
- expected = committed records; delivered = committed records processed at least once.
- Per record, g's outcomes in (consume_ts, consume_seq, consumer, offset, outcome, attempt, error)
  order (total: ties never depend on the rows' order). Not processed:
  `dead_lettered` if any outcome is dead_lettered; else `pending` within grace; else
  `retry_overdue` if g has only `failed` outcomes for it (detail: the last one's attempt,
  consumer and, when the row has one, error); else `expired_unconsumed` if offset < the highest log_start_offset captured; else `missed` if offset
  < g's committed offset (the latest captured one, or the highest `committed` row of g's consumer
  interceptor, whichever is higher); else `overdue`.
- "Processed" means a `processed` or a `handed` outcome (PROCESSING_OUTCOMES): a group audited by
  the Java consumer interceptor is judged on what poll() handed to the application. `committed`
  rows are not outcomes of a record; they only give g's committed offset.
- A committed record with no processed or dead_lettered outcome of g, whose unit has a row in a
  sink fed by g (sink config `group == g`; matched to the unit as the sink stage matches it, by
  (pid, seq), or by (partition, offset) for unaudited records), counts as processed by g: it is
  delivered, with no missed/overdue/pending/expired_unconsumed row, no redelivered row, and no
  produce-to-consume latency (no consume_ts). An exactly-once sink commits offsets and sink rows
  together, so a consumer killed before flushing its consumption rows leaves only this evidence.
- `redelivered`: one row per processing after the first (detail: "processing k of n by <consumer>").
- `reordered_in_consumption`: per (g, partition), over all processed outcomes visible, the first
  processing of an offset lower than the highest offset processed before it; reported on committed
  records only.
- `aborted_read`: one row per uncommitted record that g processed.
- produce-to-consume latency = first processing's consume_ts - produce time.
- Failover (docs/design.md §5.5): rows with a `cluster` count only for a group in that mirror's
  `failover_groups`; such a row with (pid, seq) of a message with a committed source copy counts as
  a row of the original (no order check); a later processing on the target is `redelivered` with
  the failover detail (mirror, F = the first visible target row). Resume offset per target
  partition = min(lowest target offset processed, latest target committed offset); failover
  position = 1 + the highest source offset whose first copy (same partition) is below it; a
  record never processed, below it, and not caught by the checks above `overdue`, is `missed`
  with the failover detail. The other visible rows with a `cluster` (a group not declared for that
  mirror, or a cluster naming no mirror of the topic) are not used, and are counted per (group,
  cluster) in `ignored_mirror_rows` (every outcome, `committed` rows included) for the run summary.

Stage `sink:<s>` (unit: message, or unaudited record; fed by group g, or by the committed log
when the sink has no group; report partition: the original copy's)
- expected = units with a committed copy that g processed (any copy); delivered = expected units
  with a sink row.
- `unexpected_in_sink`: every sink row of a unit with no committed copy visible (partition =
  the row's audit partition, -1 if NULL).
- `duplicate_in_sink`: sink rows of a unit with a committed copy, ordered by (sink_ts, offset,
  partition), every row but the first (detail "copy k of n", offset = that row's audit offset).
- expected and no sink row: `pending` within grace, else `missing_in_sink`.
- produce-to-sink latency = earliest sink_ts - produce time.
- a sink row without pid/seq and without partition/offset names no unit (a coordinates sink's
  row with null coordinates): counted in `quarantined_ledger_rows` in the window of its sink_ts,
  or in every window that reads it when it has none; never a unit.
- dead-letter rows (`dead_letter`: a record of the sink's dead-letter topic naming the unit's
  source record) are not sink rows: an expected unit with no sink row and a dead-letter row is
  `dead_lettered` (accounted for; pending/missing never apply). A dead-letter row of a unit with
  no committed copy visible (a position the log never held) is counted in
  `quarantined_ledger_rows`, never `unexpected_in_sink`. A group's "in a sink it feeds" fallback
  takes sink rows only.

Stage `share:<g>` (a share group, KIP-932; unit: each distinct log record of the window, like a
group; report partition: its own). g's rows are `acquired` (a delivery; `attempt` = the broker's
delivery count) and `accepted` / `released` / `rejected` (an acknowledgement; `error` null when the
broker took it), in the order of a group's outcomes, and `dead_lettered` (a record of g's
dead-letter topic naming it, `consumer` = that topic, `error` = its reason; never a member's row).
A row of g with any other outcome is not used and counted as quarantined (with the ledger's), and so
is a `dead_lettered` row naming a position the log never held (in the window of its consume_ts).
- expected = committed records; delivered = committed records with an `accepted` the broker took.
  Uncommitted records are not expected (nothing is reported for them at this stage).
- `redelivered`: one row per acquisition after the first ("delivery k of n to <consumer>"): normal
  queue behaviour, in no total; the SLA rule max_redelivery_ratio bounds it.
- `processed_twice`: when delivered, one row per `accepted` row after the first, taken or refused
  (a member whose lock expired still processed the record): "accept k of n, by <consumer>".
- Not delivered: `dead_lettered` if g has a `dead_lettered` row of it (the broker dead-letters a
  record a member rejected and one archived at the delivery limit; the first row's topic and reason
  in the detail); else `rejected` if a `rejected` the broker took (its consumer and delivery count in the
  detail); else `archived_unprocessed` if an acquisition's delivery count reached the group's
  `delivery_count_limit` and either g's last row of the record is a `released` the broker took or
  as_of >= produce time + grace (its lock has long expired); else `pending` within grace; else
  `overdue`, except that a record past grace that no member of g was handed (no `acquired` row of g)
  and whose offset is below g's share-partition start offset at the latest capture of its partition
  (`share_offsets`; a null start offset is none) is `missed`: the broker will never hand it out (the
  group's offsets were moved past it, retention removed it, or it predates the group, which starts
  at the log end by default).
- produce-to-consume latency = the first acquisition's consume_ts (else the first row's) - produce time.

Report rows: one per (stage, partition) for every partition of the topic in
partition_watermarks and every partition a unit or anomaly of that stage has in the window.
lost/duplicated/reordered/pending follow docs/design.md §5; the stage's own code columns hold row counts
(0 when none), other stages' code columns are NULL. Percentiles are Spark's exact `percentile`
(linear interpolation between closest ranks). status = final iff as_of >= window_end + grace.
run_id = stable hash of (topic, window_start, as_of); computed_at = as_of.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from datetime import datetime, timedelta
from operator import attrgetter
from typing import Any, Generic, TypeVar

from audit.core.config import ShareGroupConfig, TopicConfig
from audit.core.failover import Failover, failover_instant, failover_pairs
from audit.core.percentiles import latency_columns
from audit.core.report import assemble_report, code_counts
from audit.core.vocabulary import (
    ABORTED,
    ACCEPTED,
    ACKED,
    ACQUIRED,
    COMMITTED,
    CONSUME_FAILED,
    DEAD_LETTERED,
    FAILED,
    LEDGER_STATUS_PRECEDENCE,
    LEDGER_STATUSES,
    LOG,
    MAX_GAP_ROWS,
    PROCESSING_OUTCOMES,
    REJECTED,
    RELEASED,
    SHARE_ROW_OUTCOMES,
    detail,
    group_stage,
    mirror_stage,
    share_stage,
    sink_stage,
    stage_kind,
)
from audit.core.windows import EPOCH, read_ranges, run_id_for

_MS = timedelta(milliseconds=1)


# ---------------------------------------------------------------------------- inputs
@dataclass(frozen=True)
class LedgerRow:
    pid: str
    seq: int
    partition: int
    offset: int | None
    status: str
    produce_ts: datetime
    ack_ts: datetime | None = None
    topic: str = "t"
    producer: str | None = None
    error: str | None = None
    txn_id: str | None = None
    fingerprint: str | None = None  # of a failed send's content, where the client records it


@dataclass(frozen=True)
class LogRecord:
    partition: int
    offset: int
    pid: str | None
    seq: int | None
    produce_ts: datetime | None
    kafka_ts: datetime | None
    captured_at: datetime
    fingerprint: str | None = None
    committed: bool = True
    header_error: str | None = None
    topic: str = "t"


@dataclass(frozen=True)
class ConsumedRow:
    group: str
    consumer: str
    consume_seq: int
    partition: int
    offset: int
    pid: str | None
    seq: int | None
    outcome: str
    consume_ts: datetime
    attempt: int = 1
    topic: str = "t"
    error: str | None = None  # the handler's error of a failed / dead_lettered outcome
    cluster: str | None = None  # the mirror whose target copy it was consumed from; None: the audited cluster
    # the message's produce time from its audit headers, as the consumer wrote it: carried, never
    # used by a rule (every latency is from the ledger's produce time)
    produce_ts: datetime | None = None


@dataclass(frozen=True)
class GroupOffset:
    group: str
    partition: int
    committed_offset: int | None
    captured_at: datetime
    topic: str = "t"


@dataclass(frozen=True)
class ShareOffset:
    """A capture's snapshot of a share group's share-partition start offset (`share_offsets`)."""

    group: str
    partition: int
    start_offset: int | None
    captured_at: datetime
    topic: str = "t"


@dataclass(frozen=True)
class Watermark:
    partition: int
    log_start_offset: int
    high_watermark: int
    captured_at: datetime
    topic: str = "t"
    captured_from: int | None = None  # the offsets the capture read; None: [log start, high watermark)
    captured_to: int | None = None

    def covers(self, offset: int) -> bool:
        """The capture read this offset and the log still held it."""
        lo = self.log_start_offset if self.captured_from is None else max(self.log_start_offset, self.captured_from)
        hi = self.high_watermark if self.captured_to is None else min(self.high_watermark, self.captured_to)
        return lo <= offset < hi


@dataclass(frozen=True)
class SinkRow:
    partition: int | None
    offset: int | None
    pid: str | None
    seq: int | None
    sink_ts: datetime | None
    topic: str = "t"
    produce_ts: datetime | None = None  # the optional audit_produce_ts column: carried, never used by a rule
    # a record of the sink connector's dead-letter topic naming this position (its
    # __connect.errors.* headers, sinks[].dead_letter_topic), not a row of the sink table
    dead_letter: bool = False


@dataclass(frozen=True)
class MirrorRecord(LogRecord):
    """A record of the topic's copy on a mirror's target cluster (`mirror_records`): `topic` is the
    audited (source) topic, partition and offset are the target's."""

    mirror: str = field(kw_only=True)


@dataclass(frozen=True)
class MirrorWatermark(Watermark):
    """A capture's snapshot of a target partition of a mirror (`mirror_watermarks`)."""

    mirror: str = field(kw_only=True)


@dataclass(frozen=True)
class MirrorGroupOffset(GroupOffset):
    """A capture's snapshot of a group's committed offset on a mirror's target cluster
    (`mirror_group_offsets`): `topic` is the audited topic, `partition` the target's."""

    mirror: str = field(kw_only=True)


@dataclass
class Inputs:
    ledger: Sequence[LedgerRow] = ()
    log: Sequence[LogRecord] = ()
    consumed: Sequence[ConsumedRow] = ()
    group_offsets: Sequence[GroupOffset] = ()
    watermarks: Sequence[Watermark] = ()
    sinks: Mapping[str, Sequence[SinkRow]] = field(default_factory=dict)
    mirror_log: Sequence[MirrorRecord] = ()
    mirror_watermarks: Sequence[MirrorWatermark] = ()
    mirror_group_offsets: Sequence[MirrorGroupOffset] = ()
    share_offsets: Sequence[ShareOffset] = ()


def log_start_offsets(topic: str, watermarks: Iterable[Watermark]) -> dict[int, int]:
    """Per partition of `topic`, the highest log start offset captured: a record below it is gone."""
    out: dict[int, int] = {}
    for w in watermarks:
        if w.topic == topic:
            out[w.partition] = max(out.get(w.partition, w.log_start_offset), w.log_start_offset)
    return out


def committed_offsets(topic: str, group_offsets: Iterable[GroupOffset],
                      consumed: Iterable[ConsumedRow]) -> dict[tuple[str, int], int | None]:
    """Per (group, partition) of `topic`, the group's committed offset: the latest captured one, or
    the highest `committed` row in `consumed` (the consumer interceptor's onCommit: the group's own
    word on it, not an outcome of the record at that offset), whichever is higher."""
    out: dict[tuple[str, int], int | None] = {}
    for go in sorted((go for go in group_offsets if go.topic == topic),
                     key=lambda go: (go.captured_at, -1 if go.committed_offset is None else go.committed_offset)):
        out[(go.group, go.partition)] = go.committed_offset
    for c in consumed:
        if c.outcome == COMMITTED and c.topic == topic:
            known = out.get((c.group, c.partition))
            out[(c.group, c.partition)] = c.offset if known is None else max(known, c.offset)
    return out


def start_offsets(topic: str, rows: Iterable[ShareOffset]) -> dict[tuple[str, int], int]:
    """(share group, partition) -> its start offset at the latest capture that holds one (of `topic`)."""
    latest: dict[tuple[str, int], ShareOffset] = {}
    for so in rows:
        if so.topic == topic and ((prev := latest.get((so.group, so.partition))) is None
                                  or so.captured_at >= prev.captured_at):
            latest[(so.group, so.partition)] = so
    return {k: so.start_offset for k, so in latest.items() if so.start_offset is not None}


@dataclass
class OracleResult:
    report: list[dict[str, Any]]
    anomalies: list[dict[str, Any]]
    quarantined_ledger_rows: int
    # (group, cluster) -> visible consumption rows read on a mirror the group does not fail over to
    # (or on a cluster that names no mirror of the topic): left out of the judgement, counted (§5.5)
    ignored_mirror_rows: dict[tuple[str, str], int] = field(default_factory=dict)


# ---------------------------------------------------------------------------- helpers
def _ms(later: datetime, earlier: datetime) -> float:
    return (later - earlier) / _MS


def _log_time(r: LogRecord) -> datetime:
    return r.produce_ts or r.kafka_ts or r.captured_at


def _identity(cls: type) -> Any:
    """A record's fields but `captured_at`, as a tuple: two captures of one record share it."""
    return attrgetter(*(f.name for f in fields(cls) if f.name != "captured_at"))


_LOG_IDENTITY = _identity(LogRecord)
_MIRROR_IDENTITY = _identity(MirrorRecord)


def _valid(r: LogRecord) -> bool:
    return r.header_error is None and r.pid is not None and r.seq is not None


Key = tuple[str, Any, Any]
_T = TypeVar("_T")


class _kept(Generic[_T]):
    """A property computed on its first read and kept in the instance: `functools.cached_property`
    without the lock Python 3.11 takes on every first read (with it, the oracle took several per
    cent longer; docs/benchmarks.md)."""

    def __init__(self, fn: Callable[[Any], _T]) -> None:
        self.fn = fn
        self.name = fn.__name__

    def __get__(self, obj: Any, cls: Any = None) -> _T:
        if obj is None:  # read on the class (documentation tools)
            return self  # type: ignore[return-value]
        value = obj.__dict__[self.name] = self.fn(obj)  # later reads find it in the instance
        return value


def _key(pid: str | None, seq: int | None, partition: int | None, offset: int | None) -> Key:
    if pid is not None and seq is not None:
        return ("m", pid, seq)
    return ("o", partition, offset)


@dataclass
class _Unit:
    """Every tier's rows of one unit. What is derived from them (produce time, status, the acked row,
    the committed copies, the original, the extras) is computed on its first read and kept, so read
    it only once the rows it derives from are all in: the ledger and log rows before `original` (the
    failover step reads it while it still adds consumption rows), every tier before `produce_time`."""

    key: Key
    ledger: list[LedgerRow] = field(default_factory=list)
    log: list[LogRecord] = field(default_factory=list)
    consumed: list[tuple[ConsumedRow, bool]] = field(default_factory=list)  # (row, reorder flag)
    sinks: dict[str, list[SinkRow]] = field(default_factory=lambda: defaultdict(list))

    @_kept
    def produce_time(self) -> datetime | None:
        tiers: list[Iterable[datetime | None]] = [
            (r.produce_ts for r in self.ledger), (r.produce_ts for r in self.log),
            (r.kafka_ts for r in self.log), (r.captured_at for r in self.log),
            (c.consume_ts for c, _ in self.consumed),
            (s.sink_ts for rows in self.sinks.values() for s in rows),
        ]
        for tier in tiers:
            present = [t for t in tier if t is not None]
            if present:
                return min(present)
        return None

    @_kept
    def status(self) -> str | None:
        statuses = {r.status for r in self.ledger}
        for s in LEDGER_STATUS_PRECEDENCE:
            if s in statuses:
                if s == ACKED and (ack := self.acked_row) is not None and any(
                        not r.committed and (r.partition, r.offset) == (ack.partition, ack.offset) for r in self.log):
                    return ABORTED  # its own record at the acked offset is uncommitted: its transaction aborted
                return s
        return None

    @_kept
    def acked_row(self) -> LedgerRow | None:
        acked = [r for r in self.ledger if r.status == ACKED]
        return min(acked, key=lambda r: (r.partition, r.offset or 0)) if acked else None

    @_kept
    def committed_copies(self) -> list[LogRecord]:
        return sorted((r for r in self.log if r.committed), key=lambda r: (r.partition, r.offset))

    @_kept
    def original(self) -> LogRecord | None:
        copies = self.committed_copies
        ack = self.acked_row
        if ack is not None:
            for r in copies:
                if (r.partition, r.offset) == (ack.partition, ack.offset):
                    return r
        return copies[0] if copies else None

    @_kept
    def extras(self) -> list[LogRecord]:
        orig = self.original
        return [r for r in self.committed_copies if r is not orig]


# ---------------------------------------------------------------------------- checks that need neighbours
# Each reads one narrow row per message (or per processing) of the window's reach, not a unit's
# tiers: what the kernel (`audit/rules/`), which settles most messages on columns, still has to
# hand them for every message. `reconcile_window` builds the rows and turns what they find into
# anomaly rows.


@dataclass(frozen=True)
class Narrow:
    """What the checks that need neighbours read of one message (pid, seq)."""

    pid: str
    seq: int
    present: bool  # it has a ledger row or a log record: its seq counts for the gap check
    partition: int | None  # its original copy's (partition, offset); None without a committed copy
    offset: int | None
    fingerprint: str | None  # its original copy's
    produce_time: datetime | None
    in_window: bool


def _consume_order(c: ConsumedRow) -> tuple[Any, ...]:
    """A processing's place in its consumer's order: (consume time, consume seq, consumer), then its
    offset and outcome, so that the order is total (a missing consume seq or consumer sorts first)."""
    return (c.consume_ts, _int_key(c.consume_seq), c.consumer or "", c.offset, c.outcome, c.attempt, c.error or "")


def reordered_in_consumption(processings: Iterable[ConsumedRow]) -> Iterator[ConsumedRow]:
    """Per (group, partition), processings in `_consume_order`: each first
    processing of an offset lower than the highest offset processed before it."""
    by_gp: dict[tuple[str, int], list[ConsumedRow]] = defaultdict(list)
    for c in processings:
        by_gp[(c.group, c.partition)].append(c)
    for procs in by_gp.values():
        seen: set[int] = set()
        high: int | None = None
        for c in sorted(procs, key=_consume_order):
            if c.offset not in seen and high is not None and c.offset < high:
                yield c
            seen.add(c.offset)
            high = c.offset if high is None else max(high, c.offset)


def reordered_in_log(messages: Iterable[Narrow]) -> Iterator[tuple[Narrow, int]]:
    """Per (partition, pid), originals in (offset, seq) order: (message, the highest seq before it)
    for each message of the window whose seq is lower than that."""
    per_ppid: dict[tuple[int, str], list[Narrow]] = defaultdict(list)
    for n in messages:
        if n.partition is not None:
            per_ppid[(n.partition, n.pid)].append(n)
    for originals in per_ppid.values():
        high: int | None = None
        for n in sorted(originals, key=attrgetter("offset", "seq")):
            if high is not None and n.seq < high and n.in_window:
                yield n, high
            high = n.seq if high is None else max(high, n.seq)


def seq_gaps(messages: Iterable[Narrow]) -> Iterator[tuple[str, int, int]]:
    """Per pid, (pid, a, b) for consecutive present seqs a < b with b - a > 1 whose b is in the
    window (a gap belongs to the window of the seq that reveals it)."""
    present: dict[str, list[Narrow]] = defaultdict(list)
    for n in messages:
        if n.present:
            present[n.pid].append(n)
    for pid, ns in present.items():
        ns.sort(key=attrgetter("seq"))
        for before, nxt in zip(ns, ns[1:], strict=False):
            if nxt.seq - before.seq > 1 and nxt.in_window:
                yield pid, before.seq, nxt.seq


def content_duplicates(messages: Iterable[Narrow]) -> Iterator[tuple[Narrow, Narrow]]:
    """Messages whose original copies share a fingerprint, in (produce time, pid, seq) order: (message,
    the first one) for every message of the window but the first."""
    by_fp: dict[str, list[Narrow]] = defaultdict(list)
    for n in messages:
        if n.partition is not None and n.fingerprint is not None:
            by_fp[n.fingerprint].append(n)
    for ns in by_fp.values():
        ns.sort(key=lambda n: (n.produce_time, n.pid, n.seq))
        for n in ns[1:]:
            if n.in_window:
                yield n, ns[0]


def resent(resendable: Iterable[tuple[dict[str, Any], str, datetime]], messages: Iterable[Narrow]) -> list[dict[str, Any]]:
    """The `failed_send` rows (of `Facts.resendable`) whose content a message with a committed copy
    holds, produced at or after the failed send: the application resent it."""
    latest: dict[str, datetime] = {}
    for n in messages:
        if n.partition is not None and n.fingerprint is not None and n.produce_time is not None:
            latest[n.fingerprint] = max(n.produce_time, latest.get(n.fingerprint, n.produce_time))
    return [row for row, fp, pt in resendable if fp in latest and latest[fp] >= pt]


def without(anomalies: list[dict[str, Any]], rows: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """`anomalies` without `rows` (the same objects)."""
    gone = {id(r) for r in rows}
    return [a for a in anomalies if id(a) not in gone]


# ---------------------------------------------------------------------------- the classifier
def reconcile_window(tc: TopicConfig, window_start: datetime, as_of: datetime, inputs: Inputs) -> OracleResult:
    """Classify one (topic, window) as of `as_of`: report rows and anomaly rows (docs/design.md §5)."""
    return window_report(tc, window_start, as_of, window_facts(tc, window_start, as_of, inputs))


@dataclass
class Facts:
    """What a window's report is assembled from (`window_report`): anomaly rows, and per (stage,
    partition) the unit counts and latencies; with the quarantined and ignored rows, the partitions
    the watermarks know, and each message's narrow row (what the checks that need neighbours read)."""

    anomalies: list[dict[str, Any]]
    counts: dict[tuple[str, int], dict[str, int]]
    latencies: dict[tuple[str, int], list[float]]
    partitions: set[int]
    quarantined: int
    ignored: dict[tuple[str, str], int]
    narrow: list[Narrow]
    # the `failed_send` rows whose send has a fingerprint, each with it and the send's produce time:
    # a later original with that fingerprint is its resend (`resent`), which takes the row back
    resendable: list[tuple[dict[str, Any], str, datetime]] = field(default_factory=list)


def window_report(tc: TopicConfig, window_start: datetime, as_of: datetime, facts: Facts) -> OracleResult:
    """The report rows of `facts` (its latencies' percentiles), with its anomaly rows."""
    stats = {k: {**v, **latency_columns(facts.latencies.get(k, []))} for k, v in facts.counts.items()}
    report = assemble_report(tc, window_start, as_of, facts.partitions, stats, code_counts(facts.anomalies))
    return OracleResult(report, facts.anomalies, facts.quarantined, dict(facts.ignored))


def window_facts(tc: TopicConfig, window_start: datetime, as_of: datetime, inputs: Inputs, *,
                 reordered: set[int] | None = None, neighbours: bool = True) -> Facts:
    """Every rule of docs/design.md §5 on one (topic, window). `reordered`: the `id()`s of the rows of
    `inputs.consumed` flagged by the order of consumption, when the caller ran it over more rows
    than `inputs` holds; `neighbours=False` leaves the log order, gap and content checks to the
    caller (the narrow rows are still returned), for the same reason."""
    topic = tc.name
    ws, we = window_start, window_start + tc.window
    rr = read_ranges(tc, window_start)
    grace = tc.grace

    # --- read: visibility and quarantine
    quarantined = 0
    ledger: list[LedgerRow] = []
    for lr in inputs.ledger:
        if lr.topic != topic or not (rr.message_lo <= lr.produce_ts < rr.message_hi):
            continue
        if lr.status not in LEDGER_STATUSES or (lr.status == ACKED and (lr.offset is None or lr.partition < 0)):
            quarantined += 1
            continue
        ledger.append(lr)
    log_seen: dict[tuple[Any, ...], LogRecord] = {}
    for r in inputs.log:
        if r.topic == topic and rr.message_lo <= _log_time(r) < rr.message_hi:
            # a re-run capture may hold the same record twice; keep its first capture
            k = _LOG_IDENTITY(r)
            prev = log_seen.get(k)
            if prev is None or r.captured_at < prev.captured_at:
                log_seen[k] = r
    consumed = [c for c in inputs.consumed if c.topic == topic and c.group in tc.consuming_groups
                and rr.event_lo <= c.consume_ts < rr.event_hi]
    # a share group's row with an outcome no share member writes (nor its dead-letter topic) is not
    # used: counted (§5.9)
    shares = {g.name for g in tc.share_groups}
    bad_share = [c for c in consumed if c.group in shares and c.outcome not in SHARE_ROW_OUTCOMES]
    quarantined += len(bad_share)
    if bad_share:
        consumed = [c for c in consumed if not (c.group in shares and c.outcome not in SHARE_ROW_OUTCOMES)]
    # rows consumed from a mirror's target copy count only for a group declared to fail over to it
    # (mirrors[].failover_groups); their partition/offset are the target's, so they are matched to
    # the source record by the message's identity below, and take no part in the order check.
    failover_to = failover_pairs(tc)
    target_rows = [c for c in consumed if c.cluster is not None and (c.cluster, c.group) in failover_to]
    ignored: dict[tuple[str, str], int] = defaultdict(int)  # the others: counted, said in the run summary
    for c in consumed:
        if c.cluster is not None and (c.cluster, c.group) not in failover_to:
            ignored[(c.group, c.cluster)] += 1
    consumed = [c for c in consumed if c.cluster is None]
    sink_rows = {s.name: [r for r in inputs.sinks.get(s.name, ()) if r.topic == topic
                          and (r.sink_ts is None or rr.event_lo <= r.sink_ts < rr.event_hi)] for s in tc.sinks}
    watermarks = [w for w in inputs.watermarks if w.topic == topic]
    max_lso = log_start_offsets(topic, watermarks)
    committed_offset = committed_offsets(topic, inputs.group_offsets, consumed)
    consumed = [c for c in consumed if c.outcome != COMMITTED]

    # --- order of consumption, per (group, partition): flags first processings that go backwards
    reorder = reordered if reordered is not None else {
        id(c) for c in reordered_in_consumption(c for c in consumed if c.outcome in PROCESSING_OUTCOMES)}

    # --- gather every tier of a unit under its key
    units: dict[Key, _Unit] = {}

    def unit(k: Key) -> _Unit:
        u = units.get(k)
        if u is None:
            u = units[k] = _Unit(k)
        return u

    for lr in ledger:
        unit(("m", lr.pid, lr.seq)).ledger.append(lr)
    for r in log_seen.values():
        if _valid(r):
            unit(("m", r.pid, r.seq)).log.append(r)
        else:
            unit(("o", r.partition, r.offset)).log.append(r)
    for c in consumed:
        unit(_key(c.pid, c.seq, c.partition, c.offset)).consumed.append((c, id(c) in reorder))
    for name, srows in sink_rows.items():
        for s in srows:
            if (s.pid is None or s.seq is None) and (s.partition is None or s.offset is None):
                # names no message and no record (null coordinates, docs/design.md §4.2): counted in
                # the window of its sink time, or in every window that reads it when it has none
                if s.sink_ts is None or ws <= s.sink_ts < we:
                    quarantined += 1
                continue
            unit(_key(s.pid, s.seq, s.partition, s.offset)).sinks[name].append(s)
    failover = _failover(tc, inputs, rr, target_rows, units)
    for c in target_rows:
        if c.outcome == COMMITTED or c.pid is None or c.seq is None:
            continue
        tu = units.get(("m", c.pid, c.seq))
        if tu is None or tu.original is None:
            continue  # no committed source copy visible: no identity to follow across clusters
        torig = tu.original
        tu.consumed.append((replace(c, partition=torig.partition, offset=torig.offset), False))

    def in_window(u: _Unit) -> bool:
        pt = u.produce_time
        return pt is not None and ws <= pt < we

    anomalies: list[dict[str, Any]] = []
    resendable: list[tuple[dict[str, Any], str, datetime]] = []
    # (stage, partition) -> counters / latencies
    counts: dict[tuple[str, int], dict[str, int]] = defaultdict(lambda: defaultdict(int))
    latencies: dict[tuple[str, int], list[float]] = defaultdict(list)

    emit = anomaly_emitter(anomalies, topic, ws, as_of)

    messages = [u for u in units.values() if u.key[0] == "m"]
    window_units = [u for u in units.values() if in_window(u)]

    # --- stage log
    for u in window_units:
        pt = u.produce_time
        assert pt is not None
        pid, seq = (u.key[1], u.key[2]) if u.key[0] == "m" else (None, None)
        copies, orig = u.committed_copies, u.original
        if u.key[0] == "m":
            status, ack = u.status, u.acked_row
            if status == ACKED and ack is not None:
                p, o = ack.partition, ack.offset
                lc = counts[(LOG, p)]
                lc["expected"] += 1
                if ack.ack_ts is not None:
                    latencies[(LOG, p)].append(_ms(ack.ack_ts, ack.produce_ts))
                if copies:
                    lc["delivered"] += 1
                else:
                    assert o is not None
                    covered = any(w.partition == p and w.covers(o) for w in watermarks)
                    if covered and as_of >= pt + grace:
                        emit(LOG, "lost_acked", p, pid, seq, o)
                    elif not covered and max_lso.get(p, -1) > o:
                        emit(LOG, "unverifiable", p, pid, seq, o)
                    else:
                        lc["pending"] += 1
            if status == FAILED and orig is not None:
                emit(LOG, "ghost_write", orig.partition, pid, seq, orig.offset)
            if status == FAILED and orig is None and as_of >= pt + grace:
                emit(LOG, "failed_send", min((lr.produce_ts, lr.partition) for lr in u.ledger)[1], pid, seq, None)
                fp = next((lr.fingerprint for lr in sorted(u.ledger, key=lambda lr: lr.produce_ts)
                           if lr.status == FAILED and lr.fingerprint is not None), None)
                if fp is not None:
                    resendable.append((anomalies[-1], fp, pt))
            if status is None and orig is not None:
                emit(LOG, "unledgered", orig.partition, pid, seq, orig.offset)
            for x in u.extras:
                assert orig is not None
                emit(LOG, "duplicate_in_log", x.partition, pid, seq, x.offset,
                     orig_partition=orig.partition, orig_offset=orig.offset)
        for r in sorted(u.log, key=lambda r: (r.partition, r.offset)):
            if not _valid(r):
                emit(LOG, "unaudited", r.partition, r.pid, r.seq, r.offset, header_error=r.header_error)
            if not r.committed:
                emit(LOG, "aborted", r.partition, pid if pid is not None else r.pid,
                     seq if seq is not None else r.seq, r.offset)

    # --- the checks that need neighbours, over one narrow row per message
    narrow = []
    for u in messages:
        orig = u.original
        narrow.append(Narrow(u.key[1], u.key[2], bool(u.ledger or u.log), None if orig is None else orig.partition,
                             None if orig is None else orig.offset, None if orig is None else orig.fingerprint,
                             u.produce_time, in_window(u)))
    if neighbours:
        emit_neighbour_rows(emit, ((nr.pid, nr.seq, nr.partition, nr.offset, high) for nr, high in reordered_in_log(narrow)),
                            seq_gaps(narrow),
                            ((nr.pid, nr.seq, nr.partition, nr.offset, first.pid, first.seq)
                             for nr, first in content_duplicates(narrow)))
        anomalies[:] = without(anomalies, resent(resendable, narrow))
        resendable = []

    # --- stage group:<g>
    for g in tc.groups:
        stage = group_stage(g)
        fed_sinks = [s.name for s in tc.sinks if s.group == g]
        for u in window_units:
            pt = u.produce_time
            assert pt is not None
            pid, seq = (u.key[1], u.key[2]) if u.key[0] == "m" else (None, None)
            for r in sorted(u.log, key=lambda r: (r.partition, r.offset)):
                rpid = pid if pid is not None else r.pid
                rseq = seq if seq is not None else r.seq
                outs = sorted(((c, f) for c, f in u.consumed
                               if c.group == g and (c.partition, c.offset) == (r.partition, r.offset)),
                              key=lambda cf: _consume_order(cf[0]))
                processed = [(c, f) for c, f in outs if c.outcome in PROCESSING_OUTCOMES]
                if not r.committed:
                    if processed:
                        emit(stage, "aborted_read", r.partition, rpid, rseq, r.offset)
                    continue
                cnt = counts[(stage, r.partition)]
                cnt["expected"] += 1
                if processed:
                    cnt["delivered"] += 1
                    latencies[(stage, r.partition)].append(_ms(processed[0][0].consume_ts, pt))
                    n = len(processed)
                    for i, (c, _) in enumerate(processed[1:], start=2):
                        if c.cluster is None:
                            emit(stage, "redelivered", r.partition, rpid, rseq, r.offset, k=i, n=n,
                                 consumer=c.consumer)
                        else:
                            emit(stage, "redelivered", r.partition, rpid, rseq, r.offset, "failover", k=i, n=n,
                                 consumer=c.consumer, mirror=c.cluster,
                                 failover_at=failover_instant(failover[(g, c.cluster)].at))
                    if any(f for _, f in processed):
                        emit(stage, "reordered_in_consumption", r.partition, rpid, rseq, r.offset)
                elif any(c.outcome == DEAD_LETTERED for c, _ in outs):
                    emit(stage, "dead_lettered", r.partition, rpid, rseq, r.offset)
                elif any(not row.dead_letter for name in fed_sinks for row in u.sinks.get(name, ())):
                    cnt["delivered"] += 1  # in a sink g feeds: processed, consumption row never flushed
                elif as_of < pt + grace:
                    emit(stage, "pending", r.partition, rpid, rseq, r.offset)
                elif failed := [c for c, _ in outs if c.outcome == CONSUME_FAILED]:
                    # a retry is pending and never reached a final outcome: not `missed`
                    last = failed[-1]
                    emit(stage, "retry_overdue", r.partition, rpid, rseq, r.offset,
                         None if last.error is None else "error",
                         attempt=last.attempt, consumer=last.consumer, error=last.error)
                elif r.offset < max_lso.get(r.partition, -1):
                    emit(stage, "expired_unconsumed", r.partition, rpid, rseq, r.offset)
                elif (co := committed_offset.get((g, r.partition))) is not None and r.offset < co:
                    emit(stage, "missed", r.partition, rpid, rseq, r.offset, committed_offset=co)
                elif skip := next((f for (fg, _), f in sorted(failover.items())
                                   if fg == g and r.offset < f.position.get(r.partition, -1)), None):
                    emit(stage, "missed", r.partition, rpid, rseq, r.offset, "failover", mirror=skip.mirror,
                         failover_at=failover_instant(skip.at), resume_offset=skip.resume[r.partition])
                else:
                    emit(stage, "overdue", r.partition, rpid, rseq, r.offset)

    # --- stage share:<g>
    spso = start_offsets(topic, inputs.share_offsets) if tc.share_groups else {}
    for sg in tc.share_groups:
        stage = share_stage(sg.name)
        for u in window_units:
            pt = u.produce_time
            assert pt is not None
            pid, seq = (u.key[1], u.key[2]) if u.key[0] == "m" else (None, None)
            if not any(r.committed for r in u.log):
                # a record of g's dead-letter topic naming a position the log never held: counted
                quarantined += sum(c.group == sg.name and c.outcome == DEAD_LETTERED for c, _ in u.consumed)
            for r in sorted(u.log, key=lambda r: (r.partition, r.offset)):
                if not r.committed:
                    continue
                rpid = pid if pid is not None else r.pid
                rseq = seq if seq is not None else r.seq
                share_facts(emit, stage, sg, r.partition, r.offset, rpid, rseq, pt, as_of, grace,
                            [c for c, _ in u.consumed if c.group == sg.name
                             and (c.partition, c.offset) == (r.partition, r.offset)],
                            counts[(stage, r.partition)], latencies[(stage, r.partition)],
                            spso.get((sg.name, r.partition)))

    # --- stage sink:<s>
    for sink in tc.sinks:
        stage = sink_stage(sink.name)
        for u in window_units:
            pt = u.produce_time
            assert pt is not None
            srows = [r for r in u.sinks.get(sink.name, []) if not r.dead_letter]
            dead = len(u.sinks.get(sink.name, [])) - len(srows)  # its dead-letter rows
            sorig = u.original
            if sorig is None:
                quarantined += dead  # a dead-letter record naming a position the log never held
                for row in srows:
                    emit(stage, "unexpected_in_sink", row.partition if row.partition is not None else -1,
                         row.pid, row.seq, row.offset)
                continue
            pid, seq = (u.key[1], u.key[2]) if u.key[0] == "m" else (sorig.pid, sorig.seq)
            p = sorig.partition
            if sink.group is None:
                expected = True
            else:
                coords = {(r.partition, r.offset) for r in u.committed_copies}
                expected = any(c.group == sink.group and c.outcome in PROCESSING_OUTCOMES and (c.partition, c.offset) in coords
                               for c, _ in u.consumed)
            scnt = counts[(stage, p)]
            if expected:
                scnt["expected"] += 1
            if srows:
                ordered = sorted(srows, key=lambda r: (_ts_key(r.sink_ts), _int_key(r.offset), _int_key(r.partition)))
                if expected:
                    scnt["delivered"] += 1
                    ts = [r.sink_ts for r in srows if r.sink_ts is not None]
                    if ts:
                        latencies[(stage, p)].append(_ms(min(ts), pt))
                n = len(ordered)
                for i, row in enumerate(ordered[1:], start=2):
                    emit(stage, "duplicate_in_sink", p, pid, seq, row.offset, k=i, n=n)
            elif expected:
                if dead:
                    emit(stage, "dead_lettered", p, pid, seq, sorig.offset)
                elif as_of < pt + grace:
                    emit(stage, "pending", p, pid, seq, sorig.offset)
                else:
                    emit(stage, "missing_in_sink", p, pid, seq, sorig.offset)

    # --- stage mirror:<m>
    for m in tc.mirrors:
        stage = mirror_stage(m.name)
        mirror_seen: dict[tuple[Any, ...], MirrorRecord] = {}
        for mr in inputs.mirror_log:
            if (mr.mirror == m.name and mr.topic == topic and mr.committed and _valid(mr)
                    and rr.message_lo <= _log_time(mr) < rr.message_hi):
                mirror_seen.setdefault(_MIRROR_IDENTITY(mr), mr)
        mcopies: dict[tuple[Any, Any], list[MirrorRecord]] = defaultdict(list)
        for mr in sorted(mirror_seen.values(), key=lambda r: (r.partition, r.offset)):
            mcopies[(mr.pid, mr.seq)].append(mr)
        last_capture: dict[int, datetime] = {}
        for mw in inputs.mirror_watermarks:
            if mw.mirror == m.name and mw.topic == topic:
                last_capture[mw.partition] = max(last_capture.get(mw.partition, mw.captured_at), mw.captured_at)
        for u in window_units:
            morig = u.original
            if u.key[0] != "m" or morig is None:
                continue  # only audited messages committed at the source are expected in the copy
            pt = u.produce_time
            assert pt is not None
            pid, seq, p = u.key[1], u.key[2], morig.partition
            mcs = mcopies.get((pid, seq), [])
            mcnt = counts[(stage, p)]
            mcnt["expected"] += 1
            if mcs:
                mcnt["delivered"] += 1
                if mcs[0].kafka_ts is not None:
                    latencies[(stage, p)].append(_ms(mcs[0].kafka_ts, pt))
                for mx in mcs[1:]:
                    emit(stage, "duplicate_in_mirror", mx.partition, pid, seq, mx.offset,
                         orig_partition=mcs[0].partition, orig_offset=mcs[0].offset, mirror_topic=m.topic)
            elif as_of < pt + grace or not (p in last_capture and last_capture[p] >= pt + grace):
                emit(stage, "pending", p, pid, seq, morig.offset, mirror_topic=m.topic)
            else:
                emit(stage, "lost_in_mirror", p, pid, seq, morig.offset, mirror_topic=m.topic)
        # reordered_in_mirror: per target partition, first mcopies (of messages from the same source
        # partition) in target offset order; a source offset below the highest one before it
        firsts: dict[int, list[tuple[MirrorRecord, _Unit, LogRecord]]] = defaultdict(list)
        for u in messages:
            uorig = u.original
            mcs = mcopies.get((u.key[1], u.key[2]), [])
            if uorig is not None and mcs and mcs[0].partition == uorig.partition:
                firsts[mcs[0].partition].append((mcs[0], u, uorig))
        for tp, mrows in firsts.items():
            mhigh: int | None = None
            for mc, u, uorig in sorted(mrows, key=lambda t: t[0].offset):
                if mhigh is not None and uorig.offset < mhigh and in_window(u):
                    emit(stage, "reordered_in_mirror", tp, u.key[1], u.key[2], mc.offset,
                         late_offset=uorig.offset, high_offset=mhigh)
                mhigh = uorig.offset if mhigh is None else max(mhigh, uorig.offset)

    return Facts(anomalies, counts, latencies, {w.partition for w in watermarks}, quarantined, dict(ignored), narrow,
                 resendable)


def share_facts(emit: Callable[..., None], stage: str, sg: ShareGroupConfig, partition: int, offset: int,
                pid: str | None, seq: int | None, pt: datetime, as_of: datetime, grace: timedelta,
                rows: Sequence[ConsumedRow], cnt: dict[str, int], latency: list[float],
                start_offset: int | None = None) -> None:
    """The share stage's rules (module docstring) for one committed record: `rows` are share group
    `sg`'s rows of it, `start_offset` its partition's start offset at the latest capture (None: none
    captured); counts it in `cnt`, its latency in `latency`, its anomaly rows through `emit`. Its
    `dead_lettered` rows are the records of g's dead-letter topic naming it, not a member's."""
    rows = sorted(rows, key=_consume_order)
    dead = [c for c in rows if c.outcome == DEAD_LETTERED]
    rows = [c for c in rows if c.outcome != DEAD_LETTERED]
    acquired = [c for c in rows if c.outcome == ACQUIRED]
    accepts = [c for c in rows if c.outcome == ACCEPTED]
    cnt["expected"] += 1
    for k, c in enumerate(acquired[1:], start=2):
        emit(stage, "redelivered", partition, pid, seq, offset, k=k, n=len(acquired), consumer=c.consumer)
    if any(c.error is None for c in accepts):
        cnt["delivered"] += 1
        latency.append(_ms((acquired or rows)[0].consume_ts, pt))
        for k, c in enumerate(accepts[1:], start=2):
            emit(stage, "processed_twice", partition, pid, seq, offset, k=k, n=len(accepts), consumer=c.consumer)
    elif dead:
        emit(stage, "dead_lettered", partition, pid, seq, offset, dlq_topic=dead[0].consumer,
             reason=dead[0].error or "no reason given")
    elif rejected := [c for c in rows if c.outcome == REJECTED and c.error is None]:
        emit(stage, "rejected", partition, pid, seq, offset, consumer=rejected[0].consumer, attempt=rejected[0].attempt)
    elif any(c.attempt >= sg.delivery_count_limit for c in acquired) and (
            (rows[-1].outcome == RELEASED and rows[-1].error is None) or as_of >= pt + grace):
        emit(stage, "archived_unprocessed", partition, pid, seq, offset, limit=sg.delivery_count_limit)
    elif as_of < pt + grace:
        emit(stage, "pending", partition, pid, seq, offset)
    elif not acquired and start_offset is not None and offset < start_offset:
        emit(stage, "missed", partition, pid, seq, offset, start_offset=start_offset)
    else:
        emit(stage, "overdue", partition, pid, seq, offset)


def anomaly_emitter(anomalies: list[dict[str, Any]], topic: str, window_start: datetime,
                    as_of: datetime) -> Callable[..., None]:
    """`emit(stage, code, partition, pid, seq, offset, variant=None, **values)`: appends one anomaly
    row of the (topic, window) to `anomalies`; its detail is the vocabulary's template for (stage
    kind, code)."""
    run_id = run_id_for(topic, window_start, as_of)

    def emit(stage: str, code: str, partition: int, pid: str | None, seq: int | None,
             offset: int | None, variant: str | None = None, **values: Any) -> None:
        anomalies.append({"window_start": window_start, "topic": topic, "partition": partition, "stage": stage,
                          "anomaly": code, "pid": pid, "seq": seq, "offset": offset,
                          "detail": detail(stage_kind(stage), code, variant, **values),
                          "run_id": run_id, "computed_at": as_of})

    return emit


def emit_neighbour_rows(emit: Callable[..., None], reordered: Iterable[tuple[str, int, Any, Any, int]],
                        gaps: Iterable[tuple[str, int, int]],
                        content: Iterable[tuple[str, int, Any, Any, str, int]]) -> None:
    """The anomaly rows of what the checks that need neighbours found: `reordered` (pid, seq,
    partition, offset, the highest seq before it), `gaps` (pid, a, b: the seqs strictly between are
    missing) and `content` (pid, seq, partition, offset, the first message's pid and seq); `emit`
    as `window_facts`' own (stage, code, partition, pid, seq, offset, variant, **detail values)."""
    for pid, seq, p, off, high in reordered:
        emit(LOG, "reordered_in_log", p, pid, seq, off, late_seq=seq, high_seq=high)
    for pid, a, b in gaps:
        missing = b - a - 1
        if missing > MAX_GAP_ROWS:
            emit(LOG, "seq_gap", -1, pid, a + 1, None, "wide", missing=missing, first=a + 1, last=b - 1)
        else:
            for gap_seq in range(a + 1, b):
                emit(LOG, "seq_gap", -1, pid, gap_seq, None)
    for pid, seq, p, off, first_pid, first_seq in content:
        emit(LOG, "content_duplicate", p, pid, seq, off, first_pid=first_pid, first_seq=first_seq)


def _failover(tc: TopicConfig, inputs: Inputs, rr: Any, target_rows: Sequence[ConsumedRow],
              units: Mapping[Key, _Unit]) -> dict[tuple[str, str], Failover]:
    """Per (group, mirror) with consumption rows on the target copy: F, where g resumed on the
    target in each partition -- the lowest target offset it processed there, or the group's latest
    captured committed offset on the target (`mirror_group_offsets`) if lower or if it processed
    nothing there -- and the failover position in the source partition: one past the highest
    source offset (of the same partition) whose first copy lies below the resume offset. A record
    below it that g never processed on either cluster was skipped by the translation."""
    out: dict[tuple[str, str], Failover] = {}
    for m in tc.mirrors:
        for g in m.failover_groups:
            rows = [c for c in target_rows if c.cluster == m.name and c.group == g]
            if not rows:
                continue
            resume: dict[int, int] = {}
            for c in rows:
                if c.outcome in PROCESSING_OUTCOMES:
                    resume[c.partition] = min(resume.get(c.partition, c.offset), c.offset)
            latest: dict[int, MirrorGroupOffset] = {}
            for mg in inputs.mirror_group_offsets:
                if mg.mirror == m.name and mg.group == g and mg.topic == tc.name and (
                        mg.partition not in latest or mg.captured_at >= latest[mg.partition].captured_at):
                    latest[mg.partition] = mg
            for p, mg in latest.items():
                if mg.committed_offset is not None:
                    resume[p] = min(resume.get(p, mg.committed_offset), mg.committed_offset)
            first_copy: dict[tuple[str, int], MirrorRecord] = {}
            for mr in inputs.mirror_log:
                if (mr.mirror == m.name and mr.topic == tc.name and mr.committed and _valid(mr)
                        and rr.message_lo <= _log_time(mr) < rr.message_hi):
                    assert mr.pid is not None and mr.seq is not None
                    k = (mr.pid, mr.seq)
                    if k not in first_copy or (mr.partition, mr.offset) < (first_copy[k].partition, first_copy[k].offset):
                        first_copy[k] = mr
            position: dict[int, int] = {}
            for (pid, seq), mc in first_copy.items():
                u = units.get(("m", pid, seq))
                orig = u.original if u is not None else None
                if orig is not None and orig.partition == mc.partition and mc.partition in resume \
                        and mc.offset < resume[mc.partition]:
                    position[orig.partition] = max(position.get(orig.partition, 0), orig.offset + 1)
            out[(g, m.name)] = Failover(m.name, min(c.consume_ts for c in rows), resume, position)
    return out


def _ts_key(t: datetime | None) -> tuple[int, datetime]:
    return (0, EPOCH) if t is None else (1, t)


def _int_key(v: int | None) -> int:
    return -(2**62) if v is None else v
