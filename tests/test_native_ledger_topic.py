"""The unchanged native clients ship their ledgers to the ledger topic themselves
(docs/design.md §4.2 "Ledger transport", §3.3, §3.4): the Java interceptors and the librdkafka
plugin, configured with `msgaudit.ledger.topic`, put every spool line on the topic with the keys
of audit/clients/ledger_ship.py and mark each segment `.shipped`; a ledger topic that is down at
close leaves the segments unmarked for `msgaudit ship`, which ships them once. Real broker."""

from __future__ import annotations

import json
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import KafkaException, Producer

from audit.clients.ledger import sealed_segments
from audit.clients.ledger_ship import is_shipped, row_key, ship_spool
from tests.conftest import new_topic
from tests.test_plugin import kcat, plugin_conf
from tests.test_producer import consume_all

PRODUCER_INTERCEPTOR = "interceptor.classes=io.msgaudit.interceptors.AuditProducerInterceptor"
CONSUMER_INTERCEPTOR = "interceptor.classes=io.msgaudit.interceptors.AuditConsumerInterceptor"
DELIVERY_TIMEOUT_20 = ("msgaudit.ledger.delivery.timeout.ms: expected 21..2147483647 (more than the shipper's "
                       'linger.ms 20), got "20"')


def dead_bootstrap() -> str:
    """A 127.0.0.1 address where nothing listens (a ledger cluster that is down)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def spool_records(folder: Path, kind: str) -> dict[bytes, bytes]:
    """What the ledger topic must hold for a spool folder: key -> line, for every sealed line."""
    want: dict[bytes, bytes] = {}
    for seg in sealed_segments(folder):
        for n, line in enumerate(seg.read_bytes().splitlines()):
            want[row_key(kind, seg, n)] = line
    return want


def rows_of(want: dict[bytes, bytes], kind: str = "producer") -> int:
    """Table rows of the lines under `kind`'s keys: a Java producer line with `"run": k` is k rows."""
    return sum(json.loads(line).get("run", 1) for k, line in want.items() if k.startswith(kind.encode() + b"/"))


def topic_records(bootstrap: str, topic: str, expected: int) -> list[tuple[bytes, bytes]]:
    records = consume_all(bootstrap, topic, expected, timeout=60)
    # the shipper's own producer runs no interceptor and no plugin: its records are not stamped
    assert [m.headers() for m in records] == [None] * len(records)
    return [(m.key(), m.value()) for m in records]


def run(cmd: list[str], *props: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*cmd, *props], capture_output=True, text=True, timeout=timeout)


@pytest.mark.kafka
def test_java_clients_ship_every_ledger_row_once_and_mark_every_segment(
        java_producer: list[str], java_consumer: list[str], kafka_bootstrap: str, tmp_path: Path) -> None:
    topic = new_topic(kafka_bootstrap, partitions=2)
    ledger_topic = new_topic(kafka_bootstrap, partitions=2, prefix="msgaudit.ledger")
    spool = tmp_path / "ledger"
    (spool / "producer").mkdir(parents=True)
    (spool / "consumer").mkdir()
    n = 400
    p = run(java_producer, topic, str(n), f"bootstrap.servers={kafka_bootstrap}", PRODUCER_INTERCEPTOR,
            f"msgaudit.ledger.dir={spool / 'producer'}", "msgaudit.producer.name=java-app",
            f"msgaudit.ledger.topic={ledger_topic}")
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == f"SENT {n}" and "msgaudit:" not in p.stderr
    c = run(java_consumer, topic, "-1", f"bootstrap.servers={kafka_bootstrap}", "group.id=g-ship",
            CONSUMER_INTERCEPTOR, f"msgaudit.ledger.dir={spool / 'consumer'}", f"msgaudit.ledger.topic={ledger_topic}")
    assert c.returncode == 0, c.stderr
    assert c.stdout.splitlines()[-1] == f"DONE {n}" and "msgaudit:" not in c.stderr

    produced = sealed_segments(spool / "producer")
    consumed = sealed_segments(spool / "consumer")
    assert produced and consumed
    assert all(is_shipped(s) for s in produced + consumed)
    want = {**spool_records(spool / "producer", "producer"), **spool_records(spool / "consumer", "consumer")}
    assert rows_of(want) == n
    got = topic_records(kafka_bootstrap, ledger_topic, len(want))
    assert len(got) == len(want)  # one record per ledger row, none twice
    assert dict(got) == want


