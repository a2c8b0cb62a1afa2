"""The audit headers every audited record carries (docs/design.md §3): make them, stamp them, parse them.

This module is pure Python and is the one definition of the header rules: the AuditedProducer
stamps with it, the AuditedConsumer parses with it, and the Spark log capture mirrors `parse`
rule for rule. It must not import Kafka, Spark or anything that does I/O.

Parse rules, checked in this order; the first one broken is the `error` (a short reason):

1. No header named `audit.pid`, `audit.seq`, `audit.ts` or `audit.key` at all (or no headers)
   -> "no audit headers".
2. One of those four names appears more than once -> "duplicate audit header: <name>".
3. A present audit header has a null value -> "<name> has no value"; a value that is not valid
   UTF-8 -> "<name> is not UTF-8".
4. `audit.pid` missing -> "missing audit.pid"; empty -> "audit.pid is empty";
   more than 64 characters -> "audit.pid longer than 64 chars".
5. `audit.seq` missing -> "missing audit.seq"; not ASCII digits only (no sign, no spaces)
   -> "audit.seq not an integer: '<value>'"; above 2**63-1 -> "audit.seq out of range: '<value>'".
6. `audit.ts` the same as `audit.seq` ("missing audit.ts", "audit.ts not an integer: ...",
   "audit.ts out of range: ..."), except that its range ends at 9999-12-31T23:59:59.999Z
   (253402300799999): the latest instant a timestamp column or Python's datetime can hold.
7. `audit.key` is optional; when present it must be non-empty -> "audit.key is empty".

The packed form `audit.id` = "<pid>/<seq>/<ts>" (docs/design.md §3.1) counts as an audit header for
rules 1-3; then (rule 3a, before rule 4) `audit.id` together with `audit.pid`, `audit.seq` or
`audit.ts` -> "audit.id together with <the first of those present>", and an `audit.id` without two
'/' -> "audit.id is not <pid>/<seq>/<ts>: '<value>'". Otherwise its three parts (split at the last
two '/') are the texts rules 4-6 check, with the same reasons. When `audit.id` is present, pid, seq
and ts come from it alone (None if it breaks rule 2, 3 or 3a).

Other headers (the user's own) are ignored. Each field that passes its own checks is returned
even when another field is bad (a record with a bad seq keeps its pid); a field involved in
rule 2 or 3 is returned as None. Values quoted in reasons are cut to 40 characters.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

PID = "audit.pid"
SEQ = "audit.seq"
TS = "audit.ts"
KEY = "audit.key"
ID = "audit.id"  # the packed form: "<pid>/<seq>/<ts>"

AUDIT_HEADERS = (PID, SEQ, TS, KEY, ID)
# The wire forms a producer can stamp: one packed `audit.id` header (the default) or three.
PACKED, THREE = "packed", "three"
HEADER_FORMS = (PACKED, THREE)
MAX_PID_CHARS = 64
MAX_LONG = 2**63 - 1
MAX_TS_MS = 253_402_300_799_999  # 9999-12-31T23:59:59.999Z, epoch ms
_RANDOM_CHARS = 12  # hex chars: 48 random bits per producer start
_QUOTE_CHARS = 40

Headers = Sequence[tuple[str, bytes | None]]
# What confluent_kafka's produce() accepts as headers.
UserHeaders = Sequence[tuple[str, bytes | str | None]] | Mapping[str, bytes | str | None]


@dataclass(frozen=True)
class AuditHeaders:
    pid: str | None
    seq: int | None
    ts_ms: int | None
    key: str | None
    error: str | None  # None when the record's audit headers are valid

    @property
    def valid(self) -> bool:
        return self.error is None


def new_pid(producer_name: str) -> str:
    """A fresh producer session id `<name>:<random>`, at most 64 chars (the name is cut to fit)."""
    if not isinstance(producer_name, str) or not producer_name:
        raise ValueError(f"producer_name must be a non-empty string, got {producer_name!r}")
    suffix = os.urandom(_RANDOM_CHARS // 2).hex()
    room = MAX_PID_CHARS - len(suffix) - 1
    return f"{producer_name[:room]}:{suffix}"


def stamp(
    headers: UserHeaders | None,
    pid: str,
    seq: int,
    ts_ms: int,
    key: str | None = None,
    form: str = THREE,
) -> list[tuple[str, bytes]]:
    """The user's headers (list or dict, as confluent_kafka accepts them) followed by ours: the
    three headers, or with `form=PACKED` the one `audit.id` header (what producers send by default).

    User headers named like ours are dropped, so the record never carries a duplicate audit
    header (which parse would reject); every other user header is kept in order.
    """
    out: list[tuple[str, bytes]] = []
    if headers:
        items = headers.items() if isinstance(headers, Mapping) else headers
        for name, value in items:
            if name in AUDIT_HEADERS:
                continue
            out.append((name, value.encode() if isinstance(value, str) else value))  # type: ignore[arg-type]
    if form == PACKED:
        out.append((ID, f"{pid}/{seq}/{ts_ms}".encode()))
    else:
        out.append((PID, pid.encode()))
        out.append((SEQ, str(seq).encode()))
        out.append((TS, str(ts_ms).encode()))
    if key is not None:
        out.append((KEY, key.encode()))
    return out


def fingerprint(key: bytes | str | None, value: bytes | str | None, headers: Headers | None) -> str:
    """A record's content fingerprint as capture computes it (docs/design.md §3): its `audit.key`
    header when present, else the SHA-256 hex of (key bytes, 0x00, value bytes)."""
    for name, v in headers or ():
        if name == KEY and v is not None:
            return v.decode("utf-8", "replace")
    def raw(x: bytes | str | None) -> bytes:
        return b"" if x is None else x.encode() if isinstance(x, str) else x
    return hashlib.sha256(raw(key) + b"\x00" + raw(value)).hexdigest()


# Headers of the AuditedConsumer's retry and dead-letter copies (docs/design.md §9): known audit.*
# names an application may pass on (a handler forwarding a copy's headers), unlike an unknown one.
COPY_HEADERS = ("audit.src.topic", "audit.src.partition", "audit.src.offset", "audit.attempt", "audit.retry.at",
                "audit.error", "audit.group")
RESERVED_PREFIX = "audit."


def user_header_error(headers: UserHeaders) -> str | None:
    """Why an application's headers cannot be stamped, or None. `audit.*` names are reserved: an
    unknown one is refused; `audit.pid`/`audit.seq`/`audit.ts`/`audit.key` are replaced by the
    producer's own (see `stamp`), but a value that breaks the parse rules above is refused too,
    so a malformed audit header is reported at `produce()`, not found later in the log."""
    items = headers.items() if isinstance(headers, Mapping) else headers
    for item in items:
        try:
            name, value = item
        except (TypeError, ValueError):
            return f"a header must be a (name, value) pair, got {_quote(repr(item))}"
        if not isinstance(name, str) or not name.startswith(RESERVED_PREFIX):
            continue
        if name not in AUDIT_HEADERS and name not in COPY_HEADERS:
            return (f"unknown audit header {_quote(name)}: audit.* names are reserved "
                    f"({', '.join(AUDIT_HEADERS + COPY_HEADERS)})")
        if name not in AUDIT_HEADERS:
            continue
        text = value.decode("utf-8", "replace") if isinstance(value, bytes) else value
        if text is None:
            return f"{name} has no value"
        if not isinstance(text, str):
            return f"{name} must be str or bytes, got {type(text).__name__}"
        if name == ID:
            parts = text.rsplit("/", 2)
            if len(parts) != 3:
                return f"{ID} is not <pid>/<seq>/<ts>: {_quote(text)}"
            if not parts[0] or len(parts[0]) > MAX_PID_CHARS:
                return f"{ID}: the pid must be 1 to {MAX_PID_CHARS} chars: {_quote(text)}"
            for part, limit, what in ((parts[1], MAX_LONG, SEQ), (parts[2], MAX_TS_MS, TS)):
                err = _long(what, part, limit)[1]
                if err is not None:
                    return f"{ID}: " + err.replace("not an integer", "not a decimal integer")
            continue
        if name == PID and len(text) > MAX_PID_CHARS:
            return f"{PID} longer than {MAX_PID_CHARS} chars: {_quote(text)}"
        if name in (SEQ, TS):
            err = _long(name, text, MAX_LONG if name == SEQ else MAX_TS_MS)[1]
            if err is not None:
                return err.replace("not an integer", "not a decimal integer")
        if not text:
            return f"{name} is empty"
    return None


def _quote(text: str) -> str:
    return repr(text if len(text) <= _QUOTE_CHARS else text[:_QUOTE_CHARS] + "...")


def _long(name: str, text: str | None, limit: int = MAX_LONG) -> tuple[int | None, str | None]:
    if text is None:
        return None, f"missing {name}"
    if not text or not text.isascii() or not text.isdigit():
        return None, f"{name} not an integer: {_quote(text)}"
    value = int(text)
    if value > limit:
        return None, f"{name} out of range: {_quote(text)}"
    return value, None


def parse(headers: Headers | None) -> AuditHeaders:
    """Read the audit headers of one record; see the module docstring for the rules."""
    raw: dict[str, list[bytes | None]] = {}
    for name, value in headers or ():
        if name in AUDIT_HEADERS:
            raw.setdefault(name, []).append(value)
    if not raw:
        return AuditHeaders(None, None, None, None, "no audit headers")

    errors: list[str] = []
    text: dict[str, str | None] = {}
    for name in AUDIT_HEADERS:
        values = raw.get(name)
        if values is None:
            text[name] = None
        elif len(values) > 1:
            errors.append(f"duplicate audit header: {name}")
            text[name] = None
        elif values[0] is None:
            errors.append(f"{name} has no value")
            text[name] = None
        else:
            try:
                text[name] = values[0].decode("utf-8")
            except UnicodeDecodeError:
                errors.append(f"{name} is not UTF-8")
                text[name] = None
    # Rules 2 and 3 come before the per-field rules whatever the header order on the record.
    errors.sort(key=lambda e: 0 if e.startswith("duplicate") else 1)
    broken = {n for n in AUDIT_HEADERS if n in raw and text[n] is None}

    # Rule 3a: the packed form, alone, gives the texts of pid, seq and ts.
    if ID in raw:
        packed = text[ID]
        others = [n for n in (PID, SEQ, TS) if n in raw]
        parts = packed.rsplit("/", 2) if packed is not None else []
        if packed is not None and others:
            errors.append(f"{ID} together with {others[0]}")
        elif packed is not None and len(parts) != 3:
            errors.append(f"{ID} is not <pid>/<seq>/<ts>: {_quote(packed)}")
        if packed is not None and not others and len(parts) == 3:
            text[PID], text[SEQ], text[TS] = parts
        else:
            text[PID] = text[SEQ] = text[TS] = None
            broken |= {PID, SEQ, TS}

    pid = text[PID]
    if pid is None:
        if PID not in broken:
            errors.append(f"missing {PID}")
    elif not pid:
        errors.append(f"{PID} is empty")
        pid = None
    elif len(pid) > MAX_PID_CHARS:
        errors.append(f"{PID} longer than {MAX_PID_CHARS} chars")
        pid = None

    seq: int | None = None
    ts_ms: int | None = None
    for name in (SEQ, TS):
        if name in broken:
            continue
        number, err = _long(name, text[name], MAX_LONG if name == SEQ else MAX_TS_MS)
        if err:
            errors.append(err)
        if name == SEQ:
            seq = number
        else:
            ts_ms = number

    key = text[KEY]
    if key is not None and not key:
        errors.append(f"{KEY} is empty")
        key = None

    return AuditHeaders(pid, seq, ts_ms, key, errors[0] if errors else None)
