"""Sink writers that stamp the audit columns: the user's "sink tables" in a SQL database.

A sink row is the user's payload (a mapping returned by the consumer's handler) plus the audit
columns that name the message it came from (docs/design.md §4): `audit_topic, audit_partition,
audit_offset, audit_pid, audit_seq, audit_sink_ts` by default, and the optional
`audit_produce_ts` (the message's produce time from its audit headers, in tables created with it),
renamed through `SinkConfig.column(logical)`. The sink stage of the audit reads these tables in place.

`SqlSink` writes through SQLAlchemy, one transaction per batch:
- `mode="insert"`: plain INSERT; a redelivered message becomes a second row (at-least-once
  shows up as `duplicate_in_sink`).
- `mode="upsert"`: INSERT ... ON CONFLICT (topic, pid, seq) DO UPDATE; a redelivered message
  replaces its row. Rows without audit identity (pid/seq NULL: unaudited records) are inserted.
- with `positions` (the `exactly_once_sink` semantics): the consumer's next offsets go to
  `msgaudit_sink_offsets(group, topic, partition, next_offset)` in the same transaction as the
  rows, and `read_positions` gives them back on partition assignment ("store the offset with the
  output").
- with `consumption` (also `exactly_once_sink`): the batch's consumption-ledger rows go to
  `msgaudit_consumed_records` in the same transaction (docs/design.md §4.2, "Consumption evidence
  in the sink database"), so a crash at any point leaves rows, offsets and the evidence of
  processing all there or all absent. `msgaudit ingest` lands that table into `consumed_records`.

`Sink` is the protocol the consumer talks to; `spark_jobs.io.delta_sink.DeltaSink` is the Delta
implementation. This module must not import pyspark or Kafka, and never drops a row silently:
a payload column the table does not have is an InputError, not a lost field.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Protocol

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from audit.core.config import SINK_AUDIT_COLUMNS, SinkConfig
from audit.core.errors import ConfigError, InputError

OFFSETS_TABLE = "msgaudit_sink_offsets"
CONSUMPTION_TABLE = "msgaudit_consumed_records"
# Columns of a consumption row, as the consumer builds it (the `consumed_records` ledger format,
# consume_ts in epoch ms), in table order; `written_ts` (epoch ms, set by the sink as it writes) is
# added by the sink and is what ingest's cursor follows.
CONSUMPTION_COLUMNS = ("group", "consumer", "consume_seq", "topic", "partition", "offset", "pid", "seq",
                       "outcome", "attempt", "consume_ts", "error")
SINK_MODES = ("insert", "upsert")

TopicPartitionKey = tuple[str, int]


@dataclass(frozen=True)
class SinkRecord:
    """One sink row to write: the handler's payload and the identity of its source message.

    (topic, partition, offset) are the ORIGINAL log coordinates (a retried message keeps those of
    its first delivery); pid/seq come from its audit headers and are None for unaudited records.
    """

    payload: Mapping[str, Any]
    topic: str
    partition: int
    offset: int
    pid: str | None
    seq: int | None
    # the message's produce time from its audit headers (None for unaudited records): written to
    # the optional audit_produce_ts column, so reconcile needs no join for its latency
    produce_ts: datetime | None = None


@dataclass(frozen=True)
class Position:
    """The next offset to consume of one (topic, partition) of a group, stored with the rows."""

    topic: str
    partition: int
    next_offset: int


class Sink(Protocol):
    """What AuditedConsumer needs from a sink writer.

    `stores_consumption`: True when `write` can store consumption-ledger rows (`consumption=`) in
    the same commit as the rows and positions; the exactly_once_sink consumer then writes its
    ledger rows there instead of to the ledger files."""

    stores_consumption: bool

    def write(self, records: Sequence[SinkRecord], *, group: str | None = None,
              positions: Sequence[Position] = (),
              before_commit: Callable[[], None] | None = None,
              consumption: Sequence[Mapping[str, Any]] = ()) -> None:
        """Write `records` (and `positions` for `group`, and `consumption` rows, if any) atomically.

        `before_commit` is called inside the transaction, after everything is written and
        before it commits (metrics and fault-injection tests hook it)."""

    def read_positions(self, group: str,
                       partitions: Iterable[TopicPartitionKey]) -> dict[TopicPartitionKey, int]:
        """Stored next offsets of `group` for those partitions that have one."""

    def close(self) -> None: ...


@dataclass(frozen=True)
class AuditColumns:
    """Physical names of the six audit columns and of the optional produce time."""

    topic: str = "audit_topic"
    partition: str = "audit_partition"
    offset: str = "audit_offset"
    pid: str = "audit_pid"
    seq: str = "audit_seq"
    sink_ts: str = "audit_sink_ts"
    produce_ts: str = "audit_produce_ts"

    @classmethod
    def of(cls, columns: Mapping[str, str] | SinkConfig | AuditColumns | None) -> AuditColumns:
        if columns is None:
            return cls()
        if isinstance(columns, AuditColumns):
            return columns
        if isinstance(columns, SinkConfig):
            return cls(**{c: columns.column(c) for c in SINK_AUDIT_COLUMNS})
        unknown = sorted(set(columns) - set(SINK_AUDIT_COLUMNS))
        if unknown:
            raise ConfigError(f"sink columns: unknown logical audit column(s) {unknown} "
                              f"(allowed: {', '.join(SINK_AUDIT_COLUMNS)})")
        return cls(**{c: columns.get(c, f"audit_{c}") for c in SINK_AUDIT_COLUMNS})

    def names(self) -> tuple[str, ...]:
        """The six required audit columns (a table without one of them is refused)."""
        return (self.topic, self.partition, self.offset, self.pid, self.seq, self.sink_ts)

    def key(self) -> tuple[str, str, str]:
        """The message identity an upsert is idempotent on."""
        return (self.topic, self.pid, self.seq)


def stamp_row(record: SinkRecord, cols: AuditColumns, sink_ts: datetime) -> dict[str, Any]:
    """Payload + audit columns, the produce time included (a writer whose table lacks that column
    leaves it out); a payload that already uses an audit column name is an error."""
    clash = [c for c in (*cols.names(), cols.produce_ts) if c in record.payload]
    if clash:
        raise InputError(f"sink payload uses the audit column name(s) {clash}; rename the payload "
                         "field(s) or map the audit columns to other names (sink `columns:`)")
    row = dict(record.payload)
    row[cols.topic] = record.topic
    row[cols.partition] = record.partition
    row[cols.offset] = record.offset
    row[cols.pid] = record.pid
    row[cols.seq] = record.seq
    row[cols.sink_ts] = sink_ts
    row[cols.produce_ts] = record.produce_ts
    return row


def dedupe_last(rows: Sequence[dict[str, Any]], key: tuple[str, ...]) -> list[dict[str, Any]]:
    """Keep the last row per key (an upsert batch must not touch one key twice); rows with a NULL
    key part have no identity and are all kept."""
    out: list[dict[str, Any] | None] = []
    slots: dict[tuple[Any, ...], int] = {}
    for row in rows:
        k = tuple(row[c] for c in key)
        if any(v is None for v in k):
            out.append(row)
            continue
        if k in slots:
            out[slots[k]] = None
        slots[k] = len(out)
        out.append(row)
    return [r for r in out if r is not None]


def _sql_type(value: Any) -> sa.types.TypeEngine[Any]:
    # bool before int: bool is an int in Python.
    if isinstance(value, bool):
        return sa.Boolean()
    if isinstance(value, int):
        return sa.BigInteger()
    if isinstance(value, float):
        return sa.Float()
    if isinstance(value, datetime):
        return sa.DateTime(timezone=True)
    if isinstance(value, bytes | bytearray):
        return sa.LargeBinary()
    if isinstance(value, dict | list):
        return sa.JSON()
    return sa.Text()


def infer_columns(rows: Sequence[Mapping[str, Any]]) -> dict[str, sa.types.TypeEngine[Any]]:
    """Column types from the first non-null value of each payload field, in first-seen order."""
    types: dict[str, sa.types.TypeEngine[Any] | None] = {}
    for row in rows:
        for name, value in row.items():
            if types.get(name) is None:
                types[name] = None if value is None or (isinstance(value, float) and math.isnan(value)) \
                    else _sql_type(value)
    return {n: (t if t is not None else sa.Text()) for n, t in types.items()}


def consumption_table(metadata: sa.MetaData | None = None) -> sa.Table:
    """`msgaudit_consumed_records`: the consumption ledger of exactly_once_sink consumers, kept in
    the sink database (docs/design.md §4.2). One row per processing outcome, written in the same
    transaction as the batch's sink rows and positions; key (group, consumer, consume_seq)."""
    return sa.Table(
        CONSUMPTION_TABLE, metadata if metadata is not None else sa.MetaData(),
        sa.Column("group", sa.String(255), primary_key=True),
        sa.Column("consumer", sa.String(255), primary_key=True),
        sa.Column("consume_seq", sa.BigInteger, primary_key=True),
        sa.Column("topic", sa.String(255), nullable=False),
        sa.Column("partition", sa.Integer, nullable=False),
        sa.Column("offset", sa.BigInteger, nullable=False),
        sa.Column("pid", sa.String(64)),
        sa.Column("seq", sa.BigInteger),
        sa.Column("outcome", sa.String(32), nullable=False),
        sa.Column("attempt", sa.Integer, nullable=False),
        sa.Column("consume_ts", sa.BigInteger, nullable=False),
        sa.Column("error", sa.Text),
        sa.Column("written_ts", sa.BigInteger, nullable=False, index=True),
    )


