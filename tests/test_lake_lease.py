"""One writer per lake: `msgaudit ingest` holds a lease file in the lake; a second concurrent ingest
is refused with one clear line, and the tables equal a single ingest's. Real Spark + Delta."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from audit import cli
from audit.clients.ledger import LedgerWriter
from audit.core.errors import LakeBusy
from spark_jobs.ingest import ingest
from spark_jobs.io import lake
from tests.test_ingest import crow, prow


def _ledgers(cfg: Any, n: int) -> None:
    with LedgerWriter(Path(cfg.ledger_dir) / "producer", "p") as w:
        for i in range(n):
            w.append(prow(i))
    with LedgerWriter(Path(cfg.ledger_dir) / "consumer", "c") as w:
        for i in range(n):
            w.append(crow(i))


@pytest.mark.spark
def test_two_concurrent_ingests_one_is_refused_and_tables_equal_one_ingest(
        spark: Any, tmp_path: Path, make_config: Any) -> None:
    cfg = make_config(tmp_path)
    _ledgers(cfg, 40)
    outcomes: dict[str, Any] = {}

    def run(name: str) -> None:
        try:
            outcomes[name] = ingest(spark, cfg)
        except LakeBusy as e:
            outcomes[name] = e

    threads = [threading.Thread(target=run, args=(n,)) for n in ("a", "b")]
    for t in threads:
        t.start()
        time.sleep(0.05)
    for t in threads:
        t.join(300)
    refused = [v for v in outcomes.values() if isinstance(v, LakeBusy)]
    landed = [v for v in outcomes.values() if not isinstance(v, LakeBusy)]
    assert len(refused) == 1 and len(landed) == 1, outcomes
    assert "is being written by msgaudit ingest on" in str(refused[0]) and "one writer per lake" in str(refused[0])
    assert landed[0].landed == 80
    assert spark.read.format("delta").load(lake.table_path(cfg, "producer_ledger")).count() == 40
    assert spark.read.format("delta").load(lake.table_path(cfg, "consumed_records")).count() == 40
    # The lease is released: the next ingest runs (and lands nothing new).
    assert not Path(lake.lease_location(cfg)).exists()
    assert ingest(spark, cfg).landed == 0


@pytest.mark.spark
def test_cli_refuses_a_second_writer_in_one_line_and_a_dead_writers_lease_expires(
        spark: Any, tmp_path: Path, make_config: Any, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = make_config(tmp_path)
    _ledgers(cfg, 3)
    cfg_file = tmp_path / "msgaudit.yaml"
    cfg_file.write_text(f"lake: {cfg.lake}\nledger_dir: {cfg.ledger_dir}\nhome: {cfg.home}\n")
    with lake.writer_lease(spark, cfg, "a backfill"):
        assert cli.main(["ingest", "--config", str(cfg_file)]) == 4
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is being written by a backfill on" in err[0], err
    # A lease left by a writer that died long ago is taken over.
    Path(lake.lease_location(cfg)).write_text(json.dumps({"what": "msgaudit ingest", "acquired_at": 1.0}))
    assert ingest(spark, cfg).landed == 6
    assert not Path(lake.lease_location(cfg)).exists()
