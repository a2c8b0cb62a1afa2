"""A share group member the lab can SIGKILL: `python -m audit.lab.share_worker ...`.

It consumes JSON messages {"n": <int>, ...} with `AuditedShareConsumer` (share group --group) and
answers each by what the message asks: `"poison": true` -> reject; `"release": true` -> release
(every delivery, until the group's delivery limit archives it); `"slow": S` -> sleep S seconds
before accepting, on its first delivery only; anything else -> accept. It stops after --idle-s
without a record (counted from the first one).

Ground truth (for the scenario, never read by the audit): every record handed to the handler and
every answer is appended to --truth with an unbuffered O_APPEND write, which survives SIGKILL:
`delivered <name> <partition> <offset> <delivery count>` and
`answered <name> <partition> <offset> <accept|release|reject>`.

--done FILE: a member that was handed nothing stops once FILE exists (the scenario's records
are all answered) instead of waiting up to a minute for its first record.

--once: stop after answering one record (so a record it gave up goes to another member).

--hold: after the first poll that hands over records, write --marker (JSON: the records held,
[partition, offset, delivery count] each) and sleep without acknowledging, until SIGKILLed.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from audit.lab.worker import worker_parser


def main(argv: Sequence[str] | None = None) -> int:
    p = worker_parser("python -m audit.lab.share_worker", idle_s=3.0, truth=True)
    p.add_argument("--hold", action="store_true")
    p.add_argument("--marker")
    p.add_argument("--done", help="stop waiting for a first record once this file exists")
    p.add_argument("--once", action="store_true", help="stop after answering one record")
    args = p.parse_args(argv)

    from audit.clients.consumer import ConsumedRecord
    from audit.clients.share_consumer import AuditedShareConsumer

    truth = os.open(args.truth, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def note(line: str) -> None:
        os.write(truth, f"{line}\n".encode())

    consumer = AuditedShareConsumer({"bootstrap.servers": args.bootstrap, "log_level": 0}, topics=[args.topic],
                                    group=args.group, name=args.name, ledger_dir=args.ledger_dir, poll_timeout_s=0.2)
    if args.hold:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            records = consumer.poll()
            if records:
                for r in records:
                    note(f"delivered {args.name} {r.partition} {r.offset} {r.attempt}")
                if args.marker:
                    Path(args.marker).write_text(json.dumps({"records": [[r.partition, r.offset, r.attempt]
                                                                         for r in records]}))
                while True:  # holding the records' locks, until SIGKILL
                    time.sleep(1)
        return 1

    def handle(rec: ConsumedRecord) -> Any:
        note(f"delivered {args.name} {rec.partition} {rec.offset} {rec.attempt}")
        body = json.loads(rec.value or b"{}")
        answer = "reject" if body.get("poison") else "release" if body.get("release") else "accept"
        if body.get("slow") and rec.attempt == 1:
            time.sleep(float(body["slow"]))
        note(f"answered {args.name} {rec.partition} {rec.offset} {answer}")
        return answer

    # Idle counts from the first record (joining the group can take a while on a busy machine).
    limit = 1 if args.once else None
    with consumer:
        first = time.monotonic() + 60
        done = Path(args.done) if args.done else None
        while time.monotonic() < first and not consumer.stats["acquired"] and not (done and done.exists()):
            consumer.run(handle, max_messages=limit, idle_timeout_s=0.5)
        if not (args.once and consumer.stats["acquired"]):
            consumer.run(handle, max_messages=limit, idle_timeout_s=args.idle_s)
    os.close(truth)
    print(json.dumps(consumer.stats))
    return 0


if __name__ == "__main__":
    sys.exit(main())
