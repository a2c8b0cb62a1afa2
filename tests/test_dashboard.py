"""Dashboard: exact data behind each chart, escaping of untrusted strings, the CLI, and a real render
in headless Chromium (DOM checked for every plot and row; a screenshot is kept).

The Chromium test fails -- it never skips -- when Chromium is missing: install it with
`apt-get install -y chromium`. Set MSGAUDIT_UPDATE_SCREENSHOT=1 to copy its screenshot to
docs/dashboard.png.
"""

from __future__ import annotations

import os
import re
import shutil
import struct
import subprocess
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from audit import cli
from audit.core.errors import InputError
from audit.serving.dashboard import build_html, cell_status, heatmap_data, latency_data, render, trend_data
from audit.serving.report_store import ReportStore
from tests.test_report_store import anomaly_row, report_row, sla_row

W0 = datetime(2026, 11, 21, 6, tzinfo=UTC)
HOUR = timedelta(hours=1)
PAYLOAD_PID = "<script>document.title='pwned'</script>"
PAYLOAD_DETAIL = '<img src=x onerror="document.body.setAttribute(\'data-pwned\',\'yes\')">'
DOCS_PNG = Path(__file__).resolve().parent.parent / "docs" / "dashboard.png"


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
        store.replace_window("audit_partition_report", "orders", w, rows)
        store.replace_window("audit_anomalies", "orders", w, anomalies)
        store.replace_window("sla_results", "orders", w, sla)
        store.replace_window("audit_partition_report", "payments", w, [
            report_row(w, "payments", p, "log", expected=50, delivered=50, **lat(3, 5, 8 + p)) for p in range(2)])
    w3 = W0 + 3 * HOUR
    store.replace_window("audit_anomalies", "payments", w3, [
        anomaly_row(w3, "payments", 1, "log", "unaudited", PAYLOAD_PID, None, 42, detail=PAYLOAD_DETAIL)])
    return store


# ---- pure data shaping ---------------------------------------------------------------------------

@pytest.mark.unit
@pytest.mark.parametrize(("passed_severity", "status"), [
    ([], "no_rules"),
    ([(True, "error"), (True, "warn")], "pass"),
    ([(True, "error"), (False, "warn")], "warn"),
    ([(False, "warn"), (False, "error"), (True, "error")], "fail"),
])
def test_cell_status_is_the_worst(passed_severity: list[tuple[bool, str]], status: str) -> None:
    assert cell_status([{"passed": p, "severity": s} for p, s in passed_severity]) == status


@pytest.mark.unit
def test_heatmap_trend_and_latency_data() -> None:
    w1 = W0 + HOUR
    report = [report_row(W0, "orders", 0, "log", lost=1, **lat(1, 2, 3)),
              report_row(W0, "orders", 0, "group:g", duplicated=2, **lat(10, 20, 30)),
              report_row(W0, "orders", 1, "log", reordered=4, **lat(5, 6, 7)),
              report_row(w1, "orders", 0, "log", **lat(1, 1, 1)),
              report_row(W0, "other", 0, "log", lost=9)]
    sla = [sla_row(W0, "orders", 0, "log", "max_lost", 1, 0, False),
           sla_row(W0, "orders", 0, "group:g", "max_lost", 0, 0, True),
           sla_row(W0, "orders", 1, "log", "max_reordered", 4, 0, False, "warn"),
           sla_row(W0, "other", 0, "log", "max_lost", 9, 0, False)]
    x, y, z, text = heatmap_data("orders", report, sla)
    assert (x, y, z) == (["2026-11-21 06:00", "2026-11-21 07:00"], ["p0", "p1"], [[3, 0], [2, None]])
    assert text[0][0] == "orders p0 · 2026-11-21 06:00 · fail<br>max_lost @ log = 1 (error)"
    assert text[1] == ["orders p1 · 2026-11-21 06:00 · warn<br>max_reordered @ log = 4 (warn)", ""]

    assert trend_data("orders", report) == (["2026-11-21 06:00", "2026-11-21 07:00"],
                                            {"lost": [1, 0], "duplicated": [2, 0], "reordered": [4, 0]})
    x, series = latency_data("orders", report)
    assert series == {("group:g", "latency_p50_ms"): [10.0, None], ("group:g", "latency_p95_ms"): [20.0, None],
                      ("group:g", "latency_p99_ms"): [30.0, None], ("log", "latency_p50_ms"): [5.0, 1.0],
                      ("log", "latency_p95_ms"): [6.0, 1.0], ("log", "latency_p99_ms"): [7.0, 1.0]}


