"""README's "Quick start", run as written: its msgaudit.yaml, `msgaudit kafka start`, the Python
snippet and the commands, in a fresh folder, so the manual cannot drift from the product.

Two things differ from a new user's machine, both to reuse the session's services: the broker is
the session's (its address replaces 127.0.0.1:9092 in the yaml, and `msgaudit kafka start` gets its
--port and --data-dir), and the Spark steps run in this process on the session's SparkSession."""

from __future__ import annotations

import re
import shlex
import sqlite3
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from audit.runtime.local_kafka import LocalKafka

ROOT = Path(__file__).resolve().parent.parent


def quick_start() -> dict[str, Any]:
    """The quick start's blocks: the yaml, the kafka start command, the Python snippet, the commands."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("\n## Quick start\n", 1)[1].split("\n## ", 1)[0].split("\n### ", 1)[0]
    blocks = re.findall(r"^```(\w+)\n(.*?)^```", section, re.S | re.M)
    by_lang = {lang: [b for k, b in blocks if k == lang] for lang in ("yaml", "python", "bash")}
    assert [len(v) for v in by_lang.values()] == [1, 1, 1], "the quick start has one yaml, python and bash block"
    inline = re.findall(r"`(msgaudit kafka [^`]*)`", section)
    assert inline == ["msgaudit kafka start"]
    commands = [shlex.split(line) for line in by_lang["bash"][0].splitlines() if line.strip()]
    assert all(c[0] == "msgaudit" for c in commands)
    return {"yaml": by_lang["yaml"][0], "kafka": shlex.split(inline[0]), "python": by_lang["python"][0],
            "commands": commands}


@pytest.mark.unit
def test_the_quick_start_blocks_are_found() -> None:
    qs = quick_start()
    assert "127.0.0.1:9092" in qs["yaml"]
    assert [c[1] for c in qs["commands"]] == ["ingest", "capture", "reconcile", "sla", "dashboard"]


@pytest.mark.e2e
@pytest.mark.kafka
@pytest.mark.spark
def test_the_quick_start_runs_as_written(kafka_cluster: LocalKafka, spark: Any, tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from audit.cli import main

    qs = quick_start()
    monkeypatch.chdir(tmp_path)
    (tmp_path / "msgaudit.yaml").write_text(qs["yaml"].replace("127.0.0.1:9092", kafka_cluster.bootstrap_servers))
    (tmp_path / "quickstart.py").write_text(qs["python"])
    node = kafka_cluster.nodes[0]

    # a new user's first try: the snippet's sends before anything created `orders` (the run;
    # librdkafka gives up on the unknown topic after 1 s instead of its default 30 s)
    early = subprocess.run([sys.executable, "-c", EARLY_SENDS], cwd=tmp_path, capture_output=True, text=True,
                           timeout=120, env=_env())
    assert (early.returncode, early.stdout) == (0, "UNKNOWN_TOPIC_OR_PART UNKNOWN_TOPIC_OR_PART\n"), early.stderr

    # 2. the broker (the session's, already running) gets the config's topics
    assert main([*qs["kafka"][1:], "--port", str(node.port), "--data-dir", str(kafka_cluster.data_dir)]) == 0
    assert "kafka: created topic(s) orders of msgaudit.yaml" in capsys.readouterr().out

    # 3. the snippet, as a program of its own
    run = subprocess.run([sys.executable, "quickstart.py"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=120, env=_env())
    # librdkafka's own log lines (`%4|...`, e.g. a fresh broker's coordinator still loading) aside
    assert (run.returncode, [ln for ln in run.stderr.splitlines() if not ln.startswith("%")]) == (0, [])

    # 4. the commands
    for argv in qs["commands"]:
        assert main(argv[1:]) == 0, (argv, capsys.readouterr())
    out = capsys.readouterr().out
    assert re.findall(r"\bFAIL\b", out) == [] and len(re.findall(r"\bPASS\b", out)) > 0
    assert _report(tmp_path) == ([("group:orders-loader", 1, 1), ("log", 1, 1), ("sink:orders_table", 1, 1)], [], 0)
    assert (tmp_path / "dashboard" / "index.html").exists()

    # judged past grace, the first try's sends, told failed and never in the log, are reported
    # (informational: not lost, not expected) -- but the second, whose content (key o-1) the
    # snippet sent again later, was resent
    later = (datetime.now(UTC) + timedelta(minutes=16)).strftime("%Y-%m-%dT%H:%M:%SZ")
    assert main([*qs["commands"][2][1:], "--as-of", later]) == 0
    detail = "ledger says failed, no copy in the log"
    assert _report(tmp_path) == (
        [("group:orders-loader", 1, 1), ("log", 1, 1), ("sink:orders_table", 1, 1)],
        [("log", "failed_send", -1, 0, None, detail)], 1)


def _report(folder: Path) -> tuple[list[Any], list[Any], int]:
    """The report store's (stage, expected, delivered) rows that expect something, its anomaly rows,
    and the log stage's failed_send total."""
    with sqlite3.connect(folder / ".msgaudit" / "report.db") as db:
        rows = db.execute("SELECT stage, expected, delivered FROM audit_partition_report "
                          "WHERE topic = 'orders' AND expected > 0 ORDER BY stage").fetchall()
        anomalies = db.execute("SELECT stage, anomaly, partition, seq, \"offset\", detail FROM audit_anomalies "
                               "ORDER BY seq").fetchall()
        (failed,) = db.execute("SELECT coalesce(sum(failed_send), 0) FROM audit_partition_report "
                               "WHERE stage = 'log'").fetchone()
    return rows, anomalies, failed


