"""Ingest throughput from the ledger topic, side by side with the local-file ingest of the same rows.

One spool of N producer-ledger rows (segments of --segment-rows lines, written by LedgerWriter)
is landed three ways in one Spark session, each into its own lake:

- `files`: `msgaudit ingest` of the spool folder (the single-host path, spark_jobs/ingest.py);
- `topic`: the spool shipped to a ledger topic (`msgaudit ship`), then `msgaudit ingest` of the
  topic (spark_jobs/ingest_topic.py: Kafka source, read_committed, dedup on identity);
- `topic replay`: the whole spool shipped a second time (every row again, same keys) and ingested
  again into the `topic` lake: every row is read, recognised as already landed and skipped.

Shipping rows/s is printed too. Ratio lines name both sides (`ratio topic/files: 0.62`).

    .venv/bin/python benchmarks/ledger_topic_ingest.py                   # 1,000,000 rows, own broker
    .venv/bin/python benchmarks/ledger_topic_ingest.py --n 200000 --bootstrap 127.0.0.1:9092

This script measures; it asserts nothing.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from confluent_kafka.admin import AdminClient, NewTopic  # noqa: E402

from audit.clients.ledger import LedgerWriter, sealed_segments  # noqa: E402
from audit.clients.ledger_ship import marker, ship_spool  # noqa: E402
from audit.core import config as config_mod  # noqa: E402

T0 = 1_795_000_000_000


def write_spool(folder: Path, n: int, segment_rows: int) -> None:
    fmt = ('%.0s{"producer":"bench","pid":"bench:%s","seq":%d,"topic":"orders","partition":%d,"offset":%d,'
           '"status":"acked","error":null,"txn_id":null,"produce_ts":%d,"ack_ts":%d}')
    written = 0
    while written < n:
        rows = min(segment_rows, n - written)
        with LedgerWriter(folder, "producer", max_bytes=1 << 30) as w:
            for i in range(written, written + rows):
                w.append_formatted((fmt, "p0", i, i % 4, i // 4, T0 + i, T0 + i + 3))
        written += rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=1_000_000, help="ledger rows (default 1,000,000)")
    ap.add_argument("--segment-rows", type=int, default=50_000, help="rows per spool segment (default 50,000)")
    ap.add_argument("--partitions", type=int, default=4, help="ledger topic partitions (default 4)")
    ap.add_argument("--bootstrap", default=None, help="use this broker instead of starting one")
    args = ap.parse_args(argv)

    from audit.runtime.local_kafka import LocalKafka
    from spark_jobs.ingest import ingest
    from spark_jobs.ingest_topic import land_topic
    from spark_jobs.io.session import build_spark

    work = Path(tempfile.mkdtemp(prefix="msgaudit-bench-ledger-"))
    broker: Any = None
    try:
        bootstrap = args.bootstrap
        if bootstrap is None:
            broker = LocalKafka(work / "kafka", port=None, nodes=1).start(timeout=300)
            bootstrap = broker.bootstrap_servers
        topic = f"bench-ledger-{uuid.uuid4().hex[:8]}"
        admin = AdminClient({"bootstrap.servers": bootstrap})  # held: a collected client fails its futures
        admin.create_topics([NewTopic(topic, args.partitions, 1)])[topic].result(timeout=30)
        spool = work / "spool"
        t = time.monotonic()
        write_spool(spool / "producer", args.n, args.segment_rows)
        print(f"spool: {args.n} rows in {len(sealed_segments(spool / 'producer'))} segments "
              f"({time.monotonic() - t:.1f}s)", flush=True)

        def cfg(name: str, topic_: str | None) -> Any:
            data: dict[str, Any] = {"home": str(work / "home"), "lake": str(work / name), "ledger_dir": str(spool),
                                    "kafka": {"bootstrap.servers": bootstrap},
                                    "spark": {"spark.sql.shuffle.partitions": "4"}}
            if topic_:
                data["ledger"] = {"topic": topic_}
            return config_mod.from_dict(data, source="<bench>", base=work)

        files_cfg, topic_cfg = cfg("lake-files", None), cfg("lake-topic", topic)
        t = time.monotonic()
        shipped = ship_spool(spool, {"bootstrap.servers": bootstrap}, topic, timeout=300)
        ship_s = time.monotonic() - t
        print(f"ship: {shipped.rows} rows in {ship_s:.1f}s = {shipped.rows / ship_s:,.0f} rows/s", flush=True)

        spark = build_spark(files_cfg, app_name="msgaudit-bench-ledger")
        spark.range(1).count()  # JVM warm
        figures: dict[str, float] = {}
        for name, run in (("files", lambda: ingest(spark, files_cfg)),
                          ("topic", lambda: land_topic(spark, topic_cfg))):
            t = time.monotonic()
            result = run()
            s = time.monotonic() - t
            figures[name] = result.landed / s
            print(f"{name}: {result.landed} rows landed in {s:.1f}s = {figures[name]:,.0f} rows/s", flush=True)
        for seg in sealed_segments(spool / "producer"):
            marker(seg).unlink()
        ship_spool(spool, {"bootstrap.servers": bootstrap}, topic, timeout=300)
        t = time.monotonic()
        replay = land_topic(spark, topic_cfg)
        s = time.monotonic() - t
        figures["topic replay"] = replay.replayed / s
        print(f"topic replay: {replay.replayed} replayed rows read and skipped ({replay.landed} landed) in {s:.1f}s"
              f" = {figures['topic replay']:,.0f} rows/s", flush=True)
        print(f"ratio topic/files: {figures['topic'] / figures['files']:.2f}")
        print(f"ratio topic replay/topic: {figures['topic replay'] / figures['topic']:.2f}")
        spark.stop()
    finally:
        if broker is not None:
            broker.stop()
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
