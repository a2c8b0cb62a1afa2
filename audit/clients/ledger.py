"""Crash-safe JSON-lines ledger segments: the producer ledger and the consumption ledger on disk.

A `LedgerWriter` takes rows from a hot path (a Kafka delivery callback, a consumer loop) and
writes them to segment files from a background thread, so `append` never waits for a disk.
Segments live in one directory:

    <prefix>-<utc stamp>-<os pid>-<random>.jsonl.open   being written (holds an flock)
    <prefix>-<utc stamp>-<os pid>-<random>.jsonl        sealed: fsynced, renamed, never changed again

A segment is sealed when it reaches `max_bytes`, when it is `max_age_s` old, and on `close()`.
Readers (`msgaudit ingest`) read only `*.jsonl`, so they never see a partial segment. A writer
killed with SIGKILL leaves its `.open` segment behind; `recover_orphans` (run by ingest before
reading) seals every `.open` segment whose writer is gone: it cuts the file after its last
complete line and renames it. Such a writer loses at most the rows still in its memory buffer
(at most `flush_interval_s` worth) and never leaves a file that breaks ingestion.

Whether a writer is gone is decided by the advisory lock each writer holds on its open segment
(fcntl.flock here and in the librdkafka plugin; a POSIX record lock in the Java interceptors):
the kernel drops it when the process dies, so a reused pid cannot fool it.
The pid in the name is for humans.

This module must not import Kafka or Spark, and must never block the caller of `append`.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable
from datetime import UTC, datetime
from itertools import chain, repeat, starmap
from operator import itemgetter
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol

from audit.core.errors import LedgerError

log = logging.getLogger(__name__)

OPEN_SUFFIX = ".jsonl.open"
SEALED_SUFFIX = ".jsonl"
_NEW_SUFFIX = ".jsonl.new"  # created and locked here first, so no reader sees an unlocked open segment
_CHUNK_ROWS = 20_000  # rows encoded per write(); bounds how far a segment can overshoot max_bytes
_FORMAT_ROWS = 2_048  # rows per %-operation (see _format_lines)



def encode_row(row: Any) -> str:
    """One compact JSON object (no newline inside, non-ASCII escaped)."""
    return json.dumps(row, separators=(",", ":"))


# `LINE_FORMAT % (LINE_FORMAT, line)` == line: an already encoded row in append_formatted form.
LINE_FORMAT = "%.0s%s"
_first = itemgetter(0)


def _encode_checked(row: dict[str, Any]) -> tuple[str, str]:
    try:
        return (LINE_FORMAT, encode_row(row))
    except (TypeError, ValueError) as e:
        raise LedgerError(f"ledger row is not JSON-serialisable ({e}); timestamps go in as epoch ms: {row!r}") from e


def _format_lines(items: list[tuple[Any, ...]]) -> str:
    """Every item's line (`item[0] % item`), each followed by a newline, as one string.

    One %-operation over the joined formats and the flattened values instead of one per row:
    the per-call overhead was most of a row's cost, and this runs on the writer thread, which
    shares the GIL with the producer's hot path. A bad item makes the whole operation fail
    (a value of the wrong type, or a count that no longer adds up), so the batch is redone
    row by row and only the bad rows become error lines."""
    try:
        return ("\n".join(map(_first, items)) + "\n") % tuple(chain.from_iterable(items))
    except (TypeError, ValueError):
        return "".join([_format_one(item) + "\n" for item in items])


def _format_one(item: tuple[Any, ...]) -> str:
    """Slow path for a batch with a bad item: that item becomes a line ingest will quarantine
    (and count) rather than an exception that would stop the writer and lose every later row."""
    try:
        return str(item[0] % item)
    except (TypeError, ValueError, IndexError) as e:
        log.error("ledger row could not be formatted (%s): %r", e, item)
        return encode_row({"ledger_format_error": str(e), "item": repr(item)})


def _fsync_dir(directory: Path) -> None:
    # The rename is durable only once the directory entry is.
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class SegmentObserver(Protocol):
    """What a LedgerWriter tells a shipper (audit.clients.ledger_ship), on the writer's thread.
    Every call must return quickly and never raise into the writer."""

    def opened(self, segment: Path) -> None:
        """A new segment exists (`segment` is its sealed path-to-be)."""

    def lines(self, segment: Path, first_line: int, lines: list[str]) -> None:
        """`lines` are written (not yet fsynced) at line numbers first_line, first_line + 1, ..."""

    def sealed(self, segment: Path, rows: int) -> None:
        """The segment is sealed at `segment` with `rows` lines."""


_last_stamp = [""]


def _segment_stem(prefix: str) -> str:
    # Microseconds, strictly increasing within a process: names sort in creation order.
    now = datetime.now(UTC)
    stamp = now.strftime("%Y%m%dT%H%M%S") + f"{now.microsecond:06d}Z"
    while stamp <= _last_stamp[0]:
        now = datetime.now(UTC)
        stamp = now.strftime("%Y%m%dT%H%M%S") + f"{now.microsecond:06d}Z"
    _last_stamp[0] = stamp
    return f"{prefix}-{stamp}-{os.getpid()}-{os.urandom(4).hex()}"


class _Segment:
    """One open segment: a locked file descriptor and its sizes."""

    def __init__(self, directory: Path, prefix: str) -> None:
        stem = _segment_stem(prefix)
        new = directory / (stem + _NEW_SUFFIX)
        self.open_path = directory / (stem + OPEN_SUFFIX)
        self.sealed_path = directory / (stem + SEALED_SUFFIX)
        self.fd = os.open(new, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o644)
        fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.rename(new, self.open_path)
        self.opened = time.monotonic()
        self.size = 0
        self.rows = 0

    def write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            n = os.write(self.fd, view)
            view = view[n:]
        self.size += len(data)

    def sync(self) -> None:
        os.fsync(self.fd)

    def seal(self) -> Path:
        os.fsync(self.fd)
        os.rename(self.open_path, self.sealed_path)
        _fsync_dir(self.sealed_path.parent)
        os.close(self.fd)  # releases the lock only after the rename, see recover_orphans
        return self.sealed_path


class _State:
    """Everything the writer thread touches; kept apart from LedgerWriter so the thread does
    not keep the writer object alive and a forgotten writer is still sealed at exit."""

    def __init__(self, directory: Path, prefix: str, max_bytes: int, max_age_s: float,
                 flush_interval_s: float, mirror: Callable[[list[str]], None] | None,
                 observer: SegmentObserver | None = None) -> None:
        self.directory = directory
        self.prefix = prefix
        self.max_bytes = max_bytes
        self.max_age_s = max_age_s
        self.flush_interval_s = flush_interval_s
        self.mirror = mirror
        self.observer = observer
        self.queue: deque[Any] = deque()
        self.cond = threading.Condition()
        self.flush_requested = 0
        self.flush_done = 0
        self.closing = False
        self.closed = False
        self.error: BaseException | None = None
        self.segment: _Segment | None = None
        self.sealed: list[Path] = []
        self.rows_written = 0

    # -- writer thread -------------------------------------------------------------------
    def run(self) -> None:
        try:
            while True:
                with self.cond:
                    if not (self.closing or self.flush_requested > self.flush_done):
                        self.cond.wait(self.flush_interval_s)
                    closing = self.closing
                    want = self.flush_requested
                self._drain()
                if self.segment is not None and (
                    self.segment.size >= self.max_bytes
                    or time.monotonic() - self.segment.opened >= self.max_age_s
                ):
                    self._seal()
                if closing:
                    self._drain()
                    self._seal()
                    with self.cond:
                        self.flush_done = self.flush_requested
                        self.closed = True
                        self.cond.notify_all()
                    return
                if want > self.flush_done:
                    if self.segment is not None:
                        self.segment.sync()
                    with self.cond:
                        self.flush_done = want
                        self.cond.notify_all()
        except BaseException as e:  # noqa: BLE001 - reported to flush()/close() callers
            log.error("ledger writer for %s failed: %s", self.directory, e)
            with self.cond:
                self.error = e
                self.closed = True
                self.cond.notify_all()

    def _drain(self) -> None:
        q = self.queue
        while q:
            n = min(len(q), _CHUNK_ROWS)
            pop = q.popleft
            # Each item is a tuple (fmt, *values) and its line is `fmt % item` (see
            # append_formatted), made in batches by _format_lines: this thread shares the GIL
            # with the hot path, so per-row Python work here slows the producer.
            items = list(starmap(pop, repeat((), n)))  # n poplefts, looped in C
            text = "".join([_format_lines(items[i:i + _FORMAT_ROWS]) for i in range(0, n, _FORMAT_ROWS)])
            if self.segment is None:
                self.segment = _Segment(self.directory, self.prefix)
                self._observe("opened", self.segment.sealed_path)
            self.segment.write(text.encode("utf-8"))
            first = self.segment.rows
            self.segment.rows += n
            self.rows_written += n
            if self.mirror is not None:
                self.mirror(text[:-1].split("\n"))
            if self.observer is not None:
                self._observe("lines", self.segment.sealed_path, first, text[:-1].split("\n"))
            if self.segment.size >= self.max_bytes:
                self._seal()

    def _seal(self) -> None:
        if self.segment is not None:
            rows = self.segment.rows
            self.sealed.append(self.segment.seal())
            self.segment = None
            self._observe("sealed", self.sealed[-1], rows)

    def _observe(self, what: str, *args: Any) -> None:
        # The segment files are the ledger of record: a failing shipper is logged, never
        # allowed to stop them (what it did not ship stays in the spool for `msgaudit ship`).
        if self.observer is None:
            return
        try:
            getattr(self.observer, what)(*args)
        except Exception as e:  # noqa: BLE001
            log.error("ledger shipper for %s failed in %s: %s", self.directory, what, e)

    # -- caller side ---------------------------------------------------------------------
    def wait(self, closing: bool, timeout: float | None) -> None:
        with self.cond:
            if self.closed and self.error is None:
                if closing:
                    return
                raise LedgerError(f"ledger writer for {self.directory} is closed")
            self.flush_requested += 1
            target = self.flush_requested
            if closing:
                self.closing = True
            self.cond.notify_all()
            ok = self.cond.wait_for(lambda: self.flush_done >= target or self.error is not None, timeout)
            if self.error is not None:
                raise LedgerError(
                    f"ledger writer for {self.directory} failed: {self.error}; "
                    f"{len(self.queue)} rows were not written (fix the directory and restart)"
                ) from self.error
            if not ok:
                raise LedgerError(f"ledger writer for {self.directory} did not finish within {timeout}s")

    def finalize(self) -> None:
        # Interpreter exit or garbage collection of a writer that was never closed.
        with contextlib.suppress(Exception):
            self.wait(closing=True, timeout=30.0)


class LedgerWriter:
    """Buffered, crash-safe JSON-lines segment writer (see the module docstring).

    `append` puts the row in an in-memory queue and returns; a background thread encodes,
    writes and rotates. `flush()` makes every row appended so far durable in the open segment;
    `close()` seals it. A writer that is never closed is sealed at interpreter exit.

    `append_formatted((fmt, v1, v2, ...))` is the fast path for hot callers: the writer thread
    makes the line as `fmt % item`, where fmt is a %-format that starts with `%.0s` (it
    swallows fmt itself) and produces one JSON object, so the caller pays for one tuple, not
    for JSON encoding. `append(row)` encodes the dict on the caller's
    thread, so a row that is not JSON-serialisable fails there, loudly, not in the writer. `mirror`, if given,
    receives each batch of encoded lines after it is written. `observer` (a SegmentObserver, e.g.
    audit.clients.ledger_ship.LedgerShipper) is told of each segment opened, each batch of lines
    with their line numbers, and each seal: that is how rows are shipped to the ledger topic.
    """

    def __init__(
        self,
        directory: Path,
        prefix: str,
        *,
        max_bytes: int = 64 << 20,
        max_age_s: float = 60.0,
        flush_interval_s: float = 0.2,
        mirror: Callable[[list[str]], None] | None = None,
        observer: SegmentObserver | None = None,
    ) -> None:
        if not prefix or "/" in prefix or prefix.startswith("."):
            raise LedgerError(f"ledger prefix must be a plain file-name prefix, got {prefix!r}")
        if max_bytes <= 0 or max_age_s <= 0 or flush_interval_s <= 0:
            raise LedgerError("ledger max_bytes, max_age_s and flush_interval_s must be positive")
        directory = Path(directory)
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise LedgerError(f"cannot create ledger directory {directory}: {e}") from e
        self.directory = directory
        self.prefix = prefix
        self._state = _State(directory, prefix, max_bytes, max_age_s, flush_interval_s, mirror, observer)
        # Bound method of the deque: appending is one C call, safe from any thread.
        self.append_formatted: Callable[[tuple[Any, ...]], None] = self._state.queue.append
        self._thread = threading.Thread(target=self._state.run, name=f"ledger-{prefix}", daemon=True)
        self._thread.start()
        self._finalizer = weakref.finalize(self, self._state.finalize)

    def append(self, row: dict[str, Any]) -> None:
        """Queue one row (docs/design.md §4 column names; timestamps as epoch ms). Never blocks."""
        if self._state.closed:
            raise LedgerError(f"ledger writer for {self.directory} is closed; row not written: {row!r}")
        self._state.queue.append(_encode_checked(row))

    def extend(self, rows: Iterable[dict[str, Any]]) -> None:
        if self._state.closed:
            raise LedgerError(f"ledger writer for {self.directory} is closed")
        self._state.queue.extend([_encode_checked(row) for row in rows])

    def flush(self, timeout: float | None = 30.0) -> None:
        """Block until every row appended so far is written and fsynced in the open segment."""
        self._state.wait(closing=False, timeout=timeout)

    def close(self, timeout: float | None = 30.0) -> None:
        """Write everything, seal the open segment (fsync + atomic rename) and stop. Idempotent."""
        if self._finalizer.detach() is None and self._state.closed and self._state.error is None:
            return
        self._state.wait(closing=True, timeout=timeout)
        self._thread.join(timeout)

    @property
    def closed(self) -> bool:
        return self._state.closed

    @property
    def pending(self) -> int:
        """Rows queued in memory, not yet written."""
        return len(self._state.queue)

    @property
    def rows_written(self) -> int:
        return self._state.rows_written

    @property
    def sealed_segments(self) -> list[Path]:
        """Segments this writer has sealed so far, oldest first."""
        return list(self._state.sealed)

    @property
    def open_segment(self) -> Path | None:
        seg = self._state.segment
        return seg.open_path if seg is not None else None

    def __enter__(self) -> LedgerWriter:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


def _try_lock(fd: int) -> bool:
    """True when no writer holds the segment: neither a flock (Python writers, the librdkafka
    plugin) nor a POSIX record lock (the Java interceptors: FileChannel.lock takes those, and the
    two kinds do not conflict on Linux). `fd` must be open for writing. Closing it drops both."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno in (errno.EACCES, errno.EAGAIN):
            return False
        raise
    return True


