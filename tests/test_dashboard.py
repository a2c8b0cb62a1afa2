"""Dashboard: the SQL aggregates behind the overview, the folder of pages, escaping of untrusted
strings, the CLI, and one headless Chromium session over a 500 topics x 48 windows report store.

The Chromium test fails -- it never skips -- when Chromium is missing: install it with
`apt-get install -y chromium`. Set MSGAUDIT_UPDATE_SCREENSHOT=1 to save its screenshot of the
500-topic overview to docs/dashboard-500-topics.png.
"""

from __future__ import annotations

import functools
import hashlib
import html
import http.server
import os
import re
import threading
import time
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from audit import cli
from audit.core.errors import InputError
from audit.core.vocabulary import explanation
from audit.serving.dashboard import render, topic_file
from audit.serving.dashboard.data import MAX_ANOMALY_ROWS, Cell, Scope, overview_data, topics_data
from audit.serving.report_store import ANOMALIES, PARTITION_REPORT, SLA_RESULTS, TABLES, ReportStore
from tests.support.browser import Browser
from tests.test_report_store import BACKENDS, anomaly_row, report_row, sla_row, store_url

W0 = datetime(2026, 11, 21, 6, tzinfo=UTC)
HOUR = timedelta(hours=1)
PAYLOAD_PID = "<script>document.title='pwned'</script>"
PAYLOAD_DETAIL = '<img src=x onerror="document.body.setAttribute(\'data-pwned\',\'yes\')">'
DOCS = Path(__file__).resolve().parent.parent / "docs"


def lat(p50: float, p95: float, p99: float) -> dict[str, float]:
    return {"latency_p50_ms": p50, "latency_p95_ms": p95, "latency_p99_ms": p99, "latency_max_ms": p99 * 1.5}


def demo_store(url: str) -> ReportStore:
    """Two topics over 8 hourly windows: orders (3 partitions, log + group + sink) with faults
    and a full SLA; payments (2 partitions, log only) with no SLA; one pid carries a script."""
    store = ReportStore(url)
    for i in range(8):
        w = W0 + i * HOUR
        status = "final" if i < 7 else "provisional"
        rows, anomalies, sla = [], [], []
        for p in range(3):
            lost = 2 if (i, p) == (2, 1) else 0
            dup = 3 if (i, p) in ((4, 0), (5, 0)) else 0
            reord = 1 if (i, p) == (6, 2) else 0
            rows.append(report_row(w, "orders", p, "log", expected=120, delivered=120 - lost, lost=lost,
                                   duplicated=dup, reordered=reord, status=status, **lat(4 + p, 9 + i, 15 + i)))
            rows.append(report_row(w, "orders", p, "group:loader", expected=120, delivered=120, status=status,
                                   **lat(40 + p, 90 + 5 * i, 150 + 40 * i)))
            rows.append(report_row(w, "orders", p, "sink:orders_table", expected=120, delivered=120,
                                   status=status, **lat(60 + p, 120 + 5 * i, 200 + 45 * i)))
            for stage in ("log", "group:loader", "sink:orders_table"):
                p99 = next(r["latency_p99_ms"] for r in rows if r["partition"] == p and r["stage"] == stage)
                severity = "error" if status == "final" else "warn"
                sla += [sla_row(w, "orders", p, stage, "max_lost", lost if stage == "log" else 0, 0,
                                not (stage == "log" and lost), severity),
                        sla_row(w, "orders", p, stage, "max_p99_latency_ms", p99, 400, p99 <= 400, "warn")]
            for k in range(lost):
                anomalies.append(anomaly_row(w, "orders", p, "log", "lost_acked", f"orders-svc:{p}a", 100 + k, 500 + k))
            for k in range(dup):
                anomalies.append(anomaly_row(w, "orders", p, "log", "duplicate_in_log", f"orders-svc:{p}b", 7 + k,
                                             900 + k, detail="copy at a later offset"))
            if reord:
                anomalies.append(anomaly_row(w, "orders", p, "log", "reordered_in_log", f"orders-svc:{p}c", 3, 77))
        store.replace_window(PARTITION_REPORT, "orders", w, rows)
        store.replace_window(ANOMALIES, "orders", w, anomalies)
        store.replace_window(SLA_RESULTS, "orders", w, sla)
        store.replace_window(PARTITION_REPORT, "payments", w, [
            report_row(w, "payments", p, "log", expected=50, delivered=50, **lat(3, 5, 8 + p)) for p in range(2)])
    w3 = W0 + 3 * HOUR
    store.replace_window(ANOMALIES, "payments", w3, [
        anomaly_row(w3, "payments", 1, "log", "unaudited", PAYLOAD_PID, None, 42, detail=PAYLOAD_DETAIL)])
    return store