@pytest.mark.kafka
def test_java_producer_with_the_ledger_topic_down_at_close_leaves_segments_for_msgaudit_ship(
        java_producer: list[str], kafka_bootstrap: str, tmp_path: Path) -> None:
    topic = new_topic(kafka_bootstrap)
    ledger_topic = new_topic(kafka_bootstrap, prefix="msgaudit.ledger")
    spool = tmp_path / "ledger"
    (spool / "producer").mkdir(parents=True)
    n = 50
    started = time.monotonic()
    p = run(java_producer, topic, str(n), f"bootstrap.servers={kafka_bootstrap}", PRODUCER_INTERCEPTOR,
            f"msgaudit.ledger.dir={spool / 'producer'}", f"msgaudit.ledger.topic={ledger_topic}",
            f"msgaudit.ledger.bootstrap.servers={dead_bootstrap()}", "msgaudit.ledger.close.timeout.ms=2000")
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == f"SENT {n}"
    assert time.monotonic() - started < 60  # the close waited its bound, not the delivery timeout
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith("msgaudit:")]
    assert lines == [f"msgaudit: ledger topic {ledger_topic}: 1 producer segments not shipped; "
                     f"`msgaudit ship` ships them from {spool / 'producer'}"]
    segs = sealed_segments(spool / "producer")
    assert len(segs) == 1 and not is_shipped(segs[0])

    want = spool_records(spool / "producer", "producer")
    assert rows_of(want) == n
    result = ship_spool(spool, {"bootstrap.servers": kafka_bootstrap}, ledger_topic)
    # the producer's lines, and its settings row (only `msgaudit ship` ships those)
    assert (result.segments, result.rows, result.failed) == (2, len(want) + 1, 0)
    assert is_shipped(segs[0])
    assert ship_spool(spool, {"bootstrap.servers": kafka_bootstrap}, ledger_topic).segments == 0
    got = dict(r for r in topic_records(kafka_bootstrap, ledger_topic, len(want) + 1)
               if r[0].startswith(b"producer/"))
    assert got == want


