"""The lab's share group scenarios (KIP-932, stage `share:<group>`, docs/design.md §5.9).

Each creates its own topic and share group, sets the group's configs through the Admin API
(`incrementalAlterConfigs` on resource type GROUP: `share.auto.offset.reset=earliest`, a short
`share.record.lock.duration.ms`, a small `share.delivery.count.limit`; the lab's broker allows a
lock of 1 s, `group.share.min.record.lock.duration.ms`, audit.runtime.local_kafka), runs its members
as `audit.lab.share_worker` processes and returns the ground truth:

  share_kill      a member SIGKILLed holding the records of its first poll; after their locks
                  expire another member gets each again (delivery 2): redelivered
  share_poison    a poison record rejected by its member: rejected
  share_archive   a record released at every delivery until the group's limit (3) archives it:
                  redelivered x2, archived_unprocessed
  share_slow      a member sleeps longer than the lock (2 s) on a record, accepts it (refused: the
                  lock had expired) and leaves; another member takes it and accepts it:
                  redelivered, processed_twice
  share_clean     three members share 30 records on 3 partitions: no anomaly
  share_missed    10 records; before any member joins, the group's start offset is moved to 4
                  (Admin.alterShareGroupOffsets, audit.runtime.share_admin); a member then gets
                  the other 6: missed x4 (capture, after the scenarios, snapshots the start offset)
  share_dlq       a group with a dead-letter topic (KIP-1191): a poison record rejected and one
                  released until the limit (3) are both written there by the broker:
                  redelivered x2, dead_lettered x2

Where the truth comes from: the members' own record of every record handed to their handler and
of each answer (the workers' truth files, which survive SIGKILL) and the marker of the killed
member, and (share_dlq) the group's dead-letter topic read back; never the audit's tables, ledgers
or rules. Each scenario also checks that its fault happened (e.g. the held records reached the
other member at delivery 2), and fails otherwise.

Registered in `audit.lab.scenarios.SCENARIOS`; this module must not import Spark.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from audit.core.config import ShareGroupConfig, SlaRule, TopicConfig
from audit.core.errors import BrokerError
from audit.lab.env import alter_configs
from audit.lab.truth import Truth

if TYPE_CHECKING:
    from audit.lab.scenarios import Context

LOCK_MS = 2000  # the kill and slow scenarios' acquisition lock
SLOW_S = 4.0  # how long the slow member works on its record: twice the lock
ARCHIVE_LIMIT = 3
# No SLA rule on redeliveries: they are normal queue behaviour (docs/design.md §5.9).
SHARE_SLA = (SlaRule("max_lost", 0), SlaRule("max_duplicate_ratio", 0))


@dataclass
class Observed:
    """What the members' handlers saw of one record: (member, delivery count) per delivery, and
    (member, answer) per answer."""

    deliveries: list[tuple[str, int]] = field(default_factory=list)
    answers: list[tuple[str, str]] = field(default_factory=list)

    def expected(self, limit: int, dead_lettered: bool = False) -> list[str]:
        """The share stage's anomaly codes this record's history means, one per row (§5.9);
        `dead_lettered`: the group's dead-letter topic holds a record naming it."""
        codes = ["redelivered"] * max(0, len(self.deliveries) - 1)
        accepts = sum(1 for _, a in self.answers if a == "accept")
        if accepts:
            codes += ["processed_twice"] * (accepts - 1)
        elif dead_lettered:
            codes.append("dead_lettered")
        elif any(a == "reject" for _, a in self.answers):
            codes.append("rejected")
        elif any(n >= limit for _, n in self.deliveries):
            codes.append("archived_unprocessed")
        return codes


def observed(lines: list[str]) -> dict[tuple[int, int], Observed]:
    """(partition, offset) -> Observed, from the workers' truth lines (audit.lab.share_worker)."""
    out: dict[tuple[int, int], Observed] = defaultdict(Observed)
    for line in lines:
        what, name, part, off, value = line.split()
        rec = out[(int(part), int(off))]
        if what == "delivered":
            rec.deliveries.append((name, int(value)))
        elif what == "answered":
            rec.answers.append((name, value))
        else:
            raise ValueError(f"share lab: unknown truth line {line!r}")
    return dict(out)


