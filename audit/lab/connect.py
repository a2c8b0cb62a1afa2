"""Lab scenarios of the sinks pipelines land Kafka data with, identified by Kafka coordinates
(docs/design.md §4.2 `identity: coordinates`): a real Kafka Connect worker running Iceberg's sink
connector (with KafkaMetadataTransform) into a Hadoop-catalog table, and a Spark Structured
Streaming job (Kafka source -> Delta).

  connect_kill       the Connect worker SIGKILLed mid-commit (its coordinator has every data file
                     of a commit in hand, the table commit not yet done) and restarted
  connect_dlq        a record the connector cannot convert goes to Connect's dead-letter topic
  connect_drop       errors.tolerance=all without a dead-letter topic drops that record
  streaming_restart  a Structured Streaming job rerun without its checkpoint writes everything twice

Truth (never the audit's readers or rules): the sink table read back with pyiceberg (Iceberg) or a
plain Spark read (Delta), the topic read with a plain consumer, the dead-letter topic's context
headers: a log record absent from the table is missing_in_sink (dead_lettered when the DLQ names
it), each extra row at one (topic, partition, offset) a duplicate_in_sink, a row at a position the
log never held unexpected_in_sink.

All Connect scenarios share one worker: the one running from `<work>/connect` (e.g. started with
`msgaudit connect start --dir <work>/connect`; left running), else one the lab starts and stops
after the audit. Each scenario deletes its connector once its table is final.
"""

from __future__ import annotations

import json
import re
import signal
import time
import uuid
from collections import Counter
from collections.abc import Callable
from collections.abc import Set as AbstractSet
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from audit.core.config import SinkConfig
from audit.core.errors import BrokerError, InputError
from audit.lab.env import Position, read_log
from audit.lab.truth import Truth
from audit.runtime.local_connect import LocalConnect, create_topics, iceberg_sink_config

if TYPE_CHECKING:
    from audit.lab.scenarios import Context

# KafkaMetadataTransform's flat columns: the row's Kafka coordinates
COORDINATES = {"topic": "_kafka_metadata_topic", "partition": "_kafka_metadata_partition",
               "offset": "_kafka_metadata_offset"}


# ------------------------------------------------------------------------------------------
# the worker, the connector, what the table and the log hold


def connect_worker(ctx: Context) -> LocalConnect:
    """The Connect worker the scenarios share (see the module's docstring)."""
    if "connect" not in ctx.resources:
        worker = LocalConnect.attach(ctx.work / "connect")
        if worker is None:
            from audit.runtime.local_kafka import free_port

            worker = LocalConnect(ctx.work / "connect", ctx.lab.bootstrap, port=free_port(),
                                  group_id=f"lab-connect-{uuid.uuid4().hex[:8]}")
            ctx.say(f"connect: starting a Kafka Connect worker (log in {worker.log_file})")
            worker.start()
            ctx.cleanups.append(worker.stop)
        elif worker.bootstrap != ctx.lab.bootstrap:
            raise InputError(f"the Connect worker running from {worker.data_dir} is on {worker.bootstrap}, not on "
                             f"the lab's {ctx.lab.bootstrap}; stop it (msgaudit connect stop --dir ...)")
        ctx.resources["connect"] = worker
    return cast(LocalConnect, ctx.resources["connect"])


def iceberg_sink(ctx: Context, topic: str, dead_letter_topic: str | None = None, **extra: str) -> SinkConfig:
    """Submit an Iceberg sink connector for `topic` (its control topic created first; `extra`:
    more connector properties), wait until its task runs, audit `topic` with the table as sink
    `iceberg` identified by its rows' coordinates."""
    worker = connect_worker(ctx)
    warehouse = ctx.work / "warehouse"
    table = f"lab.{topic.replace('-', '_')}"
    control = f"{topic}-control"
    create_topics(ctx.lab.bootstrap, [control])
    if dead_letter_topic:
        extra = {"errors.deadletterqueue.topic.name": dead_letter_topic,
                 "errors.deadletterqueue.topic.replication.factor": "1",
                 "errors.deadletterqueue.context.headers.enable": "true", **extra}
    name = connector_name(topic)
    worker.submit(name, iceberg_sink_config(topic, table, warehouse, control, **extra))
    worker.wait_running(name)
    sink = SinkConfig(name="iceberg", format="iceberg", warehouse=str(warehouse), table=table,
                      identity="coordinates", columns=COORDINATES, topic=topic, dead_letter_topic=dead_letter_topic)
    ctx.audit_topic(topic, sinks=(sink,))
    return sink