def consumption_rows(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Consumption rows checked against CONSUMPTION_COLUMNS (a missing required column or an
    unknown one is an InputError: these rows are the audit's evidence, never half-written)."""
    out = []
    for row in rows:
        # produce_ts (the message's audit.ts, optional in the ledger files) is not kept here
        unknown = sorted(set(row) - set(CONSUMPTION_COLUMNS) - {"produce_ts"})
        missing = [c for c in CONSUMPTION_COLUMNS if c not in row and c not in ("pid", "seq", "error")]
        if unknown or missing:
            raise InputError(f"consumption row: unknown column(s) {unknown}, missing {missing} "
                             f"(expected {', '.join(CONSUMPTION_COLUMNS)})")
        out.append({c: row.get(c) for c in CONSUMPTION_COLUMNS})
    return out


class SqlSink:
    """A sink table in any SQLAlchemy database (SQLite and PostgreSQL tested).

    The table is created on the first write if missing: the payload columns (types from `schema`,
    else inferred from the first batch) followed by the audit columns, plus a unique index on
    (topic, pid, seq) in upsert mode. An existing table is used as it is.
    """

    stores_consumption = True

    def __init__(self, url: str | Engine, table: str, mode: str = "insert",
                 columns: Mapping[str, str] | SinkConfig | AuditColumns | None = None, *,
                 schema: Mapping[str, sa.types.TypeEngine[Any] | type[sa.types.TypeEngine[Any]]] | None = None,
                 now: Callable[[], datetime] | None = None) -> None:
        if mode not in SINK_MODES:
            raise ConfigError(f"SqlSink mode: expected one of {SINK_MODES}, got {mode!r}")
        if not isinstance(table, str) or not table:
            raise ConfigError(f"SqlSink table: expected a table name, got {table!r}")
        self.mode = mode
        self.table_name = table
        self.cols = AuditColumns.of(columns)
        self._schema = {k: (t() if isinstance(t, type) else t) for k, t in (schema or {}).items()}
        self._now = now or (lambda: datetime.now(UTC))
        if isinstance(url, Engine):
            self.engine = url
            self._own_engine = False
        else:
            try:
                self.engine = sa.create_engine(url, future=True)
            except (sa.exc.ArgumentError, sa.exc.NoSuchModuleError) as e:
                raise ConfigError(f"SqlSink url: {url!r} is not a usable SQLAlchemy URL: {e}") from None
            self._own_engine = True
        self._table: sa.Table | None = None
        self._offsets = sa.Table(
            OFFSETS_TABLE, sa.MetaData(),
            sa.Column("group", sa.String(255), primary_key=True),
            sa.Column("topic", sa.String(255), primary_key=True),
            sa.Column("partition", sa.Integer, primary_key=True),
            sa.Column("next_offset", sa.BigInteger, nullable=False),
        )
        self._offsets_ready = False
        self._consumption = consumption_table()
        self._consumption_ready = False

    @classmethod
    def from_config(cls, sink: SinkConfig, mode: str = "insert", **kwargs: Any) -> SqlSink:
        if sink.format != "sql" or not sink.url or not sink.table:
            raise ConfigError(f"sink {sink.name!r}: SqlSink needs a format: sql sink with url and table")
        return cls(sink.url, sink.table, mode, sink, **kwargs)

    # -- table management -------------------------------------------------------------------

    def _load_table(self, conn: Connection) -> sa.Table | None:
        if self._table is None and sa.inspect(conn).has_table(self.table_name):
            self._table = sa.Table(self.table_name, sa.MetaData(), autoload_with=conn)
            missing = [c for c in self.cols.names() if c not in self._table.c]
            if missing:
                raise InputError(f"sink table {self.table_name!r} exists but lacks the audit column(s) "
                                 f"{missing}; add them or map the audit columns to existing ones")
            if self.mode == "upsert":
                self._ensure_unique_key(conn)
        return self._table

    def _unique_index(self, table: sa.Table) -> sa.Index:
        return sa.Index(f"ux_{self.table_name}_audit_msg", *(table.c[c] for c in self.cols.key()), unique=True)

    def _ensure_unique_key(self, conn: Connection) -> None:
        assert self._table is not None
        want = set(self.cols.key())
        insp = sa.inspect(conn)
        uniques: list[set[str | None]] = [set(u["column_names"]) for u in insp.get_unique_constraints(self.table_name)]
        uniques += [set(i["column_names"]) for i in insp.get_indexes(self.table_name) if i.get("unique")]
        pk = insp.get_pk_constraint(self.table_name).get("constrained_columns") or []
        if any(u == want for u in uniques) or set(pk) == want:
            return
        try:
            self._unique_index(self._table).create(conn)
        except sa.exc.IntegrityError as e:
            raise InputError(f"sink table {self.table_name!r} already holds duplicate messages on "
                             f"{self.cols.key()}, so upsert mode cannot add its unique index; "
                             "deduplicate the table or use mode='insert'") from e

    def _create_table(self, conn: Connection, rows: Sequence[Mapping[str, Any]]) -> sa.Table:
        payload = dict(self._schema) if self._schema else infer_columns(rows)
        c = self.cols
        table = sa.Table(
            self.table_name, sa.MetaData(),
            *(sa.Column(name, typ) for name, typ in payload.items()),
            sa.Column(c.topic, sa.String(255), nullable=False),
            sa.Column(c.partition, sa.Integer, nullable=False),
            sa.Column(c.offset, sa.BigInteger, nullable=False),
            sa.Column(c.pid, sa.String(64)),
            sa.Column(c.seq, sa.BigInteger),
            sa.Column(c.sink_ts, sa.DateTime(timezone=True), nullable=False),
            sa.Column(c.produce_ts, sa.DateTime(timezone=True)),
        )
        if self.mode == "upsert":
            self._unique_index(table)
        table.create(conn, checkfirst=True)
        self._table = table
        return table

    def table(self) -> sa.Table | None:
        """The sink's table, or None if it does not exist yet."""
        with self.engine.connect() as conn:
            return self._load_table(conn)

    # -- writing ----------------------------------------------------------------------------

    def write(self, records: Sequence[SinkRecord], *, group: str | None = None,
              positions: Sequence[Position] = (),
              before_commit: Callable[[], None] | None = None,
              consumption: Sequence[Mapping[str, Any]] = ()) -> None:
        if positions and not group:
            raise InputError("SqlSink.write: positions need the consumer group they belong to")
        evidence = consumption_rows(consumption)
        sink_ts = self._now()
        rows = [stamp_row(r, self.cols, sink_ts) for r in records]
        with self.engine.begin() as conn:
            if rows:
                table = self._load_table(conn)
                if table is None:
                    table = self._create_table(conn, [r.payload for r in records])
                if self.cols.produce_ts not in table.c:  # a table made without the optional column
                    for row in rows:
                        row.pop(self.cols.produce_ts, None)
                unknown = sorted({k for row in rows for k in row} - set(table.c.keys()))
                if unknown:
                    raise InputError(f"sink table {self.table_name!r} has no column(s) {unknown} that the "
                                     "handler returned; add them to the table or stop returning them")
                if self.mode == "upsert":
                    self._upsert(conn, table, dedupe_last(rows, self.cols.key()))
                else:
                    conn.execute(table.insert(), rows)
            if positions:
                assert group is not None
                self._store_positions(conn, group, positions)
            if evidence:
                if not self._consumption_ready:
                    self._consumption.create(conn, checkfirst=True)
                    self._consumption_ready = True
                written = int(sink_ts.timestamp() * 1000)
                conn.execute(self._consumption.insert(), [{**{c: r.get(c) for c in CONSUMPTION_COLUMNS}, "written_ts": written} for r in evidence])
            if before_commit is not None:
                before_commit()

    def _upsert(self, conn: Connection, table: sa.Table, rows: list[dict[str, Any]]) -> None:
        key = self.cols.key()
        # Same column set for every row so one executemany statement covers the batch.
        table_columns: list[str] = list(table.c.keys())
        names = [c for c in table_columns if any(c in r for r in rows)]
        rows = [{n: r.get(n) for n in names} for r in rows]
        dialect = conn.dialect.name
        if dialect in ("postgresql", "sqlite"):
            from sqlalchemy.dialects import postgresql, sqlite

            ins = (postgresql.insert if dialect == "postgresql" else sqlite.insert)(table)
            stmt = ins.on_conflict_do_update(
                index_elements=[table.c[k] for k in key],
                set_={n: ins.excluded[n] for n in names if n not in key},
            )
            conn.execute(stmt, rows)
            return
        # Other databases: delete-then-insert inside the batch's transaction is the same upsert.
        for row in rows:
            if all(row[k] is not None for k in key):
                conn.execute(table.delete().where(sa.and_(*(table.c[k] == row[k] for k in key))))
        conn.execute(table.insert(), rows)

    # -- consumer positions (exactly_once_sink) ---------------------------------------------

    def _ensure_offsets(self, conn: Connection) -> None:
        if not self._offsets_ready:
            self._offsets.create(conn, checkfirst=True)
            self._offsets_ready = True

    def _store_positions(self, conn: Connection, group: str, positions: Sequence[Position]) -> None:
        self._ensure_offsets(conn)
        t = self._offsets
        latest = {(p.topic, p.partition): p.next_offset for p in positions}
        for (topic, partition), next_offset in latest.items():
            where = sa.and_(t.c.group == group, t.c.topic == topic, t.c.partition == partition)
            done = conn.execute(t.update().where(where).values(next_offset=next_offset))
            if done.rowcount == 0:
                conn.execute(t.insert().values(group=group, topic=topic, partition=partition,
                                               next_offset=next_offset))

    def read_positions(self, group: str,
                       partitions: Iterable[TopicPartitionKey]) -> dict[TopicPartitionKey, int]:
        wanted = set(partitions)
        if not wanted:
            return {}
        with self.engine.begin() as conn:
            self._ensure_offsets(conn)
            t = self._offsets
            rows = conn.execute(sa.select(t.c.topic, t.c.partition, t.c.next_offset)
                                .where(t.c.group == group)).all()
        return {(r.topic, r.partition): int(r.next_offset) for r in rows if (r.topic, r.partition) in wanted}

    def close(self) -> None:
        if self._own_engine:
            self.engine.dispose()

    def __enter__(self) -> SqlSink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
