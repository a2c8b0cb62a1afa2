"""The lab's fault scenarios: each produces one failure of docs/design.md §5 on a real broker and returns
the ground truth of what it did (`Truth`), recorded by the scenario itself.

A scenario is `fn(ctx: Context) -> Truth`. It creates its own topics (so scenarios can share a
broker and one audit run), drives real producers and consumers (`AuditedProducer`,
`AuditedConsumer`, killed worker processes from `audit.lab.worker`), and registers the topics it
wants audited in `ctx.topics`. Run them with `audit.lab.runner.run_scenarios` (or `msgaudit demo
--scenario NAME`), which then ingests, captures, reconciles and compares the audit's anomaly
rows with the truth, exactly.

Against your own cluster: build `Lab(bootstrap)` and a Config pointing at it. Scenarios 1 and 2
need the fault proxy in front of the broker (the broker must advertise the proxy's address) and
scenario 10 needs a 3-node cluster the lab may kill nodes of; they refuse to run otherwise.

Where the truth comes from, per scenario (never from the audit's tables, ledgers or rules):
  lost_response / idempotent   the proxy's wire record: batches written whose answer was dropped,
                               and the scenario's own delivery reports (where the retry landed)
  reorder                      the proxy's wire record: the batch that failed in flight; delivery reports
  producer_restart             the messages the scenario chose to re-send, and where they landed
  at_most_once / at_least_once the marker the killed worker wrote (the batch it held)
  auto_commit                  the plain consumer's own record of what it was handed and processed,
                               and the group's committed offset read from the broker after each kill
  exactly_once_kafka / _sink   the kill matrix: nothing is expected
  aborted                      the transaction the scenario aborted, and its delivery reports
  retention                    the records the scenario's consumer did not reach, and the broker's
                               log start offset after retention
  poison                       the record the scenario poisoned
  unaudited                    the records the scenario wrote with a plain producer
  lost_acked                   acks seen by the scenario's callback minus what a plain consumer
                               reads back after the failover
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any, cast

from audit.core.config import Config, MirrorConfig, SinkConfig, SlaRule, TopicConfig
from audit.core.errors import BrokerError, InputError
from audit.core.headers import parse as parse_audit_headers
from audit.lab.env import Lab, alter_configs, read_log
from audit.lab.proxy import ProduceExchange
from audit.lab.truth import Truth

LOG = "log"
# The strict SLA of a pipeline that promises exactly-once: every lab fault should break one rule.
LAB_SLA = (SlaRule("max_lost", 0), SlaRule("max_duplicate_ratio", 0), SlaRule("max_reordered", 0))


@dataclass
class Context:
    """What a scenario runs with. `capture_now(topic)` runs a log capture at this moment (the
    retention scenario needs one before Kafka deletes the records)."""

    lab: Lab
    cfg: Config
    work: Path
    window: timedelta = timedelta(minutes=1)
    grace: timedelta = timedelta(seconds=5)
    say: Callable[[str], None] = print
    capture_now: Callable[[str], None] | None = None
    topics: dict[str, TopicConfig] = field(default_factory=dict)
    # what scenarios share (e.g. the mirror scenarios' target cluster), and how to stop it once the
    # audit has read it (the runner calls `cleanups` last)
    resources: dict[str, Any] = field(default_factory=dict)
    cleanups: list[Callable[[], None]] = field(default_factory=list)
    # SQLAlchemy URL of the exactly_once_sink scenario's database (e.g. PostgreSQL); default: a
    # SQLite file in `work`.
    sink_url: str | None = None
    # Ledger topics some workers ship to (their spools live outside ledger_dir): the audit lands
    # each of them besides the ledger files.
    ledger_topics: list[str] = field(default_factory=list)
    # the audit's Spark session, for scenarios that run a Spark job (audit.lab.connect)
    spark: Callable[[], Any] | None = None

    def audit_topic(self, name: str, groups: tuple[str, ...] = (), sinks: tuple[SinkConfig, ...] = (),
                    mirrors: tuple[MirrorConfig, ...] = ()) -> None:
        self.topics[name] = TopicConfig(name=name, window=self.window, grace=self.grace, groups=groups, sinks=sinks,
                                        sla=LAB_SLA, mirrors=mirrors)

    @property
    def ledger_dir(self) -> Path:
        return Path(self.cfg.ledger_dir)

    def producer(self, name: str, **conf: Any) -> Any:
        from audit.clients.producer import AuditedProducer

        return AuditedProducer.from_config(self.cfg, producer_name=name, **{"log_level": 0, **conf})


# ------------------------------------------------------------------------------------------
# helpers


class Acks:
    """The scenario's own delivery reports: seq -> (partition, offset) of the acked copy."""

    def __init__(self) -> None:
        self.acked: dict[int, tuple[int, int]] = {}
        self.failed: dict[int, str] = {}

    def callback(self, seq: int) -> Callable[[Any, Any], None]:
        return partial(self._report, seq)

    def _report(self, seq: int, err: Any, msg: Any) -> None:
        if err is None:
            self.acked[seq] = (int(msg.partition()), int(msg.offset()))
        else:
            self.failed[seq] = str(err)


def _value(n: int, **extra: Any) -> bytes:
    return json.dumps({"n": n, **extra}).encode()


def _produce(producer: Any, topic: str, acks: Acks, seq: int, value: bytes, key: bytes | None = None) -> None:
    producer.produce(topic, value, key, on_delivery=acks.callback(seq))


def _flush(producer: Any) -> None:
    if producer.flush(30) != 0:
        raise BrokerError("lab: producer could not deliver within 30s")


def _need_proxy(ctx: Context, scenario: str) -> Any:
    if ctx.lab.proxy is None:
        raise InputError(f"scenario {scenario!r} needs the fault proxy in front of the broker "
                         "(run it through `msgaudit demo` or audit.lab.env.ProxiedBroker)")
    return ctx.lab.proxy


def _wire_offsets(ex: ProduceExchange, topic: str) -> list[tuple[int, int, str | None, int | None]]:
    """(partition, offset, pid, seq) of every record of a written exchange, from its answer."""
    base = {(r.topic, r.partition): r.base_offset for r in ex.results if r.error_code == 0}
    out = []
    for b in ex.batches:
        if b.topic != topic or (b.topic, b.partition) not in base:
            continue
        for r in b.records or ():
            out.append((b.partition, base[(b.topic, b.partition)] + r.offset_delta, r.pid, r.seq))
    return out


def _worker(ctx: Context, topic: str, group: str, semantics: str, *, name: str = "w1",
            kill_at: str | None = None, kill_offset: int = -1, marker: Path | None = None,
            sink: tuple[str, str, str] | None = None, output_topic: str | None = None,
            isolation: str = "read_committed", max_messages: int | None = None, max_attempts: int = 0,
            batch_size: int = 5, idle_s: float = 2.0, timeout: float = 90.0,
            ledger: tuple[str, Path] | None = None) -> int:
    """Run audit.lab.worker once. `ledger`: (ledger topic, spool folder) to ship its ledger through
    a topic (the topic must be in ctx.ledger_topics, the folder outside ctx.ledger_dir)."""
    cmd = [sys.executable, "-m", "audit.lab.worker", "--bootstrap", ctx.lab.bootstrap, "--topic", topic,
           "--group", group, "--name", name, "--semantics", semantics,
           "--ledger-dir", str(ledger[1] if ledger else ctx.ledger_dir),
           "--batch-size", str(batch_size), "--idle-s", str(idle_s), "--isolation", isolation,
           "--max-attempts", str(max_attempts)]
    if kill_at:
        cmd += ["--kill-at", kill_at, "--kill-offset", str(kill_offset)]
    if marker:
        cmd += ["--marker", str(marker)]
    if sink:
        cmd += ["--sink-url", sink[0], "--sink-table", sink[1], "--sink-mode", sink[2]]
    if output_topic:
        cmd += ["--output-topic", output_topic]
    if ledger:
        cmd += ["--ledger-topic", ledger[0]]
    if max_messages is not None:
        cmd += ["--max-messages", str(max_messages)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[2]),
                                                          os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if proc.returncode not in (0, 137):
        raise BrokerError(f"lab worker ({semantics}, group {group}) failed with {proc.returncode}: "
                          f"{proc.stderr.strip()[-800:]}")
    return proc.returncode


