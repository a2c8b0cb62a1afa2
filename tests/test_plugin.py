"""The libmsgaudit librdkafka plugin in clients that know nothing of msgaudit: a plain
confluent-kafka `Producer` and kcat, configured only through `plugin.library.paths` and
`msgaudit.*` properties (docs/design.md §3.3). Real broker unless marked `unit`."""

from __future__ import annotations

import shutil
import subprocess
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import KafkaException, Producer

from audit.clients.plugin import Plugin
from audit.core import headers as h
from tests.conftest import new_topic
from tests.test_producer import consume_all, ledger_rows


def plugin_conf(so: Path, ledger: Path, **extra: Any) -> dict[str, Any]:
    return {"plugin.library.paths": str(so), "msgaudit.ledger.dir": str(ledger), **extra}


def kcat(so: Path, *args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    exe = shutil.which("kcat")
    if exe is None:
        pytest.fail("kcat is not installed (Debian: apt-get install -y kcat; ./dev test installs it)")
    return subprocess.run([exe, "-X", f"plugin.library.paths={so}", *args], input=stdin, text=True,
                          capture_output=True, timeout=60)


# -- unit: configuration and failure handling ----------------------------------------------------

@pytest.mark.unit
def test_bad_configuration_is_one_clear_error_at_client_start(libmsgaudit: Path, tmp_path: Path) -> None:
    cases = [
        ({"msgaudit.ledger.dir": str(tmp_path / "missing")},
         f"msgaudit.ledger.dir: {tmp_path / 'missing'}: No such file or directory (create the ledger folder first)"),
        ({"msgaudit.ledger.dir": "/proc"}, "msgaudit.ledger.dir: cannot write in /proc"),
        ({"msgaudit.ledger.dir": str(tmp_path), "msgaudit.ledgr.dir": "x"},
         'unknown msgaudit property "msgaudit.ledgr.dir" (known: msgaudit.ledger.dir, '),
        ({"msgaudit.segment.max.bytes": "-5"}, 'msgaudit.segment.max.bytes: expected a positive integer, got "-5"'),
        ({"msgaudit.pid": "x" * 65}, "msgaudit.pid must be 1 to 64 characters"),
        ({"msgaudit.header.form": "two"}, 'msgaudit.header.form: expected packed or three, got "two"'),
    ]
    for props, message in cases:
        with pytest.raises(KafkaException) as err:
            Producer({"plugin.library.paths": str(libmsgaudit), **props})
        assert message in err.value.args[0].str()

    # kcat: the same one line, and a non-zero exit before anything is produced.
    r = kcat(libmsgaudit, "-X", "msgaudit.bogus=1", "-b", "127.0.0.1:1", "-P", "-t", "t", stdin="x\n")
    assert r.returncode != 0
    assert 'unknown msgaudit property "msgaudit.bogus"' in r.stderr
    assert not list(tmp_path.iterdir())


@pytest.mark.unit
def test_unwritable_spool_and_full_buffer_are_counted_never_fatal(libmsgaudit: Path, tmp_path: Path,
                                                                  capfd: pytest.CaptureFixture[str]) -> None:
    plugin = Plugin.load(libmsgaudit)
    gone = tmp_path / "gone"
    gone.mkdir()
    pid = f"spool-test:{uuid.uuid4().hex[:12]}"
    p = Producer(plugin_conf(libmsgaudit, gone, **{"msgaudit.pid": pid, "test.mock.num.brokers": 1,
                                                   "log_level": 0}))
    gone.rmdir()  # the spool disappears under a running client
    for i in range(10):
        p.produce("a", b"%d" % i)
    assert p.flush(10) == 0
    plugin.flush(pid, 10)
    stats = plugin.stats(pid)
    assert stats is not None
    assert (stats.stamped, stats.acked, stats.written, stats.dropped) == (10, 10, 0, 10)
    del p
    err = capfd.readouterr().err
    assert f"msgaudit: ledger spool {gone}: cannot create a segment: No such file or directory" in err
    assert f"msgaudit: producer {pid}: 10 ledger rows could not be recorded in {gone}" in err

    # A buffer too small for the rows of one writer pass: every row is written or counted.
    small = tmp_path / "small"
    small.mkdir()
    pid2 = f"small:{uuid.uuid4().hex[:12]}"
    p = Producer(plugin_conf(libmsgaudit, small, **{"msgaudit.pid": pid2, "msgaudit.buffer.max.bytes": "400",
                                                    "msgaudit.flush.interval.ms": "60000",
                                                    "test.mock.num.brokers": 1, "log_level": 0}))
    for i in range(20):
        p.produce("a", b"%d" % i)
    assert p.flush(10) == 0
    plugin.flush(pid2, 10)
    s2 = plugin.stats(pid2)
    del p
    assert s2 is not None and s2.acked == 20
    assert s2.written + s2.dropped == 20 and s2.dropped > 0 and s2.written > 0
    assert len(ledger_rows(small)) == s2.written


# -- real broker -------------------------------------------------------------------------------------

@pytest.mark.kafka
def test_plain_producer_stamps_after_the_app_headers_and_ledgers_every_outcome(
        libmsgaudit: Path, kafka_bootstrap: str, tmp_path: Path) -> None:
    topic = new_topic(kafka_bootstrap, partitions=2)
    reports: dict[Any, Any] = {}
    conf = plugin_conf(libmsgaudit, tmp_path, **{"bootstrap.servers": kafka_bootstrap,
                                                 "msgaudit.producer.name": "plain-app"})
    p = Producer(conf)
    n = 40
    for i in range(n):
        hdrs: Any = [("trace", b"t%d" % i), ("trace", b"again")] if i % 2 else None
        p.produce(topic, b"v%d" % i, key=b"k%d" % i, headers=hdrs,
                  on_delivery=lambda e, m: reports.__setitem__(m.value(), (m.partition(), m.offset())))
    # Already stamped (a copy that keeps its original identity): left alone, no ledger row.
    stamped: Any = [("audit.pid", b"elsewhere:0123456789ab"), ("audit.seq", b"7"), ("audit.ts", b"1700000000000")]
    p.produce(topic, b"copy", headers=stamped)
    assert p.flush(30) == 0
    # Refused inside produce() after on_send (unknown partition of a known topic): librdkafka
    # acknowledges it as failed inline; one failed row, its seq used.
    with pytest.raises(KafkaException, match="UNKNOWN_PARTITION"):
        p.produce(topic, b"nowhere", partition=9)
    assert p.flush(30) == 0
    del p

    rows = ledger_rows(tmp_path)
    pids = {r["pid"] for r in rows}
    assert len(pids) == 1
    pid = pids.pop()
    assert pid.startswith("plain-app:") and len(pid) == len("plain-app:") + 12
    by_seq = {r["seq"]: r for r in rows}
    assert sorted(by_seq) == list(range(n + 1))
    assert (by_seq[n]["status"], by_seq[n]["error"], by_seq[n]["partition"], by_seq[n]["offset"]) == (
        "failed", "_UNKNOWN_PARTITION", 9, None)
    acked = [r for r in rows if r["status"] == "acked"]
    assert len(acked) == n and all(r["producer"] == "plain-app" and r["topic"] == topic for r in acked)

    records = consume_all(kafka_bootstrap, topic, n + 1)
    assert len(records) == n + 1
    for m in records:
        if m.value() == b"copy":
            assert m.headers() == stamped
            continue
        i = int(m.value()[1:])
        parsed = h.parse(m.headers())
        assert parsed.error is None and parsed.pid == pid
        names = [k for k, _ in m.headers()]
        assert names == (["trace", "trace"] if i % 2 else []) + ["audit.id"]  # the packed form by default
        row = by_seq[parsed.seq]
        assert (row["partition"], row["offset"], row["produce_ts"]) == (m.partition(), m.offset(), parsed.ts_ms)
        assert (m.partition(), m.offset()) == reports[m.value()]
        assert row["ack_ts"] >= row["produce_ts"]


@pytest.mark.spark
@pytest.mark.kafka
@pytest.mark.e2e
def test_unchanged_clients_audit_equal_to_the_ground_truth(
        libmsgaudit: Path, java_producer: list[str], kafka_bootstrap: str, spark: Any, tmp_path: Path,
        make_config: Any) -> None:
    """A plain confluent-kafka Producer and kcat with the plugin, and a plain Java producer with
    the interceptor, on one topic; ingest, capture and reconcile land their ledgers unchanged
    and find nothing wrong: every message is acked, in the log once, in order, and ledgered
    (no `unledgered`, no `unaudited`)."""
    from audit.serving.report_store import ReportStore
    from spark_jobs.pipeline.steps import StepRange, run_step

    topic = new_topic(kafka_bootstrap, partitions=2)
    cfg = make_config(tmp_path, topics={topic: {"window": "1h", "grace": "1m"}})
    spool = cfg.ledger_dir / "producer"
    spool.mkdir(parents=True)
    start = datetime.now(UTC).replace(minute=0, second=0, microsecond=0)

    p = Producer(plugin_conf(libmsgaudit, spool, **{"bootstrap.servers": kafka_bootstrap,
                                                    "msgaudit.producer.name": "py-plain", "linger.ms": 5}))
    n_py = 300
    for i in range(n_py):
        p.produce(topic, b"py-%d" % i, key=b"k%d" % (i % 11), headers=[("app", b"x")] if i % 3 == 0 else None)
    assert p.flush(30) == 0
    del p

    n_kcat = 120
    lines = "".join(f"kcat-{i}\n" for i in range(n_kcat))
    r = kcat(libmsgaudit, "-X", f"msgaudit.ledger.dir={spool}", "-X", "msgaudit.producer.name=kcat-job",
             "-X", "msgaudit.header.form=three",  # the three-header form, through capture as well
             "-b", kafka_bootstrap, "-P", "-t", topic, "-H", "source=kcat", stdin=lines)
    assert r.returncode == 0, r.stderr
    assert "msgaudit" not in r.stderr

    n_java = 80
    j = subprocess.run([*java_producer, topic, str(n_java), f"bootstrap.servers={kafka_bootstrap}",
                        "interceptor.classes=io.msgaudit.interceptors.AuditProducerInterceptor",
                        f"msgaudit.ledger.dir={spool}", "msgaudit.producer.name=java-app"],
                       capture_output=True, text=True, timeout=120)
    assert j.returncode == 0, j.stderr

    rows = ledger_rows(spool)
    assert sorted((r["producer"], r["status"]) for r in rows) == sorted(
        [("py-plain", "acked")] * n_py + [("kcat-job", "acked")] * n_kcat + [("java-app", "acked")] * n_java)

    end = start + timedelta(hours=1)
    as_of = end + timedelta(minutes=2)
    run_step(spark, cfg, "ingest", StepRange())
    run_step(spark, cfg, "capture", StepRange(start, end, (topic,)))
    run_step(spark, cfg, "reconcile", StepRange(start, end, (topic,), as_of))
    store = ReportStore(cfg.report_store)
    try:
        anomalies = store.read("audit_anomalies", topic=topic)
        report = store.read("audit_partition_report", topic=topic)
    finally:
        store.close()
    assert anomalies == []
    log_rows = [r for r in report if r["stage"] == "log"]
    assert sorted(r["partition"] for r in log_rows) == [0, 1]
    assert sum(r["expected"] for r in log_rows) == sum(r["delivered"] for r in log_rows) == n_py + n_kcat + n_java
    assert all((r["lost"], r["duplicated"], r["reordered"], r["pending"], r["unledgered"], r["unaudited"])
               == (0, 0, 0, 0, 0, 0) for r in log_rows)
    assert {r["status"] for r in log_rows} == {"final"}