@pytest.mark.kafka
def test_java_producer_and_consumer_on_one_folder_each_ship_only_their_own_segments(
        java_producer: list[str], java_consumer: list[str], kafka_bootstrap: str, tmp_path: Path) -> None:
    """One msgaudit.ledger.dir for a producer and a consumer interceptor: a client started on the
    folder ships the unmarked segments left there of its own kind only (producer segments under
    producer/ keys, consumer segments under consumer/ keys), never the other's. A delivery timeout under 30 s (the request timeout) ships."""
    topic = new_topic(kafka_bootstrap)
    ledger_topic = new_topic(kafka_bootstrap, prefix="msgaudit.ledger")
    folder = tmp_path / "ledger"
    folder.mkdir()
    ship = [f"msgaudit.ledger.topic={ledger_topic}", "msgaudit.ledger.delivery.timeout.ms=5000"]
    n1, n2 = 30, 20
    # 1. a producer whose ledger topic is down at close: its segment stays unmarked
    p1 = run(java_producer, topic, str(n1), f"bootstrap.servers={kafka_bootstrap}", PRODUCER_INTERCEPTOR,
             f"msgaudit.ledger.dir={folder}", *ship, f"msgaudit.ledger.bootstrap.servers={dead_bootstrap()}",
             "msgaudit.ledger.close.timeout.ms=1500")
    assert p1.returncode == 0, p1.stderr
    first = [s for s in sealed_segments(folder) if s.name.startswith("producer-")]
    assert len(first) == 1 and not is_shipped(first[0])
    # 2. a consumer on the same folder ships its own segments, and leaves the producer's alone
    c = run(java_consumer, topic, "-1", f"bootstrap.servers={kafka_bootstrap}", "group.id=g-shared",
            CONSUMER_INTERCEPTOR, f"msgaudit.ledger.dir={folder}", *ship)
    assert c.returncode == 0, c.stderr
    assert c.stdout.splitlines()[-1] == f"DONE {n1}" and "msgaudit:" not in c.stderr
    consumed = [s for s in sealed_segments(folder) if s.name.startswith("consumer-")]
    assert consumed and all(is_shipped(s) for s in consumed)
    assert not is_shipped(first[0])
    # 3. the next producer on the folder ships its own segment and the one left by the first
    p2 = run(java_producer, topic, str(n2), f"bootstrap.servers={kafka_bootstrap}", PRODUCER_INTERCEPTOR,
             f"msgaudit.ledger.dir={folder}", *ship)
    assert p2.returncode == 0, p2.stderr
    assert "msgaudit:" not in p2.stderr
    produced = [s for s in sealed_segments(folder) if s.name.startswith("producer-")]
    assert len(produced) == 2 and all(is_shipped(s) for s in produced)
    assert len(sealed_segments(folder)) == len(produced) + len(consumed)

    want: dict[bytes, bytes] = {}
    for kind, segs in (("producer", produced), ("consumer", consumed)):
        for seg in segs:
            for n, line in enumerate(seg.read_bytes().splitlines()):
                want[row_key(kind, seg, n)] = line
    assert rows_of(want) == n1 + n2
    got = topic_records(kafka_bootstrap, ledger_topic, len(want))
    assert len(got) == len(want)  # each row once, under its own kind
    assert dict(got) == want


@pytest.mark.kafka
def test_java_bad_ledger_topic_settings_stop_the_client_at_start(
        java_producer: list[str], kafka_bootstrap: str, tmp_path: Path) -> None:
    topic = new_topic(kafka_bootstrap)
    cases = [
        (["msgaudit.ledger.topik=x"], 'unknown msgaudit property "msgaudit.ledger.topik" (known: '),
        ([f"msgaudit.ledger.bootstrap.servers={kafka_bootstrap}"],
         "msgaudit.ledger.bootstrap.servers is set but msgaudit.ledger.topic is not"),
        (["msgaudit.ledger.topic=t", "msgaudit.ledger.close.timeout.ms=0"],
         'msgaudit.ledger.close.timeout.ms: expected a positive integer, got "0"'),
        # kafka-clients would refuse the shipper's producer later, on its own thread (shipping off)
        (["msgaudit.ledger.topic=t", "msgaudit.ledger.delivery.timeout.ms=20"], DELIVERY_TIMEOUT_20),
    ]
    for props, message in cases:
        r = run(java_producer, topic, "1", f"bootstrap.servers={kafka_bootstrap}", PRODUCER_INTERCEPTOR,
                f"msgaudit.ledger.dir={tmp_path}", *props)
        assert r.returncode != 0 and "SENT" not in r.stdout
        assert message in r.stderr
    assert list(tmp_path.iterdir()) == []


# -- the librdkafka plugin -----------------------------------------------------------------------

