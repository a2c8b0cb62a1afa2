"""`DeltaSink`: the Delta implementation of `audit.clients.sinks.Sink`, for consumers that land rows in a
Delta table (a user's "sink table" the audit reads in place).

Each batch is ONE Delta commit: the payload rows stamped with the audit columns (default
`audit_topic, audit_partition, audit_offset, audit_pid, audit_seq, audit_sink_ts`, plus the
message's produce time `audit_produce_ts` in a table created with it; renamed via
`SinkConfig.column`) and, for `exactly_once_sink`, the consumer's next offsets and the batch's
consumption-ledger rows, carried in that same commit's `userMetadata` as JSON `{"msgaudit": 1,
"group": ..., "positions": [[topic, partition, next_offset], ...], "consumed": [{<consumption row>},
...]}`. `read_positions` folds the table history (newest commit first) back into positions, so the
rows and the offsets can never disagree: a commit has both or neither. `msgaudit ingest` lands the
`consumed` rows of new commits into `consumed_records` (spark_jobs/ingest.py), so a crash right
after the commit loses no evidence. (Positions live as long as the table's log retention, 30 days
by default; a group idle longer than that falls back to its Kafka offsets, and ingest must run
within that time to land the evidence.)

Modes: `append` (a redelivered message becomes a second row) or `merge` (MERGE on (topic, pid,
seq): a redelivered message replaces its row; rows without audit identity are inserted).
The table is created by the first write; later writes may add payload columns (schema merge).

Keep this light: it builds one small DataFrame per batch on the driver. It must not read or
write any other table, and it never drops a row silently (a payload that clashes with an audit
column name is an InputError).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.types import (
    BinaryType,
    BooleanType,
    DataType,
    DoubleType,
    IntegerType,
    LongType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)

from audit.clients.sinks import (
    AuditColumns,
    Position,
    SinkRecord,
    TopicPartitionKey,
    consumption_rows,
    dedupe_last,
    stamp_row,
)
from audit.core.config import SinkConfig
from audit.core.errors import ConfigError, InputError
from spark_jobs.io.session import local_frame

DELTA_MODES = ("append", "merge")
_META_CONF = "spark.databricks.delta.commitInfo.userMetadata"
_AUTOMERGE_CONF = "spark.databricks.delta.schema.autoMerge.enabled"
# Delta skips commits that add no files; a batch whose handler returned no rows must still
# commit its positions.
_EMPTY_COMMITS_CONF = "spark.databricks.delta.skipRecordingEmptyCommits"
_META_TAG = '{"msgaudit":1'


def _spark_type(value: Any) -> DataType:
    if isinstance(value, bool):
        return BooleanType()
    if isinstance(value, int):
        return LongType()
    if isinstance(value, float):
        return DoubleType()
    if isinstance(value, datetime):
        return TimestampType()
    if isinstance(value, bytes | bytearray):
        return BinaryType()
    return StringType()


def payload_schema(rows: Sequence[Mapping[str, Any]]) -> StructType:
    """Spark types from the first non-null value of each payload field, in first-seen order."""
    types: dict[str, DataType | None] = {}
    for row in rows:
        for name, value in row.items():
            if types.get(name) is None:
                types[name] = None if value is None else _spark_type(value)
    return StructType([StructField(n, t or StringType(), True) for n, t in types.items()])


def audit_fields(cols: AuditColumns) -> list[StructField]:
    return [
        StructField(cols.topic, StringType(), False),
        StructField(cols.partition, IntegerType(), False),
        StructField(cols.offset, LongType(), False),
        StructField(cols.pid, StringType(), True),
        StructField(cols.seq, LongType(), True),
        StructField(cols.sink_ts, TimestampType(), False),
        StructField(cols.produce_ts, TimestampType(), True),
    ]


class DeltaSink:
    """A Delta sink table at `location` (see the module docstring)."""

    # Consumption rows travel in the commit's userMetadata with the positions (docs/design.md §11).
    stores_consumption = True

    def __init__(self, spark: SparkSession, location: str, mode: str = "append",
                 columns: Mapping[str, str] | SinkConfig | AuditColumns | None = None, *,
                 schema: StructType | None = None, now: Callable[[], datetime] | None = None) -> None:
        if mode not in DELTA_MODES:
            raise ConfigError(f"DeltaSink mode: expected one of {DELTA_MODES}, got {mode!r}")
        if not isinstance(location, str) or not location:
            raise ConfigError(f"DeltaSink location: expected a path, got {location!r}")
        self.spark = spark
        self.location = location
        self.mode = mode
        self.cols = AuditColumns.of(columns)
        self._schema = schema
        self._payload: StructType | None = None  # payload columns of the table, once known
        self._produce_ts = True  # whether the table has the optional audit_produce_ts column
        self._now = now or (lambda: datetime.now(UTC))

    @classmethod
    def from_config(cls, spark: SparkSession, sink: SinkConfig, mode: str = "append", **kwargs: Any) -> DeltaSink:
        if sink.format != "delta" or not sink.location:
            raise ConfigError(f"sink {sink.name!r}: DeltaSink needs a format: delta sink with a location")
        return cls(spark, sink.location, mode, sink, **kwargs)

    def exists(self) -> bool:
        from delta.tables import DeltaTable

        return bool(DeltaTable.isDeltaTable(self.spark, self.location))

    def read(self) -> DataFrame:
        if not self.exists():
            raise InputError(f"Delta sink table not found at {self.location} (nothing written yet)")
        return self.spark.read.format("delta").load(self.location)

    # -- writing ----------------------------------------------------------------------------

    def _frame(self, records: Sequence[SinkRecord]) -> DataFrame:
        sink_ts = self._now()
        rows = [stamp_row(r, self.cols, sink_ts) for r in records]
        if self.mode == "merge":
            rows = dedupe_last(rows, self.cols.key())
        audit = audit_fields(self.cols)
        audit_names = {f.name for f in audit}
        if self._payload is None:
            if self.exists():
                existing = self.read().schema
                self._payload = StructType([f for f in existing.fields if f.name not in audit_names])
                # a table made without the optional produce time keeps its schema
                self._produce_ts = self.cols.produce_ts in existing.fieldNames()
            else:
                self._payload = self._schema or StructType([])
        if not self._produce_ts:
            audit = [f for f in audit if f.name != self.cols.produce_ts]
        known = self._payload
        new = payload_schema([r.payload for r in records])
        fields = list(known.fields) + [f for f in new.fields if f.name not in known.fieldNames()]
        schema = StructType(fields + audit)
        self._payload = StructType(fields)
        names = schema.fieldNames()
        return local_frame(self.spark, [tuple(row.get(n) for n in names) for row in rows], schema)

    def write(self, records: Sequence[SinkRecord], *, group: str | None = None,
              positions: Sequence[Position] = (),
              before_commit: Callable[[], None] | None = None,
              consumption: Sequence[Mapping[str, Any]] = ()) -> None:
        """One Delta commit with the rows and (if given) the positions and consumption rows.
        `before_commit` runs just before that commit: Delta has no open transaction to hook into,
        and nothing is visible until the commit lands."""
        evidence = consumption_rows(consumption)
        if (positions or evidence) and not group:
            raise InputError("DeltaSink.write: positions and consumption rows need the consumer group they belong to")
        if not records and not positions and not evidence:
            return
        meta = None
        if positions or evidence:
            doc: dict[str, Any] = {"msgaudit": 1, "group": group,
                                   "positions": [[p.topic, p.partition, p.next_offset] for p in positions]}
            if evidence:
                doc["consumed"] = evidence
            meta = json.dumps(doc, separators=(",", ":"))
        df = self._frame(records)
        if before_commit is not None:
            before_commit()
        if self.mode == "merge" and records and self.exists():
            self._merge(df, meta)
            return
        writer = df.write.format("delta").mode("append").option("mergeSchema", "true")
        if meta is not None:
            writer = writer.option("userMetadata", meta)
        with self._conf({_EMPTY_COMMITS_CONF: "false"} if not records else {}):
            writer.save(self.location)

    def _merge(self, df: DataFrame, meta: str | None) -> None:
        from delta.tables import DeltaTable

        t, p, s = self.cols.key()
        cond = f"t.`{t}` = s.`{t}` AND t.`{p}` = s.`{p}` AND t.`{s}` = s.`{s}`"
        target = DeltaTable.forPath(self.spark, self.location)
        with self._conf({_META_CONF: meta, _AUTOMERGE_CONF: "true"}):
            (target.alias("t").merge(df.alias("s"), cond)
             .whenMatchedUpdateAll().whenNotMatchedInsertAll().execute())

    @contextmanager
    def _conf(self, settings: Mapping[str, str | None]) -> Iterator[None]:
        # MERGE takes no writer options, so its commit metadata comes from the session conf.
        old = {k: self.spark.conf.get(k, None) for k in settings}
        try:
            for k, v in settings.items():
                if v is None:
                    self.spark.conf.unset(k)
                else:
                    self.spark.conf.set(k, v)
            yield
        finally:
            for k, v in old.items():
                if v is None:
                    self.spark.conf.unset(k)
                else:
                    self.spark.conf.set(k, v)

    # -- positions ----------------------------------------------------------------------------

    def read_positions(self, group: str,
                       partitions: Iterable[TopicPartitionKey]) -> dict[TopicPartitionKey, int]:
        from delta.tables import DeltaTable

        wanted = set(partitions)
        if not wanted or not self.exists():
            return {}
        history = (DeltaTable.forPath(self.spark, self.location).history()
                   .where(f"userMetadata LIKE '{_META_TAG}%'")
                   .select("version", "userMetadata").orderBy("version", ascending=False).collect())
        found: dict[TopicPartitionKey, int] = {}
        for row in history:
            meta = json.loads(row["userMetadata"])
            if meta.get("group") != group:
                continue
            for topic, partition, next_offset in meta.get("positions", ()):
                k = (str(topic), int(partition))
                if k in wanted and k not in found:  # newest commit wins
                    found[k] = int(next_offset)
            if len(found) == len(wanted):
                break
        return found

    def close(self) -> None:
        """Nothing to release: the SparkSession belongs to the caller."""
