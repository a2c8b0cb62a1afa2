"""Reconcile with the lake on an S3-compatible object store, on `local[2]` and on a Spark standalone
cluster (issue 78): the reconcile against a scan of the same inputs from the same store, the store's
own CPU, and the driver's memory and CPU.

The store (`--store`) is gofakes3 by default: a Go S3 server holding its objects in memory, built
once from the Go module proxy (`go install`); or moto's server mode, the tests' store (PyPI
`moto[server]`), whose range GETs copy the whole object in Python, so that a reader of Parquet
row groups keeps it busy. Spark reaches the store through s3a, the settling tasks through pyarrow
with the same settings. The window is `reconcile_scale.py`'s (N messages in one
hour over the four tiers, its lookback hour, the same injected anomalies, the Delta sink on the
store too), generated once by a `local[2]` process of its own. Then, for each master in turn, a
process of its own (so that its driver's peak memory is its own) starts a session on that master,
makes an untimed scan and `--warmups` untimed reconciles, then `--reps` alternating pairs of the
scan baseline and the reconcile (classification + publish), and prints medians of:
- the scan and the reconcile, and their ratio (target <= 3.5 at 10M on local[2]);
- the store's CPU seconds during each: how busy the server was (a server near one core for the
  whole scan would be the bottleneck, not the reader);
- the driver's CPU (the Python driver and its JVM) and the CPU of the rest of the machine, the
  store's left out (the driver, the cluster's master, workers, executors and their Python workers;
  on local[2] the driver JVM runs the tasks), and the driver's peak RSS (JVM + Python; target at 10M on the
  cluster <= 1.5 GB and <= 1.2x its 1M figure, driver CPU <= 10 % of the total);
- whether every injected anomaly was found exactly, and a digest of the published rows (Delta
  report and anomalies), which must be the same on every master.

The cluster is `audit.runtime.local_spark` (what `msgaudit cluster start` runs): a master and two
workers of one core each, with `--worker-memory` each.

    .venv/bin/python benchmarks/object_store.py --n 1000000
    .venv/bin/python benchmarks/object_store.py --n 10000000 --masters local[2] --reps 2
    .venv/bin/python benchmarks/object_store.py --n 1000000 --store moto

This is a measurement script, not a test: it asserts nothing about time, it prints ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import reconcile_scale as rs  # noqa: E402

WINDOW_ORDINAL = 1  # hour 0 is the lookback hour, hour 1 the window
CLUSTER = "cluster"
TICK = os.sysconf("SC_CLK_TCK")


def config(endpoint: str, bucket: str, work: Path, master: str, extra: dict[str, str] | None = None) -> Any:
    """The benchmark's configuration with the lake and the Delta sink in `bucket` on the store."""
    from audit.core import config as config_mod
    from tests.support.services import s3a_settings

    return config_mod.from_dict({
        "home": str(work / "home"), "lake": f"s3a://{bucket}/lake", "report_store": f"sqlite:///{work / 'report.db'}",
        "reconcile": {"engine": "spark"},
        "spark": {"master": master, "spark.sql.shuffle.partitions": "8", **s3a_settings(endpoint),
                  # one PUT per file, no multipart upload: gofakes3 keeps a part's aws-chunked body as
                  # it came (its trailer ends the object, which is then no Parquet file)
                  "spark.hadoop.fs.s3a.multipart.size": "1536M", **(extra or {})},
        "topics": {rs.TOPIC: {"window": "1h", "grace": "15m", "groups": [rs.GROUP],
                              "sinks": [{"name": "table", "format": "delta", "location": f"s3a://{bucket}/sink",
                                         "group": rs.GROUP}]}}}, source="<benchmark>", base=work)


# ---- the stores: each a context manager giving (endpoint, the server's process id)

BUCKET = "audit-lake"
GOFAKES3 = "github.com/johannesboyne/gofakes3/cmd/gofakes3@v1.2.0"


@contextmanager
def moto_store() -> Iterator[tuple[str, int]]:
    """moto's S3 server (the tests' store): a range GET copies the whole object in Python."""
    from tests.support.services import s3_server

    with s3_server(BUCKET) as s3:
        yield s3.endpoint, s3.pid


