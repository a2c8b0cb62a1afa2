"""Failover of a consumer group to a MirrorMaker 2 copy (docs/design.md §5.5), in the group stage:
the rows a group declared in `mirrors[].failover_groups` consumed on the mirror's target copy
(`consumed_records.cluster` = the mirror) are judged with its source rows. The rules are the
oracle's (`audit/oracle.py`, `_failover` and the group stage), restated as DataFrame steps:

- `translate`: each target row with an audit identity (pid, seq) whose message has a committed
  copy in the visible source log is moved to that message's original copy (partition, offset):
  it is then a processing of the source record like any other (keeping its `cluster`), so a record
  processed on both clusters is `redelivered` (failover variant of the detail) and one processed
  on the target only is delivered;
- `failover_lookups`: per (topic, group), the failover instant F (the first visible target row),
  where the group resumed in each target partition (the lowest target offset it processed there,
  or its latest captured committed offset on the target, `mirror_group_offsets`, if lower) and
  the failover position of each source partition (one past the highest source offset whose first
  copy in the same partition lies below the resume offset); a record below it that the group never
  processed on either cluster is `missed` (classify.py, failover variant);
- `ignored_rows` / `ignored_x`: the other rows with a `cluster` (a group not declared for that
  mirror, or a cluster naming no mirror of the topic) are not used, but counted: X rows of kind
  'I' that the summary aggregation counts per (topic, group, cluster) for the run summary.

What the oracle shares with this module (`Failover`, the instant's text, the run summary's line
for ignored rows) lives in `audit/core/failover.py`.

This module must not read or write tables or spell out a detail text; it collects only small
per-partition aggregates to the driver (like the group offsets).
"""

from __future__ import annotations

from datetime import datetime

from pyspark.sql import Column, DataFrame, Window
from pyspark.sql import functions as F

from audit.core.failover import Failover
from audit.core.vocabulary import COMMITTED, PROCESSED
from spark_jobs.io.session import local_frame
from spark_jobs.reconcile.mirror import mirror_copies, source_units
from spark_jobs.reconcile.params import Shape
from spark_jobs.reconcile.sql import X_FIELDS


def declared(shape: Shape) -> list[tuple[str, str, str]]:
    """(topic, group, mirror) of every group declared to fail over to a mirror."""
    return [(tc.name, g, m.name) for tc in shape.topics for m in tc.mirrors for g in m.failover_groups]


def _is(topic: str, group: str, mirror: str) -> Column:
    return (F.col("topic") == topic) & (F.col("group") == group) & (F.col("cluster") == mirror)


def target_rows(consumed: DataFrame, shape: Shape) -> DataFrame | None:
    """The visible consumption rows of declared failover groups on their mirrors' target copies."""
    cond = _declared_on_mirror(shape)
    return None if cond is None else consumed.where(cond)


def _declared_on_mirror(shape: Shape) -> Column | None:
    pairs = declared(shape)
    if not pairs:
        return None
    cond = _is(*pairs[0])
    for p in pairs[1:]:
        cond = cond | _is(*p)
    return cond


def ignored_rows(consumed: DataFrame, shape: Shape) -> DataFrame:
    """The visible consumption rows read on a mirror that §5.5 leaves out of the judgement: their
    `cluster` names a mirror their group does not fail over to, or no mirror of the topic."""
    on_mirror = F.col("cluster").isNotNull()
    cond = _declared_on_mirror(shape)
    return consumed.where(on_mirror if cond is None else on_mirror & ~cond)


def ignored_x(rows: DataFrame) -> DataFrame:
    """`ignored_rows` as X rows of kind 'I' (stage = the group, anomaly = the cluster): the summary
    counts them per (topic, group, cluster) in the aggregation it already runs, no job of their own."""
    named = {"kind": F.lit("I"), "stage": F.col("group"), "anomaly": F.col("cluster")}
    return rows.select(*[F.col("topic") if n == "topic" else named[n].alias(n) if n in named
                         else F.lit(None).cast(t).alias(n) for n, t in X_FIELDS])


def translate(rows: DataFrame, ledger: DataFrame, log: DataFrame, shape: Shape, columns: list[str]) -> DataFrame:
    """Target rows (not `committed` ones) moved to their message's original source copy, per topic."""
    parts = []
    for topic in sorted({t for t, _, _ in declared(shape)}):
        one = F.col("topic") == topic
        units = source_units(ledger.where(one), log.where(one)).select("pid", "seq", "op", "oo")
        moved = (rows.where(one & (F.col("outcome") != COMMITTED) & F.col("pid").isNotNull() & F.col("seq").isNotNull())
                 .join(units, ["pid", "seq"]))
        parts.append(moved.withColumn("partition", F.col("op")).withColumn("offset", F.col("oo")).select(*columns))
    out = parts[0]
    for p in parts[1:]:
        out = out.unionByName(p)
    return out


def failover_lookups(rows: DataFrame, ledger: DataFrame, log: DataFrame, mirror_log: DataFrame | None,
                     mirror_group_offsets: DataFrame | None, shape: Shape, ws: datetime) -> dict[str, dict[str, Failover]]:
    """topic -> group -> its failover (only groups with target rows visible in the window)."""
    out: dict[str, dict[str, Failover]] = {}
    for tc in shape.topics:
        one = F.col("topic") == tc.name
        for m in tc.mirrors:
            for g in m.failover_groups:
                mine = rows.where(_is(tc.name, g, m.name))
                first = mine.agg(F.min("consume_ts")).first()
                if first is None or first[0] is None:
                    continue
                resume = {int(r[0]): int(r[1]) for r in mine.where(F.col("outcome") == PROCESSED)
                          .groupBy("partition").agg(F.min("offset")).collect()}
                if mirror_group_offsets is not None:
                    latest = Window.partitionBy("partition").orderBy(F.col("captured_at").desc())
                    for r in (mirror_group_offsets.where((F.col("mirror") == m.name) & (F.col("group") == g) & one)
                              .withColumn("_rn", F.row_number().over(latest)).where("_rn = 1")
                              .where(F.col("committed_offset").isNotNull()).collect()):
                        p, co = int(r["partition"]), int(r["committed_offset"])
                        resume[p] = min(resume.get(p, co), co)
                position: dict[int, int] = {}
                if resume and mirror_log is not None:
                    spark = rows.sparkSession
                    res = local_frame(spark, list(resume.items()), "partition int, resume bigint")
                    firsts = mirror_copies(mirror_log, tc, m, ws).where("k = 1").select("pid", "seq", "partition", "offset")
                    units = source_units(ledger.where(one), log.where(one))
                    position = {int(r[0]): int(r[1]) + 1 for r in (
                        firsts.join(F.broadcast(res), "partition").where(F.col("offset") < F.col("resume"))
                        .join(units, ["pid", "seq"]).where(F.col("op") == F.col("partition"))
                        .groupBy("op").agg(F.max("oo")).collect())}
                out.setdefault(tc.name, {})[g] = Failover(m.name, first[0], resume, position)
    return out
