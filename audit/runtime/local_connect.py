"""A real Kafka Connect worker in distributed mode, run from the cached `kafka-connect` jars with
`java -cp` (`org.apache.kafka.connect.cli.ConnectDistributed`), against a Kafka cluster (e.g. the
`LocalKafka` broker).

The class path holds Kafka's connect-runtime (and its FileStream connectors), Iceberg's sink
connector with its transforms (`KafkaMetadataTransform`) and what Iceberg's Hadoop (filesystem)
catalog needs on local disk. `LocalConnect` writes the worker's properties (its config, offset
and status topics live on the cluster, named after the worker's group), starts it, waits for its
REST API, submits connectors and waits for their tasks, and stops it; its log goes to
`<data_dir>/connect.log`, never to the terminal. This module knows nothing about audit logic.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from audit.core.errors import BrokerError, ConfigError
from audit.runtime import jars
from audit.runtime.jvm_service import (
    JvmService,
    log4j2_file_config,
    port_in_use,
    properties_text,
    wait_until,
    write_private,
)

CONNECT_MAIN = "org.apache.kafka.connect.cli.ConnectDistributed"
MANIFEST = "kafka-connect"
DEFAULT_PORT = 8083

_LOG4J2 = log4j2_file_config("${sys:connect.log.file}", {"org.apache.kafka.clients": "WARN",
                                                        "org.apache.kafka.common.utils.AppInfoParser": "WARN",
                                                        "org.apache.hadoop": "WARN", "org.apache.parquet": "WARN",
                                                        "org.reflections": "ERROR"})


class LocalConnect(JvmService):
    """One distributed Connect worker (group `group_id`) on `bootstrap`, REST on 127.0.0.1:`port`.

    `extra` adds or overrides any worker property."""

    what = "the Connect worker"
    state_name = "connect.json"
    log_name = "connect.log"

    def __init__(self, data_dir: Path | str, bootstrap: str, port: int = DEFAULT_PORT,
                 group_id: str = "msgaudit-connect", extra: Mapping[str, str] | None = None) -> None:
        super().__init__(data_dir)
        self.bootstrap = bootstrap
        self.port = port
        self.group_id = group_id
        self.extra = dict(extra or {})

    # -- configuration ---------------------------------------------------------------
    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def properties(self) -> dict[str, str]:
        g = self.group_id
        props = {
            "bootstrap.servers": self.bootstrap,
            "group.id": g,
            "listeners": self.url,
            "rest.advertised.host.name": "127.0.0.1",
            "rest.advertised.port": str(self.port),
            "config.storage.topic": f"{g}-configs",
            "offset.storage.topic": f"{g}-offsets",
            "status.storage.topic": f"{g}-status",
            # one-node lab clusters: every internal topic has one replica
            "config.storage.replication.factor": "1",
            "offset.storage.replication.factor": "1",
            "status.storage.replication.factor": "1",
            "offset.storage.partitions": "1",
            "status.storage.partitions": "1",
            "key.converter": "org.apache.kafka.connect.storage.StringConverter",
            "value.converter": "org.apache.kafka.connect.json.JsonConverter",
            "value.converter.schemas.enable": "false",
            "offset.flush.interval.ms": "1000",
            # every plugin on the class path ships ServiceLoader manifests: no slow reflective scan
            "plugin.discovery": "service_load",
            # a task whose rebalance is pending waits this long at most (a lab worker is alone)
            "scheduled.rebalance.max.delay.ms": "0",
        }
        props.update(self.extra)
        return props

    # -- lifecycle -------------------------------------------------------------------
    @classmethod
    def state_in(cls, data_dir: Path | str) -> dict[str, Any]:
        """What the worker started in `data_dir` recorded (pid, port, bootstrap); {} if none."""
        with contextlib.suppress(OSError, ValueError):
            return dict(json.loads((Path(data_dir) / cls.state_name).read_text()))
        return {}

    @classmethod
    def attach(cls, data_dir: Path | str) -> LocalConnect | None:
        """The worker running from `data_dir` (e.g. started by `msgaudit connect start --dir`), else None."""
        state = cls.state_in(data_dir)
        worker = cls(data_dir, str(state.get("bootstrap", "")), port=int(state.get("port", DEFAULT_PORT)))
        return worker if worker.running() else None

    def start(self, timeout: float = 120.0) -> LocalConnect:
        """Start the worker and wait until its REST API answers and it has joined its group."""
        if self.running():
            self.wait_ready(timeout)
            return self
        if port_in_use(self.port):
            raise BrokerError(f"port {self.port} on 127.0.0.1 is already in use; stop what uses it or pass --port")
        classpath = str(jars.jar_dir(MANIFEST) / "*")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        props = write_private(self.data_dir / "connect-distributed.properties", properties_text(self.properties()))
        self.launch(classpath, CONNECT_MAIN, [str(props)], _LOG4J2, "connect.log.file", heap="512m",
                    state={"port": self.port, "bootstrap": self.bootstrap})
        try:
            self.wait_ready(timeout)
        except BaseException:
            self.stop(timeout=10)  # a start that failed leaves no JVM behind (the log stays)
            raise
        return self

    def wait_ready(self, timeout: float = 120.0) -> None:
        def answers() -> bool:
            try:
                self.request("GET", "/connectors")  # answers once the worker has joined its group
                return True
            except (BrokerError, OSError):
                return False

        if not wait_until(answers, timeout, self.check_alive):
            raise BrokerError(f"the Connect worker did not answer on {self.url} within {timeout:.0f}s; see {self.log_file}")

    def __enter__(self) -> LocalConnect:
        return self.start()

    # -- REST ------------------------------------------------------------------------
    def request(self, method: str, path: str, body: Any = None) -> Any:
        """One call of the worker's REST API; its JSON answer (None when empty). An error status is a
        BrokerError carrying the worker's message."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json", "Accept": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                text = resp.read().decode()
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")
            with contextlib.suppress(ValueError):
                detail = json.loads(detail).get("message", detail)
            raise BrokerError(f"Connect {method} {path}: HTTP {e.code}: {detail}") from None
        return json.loads(text) if text.strip() else None

    def submit(self, name: str, config: Mapping[str, str]) -> None:
        """Create or update connector `name` with `config` (PUT /connectors/<name>/config)."""
        self.request("PUT", f"/connectors/{name}/config", {k: str(v) for k, v in config.items()})

    def connectors(self) -> list[str]:
        return sorted(self.request("GET", "/connectors") or [])

    def status(self, name: str) -> dict[str, Any]:
        return dict(self.request("GET", f"/connectors/{name}/status"))

    def delete(self, name: str) -> None:
        self.request("DELETE", f"/connectors/{name}")

    def wait_running(self, name: str, timeout: float = 60.0) -> dict[str, Any]:
        """Wait until the connector and each of its tasks are RUNNING; a FAILED one is a
        BrokerError with its trace's first line."""
        deadline = time.monotonic() + timeout
        status: dict[str, Any] = {}
        while time.monotonic() < deadline:
            try:
                status = self.status(name)
            except BrokerError:
                time.sleep(0.5)
                continue
            states = [status["connector"]] + list(status.get("tasks", []))
            failed = [s for s in states if s.get("state") == "FAILED"]
            if failed:
                trace = (failed[0].get("trace") or "").strip().splitlines()
                raise BrokerError(f"connector {name!r} failed: {trace[0] if trace else 'no trace'}; see {self.log_file}")
            if status.get("tasks") and all(s.get("state") == "RUNNING" for s in states):
                return status
            time.sleep(0.5)
        raise BrokerError(f"connector {name!r} is not running after {timeout:.0f}s: {status}; see {self.log_file}")


