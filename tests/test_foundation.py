"""The local stack itself: the broker lifecycle, Spark with Delta, Spark's Kafka source, PostgreSQL."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Producer

from audit.core.errors import BrokerError, SetupError
from audit.runtime.local_kafka import LocalKafka, PortTaken, free_port, new_cluster_id
from tests.conftest import new_topic


@pytest.mark.unit
def test_port_taken_is_a_clear_error(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(BrokerError, match=f"port {port} on 127.0.0.1 is already in use"):
            LocalKafka(tmp_path, port=port).start()


@pytest.mark.unit
def test_missing_java_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("JAVA_HOME", raising=False)
    with pytest.raises(SetupError, match="Java is not installed"):
        LocalKafka(tmp_path, port=free_port()).start()


@pytest.mark.unit
def test_cluster_is_a_parameter(tmp_path: Path) -> None:
    k = LocalKafka(tmp_path, port=30000, nodes=3)
    assert k.bootstrap_servers == "127.0.0.1:30000,127.0.0.1:30001,127.0.0.1:30002"
    props = k._properties(k.nodes[1])
    assert props["node.id"] == "2"
    assert props["controller.quorum.voters"] == "1@127.0.0.1:30003,2@127.0.0.1:30004,3@127.0.0.1:30005"
    assert props["offsets.topic.replication.factor"] == "3"


@pytest.mark.kafka
def test_broker_start_status_stop(tmp_path: Path) -> None:
    port = free_port()
    k = LocalKafka(tmp_path / "k", port=port)
    k.start()
    try:
        assert k.running_nodes() == [1]
        assert k.is_ready()
        # A second start on a running broker is a no-op, not a second process.
        k.start()
        assert k.running_nodes() == [1]
    finally:
        k.stop()
    assert k.running_nodes() == []
    assert not k.is_ready()


@pytest.mark.kafka
def test_picked_ports_another_process_takes_before_the_broker_binds_them_are_picked_again(tmp_path: Path) -> None:
    k = LocalKafka(tmp_path / "k", port=None)
    first = (k.nodes[0].port, k.nodes[0].controller_port)
    with socket.socket() as s:
        # Bound, not listening: the check before the start does not see it, the broker's bind fails.
        s.bind(("127.0.0.1", first[1]))
        k.start()
        try:
            assert (k.nodes[0].port, k.nodes[0].controller_port) != first
            assert k.running_nodes() == [1]
            assert k.is_ready()
        finally:
            k.stop()
        # A port the caller chose is not moved: the failed bind is one clear error.
        with pytest.raises(PortTaken, match=f"could not bind their ports \\({first[0]}, {first[1]}\\)"):
            LocalKafka(tmp_path / "fixed", port=first[0]).start()


def test_new_cluster_ids_never_start_with_a_dash() -> None:
    ids = [new_cluster_id() for _ in range(3000)]  # 1 in 64 random ids starts with '-'
    assert all(len(c) == 22 and not c.startswith("-") for c in ids)
    assert len(set(ids)) == 3000


@pytest.mark.kafka
def test_broker_formats_storage_with_a_cluster_id_that_looks_like_an_option(tmp_path: Path) -> None:
    # A cluster id kept from an earlier run (or chosen by a user) may begin with '-'; the storage
    # tool must receive it as the value of --cluster-id, not as an unknown option.
    k = LocalKafka(tmp_path / "k", port=free_port())
    (tmp_path / "k").mkdir(parents=True, exist_ok=True)
    (tmp_path / "k" / "cluster.id").write_text("-" + new_cluster_id()[1:])
    k.start()
    try:
        assert k.running_nodes() == [1]
        assert k.is_ready()
    finally:
        k.stop()


@pytest.mark.unit
def test_free_ports_are_below_the_ephemeral_range() -> None:
    """Outgoing connections take ports from the ephemeral range; a broker port picked there could be
    taken before the broker binds it (it happened to a 3-node cluster's own peer connections)."""
    from audit.runtime.local_kafka import _ephemeral_low

    ports = [free_port() for _ in range(50)]
    assert all(10_000 <= p < _ephemeral_low() - 64 for p in ports)


# Cycles of what a large window's chunks do: Arrow buffers and numpy arrays of 64 MB allocated,
# touched and freed; prints Arrow's purge delay, whether glibc's setting took, and the cycles' page faults.
_CYCLES = """
import os
import resource
import spark_jobs  # first, as msgaudit's commands import it
import numpy as np
import pyarrow as pa
from audit.runtime import memory
print(os.environ.get("MIMALLOC_PURGE_DELAY"), memory.keep_freed_memory())
f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    bufs = [pa.allocate_buffer(64 << 20) for _ in range(2)]
    arrays = [np.empty(8 << 20) for _ in range(2)]
    for x in [*(np.frombuffer(b, dtype=np.uint8) for b in bufs), *arrays]:
        x.view(np.uint8)[::4096] = 1
    del bufs, arrays, x
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
"""


@pytest.mark.unit
def test_a_job_process_keeps_the_memory_it_frees_for_its_next_chunk() -> None:
    """`import spark_jobs` sets Arrow's purge delay before pyarrow loads and `keep_freed_memory`
    glibc's thresholds: the chunks' cycles then fault their pages in once, not every time."""
    def cycles(**env: str) -> tuple[str, int]:
        env = {**{k: v for k, v in os.environ.items() if k != "MIMALLOC_PURGE_DELAY"}, **env}
        out = subprocess.run([sys.executable, "-c", _CYCLES], capture_output=True, text=True, env=env,
                             cwd=Path(__file__).resolve().parent.parent, timeout=120, check=True).stdout.split("\n")
        return out[0], int(out[1])

    kept, kept_faults = cycles()
    plain, plain_faults = cycles(MSGAUDIT_KEEP_FREED_MEMORY="0")
    assert (kept, plain) == ("-1 True", "None False")
    assert kept_faults * 4 < plain_faults, (kept_faults, plain_faults)


@pytest.mark.spark
def test_driver_jvm_gets_the_default_heap_and_collector(spark: Any) -> None:
    """`build_spark` starts the JVM with `DRIVER_JVM_DEFAULTS` (4g, the parallel collector) and keeps
    Derby's home out of the working folder."""
    jvm = spark.sparkContext._jvm
    collectors = sorted(b.getName() for b in jvm.java.lang.management.ManagementFactory.getGarbageCollectorMXBeans())
    assert collectors == ["PS MarkSweep", "PS Scavenge"]
    # the parallel collector reports Xmx minus one survivor space
    assert 3500 < jvm.java.lang.Runtime.getRuntime().maxMemory() / 2**20 <= 4096
    assert jvm.java.lang.System.getProperty("derby.system.home").endswith("derby")


@pytest.mark.spark
def test_dataframe_calls_record_no_python_call_site(spark: Any) -> None:
    """pyspark's DataFrame debugging is off in msgaudit sessions (the switch pyspark's call wrappers
    read before they record each call's Python call site in the JVM)."""
    import pyspark.errors.utils as debugging

    assert spark.conf.get("spark.python.sql.dataFrameDebugging.enabled") == "false"
    assert debugging.is_debugging_enabled() is False


def _python_rdd_in_lineage(df: Any) -> bool:
    """Whether computing `df` runs a PythonRDD (rows only a Python worker can decode)."""
    return "PythonRDD" in df._jdf.queryExecution().toRdd().toDebugString()


@pytest.mark.spark
def test_local_frame_round_trips_the_drivers_rows_without_a_python_worker(spark: Any) -> None:
    """`local_frame` gives the rows back exactly, in the schema's types (None, a naive and a tz-aware
    datetime, both UTC; an empty frame keeps its columns), and its rows are decoded in the JVM: no
    PythonRDD in what Spark runs, where `createDataFrame` of the same list has one. A None where the
    schema allows none is refused with the column's name."""
    from datetime import UTC, datetime

    from pyspark.sql.types import LongType, StructField, StructType

    from spark_jobs.io.session import local_frame

    schema = "topic string, ws timestamp, partition int, n bigint, p50 double, ok boolean"
    rows = [("t1", datetime(2026, 11, 21, 10, 0, tzinfo=UTC), 0, 7, 1.5, True),
            ("t2", datetime(2026, 11, 21, 11, 30), 3, None, None, None),
            (None, None, None, 2**40, -0.25, False)]
    got = local_frame(spark, rows, schema)
    assert got.schema.simpleString() == f"struct<{schema.replace(' ', ':').replace(',:', ',')}>"
    assert [tuple(r) for r in got.collect()] == [
        ("t1", datetime(2026, 11, 21, 10, 0), 0, 7, 1.5, True),
        ("t2", datetime(2026, 11, 21, 11, 30), 3, None, None, None),
        (None, None, None, 2**40, -0.25, False)]
    empty = local_frame(spark, [], schema)
    assert empty.columns == ["topic", "ws", "partition", "n", "p50", "ok"] and empty.count() == 0
    assert not _python_rdd_in_lineage(got) and not _python_rdd_in_lineage(empty)
    assert _python_rdd_in_lineage(spark.createDataFrame(rows, schema))  # the check can fail
    with pytest.raises(ValueError, match="column 'k' is not nullable, but 1 of 2 rows hold None"):
        local_frame(spark, [(1,), (None,)], StructType([StructField("k", LongType(), False)]))


@pytest.mark.unit
def test_no_dataframe_is_made_of_python_rows_outside_local_frame() -> None:
    """Every DataFrame msgaudit's code makes of the driver's rows goes through `local_frame`, so none
    of them needs a Python worker to decode its rows."""
    root = Path(__file__).resolve().parent.parent
    offenders = sorted(str(p.relative_to(root)) for d in ("audit", "spark_jobs", "dags")
                       for p in (root / d).rglob("*.py")
                       if ".createDataFrame(" in p.read_text(encoding="utf-8")
                       and p.relative_to(root).as_posix() != "spark_jobs/io/session.py")
    assert offenders == []


@pytest.mark.spark
def test_delta_write_and_read_back(spark: Any, tmp_path: Path) -> None:
    from delta.tables import DeltaTable

    path = str(tmp_path / "t")
    spark.createDataFrame([(1, "a"), (2, "b")], "id long, v string").write.format("delta").save(path)
    DeltaTable.forPath(spark, path).alias("t").merge(
        spark.createDataFrame([(2, "B"), (3, "c")], "id long, v string").alias("s"), "t.id = s.id"
    ).whenMatchedUpdateAll().whenNotMatchedInsertAll().execute()
    rows = sorted(tuple(r) for r in spark.read.format("delta").load(path).collect())
    assert rows == [(1, "a"), (2, "B"), (3, "c")]
    assert DeltaTable.forPath(spark, path).history().count() == 2


@pytest.mark.spark
@pytest.mark.kafka
def test_spark_batch_reads_a_real_topic_with_headers(spark: Any, kafka_bootstrap: str) -> None:
    topic = new_topic(kafka_bootstrap, partitions=2)
    p = Producer({"bootstrap.servers": kafka_bootstrap})
    for i in range(6):
        p.produce(topic, key=f"k{i}".encode(), value=f"v{i}".encode(), partition=i % 2,
                  headers=[("audit.pid", b"p:1"), ("audit.seq", str(i).encode())])
    assert p.flush(10) == 0
    df = (spark.read.format("kafka").option("kafka.bootstrap.servers", kafka_bootstrap)
          .option("subscribe", topic).option("includeHeaders", "true")
          .option("startingOffsets", "earliest").option("endingOffsets", "latest").load())
    got = sorted((r.partition, r.offset, r.key.decode(), [(h.key, bytes(h.value)) for h in r.headers])
                 for r in df.collect())
    assert got == [
        (i % 2, i // 2, f"k{i}", [("audit.pid", b"p:1"), ("audit.seq", str(i).encode())])
        for i in sorted(range(6), key=lambda i: (i % 2, i // 2))
    ]


@pytest.mark.postgres
def test_postgres_is_real(pg_url: str) -> None:
    import sqlalchemy as sa

    eng = sa.create_engine(pg_url)
    with eng.connect() as c:
        assert c.execute(sa.text("select current_database()")).scalar() == "msgaudit"
        assert int(c.execute(sa.text("show server_version_num")).scalar_one()) >= 150000
    eng.dispose()
