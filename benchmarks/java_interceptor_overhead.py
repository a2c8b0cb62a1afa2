"""Throughput of a Java producer with the msgaudit interceptor versus the same producer sending
the same header without it, on a real broker (kafka-clients from the jar cache).

`benchmarks/java/ProducerPerf.java` (compiled here with javac) sends N records of `--size` bytes
and flushes; three kinds run side by side, each in its own JVM with identical producer settings
(idempotent, acks=all, linger.ms=5, batch.size=1 MB, buffer.memory kafka-clients' 32 MiB unless
`--buffer-memory`): `java+headers`, the program adding the
packed `audit.id` header the interceptor would add (<pid>/<seq>/<ts>, built per record);
`java+interceptor`, the unchanged program with `interceptor.classes=...AuditProducerInterceptor`
(stamping plus the ledger of every ack, written to a scratch folder); and `java(plain)`, no header.
Runs are interleaved (the order rotates each repetition); the figure per kind is the median.
Each run reports the JVM's CPU time per record too.

    .venv/bin/python benchmarks/java_interceptor_overhead.py                     # 1,000,000 records, own broker
    .venv/bin/python benchmarks/java_interceptor_overhead.py --n 300000 --reps 3
    .venv/bin/python benchmarks/java_interceptor_overhead.py --bootstrap 127.0.0.1:9092

The ratio lines name both sides; the first is the target's, `ratio java+interceptor/java+headers`.
This script measures; it asserts nothing.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from confluent_kafka.admin import AdminClient, NewTopic  # noqa: E402

from audit.runtime.jars import interceptors_jar, jars  # noqa: E402

SETTINGS = ["enable.idempotence=true", "acks=all", "linger.ms=5", "batch.size=1000000", "compression.type=none"]
DEFAULT_BUFFER_MEMORY = 32 << 20  # kafka-clients' default buffer.memory
KINDS = ("java+headers", "java+interceptor", "java(plain)")


def compile_perf(work: Path) -> list[str]:
    clients = [j for j in jars("kafka-broker") if j.name.startswith(("kafka-clients-", "slf4j-api-", "lz4-",
                                                                      "snappy-", "zstd-"))]
    cp = ":".join(str(j) for j in [*clients, interceptors_jar(build=True)])
    src = Path(__file__).resolve().parent / "java" / "ProducerPerf.java"
    subprocess.run(["javac", "-cp", cp, "-d", str(work), str(src)], check=True)
    return ["java", "-Xms512m", "-Xmx1g", "-cp", f"{cp}:{work}", "ProducerPerf"]


def run_one(cmd: list[str], bootstrap: str, kind: str, n: int, size: int, partitions: int,
            ledger: Path, buffer_memory: int) -> tuple[float, float]:
    topic = f"jbench-{uuid.uuid4().hex[:8]}"
    admin = AdminClient({"bootstrap.servers": bootstrap})
    admin.create_topics([NewTopic(topic, partitions, 1)])[topic].result(timeout=30)
    mode = {"java+headers": "headers", "java+interceptor": "interceptor", "java(plain)": "plain"}[kind]
    extra = []
    if kind == "java+interceptor":
        ledger.mkdir(parents=True, exist_ok=True)
        extra = ["interceptor.classes=io.msgaudit.interceptors.AuditProducerInterceptor",
                 f"msgaudit.ledger.dir={ledger}", "msgaudit.producer.name=bench"]
    r = subprocess.run([*cmd, topic, str(n), str(size), mode, f"bootstrap.servers={bootstrap}", *SETTINGS,
                        f"buffer.memory={buffer_memory}", *extra],
                       capture_output=True, text=True, timeout=3600)
    line = next((x for x in r.stdout.splitlines() if x.startswith("RESULT ")), None)
    if r.returncode != 0 or line is None:
        raise SystemExit(f"{kind} failed:\n{r.stderr[-2000:]}")
    admin.delete_topics([topic])
    shutil.rmtree(ledger, ignore_errors=True)
    _, rate, cpu = line.split()
    return float(rate), float(cpu)


def run(bootstrap: str, n: int, reps: int, size: int, partitions: int, work: Path,
        buffer_memory: int = DEFAULT_BUFFER_MEMORY) -> float:
    cmd = compile_perf(work / "classes")
    results: dict[str, list[tuple[float, float]]] = {k: [] for k in KINDS}
    for rep in range(reps):
        order = KINDS[rep % len(KINDS):] + KINDS[:rep % len(KINDS)]
        for kind in order:
            rate, cpu = run_one(cmd, bootstrap, kind, n, size, partitions, work / "ledger", buffer_memory)
            results[kind].append((rate, cpu))
            print(f"rep {rep + 1} {kind:17s} {rate:10.0f} msg/s  {cpu:7.2f} us CPU/msg", flush=True)
    med = {k: statistics.median(r for r, _ in v) for k, v in results.items()}
    cpu_med = {k: statistics.median(c for _, c in v) for k, v in results.items()}
    for k in KINDS:
        print(f"median {k:17s} {med[k]:10.0f} msg/s  {cpu_med[k]:7.2f} us CPU/msg")
    ratio = med["java+interceptor"] / med["java+headers"]
    print(f"ratio java+interceptor/java+headers: {ratio:.3f}")
    print(f"ratio java+headers/java(plain): {med['java+headers'] / med['java(plain)']:.3f}")
    print(f"ratio java+interceptor/java(plain): {med['java+interceptor'] / med['java(plain)']:.3f}")
    print(f"ratio cpu java+interceptor/java+headers: {cpu_med['java+interceptor'] / cpu_med['java+headers']:.3f}")
    return ratio


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=1_000_000, help="records per run (default 1,000,000)")
    ap.add_argument("--reps", type=int, default=3, help="repetitions of every kind (default 3)")
    ap.add_argument("--size", type=int, default=200, help="record value size in bytes (default 200)")
    ap.add_argument("--partitions", type=int, default=3, help="partitions of each benchmark topic (default 3)")
    ap.add_argument("--buffer-memory", type=int, default=DEFAULT_BUFFER_MEMORY,
                    help="the producers' buffer.memory in bytes (default 33554432, kafka-clients' default); "
                         "268435456 lets a producer that outruns the broker hold ~900k pending records in its "
                         "1 GB heap, and the run then measures the collector copying them")
    ap.add_argument("--bootstrap", default=None,
                    help="use this running broker (default: start a private one with audit.runtime.local_kafka)")
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="msgaudit-jbench-"))
    try:
        if args.bootstrap:
            run(args.bootstrap, args.n, args.reps, args.size, args.partitions, work, args.buffer_memory)
        else:
            from audit.runtime.local_kafka import LocalKafka

            with LocalKafka(work / "kafka", port=None, nodes=1) as kafka:
                run(kafka.bootstrap_servers, args.n, args.reps, args.size, args.partitions, work, args.buffer_memory)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
