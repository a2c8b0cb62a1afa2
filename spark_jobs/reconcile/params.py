"""A window's constants for the classifier: the per-partition lookups collected from the small
tables (`collect_lookups`: captured offset ranges, highest log start, latest committed offsets)
and `window_params`, one row of times (micros) and literal maps that the transforms join to.

This module collects only what it is handed (rows already on the driver) and builds one tiny
DataFrame; it must not read tables or hold any rule deciding an anomaly code.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from audit.core.config import TopicConfig


@dataclass
class Lookups:
    """Small per-partition facts collected to the driver and inlined as literal maps."""

    coverage: dict[int, list[tuple[int, int]]]  # merged captured ranges, each within [log start, high watermark)
    max_lso: dict[int, int]
    committed: dict[str, dict[int, int | None]]  # group -> partition -> latest committed offset
    partitions: set[int]


def _micros(t: datetime) -> int:
    return (t - datetime(1970, 1, 1, tzinfo=UTC)) // timedelta(microseconds=1)


def collect_lookups(watermarks: Sequence[Mapping[str, Any]], group_offsets: Sequence[Mapping[str, Any]],
                    groups: Sequence[str], commits: Sequence[Mapping[str, Any]] = ()) -> Lookups:
    """Same semantics as the oracle: coverage by any capture, highest log start, latest commit
    (raised to the highest offset of the consumer interceptor's `committed` rows, `commits`:
    group, partition, offset)."""
    raw: dict[int, list[tuple[int, int]]] = {}
    max_lso: dict[int, int] = {}
    for w in watermarks:
        p = int(w["partition"])
        lo, hi = int(w["log_start_offset"]), int(w["high_watermark"])
        if w.get("captured_from") is not None:  # rows written before these columns: the whole log
            lo = max(lo, int(w["captured_from"]))
        if w.get("captured_to") is not None:
            hi = min(hi, int(w["captured_to"]))
        raw.setdefault(p, []).append((lo, hi))
        max_lso[p] = max(max_lso.get(p, int(w["log_start_offset"])), int(w["log_start_offset"]))
    coverage: dict[int, list[tuple[int, int]]] = {}
    for p, ivs in raw.items():
        merged: list[list[int]] = []
        for lo, hi in sorted(i for i in ivs if i[0] < i[1]):
            if merged and lo <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], hi)
            else:
                merged.append([lo, hi])
        coverage[p] = [(a, b) for a, b in merged]
    committed: dict[str, dict[int, int | None]] = {g: {} for g in groups}
    for go in sorted(group_offsets, key=lambda r: (r["captured_at"], -1 if r["committed_offset"] is None
                                                   else r["committed_offset"])):
        if go["group"] in committed:
            co = go["committed_offset"]
            committed[go["group"]][int(go["partition"])] = None if co is None else int(co)
    for c in commits:
        if c["group"] in committed:
            prev = committed[c["group"]].get(int(c["partition"]))
            committed[c["group"]][int(c["partition"])] = int(c["offset"]) if prev is None else max(prev, int(c["offset"]))
    return Lookups(coverage, max_lso, committed, set(max_lso))


def _map_sql(entries: Mapping[int, str], value_type: str) -> str:
    if not entries:
        return f"cast(null as map<int,{value_type}>)"
    return "map(" + ", ".join(f"{k}, {v}" for k, v in sorted(entries.items())) + ")"


def window_params(spark: SparkSession, tc: TopicConfig, ws: datetime, as_of: datetime, lk: Lookups) -> DataFrame:
    """One row of the window's constants (times in micros, the lookup maps). Joined to the units
    instead of inlined as literals, so the generated code is the same for every window of a topic
    and Spark's codegen cache serves later windows without recompiling."""
    # typed even when a partition has no interval (an empty capture): array() alone would be array<void>
    cov = _map_sql({p: "cast(array(" + ", ".join(f"named_struct('lo', {lo}L, 'hi', {hi}L)" for lo, hi in ivs)
                    + ") as array<struct<lo:bigint,hi:bigint>>)" for p, ivs in lk.coverage.items()},
                   "array<struct<lo:bigint,hi:bigint>>")
    lso = _map_sql({p: f"{v}L" for p, v in lk.max_lso.items()}, "bigint")
    cols = [F.lit(_micros(ws)).alias("ws_us"), F.lit(_micros(ws + tc.window)).alias("we_us"),
            F.lit(_micros(as_of)).alias("asof_us"), F.lit(tc.grace // timedelta(microseconds=1)).alias("grace_us"),
            F.expr(cov).alias("cov"), F.expr(lso).alias("lso")]
    for gi, g in enumerate(tc.groups):
        co = _map_sql({p: ("cast(null as bigint)" if v is None else f"{v}L")
                       for p, v in lk.committed.get(g, {}).items()}, "bigint")
        cols.append(F.expr(co).alias(f"co{gi}"))
    return spark.range(1).select(*cols)
