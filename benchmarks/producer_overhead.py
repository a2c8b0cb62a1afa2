"""Throughput of AuditedProducer versus a plain confluent_kafka.Producer, on a real broker.

Every producer uses identical librdkafka settings (idempotent, acks=all, same linger/batch) and
a counting delivery callback. Four kinds run side by side: `plain`; `plain+headers`, a plain
Producer sending audit-sized static headers in the form the audited producers send (one packed
`audit.id` by default, `--header-form three` for audit.pid/seq/ts): what the wire and librdkafka
pay for the headers, without any audit code; `audited(plugin)`, AuditedProducer with stamping and
the ledger in the libmsgaudit librdkafka plugin; `audited(python)`, the pure-Python fallback.
`--compare-forms` adds a plain Producer sending the other form. Runs are interleaved (the
order rotates each repetition) so drifting load on a shared machine hits all alike; the figure
per producer is the median over repetitions. Each run also reports the client's CPU time per
message (every thread of this process): with the broker on the same machine, throughput ratios
include the broker's share of the CPU, while client CPU is what an application host pays.

    .venv/bin/python benchmarks/producer_overhead.py                 # 1,000,000 messages, own broker
    .venv/bin/python benchmarks/producer_overhead.py --n 200000 --reps 3
    .venv/bin/python benchmarks/producer_overhead.py --bootstrap 127.0.0.1:9092   # running broker
    .venv/bin/python benchmarks/producer_overhead.py --compare-forms   # + the other header form
    .venv/bin/python benchmarks/producer_overhead.py --header-form three   # every side sends three

Ratio lines name both sides, e.g. `ratio audited(plugin)/plain+headers: 0.97`; the last line is
`ratio audited(plugin)/plain`.
This script measures; it asserts nothing.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from confluent_kafka import Producer  # noqa: E402
from confluent_kafka.admin import AdminClient, NewTopic  # noqa: E402

from audit.clients import plugin as msgaudit_plugin  # noqa: E402
from audit.clients.ledger import sealed_segments  # noqa: E402
from audit.clients.producer import AuditedProducer  # noqa: E402

SETTINGS = {
    "enable.idempotence": True,
    "acks": "all",
    "linger.ms": 5,
    "batch.size": 1_000_000,
    "queue.buffering.max.messages": 500_000,
    "compression.type": "none",
}


def _make_topic(bootstrap: str, partitions: int) -> str:
    name = f"bench-{uuid.uuid4().hex[:8]}"
    admin = AdminClient({"bootstrap.servers": bootstrap})
    admin.create_topics([NewTopic(name, partitions, 1)])[name].result(timeout=30)
    return name


def _drive(producer: Any, topic: str, n: int, value: bytes, headers: Any = None) -> tuple[float, int, float]:
    """Produce n messages, poll on BufferError, flush; return (seconds, delivered count, CPU
    seconds of this process: every thread, librdkafka's and the ledger writer's included)."""
    delivered = [0]

    def on_delivery(err: Any, msg: Any) -> None:
        if err is None:
            delivered[0] += 1

    produce = producer.produce
    poll = producer.poll
    c0 = time.process_time()
    t0 = time.perf_counter()
    for i in range(n):
        while True:
            try:
                if headers is None:
                    produce(topic, value, on_delivery=on_delivery)
                else:
                    produce(topic, value, on_delivery=on_delivery, headers=headers)
                break
            except BufferError:
                poll(0.005)
        if not i & 1023:
            poll(0)
    producer.flush()
    return time.perf_counter() - t0, delivered[0], time.process_time() - c0


# Audit-sized static headers, per header form: what the wire and the broker pay for the audit,
# without our code.
STATIC_HEADERS = {
    "three": [("audit.pid", b"bench:0123456789ab"), ("audit.seq", b"500000"), ("audit.ts", b"1795290000000")],
    "packed": [("audit.id", b"bench:0123456789ab/500000/1795290000000")],
}


def run(bootstrap: str, n: int, reps: int, partitions: int, size: int, ledger_root: Path,
        decompose: bool, compression: str = "none", form: str = "packed", compare_forms: bool = False) -> float:
    value = b"x" * size
    conf = {"bootstrap.servers": bootstrap, **SETTINGS, "compression.type": compression}
    other = "three" if form == "packed" else "packed"
    kinds = ["plain", "plain+headers", "audited(plugin)", "audited(python)"]
    if not decompose:
        kinds.remove("plain+headers")
    if compare_forms:
        kinds.insert(1, f"plain+{other}")
    static = {"plain+headers": STATIC_HEADERS[form], f"plain+{other}": STATIC_HEADERS[other]}
    plugin_file = msgaudit_plugin.build()
    results: dict[str, list[float]] = {k: [] for k in kinds}
    cpu_us: dict[str, list[float]] = {k: [] for k in kinds}
    # Warm the broker (topic creation, segment files, JIT) outside the measured runs.
    _drive(Producer(conf), _make_topic(bootstrap, partitions), min(n, 50_000), value)  # warm-up
    for rep in range(reps):
        order = kinds[rep % len(kinds):] + kinds[:rep % len(kinds)]  # rotate: no kind always first
        for kind in order:
            topic = _make_topic(bootstrap, partitions)
            if kind.startswith("audited"):
                ledger = ledger_root / f"rep{rep}-{kind[8:-1]}"
                use_plugin = kind == "audited(plugin)"
                os.environ[msgaudit_plugin.PLUGIN_ENV] = str(plugin_file) if use_plugin else "off"
                audited = AuditedProducer(conf, producer_name="bench", ledger_dir=ledger, use_plugin=use_plugin,
                                          header_form=form)
                seconds, delivered, cpu = _drive(audited, topic, n, value)
                audited.close()
                # One acked row per message; a produce() refused with a full queue (BufferError, then
                # sent again) is a call of its own and leaves a failed row, as the contract says.
                data = b"".join(seg.read_bytes() for seg in sealed_segments(ledger))
                acked, rows = data.count(b'"status":"acked"'), data.count(b"\n")
                if acked != n:
                    raise SystemExit(f"{kind} run wrote {acked} acked ledger rows for {n} messages")
                if rows != acked:
                    print(f"  ({kind}: {rows - acked} failed rows for produce() calls refused with a full queue)")
                shutil.rmtree(ledger, ignore_errors=True)
            else:
                headers = static.get(kind)
                seconds, delivered, cpu = _drive(Producer(conf), topic, n, value, headers)
            if delivered != n:
                raise SystemExit(f"{kind} run delivered {delivered} of {n} messages")
            results[kind].append(n / seconds)
            cpu_us[kind].append(cpu / n * 1e6)
            print(f"rep {rep + 1}/{reps} {kind:>15}: {n / seconds:>11,.0f} msg/s  ({seconds:.2f}s, "
                  f"client CPU {cpu / n * 1e6:.2f} us/msg)", flush=True)
    med = {k: statistics.median(v) for k, v in results.items()}
    print(f"median over {reps} runs of {n:,} x {size} B messages, {partitions} partitions, "
          f"compression {compression}, header form {form}:")
    for k in kinds:
        print(f"  {k:>15}: {med[k]:>11,.0f} msg/s, client CPU {statistics.median(cpu_us[k]):.2f} us/msg")
    pairs = [("audited(python)", "plain"), ("audited(plugin)", "audited(python)")]
    if decompose:
        pairs = [("plain+headers", "plain"), ("audited(python)", "plain+headers"),
                 ("audited(plugin)", "plain+headers"), *pairs]
    if compare_forms:
        pairs.insert(0, (f"plain+{other}", "plain"))
        if decompose:
            pairs.insert(1, ("plain+headers", f"plain+{other}"))
    for a, b in pairs:
        print(f"ratio {a}/{b}: {med[a] / med[b]:.3f}")
    ratio = med["audited(plugin)"] / med["plain"]
    print(f"ratio audited(plugin)/plain: {ratio:.3f}")
    return ratio


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=1_000_000, help="messages per run (default 1,000,000)")
    ap.add_argument("--reps", type=int, default=3, help="repetitions of every kind (default 3)")
    ap.add_argument("--size", type=int, default=200, help="message value size in bytes (default 200)")
    ap.add_argument("--partitions", type=int, default=3, help="partitions of each benchmark topic (default 3)")
    ap.add_argument("--compression", default="none", choices=["none", "lz4", "zstd", "snappy", "gzip"],
                    help="compression.type for every producer (default none)")
    ap.add_argument("--header-form", default="packed", choices=["packed", "three"],
                    help="the audit header form every side sends: one packed audit.id (default) or audit.pid/seq/ts")
    ap.add_argument("--compare-forms", action="store_true",
                    help="also run a plain Producer sending the other header form")
    ap.add_argument("--no-decompose", action="store_true",
                    help="skip the plain+headers runs (plain Producer sending audit-sized static headers)")
    ap.add_argument("--bootstrap", default=None,
                    help="use this running broker (default: start a private one with audit.runtime.local_kafka)")
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="msgaudit-bench-"))
    try:
        if args.bootstrap:
            run(args.bootstrap, args.n, args.reps, args.partitions, args.size, work / "ledger",
                not args.no_decompose, args.compression, args.header_form, args.compare_forms)
        else:
            from audit.runtime.local_kafka import LocalKafka

            # the controller listens on port + 1
            with LocalKafka(work / "kafka", port=None, nodes=1) as kafka:
                run(kafka.bootstrap_servers, args.n, args.reps, args.partitions, args.size, work / "ledger",
                    not args.no_decompose, args.compression, args.header_form, args.compare_forms)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
