"""`msgaudit ingest`: land sealed ledger segments into the Delta ledger tables, exactly once.

    <ledger_dir>/producer/*.jsonl  ->  producer_ledger   (partitioned by topic, part_hour of produce_ts)
    <ledger_dir>/consumer/*.jsonl  ->  consumed_records  (partitioned by topic, part_hour of consume_ts)
    <ledger_dir>/producer_settings/*.jsonl  ->  producer_settings  (partitioned by part_hour of start_ts)
    lines that are not valid rows  ->  ledger_quarantine (table, source_file, line, reason, ingested_at)

Exactly once comes from Spark's file source: a streaming read of each ledger folder with a
checkpoint under `<lake>/_checkpoints/`, run with `availableNow` (everything new, then stop),
so a segment already landed is never read again. Each micro-batch is written with Delta's
idempotent-write options (txnAppId + txnVersion = batch id), so a batch replayed after a crash
between the Delta commit and the checkpoint commit is skipped by Delta rather than landed twice.

Before reading, `recover_orphans` seals the `.open` segments of dead writers (SIGKILLed
producers or consumers); only sealed `*.jsonl` files are ever read, so a segment still being
written is picked up by a later run. A line that is not a JSON object of the table's schema
(malformed, truncated, wrong type, missing a required column, bad status) is quarantined with
its reason and counted; the rest of its segment lands.

This module reads ledger files and writes the three tables above; it must not touch any other
table, and it must not reorder or deduplicate rows (reconcile judges duplicates).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.types import (
    DataType,
    IntegerType,
    LongType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)

from audit.clients.ledger import recover_orphans
from audit.core.config import Config
from audit.core.errors import InputError
from audit.core.vocabulary import CONSUME_OUTCOMES, LEDGER_STATUSES
from spark_jobs.io import lake
from spark_jobs.io.schemas import (
    CONSUMED_RECORDS,
    LEDGER_QUARANTINE,
    PART_HOUR,
    PRODUCER_LEDGER,
    PRODUCER_SETTINGS,
)

QUARANTINE_TABLE = "ledger_quarantine"
QUARANTINE_SCHEMA = LEDGER_QUARANTINE
_CORRUPT = "_corrupt_line"
_MS_PER_HOUR = 3_600_000
_MS_PER_DAY = 86_400_000


@dataclass(frozen=True)
class LedgerSource:
    """One ledger folder and the table it lands in."""

    table: str
    subdir: str
    schema: StructType
    time_column: str  # its UTC hour is part_hour
    allowed: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    partition_by: tuple[str, ...] = ("topic", PART_HOUR)

    @property
    def json_schema(self) -> StructType:
        """The schema of a line: timestamps are epoch milliseconds, everything nullable (we
        check required columns ourselves so a missing one gets a reason, not a null)."""
        def on_disk(t: DataType) -> DataType:
            return LongType() if isinstance(t, TimestampType) else t

        fields = [StructField(f.name, on_disk(f.dataType), True) for f in self.schema.fields]
        return StructType([*fields, StructField(_CORRUPT, StringType(), True)])

    @property
    def table_schema(self) -> StructType:
        return StructType([*self.schema.fields, StructField(PART_HOUR, StringType(), False)])


SOURCES: tuple[LedgerSource, ...] = (
    LedgerSource("producer_ledger", "producer", PRODUCER_LEDGER, "produce_ts",
                 {"status": LEDGER_STATUSES}),
    LedgerSource("consumed_records", "consumer", CONSUMED_RECORDS, "consume_ts",
                 {"outcome": CONSUME_OUTCOMES}),
    # one row per AuditedProducer start (audit/clients/producer.py `write_settings`); no topic
    LedgerSource("producer_settings", "producer_settings", PRODUCER_SETTINGS, "start_ts",
                 partition_by=(PART_HOUR,)),
)


@dataclass(frozen=True)
class TableIngest:
    table: str
    landed: int
    quarantined: int
    segments: int
    recovered: int  # .open segments of dead writers sealed before reading


@dataclass(frozen=True)
class IngestResult:
    tables: dict[str, TableIngest]

    @property
    def quarantined(self) -> int:
        return sum(t.quarantined for t in self.tables.values())

    @property
    def landed(self) -> int:
        return sum(t.landed for t in self.tables.values())

    def summary_lines(self, cfg: Config) -> list[str]:
        """One line per ledger table, then the totals (what `msgaudit ingest` prints)."""
        lines = []
        for t in self.tables.values():
            recovered = f" ({t.recovered} recovered from dead writers)" if t.recovered else ""
            lines.append(f"ingest {t.table}: {t.landed} rows landed from {t.segments} segments{recovered}, "
                         f"{t.quarantined} lines quarantined")
        where = lake.table_path(cfg, QUARANTINE_TABLE)
        lines.append(f"ingest: {self.landed} rows landed, {self.quarantined} lines quarantined"
                     f"{f' (see {where})' if self.quarantined else ''}")
        return lines


# -- pure transforms ------------------------------------------------------------------------

def part_hour_of_millis(ms: Column) -> Column:
    """UTC hour 'YYYY-MM-DDTHH' of epoch milliseconds, independent of the session time zone."""
    day = F.date_from_unix_date(F.floor(ms / _MS_PER_DAY).cast(IntegerType()))
    hour = F.floor(F.pmod(ms, F.lit(_MS_PER_DAY)) / _MS_PER_HOUR).cast(IntegerType())
    return F.concat(F.date_format(day, "yyyy-MM-dd"), F.lit("T"), F.lpad(hour.cast(StringType()), 2, "0"))


def parse_lines(source: LedgerSource) -> Callable[[DataFrame], DataFrame]:
    """(line, source_file) -> parsed columns + `reason` (null when the line is a valid row).

    Reasons, first that applies: 'empty line'; 'not a JSON object of the <table> schema'
    (malformed or truncated JSON, a wrong type, a number out of range); 'missing <column>'
    for a required column; 'bad <column>: <value>' for a value outside its allowed set.
    """
    def transform(df: DataFrame) -> DataFrame:
        parsed = df.withColumn("j", F.from_json(
            "line", source.json_schema, {"mode": "PERMISSIVE", "columnNameOfCorruptRecord": _CORRUPT}))
        checks: list[tuple[Column, Column]] = [
            (F.trim(F.col("line")) == "", F.lit("empty line")),
            (F.col("j").isNull() | F.col(f"j.{_CORRUPT}").isNotNull(),
             F.lit(f"not a JSON object of the {source.table} schema")),
        ]
        for f in source.schema.fields:
            if not f.nullable:
                checks.append((F.col(f"j.`{f.name}`").isNull(), F.lit(f"missing {f.name}")))
        for column, allowed in source.allowed.items():
            checks.append((~F.col(f"j.`{column}`").isin(*allowed),
                           F.concat(F.lit(f"bad {column}: "), F.col(f"j.`{column}`"))))
        reason: Column = F.lit(None).cast(StringType())
        for cond, text in reversed(checks):
            reason = F.when(cond, text).otherwise(reason)
        return parsed.withColumn("reason", reason)

    return transform


def to_table_rows(source: LedgerSource) -> Callable[[DataFrame], DataFrame]:
    """Valid parsed lines -> the table's columns (timestamps from epoch ms) + part_hour."""
    def transform(df: DataFrame) -> DataFrame:
        cols = []
        for f in source.schema.fields:
            c = F.col(f"j.`{f.name}`")
            cols.append((F.timestamp_millis(c) if isinstance(f.dataType, TimestampType) else c)
                        .cast(f.dataType).alias(f.name))
        cols.append(part_hour_of_millis(F.col(f"j.`{source.time_column}`")).alias(PART_HOUR))
        return df.filter(F.col("reason").isNull()).select(*cols)

    return transform


