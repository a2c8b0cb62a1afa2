"""Read a user's sink table in place (Delta path, SQL through Spark's JDBC source, or an Iceberg
table) as the audit's normalised sink rows: (topic, partition, offset, pid, seq, sink_ts, produce_ts).

Iceberg: the driver plans the scan with pyiceberg (metadata only: the table's current snapshot,
its manifests) and Spark's own Parquet/ORC readers read the data files on the executors, columns
matched by Iceberg field id. Iceberg's Spark runtime (built up to Spark 4.1) does not load on
Spark 4.2 (docs/internals.md).

Only this module knows how sinks are stored. It never writes to a sink and never guesses a
column: a sink without one of the audit columns is an InputError naming the column and the
config key that maps it. The optional `audit_produce_ts` is read as null when the table lacks it
and no `columns.produce_ts` maps it.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import reduce
from typing import Any
from urllib.parse import unquote, urlsplit

from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.types import DataType, StringType, StructField, StructType, VariantType

from audit.core.config import (
    OPTIONAL_AUDIT_COLUMNS,
    SINK_AUDIT_COLUMNS,
    ShareGroupConfig,
    SinkConfig,
    join_location,
)
from audit.core.errors import ConfigError, InputError
from audit.core.vocabulary import DEAD_LETTERED
from spark_jobs.io.session import local_frame

_TYPES = {"topic": "string", "partition": "int", "offset": "bigint", "pid": "string", "seq": "bigint",
          "sink_ts": "timestamp", "produce_ts": "timestamp"}


def jdbc_options(url: str) -> dict[str, str]:
    """SQLAlchemy URL -> Spark JDBC options (url, driver, user, password)."""
    parts = urlsplit(url)
    scheme = parts.scheme.split("+", 1)[0]
    if scheme in ("postgresql", "postgres"):
        host = parts.hostname or "localhost"
        port = f":{parts.port}" if parts.port else ""
        opts = {"url": f"jdbc:postgresql://{host}{port}{parts.path}", "driver": "org.postgresql.Driver"}
        if parts.query:
            opts["url"] += "?" + parts.query
        if parts.username:
            opts["user"] = unquote(parts.username)
        if parts.password:
            opts["password"] = unquote(parts.password)
        return opts
    if scheme == "sqlite":
        path = url.split(":///", 1)[1] if ":///" in url else ""
        if not path or path == ":memory:":
            raise ConfigError(f"sink url {url!r}: an in-memory SQLite database cannot be read by Spark")
        return {"url": f"jdbc:sqlite:{path}", "driver": "org.sqlite.JDBC"}
    raise ConfigError(f"sink url {url!r}: Spark can read sql sinks on postgresql or sqlite URLs")


def _load(spark: SparkSession, sink: SinkConfig) -> DataFrame:
    if sink.format == "delta":
        from delta.tables import DeltaTable

        if not sink.location or not DeltaTable.isDeltaTable(spark, sink.location):
            raise InputError(f"sink {sink.name!r}: no Delta table at {sink.location} "
                             "(has the consumer written to it yet? check sinks[].location)")
        return spark.read.format("delta").load(sink.location)
    if sink.format == "sql":
        if not sink.url or not sink.table:
            raise ConfigError(f"sink {sink.name!r}: a sql sink needs url and table")
        reader = spark.read.format("jdbc").option("dbtable", sink.table)
        for k, v in jdbc_options(sink.url).items():
            reader = reader.option(k, v)
        try:
            if sink.url.startswith("sqlite"):
                # SQLite keeps timestamps as text with microseconds; sqlite-jdbc would read that
                # fraction as milliseconds (up to 16 minutes off). Take the text and parse it in Spark.
                present = {c.lower() for c in reader.load().columns}
                texts = [sink.column(c) for c in ("sink_ts", "produce_ts") if sink.column(c).lower() in present]
                if texts:
                    reader = reader.option("customSchema", ", ".join(f"`{c}` STRING" for c in texts))
            return reader.load()
        except Exception as e:  # the JDBC source raises JVM errors: name the sink and the cause
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise InputError(f"sink {sink.name!r}: cannot read table {sink.table!r} over JDBC: {first}") from None
    if sink.format == "iceberg":
        return read_iceberg(spark, sink)
    raise ConfigError(f"sink {sink.name!r}: unknown format {sink.format!r}")


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def iceberg_table(sink: SinkConfig) -> Any:
    """The sink's pyiceberg table: from its catalog (`sinks[].catalog`: pyiceberg properties and the
    catalog's `name`, default `default`), or from the Hadoop catalog layout under
    `sinks[].warehouse` (`<warehouse>/<namespace>/<name>`, the metadata that
    `metadata/version-hint.text` names). One line naming the sink and the key to fix when the
    catalog cannot be reached or the table is not there."""
    from pyiceberg.exceptions import NoSuchNamespaceError, NoSuchTableError

    assert sink.table
    namespace, _, name = sink.table.rpartition(".")
    if sink.catalog:
        from pyiceberg.catalog import load_catalog

        try:
            props = dict(sink.catalog)
            catalog = load_catalog(props.pop("name", "default"), **props)
        except Exception as e:
            raise InputError(f"sink {sink.name!r}: cannot reach its Iceberg catalog: {_first_line(e)} "
                             "(check sinks[].catalog)") from None
        try:
            return catalog.load_table((*namespace.split("."), name))
        except (NoSuchTableError, NoSuchNamespaceError):
            raise InputError(f"sink {sink.name!r}: its Iceberg catalog has no table {sink.table!r} "
                             "(has the connector committed yet? check sinks[].table)") from None
        except Exception as e:
            raise InputError(f"sink {sink.name!r}: cannot load Iceberg table {sink.table!r} from its catalog: "
                             f"{_first_line(e)} (check sinks[].catalog)") from None
    from pyiceberg.table import StaticTable

    assert sink.warehouse
    location = join_location(sink.warehouse, *namespace.split("."), name)
    try:
        return StaticTable.from_metadata(location)
    except (FileNotFoundError, NotADirectoryError):
        raise InputError(f"sink {sink.name!r}: no Iceberg table {sink.table!r} at {location} (has the connector "
                         "committed yet? check sinks[].warehouse and sinks[].table)") from None
    except Exception as e:
        raise InputError(f"sink {sink.name!r}: cannot read Iceberg table {sink.table!r} at {location}: "
                         f"{_first_line(e)} (check sinks[].warehouse)") from None


def iceberg_spark_schema(table: Any) -> StructType:
    """The table's current schema as a Spark schema whose top-level fields carry their Iceberg
    field id (`parquet.field.id`), so Spark's Parquet reader matches columns by id: a renamed
    column still reads from older files, a column added later reads null there."""
    from pyiceberg.io.pyarrow import schema_to_pyarrow
    from pyspark.sql.pandas.types import from_arrow_type

    fields = []
    for f, a in zip(table.schema().fields, schema_to_pyarrow(table.schema()), strict=True):
        fields.append(StructField(f.name, from_arrow_type(a.type), nullable=not f.required,
                                  metadata={"parquet.field.id": f.field_id}))
    return StructType(fields)


def read_iceberg(spark: SparkSession, sink: SinkConfig) -> DataFrame:
    """The rows of the sink's Iceberg table (current snapshot), every column as stored."""
    table = iceberg_table(sink)
    schema = iceberg_spark_schema(table)
    try:
        tasks = list(table.scan().plan_files())
    except Exception as e:
        raise InputError(f"sink {sink.name!r}: cannot plan a scan of Iceberg table {sink.table!r}: "
                         f"{_first_line(e)} (check sinks[].warehouse or sinks[].catalog)") from None
    if any(t.delete_files for t in tasks):
        raise InputError(f"sink {sink.name!r}: Iceberg table {sink.table!r} has delete files (rows deleted or "
                         "upserted in place); msgaudit reads append-only Iceberg sinks: write it without "
                         "row-level deletes, or audit an append-only copy")
    by_format: dict[str, list[str]] = {}
    for t in tasks:
        by_format.setdefault(str(t.file.file_format.name).lower(), []).append(t.file.file_path)
    if not by_format:
        return local_frame(spark, [], schema)
    spark.conf.set("spark.sql.parquet.fieldId.read.enabled", "true")
    frames = []
    for fmt, paths in sorted(by_format.items()):
        if fmt not in ("parquet", "orc"):
            raise InputError(f"sink {sink.name!r}: Iceberg table {sink.table!r} has {fmt} data files; msgaudit reads "
                             "Parquet and ORC (set the connector's write-props write.format.default=parquet)")
        frames.append(spark.read.schema(schema).format(fmt).load(paths))
    df = frames[0]
    for other in frames[1:]:
        df = df.unionByName(other)
    return df


