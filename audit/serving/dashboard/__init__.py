"""`msgaudit dashboard`: a folder of static pages from the report store.

    DIR/index.html              overview: totals, topics x windows SLA matrix, topics ranked worst first
    DIR/topics/<topic>.html     one page per topic: partitions x windows, trends, latency, SLA, anomalies
    DIR/assets/plotly.min.js    Plotly's JavaScript, written once and shared by every page

The pages need no network and no server (open index.html from disk, or serve DIR with any web
server). Every string from the report is escaped (see `page.py`). The overview is built from SQL
aggregates, so its size does not grow with the number of anomaly rows.

This package only reads the report store (never the lake) and must not import pyspark.
"""

from __future__ import annotations

import argparse
import hashlib
import re
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path

from audit.core.config import Config
from audit.core.errors import InputError
from audit.core.windows import parse_instant
from audit.serving.dashboard.assets import write_assets
from audit.serving.dashboard.data import Scope, overview_data, topics_data
from audit.serving.dashboard.overview import overview_page
from audit.serving.dashboard.page import document, esc
from audit.serving.dashboard.topic import topic_page
from audit.serving.report_store import ReportStore

TITLE = "msgaudit report"
TOPICS_DIR = "topics"

__all__ = ["render", "cli_dashboard", "topic_file", "Scope"]


def topic_file(topic: str) -> str:
    """File name of a topic's page: the name itself when it is a plain Kafka topic name, else a
    sanitised name plus a digest (so no topic can write outside topics/ or collide with another)."""
    if re.fullmatch(r"[A-Za-z0-9._-]{1,200}", topic) and topic not in (".", ".."):
        return f"{topic}.html"
    digest = hashlib.sha1(topic.encode("utf-8")).hexdigest()[:10]
    return f"{re.sub(r'[^A-Za-z0-9._-]', '_', topic)[:80]}-{digest}.html"


def _subtitle(source: str, scope: Scope, prefix: str = "") -> str:
    span = f"{scope.start.isoformat() if scope.start else 'beginning'} .. {scope.end.isoformat() if scope.end else 'now'}"
    generated = datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S")
    return (f"{prefix}Report store {esc(source)} · windows {esc(span)} · generated {generated} UTC")


def render(cfg_or_store: Config | ReportStore, out: Path, start: datetime | None = None,
           end: datetime | None = None, topics: Sequence[str] | None = None) -> Path:
    """Write the dashboard folder for windows starting in [start, end) and `topics` (default: all)
    to `out`; returns the path of its index.html."""
    scope = Scope(start, end, tuple(topics) if topics else None)
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise InputError(f"--out {out}: is a file; the dashboard is a folder of pages (e.g. --out dashboard)")
    own = not isinstance(cfg_or_store, ReportStore)
    store = ReportStore(cfg_or_store.report_store) if isinstance(cfg_or_store, Config) else cfg_or_store
    try:
        ov = overview_data(store, scope)
        missing = sorted(set(scope.topics or ()) - {t.topic for t in ov.topics})
        if missing:
            raise InputError(f"--topic {', '.join(missing)}: no report rows for this topic in the range "
                             "(check the name, --start and --end)")
        names = {t.topic: topic_file(t.topic) for t in ov.topics}
        try:
            (out / TOPICS_DIR).mkdir(parents=True, exist_ok=True)
            write_assets(out)
            body, figures, extra = overview_page(ov, title=TITLE, subtitle_html=_subtitle(store.url, scope),
                                                 href=lambda t: f"{TOPICS_DIR}/{names[t]}")
            index = out / "index.html"
            index.write_text(document(title=TITLE, subtitle_html=_subtitle(store.url, scope), body=body,
                                      figures=figures, asset_prefix="", extra_js=extra), encoding="utf-8")
            for data in topics_data(store, scope, list(names)):
                tbody, tfigures = topic_page(data)
                page = document(title=f"{TITLE}: {data.topic}", body=tbody, figures=tfigures, asset_prefix="../",
                                subtitle_html=_subtitle(store.url, scope, '<a href="../index.html">&larr; overview</a> · '))
                (out / TOPICS_DIR / names[data.topic]).write_text(page, encoding="utf-8")
            # Pages of topics no longer in range would be stale: the folder holds exactly this render.
            for old in (out / TOPICS_DIR).glob("*.html"):
                if old.name not in set(names.values()):
                    old.unlink()
        except OSError as e:
            raise InputError(f"--out {out}: cannot write the dashboard: {e.strerror}") from None
    finally:
        if own:
            store.close()
    return index


def cli_dashboard(args: argparse.Namespace, cfg: Config) -> int:
    """`msgaudit dashboard --out DIR [--topic T ...] [--start --end]`."""
    start = parse_instant(args.start, "--start") if getattr(args, "start", None) else None
    end = parse_instant(args.end, "--end") if getattr(args, "end", None) else None
    topics = getattr(args, "topics", None)
    path = render(cfg, Path(args.out), start, end, topics)
    print(f"dashboard written to {path}")
    return 0
