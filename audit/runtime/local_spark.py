"""A local Spark standalone cluster: one master and N workers, each its own JVM, from pyspark's launcher.

    msgaudit cluster start --workers 2      # spark://127.0.0.1:7077, two workers of 1 core / 1 GiB
    msgaudit cluster status
    msgaudit cluster submit ingest --config msgaudit.yaml
    msgaudit cluster stop

The daemons are started with pyspark's own `bin/spark-class` (`org.apache.spark.deploy.master.Master`
and `org.apache.spark.deploy.worker.Worker`; the pip package has no `sbin/start-master.sh`), bound to
127.0.0.1 (`--host` and SPARK_LOCAL_IP, which also binds their web UIs), with small heaps. Their
logs go to `<dir>/logs/` (master.log, worker-N.log; each executor's stdout/stderr under the worker's
`work-N/<app>/<executor>/`), never to the terminal. The executors' Python is this interpreter
(PYSPARK_PYTHON), so a venv's packages are what they import besides the shipped code.

`<dir>` is `<msgaudit home>/spark-cluster` unless given; `cluster.json` there records the master URL
and the process ids, so `status`/`stop` work from any later process. This module starts, waits
for, inspects and stops processes; it knows nothing about audit logic and imports no Spark.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from audit.core.errors import SetupError
from audit.runtime.jvm_service import pid_alive, port_in_use
from audit.runtime.local_kafka import free_port

MASTER_CLASS = "org.apache.spark.deploy.master.Master"
WORKER_CLASS = "org.apache.spark.deploy.worker.Worker"
STATE_FILE = "cluster.json"
DEFAULT_PORT = 7077

# The driver's own log (spark-submit's JVM): Spark's INFO lines go to a file, the step's summary
# lines (Python's stdout) stay on the terminal.
DRIVER_LOG4J2 = """\
rootLogger.level = info
rootLogger.appenderRef.file.ref = file
appender.file.type = File
appender.file.name = file
appender.file.fileName = {log}
appender.file.append = true
appender.file.layout.type = PatternLayout
appender.file.layout.pattern = %d{{yy/MM/dd HH:mm:ss}} %p %c{{1}}: %m%n%ex
logger.jetty.name = org.sparkproject.jetty
logger.jetty.level = warn
"""


def spark_home() -> Path:
    """pyspark's folder: it holds `bin/spark-class`, `bin/spark-submit` and Spark's jars."""
    spec = importlib.util.find_spec("pyspark")
    if spec is None or not spec.submodule_search_locations:
        raise SetupError("pyspark is not installed; install msgaudit first (pip install msgaudit-<ver>.whl)")
    return Path(next(iter(spec.submodule_search_locations)))


def default_dir(home: Path) -> Path:
    return Path(home) / "spark-cluster"


@dataclass
class ClusterState:
    """What `start` recorded: enough for `status`, `stop` and `submit` in another process."""

    master_url: str
    master_pid: int
    master_ui_port: int
    worker_pids: list[int] = field(default_factory=list)
    workers: int = 2
    cores: int = 1
    memory: str = "1g"
    python: str = sys.executable
    dir: str = ""
    master_log_from: int = 0  # master.log's size when this master started: its lines come after it

    @property
    def logs(self) -> Path:
        return Path(self.dir) / "logs"

    @property
    def driver_log4j(self) -> Path:
        return Path(self.dir) / "conf" / "log4j2-driver.properties"

    def pids(self) -> list[int]:
        return [*self.worker_pids, self.master_pid]


class LocalSparkCluster:
    def __init__(self, folder: Path, *, port: int = DEFAULT_PORT, workers: int = 2, cores: int = 1,
                 memory: str = "1g", daemon_memory: str = "256m") -> None:
        if workers < 1 or cores < 1:
            raise SetupError(f"a cluster needs at least one worker of one core (got {workers} x {cores})")
        self.dir = Path(folder).resolve()
        self.port = port
        self.workers = workers
        self.cores = cores
        self.memory = memory
        self.daemon_memory = daemon_memory

    # -- state ---------------------------------------------------------------------------------

    @property
    def state_path(self) -> Path:
        return self.dir / STATE_FILE

    def state(self) -> ClusterState | None:
        """The recorded cluster, or None when none was started here (or its master has died)."""
        try:
            data = json.loads(self.state_path.read_text())
        except (OSError, ValueError):
            return None
        state = ClusterState(**data)
        return state if pid_alive(state.master_pid) else None

    def alive_workers(self, state: ClusterState) -> int:
        """Workers the master reports ALIVE (its web UI's JSON), or -1 when it does not answer."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{state.master_ui_port}/json/", timeout=3) as r:
                info = json.load(r)
        except (OSError, ValueError):
            return -1
        return int(info.get("aliveworkers", sum(1 for w in info.get("workers", []) if w.get("state") == "ALIVE")))

    # -- start / stop --------------------------------------------------------------------------

    def _env(self) -> dict[str, str]:
        home = spark_home()
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PYSPARK_GATEWAY", "SPARK_"))}
        env.update({
            "SPARK_HOME": str(home),
            "SPARK_LOCAL_IP": "127.0.0.1",  # RPC and web UIs of master, workers and executors
            "SPARK_DAEMON_MEMORY": self.daemon_memory,
            "SPARK_MASTER_OPTS": "-Dspark.master.rest.enabled=false",  # no REST submission server (port 6066)
            "SPARK_LOG_DIR": str(self.dir / "logs"),
            "SPARK_CONF_DIR": str(self.dir / "conf"),
            "PYSPARK_PYTHON": sys.executable,
        })
        return env

    def _launch(self, name: str, argv: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        log = open(self.dir / "logs" / f"{name}.log", "ab")  # noqa: SIM115 - the child keeps it open
        try:
            return subprocess.Popen([str(spark_home() / "bin" / "spark-class"), *argv], env=env, cwd=self.dir,
                                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)  # outlives `msgaudit cluster start`
        finally:
            log.close()

    def start(self, timeout_s: float = 300.0) -> ClusterState:
        """Start the master and the workers; return once the master sees every worker ALIVE."""
        return self.wait_ready(self.launch(), timeout_s)

    def launch(self) -> ClusterState:
        """Start the master and the workers' JVMs without waiting for them (see `wait_ready`)."""
        running = self.state()
        if running is not None:
            return running
        if port_in_use(self.port):
            raise SetupError(f"port {self.port} on 127.0.0.1 is taken; choose another with --port")
        for sub in ("logs", "conf"):
            (self.dir / sub).mkdir(parents=True, exist_ok=True)
        env = self._env()
        ui = free_port()
        url = f"spark://127.0.0.1:{self.port}"
        master_log = self.dir / "logs" / "master.log"
        since = master_log.stat().st_size if master_log.exists() else 0
        master = self._launch("master", [MASTER_CLASS, "--host", "127.0.0.1", "--port", str(self.port),
                                         "--webui-port", str(ui)], env)
        state = ClusterState(url, master.pid, ui, [], self.workers, self.cores, self.memory, sys.executable,
                             str(self.dir), since)
        state.driver_log4j.write_text(DRIVER_LOG4J2.format(log=state.logs / "driver.log"))
        # The workers start beside the master (they retry until it answers): one JVM start less to wait.
        state.worker_pids = self._launch_workers(url, env)
        self._write(state)
        return state

    def _launch_workers(self, url: str, env: dict[str, str]) -> list[int]:
        pids = []
        for i in range(1, self.workers + 1):
            work = self.dir / f"work-{i}"
            work.mkdir(exist_ok=True)
            w = self._launch(f"worker-{i}", [
                WORKER_CLASS, "--host", "127.0.0.1", "--webui-port", str(free_port()),
                "--cores", str(self.cores), "--memory", self.memory, "--work-dir", str(work), url], env)
            pids.append(w.pid)
        return pids

    def _moved(self, state: ClusterState) -> ClusterState | None:
        """`state` with the ports the master's log says it bound, when they are not the picked ones
        (another process took a picked port first and Spark bound the next one); None otherwise.
        Workers given the old URL would never register: they are stopped and started again on the
        new one."""
        bound = master_ports(state.logs / "master.log", state.master_log_from)
        url = f"spark://127.0.0.1:{bound['sparkMaster']}" if "sparkMaster" in bound else state.master_url
        ui = bound.get("MasterUI", state.master_ui_port)
        if (url, ui) == (state.master_url, state.master_ui_port):
            return None
        moved = replace(state, master_url=url, master_ui_port=ui)
        if url != state.master_url:
            _terminate(state.worker_pids, timeout_s=30.0)
            moved.worker_pids = self._launch_workers(url, self._env())
        self._write(moved)
        return moved

    def wait_ready(self, state: ClusterState, timeout_s: float = 300.0) -> ClusterState:
        """Wait until the master sees every worker ALIVE; a dead daemon or the timeout stops them all.

        The master may not be on the ports `launch` picked: when another process takes one first,
        Spark binds the next free port and logs it. While the workers are not all alive, the ports
        the master's log names are taken (and recorded) instead, and the workers are restarted on
        the master's new URL (`_moved`)."""
        deadline = time.monotonic() + timeout_s
        while self.alive_workers(state) != state.workers:
            if (moved := self._moved(state)) is not None:
                state = moved
                continue
            dead = [p for p in state.pids() if not pid_alive(p)]
            if dead or time.monotonic() > deadline:
                why = "a daemon exited" if dead else f"not ready after {timeout_s:.0f}s"
                self.stop()
                raise SetupError(f"Spark cluster: {why}; see the logs in {self.dir / 'logs'}")
            time.sleep(0.3)
        return state

    def _write(self, state: ClusterState) -> None:
        tmp = self.state_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(state), indent=2))
        tmp.replace(self.state_path)

    def stop(self, timeout_s: float = 30.0) -> int:
        """Stop the workers, then the master (TERM, then KILL after `timeout_s`); how many were running."""
        try:
            state = ClusterState(**json.loads(self.state_path.read_text()))
        except (OSError, ValueError):
            return 0
        running = _terminate(state.pids(), timeout_s)
        self.state_path.unlink(missing_ok=True)
        return len(running)