@contextmanager
def gofakes3_store() -> Iterator[tuple[str, int]]:
    """gofakes3's S3 server with its objects in memory (Go, built from the Go module proxy into
    `$MSGAUDIT_HOME/tools` once): a range GET is a slice of the object."""
    from audit.core.config import msgaudit_home
    from audit.runtime.jvm_service import port_in_use
    from audit.runtime.local_kafka import free_port

    tools = msgaudit_home() / "tools"
    binary = tools / "gofakes3"
    if not binary.exists():
        print(f"building {GOFAKES3} (go install, once) ...", flush=True)
        subprocess.run(["go", "install", GOFAKES3], check=True, env={**os.environ, "GOBIN": str(tools)})
    port = free_port()
    proc = subprocess.Popen([str(binary), "-backend", "memory", "-initialbucket", BUCKET, "-quiet",
                             "-host", f"127.0.0.1:{port}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while not port_in_use(port):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"gofakes3 did not start (exit {proc.poll()})")
            time.sleep(0.1)
        yield f"http://127.0.0.1:{port}", proc.pid
    finally:
        proc.terminate()
        proc.wait(timeout=10)


STORES = {"gofakes3": gofakes3_store, "moto": moto_store}


# ---- CPU and memory of processes, from /proc (Linux)

def machine_cpu_seconds() -> float:
    """CPU seconds the whole machine has spent (every process, live or gone), from /proc/stat."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    return sum(int(f) for i, f in enumerate(fields) if i not in (3, 4)) / TICK  # all but idle, iowait


def cpu_seconds(pid: int) -> float:
    """CPU seconds of the process `pid` (all its threads)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / TICK
    except OSError:
        return 0.0


# ---- the phases, each in a process of its own

def generate(args: argparse.Namespace) -> None:
    from spark_jobs.io.session import build_spark

    work = Path(args.work)
    cfg = config(args.endpoint, args.bucket, work / "generate", "local[2]")
    spark = build_spark(cfg, app_name="msgaudit-bench-generate")
    t = time.perf_counter()
    rs.generate(spark, cfg, f"s3a://{args.bucket}/sink", args.n, args.partitions,  # type: ignore[arg-type]
                range(WINDOW_ORDINAL - 1, WINDOW_ORDINAL + 1), WINDOW_ORDINAL)
    rs.write_snapshots(spark, cfg, args.n, args.partitions, WINDOW_ORDINAL)
    spark.stop()
    print(json.dumps({"generated_s": time.perf_counter() - t}))


def published(spark: Any, cfg: Any) -> dict[str, list[int]]:
    """Each published table's row count and two order-free digests of its rows (computed by Spark)."""
    from pyspark.sql import functions as F

    from spark_jobs.io.lake import read_table

    out = {}
    for table in ("audit_partition_report", "audit_anomalies"):
        df = read_table(spark, cfg, table)
        h = F.xxhash64(*[F.col(c).cast("string") for c in sorted(df.columns)])
        r = df.agg(F.count(F.lit(1)), F.bit_xor(h), F.sum(F.pmod(h, F.lit(1_000_000_007)))).collect()[0]
        out[table] = [int(r[0]), int(r[1] or 0), int(r[2] or 0)]
    return out


def measure(args: argparse.Namespace) -> None:
    from spark_jobs.io.session import build_spark

    work = Path(args.work)
    extra: dict[str, str] = {}
    if args.master.startswith("spark://"):
        extra = {"spark.driver.host": "127.0.0.1", "spark.driver.bindAddress": "127.0.0.1",
                 "spark.executor.memory": args.executor_memory}
    extra.update(dict(c.split("=", 1) for c in args.conf))
    cfg = config(args.endpoint, args.bucket, work / args.label, args.master, extra)
    spark = build_spark(cfg, app_name=f"msgaudit-bench-{args.label}")
    if args.master.startswith("spark://"):
        from audit.runtime.bundle import python_bundle

        spark.sparkContext.addPyFile(str(python_bundle()))
    jvm = rs.driver_jvm_pid(spark)
    assert jvm is not None
    me, store = os.getpid(), args.store_pid

    def clocks() -> tuple[float, float, float, float]:
        """(wall, the store's CPU, the driver's CPU, every other process's CPU: the machine's but the store's)."""
        driver = cpu_seconds(me) + cpu_seconds(jvm)
        mine = cpu_seconds(store)
        return time.perf_counter(), mine, driver, machine_cpu_seconds() - mine

    def timed(step: Any) -> tuple[Any, list[float]]:
        before = clocks()
        out = step()
        after = clocks()
        return out, [a - b for a, b in zip(after, before, strict=True)]

    rs.track_settling()
    rs.scan_baseline(spark, cfg)
    for _ in range(args.warmups):
        rs.reconcile_once(spark, cfg, rs.AS_OF)[2].release()
    scans, recs, founds = [], [], []
    rows = 0
    for _ in range(args.reps):
        (_, rows), scan = timed(lambda: rs.scan_baseline(spark, cfg))
        (_, _, result), rec = timed(lambda: rs.reconcile_once(spark, cfg, rs.AS_OF))
        founds.append(rs.found_counts(spark, result))
        result.release()
        scans.append(scan)
        recs.append(rec)
    rss = {"driver JVM": rs.jvm_peak_rss_mb(spark) or 0.0,
           "Python driver": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    digest = published(spark, cfg)
    spark.stop()

    def med(runs: list[list[float]]) -> list[float]:
        return [statistics.median(r[i] for r in runs) for i in range(4)]

    print(json.dumps({"scan": med(scans), "reconcile": med(recs), "rows": rows, "found": founds,
                      "settled": rs.SETTLED[-1], "rss": rss, "published": digest}))


def child(phase: str, args: argparse.Namespace, **more: Any) -> dict[str, Any]:
    argv = [sys.executable, __file__, "--phase", phase, "--n", str(args.n), "--partitions", str(args.partitions),
            "--reps", str(args.reps), "--warmups", str(args.warmups), "--work", str(args.work),
            "--endpoint", args.endpoint, "--bucket", args.bucket, "--store-pid", str(args.store_pid),
            "--executor-memory", args.executor_memory, *(f"--conf={c}" for c in args.conf)]
    for k, v in more.items():
        argv += [f"--{k.replace('_', '-')}", str(v)]
    out = subprocess.run(argv, stdout=subprocess.PIPE, text=True, env={**os.environ, "SPARK_LOCAL_IP": "127.0.0.1"})
    if out.returncode:
        raise SystemExit(f"the {phase} phase failed (exit {out.returncode}); its output is above")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=1_000_000, help="messages in the window (default 1,000,000)")
    ap.add_argument("--partitions", type=int, default=8, help="topic partitions = producer pids (default 8)")
    ap.add_argument("--masters", default=f"local[2],{CLUSTER}",
                    help=f"the masters, comma-separated, each run in a process of its own; `{CLUSTER}`: a local "
                         f"standalone cluster of two workers of one core (default local[2],{CLUSTER})")
    ap.add_argument("--reps", type=int, default=2, help="timed scan + reconcile pairs per master (medians)")
    ap.add_argument("--warmups", type=int, default=1, help="untimed reconciles first (default 1)")
    ap.add_argument("--store", choices=sorted(STORES), default="gofakes3",
                    help="the S3 server: gofakes3 (default; Go, objects in memory) or moto (the tests' store)")
    ap.add_argument("--worker-memory", default="4g", help="each cluster worker's memory (default 4g)")
    ap.add_argument("--executor-memory", default="3g", help="each cluster executor's heap (default 3g)")
    ap.add_argument("--conf", action="append", default=[], metavar="KEY=VALUE",
                    help="a Spark setting of the measured sessions (not the generating one), repeatable: "
                         "e.g. spark.driver.memory=1g")
    # the phases' own arguments
    ap.add_argument("--phase", choices=("generate", "measure"), help=argparse.SUPPRESS)
    for hidden in ("--work", "--endpoint", "--bucket", "--master", "--label"):
        ap.add_argument(hidden, default="", help=argparse.SUPPRESS)
    ap.add_argument("--store-pid", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if any("=" not in c for c in args.conf):
        ap.error("--conf takes KEY=VALUE, e.g. --conf spark.driver.memory=1g")
    if args.phase == "generate":
        generate(args)
        return 0
    if args.phase == "measure":
        measure(args)
        return 0
    if args.n % args.partitions or args.n % 1000:
        ap.error("--n must be a multiple of 1000 and of --partitions")

    from audit.runtime.local_kafka import free_port
    from audit.runtime.local_spark import LocalSparkCluster
    masters = [m for m in args.masters.split(",") if m]
    print(f"n={args.n:,} messages in the window, the default anomaly mix, {args.partitions} partitions; "
          f"lake and sink on {args.store}'s S3 server; masters {', '.join(masters)}; {args.reps} rep(s) (medians)")
    with tempfile.TemporaryDirectory(prefix="msgaudit-bench-s3-") as tmp, STORES[args.store]() as (endpoint, pid):
        args.work, args.endpoint, args.bucket, args.store_pid = tmp, endpoint, BUCKET, pid
        gen = child("generate", args)
        print(f"generated the window and its lookback hour on the store in {gen['generated_s']:.0f}s")
        results: dict[str, dict[str, Any]] = {}
        for master in masters:
            if master == CLUSTER:
                cluster = LocalSparkCluster(Path(tmp) / "spark-cluster", port=free_port(), workers=2, cores=1,
                                            memory=args.worker_memory)
                state = cluster.wait_ready(cluster.launch())
                try:
                    results[master] = child("measure", args, master=state.master_url, label="cluster")
                finally:
                    cluster.stop()
            else:
                results[master] = child("measure", args, master=master, label=master.replace("[", "").replace("]", ""))
            report(master, results[master], rs.expected_counts(args.n, args.partitions, WINDOW_ORDINAL))
    digests = {json.dumps(r["published"], sort_keys=True) for r in results.values()}
    print(f"\nthe same published rows on every master : {'yes' if len(digests) == 1 else 'NO'} "
          f"({', '.join(f'{t} {v[0]:,} rows' for t, v in next(iter(results.values()))['published'].items())})")
    return 0


def report(master: str, r: dict[str, Any], expected: dict[str, int]) -> None:
    (sw, sstore, _, sall), (rw, rstore, rdriver, rall) = r["scan"], r["reconcile"]
    exact = all(all(f.get(c, 0) == e for c, e in expected.items()) and f == r["found"][0] for f in r["found"])
    rss = r["rss"]
    print(f"\n{master} (settled in {r['settled']}):")
    print(f"  scan       {sw:6.1f}s  ({r['rows']:,} input rows); the store's CPU {sstore:.1f}s "
          f"({sstore / sw:.0%} of a core), the rest of the machine {sall:.1f}s")
    print(f"  reconcile  {rw:6.1f}s  (classification + publish); the store's CPU {rstore:.1f}s "
          f"({rstore / rw:.0%} of a core), the rest of the machine {rall:.1f}s")
    print(f"  reconcile / scan, same store                 : {rw / sw:.2f}  (target <= 3.5 at 10M)")
    if master == CLUSTER:
        print(f"  driver CPU / the run's CPU (reconcile)       : {rdriver / rall:.1%} ({rdriver:.1f}s of {rall:.1f}s)"
              f"  (target <= 10 %)")
    else:
        print(f"  driver CPU / the run's CPU (reconcile)       : - (the driver's JVM runs the tasks: "
              f"{rdriver:.1f}s of {rall:.1f}s)")
    print(f"  driver peak RSS                              : {sum(rss.values()):,.0f} MB ("
          + ", ".join(f"{k} {v:,.0f} MB" for k, v in rss.items()) + ")")
    print(f"  every injected anomaly found exactly         : {'yes' if exact else 'NO'}")


if __name__ == "__main__":
    raise SystemExit(main())
