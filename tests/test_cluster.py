"""The pipeline on a Spark standalone cluster gives the rows of `local[2]`, row for row.

A lab scenario makes a history (a real broker, killed consumers, SQL sinks, ledgers) and the
lab audits it as always, on the shared `local[2]` session: that is the reference. Then the same
four steps run in one `window` application through `spark-submit --master spark://127.0.0.1:<port>`
on a local standalone cluster (`audit.runtime.local_spark`: a master and two workers, each its
own JVM, from pyspark's launcher) into a second lake and report store: the jars from the cache on
`--jars`, the project's Python as a zip on `--py-files`, the venv's Python for the executors.
Every row of audit_partition_report and audit_anomalies (Delta and report store) and of
sla_results must be equal -- all columns: run_id and computed_at/checked_at derive from as_of,
which both runs share, so no field legitimately differs.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from audit.core import config as config_mod
from audit.core.config import Config
from audit.lab.env import ProxiedBroker
from audit.lab.runner import LabResult, run_scenarios
from audit.runtime.local_kafka import free_port
from audit.runtime.local_spark import ClusterState, LocalSparkCluster, master_ports
from spark_jobs.pipeline.submit import cluster_submit

SCENARIOS = ["at_least_once"]
REPORT_TABLES = ("audit_partition_report", "audit_anomalies")


def config_data(cfg: Config, work: Path) -> dict[str, Any]:
    """`cfg` as a config file's content, with its own lake, home and report store under `work`, and
    the Spark classifier for every window."""
    def topic(t: Any) -> dict[str, Any]:
        return {"window": f"{int(t.window.total_seconds())}s", "grace": f"{int(t.grace.total_seconds())}s",
                "groups": list(t.groups),
                "sla": {r.rule: {"threshold": r.threshold, "severity": r.severity} for r in t.sla},
                "sinks": [{k: v for k, v in (("name", s.name), ("format", s.format), ("group", s.group),
                                             ("location", s.location), ("url", s.url), ("table", s.table),
                                             ("columns", dict(s.columns) or None)) if v is not None}
                          for s in t.sinks]}

    # The lab's small windows are settled in the driver (`reconcile.engine: auto`); the cluster's run
    # settles them in Spark tasks on the workers, so its tables equal to the lab's also hold the two
    # engines equal.
    return {"home": str(work / "home"), "lake": str(work / "lake"), "ledger_dir": str(cfg.ledger_dir),
            "kafka": dict(cfg.kafka), "reconcile": {"engine": "spark"},
            "topics": {n: topic(t) for n, t in cfg.topics.items()}}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalSparkCluster, ClusterState]]:
    c = LocalSparkCluster(tmp_path_factory.mktemp("spark-cluster"), port=free_port(), workers=2, cores=1,
                          memory="1g")
    try:
        yield c, c.launch()  # its JVMs start while the lab runs; the test waits for them
    finally:
        c.stop()


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory, spark: Any,
        cluster: tuple[LocalSparkCluster, ClusterState]) -> Iterator[tuple[LabResult, Path]]:
    work = tmp_path_factory.mktemp("cluster-lab")
    cfg = config_mod.from_dict({"home": str(work / ".msgaudit")}, source="<cluster test>", base=work)
    with ProxiedBroker(work / "kafka") as broker:
        result = run_scenarios(SCENARIOS, broker, cfg, work, lambda: spark, say=lambda _line: None)
        yield result, work  # the broker stays up: the cluster's capture reads the same log


def _rows(spark: Any, cfg: Config, table: str) -> list[dict[str, Any]]:
    from spark_jobs.io.lake import read_table

    return sorted((r.asDict() for r in read_table(spark, cfg, table).collect()),
                  key=lambda r: tuple(str(v) for v in r.values()))


def _store_rows(cfg: Config, table: str) -> list[dict[str, Any]]:
    from audit.serving.report_store import ReportStore

    with ReportStore(cfg.report_store) as store:
        return store.read(table)


@pytest.mark.e2e
@pytest.mark.spark
@pytest.mark.kafka
def test_pipeline_on_a_standalone_cluster_equals_local(cluster: tuple[LocalSparkCluster, ClusterState],
                                                       lab: tuple[LabResult, Path], spark: Any) -> None:
    result, work = lab
    for run in result.runs:
        assert run.error is None, f"{run.name}: {run.error}"
        assert all(result.comparisons[t].exact for t in run.topics), run.name
    assert result.start is not None and result.end is not None and result.as_of is not None
    c, state = cluster
    c.wait_ready(state)

    conf_path = work / "cluster" / "msgaudit.yaml"
    conf_path.parent.mkdir()
    conf_path.write_text(yaml.safe_dump(config_data(result.cfg, work / "cluster")))
    ccfg = config_mod.load(conf_path)
    # The lab's own audit in one spark-submit of `window` (its four steps in one application), as the
    # scheduled DAGs run a window: the lab's one scenario is reconciled over its windows, the
    # cluster over the whole captured range, whose later windows hold none of its traffic.
    (run,) = result.runs
    argv, env = cluster_submit(ccfg, state, ["window", "--config", str(conf_path), "--start", result.start.isoformat(),
                                             "--end", result.end.isoformat(), "--as-of", result.as_of.isoformat(),
                                             *(a for t in run.topics for a in ("--topic", t))])
    assert argv[1:3] == ["--master", state.master_url]
    out = subprocess.run(argv, env=env, capture_output=True, text=True, cwd=work / "cluster", timeout=900)
    # exit 3: the lab's designed duplicates break max_duplicate_ratio (an error-severity rule)
    # (spark-submit merges the Python driver's stderr, a traceback, into its stdout)
    assert out.returncode == 3, out.stdout[-3000:] + out.stderr[-2000:]
    assert " INFO " not in out.stderr, out.stderr[-2000:]  # Spark's own log lines go to the log file
    outputs = [out.stdout]
    assert "landed" in outputs[0] or "rows" in outputs[0], outputs[0]

    # Both workers ran tasks, and each executor that ran one fetched the project's code as a zip (an
    # executor the master starts as an application ends may run none and fetch nothing).
    for i in (1, 2):
        apps = list((Path(state.dir) / f"work-{i}").glob("app-*/*"))
        ran = [a for a in apps if "Running task" in (a / "stderr").read_text(errors="replace")]
        assert ran, f"worker {i} ran no task: {apps}"
        assert all(list(a.glob("msgaudit-py-*.zip")) for a in ran), [list(a.iterdir()) for a in ran]
    assert (state.logs / "driver.log").stat().st_size > 0

    for table in REPORT_TABLES:
        local, remote = _rows(spark, result.cfg, table), _rows(spark, ccfg, table)
        assert local, table
        assert remote == local, table
    for table in (*REPORT_TABLES, "sla_results"):
        local, remote = _store_rows(result.cfg, table), _store_rows(ccfg, table)
        assert local, table
        assert remote == local, table


@pytest.mark.e2e
@pytest.mark.spark
@pytest.mark.kafka
def test_cluster_status_and_stop(tmp_path: Path, cluster: tuple[LocalSparkCluster, ClusterState]) -> None:
    """`status` finds the cluster from its folder in another object; `stop` ends every daemon."""
    c, state = cluster
    again = LocalSparkCluster(Path(state.dir))
    seen = again.state()
    assert seen is not None and seen.master_url == state.master_url
    assert again.alive_workers(seen) == 2
    assert again.stop() == 3
    assert again.state() is None and c.state() is None
    assert LocalSparkCluster(tmp_path / "none").state() is None




# --------------------------------------------------------------------------------------------
# unit: the code zip, the spark-submit command, the CLI without a cluster


@pytest.mark.unit
def test_python_bundle_holds_both_packages_and_is_named_by_its_content(tmp_path: Path) -> None:
    import zipfile

    from audit.runtime.bundle import package_dir, python_bundle

    first = python_bundle(tmp_path)
    assert python_bundle(tmp_path) == first  # unchanged sources: the same file, not a new one
    assert first.name.startswith("msgaudit-py-") and first.suffix == ".zip"
    with zipfile.ZipFile(first) as zf:
        names = set(zf.namelist())
        assert zf.read("spark_jobs/pipeline/plan.py") == (package_dir("spark_jobs") / "pipeline" / "plan.py").read_bytes()
    assert {"audit/__init__.py", "audit/core/config.py", "spark_jobs/__init__.py",
            "spark_jobs/reconcile/__init__.py", "audit/runtime/jvm/spark-deps/pom.xml"} <= names
    assert not [n for n in names if "__pycache__" in n or n.endswith(".pyc")]
    assert not [n for n in names if not n.startswith(("audit/", "spark_jobs/"))]


@pytest.mark.unit
def test_submit_command_names_the_master_jars_code_python_and_log_file(tmp_path: Path) -> None:
    import sys

    from audit.runtime.local_spark import submit_command

    state = ClusterState("spark://127.0.0.1:7177", 1, 8080, [2, 3], dir=str(tmp_path), python="/venv/bin/python")
    argv, env = submit_command(state, "/app/submit.py", ["ingest", "--config", "c.yaml"], jars=["/j/a.jar", "/j/b.jar"],
                               py_files=["/b/code.zip"], conf={"spark.driver.memory": "4g",
                                                               "spark.driver.extraJavaOptions": "-XX:+UseParallelGC"})
    assert argv[0].endswith("/bin/spark-submit")
    assert argv[1:5] == ["--master", "spark://127.0.0.1:7177", "--deploy-mode", "client"]
    assert argv[argv.index("--jars") + 1] == "/j/a.jar,/j/b.jar"
    assert argv[argv.index("--py-files") + 1] == "/b/code.zip"
    confs = [argv[i + 1] for i, a in enumerate(argv) if a == "--conf"]
    assert "spark.driver.memory=4g" in confs and "spark.driver.host=127.0.0.1" in confs
    assert (f"spark.driver.extraJavaOptions=-XX:+UseParallelGC -Dlog4j2.configurationFile="
            f"file:{tmp_path}/conf/log4j2-driver.properties") in confs
    assert argv[-4:] == ["/app/submit.py", "ingest", "--config", "c.yaml"]
    assert env["PYSPARK_PYTHON"] == "/venv/bin/python" and env["PYSPARK_DRIVER_PYTHON"] == sys.executable
    assert env["SPARK_LOCAL_IP"] == "127.0.0.1"


@pytest.mark.unit
def test_cluster_cli_without_a_cluster(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from audit.cli import main

    d = str(tmp_path / "c")
    assert main(["cluster", "status", "--dir", d]) == 1
    assert capsys.readouterr().out == "cluster: not running\n"
    assert main(["cluster", "submit", "ingest", "--dir", d]) == 2
    assert capsys.readouterr().err == (f"msgaudit cluster: error: no Spark cluster is running from {d}; "
                                       "run `msgaudit cluster start` first\n")
    assert main(["cluster", "submit", "--dir", d]) == 2
    assert "needs a step: one of ingest, capture, reconcile, sla, window, backfill, follow" in capsys.readouterr().err
    assert main(["cluster", "stop", "--dir", d]) == 0
    assert capsys.readouterr().out == "cluster: stopped 0 process(es)\n"


@pytest.mark.unit
def test_cluster_submit_passes_the_steps_own_flags_and_refuses_them_for_another_step(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """`--force` (backfill), `--once` and `--alert-log` (follow) reach `submit.py`, the alert log as an
    absolute path (the driver does not run in the caller's directory); given to another step, one line."""
    import audit.runtime.local_spark as local_spark
    import spark_jobs.pipeline.submit as submit
    from audit.cli import main

    submitted: list[list[str]] = []
    monkeypatch.setattr(local_spark, "running_state", lambda cluster: ClusterState("spark://127.0.0.1:7177", 1, 8080, []))

    def cluster_submit(cfg: Any, state: Any, step_argv: list[str]) -> tuple[list[str], dict[str, str]]:
        submitted.append(list(step_argv))
        return ["spark-submit"], {}

    monkeypatch.setattr(submit, "cluster_submit", cluster_submit)
    monkeypatch.chdir(tmp_path)
    d = str(tmp_path / "c")
    assert main(["cluster", "submit", "follow", "--once", "--alert-log", "alerts.jsonl", "--dir", d, "--print"]) == 0
    assert main(["cluster", "submit", "backfill", "--start", "2026-11-21T10:00Z", "--end", "2026-11-21T12:00Z",
                 "--force", "--dir", d, "--print"]) == 0
    assert submitted == [["follow", "--once", "--alert-log", str(tmp_path / "alerts.jsonl")],
                         ["backfill", "--start", "2026-11-21T10:00Z", "--end", "2026-11-21T12:00Z", "--force"]]
    assert capsys.readouterr().out == "spark-submit\nspark-submit\n"
    assert main(["cluster", "submit", "capture", "--start", "2026-11-21T10:00Z", "--end", "2026-11-21T11:00Z",
                 "--once", "--dir", d]) == 2
    assert capsys.readouterr().err == ("msgaudit cluster: error: cluster submit capture: --once is for "
                                       "`cluster submit follow` only\n")
    assert main(["cluster", "submit", "window", "--force", "--dir", d]) == 2
    assert "--force is for `cluster submit backfill` only" in capsys.readouterr().err
    assert len(submitted) == 2


class _StandInMaster:
    """A master's web UI on a free port that reports `alive` workers ALIVE."""

    def __init__(self) -> None:
        import json
        import threading
        from http.server import BaseHTTPRequestHandler, HTTPServer

        outer = self
        self.alive = 2

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - the handler's name
                body = json.dumps({"aliveworkers": outer.alive}).encode()
                self.send_response(200)
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = HTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


_EARLIER_MASTER = ("INFO Utils: Successfully started service 'sparkMaster' on port 7000.\n"
                   "INFO Utils: Successfully started service 'MasterUI' on port 4100.\n")


@pytest.mark.unit
def test_a_master_ui_moved_to_another_port_is_found_in_its_log(tmp_path: Path) -> None:
    """Another process took the UI port `launch` picked, so Spark bound the next one and logged it:
    `wait_ready` reads the master's log (after what an earlier master wrote), asks that port and
    records it for `status` and `stop`."""
    import json

    ui = _StandInMaster()
    master = subprocess.Popen(["sleep", "60"])  # a live pid to stand for the master's
    try:
        cluster = LocalSparkCluster(tmp_path)
        (tmp_path / "logs").mkdir()
        log = tmp_path / "logs" / "master.log"
        log.write_text(_EARLIER_MASTER)
        since = log.stat().st_size
        with open(log, "a") as f:
            f.write("INFO Utils: Successfully started service 'sparkMaster' on port 7077.\n"
                    "INFO Master: Starting Spark master at spark://127.0.0.1:7077\n"
                    "WARN Utils: Service 'MasterUI' could not bind on port 4200. Attempting port 4201.\n"
                    f"INFO Utils: Successfully started service 'MasterUI' on port {ui.port}.\n")
        assert master_ports(log) == {"sparkMaster": 7077, "MasterUI": ui.port}
        assert master_ports(log, since=len("INFO Utils: Successfully started service 'sparkMaster' on port 7000.\n")) \
            == {"sparkMaster": 7077, "MasterUI": ui.port}
        assert master_ports(tmp_path / "logs" / "absent.log") == {}
        picked = free_port()
        state = ClusterState("spark://127.0.0.1:7077", master.pid, picked, [], 2, dir=str(tmp_path),
                             master_log_from=since)
        assert cluster.alive_workers(state) == -1  # nothing answers on the picked port
        ready = cluster.wait_ready(state, timeout_s=10)
        assert (ready.master_url, ready.master_ui_port) == ("spark://127.0.0.1:7077", ui.port)
        assert json.loads((tmp_path / "cluster.json").read_text())["master_ui_port"] == ui.port
    finally:
        ui.server.shutdown()
        master.kill()
        master.wait()


@pytest.mark.unit
def test_workers_are_started_again_on_the_port_the_master_bound_when_its_picked_one_was_taken(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The master's RPC port was taken between `launch`'s check and the master's bind: Spark bound
    the next one, and the workers, given the picked URL, would never register. `wait_ready` finds
    the bound port in the master's log, stops those workers, starts new ones on the master's URL
    and records it."""
    import json

    ui = _StandInMaster()
    ui.alive = 0  # the master is up on the UI port `launch` picked; no worker has registered
    master = subprocess.Popen(["sleep", "60"])
    stale = subprocess.Popen(["sleep", "60"])  # a worker started on the picked URL
    fresh = subprocess.Popen(["sleep", "60"])
    started: list[str] = []

    def launch_workers(url: str, env: dict[str, str]) -> list[int]:
        started.append(url)
        ui.alive = 1  # the new worker registers
        return [fresh.pid]

    try:
        cluster = LocalSparkCluster(tmp_path, workers=1)
        monkeypatch.setattr(cluster, "_launch_workers", launch_workers)
        (tmp_path / "logs").mkdir()
        log = tmp_path / "logs" / "master.log"
        log.write_text(_EARLIER_MASTER + "WARN Utils: Service 'sparkMaster' could not bind on port 7077. "
                       "Attempting port 7078.\nINFO Utils: Successfully started service 'sparkMaster' on port 7078.\n"
                       f"INFO Utils: Successfully started service 'MasterUI' on port {ui.port}.\n")
        state = ClusterState("spark://127.0.0.1:7077", master.pid, ui.port, [stale.pid], 1, dir=str(tmp_path),
                             master_log_from=len(_EARLIER_MASTER))
        ready = cluster.wait_ready(state, timeout_s=10)
        assert started == ["spark://127.0.0.1:7078"]
        assert (ready.master_url, ready.master_ui_port, ready.worker_pids) == ("spark://127.0.0.1:7078", ui.port,
                                                                             [fresh.pid])
        assert stale.poll() is not None and fresh.poll() is None  # the stale worker stopped (and reaped)
        recorded = json.loads((tmp_path / "cluster.json").read_text())
        assert (recorded["master_url"], recorded["worker_pids"]) == ("spark://127.0.0.1:7078", [fresh.pid])
    finally:
        ui.server.shutdown()
        for p in (master, stale, fresh):
            p.kill()
            p.wait()
