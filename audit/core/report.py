"""Report rows (`audit_partition_report`, docs/design.md §4/§5) from per-(stage, partition) unit counts and
anomaly counts: the bookkeeping shared by the oracle and the Spark reconciliation. The
classification is what the two implementations do independently; this only adds up its result,
with the totals each code counts in taken from the vocabulary.

Pure functions: no I/O, no pyspark, no wall clock.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from datetime import datetime
from typing import Any

from audit.core.config import TopicConfig
from audit.core.percentiles import latency_columns
from audit.core.vocabulary import (
    ANOMALIES,
    DUPLICATED,
    FINAL,
    LOST,
    PENDING,
    PROVISIONAL,
    REORDERED,
    codes_counting_in,
    stage_kind,
    stage_names,
)
from audit.core.windows import is_final, run_id_for


def stages_of(tc: TopicConfig) -> list[str]:
    """The topic's stages in report order: log, each group, each sink, each mirror."""
    return stage_names(tc.groups, [s.name for s in tc.sinks], [m.name for m in tc.mirrors])


def code_counts(anomalies: Iterable[Mapping[str, Any]]) -> dict[tuple[str, int], dict[str, int]]:
    """Anomaly rows -> (stage, partition) -> code -> number of rows."""
    out: dict[tuple[str, int], dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for a in anomalies:
        out[(a["stage"], a["partition"])][a["anomaly"]] += 1
    return out


def assemble_report(tc: TopicConfig, ws: datetime, as_of: datetime, known_partitions: Iterable[int],
                    stats: Mapping[tuple[str, int], Mapping[str, Any]],
                    codes: Mapping[tuple[str, int], Mapping[str, int]]) -> list[dict[str, Any]]:
    """Report rows from per-(stage, partition) unit counts + latencies (`stats`: expected, delivered,
    pending (log stage), latency_*_ms) and anomaly row counts (`codes`), one row per stage and
    partition known (watermarks) or seen in `stats` or `codes`. lost / duplicated / reordered /
    pending add up the codes the vocabulary counts in them; the stage's own code columns hold row
    counts (0 when none), other stages' code columns are NULL."""
    known = set(known_partitions)
    status = FINAL if is_final(tc, ws, as_of) else PROVISIONAL
    run_id = run_id_for(tc.name, ws, as_of)
    no_latency = latency_columns([])
    rows = []
    for stage in stages_of(tc):
        kind = stage_kind(stage)
        totals = {t: codes_counting_in(kind, t) for t in (LOST, DUPLICATED, REORDERED, PENDING)}
        parts = known | {p for (st, p) in stats if st == stage} | {p for (st, p) in codes if st == stage}
        for p in sorted(parts):
            c = stats.get((stage, p), {})
            cc = codes.get((stage, p), {})

            total = {t: sum(cc.get(code, 0) for code in codes_of) for t, codes_of in totals.items()}
            # the log stage has no pending code: its pending messages are counted from the units
            pending = int(c.get(PENDING, 0) or 0) if not totals[PENDING] else total[PENDING]
            row: dict[str, Any] = {
                "window_start": ws, "window_end": ws + tc.window, "topic": tc.name, "partition": p,
                "stage": stage, "expected": int(c.get("expected", 0) or 0),
                "delivered": int(c.get("delivered", 0) or 0),
                LOST: total[LOST], DUPLICATED: total[DUPLICATED], REORDERED: total[REORDERED],
                PENDING: pending, **{k: c.get(k, v) for k, v in no_latency.items()},
                "status": status, "run_id": run_id, "computed_at": as_of,
            }
            for a in ANOMALIES:  # a column two stage kinds share (dead_lettered) holds its own kind's count
                if a.report_column is not None and (a.stage_kind == kind or a.report_column not in row):
                    row[a.report_column] = cc.get(a.name, 0) if a.stage_kind == kind else None
            rows.append(row)
    return rows
