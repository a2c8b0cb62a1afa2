"""The vocabulary (`audit/core/vocabulary.py`) is the one statement of stages, codes, statuses,
SLA rules and exit codes: these tests fail when the oracle, the Spark classifier, the report
store's columns, the SLA check or the exit codes say something else."""

from __future__ import annotations

import ast
import re
import string
from pathlib import Path
from typing import Any

import pytest

from audit.core import vocabulary as v
from tests.reconcile_cases import (
    AS_OF_FINAL,
    T0,
    at,
    build_cases,
    build_dead_letter_case,
    build_mirror_cases,
    build_share_cases,
    mirror_topic_config,
    share_topic_config,
    topic_config,
)

ROOT = Path(__file__).resolve().parents[1]
VOCAB_KEYS = {(a.stage_kind, a.name) for a in v.ANOMALIES}


def _template_regex(template: str) -> re.Pattern[str]:
    """A regex matching every rendering of a detail template."""
    out = ""
    for literal, field, _, _ in string.Formatter().parse(template):
        out += re.escape(literal)
        if field:
            out += ".+?"
    return re.compile(f"^{out}$")


def _oracle_emitted_keys() -> set[tuple[str, str]]:
    """(stage kind, code) of every `emit(stage, code, ...)` call in the oracle's source."""
    tree = ast.parse((ROOT / "audit" / "oracle.py").read_text())
    keys = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "emit":
            stage, code = node.args[0], node.args[1]
            assert isinstance(code, ast.Constant), ast.unparse(node)
            kind = {"LOG": "log"}.get(ast.unparse(stage))
            if kind is None and _enclosing_function(tree, node) == "share_facts":
                kind = "share"
            if kind is None:  # `stage` inside the group or sink loop
                loop = _enclosing_loop(tree, node)
                kind = "group" if "group" in loop else "mirror" if "mirror" in loop else "sink"
            keys.add((kind, str(code.value)))
    return keys


def _enclosing_function(tree: ast.AST, call: ast.Call) -> str | None:
    """The name of the top-level function the call is in."""
    for fn in ast.walk(tree):
        if isinstance(fn, ast.FunctionDef) and fn.col_offset == 0 and any(n is call for n in ast.walk(fn)):
            return fn.name
    return None


def _enclosing_loop(tree: ast.AST, call: ast.Call) -> str:
    """The source of the `stage = ...` assignment of the loop the call is in."""
    for loop in ast.walk(tree):
        if isinstance(loop, ast.For) and any(n is call for n in ast.walk(loop)):
            for stmt in loop.body:
                if isinstance(stmt, ast.Assign) and ast.unparse(stmt.targets[0]) == "stage":
                    return ast.unparse(stmt.value)
    raise AssertionError(f"no stage for {ast.unparse(call)}")


@pytest.mark.unit
def test_every_code_the_oracle_emits_is_in_the_vocabulary_and_every_code_is_emitted() -> None:
    assert _oracle_emitted_keys() == VOCAB_KEYS


@pytest.mark.unit
def test_oracle_anomaly_rows_use_the_vocabulary_codes_and_detail_texts() -> None:
    from audit.oracle import reconcile_window

    history, _ = build_cases()
    tc = topic_config()
    rows: list[dict[str, Any]] = []
    mirrored, _ = build_mirror_cases()
    shared, _ = build_share_cases()
    dead_letters, _ = build_dead_letter_case()
    for as_of in (AS_OF_FINAL, at(30)):
        rows += reconcile_window(tc, T0, as_of, history.inputs()).anomalies
        rows += reconcile_window(mirror_topic_config(), T0, as_of, mirrored.inputs()).anomalies
        rows += reconcile_window(share_topic_config(), T0, at(12) if as_of != AS_OF_FINAL else as_of,
                                 shared.inputs()).anomalies
        rows += reconcile_window(tc, T0, as_of, dead_letters.inputs()).anomalies
    seen = set()
    for a in rows:
        key = (v.stage_kind(a["stage"]), a["anomaly"])
        assert key in VOCAB_KEYS, key
        code = v.anomaly(*key)
        templates = [code.detail, *(t for _, t in code.variants)]
        assert a["detail"] is not None
        assert any(_template_regex(t).match(a["detail"]) for t in templates) or code.detail_from, a
        seen.add(key)
    assert len(seen) >= len(VOCAB_KEYS) - 2  # the hand-written cases cover (almost) every code


