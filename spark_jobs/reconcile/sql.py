"""SQL text helpers of the Spark classifier: the X row every rule produces (kind 'A': one
anomaly row; 'F': one unit's facts at a stage; 'Q' and 'I' are only counted by the summary: a
malformed ledger row, a consumption row read on a mirror its group does not fail over to),
string literals, and anomaly codes and detail texts taken from the vocabulary
(`audit.core.vocabulary`): `detail_sql` turns a code's detail template into the SQL expression
that renders the same text, so each text is written once. An X row carries the `topic` column of
the row it is built from, so one plan classifies many topics.

Pure string building: no DataFrames, no SparkSession, no I/O.
"""

from __future__ import annotations

import string

from audit.core.vocabulary import anomaly

_MIN = -(2**62)

X_FIELDS = (("topic", "string"), ("kind", "string"), ("stage", "string"), ("anomaly", "string"),
            ("partition", "int"),
            ("pid", "string"), ("seq", "bigint"), ("offset", "bigint"), ("detail", "string"),
            ("expected", "int"), ("delivered", "int"), ("pending", "int"), ("latency", "double"))
X_TYPE = "struct<" + ",".join(f"{n}:{t}" for n, t in X_FIELDS) + ">"
EMPTY_X = f"cast(array() as array<{X_TYPE}>)"


def _q(s: str) -> str:
    """A SQL string literal."""
    return "'" + s.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _s(x: str) -> str:
    return f"cast({x} as string)"


def code_sql(kind: str, name: str) -> str:
    """The SQL literal of an anomaly code of the vocabulary (KeyError for a code it does not have)."""
    return _q(anomaly(kind, name).name)


def template_sql(template: str, exprs: dict[str, str]) -> str:
    """A `str.format` template -> the SQL expression giving the same text, each field replaced by
    its SQL expression cast to string: "acked at offset {offset}, absent" ->
    concat('acked at offset ', cast(offset as string), ', absent')."""
    parts: list[str] = []
    for literal, field, _, _ in string.Formatter().parse(template):
        if literal:
            parts.append(_q(literal))
        if field:
            parts.append(_s(exprs[field]))
    if len(parts) == 1 and not parts[0].startswith("cast("):
        return parts[0]
    return f"concat({', '.join(parts)})"


def detail_sql(kind: str, name: str, variant: str | None = None, **exprs: str) -> str:
    """The SQL expression of an anomaly row's detail: the vocabulary's template for (kind, code),
    its fields bound to SQL expressions (`detail_from`, when the code has one, comes first)."""
    code = anomaly(kind, name)
    fields = code.fields(variant)
    missing = set(fields) - set(exprs)
    if missing:
        raise KeyError(f"{kind}/{name}: no SQL expression for {sorted(missing)}")
    text = template_sql(code.template(variant), exprs)
    if code.detail_from is not None and code.detail_from in exprs:
        return f"coalesce({exprs[code.detail_from]}, {text})"
    return text


def _a(stage: str, code: str, part: str, pid: str, seq: str, off: str, detail: str) -> str:
    return (f"named_struct('topic', topic, 'kind', 'A', 'stage', {stage}, 'anomaly', {code}, "
            f"'partition', cast({part} as int), "
            f"'pid', cast({pid} as string), 'seq', cast({seq} as bigint), 'offset', cast({off} as bigint), "
            f"'detail', cast({detail} as string), 'expected', 0, 'delivered', 0, 'pending', 0, "
            f"'latency', cast(null as double))")


def anomaly_sql(stage: str, kind: str, name: str, part: str, pid: str, seq: str, off: str,
                variant: str | None = None, **exprs: str) -> str:
    """One anomaly X row of code `name`, with its code and detail from the vocabulary."""
    return _a(stage, code_sql(kind, name), part, pid, seq, off, detail_sql(kind, name, variant, **exprs))


def _f(stage: str, part: str, expected: str, delivered: str, pending: str, latency: str) -> str:
    return (f"named_struct('topic', topic, 'kind', 'F', 'stage', {stage}, 'anomaly', cast(null as string), "
            f"'partition', cast({part} as int), 'pid', cast(null as string), 'seq', cast(null as bigint), "
            f"'offset', cast(null as bigint), 'detail', cast(null as string), "
            f"'expected', cast({expected} as int), 'delivered', cast({delivered} as int), "
            f"'pending', cast({pending} as int), 'latency', cast({latency} as double))")


def _opt(cond: str, *structs: str) -> str:
    return f"CASE WHEN {cond} THEN array({', '.join(structs)}) ELSE {EMPTY_X} END"