def set_group_configs(bootstrap: str, group: str, **settings: Any) -> None:
    """Set share group configs (dots as underscores) with incrementalAlterConfigs on GROUP `group`."""
    try:
        alter_configs(bootstrap, "group", group, {k.replace("_", "."): v for k, v in settings.items()})
    except BrokerError as e:
        raise BrokerError(f"{e} (share groups need a Kafka 4.2+ broker with share.version=1; a lock under 15 s "
                          f"needs group.share.min.record.lock.duration.ms lowered)") from e


class Members:
    """The scenario's share_worker processes; their truth lines go to one file per scenario."""

    def __init__(self, ctx: Context, topic: str, group: str) -> None:
        self.ctx, self.topic, self.group = ctx, topic, group
        self.truth_file = ctx.work / f"{group}.truth"
        self.done = ctx.work / f"{group}.done"
        self.procs: dict[str, subprocess.Popen[str]] = {}

    def start(self, name: str, *, hold: bool = False, once: bool = False, idle_s: float = 2.0) -> Path:
        marker = self.ctx.work / f"{self.group}.{name}.held.json"
        cmd = [sys.executable, "-m", "audit.lab.share_worker", "--bootstrap", self.ctx.lab.bootstrap,
               "--topic", self.topic, "--group", self.group, "--name", name, "--ledger-dir", str(self.ctx.ledger_dir),
               "--truth", str(self.truth_file), "--idle-s", str(idle_s), "--done", str(self.done)]
        if hold:
            cmd += ["--hold", "--marker", str(marker)]
        if once:
            cmd.append("--once")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[2]),
                                                              os.environ.get("PYTHONPATH", "")])}
        self.procs[name] = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        return marker

    def lines(self) -> list[str]:
        return self.truth_file.read_text().splitlines() if self.truth_file.exists() else []

    def wait_for(self, what: str, ok: Any, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while not ok():
            dead = [(n, p) for n, p in self.procs.items() if p.poll() is not None and p.returncode != 0]
            if dead or time.monotonic() > deadline:
                err = "; ".join(f"{n} exited {p.returncode}: {(p.stderr.read() if p.stderr else '')[-600:]}"
                                for n, p in dead)
                raise BrokerError(f"share lab ({self.group}): {what} did not happen within {timeout:.0f}s {err}")
            time.sleep(0.05)

    def kill(self, name: str) -> None:
        proc = self.procs[name]
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)

    def join(self, timeout: float = 120) -> None:
        """Wait for every member still running to stop on its own (idle)."""
        try:
            for name, proc in self.procs.items():
                if proc.returncode is not None:
                    continue
                rc = proc.wait(timeout)
                if rc != 0:
                    raise BrokerError(f"share lab worker {name} ({self.group}) failed with {rc}: "
                                      f"{(proc.stderr.read() if proc.stderr else '').strip()[-800:]}")
        finally:
            for proc in self.procs.values():
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()


def _setup(ctx: Context, name: str, partitions: int = 1, limit: int = 5, lock_ms: int | None = None,
           dlq: str | None = None) -> tuple[str, str, Truth]:
    truth = Truth(name)
    topic = ctx.lab.create_topic(f"lab-{name.replace('_', '-')}", partitions=partitions)
    group = f"{topic}-q"
    configs: dict[str, Any] = {"share_auto_offset_reset": "earliest", "share_delivery_count_limit": limit}
    if lock_ms is not None:
        configs["share_record_lock_duration_ms"] = lock_ms
    if dlq is not None:
        configs["errors_deadletterqueue_topic_name"] = dlq
    set_group_configs(ctx.lab.bootstrap, group, **configs)
    ctx.topics[topic] = TopicConfig(name=topic, window=ctx.window, grace=ctx.grace, sla=SHARE_SLA,
                                    share_groups=(ShareGroupConfig(group, limit, dlq),))
    truth.topic(topic)
    return topic, group, truth


