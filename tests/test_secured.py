"""A secured cluster, end to end (docs/design.md §8, "Secured clusters"): the local broker started with
SASL_SSL only (SCRAM-SHA-512, its own CA) and ACLs enforced, and msgaudit's components run against it
with config alone -- AuditedProducer and a plain producer on the librdkafka plugin, each shipping its ledger to the
ledger topic, AuditedConsumer, `msgaudit doctor`, capture through Spark's Kafka source, the ingest of the ledger
topic, the Java producer and consumer interceptors shipping theirs, and MirrorMaker 2 (secured to secured, on the
one broker) audited by capture. A user without the needed ACL gets one line naming the missing permission; no
password appears in any log, error or output.

One broker for the module (about 30 s to start on a loaded machine); each user's ACLs are granted once.
"""

from __future__ import annotations

import re
import secrets
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml

from audit.core import config as config_mod
from audit.core.config import Config
from audit.core.errors import BrokerError
from audit.runtime.local_kafka import LocalKafka

TOPIC, LEDGER, GROUP, JAVA_GROUP = "orders", "msgaudit.ledger", "orders-loader", "java-reader"
GRANT = re.compile(r"^user (\w+) may not ([A-Z_]+) (topic|group) (\S+): grant it with kafka-acls --bootstrap-server "
                   r"\S+ --command-config <admin client properties> --add --allow-principal User:(\w+) "
                   r"--operation (\w+) --(topic|group) (\S+)$")


class Secured:
    """The secured broker and its users: user name -> password."""

    def __init__(self, kafka: LocalKafka, home: Path) -> None:
        self.kafka, self.home = kafka, home
        self.passwords: dict[str, str] = {}

    def user(self, name: str, grants: list[tuple[str, str, str]]) -> None:
        self.passwords[name] = secrets.token_urlsafe(12)
        self.kafka.add_user(name, self.passwords[name])
        for operation, resource, resource_name in grants:
            self.kafka.grant(name, operation, resource, resource_name)

    def config(self, tmp: Path, user: str, password: str | None = None, ledger: bool = False,
               mirror: str | None = None) -> Config:
        """A msgaudit.yaml written to `tmp` for `user` (its settings only in the file), loaded;
        `mirror`: the topic has a mirror of that name on this same cluster (source alias `src`)."""
        kafka = self.kafka.client_config(user, self.passwords[user] if password is None else password)
        topic: dict[str, Any] = {"window": "1h", "groups": [GROUP]}
        if mirror:
            topic["mirrors"] = [{"name": mirror, "kafka": kafka, "source_alias": "src"}]
        data: dict[str, Any] = {"home": str(tmp / ".msgaudit"), "lake": str(tmp / "lake"),
                                "ledger_dir": str(tmp / "ledger"), "report_store": f"sqlite:///{tmp / 'report.db'}",
                                "kafka": kafka, "topics": {TOPIC: topic}}
        if ledger:
            data["ledger"] = {"topic": LEDGER}
        tmp.mkdir(parents=True, exist_ok=True)
        (tmp / "msgaudit.yaml").write_text(yaml.safe_dump(data))
        return config_mod.load(str(tmp / "msgaudit.yaml"))


