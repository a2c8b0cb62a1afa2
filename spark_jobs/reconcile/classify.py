"""The per-unit rules of docs/design.md §5 as Spark SQL: `classify` turns described units (the general
path) into X rows -- anomaly rows and per-stage facts --, `simple_latencies` gives the per-stage
latencies of the ordinary delivered messages of the typed path (all their facts say). The rules are the oracle's (`audit/oracle.py`);
codes, statuses, outcomes and detail texts come from `audit.core.vocabulary` through
`spark_jobs/reconcile/sql.py`, never as literals here.

`classification_sql` builds the SQL text alone (no Spark needed), so a test can read which codes
the classifier emits. This module must not read or write tables, collect rows, or hold the
checks that need neighbouring units (`order.py`).
"""

from __future__ import annotations

from collections.abc import Sequence

from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from audit.core.config import TopicConfig
from audit.core.vocabulary import (
    ACKED,
    CONSUME_FAILED,
    DEAD_LETTERED,
    FAILED,
    GROUP,
    LOG,
    PROCESSED,
    SINK,
    group_stage,
    sink_stage,
)
from spark_jobs.reconcile.params import Shape, with_params
from spark_jobs.reconcile.sql import _MIN, EMPTY_X, _a, _f, _opt, _q, anomaly_sql, code_sql, detail_sql

DUE = "(asof_us >= pt_us + grace_us)"
LOG_SQL = _q(LOG)


def simple_latencies(typed: DataFrame, params: DataFrame, shape: Shape) -> DataFrame:
    """(topic, si, partition, latency, n = 1) per stage of each simple unit of the window: an ordinary
    delivered message has no anomaly of its own, and at every stage of its topic it is expected
    and delivered, never pending, so its latency is all its facts say. `si` is the stage's index:
    0 the log, then the topic's `n_groups` groups, then its sinks in the typed columns' order
    (`with_stage_names` names them). Four narrow fields per row where an X row has thirteen. Every
    stage's partition is the acked one (`lp`: a simple unit's record is there; a unit of a clean
    block reaches the typed path without its log record, `blocks.split_by_block`)."""
    lats: list[tuple[str, str, str, str | None]] = [("0", "lp", "(lack - lpt) / 1000D", None)]
    lats += [(str(1 + i), "lp", f"(c{i}_ts - lpt) / 1000D", f"{i} < n_groups") for i in range(shape.max_groups)]
    lats += [(str(1 + shape.max_groups + i), "lp", f"(s{i}_ts - lpt) / 1000D", f"{i} < n_sinks")
             for i in range(shape.max_sinks)]
    # one generated row per stage, no array: a stage the topic lacks yields a null `si`, dropped
    cols = ", ".join(f"{si if cond is None else f'CASE WHEN {cond} THEN {si} END'}, cast({p} as int), cast({lat} as double)"
                     for si, p, lat, cond in lats)
    return (with_params(typed.where("simple"), params, shape, "ws_us", "we_us", "n_groups", "n_sinks")
            .where("lpt >= ws_us AND lpt < we_us")
            .select("topic", F.expr(f"stack({len(lats)}, {cols}) AS (si, partition, latency)"))
            .where("si IS NOT NULL").withColumn("n", F.lit(1).cast("bigint")))


def with_stage_names(df: DataFrame, params: DataFrame, shape: Shape) -> DataFrame:
    """`df` with its stage index `si` (`simple_latencies`) replaced by the stage's name, from its
    topic's row of `params` (`gst`, `sst`)."""
    name = F.expr(f"CASE WHEN si = 0 THEN {LOG_SQL} WHEN si <= {shape.max_groups} THEN try_element_at(gst, si) "
                  f"ELSE try_element_at(sst, si - {shape.max_groups}) END")
    return (df.join(F.broadcast(params.select("topic", "gst", "sst")), "topic")
            .withColumn("stage", name).drop("si", "gst", "sst"))


