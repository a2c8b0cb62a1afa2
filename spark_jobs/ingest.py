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

Consumption evidence kept in sink databases: an `exactly_once_sink` consumer writes its
consumption rows into `msgaudit_consumed_records` in the sink's database, in the same
transaction as its sink rows and offsets (docs/design.md §4.2). `ingest_sink_consumption` reads
that table of every configured sql sink's database (JDBC, only rows written since the last run
minus a look-back) and the commits of every configured delta sink newer than the last version it
read (a DeltaSink commit carries its consumption rows in its userMetadata), and MERGEs them into
`consumed_records` on their key (group, consumer, consume_seq), so re-reading a row lands
nothing twice.

This module reads ledger files (and the sinks' evidence tables) and writes the three tables
above; it must not touch any other table, and it must not reorder or deduplicate rows (reconcile
judges duplicates; the MERGE of sink evidence only refuses to land the same row twice).
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
RUN = "run"
MAX_RUN = 65_536  # the longest run one line may stand for
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
    # a line may stand for a run of messages (docs/design.md §4.2): `"run": k` means k rows, seq
    # and offset counting up from the line's; only producer ledger lines carry it
    runs: bool = False

    @property
    def json_schema(self) -> StructType:
        """The schema of a line: timestamps are epoch milliseconds, everything nullable (we
        check required columns ourselves so a missing one gets a reason, not a null)."""
        def on_disk(t: DataType) -> DataType:
            return LongType() if isinstance(t, TimestampType) else t

        fields = [StructField(f.name, on_disk(f.dataType), True) for f in self.schema.fields]
        if self.runs:
            fields.append(StructField(RUN, LongType(), True))
        return StructType([*fields, StructField(_CORRUPT, StringType(), True)])

    def landed_rows(self) -> Column:
        """Aggregate over parsed lines: the table rows their valid lines stand for (a run line k)."""
        per_line = F.coalesce(F.col(f"j.{RUN}"), F.lit(1)) if self.runs else F.lit(1)
        return F.coalesce(F.sum(F.when(F.col("reason").isNull(), per_line)), F.lit(0))

    @property
    def table_schema(self) -> StructType:
        return StructType([*self.schema.fields, StructField(PART_HOUR, StringType(), False)])


SOURCES: tuple[LedgerSource, ...] = (
    LedgerSource("producer_ledger", "producer", PRODUCER_LEDGER, "produce_ts",
                 {"status": LEDGER_STATUSES}, runs=True),
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
            unit = "sinks" if t.table == SINK_EVIDENCE else "segments"
            lines.append(f"ingest {t.table}: {t.landed} rows landed from {t.segments} {unit}{recovered}, "
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
    for a required column; 'bad <column>: <value>' for a value outside its allowed set;
    'bad run: <k>' for a run that is not 1..MAX_RUN (producer ledger lines).
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
        if source.runs:
            run = F.col(f"j.{RUN}")
            checks.append((run.isNotNull() & ((run < 1) | (run > MAX_RUN)),
                           F.concat(F.lit(f"bad {RUN}: "), run.cast(StringType()))))
        reason: Column = F.lit(None).cast(StringType())
        for cond, text in reversed(checks):
            reason = F.when(cond, text).otherwise(reason)
        return parsed.withColumn("reason", reason)

    return transform


def to_table_rows(source: LedgerSource) -> Callable[[DataFrame], DataFrame]:
    """Valid parsed lines -> the table's columns (timestamps from epoch ms) + part_hour; a line
    with `"run": k` becomes its k rows (seq and offset + 0..k-1; a null offset stays null)."""
    def transform(df: DataFrame) -> DataFrame:
        valid = df.filter(F.col("reason").isNull())
        step = None
        if source.runs:
            run = F.col(f"j.{RUN}")
            last = F.coalesce(run, F.lit(1).cast(LongType())) - 1
            valid = valid.withColumn("_step", F.explode(F.sequence(F.lit(0).cast(LongType()), last)))
            step = F.col("_step")
        cols = []
        for f in source.schema.fields:
            c = F.col(f"j.`{f.name}`")
            if step is not None and f.name in ("seq", "offset"):
                c = c + step
            cols.append((F.timestamp_millis(c) if isinstance(f.dataType, TimestampType) else c)
                        .cast(f.dataType).alias(f.name))
        cols.append(part_hour_of_millis(F.col(f"j.`{source.time_column}`")).alias(PART_HOUR))
        return valid.select(*cols)

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


def checkpoint_app_id(spark: SparkSession, checkpoint: str, label: str) -> str:
    """Delta idempotent-write app id, tied to the checkpoint: batch ids restart at 0 with a new
    checkpoint, and under an old app id Delta would skip those batches as already written.
    Kept in the checkpoint folder (through Hadoop's FileSystem: the lake may be s3a://...)."""
    f = f"{checkpoint}/msgaudit_app_id"
    text = lake.read_text(spark, f)
    if text is None:
        lake.write_text(spark, f, f"msgaudit-{label}-{uuid.uuid4().hex}", overwrite=False)
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
    app_id = checkpoint_app_id(spark, checkpoint_dir(cfg, source), f"ingest-{source.table}")
    totals = {"landed": 0, "quarantined": 0, "segments": 0}

    def land(batch: DataFrame, batch_id: int) -> None:
        parsed = batch.transform(parse_lines(source)).persist()
        try:
            counts = parsed.agg(
                source.landed_rows().alias("ok"),
                F.count(F.when(F.col("reason").isNotNull(), 1)).alias("bad"),
                F.countDistinct("source_file").alias("files"),
            ).first()
            assert counts is not None
            # txnAppId/txnVersion: Delta skips a batch id it has already committed for this app.
            (lake.by_seq(parsed.transform(to_table_rows(source)), source.partition_by).write.format("delta").mode("append")
             .option("mergeSchema", "true")  # a table of an older version may lack `error`
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
        tables = {s.table: ingest_source(spark, cfg, s) for s in SOURCES}
        evidence = ingest_sink_consumption(spark, cfg)
        if evidence.segments:
            tables[SINK_EVIDENCE] = evidence
        return IngestResult(tables)


# -- consumption evidence in sink databases (exactly_once_sink) --------------------------------

SINK_EVIDENCE = "consumed_records (sinks)"
# Rows are read from (last run's highest written_ts - look-back): a batch's rows get written_ts
# from the consumer's clock just before its transaction commits, so the look-back covers slow
# commits and consumer clocks up to this far apart.
SINK_EVIDENCE_LOOKBACK_MS = 3_600_000
_AUTOMERGE = "spark.databricks.delta.schema.autoMerge.enabled"


def check_sink_consumption(df: DataFrame, source_file: Column | None = None) -> DataFrame:
    """Evidence rows -> `consumed_records` columns (consume_ts from epoch ms) + part_hour + `line`
    (the row as JSON) + `source_file` (where it came from, given per row) + `reason` (null for a
    valid row; else the first of 'missing <column>', 'bad outcome: <v>')."""
    cols = []
    for f in CONSUMED_RECORDS.fields:
        c = F.col(f"`{f.name}`") if f.name in df.columns else F.lit(None)
        cols.append((F.timestamp_millis(c.cast(LongType())) if isinstance(f.dataType, TimestampType) else c)
                    .cast(f.dataType).alias(f.name))
    ms = F.col("consume_ts").cast(LongType()) if "consume_ts" in df.columns else F.lit(None).cast(LongType())
    out = df.select(*cols, part_hour_of_millis(ms).alias(PART_HOUR),
                    F.to_json(F.struct(*[F.col(f"`{c}`") for c in df.columns])).alias("line"),
                    (source_file if source_file is not None else F.lit(None).cast(StringType())).alias("source_file"))
    reason: Column = F.lit(None).cast(StringType())
    checks = [(F.col(f"`{f.name}`").isNull(), F.lit(f"missing {f.name}"))
              for f in CONSUMED_RECORDS.fields if not f.nullable]
    checks.append((~F.col("outcome").isin(*CONSUME_OUTCOMES), F.concat(F.lit("bad outcome: "), F.col("outcome"))))
    for cond, text in reversed(checks):
        reason = F.when(cond, text).otherwise(reason)
    return out.withColumn("reason", reason)


def land_evidence(spark: SparkSession, cfg: Config, raw: DataFrame, source_file: Column) -> tuple[int, int]:
    """MERGE valid evidence rows into `consumed_records` on (group, consumer, consume_seq), so a row
    read twice lands once; quarantine the others (once each) under `source_file`. Returns
    (rows inserted, rows quarantined)."""
    from delta.tables import DeltaTable

    table_path = lake.table_path(cfg, "consumed_records")
    quarantine_path = lake.table_path(cfg, QUARANTINE_TABLE)
    checked = check_sink_consumption(raw, source_file).persist()
    try:
        rows = checked.filter(F.col("reason").isNull()).drop("line", "reason", "source_file")
        keys = rows.select("topic", PART_HOUR).distinct().collect()
        inserted = 0
        if keys:
            prune = " OR ".join(
                f"(t.topic = '{k['topic'].replace(chr(39), chr(39) * 2)}' AND t.{PART_HOUR} = '{k[PART_HOUR]}')"
                for k in keys)
            _ensure_table(spark, table_path, SOURCES[1].table_schema, ("topic", PART_HOUR))
            target = DeltaTable.forPath(spark, table_path)
            before = target.history(1).select("version").first()
            old = spark.conf.get(_AUTOMERGE, None)
            spark.conf.set(_AUTOMERGE, "true")  # a table of an older version may lack `error`
            try:
                (target.alias("t")
                 .merge(rows.alias("s"), f"({prune}) AND t.`group` = s.`group` AND t.consumer = s.consumer "
                                         "AND t.consume_seq = s.consume_seq")
                 .whenNotMatchedInsertAll().execute())
            finally:
                if old is None:
                    spark.conf.unset(_AUTOMERGE)
                else:
                    spark.conf.set(_AUTOMERGE, old)
            # A MERGE that inserts nothing may not commit at all: count only a new version's rows.
            last = target.history(1).select("version", "operationMetrics").first()
            new_version = last is not None and (before is None or last[0] != before[0])
            inserted = int((last[1] or {}).get("numTargetRowsInserted", 0)) if last and new_version else 0
        bad = checked.filter(F.col("reason").isNotNull()).select(
            F.lit("consumed_records").alias("table"), F.col("source_file"),
            F.col("line"), F.col("reason"), F.current_timestamp().alias("ingested_at"))
        n_bad = bad.count()
        if n_bad:
            _ensure_table(spark, quarantine_path, QUARANTINE_SCHEMA, ())
            (DeltaTable.forPath(spark, quarantine_path).alias("t")
             .merge(bad.alias("s"), "t.source_file = s.source_file AND t.line = s.line")
             .whenNotMatchedInsertAll().execute())
        return inserted, n_bad
    finally:
        checked.unpersist()


def ingest_sink_consumption(spark: SparkSession, cfg: Config) -> TableIngest:
    """Land the evidence of every configured sink into `consumed_records`: the evidence table of
    each sql sink's database, and the commits of each delta sink (their userMetadata)."""
    import hashlib

    from spark_jobs.io import sinks_read

    sinks = [s for t in cfg.topics.values() for s in t.sinks]
    totals = {"landed": 0, "quarantined": 0, "databases": 0}
    for url in sinks_read.sql_sink_urls(sinks):
        if not sinks_read.has_consumption_table(url):
            continue
        totals["databases"] += 1
        cursor = lake.lake_location(cfg, "_checkpoints", "ingest_sink_consumption",
                                    hashlib.sha1(url.encode()).hexdigest()[:16])
        text = lake.read_text(spark, cursor)
        since = int(text) - SINK_EVIDENCE_LOOKBACK_MS if text else 0
        raw = sinks_read.read_consumption(spark, url, since).persist()
        try:
            top = raw.agg(F.max("written_ts")).first()
            if top is None or top[0] is None:
                continue
            landed, bad = land_evidence(spark, cfg, raw,
                                        F.lit(f"{sinks_read.redact(url)}#{sinks_read.CONSUMPTION_TABLE}"))
            totals["landed"] += landed
            totals["quarantined"] += bad
            lake.write_text(spark, cursor, str(int(top[0])))
        finally:
            raw.unpersist()
    for location in sinks_read.delta_sink_locations(sinks):
        # A version is read once: the cursor is the newest version landed (commits are immutable).
        cursor = lake.lake_location(cfg, "_checkpoints", "ingest_delta_sink_consumption",
                                    hashlib.sha1(location.encode()).hexdigest()[:16])
        text = lake.read_text(spark, cursor)
        raw, newest = sinks_read.read_delta_consumption(spark, location, int(text) if text else -1)
        if newest < 0 or (text and newest <= int(text)):
            continue
        raw = raw.persist()
        try:
            if raw.limit(1).count():
                totals["databases"] += 1
                landed, bad = land_evidence(spark, cfg, raw,
                                            F.concat(F.lit(f"{location}@v"), F.col("version").cast(StringType())))
                totals["landed"] += landed
                totals["quarantined"] += bad
            lake.write_text(spark, cursor, str(newest))
        finally:
            raw.unpersist()
    return TableIngest(SINK_EVIDENCE, totals["landed"], totals["quarantined"], totals["databases"], 0)