@pytest.mark.unit
def test_untrusted_strings_are_escaped_everywhere() -> None:
    stage = "sink:</script><script>alert(1)</script>"
    report = [report_row(W0, "orders", 0, stage, lost=1)]
    sla = [sla_row(W0, "orders", 0, stage, "max_lost", 1, 0, False)]
    anomalies = [anomaly_row(W0, "orders", 0, stage, "lost_acked", PAYLOAD_PID, 1, 2, PAYLOAD_DETAIL)]
    page = build_html(report, anomalies, sla)
    for raw in (PAYLOAD_PID, PAYLOAD_DETAIL, "<script>alert(1)", "<img src=x"):
        assert raw not in page
    assert "<td class=\"mono\">&lt;script&gt;document.title=&#x27;pwned&#x27;&lt;/script&gt;</td>" in page
    # Every <script> in the page is one of ours, carrying the page's nonce.
    nonce = re.search(r"script-src 'nonce-([^']+)'", page).group(1)  # type: ignore[union-attr]
    assert re.findall(r"<script[^>]*>", page) == [f'<script nonce="{nonce}">'] * 2


# ---- render and CLI -------------------------------------------------------------------------------

@pytest.mark.unit
def test_render_window_range_and_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "msgaudit.yaml").write_text("report_store: sqlite:///report.db\n")
    demo_store(f"sqlite:///{tmp_path / 'report.db'}").close()
    out = tmp_path / "out" / "report.html"
    code = cli.main(["dashboard", "--config", str(tmp_path / "msgaudit.yaml"), "--out", str(out),
                     "--start", "2026-11-21T08:00Z", "--end", "2026-11-21T10:00Z"])
    assert (code, capsys.readouterr().out) == (0, f"dashboard written to {out}\n")
    page = out.read_text(encoding="utf-8")
    # Windows 08:00 and 09:00 only: the 08:00 loss (2 rows) and the 09:00 unaudited record, nothing else.
    assert len(re.findall(r'<tr class="anomaly">', page)) == 3
    assert '<p class="note">3 anomaly rows</p>' in page
    assert "https://" not in page.split("<script", 1)[0]  # nothing fetched by the head
    assert 'id="fig-heatmap-orders"' in page and 'id="fig-latency-payments"' in page


@pytest.mark.unit
def test_empty_store_renders_a_hint(tmp_path: Path) -> None:
    out = render(ReportStore(f"sqlite:///{tmp_path / 'r.db'}"), tmp_path / "r.html")
    assert 'id="empty"' in out.read_text(encoding="utf-8")


@pytest.mark.unit
@pytest.mark.parametrize(("argv", "message"), [
    (["--start", "2026-11-21T10:00Z", "--end", "2026-11-21T09:00Z"], "must be after --start"),
    (["--start", "soon"], "--start: 'soon' is not an ISO 8601 time"),
    (["--out", "/proc/msgaudit/report.html"], "--out /proc/msgaudit/report.html: cannot write the dashboard"),
])
def test_cli_errors_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str],
                                 message: str) -> None:
    (tmp_path / "msgaudit.yaml").write_text("report_store: sqlite:///report.db\n")
    args = ["dashboard", "--config", str(tmp_path / "msgaudit.yaml"), "--out", str(tmp_path / "r.html"), *argv]
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("msgaudit dashboard: error: ") and message in err and err.count("\n") == 1


@pytest.mark.unit
def test_render_rejects_inverted_range(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="must be after --start"):
        render(ReportStore(f"sqlite:///{tmp_path / 'r.db'}"), tmp_path / "r.html", W0 + HOUR, W0)


# ---- headless Chromium ----------------------------------------------------------------------------

CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run", "--hide-scrollbars",
                  "--virtual-time-budget=15000"]


def chromium(tmp_path: Path, *args: str) -> str:
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        pytest.fail("chromium is not installed: apt-get update && apt-get install -y chromium")
    profile = tmp_path / f"profile-{len(list(tmp_path.glob('profile-*')))}"
    done = subprocess.run([exe, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *args],
                          capture_output=True, text=True, timeout=180, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def figure_dom(dom: str, fig_id: str) -> str:
    start = dom.index(f'id="{fig_id}"')
    nxt = dom.find('data-figure="', dom.index('data-figure="', start) + 1)
    return dom[start: nxt if nxt != -1 else len(dom)]


@pytest.mark.e2e
def test_dashboard_renders_in_headless_chromium(tmp_path: Path) -> None:
    out = render(demo_store(f"sqlite:///{tmp_path / 'report.db'}"), tmp_path / "report.html")
    url = out.resolve().as_uri()
    dom = chromium(tmp_path, "--dump-dom", url)

    # Plotly drew every figure: a heatmap image per topic, 3 trend lines, one line per (stage, percentile).
    for topic, stages in (("orders", 3), ("payments", 1)):
        heat = figure_dom(dom, f"fig-heatmap-{topic}")
        assert 'class="main-svg"' in heat and 'class="hm"' in heat and 'href="data:image/png' in heat
        assert len(re.findall(r'class="trace scatter ', figure_dom(dom, f"fig-trend-{topic}"))) == 3
        assert len(re.findall(r'class="trace scatter ', figure_dom(dom, f"fig-latency-{topic}"))) == 3 * stages
    legend = figure_dom(dom, "fig-latency-orders")
    assert {"sink:orders_table p99", "group:loader p50", "log p95"} <= set(re.findall(r'>([a-z_:]+ p\d\d)<', legend))
    # The heatmap colour bar names every status.
    assert re.findall(r'data-unformatted="(no_rules|pass|warn|fail)"', figure_dom(dom, "fig-heatmap-orders")) == [
        "no_rules", "pass", "warn", "fail"]

    # Every anomaly row, down to pid / seq / offset; the injected script is text, and did not run.
    rows = re.findall(r'<tr class="anomaly">(.*?)</tr>', dom)
    assert len(rows) == 2 + 6 + 1 + 1
    cells = [re.findall(r"<td[^>]*>(.*?)</td>", r) for r in rows]
    assert cells[0] == ["2026-11-21 12:00", "orders", "2", "log", "reordered_in_log", "orders-svc:2c", "3", "77", ""]
    assert ["2026-11-21 09:00", "payments", "1", "log", "unaudited", "&lt;script&gt;document.title='pwned'&lt;/script&gt;",
            "", "42", "&lt;img src=x onerror=\"document.body.setAttribute('data-pwned','yes')\"&gt;"] in cells
    assert "<title>msgaudit report</title>" in dom and 'data-pwned="yes"' not in dom
    # SLA results: one summary row per (topic, rule, severity) with its checks and failures.
    summary = re.findall(r"<tr class=\"(\w+)\"><td class=\"\">orders</td><td class=\"\">(\w+)</td>"
                         r"<td class=\"sev\">(\w+)</td><td class=\"num\">(\d+)</td><td class=\"num\">(\d+)</td>", dom)
    assert summary == [("fail", "max_lost", "error", "63", "1"),  # 7 final windows x 9; the 08:00 loss
                       ("pass", "max_lost", "warn", "9", "0"),  # the provisional window only warns
                       ("warn", "max_p99_latency_ms", "warn", "72", "12")]  # group from 13:00, sink from 11:00

    shot = tmp_path / "dashboard.png"
    chromium(tmp_path, "--window-size=1400,3000", f"--screenshot={shot}", url)
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and struct.unpack(">II", data[16:24]) == (1400, 3000)
    if os.environ.get("MSGAUDIT_UPDATE_SCREENSHOT") == "1":
        DOCS_PNG.parent.mkdir(exist_ok=True)
        shutil.copyfile(shot, DOCS_PNG)
