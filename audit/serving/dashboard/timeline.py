"""Message timelines for the dashboard: each anomaly row of a topic page links to the timeline of
its message -- the same text `msgaudit trace` prints -- on one static page per (topic, window),
`timelines/<topic>--<window>.html`, where each message's section is anchored by the row id of its
anomaly rows (`topic.anomaly_row_id`).

The timelines come from the lake, which this package must not read: `render` takes a `Tracer`
(the CLI and the demo pass `spark_jobs.trace.lake_tracer`, one Spark pass for every row shown).
Without one, each row shows the `msgaudit trace` command line that prints its timeline.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from audit.serving.dashboard.page import esc, ts
from audit.serving.trace_view import format_timeline

TIMELINES_DIR = "timelines"


@dataclass(frozen=True)
class MessageRef:
    """One message as `msgaudit trace` names it: by identity when the row has one, else by position."""

    topic: str
    pid: str | None = None
    seq: int | None = None
    partition: int | None = None
    offset: int | None = None

    @staticmethod
    def of(topic: str, row: Mapping[str, Any]) -> MessageRef | None:
        if row.get("pid") is not None and row.get("seq") is not None:
            return MessageRef(topic, pid=str(row["pid"]), seq=int(row["seq"]))
        if row.get("offset") is not None:
            return MessageRef(topic, partition=int(row["partition"]), offset=int(row["offset"]))
        return None

    def command(self) -> str:
        """The `msgaudit trace` command line that prints this message's timeline."""
        args = ["msgaudit", "trace", "--topic", self.topic]
        if self.pid is not None:
            args += ["--pid", self.pid, "--seq", str(self.seq)]
        else:
            args += ["--partition", str(self.partition), "--offset", str(self.offset)]
        return shlex.join(args)


# the traces (as `spark_jobs.trace.trace_messages` returns them) of the given messages, same order
Tracer = Callable[[Sequence[MessageRef]], Sequence[Mapping[str, Any]]]


def timeline_file(topic_stem: str, window: datetime) -> str:
    return f"{topic_stem}--{window.astimezone(UTC).strftime('%Y%m%dT%H%MZ')}.html"


def timeline_sections(topic: str, window: datetime,
                      messages: Sequence[tuple[str, MessageRef, Mapping[str, Any]]]) -> list[str]:
    """Body of one (topic, window) page: per message (row id, ref, trace) a section anchored by
    the row id, with the trace command and the timeline text."""
    out = [f'<section><h2>Message timelines: {esc(topic)}, window {ts(window)}</h2><p class="note">'
           "One section per message with an anomaly row in this window, as <code>msgaudit trace</code> "
           "prints it from the lake.</p></section>"]
    for rid, ref, trace in messages:
        out.append(f'<section id="{rid}" class="timeline"><h2>{esc(ref.pid if ref.pid is not None else "")}'
                   f'{esc(":" + str(ref.seq) if ref.seq is not None else f"p{ref.partition}@{ref.offset}")}</h2>'
                   f'<p class="note"><code>{esc(ref.command())}</code></p>'
                   f'<pre class="timeline">{esc(format_timeline(trace))}</pre></section>')
    return out
