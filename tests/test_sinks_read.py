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
    sink.write([SinkRecord(topic="orders", partition=0, offset=7, pid="svc:1", seq=3, payload={"v": "x"})])
    sink.close()
    rows = read_sink(spark, SinkConfig(name="orders", format="sql", url=url, table="orders"), "orders").collect()
    assert [tuple(r) for r in rows] == [("orders", 0, 7, "svc:1", 3, stamped.replace(tzinfo=None))]