def _terminate(pids: list[int], timeout_s: float) -> list[int]:
    """TERM the live ones of `pids`, KILL those still alive after `timeout_s`; the ones that were alive."""
    running = [p for p in pids if pid_alive(p)]
    for pid in running:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while any(pid_alive(p) for p in running) and time.monotonic() < deadline:
        time.sleep(0.2)
    for pid in running:
        if pid_alive(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    for pid in running:  # reap our own children (no-op for a cluster started by another process)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
    return running


_BOUND = re.compile(r"Successfully started service '(sparkMaster|MasterUI)' on port (\d+)")


def master_ports(log: Path, since: int = 0) -> dict[str, int]:
    """The ports the master bound, by service ('sparkMaster': its RPC, 'MasterUI': its web UI), as the
    last lines of its log after byte `since` that say so (a service without such a line yet is absent)."""
    try:
        with open(log, "rb") as f:
            f.seek(since)
            text = f.read().decode(errors="replace")
    except OSError:
        return {}
    return {service: int(port) for service, port in _BOUND.findall(text)}


def submit_command(state: ClusterState, application: str, app_args: list[str], *, jars: list[str],
                   py_files: list[str], conf: dict[str, str] | None = None,
                   executor_memory: str = "640m") -> tuple[list[str], dict[str, str]]:
    """The `spark-submit` argv and environment that run `application` on this cluster.

    Client deploy mode: the driver runs here, the executors in the workers' JVMs. Jars go on
    `--jars` (the driver JVM exists before the application's session is built), the project's
    Python on `--py-files`, the interpreter on PYSPARK_PYTHON; Spark's log lines go to
    `<dir>/logs/driver.log`."""
    argv = [str(spark_home() / "bin" / "spark-submit"), "--master", state.master_url, "--deploy-mode", "client",
            "--executor-memory", executor_memory,
            "--conf", "spark.driver.host=127.0.0.1", "--conf", "spark.driver.bindAddress=127.0.0.1"]
    conf = dict(conf or {})
    java = conf.pop("spark.driver.extraJavaOptions", "")
    conf["spark.driver.extraJavaOptions"] = f"{java} -Dlog4j2.configurationFile=file:{state.driver_log4j}".strip()
    for key, value in conf.items():
        argv += ["--conf", f"{key}={value}"]
    if jars:
        argv += ["--jars", ",".join(jars)]
    if py_files:
        argv += ["--py-files", ",".join(py_files)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYSPARK_GATEWAY")}
    env.update({"SPARK_HOME": str(spark_home()), "SPARK_LOCAL_IP": "127.0.0.1",
                "PYSPARK_PYTHON": state.python, "PYSPARK_DRIVER_PYTHON": sys.executable})
    return [*argv, application, *app_args], env


def cli_cluster(args: argparse.Namespace, cfg: Any) -> int:
    """`msgaudit cluster start|stop|status` (`submit` is `spark_jobs.pipeline.submit.cli_cluster_submit`)."""
    cluster = cluster_for(args, cfg)
    if args.action == "start":
        t0 = time.monotonic()
        started = cluster.start()
        print(f"cluster: {started.master_url} with {started.workers} worker(s) of {started.cores} core(s) / "
              f"{started.memory} in {time.monotonic() - t0:.1f}s (logs in {started.logs})")
        return 0
    if args.action == "stop":
        print(f"cluster: stopped {cluster.stop()} process(es)")
        return 0
    state = cluster.state()
    if state is None:
        print("cluster: not running")
        return 1
    alive = cluster.alive_workers(state)
    print(f"cluster: running at {state.master_url}, {max(alive, 0)} of {state.workers} worker(s) alive "
          f"(master UI http://127.0.0.1:{state.master_ui_port}, logs in {state.logs})")
    return 0 if alive == state.workers else 1


def cluster_for(args: argparse.Namespace, cfg: Any) -> LocalSparkCluster:
    folder = Path(args.dir) if args.dir else default_dir(cfg.home)
    return LocalSparkCluster(folder, port=args.port, workers=args.workers, cores=args.cores, memory=args.memory)


def running_state(cluster: LocalSparkCluster) -> ClusterState:
    state = cluster.state()
    if state is None:
        raise SetupError(f"no Spark cluster is running from {cluster.dir}; run `msgaudit cluster start` first")
    return state
