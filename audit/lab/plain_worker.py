"""A plain auto-commit consumer the lab SIGKILLs mid-batch: `python -m audit.lab.plain_worker ...`.

This is how most real consumers run: a `confluent_kafka.Consumer` with `enable.auto.commit=true`
and librdkafka's defaults (`enable.auto.offset.store=true`: an offset is stored when `consume()`
hands its message over; a background timer commits the stored offsets every
`auto.commit.interval.ms`, and `close()` commits them too). No msgaudit consumer wrapper: the only
audit code is a thin loop that appends one consumption row per processed record (the
`consumed_records` format, docs/design.md §4.2) with `LedgerWriter` and flushes it before the next
record -- what an application that wants its consumption audited adds.

Ground truth (for the scenario, never read by the audit): every batch handed over and every
record processed is appended to --truth with an unbuffered O_APPEND write, which survives SIGKILL:
`handed <partition> <offset>` and `processed <partition> <offset>`.

--pause-after N: after processing N records (in this process) write --paused and sleep, so the
scenario can SIGKILL the process there, mid-batch. Without it the loop stops after --idle-s
without messages (counted from the first one) and closes the consumer (which commits).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

from audit.lab.worker import worker_parser


def main(argv: Sequence[str] | None = None) -> int:
    p = worker_parser("python -m audit.lab.plain_worker", idle_s=3.0, truth=True)
    p.add_argument("--commit-interval-ms", type=int, default=5000)
    p.add_argument("--batch-size", type=int, default=10)
    p.add_argument("--pause-after", type=int, default=0)
    p.add_argument("--paused")
    args = p.parse_args(argv)

    from confluent_kafka import Consumer

    from audit.clients.ledger import LedgerWriter
    from audit.core import headers as audit_headers

    consumer = Consumer({
        "bootstrap.servers": args.bootstrap, "group.id": args.group, "auto.offset.reset": "earliest",
        "enable.auto.commit": True, "auto.commit.interval.ms": args.commit_interval_ms,
        # A restarted process takes over its dead self's partitions at once (static membership).
        "group.instance.id": f"{args.group}-{args.name}", "session.timeout.ms": 6000, "log_level": 0,
    })
    consumer.subscribe([args.topic])
    instance = audit_headers.new_pid(args.name)
    ledger = LedgerWriter(Path(args.ledger_dir) / "consumer", f"{args.group}-{args.name}".replace(".", "_"))
    truth = os.open(args.truth, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    seq = 0
    # Idle counts from the first message (joining the group can take a while on a busy machine).
    last: float | None = None
    deadline = time.monotonic() + 120
    try:
        while (time.monotonic() - last < args.idle_s) if last is not None else time.monotonic() < deadline:
            batch = [m for m in consumer.consume(args.batch_size, 0.5) if m.error() is None]
            if not batch:
                continue
            last = time.monotonic()
            os.write(truth, "".join(f"handed {m.partition()} {m.offset()}\n" for m in batch).encode())
            for m in batch:
                h = audit_headers.parse(cast(Any, m.headers()))
                ledger.append({"group": args.group, "consumer": instance, "consume_seq": seq, "topic": m.topic(),
                               "partition": m.partition(), "offset": m.offset(), "pid": h.pid, "seq": h.seq,
                               "outcome": "processed", "attempt": 1, "consume_ts": time.time_ns() // 1_000_000})
                ledger.flush()
                os.write(truth, f"processed {m.partition()} {m.offset()}\n".encode())
                seq += 1
                if args.pause_after and seq == args.pause_after and args.paused:
                    Path(args.paused).write_text("paused")
                    while True:  # until SIGKILL
                        time.sleep(1)
    finally:
        os.close(truth)
    consumer.close()
    ledger.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