def _fill(ctx: Context, topic: str, bodies: list[dict[str, Any]], producer: str) -> tuple[str, dict[tuple[int, int], int]]:
    """Produce one audited JSON message per body, keyed by its index (spread over the partitions);
    returns (pid, (partition, offset) -> seq)."""
    from audit.lab.scenarios import Acks, _flush, _produce

    p = ctx.producer(producer, **{"linger.ms": 5})
    acks = Acks()
    try:
        for i, body in enumerate(bodies):
            _produce(p, topic, acks, i, json.dumps({"n": i, **body}).encode(), key=str(i).encode())
        _flush(p)
    finally:
        p.close()
    if len(acks.acked) != len(bodies):
        raise BrokerError(f"lab: only {len(acks.acked)} of {len(bodies)} messages acked on {topic}: {acks.failed}")
    return p.pid, {po: seq for seq, po in acks.acked.items()}


def _expect(truth: Truth, topic: str, group: str, pid: str, seq_at: dict[tuple[int, int], int],
            seen: dict[tuple[int, int], Observed], limit: int, *, skipped: frozenset[tuple[int, int]] = frozenset(),
            dead: frozenset[tuple[int, int]] = frozenset()) -> None:
    """Expect every record's rows by what its members saw (and `dead`: the positions the group's
    dead-letter topic names); every record produced must have been seen, but the `skipped` ones
    (below a start offset moved past them), which none may have been."""
    unseen = sorted(set(seq_at) - set(seen) - skipped)
    if unseen:
        raise BrokerError(f"share lab ({group}): no member was handed {unseen}")
    if handed := sorted(skipped & set(seen)):
        raise BrokerError(f"share lab ({group}): {handed} were handed to a member although the group's start "
                          "offset had moved past them")
    for part, off in sorted(skipped):
        truth.expect(topic, f"share:{group}", "missed", part, pid, seq_at[(part, off)], off)
    for (part, off), obs in sorted(seen.items()):
        for code in obs.expected(limit, (part, off) in dead):
            truth.expect(topic, f"share:{group}", code, part, pid, seq_at[(part, off)], off)
    truth.facts.update(messages=len(seq_at), deliveries=sum(len(o.deliveries) for o in seen.values()))


def share_kill(ctx: Context) -> Truth:
    """Member `doomed` polls once and is SIGKILLed holding what it got; `survivor` then gets it again."""
    topic, group, truth = _setup(ctx, "share_kill", lock_ms=LOCK_MS)
    pid, seq_at = _fill(ctx, topic, [{}] * 10, "lab-share-kill")
    members = Members(ctx, topic, group)
    marker = members.start("doomed", hold=True)
    members.wait_for("the doomed member's first poll", marker.exists)
    members.kill("doomed")
    held = {(int(p), int(o)) for p, o, _ in json.loads(marker.read_text())["records"]}
    members.start("survivor")
    members.join()
    seen = observed(members.lines())
    again = {po for po, obs in seen.items() if ("survivor", 2) in obs.deliveries}
    if not held or again != held:
        raise BrokerError(f"share_kill: the survivor got {sorted(again)} at delivery 2, the dead member held "
                          f"{sorted(held)}; the fault did not happen as designed")
    _expect(truth, topic, group, pid, seq_at, seen, 5)
    truth.facts.update(held_when_killed=len(held))
    ctx.say(f"share_kill: a member SIGKILLed holding {len(held)} records; another got them again at delivery 2")
    return truth


def share_poison(ctx: Context) -> Truth:
    """One member; record n=3 is poison: the member rejects it."""
    topic, group, truth = _setup(ctx, "share_poison")
    pid, seq_at = _fill(ctx, topic, [{"poison": True} if i == 3 else {} for i in range(10)], "lab-share-poison")
    members = Members(ctx, topic, group)
    members.start("m1")
    members.join()
    seen = observed(members.lines())
    _expect(truth, topic, group, pid, seq_at, seen, 5)
    ctx.say("share_poison: 10 records, the poison one rejected")
    return truth


