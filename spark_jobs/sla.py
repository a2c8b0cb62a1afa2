"""SLA check (docs/design.md §7): each topic's SLA as a Great Expectations suite over `audit_partition_report`.

For a window range, the report rows are read from the Delta lake, given one observed column per
rule (`with_sla_observations`, a pure transform), and validated with Great Expectations 1.x: one
ExpectationSuite per SLA -- the topics with the same rules, thresholds and severities share one, and
one validation over all their rows -- one `expect_column_values_to_be_between` per rule, run on
the Spark DataFrame through an ephemeral context (Spark datasource, whole-dataframe batch
definition, ValidationDefinition). GE's row-level unexpected index list decides pass or fail of
every (window_start, topic, partition, stage, rule); one row each goes to `sla_results` in the
report store, replacing that (topic, window) so reruns are idempotent.

Rules, the observed value they judge and the stages they apply to:

| rule | observed | passes when | stages |
|---|---|---|---|
| max_lost | lost | observed <= t | log, group, sink |
| max_duplicate_ratio | duplicated / max(expected, 1) | observed <= t | log, group, sink |
| max_reordered | reordered | observed <= t | log, group (a sink has no order) |
| max_p99_latency_ms | latency_p99_ms | observed <= t; null (nothing delivered) passes | log, group, sink |
| min_completeness | (delivered + dead_lettered) / expected | observed >= t; null (expected 0) passes | log, group, sink |
| max_failed_sends | failed_send (failed sends with no copy in the log) | observed <= t | log |
| max_redelivery_ratio | redelivered / max(expected, 1) | observed <= t | group, share |

Latency at every stage is measured from produce time, so a p99 bound holds for each hop.
The duplicate ratio's denominator is at least 1 so that copies of nothing still fail a 0 bound.
Only final rows are judged at the configured severity; on a provisional row every rule is at most
`warn` (its counts can still change), so provisional data never fails a scheduler run.

This module reads the report only from the lake and writes only `sla_results`; it never changes
the report and never decides anything GE did not.
"""

from __future__ import annotations

import sys
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F

from audit.core.config import Config, SlaRule, TopicConfig
from audit.core.errors import InputError
from audit.core.vocabulary import (
    ERROR,
    FINAL,
    SLA_RULE_SPECS,
    STAGE_KINDS,
    WARN,
    SlaRuleSpec,
    rule_explanations,
    stage_kind,
)
from audit.core.windows import EPOCH, floor_window, windows
from audit.serving.report_store import SLA_RESULTS, ReportStore

if TYPE_CHECKING:
    from great_expectations.core import ExpectationSuite

ALL_STAGE_KINDS = STAGE_KINDS

# The rules (audit.core.vocabulary.SLA_RULE_SPECS), by name.
RULES: dict[str, SlaRuleSpec] = {spec.name: spec for spec in SLA_RULE_SPECS}
# Observed columns `with_sla_observations` adds to the report's own.
DUPLICATE_RATIO, COMPLETENESS, REDELIVERY_RATIO = "duplicate_ratio", "completeness", "redelivery_ratio"
DERIVED_COLUMNS = (DUPLICATE_RATIO, COMPLETENESS, REDELIVERY_RATIO)

# the rules that judge a latency: not evaluable on a sink whose rows carry no sink time
LATENCY_RULES = {s.name for s in SLA_RULE_SPECS if s.observed_column.startswith("latency_")}
_KEY = "sla_key"
_WINDOW_US = "window_start_us"


