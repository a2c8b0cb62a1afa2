"""Sink writers: SqlSink (SQLite, PostgreSQL) and DeltaSink (real Spark + Delta).

Each test writes known records and reads the table back, asserting the exact rows: insert keeps
redeliveries as extra rows, upsert/merge keeps one row per (topic, pid, seq), positions are
stored in the same transaction/commit as the rows (and vanish with them on a rollback).
"""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from audit.clients.sinks import CONSUMPTION_TABLE, AuditColumns, Position, SinkRecord, SqlSink, dedupe_last
from audit.core.config import SinkConfig
from audit.core.errors import ConfigError, InputError

TS = datetime(2026, 11, 21, 10, 0, tzinfo=UTC)
PT = datetime(2026, 11, 21, 9, 59, 59, 123000, tzinfo=UTC)  # the records' produce time (rec)


def rec(offset: int, seq: int | None = None, pid: str | None = "p:1", topic: str = "orders",
        partition: int = 0, **payload: Any) -> SinkRecord:
    """A sink record; seq defaults to the offset, and to None (unaudited) when pid is None; an
    audited one carries its produce time, PT + seq ms."""
    if seq is None and pid is not None:
        seq = offset
    pt = PT + timedelta(milliseconds=seq) if pid is not None and seq is not None else None
    return SinkRecord(payload or {"n": offset}, topic, partition, offset, pid, seq, pt)


def rows_of(sink: SqlSink, *cols: str) -> list[tuple[Any, ...]]:
    with sink.engine.connect() as conn:
        table = sink.table()
        assert table is not None
        return sorted((tuple(r) for r in conn.execute(sa.select(*(table.c[c] for c in cols)))), key=nulls_first)


def nulls_first(row: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple((x is not None, x) for x in row)


class Boom(Exception):
    pass


def _raise() -> None:
    raise Boom("crash inside the transaction")


# -- unit (SQLite files are real databases; no server needed) ----------------------------------

@pytest.mark.unit
def test_audit_columns_from_config_and_mapping() -> None:
    sc = SinkConfig(name="s", format="sql", url="sqlite://", table="t", columns={"offset": "src_off"})
    assert AuditColumns.of(sc).names() == ("audit_topic", "audit_partition", "src_off", "audit_pid",
                                           "audit_seq", "audit_sink_ts")
    assert AuditColumns.of({"pid": "producer_id"}).key() == ("audit_topic", "producer_id", "audit_seq")
    with pytest.raises(ConfigError, match="unknown logical audit column"):
        AuditColumns.of({"offest": "x"})


@pytest.mark.unit
def test_dedupe_last_keeps_the_last_row_per_key_and_every_keyless_row() -> None:
    rows: list[dict[str, Any]] = [{"k": 1, "v": "a"}, {"k": None, "v": "b"}, {"k": 1, "v": "c"}, {"k": None, "v": "d"}, {"k": 2, "v": "e"}]
    assert dedupe_last(rows, ("k",)) == [{"k": None, "v": "b"}, {"k": 1, "v": "c"}, {"k": None, "v": "d"},
                                         {"k": 2, "v": "e"}]


def _sqlite(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'sink.db'}"


@pytest.mark.unit
def test_insert_mode_keeps_redelivered_rows_and_stamps_audit_columns(tmp_path: Path) -> None:
    sink = SqlSink(_sqlite(tmp_path), "orders_sink", "insert", now=lambda: TS)
    sink.write([rec(0), rec(1), rec(2, pid=None, seq=None)])
    sink.write([rec(1)])  # a redelivery
    assert rows_of(sink, "n", "audit_topic", "audit_partition", "audit_offset", "audit_pid", "audit_seq") == [
        (0, "orders", 0, 0, "p:1", 0), (1, "orders", 0, 1, "p:1", 1), (1, "orders", 0, 1, "p:1", 1),
        (2, "orders", 0, 2, None, None)]
    table = sink.table()
    assert table is not None and list(table.c.keys()) == [
        "n", "audit_topic", "audit_partition", "audit_offset", "audit_pid", "audit_seq", "audit_sink_ts",
        "audit_produce_ts"]
    with sink.engine.connect() as conn:
        stamped = conn.execute(sa.select(table.c.audit_sink_ts)).scalars().all()
        produced = conn.execute(sa.select(table.c.n, table.c.audit_produce_ts).order_by(table.c.n)).all()
    assert {s.replace(tzinfo=None) for s in stamped} == {TS.replace(tzinfo=None)}
    assert [(n, p if p is None else p.replace(tzinfo=None)) for n, p in produced] == [
        (0, datetime(2026, 11, 21, 9, 59, 59, 123000)), (1, datetime(2026, 11, 21, 9, 59, 59, 124000)),
        (1, datetime(2026, 11, 21, 9, 59, 59, 124000)), (2, None)]
    sink.close()


@pytest.mark.unit
def test_a_table_made_without_the_produce_time_keeps_its_columns(tmp_path: Path) -> None:
    """The optional audit_produce_ts is left out of a table that lacks it: rows land, schema unchanged."""
    url = _sqlite(tmp_path)
    engine = sa.create_engine(url)
    with engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE s (n BIGINT, audit_topic TEXT, audit_partition INT, audit_offset BIGINT, "
                             "audit_pid TEXT, audit_seq BIGINT, audit_sink_ts TIMESTAMP)"))
    engine.dispose()
    sink = SqlSink(url, "s", "insert", now=lambda: TS)
    sink.write([rec(0), rec(1)])
    table = sink.table()
    assert table is not None and "audit_produce_ts" not in table.c
    assert rows_of(sink, "n", "audit_offset", "audit_seq") == [(0, 0, 0), (1, 1, 1)]
    sink.close()


