"""A real MirrorMaker 2 process, run from the cached `kafka-mirror` jars with `java -cp`
(`org.apache.kafka.connect.mirror.MirrorMaker`, Kafka's dedicated MM2 mode), between two Kafka
clusters (e.g. two `LocalKafka` instances with their own data folder and port).

`LocalMirrorMaker` writes an `mm2.properties` for one replication flow `<source>-><target>` of the
given topics (the default replication policy names the copy `<source-alias>.<topic>`), starts,
SIGKILLs, restarts and stops the process, and keeps its log in `<data_dir>/mm2.log`. A secured
cluster's settings are msgaudit's own (librdkafka names: `kafka:` for the source, `mirrors[].kafka`
for the target, `LocalMirrorMaker.for_mirror`), translated to MM2's `<alias>.security.protocol`,
`<alias>.sasl.*`, `<alias>.ssl.*`; the secret ones (the JAAS line with the password, a key's
password) are written to `mm2-secrets.properties` (mode 0600) and named in `mm2.properties` (also
0600) as `${file:...}` references, resolved by Kafka's FileConfigProvider: MM2 keeps its connectors'
configs in a topic of the target cluster, which so never holds a password. MM2 keeps its
own state (source offsets, configs, status) in internal topics of the target cluster, so a
restarted process resumes from the last source offsets it flushed: a SIGKILL between two flushes
copies the records since the last flush again (MM2 is at-least-once unless its exactly-once
mode, `exactly_once=True`, is on). This module knows nothing about audit logic.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from audit.core.config import Config
from audit.core.errors import BrokerError, ConfigError
from audit.core.kafka_conf import internal_client_conf, java_client_settings
from audit.runtime import jars
from audit.runtime.jvm_service import JvmService, log4j2_file_config, properties_text, write_private

MIRROR_MAKER_MAIN = "org.apache.kafka.connect.mirror.MirrorMaker"
MANIFEST = "kafka-mirror"
SECRET_KEYS = ("sasl.jaas.config", "ssl.key.password", "ssl.keystore.key")  # never in mm2.properties
FILE_PROVIDER = "org.apache.kafka.common.config.provider.FileConfigProvider"

_LOG4J2 = log4j2_file_config("${sys:mm2.log.file}", {"org.apache.kafka.clients": "WARN",
                                                   "org.apache.kafka.common.utils.AppInfoParser": "WARN",
                                                   "org.reflections": "ERROR"})


def mirrored_topic(source_alias: str, topic: str) -> str:
    """The name MM2's default replication policy gives the copy of `topic` on the target."""
    return f"{source_alias}.{topic}"


