"""A real MirrorMaker 2 process, run from the cached `kafka-mirror` jars with `java -cp`
(`org.apache.kafka.connect.mirror.MirrorMaker`, Kafka's dedicated MM2 mode), between two Kafka
clusters (e.g. two `LocalKafka` instances with their own data folder and port).

`LocalMirrorMaker` writes an `mm2.properties` for one replication flow `<source>-><target>` of the
given topics (the default replication policy names the copy `<source-alias>.<topic>`), starts,
SIGKILLs, restarts and stops the process, and keeps its log in `<data_dir>/mm2.log`. MM2 keeps its
own state (source offsets, configs, status) in internal topics of the target cluster, so a
restarted process resumes from the last source offsets it flushed: a SIGKILL between two flushes
copies the records since the last flush again (MM2 is at-least-once unless its exactly-once
mode, `exactly_once=True`, is on). This module knows nothing about audit logic.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from audit.core.errors import BrokerError
from audit.runtime import jars
from audit.runtime.local_kafka import _java, _pid_alive, _wait_dead, log4j2_file_config

MIRROR_MAKER_MAIN = "org.apache.kafka.connect.mirror.MirrorMaker"
MANIFEST = "kafka-mirror"

_LOG4J2 = log4j2_file_config("${sys:mm2.log.file}", {"org.apache.kafka.clients": "WARN",
                                                   "org.apache.kafka.common.utils.AppInfoParser": "WARN",
                                                   "org.reflections": "ERROR"})


def mirrored_topic(source_alias: str, topic: str) -> str:
    """The name MM2's default replication policy gives the copy of `topic` on the target."""
    return f"{source_alias}.{topic}"


class LocalMirrorMaker:
    """One MM2 flow `source_alias -> target_alias` for `topics`, as a local process.

    `offset_flush_ms` is how often MM2 commits the source offsets it copied (a SIGKILL re-copies
    what came after the last flush); `groups` are the consumer groups whose committed offsets MM2
    checkpoints and translates to the target (`sync.group.offsets.enabled`); `extra` adds or
    overrides any mm2.properties key."""

    def __init__(self, data_dir: Path | str, source_bootstrap: str, target_bootstrap: str,
                 topics: Sequence[str], source_alias: str = "source", target_alias: str = "target",
                 groups: Sequence[str] = (), offset_flush_ms: int = 2000, exactly_once: bool = False,
                 extra: Mapping[str, str] | None = None) -> None:
        self.data_dir = Path(data_dir)
        self.source_bootstrap = source_bootstrap
        self.target_bootstrap = target_bootstrap
        self.topics = tuple(topics)
        self.source_alias = source_alias
        self.target_alias = target_alias
        self.groups = tuple(groups)
        self.offset_flush_ms = offset_flush_ms
        self.exactly_once = exactly_once
        self.extra = dict(extra or {})
        self._proc: subprocess.Popen[bytes] | None = None

    # -- configuration ---------------------------------------------------------------
    @property
    def flow(self) -> str:
        return f"{self.source_alias}->{self.target_alias}"

    def target_topic(self, topic: str) -> str:
        return mirrored_topic(self.source_alias, topic)

    @property
    def log_file(self) -> Path:
        return self.data_dir / "mm2.log"

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
        props.update(self.extra)
        return props

    # -- lifecycle -------------------------------------------------------------------
    def _state_file(self) -> Path:
        return self.data_dir / "mm2.json"

    @property
    def pid(self) -> int | None:
        try:
            pid = int(json.loads(self._state_file().read_text())["pid"])
        except (OSError, ValueError, KeyError):
            return None
        return pid if _pid_alive(pid) else None

    def running(self) -> bool:
        return self.pid is not None

    def start(self) -> LocalMirrorMaker:
        """Start the MM2 process (returns at once; `wait_topic` waits for the first copy)."""
        if self.running():
            return self
        java = _java()
        classpath = str(jars.jar_dir(MANIFEST) / "*")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        props = self.data_dir / "mm2.properties"
        props.write_text("".join(f"{k}={v}\n" for k, v in self.properties().items()))
        log4j = self.data_dir / "log4j2.xml"
        log4j.write_text(_LOG4J2)
        out = open(self.data_dir / "stdout.log", "ab")  # noqa: SIM115 - handed to the child
        self._proc = subprocess.Popen(
            [java, "-Xms64m", "-Xmx384m", "-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1", "-Djava.awt.headless=true",
             f"-Dlog4j2.configurationFile={log4j}", f"-Dmm2.log.file={self.log_file}", "-cp", classpath,
             MIRROR_MAKER_MAIN, str(props), "--clusters", self.target_alias],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        self._state_file().write_text(json.dumps({"pid": self._proc.pid}))
        return self

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Kill the process (SIGKILL by default: no flush of the source offsets it copied)."""
        pid = self.pid
        if pid is not None:
            os.kill(pid, sig)
            if not _wait_dead(pid, 30):
                raise BrokerError(f"MirrorMaker 2 (pid {pid}) did not exit after signal {sig}")

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM (MM2 flushes its offsets and stops its connectors), SIGKILL if it hangs."""
        pid = self.pid
        if pid is None:
            return
        os.kill(pid, signal.SIGTERM)
        if not _wait_dead(pid, timeout):
            os.kill(pid, signal.SIGKILL)
            _wait_dead(pid, 5)

    def restart(self) -> LocalMirrorMaker:
        self.stop()
        return self.start()

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def wait_records(self, topic: str, count: int, timeout: float = 90.0) -> int:
        """Wait until the copy of `topic` on the target holds at least `count` records (high
        watermark minus log start, summed over partitions); return what it holds."""
        deadline = time.monotonic() + timeout
        held = 0
        target = self.target_topic(topic)
        while time.monotonic() < deadline:
            if self.pid is None:
                raise BrokerError(f"MirrorMaker 2 exited; see {self.log_file}:\n{self.log_tail()}")
            held = topic_size(self.target_bootstrap, target)
            if held >= count:
                return held
            time.sleep(0.5)
        raise BrokerError(f"MirrorMaker 2 copied {held} of {count} records of {topic!r} to {target!r} "
                          f"within {timeout:.0f}s; see {self.log_file}:\n{self.log_tail()}")

    def __enter__(self) -> LocalMirrorMaker:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _regex_literal(name: str) -> str:
    """A topic or group name as an MM2 regex that matches exactly it."""
    special = set(".^$*+?()[]{}|\\")
    return "".join("\\" + c if c in special else c for c in name)


def topic_size(bootstrap: str, topic: str) -> int:
    """Records a topic holds (high watermark - log start, summed); 0 when it does not exist yet."""
    from confluent_kafka import Consumer, TopicPartition

    consumer: Any = Consumer({"bootstrap.servers": bootstrap, "group.id": "msgaudit-topic-size", "log_level": 0})
    try:
        md = consumer.list_topics(topic, timeout=5)
        meta = md.topics.get(topic)
        if meta is None or meta.error is not None:
            return 0
        total = 0
        for p in meta.partitions:
            lo, hi = consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=5)
            total += hi - lo
        return total
    finally:
        consumer.close()