def create_topics(bootstrap: str, names: list[str], partitions: int = 1) -> None:
    """Create the topics of `names` the cluster lacks (one replica): e.g. the Iceberg sink's
    control topic, which the connector does not create."""
    from confluent_kafka import KafkaError, KafkaException
    from confluent_kafka.admin import AdminClient, NewTopic

    admin = AdminClient({"bootstrap.servers": bootstrap, "log_level": 0})
    missing = sorted(set(names) - set(admin.list_topics(timeout=10).topics))
    if not missing:
        return
    for name, fut in admin.create_topics([NewTopic(n, partitions, 1) for n in missing]).items():
        try:
            fut.result(timeout=30)
        except KafkaException as e:
            if e.args[0].code() != KafkaError.TOPIC_ALREADY_EXISTS:
                raise BrokerError(f"cannot create topic {name!r} on {bootstrap}: {e.args[0].str()}") from e


ICEBERG_SINK = "org.apache.iceberg.connect.IcebergSinkConnector"


def iceberg_sink_config(topic: str, table: str, warehouse: Path | str, control_topic: str,
                        **extra: str) -> dict[str, str]:
    """Iceberg's sink connector writing `topic` into `table` (`namespace.name`) of a Hadoop
    (filesystem) catalog at `warehouse`, committing every second, each row stamped with its Kafka
    coordinates by KafkaMetadataTransform (flat `_kafka_metadata_*` columns). `extra`: more
    connector properties, keys with dots (e.g. errors.tolerance)."""
    return {
        "connector.class": ICEBERG_SINK,
        "tasks.max": "1",
        "topics": topic,
        "iceberg.tables": table,
        "iceberg.tables.auto-create-enabled": "true",
        "iceberg.catalog.type": "hadoop",
        "iceberg.catalog.warehouse": str(warehouse),
        "iceberg.control.topic": control_topic,
        "iceberg.control.commit.interval-ms": "1000",
        "consumer.override.auto.offset.reset": "earliest",
        "transforms": "kafka",
        "transforms.kafka.type": "org.apache.iceberg.connect.transforms.KafkaMetadataTransform",
        **extra,
    }


