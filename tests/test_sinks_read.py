"""Reading users' SQL sinks through Spark's JDBC source keeps their audit timestamps exact."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from audit.clients.sinks import SinkRecord, SqlSink
from audit.core.config import SinkConfig
from spark_jobs.io.sinks_read import read_sink


@pytest.mark.spark
def test_sqlite_sink_timestamps_keep_their_microseconds(spark: Any, tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'sink.db'}"
    stamped = datetime(2026, 11, 21, 20, 34, 11, 264041, tzinfo=UTC)
    sink = SqlSink(url, "orders", mode="insert", now=lambda: stamped)
    produced = datetime(2026, 11, 21, 20, 34, 10, 5123, tzinfo=UTC)
    sink.write([SinkRecord(topic="orders", partition=0, offset=7, pid="svc:1", seq=3, payload={"v": "x"},
                           produce_ts=produced)])
    sink.close()
    rows = read_sink(spark, SinkConfig(name="orders", format="sql", url=url, table="orders"), "orders").collect()
    # a row of the table itself, not a dead-letter topic's (`dead_letter` false)
    assert [tuple(r) for r in rows] == [("orders", 0, 7, "svc:1", 3, stamped.replace(tzinfo=None),
                                         produced.replace(tzinfo=None), False)]


@pytest.mark.spark
def test_a_sink_without_the_optional_produce_time_reads_it_as_null(spark: Any, tmp_path: Path) -> None:
    """No audit_produce_ts: the column is null; a mapping that names a missing column is one clear error."""
    import sqlalchemy as sa

    from audit.core.errors import InputError

    url = f"sqlite:///{tmp_path / 'sink.db'}"
    engine = sa.create_engine(url)
    with engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE s (audit_topic TEXT, audit_partition INT, audit_offset BIGINT, "
                             "audit_pid TEXT, audit_seq BIGINT, audit_sink_ts TIMESTAMP)"))
        conn.execute(sa.text("INSERT INTO s VALUES ('orders', 0, 7, 'svc:1', 3, '2026-11-21 20:34:11.264041')"))
    engine.dispose()
    rows = read_sink(spark, SinkConfig(name="s", format="sql", url=url, table="s"), "orders").collect()
    assert [tuple(r) for r in rows] == [("orders", 0, 7, "svc:1", 3, datetime(2026, 11, 21, 20, 34, 11, 264041),
                                         None, False)]
    mapped = SinkConfig(name="s", format="sql", url=url, table="s", columns={"produce_ts": "made_at"})
    with pytest.raises(InputError, match="no audit column 'made_at' .for produce_ts.*columns.produce_ts"):
        read_sink(spark, mapped, "orders")


@pytest.mark.spark
def test_a_delta_sinks_rows_are_read_by_the_settling_tasks_themselves(spark: Any, tmp_path: Path) -> None:
    """A Delta sink of audit columns lies in plain Parquet files that the tasks settling a window's
    chunks read with pyarrow (its scan pinned to its files, as a window's are, and its `dead_letter`
    the literal false), not rows Spark hands them."""
    from spark_jobs.io.lake import pin_scans
    from spark_jobs.reconcile.read import FALSE_SOURCE, file_table
    from spark_jobs.reconcile.settle import TIERS, Chunks, read_files
    from tests.reconcile_cases import History, at, write_delta_sink

    h = History()
    for i in range(3):
        h.clean("p", i, 0, i, at(5 + i))
    write_delta_sink(spark, tmp_path / "s1", h.sinks["s1"])
    df = pin_scans(read_sink(spark, SinkConfig(name="s1", format="delta", location=str(tmp_path / "s1")), "t"))
    cols = [c for c in TIERS["sink"][1] if c in df.columns]
    ft = file_table(df.select(*cols), cols)
    assert ft is not None and dict(ft.sources)["dead_letter"] == FALSE_SOURCE
    rows = read_files(ft, Chunks((), ()), 0)
    assert sorted(rows["seq"].to_pylist()) == [0, 1, 2]
    assert rows["dead_letter"].to_pylist() == [False] * 3