@pytest.mark.unit
def test_upsert_mode_keeps_one_row_per_message(tmp_path: Path) -> None:
    sink = SqlSink(_sqlite(tmp_path), "orders_sink", "upsert")
    sink.write([rec(0, v="a"), rec(1, v="a"), rec(5, pid=None, seq=None, v="x")])
    # Redelivered at a new offset (a duplicate in the log) and within one batch: still one row.
    sink.write([rec(9, seq=1, v="b"), rec(10, seq=1, v="c"), rec(6, pid=None, seq=None, v="y")])
    assert rows_of(sink, "audit_pid", "audit_seq", "audit_offset", "v") == [
        (None, None, 5, "x"), (None, None, 6, "y"), ("p:1", 0, 0, "a"), ("p:1", 1, 10, "c")]
    sink.close()


@pytest.mark.unit
def test_positions_commit_and_roll_back_with_the_rows(tmp_path: Path) -> None:
    sink = SqlSink(_sqlite(tmp_path), "s", "insert")
    sink.write([rec(0), rec(1)], group="g", positions=[Position("orders", 0, 2)])
    with pytest.raises(Boom):
        sink.write([rec(2)], group="g", positions=[Position("orders", 0, 3)], before_commit=_raise)
    assert rows_of(sink, "audit_offset") == [(0,), (1,)]
    assert sink.read_positions("g", [("orders", 0), ("orders", 1)]) == {("orders", 0): 2}
    sink.write([], group="g", positions=[Position("orders", 0, 3), Position("orders", 1, 7)])
    assert sink.read_positions("g", [("orders", 0), ("orders", 1)]) == {("orders", 0): 3, ("orders", 1): 7}
    assert sink.read_positions("other", [("orders", 0)]) == {}
    with pytest.raises(InputError, match="group"):
        sink.write([rec(3)], positions=[Position("orders", 0, 4)])
    sink.close()


