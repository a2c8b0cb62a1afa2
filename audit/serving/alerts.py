"""SLA alerts for the Airflow DAGs: the failure callback, its notifiers, and the retry policy that
keeps an SLA breach from being retried.

`sla_failure_callback(context)` is the `on_failure_callback` of every Spark step of the msgaudit
DAGs. It builds one `Alert` (which DAG, window, step, and -- read back from the report store --
which SLA rules failed), logs it on the `msgaudit.alerts` logger, appends it as one JSON line to
the file named by the Airflow Variable `msgaudit_alert_log` when set, and sends it through
Airflow's notifiers when they are configured:

* Variable `msgaudit_alert_email` (comma-separated addresses): `SmtpNotifier` over the SMTP
  connection `msgaudit_alert_smtp_conn` (default: Airflow's `[email] email_conn_id`, smtp_default).
* Variable `msgaudit_alert_slack_webhook_conn` (a Slack incoming-webhook connection id):
  `SlackWebhookNotifier` from apache-airflow-providers-slack.

A notifier that fails is logged and skipped: the task already failed, the alert must not hide why.

`spark_submit_retry_policy()` returns the retry policy of those steps: exit code 3 of
`spark_jobs/pipeline/submit.py sla`, `... window` or `... backfill` (an error-severity SLA rule
failed; the alert lists the failed rules of the task's window or range) fails the task at once -- the same
report would fail again -- and everything else (broker, cluster, store hiccups) is retried with
the task's exponential backoff.

This module must stay importable without Airflow (the `audit` package does not depend on it):
Airflow is imported only inside the functions that need it.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from audit.core.vocabulary import ERROR, ExitCode, rule_explanations, stage_kind

log = logging.getLogger("msgaudit.alerts")

SLA_EXIT_CODE = ExitCode.SLA_FAILED.value  # spark_jobs/pipeline/submit.py: an error-severity SLA rule failed
# the submit.py steps that check SLAs: `window` (the scheduled DAGs' task) and `backfill` (every window of its range)
SLA_STEPS = ("sla", "window", "backfill")

VAR_CONFIG = "msgaudit_config"
VAR_ALERT_LOG = "msgaudit_alert_log"
VAR_ALERT_EMAIL = "msgaudit_alert_email"
VAR_ALERT_SMTP_CONN = "msgaudit_alert_smtp_conn"
VAR_ALERT_SLACK_CONN = "msgaudit_alert_slack_webhook_conn"
DEFAULT_CONFIG = "msgaudit.yaml"

_EXIT_CODE_RE = re.compile(r"Error code is: (-?\d+)")


@dataclass(frozen=True)
class FailedRule:
    """One failed row of `sla_results` (docs/design.md §4, §7)."""

    window_start: str
    topic: str
    partition: int | None
    stage: str | None
    rule: str
    observed: float | None
    threshold: float | None
    severity: str

    def describe(self) -> str:
        where = self.topic if self.partition is None else f"{self.topic}[{self.partition}]"
        stage = f" {self.stage}" if self.stage else ""
        return (f"{where}{stage} {self.rule}: observed {self.observed:g} vs threshold {self.threshold:g} "
                f"({self.severity}, window {self.window_start})"
                if self.observed is not None and self.threshold is not None
                else f"{where}{stage} {self.rule} ({self.severity}, window {self.window_start})")


@dataclass(frozen=True)
class Alert:
    """Everything an on-call engineer needs to find the failed window."""

    dag_id: str
    run_id: str
    task_id: str
    map_index: int
    step: str | None  # ingest | capture | reconcile | sla (from the spark-submit arguments)
    window_start: str | None
    window_end: str | None
    topics: tuple[str, ...]
    exit_code: int | None
    sla_breach: bool
    error: str
    failed_rules: tuple[FailedRule, ...] = field(default=())
    # The producer sessions whose recorded settings explain failed log checks (producer_failure_lines).
    producer_lines: tuple[str, ...] = field(default=())

    @property
    def subject(self) -> str:
        what = "SLA breach" if self.sla_breach else f"{self.step or self.task_id} failed"
        return f"msgaudit {what}: {self.dag_id} [{self.window_start} .. {self.window_end})"

    def text(self) -> str:
        lines = [self.subject, f"run {self.run_id}, task {self.task_id}"
                 + (f"[{self.map_index}]" if self.map_index >= 0 else "")
                 + (f", topics {', '.join(self.topics)}" if self.topics else "")]
        lines += [f"  - {r.describe()}" for r in self.failed_rules]
        lines += _why(self.failed_rules)
        lines += [f"  producer: {line}" for line in self.producer_lines]
        if not self.failed_rules:
            lines.append(f"  error: {self.error}")
        return "\n".join(lines)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True, default=str)


# ---- pure helpers ---------------------------------------------------------------------------------

def _why(rules: Sequence[FailedRule]) -> list[str]:
    """The cause and remedy of each code that can fail each failed rule (docs/design.md §5)."""
    pairs = sorted({(stage_kind(r.stage), r.rule) for r in rules if r.stage})
    return [f"  why {kind} {rule} <- {code}: {e.cause}; fix: {e.remedy}"
            for kind, rule in pairs for code, e in rule_explanations(rule, kind)]


def parse_submit_args(args: Sequence[Any] | None) -> dict[str, Any]:
    """`[step, --config F, --start S, --end E, --as-of A, --topic T ...]` -> a dict (step, config,
    start, end, as_of, topics). Unknown flags are ignored."""
    out: dict[str, Any] = {"step": None, "config": None, "start": None, "end": None, "as_of": None,
                           "topics": []}
    items = [str(a) for a in (args or [])]
    if items and not items[0].startswith("--"):
        out["step"] = items[0]
    flags = {"--config": "config", "--start": "start", "--end": "end", "--as-of": "as_of"}
    for i, item in enumerate(items[:-1]):
        if item in flags:
            out[flags[item]] = items[i + 1]
        elif item == "--topic":
            out["topics"].append(items[i + 1])
    return out


def exit_code_of(exception: BaseException | None, task: Any = None) -> int | None:
    """The spark-submit exit code behind a SparkSubmitOperator failure, if there was one."""
    proc = getattr(getattr(task, "_hook", None), "_submit_sp", None)
    code = getattr(proc, "returncode", None)
    if isinstance(code, int):
        return code
    m = _EXIT_CODE_RE.search(str(exception or ""))
    return int(m.group(1)) if m else None


def failed_rules(report_store_url: str, start: datetime, end: datetime,
                 topics: Sequence[str] = ()) -> tuple[FailedRule, ...]:
    """Failed `sla_results` rows of windows starting in [start, end), error severity first."""
    from audit.serving.report_store import ReportStore

    rows: list[Mapping[str, Any]] = []
    with ReportStore(report_store_url) as store:
        selection: list[str | None] = list(topics) or [None]
        for topic in selection:
            rows += [r for r in store.read("sla_results", topic=topic, start=start, end=end) if not r["passed"]]
    rules = [FailedRule(window_start=_iso(r["window_start"]), topic=r["topic"], partition=r.get("partition"),
                        stage=r.get("stage"), rule=r["rule"], observed=r.get("observed"),
                        threshold=r.get("threshold"), severity=r["severity"]) for r in rows]
    return tuple(sorted(rules, key=lambda r: (r.severity != ERROR, r.window_start, r.topic,
                                              r.partition if r.partition is not None else -1,
                                              r.stage or "", r.rule)))


def producer_failure_lines(report_store_url: str, rules: Sequence[FailedRule]) -> tuple[str, ...]:
    """The producer sessions behind failed log checks, named with their recorded settings
    (`ReportStore.failure_producer_lines`; the same lines `msgaudit sla` prints)."""
    from audit.serving.report_store import ReportStore

    with ReportStore(report_store_url) as store:
        return tuple(store.failure_producer_lines([asdict(r) for r in rules]))


def _iso(value: Any) -> str:
    return value.isoformat() if isinstance(value, datetime) else str(value)


def _instant(text: str | None, fallback: Any) -> datetime | None:
    from audit.core.windows import parse_instant

    if text:
        return parse_instant(text)
    if isinstance(fallback, datetime):
        return fallback.astimezone(UTC)
    return None


# ---- Airflow-facing -------------------------------------------------------------------------------

def _variable(key: str, default: str | None = None) -> str | None:
    from airflow.sdk import Variable

    try:
        value = Variable.get(key, default=default)
    except Exception:  # no Variable backend reachable: treat as not configured
        log.warning("msgaudit alerts: cannot read Airflow Variable %s; treating it as unset", key)
        return default
    return None if value is None else str(value)


def build_alert(context: Mapping[str, Any]) -> Alert:
    """An `Alert` from a task failure context (scheduled, backfill or mapped task)."""
    ti = context.get("ti") or context.get("task_instance")
    task = context.get("task") or getattr(ti, "task", None)
    exception = context.get("exception")
    submit = parse_submit_args(getattr(task, "application_args", None))
    start = _instant(submit["start"], context.get("data_interval_start"))
    end = _instant(submit["end"], context.get("data_interval_end"))
    code = exit_code_of(exception, task)
    breach = submit["step"] in SLA_STEPS and code == SLA_EXIT_CODE
    rules: tuple[FailedRule, ...] = ()
    producers: tuple[str, ...] = ()
    if breach and start is not None and end is not None:
        try:
            from audit.core import config as config_mod

            cfg = config_mod.load(submit["config"] or _variable(VAR_CONFIG, DEFAULT_CONFIG))
            rules = failed_rules(cfg.report_store, start, end, submit["topics"])
            producers = producer_failure_lines(cfg.report_store, rules)
        except Exception as e:  # the alert must go out even when the store cannot say why
            log.warning("msgaudit alerts: could not read the failed SLA rules: %s", e)
    dag_run = context.get("dag_run")
    return Alert(
        dag_id=str(getattr(ti, "dag_id", None) or getattr(context.get("dag"), "dag_id", "")),
        run_id=str(getattr(ti, "run_id", None) or getattr(dag_run, "run_id", "")),
        task_id=str(getattr(ti, "task_id", "")),
        map_index=int(getattr(ti, "map_index", -1) if getattr(ti, "map_index", None) is not None else -1),
        step=submit["step"],
        window_start=start.isoformat() if start else None,
        window_end=end.isoformat() if end else None,
        topics=tuple(submit["topics"]),
        exit_code=code,
        sla_breach=breach,
        error=str(exception) if exception is not None else "",
        failed_rules=rules,
        producer_lines=producers,
    )


def notifiers(alert: Alert) -> list[Any]:
    """The Airflow notifiers configured through Variables (see the module docstring)."""
    out: list[Any] = []
    emails = _variable(VAR_ALERT_EMAIL)
    if emails:
        from airflow.providers.smtp.notifications.smtp import SmtpNotifier

        html = "<pre>" + alert.text().replace("&", "&amp;").replace("<", "&lt;") + "</pre>"
        out.append(SmtpNotifier(to=[e.strip() for e in emails.split(",") if e.strip()],
                                subject=alert.subject, html_content=html,
                                smtp_conn_id=_variable(VAR_ALERT_SMTP_CONN)))
    slack_conn = _variable(VAR_ALERT_SLACK_CONN)
    if slack_conn:
        try:
            from airflow.providers.slack.notifications.slack_webhook import SlackWebhookNotifier
        except ImportError:
            log.error("msgaudit alerts: Variable %s is set but apache-airflow-providers-slack is not "
                      "installed; no Slack alert sent", VAR_ALERT_SLACK_CONN)
        else:
            out.append(SlackWebhookNotifier(slack_webhook_conn_id=slack_conn, text=alert.text()))
    return out


def sla_failure_callback(context: Mapping[str, Any]) -> None:
    """on_failure_callback: log the alert, append it to the alert log, send it through notifiers."""
    alert = build_alert(context)
    log.error("%s", alert.text())
    path = _variable(VAR_ALERT_LOG)
    if path:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        with p.open("a", encoding="utf-8") as f:
            f.write(alert.to_json() + "\n")
    for notifier in notifiers(alert):
        try:
            notifier(dict(context))
        except Exception as e:
            log.error("msgaudit alerts: notifier %s failed: %s", type(notifier).__name__, e)


def spark_submit_retry_policy() -> Any:
    """Retry policy for the spark-submit steps: an SLA breach (exit 3 of the sla step) fails at
    once; any other failure falls through to the task's retries with exponential backoff."""
    from airflow.sdk import RetryDecision, RetryPolicy

    class SlaBreachIsFinal(RetryPolicy):
        def evaluate(self, exception: BaseException, try_number: int, max_tries: int,
                     context: Any = None) -> RetryDecision:
            task = (context or {}).get("task")
            step = parse_submit_args(getattr(task, "application_args", None))["step"]
            if step in SLA_STEPS and exit_code_of(exception, task) == SLA_EXIT_CODE:
                return RetryDecision.fail("SLA breach: the same report would fail again")
            return RetryDecision.default()

        def serialize(self) -> dict[str, Any]:
            return {"__type": "msgaudit.SlaBreachIsFinal"}

    return SlaBreachIsFinal()
