"""UTC window arithmetic shared by the CLI, the oracle and the Spark jobs (DESIGN §6)."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

from audit.core.errors import InputError

EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def parse_instant(text: str, what: str = "time") -> datetime:
    """ISO 8601 ('2026-11-21T10:00', '2026-11-21T10:00:00Z', '2026-11-21') or 'now' -> aware UTC."""
    if text == "now":
        return datetime.now(UTC)
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