def consumption(seq: int, offset: int, outcome: str = "processed", **kw: Any) -> dict[str, Any]:
    return {"group": "g", "consumer": "w1:abc", "consume_seq": seq, "topic": "orders", "partition": 0,
            "offset": offset, "pid": "p:1", "seq": offset, "outcome": outcome, "attempt": 1,
            "consume_ts": 1_795_000_000_000 + seq, **kw}


def consumption_of(sink: SqlSink) -> list[tuple[Any, ...]]:
    with sink.engine.connect() as conn:
        return sorted(tuple(r) for r in conn.execute(sa.text(
            f"SELECT consume_seq, \"offset\", outcome, error, written_ts FROM {CONSUMPTION_TABLE}")))


@pytest.mark.unit
def test_consumption_rows_commit_and_roll_back_with_the_rows_and_positions(tmp_path: Path) -> None:
    sink = SqlSink(_sqlite(tmp_path), "s", "insert", now=lambda: TS)
    assert sink.stores_consumption
    sink.write([rec(0)], group="g", positions=[Position("orders", 0, 2)],
               consumption=[consumption(0, 0), consumption(1, 1, "failed", error="ValueError: x")])
    with pytest.raises(Boom):
        sink.write([rec(2)], group="g", positions=[Position("orders", 0, 3)],
                   consumption=[consumption(2, 2)], before_commit=_raise)
    ms = int(TS.timestamp() * 1000)
    assert consumption_of(sink) == [(0, 0, "processed", None, ms), (1, 1, "failed", "ValueError: x", ms)]
    assert rows_of(sink, "audit_offset") == [(0,)]
    assert sink.read_positions("g", [("orders", 0)]) == {("orders", 0): 2}
    # A row the audit could not read is refused before anything is written.
    with pytest.raises(InputError, match=r"unknown column\(s\) \['note'\], missing \['attempt'\]"):
        bad = {k: v for k, v in consumption(2, 2, note="x").items() if k != "attempt"}
        sink.write([rec(2)], group="g", positions=[Position("orders", 0, 3)], consumption=[bad])
    assert rows_of(sink, "audit_offset") == [(0,)]
    sink.close()


@pytest.mark.unit
def test_bad_rows_are_named_errors_not_silent_drops(tmp_path: Path) -> None:
    sink = SqlSink(_sqlite(tmp_path), "s", "insert")
    sink.write([rec(0)])
    with pytest.raises(InputError, match=r"no column\(s\) \['extra'\]"):
        sink.write([SinkRecord({"n": 1, "extra": 2}, "orders", 0, 1, "p:1", 1)])
    with pytest.raises(InputError, match="audit column name"):
        sink.write([SinkRecord({"audit_offset": 1}, "orders", 0, 1, "p:1", 1)])
    assert rows_of(sink, "audit_offset") == [(0,)]
    with pytest.raises(ConfigError, match="mode"):
        SqlSink(_sqlite(tmp_path), "s", "merge")
    sink.close()


@pytest.mark.unit
def test_existing_table_upsert_gets_its_unique_index_or_a_clear_error(tmp_path: Path) -> None:
    url = _sqlite(tmp_path)
    SqlSink(url, "plain", "insert").write([rec(0), rec(0)])
    with pytest.raises(InputError, match="duplicate messages"):
        SqlSink(url, "plain", "upsert").write([rec(1)])
    SqlSink(url, "clean", "insert").write([rec(0)])
    up = SqlSink(url, "clean", "upsert")
    up.write([rec(0, n=100)])
    assert rows_of(up, "audit_offset") == [(0,)]


@pytest.mark.unit
def test_mapped_column_names(tmp_path: Path) -> None:
    cols = {"topic": "src_topic", "offset": "src_offset", "sink_ts": "loaded_at"}
    sink = SqlSink(_sqlite(tmp_path), "m", "upsert", cols)
    sink.write([rec(3), rec(3)])
    assert rows_of(sink, "src_topic", "src_offset", "audit_pid", "audit_seq") == [("orders", 3, "p:1", 3)]