@dataclass
class SlaOutcome:
    """Every `sla_results` row written by one check, and how many failed at each severity."""

    start: datetime
    end: datetime
    rows: list[dict[str, Any]] = field(default_factory=list)
    report_rows: int = 0
    # The producer sessions whose recorded settings explain failed checks at the log stage
    # (`ReportStore.failure_producer_lines`).
    producer_lines: list[str] = field(default_factory=list)
    # (topic, stage, rule) checks that cannot be judged: a latency rule on a sink whose rows carry no
    # sink time (docs/design.md §7); no sla_results row, never a pass
    not_evaluable: set[tuple[str, str, str]] = field(default_factory=set)

    def failed(self, severity: str, topic: str | None = None) -> int:
        """How many rows of this severity failed (of one topic, or of all)."""
        return sum(1 for r in self.rows if not r["passed"] and r["severity"] == severity
                   and (topic is None or r["topic"] == topic))

    @property
    def failed_errors(self) -> int:
        return self.failed(ERROR)

    @property
    def failed_warnings(self) -> int:
        return self.failed(WARN)


# ---------------------------------------------------------------------------------------------
# Pure transform
# ---------------------------------------------------------------------------------------------

def with_sla_observations(report: DataFrame) -> DataFrame:
    """Report rows -> the same rows plus the observed value of every rule, a stage kind and a row key."""
    expected = F.col("expected")
    return (
        report
        .withColumn("stage_kind", F.split(F.col("stage"), ":").getItem(0))
        .withColumn(DUPLICATE_RATIO, F.col("duplicated").cast("double") / F.greatest(expected, F.lit(1)))
        .withColumn(REDELIVERY_RATIO, F.coalesce(F.col("redelivered"), F.lit(0)).cast("double")
                    / F.greatest(expected, F.lit(1)))
        .withColumn(COMPLETENESS, F.when(
            expected > 0,
            (F.col("delivered") + F.coalesce(F.col("dead_lettered"), F.lit(0))).cast("double") / expected))
        .withColumn(_WINDOW_US, F.unix_micros(F.col("window_start")))
        # GE reports unexpected rows by this key; timestamps stay out of it (no time zone round trips).
        .withColumn(_KEY, F.concat_ws("|", F.col(_WINDOW_US).cast("string"), F.col("topic"),
                                      F.col("partition").cast("string"), F.col("stage")))
    )


def _in_range(topics: Iterable[TopicConfig], start: datetime, end: datetime) -> Column:
    """Rows of these topics whose window overlaps [start, end) (windows aligned per topic)."""
    cond: Column | None = None
    for t in topics:
        c = ((F.col("topic") == t.name) & (F.col("window_start") >= F.lit(floor_window(start, t.window)))
             & (F.col("window_start") < F.lit(end)))
        cond = c if cond is None else cond | c
    return cond if cond is not None else F.lit(False)


# ---------------------------------------------------------------------------------------------
# Great Expectations
# ---------------------------------------------------------------------------------------------

def rules_suite(topics: Sequence[TopicConfig]) -> ExpectationSuite:
    """The Great Expectations suite of `topics`, which share one SLA (one expectation per configured
    rule): named after the first topic, and after how many more share it."""
    import great_expectations as gx
    import great_expectations.expectations as gxe
    from great_expectations.expectations.row_conditions import Column as GxColumn

    first = topics[0]
    names = ", ".join(t.name for t in topics)
    suite = gx.ExpectationSuite(name=f"sla_{first.name}" + (f"_and_{len(topics) - 1}_more" if len(topics) > 1 else ""))
    for rule in first.sla:
        spec = RULES[rule.rule]
        kwargs: dict[str, Any] = {"column": spec.observed_column,
                                  "meta": {"rule": rule.rule, "severity": rule.severity, "topic": names}}
        kwargs["max_value" if spec.bound == "max" else "min_value"] = rule.threshold
        if spec.stage_kinds != ALL_STAGE_KINDS:
            kwargs["row_condition"] = GxColumn("stage_kind").is_in(list(spec.stage_kinds))
        suite.add_expectation(gxe.ExpectColumnValuesToBeBetween(**kwargs))
    return suite


def same_sla(topics: Iterable[TopicConfig]) -> list[list[TopicConfig]]:
    """`topics` grouped by their SLA (the same rules, thresholds and severities, in any order), each
    group in the order given: one validation checks a whole group's rows."""
    groups: dict[frozenset[SlaRule], list[TopicConfig]] = {}
    for t in topics:
        groups.setdefault(frozenset(t.sla), []).append(t)
    return list(groups.values())


