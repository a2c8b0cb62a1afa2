"""A consumer group's failover to a MirrorMaker 2 copy (docs/design.md §5.5): what the oracle
(`audit/oracle.py`) and the Spark reconcile (`spark_jobs/reconcile/failover.py`) both need -- the
failover as a window sees it, how its instant is written, and the line that says which
consumption rows read on a mirror were left out of the judgement, and why.

Plain values and text only: no Spark, no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime

from audit.core.config import TopicConfig


@dataclass(frozen=True)
class Failover:
    """Group g's failover to mirror m as the window sees it."""

    mirror: str
    at: datetime  # F: the first visible consumption row of g on the target copy
    resume: dict[int, int]  # per target partition: the offset g resumed from on the target
    position: dict[int, int]  # per source partition: one past the highest source offset copied below it


def failover_instant(at: datetime) -> str:
    """The failover instant as the detail texts write it (UTC, microseconds); a naive datetime is UTC
    (the Spark session's time zone, spark_jobs/io/session.py)."""
    at = at.replace(tzinfo=UTC) if at.tzinfo is None else at.astimezone(UTC)
    return at.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def failover_pairs(tc: TopicConfig) -> set[tuple[str, str]]:
    """(mirror, group) of every group of the topic declared to fail over to one of its mirrors."""
    return {(m.name, g) for m in tc.mirrors for g in m.failover_groups}


def ignored_rows_line(tc: TopicConfig, group: str, cluster: str, n: int) -> str:
    """The one line that says `n` consumption rows of `group` read on `cluster` were ignored, and the fix."""
    rows = f"{n} consumption row{'' if n == 1 else 's'}"
    if any(m.name == cluster for m in tc.mirrors):
        return (f"ignored {rows} of group {group!r} read on mirror {cluster!r} (not in its failover_groups): "
                f"add {group!r} to mirrors[{cluster}].failover_groups, or drop the cluster setting")
    names = ", ".join(repr(m.name) for m in tc.mirrors) or "none"
    return (f"ignored {rows} of group {group!r} read on cluster {cluster!r} (no mirror of topic {tc.name!r} "
            f"has that name; its mirrors: {names}): name the mirror as configured under topics.{tc.name}.mirrors, "
            f"with {group!r} in its failover_groups, or drop the cluster setting")


def ignored_rows_lines(tc: TopicConfig, ignored: Mapping[tuple[str, str], int]) -> list[str]:
    """`ignored_rows_line` for every (group, cluster) with rows, in (group, cluster) order."""
    return [ignored_rows_line(tc, g, c, n) for (g, c), n in sorted(ignored.items()) if n]