def _marker_offsets(marker: Path) -> list[tuple[int, int]]:
    data = json.loads(marker.read_text())
    return [(int(p), int(o)) for _, p, o in data["records"]]


def _fill(ctx: Context, topic: str, n: int, producer_name: str,
          poison: frozenset[int] = frozenset()) -> tuple[str, Acks]:
    """n audited JSON messages {"n": i}, idempotent producer; returns (pid, acks)."""
    p = ctx.producer(producer_name, **{"linger.ms": 5})
    acks = Acks()
    try:
        for i in range(n):
            _produce(p, topic, acks, i, _value(i, **({"poison": True} if i in poison else {})))
        _flush(p)
    finally:
        p.close()
    if len(acks.acked) != n:
        raise BrokerError(f"lab: only {len(acks.acked)} of {n} messages acked on {topic}: {acks.failed}")
    return p.pid, acks


def _by_offset(acks: Acks) -> dict[tuple[int, int], int]:
    return {po: seq for seq, po in acks.acked.items()}


# ------------------------------------------------------------------------------------------
# 1. lost produce responses


def _lost_response(ctx: Context, idempotent: bool) -> Truth:
    name = "lost_response_idempotent" if idempotent else "lost_response"
    proxy = _need_proxy(ctx, name)
    truth = Truth(name)
    topic = ctx.lab.create_topic("lab-lostresp-idem" if idempotent else "lab-lostresp")
    ctx.audit_topic(topic)
    truth.topic(topic)
    p = ctx.producer(f"lab-{name}", **{"enable.idempotence": idempotent, "acks": "all", "linger.ms": 5,
                                       "retry.backoff.ms": 50})
    acks = Acks()
    n, bursts, dropped_at = 40, 8, (2, 5)
    per = n // bursts
    try:
        for b in range(bursts):
            if b in dropped_at:
                proxy.drop_produce_responses(1)
            for i in range(b * per, (b + 1) * per):
                _produce(p, topic, acks, i, _value(i))
            _flush(p)
    finally:
        p.close()
    pid = p.pid
    extra = 0
    written: dict[int, set[tuple[int, int]]] = {}
    for ex in proxy.exchanges(topic):
        for part, off, wpid, seq in _wire_offsets(ex, topic):
            if wpid == pid and seq is not None:
                written.setdefault(seq, set()).add((part, off))
    for seq, copies in sorted(written.items()):
        for part, off in sorted(copies - {acks.acked[seq]}):
            truth.expect(topic, LOG, "duplicate_in_log", part, pid, seq, off)
            extra += 1
    dropped = [ex for ex in proxy.exchanges(topic) if ex.fate == "response_dropped"]
    truth.facts.update(messages=n, responses_dropped=len(dropped),
                       messages_in_dropped_batches=sum(len(_wire_offsets(e, topic)) for e in dropped),
                       extra_copies_in_log=extra, idempotence=idempotent)
    ctx.say(f"{name}: {n} messages, {len(dropped)} produce responses dropped after the broker wrote, "
            f"{extra} extra copies in the log")
    return truth


def lost_response(ctx: Context) -> Truth:
    """Seed 001: the broker wrote the batch, the answer was lost, the producer retried (idempotence off)."""
    return _lost_response(ctx, idempotent=False)


def lost_response_idempotent(ctx: Context) -> Truth:
    """The same traffic and faults with enable.idempotence=true: the broker drops the retries."""
    return _lost_response(ctx, idempotent=True)


# ------------------------------------------------------------------------------------------
# 2. reordering: max.in.flight > 1, retries, no idempotence, a failed in-flight batch


def reorder(ctx: Context) -> Truth:
    proxy = _need_proxy(ctx, "reorder")
    truth = Truth("reorder")
    topic = ctx.lab.create_topic("lab-reorder")
    ctx.audit_topic(topic)
    truth.topic(topic)
    p = ctx.producer("lab-reorder", **{"enable.idempotence": False, "acks": "all", "max.in.flight": 5,
                                       "linger.ms": 20, "retry.backoff.ms": 50})
    acks = Acks()
    seq = 0
    try:
        for _ in range(5):
            _produce(p, topic, acks, seq, _value(seq))
            seq += 1
        _flush(p)
        seen = len(proxy.exchanges(topic))
        proxy.fail_next_produce_request(after_responses=1)
        for _ in range(5):  # batch A: will fail in flight
            _produce(p, topic, acks, seq, _value(seq))
            seq += 1
        if not proxy.wait_until(lambda: len(proxy.exchanges(topic)) > seen, 10):
            raise BrokerError("reorder: the producer did not send batch A")
        for _ in range(5):  # batch B: in flight behind A, succeeds first
            _produce(p, topic, acks, seq, _value(seq))
            seq += 1
        _flush(p)
        for _ in range(5):
            _produce(p, topic, acks, seq, _value(seq))
            seq += 1
        _flush(p)
    finally:
        p.close()
    failed = [ex for ex in proxy.exchanges(topic) if ex.fate == "request_failed"]
    failed_seqs = sorted(s for ex in failed for _, _, _, s in ex.messages() if s is not None)
    later = [s for s in acks.acked if s not in failed_seqs and s > max(failed_seqs, default=-1)]
    # Each re-sent message lands after a higher seq of the same producer: reordered, as designed.
    highest_before = {s: max((t for t in later if acks.acked[t][1] < acks.acked[s][1]), default=-1)
                      for s in failed_seqs}
    for s in failed_seqs:
        if highest_before[s] > s:
            part, off = acks.acked[s]
            truth.expect(topic, LOG, "reordered_in_log", part, p.pid, s, off)
    truth.facts.update(messages=seq, batches_failed_in_flight=len(failed), messages_resent_out_of_order=len(failed_seqs))
    ctx.say(f"reorder: {seq} messages, 1 batch of {len(failed_seqs)} failed in flight and was re-sent "
            f"behind the next batch")
    return truth


# ------------------------------------------------------------------------------------------
# 3. a restarted producer re-sends its last N messages


def producer_restart(ctx: Context) -> Truth:
    truth = Truth("producer_restart")
    topic = ctx.lab.create_topic("lab-restart")
    ctx.audit_topic(topic)
    truth.topic(topic)
    n, resend = 20, 5
    first = ctx.producer("lab-orders-svc")  # idempotent: its own retries are safe
    acks1 = Acks()
    try:
        for i in range(n):
            _produce(first, topic, acks1, i, _value(i, order=f"order-{i}"), key=f"order-{i}".encode())
        _flush(first)
    finally:
        first.close()  # the process "restarts": a new session, a new producer id
    second = ctx.producer("lab-orders-svc")
    acks2 = Acks()
    try:
        for j, i in enumerate(range(n - resend, n)):
            _produce(second, topic, acks2, j, _value(i, order=f"order-{i}"), key=f"order-{i}".encode())
        _flush(second)
    finally:
        second.close()
    for j in range(resend):
        part, off = acks2.acked[j]
        truth.expect(topic, LOG, "content_duplicate", part, second.pid, j, off)
    truth.facts.update(messages=n, resent_after_restart=resend)
    ctx.say(f"producer_restart: {n} messages, restarted producer re-sent the last {resend} (new producer id)")
    return truth


# ------------------------------------------------------------------------------------------
# 4./5. consumers killed between commit and processing