def _case(kind: str, branches: Sequence[tuple[str | None, str, dict[str, str]]]) -> tuple[str, str]:
    """(code SQL, detail SQL) choosing among codes of one stage kind: [(condition, code, detail
    expressions)], the last one's condition None (ELSE). A `variant` key in the expressions picks
    that variant of the code's detail template."""
    code, det = "CASE", "CASE"
    for cond, name, exprs in branches:
        head = " ELSE " if cond is None else f" WHEN {cond} THEN "
        code += head + code_sql(kind, name)
        fields = {k: v for k, v in exprs.items() if k != "variant"}
        det += head + detail_sql(kind, name, exprs.get("variant"), **fields)
    return code + " END", det + " END"


UNIT_FLAGS = {
    "acked_missing": f"status = {_q(ACKED)} AND size(copies) = 0",
    "covered": ("CASE WHEN acked_missing THEN coalesce(exists(try_element_at(cov, ack.partition), "
                "w -> w.lo <= ack.offset AND ack.offset < w.hi), false) ELSE false END"),
    "lost": f"acked_missing AND covered AND {DUE}",
    "unverif": "acked_missing AND NOT covered AND coalesce(try_element_at(lso, ack.partition), -1) > ack.offset",
}


def classification_sql(tc: TopicConfig) -> tuple[dict[str, str], str]:
    """The SQL of `classify`: (per-stage helper columns, the expression of a unit's X rows). It reads
    a described unit's columns plus `UNIT_FLAGS`."""
    per_stage: dict[str, str] = {}
    log_anoms = [
        _opt("lost", anomaly_sql(LOG_SQL, LOG, "lost_acked", "ack.partition", "pid", "seq", "ack.offset")),
        _opt("unverif", anomaly_sql(LOG_SQL, LOG, "unverifiable", "ack.partition", "pid", "seq", "ack.offset")),
        _opt(f"ktype = 0 AND status = {_q(FAILED)} AND orig IS NOT NULL",
             anomaly_sql(LOG_SQL, LOG, "ghost_write", "orig.partition", "pid", "seq", "orig.offset")),
        _opt("ktype = 0 AND status IS NULL AND orig IS NOT NULL",
             anomaly_sql(LOG_SQL, LOG, "unledgered", "orig.partition", "pid", "seq", "orig.offset")),
        "transform(extras, x -> " + anomaly_sql(LOG_SQL, LOG, "duplicate_in_log", "x.partition", "pid", "seq",
                                                "x.offset", orig_partition="orig.partition",
                                                orig_offset="orig.offset") + ")",
        "transform(filter(R2, x -> NOT (x.header_error IS NULL AND x.pid IS NOT NULL AND x.seq IS NOT NULL)), "
        "x -> " + anomaly_sql(LOG_SQL, LOG, "unaudited", "x.partition", "x.pid", "x.seq", "x.offset",
                              header_error="x.header_error") + ")",
        "transform(filter(R2, x -> NOT x.committed), x -> " + anomaly_sql(
            LOG_SQL, LOG, "aborted", "x.partition", "x.pid", "x.seq", "x.offset") + ")",
    ]
    facts = [_opt(f"ktype = 0 AND status = {_q(ACKED)}", _f(
        LOG_SQL, "ack.partition", "1", "CASE WHEN size(copies) > 0 THEN 1 ELSE 0 END",
        "CASE WHEN acked_missing AND NOT lost AND NOT unverif THEN 1 ELSE 0 END",
        "(unix_micros(ack.ack_ts) - unix_micros(ack.produce_ts)) / 1000D"))]

    for gi, g in enumerate(tc.groups):
        stage = _q(group_stage(g))
        gcol = f"_group{gi}"
        co = f"co{gi}"
        match = f"c.group = {_q(g)} AND c.partition = r.partition AND c.offset = r.offset"
        # a sink row from a sink g feeds is evidence that g processed the unit (exactly-once sinks
        # commit offsets with the rows; the consumption row may never have been flushed)
        fed = [s.name for s in tc.sinks if s.group == g]
        sunk = (f"exists(S, x -> x.sink IN ({', '.join(_q(name) for name in fed)}))" if fed else "false")
        per_stage[gcol] = (
            f"transform(R2, r -> named_struct('r', r, "
            f"'proc', array_sort(filter(C, c -> {match} AND c.outcome = {_q(PROCESSED)})), "
            f"'dead', exists(C, c -> {match} AND c.outcome = {_q(DEAD_LETTERED)}), "
            f"'fail', array_sort(filter(C, c -> {match} AND c.outcome = {_q(CONSUME_FAILED)})), 'sunk', {sunk}))")
        n = "size(x.proc)"
        committed = f"try_element_at({co}, x.r.partition)"
        unprocessed_code, unprocessed_detail = _case(GROUP, [
            ("x.dead", "dead_lettered", {}),
            (f"NOT {DUE}", "pending", {}),
            ("size(x.fail) > 0 AND element_at(x.fail, -1).error IS NOT NULL", "retry_overdue",
             {"variant": "error", "attempt": "element_at(x.fail, -1).attempt",
              "consumer": "element_at(x.fail, -1).consumer", "error": "element_at(x.fail, -1).error"}),
            ("size(x.fail) > 0", "retry_overdue", {"attempt": "element_at(x.fail, -1).attempt",
                                                   "consumer": "element_at(x.fail, -1).consumer"}),
            ("x.r.offset < coalesce(try_element_at(lso, x.r.partition), -1)", "expired_unconsumed", {}),
            (f"x.r.offset < {committed}", "missed", {"committed_offset": committed}),
            (f"x.r.offset < coalesce(try_element_at(fo{gi}, x.r.partition), -1)", "missed",
             {"variant": "failover", "mirror": f"fm{gi}", "failover_at": f"fa{gi}",
              "resume_offset": f"try_element_at(fr{gi}, x.r.partition)"}),
            (None, "overdue", {}),
        ])
        per_record = ", ".join([
            _opt(f"NOT x.r.committed AND {n} > 0", anomaly_sql(stage, GROUP, "aborted_read", "x.r.partition",
                                                             "x.r.pid", "x.r.seq", "x.r.offset")),
            f"CASE WHEN x.r.committed AND {n} > 1 THEN transform(slice(x.proc, 2, {n} - 1), (c, i) -> "
            + "CASE WHEN c.cluster IS NULL THEN "
            + anomaly_sql(stage, GROUP, "redelivered", "x.r.partition", "x.r.pid", "x.r.seq", "x.r.offset",
                          k="i + 2", n=n, consumer="c.consumer")
            + " ELSE " + anomaly_sql(stage, GROUP, "redelivered", "x.r.partition", "x.r.pid", "x.r.seq", "x.r.offset",
                                     "failover", k="i + 2", n=n, consumer="c.consumer", mirror="c.cluster",
                                     failover_at=f"fa{gi}")
            + f" END) ELSE {EMPTY_X} END",
            _opt("x.r.committed AND exists(x.proc, c -> c.reorder)",
                 anomaly_sql(stage, GROUP, "reordered_in_consumption", "x.r.partition", "x.r.pid", "x.r.seq",
                             "x.r.offset")),
            _opt(f"x.r.committed AND {n} = 0 AND (x.dead OR NOT x.sunk)",
                 _a(stage, unprocessed_code, "x.r.partition", "x.r.pid", "x.r.seq", "x.r.offset",
                    unprocessed_detail)),
        ])
        log_anoms.append(f"flatten(transform({gcol}, x -> concat({per_record})))")
        facts.append(f"transform(filter({gcol}, x -> x.r.committed), x -> " + _f(
            stage, "x.r.partition", "1", f"CASE WHEN {n} > 0 OR (NOT x.dead AND x.sunk) THEN 1 ELSE 0 END", "0",
            f"CASE WHEN {n} > 0 THEN (unix_micros(get(x.proc, 0).consume_ts) - pt_us) / 1000D END") + ")")

    for si, s in enumerate(tc.sinks):
        stage = _q(sink_stage(s.name))
        rows = f"filter(S, x -> x.sink = {_q(s.name)})"
        if s.group is None:
            expected = "true"
        else:
            expected = (f"exists(C, c -> c.group = {_q(s.group)} AND c.outcome = {_q(PROCESSED)} AND "
                        "exists(copies, r -> r.partition = c.partition AND r.offset = c.offset))")
        scol = f"_sink{si}"
        per_stage[scol] = (
            f"named_struct('rows', {rows}, 'exp', {expected}, 'sorted', array_sort(transform({rows}, x -> "
            f"named_struct('a', coalesce(unix_micros(x.sink_ts), {_MIN}L), 'b', coalesce(x.offset, {_MIN}L), "
            f"'c', coalesce(cast(x.partition as bigint), {_MIN}L), 'row', x))))")
        n = f"size({scol}.rows)"
        absent_code, absent_detail = _case(SINK, [(DUE, "missing_in_sink", {}), (None, "pending", {})])
        log_anoms += [
            f"CASE WHEN orig IS NULL THEN transform({scol}.rows, x -> "
            + anomaly_sql(stage, SINK, "unexpected_in_sink", "coalesce(x.partition, -1)", "x.pid", "x.seq",
                          "x.offset") + f") ELSE {EMPTY_X} END",
            f"CASE WHEN orig IS NOT NULL AND {n} > 1 THEN transform(slice({scol}.sorted, 2, {n} - 1), (x, i) -> "
            + anomaly_sql(stage, SINK, "duplicate_in_sink", "orig.partition", "pid", "seq", "x.row.offset",
                          k="i + 2", n=n) + f") ELSE {EMPTY_X} END",
            _opt(f"orig IS NOT NULL AND {scol}.exp AND {n} = 0",
                 _a(stage, absent_code, "orig.partition", "pid", "seq", "orig.offset", absent_detail)),
        ]
        facts.append(_opt("orig IS NOT NULL", _f(
            stage, "orig.partition", f"CASE WHEN {scol}.exp THEN 1 ELSE 0 END",
            f"CASE WHEN {scol}.exp AND {n} > 0 THEN 1 ELSE 0 END", "0",
            f"CASE WHEN {scol}.exp AND {n} > 0 THEN (unix_micros(array_min(transform({scol}.rows, "
            "x -> x.sink_ts))) - pt_us) / 1000D END")))

    return per_stage, f"concat({', '.join(log_anoms + facts)})"