@pytest.mark.kafka
def test_plugin_clients_ship_every_ledger_row_once_and_mark_every_segment(
        libmsgaudit: Path, kafka_bootstrap: str, tmp_path: Path) -> None:
    """A plain confluent-kafka Producer and kcat, each with the plugin and the ledger topic."""
    topic = new_topic(kafka_bootstrap, partitions=2)
    ledger_topic = new_topic(kafka_bootstrap, partitions=2, prefix="msgaudit.ledger")
    spool = tmp_path / "ledger" / "producer"
    spool.mkdir(parents=True)
    p = Producer(plugin_conf(libmsgaudit, spool, **{"bootstrap.servers": kafka_bootstrap,
                                                    "msgaudit.producer.name": "py-plain",
                                                    "msgaudit.ledger.topic": ledger_topic,
                                                    "msgaudit.segment.max.bytes": 6000, "linger.ms": 5}))
    n_py = 300
    for i in range(n_py):
        p.produce(topic, b"py-%d" % i)
        if i % 50 == 49:  # a few batches: segments are sealed and shipped while the producer runs
            assert p.flush(30) == 0
            time.sleep(0.3)  # > msgaudit.flush.interval.ms: the writer writes the batch
    assert p.flush(30) == 0
    del p
    n_kcat = 120
    r = kcat(libmsgaudit, "-X", f"msgaudit.ledger.dir={spool}", "-X", "msgaudit.producer.name=kcat-job",
             "-X", f"msgaudit.ledger.topic={ledger_topic}", "-b", kafka_bootstrap, "-P", "-t", topic,
             stdin="".join(f"kcat-{i}\n" for i in range(n_kcat)))
    assert r.returncode == 0, r.stderr
    assert "msgaudit" not in r.stderr

    segs = sealed_segments(spool)
    assert len(segs) >= 4 and all(is_shipped(s) for s in segs)
    want = spool_records(spool, "producer")
    assert len(want) == n_py + n_kcat
    got = topic_records(kafka_bootstrap, ledger_topic, len(want))
    assert len(got) == len(want)  # one record per ledger row, none twice
    assert dict(got) == want


