"""Quiet command output (docs/design.md §9): a command prints only its own progress and results.

What the JVM prints (Spark's log4j lines and start-up notices, JVM warnings, the Python workers it
starts) and Python warnings go to one log file, `$MSGAUDIT_HOME/logs/msgaudit.log`, instead of the
terminal. `jvm_output(home)` is held while the JVM starts: the JVM is a child process and keeps the
file descriptor it was given as its stderr for its whole life, while this process's own stderr is
left as it was. `msgaudit --verbose` (or MSGAUDIT_VERBOSE=1) turns all of this off.
"""

from __future__ import annotations

import os
import re
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TextIO

ENV_VERBOSE = "MSGAUDIT_VERBOSE"
# a log line at WARN or above, as log4j, the JVM and Python's warnings write them
WARN_LINE = re.compile(r"\b(WARN|WARNING|ERROR|FATAL|SEVERE)\b|Warning:|Exception")


def verbose() -> bool:
    return os.environ.get(ENV_VERBOSE, "") not in ("", "0")


def log_path(home: Path) -> Path:
    return Path(home) / "logs" / "msgaudit.log"


def _open_log(home: Path) -> int:
    path = log_path(home)
    path.parent.mkdir(parents=True, exist_ok=True)
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)


@contextmanager
def jvm_output(home: Path) -> Iterator[None]:
    """While inside, file descriptor 2 is the log file, so a process started here (the Spark JVM)
    writes its stderr there for good; on exit this process's stderr is restored."""
    if verbose():
        yield
        return
    sys.stderr.flush()
    fd = _open_log(home)
    saved = os.dup(2)
    try:
        os.write(fd, f"--- {datetime.now(UTC).isoformat(timespec='seconds')} process {os.getpid()}: "
                     f"{' '.join(sys.argv)}\n".encode())
        os.dup2(fd, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(fd)


def python_warnings_to_log(home: Path) -> None:
    """Python warnings (pyspark, py4j, libraries) are appended to the log file, not shown."""
    if verbose():
        return

    def show(message: Warning | str, category: type[Warning], filename: str, lineno: int,
             file: TextIO | None = None, line: str | None = None) -> None:
        fd = _open_log(home)
        try:
            os.write(fd, warnings.formatwarning(message, category, filename, lineno, line).encode())
        finally:
            os.close(fd)

    warnings.showwarning = show


def log_size(home: Path) -> int:
    try:
        return log_path(home).stat().st_size
    except OSError:
        return 0


def warned_since(home: Path, offset: int) -> bool:
    """Whether a WARN-or-worse line was logged after byte `offset` of the log file."""
    try:
        with open(log_path(home), "rb") as f:
            f.seek(offset)
            return any(WARN_LINE.search(line.decode("utf-8", "replace")) for line in f)
    except OSError:
        return False


def notice(home: Path, offset: int, command: str, err: Any = None) -> None:
    """One line at the end of a command that logged warnings: where they are."""
    if not verbose() and warned_since(home, offset):
        print(f"msgaudit {command}: Spark/JVM warnings were logged to {log_path(home)} (--verbose shows them)",
              file=err or sys.stderr)