def to_quarantine_rows(source: LedgerSource) -> Callable[[DataFrame], DataFrame]:
    def transform(df: DataFrame) -> DataFrame:
        return df.filter(F.col("reason").isNotNull()).select(
            F.lit(source.table).alias("table"),
            F.col("source_file"),
            F.col("line"),
            F.col("reason"),
            F.current_timestamp().alias("ingested_at"),
        )

    return transform


# -- I/O edges ------------------------------------------------------------------------------

def _ensure_table(spark: SparkSession, path: str, schema: StructType, partition_by: tuple[str, ...]) -> None:
    """Create the Delta table with its declared schema (nullability included) if missing."""
    from delta.tables import DeltaTable

    builder = DeltaTable.createIfNotExists(spark).location(path).addColumns(schema)
    if partition_by:
        builder = builder.partitionedBy(*partition_by)
    builder.execute()


def checkpoint_dir(cfg: Config, source: LedgerSource) -> str:
    return lake.lake_location(cfg, "_checkpoints", f"ingest_{source.table}")


def _app_id(spark: SparkSession, checkpoint: str, source: LedgerSource) -> str:
    """Delta idempotent-write app id, tied to the checkpoint: batch ids restart at 0 with a new
    checkpoint, and under an old app id Delta would skip those batches as already written.
    Kept in the checkpoint folder (through Hadoop's FileSystem: the lake may be s3a://...)."""
    f = f"{checkpoint}/msgaudit_app_id"
    text = lake.read_text(spark, f)
    if text is None:
        lake.write_text(spark, f, f"msgaudit-ingest-{source.table}-{uuid.uuid4().hex}", overwrite=False)
        text = lake.read_text(spark, f)
    assert text is not None
    return text.strip()