def rows_of(page: str, table_id: str) -> list[list[str]]:
    """The cell texts (still HTML-escaped) of every body row of table `table_id`."""
    body = page.split(f'<table id="{table_id}">', 1)[1].split("</tbody>", 1)[0]
    return [re.findall(r"<td[^>]*>(.*?)</td>", tr) for tr in re.findall(r"<tr[^>]*>(.*?)</tr>", body)[1:]]


# ---- SQL aggregates -------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
def test_overview_aggregates(backend: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    store = demo_store(store_url(backend, request, tmp_path))
    ov = overview_data(store, Scope())
    assert ov.windows == [W0 + i * HOUR for i in range(8)]
    orders, payments = ov.topics
    # orders: the 08:00 loss failed an error rule; 12 latency warnings (group at 13:00, sink from 11:00).
    assert (orders.topic, orders.status, orders.lost, orders.duplicated, orders.reordered, orders.sla_errors,
            orders.sla_warnings, orders.anomalies, orders.windows) == ("orders", "fail", 2, 6, 1, 1, 12, 2 + 6 + 1, 8)
    # Bad windows: 08:00 (loss), 10:00 and 11:00 (duplicates, 11:00 sink latency), 12:00, 13:00.
    assert (orders.bad_windows, orders.first_bad, orders.last_bad) == (5, W0 + 2 * HOUR, W0 + 7 * HOUR)
    assert (payments.status, payments.lost, payments.anomalies, payments.bad_windows) == ("no_rules", 0, 1, 0)
    # 08:00: p1's log lost 2 -> fail; 10:00: p0 duplicated 3, every rule passed; 11:00: the three sink
    # partitions broke the latency rule (warn), p0 sorts first; 06:00 nothing wrong.
    assert ov.cells[("orders", W0 + 2 * HOUR)] == Cell(3, 2, 0, 0, 1, 0, 2, "p1 log")
    assert ov.cells[("orders", W0 + 4 * HOUR)] == Cell(1, 0, 3, 0, 0, 0, 3, "p0 log")
    assert ov.cells[("orders", W0 + 5 * HOUR)] == Cell(2, 0, 3, 0, 0, 3, 3, "p0 sink:orders_table")
    assert ov.cells[("orders", W0)] == Cell(1, 0, 0, 0, 0, 0, 0, "")
    assert ov.cells[("payments", W0 + 3 * HOUR)] == Cell(0, 0, 0, 0, 0, 0, 1, "")
    assert ov.totals == {"topics": 2, "windows": 8, "topic windows": 16, "lost": 2, "duplicated": 6, "reordered": 1,
                         "anomaly rows": 10, "SLA failures (error)": 1, "SLA failures (warn)": 12, "failing topics": 1}
    narrow = overview_data(store, Scope(W0 + 2 * HOUR, W0 + 4 * HOUR, ("orders",)))
    assert ([t.topic for t in narrow.topics], narrow.windows, narrow.totals["anomaly rows"]) == (
        ["orders"], [W0 + 2 * HOUR, W0 + 3 * HOUR], 2)
    # A topic page's data: its own rows only, anomalies newest first, counts per (stage, code).
    pages = {d.topic: d for d in topics_data(store, Scope(), ["payments", "orders"])}
    assert sorted(pages) == ["orders", "payments"]
    assert (len(pages["orders"].report), len(pages["orders"].sla), len(pages["payments"].report)) == (72, 144, 16)
    assert pages["orders"].anomaly_counts == [("log", "duplicate_in_log", 6), ("log", "lost_acked", 2),
                                              ("log", "reordered_in_log", 1)]
    assert [(a["window_start"], a["anomaly"], a["seq"]) for a in pages["orders"].anomalies][:3] == [
        (W0 + 6 * HOUR, "reordered_in_log", 3), (W0 + 5 * HOUR, "duplicate_in_log", 7),
        (W0 + 5 * HOUR, "duplicate_in_log", 8)]
    assert [a["pid"] for a in pages["payments"].anomalies] == [PAYLOAD_PID]
    store.close()


# ---- the folder, escaping, size --------------------------------------------------------------------

@pytest.mark.unit
def test_folder_pages_and_escaping(tmp_path: Path) -> None:
    store = demo_store(f"sqlite:///{tmp_path / 'r.db'}")
    evil = "evil<b>/../x"
    store.replace_window(PARTITION_REPORT, evil, W0, [report_row(W0, evil, 0, "sink:</script><script>alert(1)")])
    index = render(store, tmp_path / "out")
    out = tmp_path / "out"
    assert index == out / "index.html"
    files = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    assert files == ["assets/plotly.min.js", "index.html", f"topics/{topic_file(evil)}", "topics/orders.html",
                     "topics/payments.html"]
    assert topic_file(evil).startswith("evil_b__.._x-") and topic_file("orders") == "orders.html"
    pages = [p.read_text(encoding="utf-8") for p in (out / "index.html", *sorted((out / "topics").iterdir()))]
    for page in pages:
        for raw in (PAYLOAD_PID, PAYLOAD_DETAIL, "<script>alert(1)", "<img src=x", "evil<b>"):
            assert raw not in page
        nonce = re.search(r"script-src 'nonce-([^']+)'", page).group(1)  # type: ignore[union-attr]
        tags = re.findall(r"<script[^>]*>", page)
        assert tags[1:] == [f'<script nonce="{nonce}">'] and re.fullmatch(
            rf'<script nonce="{nonce}" src="(\.\./)?assets/plotly.min.js">', tags[0])
        assert "plotly.js v" not in page  # Plotly's 4 MB are written once, in assets/
    payments = (out / "topics" / "payments.html").read_text(encoding="utf-8")
    row_id = f"m-p1-o42-sx-{hashlib.sha1(PAYLOAD_PID.encode()).hexdigest()[:8]}"  # partition, offset, no seq, pid
    assert rows_of(payments, "anomalies") == [[
        "2026-11-21 09:00", "1", "log", "unaudited", "&lt;script&gt;document.title=&#x27;pwned&#x27;&lt;/script&gt;",
        "", "42", "&lt;img src=x onerror=&quot;document.body.setAttribute(&#x27;data-pwned&#x27;,&#x27;yes&#x27;)&quot;&gt;",
        f'<a href="#{row_id}" title="link to this row">#</a>',
        '<code title="prints the timeline of this message">msgaudit trace --topic payments --partition 1 --offset 42</code>']]
    assert (f'id="{row_id}" data-topic="payments" data-partition="1" data-offset="42" '
            'data-pid="&lt;script&gt;document.title=&#x27;pwned&#x27;&lt;/script&gt;" data-seq=""') in payments


@pytest.mark.unit
def test_overview_size_does_not_grow_with_anomaly_rows(tmp_path: Path) -> None:
    store = demo_store(f"sqlite:///{tmp_path / 'r.db'}")
    before = render(store, tmp_path / "a").read_text(encoding="utf-8")
    w = W0 + 6 * HOUR
    extra = [anomaly_row(w, "orders", 2, "group:loader", "redelivered", f"bulk-pid-{k}", k, 10_000 + k)
             for k in range(2500)]
    store.replace_window(ANOMALIES, "orders", w, [*store.read(ANOMALIES, "orders", w, w + HOUR), *extra])
    after = render(store, tmp_path / "b").read_text(encoding="utf-8")
    assert "bulk-pid-" not in after
    # Only numbers changed (10 -> 2510 rows in total, 1 -> 2501 in the 12:00 cell and ranking): a few bytes.
    assert 0 < len(after) - len(before) <= 16
    page = (tmp_path / "b" / "topics" / "orders.html").read_text(encoding="utf-8")
    # orders: 9 rows of its own + 2500.
    assert f'<p class="note">2509 anomaly rows, showing the newest {MAX_ANOMALY_ROWS}</p>' in page
    assert len(rows_of(page, "anomalies")) == MAX_ANOMALY_ROWS
    codes = rows_of(page, "codes")
    assert ["group:loader", "redelivered", "0", "2500"] in [r[:4] for r in codes]
    # each code carries its cause and remedy from the vocabulary
    why = explanation("group", "redelivered")
    assert [html.escape(why.cause), html.escape(why.remedy)] in [r[4:] for r in codes if r[1] == "redelivered"]


@pytest.mark.unit
def test_timelines_come_from_one_tracer_call(tmp_path: Path) -> None:
    """With a tracer, every anomaly row shown links to its message's section on the (topic, window)
    timeline page; all messages are traced in one call, each once. (The tracer here returns empty
    traces; the lake tracer is tested end to end in tests/test_trace.py.)"""
    from audit.serving.dashboard import MessageRef
    from audit.serving.dashboard.timeline import timeline_file
    from audit.serving.trace_view import format_timeline

    store = demo_store(f"sqlite:///{tmp_path / 'r.db'}")
    calls: list[list[MessageRef]] = []

    def trace(r: MessageRef) -> dict[str, object]:
        return {"topic": r.topic, "ids": [(r.pid, r.seq)] if r.pid else [],
                "positions": [] if r.pid else [(r.partition, r.offset)], "missing": [], "ledger": [], "log": [],
                "consumed": [], "anomalies": [], "sinks": {}}

    def tracer(refs: Sequence[MessageRef]) -> list[dict[str, object]]:
        calls.append(list(refs))
        return [trace(r) for r in refs]

    out = tmp_path / "out"
    render(store, out, tracer=tracer)
    # orders: lost 1a:100-101 (08:00), duplicates 0b:7-9 (10:00 and 11:00: the same messages), reordered
    # 2c:3 (12:00); payments: the unaudited record, by position.
    assert calls == [[MessageRef("orders", "orders-svc:0b", s) for s in (7, 8, 9)]
                     + [MessageRef("orders", "orders-svc:1a", s) for s in (100, 101)]
                     + [MessageRef("orders", "orders-svc:2c", 3), MessageRef("payments", partition=1, offset=42)]]
    files = {timeline_file(t, W0 + h * HOUR) for t, h in (("orders", 2), ("orders", 4), ("orders", 5),
                                                           ("orders", 6), ("payments", 3))}
    assert {p.name for p in (out / "timelines").iterdir()} == files
    orders = (out / "topics" / "orders.html").read_text(encoding="utf-8")
    digest = hashlib.sha1(b"orders-svc:2c").hexdigest()[:8]
    assert rows_of(orders, "anomalies")[0][9] == (
        f'<a class="timeline" href="../timelines/{timeline_file("orders", W0 + 6 * HOUR)}#m-p2-o77-s3-{digest}">'
        "timeline</a>")
    payments = (out / "timelines" / timeline_file("payments", W0 + 3 * HOUR)).read_text(encoding="utf-8")
    rid = f"m-p1-o42-sx-{hashlib.sha1(PAYLOAD_PID.encode()).hexdigest()[:8]}"
    ref = MessageRef("payments", partition=1, offset=42)
    assert (f'<section id="{rid}" class="timeline"><h2>p1@42</h2><p class="note"><code>'
            f"msgaudit trace --topic payments --partition 1 --offset 42</code></p>"
            f'<pre class="timeline">{html.escape(format_timeline(trace(ref)))}</pre></section>') in payments
    assert PAYLOAD_PID not in payments and len(re.findall(r"<script", payments)) == 2
    # Without a tracer the rows show the trace command, and no timeline page is left behind.
    render(store, out)
    assert list((out / "timelines").iterdir()) == []
    assert rows_of((out / "topics" / "orders.html").read_text(encoding="utf-8"), "anomalies")[0][9] == (
        '<code title="prints the timeline of this message">'
        "msgaudit trace --topic orders --pid orders-svc:2c --seq 3</code>")


# ---- CLI ---------------------------------------------------------------------------------------------

@pytest.mark.unit
def test_cli_range_and_topic(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "msgaudit.yaml").write_text("report_store: sqlite:///report.db\n")
    demo_store(f"sqlite:///{tmp_path / 'report.db'}").close()
    out = tmp_path / "dash"
    code = cli.main(["dashboard", "--config", str(tmp_path / "msgaudit.yaml"), "--out", str(out),
                     "--start", "2026-11-21T08:00Z", "--end", "2026-11-21T10:00Z"])
    assert (code, capsys.readouterr().out) == (0, f"dashboard written to {out / 'index.html'}\n")
    orders = (out / "topics" / "orders.html").read_text(encoding="utf-8")
    # Windows 08:00 and 09:00 only: the 08:00 loss (2 rows) and nothing else of orders.
    assert [r[:7] for r in rows_of(orders, "anomalies")] == [
        ["2026-11-21 08:00", "1", "log", "lost_acked", "orders-svc:1a", "100", "500"],
        ["2026-11-21 08:00", "1", "log", "lost_acked", "orders-svc:1a", "101", "501"]]
    assert [r[1] for r in rows_of((out / "index.html").read_text(encoding="utf-8"), "ranking")] == [
        '<a href="topics/orders.html">orders</a>', '<a href="topics/payments.html">payments</a>']
    code = cli.main(["dashboard", "--config", str(tmp_path / "msgaudit.yaml"), "--out", str(out), "--topic", "payments"])
    assert code == 0 and sorted(p.name for p in (out / "topics").iterdir()) == ["payments.html"]


@pytest.mark.unit
@pytest.mark.parametrize(("argv", "message"), [
    (["--start", "2026-11-21T10:00Z", "--end", "2026-11-21T09:00Z"], "must be after --start"),
    (["--start", "soon"], "--start: 'soon' is not an ISO 8601 time"),
    (["--out", "/proc/msgaudit/dash"], "--out /proc/msgaudit/dash: cannot write the dashboard"),
    (["--topic", "nope"], "--topic nope: no report rows for this topic in the range"),
    (["--out", "{tmp}/msgaudit.yaml"], "msgaudit.yaml: is a file; the dashboard is a folder of pages"),
])
def test_cli_errors_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str],
                                 message: str) -> None:
    (tmp_path / "msgaudit.yaml").write_text("report_store: sqlite:///report.db\n")
    demo_store(f"sqlite:///{tmp_path / 'report.db'}").close()
    args = ["dashboard", "--config", str(tmp_path / "msgaudit.yaml"), "--out", str(tmp_path / "d"),
            *[a.replace("{tmp}", str(tmp_path)) for a in argv]]
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("msgaudit dashboard: error: ") and message in err and err.count("\n") == 1


