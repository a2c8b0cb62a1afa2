"""`msgaudit trace`: one message's journey through the lake (docs/design.md §9).

A message is named by its identity (`--pid P --seq N`) or by a position in the log
(`--partition P --offset O`). `resolve` turns either into the identities and log positions that
belong to it (a position's record gives its pid:seq; an identity's copies give its positions), and
`select` keeps, in each table, the rows matching one of them: ledger rows, every copy in the log,
every processing by every group, every sink row and the anomaly rows naming it. Both are pure
transforms of DataFrames; `trace_message` does the reads (lake tables through `spark_jobs.io.lake`,
sinks through `spark_jobs.io.sinks_read`). The terminal and JSON forms are in
`audit/serving/trace_view.py`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import reduce
from typing import Any

from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F

from audit.core.config import Config
from audit.core.errors import InputError

# lake table -> the key of the traced rows it contributes, in timeline order
TRACE_TABLES: tuple[tuple[str, str], ...] = (
    ("producer_ledger", "ledger"), ("log_records", "log"), ("consumed_records", "consumed"),
    ("audit_anomalies", "anomalies"),
)


@dataclass(frozen=True)
class TraceQuery:
    """Which message: `pid` and `seq`, or `partition` and `offset`, of `topic`."""

    topic: str
    pid: str | None = None
    seq: int | None = None
    partition: int | None = None
    offset: int | None = None

    def __post_init__(self) -> None:
        by_id = self.pid is not None and self.seq is not None
        by_pos = self.partition is not None and self.offset is not None
        if by_id == by_pos or (not by_id and (self.pid is not None or self.seq is not None)) \
                or (not by_pos and (self.partition is not None or self.offset is not None)):
            raise InputError("name one message: --pid P --seq N, or --partition P --offset O")


@dataclass(frozen=True)
class Resolved:
    """The identities (pid, seq) and log positions (partition, offset) of the traced message."""

    ids: frozenset[tuple[str, int]]
    positions: frozenset[tuple[int, int]]


def _matches(df: DataFrame, r: Resolved) -> Column:
    conds = [(F.col("pid") == p) & (F.col("seq") == s) for p, s in sorted(r.ids)]
    conds += [(F.col("partition") == p) & (F.col("offset") == o) for p, o in sorted(r.positions)]
    return reduce(lambda a, b: a | b, conds) if conds else F.lit(False)


def resolve(q: TraceQuery, ledger: DataFrame | None, log: DataFrame | None) -> Resolved:
    """The identities and positions of the message `q` names (one small collect of each table)."""
    ids: set[tuple[str, int]] = set()
    positions: set[tuple[int, int]] = set()
    if q.pid is not None and q.seq is not None:
        ids.add((q.pid, q.seq))
    else:
        assert q.partition is not None and q.offset is not None
        positions.add((q.partition, q.offset))
    tables = [t.where(F.col("topic") == q.topic) for t in (ledger, log) if t is not None]
    for _ in range(2):  # identity -> positions -> identities of those positions
        found = Resolved(frozenset(ids), frozenset(positions))
        for t in tables:
            for row in t.where(_matches(t, found)).select("pid", "seq", "partition", "offset").collect():
                if row["pid"] is not None and row["seq"] is not None:
                    ids.add((row["pid"], int(row["seq"])))
                if row["offset"] is not None:
                    positions.add((int(row["partition"]), int(row["offset"])))
    return Resolved(frozenset(ids), frozenset(positions))


def select(df: DataFrame, topic: str, r: Resolved) -> list[dict[str, Any]]:
    """The rows of `df` (of `topic`) that belong to the resolved message, without `part_hour`."""
    cols = [c for c in df.columns if c != "part_hour"]
    return [row.asDict() for row in df.where((F.col("topic") == topic) & _matches(df, r)).select(*cols).collect()]


def trace_message(spark: SparkSession, cfg: Config, q: TraceQuery) -> dict[str, Any]:
    """Read the lake and the topic's sinks; the traced rows by kind (ledger, log, consumed,
    sinks {name: rows}, anomalies) plus `missing` (lake tables not written yet)."""
    from spark_jobs.io.lake import read_table, table_exists
    from spark_jobs.io.sinks_read import read_sink

    tc = cfg.topic(q.topic)
    frames = {name: read_table(spark, cfg, name) if table_exists(spark, cfg, name) else None
              for name, _ in TRACE_TABLES}
    r = resolve(q, frames["producer_ledger"], frames["log_records"])
    out: dict[str, Any] = {"topic": q.topic, "ids": sorted(r.ids), "positions": sorted(r.positions),
                           "missing": [n for n, df in frames.items() if df is None]}
    for name, key in TRACE_TABLES:
        df = frames[name]
        out[key] = [] if df is None else select(df, q.topic, r)
    out["sinks"] = {s.name: select(read_sink(spark, s, q.topic), q.topic, r) for s in tc.sinks}
    return out
