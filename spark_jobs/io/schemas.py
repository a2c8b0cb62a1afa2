"""Spark schemas of every msgaudit table (docs/design.md §4), in one place.

Input tables carry two partition columns besides their contract columns: `topic` (already a
column) and `part_hour`, the UTC hour ('YYYY-MM-DDTHH') of the row's natural time (produce
time for ledger and log rows, consume time for consumption rows), so that a window and its
lookback read only their own files.
"""

from __future__ import annotations

from pyspark.sql.pandas.types import to_arrow_schema
from pyspark.sql.types import (
    BooleanType,
    DoubleType,
    IntegerType,
    LongType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)

from audit.core.vocabulary import REPORT_CODE_COLUMNS

PART_HOUR = "part_hour"
PART_HOUR_FORMAT = "yyyy-MM-dd'T'HH"  # Spark date_format pattern; Python: "%Y-%m-%dT%H"


def _s(*fields: tuple[str, object, bool]) -> StructType:
    return StructType([StructField(n, t, nullable) for n, t, nullable in fields])  # type: ignore[arg-type]


PRODUCER_LEDGER = _s(
    ("producer", StringType(), True),
    ("pid", StringType(), False),
    ("seq", LongType(), False),
    ("topic", StringType(), False),
    ("partition", IntegerType(), False),
    ("offset", LongType(), True),
    ("status", StringType(), False),
    ("error", StringType(), True),
    ("txn_id", StringType(), True),
    ("produce_ts", TimestampType(), False),
    ("ack_ts", TimestampType(), True),
    ("fingerprint", StringType(), True),  # a failed send's content fingerprint, where the client records it
)

# One row per producer start (AuditedProducer, both paths): its delivery settings (docs/design.md §4.2).
PRODUCER_SETTINGS = _s(
    ("producer", StringType(), True),
    ("pid", StringType(), False),
    ("start_ts", TimestampType(), False),
    ("acks", StringType(), False),
    ("enable_idempotence", BooleanType(), False),
    ("retries", LongType(), True),
    ("max_in_flight", LongType(), True),
    ("transactional_id", StringType(), True),
    ("mode", StringType(), True),
)

LOG_RECORDS = _s(
    ("topic", StringType(), False),
    ("partition", IntegerType(), False),
    ("offset", LongType(), False),
    ("kafka_ts", TimestampType(), True),
    ("pid", StringType(), True),
    ("seq", LongType(), True),
    ("produce_ts", TimestampType(), True),
    ("fingerprint", StringType(), True),
    ("committed", BooleanType(), False),
    ("header_error", StringType(), True),
    ("captured_at", TimestampType(), False),
    # The record's Kafka key as text (UTF-8), null when it has none: what `msgaudit trace --key`
    # finds messages by. Null in rows captured before this column existed.
    ("key", StringType(), True),
)

CONSUMED_RECORDS = _s(
    ("group", StringType(), False),
    ("consumer", StringType(), False),
    ("consume_seq", LongType(), False),
    ("topic", StringType(), False),
    ("partition", IntegerType(), False),
    ("offset", LongType(), False),
    ("pid", StringType(), True),
    ("seq", LongType(), True),
    ("outcome", StringType(), False),
    ("attempt", IntegerType(), False),
    ("consume_ts", TimestampType(), False),
    ("error", StringType(), True),
    # the mirror (docs/design.md §5.5) whose target copy the row was consumed from; null: the audited cluster
    ("cluster", StringType(), True),
    # the message's produce time as its audit headers carry it (audit.ts); null for an unaudited
    # record and in rows of clients that do not write it (docs/design.md §4.2)
    ("produce_ts", TimestampType(), True),
)

GROUP_OFFSETS = _s(
    ("group", StringType(), False),
    ("topic", StringType(), False),
    ("partition", IntegerType(), False),
    ("committed_offset", LongType(), True),
    ("captured_at", TimestampType(), False),
)

# A share group's (KIP-932) share-partition start offset (SPSO): the broker never hands out a record
# below it again (docs/design.md §5.9, `missed`). Null: the group holds no start offset for the partition.
SHARE_OFFSETS = _s(
    ("group", StringType(), False),
    ("topic", StringType(), False),
    ("partition", IntegerType(), False),
    ("start_offset", LongType(), True),
    ("captured_at", TimestampType(), False),
)

PARTITION_WATERMARKS = _s(
    ("topic", StringType(), False),
    ("partition", IntegerType(), False),
    ("log_start_offset", LongType(), False),
    ("high_watermark", LongType(), False),
    ("captured_at", TimestampType(), False),
    # The offsets this capture actually read, [captured_from, captured_to): what "the capture
    # covered" means in docs/design.md §5. Null in rows written before these columns existed.
    ("captured_from", LongType(), True),
    ("captured_to", LongType(), True),
)