class _GxRunner:
    """One ephemeral GE context for a check: a Spark datasource and one validation per group of
    topics that share an SLA (`same_sla`)."""

    def __init__(self) -> None:
        import great_expectations as gx
        from great_expectations.data_context.types.base import (
            DataContextConfig,
            InMemoryStoreBackendDefaults,
            ProgressBarsConfig,
        )

        self._gx = gx
        self.context = gx.get_context(mode="ephemeral", project_config=DataContextConfig(
            analytics_enabled=False,  # no network calls from a scheduled job
            progress_bars=ProgressBarsConfig(globally=False),
            store_backend_defaults=InMemoryStoreBackendDefaults(),
        ))
        asset = self.context.data_sources.add_spark("audit_report").add_dataframe_asset("audit_partition_report")
        self.batch_definition = asset.add_batch_definition_whole_dataframe("window_range")

    def unexpected_keys(self, topics: Sequence[TopicConfig], df: DataFrame) -> dict[str, set[str]]:
        """Validate `df` (the rows of `topics`, which share one SLA) against their suite: rule -> keys
        of failing rows."""
        suite = self.context.suites.add(rules_suite(topics))
        validation = self.context.validation_definitions.add(self._gx.ValidationDefinition(
            name=suite.name, data=self.batch_definition, suite=suite))
        result = validation.run(batch_parameters={"dataframe": df}, result_format={
            "result_format": "COMPLETE", "unexpected_index_column_names": [_KEY],
            "return_unexpected_index_query": False})
        failing: dict[str, set[str]] = {}
        for r in result.results:
            assert r.expectation_config is not None  # GE fills it for every result of a suite run
            rule = r.expectation_config.meta["rule"]
            if r.exception_info.get("raised_exception"):
                # A rule GE could not evaluate is an error, never a silent pass.
                which = f"topic {topics[0].name!r}" if len(topics) == 1 else \
                    f"topics {', '.join(repr(t.name) for t in topics)}"
                raise InputError(f"SLA rule {rule} of {which} could not be evaluated: "
                                 f"{r.exception_info.get('exception_message')}")
            failing[rule] = {row[_KEY] for row in r.result.get("unexpected_index_list") or []}
        return failing

    def build_data_docs(self, folder: Path) -> str:
        self.context.add_data_docs_site("msgaudit_sla", {
            "class_name": "SiteBuilder",
            "store_backend": {"class_name": "TupleFilesystemStoreBackend", "base_directory": str(folder)},
            "site_index_builder": {"class_name": "DefaultSiteIndexBuilder"},
        })
        return str(self.context.build_data_docs(site_names=["msgaudit_sla"])["msgaudit_sla"])


# ---------------------------------------------------------------------------------------------
# The check
# ---------------------------------------------------------------------------------------------

def _aware(value: datetime, what: str) -> datetime:
    if not isinstance(value, datetime) or value.tzinfo is None:
        raise InputError(f"{what}: expected a timezone-aware UTC datetime, got {value!r}")
    return value.astimezone(UTC)


def _result_row(rule: SlaRule, row: Any, failing: set[str], checked_at: datetime) -> dict[str, Any]:
    spec = RULES[rule.rule]
    observed = row[spec.observed_column]
    return {
        "window_start": EPOCH + timedelta(microseconds=row[_WINDOW_US]),
        "topic": row["topic"],
        "partition": row["partition"],
        "stage": row["stage"],
        "rule": rule.rule,
        "observed": None if observed is None else float(observed),
        "threshold": rule.threshold,
        "passed": row[_KEY] not in failing,
        # Provisional counts can still change: they may warn, never fail the run.
        "severity": rule.severity if row["status"] == FINAL else WARN,
        "checked_at": checked_at,
    }