def connector_name(topic: str) -> str:
    return f"{topic}-sink"


def remove_connector(ctx: Context, topic: str, timeout: float = 30.0) -> None:
    """Delete the topic's connector and wait until the worker no longer lists it: its table is final."""
    worker = connect_worker(ctx)
    name = connector_name(topic)
    worker.delete(name)
    deadline = time.monotonic() + timeout
    while name in worker.connectors():
        if time.monotonic() > deadline:
            raise BrokerError(f"connector {name!r} still listed {timeout:.0f}s after its deletion; see {worker.log_file}")
        time.sleep(0.2)


def iceberg_positions(sink: SinkConfig) -> Counter[Position]:
    """(partition, offset) -> rows of the sink's Iceberg table, read with pyiceberg alone (the
    Hadoop catalog's layout: <warehouse>/<namespace>/<name>); empty before the first commit."""
    from pyiceberg.table import StaticTable

    assert sink.warehouse and sink.table
    location = Path(sink.warehouse, *sink.table.split("."))
    if not (location / "metadata" / "version-hint.text").exists():
        return Counter()
    arrow = StaticTable.from_metadata(str(location)).scan(
        selected_fields=(COORDINATES["partition"], COORDINATES["offset"])).to_arrow()
    return Counter(zip(arrow.column(COORDINATES["partition"]).to_pylist(),
                       arrow.column(COORDINATES["offset"]).to_pylist(), strict=True))


def settled(read: Callable[[], Counter[Position]], want: int, timeout: float = 90.0, quiet_s: float = 3.0,
            given_up: Callable[[], bool] = lambda: False) -> Counter[Position]:
    """Read the table until it holds `want` distinct positions (or `given_up()`, or `timeout`
    passes), then until it has not changed for `quiet_s` (a later commit, e.g. one that writes a
    file twice, shows)."""
    deadline = time.monotonic() + timeout
    rows = read()
    while len(rows) < want and time.monotonic() < deadline and not given_up():
        time.sleep(0.5)
        rows = read()
    stable_since = time.monotonic()
    while time.monotonic() - stable_since < quiet_s:
        time.sleep(0.5)
        now = read()
        if now != rows:
            rows, stable_since = now, time.monotonic()
    return rows


def dead_lettered(bootstrap: str, dlq: str, topic: str, want: int, timeout: float = 60.0) -> set[Position]:
    """The positions of `topic` the dead-letter topic's records name by Connect's context headers
    (__connect.errors.topic/partition/offset), once it holds `want` records."""
    from confluent_kafka import Consumer

    c = Consumer({"bootstrap.servers": bootstrap, "group.id": f"lab-truth-{dlq}", "enable.auto.commit": False,
                  "auto.offset.reset": "earliest", "log_level": 0})
    named: set[Position] = set()
    seen = 0
    try:
        c.subscribe([dlq])
        deadline = time.monotonic() + timeout
        while seen < want and time.monotonic() < deadline:
            m = c.poll(0.5)
            if m is None or m.error() is not None:
                continue
            seen += 1
            h = {k: v for k, v in cast(list[tuple[str, bytes | None]], list(m.headers() or [])) if v is not None}
            if h.get("__connect.errors.topic") == topic.encode():
                named.add((int(h["__connect.errors.partition"]), int(h["__connect.errors.offset"])))
    finally:
        c.close()
    if seen < want:
        raise BrokerError(f"lab: the dead-letter topic {dlq} holds {seen} of {want} records after {timeout:.0f}s")
    return named


