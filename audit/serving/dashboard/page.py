"""The HTML frame every dashboard page shares: escaping, CSS, tables, cards and chart embedding.

Strings in the report (topic, pid, detail, stage... ultimately from message headers) are untrusted:
every one goes through `esc` before it reaches the page or a chart label, and chart data is
embedded as JSON with `<`, `>`, `&` and `/` escaped so no value can close the script element.
A Content-Security-Policy lets only scripts carrying the page's nonce run and forbids any request
except the shared local Plotly file.
"""

from __future__ import annotations

import functools
import html
import json
import secrets
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime
from typing import Any

STATUS_COLOURS = ("#c8ccd2", "#2e9d57", "#f0a531", "#d43c3c")  # no_rules, pass, warn, fail


def esc(value: Any) -> str:
    """Text for HTML, attributes and chart labels: None -> '', everything else escaped (quotes too)."""
    return "" if value is None else html.escape(str(value), quote=True)


@functools.lru_cache(maxsize=4096)
def ts(t: datetime) -> str:
    return t.astimezone(UTC).strftime("%Y-%m-%d %H:%M")


def js_json(value: Any) -> str:
    """JSON safe to place inside a <script> element."""
    return (json.dumps(value, separators=(",", ":"), allow_nan=False)
            .replace("&", "\\u0026").replace("<", "\\u003c").replace(">", "\\u003e").replace("/", "\\/"))


CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:0;background:#f5f6f8;color:#1d2330}
header{background:#1d2330;color:#fff;padding:14px 28px}header h1{margin:0;font-size:21px}
header p{margin:4px 0 0;color:#c8ccd2;font-size:13px}header a{color:#9cc3ff}main{padding:8px 28px 40px}
section{background:#fff;border-radius:8px;padding:12px 16px;margin:14px 0;box-shadow:0 1px 2px #0002}
h2{font-size:17px;margin:6px 0 10px}.cards{display:flex;gap:10px;flex-wrap:wrap;margin-top:14px}
.card{background:#fff;border-radius:8px;padding:8px 14px;box-shadow:0 1px 2px #0002;min-width:110px}
.card b{display:block;font-size:21px}.card span{font-size:12px;color:#5b6373}
.card.bad b{color:#d43c3c}.card.warn b{color:#c77c00}
table{border-collapse:collapse;font-size:12px;width:100%}th,td{border-bottom:1px solid #e3e5e9;
padding:3px 6px;text-align:left;vertical-align:top}th{background:#eef0f3;position:sticky;top:0}
th.sortable{cursor:pointer}td.num{text-align:right;font-variant-numeric:tabular-nums}
td.mono{font-family:ui-monospace,monospace;word-break:break-all}
tr.fail td.sev{color:#d43c3c;font-weight:600}tr.warn td.sev{color:#c77c00}
.dot{display:inline-block;width:10px;height:10px;border-radius:2px;margin-right:5px;vertical-align:-1px}
.s-no_rules{background:#c8ccd2}.s-pass{background:#2e9d57}.s-warn{background:#f0a531}.s-fail{background:#d43c3c}
.scroll{max-height:560px;overflow:auto}.note{font-size:12px;color:#5b6373}.grid{display:flex;gap:14px;flex-wrap:wrap}
.grid>div{flex:1 1 520px;min-width:0}:target{background:#fff3c4}
"""


def table(headers: Sequence[str], rows: Iterable[tuple[str, Sequence[tuple[str, str]]]], table_id: str,
          row_attrs: Sequence[str] | None = None, sortable: bool = False) -> str:
    """rows: (tr class, [(td class, already-escaped html)]); row_attrs: extra escaped attributes per row."""
    th_cls = ' class="sortable"' if sortable else ""
    head = "".join(f"<th{th_cls}>{esc(h)}</th>" for h in headers)
    body = []
    for i, (cls, cells) in enumerate(rows):
        extra = f" {row_attrs[i]}" if row_attrs else ""
        body.append(f'<tr class="{cls}"{extra}>' + "".join(f'<td class="{c}">{v}</td>' for c, v in cells) + "</tr>")
    return (f'<div class="scroll"><table id="{table_id}"><thead><tr>{head}</tr></thead>'
            f'<tbody>{"".join(body)}</tbody></table></div>')


def num(v: Any) -> tuple[str, str]:
    if v is None:
        return ("num", "")
    if isinstance(v, float):
        return ("num", esc(f"{v:g}"))
    return ("num", esc(v))


def cards(items: Sequence[tuple[str, Any, str]]) -> str:
    """(css class: '' | 'bad' | 'warn', value, label)."""
    return '<div class="cards" id="summary">' + "".join(
        f'<div class="card {c}"><b>{esc(v)}</b><span>{esc(label)}</span></div>' for c, v, label in items) + "</div>"


# Click a header to sort a `sortable` table by that column (numbers numerically, worst-first start).
SORT_JS = """
document.querySelectorAll("th.sortable").forEach(function(th){th.addEventListener("click",function(){
var tb=th.closest("table").tBodies[0],i=Array.prototype.indexOf.call(th.parentNode.children,th);
var d=th.dataset.dir==="asc"?"desc":"asc";th.dataset.dir=d;var rows=Array.from(tb.rows);
rows.sort(function(a,b){var x=a.cells[i].dataset.v||a.cells[i].textContent,y=b.cells[i].dataset.v||b.cells[i].textContent;
var nx=parseFloat(x),ny=parseFloat(y),c=(!isNaN(nx)&&!isNaN(ny))?nx-ny:x.localeCompare(y);return d==="asc"?c:-c;});
rows.forEach(function(r){tb.appendChild(r);});});});
"""


def document(*, title: str, subtitle_html: str, body: Sequence[str], figures: Sequence[tuple[str, dict[str, Any]]],
             asset_prefix: str, extra_js: str = "") -> str:
    """A whole page. figures: (div id, {"data": [...], "layout": {...}}), drawn after load; when all
    are drawn, <body> gets data-rendered-ms (time since navigation start) for tests and benchmarks."""
    from audit.serving.dashboard.assets import PLOTLY_JS

    nonce = secrets.token_urlsafe(16)
    csp = (f"default-src 'none'; script-src 'nonce-{nonce}'; style-src 'unsafe-inline'; "
           "img-src data: blob:; font-src data:")
    draw = ("var config={displaylogo:false,responsive:true};var figs=" + js_json(
        [{"id": fid, "data": f["data"], "layout": f["layout"]} for fid, f in figures]) + ";"
        "Promise.all(figs.map(function(f){return Plotly.newPlot(f.id,f.data,f.layout,config);}))"
        ".then(function(){document.body.setAttribute('data-rendered-ms',String(Math.round(performance.now())));"
        "document.dispatchEvent(new Event('dashboard-rendered'));});")
    return "\n".join([
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f'<meta http-equiv="Content-Security-Policy" content="{csp}">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>{esc(title)}</title><style>{CSS}</style>",
        f'<script nonce="{nonce}" src="{asset_prefix}{PLOTLY_JS}"></script>',
        "</head><body>",
        f"<header><h1>{esc(title)}</h1><p>{subtitle_html}</p></header><main>",
        *body,
        "</main>",
        f'<script nonce="{nonce}">{SORT_JS}{draw}{extra_js}</script>',
        "</body></html>",
    ])
