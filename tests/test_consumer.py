"""AuditedConsumer: each delivery semantics under a crash at its dangerous point, rebalances,
retries and dead letters — read straight from the consumption ledger and the sink.

The crash tests run tests/support/consumer_crash.py as a subprocess that dies (os._exit, no
cleanup, like SIGKILL) at a named stage, then run it again to finish the partition, and assert
the exact outcome the delivery semantics predict: at-most-once loses exactly the batch committed before
processing; at-least-once processes exactly that batch twice (two sink rows with a plain insert,
one with an upsert); both exactly-once modes process every record exactly once.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import pytest
import sqlalchemy as sa
from confluent_kafka import Consumer, ConsumerGroupState, Message
from confluent_kafka.admin import AdminClient

from audit.clients import consumer as consumer_mod
from audit.clients.consumer import AuditedConsumer, ConsumedRecord, HandlerFailed, RetryPolicy
from audit.clients.ledger import recover_orphans, sealed_segments
from audit.clients.sinks import CONSUMPTION_TABLE, SqlSink
from audit.core.errors import ConfigError
from audit.core.headers import parse, stamp
from tests.conftest import new_topic

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "support" / "consumer_crash.py"
N = 30  # messages per crash test: six batches of five


# -- helpers ---------------------------------------------------------------------------------

def produce_audited(bootstrap: str, topic: str, values: Sequence[dict[str, Any]], ledger_dir: Path,
                    keys: Sequence[bytes | None] | None = None, one_per_batch: bool = False) -> None:
    """Produce with real audit headers; `one_per_batch` makes each message its own record batch
    (so a consumer with a tiny fetch size reads the partitions interleaved)."""
    from audit.clients.producer import AuditedProducer

    with AuditedProducer({"bootstrap.servers": bootstrap}, producer_name="test-src",
                         ledger_dir=ledger_dir / "producer") as p:
        for i, v in enumerate(values):
            p.produce(topic, json.dumps(v).encode(), keys[i] if keys else None)
            if one_per_batch:
                assert p.flush(30) == 0
        assert p.flush(30) == 0


def ledger_rows(ledger_dir: Path) -> list[dict[str, Any]]:
    """Every consumption-ledger row, as ingest would see it (orphans of killed writers sealed)."""
    directory = ledger_dir / "consumer"
    recover_orphans(directory)
    rows = []
    for seg in sealed_segments(directory):
        rows += [json.loads(line) for line in seg.read_text().splitlines() if line]
    return rows


def run_consumer(args: Sequence[str], *, kill_at: str | None = None, kill_offset: int | None = None,
                 timeout: float = 90) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("MSGAUDIT_KILL_AT", None)
    if kill_at is not None:
        env["MSGAUDIT_KILL_AT"] = kill_at
        env["MSGAUDIT_KILL_OFFSET"] = str(kill_offset)
    return subprocess.run([sys.executable, str(SCRIPT), *args], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


def sink_evidence(url: str, topic: str) -> list[dict[str, Any]]:
    """The consumption rows an exactly_once_sink consumer wrote into the sink database for `topic`
    (a PostgreSQL database is shared by the tests)."""
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            if not sa.inspect(conn).has_table(CONSUMPTION_TABLE):
                return []
            return [dict(r._mapping) for r in conn.execute(
                sa.text(f"SELECT * FROM {CONSUMPTION_TABLE} WHERE topic = :t"), {"t": topic})]
    finally:
        engine.dispose()


def sink_offsets(url: str, table: str) -> list[int]:
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            return sorted(r[0] for r in conn.execute(sa.text(f"SELECT audit_offset FROM {table}")))
    finally:
        engine.dispose()


def read_committed(bootstrap: str, topic: str, expect: int, timeout_s: float = 20) -> list[Message]:
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": f"reader-{uuid.uuid4().hex[:8]}",
                  "auto.offset.reset": "earliest", "isolation.level": "read_committed",
                  "enable.auto.commit": False})
    c.subscribe([topic])
    out: list[Message] = []
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            out += [m for m in c.consume(100, 0.5) if m.error() is None]
            if len(out) >= expect:
                # A little longer, so extra (duplicate) copies would be seen too.
                out += [m for m in c.consume(100, 1.0) if m.error() is None]
                break
    finally:
        c.close()
    return out


def crash_case(tmp_path: Path, bootstrap: str, semantics: str, kill_at: str, *, sink_url: str | None,
               sink_mode: str = "insert", output_topic: str | None = None,
               kill_offset: int = 12, ledger_topic: str | None = None,
               extra: Sequence[str] = ()) -> tuple[str, list[int], list[dict[str, Any]]]:
    """Produce N messages, run the consumer until it dies at `kill_at`, rerun it to the end.

    Returns the topic, the source offsets of the batch it died in, and the ledger rows (the
    ledger files', or for exactly_once_sink the sink database's)."""
    topic = new_topic(bootstrap)
    produce_audited(bootstrap, topic, [{"n": i} for i in range(N)], tmp_path)
    marker = tmp_path / "marker.json"
    args = ["--bootstrap", bootstrap, "--topic", topic, "--group", f"g-{topic}", "--name", "worker-1",
            "--semantics", semantics, "--ledger-dir", str(tmp_path / "ledger"), "--marker", str(marker)]
    if sink_url:
        args += ["--sink-url", sink_url, "--sink-table", "sink_" + topic.replace("-", "_"),
                 "--sink-mode", sink_mode]
    if output_topic:
        args += ["--output-topic", output_topic]
    if ledger_topic:
        args += ["--ledger-topic", ledger_topic]
    args += list(extra)
    first = run_consumer(args, kill_at=kill_at, kill_offset=kill_offset)
    assert first.returncode == 137, first.stderr[-3000:]
    died_in = json.loads(marker.read_text())
    assert died_in["stage"] == kill_at
    batch = sorted(o for _, _, o in died_in["records"])
    assert kill_offset in batch
    second = run_consumer(args)
    assert second.returncode == 0, second.stderr[-3000:]
    if semantics == "exactly_once_sink":
        assert ledger_rows(tmp_path / "ledger") == []  # its consumption rows are in the sink's commits
        assert sink_url is not None
        return topic, batch, sink_evidence(sink_url, topic)
    return topic, batch, ledger_rows(tmp_path / "ledger")


def processed_offsets(rows: list[dict[str, Any]]) -> Counter[int]:
    return Counter(r["offset"] for r in rows if r["outcome"] == "processed")


# -- unit: pure pieces -------------------------------------------------------------------------

@pytest.mark.unit
def test_retry_policy_backoff_and_validation() -> None:
    p = RetryPolicy(max_attempts=4, backoff_ms=100, multiplier=3, max_backoff_ms=500)
    assert [p.delay_ms(a) for a in (2, 3, 4, 5)] == [100, 300, 500, 500]
    with pytest.raises(ConfigError, match="max_attempts"):
        RetryPolicy(max_attempts=0)
    with pytest.raises(ConfigError, match="multiplier"):
        RetryPolicy(multiplier=0.5)


@pytest.mark.unit
def test_constructor_names_the_bad_argument(tmp_path: Path) -> None:
    base = {"bootstrap.servers": "127.0.0.1:1"}
    with pytest.raises(ConfigError, match="semantics"):
        AuditedConsumer(base, topics=["a"], group="g", semantics="exactly_once", ledger_dir=tmp_path)
    with pytest.raises(ConfigError, match="needs a sink"):
        AuditedConsumer(base, topics=["a"], group="g", semantics="exactly_once_sink", ledger_dir=tmp_path)
    with pytest.raises(ConfigError, match="group"):
        AuditedConsumer(base, topics=["a"], ledger_dir=tmp_path)
    with pytest.raises(ConfigError, match="topics"):
        AuditedConsumer(base, topics="a", group="g", ledger_dir=tmp_path)
    with pytest.raises(ConfigError, match="must differ"):
        AuditedConsumer(base, topics=["a"], group="g", ledger_dir=tmp_path,
                        retry=RetryPolicy(retry_topic="a"))


@pytest.mark.unit
def test_a_mirror_copy_is_recorded_against_its_audited_topic(tmp_path: Path) -> None:
    """cluster=<mirror>: the copy's name maps to the audited topic through the config's mirrors
    (a source alias with a dot, an identity policy), then source_topics=, then MM2's default."""
    from audit.core.config import from_dict

    cfg = from_dict({"topics": {
        "orders": {"mirrors": [{"name": "dr", "kafka": {"bootstrap.servers": "127.0.0.1:1"},
                                "source_alias": "us.east"}]},
        "orders.v2": {"mirrors": [{"name": "dr", "kafka": {"bootstrap.servers": "127.0.0.1:1"},
                                   "topic": "orders.v2"}]}}}, base=tmp_path)
    c = AuditedConsumer({"bootstrap.servers": "127.0.0.1:1"}, topics=["us.east.orders", "orders.v2", "src.pay"],
                        group="g", cfg=cfg, ledger_dir=tmp_path, cluster="dr", source_topics={"x.y": "z"})
    try:
        got = {t: c._record(Message(topic=t, partition=1, offset=9, value=b"v", headers=[])).topic
               for t in ("us.east.orders", "orders.v2", "src.pay", "x.y")}
        assert got == {"us.east.orders": "orders", "orders.v2": "orders.v2", "src.pay": "pay", "x.y": "z"}
    finally:
        c.close()


