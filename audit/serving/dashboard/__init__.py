"""`msgaudit dashboard`: a folder of static pages from the report store.

    DIR/index.html              overview: totals, topics x windows SLA matrix, topics ranked worst first
    DIR/topics/<topic>.html     one page per topic: partitions x windows, trends, latency, SLA, anomalies
    DIR/timelines/<topic>--<window>.html   the timeline of every message with an anomaly row shown
                                (one section per message, anchored by its row id; see timeline.py)
    DIR/assets/plotly.min.js    Plotly's JavaScript, written once and shared by every page

The pages need no network and no server (open index.html from disk, or serve DIR with any web
server). Every string from the report is escaped (see `page.py`). The overview is built from SQL
aggregates, so its size does not grow with the number of anomaly rows.

This package only reads the report store (never the lake) and must not import pyspark: message
timelines come through the `tracer` the caller passes (`spark_jobs.trace.lake_tracer`).
"""

from __future__ import annotations

import argparse
import hashlib
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from audit.core.config import Config
from audit.core.errors import InputError
from audit.core.windows import parse_instant
from audit.serving.dashboard.assets import write_assets
from audit.serving.dashboard.data import Scope, TopicData, overview_data, topics_data
from audit.serving.dashboard.overview import overview_page, risks_section
from audit.serving.dashboard.page import document, esc
from audit.serving.dashboard.timeline import (
    TIMELINES_DIR,
    MessageRef,
    Tracer,
    timeline_file,
    timeline_sections,
)
from audit.serving.dashboard.topic import anomaly_row_id, topic_page
from audit.serving.report_store import ReportStore

TITLE = "msgaudit report"
TOPICS_DIR = "topics"

__all__ = ["render", "cli_dashboard", "topic_file", "Scope", "MessageRef", "Tracer"]


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


@dataclass
class _TimelinePage:
    topic: str
    window: datetime
    messages: dict[str, MessageRef]  # row id -> message, in table order
    traces: list[tuple[str, MessageRef, Any]]


def _timelines(datas: Sequence[TopicData], names: dict[str, str], tracer: Tracer
               ) -> tuple[dict[tuple[str, str], str], dict[str, _TimelinePage]]:
    """Trace every message the topic pages show, in one call of `tracer`. Returns the timeline href
    of each (topic, row id), and the timeline pages by file name."""
    hrefs: dict[tuple[str, str], str] = {}
    pages: dict[str, _TimelinePage] = {}
    for d in datas:
        stem = names[d.topic][:-len(".html")]
        for row in d.anomalies:
            ref = MessageRef.of(d.topic, row)
            if ref is None:
                continue
            rid = anomaly_row_id(row)
            file = timeline_file(stem, row["window_start"])
            pages.setdefault(file, _TimelinePage(d.topic, row["window_start"], {}, [])).messages[rid] = ref
            hrefs[(d.topic, rid)] = f"../{TIMELINES_DIR}/{file}#{rid}"
    unique = sorted({ref for p in pages.values() for ref in p.messages.values()},
                    key=lambda r: (r.topic, r.pid or "", -1 if r.seq is None else r.seq,
                                   -1 if r.partition is None else r.partition, -1 if r.offset is None else r.offset))
    traced = dict(zip(unique, tracer(unique), strict=True)) if unique else {}
    for p in pages.values():
        p.traces = [(rid, ref, traced[ref]) for rid, ref in p.messages.items()]
    return hrefs, pages


def render(cfg_or_store: Config | ReportStore, out: Path, start: datetime | None = None,
           end: datetime | None = None, topics: Sequence[str] | None = None, tracer: Tracer | None = None) -> Path:
    """Write the dashboard folder for windows starting in [start, end) and `topics` (default: all)
    to `out`; returns the path of its index.html. With `tracer`, every anomaly row shown links to
    its message's timeline under timelines/ (all traced in one call); without, each row shows the
    `msgaudit trace` command."""
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
                                                 href=lambda t: f"{TOPICS_DIR}/{names[t]}",
                                                 risks=risks_section(*store.latest_risks()))
            index = out / "index.html"
            index.write_text(document(title=TITLE, subtitle_html=_subtitle(store.url, scope), body=body,
                                      figures=figures, asset_prefix="", extra_js=extra), encoding="utf-8")
            datas: Iterable[TopicData] = topics_data(store, scope, list(names))
            hrefs: dict[tuple[str, str], str] = {}
            timeline_pages: dict[str, _TimelinePage] = {}
            if tracer is not None:
                datas = list(datas)
                hrefs, timeline_pages = _timelines(datas, names, tracer)
            (out / TIMELINES_DIR).mkdir(exist_ok=True)
            for data in datas:
                def link(row: dict[str, Any], topic: str = data.topic) -> str | None:
                    return hrefs.get((topic, anomaly_row_id(row)))

                tbody, tfigures = topic_page(data, link if tracer is not None else None)
                page = document(title=f"{TITLE}: {data.topic}", body=tbody, figures=tfigures, asset_prefix="../",
                                subtitle_html=_subtitle(store.url, scope, '<a href="../index.html">&larr; overview</a> · '))
                (out / TOPICS_DIR / names[data.topic]).write_text(page, encoding="utf-8")
            for file, tp in timeline_pages.items():
                back = f'<a href="../{TOPICS_DIR}/{esc(names[tp.topic])}">&larr; {esc(tp.topic)}</a> · '
                page = document(title=f"{TITLE}: {tp.topic} timelines", figures=[], asset_prefix="../",
                                body=timeline_sections(tp.topic, tp.window, tp.traces),
                                subtitle_html=_subtitle(store.url, scope, back))
                (out / TIMELINES_DIR / file).write_text(page, encoding="utf-8")
            # Pages of topics no longer in range would be stale: the folder holds exactly this render.
            for folder, keep in ((TOPICS_DIR, set(names.values())), (TIMELINES_DIR, set(timeline_pages))):
                for old in (out / folder).glob("*.html"):
                    if old.name not in keep:
                        old.unlink()
        except OSError as e:
            raise InputError(f"--out {out}: cannot write the dashboard: {e.strerror}") from None
    finally:
        if own:
            store.close()
    return index


def cli_dashboard(args: argparse.Namespace, cfg: Config, tracer: Tracer | None = None) -> int:
    """`msgaudit dashboard --out DIR [--topic T ...] [--start --end]`."""
    start = parse_instant(args.start, "--start") if getattr(args, "start", None) else None
    end = parse_instant(args.end, "--end") if getattr(args, "end", None) else None
    topics = getattr(args, "topics", None)
    path = render(cfg, Path(args.out), start, end, topics, tracer)
    print(f"dashboard written to {path}")
    return 0
