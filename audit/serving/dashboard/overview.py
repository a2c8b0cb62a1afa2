"""The overview page (`index.html`): totals, the topics x windows SLA matrix, the ranked topics.

Its size grows with topics x windows only: every number on it is an SQL aggregate (see `data.py`).
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import Any

from audit.core.vocabulary import ERROR, FAIL, WARN
from audit.serving.dashboard.data import STATUS_LEVELS, Overview, TopicSummary
from audit.serving.dashboard.page import STATUS_COLOURS, cards, esc, js_json, num, table, ts

ROW_PX = 14  # matrix row height: 500 topics stay legible in one scrollable plot


def status_colourscale() -> list[list[Any]]:
    """A stepped colour scale over levels 0..3: each status gets one solid band."""
    n = len(STATUS_LEVELS)
    return [[b, c] for i, c in enumerate(STATUS_COLOURS) for b in (i / n, (i + 1) / n)]


def matrix_figure(ov: Overview) -> dict[str, Any]:
    """Topics (worst first, top to bottom) x windows; z = status level, hover = the cell's counts."""
    x = [ts(w) for w in ov.windows]
    y = [esc(t.topic) for t in ov.topics]
    z: list[list[int | None]] = []
    custom: list[list[list[Any] | None]] = []
    for t in ov.topics:
        z_row: list[int | None] = []
        c_row: list[list[Any] | None] = []
        for w in ov.windows:
            c = ov.cells.get((t.topic, w))
            if c is None:
                z_row.append(None)
                c_row.append(None)
                continue
            z_row.append(c.level)
            c_row.append([c.status, c.lost, c.duplicated, c.reordered, c.sla_errors, c.sla_warnings,
                          c.anomalies, esc(c.worst) or "-"])
        z.append(z_row)
        custom.append(c_row)
    n = len(STATUS_LEVELS)
    hover = ("<b>%{y}</b> · %{x}<br>status <b>%{customdata[0]}</b> · worst %{customdata[7]}<br>"
             "lost %{customdata[1]} · duplicated %{customdata[2]} · reordered %{customdata[3]}<br>"
             "failed rules: %{customdata[4]} error, %{customdata[5]} warn · anomaly rows %{customdata[6]}"
             "<extra></extra>")
    trace = {"type": "heatmap", "x": x, "y": y, "z": z, "customdata": custom, "hovertemplate": hover,
             "zmin": -0.5, "zmax": n - 0.5, "colorscale": status_colourscale(),
             "colorbar": {"tickvals": list(range(n)), "ticktext": list(STATUS_LEVELS), "title": {"text": "SLA"},
                          "len": min(1.0, 400 / max(1, ROW_PX * len(y))), "y": 1, "yanchor": "top"}}
    # Fixed margins and no cell gaps: with 24,000 cells, automargin passes and per-cell gaps cost
    # Plotly seconds; plain cells draw as one image.
    left = min(320, 16 + 6 * max((len(t.topic) for t in ov.topics), default=4))
    layout = {"height": max(260, 130 + ROW_PX * len(y)), "margin": {"l": left, "r": 10, "t": 110, "b": 20},
              "xaxis": {"type": "category", "side": "top", "tickangle": -45},
              "yaxis": {"type": "category", "autorange": "reversed", "tickfont": {"size": 10}},
              "plot_bgcolor": "#ffffff"}
    return {"data": [trace], "layout": layout}


def _ranking(ov: Overview, href: Callable[[str], str]) -> str:
    rows = []
    attrs = []
    for i, t in enumerate(ov.topics, 1):
        rows.append((t.status, [num(i), ("", f'<a href="{esc(href(t.topic))}">{esc(t.topic)}</a>'),
                                ("sev", f'<span class="dot s-{t.status}"></span>{t.status}'),
                                num(t.lost), num(t.duplicated), num(t.reordered), num(t.sla_errors),
                                num(t.sla_warnings), num(t.anomalies), num(t.bad_windows), num(t.windows),
                                ("", ts(t.first_bad) if t.first_bad else ""),
                                ("", ts(t.last_bad) if t.last_bad else "")]))
        attrs.append(f'data-topic="{esc(t.topic)}"')
    return table(["#", "topic", "status", "lost", "duplicated", "reordered", "failed rules (error)",
                  "failed rules (warn)", "anomaly rows", "bad windows", "windows", "first bad window",
                  "last bad window"], rows, "ranking", attrs, sortable=True)