def at_most_once(ctx: Context) -> Truth:
    """Commit, then process; killed after the commit of the batch holding offset 10."""
    truth = Truth("at_most_once")
    topic = ctx.lab.create_topic("lab-amo")
    group = f"{topic}-loader"
    ctx.audit_topic(topic, groups=(group,))
    truth.topic(topic)
    pid, acks = _fill(ctx, topic, 25, "lab-amo")
    marker = ctx.work / f"{topic}.killed.json"
    rc = _worker(ctx, topic, group, "at_most_once", kill_at="committed_before_processing", kill_offset=10,
                 marker=marker)
    if rc != 137 or not marker.exists():
        raise BrokerError("at_most_once: the worker was not killed at the planned point")
    _worker(ctx, topic, group, "at_most_once")
    seq_at = _by_offset(acks)
    lost = _marker_offsets(marker)
    for part, off in lost:
        truth.expect(topic, f"group:{group}", "missed", part, pid, seq_at[(part, off)], off)
    truth.facts.update(messages=25, killed_after_commit_before_processing=len(lost))
    ctx.say(f"at_most_once: worker killed after committing a batch of {len(lost)} it never processed")
    return truth


def at_least_once(ctx: Context) -> Truth:
    """Process, then commit; killed after processing (sink written, ledger durable) before the commit.
    Two groups: one with a plain-insert sink, one with an upsert sink."""
    truth = Truth("at_least_once")
    topic = ctx.lab.create_topic("lab-alo")
    url = f"sqlite:///{ctx.work / 'lab_sinks.db'}"
    g_ins, g_ups = f"{topic}-insert", f"{topic}-upsert"
    t_ins, t_ups = f"{topic}_insert".replace("-", "_"), f"{topic}_upsert".replace("-", "_")
    s_ins = SinkConfig(name="plain_insert", format="sql", group=g_ins, url=url, table=t_ins)
    s_ups = SinkConfig(name="upsert", format="sql", group=g_ups, url=url, table=t_ups)
    ctx.audit_topic(topic, groups=(g_ins, g_ups), sinks=(s_ins, s_ups))
    truth.topic(topic)
    pid, acks = _fill(ctx, topic, 25, "lab-alo")
    seq_at = _by_offset(acks)
    redelivered = 0
    for group, table, mode in ((g_ins, t_ins, "insert"), (g_ups, t_ups, "upsert")):
        marker = ctx.work / f"{group}.killed.json"
        rc = _worker(ctx, topic, group, "at_least_once", kill_at="ledger_flushed", kill_offset=10,
                     marker=marker, sink=(url, table, mode))
        if rc != 137 or not marker.exists():
            raise BrokerError(f"at_least_once: the {mode} worker was not killed at the planned point")
        _worker(ctx, topic, group, "at_least_once", sink=(url, table, mode))
        for part, off in _marker_offsets(marker):
            truth.expect(topic, f"group:{group}", "redelivered", part, pid, seq_at[(part, off)], off)
            if mode == "insert":
                truth.expect(topic, "sink:plain_insert", "duplicate_in_sink", part, pid, seq_at[(part, off)], off)
            redelivered += 1
    truth.facts.update(messages=25, redelivered=redelivered)
    ctx.say(f"at_least_once: two workers (insert / upsert sink) killed before committing a processed batch; "
            f"{redelivered} redeliveries")
    return truth


# ------------------------------------------------------------------------------------------
# 5b. a plain auto-commit consumer, SIGKILLed mid-batch


def _committed(ctx: Context, topic: str, group: str) -> int:
    """The group's committed offset of partition 0 as the broker has it now (-1: none)."""
    from confluent_kafka import Consumer, TopicPartition

    c = Consumer({"bootstrap.servers": ctx.lab.bootstrap, "group.id": group, "enable.auto.commit": False,
                  "log_level": 0})
    try:
        (tp,) = c.committed([TopicPartition(topic, 0)], timeout=10)
        return int(tp.offset) if tp.offset >= 0 else -1
    finally:
        c.close()


def _plain_life(ctx: Context, topic: str, group: str, life: int, *, interval_ms: int,
                pause_after: int = 0, wait_commit: bool = False) -> tuple[list[tuple[str, int]], int]:
    """One process life of audit.lab.plain_worker. With `pause_after` it is SIGKILLed mid-batch once
    it processed that many records (after the auto-commit timer covered every offset handed over,
    if `wait_commit`). Returns its truth lines (event, offset) and the group's committed offset
    right after it died (or exited)."""
    import signal

    truth_file = ctx.work / f"{group}.life{life}.truth"
    paused = ctx.work / f"{group}.life{life}.paused"
    cmd = [sys.executable, "-m", "audit.lab.plain_worker", "--bootstrap", ctx.lab.bootstrap, "--topic", topic,
           "--group", group, "--name", "plain", "--ledger-dir", str(ctx.ledger_dir), "--truth", str(truth_file),
           "--commit-interval-ms", str(interval_ms), "--pause-after", str(pause_after), "--paused", str(paused)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[2]),
                                                          os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    def lines() -> list[tuple[str, int]]:
        if not truth_file.exists():
            return []
        return [(ev, int(off)) for ev, _, off in (ln.split() for ln in truth_file.read_text().splitlines())]

    try:
        deadline = time.monotonic() + 90
        if pause_after:
            while not paused.exists():
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise BrokerError(f"auto_commit: life {life} did not reach its kill point: "
                                      f"{(proc.stderr.read() if proc.stderr else '')[-800:]}")
                time.sleep(0.05)
            if wait_commit:
                handed = max(off for ev, off in lines() if ev == "handed") + 1
                while _committed(ctx, topic, group) < handed:
                    if time.monotonic() > deadline:
                        raise BrokerError(f"auto_commit: the timer never committed offset {handed}")
                    time.sleep(0.2)
            proc.send_signal(signal.SIGKILL)
        rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if rc != (-signal.SIGKILL if pause_after else 0):
        raise BrokerError(f"auto_commit: life {life} ended with {rc}: {(proc.stderr.read() if proc.stderr else '')[-800:]}")
    return lines(), _committed(ctx, topic, group)


def auto_commit(ctx: Context) -> Truth:
    """A plain enable.auto.commit=true consumer (librdkafka defaults) SIGKILLed mid-batch, twice:
    once after the auto-commit timer committed the whole batch it was handed (its unprocessed
    records are `missed`), once before the timer ran (what it processed since the last commit is
    `redelivered` by the next life); a last life runs to the end and closes."""
    truth = Truth("auto_commit")
    topic = ctx.lab.create_topic("lab-autocommit")
    group = f"{topic}-plain"
    ctx.audit_topic(topic, groups=(group,))
    truth.topic(topic)
    n = 50
    pid, acks = _fill(ctx, topic, n, "lab-autocommit")
    seq_at = _by_offset(acks)
    # Batches of 10; each killed life processes 15 records, i.e. dies 5 records into its second batch.
    life1, committed1 = _plain_life(ctx, topic, group, 1, interval_ms=300, pause_after=15, wait_commit=True)
    life2, committed2 = _plain_life(ctx, topic, group, 2, interval_ms=600_000, pause_after=15)
    life3, committed3 = _plain_life(ctx, topic, group, 3, interval_ms=300)
    processed = [off for lives in (life1, life2, life3) for ev, off in lives if ev == "processed"]
    handed = {off for lives in (life1, life2, life3) for ev, off in lives if ev == "handed"}
    times = {off: processed.count(off) for off in range(n)}
    g = f"group:{group}"
    for off in range(n):
        if times[off] == 0 and off in handed and off < committed3:
            truth.expect(topic, g, "missed", 0, pid, seq_at[(0, off)], off)
        for _ in range(times[off] - 1):
            truth.expect(topic, g, "redelivered", 0, pid, seq_at[(0, off)], off)
    if committed3 != n or set(range(n)) - handed:
        raise BrokerError(f"auto_commit: the last life did not finish the topic (committed {committed3})")
    truth.facts.update(messages=n, committed_at_kill_1=committed1, committed_at_kill_2=committed2,
                       never_processed=sum(1 for t in times.values() if t == 0),
                       processed_twice=sum(1 for t in times.values() if t == 2))
    ctx.say(f"auto_commit: killed after the timer committed offset {committed1} (5 records handed, never "
            f"processed), then killed with offset {committed2} committed after processing past it")
    return truth