@pytest.mark.kafka
def test_plugin_with_the_ledger_topic_down_at_close_leaves_segments_for_msgaudit_ship(
        libmsgaudit: Path, kafka_bootstrap: str, tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    topic = new_topic(kafka_bootstrap)
    ledger_topic = new_topic(kafka_bootstrap, prefix="msgaudit.ledger")
    spool = tmp_path / "ledger" / "producer"
    spool.mkdir(parents=True)
    n = 40
    p = Producer(plugin_conf(libmsgaudit, spool, **{"bootstrap.servers": kafka_bootstrap,
                                                    "msgaudit.ledger.topic": ledger_topic,
                                                    "msgaudit.ledger.bootstrap.servers": dead_bootstrap(),
                                                    "msgaudit.ledger.close.timeout.ms": 1500}))
    for i in range(n):
        p.produce(topic, b"v%d" % i)
    assert p.flush(30) == 0
    started = time.monotonic()
    del p  # rd_kafka_destroy: the writer seals, the shipper gives up after its bound
    closed_in = time.monotonic() - started
    # msgaudit.ledger.close.timeout.ms bounds the shipper's whole close; the rest is the client's own
    # destroy, its messages already flushed (the bound was 1.5 s + 3 s before)
    assert closed_in < 1.5 + 1.0, closed_in
    lines = [ln for ln in capfd.readouterr().err.splitlines() if ln.startswith("msgaudit:")]
    assert lines == [f"msgaudit: ledger topic {ledger_topic}: 1 producer segments not shipped; "
                     f"`msgaudit ship` ships them from {spool}"]
    segs = sealed_segments(spool)
    assert len(segs) == 1 and not is_shipped(segs[0])

    want = spool_records(spool, "producer")
    assert len(want) == n
    result = ship_spool(spool.parent, {"bootstrap.servers": kafka_bootstrap}, ledger_topic)
    assert (result.segments, result.rows, result.failed) == (2, n + 1, 0)  # with the settings row
    assert is_shipped(segs[0])
    assert ship_spool(spool.parent, {"bootstrap.servers": kafka_bootstrap}, ledger_topic).segments == 0
    got = dict(r for r in topic_records(kafka_bootstrap, ledger_topic, n + 1) if r[0].startswith(b"producer/"))
    assert got == want


@pytest.mark.kafka
def test_the_next_plugin_client_on_the_folder_ships_what_an_outage_left(
        libmsgaudit: Path, kafka_bootstrap: str, tmp_path: Path) -> None:
    topic = new_topic(kafka_bootstrap)
    ledger_topic = new_topic(kafka_bootstrap, prefix="msgaudit.ledger")
    spool = tmp_path / "producer"
    spool.mkdir()
    for ledger_servers, n in ((dead_bootstrap(), 30), (kafka_bootstrap, 10)):
        p = Producer(plugin_conf(libmsgaudit, spool, **{"bootstrap.servers": kafka_bootstrap,
                                                        "msgaudit.ledger.topic": ledger_topic,
                                                        "msgaudit.ledger.bootstrap.servers": ledger_servers,
                                                        "msgaudit.ledger.close.timeout.ms": 1500}))
        for i in range(n):
            p.produce(topic, b"v%d" % i)
        assert p.flush(30) == 0
        del p
    segs = sealed_segments(spool)
    assert len(segs) == 2 and all(is_shipped(s) for s in segs)
    want = spool_records(spool, "producer")
    assert len(want) == 40
    got = topic_records(kafka_bootstrap, ledger_topic, len(want))
    assert len(got) == len(want) and dict(got) == want


@pytest.mark.kafka
def test_java_and_plugin_stream_a_left_segment_line_by_line_with_its_line_numbers(
        libmsgaudit: Path, java_producer: list[str], kafka_bootstrap: str, tmp_path: Path) -> None:
    """A segment left unmarked by an earlier client, with a line longer than the Java shipper's
    64 KiB read buffer, an empty line and a last line without a newline, is shipped line by line
    by the next Java and the next plugin client on the folder: keys :0, :1, :2, lines unchanged."""
    topic = new_topic(kafka_bootstrap)
    ledger_topic = new_topic(kafka_bootstrap, prefix="msgaudit.ledger")
    long_line = b'{"row":"' + b"y" * 100_000 + b'"}'
    lines = [long_line, b"", b'{"row":"last"}']
    left: dict[str, Path] = {}
    for client in ("java", "plugin"):
        folder = tmp_path / client
        folder.mkdir()
        left[client] = folder / f"producer-20260101T000000000000Z-1-{client}.jsonl"
        left[client].write_bytes(b"\n".join(lines))  # no newline after the last line
    j = run(java_producer, topic, "5", f"bootstrap.servers={kafka_bootstrap}", PRODUCER_INTERCEPTOR,
            f"msgaudit.ledger.dir={tmp_path / 'java'}", f"msgaudit.ledger.topic={ledger_topic}")
    assert j.returncode == 0, j.stderr
    assert "msgaudit:" not in j.stderr
    p = Producer(plugin_conf(libmsgaudit, tmp_path / "plugin", **{"bootstrap.servers": kafka_bootstrap,
                                                                  "msgaudit.ledger.topic": ledger_topic}))
    for i in range(5):
        p.produce(topic, b"v%d" % i)
    assert p.flush(30) == 0
    del p
    want: dict[bytes, bytes] = {}
    for client in ("java", "plugin"):
        assert all(is_shipped(s) for s in sealed_segments(tmp_path / client))
        want.update(spool_records(tmp_path / client, "producer"))
        assert [want[row_key("producer", left[client], n)] for n in range(3)] == lines
    left_keys = [k for k in want if k.startswith(b"producer/producer-20260101T000000000000Z-1-")]
    assert len(left_keys) == 2 * 3
    assert rows_of({k: v for k, v in want.items() if k not in left_keys}) == 2 * 5  # each client's 5 records
    got = topic_records(kafka_bootstrap, ledger_topic, len(want))
    assert len(got) == len(want) and dict(got) == want


@pytest.mark.kafka
def test_plugin_shipper_reaches_the_clients_cluster_with_the_clients_connection_settings(
        libmsgaudit: Path, kafka_bootstrap: str, tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """Without msgaudit.ledger.bootstrap.servers the plugin's shipper reaches the ledger topic the
    way the client does, with its security./sasl./ssl./socket./broker./client.dns. settings: a
    client held to IPv6 (broker.address.family=v6) cannot reach the broker on 127.0.0.1, and
    neither can its shipper (the segment stays unmarked, reported); the next client on the folder,
    without that setting, ships it."""
    topic = new_topic(kafka_bootstrap)
    ledger_topic = new_topic(kafka_bootstrap, prefix="msgaudit.ledger")
    spool = tmp_path / "producer"
    spool.mkdir()
    common = {"bootstrap.servers": kafka_bootstrap, "msgaudit.ledger.topic": ledger_topic,
              "msgaudit.ledger.delivery.timeout.ms": 1500, "msgaudit.ledger.close.timeout.ms": 2500,
              "msgaudit.settings.row": "false"}
    capfd.readouterr()
    p = Producer(plugin_conf(libmsgaudit, spool, **common, **{"broker.address.family": "v6",
                                                              "message.timeout.ms": 1500}))
    for i in range(3):
        p.produce(topic, b"v%d" % i)
    assert p.flush(20) == 0  # the client reaches no broker: its messages time out (ledgered failed)
    del p
    lines = [ln for ln in capfd.readouterr().err.splitlines() if ln.startswith("msgaudit:")]
    assert lines == [f"msgaudit: ledger topic {ledger_topic}: 1 producer segments not shipped; "
                     f"`msgaudit ship` ships them from {spool}"]
    first = sealed_segments(spool)
    assert len(first) == 1 and not is_shipped(first[0])
    p = Producer(plugin_conf(libmsgaudit, spool, **common))
    for i in range(4):
        p.produce(topic, b"w%d" % i)
    assert p.flush(30) == 0
    del p
    segs = sealed_segments(spool)
    assert len(segs) == 2 and all(is_shipped(s) for s in segs)
    want = spool_records(spool, "producer")
    assert len(want) == 3 + 4
    got = topic_records(kafka_bootstrap, ledger_topic, len(want))
    assert len(got) == len(want) and dict(got) == want


@pytest.mark.unit
def test_plugin_bad_ledger_topic_settings_are_one_clear_error_at_client_start(
        libmsgaudit: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    cases = [
        ({"msgaudit.ledger.topik": "x"}, 'unknown msgaudit property "msgaudit.ledger.topik" (known: '),
        ({"msgaudit.ledger.close.timeout.ms": "soon"}, 'msgaudit.ledger.close.timeout.ms: expected a positive '
                                                       'integer, got "soon"'),
        # librdkafka would refuse the shipper's producer later, on its own thread (shipping off)
        ({"msgaudit.ledger.delivery.timeout.ms": "20"}, DELIVERY_TIMEOUT_20),
    ]
    for props, message in cases:
        with pytest.raises(KafkaException) as err:
            Producer({"plugin.library.paths": str(libmsgaudit), "msgaudit.ledger.dir": str(tmp_path), **props})
        assert message in err.value.args[0].str()
    assert list(tmp_path.iterdir()) == []
    # Settings that conflict only with each other are seen when the client starts, where librdkafka
    # cannot fail: one line says so, the client stays audited (spool only) for `msgaudit ship`.
    capfd.readouterr()
    cases = [
        ({"msgaudit.ledger.bootstrap.servers": "127.0.0.1:1"},
         f"msgaudit: msgaudit.ledger.bootstrap.servers is set but msgaudit.ledger.topic is not; ledger rows "
         f"stay in {tmp_path}"),
        ({"msgaudit.ledger.topic": "ledger"},
         "msgaudit: msgaudit.ledger.topic: no bootstrap.servers for the ledger topic (set "
         f"msgaudit.ledger.bootstrap.servers); ledger rows stay in {tmp_path} for `msgaudit ship`"),
    ]
    for props, message in cases:
        p = Producer({"plugin.library.paths": str(libmsgaudit), "msgaudit.ledger.dir": str(tmp_path),
                      "msgaudit.settings.row": "false", "message.timeout.ms": 200, **props})
        p.produce("t", b"x")
        assert p.flush(10) == 0  # no broker: the message times out, the plugin ledgers it failed
        del p
        lines = [ln for ln in capfd.readouterr().err.splitlines() if ln.startswith("msgaudit:")]
        assert lines == [message]
    rows = [line for seg in sealed_segments(tmp_path) for line in seg.read_text().splitlines()]
    assert len(rows) == 2 and all('"status":"failed"' in r for r in rows)  # audited: one row each


# -- the lake: the ledger topic lands what the spool would ---------------------------------------

@pytest.mark.spark
@pytest.mark.kafka
@pytest.mark.e2e
def test_ingest_from_the_native_clients_ledger_topic_equals_ingest_from_their_spool(
        libmsgaudit: Path, java_producer: list[str], java_consumer: list[str], kafka_bootstrap: str, spark: Any,
        tmp_path: Path, make_config: Any) -> None:
    """A Java producer (interceptor), a plain confluent-kafka Producer (plugin) and a Java consumer
    group member (interceptor) ship to one ledger topic; `msgaudit ingest` from that topic lands the
    same producer_ledger and consumed_records as `msgaudit ingest` from their spool folders."""
    from spark_jobs.io import lake
    from spark_jobs.pipeline.steps import StepRange, run_step

    topic = new_topic(kafka_bootstrap, partitions=2)
    ledger_topic = new_topic(kafka_bootstrap, partitions=2, prefix="msgaudit.ledger")
    spool = tmp_path / "spool"
    (spool / "producer").mkdir(parents=True)
    (spool / "consumer").mkdir()
    ship = f"msgaudit.ledger.topic={ledger_topic}"
    n_java, n_py = 60, 90
    j = run(java_producer, topic, str(n_java), f"bootstrap.servers={kafka_bootstrap}", PRODUCER_INTERCEPTOR,
            f"msgaudit.ledger.dir={spool / 'producer'}", "msgaudit.producer.name=java-app", ship)
    assert j.returncode == 0, j.stderr
    p = Producer(plugin_conf(libmsgaudit, spool / "producer", **{
        "bootstrap.servers": kafka_bootstrap, "msgaudit.producer.name": "py-plain",
        "msgaudit.ledger.topic": ledger_topic}))
    for i in range(n_py):
        p.produce(topic, b"py-%d" % i)
    assert p.flush(30) == 0
    del p
    c = run(java_consumer, topic, "-1", f"bootstrap.servers={kafka_bootstrap}", "group.id=g-lake",
            CONSUMER_INTERCEPTOR, f"msgaudit.ledger.dir={spool / 'consumer'}", ship)
    assert c.returncode == 0, c.stderr
    assert c.stdout.splitlines()[-1] == f"DONE {n_java + n_py}"
    segs = sealed_segments(spool / "producer") + sealed_segments(spool / "consumer")
    assert all(is_shipped(s) for s in segs)

    topics = {topic: {"window": "1h", "grace": "1m", "groups": ["g-lake"]}}
    from_spool = make_config(tmp_path / "a", topics=topics, ledger_dir=str(spool))
    from_topic = make_config(tmp_path / "b", topics=topics, ledger_dir=str(tmp_path / "b" / "no-local-ledgers"),
                             ledger={"topic": ledger_topic, "kafka": {"bootstrap.servers": kafka_bootstrap}})
    landed = {}
    for name, cfg in (("spool", from_spool), ("topic", from_topic)):
        run_step(spark, cfg, "ingest", StepRange())
        landed[name] = {t: sorted(tuple(r) for r in lake.read_table(spark, cfg, t).drop("ingested_at").collect())
                        for t in ("producer_ledger", "consumed_records")}
    produced = landed["spool"]["producer_ledger"]
    assert len(produced) == n_java + n_py
    assert len(landed["spool"]["consumed_records"]) >= n_java + n_py  # handed + committed rows
    assert landed["topic"] == landed["spool"]