def check_sla(spark: SparkSession, cfg: Config, start: datetime, end: datetime,
              topics: Sequence[str] | None = None, *, checked_at: datetime | None = None,
              data_docs_dir: Path | None = None) -> SlaOutcome:
    """Check the SLA of `topics` (default: every configured topic) for windows overlapping [start, end).

    Writes one `sla_results` row per (window_start, topic, partition, stage, rule) to the report
    store, replacing every (topic, window) of the range. Optionally builds GE Data Docs in
    `data_docs_dir`. Raises InputError when the report table is missing or the range is empty.
    """
    from spark_jobs.io.lake import read_table

    start, end = _aware(start, "start"), _aware(end, "end")
    if end <= start:
        raise InputError(f"--end ({end.isoformat()}) must be after --start ({start.isoformat()})")
    checked_at = _aware(checked_at, "checked_at") if checked_at is not None else datetime.now(UTC)
    selected = [cfg.topic(name) for name in (topics or sorted(cfg.topics))]  # ConfigError names unknown ones
    outcome = SlaOutcome(start=start, end=end)
    if not selected:
        return outcome

    report = read_table(spark, cfg, "audit_partition_report")
    rows_df = report.filter(_in_range(selected, start, end)).transform(with_sla_observations).cache()
    try:
        runner = _GxRunner() if any(t.sla for t in selected) else None
        store = ReportStore(cfg.report_store)
        try:
            observed = sorted({RULES[r.rule].observed_column for t in selected for r in t.sla})
            collected: dict[str, list[Any]] = defaultdict(list)
            for row in rows_df.select(_KEY, _WINDOW_US, "topic", "partition", "stage", "status", *observed).collect():
                collected[row["topic"]].append(row)
            failing: dict[str, set[str]] = defaultdict(set)  # rule -> keys of failing rows, every topic's
            # one validation per group of topics that share an SLA, not one per topic
            for group in same_sla(t for t in selected if t.sla and collected[t.name]):
                assert runner is not None  # a topic with rules
                names = [t.name for t in group]
                for name, keys in runner.unexpected_keys(group, rows_df.filter(F.col("topic").isin(names))).items():
                    failing[name] |= keys
            for topic in _progress(selected):
                outcome.report_rows += len(collected[topic.name])
                by_window: dict[datetime, list[dict[str, Any]]] = defaultdict(list)
                timeless = {f"sink:{s.name}" for s in topic.sinks if not s.has_sink_time}
                for row in collected[topic.name]:
                    kind = row["stage"].split(":", 1)[0]
                    for rule in topic.sla:
                        if rule.rule in LATENCY_RULES and row["stage"] in timeless:
                            outcome.not_evaluable.add((topic.name, row["stage"], rule.rule))
                        elif kind in RULES[rule.rule].stage_kinds:
                            by_window[EPOCH + timedelta(microseconds=row[_WINDOW_US])].append(
                                _result_row(rule, row, failing[rule.rule], checked_at))
                # Every window of the range is replaced, so a rerun also clears results of rows that vanished.
                targets = {w for w, _ in windows(start, end, topic.window)} | set(by_window)
                for w in sorted(targets):
                    rows = sorted(by_window.get(w, []), key=lambda r: (r["partition"], r["stage"], r["rule"]))
                    store.replace_window(SLA_RESULTS, topic.name, w, rows)
                    outcome.rows.extend(rows)
            outcome.producer_lines = store.failure_producer_lines([r for r in outcome.rows if not r["passed"]])
        finally:
            store.close()
        if data_docs_dir is not None and runner is not None:
            runner.build_data_docs(Path(data_docs_dir))
    finally:
        rows_df.unpersist()
    outcome.rows.sort(key=lambda r: (r["window_start"], r["topic"], r["partition"], r["stage"], r["rule"]))
    return outcome


def _progress(items: list[TopicConfig]) -> Iterable[TopicConfig]:
    from tqdm import tqdm

    # disable=None: a bar on a terminal, silence in schedulers and tests.
    return tqdm(items, desc="sla", unit="topic", disable=None, file=sys.stderr)


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------

