"""`msgaudit ingest`: ledger segments -> Delta producer_ledger / consumed_records, exactly once,
partitioned by topic and hour, bad lines quarantined and counted. Real Spark + Delta."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from chispa import assert_df_equality

from audit.clients.ledger import LedgerWriter, sealed_segments
from spark_jobs.ingest import (
    QUARANTINE_TABLE,
    SOURCES,
    ingest,
    parse_lines,
    part_hour_of_millis,
)
from spark_jobs.io import lake
from spark_jobs.io.schemas import CONSUMED_RECORDS, PART_HOUR, PRODUCER_LEDGER
from spark_jobs.pipeline.steps import StepRange, run_step
from tests.support.jobs import job_descriptions, ours

ROOT = Path(__file__).resolve().parent.parent
PRODUCER = SOURCES[0]
T0 = 1_795_000_000_000  # 2026-11-18T11:06:40Z
HOUR = "2026-11-18T11"
MIDNIGHT = 1_795_046_400_000  # 2026-11-19T00:00:00Z


def ms_to_dt(ms: int | None) -> datetime | None:
    return None if ms is None else datetime.fromtimestamp(ms / 1000, tz=UTC)


def prow(seq: int, topic: str = "orders", status: str = "acked", ts: int = T0, **kw: Any) -> dict[str, Any]:
    row = {"producer": "svc", "pid": "svc:0123456789ab", "seq": seq, "topic": topic, "partition": seq % 2,
           "offset": seq if status != "failed" else None, "status": status,
           "error": "_MSG_TIMED_OUT" if status == "failed" else None, "txn_id": None,
           "produce_ts": ts + seq, "ack_ts": ts + seq + 5 if status != "failed" else None}
    row.update(kw)
    return row


def crow(offset: int, ts: int = T0) -> dict[str, Any]:
    return {"group": "loader", "consumer": "c-1", "consume_seq": offset, "topic": "orders", "partition": 0,
            "offset": offset, "pid": "svc:0123456789ab", "seq": offset, "outcome": "processed", "attempt": 1,
            "consume_ts": ts + 1000 + offset}


def write_segment(directory: Path, rows: list[dict[str, Any]]) -> Path:
    with LedgerWriter(directory, "test") as w:
        for r in rows:
            w.append(r)
    (seg,) = w.sealed_segments
    return seg


def expected_ledger(spark: Any, rows: list[dict[str, Any]]) -> Any:
    from pyspark.sql.types import StringType, StructField, StructType

    schema = StructType([*PRODUCER_LEDGER.fields, StructField(PART_HOUR, StringType(), False)])
    data = []
    for r in rows:
        data.append(tuple(ms_to_dt(r[f.name]) if f.name.endswith("_ts") else r.get(f.name) for f in PRODUCER_LEDGER.fields)
                    + (datetime.fromtimestamp(r["produce_ts"] / 1000, tz=UTC).strftime("%Y-%m-%dT%H"),))
    return spark.createDataFrame(data, schema)


@pytest.mark.spark
def test_parse_lines_gives_each_bad_line_its_reason(spark: Any) -> None:
    good = json.dumps(prow(1))
    lines = [
        good,
        "",
        "garbage",
        good[:40],  # truncated
        json.dumps({**prow(2), "seq": "two"}),  # wrong type
        json.dumps({k: v for k, v in prow(3).items() if k != "pid"}),
        json.dumps(prow(4, partition=None)),
        json.dumps(prow(5, status="lost")),
        json.dumps(prow(6, partition=3_000_000_000)),  # not an int
        json.dumps({**prow(7), "run": 0}),
        json.dumps({**prow(8), "run": 65_537}),
        json.dumps({**prow(9), "run": 65_536}),
    ]
    df = spark.createDataFrame([(x, "f") for x in lines], "line string, source_file string")
    actual = df.transform(parse_lines(PRODUCER)).select("line", "reason")
    bad_schema = "not a JSON object of the producer_ledger schema"
    expected = spark.createDataFrame(
        list(zip(lines, [None, "empty line", bad_schema, bad_schema, bad_schema, "missing pid",
                         "missing partition", "bad status: lost", bad_schema, "bad run: 0",
                         "bad run: 65537", None], strict=True)),
        "line string, reason string")
    assert_df_equality(actual, expected, ignore_nullable=True)


@pytest.mark.spark
def test_part_hour_is_the_utc_hour_whatever_the_session_zone(spark: Any) -> None:
    from pyspark.sql import functions as F

    cases = [(0, "1970-01-01T00"), (T0, HOUR), (MIDNIGHT - 1, "2026-11-18T23"), (MIDNIGHT, "2026-11-19T00")]
    df = spark.createDataFrame([(ms,) for ms, _ in cases], "ms long")
    old = spark.conf.get("spark.sql.session.timeZone")
    spark.conf.set("spark.sql.session.timeZone", "America/New_York")
    try:
        got = [r[0] for r in df.select(part_hour_of_millis(F.col("ms"))).collect()]
    finally:
        spark.conf.set("spark.sql.session.timeZone", old)
    assert got == [h for _, h in cases]


@pytest.mark.spark
def test_timestamps_read_back_are_utc_when_the_driver_started_in_another_zone(spark: Any) -> None:
    """pyspark converts TIMESTAMP values with the Python process's local zone: build_spark makes it
    UTC, so a driver started with TZ=Asia/Tokyo still reads 00:00 UTC as 00:00 (not 09:00)."""
    import os
    import time
    from datetime import datetime

    from spark_jobs.io.session import utc_process_clock

    old = os.environ.get("TZ")
    os.environ["TZ"] = "Asia/Tokyo"
    time.tzset()
    try:
        assert datetime.fromtimestamp(0).hour == 9  # the zone the driver started in
        utc_process_clock()
        [row] = spark.sql("SELECT TIMESTAMP '2026-11-19 00:00:00' AS t").collect()
        assert row["t"] == datetime(2026, 11, 19, 0, 0)
    finally:
        if old is None:
            os.environ.pop("TZ", None)
        else:
            os.environ["TZ"] = old
        time.tzset()


@pytest.mark.spark
def test_ingest_lands_exactly_once_and_partitions_by_topic_and_hour(spark: Any, tmp_path: Path,
                                                                   make_config: Any) -> None:
    from delta.tables import DeltaTable

    cfg = make_config(tmp_path)
    prod, cons = cfg.ledger_dir / "producer", cfg.ledger_dir / "consumer"
    first = [prow(i) for i in range(4)] + [prow(0, topic="payments"), prow(4, status="failed")]
    write_segment(prod, first[:3])
    write_segment(prod, first[3:])
    write_segment(cons, [crow(0), crow(1)])
    # A producer's settings at start: one sealed one-line segment of its own (audit/clients/producer.py).
    from audit.clients.producer import SETTINGS_DIR, settings_row, write_settings

    write_settings(cfg.ledger_dir / SETTINGS_DIR, settings_row(
        {"acks": "1", "max.in.flight": 5}, "orders-svc", "orders-svc:0123456789ab", "python", T0))
    # A live writer's open segment is not read until it is sealed.
    live = LedgerWriter(prod, "live", max_age_s=3600)
    live.append(prow(9, topic="late"))
    live.flush()

    r1 = ingest(spark, cfg)
    assert {t: (x.landed, x.quarantined, x.segments) for t, x in r1.tables.items()} == {
        "producer_ledger": (6, 0, 2), "consumed_records": (2, 0, 1), "producer_settings": (1, 0, 1)}
    settings = lake.read_table(spark, cfg, "producer_settings").selectExpr("*", "unix_millis(start_ts) AS ms")
    assert [r.asDict() for r in settings.drop("start_ts").collect()] == [{
        "producer": "orders-svc", "pid": "orders-svc:0123456789ab", "acks": "1", "enable_idempotence": False,
        "retries": 2147483647, "max_in_flight": 5, "transactional_id": None, "mode": "python", PART_HOUR: HOUR,
        "ms": T0}]
    ledger = lake.read_table(spark, cfg, "producer_ledger")
    assert_df_equality(ledger, expected_ledger(spark, first), ignore_row_order=True, ignore_nullable=True,
                       ignore_column_order=True)
    consumed = lake.read_table(spark, cfg, "consumed_records")
    got = consumed.selectExpr("`group`", "offset", "unix_millis(consume_ts) AS ms", PART_HOUR).collect()
    assert sorted(tuple(r) for r in got) == [("loader", 0, T0 + 1000, HOUR), ("loader", 1, T0 + 1001, HOUR)]
    assert [f.name for f in consumed.schema.fields] == [*CONSUMED_RECORDS.fieldNames(), PART_HOUR]

    # Twice: nothing new, nothing added.
    r2 = ingest(spark, cfg)
    assert {t: (x.landed, x.quarantined, x.segments) for t, x in r2.tables.items()} == {
        "producer_ledger": (0, 0, 0), "consumed_records": (0, 0, 0), "producer_settings": (0, 0, 0)}
    assert lake.read_table(spark, cfg, "producer_ledger").count() == 6

    # Only the new segments land next time (the live one, now sealed, and a later hour).
    live.close()
    later = [prow(7, ts=T0 + 3_600_000)]
    write_segment(prod, later)
    r3 = ingest(spark, cfg)
    assert (r3.tables["producer_ledger"].landed, r3.tables["producer_ledger"].segments) == (2, 2)
    assert_df_equality(lake.read_table(spark, cfg, "producer_ledger"),
                       expected_ledger(spark, [*first, prow(9, topic="late"), *later]),
                       ignore_row_order=True, ignore_nullable=True, ignore_column_order=True)

    # Partitioned so a window reads only its own files.
    detail = DeltaTable.forPath(spark, lake.table_path(cfg, "producer_ledger")).detail().first()
    assert detail is not None and list(detail["partitionColumns"]) == ["topic", PART_HOUR]
    one_hour = lake.read_table(spark, cfg, "producer_ledger").where(
        f"topic = 'orders' AND {PART_HOUR} = '{HOUR}'")
    files = one_hour.inputFiles()
    assert files and all(f"/topic=orders/{PART_HOUR}={HOUR}/" in f for f in files)
    assert one_hour.count() == 5


@pytest.mark.spark
def test_ingest_writes_each_ledger_file_sorted_by_seq(spark: Any, tmp_path: Path, make_config: Any) -> None:
    """The producer and consumption ledgers' files each hold their rows sorted by seq, in row groups of
    narrow seq ranges (docs/internals.md: what a task reading its chunk's rows itself would use)."""
    import pyarrow.parquet as pq

    cfg = make_config(tmp_path)
    write_segment(cfg.ledger_dir / "producer", [prow(i) for i in (5, 3, 1, 4, 2, 0)])
    write_segment(cfg.ledger_dir / "producer", [prow(i) for i in (9, 7, 8, 6)])
    write_segment(cfg.ledger_dir / "consumer", [crow(o) for o in (3, 0, 2, 1)])
    ingest(spark, cfg)
    for table, seqs in (("producer_ledger", list(range(10))), ("consumed_records", [0, 1, 2, 3])):
        files = lake.read_table(spark, cfg, table).inputFiles()
        in_files = [pq.read_table(f.removeprefix("file:"), columns=["seq"]).column("seq").to_pylist() for f in files]
        assert sorted(s for f in in_files for s in f) == seqs
        assert all(f == sorted(f) for f in in_files), in_files


@pytest.mark.spark
def test_corrupt_segment_is_quarantined_counted_and_the_rest_lands(
        spark: Any, tmp_path: Path, make_config: Any, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = make_config(tmp_path)
    prod = cfg.ledger_dir / "producer"
    good = [prow(0), prow(1)]
    seg = write_segment(prod, good)
    truncated = json.dumps(prow(2))[:30]
    with seg.open("a") as f:
        f.write("not json at all\n")
        f.write(json.dumps(prow(3, status="maybe")) + "\n")
        f.write(truncated + "\n")

    before = set(job_descriptions(spark))
    run_step(spark, cfg, "ingest", StepRange(), say=print)
    # every Spark job of the step is named after it in the Spark UI, or after its streaming query
    # (Delta's own ones after "Delta: ")
    named = [d for i, d in job_descriptions(spark).items() if i not in before]
    assert named and all(ours(d).startswith(("msgaudit ingest", "msgaudit_ingest_")) for d in named), named
    out = capsys.readouterr().out
    assert "ingest producer_ledger: 2 rows landed from 1 segments, 3 lines quarantined" in out
    assert "ingest consumed_records: 0 rows landed from 0 segments, 0 lines quarantined" in out
    assert "2 rows landed, 3 lines quarantined" in out.splitlines()[-1]

    assert_df_equality(lake.read_table(spark, cfg, "producer_ledger"), expected_ledger(spark, good),
                       ignore_row_order=True, ignore_nullable=True, ignore_column_order=True)
    q = lake.read_table(spark, cfg, QUARANTINE_TABLE)
    bad_schema = "not a JSON object of the producer_ledger schema"
    assert sorted((r["table"], Path(r["source_file"]).name, r["line"], r["reason"]) for r in q.collect()) == sorted([
        ("producer_ledger", seg.name, "not json at all", bad_schema),
        ("producer_ledger", seg.name, json.dumps(prow(3, status="maybe")), "bad status: maybe"),
        ("producer_ledger", seg.name, truncated, bad_schema),
    ])
    # Quarantined lines are counted once: a second run adds nothing anywhere.
    r2 = ingest(spark, cfg)
    assert (r2.landed, r2.quarantined) == (0, 0)
    assert lake.read_table(spark, cfg, QUARANTINE_TABLE).count() == 3


@pytest.mark.spark
def test_a_run_line_lands_as_one_row_per_message(spark: Any, tmp_path: Path, make_config: Any,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """`"run": k` (the Java interceptor's lines, docs/design.md §4.2): k rows, seq and offset
    counting up from the line's, every other column the line's; a failed run keeps its null offset."""
    cfg = make_config(tmp_path)
    acked = prow(10, partition=1, offset=500)
    failed = prow(20, status="failed", partition=0)
    seg = write_segment(cfg.ledger_dir / "producer", [{**acked, "run": 3}, prow(0), {**failed, "run": 2}])
    with seg.open("a") as f:
        f.write(json.dumps({**prow(30), "run": -1}) + "\n")

    run_step(spark, cfg, "ingest", StepRange(), say=print)
    out = capsys.readouterr().out
    assert "ingest producer_ledger: 6 rows landed from 1 segments, 1 lines quarantined" in out
    expected = ([{**acked, "seq": 10 + i, "offset": 500 + i} for i in range(3)] + [prow(0)]
                + [{**failed, "seq": 20 + i} for i in range(2)])
    assert_df_equality(lake.read_table(spark, cfg, "producer_ledger"), expected_ledger(spark, expected),
                       ignore_row_order=True, ignore_nullable=True, ignore_column_order=True)
    [q] = lake.read_table(spark, cfg, QUARANTINE_TABLE).collect()
    assert q["reason"] == "bad run: -1"


@pytest.mark.spark
@pytest.mark.kafka
def test_sigkilled_producer_leaves_an_ingestible_ledger(spark: Any, kafka_bootstrap: str, tmp_path: Path,
                                                       make_config: Any) -> None:
    from tests.conftest import new_topic
    from tests.test_producer import consume_all

    cfg = make_config(tmp_path)
    prod = cfg.ledger_dir / "producer"
    topic = new_topic(kafka_bootstrap, partitions=2)
    n = 200
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.support.producer_kill_target", "producer", str(prod), str(n),
         kafka_bootstrap, topic], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == f"READY {n}"
        time.sleep(0.5)  # keep producing, unflushed, when the kill lands
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    assert sealed_segments(prod) == [] and len(list(prod.glob("*.jsonl.open"))) == 1

    result = ingest(spark, cfg)
    r = result.tables["producer_ledger"]
    assert (r.recovered, r.segments, r.quarantined) == (1, 1, 0)
    assert r.landed >= n
    rows = lake.read_table(spark, cfg, "producer_ledger").collect()
    assert len(rows) == r.landed
    seqs = {row["seq"] for row in rows}
    assert len(seqs) == len(rows) and set(range(n)) <= seqs  # every flushed row landed, once
    # Delivery callbacks, hence ledger rows, are in offset order per partition only (the two
    # partitions' batches are acked independently), so the lost tail is a tail per partition:
    # the landed offsets of each partition run from 0 without a hole.
    for p in (0, 1):
        offsets = sorted(row["offset"] for row in rows if row["partition"] == p)
        assert offsets == list(range(len(offsets)))
    assert {row["status"] for row in rows} == {"acked"}

    # Every landed acked row points at the record that carries its seq.
    from confluent_kafka import Consumer, TopicPartition

    from audit.core import headers as h

    c = Consumer({"bootstrap.servers": kafka_bootstrap, "group.id": "wm"})
    total = sum(c.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1] for p in (0, 1))
    c.close()
    records = consume_all(kafka_bootstrap, topic, total, timeout=60)
    assert len(records) == total >= len(rows)
    at = {(m.partition(), m.offset()): h.parse(m.headers()).seq for m in records}
    assert all(at[(row["partition"], row["offset"])] == row["seq"] for row in rows)


@pytest.mark.spark
def test_consumption_rows_kept_in_a_sink_database_land_once(spark: Any, tmp_path: Path, make_config: Any) -> None:
    """exactly_once_sink evidence: the rows SqlSink wrote with a batch land in consumed_records,
    exactly once over repeated ingests (the look-back re-reads them), bad rows quarantined once."""
    import sqlalchemy as sa

    from audit.clients.sinks import CONSUMPTION_TABLE, Position, SinkRecord, SqlSink

    url = f"sqlite:///{tmp_path / 'sink.db'}"
    cfg = make_config(tmp_path, topics={"orders": {"groups": ["loader"], "sinks": [
        {"name": "orders_db", "format": "sql", "url": url, "table": "orders_out", "group": "loader"}]}})
    sink = SqlSink(url, "orders_out")

    def evidence(offset: int, **kw: Any) -> dict[str, Any]:
        return {**crow(offset), "consumer": "loader-w1:abc", **kw}

    rec = SinkRecord({"n": 0}, "orders", 0, 0, "svc:0123456789ab", 0)
    sink.write([rec], group="loader", positions=[Position("orders", 0, 2)],
               consumption=[evidence(0), evidence(1, outcome="failed", error="ValueError: bad")])
    r1 = ingest(spark, cfg)
    assert (r1.tables["consumed_records (sinks)"].landed,
            r1.tables["consumed_records (sinks)"].segments) == (2, 1)
    r2 = ingest(spark, cfg)
    assert r2.tables["consumed_records (sinks)"].landed == 0

    sink.write([], group="loader", positions=[Position("orders", 0, 3)], consumption=[evidence(2)])
    written = int(time.time() * 1000)  # within the look-back of the last ingest's newest row
    with sa.create_engine(url).begin() as conn:  # another writer's row with an outcome we do not know
        conn.execute(sa.text(f"INSERT INTO {CONSUMPTION_TABLE} VALUES ('loader', 'x', 0, 'orders', 0, 9, "
                             f"NULL, NULL, 'skipped', 1, {T0}, NULL, {written})"))
    r3 = ingest(spark, cfg)
    assert (r3.tables["consumed_records (sinks)"].landed,
            r3.tables["consumed_records (sinks)"].quarantined) == (1, 1)
    ingest(spark, cfg)
    sink.close()

    got = lake.read_table(spark, cfg, "consumed_records").selectExpr(
        "`group`", "consumer", "consume_seq", "offset", "outcome", "error", "unix_millis(consume_ts) AS ms",
        PART_HOUR).collect()
    assert sorted(tuple(r) for r in got) == [
        ("loader", "loader-w1:abc", 0, 0, "processed", None, T0 + 1000, HOUR),
        ("loader", "loader-w1:abc", 1, 1, "failed", "ValueError: bad", T0 + 1001, HOUR),
        ("loader", "loader-w1:abc", 2, 2, "processed", None, T0 + 1002, HOUR)]
    bad = lake.read_table(spark, cfg, QUARANTINE_TABLE).select("source_file", "reason").collect()
    assert [tuple(r) for r in bad] == [(f"{url}#{CONSUMPTION_TABLE}", "bad outcome: skipped")]
