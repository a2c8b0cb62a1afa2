"""Ground truth: what a lab scenario actually did, recorded by the scenario itself.

A scenario knows, without asking the audit, which anomalies it caused: the wire record of the
fault proxy says which batches the broker wrote and whose answer was lost; the scenario's own
delivery callbacks say where each message was acknowledged; a killed consumer leaves a marker
naming the batch it held; the scenario chose which record to poison and which transaction to
abort. `Truth` collects those facts as `Expected` rows, and `compare` checks the audit's
`audit_anomalies` rows against them exactly (as multisets: "one row per extra copy" rows can
repeat a key).

This module must not read the audit's tables or ledgers or use its classification code.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

# (stage, anomaly, partition, pid, seq, offset)
Key = tuple[str, str, int, str | None, int | None, int | None]


@dataclass(frozen=True, order=True)
class Expected:
    """One anomaly row the audit must report (the identifying columns of `audit_anomalies`)."""

    stage: str
    anomaly: str
    partition: int
    pid: str | None
    seq: int | None
    offset: int | None

    @property
    def key(self) -> Key:
        return (self.stage, self.anomaly, self.partition, self.pid, self.seq, self.offset)


def key_of(row: Mapping[str, Any]) -> Key:
    """The identifying columns of an `audit_anomalies` row (report store or Delta)."""
    seq = row.get("seq")
    off = row.get("offset")
    return (str(row["stage"]), str(row["anomaly"]), int(row["partition"]), row.get("pid"),
            None if seq is None else int(seq), None if off is None else int(off))


@dataclass
class Truth:
    """Expected anomaly rows per topic, plus the measured facts of the run (for the README table)."""

    scenario: str
    rows: dict[str, list[Expected]] = field(default_factory=dict)
    facts: dict[str, Any] = field(default_factory=dict)

    def expect(self, topic: str, stage: str, anomaly: str, partition: int, pid: str | None,
               seq: int | None, offset: int | None) -> None:
        self.rows.setdefault(topic, []).append(Expected(stage, anomaly, partition, pid, seq, offset))

    def topic(self, topic: str) -> None:
        """Declare an audited topic (possibly with no expected anomaly)."""
        self.rows.setdefault(topic, [])

    @property
    def topics(self) -> list[str]:
        return list(self.rows)

    def counts(self) -> dict[str, int]:
        """anomaly -> expected rows, over every topic."""
        c: Counter[str] = Counter(e.anomaly for rows in self.rows.values() for e in rows)
        return dict(sorted(c.items()))


@dataclass(frozen=True)
class Comparison:
    topic: str
    missing: tuple[Key, ...]  # expected, not reported (a miss)
    unexpected: tuple[Key, ...]  # reported, not expected (a false alarm)
    reported: int
    expected: int

    @property
    def exact(self) -> bool:
        return not self.missing and not self.unexpected

    def describe(self, limit: int = 10) -> str:
        if self.exact:
            return f"{self.topic}: audit == ground truth ({self.expected} rows)"
        parts = [f"{self.topic}: audit != ground truth (expected {self.expected}, reported {self.reported})"]
        for title, keys in (("missed by the audit", self.missing), ("false alarms", self.unexpected)):
            if keys:
                parts.append(f"  {title} ({len(keys)}):")
                parts.extend(f"    {k}" for k in keys[:limit])
                if len(keys) > limit:
                    parts.append(f"    ... {len(keys) - limit} more")
        return "\n".join(parts)


def compare(topic: str, expected: Iterable[Expected], reported: Iterable[Mapping[str, Any]]) -> Comparison:
    want = Counter(e.key for e in expected)
    got = Counter(key_of(r) for r in reported)
    return Comparison(topic, tuple(sorted((want - got).elements(), key=repr)),
                      tuple(sorted((got - want).elements(), key=repr)),
                      sum(got.values()), sum(want.values()))
