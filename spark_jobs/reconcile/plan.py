"""Planning a run: which topics are classified together (`Shape`, `batches`), where a window's
rules run (`engine`: the driver or Spark tasks, docs/design.md §5.8) and in how many chunks, and
what its Spark jobs are called. No DataFrame is read or written here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from audit.core.config import TopicConfig
from audit.core.windows import read_ranges

# At most this many topics share one batch: a window's Spark jobs are a handful per batch, whatever
# its topic count, and one plan's size (its union branches, its filters) stays bounded.
MAX_TOPICS_PER_PLAN = 64
# `reconcile.engine: auto` settles a batch whose inputs hold at most this many rows in the driver
# (collected as Arrow columns: about 350 bytes a row at the peak), a larger one in Spark tasks.
DRIVER_ROWS = 1_000_000
# A chunk (one Spark task) holds about this many input rows: about 1 GB of Arrow columns and numpy
# arrays in its Python worker at the peak (docs/internals.md).
CHUNK_ROWS = 3_000_000
# A batch is cut into one chunk per core only where each holds at least this many rows: a smaller one
# costs its Spark jobs more than the second core saves, and one chunk needs no passes of its own for
# the checks that need neighbours.
MIN_CHUNK_ROWS = 100_000


@dataclass(frozen=True)
class Shape:
    """The topics one batch classifies together: their windows share read ranges (`batches`), every
    row carries its `topic`, and the kernel settles each topic's rows apart."""

    topics: tuple[TopicConfig, ...]

    @property
    def names(self) -> list[str]:
        return [t.name for t in self.topics]

    @property
    def max_groups(self) -> int:
        return max((len(t.consuming_groups) for t in self.topics), default=0)

    @property
    def mirrored(self) -> list[str]:
        """The topics with mirrors: settled as one chunk each (their failover rules read the window)."""
        return [t.name for t in self.topics if t.mirrors]


def batches(topics: Sequence[TopicConfig], ws: datetime, cap: int = MAX_TOPICS_PER_PLAN) -> list[Shape]:
    """The topics of one window start, in batches classified together: topics with the same read
    ranges (window size, lookback, grace: docs/design.md §6.3), at most `cap` each."""
    by_range: dict[Any, list[TopicConfig]] = {}
    for tc in topics:
        by_range.setdefault(read_ranges(tc, ws), []).append(tc)
    return [Shape(tuple(tcs[i:i + cap])) for tcs in by_range.values() for i in range(0, len(tcs), cap)]


def chunk_count(rows: int, parallelism: int) -> int:
    """The chunks (Spark tasks) a batch of `rows` input rows is settled in: about CHUNK_ROWS rows each,
    at least one per core of the cluster, and a whole number of rounds of the cores (no core idle in
    the last), as far as each chunk still gets MIN_CHUNK_ROWS."""
    cores = max(1, parallelism)
    n = max(1, -(-rows // CHUNK_ROWS))
    return max(n, min(-(-n // cores) * cores, rows // MIN_CHUNK_ROWS))


def job_label(shape: Shape, ws: datetime) -> str:
    """What a window's Spark jobs are called in the Spark UI (`<label>: <step>`, `session.described`)."""
    names = shape.names
    who = names[0] if len(names) == 1 else f"{names[0]} and {len(names) - 1} more topics"
    return f"msgaudit reconcile {who} {ws.isoformat()}"
