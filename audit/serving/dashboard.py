"""`msgaudit dashboard`: one self-contained HTML file from the report store.

It shows, per topic, a partitions x windows heatmap coloured by SLA status, the trend of lost /
duplicated / reordered messages, latency percentiles per stage, then the SLA results and the
anomaly rows down to pid / seq / offset. Plotly's JavaScript is inlined, so the file opens offline
and makes no network request (a Content-Security-Policy forbids any).

Strings in the report (pid, detail, stage... ultimately from message headers) are untrusted input:
every one is HTML-escaped before it reaches the page or a chart, and chart data is embedded as
JSON with `<`, `>` and `/` escaped. Scripts run only with the page's nonce.

This module only reads the report store (never the lake) and must not import pyspark.
"""

from __future__ import annotations

import argparse
import html
import secrets
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from audit.core.config import Config
from audit.core.errors import InputError
from audit.core.vocabulary import DUPLICATED, ERROR, FAIL, LOST, PASS, REORDERED, SLA_CHECK_STATUSES, WARN
from audit.core.windows import parse_instant
from audit.serving.report_store import ANOMALIES, PARTITION_REPORT, SLA_RESULTS, ReportStore

MAX_ANOMALY_ROWS = 2000
MAX_SLA_FAILURE_ROWS = 1000

# Heatmap cell status, worst first wins. `no_rules`: report rows exist but no SLA was checked.
STATUS_LEVELS = ("no_rules", *SLA_CHECK_STATUSES)
STATUS_COLOURS = ("#c8ccd2", "#2e9d57", "#f0a531", "#d43c3c")
TREND_METRICS = (LOST, DUPLICATED, REORDERED)
LATENCY_METRICS = ("latency_p50_ms", "latency_p95_ms", "latency_p99_ms")


def esc(value: Any) -> str:
    """Text for HTML and chart labels: None -> '', everything else escaped (quotes too)."""
    return "" if value is None else html.escape(str(value), quote=True)


def _g(value: float | None) -> str:
    return "-" if value is None else f"{value:g}"


def _ts(t: datetime) -> str:
    return t.astimezone(UTC).strftime("%Y-%m-%d %H:%M")


# ---------------------------------------------------------------------------------------------
# Data shaping (pure)
# ---------------------------------------------------------------------------------------------

def cell_status(sla_rows: Iterable[Mapping[str, Any]]) -> str:
    """Worst SLA status among the results of one (topic, partition, window): fail > warn > pass."""
    level = 0
    for r in sla_rows:
        level = max(level, STATUS_LEVELS.index(PASS if r["passed"] else FAIL if r["severity"] == ERROR else WARN))
    return STATUS_LEVELS[level]


def heatmap_data(topic: str, report: Sequence[Mapping[str, Any]], sla: Sequence[Mapping[str, Any]]
                 ) -> tuple[list[str], list[str], list[list[int | None]], list[list[str]]]:
    """(x window labels, y partition labels, z status levels, hover texts) for one topic."""
    rows = [r for r in report if r["topic"] == topic]
    windows = sorted({r["window_start"] for r in rows})
    partitions = sorted({r["partition"] for r in rows})
    present = {(r["partition"], r["window_start"]) for r in rows}
    by_cell: dict[tuple[int, datetime], list[Mapping[str, Any]]] = defaultdict(list)
    for s in sla:
        if s["topic"] == topic:
            by_cell[(s["partition"], s["window_start"])].append(s)
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
            results = by_cell.get((p, w), [])
            status = cell_status(results)
            z_row.append(STATUS_LEVELS.index(status))
            failed = [f"{esc(s['rule'])} @ {esc(s['stage'])} = {_g(s['observed'])} ({esc(s['severity'])})"
                      for s in results if not s["passed"]]
            t_row.append("<br>".join([f"{esc(topic)} p{p} · {_ts(w)} · {status}", *failed[:8]]))
        z.append(z_row)
        text.append(t_row)
    return [_ts(w) for w in windows], [f"p{p}" for p in partitions], z, text


def trend_data(topic: str, report: Sequence[Mapping[str, Any]]) -> tuple[list[str], dict[str, list[int]]]:
    """Per window of a topic: lost / duplicated / reordered summed over partitions and stages.

    Summing stages is right because every fault is reported once, at the stage where it happened."""
    sums: dict[datetime, dict[str, int]] = defaultdict(lambda: dict.fromkeys(TREND_METRICS, 0))
    for r in report:
        if r["topic"] == topic:
            for m in TREND_METRICS:
                sums[r["window_start"]][m] += int(r[m] or 0)
    windows = sorted(sums)
    return [_ts(w) for w in windows], {m: [sums[w][m] for w in windows] for m in TREND_METRICS}