class LocalMirrorMaker(JvmService):
    """One MM2 flow `source_alias -> target_alias` for `topics`, as a local process.

    `offset_flush_ms` is how often MM2 commits the source offsets it copied (a SIGKILL re-copies
    what came after the last flush); `groups` are the consumer groups whose committed offsets MM2
    checkpoints and translates to the target (`sync.group.offsets.enabled`); `source_kafka` /
    `target_kafka` are the clusters' librdkafka settings (security included; their
    `bootstrap.servers` is the one given); `extra` adds or overrides any mm2.properties key."""

    what = "MirrorMaker 2"
    state_name = "mm2.json"
    log_name = "mm2.log"

    def __init__(self, data_dir: Path | str, source_bootstrap: str, target_bootstrap: str,
                 topics: Sequence[str], source_alias: str = "source", target_alias: str = "target",
                 groups: Sequence[str] = (), offset_flush_ms: int = 2000, exactly_once: bool = False,
                 extra: Mapping[str, str] | None = None, source_kafka: Mapping[str, str] | None = None,
                 target_kafka: Mapping[str, str] | None = None) -> None:
        super().__init__(data_dir)
        self.source_bootstrap = source_bootstrap
        self.target_bootstrap = target_bootstrap
        self.topics = tuple(topics)
        self.source_alias = source_alias
        self.target_alias = target_alias
        self.groups = tuple(groups)
        self.offset_flush_ms = offset_flush_ms
        self.exactly_once = exactly_once
        self.extra = dict(extra or {})
        self.source_kafka = {**(source_kafka or {}), "bootstrap.servers": source_bootstrap}
        self.target_kafka = {**(target_kafka or {}), "bootstrap.servers": target_bootstrap}

    @classmethod
    def for_mirror(cls, data_dir: Path | str, cfg: Config, topic: str, mirror: str, **kw: Any) -> LocalMirrorMaker:
        """The MM2 flow that makes mirror `mirror` of `topic` as `cfg` describes it: from the
        cluster of `kafka:` to that of `mirrors[].kafka`, source alias `mirrors[].source_alias`,
        target alias the mirror's name. `kw`: the other arguments of the constructor."""
        m = next((m for m in cfg.topic(topic).mirrors if m.name == mirror), None)
        if m is None:
            raise ConfigError(f"{cfg.source}: topic {topic!r} has no mirror {mirror!r}")
        if m.topic != mirrored_topic(m.source_alias, topic):
            raise ConfigError(f"{cfg.source}: topics.{topic}.mirrors[{mirror}].topic is {m.topic!r}; MM2's default "
                              f"replication policy names the copy {mirrored_topic(m.source_alias, topic)!r}")
        return cls(data_dir, cfg.kafka.get("bootstrap.servers", ""), m.kafka["bootstrap.servers"], [topic],
                   source_alias=m.source_alias, target_alias=m.name, source_kafka=cfg.kafka, target_kafka=m.kafka, **kw)

    # -- configuration ---------------------------------------------------------------
    @property
    def flow(self) -> str:
        return f"{self.source_alias}->{self.target_alias}"

    def target_topic(self, topic: str) -> str:
        return mirrored_topic(self.source_alias, topic)

    @property
    def secrets_file(self) -> Path:
        return self.data_dir / "mm2-secrets.properties"

    def _security(self) -> tuple[dict[str, str], dict[str, str]]:
        """Each cluster's Java security settings as `<alias>.<key>` (a secret one as a `${file:...}`
        reference), and the secrets file's `<alias>.<key>` values."""
        props: dict[str, str] = {}
        secrets: dict[str, str] = {}
        for alias, kafka in ((self.source_alias, self.source_kafka), (self.target_alias, self.target_kafka)):
            settings = java_client_settings(kafka, f"MirrorMaker 2 (cluster {alias})")
            settings.pop("bootstrap.servers")
            for key, value in settings.items():
                if key in SECRET_KEYS:
                    secrets[f"{alias}.{key}"] = value
                    value = f"${{file:{self.secrets_file}:{alias}.{key}}}"
                props[f"{alias}.{key}"] = value
        if secrets:
            props.update({"config.providers": "file", "config.providers.file.class": FILE_PROVIDER})
        return props, secrets

    def properties(self) -> dict[str, str]:
        s, t, flow = self.source_alias, self.target_alias, self.flow
        props = {
            "clusters": f"{s}, {t}",
            f"{s}.bootstrap.servers": self.source_bootstrap,
            f"{t}.bootstrap.servers": self.target_bootstrap,
            f"{flow}.enabled": "true",
            f"{flow}.topics": "|".join(_regex_literal(x) for x in self.topics) or "^$",
            f"{flow}.groups": "|".join(_regex_literal(g) for g in self.groups) or "^$",
            f"{t}->{s}.enabled": "false",
            "tasks.max": "1",
            # the mirror connectors ship ServiceLoader manifests: skip the slow reflective class-path scan
            "plugin.discovery": "service_load",
            # one-node lab clusters: every topic MM2 creates has one replica
            "replication.factor": "1",
            "checkpoints.topic.replication.factor": "1",
            "heartbeats.topic.replication.factor": "1",
            "offset-syncs.topic.replication.factor": "1",
            "offset.storage.replication.factor": "1",
            "status.storage.replication.factor": "1",
            "config.storage.replication.factor": "1",
            # the target topic keeps the settings it was created with (e.g. LogAppendTime)
            "sync.topic.configs.enabled": "false",
            "sync.topic.acls.enabled": "false",
            "refresh.topics.interval.seconds": "2",
            "refresh.groups.interval.seconds": "2",
            "emit.checkpoints.interval.seconds": "1",
            "emit.heartbeats.interval.seconds": "1",
            "sync.group.offsets.enabled": "true" if self.groups else "false",
            "sync.group.offsets.interval.seconds": "1",
            "offset.flush.interval.ms": str(self.offset_flush_ms),
            # translate every committed offset exactly (an offset sync per record): the lab's
            # groups are small, and a coarse sync would make the translated offset approximate
            "offset.lag.max": "0",
        }
        # Connect worker settings apply only with the target cluster's prefix (MM2 builds each flow's
        # worker config from `<target>.`-prefixed keys); the plain keys above are kept for readers
        for key in ("plugin.discovery", "offset.flush.interval.ms"):
            props[f"{t}.{key}"] = props[key]
        if self.exactly_once:
            props[f"{t}.exactly.once.source.support"] = "enabled"
        props.update(self._security()[0])
        props.update(self.extra)
        return props

    # -- lifecycle -------------------------------------------------------------------
    def start(self) -> LocalMirrorMaker:
        """Start the MM2 process (returns at once; `wait_records` waits for the copies)."""
        if self.running():
            return self
        classpath = str(jars.jar_dir(MANIFEST) / "*")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        secrets = self._security()[1]
        if secrets:
            write_private(self.secrets_file, properties_text(secrets))
        props = write_private(self.data_dir / "mm2.properties", properties_text(self.properties()))
        self.launch(classpath, MIRROR_MAKER_MAIN, [str(props), "--clusters", self.target_alias], _LOG4J2,
                    "mm2.log.file")
        return self

    def restart(self) -> LocalMirrorMaker:
        self.stop()
        return self.start()

    def wait_records(self, topic: str, count: int, timeout: float = 90.0) -> int:
        """Wait until the copy of `topic` on the target holds at least `count` records (high
        watermark minus log start, summed over partitions); return what it holds."""
        deadline = time.monotonic() + timeout
        held = 0
        target = self.target_topic(topic)
        while time.monotonic() < deadline:
            self.check_alive("the copy")
            held = topic_size(self.target_kafka, target)
            if held >= count:
                return held
            time.sleep(0.5)
        raise BrokerError(f"MirrorMaker 2 copied {held} of {count} records of {topic!r} to {target!r} "
                          f"within {timeout:.0f}s; see {self.log_file}:\n{self.log_tail()}")

    def __enter__(self) -> LocalMirrorMaker:
        return self.start()