def expect_sink(truth: Truth, topic: str, stage: str, log: dict[Position, tuple[str | None, int | None]],
                rows: Counter[Position], dead: AbstractSet[Position] = frozenset()) -> dict[str, int]:
    """The sink anomalies of a table's rows against the log (see the module's docstring); their counts."""
    counts: Counter[str] = Counter()
    for (part, off), (pid, seq) in sorted(log.items()):
        n = rows.get((part, off), 0)
        if n == 0:
            code = "dead_lettered" if (part, off) in dead else "missing_in_sink"
            truth.expect(topic, stage, code, part, pid, seq, off)
            counts[code] += 1
        for _ in range(n - 1):
            truth.expect(topic, stage, "duplicate_in_sink", part, pid, seq, off)
            counts["duplicate_in_sink"] += 1
    for (part, off), n in sorted(rows.items()):
        if (part, off) not in log:
            for _ in range(n):
                truth.expect(topic, stage, "unexpected_in_sink", part, None, None, off)
                counts["unexpected_in_sink"] += 1
    return dict(counts)


def _produce(ctx: Context, topic: str, name: str, values: list[bytes], partitions: int = 1) -> None:
    p = ctx.producer(name, **{"linger.ms": 5})
    try:
        for i, v in enumerate(values):
            p.produce(topic, v, key=f"k{i}".encode(), partition=i % partitions)
        if p.flush(30) != 0:
            raise BrokerError(f"lab: producer could not deliver to {topic} within 30s")
    finally:
        p.close()


def _record(n: int) -> bytes:
    return json.dumps({"n": n, "item": f"sku-{n}"}).encode()


# ------------------------------------------------------------------------------------------
# a record the connector cannot convert: to the dead-letter topic, or dropped


BAD_VALUE = b"not json {"


def _unconvertible(ctx: Context, name: str, with_dlq: bool) -> Truth:
    truth = Truth(name)
    topic = ctx.lab.create_topic(f"lab-{name.replace('_', '-')}")
    truth.topic(topic)
    n, bad = 6, 2  # offset 2 is not JSON: the worker's JsonConverter cannot read it
    _produce(ctx, topic, name, [BAD_VALUE if i == bad else _record(i) for i in range(n)])
    dlq = f"{topic}-dlq" if with_dlq else None
    sink = iceberg_sink(ctx, topic, dead_letter_topic=dlq, **{"errors.tolerance": "all"})
    log = read_log(ctx.lab.bootstrap, topic)
    rows = settled(lambda: iceberg_positions(sink), len(log) - 1)
    dead = dead_lettered(ctx.lab.bootstrap, dlq, topic, 1) if dlq else set()
    remove_connector(ctx, topic)
    rows = iceberg_positions(sink)
    counts = expect_sink(truth, topic, f"sink:{sink.name}", log, rows, dead)
    truth.facts.update(messages=n, unconvertible=1, rows_in_table=sum(rows.values()), dead_letter_records=len(dead),
                       **counts)
    where = f"to the dead-letter topic {dlq}" if dlq else "dropped (errors.tolerance=all, no dead-letter topic)"
    ctx.say(f"{name}: {n} records, one not JSON: {sum(rows.values())} rows in the Iceberg table, the bad one {where}")
    return truth


def connect_dlq(ctx: Context) -> Truth:
    return _unconvertible(ctx, "connect_dlq", with_dlq=True)


def connect_drop(ctx: Context) -> Truth:
    return _unconvertible(ctx, "connect_drop", with_dlq=False)


# ------------------------------------------------------------------------------------------
# the worker SIGKILLed mid-commit, restarted

# Iceberg's coordinator (iceberg-kafka-connect 1.11) logs these at INFO: every partition's data
# files are in hand (the table commit comes next), and the whole commit is done.
READY = re.compile(r"Commit (\S+) ready, received responses for all")
COMPLETED = re.compile(r"completed commit (\S+),")


