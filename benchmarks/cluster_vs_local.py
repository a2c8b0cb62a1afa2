"""The pipeline on a local Spark standalone cluster against `local[2]`, on the same window (issue 16).

Starts a local broker, produces N audited messages (the producer ledger on local files) to one
topic of two partitions, then runs ingest -> capture -> reconcile -> sla twice with the same
arguments, each step one `spark-submit` (as the Airflow DAGs run them), into two fresh lakes:

- `--master local[2]`: driver and executors in one JVM;
- `--master spark://127.0.0.1:<port>`: a master and two workers of 1 core each
  (`audit.runtime.local_spark`), jars on --jars, the project's code as a zip on --py-files.

It prints each step's wall time on both (JVM starts included), the totals and their ratio
(cluster / local), and the local-file ingest rate of each run. A third run on `local[2]` does the
four steps in one submission (`submit.py window`, what a scheduled DAG run pays) and its ratio to
the four submissions is printed too; all three runs must publish the same report rows. It also times `ingest` inside an already
running local[2] session (no JVM start) for the rate of the landing itself.

    .venv/bin/python benchmarks/cluster_vs_local.py --n 50000

A measurement script, not a test: it asserts nothing about time.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from audit.core import config as config_mod  # noqa: E402
from audit.core.windows import floor_window  # noqa: E402
from audit.runtime.local_kafka import LocalKafka, free_port  # noqa: E402
from audit.runtime.local_spark import ClusterState, LocalSparkCluster, spark_home  # noqa: E402

TOPIC = "bench-cluster"
WINDOW = timedelta(hours=1)
GRACE = timedelta(minutes=1)


def create_topic(bootstrap: str, topic: str = TOPIC) -> None:
    """`topic` with two partitions, replication 1."""
    from confluent_kafka.admin import AdminClient, NewTopic

    admin = AdminClient({"bootstrap.servers": bootstrap, "log_level": 0})
    for f in admin.create_topics([NewTopic(topic, num_partitions=2, replication_factor=1)]).values():
        f.result(30)


def produce_messages(bootstrap: str, ledger_dir: Path, n: int, topic: str = TOPIC, name: str = "bench") -> None:
    """n audited messages to `topic` from one producer, closed at the end (its ledger segment sealed)."""
    from audit.clients.producer import AuditedProducer

    p = AuditedProducer({"bootstrap.servers": bootstrap, "linger.ms": 20, "log_level": 0},
                        producer_name=name, ledger_dir=ledger_dir / "producer")
    failed: list[Any] = []

    def delivered(err: Any, _msg: Any) -> None:
        if err is not None:
            failed.append(err)

    for i in range(n):
        p.produce(topic, b'{"n": %d}' % i, on_delivery=delivered)
        if i % 10000 == 9999:
            p.poll(0)
    if p.flush(120) != 0 or failed:
        raise SystemExit(f"bench: {len(failed)} messages not delivered")
    p.close()


def produce(bootstrap: str, ledger_dir: Path, n: int) -> None:
    create_topic(bootstrap)
    produce_messages(bootstrap, ledger_dir, n)


def config_file(work: Path, bootstrap: str, ledger_dir: Path) -> Path:
    work.mkdir(parents=True)
    path = work / "msgaudit.yaml"
    path.write_text(yaml.safe_dump({
        "home": str(work / "home"), "lake": str(work / "lake"), "ledger_dir": str(ledger_dir),
        "kafka": {"bootstrap.servers": bootstrap},
        "topics": {TOPIC: {"window": "1h", "grace": "1m", "sla": {"max_lost": 0}}},
    }))
    return path


def steps(conf: Path, start: datetime, end: datetime, as_of: datetime) -> list[list[str]]:
    rng = ["--config", str(conf), "--start", start.isoformat(), "--end", end.isoformat()]
    return [["ingest", "--config", str(conf)], ["capture", *rng], ["reconcile", *rng, "--as-of", as_of.isoformat()],
            ["sla", *rng, "--as-of", as_of.isoformat()]]


def run(name: str, argvs: list[tuple[list[str], dict[str, str]]], cwd: Path) -> dict[str, float]:
    times: dict[str, float] = {}
    for argv, env in argvs:
        t0 = time.monotonic()
        out = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True)
        elapsed = time.monotonic() - t0
        label = next(a for a in argv if a in ("ingest", "capture", "reconcile", "sla", "window"))
        if out.returncode != 0:
            # spark-submit merges the Python driver's stderr (a traceback) into its stdout
            raise SystemExit(f"{name} {label} failed ({out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-2000:]}")
        times[label] = elapsed
        print(f"  {name:8} {label:9} {elapsed:7.1f}s  {out.stdout.strip().splitlines()[-1] if out.stdout.strip() else ''}",
              flush=True)
    return times


def local_argv(conf: Path, step: list[str], log4j: Path) -> tuple[list[str], dict[str, str]]:
    import os

    from audit.runtime import jars

    cfg = config_mod.load(conf)
    argv = [str(spark_home() / "bin" / "spark-submit"), "--master", "local[2]",
            "--jars", ",".join(str(p) for p in jars.jars("spark-deps"))]
    java = cfg.driver_jvm["spark.driver.extraJavaOptions"]
    argv += ["--conf", f"spark.driver.memory={cfg.driver_jvm['spark.driver.memory']}",
             "--conf", f"spark.driver.extraJavaOptions={java} -Dlog4j2.configurationFile=file:{log4j}"]
    submit = Path(__file__).resolve().parent.parent / "spark_jobs" / "pipeline" / "submit.py"
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable, "PYSPARK_DRIVER_PYTHON": sys.executable,
           "SPARK_LOCAL_IP": "127.0.0.1"}
    return [*argv, str(submit), *step], env


def report_rows(conf: Path) -> list[dict[str, Any]]:
    from audit.serving.report_store import ReportStore

    cfg = config_mod.load(conf)
    with ReportStore(cfg.report_store) as store:
        return [*store.read("audit_partition_report"), *store.read("audit_anomalies"), *store.read("sla_results")]


def warm_ingest(bootstrap: str, ledger_dir: Path, work: Path) -> tuple[float, int]:
    from spark_jobs.io.session import build_spark
    from spark_jobs.pipeline.steps import StepRange, run_step

    cfg = config_mod.load(config_file(work, bootstrap, ledger_dir))
    spark = build_spark(cfg, app_name="bench-warm")
    try:
        spark.range(1000).count()  # JVM and session up before the clock starts
        t0 = time.monotonic()
        result = run_step(spark, cfg, "ingest", StepRange())
        return time.monotonic() - t0, int(result.landed)
    finally:
        spark.stop()


def main(argv: list[str] | None = None) -> int:
    from spark_jobs.pipeline.submit import cluster_submit

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=50000, help="messages produced (default 50000)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="msgaudit-bench-cluster-") as tmp:
        root = Path(tmp)
        ledger = root / "ledger"
        kafka = LocalKafka(root / "kafka", port=None)
        cluster = LocalSparkCluster(root / "spark-cluster", port=free_port(), workers=2, cores=1, memory="1g")
        state: ClusterState = cluster.launch()
        try:
            kafka.start(300)
            t0 = datetime.now(UTC)
            tp = time.monotonic()
            produce(kafka.bootstrap_servers, ledger, args.n)
            print(f"produced {args.n} audited messages in {time.monotonic() - tp:.1f}s", flush=True)
            start = floor_window(t0, WINDOW)
            end = floor_window(datetime.now(UTC), WINDOW) + WINDOW
            as_of = end + GRACE
            cluster.wait_ready(state)
            print(f"cluster: {state.master_url}, {state.workers} workers x {state.cores} core, {state.memory}",
                  flush=True)
            conf_local = config_file(root / "local", kafka.bootstrap_servers, ledger)
            conf_cluster = config_file(root / "cluster", kafka.bootstrap_servers, ledger)
            local = run("local[2]", [local_argv(conf_local, s, state.driver_log4j)
                                     for s in steps(conf_local, start, end, as_of)], root / "local")
            remote = run("cluster", [cluster_submit(config_mod.load(conf_cluster), state, s)
                                     for s in steps(conf_cluster, start, end, as_of)], root / "cluster")
            conf_window = config_file(root / "window", kafka.bootstrap_servers, ledger)
            one = run("window", [local_argv(conf_window, ["window", *steps(conf_window, start, end, as_of)[-1][1:]],
                                            state.driver_log4j)], root / "window")
            same = report_rows(conf_local) == report_rows(conf_cluster) == report_rows(conf_window)
            warm_s, warm_rows = warm_ingest(kafka.bootstrap_servers, ledger, root / "warm")
        finally:
            cluster.stop()
            kafka.stop()
    tl, tc = sum(local.values()), sum(remote.values())
    print(f"\npipeline (4 spark-submits) on {args.n} messages, one topic, 2 partitions:")
    for step in local:
        print(f"  {step:9} local[2] {local[step]:6.1f}s   cluster {remote[step]:6.1f}s   "
              f"cluster/local {remote[step] / local[step]:.2f}")
    print(f"  total     local[2] {tl:6.1f}s   cluster {tc:6.1f}s   cluster/local {tc / tl:.2f}")
    print(f"  the four steps in one spark-submit (`window`, as the scheduled DAGs run them): local[2] "
          f"{one['window']:6.1f}s   four submissions / one {tl / one['window']:.2f}")
    print(f"local-file ingest, one spark-submit (JVM start included): local[2] {args.n / local['ingest']:,.0f} rows/s, "
          f"cluster {args.n / remote['ingest']:,.0f} rows/s")
    print(f"local-file ingest in a running local[2] session: {warm_rows} rows in {warm_s:.1f}s = "
          f"{warm_rows / warm_s:,.0f} rows/s")
    print(f"same report, anomaly and SLA rows on all three: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