def _regex_literal(name: str) -> str:
    """A topic or group name as an MM2 regex that matches exactly it."""
    special = set(".^$*+?()[]{}|\\")
    return "".join("\\" + c if c in special else c for c in name)


def topic_size(kafka: Mapping[str, str] | str, topic: str) -> int:
    """Records a topic holds (high watermark - log start, summed); 0 when it does not exist yet.
    A partition that has no leader yet (a topic just created) counts 0, so a caller that polls
    keeps waiting. `kafka`: the cluster's librdkafka settings, or its bootstrap servers."""
    from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

    not_yet = {KafkaError.NOT_LEADER_FOR_PARTITION, KafkaError.LEADER_NOT_AVAILABLE,
               KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError._UNKNOWN_PARTITION}

    conf = {"bootstrap.servers": kafka} if isinstance(kafka, str) else dict(kafka)
    consumer: Any = Consumer(internal_client_conf(conf, **{"group.id": "msgaudit-topic-size", "log_level": 0}))
    try:
        md = consumer.list_topics(topic, timeout=5)
        meta = md.topics.get(topic)
        if meta is None or meta.error is not None:
            return 0
        total = 0
        for p, part in meta.partitions.items():
            if part.leader < 0:
                continue
            try:
                lo, hi = consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=5)
            except KafkaException as e:
                if e.args[0].code() in not_yet:
                    continue
                raise
            total += hi - lo
        return total
    finally:
        consumer.close()
