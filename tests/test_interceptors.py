"""The msgaudit-interceptors jar in a plain Java producer that knows nothing of msgaudit:
`interceptor.classes` and `msgaudit.*` client properties only (docs/design.md §3.4). Real broker."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from audit.core import headers as h
from tests.conftest import new_topic
from tests.test_plugin import ledger_rows
from tests.test_producer import consume_all, ledger_lines

INTERCEPTOR = "interceptor.classes=io.msgaudit.interceptors.AuditProducerInterceptor"


def run_java(java_producer: list[str], topic: str, n: int, *props: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*java_producer, topic, str(n), *props], capture_output=True, text=True, timeout=120)


@pytest.mark.kafka
def test_java_producer_with_the_interceptor_stamps_and_ledgers_every_record(
        java_producer: list[str], kafka_bootstrap: str, tmp_path: Path) -> None:
    topic = new_topic(kafka_bootstrap, partitions=2)
    n = 30
    spool = tmp_path / "producer"
    spool.mkdir()
    # acks=1 without enable.idempotence: kafka-clients turns idempotence off, the settings row says so
    r = run_java(java_producer, topic, n, f"bootstrap.servers={kafka_bootstrap}", INTERCEPTOR, "acks=1",
                 f"msgaudit.ledger.dir={spool}", "msgaudit.producer.name=java-app")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"SENT {n}"
    assert "msgaudit:" not in r.stderr

    rows = ledger_rows(spool)
    assert len(rows) == n
    pid = rows[0]["pid"]
    assert pid.startswith("java-app:") and len(pid) == len("java-app:") + 12
    # one producer_settings row for the session, beside the ledger folder
    files = list((tmp_path / "producer_settings").iterdir())
    assert len(files) == 1 and files[0].name.startswith("settings-") and files[0].suffix == ".jsonl"
    settings = json.loads(files[0].read_text())
    assert abs(settings.pop("start_ts") - int(time.time() * 1000)) < 120_000
    assert settings == {"producer": "java-app", "pid": pid, "acks": "1", "enable_idempotence": False,
                        "retries": 2147483647, "max_in_flight": 5, "transactional_id": None, "mode": "interceptor"}
    by_seq = {row["seq"]: row for row in rows}
    assert sorted(by_seq) == list(range(n))
    assert {(row["producer"], row["pid"], row["topic"], row["status"], row["error"], row["txn_id"])
            for row in rows} == {("java-app", pid, topic, "acked", None, None)}

    records = consume_all(kafka_bootstrap, topic, n)
    assert len(records) == n
    for m in records:
        i = int(m.value().decode().removeprefix("java-"))
        names = [k for k, _ in m.headers()]
        assert names == (["trace"] if i % 2 else []) + ["audit.id"]  # the packed form by default
        parsed = h.parse(m.headers())
        assert parsed.error is None and parsed.pid == pid
        row = by_seq[parsed.seq]
        assert (row["partition"], row["offset"], row["produce_ts"]) == (m.partition(), m.offset(), parsed.ts_ms)
        assert row["ack_ts"] >= row["produce_ts"]


@pytest.mark.kafka
def test_java_interceptor_writes_the_records_of_a_batch_as_one_run(
        java_producer: list[str], kafka_bootstrap: str, tmp_path: Path) -> None:
    """Records acknowledged together with consecutive seqs and offsets and one produce millisecond
    are one ledger line (`"run": k`); expanded, the lines are exactly one row per record."""
    topic = new_topic(kafka_bootstrap, partitions=2)
    n = 2000
    spool = tmp_path / "producer"
    spool.mkdir()
    r = run_java(java_producer, topic, n, f"bootstrap.servers={kafka_bootstrap}", INTERCEPTOR,
                 "partitioner.ignore.keys=true", "linger.ms=50", f"msgaudit.ledger.dir={spool}")
    assert r.returncode == 0, r.stderr
    lines = ledger_lines(spool)
    assert any(line.get("run", 1) > 1 for line in lines)
    assert len(lines) <= n // 4, f"{len(lines)} lines for {n} records"
    rows = ledger_rows(spool)
    records = consume_all(kafka_bootstrap, topic, n)
    stamps = {(p.pid, p.seq): (m.partition(), m.offset(), p.ts_ms)
              for m in records for p in [h.parse(m.headers())]}
    assert len(stamps) == len(records) == n
    assert {(row["pid"], row["seq"]): (row["partition"], row["offset"], row["produce_ts"]) for row in rows} == stamps
    assert len(rows) == n


@pytest.mark.kafka
def test_java_bad_configuration_stops_the_producer_at_start(java_producer: list[str], kafka_bootstrap: str,
                                                            tmp_path: Path) -> None:
    topic = new_topic(kafka_bootstrap)
    cases = [
        ([f"msgaudit.ledger.dir={tmp_path / 'missing'}"],
         f"msgaudit.ledger.dir: {tmp_path / 'missing'}: No such file or directory (create the ledger folder first)"),
        ([f"msgaudit.ledger.dir={tmp_path}", "msgaudit.ledgr.dir=x"],
         'unknown msgaudit property "msgaudit.ledgr.dir" (known: msgaudit.ledger.dir, '),
        ([f"msgaudit.ledger.dir={tmp_path}", "msgaudit.flush.interval.ms=soon"],
         'msgaudit.flush.interval.ms: expected a positive integer, got "soon"'),
    ]
    for props, message in cases:
        r = run_java(java_producer, topic, 1, f"bootstrap.servers={kafka_bootstrap}", INTERCEPTOR, *props)
        assert r.returncode != 0 and "SENT" not in r.stdout
        assert message in r.stderr
    assert list(tmp_path.iterdir()) == []
    assert consume_all(kafka_bootstrap, topic, 0, timeout=1) == []


@pytest.mark.unit
def test_a_segment_under_a_posix_lock_is_live_until_its_writer_dies(tmp_path: Path) -> None:
    """The Java writer locks its open segment with FileChannel.lock (a POSIX record lock, which
    does not conflict with flock): ingest's orphan recovery must still see it as live."""
    import sys

    from audit.clients.ledger import recover_orphans, sealed_segments

    seg = tmp_path / "producer-20261123T000000000000Z-1-0000abcd.jsonl.open"
    seg.write_text('{"a":1}\n')
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl,os,sys,time; fd=os.open(sys.argv[1], os.O_RDWR); "
         "fcntl.lockf(fd, fcntl.LOCK_EX); print('READY', flush=True); time.sleep(60)", str(seg)],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "READY"
        assert recover_orphans(tmp_path) == 0
        assert seg.exists() and sealed_segments(tmp_path) == []
    finally:
        holder.kill()
        holder.wait(10)
    assert recover_orphans(tmp_path) == 1
    assert [p.name for p in sealed_segments(tmp_path)] == [seg.name.removesuffix(".open")]