def normalise(df: DataFrame, sink: SinkConfig) -> DataFrame:
    """Rename the mapped audit columns to their logical names and types; error if one is missing."""
    present = {c.lower(): c for c in df.columns}
    cols = []
    for logical in SINK_AUDIT_COLUMNS:
        physical = sink.column(logical)
        if physical.lower() not in present and logical in OPTIONAL_AUDIT_COLUMNS and logical not in sink.columns:
            cols.append(F.lit(None).cast(_TYPES[logical]).alias(logical))
            continue
        if physical.lower() not in present:
            raise InputError(
                f"sink {sink.name!r} has no audit column {physical!r} (for {logical}); add it to the table "
                f"or map it with sinks[].columns.{logical}")
        col = F.col(f"`{present[physical.lower()]}`")
        if logical in ("sink_ts", "produce_ts"):
            # SQLite hands timestamps over as text: parse leniently (an unparseable one becomes NULL,
            # and the row is then placed by its message's produce time, never dropped).
            is_text = dict(df.dtypes)[present[physical.lower()]] == "string"
            col = F.try_to_timestamp(col) if is_text else col.cast("timestamp")
        else:
            col = col.cast(_TYPES[logical])
        cols.append(col.alias(logical))
    return df.select(*cols)


def read_sink(spark: SparkSession, sink: SinkConfig, topic: str | None, log: DataFrame | None = None,
              dead_letters: DataFrame | None = None) -> DataFrame:
    """The sink's rows of `topic` (None: of every topic), normalised, with `dead_letter` false. Filters
    push down to Delta and JDBC. A sink whose rows name their message by Kafka coordinates is
    resolved through `log` (`log_records`; required for `identity: coordinates`). A sink with a
    `dead_letter_topic` also gets that topic's records from `dead_letters` (`dead_letter_records`,
    required then) as rows with `dead_letter` true (`dead_letter_rows`)."""
    raw = _load(spark, sink)
    if sink.identity == "audit":
        df = normalise(raw, sink)
    else:
        rows = identity_rows(raw, sink)
        if sink.identity == "coordinates":
            if log is None:
                raise InputError(f"sink {sink.name!r}: identity coordinates needs the captured log (log_records)")
            rows = resolve_coordinates(rows, log)
        df = rows.select(*SINK_AUDIT_COLUMNS)
    df = df.withColumn("dead_letter", F.lit(False))
    if sink.dead_letter_topic:
        if log is None or dead_letters is None:
            raise InputError(f"sink {sink.name!r}: sinks[].dead_letter_topic needs the captured log and its "
                             "dead-letter records (run `msgaudit capture` first)")
        df = df.unionByName(dead_letter_rows(dead_letters, sink, log))
    return df if topic is None else df.where(F.col("topic") == topic)


