"""Fixed cost of `msgaudit capture`: many small topics read and MERGEd together or one by one.

Starts its own broker, creates K topics (default 50) of 2 partitions and produces M audited
messages (default 1,000) to each, then, in one Spark session, times each capture of the window
into a fresh lake (so every capture writes every row, as a scheduled window's first capture does),
interleaved:

- `one topic`: the capture of one of the topics alone;
- `together`: all K topics, `capture.BATCH_TOPICS` of them per Kafka read and MERGE (the default);
- `one by one`: all K topics, one read and one MERGE per topic (`BATCH_TOPICS = 1`);
- `before`: one by one with the Java consumer's default `fetch.max.wait.ms` of 500 ms
  (`FETCH_MAX_WAIT_MS = 500`): how every capture ran before the batches (`--no-before` skips it);
- `unsorted` (with `--unsorted`): together, the log left in the MERGE's order (its hours not
  rewritten in seq order: `lake.rewrite_by_seq` skipped), so `together / unsorted` is what the
  rewrite costs.

With `--mirrors`, every topic also has a mirror whose copy is another topic on the same broker
(holding the same messages), captured with it into `mirror_records`: together the copies of a batch
share one read and one MERGE, one by one each copy has its own.

It prints the medians, the ratios between the ways and K topics / one topic, and whether the lakes
of every K-topic way hold the same log_records (and mirror_records) rows (every produced message
once).

    .venv/bin/python benchmarks/capture_topics.py --topics 50 --messages 1000 --reps 3
    .venv/bin/python benchmarks/capture_topics.py --topics 50 --messages 1000 --reps 2 --mirrors --no-before
    .venv/bin/python benchmarks/capture_topics.py --topics 50 --messages 1000 --reps 3 --no-before --no-one-by-one --unsorted

A measurement script, not a test: it asserts nothing about time, it prints ratios.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from audit.core import config as config_mod  # noqa: E402
from audit.core.config import Config  # noqa: E402
from audit.core.windows import floor_window  # noqa: E402
from audit.runtime.local_kafka import LocalKafka  # noqa: E402

WINDOW = timedelta(hours=1)
PARTITIONS = 2


def produce(bootstrap: str, ledger_dir: Path, topics: list[str], m: int) -> None:
    from confluent_kafka.admin import AdminClient, NewTopic

    from audit.clients.producer import AuditedProducer

    admin = AdminClient({"bootstrap.servers": bootstrap, "log_level": 0})
    for f in admin.create_topics([NewTopic(t, num_partitions=PARTITIONS, replication_factor=1)
                                  for t in topics]).values():
        f.result(60)
    p = AuditedProducer({"bootstrap.servers": bootstrap, "linger.ms": 20, "log_level": 0},
                        producer_name="bench", ledger_dir=ledger_dir)
    failed: list[Any] = []

    def delivered(err: Any, _msg: Any) -> None:
        if err is not None:
            failed.append(err)

    for t in topics:
        for i in range(m):
            p.produce(t, b'{"n": %d}' % i, on_delivery=delivered)
        p.poll(0)
    if p.flush(120) != 0 or failed:
        raise SystemExit(f"bench: {len(failed)} messages not delivered")
    p.close()


def copy_of(topic: str) -> str:
    return f"copy-{topic}"


def config(work: Path, name: str, bootstrap: str, topics: list[str], mirrors: bool) -> Config:
    mirror = lambda t: {"mirrors": [{"name": "dr", "kafka": {"bootstrap.servers": bootstrap},  # noqa: E731
                                     "topic": copy_of(t)}]} if mirrors else {}
    return config_mod.from_dict({
        "home": str(work / "home"), "lake": str(work / "lakes" / name),
        "report_store": f"sqlite:///{work / 'report.db'}", "kafka": {"bootstrap.servers": bootstrap},
        "spark": {"master": "local[2]"},
        "topics": {t: {"window": "1h", "grace": "1m", **mirror(t)} for t in topics}}, source="<benchmark>", base=work)


def captured_rows(spark: Any, cfg: Config, mirrors: bool) -> list[tuple[Any, ...]]:
    """log_records' rows (and mirror_records' with --mirrors), without captured_at."""
    from spark_jobs.io.lake import read_table

    rows = [tuple(r) for r in read_table(spark, cfg, "log_records").drop("captured_at").collect()]
    if mirrors:
        rows += [tuple(r) for r in read_table(spark, cfg, "mirror_records").drop("captured_at").collect()]
    return sorted(rows, key=repr)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--topics", type=int, default=50, help="small topics (default 50)")
    ap.add_argument("--messages", type=int, default=1000, help="messages per topic (default 1,000)")
    ap.add_argument("--reps", type=int, default=3, help="interleaved rounds of the captures; medians printed")
    ap.add_argument("--no-before", action="store_true", help="skip the `before` way (the longest)")
    ap.add_argument("--no-one-by-one", action="store_true", help="skip the `one by one` way")
    ap.add_argument("--unsorted", action="store_true",
                    help="add the `unsorted` way: together, the log's hours not rewritten in seq order")
    ap.add_argument("--mirrors", action="store_true",
                    help="give every topic a mirror (a copy on the same broker) captured with it")
    args = ap.parse_args(argv)
    from spark_jobs import capture as C
    from spark_jobs.io import lake
    from spark_jobs.io.session import build_spark

    with tempfile.TemporaryDirectory(prefix="msgaudit-bench-capture-") as tmp:
        work = Path(tmp)
        kafka = LocalKafka(work / "kafka", port=None)
        kafka.start(300)
        try:
            names = [f"cap{k:03d}" for k in range(args.topics)]
            t0 = datetime.now(UTC)
            tp = time.perf_counter()
            produced = [*names, *(copy_of(t) for t in names)] if args.mirrors else names
            produce(kafka.bootstrap_servers, work / "ledger", produced, args.messages)
            print(f"{len(produced)} topics x {args.messages:,} audited messages produced in "
                  f"{time.perf_counter() - tp:.1f}s", flush=True)
            start = floor_window(t0, WINDOW)
            end = floor_window(datetime.now(UTC), WINDOW) + WINDOW
            warm = config(work, "warm", kafka.bootstrap_servers, names, args.mirrors)
            spark = build_spark(warm, app_name="msgaudit-capture-bench")
            with contextlib.redirect_stdout(io.StringIO()):  # capture's line per topic
                C.capture(spark, warm, start, end)  # compiles plans
            batch, wait = C.BATCH_TOPICS, C.FETCH_MAX_WAIT_MS
            ways = {"one topic": (names[:1], batch, wait), "together": (names, batch, wait)}
            if not args.no_one_by_one:
                ways["one by one"] = (names, 1, wait)
            if not args.no_before:
                ways["before"] = (names, 1, 500)
            if args.unsorted:
                ways["unsorted"] = (names, batch, wait)
            rewrite = lake.rewrite_by_seq
            times: dict[str, list[float]] = {w: [] for w in ways}
            last: dict[str, Config] = {}
            for i in range(args.reps):
                order = list(ways) if i % 2 == 0 else list(reversed(ways))
                for way in order:
                    topics, C.BATCH_TOPICS, C.FETCH_MAX_WAIT_MS = ways[way]
                    lake.rewrite_by_seq = (lambda *_: None) if way == "unsorted" else rewrite
                    cfg = last[way] = config(work, f"{way.replace(' ', '-')}-{i}", kafka.bootstrap_servers, topics,
                                             args.mirrors)
                    t = time.perf_counter()
                    with contextlib.redirect_stdout(io.StringIO()):
                        C.capture(spark, cfg, start, end)
                    times[way].append(time.perf_counter() - t)
                    print(f"  round {i + 1}: {way:<10} {times[way][-1]:6.2f}s", flush=True)
            C.BATCH_TOPICS, C.FETCH_MAX_WAIT_MS = batch, wait
            lake.rewrite_by_seq = rewrite
            expected = args.topics * args.messages * (2 if args.mirrors else 1)
            together = captured_rows(spark, last["together"], args.mirrors)
            same = (len(together) == expected
                    and all(captured_rows(spark, last[w], args.mirrors) == together
                            for w in ways if w not in ("one topic", "together")))
            spark.stop()
        finally:
            kafka.stop()
    med = {w: statistics.median(v) for w, v in times.items()}
    for way, v in times.items():
        print(f"{way:<10}: {med[way]:6.2f}s  (runs: {', '.join(f'{x:.2f}' for x in v)})")
    what = "log_records and mirror_records" if args.mirrors else "log_records"
    print(f"same {what} rows every way ({expected:,} expected): {'yes' if same else 'NO'}")
    if "one by one" in med:
        print(f"ratio one by one / together ({args.topics} topics, {batch} per batch): "
              f"{med['one by one'] / med['together']:.2f}")
    if "unsorted" in med:
        print(f"ratio together / unsorted (what rewriting the log's hours in seq order costs): "
              f"{med['together'] / med['unsorted']:.2f}")
    if "before" in med:
        print(f"ratio before / one by one (fetch.max.wait.ms 500 against {wait}): {med['before'] / med['one by one']:.2f}")
        print(f"ratio before / together (this change as a whole): {med['before'] / med['together']:.2f}")
    print(f"ratio {args.topics} topics / one topic: together {med['together'] / med['one topic']:.2f}"
          + (f", one by one {med['one by one'] / med['one topic']:.2f}" if "one by one" in med else ""))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
