"""The terminal timeline and the JSON of `msgaudit trace` (docs/design.md §9), from the rows
`spark_jobs/trace.py` selects. Pure functions: no Spark, no I/O."""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from audit.core.explain import setting_remedy
from audit.core.vocabulary import explanation, stage_kind

__all__ = ["format_key_traces", "format_timeline", "key_traces_json", "setting_remedy", "to_json"]


def _utc(t: Any) -> datetime | None:
    if not isinstance(t, datetime):
        return None
    return t.replace(tzinfo=UTC) if t.tzinfo is None else t.astimezone(UTC)


def _ts(t: Any) -> str:
    u = _utc(t)
    return "(no time)".ljust(24) if u is None else u.strftime("%Y-%m-%dT%H:%M:%S.") + f"{u.microsecond // 1000:03d}Z"


def _pos(r: Mapping[str, Any]) -> str:
    return f"{r['partition']}@{r['offset']}" if r.get("offset") is not None else f"{r['partition']}@-"


def _id(r: Mapping[str, Any]) -> str:
    return f"{r['pid']}:{r['seq']}" if r.get("pid") is not None and r.get("seq") is not None else "(no audit id)"


def _ms(a: Any, b: Any) -> str:
    ua, ub = _utc(a), _utc(b)
    return "" if ua is None or ub is None else f" +{round((ub - ua).total_seconds() * 1000)} ms"


def _settings_text(r: Mapping[str, Any]) -> str:
    return (f"acks={r['acks']}, enable.idempotence={'true' if r['enable_idempotence'] else 'false'}, "
            f"retries={r['retries']}, max.in.flight={r['max_in_flight']}")


def _events(trace: Mapping[str, Any]) -> list[tuple[datetime | None, int, str]]:
    ev: list[tuple[datetime | None, int, str]] = []
    for r in trace.get("settings", []):
        ev.append((_utc(r["start_ts"]), -1, f"producer {r['producer']} session {r['pid']} started ({r['mode']}): "
                   + _settings_text(r)))
    for r in trace["ledger"]:
        line = f"produce  {_id(r)} -> partition {r['partition']}: {r['status']}"
        if r.get("offset") is not None:
            line += f" at offset {r['offset']}"
        if r.get("ack_ts") is not None:
            line += f" (ack{_ms(r['produce_ts'], r['ack_ts'])})"
        if r.get("error"):
            line += f", error {r['error']}"
        ev.append((_utc(r["produce_ts"]), 0, line))
    for r in trace["log"]:
        line = f"log      {_pos(r)} {_id(r)} {'committed' if r['committed'] else 'aborted'}"
        if r.get("header_error"):
            line += f", header error: {r['header_error']}"
        ev.append((_utc(r.get("kafka_ts") or r.get("produce_ts") or r.get("captured_at")), 1, line))
    for r in trace["consumed"]:
        line = (f"group    {r['group']}: {r['outcome']} {_pos(r)} attempt {r['attempt']} "
                f"by {r['consumer']} (consume_seq {r['consume_seq']})")
        if r.get("error"):  # a failed processing's error; a share group's dead-letter record: the broker's reason
            line += f", error {r['error']}"
        ev.append((_utc(r["consume_ts"]), 2, line))
    for name, rows in sorted(trace["sinks"].items()):
        for r in rows:
            ev.append((_utc(r.get("sink_ts")), 3, f"sink     {name}: row {_pos(r)} {_id(r)}"))
    far = datetime.max.replace(tzinfo=UTC)
    return sorted(ev, key=lambda e: (e[0] or far, e[1], e[2]))


def _anomalies(trace: Mapping[str, Any]) -> list[dict[str, Any]]:
    out = []
    for r in sorted(trace["anomalies"], key=lambda r: (str(r["window_start"]), r["stage"], r["anomaly"],
                                                       r["partition"], r.get("offset") or -1)):
        e = explanation(stage_kind(r["stage"]), r["anomaly"])
        out.append({**r, "cause": e.cause, "remedy": e.remedy})
    return out


def format_timeline(trace: Mapping[str, Any]) -> str:
    """The readable journey: a header, one line per event in time order, then the anomalies
    naming the message with their cause and remedy."""
    ids = ", ".join(f"{p}:{s}" for p, s in trace["ids"]) or "(no audit id)"
    pos = ", ".join(f"{p}@{o}" for p, o in trace["positions"]) or "(not in the log)"
    lines = [f"trace {trace['topic']} message {ids}, log position(s) {pos}"]
    if trace["missing"]:
        lines.append(f"(not in the lake yet: {', '.join(trace['missing'])})")
    events = _events(trace)
    if not events:
        lines.append("no ledger, log, consumer or sink row names this message")
    lines += [f"  {_ts(t)}  {text}" for t, _, text in events]
    anomalies = _anomalies(trace)
    lines += ["", f"anomalies: {len(anomalies) or 'none'}"]
    for a in anomalies:
        ws = _utc(a["window_start"])
        window = ws.strftime("%Y-%m-%dT%H:%MZ") if ws else "?"
        lines.append(f"  [{window}] {a['stage']} {a['anomaly']} at {_pos(a)}: {a['detail']}")
        lines.append(f"      cause: {a['cause']}")
        lines.append(f"      fix: {a['remedy']}")
        specific = setting_remedy(a["anomaly"], [x for x in trace.get("settings", []) if x["pid"] == a["pid"]])
        if specific:
            lines.append(f"      {specific}")
    return "\n".join(lines)


def _plain(v: Any) -> Any:
    if isinstance(v, datetime):
        u = _utc(v)
        return u.isoformat() if u else None
    if isinstance(v, Mapping):
        return {k: _plain(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [_plain(x) for x in v]
    return v


def _json_obj(trace: Mapping[str, Any]) -> Any:
    return _plain({**trace, "anomalies": _anomalies(trace)})


def to_json(trace: Mapping[str, Any]) -> str:
    """The same rows as JSON (timestamps ISO 8601 UTC; anomalies with cause and remedy)."""
    return json.dumps(_json_obj(trace), indent=2, sort_keys=True)


def format_key_traces(result: Mapping[str, Any]) -> str:
    """`msgaudit trace --key`: one line naming every message the key names, in produce order, then
    the timeline of each shown one (blank line between), then how many were left out."""
    names, traces = result["messages"], result["traces"]
    head = f"key {result['key']!r} on topic {result['topic']}"
    if not names:
        return (f"{head}: no captured log record carries this key (keys are read from the captured log: "
                "a message the log never held, or in windows not captured yet, is not found)")
    lines = [f"{head}: {len(names)} message{'' if len(names) == 1 else 's'} in produce order: {', '.join(names)}"]
    for t in traces:
        lines += ["", format_timeline(t)]
    if len(traces) < len(names):
        lines += ["", f"{len(names) - len(traces)} more message(s) not shown (--limit {len(traces)}): "
                  f"{', '.join(names[len(traces):])}"]
    return "\n".join(lines)


def key_traces_json(result: Mapping[str, Any]) -> str:
    """The same as JSON: {topic, key, messages, traces} (each trace as `to_json` prints it)."""
    return json.dumps({"topic": result["topic"], "key": result["key"], "messages": list(result["messages"]),
                       "traces": [_json_obj(t) for t in result["traces"]]}, indent=2, sort_keys=True)