def dead_letter_rows(dead_letters: DataFrame, sink: SinkConfig, log: DataFrame) -> DataFrame:
    """The records of the sink's dead-letter topic (`dead_letter_records`) as sink rows with
    `dead_letter` true: the source record each names, resolved through the log like a coordinates
    row, placed by the DLQ record's Kafka timestamp (when the connector dead-lettered it). A record
    naming a position the log never held keeps pid and seq null (the rules count it as
    quarantined); one without the __connect.errors.* headers names nothing and is quarantined too,
    under the sink's topic."""
    rows = dead_letters.where(F.col("dlq_topic") == F.lit(sink.dead_letter_topic))
    return resolved_dead_letters(rows, sink.topic, log).select(*SINK_AUDIT_COLUMNS).withColumn("dead_letter", F.lit(True))


def resolved_dead_letters(dead_letters: DataFrame, topic: str | None, log: DataFrame,
                          keep: Sequence[str] = ()) -> DataFrame:
    """`dead_letter_records` rows as coordinates rows resolved through the log (`resolve_coordinates`),
    placed by the DLQ record's Kafka timestamp (`sink_ts`: when it was dead-lettered), with the
    columns `keep` of the record passed through. A record without a full position keeps partition
    and offset null, under `topic` when it names none."""
    named = F.col("topic").isNotNull() & F.col("partition").isNotNull() & F.col("offset").isNotNull()
    rows = dead_letters.select(
        F.coalesce(F.col("topic"), F.lit(topic)).cast("string").alias("topic"),
        F.when(named, F.col("partition")).cast("int").alias("partition"),
        F.when(named, F.col("offset")).cast("bigint").alias("offset"),
        F.lit(None).cast("string").alias("pid"), F.lit(None).cast("bigint").alias("seq"),
        F.col("kafka_ts").cast("timestamp").alias("sink_ts"), F.lit(None).cast("timestamp").alias("produce_ts"),
        F.col("kafka_ts").cast("timestamp").alias("record_ts"), *keep)
    return resolve_coordinates(rows, log, keep)