# ------------------------------------------------------------------------------------------
# 6. exactly-once, killed at every point; an aborted transaction


EOS_KILL_POINTS = {
    "exactly_once_kafka": ("handled", "sink_written", "txn_before_commit", "txn_committed", "ledger_flushed",
                           "committed"),
    "exactly_once_sink": ("handled", "sink_txn_open", "sink_written", "ledger_flushed", "committed"),
}


def _exactly_once(ctx: Context, semantics: str) -> Truth:
    """One exactly-once mode, a worker killed at every point of its loop in turn: no anomaly.

    exactly_once_sink: `sink_written` is the kill just after the database commit (rows, offsets
    and consumption rows committed, nothing else done). exactly_once_kafka: `txn_committed` is the
    kill just after the transaction commits; the worker ships its ledger through a ledger topic on
    the lab cluster, so the batch's consumption rows are committed in its transaction. The sink is audited without `group`, so
    the group stage's only evidence of processing is the consumption rows committed with each
    batch (docs/design.md §5.3's sink-row fallback does not apply): a batch whose rows were lost
    would show as `missed`."""
    truth = Truth(semantics)
    url = (ctx.sink_url if semantics == "exactly_once_sink" else None) or f"sqlite:///{ctx.work / 'lab_sinks.db'}"
    points = EOS_KILL_POINTS[semantics]
    topic = ctx.lab.create_topic("lab-eos-kafka" if semantics == "exactly_once_kafka" else "lab-eos-sink")
    group = f"{topic}-loader"
    sinks: tuple[SinkConfig, ...] = ()
    sink_arg = None
    output = None
    ledger: tuple[str, Path] | None = None
    if semantics == "exactly_once_sink":
        table = topic.replace("-", "_")
        sinks = (SinkConfig(name="eos_table", format="sql", url=url, table=table),)
        sink_arg = (url, table, "insert")
    else:
        output = ctx.lab.create_topic("lab-eos-out")
        ledger = (ctx.lab.create_topic("lab-eos-ledger"), ctx.work / f"{topic}-spool")
        ctx.ledger_topics.append(ledger[0])
    ctx.audit_topic(topic, groups=(group,), sinks=sinks)
    truth.topic(topic)
    n = 5 * (len(points) + 1)
    _fill(ctx, topic, n, f"lab-{semantics}")
    killed = []
    for k, point in enumerate(points):
        # Batches of 5: kill k hits the batch holding offset 5k+2, at `point`.
        marker = ctx.work / f"{group}.{point}.json"
        rc = _worker(ctx, topic, group, semantics, kill_at=point, kill_offset=5 * k + 2, marker=marker,
                     sink=sink_arg, output_topic=output, ledger=ledger)
        if rc != 137 or not marker.exists():
            raise BrokerError(f"{semantics}: worker not killed at {point}")
        killed.append(point)
    _worker(ctx, topic, group, semantics, sink=sink_arg, output_topic=output, ledger=ledger)
    truth.facts.update(messages=n, kills=len(killed), kill_points=", ".join(killed))
    ctx.say(f"{semantics}: {len(killed)} kills, one at each point of the loop ({', '.join(killed)})")
    return truth


def exactly_once_kafka(ctx: Context) -> Truth:
    """Consume-transform-produce in Kafka transactions, killed at every point."""
    return _exactly_once(ctx, "exactly_once_kafka")


def exactly_once_sink(ctx: Context) -> Truth:
    """Offsets stored atomically with the sink rows, killed at every point."""
    return _exactly_once(ctx, "exactly_once_sink")


def aborted(ctx: Context) -> Truth:
    """A transactional producer aborts its second transaction; a read_uncommitted consumer reads it."""
    truth = Truth("aborted")
    topic = ctx.lab.create_topic("lab-aborted")
    group = f"{topic}-uncommitted"
    ctx.audit_topic(topic, groups=(group,))
    truth.topic(topic)
    p = ctx.producer("lab-txn", **{"transactional.id": f"lab-{topic}", "linger.ms": 5})
    acks = Acks()
    p.init_transactions(30)
    seq = 0
    aborted_seqs = []
    try:
        for txn in range(3):
            p.begin_transaction()
            for _ in range(5):
                _produce(p, topic, acks, seq, _value(seq))
                if txn == 1:
                    aborted_seqs.append(seq)
                seq += 1
            _flush(p)
            if txn == 1:
                p.abort_transaction(30)
            else:
                p.commit_transaction(30)
    finally:
        p.close()
    _worker(ctx, topic, group, "at_least_once", isolation="read_uncommitted")
    for s in aborted_seqs:
        part, off = acks.acked[s]
        truth.expect(topic, LOG, "aborted", part, p.pid, s, off)
        truth.expect(topic, f"group:{group}", "aborted_read", part, p.pid, s, off)
    truth.facts.update(messages=seq, aborted=len(aborted_seqs))
    ctx.say("aborted: 3 transactions of 5, the second aborted; a read_uncommitted group read it")
    return truth


# ------------------------------------------------------------------------------------------
# 7. retention shorter than a stalled consumer's lag


def retention(ctx: Context) -> Truth:
    """A consumer stalls after 5 of 20 records; the topic's retention is then cut to 1s (an operator
    reclaiming disk, or simply a retention shorter than the lag) and Kafka deletes the rest unread."""
    from confluent_kafka import Consumer, TopicPartition

    truth = Truth("retention")
    if ctx.capture_now is None:
        raise InputError("scenario 'retention' needs a capture before Kafka deletes the records (ctx.capture_now)")
    topic = ctx.lab.create_topic("lab-retention")
    group = f"{topic}-slow"
    ctx.audit_topic(topic, groups=(group,))
    truth.topic(topic)
    n, consumed = 20, 5
    pid, acks = _fill(ctx, topic, n, "lab-retention")
    _worker(ctx, topic, group, "at_least_once", max_messages=consumed)  # then it stalls
    ctx.capture_now(topic)  # the audit's regular capture sees the records while they exist
    alter_configs(ctx.lab.bootstrap, "topic", topic, {"retention.ms": 1000})
    probe = Consumer({"bootstrap.servers": ctx.lab.bootstrap, "group.id": f"{topic}-probe", "log_level": 0})
    deadline = time.monotonic() + 90
    start = 0
    try:
        while time.monotonic() < deadline:
            start, _ = probe.get_watermark_offsets(TopicPartition(topic, 0), timeout=5)
            if start >= n:
                break
            time.sleep(0.5)
    finally:
        probe.close()
    if start < n:
        raise BrokerError(f"retention: Kafka did not delete the old records within 90s (log start {start})")
    seq_at = _by_offset(acks)
    for off in range(consumed, n):
        truth.expect(topic, f"group:{group}", "expired_unconsumed", 0, pid, seq_at[(0, off)], off)
    truth.facts.update(messages=n, consumed_before_stall=consumed, log_start_offset_after=start,
                       expired_unconsumed=n - consumed)
    ctx.say(f"retention: consumer stalled after {consumed} of {n}; retention cut to 1s moved the log start to {start}")
    return truth


# ------------------------------------------------------------------------------------------
# 8. a poison message