def recover_orphans(directory: Path) -> int:
    """Seal every `.open` segment in `directory` whose writer is gone; return how many.

    The file is cut after its last complete line (a SIGKILL can interrupt a write mid-line),
    fsynced and renamed to `.jsonl`; a segment with no complete line is removed. Segments of
    live writers (their lock is held) are left alone. Safe to run while writers are running
    and from several processes at once.
    """
    directory = Path(directory)
    if not directory.is_dir():
        return 0
    recovered = 0
    for path in sorted(directory.iterdir()):
        name = path.name
        if name.endswith(_NEW_SUFFIX):
            _remove_if_unlocked(path)
            continue
        if not name.endswith(OPEN_SUFFIX):
            continue
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            continue  # sealed by its writer meanwhile
        try:
            if not _try_lock(fd):
                continue  # a live writer
            try:
                same = os.stat(path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if not same:
                continue  # the writer sealed it between our open and our lock
            size = os.fstat(fd).st_size
            keep = _last_line_end(fd, size)
            if keep == 0:
                os.unlink(path)
                _fsync_dir(directory)
                continue
            if keep < size:
                log.warning("ledger segment %s: dropped %d bytes of an unfinished last line", path, size - keep)
                os.ftruncate(fd, keep)
            # A fresh mtime: file-source readers may skip files that look older than their newest.
            os.utime(fd)
            os.fsync(fd)
            os.rename(path, path.with_name(name[: -len(OPEN_SUFFIX)] + SEALED_SUFFIX))
            _fsync_dir(directory)
            recovered += 1
        finally:
            os.close(fd)
    return recovered


def _last_line_end(fd: int, size: int) -> int:
    """Offset just after the last b'\\n' in the file (0 if none), reading backwards in blocks."""
    block = 1 << 16
    end = size
    while end > 0:
        start = max(0, end - block)
        data = os.pread(fd, end - start, start)
        i = data.rfind(b"\n")
        if i >= 0:
            return start + i + 1
        end = start
    return 0


def _remove_if_unlocked(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return
    try:
        if _try_lock(fd) and os.path.exists(path) and os.stat(path).st_ino == os.fstat(fd).st_ino:
            os.unlink(path)
    finally:
        os.close(fd)


def sealed_segments(directory: Path) -> list[Path]:
    """The sealed segments in `directory`, oldest name first (what ingest reads)."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.iterdir() if p.name.endswith(SEALED_SUFFIX))