@pytest.mark.unit
def test_the_engines_write_no_detail_text_of_their_own() -> None:
    """Every detail text comes from the vocabulary: no template's text is spelled out in the kernel's
    or the Spark package's sources (the oracle renders them, from the vocabulary)."""
    strings = []  # every string constant of the packages' code (docstrings aside)
    for path in [*(ROOT / "spark_jobs" / "reconcile").glob("*.py"), *(ROOT / "audit" / "rules").glob("*.py")]:
        tree = ast.parse(path.read_text())
        docs = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)}
        strings += [n.value for n in ast.walk(tree)
                    if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs]
    sources = "\n".join(strings)
    for a in v.ANOMALIES:
        for template in (a.detail, *(t for _, t in a.variants)):
            for literal, _, _, _ in string.Formatter().parse(template):
                if len(literal.strip()) > 6:
                    assert literal not in sources, (a.name, literal)


@pytest.mark.unit
def test_report_columns_are_the_base_columns_and_the_vocabularys_code_columns() -> None:
    from audit.core.report import assemble_report
    from audit.serving.report_store import anomalies, partition_report
    from spark_jobs.io.schemas import AUDIT_ANOMALIES, AUDIT_PARTITION_REPORT

    # one column per code name (dead_lettered: group and sink share it)
    expected = v.REPORT_BASE_COLUMNS + tuple(dict.fromkeys(a.report_column for a in v.ANOMALIES if a.report_column))
    assert tuple(c.name for c in partition_report.columns) == expected
    assert tuple(f.name for f in AUDIT_PARTITION_REPORT.fields) == expected
    assert tuple(c.name for c in anomalies.columns) == v.ANOMALY_COLUMNS
    assert tuple(f.name for f in AUDIT_ANOMALIES.fields) == v.ANOMALY_COLUMNS
    row = assemble_report(topic_config(), T0, AS_OF_FINAL, [0], {}, {})[0]
    assert tuple(row) == expected


@pytest.mark.unit
def test_report_totals_add_up_the_codes_the_vocabulary_counts_in_them() -> None:
    from audit.core.report import assemble_report

    tc = topic_config()
    codes = {(stage, 0): {a.name: 1 for a in v.ANOMALIES if a.stage_kind == v.stage_kind(stage)}
             for stage in ("log", "group:g1", "sink:s1")}
    rows = {r["stage"]: r for r in assemble_report(tc, T0, AS_OF_FINAL, [0], {("log", 0): {"pending": 4}}, codes)}
    for stage, row in rows.items():
        kind = v.stage_kind(stage)
        for total in (v.LOST, v.DUPLICATED, v.REORDERED):
            assert row[total] == len(v.codes_counting_in(kind, total)), (stage, total)
    assert (rows["log"]["pending"], rows["group:g1"]["pending"], rows["sink:s1"]["pending"]) == (4, 1, 1)


@pytest.mark.unit
def test_sla_rules_agree_everywhere() -> None:
    from audit.core import config
    from spark_jobs import sla

    assert config.SLA_RULES == v.SLA_RULES == tuple(sla.RULES)
    for spec in v.SLA_RULE_SPECS:
        assert spec.observed_column in v.REPORT_COLUMNS or spec.observed_column in sla.DERIVED_COLUMNS, spec
        assert spec.bound in ("max", "min") and set(spec.stage_kinds) <= set(v.STAGE_KINDS), spec
        assert spec.measures


@pytest.mark.unit
def test_statuses_outcomes_and_exit_codes_come_from_the_vocabulary() -> None:
    from audit.core.errors import ConfigError, MsgauditError, SlaFailed
    from audit.serving import alerts
    from audit.serving.dashboard import data as dashboard

    assert MsgauditError.exit_code == ConfigError.exit_code == v.ExitCode.INPUT == 2
    assert SlaFailed.exit_code == alerts.SLA_EXIT_CODE == v.ExitCode.SLA_FAILED == 3
    assert (v.ExitCode.OK, v.ExitCode.UNEXPECTED) == (0, 1)
    assert dashboard.STATUS_LEVELS[1:] == v.SLA_CHECK_STATUSES
    assert set(v.LEDGER_STATUS_PRECEDENCE) == set(v.LEDGER_STATUSES)
    assert v.DEAD_LETTERED in v.CONSUME_OUTCOMES and v.PROCESSED in v.CONSUME_OUTCOMES


@pytest.mark.unit
def test_every_template_renders() -> None:
    for a in v.ANOMALIES:
        for variant in (None, *(name for name, _ in a.variants)):
            fields = a.fields(variant)
            assert a.render(variant, **dict.fromkeys(fields, 7))
    with pytest.raises(KeyError):
        v.anomaly("log", "no_such_code")