def latency_data(topic: str, report: Sequence[Mapping[str, Any]]
                 ) -> tuple[list[str], dict[tuple[str, str], list[float | None]]]:
    """Per window of a topic, per (stage, percentile): the worst partition's value (percentiles do not add)."""
    rows = [r for r in report if r["topic"] == topic]
    windows = sorted({r["window_start"] for r in rows})
    worst: dict[tuple[str, str], dict[datetime, float]] = defaultdict(dict)
    for r in rows:
        for m in LATENCY_METRICS:
            if r[m] is not None:
                cell = worst[(r["stage"], m)]
                cell[r["window_start"]] = max(cell.get(r["window_start"], float("-inf")), float(r[m]))
    series = {key: [cells.get(w) for w in windows] for key, cells in sorted(worst.items())}
    return [_ts(w) for w in windows], series


# ---------------------------------------------------------------------------------------------
# Figures
# ---------------------------------------------------------------------------------------------

def _figures(topic: str, report: Sequence[Mapping[str, Any]], sla: Sequence[Mapping[str, Any]]) -> list[tuple[str, Any]]:
    import plotly.graph_objects as go

    t = esc(topic)
    figs: list[tuple[str, Any]] = []
    x, y, z, text = heatmap_data(topic, report, sla)
    n = len(STATUS_LEVELS)
    # A stepped colour scale: each status level gets one solid band.
    scale = [[b, c] for i, c in enumerate(STATUS_COLOURS) for b in (i / n, (i + 1) / n)]
    heat = go.Figure(go.Heatmap(
        x=x, y=y, z=z, text=text, hoverinfo="text", zmin=-0.5, zmax=n - 0.5, colorscale=scale, xgap=2, ygap=2,
        colorbar={"tickvals": list(range(n)), "ticktext": list(STATUS_LEVELS), "title": {"text": "SLA"}},
    ))
    heat.update_layout(title={"text": f"SLA status by partition and window: {t}"}, xaxis={"type": "category"},
                       height=max(260, 60 + 28 * len(y)), margin={"l": 60, "r": 20, "t": 50, "b": 60})
    figs.append((f"heatmap-{topic}", heat))

    x, sums = trend_data(topic, report)
    trend = go.Figure([go.Scatter(x=x, y=v, name=m, mode="lines+markers") for m, v in sums.items()])
    trend.update_layout(title={"text": f"Lost / duplicated / reordered per window: {t}"}, height=320,
                        xaxis={"type": "category"}, yaxis={"title": {"text": "messages"}, "rangemode": "tozero"},
                        margin={"l": 60, "r": 20, "t": 50, "b": 60})
    figs.append((f"trend-{topic}", trend))

    x, series = latency_data(topic, report)
    lat = go.Figure([go.Scatter(x=x, y=v, name=f"{esc(stage)} {m.split('_')[1]}", mode="lines+markers")
                     for (stage, m), v in series.items()])
    lat.update_layout(title={"text": f"Latency percentiles (worst partition) per stage: {t}"}, height=340,
                      xaxis={"type": "category"}, yaxis={"title": {"text": "ms"}, "rangemode": "tozero"},
                      margin={"l": 60, "r": 20, "t": 50, "b": 60})
    figs.append((f"latency-{topic}", lat))
    return figs


# ---------------------------------------------------------------------------------------------
# HTML
# ---------------------------------------------------------------------------------------------