@pytest.mark.postgres
@pytest.mark.parametrize("mode, expected", [("insert", [0, 1, 1]), ("upsert", [0, 1])])
def test_postgres_insert_and_upsert(pg_url: str, mode: str, expected: list[int]) -> None:
    table = f"pg_{mode}_{time.time_ns()}"
    sink = SqlSink(pg_url, table, mode)
    sink.write([rec(0), rec(1)], group=table, positions=[Position("orders", 0, 2)])
    with pytest.raises(Boom):
        sink.write([rec(5)], group=table, positions=[Position("orders", 0, 6)], before_commit=_raise)
    sink.write([rec(1)], group=table, positions=[Position("orders", 0, 2)])
    assert [r[0] for r in rows_of(sink, "audit_offset")] == expected
    assert sink.read_positions(table, [("orders", 0)]) == {("orders", 0): 2}
    sink.close()


# -- Delta -------------------------------------------------------------------------------------

@pytest.mark.spark
@pytest.mark.parametrize("mode, expected", [
    ("append", [("a", 0, 0), ("a", 1, 1), ("b", 1, 1)]),
    ("merge", [("a", 0, 0), ("b", 1, 1)]),
])
def test_delta_sink_append_and_merge(spark: Any, tmp_path: Path, mode: str,
                                     expected: list[tuple[str, int, int]]) -> None:
    from chispa import assert_df_equality

    from spark_jobs.io.delta_sink import DeltaSink

    sink = DeltaSink(spark, str(tmp_path / "sink"), mode, now=lambda: TS)
    sink.write([rec(0, v="a"), rec(1, v="a")])
    sink.write([rec(1, v="b")])
    got = sink.read().select("v", "audit_offset", "audit_seq")
    want = spark.createDataFrame(expected, got.schema)
    assert_df_equality(got, want, ignore_row_order=True)
    assert [f.name for f in sink.read().schema.fields] == [
        "v", "audit_topic", "audit_partition", "audit_offset", "audit_pid", "audit_seq", "audit_sink_ts",
        "audit_produce_ts"]
    assert sorted((r.audit_seq, r.audit_produce_ts) for r in sink.read().collect())[:2] == [
        (0, datetime(2026, 11, 21, 9, 59, 59, 123000)), (1, datetime(2026, 11, 21, 9, 59, 59, 124000))]
    # a table made without the optional column keeps its schema
    before = "v string, audit_topic string, audit_partition int, audit_offset bigint, audit_pid string, " \
             "audit_seq bigint, audit_sink_ts timestamp"
    spark.createDataFrame([("a", "orders", 0, 0, "p:1", 0, TS)], before).write.format("delta").save(
        str(tmp_path / "old"))
    old = DeltaSink(spark, str(tmp_path / "old"), mode, now=lambda: TS)
    old.write([rec(1, v="b")])
    assert [f.name for f in old.read().schema.fields] == [c.split()[0] for c in before.split(", ")]
    assert sorted(r.audit_seq for r in old.read().collect()) == [0, 1]


@pytest.mark.spark
def test_delta_sink_positions_travel_in_the_same_commit(spark: Any, tmp_path: Path) -> None:
    from delta.tables import DeltaTable

    from spark_jobs.io.delta_sink import DeltaSink

    sink = DeltaSink(spark, str(tmp_path / "sink"), "merge")
    assert sink.read_positions("g", [("orders", 0)]) == {}
    sink.write([rec(0), rec(1)], group="g", positions=[Position("orders", 0, 2)])
    sink.write([rec(7, partition=1)], group="g", positions=[Position("orders", 1, 8)])
    sink.write([rec(2)], group="g", positions=[Position("orders", 0, 3)])
    sink.write([], group="g2", positions=[Position("orders", 0, 99)])
    with pytest.raises(Boom):
        sink.write([rec(3)], group="g", positions=[Position("orders", 0, 4)], before_commit=_raise)
    assert sink.read_positions("g", [("orders", 0), ("orders", 1), ("orders", 2)]) == {
        ("orders", 0): 3, ("orders", 1): 8}
    assert sink.read_positions("g2", [("orders", 0)]) == {("orders", 0): 99}
    assert sorted(r.audit_offset for r in sink.read().collect()) == [0, 1, 2, 7]
    # Rows and positions are one commit each: every commit with rows carries its metadata.
    hist = DeltaTable.forPath(spark, str(tmp_path / "sink")).history().orderBy("version").collect()
    metas = [json.loads(h.userMetadata)["positions"] for h in hist]
    assert metas == [[["orders", 0, 2]], [["orders", 1, 8]], [["orders", 0, 3]], [["orders", 0, 99]]]