def _ready_commits_done(worker: LocalConnect, since: int) -> int:
    """Commits the coordinator logged since byte `since` that had every partition's answer and completed."""
    with open(worker.log_file, "rb") as f:
        f.seek(since)
        text = f.read().decode(errors="replace")
    return len(set(READY.findall(text)) & set(COMPLETED.findall(text)))


def _kill_when_ready(worker: LocalConnect, since: int, data_dir: Path, timeout: float = 90.0) -> str:
    """SIGKILL the worker the moment its coordinator logs a commit ready while data files exist
    under `data_dir`; return that commit's id."""
    deadline = time.monotonic() + timeout
    with open(worker.log_file, "rb") as log:
        log.seek(since)
        pending = b""
        while time.monotonic() < deadline:
            chunk = log.read()
            if not chunk:
                time.sleep(0.005)
                continue
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                m = READY.search(line.decode(errors="replace"))
                if m and any(data_dir.rglob("*.parquet")):
                    if worker.pid is None:
                        raise BrokerError(f"the Connect worker exited before the kill; see {worker.log_file}")
                    worker.kill(signal.SIGKILL)  # and waits until it is gone
                    return m.group(1)
    raise BrokerError(f"connect_kill: no commit with data files within {timeout:.0f}s; see {worker.log_file}")


def connect_kill(ctx: Context) -> Truth:
    """20 records on 2 partitions; the Iceberg connector (commit every 3 s) consumes them; the
    worker is SIGKILLed the moment its coordinator has every partition's data files of a commit
    (the table commit next); 10 more records come while it is down; it restarts and the connector
    resumes. Whatever the table then holds twice or lacks is the truth."""
    truth = Truth("connect_kill")
    topic = ctx.lab.create_topic("lab-connect-kill", partitions=2)
    truth.topic(topic)
    _produce(ctx, topic, "lab-connect-kill", [_record(i) for i in range(20)], partitions=2)
    worker = connect_worker(ctx)
    since = worker.log_file.stat().st_size if worker.log_file.exists() else 0
    # a restarted task's consumer rejoins at once: the dead member leaves the group after 6 s, not 45
    sink = iceberg_sink(ctx, topic, **{"iceberg.control.commit.interval-ms": "3000",
                                       "consumer.override.session.timeout.ms": "6000",
                                       "consumer.override.heartbeat.interval.ms": "1000"})
    assert sink.warehouse and sink.table
    table_dir = Path(sink.warehouse, *sink.table.split("."))
    commit = _kill_when_ready(worker, since, table_dir / "data")
    log_after = worker.log_file.read_text(errors="replace")[since:]
    completed = f"completed commit {commit}" in log_after
    at_kill = iceberg_positions(sink)
    files_at_kill = len(list((table_dir / "data").rglob("*.parquet")))
    _produce(ctx, topic, "lab-connect-kill", [_record(i) for i in range(20, 30)], partitions=2)
    restarted = worker.log_file.stat().st_size
    worker.start()
    log = read_log(ctx.lab.bootstrap, topic)
    # done when the table holds every record, or when two commits after the restart completed with
    # every partition's answer (what the restarted task had to write, it has written)
    rows = settled(lambda: iceberg_positions(sink), len(log), timeout=150, quiet_s=4.0,
                   given_up=lambda: _ready_commits_done(worker, restarted) >= 2)
    remove_connector(ctx, topic)
    rows = iceberg_positions(sink)
    counts = expect_sink(truth, topic, f"sink:{sink.name}", log, rows)
    truth.facts.update(messages=len(log), killed_at_commit=commit, commit_completed_before_kill=completed,
                       rows_committed_at_kill=sum(at_kill.values()), data_files_at_kill=files_at_kill,
                       rows_in_table=sum(rows.values()), **counts)
    ctx.say(f"connect_kill: worker SIGKILLed with commit {commit} ready ({files_at_kill} data files, "
            f"{sum(at_kill.values())} rows committed, commit {'done' if completed else 'not done'} at the kill); "
            f"after the restart {sum(rows.values())} rows for {len(log)} records: {counts or 'no anomaly'}")
    return truth