@pytest.mark.unit
def test_retry_copy_is_audited_by_its_original_coordinates(tmp_path: Path) -> None:
    c = AuditedConsumer({"bootstrap.servers": "127.0.0.1:1"}, topics=["orders"], group="g", name="w",
                        retry=RetryPolicy(), ledger_dir=tmp_path)
    try:
        audit: list[Any] = list(stamp(None, "p:1", 7, 1000))
        original = Message(topic="orders", partition=2, offset=41, key=b"k", value=b"v", headers=audit,
                           timestamp=(1, 1000))
        rec = c._record(original)
        assert (rec.topic, rec.partition, rec.offset, rec.attempt, rec.via) == ("orders", 2, 41, 1, ("orders", 2))
        copy_headers: list[Any] = [*audit, (consumer_mod.SRC_TOPIC, b"orders"), (consumer_mod.SRC_PARTITION, b"2"),
                        (consumer_mod.SRC_OFFSET, b"41"), (consumer_mod.ATTEMPT, b"3"),
                        (consumer_mod.RETRY_AT, b"0")]
        copy = Message(topic="g.retry", partition=0, offset=5, key=b"k", value=b"v", headers=copy_headers,
                       timestamp=(1, 2000))
        rec2 = c._record(copy)
        assert (rec2.topic, rec2.partition, rec2.offset, rec2.attempt, rec2.via) == ("orders", 2, 41, 3,
                                                                                     ("g.retry", 0))
        assert (rec2.audit.pid, rec2.audit.seq, rec2.audit.error) == ("p:1", 7, None)
        # A copy that is not due yet is held, and so is everything behind it in its partition;
        # source partitions pass.
        later = str(consumer_mod._now_ms() + 60_000).encode()
        held = Message(topic="g.retry", partition=0, offset=6, value=b"x",
                       headers=[(consumer_mod.RETRY_AT, later)])
        behind = Message(topic="g.retry", partition=0, offset=7, value=b"y",
                         headers=[(consumer_mod.RETRY_AT, b"0")])
        src = Message(topic="orders", partition=0, offset=9, value=b"z")
        real = c.consumer
        c.consumer = _PauseRecorder()  # type: ignore[assignment]
        try:
            assert [m.offset() for m in c._gate([held, src, behind])] == [9]
            assert [m.offset() for m in c._held[("g.retry", 0)]] == [6, 7]
            assert c.consumer.paused == [("g.retry", 0)]  # type: ignore[attr-defined]
        finally:
            c.consumer = real
    finally:
        c.ledger.close()
        c.consumer.close()


