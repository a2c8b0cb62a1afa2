"""What one window reads: `read_window_inputs` reads only the Delta partitions (topic, part_hour)
the window and its lookback need (with `spark_jobs/io/sinks_read.py` for sinks), `restrict`
applies the oracle's exact visibility rules (`audit.core.windows.read_ranges`) and
`ledger_is_valid` the quarantine rule for malformed ledger rows.

With `outputs.py` this is the only I/O of the reconciliation; it must not classify anything or
write anything.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from audit.core.config import Config, TopicConfig
from audit.core.vocabulary import ACKED, LEDGER_STATUSES
from audit.core.windows import read_ranges


@dataclass
class WindowInputs:
    """The DataFrames one window reads (already limited to the topic's partitions of the lake).

    Sinks are normalised to (topic, partition, offset, pid, seq, sink_ts) by sinks_read."""

    ledger: DataFrame
    log: DataFrame
    consumed: DataFrame | None
    group_offsets: DataFrame | None
    watermarks: DataFrame | None
    sinks: Mapping[str, DataFrame] = field(default_factory=dict)
    mirror_log: DataFrame | None = None  # mirror_records of the topic (stage mirror:<m>), visibility in mirror.py
    mirror_watermarks: DataFrame | None = None


def restrict(inputs: WindowInputs, tc: TopicConfig, ws: datetime) -> WindowInputs:
    """Exact visibility rules of the oracle (the I/O edge prunes Delta partitions coarsely first)."""
    rr = read_ranges(tc, ws)
    topic = F.col("topic") == tc.name

    def between(col: Any, lo: datetime, hi: datetime) -> Any:
        return (col >= F.lit(lo)) & (col < F.lit(hi))

    ledger = inputs.ledger.where(topic & between(F.col("produce_ts"), rr.message_lo, rr.message_hi))
    natural = F.coalesce("produce_ts", "kafka_ts", "captured_at")
    log = inputs.log.where(topic & between(natural, rr.message_lo, rr.message_hi))
    consumed = None
    if inputs.consumed is not None and tc.groups:
        consumed = inputs.consumed.where(topic & F.col("group").isin(list(tc.groups))
                                         & between(F.col("consume_ts"), rr.event_lo, rr.event_hi))
    sinks = {name: df.where(topic & (F.col("sink_ts").isNull()
                                     | between(F.col("sink_ts"), rr.event_lo, rr.event_hi)))
             for name, df in inputs.sinks.items()}
    return WindowInputs(ledger, log, consumed, inputs.group_offsets, inputs.watermarks, sinks,
                        inputs.mirror_log, inputs.mirror_watermarks)


def ledger_is_valid() -> Any:
    return (F.col("status").isin(list(LEDGER_STATUSES))
            & ~((F.col("status") == ACKED) & (F.col("offset").isNull() | (F.col("partition") < 0))))


def _hours(lo: datetime, hi: datetime) -> tuple[str, str]:
    """part_hour bounds (inclusive) of the instants [lo, hi)."""
    return lo.strftime("%Y-%m-%dT%H"), (hi - timedelta(microseconds=1)).strftime("%Y-%m-%dT%H")


def read_window_inputs(spark: SparkSession, cfg: Config, tc: TopicConfig, ws: datetime) -> WindowInputs:
    """Read only the Delta partitions (topic, part_hour) the window and its lookback need."""
    from spark_jobs.io.lake import read_input_table, table_exists
    from spark_jobs.io.sinks_read import read_sink

    rr = read_ranges(tc, ws)
    m_lo, m_hi = _hours(rr.message_lo, rr.message_hi)
    e_lo, e_hi = _hours(rr.event_lo, rr.event_hi)

    def pruned(name: str, lo: str, hi: str) -> DataFrame:
        df, partitioned = read_input_table(spark, cfg, name)
        df = df.where(F.col("topic") == tc.name)
        if not partitioned:  # written by another tool without part_hour: read whole (`restrict` is exact)
            return df
        return df.where((F.col("part_hour") >= lo) & (F.col("part_hour") <= hi))

    def small(name: str) -> DataFrame:
        return read_input_table(spark, cfg, name)[0].where(F.col("topic") == tc.name)

    ledger = pruned("producer_ledger", m_lo, m_hi)
    log = pruned("log_records", m_lo, m_hi)
    watermarks = small("partition_watermarks")
    consumed = group_offsets = None
    if tc.groups:
        consumed = pruned("consumed_records", e_lo, e_hi)
        group_offsets = small("group_offsets")
    elif table_exists(spark, cfg, "group_offsets"):
        group_offsets = small("group_offsets")
    sinks = {s.name: read_sink(spark, s, tc.name) for s in tc.sinks}
    mirror_log = mirror_watermarks = None
    if tc.mirrors:
        mirror_log = pruned("mirror_records", m_lo, m_hi) if table_exists(spark, cfg, "mirror_records") else None
        if table_exists(spark, cfg, "mirror_watermarks"):
            mirror_watermarks = small("mirror_watermarks")
    return WindowInputs(ledger, log, consumed, group_offsets, watermarks, sinks, mirror_log, mirror_watermarks)


def check_window_inputs(spark: SparkSession, cfg: Config, tc: TopicConfig) -> None:
    """Check the schema of every input and sink table the topic's windows read, before any window
    runs: a missing column is one InputError naming the table, the column and what writes it."""
    from spark_jobs.io.lake import read_input_table, table_exists
    from spark_jobs.io.sinks_read import read_sink

    names = ["producer_ledger", "log_records", "partition_watermarks"]
    if tc.groups:
        names += ["consumed_records", "group_offsets"]
    elif table_exists(spark, cfg, "group_offsets"):
        names.append("group_offsets")
    for name in names:
        read_input_table(spark, cfg, name)
    for s in tc.sinks:
        read_sink(spark, s, tc.name)