def iceberg_control_topic(config: Mapping[str, Any]) -> str | None:
    """The control topic of an Iceberg sink connector's config (default `control-iceberg`), else None."""
    if config.get("connector.class") not in (ICEBERG_SINK, "IcebergSinkConnector"):
        return None
    return str(config.get("iceberg.control.topic", "control-iceberg"))


def cli_connect(args: argparse.Namespace, cfg: Any) -> int:
    data_dir = Path(args.dir) if args.dir else Path(cfg.home) / "connect"
    state = LocalConnect.state_in(data_dir)
    bootstrap = args.bootstrap or state.get("bootstrap") or cfg.kafka.get("bootstrap.servers")
    port = args.port or int(state.get("port", DEFAULT_PORT))
    if args.action == "start" and not bootstrap:
        raise ConfigError("connect start: no Kafka cluster; pass --bootstrap HOST:PORT or set kafka.bootstrap.servers "
                          "in the config")
    worker = LocalConnect(data_dir, bootstrap or "", port=port)
    if args.action == "start":
        t0 = time.monotonic()
        worker.start()
        print(f"connect: worker ready at {worker.url} on {bootstrap} in {time.monotonic() - t0:.1f}s "
              f"(log in {worker.log_file})")
    elif args.action == "stop":
        was = worker.running()
        worker.stop()
        print("connect: stopped" if was else "connect: not running")
    elif args.action == "submit":
        if not args.file:
            raise ConfigError("connect submit: pass the connector's JSON file ({\"name\": ..., \"config\": {...}})")
        try:
            spec = json.loads(Path(args.file).read_text())
        except (OSError, ValueError) as e:
            raise ConfigError(f"connect submit: cannot read {args.file}: {e}") from None
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str) or not isinstance(spec.get("config"), dict):
            raise ConfigError(f"connect submit: {args.file} must hold {{\"name\": ..., \"config\": {{...}}}}")
        if not worker.running():
            raise BrokerError(f"connect submit: no worker is running in {data_dir}; run `msgaudit connect start`")
        control = iceberg_control_topic(spec["config"])
        if control:  # Iceberg's sink does not create its control topic
            create_topics(worker.bootstrap, [control])
        worker.submit(spec["name"], spec["config"])
        status = worker.wait_running(spec["name"])
        print(f"connect: connector {spec['name']} running, {len(status['tasks'])} task(s)")
    else:
        if not worker.running():
            print("connect: not running")
            return 1
        names = worker.connectors()
        states = [f"{n} {worker.status(n)['connector']['state']}" for n in names]
        print(f"connect: running at {worker.url}; connectors: {', '.join(states) or 'none'}")
    return 0