class _PauseRecorder:
    def __init__(self) -> None:
        self.paused: list[tuple[str, int]] = []

    def pause(self, parts: list[Any]) -> None:
        self.paused += [(tp.topic, tp.partition) for tp in parts]


# -- kafka: crash at each dangerous point -----------------------------------------------------

@pytest.mark.kafka
def test_at_most_once_crash_after_commit_loses_exactly_that_batch(tmp_path: Path, kafka_bootstrap: str) -> None:
    url = f"sqlite:///{tmp_path / 'sink.db'}"
    topic, batch, rows = crash_case(tmp_path, kafka_bootstrap, "at_most_once", "committed_before_processing",
                                    sink_url=url)
    seen = processed_offsets(rows)
    assert sorted(seen) == sorted(set(range(N)) - set(batch))  # the batch is lost ...
    assert set(seen.values()) == {1}  # ... and nothing is duplicated
    assert {r["outcome"] for r in rows} == {"processed"}
    assert sink_offsets(url, "sink_" + topic.replace("-", "_")) == sorted(seen)
    assert len(batch) >= 1


@pytest.mark.kafka
@pytest.mark.parametrize("mode", ["insert", "upsert"])
def test_at_least_once_crash_before_commit_redelivers_that_batch(tmp_path: Path, kafka_bootstrap: str,
                                                                  mode: str) -> None:
    url = f"sqlite:///{tmp_path / 'sink.db'}"
    topic, batch, rows = crash_case(tmp_path, kafka_bootstrap, "at_least_once", "ledger_flushed",
                                    sink_url=url, sink_mode=mode)
    seen = processed_offsets(rows)
    assert sorted(seen) == list(range(N))  # nothing lost
    assert sorted(o for o, k in seen.items() if k == 2) == batch  # exactly the batch twice
    assert set(seen.values()) == {1, 2}
    # Two instances (the dead one and the rerun), each with its own increasing consume_seq.
    by_instance: dict[str, list[int]] = {}
    for r in rows:
        by_instance.setdefault(r["consumer"], []).append(r["consume_seq"])
    assert len(by_instance) == 2
    assert all(s == list(range(len(s))) for s in by_instance.values())
    in_sink = Counter(sink_offsets(url, "sink_" + topic.replace("-", "_")))
    if mode == "insert":
        assert in_sink == seen  # the duplicates reach the plain-insert sink
    else:
        assert in_sink == Counter(range(N))  # the upsert absorbs them