def poison(ctx: Context) -> Truth:
    truth = Truth("poison")
    topic = ctx.lab.create_topic("lab-poison")
    group = f"{topic}-loader"
    ctx.audit_topic(topic, groups=(group,))
    truth.topic(topic)
    n, bad = 20, 7
    pid, acks = _fill(ctx, topic, n, "lab-poison", poison=frozenset({bad}))
    _worker(ctx, topic, group, "at_least_once", max_attempts=3, idle_s=3.0)
    part, off = acks.acked[bad]
    truth.expect(topic, f"group:{group}", "dead_lettered", part, pid, bad, off)
    truth.facts.update(messages=n, poisoned=1, attempts=3)
    ctx.say(f"poison: message n={bad} fails every attempt -> DLQ after 3; the other {n - 1} flow on")
    return truth


# ------------------------------------------------------------------------------------------
# 9. unaudited producers and garbage headers


GARBAGE_HEADERS: tuple[list[tuple[str, bytes]] | None, ...] = (
    None,  # a plain producer, no headers at all
    [("trace-id", b"abc")],  # headers, none of them ours
    [("audit.seq", b"abc")],  # no pid, seq not a number
    [("audit.pid", b""), ("audit.seq", b"-1"), ("audit.ts", b"x")],  # empty pid, signed seq
    [("audit.pid", b"p" * 80), ("audit.pid", b"q"), ("audit.seq", b"1e3")],  # duplicate pid, bad seq
)


def unaudited(ctx: Context) -> Truth:
    from confluent_kafka import Producer

    truth = Truth("unaudited")
    topic = ctx.lab.create_topic("lab-unaudited")
    ctx.audit_topic(topic)
    truth.topic(topic)
    _fill(ctx, topic, 10, "lab-audited")
    plain = Producer({"bootstrap.servers": ctx.lab.bootstrap, "log_level": 0})
    offsets: list[tuple[int, int]] = []

    def dr(err: Any, msg: Any) -> None:
        if err is None:
            offsets.append((int(msg.partition()), int(msg.offset())))

    for i, headers in enumerate(GARBAGE_HEADERS):
        plain.produce(topic, _value(100 + i), headers=cast(Any, headers), on_delivery=dr)
    if plain.flush(30) != 0 or len(offsets) != len(GARBAGE_HEADERS):
        raise BrokerError("unaudited: the plain producer's records were not all acked")
    for part, off in offsets:
        truth.expect(topic, LOG, "unaudited", part, None, None, off)
    truth.facts.update(audited=10, unaudited=len(offsets))
    ctx.say(f"unaudited: 10 audited messages and {len(offsets)} records from a plain producer / garbage headers")
    return truth


# ------------------------------------------------------------------------------------------
# 10. acks=1, the leader dies before its follower fetched, unclean leader election


def _partition_state(ctx: Context, topic: str, avoid: set[int]) -> tuple[int | None, list[int]]:
    """(leader, isr) of partition 0, asked of nodes not in `avoid` (a frozen node never answers)."""
    from confluent_kafka import TopicCollection
    from confluent_kafka.admin import AdminClient

    assert ctx.lab.kafka is not None
    nodes = [n for n in ctx.lab.kafka.nodes if n.node_id not in avoid and n.node_id in ctx.lab.kafka.running_nodes()]
    admin = AdminClient({"bootstrap.servers": ",".join(n.address for n in nodes), "log_level": 0})
    try:
        d = admin.describe_topics(TopicCollection([topic]), request_timeout=3)[topic].result(5)
    except Exception:
        return None, []
    p = d.partitions[0]
    return (p.leader.id if p.leader else None), sorted(r.id for r in p.isr)


def _wait_state(ctx: Context, topic: str, avoid: set[int], ok: Callable[[int | None, list[int]], bool],
                what: str, timeout: float = 90.0) -> tuple[int | None, list[int]]:
    deadline = time.monotonic() + timeout
    state: tuple[int | None, list[int]] = (None, [])
    while time.monotonic() < deadline:
        state = _partition_state(ctx, topic, avoid)
        if ok(*state):
            return state
        time.sleep(0.3)
    raise BrokerError(f"lost_acked: {what} did not happen within {timeout:.0f}s (leader, isr = {state})")


def lost_acked(ctx: Context) -> Truth:
    """acks=1; the follower is frozen (SIGSTOP) so it never fetches; the leader acks alone, then is
    killed; unclean leader election makes the stale follower leader; the old leader truncates."""
    kafka = ctx.lab.kafka
    if kafka is None or len(kafka.nodes) < 3:
        raise InputError("scenario 'lost_acked' needs a local 3-node cluster the lab may kill nodes of "
                         "(audit.lab.env.LocalCluster)")
    truth = Truth("lost_acked")
    topic = ctx.lab.create_topic("lab-lostacked", replica_assignment=[[1, 2]],
                                 unclean_leader_election_enable="true", min_insync_replicas="1")
    ctx.audit_topic(topic)
    truth.topic(topic)
    leader, follower = 1, 2
    _wait_state(ctx, topic, set(), lambda ld, isr: ld == leader and isr == [1, 2], "initial ISR")
    p = ctx.producer("lab-acks1", **{"acks": "1", "enable.idempotence": False, "linger.ms": 0,
                                     "message.timeout.ms": 120000})
    acks = Acks()
    seq = 0
    before, during, after = 20, 10, 15
    try:
        for _ in range(before):
            _produce(p, topic, acks, seq, _value(seq))
            seq += 1
        _flush(p)
        # The follower must hold everything so far: the high watermark covers it.
        from confluent_kafka import Consumer, TopicPartition

        probe = Consumer({"bootstrap.servers": ctx.lab.bootstrap, "group.id": f"{topic}-probe", "log_level": 0})
        deadline = time.monotonic() + 30
        while probe.get_watermark_offsets(TopicPartition(topic, 0), timeout=5)[1] < before:
            if time.monotonic() > deadline:
                raise BrokerError("lost_acked: follower did not catch up")
            time.sleep(0.2)
        probe.close()
        kafka.pause_node(follower)
        try:
            _wait_state(ctx, topic, {follower}, lambda ld, isr: isr == [leader], "ISR shrink to the leader")
            for _ in range(during):
                _produce(p, topic, acks, seq, _value(seq))
                seq += 1
            _flush(p)
            kafka.kill_node(leader)
        finally:
            kafka.resume_node(follower)
        _wait_state(ctx, topic, {leader}, lambda ld, isr: ld == follower, "unclean election of the follower")
        kafka.restart_node(leader)
        _wait_state(ctx, topic, set(), lambda ld, isr: leader in isr, "old leader rejoining", timeout=120)
        for _ in range(after):  # writes after the failover reuse the lost offsets
            _produce(p, topic, acks, seq, _value(seq))
            seq += 1
        _flush(p)
    finally:
        p.close()
    present = set(read_log(ctx.lab.bootstrap, topic).values())
    lost = sorted(s for s in acks.acked if (p.pid, s) not in present)
    for s in lost:
        part, off = acks.acked[s]
        truth.expect(topic, LOG, "lost_acked", part, p.pid, s, off)
    truth.facts.update(messages=seq, acked=len(acks.acked), acked_while_follower_frozen=during, lost=len(lost),
                       lost_seqs=f"{lost[0]}..{lost[-1]}" if lost else "none")
    ctx.say(f"lost_acked: {len(acks.acked)} acked with acks=1, {len(lost)} of them gone after the unclean election")
    return truth


# ------------------------------------------------------------------------------------------

Scenario = Callable[[Context], Truth]