@pytest.mark.unit
def test_empty_store_renders_a_hint_and_inverted_range_fails(tmp_path: Path) -> None:
    store = ReportStore(f"sqlite:///{tmp_path / 'r.db'}")
    assert 'id="empty"' in render(store, tmp_path / "d").read_text(encoding="utf-8")
    with pytest.raises(InputError, match="must be after --start"):
        render(store, tmp_path / "d", W0 + HOUR, W0)


# ---- 500 topics x 48 windows in one headless Chromium ------------------------------------------------

N_TOPICS, N_WINDOWS = 500, 48
# (topic, window index, partition) -> (lost, duplicated, reordered). Topics t400-t499 have no SLA rules.
FAULTS = {("t123", 10, 1): (50, 0, 0), ("t250", 5, 0): (20, 0, 0), ("t250", 6, 1): (1, 0, 0),
          ("t042", 40, 0): (20, 0, 0), ("t042", 41, 0): (0, 5, 0), ("t300", 20, 1): (0, 30, 0),
          ("t450", 47, 0): (3, 0, 0), ("t007", 0, 1): (0, 0, 5)}
# Worst first: the three failing topics by lost, the warning, then lost / reordered without a failed rule.
WORST = ["t123", "t250", "t042", "t300", "t450", "t007"]
NEW_TOPIC = "t499"  # reported from window 24 on only; carries the scripted pid