def share_dead_letter_rows(dead_letters: DataFrame, groups: Sequence[ShareGroupConfig], log: DataFrame) -> DataFrame:
    """The records of share groups' dead-letter topics (`dead_letter_records`; each group's own: its
    `__dlq.errors.group`, when the record names one) as `consumed_records` rows of the group with
    outcome `dead_lettered` (docs/design.md §5.9): the source record resolved through the log, placed
    by the DLQ record's Kafka timestamp, `consumer` = the DLQ topic, `consume_seq` = its offset,
    `attempt` = its delivery count (0 when it names none), `error` = the broker's reason. A record
    naming no position (no __dlq.errors.* headers: not the broker's) is left out; capture's summary
    counts it."""
    parts = []
    for sg in groups:
        if not sg.dead_letter_topic:
            continue
        mine = dead_letters.where((F.col("dlq_topic") == F.lit(sg.dead_letter_topic))
                                  & (F.col("group").isNull() | (F.col("group") == F.lit(sg.name))))
        rows = resolved_dead_letters(mine, None, log, ("dlq_topic", "dlq_offset", "error", "delivery_count"))
        parts.append(rows.where(F.col("partition").isNotNull() & F.col("offset").isNotNull()).select(
            F.lit(sg.name).alias("group"), F.col("dlq_topic").alias("consumer"),
            F.col("dlq_offset").cast("bigint").alias("consume_seq"), "topic", "partition", "offset", "pid", "seq",
            F.lit(DEAD_LETTERED).alias("outcome"), F.coalesce(F.col("delivery_count"), F.lit(0)).cast("int").alias("attempt"),
            F.col("sink_ts").alias("consume_ts"), F.col("error").cast("string").alias("error"),
            F.lit(None).cast("string").alias("cluster"), F.col("produce_ts")))
    return reduce(lambda a, b: a.unionByName(b), parts)


# -- sinks whose rows name their message otherwise (docs/design.md §4.2, §8 `identity`) ---------

_INTEGRAL = ("tinyint", "smallint", "int", "bigint")
_TIMES = ("timestamp", "timestamp_ntz", "bigint", "string", "date")  # bigint: epoch milliseconds


def _field(df: DataFrame, sink: SinkConfig, key: str) -> tuple[Column, str]:
    """The column, nested field (`a.b`) or JSON / variant field (`c:f`) `columns.<key>` maps, and
    its Spark type ('string' for a JSON or variant field, whose values are typed when read)."""
    spec = sink.columns[key]
    path, _, json_path = spec.partition(":")
    schema: DataType = df.schema
    names: list[str] = []
    for part in path.split("."):
        fields = {f.name.lower(): f for f in schema.fields} if isinstance(schema, StructType) else {}
        found = fields.get(part.lower())
        if found is None:
            where = "" if not names else f" in {'.'.join(names)!r}"
            raise InputError(f"sink {sink.name!r} has no column or field {part!r}{where} (for {key}): map "
                             f"sinks[].columns.{key} to one the table has")
        names.append(found.name)
        schema = found.dataType
    col = F.col(".".join(f"`{n}`" for n in names))
    if not json_path:
        return col, schema.simpleString()
    json = "$." + json_path
    if isinstance(schema, StringType):
        return F.get_json_object(col, json), "string"
    if isinstance(schema, VariantType):
        return F.try_variant_get(col, json, "string"), "string"
    raise InputError(f"sink {sink.name!r}: {'.'.join(names)!r} is {schema.simpleString()}, not a JSON string or a "
                     f"variant (for {key}): map sinks[].columns.{key} to a column or field of one")


def _typed(df: DataFrame, sink: SinkConfig, key: str, kind: str) -> Column:
    """`columns.<key>` read as `kind` ('string', 'int', 'bigint' or 'timestamp'); a value that is
    not one (a JSON field holding text) is null."""
    if key not in sink.columns:
        return F.lit(None).cast(kind)
    col, typ = _field(df, sink, key)
    ok = {"string": ("string",), "int": (*_INTEGRAL, "string"), "bigint": (*_INTEGRAL, "string"),
          "timestamp": _TIMES}[kind]
    if typ not in ok and not (typ.startswith("decimal(") and typ.endswith(",0)") and kind != "string"):
        raise InputError(f"sink {sink.name!r}: sinks[].columns.{key} ({sink.columns[key]!r}) is {typ}, expected "
                         f"{' or '.join(ok)}: map it to the {key} the writer records")
    if kind != "timestamp":
        return col.try_cast(kind) if typ == "string" else col.cast(kind)
    if typ == "bigint" or typ == "string":  # epoch milliseconds, or a timestamp's text
        text = col.cast("string")
        return F.when(text.rlike("^[0-9]+$"), F.timestamp_millis(text.cast("bigint"))).otherwise(F.try_to_timestamp(text))
    return col.cast("timestamp")