def classify(units: DataFrame, shape: Shape) -> DataFrame:
    """Described units -> X rows: kind 'A' (one anomaly row) or 'F' (one unit's facts at a stage).
    The rules name a topic's groups and sinks, so topics whose rules read the same
    (`classification_sql`) share one expression; each other set is one more narrow branch over the
    same gathered units (no new shuffle)."""
    u = units.where("in_w")
    for name in ("acked_missing", "covered"):
        u = u.withColumn(name, F.expr(UNIT_FLAGS[name]))
    u = u.withColumns({name: F.expr(UNIT_FLAGS[name]) for name in ("lost", "unverif")})
    by_sql: dict[tuple[tuple[tuple[str, str], ...], str], list[str]] = {}
    for tc in shape.topics:
        per_stage, rows = classification_sql(tc)
        by_sql.setdefault((tuple(per_stage.items()), rows), []).append(tc.name)
    out = None
    for (per_stage_items, rows), names in by_sql.items():
        v = u if len(by_sql) == 1 else u.where(F.col("topic").isin(names))
        if per_stage_items:
            v = v.withColumns({name: F.expr(sql) for name, sql in per_stage_items})
        x = v.select(F.explode(F.expr(rows)).alias("x")).select("x.*")
        out = x if out is None else out.unionByName(x)
    assert out is not None, "a shape has at least one topic"
    return out