def big_store(url: str) -> ReportStore:
    """500 topics x 48 hourly windows x 2 partitions, log stage; rules max_lost (error) and
    max_duplicated (warn) on t000-t399; the anomalies in FAULTS, one row per faulty message."""
    store = ReportStore(url)
    report, sla, anomalies = [], [], []
    for n in range(N_TOPICS):
        topic = f"t{n:03d}"
        for i in range(24 if topic == NEW_TOPIC else 0, N_WINDOWS):
            w = W0 + i * HOUR
            for p in range(2):
                lost, dup, reord = FAULTS.get((topic, i, p), (0, 0, 0))
                report.append(report_row(w, topic, p, "log", expected=100, delivered=100 - lost, lost=lost,
                                         duplicated=dup, reordered=reord, lost_acked=lost, duplicate_in_log=dup,
                                         reordered_in_log=reord, **lat(2, 4, 6 + p)))
                if n < 400:
                    sla += [sla_row(w, topic, p, "log", "max_lost", lost, 0, lost == 0, "error"),
                            sla_row(w, topic, p, "log", "max_duplicated", dup, 0, dup == 0, "warn")]
                for code, k in (("lost_acked", lost), ("duplicate_in_log", dup), ("reordered_in_log", reord)):
                    anomalies += [anomaly_row(w, topic, p, "log", code, f"{topic}-svc:{p}", 1000 * i + j, 50 * i + j)
                                  for j in range(k)]
    anomalies.append(anomaly_row(W0 + 30 * HOUR, NEW_TOPIC, 1, "log", "unaudited", PAYLOAD_PID, None, 42,
                                 detail=PAYLOAD_DETAIL))
    with store.engine.begin() as conn:
        for name, rows in ((PARTITION_REPORT, report), (SLA_RESULTS, sla), (ANOMALIES, anomalies)):
            conn.execute(TABLES[name].insert(), rows)
    return store


