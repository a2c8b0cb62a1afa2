"""UTC window arithmetic shared by the CLI, the oracle and the Spark jobs (docs/design.md §6): aligned
windows, what one window's run reads (`read_ranges`), its run id and whether it is final.

Pure functions of their arguments (`parse_instant('now...')` aside): no I/O, no pyspark.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING

from audit.core.errors import ConfigError, InputError

if TYPE_CHECKING:
    from audit.core.config import TopicConfig

EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def parse_instant(text: str, what: str = "time") -> datetime:
    """ISO 8601 ('2026-11-21T10:00', '2026-11-21T10:00:00Z', '2026-11-21'), 'now' or 'now-<duration>'
    ('now-1h', 'now-90m', 'now-2d') -> aware UTC."""
    if text == "now":
        return datetime.now(UTC)
    if text.startswith("now-"):
        from audit.core.config import parse_duration

        try:
            return datetime.now(UTC) - parse_duration(text[4:], what)
        except ConfigError:
            raise InputError(f"{what}: {text!r} is not 'now-' and a duration such as now-1h, now-30m or now-2d") from None
    try:
        dt = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise InputError(f"{what}: {text!r} is not an ISO 8601 time such as 2026-11-21T10:00Z") from None
    return dt.replace(tzinfo=UTC) if dt.tzinfo is None else dt.astimezone(UTC)


def floor_window(t: datetime, size: timedelta) -> datetime:
    """Start of the UTC-aligned window of `size` that contains `t`."""
    n = (t - EPOCH) // size
    return EPOCH + n * size


def windows(start: datetime, end: datetime, size: timedelta) -> Iterator[tuple[datetime, datetime]]:
    """Every aligned window that overlaps [start, end)."""
    if end <= start:
        raise InputError(f"--end ({end.isoformat()}) must be after --start ({start.isoformat()})")
    w = floor_window(start, size)
    while w < end:
        yield w, w + size
        w += size


def to_millis(t: datetime) -> int:
    return (t - EPOCH) // timedelta(milliseconds=1)


def from_millis(ms: int) -> datetime:
    return EPOCH + timedelta(milliseconds=ms)


@dataclass(frozen=True)
class ReadRanges:
    """What one window's run reads (see the docstring of `audit/oracle.py`): ledger and log rows by
    their natural time in [message_lo, message_hi); consumption and sink rows in [event_lo, event_hi).

    Messages outside the window are context: the lookback's (before it) for the order, gap and
    content-duplicate checks, and those of the grace after it for the order checks -- a retried
    batch of the window can land behind a batch stamped after the window's end (it lands within
    the delivery timeout, which grace covers), and the window must see that batch to flag it."""

    message_lo: datetime
    message_hi: datetime
    event_lo: datetime
    event_hi: datetime


def read_ranges(tc: TopicConfig, window_start: datetime) -> ReadRanges:
    lookback = tc.lookback_or_window
    window_end = window_start + tc.window
    return ReadRanges(window_start - lookback, window_end + tc.grace, window_start - lookback,
                      window_end + tc.grace + lookback)


def run_id_for(topic: str, window_start: datetime, as_of: datetime) -> str:
    """A stable hash of (topic, window_start, as_of): the same run gives the same id."""
    text = f"{topic}|{window_start.isoformat()}|{as_of.isoformat()}"
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:20]


def is_final(tc: TopicConfig, window_start: datetime, as_of: datetime) -> bool:
    """A window's report is final once as_of >= window end + grace (its counts no longer change)."""
    return as_of >= window_start + tc.window + tc.grace
