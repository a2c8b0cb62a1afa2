"""A fleet ships its ledgers through the ledger topic and the audit equals the ground truth.

Two producer hosts and one consumer host (separate processes, separate configs, separate spools)
work against the data broker; their ledgers go to a ledger topic on a second broker, which is
killed mid-run and restarted later. Rows the topic missed are shipped again from the spools (by
the clients once it is back, and by `msgaudit ship`), often together with rows it already had.
Ingest runs twice (before and after the spools are drained); the ledger tables then hold exactly
one row per produce and per processing, and reconcile reports no anomaly.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml

from audit.cli import main as cli_main
from audit.clients.ledger import sealed_segments
from audit.clients.ledger_ship import is_shipped
from audit.core import config as config_mod
from audit.runtime.local_kafka import LocalKafka
from audit.serving.report_store import ReportStore
from spark_jobs.io import lake
from spark_jobs.pipeline.steps import StepRange, run_step
from tests.conftest import new_topic

pytestmark = [pytest.mark.e2e, pytest.mark.kafka, pytest.mark.spark]

ROOT = Path(__file__).resolve().parent.parent
HOST = [sys.executable, str(ROOT / "tests" / "support" / "fleet_host.py")]
PER_PRODUCER = 400
SECONDS = 14.0


def _write_config(path: Path, data: dict[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data))
    return path


def _spawn(args: list[str], log: Path) -> subprocess.Popen[str]:
    return subprocess.Popen([*HOST, *args], stdout=subprocess.PIPE, stderr=log.open("w"), text=True,
                            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})


def _result(proc: subprocess.Popen[str], log: Path, timeout: float) -> dict[str, Any]:
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, log.read_text()[-3000:]
    return dict(json.loads(out.strip().splitlines()[-1]))


def _wait_for_spools(folders: list[Path], procs: dict[str, subprocess.Popen[str]]) -> None:
    """Until every producer host has started writing its spool (process start-up is slow under load)."""
    deadline = time.monotonic() + 120
    while not all(f.is_dir() and any(f.iterdir()) for f in folders):
        assert all(p.poll() is None for p in procs.values()), "a producer host exited early"
        assert time.monotonic() < deadline, "the producer hosts did not start"
        time.sleep(0.1)


def test_fleet_ledgers_survive_a_ledger_topic_outage_and_land_once(
        spark: Any, kafka_bootstrap: str, tmp_path: Path) -> None:
    ledger_broker = LocalKafka(tmp_path / "ledger-kafka", port=None, nodes=1).start(timeout=240)
    try:
        data_topic = new_topic(kafka_bootstrap, partitions=2, prefix="orders")
        ledger_topic = new_topic(ledger_broker.bootstrap_servers, partitions=2, prefix="msgaudit.ledger")
        group = "loader"
        ledger = {"topic": ledger_topic,
                  # Rows the ledger topic does not take within 3 s fail; their segments are re-shipped.
                  "kafka": {"bootstrap.servers": ledger_broker.bootstrap_servers, "message.timeout.ms": 3000}}
        common = {"kafka": {"bootstrap.servers": kafka_bootstrap}, "ledger": ledger}
        hosts = {name: _write_config(tmp_path / name / "msgaudit.yaml",
                                     {**common, "ledger_dir": str(tmp_path / name / "spool")})
                 for name in ("host-a", "host-b", "host-c")}
        logs = {name: tmp_path / f"{name}.log" for name in hosts}
        consumer = _spawn(["consumer", str(hosts["host-c"]), data_topic, "c1", group, str(2 * PER_PRODUCER),
                           "90"], logs["host-c"])
        producers = {name: _spawn(["producer", str(hosts[name]), data_topic, f"svc-{name}", str(PER_PRODUCER),
                                   str(SECONDS)], logs[name]) for name in ("host-a", "host-b")}
        _wait_for_spools([tmp_path / name / "spool" / "producer" for name in producers], producers)
        time.sleep(SECONDS / 4)
        ledger_broker.kill_node(1)  # the ledger topic goes away mid-run ...
        time.sleep(SECONDS / 2)
        ledger_broker.restart_node(1)  # ... and comes back before the hosts finish
        ledger_broker.wait_ready(120)
        truth = {name: _result(p, logs[name], 120) for name, p in producers.items()}
        consumed = _result(consumer, logs["host-c"], 120)

        sent = sorted((p, o) for t in truth.values() for p, o in t["acked"])
        assert len(sent) == 2 * PER_PRODUCER
        assert sorted(map(tuple, consumed["processed"])) == sent
        # The outage cost the live shipping rows (re-shipped from the spools), never the spools.
        assert sum(t["ledger_topic_failed"] for t in truth.values()) > 0

        # The lake side: an audit config with the data topic, the ledger topic, its own lake.
        audit_cfg_path = _write_config(tmp_path / "audit" / "msgaudit.yaml", {
            **common, "lake": str(tmp_path / "audit" / "lake"), "report_store": "sqlite:///report.db",
            "ledger_dir": str(tmp_path / "audit" / "no-local-ledgers"),
            "topics": {data_topic: {"window": "1h", "grace": "1m", "groups": [group]}}})
        cfg = config_mod.load(audit_cfg_path)
        first = run_step(spark, cfg, "ingest", StepRange())
        # Drain every host's spool: whatever is still unmarked goes again (with rows the topic has).
        for name, path in hosts.items():
            assert cli_main(["ship", "--config", str(path)]) == 0, name
            spool = tmp_path / name / "spool"
            segs = sealed_segments(spool / "producer") + sealed_segments(spool / "consumer")
            assert segs and all(is_shipped(s) for s in segs), name
        second = run_step(spark, cfg, "ingest", StepRange())
        # `msgaudit ship` also ships each producer host's settings file (one per AuditedProducer start)
        settings = first.tables["producer_settings"].landed + second.tables["producer_settings"].landed
        assert settings == 2
        assert first.landed + second.landed - settings == 4 * PER_PRODUCER

        produced = lake.read_table(spark, cfg, "producer_ledger").select("pid", "seq", "partition", "offset",
                                                                         "status").collect()
        pids = {name: t["pid"] for name, t in truth.items()}
        assert sorted((r["pid"], r["partition"], r["offset"]) for r in produced) == sorted(
            (pids[name], p, o) for name, t in truth.items() for p, o in t["acked"])
        assert {r["status"] for r in produced} == {"acked"}
        assert sorted((r["pid"], r["seq"]) for r in produced) == sorted(
            (pid, s) for pid in pids.values() for s in range(PER_PRODUCER))  # each (pid, seq) once
        processed = lake.read_table(spark, cfg, "consumed_records").select("consume_seq", "partition",
                                                                           "offset", "outcome").collect()
        assert sorted(r["consume_seq"] for r in processed) == list(range(2 * PER_PRODUCER))
        assert sorted((r["partition"], r["offset"]) for r in processed) == sent

        # The audit: every message produced once, in the log once, processed once -> no anomaly.
        now = datetime.now(UTC)
        start = now.replace(minute=0, second=0, microsecond=0) - timedelta(hours=1)
        end = start + timedelta(hours=2)
        run_step(spark, cfg, "capture", StepRange(start, end))
        run_step(spark, cfg, "reconcile", StepRange(start, end, None, end + timedelta(minutes=1)))
        store = ReportStore(cfg.report_store)
        try:
            assert store.read("audit_anomalies", topic=data_topic) == []
            report = store.read("audit_partition_report", topic=data_topic)
        finally:
            store.close()
        delivered = {stage: sum(r["delivered"] for r in report if r["stage"] == stage)
                     for stage in ("log", f"group:{group}")}
        assert delivered == {"log": 2 * PER_PRODUCER, f"group:{group}": 2 * PER_PRODUCER}
        assert sum(r["lost"] + r["duplicated"] + r["pending"] for r in report) == 0
    finally:
        ledger_broker.stop()
