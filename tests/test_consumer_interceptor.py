"""The consumer interceptor (`io.msgaudit.interceptors.AuditConsumerInterceptor`) in a plain Java
consumer-group member that knows nothing of msgaudit: `interceptor.classes` and `msgaudit.*`
client properties only (docs/design.md §3.4, §5.3). Real broker, real Spark."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import uuid
from collections import Counter
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import audit_topic, new_topic

CONSUMER_INTERCEPTOR = "interceptor.classes=io.msgaudit.interceptors.AuditConsumerInterceptor"
PRODUCER_INTERCEPTOR = "interceptor.classes=io.msgaudit.interceptors.AuditProducerInterceptor"


def rows_of(folder: Path) -> list[dict[str, Any]]:
    """Every ledger row in a folder, sealed or still open (a killed writer's segment)."""
    out = []
    for f in sorted(folder.glob("*.jsonl*")):
        out += [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
    return out


def got(stdout: str) -> list[tuple[int, int]]:
    return [(int(p), int(o)) for _, p, o in (line.split() for line in stdout.splitlines() if line.startswith("GOT "))]


@pytest.mark.kafka
def test_bad_configuration_stops_the_consumer_at_start(java_consumer: list[str], kafka_bootstrap: str,
                                                       tmp_path: Path) -> None:
    topic = new_topic(kafka_bootstrap)
    cases = [
        ([f"msgaudit.ledger.dir={tmp_path / 'missing'}"],
         f"msgaudit.ledger.dir: {tmp_path / 'missing'}: No such file or directory (create the ledger folder first)"),
        ([f"msgaudit.ledger.dir={tmp_path}", "msgaudit.consumer.nam=x"],
         'unknown msgaudit property "msgaudit.consumer.nam" (known: msgaudit.ledger.dir, '),
        ([f"msgaudit.ledger.dir={tmp_path}", "msgaudit.handover.wait.ms=-1"],
         'msgaudit.handover.wait.ms: expected a positive integer, got "-1"'),
        ([f"msgaudit.ledger.dir={tmp_path}", "msgaudit.cluster="],
         "msgaudit.cluster must not be empty (the mirror's name, mirrors[].name)"),
        ([f"msgaudit.ledger.dir={tmp_path}", "msgaudit.source.topics=a=b"],
         "msgaudit.source.topics needs msgaudit.cluster (it names a mirror's copies)"),
        ([f"msgaudit.ledger.dir={tmp_path}", "msgaudit.cluster=dr", "msgaudit.source.topics=orders"],
         'msgaudit.source.topics: expected copy=topic[,copy=topic...], got "orders" (e.g. src.orders=orders)'),
    ]
    for props, message in cases:
        r = subprocess.run([*java_consumer, topic, "-1", f"bootstrap.servers={kafka_bootstrap}", "group.id=g-bad",
                            CONSUMER_INTERCEPTOR, *props], capture_output=True, text=True, timeout=60)
        assert r.returncode != 0 and "GOT" not in r.stdout and "DONE" not in r.stdout
        assert message in r.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.kafka
def test_a_member_reading_a_mirror_copy_writes_the_audited_topic_and_the_mirror(
        java_producer: list[str], java_consumer: list[str], kafka_bootstrap: str, tmp_path: Path) -> None:
    """A failed-over group member reads MM2's copy `src.<topic>` (here a topic of that name on one
    broker, its records stamped by the producer interceptor): with `msgaudit.cluster=dr` each row
    names the audited topic (the copy's name after its first '.', or `msgaudit.source.topics`), the
    copy's partition and offset, and `cluster` = dr (docs/design.md §5.5)."""
    copy = new_topic(kafka_bootstrap, prefix="src.orders")
    audited = copy.split(".", 1)[1]
    pspool = tmp_path / "producer"
    pspool.mkdir()
    j = subprocess.run([*java_producer, copy, "4", f"bootstrap.servers={kafka_bootstrap}", PRODUCER_INTERCEPTOR,
                        f"msgaudit.ledger.dir={pspool}"], capture_output=True, text=True, timeout=120)
    assert j.returncode == 0, j.stderr
    for name, extra, want in [("default", [], audited), ("mapped", [f"msgaudit.source.topics={copy}=orders"], "orders")]:
        spool = tmp_path / name
        spool.mkdir()
        r = subprocess.run([*java_consumer, copy, "-1", f"bootstrap.servers={kafka_bootstrap}",
                            f"group.id=g-{name}-{uuid.uuid4().hex[:6]}", CONSUMER_INTERCEPTOR,
                            f"msgaudit.ledger.dir={spool}", "msgaudit.cluster=dr", *extra],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        assert got(r.stdout) == [(0, 0), (0, 1), (0, 2), (0, 3)]
        rows = rows_of(spool)
        assert [(r["topic"], r["partition"], r["offset"], r["seq"], r["outcome"], r["cluster"]) for r in rows] == [
            *((want, 0, o, o, "handed", "dr") for o in range(4)), (want, 0, 4, None, "committed", "dr")]
        assert len({r["pid"] for r in rows[:4]}) == 1 and rows[4]["pid"] is None


@pytest.mark.spark
@pytest.mark.kafka
@pytest.mark.e2e
def test_java_group_killed_mid_stream_and_restarted_audits_equal_to_the_ground_truth(
        java_producer: list[str], java_consumer: list[str], kafka_bootstrap: str, spark: Any, tmp_path: Path,
        make_config: Any) -> None:
    """A Java producer (producer interceptor) writes 300 records on 2 partitions; a Java group
    member with the consumer interceptor commits after every batch, is killed with SIGKILL after
    a batch it was handed but did not commit, and a new instance finishes the stream. The group's
    ledger is landed by `msgaudit ingest` unchanged, and the audit equals what the application
    printed: every record handed at least once, exactly the uncommitted batch `redelivered`,
    nothing missed, nothing else."""

    topic = new_topic(kafka_bootstrap, partitions=2)
    group = f"java-group-{uuid.uuid4().hex[:8]}"
    cfg = make_config(tmp_path, topics={topic: {"window": "1d", "grace": "1m", "groups": [group]}})
    pspool, cspool = cfg.ledger_dir / "producer", cfg.ledger_dir / "consumer"
    pspool.mkdir(parents=True)
    cspool.mkdir(parents=True)
    start = datetime.now(UTC).replace(hour=0, minute=0, second=0, microsecond=0)

    n = 300
    j = subprocess.run([*java_producer, topic, str(n), f"bootstrap.servers={kafka_bootstrap}", PRODUCER_INTERCEPTOR,
                        f"msgaudit.ledger.dir={pspool}", "msgaudit.producer.name=java-app"],
                       capture_output=True, text=True, timeout=120)
    assert j.returncode == 0, j.stderr

    common = [f"bootstrap.servers={kafka_bootstrap}", f"group.id={group}", CONSUMER_INTERCEPTOR,
              f"msgaudit.ledger.dir={cspool}", "msgaudit.consumer.name=java-reader", "max.poll.records=25",
              "group.instance.id=reader-1", "session.timeout.ms=10000"]
    first = subprocess.Popen([*java_consumer, topic, "120", *common], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    lines = []
    assert first.stdout is not None
    for line in first.stdout:
        lines.append(line)
        if line.strip() == "PAUSE":
            break
    os.kill(first.pid, signal.SIGKILL)
    first.wait(30)
    first_got = got("".join(lines))
    assert 120 <= len(first_got) < n
    second = subprocess.run([*java_consumer, topic, "-1", *common], capture_output=True, text=True, timeout=180)
    assert second.returncode == 0, second.stderr
    assert "msgaudit:" not in second.stderr
    second_got = got(second.stdout)

    # ground truth: what the application was handed, in both runs
    handed = Counter(first_got + second_got)
    assert len(handed) == n  # every record reached the application
    redelivered = sorted(k for k, c in handed.items() if c == 2)
    assert redelivered and all(c <= 2 for c in handed.values())
    assert set(redelivered) <= set(first_got) and set(redelivered) <= set(second_got)

    rows = rows_of(cspool)
    instances = sorted({r["consumer"] for r in rows})
    assert len(instances) == 2 and all(i.startswith("java-reader:") for i in instances)
    assert Counter((r["partition"], r["offset"]) for r in rows if r["outcome"] == "handed") == handed
    for inst in instances:  # per instance, consume_seq counts its rows from 0
        assert sorted(r["consume_seq"] for r in rows if r["consumer"] == inst) == list(
            range(sum(1 for r in rows if r["consumer"] == inst)))
    assert {r["outcome"] for r in rows} == {"handed", "committed"}
    assert all(r["pid"].startswith("java-app:") for r in rows if r["outcome"] == "handed")
    # a handed row carries the message's produce time from its headers: the producer ledger's
    produced = {(r["pid"], r["seq"] + k): r["produce_ts"] for r in rows_of(pspool) for k in range(r.get("run", 1))}
    assert len(produced) == n
    assert {(r["pid"], r["seq"], r["produce_ts"]) for r in rows if r["outcome"] == "handed"} == {
        (pid, seq, ts) for (pid, seq), ts in produced.items()}
    assert all("produce_ts" not in r for r in rows if r["outcome"] == "committed")

    end = start + timedelta(days=1)
    as_of = datetime.now(UTC) + timedelta(minutes=2)
    anomalies, report = audit_topic(spark, cfg, topic, start, end, as_of)
    second_instance = max(instances, key=lambda i: min(r["consume_ts"] for r in rows if r["consumer"] == i))
    assert sorted((a["stage"], a["anomaly"], a["partition"], a["offset"], a["detail"]) for a in anomalies) == [
        (f"group:{group}", "redelivered", p, o, f"processing 2 of 2 by {second_instance}") for p, o in redelivered]
    g_rows = [r for r in report if r["stage"] == f"group:{group}"]
    assert sum(r["expected"] for r in g_rows) == sum(r["delivered"] for r in g_rows) == n
    assert sum(r["duplicated"] for r in g_rows) == len(redelivered)
    assert all((r["lost"], r["pending"], r["missed"], r["overdue"]) == (0, 0, 0, 0) for r in g_rows)
    log_rows = [r for r in report if r["stage"] == "log"]
    assert sum(r["delivered"] for r in log_rows) == n and all(r["unledgered"] == 0 for r in log_rows)