SCENARIOS: dict[str, tuple[Scenario, str]] = {
    "lost_response": (lost_response, "proxy drops produce responses after the write; idempotence off"),
    "lost_response_idempotent": (lost_response_idempotent, "the same faults with idempotence on"),
    "reorder": (reorder, "max.in.flight=5, no idempotence, a batch fails in flight and is re-sent late"),
    "producer_restart": (producer_restart, "a restarted producer re-sends its last 5 messages"),
    "at_most_once": (at_most_once, "consumer killed after commit, before processing"),
    "at_least_once": (at_least_once, "consumer killed after processing, before commit; insert vs upsert sink"),
    "auto_commit": (auto_commit, "plain enable.auto.commit=true consumer SIGKILLed mid-batch, before and after "
                                 "the timer commit"),
    "exactly_once_kafka": (exactly_once_kafka, "transactional consume-transform-produce, killed at every point"),
    "exactly_once_sink": (exactly_once_sink, "offsets stored with the sink rows, killed at every point"),
    "aborted": (aborted, "an aborted transaction, read by a read_uncommitted group"),
    "retention": (retention, "retention deletes records a stalled consumer never read"),
    "poison": (poison, "a poison message is retried, dead-lettered, the partition flows on"),
    "unaudited": (unaudited, "a plain producer and garbage audit headers"),
    "lost_acked": (lost_acked, "3-node cluster, acks=1, leader killed before the follower fetched, unclean election"),
}



def with_bootstrap(cfg: Config, bootstrap: str) -> Config:
    return replace(cfg, kafka={**cfg.kafka, "bootstrap.servers": bootstrap})


# ------------------------------------------------------------------------------------------
# 12. MirrorMaker 2 (stage mirror:<m>): a second local cluster, MM2 run from its own jars
#
# Truth: the scenario's own delivery reports (source offsets), the batches it produced while MM2
# was down, and a plain consumer's read-back of the copy on the target after MM2 has caught up
# (which copies exist, at which target offsets).

MIRROR_NAME, MIRROR_ALIAS = "dr", "source"


def _target_cluster(ctx: Context) -> Any:
    """The mirror scenarios' target cluster: a second single-node KRaft cluster under the lab's
    work folder, started once, stopped after the audit has captured it."""
    from audit.runtime.local_kafka import LocalKafka

    if "mirror_target" not in ctx.resources:
        target = LocalKafka(ctx.work / "kafka-mirror-target", port=None, nodes=1)
        target.wipe()
        target.start(120)
        ctx.resources["mirror_target"] = target
        ctx.cleanups.append(target.stop)
    return ctx.resources["mirror_target"]


def _mirror_setup(ctx: Context, prefix: str, flush_ms: int, group: str | None = None,
                  extra: dict[str, str] | None = None,
                  copy_config: dict[str, str] | None = None) -> tuple[str, Any, Any]:
    """A source topic, its copy pre-created on the target with LogAppendTime (so the copy's Kafka
    timestamp is MM2's append time: the mirror latency), the topic audited with its mirror, and an
    MM2 for that one flow (not started). `group`: a group audited on the topic that fails over to
    the mirror (MM2 checkpoints it and syncs its offsets to the target). `copy_config`: the copy's
    topic settings instead of LogAppendTime."""
    from confluent_kafka.admin import AdminClient, NewTopic

    from audit.runtime.local_mirror import LocalMirrorMaker, mirrored_topic

    target = _target_cluster(ctx)
    topic = ctx.lab.create_topic(prefix)
    copy = mirrored_topic(MIRROR_ALIAS, topic)
    admin = AdminClient({"bootstrap.servers": target.bootstrap_servers, "log_level": 0})
    config = copy_config if copy_config is not None else {"message.timestamp.type": "LogAppendTime"}
    admin.create_topics([NewTopic(copy, 1, 1, config=config)])[copy].result(30)
    groups = (group,) if group else ()
    ctx.audit_topic(topic, groups=groups, mirrors=(MirrorConfig(
        MIRROR_NAME, {"bootstrap.servers": target.bootstrap_servers}, copy, MIRROR_ALIAS, failover_groups=groups),))
    mm2 = LocalMirrorMaker(ctx.work / f"mm2-{topic}", ctx.lab.bootstrap, target.bootstrap_servers, [topic],
                           source_alias=MIRROR_ALIAS, offset_flush_ms=flush_ms, groups=groups, extra=extra)
    ctx.cleanups.append(mm2.stop)
    return topic, target, mm2


def _produce_batch(p: Any, topic: str, acks: Acks, seqs: range) -> None:
    for i in seqs:
        _produce(p, topic, acks, i, _value(i))
    _flush(p)


def _read_copies(bootstrap: str, topic: str, expect: int) -> list[tuple[int, int, str, int]]:
    """(partition, offset, pid, seq) of every record of the copy, read back with a plain consumer."""
    from confluent_kafka import Consumer, TopicPartition

    c = Consumer({"bootstrap.servers": bootstrap, "group.id": f"lab-readback-{topic}", "enable.auto.commit": False,
                  "auto.offset.reset": "earliest", "log_level": 0})
    out: list[tuple[int, int, str, int]] = []
    try:
        lo, hi = c.get_watermark_offsets(TopicPartition(topic, 0), timeout=10)
        c.assign([TopicPartition(topic, 0, lo)])
        deadline = time.monotonic() + 60
        while len(out) < hi - lo and time.monotonic() < deadline:
            msg = c.poll(0.5)
            if msg is None or msg.error() is not None:
                continue
            # librdkafka hands out a consumed record's headers as (str, bytes | None) tuples
            h = parse_audit_headers(cast(list[tuple[str, bytes | None]], list(msg.headers() or [])))
            if h.pid is None or h.seq is None:
                raise BrokerError(f"lab: a copy on {topic} at offset {msg.offset()} has no audit identity: {h.error}")
            out.append((int(msg.partition() or 0), int(msg.offset() or 0), h.pid, h.seq))
    finally:
        c.close()
    if len(out) < expect:
        raise BrokerError(f"lab: read back {len(out)} of {expect} records of {topic}")
    return out


def _expect_duplicates(truth: Truth, topic: str, copies: list[tuple[int, int, str, int]]) -> int:
    """Every copy after the first of a (pid, seq) on the target: duplicate_in_mirror at its target offset."""
    seen: set[tuple[str, int]] = set()
    extra = 0
    for part, off, pid, seq in sorted(copies):
        if (pid, seq) in seen:
            truth.expect(topic, f"mirror:{MIRROR_NAME}", "duplicate_in_mirror", part, pid, seq, off)
            extra += 1
        seen.add((pid, seq))
    return extra


def mirror_kill(ctx: Context) -> Truth:
    """MM2 copies 10 messages, is SIGKILLed before it flushed their source offsets (flush every
    10 minutes), 10 more are produced while it is down, and the restarted MM2 copies from the last
    flushed offset: the first 10 land on the target twice."""
    truth = Truth("mirror_kill")
    topic, target, mm2 = _mirror_setup(ctx, "lab-mirror-kill", flush_ms=600_000)
    truth.topic(topic)
    p = ctx.producer("lab-mirror-kill", **{"linger.ms": 5})
    acks = Acks()
    try:
        _produce_batch(p, topic, acks, range(0, 10))
        mm2.start()
        mm2.wait_records(topic, 10, timeout=180)
        mm2.kill()  # SIGKILL: no flush of the source offsets it copied
        _produce_batch(p, topic, acks, range(10, 20))
        mm2.start()
        mm2.wait_records(topic, 30, timeout=180)
        time.sleep(2)  # anything MM2 would copy beyond the 30 (it must not)
        mm2.stop()
    finally:
        p.close()
    copies = _read_copies(target.bootstrap_servers, mm2.target_topic(topic), 30)
    extra = _expect_duplicates(truth, topic, copies)
    truth.facts.update(messages=20, copies=len(copies), duplicate_in_mirror=extra)
    ctx.say(f"mirror_kill: 20 messages, MM2 SIGKILLed after copying 10 and restarted: {len(copies)} copies "
            f"on the target, {extra} extra")
    return truth


