"""A consumer process the lab can kill at an exact point: `python -m audit.lab.worker ...`.

It consumes JSON messages {"n": <int>, "poison": <bool>} with `AuditedConsumer` and the given
semantics, writes {"n", "body"} rows to an optional SQL sink, or (exactly_once_kafka) forwards the
value to --output-topic inside the transaction, and stops when idle or after --max-messages.

Kill switch: --kill-at STAGE (one of audit.clients.consumer.STAGES) and --kill-offset N. At that stage of
the first batch that holds source offset N (first attempt), the worker writes the batch's source
coordinates to --marker as JSON and calls os._exit(137): nothing is flushed, committed or closed
on the way out, which is what SIGKILL leaves behind. The marker is the scenario's ground truth
of what the dead process held; the worker never reads the audit's tables.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

KILLED_EXIT = 137


def worker_parser(prog: str, *, idle_s: float, truth: bool = False) -> argparse.ArgumentParser:
    """The options every lab worker takes: the topic and group it consumes, its name, its ledger
    folder, how long it waits idle, and (`truth`) the file its ground truth lines go to."""
    p = argparse.ArgumentParser(prog=prog)
    for option in ("--bootstrap", "--topic", "--group", "--name", "--ledger-dir", *(("--truth",) if truth else ())):
        p.add_argument(option, required=True)
    p.add_argument("--idle-s", type=float, default=idle_s)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    p = worker_parser("python -m audit.lab.worker", idle_s=2.0)
    p.add_argument("--semantics", required=True)
    p.add_argument("--sink-url")
    p.add_argument("--sink-table")
    p.add_argument("--sink-mode", default="insert")
    p.add_argument("--output-topic")
    p.add_argument("--ledger-topic", help="ship the ledger there (exactly_once_kafka: inside the transaction)")
    p.add_argument("--isolation", default="read_committed")
    p.add_argument("--batch-size", type=int, default=5)
    p.add_argument("--max-messages", type=int, default=None)
    p.add_argument("--max-attempts", type=int, default=0, help="0: no RetryPolicy")
    p.add_argument("--kill-at")
    p.add_argument("--kill-offset", type=int, default=-1)
    p.add_argument("--marker")
    args = p.parse_args(argv)

    from audit.clients.consumer import AuditedConsumer, ConsumedRecord, RetryPolicy
    from audit.clients.sinks import SqlSink

    def on_stage(stage: str, records: Sequence[ConsumedRecord]) -> None:
        if stage == args.kill_at and any(r.offset == args.kill_offset and r.attempt == 1 for r in records):
            if args.marker:
                Path(args.marker).write_text(json.dumps(
                    {"stage": stage, "records": [[r.topic, r.partition, r.offset] for r in records]}))
            os._exit(KILLED_EXIT)

    sink = SqlSink(args.sink_url, args.sink_table, args.sink_mode) if args.sink_url else None
    retry = RetryPolicy(max_attempts=args.max_attempts, backoff_ms=100) if args.max_attempts else None
    conf: dict[str, Any] = {"bootstrap.servers": args.bootstrap, "session.timeout.ms": 6000,
                            "heartbeat.interval.ms": 500, "isolation.level": args.isolation,
                            # A restarted worker takes over its dead self's partitions at once.
                            "group.instance.id": f"{args.group}-{args.name}"}
    consumer = AuditedConsumer(
        conf, topics=[args.topic], group=args.group, name=args.name, semantics=args.semantics, sink=sink,
        retry=retry, ledger_dir=args.ledger_dir, batch_size=args.batch_size, poll_timeout_s=0.2,
        on_stage=on_stage, producer_config={"transaction.timeout.ms": 10000}, ledger_topic=args.ledger_topic,
    )

    def handle(rec: ConsumedRecord) -> Any:
        body = json.loads(rec.value or b"{}")
        if body.get("poison"):
            raise ValueError(f"poison message n={body.get('n')}")
        if args.output_topic:
            assert consumer.producer is not None
            consumer.producer.produce(args.output_topic, rec.value, rec.key)
        return {"n": body.get("n"), "body": (rec.value or b"").decode()} if sink is not None else None

    with consumer:
        stats = consumer.run(handle, idle_timeout_s=args.idle_s, max_messages=args.max_messages)
    if sink is not None:
        sink.close()
    print(json.dumps({"processed": stats.processed, "failed": stats.failed,
                      "dead_lettered": stats.dead_lettered}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