@pytest.mark.unit
def test_the_secure_broker_config_and_certificates_without_a_broker(tmp_path: Path) -> None:
    """secure=True: SASL_SSL listener, SCRAM, ACLs, a broker certificate for 127.0.0.1 signed by the
    local CA; the plaintext config is what it was; a secured data folder stays secured."""
    from cryptography import x509

    plain, secure = LocalKafka(tmp_path / "plain", port=19092), LocalKafka(tmp_path / "secure", port=19092, secure=True)
    node = plain.nodes[0]
    assert plain.client_config() == {"bootstrap.servers": "127.0.0.1:19092"}
    assert plain._properties(node)["listeners"] == "PLAINTEXT://127.0.0.1:19092,CONTROLLER://127.0.0.1:19093"
    assert "authorizer.class.name" not in plain._properties(node)
    props = secure._properties(secure.nodes[0])
    assert {k: props[k] for k in ("listeners", "sasl.enabled.mechanisms", "authorizer.class.name", "super.users")} == {
        "listeners": "SASL_SSL://127.0.0.1:19092,CONTROLLER://127.0.0.1:19093", "sasl.enabled.mechanisms": "SCRAM-SHA-512",
        "authorizer.class.name": "org.apache.kafka.metadata.authorizer.StandardAuthorizer",
        "super.users": "User:admin;User:ANONYMOUS"}
    folder = tmp_path / "secure" / "secure"
    assert {p.name: p.stat().st_mode & 0o077 for p in folder.iterdir() if p.name != "ca.pem"} == {
        "credentials.json": 0, "broker.pem": 0}
    ca = x509.load_pem_x509_certificate((folder / "ca.pem").read_bytes())
    broker = x509.load_pem_x509_certificates((folder / "broker.pem").read_bytes())[0]
    broker.verify_directly_issued_by(ca)
    san = broker.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert [str(ip) for ip in san.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]
    assert LocalKafka(tmp_path / "secure", port=19092).secure and not LocalKafka(tmp_path / "plain").secure


@pytest.mark.unit
def test_a_spark_read_denied_by_the_acls_is_one_line(tmp_path: Path) -> None:
    from spark_jobs.capture import _read_access

    cfg = config_mod.from_dict({"kafka": {"bootstrap.servers": "b:9093", "sasl.username": "carol",
                                          "sasl.password": "pw"}}, source="<test>", base=tmp_path)
    java = ("An error occurred while calling o93.collectToPython.\n: org.apache.spark.SparkException: Job aborted"
            "\nCaused by: org.apache.kafka.common.errors.TopicAuthorizationException: Not authorized to access "
            "topics: [orders]\n\tat org.apache.kafka...")
    with pytest.raises(BrokerError) as denied, _read_access(cfg, ["orders", "payments"]):
        raise RuntimeError(java)
    assert str(denied.value) == (
        "capture: user carol may not READ topic orders: grant it with kafka-acls --bootstrap-server b:9093 "
        "--command-config <admin client properties> --add --allow-principal User:carol --operation Read --topic orders")
    with pytest.raises(RuntimeError, match="something else"), _read_access(cfg, ["orders"]):
        raise RuntimeError("something else")


@pytest.fixture(scope="session")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Secured]:
    from confluent_kafka.admin import AdminClient, NewTopic

    kafka = LocalKafka(tmp_path_factory.mktemp("kafka-secured"), port=None, nodes=1, secure=True)
    kafka.start(timeout=180)
    try:
        admin = AdminClient(dict(kafka.client_config()))
        for fut in admin.create_topics([NewTopic(TOPIC, 1, 1), NewTopic(LEDGER, 1, 1)]).values():
            fut.result(timeout=30)
        del admin
        s = Secured(kafka, tmp_path_factory.mktemp("secured-home"))
        s.user("alice", [("WRITE", "TOPIC", TOPIC), ("READ", "TOPIC", TOPIC), ("DESCRIBE", "TOPIC", TOPIC),
                         ("READ", "GROUP", GROUP), ("READ", "GROUP", JAVA_GROUP), ("WRITE", "TOPIC", LEDGER)])
        s.user("auditor", [("DESCRIBE", "TOPIC", TOPIC), ("DESCRIBE_CONFIGS", "TOPIC", TOPIC),
                           ("READ", "TOPIC", TOPIC), ("DESCRIBE", "GROUP", GROUP),
                           ("READ", "TOPIC", LEDGER), ("DESCRIBE", "TOPIC", LEDGER)])
        # MirrorMaker 2 reads the source, creates and writes the copy and its own internal topics and groups
        s.user("mirror", [("ALL", "TOPIC", "*"), ("ALL", "GROUP", "*"), ("ALL", "BROKER", "kafka-cluster")])
        s.user("bob", [("READ", "GROUP", GROUP), ("DESCRIBE", "TOPIC", TOPIC)])  # no READ on the topic
        yield s
    finally:
        kafka.stop()


