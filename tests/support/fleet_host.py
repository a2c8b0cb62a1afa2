"""One host of the fleet e2e (tests/test_fleet.py), run as its own process with its own config and spool.

    python fleet_host.py producer CONFIG TOPIC NAME COUNT SECONDS
        produce COUNT messages evenly over SECONDS through an AuditedProducer (ledger shipped to
        the config's ledger topic), close, print one JSON line of ground truth: the acked
        (pid, seq, partition, offset) of every message.
    python fleet_host.py consumer CONFIG TOPIC NAME GROUP EXPECTED DEADLINE_S
        consume with an at_least_once AuditedConsumer until EXPECTED records are processed (or the
        deadline), close, print one JSON line: the (partition, offset) of every processed record.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

from audit.clients.consumer import AuditedConsumer
from audit.clients.producer import AuditedProducer
from audit.core import config as config_mod


def produce(cfg: Any, topic: str, name: str, count: int, seconds: float) -> None:
    acked: list[list[Any]] = []

    def report(err: Any, msg: Any) -> None:
        if err is None:
            acked.append([int(msg.partition()), int(msg.offset())])

    p = AuditedProducer.from_config(cfg, producer_name=name, ledger_max_age_s=0.5)
    t0 = time.monotonic()
    for i in range(count):
        p.produce(topic, value=f"{name}-{i}".encode(), key=str(i).encode(), on_delivery=report)
        p.poll(0)
        delay = t0 + seconds * (i + 1) / count - time.monotonic()
        if delay > 0:
            time.sleep(delay)
    p.flush(30)
    stats = p.stats()
    p.close(60)
    print(json.dumps({"pid": p.pid, "acked": sorted(acked), "ledger_topic_failed": stats.ledger_topic_failed}),
          flush=True)


def consume(cfg: Any, topic: str, name: str, group: str, expected: int, deadline_s: float) -> None:
    seen: list[list[int]] = []

    def handler(rec: Any) -> None:
        seen.append([rec.partition, rec.offset])

    c = AuditedConsumer.from_config(cfg, topics=[topic], group=group, name=name, batch_size=50)
    deadline = time.monotonic() + deadline_s
    c.run(handler, max_messages=expected, stop=lambda: time.monotonic() > deadline)
    c.close()
    print(json.dumps({"processed": sorted(seen)}), flush=True)


if __name__ == "__main__":
    role, config_path, topic, name = sys.argv[1:5]
    cfg = config_mod.load(config_path)
    if role == "producer":
        produce(cfg, topic, name, int(sys.argv[5]), float(sys.argv[6]))
    else:
        consume(cfg, topic, name, sys.argv[5], int(sys.argv[6]), float(sys.argv[7]))