def _cards(ov: Overview) -> str:
    t = ov.totals

    def cls(key: str, bad: str) -> str:
        return bad if t[key] else ""

    return cards([("", t["topics"], "topics"), ("", t["windows"], "windows"),
                  ("bad" if t["failing topics"] else "", t["failing topics"], "failing topics"),
                  (cls("lost", "bad"), t["lost"], "lost"), (cls("duplicated", "warn"), t["duplicated"], "duplicated"),
                  (cls("reordered", "warn"), t["reordered"], "reordered"), ("", t["anomaly rows"], "anomaly rows"),
                  (cls("SLA failures (error)", "bad"), t["SLA failures (error)"], "failed rules (error)"),
                  (cls("SLA failures (warn)", "warn"), t["SLA failures (warn)"], "failed rules (warn)")])


def risks_section(checked_at: datetime | None, risks: list[dict[str, Any]]) -> str:
    """The latest `msgaudit doctor` run's risks (from the report store), errors first."""
    if checked_at is None:
        return ('<section id="risks-section"><h2>Loss risks</h2><p class="note">No <code>msgaudit doctor</code> '
                "run stored yet.</p></section>")
    rows = [(FAIL if r["severity"] == ERROR else WARN,
             [("sev", esc(r["severity"])), ("", esc(r["topic"])), ("mono", esc(r["subject"])), ("", esc(r["risk"])),
              ("", esc(r["detail"]))]) for r in risks]
    note = (f'<p class="note">From the latest <code>msgaudit doctor</code> run, {ts(checked_at)} UTC: '
            f"{len(risks) or 'no'} risk(s).</p>")
    return ('<section id="risks-section"><h2>Loss risks</h2>' + note
            + (table(["severity", "topic", "subject", "risk", "detail"], rows, "risks") if rows else "") + "</section>")


def overview_page(ov: Overview, *, title: str, subtitle_html: str, href: Callable[[str], str],
                  risks: str = "") -> tuple[list[str], list[tuple[str, dict[str, Any]]], str]:
    """(body sections, figures, extra js) of index.html; `risks`: the loss-risk section's HTML."""
    if not ov.topics:
        return ([_cards(ov), '<section><p class="note" id="empty">No report rows in this range: run '
                 "<code>msgaudit reconcile</code> first.</p></section>", risks], [], "")
    legend = " ".join(f'<span class="dot s-{s}"></span>{s}' for s in STATUS_LEVELS)
    body = [
        _cards(ov),
        '<section id="matrix-section"><h2>SLA status, topics x windows (worst topics first)</h2>'
        f'<p class="note">Each cell: the worst failed rule of any partition and stage in that window ({legend}; '
        "blank: no report). Hover for the counts; click a row to open the topic.</p>"
        '<div class="scroll" style="max-height:75vh"><div id="matrix" class="plotly-graph-div"></div></div></section>',
        '<section id="ranking-section"><h2>Topics ranked, worst first</h2>'
        '<p class="note">Order: fail, warn, then lost, duplicated, reordered, failed rules, bad windows. '
        "Click a column header to sort by it.</p>" + _ranking(ov, href) + "</section>",
    ]
    if risks:
        body.insert(1, risks)
    links = [href(t.topic) for t in ov.topics]
    extra = ("var links=" + js_json(links) + ";document.addEventListener('dashboard-rendered',function(){"
             "var gd=document.getElementById('matrix');gd.on('plotly_click',function(ev){"
             "var p=ev.points&&ev.points[0];if(p){window.location.href=links[p.pointIndex[0]];}});});")
    return body, [("matrix", matrix_figure(ov))], extra


__all__ = ["overview_page", "matrix_figure", "TopicSummary"]