def mirror_retention(ctx: Context) -> Truth:
    """MM2 copies 5 messages and stops; 10 more are produced during its outage and the source's
    retention (cut to 1s, shorter than the outage) deletes them before MM2 is back; the restarted
    MM2 resumes at the new log start and copies 5 later messages: the 10 are lost in the mirror."""
    from confluent_kafka import Consumer, TopicPartition

    truth = Truth("mirror_retention")
    if ctx.capture_now is None:
        raise InputError("scenario 'mirror_retention' needs a capture before Kafka deletes the records")
    topic, target, mm2 = _mirror_setup(ctx, "lab-mirror-retention", flush_ms=1000)
    truth.topic(topic)
    p = ctx.producer("lab-mirror-retention", **{"linger.ms": 5})
    acks = Acks()

    def retention(ms: str) -> None:
        alter_configs(ctx.lab.bootstrap, "topic", topic, {"retention.ms": ms})

    try:
        _produce_batch(p, topic, acks, range(0, 5))
        mm2.start()
        mm2.wait_records(topic, 5, timeout=180)
        mm2.stop()  # clean stop: its source offsets are flushed, nothing is copied twice
        _produce_batch(p, topic, acks, range(5, 15))
        ctx.capture_now(topic)  # the audit's regular capture sees the outage's records at the source
        retention("1000")
        probe = Consumer({"bootstrap.servers": ctx.lab.bootstrap, "group.id": f"{topic}-probe", "log_level": 0})
        deadline, start = time.monotonic() + 90, 0
        try:
            while time.monotonic() < deadline:
                start, _ = probe.get_watermark_offsets(TopicPartition(topic, 0), timeout=5)
                if start >= 15:
                    break
                time.sleep(0.5)
        finally:
            probe.close()
        if start < 15:
            raise BrokerError(f"mirror_retention: Kafka did not delete the outage's records within 90s (log start {start})")
        retention("604800000")
        _produce_batch(p, topic, acks, range(15, 20))
        mm2.start()
        mm2.wait_records(topic, 10, timeout=180)
        time.sleep(2)
        mm2.stop()
    finally:
        p.close()
    copies = _read_copies(target.bootstrap_servers, mm2.target_topic(topic), 10)
    copied = {(pid, seq) for _, _, pid, seq in copies}
    pid = p.pid
    outage = range(5, 15)
    if any((pid, seq) in copied for seq in outage):
        raise BrokerError("mirror_retention: MM2 copied a record of its outage; the fault did not happen")
    for seq in outage:
        part, off = acks.acked[seq]
        truth.expect(topic, f"mirror:{MIRROR_NAME}", "lost_in_mirror", part, pid, seq, off)
    extra = _expect_duplicates(truth, topic, copies)
    truth.facts.update(messages=20, lost_in_mirror=len(outage), copies=len(copies), duplicate_in_mirror=extra,
                       source_log_start_after=start)
    ctx.say(f"mirror_retention: MM2 down while 10 messages came and the source's retention (1s) deleted them; "
            f"{len(copies)} copies on the target")
    return truth


def _set_topic_config(bootstrap: str, topic: str, key: str, value: str, timeout: float = 30) -> None:
    """Set one topic config on that cluster and wait until its broker reports the new value."""
    from confluent_kafka.admin import AdminClient, ConfigResource, ResourceType

    alter_configs(bootstrap, "topic", topic, {key: value}, timeout)
    admin = AdminClient({"bootstrap.servers": bootstrap, "log_level": 0})
    deadline, seen = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        (fut,) = admin.describe_configs([ConfigResource(ResourceType.TOPIC, topic)]).values()
        entry = fut.result(timeout).get(key)
        seen = None if entry is None else entry.value
        if seen == value:
            return
        time.sleep(0.2)
    raise BrokerError(f"lab: {topic} at {bootstrap} still has {key}={seen} {timeout:.0f}s after setting it to {value}")


def _wait_watermarks(bootstrap: str, topic: str, low: int = 0, high: int = 0, timeout: float = 90,
                     mm2: Any = None) -> tuple[int, int]:
    """Poll partition 0 of `topic` until its log start offset is >= `low` and its high watermark
    >= `high`; return (log start, high watermark), or raise BrokerError naming what was seen (at
    once if `mm2`, the LocalMirrorMaker that should be writing there, exited)."""
    from confluent_kafka import Consumer, TopicPartition

    probe = Consumer({"bootstrap.servers": bootstrap, "group.id": f"lab-probe-{topic}", "log_level": 0})
    deadline, lo, hi = time.monotonic() + timeout, -1, -1
    try:
        while time.monotonic() < deadline:
            if mm2 is not None and mm2.pid is None:
                raise BrokerError(f"MirrorMaker 2 exited; see {mm2.log_file}:\n{mm2.log_tail()}")
            lo, hi = probe.get_watermark_offsets(TopicPartition(topic, 0), timeout=5)
            if lo >= low and hi >= high:
                return int(lo), int(hi)
            time.sleep(0.2)
    finally:
        probe.close()
    raise BrokerError(f"lab: {topic} at {bootstrap} has log start {lo}, high watermark {hi} after {timeout:.0f}s "
                      f"(waited for >= {low}, >= {high})")


TARGET_RETENTION_MS = 2000


def mirror_target_retention(ctx: Context) -> Truth:
    """The TARGET topic's retention is shorter than MM2's outage. The copy keeps the source's
    timestamps (CreateTime, the default of a topic MM2 creates: MM2 copies each record's
    timestamp). MM2 copies 5 messages and stops cleanly; a capture reads them on the target; the
    copy's retention.ms is cut to 2 s; 10 messages are produced during the outage, which lasts
    longer than that; the restarted MM2 copies them with their old timestamps and the target's
    retention deletes them at once, before any capture reads them; the retention is restored and 5
    later messages (fresh timestamps) are copied and kept: the 10 are lost in the mirror.

    The 5 copied before the outage are older still, and retention deletes a log prefix, so they
    go too; the capture before the outage read them (`mirror_records` keeps what a capture read),
    as a regular audit capture would have. The lab's MM2 runs with
    `sync.topic.configs.enabled=false` (audit.runtime.local_mirror), so it never overwrites the
    copy's retention.ms with the source's; both lab clusters check retention every second
    (`log.retention.check.interval.ms=1000`), and Kafka rolls the active segment once it breaches
    retention, so no small segment.ms is needed."""
    truth = Truth("mirror_target_retention")
    if ctx.capture_now is None:
        raise InputError("scenario 'mirror_target_retention' needs a capture of the mirror before the outage")
    topic, target, mm2 = _mirror_setup(ctx, "lab-mirror-target-retention", flush_ms=1000,
                                       copy_config={"message.timestamp.type": "CreateTime"})
    truth.topic(topic)
    copy = mm2.target_topic(topic)
    p = ctx.producer("lab-mirror-target-retention", **{"linger.ms": 5})
    acks = Acks()
    try:
        _produce_batch(p, topic, acks, range(0, 5))
        mm2.start()
        mm2.wait_records(topic, 5, timeout=180)
        mm2.stop()  # clean stop: its source offsets are flushed, nothing is copied twice
        first = _read_copies(target.bootstrap_servers, copy, 5)
        ctx.capture_now(topic)  # the audit's regular capture reads the first copies on the target
        _set_topic_config(target.bootstrap_servers, copy, "retention.ms", str(TARGET_RETENTION_MS))
        _produce_batch(p, topic, acks, range(5, 15))
        produced = time.monotonic()
        # the outage outlasts the target's retention: the copies will arrive already expired
        time.sleep(max(0.0, produced + TARGET_RETENTION_MS / 1000 + 0.5 - time.monotonic()))
        mm2.start()
        # the outage's copies reach the target (its log end passes them) ...
        _, copied_to = _wait_watermarks(target.bootstrap_servers, copy, high=15, timeout=180, mm2=mm2)
        try:  # ... and its retention deletes them (its log start passes them)
            start, _ = _wait_watermarks(target.bootstrap_servers, copy, low=15, timeout=60)
        except BrokerError as e:
            raise BrokerError(f"mirror_target_retention: the target's retention did not delete the outage's "
                              f"copies; the fault did not happen ({e})") from e
        _set_topic_config(target.bootstrap_servers, copy, "retention.ms", "604800000")
        _produce_batch(p, topic, acks, range(15, 20))
        _, end = _wait_watermarks(target.bootstrap_servers, copy, high=20, timeout=180, mm2=mm2)
        time.sleep(2)  # anything MM2 would copy beyond the 20 (it must not)
        mm2.stop()
    finally:
        p.close()
    later = _read_copies(target.bootstrap_servers, copy, 5)
    pid = p.pid
    outage = range(5, 15)
    if [(c_pid, seq) for _, _, c_pid, seq in sorted(first)] != [(pid, s) for s in range(0, 5)]:
        raise BrokerError(f"mirror_target_retention: the first copies on the target are not seqs 0-4: {first}")
    if any(c_pid == pid and seq in outage for _, _, c_pid, seq in later):
        raise BrokerError("mirror_target_retention: a copy of an outage record survived on the target; "
                          "the fault did not happen")
    for seq in outage:
        part, off = acks.acked[seq]
        truth.expect(topic, f"mirror:{MIRROR_NAME}", "lost_in_mirror", part, pid, seq, off)
    extra = _expect_duplicates(truth, topic, first + later)
    truth.facts.update(messages=20, lost_in_mirror=len(outage), copies_read=len(first) + len(later),
                       duplicate_in_mirror=extra, target_copied_to=copied_to, target_log_start_after=start,
                       target_end=end)
    ctx.say(f"mirror_target_retention: MM2 down while 10 messages came; the copy's retention "
            f"({TARGET_RETENTION_MS} ms) deleted them as MM2 copied them (target log start {start}); "
            f"{len(first)} copies read before the outage, {len(later)} after")
    return truth


