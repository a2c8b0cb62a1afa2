"""`AuditedProducer`: a drop-in `confluent_kafka.Producer` that stamps audit headers and keeps a ledger.

Every `produce()` call gets `audit.pid`, `audit.seq` (per pid and topic, +1 per call, failed
calls included), `audit.ts` and, when given, `audit.key` (docs/design.md §3). Every outcome becomes one
`producer_ledger` row (docs/design.md §4), written only from the delivery callback (or, for a call that
raises, from the failed call itself): `acked` with partition and offset, `failed` with the
librdkafka error name, `aborted` for every message of an aborted transaction.

Pointing it at your config::

    cfg = audit.core.config.load("msgaudit.yaml")
    producer = AuditedProducer.from_config(cfg, producer_name="orders-svc")
    # same as: AuditedProducer(dict(cfg.kafka), producer_name="orders-svc",
    #                          ledger_dir=cfg.ledger_dir / "producer")

Without a config the ledger goes to `.msgaudit/ledger/producer` under the working directory,
which is where the default config's `msgaudit ingest` looks. Call `close()` (or use `with`) so
the last segment is sealed. A killed process loses at most the ledger rows of its last ~0.2 s
(plus delivery reports librdkafka had not yet handed over); those messages may still be in
the log, where reconcile reports them as `unledgered` - never as silently fine.

The hot path (`produce` and the delivery callback) only builds three headers, counts and puts
a small tuple on a queue; JSON encoding and disk writes happen on the ledger's own thread.
This module must not block `produce()` on disk or network, and must not import Spark.

On the plugin. When the `libmsgaudit` librdkafka plugin is available (`audit.clients.plugin`:
built by `msgaudit setup`, or named by `$MSGAUDIT_PLUGIN`), a non-transactional producer
without a `ledger_topic` loads it through `plugin.library.paths` and leaves stamping and the
ledger to C: `produce()` only filters the user's headers and hands the call to librdkafka, with
no Python delivery callback unless the user gives one. Same headers, same ledger rows, same
segment files (docs/design.md §3.3). `use_plugin=False` (or `MSGAUDIT_PLUGIN=off`) keeps the
pure-Python path, which transactional producers and `ledger_topic` always use.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from functools import partial
from itertools import count
from pathlib import Path
from time import time_ns
from types import TracebackType
from typing import Any

from confluent_kafka import KafkaError, KafkaException, Message, Producer

from audit.clients.ledger import LedgerWriter
from audit.clients.ledger_ship import LedgerShipper, TransactionShipped, connection_settings, producer_txn_key
from audit.clients.plugin import Plugin, plugin_path
from audit.core import headers as audit_headers
from audit.core.errors import ConfigError, InputError, LedgerError

log = logging.getLogger(__name__)

DEFAULT_LEDGER_DIR = Path(".msgaudit") / "ledger" / "producer"
LEDGER_PREFIX = "producer"

DeliveryCallback = Callable[[KafkaError | None, Message], Any]

_PID = audit_headers.PID
_SEQ = audit_headers.SEQ
_TS = audit_headers.TS
_ID = audit_headers.ID


@dataclass(frozen=True)
class ProducerStats:
    """Counters of one producer session. acked/failed count delivery reports (plus produce()
    calls that raised, as failed); aborted counts ledger rows of aborted transactions;
    in_flight = messages handed to librdkafka without a delivery report served yet."""

    sent: int
    acked: int
    failed: int
    aborted: int
    in_flight: int
    ledger_pending: int
    ledger_topic_failed: int = 0  # rows the ledger topic did not take live (re-shipped from the spool)
    ledger_dropped: int = 0  # rows the plugin could not record (full buffer, unwritable spool)


def _error_name(exc: BaseException) -> str:
    if isinstance(exc, BufferError):
        return KafkaError(KafkaError._QUEUE_FULL).name()
    if isinstance(exc, KafkaException) and exc.args and isinstance(exc.args[0], KafkaError):
        return str(exc.args[0].name())
    return type(exc).__name__


def _json_fmt(value: str) -> str:
    """A JSON string literal, safe inside a %-format string."""
    return json.dumps(value).replace("%", "%%")


class _TopicFormats:
    """Per-topic %-formats of a ledger line, in LedgerWriter.append_formatted form: the item is
    (fmt, *values) and `fmt % item` is the line (the leading %.0s swallows fmt itself).

    `acked` values: (seq, partition, offset, produce_ts, ack_ts) - the one format on the hot path.
    `any` values: (seq, partition, offset|'null', status, error json|'null', txn_id json|'null',
    produce_ts, ack_ts|'null') for transactional rows; `failed` those of `_TopicFormats.failed`.
    """

    __slots__ = ("acked", "any", "failed", "topic")

    def __init__(self, producer_name: str, pid: str, topic: str) -> None:
        self.topic = topic
        head = f'%.0s{{"producer":{_json_fmt(producer_name)},"pid":{_json_fmt(pid)},"seq":%d,"topic":{_json_fmt(topic)},'
        self.acked = head + ('"partition":%d,"offset":%d,"status":"acked","error":null,"txn_id":null,'
                             '"produce_ts":%d,"ack_ts":%d}')
        self.any = head + '"partition":%d,"offset":%s,"status":"%s","error":%s,"txn_id":%s,"produce_ts":%d,"ack_ts":%s}'
        # a failed send outside a transaction: (seq, partition, error json, produce_ts, fingerprint json)
        self.failed = head + ('"partition":%d,"offset":null,"status":"failed","error":%s,"txn_id":null,'
                              '"produce_ts":%d,"ack_ts":null,"fingerprint":%s}')


class _Slot:
    """Per-message state of one in-flight message, recycled through a pool.

    A fresh functools.partial per message would be a garbage-collected object alive until its
    delivery report; with hundreds of thousands in flight the collector's passes over them cost
    about as much as the produce() call itself. A slot is reused once its report is served.
    """

    __slots__ = ("seq", "ts", "fmts", "user_cb", "dr", "audit_key")

    seq: int
    ts: int
    fmts: _TopicFormats
    user_cb: Any
    dr: Callable[[KafkaError | None, Message], None]
    audit_key: str | None  # a delivery report does not carry the headers: the fingerprint needs it


def _user_headers(headers: Any, audit_key: str | None) -> list[tuple[str, Any]]:
    """The user's headers without any audit header (as `audit_headers.stamp` drops them), plus
    `audit.key` when given: what the plugin path hands librdkafka, which appends the rest."""
    out: list[tuple[str, Any]] = []
    if headers:
        items = headers.items() if isinstance(headers, Mapping) else headers
        out = [(k, v) for k, v in items if k not in audit_headers.AUDIT_HEADERS]
    if audit_key is not None:
        out.append((audit_headers.KEY, audit_key.encode()))
    return out


def _kafka_conf(config: Mapping[str, Any]) -> dict[str, Any]:
    conf = dict(config)
    acks = conf.get("acks", conf.get("request.required.acks"))
    if acks is None:
        conf["acks"] = "all"
    if "enable.idempotence" not in conf and (acks is None or str(acks) in ("all", "-1")):
        conf["enable.idempotence"] = True
    return conf



SETTINGS_DIR = "producer_settings"  # beside the producer ledger folder: <ledger root>/producer_settings
# librdkafka's defaults, for the settings a producer did not set
_RDKAFKA_DEFAULTS = {"retries": 2147483647, "max_in_flight": 1000000}


def settings_row(conf: Mapping[str, Any], producer_name: str, pid: str, mode: str, start_ms: int) -> dict[str, Any]:
    """The producer's delivery settings at start (one `producer_settings` row, docs/design.md §4.2):
    the effective value of each, librdkafka's default where the config does not set it."""
    def first(*names: str) -> Any:
        return next((conf[n] for n in names if n in conf), None)

    acks = str(first("acks", "request.required.acks") or "all").lower()
    idem = str(first("enable.idempotence") or "false").lower() in ("true", "1")
    retries = first("retries", "message.send.max.retries")
    in_flight = first("max.in.flight.requests.per.connection", "max.in.flight")
    return {"producer": producer_name, "pid": pid, "start_ts": start_ms, "acks": "all" if acks == "-1" else acks,
            "enable_idempotence": idem,
            "retries": int(retries) if retries is not None else _RDKAFKA_DEFAULTS["retries"],
            "max_in_flight": int(in_flight) if in_flight is not None else _RDKAFKA_DEFAULTS["max_in_flight"],
            "transactional_id": first("transactional.id"), "mode": mode}