_PACKED = r"^(.+)/([0-9]+)/([0-9]+)$"  # audit.id = <pid>/<seq>/<ts>, split at its last two '/' (§3.1)


def identity_rows(df: DataFrame, sink: SinkConfig) -> DataFrame:
    """A coordinates or packed_id sink's rows as (topic, partition, offset, pid, seq, sink_ts,
    produce_ts, record_ts): what each row names, before the log resolves coordinates. A row whose
    topic is not mapped has the topic whose `sinks` holds the sink. A row that names no message
    (a null topic, partition or offset; for packed_id, no valid id and no partition and offset)
    keeps only its sink time: the rules count it as quarantined (docs/design.md §4.2)."""
    topic = _typed(df, sink, "topic", "string") if "topic" in sink.columns else F.lit(sink.topic).cast("string")
    partition, offset = _typed(df, sink, "partition", "int"), _typed(df, sink, "offset", "bigint")
    pid = seq = produce_ts = None
    if sink.identity == "packed_id":
        packed, typ = _field(df, sink, "id")
        if typ != "string":
            raise InputError(f"sink {sink.name!r}: sinks[].columns.id ({sink.columns['id']!r}) is {typ}, expected "
                             "string (the audit.id header's text, <pid>/<seq>/<ts>)")
        valid = packed.rlike(_PACKED)
        pid = F.when(valid, F.regexp_extract(packed, _PACKED, 1))
        seq = F.when(valid, F.regexp_extract(packed, _PACKED, 2).try_cast("bigint"))
        produce_ts = F.when(valid, F.timestamp_millis(F.regexp_extract(packed, _PACKED, 3).try_cast("bigint")))
    # a packed id names its message without a position; coordinates need all three
    placed = partition.isNotNull() & offset.isNotNull()
    named = topic.isNotNull() & (placed if sink.identity == "coordinates" else F.lit(True))
    return df.select(
        F.when(named, topic).otherwise(F.lit(sink.topic)).alias("topic"),
        F.when(named & placed, partition).alias("partition"),
        F.when(named & placed, offset).alias("offset"),
        F.when(named, pid if pid is not None else F.lit(None)).cast("string").alias("pid"),
        F.when(named, seq if seq is not None else F.lit(None)).cast("bigint").alias("seq"),
        _typed(df, sink, "sink_ts", "timestamp").alias("sink_ts"),
        (produce_ts if produce_ts is not None else F.lit(None).cast("timestamp")).alias("produce_ts"),
        _typed(df, sink, "record_ts", "timestamp").alias("record_ts"))


def resolve_coordinates(rows: DataFrame, log: DataFrame, keep: Sequence[str] = ()) -> DataFrame:
    """Coordinate rows (`identity_rows`) as the audit columns would name them, by a join with the
    captured log on (topic, partition, offset): the record there gives the message (pid, seq; null
    for a record without valid audit headers, which the rules then match by its offset) and its
    produce time. A position the log never held (a phantom, a transaction marker, a compacted
    offset) keeps pid and seq null and names a record no stage expects: `unexpected_in_sink`; it is
    placed in a window by its sink time, else by the Kafka timestamp the row recorded (`record_ts`);
    with neither it names nothing placeable and is quarantined like a row without coordinates."""
    held = (log.select("topic", "partition", "offset",
                       F.when(F.col("header_error").isNull(), F.col("pid")).alias("_pid"),
                       F.when(F.col("header_error").isNull(), F.col("seq")).alias("_seq"),
                       F.coalesce("produce_ts", "kafka_ts").alias("_pt"), F.lit(True).alias("_held"))
            .dropDuplicates(["topic", "partition", "offset"]))
    joined = rows.join(held, ["topic", "partition", "offset"], "left")
    never_held = F.col("_held").isNull() & F.col("offset").isNotNull()
    # with no time at all such a row could be placed in no window: it is quarantined instead
    placeable = ~never_held | F.coalesce("sink_ts", "record_ts").isNotNull()
    return joined.select(
        "topic", F.when(placeable, F.col("partition")).alias("partition"),
        F.when(placeable, F.col("offset")).alias("offset"), F.col("_pid").alias("pid"), F.col("_seq").alias("seq"),
        F.when(never_held, F.coalesce("sink_ts", "record_ts")).otherwise(F.col("sink_ts")).alias("sink_ts"),
        F.coalesce("_pt", "record_ts").alias("produce_ts"), *keep)