_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:0;background:#f5f6f8;color:#1d2330}
header{background:#1d2330;color:#fff;padding:16px 28px}header h1{margin:0;font-size:22px}
header p{margin:4px 0 0;color:#c8ccd2;font-size:13px}main{padding:12px 28px 40px}
section{background:#fff;border-radius:8px;padding:12px 16px;margin:16px 0;box-shadow:0 1px 2px #0002}
h2{font-size:17px;margin:6px 0 10px}.cards{display:flex;gap:12px;flex-wrap:wrap}
.card{background:#fff;border-radius:8px;padding:10px 16px;box-shadow:0 1px 2px #0002;min-width:120px}
.card b{display:block;font-size:22px}.card span{font-size:12px;color:#5b6373}
.card.bad b{color:#d43c3c}.card.warn b{color:#c77c00}
table{border-collapse:collapse;font-size:12px;width:100%}th,td{border-bottom:1px solid #e3e5e9;
padding:3px 6px;text-align:left;vertical-align:top}th{background:#eef0f3;position:sticky;top:0}
td.num{text-align:right;font-variant-numeric:tabular-nums}td.mono{font-family:ui-monospace,monospace;
word-break:break-all}tr.fail td.sev{color:#d43c3c;font-weight:600}tr.warn td.sev{color:#c77c00}
.scroll{max-height:520px;overflow:auto}.note{font-size:12px;color:#5b6373}
"""


def _table(headers: Sequence[str], rows: Iterable[tuple[str, Sequence[tuple[str, str]]]], table_id: str) -> str:
    """rows: (tr class, [(td class, already-escaped text)])."""
    head = "".join(f"<th>{esc(h)}</th>" for h in headers)
    body = "".join(
        f'<tr class="{cls}">' + "".join(f'<td class="{c}">{v}</td>' for c, v in cells) + "</tr>"
        for cls, cells in rows)
    return f'<div class="scroll"><table id="{table_id}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>'


def _num(v: Any) -> tuple[str, str]:
    if v is None:
        return ("num", "")
    if isinstance(v, float):
        return ("num", esc(f"{v:g}"))
    return ("num", esc(v))


def _sla_summary(sla: Sequence[Mapping[str, Any]]) -> str:
    groups: dict[tuple[str, str, str], list[Mapping[str, Any]]] = defaultdict(list)
    for r in sla:
        groups[(r["topic"], r["rule"], r["severity"])].append(r)
    rows = []
    for (topic, rule, severity), rs in sorted(groups.items()):
        failed = sum(1 for r in rs if not r["passed"])
        cls = (FAIL if severity == ERROR else WARN) if failed else PASS
        rows.append((cls, [("", esc(topic)), ("", esc(rule)), ("sev", esc(severity)), _num(len(rs)),
                           _num(failed), ("num", f"{100 * (len(rs) - failed) / len(rs):.1f}%")]))
    return _table(["topic", "rule", "severity", "checks", "failed", "pass rate"], rows, "sla-summary")


def _sla_failures(sla: Sequence[Mapping[str, Any]]) -> str:
    failures = [r for r in sla if not r["passed"]]
    shown = failures[:MAX_SLA_FAILURE_ROWS]
    rows = [(FAIL if r["severity"] == ERROR else WARN,
             [("", _ts(r["window_start"])), ("", esc(r["topic"])), _num(r["partition"]), ("mono", esc(r["stage"])),
              ("", esc(r["rule"])), _num(r["observed"]), _num(r["threshold"]), ("sev", esc(r["severity"]))])
            for r in shown]
    note = f'<p class="note">{len(failures)} failed checks' + (
        f", showing the first {len(shown)}" if len(shown) < len(failures) else "") + "</p>"
    return note + _table(["window", "topic", "partition", "stage", "rule", "observed", "threshold", "severity"],
                         rows, "sla-failures")


def _anomaly_table(anomalies: Sequence[Mapping[str, Any]]) -> str:
    # Newest windows first: what an on-call engineer looks at.
    ordered = sorted(anomalies, key=lambda r: r["window_start"], reverse=True)
    shown = ordered[:MAX_ANOMALY_ROWS]
    rows = [("anomaly", [("", _ts(r["window_start"])), ("", esc(r["topic"])), _num(r["partition"]),
                         ("mono", esc(r["stage"])), ("", esc(r["anomaly"])), ("mono", esc(r["pid"])),
                         _num(r["seq"]), _num(r["offset"]), ("mono", esc(r["detail"]))])
            for r in shown]
    note = f'<p class="note">{len(anomalies)} anomaly rows' + (
        f", showing the newest {len(shown)}" if len(shown) < len(anomalies) else "") + "</p>"
    return note + _table(["window", "topic", "partition", "stage", "anomaly", "pid", "seq", "offset", "detail"],
                         rows, "anomalies")


def _cards(report: Sequence[Mapping[str, Any]], anomalies: Sequence[Mapping[str, Any]],
           sla: Sequence[Mapping[str, Any]]) -> str:
    failed_err = sum(1 for r in sla if not r["passed"] and r["severity"] == ERROR)
    failed_warn = sum(1 for r in sla if not r["passed"] and r["severity"] == WARN)
    cards = [
        ("", len({r["topic"] for r in report}), "topics"),
        ("", len({(r["topic"], r["window_start"]) for r in report}), "topic windows"),
        ("bad" if any(r["lost"] for r in report) else "", sum(r["lost"] for r in report), "lost"),
        ("warn" if any(r["duplicated"] for r in report) else "", sum(r["duplicated"] for r in report), "duplicated"),
        ("warn" if any(r["reordered"] for r in report) else "", sum(r["reordered"] for r in report), "reordered"),
        ("", len(anomalies), "anomaly rows"),
        ("bad" if failed_err else "", failed_err, "SLA failures (error)"),
        ("warn" if failed_warn else "", failed_warn, "SLA failures (warn)"),
    ]
    return '<div class="cards" id="summary">' + "".join(
        f'<div class="card {c}"><b>{esc(v)}</b><span>{esc(label)}</span></div>' for c, v, label in cards) + "</div>"


def build_html(report: Sequence[Mapping[str, Any]], anomalies: Sequence[Mapping[str, Any]],
               sla: Sequence[Mapping[str, Any]], *, title: str = "msgaudit report",
               subtitle: str = "") -> str:
    """The whole page as a string (pure: rows in, HTML out)."""
    import plotly.io as pio
    from plotly.offline import get_plotlyjs

    nonce = secrets.token_urlsafe(16)
    topics = sorted({r["topic"] for r in report} | {r["topic"] for r in sla})
    sections: list[str] = []
    scripts: list[str] = []
    for topic in topics:
        parts = []
        for div_id, fig in _figures(topic, report, sla):
            safe_id = "fig-" + "".join(ch if ch.isalnum() or ch in "-_" else "_" for ch in div_id)
            parts.append(f'<div id="{safe_id}" class="plotly-graph-div" data-figure="{esc(div_id)}"></div>')
            # pio.to_json escapes <, > and / so no label can close the <script> element.
            scripts.append(f'Plotly.newPlot("{safe_id}", {pio.to_json(fig, validate=False)}, '
                           '{"displaylogo": false, "responsive": true});')
        sections.append(f'<section class="topic" data-topic="{esc(topic)}"><h2>Topic {esc(topic)}</h2>'
                        + "".join(parts) + "</section>")
    if not report:
        sections.append('<section><p class="note" id="empty">No report rows in this range: run '
                        "<code>msgaudit reconcile</code> first.</p></section>")
    csp = (f"default-src 'none'; script-src 'nonce-{nonce}'; style-src 'unsafe-inline'; "
           "img-src data: blob:; font-src data:")
    return "\n".join([
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f'<meta http-equiv="Content-Security-Policy" content="{csp}">',
        f"<title>{esc(title)}</title><style>{_CSS}</style>",
        f'<script nonce="{nonce}">{get_plotlyjs()}</script>',
        "</head><body>",
        f"<header><h1>{esc(title)}</h1><p>{esc(subtitle)}</p></header><main>",
        _cards(report, anomalies, sla),
        *sections,
        f'<section id="sla"><h2>SLA results</h2>{_sla_summary(sla)}{_sla_failures(sla)}</section>',
        f'<section id="anomaly-section"><h2>Anomalies</h2>{_anomaly_table(anomalies)}</section>',
        "</main>",
        f'<script nonce="{nonce}">{"".join(scripts)}</script>',
        "</body></html>",
    ])


def render(cfg_or_store: Config | ReportStore, out: Path, start: datetime | None = None,
           end: datetime | None = None) -> Path:
    """Write the dashboard of windows starting in [start, end) (default: everything) to `out`."""
    if start is not None and end is not None and end <= start:
        raise InputError(f"--end ({end.isoformat()}) must be after --start ({start.isoformat()})")
    own = not isinstance(cfg_or_store, ReportStore)
    store = ReportStore(cfg_or_store.report_store) if isinstance(cfg_or_store, Config) else cfg_or_store
    try:
        report = store.read(PARTITION_REPORT, start=start, end=end)
        anomalies = store.read(ANOMALIES, start=start, end=end)
        sla = store.read(SLA_RESULTS, start=start, end=end)
        source = store.url
    finally:
        if own:
            store.close()
    span = (f"{start.isoformat() if start else 'beginning'} .. {end.isoformat() if end else 'now'}")
    subtitle = (f"Report store {source} · windows {span} · generated "
                f"{datetime.now(UTC).strftime('%Y-%m-%d %H:%M:%S')} UTC")
    page = build_html(report, anomalies, sla, subtitle=subtitle)
    out = Path(out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(page, encoding="utf-8")
    except OSError as e:
        raise InputError(f"--out {out}: cannot write the dashboard: {e.strerror}") from None
    return out


def cli_dashboard(args: argparse.Namespace, cfg: Config) -> int:
    """`msgaudit dashboard --out FILE [--start --end]`."""
    start = parse_instant(args.start, "--start") if getattr(args, "start", None) else None
    end = parse_instant(args.end, "--end") if getattr(args, "end", None) else None
    path = render(cfg, Path(args.out), start, end)
    print(f"dashboard written to {path}")
    return 0