@pytest.mark.kafka
def test_exactly_once_kafka_crash_inside_transaction(tmp_path: Path, kafka_bootstrap: str) -> None:
    out = new_topic(kafka_bootstrap)
    _, batch, rows = crash_case(tmp_path, kafka_bootstrap, "exactly_once_kafka", "txn_before_commit",
                                sink_url=None, output_topic=out)
    assert processed_offsets(rows) == Counter(range(N))
    assert len(batch) >= 1
    copies = read_committed(kafka_bootstrap, out, N)
    assert sorted(json.loads(m.value() or b"{}")["n"] for m in copies) == list(range(N))
    # The aborted attempt really wrote to the log: a read_uncommitted reader sees its records too.
    c = Consumer({"bootstrap.servers": kafka_bootstrap, "group.id": f"r-{uuid.uuid4().hex[:6]}",
                  "auto.offset.reset": "earliest", "isolation.level": "read_uncommitted"})
    c.subscribe([out])
    raw: list[Message] = []
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and len(raw) < N + len(batch):
        raw += [m for m in c.consume(100, 0.5) if m.error() is None]
    c.close()
    assert len(raw) == N + len(batch)


@pytest.mark.kafka
@pytest.mark.parametrize("db", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def test_exactly_once_sink_crash_inside_db_transaction(tmp_path: Path, kafka_bootstrap: str, db: str,
                                                       request: pytest.FixtureRequest) -> None:
    url = f"sqlite:///{tmp_path / 'sink.db'}" if db == "sqlite" else request.getfixturevalue("pg_url")
    topic, batch, rows = crash_case(tmp_path, kafka_bootstrap, "exactly_once_sink", "sink_txn_open",
                                    sink_url=url, sink_mode="insert")
    assert processed_offsets(rows) == Counter(range(N))
    assert sink_offsets(url, "sink_" + topic.replace("-", "_")) == list(range(N))
    assert len(batch) >= 1
    stored = SqlSink(url, "unused").read_positions(f"g-{topic}", [(topic, 0)])
    assert stored == {(topic, 0): N}


@pytest.mark.kafka
@pytest.mark.postgres
def test_exactly_once_sink_killed_just_after_the_db_commit_keeps_its_consumption_rows(
        tmp_path: Path, kafka_bootstrap: str, pg_url: str) -> None:
    """SIGKILL right after the database commit, before anything else: the batch's consumption rows
    were in that commit, so every record -- also those the handler wrote no sink row for -- has
    exactly one `processed` row, and the rerun starts after the batch."""
    topic, batch, rows = crash_case(tmp_path, kafka_bootstrap, "exactly_once_sink", "sink_written",
                                    sink_url=pg_url, sink_mode="insert", extra=["--skip-every", "3"])
    assert 12 in batch
    mine = [r for r in rows if r["group"] == f"g-{topic}"]
    assert processed_offsets(mine) == Counter(range(N))
    assert {(r["topic"], r["attempt"], r["error"]) for r in mine} == {(topic, 1, None)}
    # The dead instance wrote everything up to its last batch, the rerun (a new instance id) the rest.
    by_consumer = Counter(r["consumer"] for r in mine)
    done = max(batch) + 1
    assert sorted(by_consumer.values()) == sorted([done, N - done])
    for consumer, count in by_consumer.items():
        assert sorted(r["consume_seq"] for r in mine if r["consumer"] == consumer) == list(range(count))
    assert sink_offsets(pg_url, "sink_" + topic.replace("-", "_")) == [n for n in range(N) if n % 3]


@pytest.mark.kafka
def test_exactly_once_sink_restores_positions_from_the_sink_not_kafka(tmp_path: Path,
                                                                      kafka_bootstrap: str) -> None:
    """The sink's stored offsets win over the group's Kafka offsets on assignment."""
    topic = new_topic(kafka_bootstrap)
    produce_audited(kafka_bootstrap, topic, [{"n": i} for i in range(10)], tmp_path)
    sink = SqlSink(f"sqlite:///{tmp_path / 'sink.db'}", "rows")
    from audit.clients.sinks import Position

    sink.write([], group="g1", positions=[Position(topic, 0, 6)])
    seen: list[int] = []
    with AuditedConsumer({"bootstrap.servers": kafka_bootstrap}, topics=[topic], group="g1",
                         semantics="exactly_once_sink", sink=sink, ledger_dir=tmp_path / "ledger",
                         poll_timeout_s=0.2) as c:
        def handle(r: ConsumedRecord) -> dict[str, int]:
            seen.append(r.offset)
            return {"n": r.offset}

        c.run(handle, idle_timeout_s=1.5)
    assert seen == [6, 7, 8, 9]
    assert sink.read_positions("g1", [(topic, 0)]) == {(topic, 0): 10}
    sink.close()


# -- kafka: rebalance, retries, dead letters ---------------------------------------------------

@pytest.mark.kafka
def test_two_consumers_rebalance_mid_stream_without_loss_or_redelivery(tmp_path: Path,
                                                                      kafka_bootstrap: str) -> None:
    topic = new_topic(kafka_bootstrap, partitions=2)
    total, early = 40, 20
    keys = [str(i).encode() for i in range(total)]
    # Both halves have keys of both partitions (fixed keys: the partitioner's choice is fixed too).
    produce_audited(kafka_bootstrap, topic, [{"n": i} for i in range(early)], tmp_path,
                    keys=keys[:early], one_per_batch=True)
    url = f"sqlite:///{tmp_path / 'sink.db'}"
    common = ["--bootstrap", kafka_bootstrap, "--topic", topic, "--group", f"g-{topic}", "--semantics",
              "at_least_once", "--ledger-dir", str(tmp_path / "ledger"), "--sink-url", url,
              "--sink-table", "rows", "--batch-size", "2", "--sleep-ms", "40", "--idle-s", "3",
              "--max-partition-fetch-bytes", "64"]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    progress, gate, b_ready = tmp_path / "a.progress", tmp_path / "gate", tmp_path / "b.ready"
    # A holds in its handler once it has records of both partitions, until B is joining; so the
    # partition B gets is one A already worked on. The second half is produced while A holds, so
    # that partition still has records A has not handled (the first half of one partition may
    # have reached A long before the other's first record did).
    procs: list[subprocess.Popen[str]] = []
    try:
        a = subprocess.Popen([sys.executable, str(SCRIPT), *common, "--name", "a", "--progress", str(progress),
                              "--hold-until", str(gate)],
                             env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        procs.append(a)
        deadline = time.monotonic() + 60
        while not (progress.exists() and progress.read_text() == "held"):
            assert a.poll() is None and time.monotonic() < deadline, a.communicate()[1][-3000:]
            time.sleep(0.05)
        produce_audited(kafka_bootstrap, topic, [{"n": i} for i in range(early, total)], tmp_path / "late",
                        keys=keys[early:], one_per_batch=True)
        # B waits longer when idle than A: on a loaded machine its share may take seconds to arrive.
        b = subprocess.Popen([sys.executable, str(SCRIPT), *common, "--name", "b", "--ready", str(b_ready),
                              "--idle-s", "10"],
                             env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        procs.append(b)
        while not b_ready.exists():
            assert b.poll() is None and time.monotonic() < deadline, b.communicate()[1][-3000:]
            time.sleep(0.05)
        # B's JoinGroup has reached the coordinator once the group is rebalancing with B among its
        # members (A, held, has not rejoined yet); only then let A go on, so the rebalance surely
        # happens mid-stream. (Rebalancing alone is not enough: A may rejoin on its own.)
        admin = AdminClient({"bootstrap.servers": kafka_bootstrap})

        def b_is_joining() -> bool:
            group = admin.describe_consumer_groups([f"g-{topic}"])[f"g-{topic}"].result(10)
            return group.state == ConsumerGroupState.PREPARING_REBALANCING and \
                any(m.group_instance_id == "b" for m in group.members)

        while not b_is_joining():
            assert b.poll() is None and time.monotonic() < deadline, b.communicate()[1][-3000:]
            time.sleep(0.1)
        gate.write_text("go")
        b_out, b_err = b.communicate(timeout=90)
        a_out, a_err = a.communicate(timeout=90)
    finally:
        for proc in procs:  # only on failure: both exited normally otherwise
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    assert a.returncode == 0 and b.returncode == 0, (a_err[-2000:], b_err[-2000:])
    assert json.loads(a_out.splitlines()[-1])["rebalances"] >= 2  # joined alone, then rebalanced
    assert json.loads(b_out.splitlines()[-1])["processed"] > 0, (a_out, b_out, a_err[-3000:], b_err[-3000:])

    rows = ledger_rows(tmp_path / "ledger")
    per_record = Counter((r["partition"], r["offset"]) for r in rows if r["outcome"] == "processed")
    sizes = Counter(r["partition"] for r in rows)
    assert sum(per_record.values()) == total and set(per_record.values()) == {1}  # each once
    assert sum(sizes.values()) == total
    # A partition changed hands mid-stream: both instances processed part of it.
    owners = {p: {r["consumer"].split(":")[0] for r in rows if r["partition"] == p} for p in (0, 1)}
    assert {"a", "b"} in owners.values(), owners
    assert Counter(sink_offsets(url, "rows")) == Counter(o for _, o in per_record)


@pytest.mark.kafka
def test_poison_message_is_dead_lettered_after_n_attempts_while_the_partition_flows(
        tmp_path: Path, kafka_bootstrap: str) -> None:
    topic = new_topic(kafka_bootstrap)
    values = [{"n": i, "poison": i == 3} for i in range(20)]
    produce_audited(kafka_bootstrap, topic, values, tmp_path)
    group = f"g-{topic}"
    flaky_failures = {7: 1}  # offset 7 fails once, then succeeds
    order: list[tuple[int, int]] = []

    def handle(rec: ConsumedRecord) -> dict[str, Any]:
        order.append((rec.offset, rec.attempt))
        if json.loads(rec.value or b"{}")["poison"]:
            raise ValueError("cannot parse order")
        if flaky_failures.get(rec.offset, 0) >= rec.attempt:
            raise TimeoutError("downstream timed out")
        return {"n": rec.offset}

    sink = SqlSink(f"sqlite:///{tmp_path / 'sink.db'}", "rows", "upsert")
    with AuditedConsumer({"bootstrap.servers": kafka_bootstrap}, topics=[topic], group=group, name="w",
                         sink=sink, retry=RetryPolicy(max_attempts=3, backoff_ms=200),
                         ledger_dir=tmp_path / "ledger", batch_size=4, poll_timeout_s=0.2) as c:
        stats = c.run(handle, idle_timeout_s=2)
    assert (stats.processed, stats.failed, stats.dead_lettered) == (19, 3, 1)

    rows = ledger_rows(tmp_path / "ledger")
    assert all(r["topic"] == topic and r["partition"] == 0 for r in rows)  # original coordinates only
    outcomes = sorted((r["offset"], r["attempt"], r["outcome"]) for r in rows)
    assert outcomes == sorted(
        [(o, 1, "processed") for o in range(20) if o not in (3, 7)]
        + [(3, 1, "failed"), (3, 2, "failed"), (3, 3, "dead_lettered"), (7, 1, "failed"), (7, 2, "processed")])
    pids = {r["pid"] for r in rows}
    assert len(pids) == 1 and next(iter(pids)).startswith("test-src:")  # the producer's pid
    assert [r["seq"] for r in rows if r["offset"] == 3] == [3, 3, 3]
    # The poison message never blocked its partition: every later offset was processed before
    # its final (third) attempt.
    last_source = max(i for i, (o, a) in enumerate(order) if a == 1)
    assert order.index((3, 3)) > last_source

    dlq = read_committed(kafka_bootstrap, f"{group}.dlq", 1, timeout_s=10)
    assert len(dlq) == 1
    h = dict(dlq[0].headers() or [])
    assert (h["audit.src.topic"], h["audit.src.partition"], h["audit.src.offset"], h["audit.attempt"]) == (
        topic.encode(), b"0", b"3", b"3")
    assert h["audit.error"] == b"ValueError: cannot parse order"
    assert parse(cast(Any, dlq[0].headers())).seq == 3
    with sink.engine.connect() as conn:
        assert sorted(r[0] for r in conn.execute(sa.text("SELECT audit_offset FROM rows"))) == [
            o for o in range(20) if o != 3]
    sink.close()


@pytest.mark.kafka
def test_handler_failure_without_retry_policy_stops_and_is_redelivered(tmp_path: Path,
                                                                      kafka_bootstrap: str) -> None:
    topic = new_topic(kafka_bootstrap)
    produce_audited(kafka_bootstrap, topic, [{"n": i} for i in range(6)], tmp_path)
    fail = {"on": True}

    def handle(rec: ConsumedRecord) -> None:
        if rec.offset == 4 and fail["on"]:
            raise RuntimeError("boom")

    kw: dict[str, Any] = {"topics": [topic], "group": f"g-{topic}", "ledger_dir": tmp_path / "ledger",
                          "poll_timeout_s": 0.2}
    with AuditedConsumer({"bootstrap.servers": kafka_bootstrap}, **kw) as c, \
            pytest.raises(HandlerFailed, match=r"\[0\]@4 .*boom.*redelivered"):
        c.run(handle, idle_timeout_s=5)
    fail["on"] = False
    with AuditedConsumer({"bootstrap.servers": kafka_bootstrap}, **kw) as c:
        c.run(handle, idle_timeout_s=1.5)
    rows = sorted((r["offset"], r["outcome"]) for r in ledger_rows(tmp_path / "ledger"))
    assert rows == [(0, "processed"), (1, "processed"), (2, "processed"), (3, "processed"), (4, "failed"),
                    (4, "processed"), (5, "processed")]


@pytest.mark.kafka
def test_ledger_is_landed_in_the_consumer_folder_of_cfg_ledger_dir(tmp_path: Path, kafka_bootstrap: str,
                                                                   make_config: Any) -> None:
    cfg = make_config(tmp_path)
    topic = new_topic(kafka_bootstrap)
    produce_audited(kafka_bootstrap, topic, [{"n": 0}, {"n": 1}], tmp_path)
    with AuditedConsumer.from_config(cfg, topics=[topic], group="g-cfg", name="cfgd", poll_timeout_s=0.2) as c:
        c.run(lambda r: None, idle_timeout_s=1.5)
    rows = ledger_rows(Path(cfg.ledger_dir))
    assert [(r["group"], r["offset"], r["outcome"], r["attempt"], r["consume_seq"]) for r in rows] == [
        ("g-cfg", 0, "processed", 1, 0), ("g-cfg", 1, "processed", 1, 1)]
    assert set(rows[0]) == {"group", "consumer", "consume_seq", "topic", "partition", "offset", "pid", "seq",
                            "outcome", "attempt", "consume_ts", "error", "produce_ts"}
    assert isinstance(rows[0]["consume_ts"], int) and rows[0]["consumer"].startswith("cfgd:")
    # the message's produce time from its audit headers: the producer ledger's
    produced = [json.loads(line) for f in sorted((tmp_path / "producer").glob("*.jsonl*"))
                for line in f.read_text().splitlines() if line.strip()]
    assert sorted((r["pid"], r["seq"], r["produce_ts"]) for r in rows) == sorted(
        (r["pid"], r["seq"] + k, r["produce_ts"]) for r in produced for k in range(r.get("run", 1)))