# Pixel colour at the centre of matrix cells (row, column), read back from the heatmap Plotly drew.
CELL_RGBA_JS = """(async (cells) => {
  const gd = document.getElementById('matrix');
  const img = gd.querySelector('.hm image');
  const im = new Image(); im.src = img.getAttribute('href') || img.getAttribute('xlink:href'); await im.decode();
  const c = document.createElement('canvas'); c.width = im.naturalWidth; c.height = im.naturalHeight;
  const ctx = c.getContext('2d'); ctx.drawImage(im, 0, 0);
  const nx = gd.data[0].x.length, ny = gd.data[0].y.length;
  return cells.map(([r, k]) => Array.from(ctx.getImageData(Math.floor((k + 0.5) / nx * c.width),
                                                           Math.floor((r + 0.5) / ny * c.height), 1, 1).data));
})"""
TABLE_ROWS_JS = """((id) => Array.from(document.querySelectorAll('#' + id + ' tbody tr'))
  .map(tr => Array.from(tr.cells).map(td => td.textContent)))"""
RGBA = {"fail": [212, 60, 60, 255], "warn": [240, 165, 49, 255], "pass": [46, 157, 87, 255],
        "no_rules": [200, 204, 210, 255], "blank": [0, 0, 0, 0]}


@pytest.mark.e2e
def test_500_topics_in_headless_chromium(tmp_path: Path) -> None:
    store = big_store(f"sqlite:///{tmp_path / 'report.db'}")
    t0 = time.monotonic()
    index = render(store, tmp_path / "dash")
    render_s = time.monotonic() - t0
    one = render(store, tmp_path / "one", W0 + 10 * HOUR, W0 + 11 * HOUR, ["t123"])
    assert len(list((tmp_path / "dash" / "topics").iterdir())) == N_TOPICS
    print(f"\nrender 500 topics x 48 windows: {render_s:.1f}s; index.html {index.stat().st_size / 1e6:.2f} MB")

    with Browser(tmp_path / "profile") as b:
        # Overview, opened from disk: drawn in a few seconds, nothing fetched but the page and its Plotly file.
        ms = b.open(index.resolve().as_uri())
        print(f"overview drawn {ms} ms after navigation start")
        assert ms < 15_000
        fetched = {u.split("/dash/", 1)[-1] for u in b.requests if not u.startswith(("data:", "blob:"))}
        assert fetched == {"index.html", "assets/plotly.min.js"}
        ranking = b.evaluate(TABLE_ROWS_JS + "('ranking')")
        assert len(ranking) == N_TOPICS
        assert [r[1] for r in ranking[:8]] == [*WORST, "t000", "t001"]
        assert [(r[2], r[3], r[4], r[5]) for r in ranking[:6]] == [
            ("fail", "50", "0", "0"), ("fail", "21", "0", "0"), ("fail", "20", "5", "0"), ("warn", "0", "30", "0"),
            ("no_rules", "3", "0", "0"), ("pass", "0", "0", "5")]
        assert b.evaluate("document.getElementById('matrix').data[0].y.slice(0, 6)") == WORST
        row = {t: i for i, t in enumerate(r[1] for r in ranking)}
        cells = {("t123", 10): "fail", ("t123", 11): "pass", ("t042", 40): "fail", ("t042", 41): "warn",
                 ("t300", 20): "warn", ("t450", 47): "no_rules", ("t000", 0): "pass", (NEW_TOPIC, 23): "blank",
                 (NEW_TOPIC, 24): "no_rules"}
        rgba = b.evaluate(CELL_RGBA_JS + f"({[[row[t], i] for t, i in cells]})")
        assert dict(zip(cells, rgba, strict=True)) == {k: RGBA[v] for k, v in cells.items()}
        # Hover gives the cell's counts and its worst partition and stage.
        assert b.evaluate("(() => {const gd = document.getElementById('matrix'); Plotly.Fx.hover(gd, {xval: 10, yval: 0});"
                          "return Array.from(gd.querySelectorAll('.hovertext')).map(e => e.textContent);})()") == [
            "t123 · 2026-11-21 16:00status fail · worst p1 loglost 50 · duplicated 0 · reordered 0"
            "failed rules: 1 error, 0 warn · anomaly rows 50"]

        # The new topic's page: its one anomaly row, the injected script shown as text and never run.
        b.open((tmp_path / "dash" / "topics" / f"{NEW_TOPIC}.html").resolve().as_uri())
        assert b.evaluate(TABLE_ROWS_JS + "('anomalies')") == [
            ["2026-11-22 12:00", "1", "log", "unaudited", PAYLOAD_PID, "", "42", PAYLOAD_DETAIL, "#",
             f"msgaudit trace --topic {NEW_TOPIC} --partition 1 --offset 42"]]
        assert b.evaluate("[document.title, document.body.getAttribute('data-pwned'), "
                          "document.querySelectorAll('script').length]") == [f"msgaudit report: {NEW_TOPIC}", None, 2]
        if os.environ.get("MSGAUDIT_UPDATE_SCREENSHOT") == "1":
            b.open(index.resolve().as_uri())
            b.screenshot(DOCS / "dashboard-500-topics.png")

        # t123's page, this time served by a plain web server: exactly its 50 lost messages, newest
        # first; trends over 48 windows are lines.
        handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path / "dash"))
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        try:
            base = f"http://127.0.0.1:{server.server_address[1]}"
            b.open(f"{base}/topics/t123.html")
            assert sorted(u for u in b.requests if not u.startswith(("data:", "blob:"))) == [
                f"{base}/assets/plotly.min.js", f"{base}/topics/t123.html"]
        finally:
            server.shutdown()
            server.server_close()
        assert b.evaluate(TABLE_ROWS_JS + "('anomalies')") == [
            ["2026-11-21 16:00", "1", "log", "lost_acked", "t123-svc:1", str(10_000 + j), str(500 + j), "", "#",
             f"msgaudit trace --topic t123 --pid t123-svc:1 --seq {10_000 + j}"] for j in range(50)]
        assert b.evaluate("document.getElementById('anomalies').tBodies[0].rows[3].id") == (
            f"m-p1-o503-s10003-{hashlib.sha1(b't123-svc:1').hexdigest()[:8]}")
        assert b.evaluate("['fig-trend', 'fig-latency'].map(id => document.getElementById(id).data"
                          ".map(t => t.type + ':' + t.x.length))") == [["scatter:48"] * 3, ["scatter:48"] * 3]
        # The same topic narrowed to one window (--topic, --start/--end): bars, not a line through one point.
        b.open((one.parent / "topics" / "t123.html").resolve().as_uri())
        assert b.evaluate("['fig-trend', 'fig-latency'].map(id => document.getElementById(id).data"
                          ".map(t => t.type + ':' + t.x.length))") == [["bar:1"] * 3, ["bar:1"] * 3]
        assert len(b.evaluate(TABLE_ROWS_JS + "('anomalies')")) == 50


