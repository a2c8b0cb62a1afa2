"""Where the lab's faults run: a local broker behind the fault proxy, or a local 3-node cluster.

`Lab` bundles what a scenario may use: the bootstrap servers clients connect to, the fault proxy
(when the broker advertises it), and the `LocalKafka` handle (when the lab owns the brokers and
may kill them). Against your own cluster, build a `Lab(bootstrap)` without either: the
scenarios that need them say so and refuse to run.

This module must not import Spark.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, cast

from audit.core.errors import BrokerError
from audit.core.headers import parse as parse_audit_headers
from audit.lab.proxy import FaultProxy
from audit.runtime.local_kafka import LocalKafka, PortTaken, free_port_block


@dataclass
class Lab:
    """What a scenario runs against. `kafka` is None for a cluster the lab does not own."""

    bootstrap: str
    proxy: FaultProxy | None = None
    kafka: LocalKafka | None = None

    def admin(self) -> Any:
        from confluent_kafka.admin import AdminClient

        return AdminClient({"bootstrap.servers": self.bootstrap, "log_level": 0})

    def create_topic(self, prefix: str, partitions: int = 1, replication: int = -1,
                     replica_assignment: list[list[int]] | None = None, **config: str) -> str:
        """A fresh uniquely named topic; `config` are topic settings with dots as underscores."""
        from confluent_kafka.admin import NewTopic

        name = f"{prefix}-{uuid.uuid4().hex[:8]}"
        conf = {k.replace("_", "."): str(v) for k, v in config.items()}
        if replica_assignment is not None:
            new = NewTopic(name, num_partitions=len(replica_assignment), replication_factor=-1,
                           replica_assignment=replica_assignment, config=conf)
        else:
            new = NewTopic(name, num_partitions=partitions, replication_factor=replication, config=conf)
        admin = self.admin()  # keep the handle alive until the future resolves
        try:
            admin.create_topics([new])[name].result(30)
        except Exception as e:
            raise BrokerError(f"cannot create topic {name!r} on {self.bootstrap}: {e}") from e
        _wait_for_leaders(admin, name, new.num_partitions)
        return name


def alter_configs(bootstrap: str, kind: str, name: str, settings: Mapping[str, Any], timeout: float = 30) -> None:
    """Set configs (dotted keys) of one resource, `kind` 'topic' or 'group' (a share group's), with
    incrementalAlterConfigs; a refusal raises BrokerError naming the resource and the settings."""
    from confluent_kafka.admin import (
        AdminClient,
        AlterConfigOpType,
        ConfigEntry,
        ConfigResource,
        ResourceType,
    )

    admin = AdminClient({"bootstrap.servers": bootstrap, "log_level": 0})  # alive until the futures resolve
    entries = [ConfigEntry(k, str(v), incremental_operation=AlterConfigOpType.SET) for k, v in settings.items()]
    resource = ConfigResource({"topic": ResourceType.TOPIC, "group": ResourceType.GROUP}[kind], name,
                              incremental_configs=entries)
    try:
        for fut in admin.incremental_alter_configs([resource]).values():
            fut.result(timeout)
    except Exception as e:
        raise BrokerError(f"lab: cannot set {kind} {name!r} configs {dict(settings)} on {bootstrap}: {e}") from e


Position = tuple[int, int]


def read_log(bootstrap: str, topic: str, timeout: float = 30.0) -> dict[Position, tuple[str | None, int | None]]:
    """Every record of `topic` a plain read_committed consumer reads up to the end of each
    partition: (partition, offset) -> the (pid, seq) of its audit headers (ground truth: the log
    as any consumer sees it)."""
    from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, TopicPartition

    c = Consumer({"bootstrap.servers": bootstrap, "group.id": f"lab-truth-{topic}", "enable.auto.commit": False,
                  "enable.partition.eof": True, "log_level": 0})
    out: dict[Position, tuple[str | None, int | None]] = {}
    try:
        partitions = c.list_topics(topic, timeout=10).topics[topic].partitions
        c.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in partitions])
        at_end: set[int] = set()
        deadline = time.monotonic() + timeout
        while len(at_end) < len(partitions):
            if time.monotonic() > deadline:
                raise BrokerError(f"lab: could not read {topic} to its end within {timeout:.0f}s")
            m = c.poll(0.5)
            if m is None:
                continue
            err = m.error()
            if err is not None:
                if err.code() == KafkaError._PARTITION_EOF:
                    at_end.add(int(m.partition() or 0))
                continue
            h = parse_audit_headers(cast(list[tuple[str, bytes | None]], list(m.headers() or [])))
            out[(int(m.partition() or 0), int(m.offset() or 0))] = (h.pid, h.seq)
    finally:
        c.close()
    return out


def _wait_for_leaders(admin: Any, topic: str, partitions: int, timeout: float = 30.0) -> None:
    """Return once every partition's leader answers ListOffsets. A created topic's metadata can name
    a leader before that broker leads the partition, and a scenario's first write would then meet
    NOT_LEADER_OR_FOLLOWER and a retry the scenario did not plan."""
    from confluent_kafka import TopicPartition
    from confluent_kafka.admin import OffsetSpec

    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        request = {TopicPartition(topic, p): OffsetSpec.latest() for p in range(partitions)}
        try:
            for future in admin.list_offsets(request, request_timeout=5).values():
                future.result(10)
            return
        except Exception as e:  # not led yet: ask again
            last = e
            time.sleep(0.1)
    raise BrokerError(f"topic {topic!r}: no partition leader answered within {timeout:.0f} s ({last}); "
                      f"is every broker of the cluster up?")


class ProxiedBroker:
    """A single local KRaft broker that advertises a fault proxy in front of itself."""

    def __init__(self, data_dir: Path | str, port: int | None = None,
                 broker_config: dict[str, str] | None = None) -> None:
        # One block for proxy, broker and controller (clients see the proxy at `port`, e.g. 9092): a
        # proxy on an ephemeral port could take the controller's port (the kernel hands them out in sequence).
        self.fixed_port = port is not None
        first = free_port_block(3, port)
        self.proxy = FaultProxy(f"127.0.0.1:{first + 1}", listen_port=first)
        self.kafka = LocalKafka(Path(data_dir), port=first + 1, nodes=1, advertised={1: self.proxy.address},
                                broker_config=broker_config)

    def start(self, timeout: float = 90.0) -> Lab:
        attempts = 1 if self.fixed_port else 3
        for attempt in range(attempts):
            fresh = not self.kafka.formatted()
            self.proxy.start()
            try:
                self.kafka.start(timeout)
                return self.lab
            except PortTaken:
                self.proxy.stop()
                if attempt == attempts - 1:
                    raise
                # Another process took the broker's or controller's port before it bound them.
                first = free_port_block(3)
                self.proxy = FaultProxy(f"127.0.0.1:{first + 1}", listen_port=first)
                self.kafka.move(first + 1, forget_storage=fresh)
                self.kafka.advertised = {1: self.proxy.address}
            except BaseException:
                self.proxy.stop()
                raise
        raise AssertionError("unreachable")

    @property
    def lab(self) -> Lab:
        return Lab(self.kafka.bootstrap_servers, self.proxy, self.kafka)

    def stop(self) -> None:
        try:
            self.kafka.stop()
        finally:
            self.proxy.stop()

    def __enter__(self) -> Lab:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


# Faster failure detection than the defaults, so a leader failover takes seconds, not half a minute.
CLUSTER_CONFIG = {
    "broker.session.timeout.ms": "3000",
    "broker.heartbeat.interval.ms": "500",
    "replica.lag.time.max.ms": "3000",
    "controller.quorum.fetch.timeout.ms": "2000",
    "controller.quorum.election.timeout.ms": "1000",
}


class LocalCluster:
    """A local 3-node KRaft cluster (combined broker+controller nodes) for replication faults."""

    def __init__(self, data_dir: Path | str, nodes: int = 3, port: int | None = None) -> None:
        self.kafka = LocalKafka(Path(data_dir), port=port, nodes=nodes, broker_config=dict(CLUSTER_CONFIG))

    def start(self, timeout: float = 120.0) -> Lab:
        self.kafka.start(timeout)
        return Lab(self.kafka.bootstrap_servers, None, self.kafka)

    def stop(self) -> None:
        self.kafka.stop()

    def __enter__(self) -> Lab:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
