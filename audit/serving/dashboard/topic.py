"""One page per topic (`topics/<name>.html`): partitions x windows, trends, latency per stage,
SLA results, anomaly counts per code with each code's likely cause and remedy (from the
vocabulary), and the anomaly rows.

Charts fit the data: with one window the trend and latency charts are bars, not a line through
one point. Every anomaly row has an id and data-topic / data-partition / data-offset / data-pid /
data-seq attributes, and links to its message's timeline (`timeline.py`) -- or, when the
dashboard was built without the lake, shows the `msgaudit trace` command that prints it.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from collections.abc import Callable
from datetime import datetime
from typing import Any

from audit.core.vocabulary import (
    ANOMALY_CODES_BY_STAGE,
    DUPLICATED,
    ERROR,
    FAIL,
    LOST,
    PASS,
    REORDERED,
    REPORT_CODE_COLUMNS,
    WARN,
    explanation,
    stage_kind,
)
from audit.serving.dashboard.data import MAX_SLA_FAILURE_ROWS, STATUS_LEVELS, TopicData
from audit.serving.dashboard.overview import status_colourscale
from audit.serving.dashboard.page import cards, esc, num, table, ts
from audit.serving.dashboard.timeline import MessageRef

# an anomaly row -> the href of its message's timeline (None: no timeline page for it)
TimelineHref = Callable[[dict[str, Any]], str | None]

TREND_METRICS = (LOST, DUPLICATED, REORDERED)
LATENCY_METRICS = ("latency_p50_ms", "latency_p95_ms", "latency_p99_ms")
_MARGIN = {"l": 60, "r": 20, "t": 40, "b": 70}


def _g(value: float | None) -> str:
    return "-" if value is None else f"{value:g}"


def _level(row: dict[str, Any]) -> int:
    return 1 if row["passed"] else 3 if row["severity"] == ERROR else 2


def heatmap_figure(d: TopicData) -> dict[str, Any]:
    """Partitions x windows; z = worst SLA level over the stages; hover = the failed rules."""
    windows = sorted({r["window_start"] for r in d.report} | {s["window_start"] for s in d.sla})
    partitions = sorted({r["partition"] for r in d.report} | {s["partition"] for s in d.sla})
    present = {(r["partition"], r["window_start"]) for r in d.report} | {(s["partition"], s["window_start"])
                                                                         for s in d.sla}
    sla_by: dict[tuple[int, datetime], list[dict[str, Any]]] = defaultdict(list)
    for s in d.sla:
        sla_by[(s["partition"], s["window_start"])].append(s)
    counts: dict[tuple[int, datetime], list[int]] = defaultdict(lambda: [0, 0, 0])
    for r in d.report:
        c = counts[(r["partition"], r["window_start"])]
        for i, m in enumerate(TREND_METRICS):
            c[i] += int(r[m] or 0)
    z: list[list[int | None]] = []
    text: list[list[str]] = []
    for p in partitions:
        z_row: list[int | None] = []
        t_row: list[str] = []
        for w in windows:
            if (p, w) not in present:
                z_row.append(None)
                t_row.append("")
                continue
            results = sla_by.get((p, w), [])
            level = max((_level(s) for s in results), default=0)
            lost, dup, reord = counts[(p, w)]
            failed = [f"{esc(s['rule'])} @ {esc(s['stage'])} = {_g(s['observed'])} ({esc(s['severity'])})"
                      for s in results if not s["passed"]]
            t_row.append("<br>".join([f"p{p} · {ts(w)} · <b>{STATUS_LEVELS[level]}</b>",
                                      f"lost {lost} · duplicated {dup} · reordered {reord}", *failed[:8]]))
            z_row.append(level)
        z.append(z_row)
        text.append(t_row)
    n = len(STATUS_LEVELS)
    trace = {"type": "heatmap", "x": [ts(w) for w in windows], "y": [f"p{p}" for p in partitions], "z": z,
             "text": text, "hoverinfo": "text", "zmin": -0.5, "zmax": n - 0.5, "colorscale": status_colourscale(),
             "xgap": 2, "ygap": 2,
             "colorbar": {"tickvals": list(range(n)), "ticktext": list(STATUS_LEVELS), "title": {"text": "SLA"}}}
    layout = {"height": max(320, 170 + 26 * len(partitions)), "margin": _MARGIN,
              "xaxis": {"type": "category", "automargin": True},
              "yaxis": {"type": "category", "autorange": "reversed", "automargin": True}}
    return {"data": [trace], "layout": layout}


def trend_figure(d: TopicData) -> dict[str, Any]:
    """Lost / duplicated / reordered per window, summed over partitions and stages (each fault is
    reported once, at the stage where it happened). One window: bars."""
    sums: dict[datetime, list[int]] = defaultdict(lambda: [0, 0, 0])
    for r in d.report:
        for i, m in enumerate(TREND_METRICS):
            sums[r["window_start"]][i] += int(r[m] or 0)
    windows = sorted(sums)
    x = [ts(w) for w in windows]
    single = len(windows) <= 1
    data = [{"type": "bar" if single else "scatter", "name": m, "x": x, "y": [sums[w][i] for w in windows],
             **({} if single else {"mode": "lines+markers"})} for i, m in enumerate(TREND_METRICS)]
    layout = {"title": {"text": "Lost / duplicated / reordered per window", "x": 0.01, "xanchor": "left"},
              "height": 320, "margin": _MARGIN, "xaxis": {"type": "category", "automargin": True}, "yaxis": {"title": {"text": "messages"}, "rangemode": "tozero"},
              "barmode": "group"}
    return {"data": data, "layout": layout}


def latency_figure(d: TopicData) -> dict[str, Any]:
    """Per stage and percentile, the worst partition's value per window (percentiles do not add).
    One window: grouped bars per stage."""
    windows = sorted({r["window_start"] for r in d.report})
    worst: dict[tuple[str, str], dict[datetime, float]] = defaultdict(dict)
    for r in d.report:
        for m in LATENCY_METRICS:
            if r[m] is not None:
                cell = worst[(r["stage"], m)]
                cell[r["window_start"]] = max(cell.get(r["window_start"], float("-inf")), float(r[m]))
    layout: dict[str, Any] = {"title": {"text": "Latency percentiles per stage (worst partition)", "x": 0.01,
                                        "xanchor": "left"}, "height": 320,
                              "margin": _MARGIN, "yaxis": {"title": {"text": "ms"}, "rangemode": "tozero"}}
    if len(windows) <= 1:
        stages = sorted({st for st, _ in worst})
        data = [{"type": "bar", "name": m.split("_")[1], "x": [esc(st) for st in stages],
                 "y": [next(iter(worst[(st, m)].values()), None) for st in stages]} for m in LATENCY_METRICS]
        layout.update(barmode="group", xaxis={"type": "category", "automargin": True})
    else:
        data = [{"type": "scatter", "mode": "lines+markers", "name": f"{esc(st)} {m.split('_')[1]}",
                 "x": [ts(w) for w in windows], "y": [cells.get(w) for w in windows]}
                for (st, m), cells in sorted(worst.items())]
        layout.update(xaxis={"type": "category", "automargin": True})
    return {"data": data, "layout": layout}


def _sla_tables(d: TopicData) -> str:
    groups: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for r in d.sla:
        groups[(r["rule"], r["severity"])].append(r)
    rows = []
    for (rule, severity), rs in sorted(groups.items()):
        failed = sum(1 for r in rs if not r["passed"])
        cls = (FAIL if severity == ERROR else WARN) if failed else PASS
        rows.append((cls, [("", esc(rule)), ("sev", esc(severity)), num(len(rs)), num(failed),
                           ("num", f"{100 * (len(rs) - failed) / len(rs):.1f}%")]))
    summary = table(["rule", "severity", "checks", "failed", "pass rate"], rows, "sla-summary")
    failures = [r for r in d.sla if not r["passed"]]
    failures.sort(key=lambda r: r["window_start"], reverse=True)
    shown = failures[:MAX_SLA_FAILURE_ROWS]
    frows = [(FAIL if r["severity"] == ERROR else WARN,
              [("", ts(r["window_start"])), num(r["partition"]), ("mono", esc(r["stage"])), ("", esc(r["rule"])),
               num(r["observed"]), num(r["threshold"]), ("sev", esc(r["severity"]))]) for r in shown]
    note = f'<p class="note">{len(failures)} failed checks' + (
        f", showing the newest {len(shown)}" if len(shown) < len(failures) else "") + "</p>"
    if not d.sla:
        return '<p class="note">No SLA rule was checked for this topic in this range.</p>'
    return summary + note + table(["window", "partition", "stage", "rule", "observed", "threshold", "severity"],
                                  frows, "sla-failures")


def _codes_table(d: TopicData) -> str:
    """Per stage and anomaly code: the report's counter and the anomaly rows stored, in vocabulary order."""
    counters: dict[tuple[str, str], int] = defaultdict(int)
    for r in d.report:
        for code in (*REPORT_CODE_COLUMNS, "pending"):
            v = r.get(code)
            if v:
                counters[(r["stage"], code)] += int(v)
    rows_by: dict[tuple[str, str], int] = {(st, code): n for st, code, n in d.anomaly_counts}
    keys = set(counters) | set(rows_by)

    def order(key: tuple[str, str]) -> tuple[Any, ...]:
        st, code = key
        codes = ANOMALY_CODES_BY_STAGE.get(stage_kind(st), ())
        return (st, codes.index(code) if code in codes else len(codes), code)

    def why(st: str, code: str) -> list[tuple[str, str]]:
        try:
            e = explanation(stage_kind(st), code)
        except KeyError:  # a code this version does not know (a report written by a newer msgaudit)
            return [("", ""), ("", "")]
        return [("", esc(e.cause)), ("", esc(e.remedy))]

    rows = [("", [("mono", esc(st)), ("", esc(code)), num(counters.get((st, code), 0) if code in (
        *REPORT_CODE_COLUMNS, "pending") else None), num(rows_by.get((st, code), 0)), *why(st, code)])
            for st, code in sorted(keys, key=order)]
    if not rows:
        return '<p class="note">No anomaly in this range.</p>'
    return table(["stage", "code", "report count", "anomaly rows", "likely cause", "remedy"], rows, "codes")