# ------------------------------------------------------------------------------------------
# a Structured Streaming job rerun without its checkpoint


def stream_once(spark: Any, bootstrap: str, topic: str, location: str, checkpoint: str) -> None:
    """The user's job: every record of `topic` with its Kafka coordinates (the Kafka source's
    topic, partition, offset, timestamp) appended to a Delta table, once (availableNow)."""
    from pyspark.sql import functions as F

    source = (spark.readStream.format("kafka").option("kafka.bootstrap.servers", bootstrap)
              .option("subscribe", topic).option("startingOffsets", "earliest").load())
    query = (source.select("topic", "partition", "offset", "timestamp", F.col("value").cast("string").alias("value"))
             .writeStream.format("delta").option("checkpointLocation", checkpoint).trigger(availableNow=True)
             .start(location))
    query.awaitTermination(120)
    if query.exception() is not None:
        raise BrokerError(f"the streaming job on {topic} failed: {query.exception()}")


def streaming_restart(ctx: Context) -> Truth:
    """4 audited records on 2 partitions and 2 more on partition 0, each in its own committed
    transaction (the first one's commit marker takes an offset no record holds: a gap a count of
    distinct offsets calls a loss); the job runs, then runs again with a new checkpoint (the old
    one was lost): every record is in the table twice."""
    if ctx.spark is None:
        raise InputError("scenario 'streaming_restart' needs a Spark session (run it through audit.lab.runner)")
    truth = Truth("streaming_restart")
    topic = ctx.lab.create_topic("lab-stream", partitions=2)
    truth.topic(topic)
    _produce(ctx, topic, "lab-stream", [_record(i) for i in range(4)], partitions=2)
    p = ctx.producer("lab-stream-txn", **{"transactional.id": f"lab-{topic}"})
    try:
        p.init_transactions(30)
        for i in (4, 5):
            p.begin_transaction()
            p.produce(topic, _record(i), partition=0)
            p.commit_transaction(30)
    finally:
        p.close()
    location = str(ctx.work / f"stream-{topic}")
    spark = ctx.spark()
    for run in (1, 2):
        stream_once(spark, ctx.lab.bootstrap, topic, location, str(ctx.work / f"stream-{topic}-checkpoint{run}"))
    sink = SinkConfig(name="stream", format="delta", location=location, identity="coordinates", topic=topic,
                      columns={"topic": "topic", "partition": "partition", "offset": "offset", "record_ts": "timestamp"})
    ctx.audit_topic(topic, sinks=(sink,))
    log = read_log(ctx.lab.bootstrap, topic)
    rows = Counter((int(r["partition"]), int(r["offset"]))
                   for r in spark.read.format("delta").load(location).select("partition", "offset").collect())
    counts = expect_sink(truth, topic, f"sink:{sink.name}", log, rows)
    p0 = sorted(o for part, o in log if part == 0)
    truth.facts.update(messages=len(log), runs=2, rows_in_table=sum(rows.values()),
                       offsets_without_record_on_p0=p0[-1] - p0[0] + 1 - len(p0), **counts)
    ctx.say(f"streaming_restart: {len(log)} records, the job rerun without its checkpoint: "
            f"{sum(rows.values())} rows in the Delta table")
    return truth


CONNECT: dict[str, tuple[Callable[[Context], Truth], str]] = {
    "connect_dlq": (connect_dlq, "Kafka Connect (Iceberg sink): a record it cannot convert goes to its dead-letter "
                                 "topic"),
    "connect_drop": (connect_drop, "Kafka Connect (Iceberg sink): errors.tolerance=all without a dead-letter topic "
                                   "drops that record"),
    "connect_kill": (connect_kill, "the Kafka Connect worker SIGKILLed mid-commit of its Iceberg sink, restarted"),
    "streaming_restart": (streaming_restart, "a Spark Structured Streaming job (Kafka -> Delta) rerun without its "
                                             "checkpoint"),
}
