"""msgaudit.yaml -> typed, immutable config objects (docs/design.md §8).

Parsing happens once, here; everything else receives a `Config`. Errors name the file and the
dotted key that is wrong. Secrets come only through `${ENV_VAR}` interpolation.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import yaml

from audit.core import vocabulary
from audit.core.errors import ConfigError

DEFAULT_CONFIG_FILE = "msgaudit.yaml"
DEFAULT_HOME = ".msgaudit"

_ENV_RE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
_DURATION_RE = re.compile(r"^\s*(\d+)\s*(ms|s|m|h|d)\s*$")
_DURATION_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}

SLA_RULES = vocabulary.SLA_RULES  # rule names; what each measures: audit.core.vocabulary.SLA_RULE_SPECS
AUDIT_COLUMNS = ("topic", "partition", "offset", "pid", "seq", "sink_ts")
# audit columns a sink may lack (read as null): the message's produce time (docs/design.md §4.2)
OPTIONAL_AUDIT_COLUMNS = ("produce_ts",)
SINK_AUDIT_COLUMNS = AUDIT_COLUMNS + OPTIONAL_AUDIT_COLUMNS  # every logical column a sink may map
# How a sink's rows name their message (docs/design.md §4.2 "Sinks that record Kafka coordinates"):
# `audit`, the audit columns above; `coordinates`, the record's (topic, partition, offset), resolved
# through the captured log; `packed_id`, one column holding the packed `audit.id` header value.
IDENTITIES = ("audit", "coordinates", "packed_id")
# identity -> (the keys `columns` may map, the keys it must map)
IDENTITY_KEYS: Mapping[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "audit": (SINK_AUDIT_COLUMNS, ()),
    "coordinates": (("topic", "partition", "offset", "sink_ts", "record_ts"), ("partition", "offset")),
    # a packed id's row whose message the log never held is placed in a window by its sink time alone
    "packed_id": (("id", "topic", "partition", "offset", "sink_ts"), ("id", "sink_ts")),
}
# a mapped source: a column, a nested struct field (`a.b`), or a field of a JSON text / variant column (`c:f`)
_SOURCE_RE = re.compile(r"^[^:.\s]+(\.[^:.\s]+)*(:[^:\s]+)?$")


def msgaudit_home() -> Path:
    """msgaudit's own folder for caches and local services: $MSGAUDIT_HOME, else the user cache
    folder ($XDG_CACHE_HOME/msgaudit, default ~/.cache/msgaudit)."""
    env = os.environ.get("MSGAUDIT_HOME")
    if env:
        return Path(env)
    cache = os.environ.get("XDG_CACHE_HOME")
    return (Path(cache) if cache else Path.home() / ".cache") / "msgaudit"


def parse_duration(value: Any, where: str) -> timedelta:
    """'1h', '15m', '30s', '1d', '250ms' or a number of seconds -> timedelta."""
    if isinstance(value, bool):
        raise ConfigError(f"{where}: expected a duration like 1h, 15m or 30s, got {value!r}")
    if isinstance(value, int | float):
        return timedelta(seconds=value)
    if isinstance(value, str):
        m = _DURATION_RE.match(value)
        if m:
            return timedelta(seconds=int(m.group(1)) * _DURATION_UNITS[m.group(2)])
    raise ConfigError(f"{where}: expected a duration like 1h, 15m or 30s, got {value!r}")


@dataclass(frozen=True)
class SlaRule:
    rule: str
    threshold: float
    severity: str = "error"


@dataclass(frozen=True)
class SinkConfig:
    """A user's sink table, read in place. `format` is 'delta' (location = path), 'sql'
    (url = SQLAlchemy/JDBC-able database URL, table = table name) or 'iceberg' (table =
    `namespace.name`; warehouse = a Hadoop (filesystem) catalog's root, or `catalog` = pyiceberg
    catalog properties, e.g. {type: rest, uri: ...})."""

    name: str
    format: str
    group: str | None = None
    location: str | None = None
    url: str | None = None
    table: str | None = None
    columns: Mapping[str, str] = field(default_factory=dict)
    warehouse: str | None = None
    catalog: Mapping[str, str] = field(default_factory=dict)
    identity: str = "audit"  # IDENTITIES
    # the topic whose `sinks` list holds this sink: the rows' topic when `columns` maps none
    topic: str | None = None
    # the sink connector's dead-letter topic (Kafka Connect's errors.deadletterqueue.topic.name):
    # its records name their source record by the __connect.errors.* headers (docs/design.md §4.2)
    dead_letter_topic: str | None = None

    @property
    def has_sink_time(self) -> bool:
        """Whether its rows carry a write time: the audit columns do; a coordinates or packed_id sink
        only when `columns.sink_ts` maps one (without it the sink latency is null, §7)."""
        return self.identity == "audit" or "sink_ts" in self.columns

    def column(self, logical: str) -> str:
        """Physical column name for a logical audit column (topic, partition, offset, pid, seq, sink_ts,
        produce_ts)."""
        return self.columns.get(logical, f"audit_{logical}")


@dataclass(frozen=True)
class MirrorConfig:
    """A copy of the topic on another Kafka cluster made by MirrorMaker 2 (stage `mirror:<name>`):
    `kafka` = the target cluster's librdkafka settings, `topic` = the copy's name there (default
    `<source_alias>.<topic>`, MM2's default replication policy). `failover_groups`: groups of the
    topic that may fail over to this copy (consumption rows with `cluster` = `name`, §5.5)."""

    name: str
    kafka: Mapping[str, str]
    topic: str
    source_alias: str = "source"
    failover_groups: tuple[str, ...] = ()


@dataclass(frozen=True)
class ShareGroupConfig:
    """A share group (KIP-932) reading the topic: `delivery_count_limit` is the broker's
    `group.share.delivery.count.limit` for it (default 5), at which an unaccepted record is archived.
    `dead_letter_topic` is the group's `errors.deadletterqueue.topic.name` (KIP-1191): the broker
    writes each record the group rejects or archives there, naming it by its __dlq.errors.* headers
    (docs/design.md §4.2)."""

    name: str
    delivery_count_limit: int = 5
    dead_letter_topic: str | None = None


@dataclass(frozen=True)
class TopicConfig:
    name: str
    window: timedelta = timedelta(hours=1)
    grace: timedelta = timedelta(minutes=15)
    lookback: timedelta | None = None  # default: one window
    sla: tuple[SlaRule, ...] = ()
    groups: tuple[str, ...] = ()
    sinks: tuple[SinkConfig, ...] = ()
    mirrors: tuple[MirrorConfig, ...] = ()
    share_groups: tuple[ShareGroupConfig, ...] = ()

    @property
    def lookback_or_window(self) -> timedelta:
        return self.lookback if self.lookback is not None else self.window

    @property
    def consuming_groups(self) -> tuple[str, ...]:
        """Every group whose consumption rows the topic's windows read: its consumer groups, then
        its share groups."""
        return self.groups + tuple(g.name for g in self.share_groups)


# The parallel collector: at 10M messages a window, G1 drivers ran out of a 4 GB heap that still had
# over a quarter free after full collections (Spark's 64 MB memory pages and sort buffers are
# humongous objects to G1, which does not move them when it compacts); the parallel collector ran
# the same windows in the same heap, and 1M-message windows 12-22 % faster.
# `reconcile.engine`: where a window's rules run (docs/design.md §5.8). `auto`: in the driver when the
# window's inputs hold at most DRIVER_ROWS rows, else in Spark tasks; `driver` / `spark` always there.
ENGINES = ("auto", "driver", "spark")

DRIVER_JVM_DEFAULTS: Mapping[str, str] = {"spark.driver.memory": "4g",
                                          "spark.driver.extraJavaOptions": "-XX:+UseParallelGC"}
# On a cluster the driver runs no task: it holds plans, the settled windows' anomaly rows and
# counts. The serial collector keeps its heap to what those need; the parallel one grows it for
# throughput, to half as much resident memory again at 1M messages, in the same time
# (docs/internals.md "The driver on a cluster").
CLUSTER_DRIVER_JVM: Mapping[str, str] = {"spark.driver.memory": "2g",
                                         "spark.driver.extraJavaOptions": "-XX:+UseSerialGC"}


@dataclass(frozen=True)
class LedgerTopicConfig:
    """`ledger: {topic: ..., kafka: {...}}`: the clients ship their ledger rows to `topic` (local
    segments stay the spool) and `msgaudit ingest` lands the topic instead of the local folder.
    `kafka` are librdkafka settings of the cluster that holds the topic (default: `kafka:`)."""

    topic: str
    kafka: Mapping[str, str]


def _parse_ledger(value: Any, kafka: Mapping[str, str], where: str) -> LedgerTopicConfig | None:
    if value is None:
        return None
    data = _mapping(value, where)
    _check_keys(data, ("topic", "kafka"), where)
    topic = data.get("topic")
    if not isinstance(topic, str) or not topic.strip():
        raise ConfigError(f"{where}.topic: expected a topic name, got {topic!r}")
    own = {str(k): str(v) for k, v in _mapping(data.get("kafka"), f"{where}.kafka").items()}
    # A separate cluster gets only its own settings; without bootstrap.servers the topic lives
    # on the data cluster and shares its settings (security included).
    merged = own if "bootstrap.servers" in own else {**kafka, **own}
    return LedgerTopicConfig(topic=topic.strip(), kafka=merged)


@dataclass(frozen=True)
class MetricsConfig:
    """`metrics:` (docs/design.md §8, §4.6): where the report store's figures go in Prometheus's format.
    `port`: `msgaudit follow` serves `/metrics` there (on `address`); `textfile`: each reconcile and
    SLA step rewrites this node_exporter textfile; `pushgateway`: each such step pushes to this URL
    under `job`; `partition_label`: the counters get a `partition` label (one series per partition)."""

    port: int | None = None
    address: str = "0.0.0.0"
    textfile: Path | None = None
    pushgateway: str | None = None
    job: str = "msgaudit"
    partition_label: bool = False


@dataclass(frozen=True)
class AlertsConfig:
    """`alerts:` (docs/design.md §8, §7.1): where each SLA check sends its failed rules, one notice per
    (topic, window, stage, rule). `alertmanager`: Alertmanager's base URL (API v2); `webhook`: a URL
    that gets each notice as a JSON POST; `active_for`: how long Alertmanager keeps a firing notice
    active without a new check; `timeout`: of each HTTP request."""

    alertmanager: str | None = None
    webhook: str | None = None
    active_for: timedelta = timedelta(hours=24)
    timeout: timedelta = timedelta(seconds=10)


@dataclass(frozen=True)
class AirflowConfig:
    """`airflow:` (docs/design.md §8, §6.5): where `msgaudit follow` posts its completeness events
    (Airflow 3's REST API, `POST /api/v2/assets/events`). `url`: the API server's base URL; `token`: a
    JWT sent as is, or `username` + `password`, exchanged for one at `<url>/auth/token`; `timeout`:
    of each HTTP request. Secrets are never shown (use `${ENV_VAR}` in the file)."""

    url: str | None = None
    token: str | None = field(default=None, repr=False)
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    timeout: timedelta = timedelta(seconds=10)


def _url(value: Any, where: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not re.match(r"^https?://[^/\s]+", value):
        raise ConfigError(f"{where}: expected an http:// or https:// URL, got {value!r}")
    return value.rstrip("/")


def _parse_metrics(value: Any, base: Path, where: str) -> MetricsConfig:
    data = _mapping(value, where)
    _check_keys(data, ("port", "address", "textfile", "pushgateway", "job", "partition_label"), where)
    port = data.get("port")
    if port is not None and (isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536):
        raise ConfigError(f"{where}.port: expected a TCP port (1-65535), got {port!r}")
    partition_label = data.get("partition_label", False)
    if not isinstance(partition_label, bool):
        raise ConfigError(f"{where}.partition_label: expected true or false, got {partition_label!r}")
    job = data.get("job", "msgaudit")
    if not isinstance(job, str) or not job:
        raise ConfigError(f"{where}.job: expected a job name, got {job!r}")
    textfile = data.get("textfile")
    if textfile is not None and (not isinstance(textfile, str) or not textfile.endswith(".prom")):
        raise ConfigError(f"{where}.textfile: expected a file name ending in .prom (node_exporter reads only "
                          f"those), got {textfile!r}")
    return MetricsConfig(port=port, address=str(data.get("address", "0.0.0.0")),
                         textfile=(base / textfile).resolve() if textfile else None,
                         pushgateway=_url(data.get("pushgateway"), f"{where}.pushgateway"), job=job,
                         partition_label=partition_label)


def _parse_alerts(value: Any, where: str) -> AlertsConfig:
    data = _mapping(value, where)
    _check_keys(data, ("alertmanager", "webhook", "active_for", "timeout"), where)
    return AlertsConfig(alertmanager=_url(data.get("alertmanager"), f"{where}.alertmanager"),
                        webhook=_url(data.get("webhook"), f"{where}.webhook"),
                        active_for=parse_duration(data.get("active_for", "24h"), f"{where}.active_for"),
                        timeout=parse_duration(data.get("timeout", "10s"), f"{where}.timeout"))


def _parse_airflow(value: Any, where: str) -> AirflowConfig:
    data = _mapping(value, where)
    _check_keys(data, ("url", "token", "username", "password", "timeout"), where)
    for key in ("token", "username", "password"):
        if data.get(key) is not None and (not isinstance(data[key], str) or not data[key]):
            raise ConfigError(f"{where}.{key}: expected a non-empty string")
    url = _url(data.get("url"), f"{where}.url")
    given = [k for k in ("token", "username", "password") if data.get(k) is not None]
    if given and url is None:
        raise ConfigError(f"{where}: {', '.join(given)} set without url; add airflow.url (the API server's "
                          "base URL, e.g. http://airflow:8080)")
    if data.get("token") is not None and (data.get("username") is not None or data.get("password") is not None):
        raise ConfigError(f"{where}: set either token or username + password, not both")
    if (data.get("username") is None) != (data.get("password") is None):
        raise ConfigError(f"{where}: username and password go together; set both (or a token instead)")
    return AirflowConfig(url=url, token=data.get("token"), username=data.get("username"),
                         password=data.get("password"),
                         timeout=parse_duration(data.get("timeout", "10s"), f"{where}.timeout"))


@dataclass(frozen=True)
class Config:
    source: str  # the file it came from, or "<defaults>"
    home: Path
    lake: str  # a Hadoop filesystem URI (s3a://bucket/lake, file:///srv/lake, ...) or an absolute local path
    ledger_dir: Path
    report_store: str
    kafka: Mapping[str, str]
    spark: Mapping[str, str]
    topics: Mapping[str, TopicConfig]
    ledger: LedgerTopicConfig | None = None  # `ledger: {topic, kafka}`: ledgers shipped through a topic
    engine: str = "auto"  # `reconcile.engine`: auto | driver | spark (ENGINES)
    metrics: MetricsConfig = MetricsConfig()  # `metrics:`: Prometheus exposition of the report store
    alerts: AlertsConfig = AlertsConfig()  # `alerts:`: where failed SLA rules are routed
    airflow: AirflowConfig = AirflowConfig()  # `airflow:`: where `follow` posts completeness events

    @property
    def ledger_topic(self) -> str | None:
        return self.ledger.topic if self.ledger is not None else None

    @property
    def spark_master(self) -> str:
        return self.spark.get("master", "local[2]")

    @property
    def driver_jvm(self) -> dict[str, str]:
        """Settings of the driver JVM itself (`DRIVER_JVM_DEFAULTS`, or `CLUSTER_DRIVER_JVM` on a master
        other than `local[...]`, unless `spark:` sets them). They take effect only where
        the JVM is started: by `build_spark`, or as spark-submit `--conf`s (the DAGs pass them); a
        running JVM ignores them."""
        defaults = DRIVER_JVM_DEFAULTS if self.spark_master.startswith("local") else CLUSTER_DRIVER_JVM
        return {k: self.spark.get(k, v) for k, v in defaults.items()}

    def topic(self, name: str) -> TopicConfig:
        try:
            return self.topics[name]
        except KeyError:
            known = ", ".join(sorted(self.topics)) or "none"
            raise ConfigError(f"{self.source}: unknown topic {name!r} (configured: {known})") from None

    def with_topics(self, topics: Mapping[str, TopicConfig]) -> Config:
        return replace(self, topics=dict(topics))


def _interpolate(value: Any, where: str) -> Any:
    if isinstance(value, str):
        def sub(m: re.Match[str]) -> str:
            name = m.group(1)
            if name not in os.environ:
                raise ConfigError(f"{where}: environment variable ${{{name}}} is not set")
            return os.environ[name]
        return _ENV_RE.sub(sub, value)
    if isinstance(value, dict):
        return {k: _interpolate(v, f"{where}.{k}") for k, v in value.items()}
    if isinstance(value, list):
        return [_interpolate(v, f"{where}[{i}]") for i, v in enumerate(value)]
    return value


def _check_keys(data: Mapping[str, Any], allowed: tuple[str, ...], where: str) -> None:
    for key in data:
        if key not in allowed:
            raise ConfigError(f"{where}: unknown key {key!r} (allowed: {', '.join(allowed)})")


def _mapping(value: Any, where: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: expected a mapping, got {type(value).__name__}")
    return value


def _parse_sla(raw: Any, where: str) -> tuple[SlaRule, ...]:
    data = _mapping(raw, where)
    _check_keys(data, SLA_RULES, where)
    rules = []
    for rule, spec in data.items():
        w = f"{where}.{rule}"
        severity = "error"
        if isinstance(spec, dict):
            _check_keys(spec, ("threshold", "severity"), w)
            if "threshold" not in spec:
                raise ConfigError(f"{w}: missing key 'threshold'")
            severity = spec.get("severity", "error")
            spec = spec["threshold"]
        if isinstance(spec, bool) or not isinstance(spec, int | float):
            raise ConfigError(f"{w}: expected a number, got {spec!r}")
        if severity not in ("error", "warn"):
            raise ConfigError(f"{w}.severity: expected 'error' or 'warn', got {severity!r}")
        rules.append(SlaRule(rule, float(spec), severity))
    return tuple(rules)


def _parse_sink(raw: Any, where: str, base: Path, topic: str | None = None) -> SinkConfig:
    data = _mapping(raw, where)
    _check_keys(data, ("name", "format", "location", "url", "table", "group", "columns", "identity", "warehouse",
                       "catalog", "dead_letter_topic"), where)
    dlq = data.get("dead_letter_topic")
    if dlq is not None and (not isinstance(dlq, str) or not dlq.strip()):
        raise ConfigError(f"{where}.dead_letter_topic: expected the connector's errors.deadletterqueue.topic.name, "
                          f"got {dlq!r}")
    for req in ("name", "format"):
        if req not in data:
            raise ConfigError(f"{where}: missing key {req!r}")
    fmt = data["format"]
    if fmt not in ("delta", "sql", "iceberg"):
        raise ConfigError(f"{where}.format: expected 'delta', 'sql' or 'iceberg', got {fmt!r}")
    if fmt == "delta" and not data.get("location"):
        raise ConfigError(f"{where}: a delta sink needs 'location'")
    if fmt == "sql" and not (data.get("url") and data.get("table")):
        raise ConfigError(f"{where}: a sql sink needs 'url' and 'table'")
    identity = data.get("identity", "audit")
    if identity not in IDENTITIES:
        raise ConfigError(f"{where}.identity: expected one of {', '.join(IDENTITIES)} (how the sink's rows name "
                          f"their message), got {identity!r}")
    columns = _mapping(data.get("columns"), f"{where}.columns")
    allowed, required = IDENTITY_KEYS[identity]
    for key in columns:
        if key not in allowed:
            raise ConfigError(f"{where}.columns: unknown key {key!r} for identity {identity} "
                              f"(allowed: {', '.join(allowed)})")
    for key in required:
        if key not in columns:
            raise ConfigError(f"{where}.columns: missing key {key!r} (identity {identity} needs "
                              f"{' and '.join(required)} mapped to the table's column or field)")
    for key, value in columns.items():
        if identity != "audit" and (not isinstance(value, str) or not _SOURCE_RE.match(value)):
            raise ConfigError(f"{where}.columns.{key}: expected a column name, a nested field (a.b) or a field of "
                              f"a JSON or variant column (c:f), got {value!r}")
    location = data.get("location")
    if fmt == "delta" and location:
        location = storage_location(location, base, f"{where}.location")
    catalog = {str(k): str(v) for k, v in _mapping(data.get("catalog"), f"{where}.catalog").items()}
    warehouse = data.get("warehouse")
    if fmt == "iceberg":
        table = data.get("table")
        if not isinstance(table, str) or "." not in table.strip("."):
            raise ConfigError(f"{where}.table: an iceberg sink needs its table as 'namespace.name', got {table!r}")
        if not warehouse and not catalog:
            raise ConfigError(f"{where}: an iceberg sink needs 'warehouse' (the root of a Hadoop catalog) "
                              "or 'catalog' (pyiceberg catalog properties)")
        if warehouse:
            warehouse = storage_location(warehouse, base, f"{where}.warehouse")
    elif "warehouse" in data or "catalog" in data:
        raise ConfigError(f"{where}: 'warehouse' and 'catalog' are keys of an iceberg sink, not of a {fmt} one")
    return SinkConfig(
        name=str(data["name"]),
        format=fmt,
        group=data.get("group"),
        location=location,
        url=_resolve_sqlite(data.get("url"), base),
        table=data.get("table"),
        columns={k: str(v) for k, v in columns.items()},
        warehouse=warehouse,
        catalog=catalog,
        identity=identity,
        topic=topic,
        dead_letter_topic=dlq,
    )


def _parse_mirror(topic: str, raw: Any, where: str) -> MirrorConfig:
    data = _mapping(raw, where)
    _check_keys(data, ("name", "kafka", "topic", "source_alias", "failover_groups"), where)
    for req in ("name", "kafka"):
        if req not in data:
            raise ConfigError(f"{where}: missing key {req!r}")
    kafka = {str(k): str(v) for k, v in _mapping(data["kafka"], f"{where}.kafka").items()}
    if not kafka.get("bootstrap.servers"):
        raise ConfigError(f"{where}.kafka: missing key 'bootstrap.servers' (the target cluster of the mirror)")
    alias = str(data.get("source_alias", "source"))
    if not alias:
        raise ConfigError(f"{where}.source_alias: must not be empty")
    failover = data.get("failover_groups") or []
    if not isinstance(failover, list) or not all(isinstance(g, str) and g for g in failover):
        raise ConfigError(f"{where}.failover_groups: expected a list of group names, got {failover!r}")
    return MirrorConfig(name=str(data["name"]), kafka=kafka, topic=str(data.get("topic") or f"{alias}.{topic}"),
                        source_alias=alias, failover_groups=tuple(failover))


def _parse_share_groups(raw: Any, groups: list[str], where: str) -> tuple[ShareGroupConfig, ...]:
    """`share_groups: [name, {name: ..., delivery_count_limit: n, dead_letter_topic: t}, ...]`."""
    if not isinstance(raw, list):
        raise ConfigError(f"{where}: expected a list of share group names or "
                          "{name, delivery_count_limit, dead_letter_topic}")
    out: list[ShareGroupConfig] = []
    for i, item in enumerate(raw):
        w = f"{where}[{i}]"
        data = {"name": item} if isinstance(item, str) else _mapping(item, w)
        _check_keys(data, ("name", "delivery_count_limit", "dead_letter_topic"), w)
        g, limit, dlq = data.get("name"), data.get("delivery_count_limit", 5), data.get("dead_letter_topic")
        if not isinstance(g, str) or not g:
            raise ConfigError(f"{w}.name: expected a share group name, got {g!r}")
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
            raise ConfigError(f"{w}.delivery_count_limit: expected a whole number >= 1, got {limit!r}")
        if dlq is not None and (not isinstance(dlq, str) or not dlq.strip()):
            raise ConfigError(f"{w}.dead_letter_topic: expected the group's errors.deadletterqueue.topic.name, "
                              f"got {dlq!r}")
        if g in groups:
            raise ConfigError(f"{w}: group {g!r} is in both groups and share_groups; a group is a consumer "
                              "group or a share group, list it once")
        if any(o.name == g for o in out):
            raise ConfigError(f"{w}: share group {g!r} is listed twice")
        out.append(ShareGroupConfig(g, limit, dlq))
    return tuple(out)


def _parse_topic(name: str, raw: Any, where: str, base: Path) -> TopicConfig:
    data = _mapping(raw, where)
    _check_keys(data, ("window", "grace", "lookback", "sla", "groups", "sinks", "mirrors", "share_groups"), where)
    groups = data.get("groups") or []
    if not isinstance(groups, list) or not all(isinstance(g, str) for g in groups):
        raise ConfigError(f"{where}.groups: expected a list of group names")
    share_groups = _parse_share_groups(data.get("share_groups") or [], groups, f"{where}.share_groups")
    sinks_raw = data.get("sinks") or []
    if not isinstance(sinks_raw, list):
        raise ConfigError(f"{where}.sinks: expected a list")
    sinks = tuple(_parse_sink(s, f"{where}.sinks[{i}]", base, name) for i, s in enumerate(sinks_raw))
    names = [s.name for s in sinks]
    if len(set(names)) != len(names):
        raise ConfigError(f"{where}.sinks: sink names must be unique, got {names}")
    for s in sinks:
        if s.group is not None and s.group not in groups:
            raise ConfigError(f"{where}.sinks: sink {s.name!r} is fed by group {s.group!r}, which is not in groups")
    mirrors_raw = data.get("mirrors") or []
    if not isinstance(mirrors_raw, list):
        raise ConfigError(f"{where}.mirrors: expected a list")
    mirrors = tuple(_parse_mirror(name, m, f"{where}.mirrors[{i}]") for i, m in enumerate(mirrors_raw))
    if len({m.name for m in mirrors}) != len(mirrors):
        raise ConfigError(f"{where}.mirrors: mirror names must be unique, got {[m.name for m in mirrors]}")
    for i, m in enumerate(mirrors):
        for g in m.failover_groups:
            if g not in groups:
                raise ConfigError(f"{where}.mirrors[{i}].failover_groups: group {g!r} is not in the topic's groups")
            if any(g in other.failover_groups for other in mirrors[:i]):
                raise ConfigError(f"{where}.mirrors[{i}].failover_groups: group {g!r} already fails over to "
                                  "another mirror of the topic (one at most)")
    topic = TopicConfig(
        name=name,
        window=parse_duration(data.get("window", "1h"), f"{where}.window"),
        grace=parse_duration(data.get("grace", "15m"), f"{where}.grace"),
        lookback=parse_duration(data["lookback"], f"{where}.lookback") if "lookback" in data else None,
        sla=_parse_sla(data.get("sla"), f"{where}.sla"),
        groups=tuple(groups),
        sinks=sinks,
        mirrors=mirrors,
        share_groups=share_groups,
    )
    if topic.window <= timedelta(0) or timedelta(days=1) % topic.window:
        raise ConfigError(f"{where}.window: must divide a day evenly (e.g. 5m, 15m, 1h), got {data.get('window')!r}")
    return topic


_URI_RE = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def is_uri(location: str) -> bool:
    """True for 'scheme://...' (a Hadoop filesystem URI), False for a plain path."""
    return bool(_URI_RE.match(location))


def storage_location(value: Any, base: Path, where: str) -> str:
    """A storage location Spark reads or writes: a Hadoop filesystem URI is kept as written
    (`s3a://`, `abfss://`, `gs://`, `hdfs://`; a trailing '/' dropped), a plain path is a local
    folder, resolved against the config file's folder. `file:///p` is the local folder `/p`, kept
    as the plain path: Delta records a table's location as `file:/p`, and a `file:///p` beside it
    is another path to Delta's CREATE TABLE (DELTA_AMBIGUOUS_PATHS_IN_CREATE_TABLE)."""
    if not isinstance(value, str | os.PathLike) or not str(value).strip():
        raise ConfigError(f"{where}: expected a path or a URI like s3a://bucket/lake, got {value!r}")
    text = str(value).strip()
    if text.startswith("file:///") and text.rstrip("/") != "file:":
        return str(Path(text[len("file://"):]).resolve())
    if is_uri(text):
        scheme, rest = text.split("://", 1)
        if not rest.strip("/"):
            raise ConfigError(f"{where}: {text!r} names no bucket or folder")
        return text if text.endswith(":///") else text.rstrip("/")
    return str((base / text).resolve())


def join_location(root: str, *names: str) -> str:
    """`root`/`name`/... for a URI or a local path, with '/' (never pathlib: it would fold the
    '//' of 's3a://bucket' into one)."""
    return "/".join([root.rstrip("/"), *(n.strip("/") for n in names)])


def _resolve_sqlite(url: str | None, base: Path) -> str | None:
    """Relative SQLite paths are relative to the config file, like every other path."""
    if url and url.startswith("sqlite:///") and not url.startswith("sqlite:////"):
        rel = url[len("sqlite:///"):]
        if rel and rel != ":memory:":
            return "sqlite:///" + str((base / rel).resolve())
    return url


def from_dict(data: Mapping[str, Any], source: str = "<dict>", base: Path | None = None) -> Config:
    base = (base or Path.cwd()).resolve()
    data = _interpolate(dict(data), source)
    _check_keys(data, ("home", "lake", "ledger_dir", "ledger", "report_store", "kafka", "spark", "reconcile",
                       "topics", "metrics", "alerts", "airflow"), source)
    reconcile = _mapping(data.get("reconcile"), f"{source}: reconcile")
    _check_keys(reconcile, ("engine",), f"{source}: reconcile")
    engine = reconcile.get("engine", "auto")
    if engine not in ENGINES:
        raise ConfigError(f"{source}: reconcile.engine: expected one of {', '.join(ENGINES)} (auto: the driver for "
                          f"small windows, Spark tasks for the others), got {engine!r}")
    home = base / str(data.get("home", DEFAULT_HOME))
    kafka = {str(k): str(v) for k, v in _mapping(data.get("kafka"), f"{source}: kafka").items()}
    kafka.setdefault("bootstrap.servers", "127.0.0.1:9092")
    spark = {str(k): str(v) for k, v in _mapping(data.get("spark"), f"{source}: spark").items()}
    topics_raw = _mapping(data.get("topics"), f"{source}: topics")
    topics = {str(n): _parse_topic(str(n), t, f"{source}: topics.{n}", base) for n, t in topics_raw.items()}
    report_store = data.get("report_store", f"sqlite:///{home / 'report.db'}")
    if not isinstance(report_store, str) or "://" not in report_store:
        raise ConfigError(f"{source}: report_store: expected a SQLAlchemy URL, got {report_store!r}")
    return Config(
        source=source,
        home=home.resolve(),
        lake=storage_location(data.get("lake", str(home / "lake")), base, f"{source}: lake"),
        ledger_dir=(base / str(data.get("ledger_dir", home / "ledger"))).resolve(),
        report_store=_resolve_sqlite(report_store, base) or report_store,
        kafka=kafka,
        spark=spark,
        topics=topics,
        ledger=_parse_ledger(data.get("ledger"), kafka, f"{source}: ledger"),
        engine=engine,
        metrics=_parse_metrics(data.get("metrics"), base, f"{source}: metrics"),
        alerts=_parse_alerts(data.get("alerts"), f"{source}: alerts"),
        airflow=_parse_airflow(data.get("airflow"), f"{source}: airflow"),
    )


def load(path: str | os.PathLike[str] | None = None) -> Config:
    """Load a config file. With no path: ./msgaudit.yaml if it exists, else embedded defaults."""
    if path is None:
        default = Path(DEFAULT_CONFIG_FILE)
        if not default.exists():
            return from_dict({}, source="<defaults>")
        path = default
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"{p}: config file not found (pass --config FILE, or run without it for the defaults)")
    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        raise ConfigError(f"{p}: not valid YAML: {e}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: expected a mapping at the top level")
    return from_dict(data, source=str(p), base=p.resolve().parent)