@pytest.mark.kafka
def test_a_consumer_of_a_missing_topic_ends_with_one_line(kafka_bootstrap: str, tmp_path: Path) -> None:
    """A program whose AuditedConsumer subscribes to a topic the cluster lacks ends with one line
    naming the topic and what to do, not a traceback."""
    program = ("from audit import AuditedConsumer\n"
               f"c = AuditedConsumer(topics=['no-such-topic-q1'], group='g1', ledger_dir='ledger',\n"
               f"                    config={{'bootstrap.servers': '{kafka_bootstrap}'}})\n"
               "c.run(lambda rec: None, idle_timeout_s=5)\n")
    run = subprocess.run([sys.executable, "-c", program], cwd=tmp_path, capture_output=True, text=True,
                         timeout=120, env=_env())
    assert run.returncode == 1
    assert run.stderr == (f"msgaudit: AuditedConsumer group 'g1': topic 'no-such-topic-q1' does not exist on "
                          f"{kafka_bootstrap}: create it (on the local broker, `msgaudit kafka start` creates "
                          "the topics of msgaudit.yaml)\n")


EARLY_SENDS = """
from audit import AuditedProducer
from audit.core import config

errors = []
cfg = config.load("msgaudit.yaml")
with AuditedProducer.from_config(cfg, producer_name="orders-svc", **{"topic.metadata.propagation.max.ms": 1000}) as producer:
    for i in range(2):
        producer.produce("orders", key=b"o-%d" % i, value=b'{"total": 12}',
                         on_delivery=lambda err, msg: errors.append(err.name()))
    producer.flush()
print(*errors)
"""


def _env() -> dict[str, str]:
    import os

    return {**os.environ, "PYTHONPATH": str(ROOT)}


@pytest.mark.unit
def test_times_relative_to_now() -> None:
    from audit.core.errors import InputError
    from audit.core.windows import parse_instant

    before = datetime.now(UTC)
    got = parse_instant("now-90m")
    assert before - timedelta(minutes=90) <= got <= datetime.now(UTC) - timedelta(minutes=90)
    with pytest.raises(InputError, match=r"^--start: 'now-1x' is not 'now-' and a duration such as now-1h, "
                                         r"now-30m or now-2d$"):
        parse_instant("now-1x", "--start")


@pytest.mark.unit
def test_kafka_start_creates_topics_only_for_a_config_that_names_its_broker(tmp_path: Path) -> None:
    broker = LocalKafka(tmp_path, port=19092)
    assert broker.serves("127.0.0.1:19092") and broker.serves("localhost:19092,other:9092")
    assert not broker.serves("127.0.0.1:9092") and not broker.serves("broker1:19092") and not broker.serves("")
