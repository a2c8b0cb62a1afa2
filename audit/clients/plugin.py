"""The `libmsgaudit` librdkafka plugin from Python: where it is, how to build it, its counters.

The plugin (C, `native/libmsgaudit/`) stamps the audit headers and writes the producer ledger
inside librdkafka (docs/design.md §3.3); `AuditedProducer` loads it when it is available. This
module finds the built library, builds it (`msgaudit setup` does, once), and reads the plugin's
per-producer counters through ctypes. The library is opened by the same path librdkafka opens
it with, so both see the same instance of it.

Where the plugin is taken from:
  - `$MSGAUDIT_PLUGIN` = a path to `libmsgaudit.so`: that file (it must exist);
  - `$MSGAUDIT_PLUGIN` = `off` (or `0`, `false`, `no`): no plugin, the pure-Python path;
  - unset: the library `msgaudit setup` built, if it has: in a checkout
    `<project>/native/libmsgaudit/build/libmsgaudit.so`; installed from the wheel (which ships the
    source as `audit/clients/native`, a link to `native/libmsgaudit` in a checkout)
    `<msgaudit home>/plugin/libmsgaudit.so`.

This module must not import Kafka or Spark.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path

from audit.core.config import msgaudit_home
from audit.core.errors import ConfigError, LedgerError, SetupError

PLUGIN_ENV = "MSGAUDIT_PLUGIN"
_OFF = ("off", "0", "false", "no")
# The C source: the package's `native` (a link to native/libmsgaudit in a checkout, a copy in the wheel)
SOURCE_DIR = Path(__file__).resolve().parent / "native"
CHECKOUT = Path(__file__).resolve().parents[2] / "native" / "libmsgaudit"
BUILT = CHECKOUT / "build" / "libmsgaudit.so"  # where a checkout builds it


def built() -> Path:
    """Where `build` puts the library: in a checkout next to its source, else under msgaudit home."""
    return BUILT if SOURCE_DIR.resolve() == CHECKOUT.resolve() else msgaudit_home() / "plugin" / "libmsgaudit.so"


def plugin_path() -> Path | None:
    """The plugin to load, or None when there is none (see the module docstring)."""
    env = os.environ.get(PLUGIN_ENV, "").strip()
    if env.lower() in _OFF:
        return None
    if env:
        path = Path(env).resolve()
        if not path.is_file():
            raise ConfigError(f"{PLUGIN_ENV}={env}: no such file (build it with `msgaudit setup`, "
                              f"or set {PLUGIN_ENV}=off for the pure-Python producer)")
        return path
    path = built()
    return path if path.is_file() else None


def build(force: bool = False) -> Path:
    """Build the plugin from its source (`native/libmsgaudit/`) with make and gcc into `built()`;
    return the library.

    make rebuilds only when the source changed, so this is cheap when nothing did."""
    if not (SOURCE_DIR / "Makefile").is_file():
        raise SetupError(f"plugin source {SOURCE_DIR} is missing; reinstall msgaudit")
    out = built()
    for tool in ("make", "gcc"):
        if shutil.which(tool) is None:
            raise SetupError(f"building the librdkafka plugin needs {tool} (Debian: apt-get install -y build-essential)")
    if not Path("/usr/include/librdkafka/rdkafka.h").is_file():
        raise SetupError("building the librdkafka plugin needs librdkafka's header "
                         "(Debian: apt-get install -y librdkafka-dev)")
    args = ["make", "-s", "-C", str(SOURCE_DIR.resolve()), f"OUT={out.parent}"]
    if force:
        args.insert(1, "-B")
    r = subprocess.run(args, capture_output=True, text=True)
    if r.returncode != 0:
        raise SetupError(f"building the librdkafka plugin failed:\n{r.stdout}{r.stderr}")
    return out


@dataclass(frozen=True)
class PluginStats:
    """Counters of one producer instance inside the plugin."""

    stamped: int   # records stamped in on_send
    passed: int    # records that already carried audit headers, left alone (no ledger row)
    acked: int
    failed: int
    written: int   # ledger rows written to segment files
    dropped: int   # ledger rows that could not be recorded (full buffer, unwritable spool)
    pending: int   # ledger rows in memory, not yet written
    late: int      # rows reported after the client was destroyed (counted in dropped)


class Plugin:
    """ctypes view of one loaded plugin library (one per path and process)."""

    _loaded: dict[Path, Plugin] = {}
    _lock = threading.Lock()

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            lib = ctypes.CDLL(str(path))
        except OSError as e:
            raise ConfigError(f"cannot load the msgaudit plugin {path}: {e}") from e
        lib.msgaudit_flush.argtypes = [ctypes.c_char_p, ctypes.c_int]
        lib.msgaudit_flush.restype = ctypes.c_int
        lib.msgaudit_stats.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_int64)]
        lib.msgaudit_stats.restype = ctypes.c_int
        lib.msgaudit_failed_call.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_int32, ctypes.c_char_p,
                                             ctypes.c_char_p]
        lib.msgaudit_failed_call.restype = ctypes.c_int64
        self._lib = lib

    @classmethod
    def load(cls, path: Path) -> Plugin:
        with cls._lock:
            plugin = cls._loaded.get(path)
            if plugin is None:
                plugin = cls._loaded[path] = cls(path)
            return plugin

    def flush(self, pid: str, timeout_s: float) -> None:
        """Make every ledger row reported so far durable in the open segment."""
        rc = self._lib.msgaudit_flush(pid.encode(), int(max(timeout_s, 0) * 1000))
        if rc == 2:
            raise LedgerError(f"the msgaudit plugin did not write producer {pid}'s ledger within {timeout_s}s")

    def stats(self, pid: str) -> PluginStats | None:
        out = (ctypes.c_int64 * 8)()
        if self._lib.msgaudit_stats(pid.encode(), out) != 0:
            return None
        return PluginStats(*out)

    def failed_call(self, pid: str, topic: str, partition: int, error: str, fingerprint: str | None = None) -> int:
        """A produce() call that raised: a failed ledger row (with the message's content `fingerprint`)
        unless the plugin already wrote one."""
        return int(self._lib.msgaudit_failed_call(pid.encode(), str(topic).encode(), partition, error.encode(),
                                                  None if fingerprint is None else fingerprint.encode()))


__all__ = ["BUILT", "PLUGIN_ENV", "Plugin", "PluginStats", "build", "plugin_path"]