def ingest_source(spark: SparkSession, cfg: Config, source: LedgerSource) -> TableIngest:
    folder = Path(cfg.ledger_dir) / source.subdir
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise InputError(f"ledger folder {folder} cannot be created: {e}") from e
    recovered = recover_orphans(folder)
    table_path = lake.table_path(cfg, source.table)
    quarantine_path = lake.table_path(cfg, QUARANTINE_TABLE)
    _ensure_table(spark, table_path, source.table_schema, source.partition_by)
    _ensure_table(spark, quarantine_path, QUARANTINE_SCHEMA, ())
    if not any(p.name.endswith(".jsonl") for p in folder.iterdir()):
        # Nothing sealed at all: skip starting a stream (the tables exist for readers anyway).
        return TableIngest(source.table, 0, 0, 0, recovered)
    app_id = _app_id(spark, checkpoint_dir(cfg, source), source)
    totals = {"landed": 0, "quarantined": 0, "segments": 0}

    def land(batch: DataFrame, batch_id: int) -> None:
        parsed = batch.transform(parse_lines(source)).persist()
        try:
            counts = parsed.agg(
                F.count(F.when(F.col("reason").isNull(), 1)).alias("ok"),
                F.count(F.when(F.col("reason").isNotNull(), 1)).alias("bad"),
                F.countDistinct("source_file").alias("files"),
            ).first()
            assert counts is not None
            # txnAppId/txnVersion: Delta skips a batch id it has already committed for this app.
            (parsed.transform(to_table_rows(source)).write.format("delta").mode("append")
             .option("txnAppId", app_id).option("txnVersion", batch_id).save(table_path))
            if counts["bad"]:
                (parsed.transform(to_quarantine_rows(source)).write.format("delta").mode("append")
                 .option("txnAppId", app_id).option("txnVersion", batch_id).save(quarantine_path))
            totals["landed"] += counts["ok"]
            totals["quarantined"] += counts["bad"]
            totals["segments"] += counts["files"]
        finally:
            parsed.unpersist()

    lines = (
        spark.readStream.format("text")
        .option("pathGlobFilter", "*.jsonl")  # sealed segments only, never *.jsonl.open
        # A segment copied in late with an old mtime must not be skipped as "too old".
        .option("maxFileAge", "3650d")
        .load(str(folder))
        .select(F.col("value").alias("line"), F.col("_metadata.file_path").alias("source_file"))
    )
    query = (
        lines.writeStream.foreachBatch(land)
        .option("checkpointLocation", checkpoint_dir(cfg, source))
        .trigger(availableNow=True)
        .queryName(f"msgaudit_ingest_{source.table}")
        .start()
    )
    query.awaitTermination()
    return TableIngest(source.table, totals["landed"], totals["quarantined"], totals["segments"], recovered)


def ingest(spark: SparkSession, cfg: Config, *, wait_s: float = 0.0) -> IngestResult:
    """Land every new sealed segment of both ledgers; running it again lands nothing new.

    One ingest per lake at a time: it holds the lake's writer lease (`lake.writer_lease`), and a
    second one waits up to `wait_s`, then fails with LakeBusy naming the first."""
    with lake.writer_lease(spark, cfg, "msgaudit ingest", wait_s=wait_s):
        return IngestResult({s.table: ingest_source(spark, cfg, s) for s in SOURCES})