@pytest.mark.kafka
def test_the_broker_serves_sasl_ssl_only_with_acls(secured: Secured) -> None:
    """Plaintext is refused, the CA's certificate is checked, the admin's settings file says it all."""
    from confluent_kafka.admin import AdminClient

    plain = AdminClient({"bootstrap.servers": secured.kafka.bootstrap_servers, "log_level": 0})
    with pytest.raises(Exception, match="(?i)transport failure"):
        plain.list_topics(timeout=3)
    settings = yaml.safe_load(secured.kafka.write_admin_settings().read_text())["kafka"]
    assert {k: settings[k] for k in ("security.protocol", "sasl.mechanism", "sasl.username")} == {
        "security.protocol": "SASL_SSL", "sasl.mechanism": "SCRAM-SHA-512", "sasl.username": "admin"}
    assert (secured.kafka.data_dir / "secure" / "admin.yaml").stat().st_mode & 0o077 == 0
    assert {TOPIC, LEDGER} <= set(AdminClient(settings).list_topics(timeout=15).topics)


@pytest.mark.kafka
@pytest.mark.spark
@pytest.mark.e2e
def test_producer_plugin_ledger_topic_consumer_doctor_and_capture_run_by_config_alone(
        secured: Secured, spark: Any, libmsgaudit: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from confluent_kafka import Consumer, Producer, TopicPartition

    from audit import AuditedConsumer, AuditedProducer
    from audit.cli import main
    from spark_jobs import capture as C
    from spark_jobs.ingest_topic import land_topic

    app = secured.config(tmp_path / "app", "alice", ledger=True)
    t0 = datetime.now(UTC).replace(second=0, microsecond=0)
    # AuditedProducer (the Python path: its ledger shipper writes the ledger topic) ...
    with AuditedProducer.from_config(app, producer_name="orders-svc") as producer:
        for i in range(10):
            producer.produce(TOPIC, key=b"o-%d" % i, value=b'{"n": %d}' % i)
        assert producer.flush(30) == 0
    # ... and a plain librdkafka producer audited by the plugin, which ships its own ledger rows.
    plain = Producer({"plugin.library.paths": str(libmsgaudit), **app.kafka,
                      "msgaudit.ledger.dir": str(tmp_path / "app" / "ledger" / "producer"),
                      "msgaudit.producer.name": "nightly-load", "msgaudit.ledger.topic": LEDGER})
    for i in range(10, 20):
        plain.produce(TOPIC, key=b"o-%d" % i, value=b'{"n": %d}' % i)
    assert plain.flush(30) == 0
    del plain  # closing it seals and ships its segment
    handled: list[bytes | None] = []
    consumer = AuditedConsumer.from_config(app, topics=[TOPIC], group=GROUP, semantics="at_least_once")
    stats = consumer.run(lambda rec: handled.append(rec.message.value()), idle_timeout_s=3)
    consumer.close()
    assert (len(handled), stats.handled) == (20, 20)

    # Both shipped their producer rows to the ledger topic with alice's settings.
    reader = Consumer({**secured.kafka.client_config(), "group.id": "check", "enable.auto.commit": False})
    reader.assign([TopicPartition(LEDGER, 0, 0)])
    keys: list[bytes] = []
    for _ in range(60):
        keys += [m.key() or b"" for m in reader.consume(100, timeout=0.5) if m.error() is None]
        if sum(k.startswith(b"producer/") for k in keys) >= 20:
            break
    reader.close()
    assert sum(k.startswith(b"producer/") for k in keys) == 20

    # doctor as the auditor (a config file and the CLI): the unsafe single-replica topic is reported.
    audit_dir = tmp_path / "audit"
    auditor = secured.config(audit_dir, "auditor")
    assert main(["doctor", "--config", str(audit_dir / "msgaudit.yaml"), "--topic", TOPIC,
                 "--min-replication-factor", "1"]) == 3
    out = capsys.readouterr().out
    assert "min_insync_replicas" in out and "doctor: 1 risk(s), 1 error" in out

    # capture through Spark's Kafka source (SASL_SSL settings translated) as the auditor.
    got = C.capture(spark, auditor, t0, t0 + timedelta(minutes=2)).topics[TOPIC]
    assert (got.partitions, got.records, got.written, got.header_errors, got.groups) == (1, 20, 20, 0, 1)

    # the ingest of the ledger topic (Spark's Kafka source, SASL_SSL) as the auditor: every row the
    # clients wrote to their spools lands once -- the 20 producer rows and the consumer's rows.
    spooled = {kind: sum(len(f.read_text().splitlines()) for f in (tmp_path / "app" / "ledger" / kind).glob("*.jsonl*"))
               for kind in ("producer", "consumer")}
    assert spooled["producer"] == 20 and spooled["consumer"] > 0
    landed = land_topic(spark, secured.config(tmp_path / "ingest", "auditor", ledger=True))
    assert {t: (r.landed, r.quarantined) for t, r in landed.tables.items()} == {
        "producer_ledger": (20, 0), "consumed_records": (spooled["consumer"], 0), "producer_settings": (0, 0)}
    assert (landed.replayed, landed.bad_keys) == (0, 0)
    rows = spark.read.format("delta").load(str(tmp_path / "ingest" / "lake" / "producer_ledger"))
    assert sorted(r["pid"].split(":")[0] for r in rows.select("pid").distinct().collect()) == ["nightly-load", "orders-svc"]
    _no_password_anywhere(secured, [out, capsys.readouterr().err], tmp_path)


@pytest.mark.kafka
def test_a_user_without_the_acl_gets_one_line_naming_it(
        secured: Secured, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from audit import AuditedConsumer
    from audit.cli import main

    bob = secured.config(tmp_path / "bob", "bob")
    consumer = AuditedConsumer.from_config(bob, topics=[TOPIC], group=GROUP, semantics="at_least_once")
    with pytest.raises(BrokerError) as denied:
        consumer.run(lambda rec: None, stop=_after(60))
    consumer.close()
    line = str(denied.value).split(": ", 1)[1]
    assert GRANT.match(line).groups() == (  # type: ignore[union-attr]
        "bob", "READ", "topic", TOPIC, "bob", "Read", "topic", TOPIC)

    # doctor needs DESCRIBE_CONFIGS on the topic: one line on stderr, no traceback.
    assert main(["doctor", "--config", str(tmp_path / "bob" / "msgaudit.yaml"), "--topic", TOPIC]) == BrokerError.exit_code
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("msgaudit doctor: error: ")
    assert GRANT.match(err[0].removeprefix("msgaudit doctor: error: ")).groups() == (  # type: ignore[union-attr]
        "bob", "DESCRIBE_CONFIGS", "topic", TOPIC, "bob", "DescribeConfigs", "topic", TOPIC)

    # `msgaudit ship` of a spool to the ledger topic bob may not write.
    bob_ledger = secured.config(tmp_path / "bob-ship", "bob", ledger=True)
    (Path(bob_ledger.ledger_dir) / "producer").mkdir(parents=True)
    (Path(bob_ledger.ledger_dir) / "producer" / "seg-1.jsonl").write_text('{"seq": 1}\n')
    assert main(["ship", "--config", str(tmp_path / "bob-ship" / "msgaudit.yaml")]) == BrokerError.exit_code
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and GRANT.search(err[0].split("(", 1)[1].split("; ship:")[0]).groups() == (  # type: ignore[union-attr]
        "bob", "WRITE", "topic", LEDGER, "bob", "Write", "topic", LEDGER)

    # A wrong password: one line naming the user, never the password.
    wrong = secrets.token_urlsafe(12)
    consumer = AuditedConsumer.from_config(secured.config(tmp_path / "wrong", "alice", password=wrong),
                                           topics=[TOPIC], group=GROUP, semantics="at_least_once")
    with pytest.raises(BrokerError, match=r"SASL authentication of user alice failed at \S+: check "
                                          r"sasl.username, sasl.password and sasl.mechanism \(SCRAM-SHA-512\)$"):
        consumer.run(lambda rec: None, stop=_after(60))
    consumer.close()
    captured = capsys.readouterr()
    _no_password_anywhere(secured, [captured.out, captured.err, str(denied.value)], tmp_path, extra=[wrong])


def _after(seconds: float) -> Callable[[], bool]:
    """A `stop=` for AuditedConsumer.run: True once `seconds` passed (a denial never arrived)."""
    deadline = time.monotonic() + seconds
    return lambda: time.monotonic() > deadline


def _no_password_anywhere(secured: Secured, outputs: list[str], tmp: Path, extra: list[str] | None = None) -> None:
    """No password in the outputs, nor in any file of `tmp` (configs aside) or the broker's folder
    (its logs; the settings and credential files aside)."""
    passwords = [*secured.passwords.values(), secured.kafka.client_config()["sasl.password"], *(extra or [])]
    secret_files = {"msgaudit.yaml", "credentials.json", "admin.yaml", "server.properties", "mm2-secrets.properties"}
    files = [p for root in (tmp, secured.kafka.data_dir) for p in root.rglob("*")
             if p.is_file() and p.name not in secret_files]
    assert len([p for p in files if p.name == "server.log"]) == 1
    leaks = [str(p) for p in files for pw in passwords if pw.encode() in p.read_bytes()]
    leaks += [f"output {i}" for i, text in enumerate(outputs) for pw in passwords if pw in text]
    assert leaks == []


@pytest.mark.kafka
@pytest.mark.e2e
def test_java_producer_interceptor_ships_its_ledger_over_sasl_ssl(
        secured: Secured, java_producer: list[str], tmp_path: Path) -> None:
    """An unchanged JVM producer with the interceptor, its SASL_SSL settings those capture maps from
    the librdkafka ones: its records are acked and its ledger shipper (a copy of the client's
    security settings) marks every segment shipped."""
    from audit.clients.ledger import sealed_segments
    from audit.clients.ledger_ship import is_shipped
    from tests.test_native_ledger_topic import PRODUCER_INTERCEPTOR, rows_of, run, spool_records

    java = _java_settings(secured, "alice")
    spool = tmp_path / "ledger" / "producer"
    spool.mkdir(parents=True)
    p = run(java_producer, TOPIC, "5", *java, PRODUCER_INTERCEPTOR, f"msgaudit.ledger.dir={spool}",
            "msgaudit.producer.name=java-svc", f"msgaudit.ledger.topic={LEDGER}")
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.strip() == "SENT 5" and "msgaudit:" not in p.stderr
    segments = sealed_segments(spool)
    assert segments and all(is_shipped(s) for s in segments)
    assert rows_of(spool_records(spool, "producer")) == 5
    _no_password_anywhere(secured, [p.stdout, p.stderr], tmp_path)


def _java_settings(secured: Secured, user: str) -> list[str]:
    """`key=value` Java client settings of `user`, mapped from the librdkafka ones as capture does."""
    from audit.core.kafka_conf import java_client_settings

    conf = secured.kafka.client_config(user, secured.passwords[user])
    return [f"{k}={v}" for k, v in java_client_settings(conf).items()]


def _produce(secured: Secured, n: int) -> int:
    """`n` more records in the topic (as the admin); the number of records it holds now."""
    from confluent_kafka import Producer

    from audit.runtime.local_mirror import topic_size

    producer = Producer(secured.kafka.client_config())
    for i in range(n):
        producer.produce(TOPIC, key=b"x-%d" % i, value=b"{}")
    assert producer.flush(30) == 0
    return topic_size(secured.kafka.client_config(), TOPIC)


@pytest.mark.kafka
@pytest.mark.e2e
def test_java_consumer_interceptor_ships_its_ledger_over_sasl_ssl(
        secured: Secured, java_consumer: list[str], tmp_path: Path) -> None:
    """An unchanged JVM group member with the consumer interceptor, its SASL_SSL settings mapped from
    the librdkafka ones: handed every record of the topic, and its ledger shipper (a copy of the
    client's security settings) marks every segment shipped."""
    from audit.clients.ledger import sealed_segments
    from audit.clients.ledger_ship import is_shipped
    from tests.test_consumer_interceptor import CONSUMER_INTERCEPTOR, got, rows_of
    from tests.test_native_ledger_topic import run

    held = _produce(secured, 3)
    spool = tmp_path / "ledger" / "consumer"
    spool.mkdir(parents=True)
    c = run(java_consumer, TOPIC, "-1", *_java_settings(secured, "alice"), f"group.id={JAVA_GROUP}",
            CONSUMER_INTERCEPTOR, f"msgaudit.ledger.dir={spool}", "msgaudit.consumer.name=java-reader",
            f"msgaudit.ledger.topic={LEDGER}")
    assert c.returncode == 0, c.stderr[-2000:]
    assert got(c.stdout) == [(0, o) for o in range(held)] and "msgaudit:" not in c.stderr
    segments = sealed_segments(spool)
    assert segments and all(is_shipped(s) for s in segments)
    rows = rows_of(spool)
    assert sorted(r["offset"] for r in rows if r["outcome"] == "handed") == list(range(held))
    _no_password_anywhere(secured, [c.stdout, c.stderr], tmp_path)


@pytest.mark.kafka
@pytest.mark.spark
@pytest.mark.e2e
def test_mirrormaker2_between_secured_clusters_by_config_alone_audited_by_capture(
        secured: Secured, spark: Any, tmp_path: Path) -> None:
    """MM2 started from msgaudit's config alone (`kafka:` the source, `mirrors[].kafka` the target;
    here both the one secured broker, the copy `src.orders`): its SASL_SSL settings translated, the
    JAAS line only in a 0600 secrets file, copies every record, and capture audits the copy with
    exact counts. No password in MM2's logs, its properties file or the broker's topics (MM2's
    connector configs live in one)."""
    from audit.runtime.local_mirror import LocalMirrorMaker
    from spark_jobs import capture as C

    held = _produce(secured, 4)
    cfg = secured.config(tmp_path / "dr", "mirror", mirror="dr")
    mm2 = LocalMirrorMaker.for_mirror(tmp_path / "mm2", cfg, TOPIC, "dr")
    props = mm2.properties()
    assert {k: props[k] for k in ("src.security.protocol", "src.sasl.mechanism", "dr.ssl.truststore.type",
                                  "dr.ssl.truststore.location", "config.providers")} == {
        "src.security.protocol": "SASL_SSL", "src.sasl.mechanism": "SCRAM-SHA-512", "dr.ssl.truststore.type": "PEM",
        "dr.ssl.truststore.location": secured.kafka.client_config()["ssl.ca.location"], "config.providers": "file"}
    assert props["src.sasl.jaas.config"] == f"${{file:{mm2.secrets_file}:src.sasl.jaas.config}}"
    t0 = datetime.now(UTC).replace(second=0, microsecond=0)
    with mm2:
        assert mm2.wait_records(TOPIC, held, timeout=120) == held
    assert not mm2.running()
    assert {p.name: p.stat().st_mode & 0o077 for p in (tmp_path / "mm2").glob("mm2*.properties")} == {
        "mm2.properties": 0, "mm2-secrets.properties": 0}

    result = C.capture(spark, cfg, t0, t0 + timedelta(minutes=2))
    (copy,) = result.mirrors
    assert (copy.mirror, copy.target_topic) == ("dr", "src.orders")
    source = result.topics[TOPIC]  # the admin's records carry no audit headers: header errors in both
    assert (source.records, copy.captured.records, copy.captured.header_errors) == (held, held, source.header_errors)
    _no_password_anywhere(secured, [mm2.log_tail(10_000)], tmp_path)