# The topic's copy on a mirror's target cluster (stage mirror:<m>, docs/design.md §4.2): the columns
# of log_records plus the mirror's name; `topic` is the audited (source) topic, partition and
# offset are the target's.
MIRROR_RECORDS = StructType([StructField("mirror", StringType(), False), *LOG_RECORDS.fields])
MIRROR_WATERMARKS = StructType([StructField("mirror", StringType(), False), *PARTITION_WATERMARKS.fields])
# the failover groups' committed offsets on a mirror's target cluster (§5.5): topic = the source topic
MIRROR_GROUP_OFFSETS = StructType([StructField("mirror", StringType(), False), *GROUP_OFFSETS.fields])

# A dead-letter topic (a sink connector's, sinks[].dead_letter_topic, or a share group's,
# share_groups[].dead_letter_topic; docs/design.md §4.2): per DLQ record, the source record its
# headers name (__connect.errors.* or __dlq.errors.* topic / partition / offset; null without them)
# and its error (Connect: exception class: message; a share group: the broker's reason); a share
# group's also its group and delivery count (null for Connect's, and in rows captured before).
DEAD_LETTER_RECORDS = _s(
    ("dlq_topic", StringType(), False),
    ("dlq_partition", IntegerType(), False),
    ("dlq_offset", LongType(), False),
    ("topic", StringType(), True),
    ("partition", IntegerType(), True),
    ("offset", LongType(), True),
    ("error", StringType(), True),
    ("kafka_ts", TimestampType(), True),
    ("captured_at", TimestampType(), False),
    ("group", StringType(), True),
    ("delivery_count", IntegerType(), True),
)

AUDIT_PARTITION_REPORT = _s(
    ("window_start", TimestampType(), False),
    ("window_end", TimestampType(), False),
    ("topic", StringType(), False),
    ("partition", IntegerType(), False),
    ("stage", StringType(), False),
    ("expected", LongType(), False),
    ("delivered", LongType(), False),
    ("lost", LongType(), False),
    ("duplicated", LongType(), False),
    ("reordered", LongType(), False),
    ("pending", LongType(), False),
    ("latency_p50_ms", DoubleType(), True),
    ("latency_p95_ms", DoubleType(), True),
    ("latency_p99_ms", DoubleType(), True),
    ("latency_max_ms", DoubleType(), True),
    ("status", StringType(), False),
    ("run_id", StringType(), False),
    ("computed_at", TimestampType(), False),
    *[(code, LongType(), True) for code in REPORT_CODE_COLUMNS],
)

AUDIT_ANOMALIES = _s(
    ("window_start", TimestampType(), False),
    ("topic", StringType(), False),
    ("partition", IntegerType(), False),
    ("stage", StringType(), False),
    ("anomaly", StringType(), False),
    ("pid", StringType(), True),
    ("seq", LongType(), True),
    ("offset", LongType(), True),
    ("detail", StringType(), True),
    ("run_id", StringType(), False),
    ("computed_at", TimestampType(), False),
)

# audit_anomalies' rows as the driver holds them: Arrow columns (timestamps in UTC)
AUDIT_ANOMALIES_ARROW = to_arrow_schema(AUDIT_ANOMALIES, timezone="UTC")

SLA_RESULTS = _s(
    ("window_start", TimestampType(), False),
    ("topic", StringType(), False),
    ("partition", IntegerType(), False),
    ("stage", StringType(), False),
    ("rule", StringType(), False),
    ("observed", DoubleType(), True),
    ("threshold", DoubleType(), False),
    ("passed", BooleanType(), False),
    ("severity", StringType(), False),
    ("checked_at", TimestampType(), False),
)

# Ledger lines that could not be parsed: kept, with why, never silently dropped.
LEDGER_QUARANTINE = _s(
    ("table", StringType(), False),
    ("source_file", StringType(), False),
    ("line", StringType(), True),
    ("reason", StringType(), False),
    ("ingested_at", TimestampType(), False),
)

TABLES: dict[str, StructType] = {
    "ledger_quarantine": LEDGER_QUARANTINE,
    "producer_ledger": PRODUCER_LEDGER,
    "log_records": LOG_RECORDS,
    "consumed_records": CONSUMED_RECORDS,
    "group_offsets": GROUP_OFFSETS,
    "share_offsets": SHARE_OFFSETS,
    "partition_watermarks": PARTITION_WATERMARKS,
    "mirror_records": MIRROR_RECORDS,
    "mirror_watermarks": MIRROR_WATERMARKS,
    "mirror_group_offsets": MIRROR_GROUP_OFFSETS,
    "dead_letter_records": DEAD_LETTER_RECORDS,
    "audit_partition_report": AUDIT_PARTITION_REPORT,
    "audit_anomalies": AUDIT_ANOMALIES,
}