def write_settings(folder: Path, row: Mapping[str, Any]) -> None:
    """One sealed one-line segment per producer start (written under a temporary name, then renamed,
    so ingest never reads half a file). Failure is logged, never fatal: the audit then has no
    settings for this pid, which doctor and the explanations treat as unknown."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        name = f"settings-{time_ns()}-{audit_headers.new_pid('s').split(':', 1)[1]}"
        tmp = folder / f"{name}.tmp"
        tmp.write_text(json.dumps(dict(row), separators=(",", ":")) + "\n", encoding="utf-8")
        tmp.rename(folder / f"{name}.jsonl")
    except OSError as e:
        log.warning("producer settings not recorded in %s: %s", folder, e)


def _only_errors_cb(user_cb: DeliveryCallback, err: KafkaError | None, msg: Message) -> None:
    """Hand a delivery report to the application's callback only when it is an error."""
    if err is not None:
        user_cb(err, msg)

class AuditedProducer:
    """Drop-in for `confluent_kafka.Producer` (see the module docstring).

    Args beyond the Producer's:
      producer_name: logical name of this producer (ledger column `producer`, pid prefix).
      ledger_dir: folder for producer ledger segments (default `.msgaudit/ledger/producer`).
      ledger_topic: optional ledger topic: every ledger row is shipped there (keyed by its identity,
        audit.clients.ledger_ship) after it is written to the segment files, which stay the spool.
      ledger_kafka: librdkafka settings of the cluster holding the ledger topic (default: `config`).
      ledger_in_transactions: (transactional producers with a ledger_topic on their own cluster)
        the rows are not shipped from the spool: the caller sends `transaction_rows()` to the
        ledger topic inside each transaction, before committing it (exactly_once_kafka consumers
        do), so a crash right after the commit loses none of them.
      ledger_max_bytes, ledger_max_age_s: segment rotation (see `audit.clients.ledger.LedgerWriter`).
      metrics_registry: a prometheus_client CollectorRegistry (or True for the default one) to
        export the counters as `msgaudit_producer_*{producer=..., pid=...}`.
      use_plugin: None (default) loads the libmsgaudit plugin when it is available and the
        producer is neither transactional nor has a ledger_topic; True requires it; False
        never loads it. `self.mode` says which path runs: "plugin" or "python".
      header_form: "packed" (default): one `audit.id` header "<pid>/<seq>/<ts>"; "three": the
        headers `audit.pid`, `audit.seq`, `audit.ts` (docs/design.md §3.1). Both paths.
    """

    def __init__(
        self,
        config: Mapping[str, Any],
        *,
        producer_name: str = "producer",
        ledger_dir: Path | str | None = None,
        ledger_topic: str | None = None,
        ledger_kafka: Mapping[str, Any] | None = None,
        ledger_max_bytes: int = 64 << 20,
        ledger_max_age_s: float = 60.0,
        metrics_registry: Any = None,
        use_plugin: bool | None = None,
        header_form: str = audit_headers.PACKED,
        ledger_in_transactions: bool = False,
        **kwargs: Any,
    ) -> None:
        if not isinstance(config, Mapping):
            raise ConfigError(f"AuditedProducer: config must be a dict of librdkafka settings, got {type(config).__name__}")
        if not isinstance(producer_name, str) or not producer_name:
            raise ConfigError(f"AuditedProducer: producer_name must be a non-empty string, got {producer_name!r}")
        if header_form not in audit_headers.HEADER_FORMS:
            raise ConfigError(f"AuditedProducer: header_form must be one of {', '.join(audit_headers.HEADER_FORMS)}, "
                              f"got {header_form!r}")
        self.header_form = header_form
        conf = _kafka_conf({**config, **kwargs})
        # A global on_delivery would be skipped for messages that carry our per-message
        # callback, so it becomes the default user callback instead.
        self._default_cb: DeliveryCallback | None = conf.pop("on_delivery", None)
        # Our ledger needs every delivery report; the user's choice is honoured by _only_errors.
        self._only_errors = str(conf.pop("delivery.report.only.error", "false")).lower() in ("true", "1")
        self._transactional_id: str | None = conf.get("transactional.id")
        self.producer_name = producer_name
        self.pid = audit_headers.new_pid(producer_name)
        self.ledger_dir = Path(ledger_dir) if ledger_dir is not None else DEFAULT_LEDGER_DIR
        plugin_file = self._choose_plugin(use_plugin, ledger_topic)
        self._plugin: Plugin | None = None
        self.mode = "python"
        if plugin_file is not None:
            self._plugin = Plugin.load(plugin_file)
            self.mode = "plugin"
            conf = self._plugin_conf(conf, plugin_file, ledger_max_bytes, ledger_max_age_s)
        try:
            self._producer = Producer(conf)
        except KafkaException as e:
            raise ConfigError(f"AuditedProducer: librdkafka rejected the config: {e}") from e
        self._closed = False
        self._counts = [0, 0, 0]  # acked, failed, aborted
        self._topics: dict[str, tuple[Iterator[int], _TopicFormats]] = {}
        # Transactions: rows of an unresolved transaction are held until commit/abort decides
        # their status, so each message still gets exactly one ledger row.
        self._txn_no = 0
        self._txn_current: list[int | None] = [None]
        self._txn_held: dict[int, list[tuple[Any, ...]]] = {}
        self._txn_outcome: dict[int, str] = {}
        # Rows of produce() calls that raised inside the open transaction (ledger_in_transactions).
        self._txn_failed_calls: list[tuple[_TopicFormats, int, tuple[Any, ...]]] = []

        self._shipper: LedgerShipper | None = None
        observer: LedgerShipper | TransactionShipped | None = None
        if ledger_in_transactions and not (ledger_topic and self._transactional_id):
            raise ConfigError("AuditedProducer(ledger_in_transactions=True) needs a transactional.id and a ledger_topic")
        self._ledger_in_txn = ledger_in_transactions
        if ledger_in_transactions:
            observer = TransactionShipped()
        elif ledger_topic:
            ship_conf = ledger_kafka if ledger_kafka is not None else connection_settings(conf)
            observer = self._shipper = LedgerShipper(ship_conf, ledger_topic, "producer")
        self.ledger: LedgerWriter | None = None
        if self._plugin is None:
            self.ledger = LedgerWriter(
                self.ledger_dir,
                LEDGER_PREFIX,
                max_bytes=ledger_max_bytes,
                max_age_s=ledger_max_age_s,
                observer=observer,
            )
            self.produce = self._hot_path()  # type: ignore[method-assign]
        else:
            self.produce = self._plugin_path()  # type: ignore[method-assign]
        self._metrics_registry: Any = None
        if metrics_registry is not None:
            self._register_metrics(metrics_registry)
        self.settings = settings_row(conf, producer_name, self.pid, self.mode, time_ns() // 1_000_000)
        write_settings(self.ledger_dir.parent / SETTINGS_DIR, self.settings)

    def _choose_plugin(self, use_plugin: bool | None, ledger_topic: str | None) -> Path | None:
        if use_plugin is False:
            return None
        path = plugin_path()
        why_not = None
        if self._transactional_id is not None:
            why_not = "transactional producers use the Python ledger (aborted rows need the transaction's outcome)"
        elif ledger_topic:
            why_not = "ledger_topic is written by the Python ledger only"
        elif path is None:
            why_not = "the libmsgaudit plugin is not built (run `msgaudit setup`) and $MSGAUDIT_PLUGIN is unset"
        if why_not is not None:
            if use_plugin:
                raise ConfigError(f"AuditedProducer(use_plugin=True): {why_not}")
            return None
        return path

    def _plugin_conf(self, conf: dict[str, Any], plugin_file: Path, max_bytes: int,
                     max_age_s: float) -> dict[str, Any]:
        """plugin.library.paths first (librdkafka needs the plugin loaded before its own
        properties), then the user's settings, then the plugin's msgaudit.* properties."""
        try:
            self.ledger_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise LedgerError(f"cannot create ledger directory {self.ledger_dir}: {e}") from e
        paths = [p for p in str(conf.pop("plugin.library.paths", "")).split(";") if p]
        out: dict[str, Any] = {"plugin.library.paths": ";".join([*paths, str(plugin_file)])}
        out.update(conf)
        out.update({
            "msgaudit.ledger.dir": str(self.ledger_dir.resolve()),
            "msgaudit.producer.name": self.producer_name,
            "msgaudit.pid": self.pid,
            "msgaudit.segment.max.bytes": str(max_bytes),
            "msgaudit.segment.max.age.ms": str(max(1, int(max_age_s * 1000))),
            "msgaudit.header.form": self.header_form,
            "msgaudit.settings.row": "false",  # this wrapper writes the session's settings row itself
        })
        return out

    def _plugin_path(self) -> Callable[..., None]:
        """produce() when the plugin stamps and ledgers: the user's headers and callback only."""
        c_produce: Callable[..., None] = self._producer.produce
        default_cb = self._default_cb
        only_errors = self._only_errors
        plugin = self._plugin
        assert plugin is not None
        pid = self.pid
        user_headers = _user_headers
        header_error = audit_headers.user_header_error
        fingerprint = audit_headers.fingerprint

        def produce(topic: str, value: Any = None, key: Any = None, partition: int = -1,
                    on_delivery: DeliveryCallback | None = None, callback: DeliveryCallback | None = None,
                    timestamp: int = 0, headers: Any = None, *, audit_key: str | None = None) -> None:
            if headers and (bad := header_error(headers)) is not None:  # before the plugin takes a seq
                raise InputError(f"AuditedProducer.produce({topic!r}): {bad}")
            hdrs = user_headers(headers, audit_key) if headers or audit_key is not None else None
            user_cb = on_delivery or callback or default_cb
            if only_errors and user_cb is not None:
                user_cb = partial(_only_errors_cb, user_cb)
            try:
                c_produce(topic, value, key, partition, user_cb, None, timestamp, hdrs)
            except BaseException as e:
                part = partition if isinstance(partition, int) and partition >= 0 else -1
                plugin.failed_call(pid, topic, part, _error_name(e), fingerprint(key, value, hdrs))
                raise

        produce.__doc__ = AuditedProducer.produce.__doc__
        return produce

    @classmethod
    def from_config(cls, cfg: Any, producer_name: str, **overrides: Any) -> AuditedProducer:
        """Producer for a loaded msgaudit `Config`: its kafka settings and its ledger_dir.
        `overrides` are AuditedProducer keyword arguments or librdkafka settings
        (dotted names through a dict: `**{"linger.ms": 5}`)."""
        own = {k: overrides.pop(k) for k in list(overrides)
               if k in ("ledger_topic", "ledger_kafka", "ledger_max_bytes", "ledger_max_age_s",
                        "metrics_registry")}
        if getattr(cfg, "ledger", None) is not None and "ledger_topic" not in own:
            own.update(ledger_topic=cfg.ledger.topic, ledger_kafka=cfg.ledger.kafka)
        return cls({**cfg.kafka, **overrides}, producer_name=producer_name,
                   ledger_dir=Path(cfg.ledger_dir) / "producer", **own)

    # -- hot path ------------------------------------------------------------------------
    def produce(
        self,
        topic: str,
        value: Any = None,
        key: Any = None,
        partition: int = -1,
        on_delivery: DeliveryCallback | None = None,
        callback: DeliveryCallback | None = None,
        timestamp: int = 0,
        headers: Any = None,
        *,
        audit_key: str | None = None,
    ) -> None:
        """Same as `Producer.produce` (same argument order), plus `audit_key` (the optional
        business idempotency key, sent as `audit.key`). Raises what Producer.produce raises;
        such a call still uses a seq and gets a `failed` ledger row. Headers the audit cannot
        stamp -- an unknown `audit.*` name, an `audit.seq`/`audit.ts` that is not a decimal
        integer, an `audit.pid` over 64 chars (`audit.core.headers.user_header_error`) -- raise
        InputError first: no seq used, nothing sent, no ledger row.

        (Replaced per instance by the closure `_hot_path` builds; this is its signature.)"""
        raise NotImplementedError  # pragma: no cover

    def _hot_path(self) -> Callable[..., None]:
        """Build produce() and the delivery callbacks as closures over locals: attribute
        lookups and per-call allocations are what an audited produce() costs beyond a plain one."""
        c_produce: Callable[..., None] = self._producer.produce
        assert self.ledger is not None
        header_error = audit_headers.user_header_error
        fingerprint = audit_headers.fingerprint
        append = self.ledger.append_formatted
        topics = self._topics
        counts = self._counts
        txn_current = self._txn_current
        txn_held = self._txn_held
        pid = self.pid
        pid_header = (_PID, pid.encode())
        packed = self.header_form == audit_headers.PACKED
        form = self.header_form
        pid_bytes = pid.encode()
        name = self.producer_name
        default_cb = self._default_cb
        only_errors = self._only_errors
        failed_call = self._failed_call
        emit_txn_row = self._emit_txn_row
        txn_outcome = self._txn_outcome
        last_ts: list[tuple[int, tuple[str, bytes]]] = [(-1, (_TS, b""))]
        pool: list[_Slot] = []
        pool_pop = pool.pop
        pool_push = pool.append

        def new_topic(topic: str) -> tuple[Iterator[int], _TopicFormats]:
            return topics.setdefault(topic, (count(), _TopicFormats(name, pid, str(topic))))

        def new_slot() -> _Slot:
            slot = _Slot()
            slot.dr = partial(deliver, slot)
            return slot

        def deliver(slot: _Slot, err: KafkaError | None, msg: Message) -> None:
            seq = slot.seq
            ts = slot.ts
            fmts = slot.fmts
            user_cb = slot.user_cb
            audit_key = slot.audit_key
            pool_push(slot)  # free before user code runs: it may raise
            if err is None:
                counts[0] += 1
                append((fmts.acked, seq, msg.partition(), msg.offset(), ts, time_ns() // 1_000_000))
            else:
                counts[1] += 1
                part = msg.partition()
                append((fmts.failed, seq, -1 if part is None else part, json.dumps(err.name()), ts,
                        json.dumps(audit_key if audit_key is not None else fingerprint(msg.key(), msg.value(), None))))
            if user_cb is not None:
                user_cb(err, msg)

        def deliver_txn(seq: int, ts: int, fmts: _TopicFormats, user_cb: DeliveryCallback | None, txn: int,
                        err: KafkaError | None, msg: Message) -> None:
            row: tuple[Any, ...]
            if err is None:
                counts[0] += 1
                row = (fmts, seq, msg.partition(), msg.offset(), "null", ts, time_ns() // 1_000_000)
            else:
                counts[1] += 1
                part = msg.partition()
                row = (fmts, seq, -1 if part is None else part, "null", json.dumps(err.name()), ts, "null")
            held = txn_held.get(txn)
            if held is not None:
                held.append(row)
            else:  # reported after commit/abort returned
                emit_txn_row(row, txn, txn_outcome[txn])
            if user_cb is not None:
                user_cb(err, msg)

        def produce(topic: str, value: Any = None, key: Any = None, partition: int = -1,
                    on_delivery: DeliveryCallback | None = None, callback: DeliveryCallback | None = None,
                    timestamp: int = 0, headers: Any = None, *, audit_key: str | None = None) -> None:
            if headers and (bad := header_error(headers)) is not None:  # before a seq is used: nothing written
                raise InputError(f"AuditedProducer.produce({topic!r}): {bad}")
            state = topics.get(topic)
            if state is None:
                state = new_topic(topic)
            counter, fmts = state
            seq = next(counter)
            ts = time_ns() // 1_000_000
            hdrs: list[tuple[str, Any]]
            if headers or audit_key is not None:
                hdrs = audit_headers.stamp(headers, pid, seq, ts, audit_key, form)
            elif packed:
                hdrs = [(_ID, b"%s/%d/%d" % (pid_bytes, seq, ts))]
            else:
                cached = last_ts[0]  # one read of an immutable pair: safe when threads share the producer
                if cached[0] == ts:
                    ts_header = cached[1]
                else:  # one header tuple per millisecond, not per message
                    ts_header = (_TS, b"%d" % ts)
                    last_ts[0] = (ts, ts_header)
                hdrs = [pid_header, (_SEQ, b"%d" % seq), ts_header]
            user_cb = on_delivery or callback or default_cb
            if only_errors and user_cb is not None:
                user_cb = partial(_only_errors_cb, user_cb)
            txn = txn_current[0]
            if txn is None:
                try:
                    slot = pool_pop()
                except IndexError:  # pool empty (it grows to the most messages ever in flight)
                    slot = new_slot()
                slot.seq = seq
                slot.ts = ts
                slot.fmts = fmts
                slot.user_cb = user_cb
                slot.audit_key = audit_key
                try:
                    c_produce(topic, value, key, partition, slot.dr, None, timestamp, hdrs)
                except BaseException as e:
                    pool_push(slot)  # no delivery report will come for it
                    failed_call(fmts, seq, ts, partition, e, None, fingerprint(key, value, hdrs))
                    raise
            else:
                try:
                    c_produce(topic, value, key, partition, partial(deliver_txn, seq, ts, fmts, user_cb, txn),
                              None, timestamp, hdrs)
                except BaseException as e:
                    failed_call(fmts, seq, ts, partition, e, txn)
                    raise

        produce.__doc__ = AuditedProducer.produce.__doc__
        return produce

    # -- rare paths ----------------------------------------------------------------------
    def _txn_json(self, txn: int) -> str:
        return json.dumps(f"{self._transactional_id}:{txn}")

    def _emit_txn_row(self, row: tuple[Any, ...], txn: int, outcome: str) -> None:
        fmts, seq, part, offset, err_json, ts, ack = row
        if outcome == "aborted":
            status = "aborted"
            self._counts[2] += 1
        else:
            status = "acked" if err_json == "null" else "failed"
        assert self.ledger is not None
        self.ledger.append_formatted((fmts.any, seq, part, offset, status, err_json, self._txn_json(txn), ts, ack))

    def _failed_call(self, fmts: _TopicFormats, seq: int, ts: int, partition: Any, exc: BaseException,
                     txn: int | None, fp: str | None = None) -> None:
        self._counts[1] += 1
        part = partition if isinstance(partition, int) and partition >= 0 else -1
        txn_json = self._txn_json(txn) if txn is not None else "null"
        assert self.ledger is not None
        item: tuple[Any, ...] = (fmts.any, seq, part, "null", "failed", json.dumps(_error_name(exc)), txn_json, ts, "null")
        if txn is None and fp is not None:
            item = (fmts.failed, seq, part, json.dumps(_error_name(exc)), ts, json.dumps(fp))
        self.ledger.append_formatted(item)
        if txn is not None and self._ledger_in_txn:
            self._txn_failed_calls.append((fmts, seq, item))

    def transaction_rows(self) -> list[tuple[bytes, str]]:
        """(key, line) of every ledger row of the open transaction as it will read once the
        transaction commits, for the caller to produce to the ledger topic inside it. Call it after
        `flush()`: a message whose delivery report has not been served yet has no row. Keys are
        `producer/txn:<pid>:<topic>:<seq>` (audit.clients.ledger_ship)."""
        txn = self._txn_current[0]
        if txn is None:
            return []
        out = []
        txn_json = self._txn_json(txn)
        for fmts, seq, part, offset, err_json, ts, ack in self._txn_held.get(txn, ()):
            status = "acked" if err_json == "null" else "failed"
            item = (fmts.any, seq, part, offset, status, err_json, txn_json, ts, ack)
            out.append((producer_txn_key(self.pid, fmts.topic, seq), fmts.any % item))
        for fmts, seq, item in self._txn_failed_calls:
            out.append((producer_txn_key(self.pid, fmts.topic, seq), item[0] % item))
        return out

    def _resolve_txn(self, txn: int, outcome: str) -> None:
        self._txn_outcome[txn] = outcome
        for row in self._txn_held.pop(txn, ()):
            self._emit_txn_row(row, txn, outcome)

    # -- the rest of the Producer API -----------------------------------------------------
    @property
    def raw_producer(self) -> Producer:
        """The wrapped `confluent_kafka.Producer`, for records that are not audited messages of
        their own but must ride in this producer's transaction (e.g. a consumer's retry copy,
        which keeps the original's audit headers). What goes through it gets no seq, no new
        headers and no ledger row."""
        return self._producer

    def poll(self, timeout: float = -1) -> int:
        return int(self._producer.poll(timeout))

    def flush(self, timeout: float = -1) -> int:
        """Producer.flush, then make every ledger row reported so far durable on disk."""
        left = int(self._producer.flush(timeout))
        self._ledger_flush()
        return left

    def _ledger_flush(self) -> None:
        if self._plugin is not None:
            self._plugin.flush(self.pid, 30.0)
        elif self.ledger is not None:
            self.ledger.flush()

    def __len__(self) -> int:
        return len(self._producer)

    def produce_batch(self, topic: str, messages: list[dict[str, Any]], partition: int = -1,
                      on_delivery: DeliveryCallback | None = None) -> int:
        """Like Producer.produce_batch, through produce() (librdkafka's batch call cannot carry
        headers); failed messages get an '_error' entry, as there."""
        queued = 0
        for m in messages:
            try:
                self.produce(topic, m.get("value"), m.get("key"), m.get("partition", partition),
                             m.get("callback") or on_delivery, None, m.get("timestamp", 0), m.get("headers"))
                queued += 1
            except BufferError:
                m["_error"] = KafkaError(KafkaError._QUEUE_FULL)
            except KafkaException as e:
                m["_error"] = e.args[0]
        return queued

    def init_transactions(self, *args: Any, **kwargs: Any) -> None:
        self._producer.init_transactions(*args, **kwargs)

    def begin_transaction(self) -> None:
        self._producer.begin_transaction()
        self._txn_no += 1
        self._txn_held[self._txn_no] = []
        self._txn_current[0] = self._txn_no
        self._txn_failed_calls.clear()

    def send_offsets_to_transaction(self, *args: Any, **kwargs: Any) -> None:
        self._producer.send_offsets_to_transaction(*args, **kwargs)

    def commit_transaction(self, *args: Any, **kwargs: Any) -> None:
        """Commit; on success the transaction's ledger rows are written (acked/failed).
        On failure nothing is written yet: retry the commit or abort, as librdkafka says."""
        self._producer.commit_transaction(*args, **kwargs)
        self._end_txn("committed")

    def abort_transaction(self, *args: Any, **kwargs: Any) -> None:
        """Abort; every message of the transaction gets an `aborted` ledger row."""
        self._producer.abort_transaction(*args, **kwargs)
        self._end_txn("aborted")

    def _end_txn(self, outcome: str) -> None:
        self._producer.poll(0)  # serve delivery reports librdkafka queued during the call
        txn = self._txn_current[0]
        if txn is not None:
            self._txn_current[0] = None
            self._resolve_txn(txn, outcome)

    def purge(self, *args: Any, **kwargs: Any) -> None:
        # Purged messages get delivery reports with _PURGE_* errors -> failed rows.
        self._producer.purge(*args, **kwargs)

    def list_topics(self, *args: Any, **kwargs: Any) -> Any:
        return self._producer.list_topics(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        # Anything else the wrapped Producer offers (cluster_id, set_sasl_credentials, ...).
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._producer, name)

    # -- stats and lifecycle -------------------------------------------------------------
    def stats(self) -> ProducerStats:
        in_flight = len(self._producer) if not self._closed else 0
        if self._plugin is not None:
            ps = self._plugin.stats(self.pid)
            if ps is None:  # pragma: no cover - the plugin always registers its producers
                raise LedgerError(f"the msgaudit plugin does not know producer {self.pid}")
            return ProducerStats(sent=ps.acked + ps.failed + in_flight, acked=ps.acked, failed=ps.failed,
                                 aborted=0, in_flight=in_flight, ledger_pending=ps.pending,
                                 ledger_dropped=ps.dropped)
        assert self.ledger is not None
        acked, failed, aborted = self._counts
        held = sum(len(rows) for rows in self._txn_held.values())
        return ProducerStats(
            sent=acked + failed + in_flight,
            acked=acked,
            failed=failed,
            aborted=aborted,
            in_flight=in_flight,
            ledger_pending=self.ledger.pending + held,
            ledger_topic_failed=self._shipper.stats.not_shipped_live if self._shipper is not None else 0,
        )

    def _register_metrics(self, registry: Any) -> None:
        from prometheus_client import REGISTRY
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        reg = REGISTRY if registry is True else registry
        producer = self

        class _Collector:
            # Read at scrape time: exporting costs the hot path nothing.
            def collect(self) -> Iterator[Any]:
                s = producer.stats()
                labels = [producer.producer_name, producer.pid]
                for metric, value, doc in (
                    ("sent", s.sent, "produce() calls, failed ones included"),
                    ("acked", s.acked, "messages acknowledged by the broker"),
                    ("failed", s.failed, "messages that failed (delivery report or produce() error)"),
                    ("aborted", s.aborted, "messages of aborted transactions"),
                ):
                    c = CounterMetricFamily(f"msgaudit_producer_{metric}", doc, labels=["producer", "pid"])
                    c.add_metric(labels, value)
                    yield c
                for metric, value, doc in (
                    ("in_flight", s.in_flight, "messages without a delivery report yet"),
                    ("ledger_pending", s.ledger_pending, "ledger rows not yet on disk"),
                ):
                    g = GaugeMetricFamily(f"msgaudit_producer_{metric}", doc, labels=["producer", "pid"])
                    g.add_metric(labels, value)
                    yield g

        self._collector = _Collector()
        reg.register(self._collector)
        self._metrics_registry = reg

    def close(self, timeout: float = 30.0) -> None:
        """Flush (purging what cannot be delivered in `timeout`, as failed rows), abort an open
        transaction, write the rows of any unresolved transaction as aborted, close the Kafka
        producer and seal the ledger. Idempotent."""
        if self._closed:
            return
        try:
            if self._producer.flush(timeout) > 0:
                # Give up on what is still queued: purged messages get failed rows
                # (_PURGE_QUEUE/_PURGE_INFLIGHT) instead of no row at all.
                self._producer.purge()
                self._producer.flush(5.0)
            if self._txn_current[0] is not None:
                with contextlib.suppress(KafkaException):
                    # A fatal/fenced producer cannot abort; the coordinator will. Rows say aborted below.
                    self._producer.abort_transaction(timeout)
                self._producer.poll(0)
                self._txn_current[0] = None
            for txn in list(self._txn_held):
                self._resolve_txn(txn, "aborted")
        finally:
            self._closed = True
            self._producer.close()  # the plugin seals its segment in on_destroy
            if self.ledger is not None:
                self.ledger.close()
            if self._shipper is not None:
                self._shipper.close(timeout)
            if self._metrics_registry is not None:
                self._metrics_registry.unregister(self._collector)

    def __enter__(self) -> AuditedProducer:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"AuditedProducer(producer_name={self.producer_name!r}, pid={self.pid!r}, ledger={self.ledger_dir}, mode={self.mode})"


__all__ = ["AuditedProducer", "ProducerStats", "DEFAULT_LEDGER_DIR"]