def anomaly_row_id(row: dict[str, Any]) -> str:
    """A stable HTML id for a message's anomaly row: partition, offset, seq and a digest of the pid."""
    pid_digest = hashlib.sha1(str(row["pid"]).encode("utf-8")).hexdigest()[:8] if row["pid"] is not None else "x"
    off = "x" if row["offset"] is None else row["offset"]
    seq = "x" if row["seq"] is None else row["seq"]
    return f"m-p{row['partition']}-o{off}-s{seq}-{pid_digest}"


def _timeline_cell(d: TopicData, row: dict[str, Any], timeline_href: TimelineHref | None) -> tuple[str, str]:
    """A link to the message's timeline page, or (no lake access) the trace command that prints it."""
    href = timeline_href(row) if timeline_href else None
    if href is not None:
        return ("", f'<a class="timeline" href="{esc(href)}">timeline</a>')
    ref = MessageRef.of(d.topic, row)
    return ("mono", "" if ref is None else f'<code title="prints the timeline of this message">{esc(ref.command())}</code>')


def _anomaly_table(d: TopicData, timeline_href: TimelineHref | None = None) -> str:
    rows = []
    attrs = []
    used: dict[str, int] = {}
    for r in d.anomalies:
        base = anomaly_row_id(r)
        used[base] = used.get(base, 0) + 1
        rid = base if used[base] == 1 else f"{base}-{used[base]}"
        rows.append(("anomaly", [("", ts(r["window_start"])), num(r["partition"]), ("mono", esc(r["stage"])),
                                 ("", esc(r["anomaly"])), ("mono", esc(r["pid"])), num(r["seq"]), num(r["offset"]),
                                 ("mono", esc(r["detail"])), ("", f'<a href="#{rid}" title="link to this row">#</a>'),
                                 _timeline_cell(d, r, timeline_href)]))
        attrs.append(f'id="{rid}" data-topic="{esc(d.topic)}" data-partition="{r["partition"]}" '
                     f'data-offset="{esc(r["offset"])}" data-pid="{esc(r["pid"])}" data-seq="{esc(r["seq"])}"')
    shown = len(d.anomalies)
    note = f'<p class="note">{d.anomaly_total} anomaly rows' + (
        f", showing the newest {shown}" if shown < d.anomaly_total else "") + "</p>"
    return note + table(["window", "partition", "stage", "anomaly", "pid", "seq", "offset", "detail", "link", "timeline"],
                        rows, "anomalies", attrs)