@pytest.mark.spark
@pytest.mark.kafka
@pytest.mark.parametrize("crash_at", ["sink_txn_open", "sink_written"])
def test_consumer_exactly_once_into_delta_survives_a_crash_at_its_commit(
        spark: Any, tmp_path: Path, kafka_bootstrap: str, make_config: Any, crash_at: str) -> None:
    """exactly_once_sink with Delta: the first run dies just before (sink_txn_open) or just after
    (sink_written) its second Delta commit; the rerun resumes from the positions in the table.
    Every record lands exactly once, and so does its consumption row: the rows travel in the
    commit, so `msgaudit ingest` lands them from the table's history and none is lost or doubled."""
    from audit.clients.consumer import AuditedConsumer
    from spark_jobs.ingest import SINK_EVIDENCE, ingest
    from spark_jobs.io import lake
    from spark_jobs.io.delta_sink import DeltaSink
    from tests.conftest import new_topic
    from tests.test_consumer import ledger_rows, produce_audited

    topic = new_topic(kafka_bootstrap)
    group = f"g-{topic}"
    produce_audited(kafka_bootstrap, topic, [{"n": i} for i in range(8)], tmp_path)
    location = str(tmp_path / "delta_sink")
    sink = DeltaSink(spark, location, "append")
    commits = {"n": 0}

    def crash_on_second(stage: str, records: Any) -> None:
        if stage == "sink_txn_open":
            commits["n"] += 1
        if stage == crash_at and commits["n"] == 2:
            raise Boom(f"killed at {stage}")

    kw: dict[str, Any] = {"topics": [topic], "group": group, "semantics": "exactly_once_sink",
                          "sink": sink, "ledger_dir": tmp_path / "ledger", "batch_size": 4,
                          "poll_timeout_s": 0.2}
    with AuditedConsumer({"bootstrap.servers": kafka_bootstrap}, on_stage=crash_on_second, **kw) as c, \
            pytest.raises(Boom):
        c.run(lambda r: {"n": json.loads(r.value or b"{}")["n"]}, idle_timeout_s=3)
    with AuditedConsumer({"bootstrap.servers": kafka_bootstrap}, **kw) as c:
        c.run(lambda r: {"n": json.loads(r.value or b"{}")["n"]}, idle_timeout_s=1.5)
    assert sorted((r.n, r.audit_offset) for r in sink.read().collect()) == [(i, i) for i in range(8)]
    assert sink.read_positions(group, [(topic, 0)]) == {(topic, 0): 8}
    assert ledger_rows(tmp_path / "ledger") == []  # the evidence is in the commits, not in files

    cfg = make_config(tmp_path, topics={topic: {"groups": [group], "sinks": [
        {"name": "out", "format": "delta", "location": location, "group": group}]}})
    first, again = ingest(spark, cfg), ingest(spark, cfg)
    assert first.tables[SINK_EVIDENCE].landed == 8 and SINK_EVIDENCE not in again.tables
    got = lake.read_table(spark, cfg, "consumed_records").select("group", "offset", "outcome").collect()
    assert sorted(tuple(r) for r in got) == [(group, i, "processed") for i in range(8)]
