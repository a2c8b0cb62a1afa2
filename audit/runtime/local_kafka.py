"""A real local Kafka (KRaft mode) run from the cached jars with `java -cp`.

One node by default; `nodes=3` gives a small cluster (each node broker + controller) for the
replication faults of the lab. `secure=True` serves clients over SASL_SSL only (SCRAM-SHA-512, a
CA and broker certificate made here) with ACLs enforced (StandardAuthorizer;
the broker's own user `admin` is the super user); `client_config()` gives the settings to use. Everything binds to 127.0.0.1; data lives under
`<msgaudit home>/kafka/` by default (`$MSGAUDIT_HOME`, else `~/.cache/msgaudit`). This module starts, waits for, inspects and stops broker
processes; it knows nothing about audit logic.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import random
import secrets
import shutil
import signal
import socket
import subprocess
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from audit.core.errors import BrokerError
from audit.core.kafka_conf import jaas
from audit.runtime import jars
from audit.runtime.jvm_service import (
    java,
    log4j2_file_config,
    pid_alive,
    port_in_use,
    properties_text,
    terminate,
    wait_dead,
    wait_until,
    write_private,
)

KAFKA_MAIN = "kafka.Kafka"
STORAGE_TOOL = "kafka.tools.StorageTool"
# Features every new cluster is formatted with: share groups (KIP-932, "Queues for Kafka") with their
# dead-letter topics (KIP-1191: share.version=2, which needs metadata version 4.4-IV0, the default).
FEATURES = ["--feature", "share.version=2"]

_LOG4J2 = log4j2_file_config("${sys:kafka.logs.dir}/server.log",
                             {"org.apache.kafka": "INFO", "kafka": "INFO", "state.change.logger": "WARN"})


@dataclass(frozen=True)
class NodeSpec:
    node_id: int
    port: int
    controller_port: int
    data_dir: Path

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


def _ephemeral_low() -> int:
    """Lowest port of the kernel's ephemeral range (what outgoing connections get)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A free loopback port below the kernel's ephemeral range, so the next few ports are below it
    too. A port picked inside that range can be handed to an outgoing connection (a starting
    broker's own, to its peers) between picking it and binding it; below it only another listener
    can take it."""
    top = _ephemeral_low() - 64
    rng = random.SystemRandom()
    for _ in range(200 if top > 10_000 else 0):
        port = rng.randrange(10_000, top)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_port_block(n: int, preferred: int | None = None) -> int:
    """First port of `n` consecutive free loopback ports (`preferred` if that block is free)."""
    if preferred is not None and not any(port_in_use(p) for p in range(preferred, preferred + n)):
        return preferred
    for _ in range(100):
        port = free_port()
        if port + n < 65536 and not any(port_in_use(p) for p in range(port + 1, port + n)):
            return port
    raise BrokerError(f"no block of {n} free ports on 127.0.0.1")


class PortTaken(BrokerError):
    """A node could not bind its port: something else took it between picking and binding."""


def _bind_failed(node_dir: Path) -> bool:
    for name in ("server.log", "stdout.log"):
        try:
            with open(node_dir / name, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - 65536))
                if b"Address already in use" in f.read():
                    return True
        except OSError:
            continue
    return False


def new_cluster_id() -> str:
    """A random KRaft cluster id: 22 URL-safe base64 characters, never starting with '-'.

    Like Kafka's own `Uuid.randomUuid()`, ids that begin with '-' are skipped: command-line
    tools would read them as an option (1 in 64 random ids).
    """
    while True:
        cid = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if not cid.startswith("-"):
            return cid


SECURE_DIR = "secure"  # in the data folder: credentials.json and broker.pem (0600), ca.pem
SCRAM = "SCRAM-SHA-512"
SUPER_USER = "admin"


def make_certificates(folder: Path) -> None:
    """A CA (`ca.pem`, what clients trust) and the broker's key and certificate signed by it, for
    127.0.0.1 and localhost (`broker.pem`: key, certificate, CA; readable by its owner only)."""
    import ipaddress
    from datetime import UTC, datetime, timedelta

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    now = datetime.now(UTC)
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())

    def cert(subject: str, public: object, ca: bool) -> x509.Certificate:
        b = (x509.CertificateBuilder().subject_name(name(subject)).issuer_name(name("msgaudit local CA"))
             .public_key(public).serial_number(x509.random_serial_number())  # type: ignore[arg-type]
             .not_valid_before(now - timedelta(minutes=5)).not_valid_after(now + timedelta(days=3650))
             .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if not ca:
            b = b.add_extension(x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]), critical=False)
        return b.sign(ca_key, hashes.SHA256())

    ca_pem = cert("msgaudit local CA", ca_key.public_key(), True).public_bytes(serialization.Encoding.PEM)
    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    broker_pem = cert("localhost", key.public_key(), False).public_bytes(serialization.Encoding.PEM)
    (folder / "ca.pem").write_bytes(ca_pem)
    own = folder / "broker.pem"
    own.touch(mode=0o600)
    own.write_bytes(key_pem + broker_pem + ca_pem)


class LocalKafka:
    """A local KRaft cluster of `nodes` combined broker+controller processes.

    Client ports are `port, port+1, ...`; controller ports follow them. `port=None` picks a free
    block and, should another process take one of its ports before the broker binds it, starts
    again on a new block. `advertised` overrides the address a node advertises (the lab's fault
    proxy uses it to sit between client and broker).
    """

    def __init__(self, data_dir: Path | str | None = None, port: int | None = 9092, nodes: int = 1,
                 advertised: dict[int, str] | None = None, broker_config: dict[str, str] | None = None,
                 secure: bool | None = None) -> None:
        if nodes < 1:
            raise BrokerError(f"nodes must be >= 1, got {nodes}")
        self.data_dir = Path(data_dir) if data_dir else jars.msgaudit_home() / "kafka"
        # None: as the data folder was made (its storage holds the SCRAM credentials); plaintext when new.
        self.secure = (self.data_dir / SECURE_DIR / "credentials.json").exists() if secure is None else secure
        self.auto_port = port is None
        self.nodes: list[NodeSpec] = []
        self.move(free_port_block(2 * nodes) if port is None else port, nodes)
        self.advertised = advertised or {}
        self.broker_config = broker_config or {}

    def move(self, port: int, nodes: int | None = None, forget_storage: bool = False) -> None:
        """Place the nodes' ports at `port, port+1, ...` (before a start). `forget_storage`: remove
        the nodes' folders first (storage only a failed start formatted, for the old ports)."""
        if forget_storage:
            for node in self.nodes:
                shutil.rmtree(node.data_dir, ignore_errors=True)
        n = nodes or len(self.nodes)
        self.port = port
        self.nodes = [NodeSpec(i + 1, port + i, port + n + i, self.data_dir / f"node-{i + 1}") for i in range(n)]

    # -- configuration ---------------------------------------------------------------
    @property
    def bootstrap_servers(self) -> str:
        return ",".join(self.advertised.get(n.node_id, n.address) for n in self.nodes)

    def _properties(self, node: NodeSpec) -> dict[str, str]:
        n = len(self.nodes)
        rf = str(min(3, n))
        props = {
            "process.roles": "broker,controller",
            "node.id": str(node.node_id),
            "controller.quorum.voters": ",".join(f"{m.node_id}@127.0.0.1:{m.controller_port}" for m in self.nodes),
            "listeners": f"PLAINTEXT://127.0.0.1:{node.port},CONTROLLER://127.0.0.1:{node.controller_port}",
            "advertised.listeners": f"PLAINTEXT://{self.advertised.get(node.node_id, node.address)}",
            "controller.listener.names": "CONTROLLER",
            "inter.broker.listener.name": "PLAINTEXT",
            "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
            "log.dirs": str(node.data_dir / "logs"),
            "num.partitions": "1",
            "default.replication.factor": rf,
            "offsets.topic.replication.factor": rf,
            "offsets.topic.num.partitions": "4",
            "transaction.state.log.replication.factor": rf,
            "transaction.state.log.min.isr": "1",
            "transaction.state.log.num.partitions": "4",
            "share.coordinator.state.topic.replication.factor": rf,
            "share.coordinator.state.topic.min.isr": "1",
            "share.coordinator.state.topic.num.partitions": "4",
            # a share group may set an acquisition lock down to 1 s (the lab's scenarios do; default 15 s)
            "group.share.min.record.lock.duration.ms": "1000",
            "group.initial.rebalance.delay.ms": "0",
            "auto.create.topics.enable": "false",
            "log.retention.check.interval.ms": "1000",
            "log.segment.delete.delay.ms": "0",
            "log.flush.interval.messages": "9223372036854775807",
            "num.network.threads": "2",
            "num.io.threads": "2",
            "num.recovery.threads.per.data.dir": "1",
        }
        if self.secure:
            props.update(self._secure_properties(node))
        props.update(self.broker_config)
        return props

    # -- SASL/SCRAM over TLS with ACLs (secure=True) ------------------------------------
    def _secure_properties(self, node: NodeSpec) -> dict[str, str]:
        cred = self._credentials()
        sec = self.data_dir / SECURE_DIR
        return {
            "listeners": f"SASL_SSL://127.0.0.1:{node.port},CONTROLLER://127.0.0.1:{node.controller_port}",
            "advertised.listeners": f"SASL_SSL://{self.advertised.get(node.node_id, node.address)}",
            "inter.broker.listener.name": "SASL_SSL",
            # The controller listener stays on loopback without TLS: KRaft cannot check SCRAM there
            # (the credentials live in the metadata it serves), so its peers are User:ANONYMOUS.
            "listener.security.protocol.map": "SASL_SSL:SASL_SSL,CONTROLLER:PLAINTEXT",
            "sasl.enabled.mechanisms": SCRAM,
            "sasl.mechanism.inter.broker.protocol": SCRAM,
            f"listener.name.sasl_ssl.{SCRAM.lower()}.sasl.jaas.config": jaas(SUPER_USER, cred["admin"]),
            "ssl.keystore.type": "PEM",
            "ssl.keystore.location": str(sec / "broker.pem"),
            "ssl.truststore.type": "PEM",  # the broker is a client of its peers too
            "ssl.truststore.location": str(sec / "ca.pem"),
            "authorizer.class.name": "org.apache.kafka.metadata.authorizer.StandardAuthorizer",
            "super.users": f"User:{SUPER_USER};User:ANONYMOUS",
            "allow.everyone.if.no.acl.found": "false",
        }

    def _credentials(self) -> dict[str, str]:
        """The admin's password, made with the certificates on first use."""
        sec = self.data_dir / SECURE_DIR
        f = sec / "credentials.json"
        if f.exists():
            return dict(json.loads(f.read_text()))
        sec.mkdir(parents=True, exist_ok=True)
        sec.chmod(0o700)
        cred = {"admin": secrets.token_urlsafe(18)}
        make_certificates(sec)
        tmp = sec / "credentials.json.tmp"
        tmp.touch(mode=0o600)
        tmp.write_text(json.dumps(cred))
        tmp.rename(f)
        return cred

    def client_config(self, user: str = SUPER_USER, password: str | None = None) -> dict[str, str]:
        """librdkafka settings for a client of this cluster (as `user`; the admin by default).
        Plaintext: only bootstrap.servers."""
        conf = {"bootstrap.servers": self.bootstrap_servers}
        if self.secure:
            conf.update({"security.protocol": "SASL_SSL", "sasl.mechanism": SCRAM, "sasl.username": user,
                         "sasl.password": self._credentials()["admin"] if password is None else password,
                         "ssl.ca.location": str(self.data_dir / SECURE_DIR / "ca.pem")})
        return conf

    def write_admin_settings(self) -> Path:
        """`<data>/secure/admin.yaml`, readable by its owner only: `kafka:` with the admin's settings."""
        import yaml

        f = self.data_dir / SECURE_DIR / "admin.yaml"
        f.touch(mode=0o600)
        f.write_text(yaml.safe_dump({"kafka": self.client_config()}, sort_keys=False))
        return f

    def add_user(self, user: str, password: str) -> None:
        """Create (or reset) a SCRAM-SHA-512 user; it may do nothing until `grant` allows it."""
        from confluent_kafka.admin import ScramCredentialInfo, ScramMechanism, UserScramCredentialUpsertion

        info = ScramCredentialInfo(ScramMechanism.SCRAM_SHA_512, 8192)
        admin = self._admin()  # kept alive until the futures resolve
        futures = admin.alter_user_scram_credentials([UserScramCredentialUpsertion(user, info, password.encode())])
        for fut in futures.values():
            fut.result(timeout=30)

    def grant(self, user: str, operation: str, resource_type: str, name: str, prefixed: bool = False) -> None:
        """Allow `user` `operation` (READ, WRITE, DESCRIBE, DESCRIBE_CONFIGS, CREATE, ...) on
        `resource_type` (TOPIC, GROUP, TRANSACTIONAL_ID, BROKER: the cluster, named `kafka-cluster`) `name`
        from any host."""
        from confluent_kafka.admin import (
            AclBinding,
            AclOperation,
            AclPermissionType,
            ResourcePatternType,
            ResourceType,
        )

        binding = AclBinding(ResourceType[resource_type.upper()], name,
                             ResourcePatternType.PREFIXED if prefixed else ResourcePatternType.LITERAL,
                             f"User:{user}", "*", AclOperation[operation.upper()], AclPermissionType.ALLOW)
        admin = self._admin()
        for fut in admin.create_acls([binding]).values():
            fut.result(timeout=30)

    def _state_file(self) -> Path:
        return self.data_dir / "cluster.json"

    # -- lifecycle -------------------------------------------------------------------
    def _pids(self) -> dict[int, int]:
        try:
            state = json.loads(self._state_file().read_text())
        except (OSError, ValueError):
            return {}
        return {int(k): int(v) for k, v in state.get("pids", {}).items()}

    def running_nodes(self) -> list[int]:
        return [nid for nid, pid in self._pids().items() if pid_alive(pid)]

    def start(self, timeout: float = 60.0) -> LocalKafka:
        """Start every node (formatting storage on first use) and wait until clients are served."""
        attempts = 3 if self.auto_port else 1
        for attempt in range(attempts):
            fresh = not self.formatted()
            try:
                return self._start(timeout)
            except PortTaken:
                if attempt == attempts - 1:
                    raise
                self.move(free_port_block(2 * len(self.nodes)), forget_storage=fresh)
        raise AssertionError("unreachable")

    def formatted(self) -> bool:
        """Whether any node's storage is formatted (a start formats it)."""
        return any((n.data_dir / "logs" / "meta.properties").exists() for n in self.nodes)

    def _start(self, timeout: float) -> LocalKafka:
        java_bin = java()
        classpath = str(jars.jar_dir("kafka-broker") / "*")
        if self.running_nodes():
            if self.is_ready():
                return self
            self.stop()
        for node in self.nodes:
            for p in (node.port, node.controller_port):
                if port_in_use(p):
                    raise PortTaken(f"port {p} on 127.0.0.1 is already in use; stop what uses it or pass --port")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        cluster_id = self._cluster_id()
        pids: dict[str, int] = {}
        for node in self.nodes:
            pids[str(node.node_id)] = self._start_node(java_bin, classpath, node, cluster_id).pid
        self._state_file().write_text(json.dumps({"cluster_id": cluster_id, "pids": pids,
                                                  "bootstrap": self.bootstrap_servers}))
        try:
            self.wait_ready(timeout)
        except BaseException:
            self.stop(timeout=10)  # a start that failed leaves no JVM behind (the logs stay)
            raise
        return self

    def _cluster_id(self) -> str:
        f = self.data_dir / "cluster.id"
        if f.exists():
            return f.read_text().strip()
        cid = new_cluster_id()
        f.write_text(cid)
        return cid

    def _start_node(self, java_bin: str, classpath: str, node: NodeSpec, cluster_id: str) -> subprocess.Popen[bytes]:
        node.data_dir.mkdir(parents=True, exist_ok=True)
        props = write_private(node.data_dir / "server.properties", properties_text(self._properties(node)))
        log4j = node.data_dir / "log4j2.xml"
        log4j.write_text(_LOG4J2)
        jvm = [java_bin, "-Xms256m", "-Xmx512m", "-XX:+UseG1GC", "-Djava.awt.headless=true",
               f"-Dlog4j2.configurationFile={log4j}", f"-Dkafka.logs.dir={node.data_dir}", "-cp", classpath]
        if not (node.data_dir / "logs" / "meta.properties").exists():
            scram = ["--add-scram", f"{SCRAM}=[name={SUPER_USER},password={self._credentials()['admin']}]"] \
                if self.secure else []
            fmt = subprocess.run([*jvm, STORAGE_TOOL, "format", f"--cluster-id={cluster_id}", "-c", str(props),
                                  "--ignore-formatted", *FEATURES, *scram], capture_output=True, text=True)
            if fmt.returncode != 0:
                err = fmt.stderr.strip()[-400:]
                if self.secure:
                    err = err.replace(self._credentials()["admin"], "***")
                raise BrokerError(f"formatting node {node.node_id} storage failed: {err}")
        out = open(node.data_dir / "stdout.log", "ab")  # noqa: SIM115 - handed to the child
        return subprocess.Popen([*jvm, KAFKA_MAIN, str(props)], stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)

    def _admin(self) -> Any:
        from confluent_kafka.admin import AdminClient

        # log_level 0: connection-refused chatter while a node boots is expected, not news.
        return AdminClient({**self.client_config(), "bootstrap.servers": ",".join(n.address for n in self.nodes),
                            "log_level": 0})

    def is_ready(self) -> bool:
        try:
            md = self._admin().list_topics(timeout=2)
        except Exception:
            return False
        return len(md.brokers) == len(self.running_nodes()) > 0

    def wait_ready(self, timeout: float = 60.0) -> None:
        if not wait_until(lambda: self.is_ready() and self._coordinator_ready(), timeout, self._check_alive, 0.3):
            raise BrokerError(f"Kafka did not become ready within {timeout:.0f}s; see {self.log_hint(self.nodes[0].node_id)}")

    def _check_alive(self) -> None:
        dead = [nid for nid, pid in self._pids().items() if not pid_alive(pid)]
        if dead:
            if any(_bind_failed(n.data_dir) for n in self.nodes if n.node_id in dead):
                taken = ", ".join(str(p) for n in self.nodes for p in (n.port, n.controller_port))
                raise PortTaken(f"Kafka node(s) {dead} could not bind their ports ({taken}): another "
                                f"process uses one; see {self.log_hint(dead[0])}")
            raise BrokerError(f"Kafka node(s) {dead} exited during start-up; see {self.log_hint(dead[0])}")

    def _coordinator_ready(self) -> bool:
        """The group coordinator answers once __consumer_offsets can be created: ask it."""
        admin = self._admin()
        try:
            admin.list_consumer_groups(request_timeout=2).result()
            return True
        except Exception:
            return False

    def create_topics(self, names: list[str]) -> list[str]:
        """Create the topics of `names` this broker lacks (its default partitions and replication);
        return the ones created. Auto-creation is off here, so a config's topics exist only this way."""
        from confluent_kafka import KafkaError, KafkaException
        from confluent_kafka.admin import NewTopic

        admin = self._admin()
        missing = sorted(set(names) - set(admin.list_topics(timeout=10).topics))
        if not missing:
            return []
        created = []
        for name, fut in admin.create_topics([NewTopic(n, -1, -1) for n in missing]).items():
            try:
                fut.result(timeout=30)
                created.append(name)
            except KafkaException as e:
                if e.args[0].code() != KafkaError.TOPIC_ALREADY_EXISTS:
                    raise BrokerError(f"cannot create topic {name!r} on {self.bootstrap_servers}: {e.args[0].str()}") from e
        return sorted(created)

    def serves(self, bootstrap_servers: str) -> bool:
        """Whether a client's `bootstrap.servers` names one of this broker's nodes."""
        ports = {n.port for n in self.nodes}
        for server in bootstrap_servers.split(","):
            host, _, port = server.strip().rpartition(":")
            if host in ("127.0.0.1", "localhost") and port.isdigit() and int(port) in ports:
                return True
        return False

    def log_hint(self, node_id: int) -> Path:
        return self.data_dir / f"node-{node_id}" / "server.log"

    def kill_node(self, node_id: int, sig: int = signal.SIGKILL) -> None:
        """Kill one node (the lab's broker faults)."""
        pid = self._pids().get(node_id)
        if pid and pid_alive(pid):
            os.kill(pid, sig)
            wait_dead(pid, 30)

    def pid_of(self, node_id: int) -> int | None:
        """The OS pid of a running node, or None."""
        pid = self._pids().get(node_id)
        return pid if pid and pid_alive(pid) else None

    def pause_node(self, node_id: int) -> None:
        """Freeze a node (SIGSTOP): it keeps its sockets but stops fetching, like a stalled follower."""
        pid = self.pid_of(node_id)
        if pid is None:
            raise BrokerError(f"node {node_id} is not running")
        os.kill(pid, signal.SIGSTOP)

    def resume_node(self, node_id: int) -> None:
        pid = self.pid_of(node_id)
        if pid is None:
            raise BrokerError(f"node {node_id} is not running")
        os.kill(pid, signal.SIGCONT)

    def restart_node(self, node_id: int) -> None:
        node = next(n for n in self.nodes if n.node_id == node_id)
        pids = self._pids()
        pids[node_id] = self._start_node(java(), str(jars.jar_dir("kafka-broker") / "*"), node,
                                         self._cluster_id()).pid
        state = json.loads(self._state_file().read_text())
        state["pids"] = {str(k): v for k, v in pids.items()}
        self._state_file().write_text(json.dumps(state))

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM every node (a clean, controlled shutdown), SIGKILL stragglers."""
        terminate(list(self._pids().values()), timeout)
        if self._state_file().exists():
            self._state_file().unlink()

    def wipe(self) -> None:
        self.stop()
        shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> LocalKafka:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def cli_kafka(args: argparse.Namespace, cfg: Any) -> int:
    data_dir = Path(args.data_dir) if args.data_dir else Path(cfg.home) / "kafka"
    kafka = LocalKafka(data_dir, port=args.port, nodes=args.nodes, secure=True if getattr(args, "secure", False) else None)
    if args.action == "start":
        t0 = time.monotonic()
        kafka.start()
        print(f"kafka: {len(kafka.nodes)} node(s) ready at {kafka.bootstrap_servers} "
              f"in {time.monotonic() - t0:.1f}s (data in {data_dir})")
        if kafka.secure:
            print(f"kafka: SASL_SSL only ({SCRAM}, ACLs enforced); the admin's client settings (a `kafka:` "
                  f"block for msgaudit.yaml) are in {kafka.write_admin_settings()}")
        # the config's topics, when the config's clients point at this broker (auto-creation is off)
        if cfg.topics and kafka.serves(cfg.kafka.get("bootstrap.servers", "")):
            created = kafka.create_topics(list(cfg.topics))
            if created:
                print(f"kafka: created topic(s) {', '.join(created)} of {cfg.source}")
    elif args.action == "stop":
        running = kafka.running_nodes()
        kafka.stop()
        print(f"kafka: stopped {len(running)} node(s)")
    else:
        running = kafka.running_nodes()
        if running and kafka.is_ready():
            print(f"kafka: running, {len(running)} node(s) at {kafka.bootstrap_servers}")
        else:
            print("kafka: not running")
            return 1
    return 0