def share_archive(ctx: Context) -> Truth:
    """One member releases record n=2 at every delivery; the group's limit (3) archives it."""
    topic, group, truth = _setup(ctx, "share_archive", limit=ARCHIVE_LIMIT)
    pid, seq_at = _fill(ctx, topic, [{"release": True} if i == 2 else {} for i in range(5)], "lab-share-archive")
    members = Members(ctx, topic, group)
    members.start("m1")
    members.join()
    seen = observed(members.lines())
    counts = sorted(n for obs in seen.values() if any(a == "release" for _, a in obs.answers) for _, n in obs.deliveries)
    if counts != list(range(1, ARCHIVE_LIMIT + 1)):
        raise BrokerError(f"share_archive: the released record's deliveries were {counts}, not 1..{ARCHIVE_LIMIT}")
    _expect(truth, topic, group, pid, seq_at, seen, ARCHIVE_LIMIT)
    ctx.say(f"share_archive: a record released {ARCHIVE_LIMIT} times, archived by the broker")
    return truth


def dead_letters(bootstrap: str, dlq: str, topic: str, want: int, timeout: float = 60) -> dict[tuple[int, int], str]:
    """(partition, offset) of `topic` -> the broker's reason, for each record of share group
    dead-letter topic `dlq` (KIP-1191: its __dlq.errors.topic / partition / offset / message
    headers), read from the start once it holds `want` records (the broker writes them
    asynchronously, after the reject or the archiving)."""
    from confluent_kafka import Consumer, TopicPartition

    c = Consumer({"bootstrap.servers": bootstrap, "group.id": f"lab-read-{dlq}", "enable.auto.commit": False,
                  "auto.offset.reset": "earliest", "log_level": 0})
    out: dict[tuple[int, int], str] = {}
    try:
        c.assign([TopicPartition(dlq, 0, 0)])
        deadline = time.monotonic() + timeout
        while len(out) < want and time.monotonic() < deadline:
            msg = c.poll(0.5)
            if msg is None or msg.error():
                continue
            h = {k: (v or b"").decode() for k, v in cast(list[tuple[str, bytes | None]], list(msg.headers() or []))}
            if h.get("__dlq.errors.topic") == topic:
                out[(int(h["__dlq.errors.partition"]), int(h["__dlq.errors.offset"]))] = h.get("__dlq.errors.message", "")
    finally:
        c.close()
    return out


def share_dlq(ctx: Context) -> Truth:
    """A share group with a dead-letter topic (KIP-1191, share.version=2): record n=1 is poison (the
    member rejects it), record n=4 is released at every delivery until the limit (3); the broker
    writes both to the DLQ topic, where they are accounted for instead of rejected or lost."""
    dlq = ctx.lab.create_topic("dlq.lab-share-dlq", errors_deadletterqueue_group_enable="true")
    topic, group, truth = _setup(ctx, "share_dlq", limit=ARCHIVE_LIMIT, dlq=dlq)
    bodies = [{"poison": True} if i == 1 else {"release": True} if i == 4 else {} for i in range(6)]
    pid, seq_at = _fill(ctx, topic, bodies, "lab-share-dlq")
    members = Members(ctx, topic, group)
    members.start("m1")
    members.join()
    seen = observed(members.lines())
    failed = {po for po, obs in seen.items() if any(a in ("reject", "release") for _, a in obs.answers)}
    dead = dead_letters(ctx.lab.bootstrap, dlq, topic, len(failed))
    if set(dead) != failed:
        raise BrokerError(f"share_dlq: the dead-letter topic {dlq} names {sorted(dead)}, the member rejected or "
                          f"released {sorted(failed)}; the broker dead-letters only with share.version=2 "
                          "(kafka-features.sh upgrade --feature share.version=2)")
    _expect(truth, topic, group, pid, seq_at, seen, ARCHIVE_LIMIT, dead=frozenset(dead))
    truth.facts.update(dead_lettered=len(dead), dlq_reasons=sorted(set(dead.values())))
    ctx.say(f"share_dlq: a poison record rejected and one released {ARCHIVE_LIMIT} times, both in {dlq}")
    return truth


