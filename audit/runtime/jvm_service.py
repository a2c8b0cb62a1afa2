"""What every local JVM service of msgaudit shares (the Kafka broker, a Connect worker, MirrorMaker 2):
finding `java`, a log4j2 configuration that keeps the JVM's log in a file, a settings file readable
by its owner only (it may hold a password), process liveness, waiting for a condition while the
process lives, and SIGTERM-then-SIGKILL.

`JvmService` is one such process whose pid is kept in a JSON state file of its data folder
(`LocalConnect`, `LocalMirrorMaker`); `LocalKafka`, several processes, uses the functions. This
module knows nothing about Kafka or audit logic.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from audit.core.errors import BrokerError, SetupError

JVM_OPTIONS = ("-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1", "-Djava.awt.headless=true")


def java() -> str:
    found = shutil.which("java")
    if found is None:
        home = os.environ.get("JAVA_HOME")
        if home and (Path(home) / "bin" / "java").exists():
            return str(Path(home) / "bin" / "java")
        raise SetupError("Java is not installed or not on PATH; install a JDK 17+ (apt-get install openjdk-17-jre-headless)")
    return found


def log4j2_file_config(file_name: str, levels: dict[str, str]) -> str:
    """A log4j2 XML configuration that writes every INFO line to one file (`file_name` may name a
    system property, e.g. `${sys:kafka.logs.dir}/server.log`), with `levels` per logger name: a
    JVM started from here never writes its log to the user's terminal."""
    loggers = "".join(f'    <Logger name="{name}" level="{level}"/>\n' for name, level in levels.items())
    return ('<?xml version="1.0" encoding="UTF-8"?>\n<Configuration status="WARN">\n  <Appenders>\n'
            f'    <File name="file" fileName="{file_name}"><PatternLayout pattern="[%d] %p %m (%c)%n"/></File>\n'
            '  </Appenders>\n  <Loggers>\n    <Root level="INFO"><AppenderRef ref="file"/></Root>\n'
            f"{loggers}  </Loggers>\n</Configuration>\n")


def write_private(path: Path, text: str) -> Path:
    """Write `text` to `path`, readable and writable by its owner only (mode 0600, also when it
    existed with a wider mode): a settings file may hold a password."""
    path.touch(mode=0o600)
    path.chmod(0o600)
    path.write_text(text)
    return path


def properties_text(props: Mapping[str, str]) -> str:
    """A Java `.properties` file of `props`, one `key=value` a line, that `Properties.load` reads back
    as given: backslashes doubled (an MM2 topic regex `a\\.b` stays one), line breaks escaped."""
    def escaped(text: str) -> str:
        return text.replace("\\", "\\\\").replace("\n", "\\n").replace("\r", "\\r")

    return "".join(f"{escaped(k)}={escaped(v)}\n" for k, v in props.items())


def port_in_use(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.3)
        return s.connect_ex(("127.0.0.1", port)) == 0


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie child still answers kill(0); treat it as dead.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return True


def wait_dead(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            waited, _ = os.waitpid(pid, os.WNOHANG)
            if waited == pid:
                return True
        except ChildProcessError:
            pass
        if not pid_alive(pid):
            return True
        time.sleep(0.1)
    return False


def terminate(pids: Sequence[int], timeout: float) -> None:
    """SIGTERM every process (a clean stop), then SIGKILL those still alive after `timeout`."""
    alive = [pid for pid in pids if pid_alive(pid)]
    for pid in alive:
        os.kill(pid, signal.SIGTERM)
    for pid in alive:
        if not wait_dead(pid, timeout):
            os.kill(pid, signal.SIGKILL)
            wait_dead(pid, 5)


def wait_until(ready: Callable[[], bool], timeout: float, check_alive: Callable[[], None],
               interval: float = 0.5) -> bool:
    """Poll `ready` until it is true (True) or `timeout` passes (False); `check_alive` runs first
    each round and raises when the service died (a dead service is not waited for)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        check_alive()
        if ready():
            return True
        time.sleep(interval)
    return False


class JvmService:
    """One JVM process of a data folder: its pid in `<data_dir>/<state_name>`, its log in
    `<data_dir>/<log_name>` (log4j2), what it writes to stdout in `<data_dir>/stdout.log`.
    Subclasses name it (`what`, for messages) and start it with `launch`."""

    what = "the JVM service"
    state_name = "service.json"
    log_name = "service.log"

    def __init__(self, data_dir: Path | str) -> None:
        self.data_dir = Path(data_dir)
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def log_file(self) -> Path:
        return self.data_dir / self.log_name

    def _state_file(self) -> Path:
        return self.data_dir / self.state_name

    @property
    def pid(self) -> int | None:
        try:
            pid = int(json.loads(self._state_file().read_text())["pid"])
        except (OSError, ValueError, KeyError):
            return None
        return pid if pid_alive(pid) else None

    def running(self) -> bool:
        return self.pid is not None

    def launch(self, classpath: str, main: str, args: Sequence[str], log4j2: str, log_property: str,
               heap: str = "384m", state: Mapping[str, Any] | None = None) -> None:
        """Start `java ... -cp classpath main args` in a session of its own; its log4j2 configuration
        in the data folder, the log file's path in the system property `log_property`."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        log4j = self.data_dir / "log4j2.xml"
        log4j.write_text(log4j2)
        out = open(self.data_dir / "stdout.log", "ab")  # noqa: SIM115 - handed to the child
        self._proc = subprocess.Popen(
            [java(), "-Xms64m", f"-Xmx{heap}", *JVM_OPTIONS, f"-Dlog4j2.configurationFile={log4j}",
             f"-D{log_property}={self.log_file}", "-cp", classpath, main, *args],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        self._state_file().write_text(json.dumps({"pid": self._proc.pid, **(state or {})}))

    def check_alive(self, during: str = "start-up") -> None:
        if self.pid is None:
            raise BrokerError(f"{self.what} exited during {during}; see {self.log_file}:\n{self.log_tail()}")

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Kill the process (SIGKILL by default: no clean stop)."""
        pid = self.pid
        if pid is not None:
            os.kill(pid, sig)
            if not wait_dead(pid, 30):
                raise BrokerError(f"{self.what} (pid {pid}) did not exit after signal {sig}")

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM (a clean stop), SIGKILL if it hangs; the state file goes."""
        pid = self.pid
        if pid is not None:
            terminate([pid], timeout)
        if self._state_file().exists():
            self._state_file().unlink()

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def __exit__(self, *exc: object) -> None:
        self.stop()