@pytest.mark.unit
def test_overview_shows_the_latest_doctor_run(tmp_path: Path) -> None:
    store = demo_store(f"sqlite:///{tmp_path / 'r.db'}")
    assert "No <code>msgaudit doctor</code> run stored yet." in render(store, tmp_path / "a").read_text("utf-8")
    risk = {"topic": "orders", "subject": "topic", "risk": "min_insync_replicas", "severity": "error",
            "detail": "min.insync.replicas=1; set >= 2"}
    store.record_risks(W0, [risk, {**risk, "risk": "dlq_growing", "severity": "warn", "detail": PAYLOAD_DETAIL}])
    store.record_risks(W0 + HOUR, [risk])
    page = render(store, tmp_path / "b").read_text("utf-8")
    assert "From the latest <code>msgaudit doctor</code> run, 2026-11-21 07:00 UTC: 1 risk(s).</p>" in page
    assert rows_of(page, "risks") == [["error", "orders", "topic", "min_insync_replicas",
                                       "min.insync.replicas=1; set &gt;= 2"]]
    store.record_risks(W0 + 2 * HOUR, [])
    page = render(store, tmp_path / "c").read_text("utf-8")
    assert "run, 2026-11-21 08:00 UTC: no risk(s).</p>" in page and 'id="risks"' not in page
    store.record_risks(W0 + 3 * HOUR, [{**risk, "detail": PAYLOAD_DETAIL}])
    page = render(store, tmp_path / "d").read_text("utf-8")
    assert PAYLOAD_DETAIL not in page and rows_of(page, "risks")[0][4] == html.escape(PAYLOAD_DETAIL)