def share_slow(ctx: Context) -> Truth:
    """Member `slow` works on the only record longer than its lock, accepts it and leaves; member
    `quick`, started once `slow` has it, gets it after the lock expires and accepts it. (`slow` leaves
    after its one answer so that the redelivery cannot go back to it while `quick` is still joining.)"""
    topic, group, truth = _setup(ctx, "share_slow", lock_ms=LOCK_MS)
    pid, seq_at = _fill(ctx, topic, [{"slow": SLOW_S}], "lab-share-slow")
    members = Members(ctx, topic, group)
    members.start("slow", once=True)
    members.wait_for("the slow member's delivery", lambda: any(ln.startswith("delivered slow") for ln in members.lines()))
    members.start("quick", idle_s=1.5)
    members.join()
    seen = observed(members.lines())
    (obs,) = seen.values()
    if sorted(a for a in obs.answers) != [("quick", "accept"), ("slow", "accept")]:
        raise BrokerError(f"share_slow: expected both members to accept the record, saw {obs}")
    _expect(truth, topic, group, pid, seq_at, seen, 5)
    ctx.say(f"share_slow: a member worked {SLOW_S:.0f}s on a record with a {LOCK_MS / 1000:.0f}s lock; "
            "another took it and both accepted it")
    return truth


def share_clean(ctx: Context) -> Truth:
    """Three members, 30 records on 3 partitions, every record accepted once."""
    topic, group, truth = _setup(ctx, "share_clean", partitions=3)
    pid, seq_at = _fill(ctx, topic, [{}] * 30, "lab-share-clean")
    members = Members(ctx, topic, group)
    for name in ("m1", "m2", "m3"):
        members.start(name)
    members.wait_for("every record answered", lambda: sum(ln.startswith("answered") for ln in members.lines()) >= 30)
    members.done.write_text("done")
    members.join()
    seen = observed(members.lines())
    _expect(truth, topic, group, pid, seq_at, seen, 5)
    truth.facts.update(members=len({n for obs in seen.values() for n, _ in obs.deliveries}))
    ctx.say(f"share_clean: 3 members shared 30 records ({truth.facts['members']} of them were handed some)")
    return truth


MISSED_RECORDS, MISSED_SKIPPED = 10, 4


def share_missed(ctx: Context) -> Truth:
    """Before any member joins, the group's start offset is moved past the first records; the member
    started afterwards is handed only the rest, and the skipped records are lost to the group."""
    from audit.runtime.share_admin import alter_start_offsets, start_offsets

    topic, group, truth = _setup(ctx, "share_missed")
    pid, seq_at = _fill(ctx, topic, [{}] * MISSED_RECORDS, "lab-share-missed")
    kafka = {"bootstrap.servers": ctx.lab.bootstrap}
    alter_start_offsets(kafka, group, topic, {0: MISSED_SKIPPED})
    got = start_offsets(kafka, [group])
    if got.offsets != {(group, topic, 0): MISSED_SKIPPED}:
        raise BrokerError(f"share_missed: the group's start offsets are {got.offsets} {got.notes}, not "
                          f"{MISSED_SKIPPED} on {topic}[0]; the fault did not happen as designed")
    members = Members(ctx, topic, group)
    members.start("m1")
    members.join()
    seen = observed(members.lines())
    skipped = frozenset(po for po in seq_at if po[1] < MISSED_SKIPPED)
    _expect(truth, topic, group, pid, seq_at, seen, 5, skipped=skipped)
    truth.facts.update(skipped=len(skipped))
    ctx.say(f"share_missed: the group's start offset moved to {MISSED_SKIPPED} before any member joined; "
            f"a member then got the other {MISSED_RECORDS - MISSED_SKIPPED} records")
    return truth


SHARE_SCENARIOS = {
    "share_kill": (share_kill, "share group: a member SIGKILLed holding acquired records; lock expiry, redelivery"),
    "share_poison": (share_poison, "share group: a poison record rejected"),
    "share_archive": (share_archive, "share group: a record released until the delivery limit archives it"),
    "share_slow": (share_slow, "share group: a member slower than the acquisition lock; processed twice"),
    "share_clean": (share_clean, "share group: three members, no anomaly"),
    "share_missed": (share_missed, "share group: its start offset moved past records no member was handed"),
    "share_dlq": (share_dlq, "share group with a dead-letter topic: a rejected and an archived record in it"),
}