def topic_page(d: TopicData, timeline_href: TimelineHref | None = None) -> tuple[list[str], list[tuple[str, dict[str, Any]]]]:
    """(body sections, figures) of one topic's page."""
    rep = d.report
    lost, dup, reord = (sum(int(r[m] or 0) for r in rep) for m in TREND_METRICS)
    errors = sum(1 for s in d.sla if not s["passed"] and s["severity"] == ERROR)
    warns = sum(1 for s in d.sla if not s["passed"] and s["severity"] == WARN)
    head = cards([("", len({r["window_start"] for r in rep}), "windows"),
                  ("", len({r["partition"] for r in rep}), "partitions"),
                  ("", len({r["stage"] for r in rep}), "stages"),
                  ("bad" if lost else "", lost, "lost"), ("warn" if dup else "", dup, "duplicated"),
                  ("warn" if reord else "", reord, "reordered"), ("", d.anomaly_total, "anomaly rows"),
                  ("bad" if errors else "", errors, "failed rules (error)"),
                  ("warn" if warns else "", warns, "failed rules (warn)")])
    body = [head,
            '<section><h2>SLA status by partition and window</h2><div id="fig-heatmap"></div></section>',
            '<section class="grid"><div id="fig-trend"></div><div id="fig-latency"></div></section>',
            f'<section id="sla"><h2>SLA results</h2>{_sla_tables(d)}</section>',
            f'<section id="code-section"><h2>Anomalies per code</h2>{_codes_table(d)}</section>',
            f'<section id="anomaly-section"><h2>Anomaly rows</h2>{_anomaly_table(d, timeline_href)}</section>']
    figures = [("fig-heatmap", heatmap_figure(d)), ("fig-trend", trend_figure(d)), ("fig-latency", latency_figure(d))]
    return body, figures
