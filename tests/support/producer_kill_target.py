"""A process for tests to SIGKILL mid-write: a LedgerWriter, or an AuditedProducer on a real broker.

    python -m tests.support.producer_kill_target ledger DIR N
        appends rows {"i": 0..N-1}, flush(), prints "READY N", then keeps appending
        rows N, N+1, ... (never flushing) until killed.
    python -m tests.support.producer_kill_target producer DIR N BOOTSTRAP TOPIC
        produces N audited messages, flush(), prints "READY N", then keeps producing
        (polling, never flushing) until killed.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path


def main(argv: list[str]) -> int:
    mode, directory, n = argv[0], Path(argv[1]), int(argv[2])
    if mode == "ledger":
        from audit.clients.ledger import LedgerWriter

        w = LedgerWriter(directory, "kill", flush_interval_s=0.05)
        for i in range(n):
            w.append({"i": i, "pad": "x" * 50})
        w.flush()
        print(f"READY {n}", flush=True)
        i = n
        while True:
            w.append({"i": i, "pad": "x" * 50})
            i += 1
            if i % 100 == 0:
                time.sleep(0.001)
    if mode == "producer":
        from audit.clients.producer import AuditedProducer

        bootstrap, topic = argv[3], argv[4]
        p = AuditedProducer({"bootstrap.servers": bootstrap, "linger.ms": 2}, producer_name="victim",
                            ledger_dir=directory)
        for i in range(n):
            p.produce(topic, b"v%d" % i)
        p.flush()
        print(f"READY {n}", flush=True)
        i = n
        while True:
            try:
                p.produce(topic, b"v%d" % i)
                i += 1
            except BufferError:
                pass
            p.poll(0.001)
    raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