# -- the consumption evidence of exactly_once_sink consumers (docs/design.md §4.2) --------------

CONSUMPTION_TABLE = "msgaudit_consumed_records"


def sql_sink_urls(sinks: list[SinkConfig]) -> list[str]:
    """The distinct databases of the sql sinks (each may hold a consumption-evidence table)."""
    return sorted({s.url for s in sinks if s.format == "sql" and s.url})


def has_consumption_table(url: str) -> bool:
    """Whether the database at `url` has the evidence table (a sink nobody wrote exactly-once has none)."""
    import sqlalchemy as sa

    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            return bool(sa.inspect(conn).has_table(CONSUMPTION_TABLE))
    except sa.exc.SQLAlchemyError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise InputError(f"sink database {redact(url)}: cannot look for {CONSUMPTION_TABLE}: {first}") from None
    finally:
        engine.dispose()


def read_consumption(spark: SparkSession, url: str, written_since_ms: int) -> DataFrame:
    """The evidence rows written at or after `written_since_ms` (epoch ms, column `written_ts`), as
    written by `audit.clients.sinks.SqlSink` (consume_ts and written_ts in epoch ms)."""
    reader = spark.read.format("jdbc").option(
        "query", f"SELECT * FROM {CONSUMPTION_TABLE} WHERE written_ts >= {int(written_since_ms)}")
    for k, v in jdbc_options(url).items():
        reader = reader.option(k, v)
    try:
        return reader.load()
    except Exception as e:  # the JDBC source raises JVM errors: name the database and the cause
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise InputError(f"sink database {redact(url)}: cannot read {CONSUMPTION_TABLE} over JDBC: {first}") from None


def delta_sink_locations(sinks: list[SinkConfig]) -> list[str]:
    """The distinct tables of the delta sinks (each commit of an exactly_once_sink consumer carries
    its consumption rows in its commitInfo.userMetadata)."""
    return sorted({s.location for s in sinks if s.format == "delta" and s.location})


# The consumption rows in a DeltaSink commit's userMetadata (audit.clients.sinks.CONSUMPTION_COLUMNS).
_CONSUMED_FIELDS = ("`group`: STRING, consumer: STRING, consume_seq: BIGINT, topic: STRING, `partition`: INT, "
                    "`offset`: BIGINT, pid: STRING, seq: BIGINT, outcome: STRING, attempt: INT, consume_ts: BIGINT, "
                    "error: STRING")


def read_delta_consumption(spark: SparkSession, location: str, after_version: int) -> tuple[DataFrame, int]:
    """The consumption rows of the commits after `after_version` (one row per consumption row,
    plus `version`: the commit that carried it), and the table's newest version (-1: not a Delta
    table yet). Rows are read from the table's history, as `spark_jobs.io.delta_sink.DeltaSink`
    writes them."""
    from delta.tables import DeltaTable

    if not DeltaTable.isDeltaTable(spark, location):
        empty = local_frame(spark, [], f"version BIGINT, {_CONSUMED_FIELDS.replace(':', '')}")
        return empty, -1
    history = DeltaTable.forPath(spark, location).history()
    newest = history.agg(F.max("version")).first()
    top = int(newest[0]) if newest is not None and newest[0] is not None else -1
    commits = history.where((F.col("version") > after_version) & (F.col("version") <= top)
                            & F.col("userMetadata").startswith('{"msgaudit":1'))
    rows = (commits.select("version", F.from_json("userMetadata", f"consumed ARRAY<STRUCT<{_CONSUMED_FIELDS}>>").alias("m"))
            .select("version", F.explode("m.consumed").alias("r")).select("version", "r.*"))
    return rows, top


def redact(url: str) -> str:
    """The URL without its password (for messages and quarantine rows)."""
    parts = urlsplit(url)
    if parts.password:
        netloc = parts.netloc.replace(f":{parts.password}@", ":***@")
        return parts._replace(netloc=netloc).geturl()
    return url
