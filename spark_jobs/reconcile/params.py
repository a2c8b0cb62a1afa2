"""A window's constants for the classifier: the per-partition lookups collected from the small
tables (`collect_lookups`: captured offset ranges, highest log start, latest committed offsets)
and `window_params`, one row of times (micros) and literal maps that the transforms join to.

This module collects only what it is handed (rows already on the driver) and builds one tiny
DataFrame; it must not read tables or hold any rule deciding an anomaly code.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from audit.core.config import TopicConfig
from audit.core.failover import Failover, failover_instant
from spark_jobs.reconcile.sql import _q


@dataclass
class Lookups:
    """Small per-partition facts collected to the driver and inlined as literal maps."""

    coverage: dict[int, list[tuple[int, int]]]  # merged captured ranges, each within [log start, high watermark)
    max_lso: dict[int, int]
    committed: dict[str, dict[int, int | None]]  # group -> partition -> latest committed offset
    partitions: set[int]
    # group -> its failover to a mirror (mirror, at, resume, position)
    failover: dict[str, Failover] = field(default_factory=dict)


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
    """The constants of one topic's window (`batch_params` for a batch of one)."""
    return batch_params(spark, Shape((tc,)), ws, as_of, {tc.name: lk})


@dataclass(frozen=True)
class Shape:
    """The topics one plan classifies together (docs/design.md §5 per topic; one plan for all):
    each row of every tier carries its `topic`, and what differs between topics -- which groups
    and sinks a topic has, their stage names, its constants -- is looked up per row (literal maps
    keyed by topic, or the per-topic rows of `batch_params`), never compiled into the plan, so one
    plan (and one set of Spark jobs) serves any number of topics."""

    topics: tuple[TopicConfig, ...]

    @property
    def names(self) -> list[str]:
        return [t.name for t in self.topics]

    @property
    def max_groups(self) -> int:
        return max((len(t.groups) for t in self.topics), default=0)

    @property
    def max_sinks(self) -> int:
        return max((len(t.sinks) for t in self.topics), default=0)

    @staticmethod
    def _lookup_sql(entries: Mapping[str, int], key_sql: str) -> Any:
        """The int `entries` gives the row's `key_sql` (null when absent)."""
        if not entries:
            return F.lit(None).cast("int")
        pairs = ", ".join(f"{_q(k)}, {i}" for k, i in sorted(entries.items()))
        return F.expr(f"try_element_at(map({pairs}), {key_sql})")

    def _index_sql(self, pairs: Mapping[tuple[str, str], int], col: str) -> Any:
        return self._lookup_sql({f"{t}{SEP}{n}": i for (t, n), i in pairs.items()}, f"concat(topic, {_q(SEP)}, {col})")

    def topic_index(self) -> Any:
        """The row's topic's position in `topics` (`batch_params`' `ti`): a small int to key
        aggregations by instead of the name (a string key keeps Spark's hash aggregation off its
        fixed-width map); a literal for a plan of one topic."""
        if len(self.topics) == 1:
            return F.lit(0)
        return self._lookup_sql({t.name: i for i, t in enumerate(self.topics)}, "topic")

    def group_index(self) -> Any:
        """The row's group's position in its topic's `groups` (null: not a group of the topic)."""
        return self._index_sql({(t.name, g): i for t in self.topics for i, g in enumerate(t.groups)}, "`group`")

    def sink_index(self) -> Any:
        """The row's sink's position in its topic's `sinks` (a `sink` column: the sink's name)."""
        return self._index_sql({(t.name, s.name): i for t in self.topics for i, s in enumerate(t.sinks)}, "sink")


SEP = "/"  # never in a Kafka topic name ([a-zA-Z0-9._-])


def with_params(df: DataFrame, params: DataFrame, shape: Shape, *cols: str) -> DataFrame:
    """`df` (rows with a `topic`) with its topic's `cols` of `params` (`batch_params`; all of them
    when none are named), joined by the topic's index (`Shape.topic_index`), not its name: the
    broadcast join then looks up an int per row instead of hashing and comparing a string (with
    the aggregation keyed the same way, the local blocks' latency step alone took a third less
    time, docs/benchmarks.md). A row whose topic is not in the shape is dropped, as by a join on
    the name."""
    right = params.drop("topic") if not cols else params.select("ti", *cols)
    return df.withColumn("ti", shape.topic_index()).join(F.broadcast(right), "ti").drop("ti")


def batch_params(spark: SparkSession, shape: Shape, ws: datetime, as_of: datetime,
                 lookups: Mapping[str, Lookups]) -> DataFrame:
    """One row per topic of the window's constants (its position `ti` in the shape, times in
    micros, the lookup maps, how many groups and sinks the topic has and their stage names), as a
    local table (its broadcast runs no Spark job). Joined to the units by topic (`with_params`)
    instead of inlined as literals, so the generated code is the same for every window and every
    topic and Spark's codegen cache serves them."""
    from audit.core.vocabulary import group_stage, sink_stage

    ng = shape.max_groups
    rows = []
    for ti, tc in enumerate(shape.topics):
        lk = lookups[tc.name]
        # typed even when a partition has no interval (an empty capture): array() alone would be array<void>
        cov = _map_sql({p: "cast(array(" + ", ".join(f"named_struct('lo', {lo}L, 'hi', {hi}L)" for lo, hi in ivs)
                        + ") as array<struct<lo:bigint,hi:bigint>>)" for p, ivs in lk.coverage.items()},
                       "array<struct<lo:bigint,hi:bigint>>")
        lso = _map_sql({p: f"{v}L" for p, v in lk.max_lso.items()}, "bigint")
        vals = [_q(tc.name), f"{_micros(ws)}L", f"{_micros(ws + tc.window)}L", f"{_micros(as_of)}L",
                f"{tc.grace // timedelta(microseconds=1)}L", cov, lso]
        for gi in range(ng):
            g = tc.groups[gi] if gi < len(tc.groups) else None
            co = {} if g is None else lk.committed.get(g, {})
            vals.append(f"cast({_map_sql({p: ('cast(null as bigint)' if v is None else f'{v}L') for p, v in co.items()}, 'bigint')} as map<int,bigint>)")
            fo = None if g is None else lk.failover.get(g)
            for m in ((fo.position, fo.resume) if fo is not None else ({}, {})):
                vals.append(f"cast({_map_sql({p: f'{v}L' for p, v in m.items()}, 'bigint')} as map<int,bigint>)")
            vals += [f"cast({_q(fo.mirror) if fo else 'null'} as string)", f"cast({_q(failover_instant(fo.at)) if fo else 'null'} as string)"]
        vals += [str(ti), str(len(tc.groups)), str(len(tc.sinks)),
                 "cast(array(" + ", ".join(_q(group_stage(g)) for g in tc.groups) + ") as array<string>)",
                 "cast(array(" + ", ".join(_q(sink_stage(s.name)) for s in tc.sinks) + ") as array<string>)"]
        rows.append("(" + ", ".join(vals) + ")")
    names = ["topic", "ws_us", "we_us", "asof_us", "grace_us", "cov", "lso",
             *[n for i in range(ng) for n in (f"co{i}", f"fo{i}", f"fr{i}", f"fm{i}", f"fa{i}")],
             "ti", "n_groups", "n_sinks", "gst", "sst"]
    return spark.sql(f"SELECT * FROM VALUES {', '.join(rows)} AS params({', '.join(names)})")
