"""Audit header format: new_pid, stamp, parse and its rules (docs/design.md §3). Pure Python."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from audit.core import headers as h
from audit.core.headers import AuditHeaders

pytestmark = pytest.mark.unit


def test_constants_are_the_design_names() -> None:
    assert (h.PID, h.SEQ, h.TS, h.KEY) == ("audit.pid", "audit.seq", "audit.ts", "audit.key")


def test_new_pid_is_name_colon_random_and_unique() -> None:
    a, b = h.new_pid("orders-svc"), h.new_pid("orders-svc")
    assert a != b
    name, rand = a.split(":")
    assert name == "orders-svc"
    assert len(rand) == 12 and int(rand, 16) >= 0


def test_new_pid_cuts_long_names_to_64_chars() -> None:
    pid = h.new_pid("n" * 100)
    assert len(pid) == 64
    assert pid.startswith("n" * 51 + ":")
    assert h.parse(h.stamp(None, pid, 0, 1)).error is None


def test_new_pid_rejects_empty_name() -> None:
    with pytest.raises(ValueError, match="producer_name"):
        h.new_pid("")


def test_stamp_keeps_user_headers_in_order_and_appends_ours() -> None:
    user: list[tuple[str, bytes | str | None]] = [("trace", b"abc"), ("empty", None), ("text", "x")]
    assert h.stamp(user, "p:1", 7, 1700000000123, key="order-9") == [
        ("trace", b"abc"),
        ("empty", None),
        ("text", b"x"),
        ("audit.pid", b"p:1"),
        ("audit.seq", b"7"),
        ("audit.ts", b"1700000000123"),
        ("audit.key", b"order-9"),
    ]


def test_stamp_accepts_dict_headers_and_drops_user_copies_of_audit_names() -> None:
    stamped = h.stamp({"a": b"1", "audit.seq": b"999"}, "p:1", 3, 5)
    assert stamped == [("a", b"1"), ("audit.pid", b"p:1"), ("audit.seq", b"3"), ("audit.ts", b"5")]


def test_parse_valid_without_and_with_key() -> None:
    assert h.parse(h.stamp(None, "p:1", 0, 17)) == AuditHeaders("p:1", 0, 17, None, None)
    assert h.parse(h.stamp([("u", b"v")], "p:1", 42, 17, "k")) == AuditHeaders("p:1", 42, 17, "k", None)


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        (None, AuditHeaders(None, None, None, None, "no audit headers")),
        ([], AuditHeaders(None, None, None, None, "no audit headers")),
        ([("trace", b"1")], AuditHeaders(None, None, None, None, "no audit headers")),
        ([("audit.seq", b"1"), ("audit.ts", b"2")], AuditHeaders(None, 1, 2, None, "missing audit.pid")),
        ([("audit.pid", b"p"), ("audit.ts", b"2")], AuditHeaders("p", None, 2, None, "missing audit.seq")),
        ([("audit.pid", b"p"), ("audit.seq", b"1")], AuditHeaders("p", 1, None, None, "missing audit.ts")),
        ([("audit.pid", b"p"), ("audit.seq", b"x"), ("audit.ts", b"2")],
         AuditHeaders("p", None, 2, None, "audit.seq not an integer: 'x'")),
        ([("audit.pid", b"p"), ("audit.seq", b"-1"), ("audit.ts", b"2")],
         AuditHeaders("p", None, 2, None, "audit.seq not an integer: '-1'")),
        ([("audit.pid", b"p"), ("audit.seq", b" 1"), ("audit.ts", b"2")],
         AuditHeaders("p", None, 2, None, "audit.seq not an integer: ' 1'")),
        ([("audit.pid", b"p"), ("audit.seq", "١".encode()), ("audit.ts", b"2")],  # Arabic-Indic digit
         AuditHeaders("p", None, 2, None, "audit.seq not an integer: '١'")),
        ([("audit.pid", b"p"), ("audit.seq", b"9223372036854775808"), ("audit.ts", b"2")],
         AuditHeaders("p", None, 2, None, "audit.seq out of range: '9223372036854775808'")),
        ([("audit.pid", b"p"), ("audit.seq", b"1"), ("audit.ts", b"")],
         AuditHeaders("p", 1, None, None, "audit.ts not an integer: ''")),
        ([("audit.pid", b"p"), ("audit.seq", b"1"), ("audit.ts", b"253402300799999")],  # 9999-12-31T23:59:59.999Z
         AuditHeaders("p", 1, 253402300799999, None, None)),
        ([("audit.pid", b"p"), ("audit.seq", b"1"), ("audit.ts", b"253402300800000")],  # year 10000
         AuditHeaders("p", 1, None, None, "audit.ts out of range: '253402300800000'")),
        ([("audit.pid", b"p"), ("audit.seq", b"1"), ("audit.ts", b"9223372036854775807")],
         AuditHeaders("p", 1, None, None, "audit.ts out of range: '9223372036854775807'")),
        ([("audit.pid", b"q" * 65), ("audit.seq", b"1"), ("audit.ts", b"2")],
         AuditHeaders(None, 1, 2, None, "audit.pid longer than 64 chars")),
        ([("audit.pid", b""), ("audit.seq", b"1"), ("audit.ts", b"2")],
         AuditHeaders(None, 1, 2, None, "audit.pid is empty")),
        ([("audit.pid", b"p"), ("audit.seq", b"1"), ("audit.seq", b"2"), ("audit.ts", b"3")],
         AuditHeaders("p", None, 3, None, "duplicate audit header: audit.seq")),
        ([("audit.pid", b"\xff\xfe"), ("audit.seq", b"1"), ("audit.ts", b"3")],
         AuditHeaders(None, 1, 3, None, "audit.pid is not UTF-8")),
        ([("audit.pid", b"p"), ("audit.seq", None), ("audit.ts", b"3")],
         AuditHeaders("p", None, 3, None, "audit.seq has no value")),
        ([("audit.pid", b"p"), ("audit.seq", b"1"), ("audit.ts", b"3"), ("audit.key", b"")],
         AuditHeaders("p", 1, 3, None, "audit.key is empty")),
        # Rule order: a duplicate is reported before a malformed value seen earlier on the record.
        ([("audit.seq", b"x"), ("audit.pid", b"p"), ("audit.ts", b"1"), ("audit.ts", b"2")],
         AuditHeaders("p", None, None, None, "duplicate audit header: audit.ts")),
        # A long bad value is quoted cut to 40 characters.
        ([("audit.pid", b"p"), ("audit.seq", b"y" * 50), ("audit.ts", b"2")],
         AuditHeaders("p", None, 2, None, "audit.seq not an integer: '" + "y" * 40 + "...'")),
    ],
)
def test_parse_rules(headers: list[tuple[str, bytes | None]] | None, expected: AuditHeaders) -> None:
    assert h.parse(headers) == expected


@given(
    seq=st.integers(min_value=0, max_value=2**63 - 1),
    ts=st.integers(min_value=0, max_value=h.MAX_TS_MS),
    name=st.text(min_size=1, max_size=80),
    key=st.one_of(st.none(), st.text(min_size=1, max_size=30)),
    user=st.lists(st.tuples(st.sampled_from(["a", "b", "trace"]), st.binary(max_size=5)), max_size=3),
)
def test_stamp_then_parse_round_trips(seq: int, ts: int, name: str, key: str | None,
                                      user: list[tuple[str, bytes]]) -> None:
    pid = h.new_pid(name)
    parsed = h.parse(h.stamp(user, pid, seq, ts, key))
    assert parsed == AuditHeaders(pid, seq, ts, key, None)


# -- the packed form: one audit.id header "<pid>/<seq>/<ts>" (docs/design.md §3.1, rule 3a)

@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        ([("audit.id", b"p:1/7/17")], AuditHeaders("p:1", 7, 17, None, None)),
        ([("a", b"1"), ("audit.id", b"a/b:1/7/17"), ("audit.key", b"k")], AuditHeaders("a/b:1", 7, 17, "k", None)),
        ([("audit.id", b"p:1/7")], AuditHeaders(None, None, None, None, "audit.id is not <pid>/<seq>/<ts>: 'p:1/7'")),
        ([("audit.id", b"p:1/7/17"), ("audit.ts", b"17")],
         AuditHeaders(None, None, None, None, "audit.id together with audit.ts")),
        ([("audit.id", b"p:1/7/17"), ("audit.id", b"p:1/7/17")],
         AuditHeaders(None, None, None, None, "duplicate audit header: audit.id")),
        ([("audit.id", None)], AuditHeaders(None, None, None, None, "audit.id has no value")),
        ([("audit.id", b"\xff/1/2")], AuditHeaders(None, None, None, None, "audit.id is not UTF-8")),
        ([("audit.id", b"/7/17")], AuditHeaders(None, 7, 17, None, "audit.pid is empty")),
        ([("audit.id", b"p/x/17")], AuditHeaders("p", None, 17, None, "audit.seq not an integer: 'x'")),
        ([("audit.id", b"p/7/253402300800000")],
         AuditHeaders("p", 7, None, None, "audit.ts out of range: '253402300800000'")),
        ([("audit.id", b"q" * 65 + b"/7/17")], AuditHeaders(None, 7, 17, None, "audit.pid longer than 64 chars")),
    ],
)
def test_parse_rules_of_the_packed_form(headers: list[tuple[str, bytes | None]], expected: AuditHeaders) -> None:
    assert h.parse(headers) == expected


def test_stamp_packed_is_one_header_after_the_users_and_drops_their_audit_names() -> None:
    stamped = h.stamp([("a", b"1"), ("audit.id", b"x/1/2"), ("audit.pid", b"y")], "p:1", 3, 5, key="k", form=h.PACKED)
    assert stamped == [("a", b"1"), ("audit.id", b"p:1/3/5"), ("audit.key", b"k")]
    assert h.parse(stamped) == AuditHeaders("p:1", 3, 5, "k", None)
    assert h.user_header_error([("audit.id", b"p/1")]) == "audit.id is not <pid>/<seq>/<ts>: 'p/1'"
    assert h.user_header_error([("audit.id", b"p/1/2")]) is None


@given(
    seq=st.integers(min_value=0, max_value=2**63 - 1),
    ts=st.integers(min_value=0, max_value=h.MAX_TS_MS),
    name=st.text(min_size=1, max_size=80),
    key=st.one_of(st.none(), st.text(min_size=1, max_size=30)),
)
def test_stamp_packed_then_parse_round_trips(seq: int, ts: int, name: str, key: str | None) -> None:
    pid = h.new_pid(name)  # a name may hold '/': the split is at the last two
    assert h.parse(h.stamp(None, pid, seq, ts, key, form=h.PACKED)) == AuditHeaders(pid, seq, ts, key, None)