def _fmt(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:g}" if abs(value) < 1e6 else f"{value:.0f}"


def format_table(outcome: SlaOutcome, max_failures: int = 50) -> str:
    """A readable summary: one line per (topic, stage, rule), then every failing check (capped)."""
    unjudged = [f"  NOT EVALUABLE  {topic}  {stage}  {rule}: the sink's rows carry no sink time (map "
                f"sinks[].columns.sink_ts to the time the writer stored the row)"
                for topic, stage, rule in sorted(outcome.not_evaluable)]
    if not outcome.rows:
        return "\n".join([f"SLA {outcome.start.isoformat()} .. {outcome.end.isoformat()}: nothing to check "
                          f"({outcome.report_rows} report rows in range)", *unjudged])
    groups: dict[tuple[str, str, str], list[dict[str, Any]]] = defaultdict(list)
    for r in outcome.rows:
        groups[(r["topic"], r["stage"], r["rule"])].append(r)
    header = ("TOPIC", "STAGE", "RULE", "THRESHOLD", "CHECKS", "FAILED", "WORST", "RESULT")
    lines: list[tuple[str, ...]] = [header]
    for (topic, stage, rule), rows in sorted(groups.items()):
        failed = [r for r in rows if not r["passed"]]
        observed = [r["observed"] for r in rows if r["observed"] is not None]
        worst = (max(observed) if RULES[rule].bound == "max" else min(observed)) if observed else None
        verdict = "PASS"
        if any(r["severity"] == ERROR for r in failed):
            verdict = "FAIL"
        elif failed:
            verdict = "WARN"
        thresholds = sorted({r["threshold"] for r in rows})
        lines.append((topic, stage, rule, "/".join(_fmt(t) for t in thresholds), str(len(rows)),
                      str(len(failed)), _fmt(worst), verdict))
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    out = [f"SLA {outcome.start.isoformat()} .. {outcome.end.isoformat()}: {len(outcome.rows)} checks on "
           f"{outcome.report_rows} report rows, {outcome.failed_errors} failed (error), "
           f"{outcome.failed_warnings} failed (warn)", ""]
    out += ["  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip() for line in lines]
    if unjudged:
        out += ["", "Not evaluable:", *unjudged]
    failures = [r for r in outcome.rows if not r["passed"]]
    if failures:
        out += ["", "Failed checks:"]
        for r in failures[:max_failures]:
            op = "<=" if RULES[r["rule"]].bound == "max" else ">="
            out.append(f"  {r['severity'].upper():5}  {r['window_start'].isoformat()}  {r['topic']}[{r['partition']}]"
                       f"  {r['stage']}  {r['rule']}: {_fmt(r['observed'])} (expected {op} {_fmt(r['threshold'])})")
        if len(failures) > max_failures:
            out.append(f"  ... and {len(failures) - max_failures} more (all rows are in sla_results)")
        out += explain_failures(((stage_kind(r["stage"]), r["rule"]) for r in failures), outcome.producer_lines)
    return "\n".join(out)


def explain_failures(kind_rules: Iterable[tuple[str, str]], producer_lines: Sequence[str] = ()) -> list[str]:
    """'Likely causes' lines for failed (stage kind, rule) pairs: each code that counts in the
    rule's total, with its cause and remedy from the vocabulary (docs/design.md §5); then the
    producer sessions whose recorded settings caused them (`producer_lines`), if any."""
    lines: list[str] = []
    for kind, rule in sorted(set(kind_rules)):
        for code, e in rule_explanations(rule, kind):
            lines.append(f"  {kind} {rule} <- {code}: {e.cause}")
            lines.append(f"      fix: {e.remedy}")
    out = ["", "Likely causes (docs/design.md §5):", *lines] if lines else []
    if producer_lines:
        out += ["", "Producer settings behind them (producer_settings):", *[f"  {line}" for line in producer_lines]]
    return out