def _committed_on(bootstrap: str, group: str, topic: str, timeout: float) -> int:
    """The group's committed offset of `topic` partition 0 on that cluster, once it has one."""
    from confluent_kafka import Consumer, TopicPartition

    c = Consumer({"bootstrap.servers": bootstrap, "group.id": group, "enable.auto.commit": False, "log_level": 0})
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            (tp,) = c.committed([TopicPartition(topic, 0)], timeout=10)
            if tp.error is None and tp.offset >= 0:
                return int(tp.offset)
            time.sleep(0.5)
    finally:
        c.close()
    raise BrokerError(f"lab: group {group!r} has no committed offset on {topic} at {bootstrap} after {timeout:.0f}s")


def mirror_failover(ctx: Context) -> Truth:
    """An AuditedConsumer group processes 10 of 20 messages on the source and stops; MM2 (checkpoints,
    `sync.group.offsets.enabled=true`, offset syncs only every 100 records: `offset.lag.max=100`)
    translates its committed offset to the target, where the group resumes on the copy. MM2
    translates at its last offset-sync point, so the translated offset lies before the source's:
    the records in between are processed again (`redelivered`); had it lain after, the records
    skipped would be `missed`. Truth: what the group's handler actually processed on each cluster."""
    from audit.clients.consumer import AuditedConsumer, ConsumedRecord

    truth = Truth("mirror_failover")
    group = "lab-failover-g"
    topic, target, mm2 = _mirror_setup(ctx, "lab-mirror-failover", flush_ms=1000, group=group,
                                       extra={"offset.lag.max": "100"})
    group = f"{topic}-g"  # one group per run of the scenario (MM2 syncs it by name)
    topic_cfg = ctx.topics[topic]
    mirror = replace(topic_cfg.mirrors[0], failover_groups=(group,))
    ctx.topics[topic] = replace(topic_cfg, groups=(group,), mirrors=(mirror,))
    mm2.groups = (group,)
    truth.topic(topic)
    p = ctx.producer("lab-mirror-failover", **{"linger.ms": 5})
    acks = Acks()
    try:
        _produce_batch(p, topic, acks, range(0, 20))
    finally:
        p.close()
    pid = p.pid
    processed: dict[str, list[int]] = {"source": [], "target": []}

    def consume(where: str, bootstrap: str, topics: list[str], **kw: Any) -> None:
        conf = {"bootstrap.servers": bootstrap, "auto.offset.reset": "earliest", "session.timeout.ms": 6000,
                "heartbeat.interval.ms": 500, "log_level": 0}

        def handle(rec: ConsumedRecord) -> None:
            if rec.audit.seq is not None and rec.audit.pid == pid:
                processed[where].append(rec.audit.seq)

        consumer = AuditedConsumer(conf, topics=topics, group=group, name=f"lab-failover-{where}",
                                   ledger_dir=ctx.ledger_dir, batch_size=5, poll_timeout_s=0.2, **kw)
        with consumer:
            if where == "source":
                consumer.run(handle, max_messages=10)
            else:
                consumer.run(handle, idle_timeout_s=5)

    consume("source", ctx.lab.bootstrap, [topic])  # processes and commits the first 10, then leaves
    source_committed = _committed_on(ctx.lab.bootstrap, group, topic, 30)
    copy = mm2.target_topic(topic)
    try:
        mm2.start()
        mm2.wait_records(topic, 20, timeout=180)
        translated = _committed_on(target.bootstrap_servers, group, copy, 120)
    finally:
        mm2.stop()  # before the group resumes there: MM2 must not sync offsets under an active group
    consume("target", target.bootstrap_servers, [copy], cluster=MIRROR_NAME)
    src, dst = set(processed["source"]), processed["target"]
    stage = f"group:{group}"
    redelivered = sorted(seq for seq in dst if seq in src)
    missed = sorted(seq for seq in range(20) if seq not in src and seq not in dst)
    for seq in redelivered:
        part, off = acks.acked[seq]
        truth.expect(topic, stage, "redelivered", part, pid, seq, off)
    for seq in missed:
        part, off = acks.acked[seq]
        truth.expect(topic, stage, "missed", part, pid, seq, off)
    truth.facts.update(messages=20, processed_on_source=len(src), source_committed=source_committed,
                       translated_offset=translated, processed_on_target=len(dst), redelivered=len(redelivered),
                       missed=len(missed))
    ctx.say(f"mirror_failover: group processed {len(src)} on the source (committed {source_committed}); MM2 "
            f"translated it to {translated} on the target, where it processed {len(dst)}: "
            f"{len(redelivered)} processed twice, {len(missed)} skipped")
    return truth


SCENARIOS.update({
    "mirror_kill": (mirror_kill, "MirrorMaker 2 SIGKILLed mid-stream and restarted: records copied twice"),
    "mirror_retention": (mirror_retention, "the source's retention is shorter than MirrorMaker 2's outage"),
    "mirror_target_retention": (mirror_target_retention, "the mirror target topic's retention is shorter than "
                                                         "MirrorMaker 2's outage: the late copies expire on arrival"),
    "mirror_failover": (mirror_failover, "a consumer group fails over to the MirrorMaker 2 copy at the translated "
                                         "offset: records processed twice or skipped"),
})

from audit.lab.connect import CONNECT  # noqa: E402 - it needs nothing of this module at import time

SCENARIOS.update(CONNECT)
# The share group scenarios (audit.lab.share) run on the same broker.
from audit.lab.share import SHARE_SCENARIOS  # noqa: E402 - it uses this module's helpers

SCENARIOS.update(SHARE_SCENARIOS)

# Scenarios that run on one broker behind the proxy (the demo's "mixed" set runs a selection); the
# MirrorMaker 2 scenarios run on it too (last: their second cluster lives until the audit is done).
# The Connect and Structured Streaming ones (audit.lab.connect) run on any one broker, with a Connect
# worker and Spark.
MIRROR_SCENARIOS = ("mirror_kill", "mirror_retention", "mirror_target_retention", "mirror_failover")
CLUSTER_SCENARIOS = ("lost_acked",)
CONNECT_SCENARIOS = tuple(CONNECT)
PROXY_SCENARIOS = tuple(n for n in SCENARIOS if n not in CLUSTER_SCENARIOS and n not in CONNECT_SCENARIOS)

