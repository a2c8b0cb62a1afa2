"""A consumer process for the crash tests of tests/test_consumer.py (run as a subprocess).

It consumes JSON messages {"n": <int>, ...} with AuditedConsumer and the given semantics, writes
{"n", "body"} rows to an optional SQL sink (or, for exactly_once_kafka, produces the value to
--output-topic inside the transaction), and stops when idle.

Fault injection (environment, so the parent test names the dangerous point):
  MSGAUDIT_KILL_AT      a stage of audit.clients.consumer.STAGES
  MSGAUDIT_KILL_OFFSET  source offset: die at that stage of the first batch that holds it
Before dying it writes the batch's source coordinates to --marker as JSON, then os._exit(137),
so nothing is flushed or closed on the way out: exactly what a SIGKILL leaves behind.
--progress FILE gets the number of handled records after every batch (for the rebalance test).
--hold-until FILE: once records of two partitions were handled, write "held" to --progress and
wait in the handler until FILE exists (so a second member can join mid-stream, deterministically).
--ready FILE is written just before the loop starts (the member is about to join its group).
--skip-every K: messages whose n is a multiple of K are processed without a sink row (a filter).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from audit.clients.consumer import AuditedConsumer, ConsumedRecord, RetryPolicy
from audit.clients.sinks import SqlSink


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--bootstrap", required=True)
    p.add_argument("--topic", action="append", required=True)
    p.add_argument("--group", required=True)
    p.add_argument("--name", required=True)
    p.add_argument("--semantics", required=True)
    p.add_argument("--ledger-dir", required=True)
    p.add_argument("--sink-url")
    p.add_argument("--sink-table")
    p.add_argument("--sink-mode", default="insert")
    p.add_argument("--output-topic")
    p.add_argument("--ledger-topic", help="ship the ledger there (exactly_once_kafka: inside the transaction)")
    p.add_argument("--batch-size", type=int, default=5)
    p.add_argument("--idle-s", type=float, default=2.0)
    p.add_argument("--sleep-ms", type=float, default=0.0)
    p.add_argument("--max-attempts", type=int, default=0, help="0: no RetryPolicy")
    p.add_argument("--marker")
    p.add_argument("--progress")
    p.add_argument("--hold-until")
    p.add_argument("--ready")
    p.add_argument("--max-partition-fetch-bytes", type=int)
    p.add_argument("--skip-every", type=int, default=0,
                   help="the handler writes no sink row for messages whose n is a multiple of this")
    args = p.parse_args(argv)
    # The library's own lines (assignments, revokes, commits) go to stderr: the tests print them on failure.
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s {args.name} %(levelname)s %(name)s: %(message)s")

    kill_at = os.environ.get("MSGAUDIT_KILL_AT")
    kill_offset = int(os.environ.get("MSGAUDIT_KILL_OFFSET", "-1"))

    def on_stage(stage: str, records: Sequence[ConsumedRecord]) -> None:
        if stage == "committed" and args.progress and not args.hold_until:
            tmp = Path(args.progress + ".tmp")
            tmp.write_text(str(consumer.stats.handled))
            tmp.replace(args.progress)
        if stage == kill_at and any(r.offset == kill_offset and r.attempt == 1 for r in records):
            if args.marker:
                Path(args.marker).write_text(json.dumps(
                    {"stage": stage, "records": [[r.topic, r.partition, r.offset] for r in records]}))
            os._exit(137)

    sink = SqlSink(args.sink_url, args.sink_table, args.sink_mode) if args.sink_url else None
    retry = RetryPolicy(max_attempts=args.max_attempts, backoff_ms=100) if args.max_attempts else None
    consumer = AuditedConsumer(
        # Static membership: the rerun takes the dead instance's place at once instead of waiting
        # a session timeout for the broker to notice it is gone.
        {"bootstrap.servers": args.bootstrap, "session.timeout.ms": 6000, "heartbeat.interval.ms": 500,
         "group.instance.id": args.name,
         **({"max.partition.fetch.bytes": args.max_partition_fetch_bytes} if args.max_partition_fetch_bytes else {})},
        topics=args.topic, group=args.group, name=args.name, semantics=args.semantics, sink=sink,
        retry=retry, ledger_dir=args.ledger_dir, batch_size=args.batch_size, poll_timeout_s=0.2,
        on_stage=on_stage, producer_config={"transaction.timeout.ms": 10000}, ledger_topic=args.ledger_topic,
    )

    seen_partitions: set[int] = set()

    def hold(partition: int) -> None:
        seen_partitions.add(partition)
        if args.hold_until and len(seen_partitions) >= 2 and not Path(args.hold_until).exists():
            Path(args.progress).write_text("held")
            deadline = time.monotonic() + 60
            while not Path(args.hold_until).exists() and time.monotonic() < deadline:
                time.sleep(0.05)

    def handle(rec: ConsumedRecord) -> Any:
        hold(rec.partition)
        body = json.loads(rec.value or b"{}")
        if args.sleep_ms:
            time.sleep(args.sleep_ms / 1000)
        if body.get("poison"):
            raise ValueError(f"poison message n={body['n']}")
        if args.output_topic:
            assert consumer.producer is not None
            consumer.producer.produce(args.output_topic, rec.value, rec.key)
        if sink is None or (args.skip_every and body["n"] % args.skip_every == 0):
            return None  # processed, nothing to write: only the consumption rows show it
        return {"n": body["n"], "body": (rec.value or b"").decode()}

    with consumer:
        if args.ready:
            Path(args.ready).write_text("ready")
        stats = consumer.run(handle, idle_timeout_s=args.idle_s)
    if sink is not None:
        sink.close()
    print(json.dumps({"processed": stats.processed, "failed": stats.failed,
                      "dead_lettered": stats.dead_lettered, "rebalances": stats.rebalances}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
