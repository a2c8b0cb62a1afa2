"""On-demand backfill: `msgaudit_backfill`, triggered by hand with params `start`, `end`, `topics`, `force`.

    plan -> ingest -> backfill -> publish

`plan` lists every UTC-aligned window of each selected topic's size that overlaps [start, end)
(`spark_jobs.pipeline.plan.plan_windows`), refuses the range if any of them is not final yet (its
as_of still in the future: those belong to the scheduled DAG), and returns the windows with the
as_of each is judged at -- the instant a scheduled run of `msgaudit_window_<size>` uses
(`plan.final_as_of`), so a backfill produces the same report rows as the scheduled runs, SLA
`checked_at` included.

`backfill` is one `spark-submit spark_jobs/pipeline/submit.py backfill` over the range: capture,
reconcile and SLA of every window in one Spark application (the topics sharing a window together),
so the range pays the JVM and session start once instead of three times per window. Finished
windows are recorded in `<home>/backfill-state.json`: a retry resumes where the failed try stopped,
and a new run skips windows an earlier run finished (their rows would be identical) unless `force`
is set. An SLA breach in any window fails the task once every window has run (exit 3, no retry;
the alert lists the failed rules of the whole range).

`publish` (a teardown of `backfill`: it runs whatever `backfill` did, and the run's state stays
`backfill`'s) emits the completeness event of each topic and window the run finished, as the window
DAG's `publish` does (same asset `msgaudit://<first bootstrap server>/<topic>`, same extra), through
the asset alias `msgaudit_backfill` (`spark_jobs.pipeline.airflow.publish_backfill`). Windows an
earlier run finished (skipped here) emit nothing again.

This file only declares: no I/O, no Spark, no config parsing at import time.
"""

from __future__ import annotations

from typing import Any

import pendulum
from airflow.providers.apache.spark.operators.spark_submit import SparkSubmitOperator
from airflow.sdk import DAG, AssetAlias, Param, task

from spark_jobs.pipeline.airflow import backfill_alias, default_args, submit_target


@task
def plan(params: dict[str, Any] | None = None, ti: Any = None, dag_run: Any = None) -> list[dict[str, Any]]:
    """The windows of [start, end) and the spark-submit arguments that run them (no Spark, no Kafka).

    Returns one {start, end, topics, as_of} per window (what the backfill step will run, for the
    run's record) and pushes `ingest` and `backfill` (argv), `application`, `jars`, `py_files`,
    `conf` and `env` as XComs of their own, and for `publish` the config's path (`config`) and the
    windows already finished before this run (`done_before`; none with `force`)."""
    from datetime import UTC, datetime
    from pathlib import Path

    from airflow.sdk import Variable
    from airflow.sdk.exceptions import AirflowFailException

    from audit.core import config as config_mod
    from audit.core.errors import MsgauditError
    from audit.core.windows import parse_instant
    from spark_jobs.pipeline.airflow import backfill_done
    from spark_jobs.pipeline.plan import backfill_argv, not_final, plan_windows, range_argv

    params = params or {}
    path = Path(Variable.get("msgaudit_config", default="msgaudit.yaml")).resolve()
    try:
        start = parse_instant(str(params.get("start") or ""), "start")
        end = parse_instant(str(params.get("end") or ""), "end")
        cfg = config_mod.load(path)
        runs = plan_windows(cfg, start, end, params.get("topics") or None)
    except MsgauditError as e:  # bad params or config will not get better by retrying
        raise AirflowFailException(str(e)) from None
    # Finality is judged at the instant the run was triggered (never the wall clock, never as data).
    early = not_final(runs, datetime.fromtimestamp(dag_run.run_after.timestamp(), UTC))
    if early:
        w = early[0]
        raise AirflowFailException(
            f"window [{w.start.isoformat()}, {w.end.isoformat()}) is not final until {w.as_of.isoformat()}; "
            "backfill past windows only (the scheduled msgaudit_window DAG handles the rest)")
    ti.xcom_push(key="ingest", value=range_argv("ingest", str(path), runs[0].start, max(r.end for r in runs)))
    ti.xcom_push(key="backfill", value=backfill_argv(str(path), start, end, params.get("topics") or None,
                                                     force=bool(params.get("force"))))
    for key, value in submit_target(cfg).items():
        ti.xcom_push(key=key, value=value)
    ti.xcom_push(key="config", value=str(path))
    ti.xcom_push(key="done_before", value=[] if params.get("force") else backfill_done(cfg))
    return [{"start": r.start.isoformat(), "end": r.end.isoformat(), "topics": list(r.topics),
             "as_of": r.as_of.isoformat()} for r in runs]


@task
def publish(alias: str, **context: Any) -> list[dict[str, Any]]:
    """One completeness event per topic of each window this run finished (docs/design.md §6.5)."""
    from spark_jobs.pipeline.airflow import publish_backfill

    return publish_backfill(alias, context)


with DAG(
    dag_id="msgaudit_backfill",
    description="msgaudit: capture, reconcile and check SLAs of every window in a past range",
    schedule=None,
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    params={
        "start": Param(type="string", format="date-time", description="range start, ISO 8601 UTC"),
        "end": Param(type="string", format="date-time", description="range end (exclusive), ISO 8601 UTC"),
        "topics": Param([], type="array", items={"type": "string"},
                        description="only these topics (default: every configured topic)"),
        "force": Param(False, type="boolean",
                       description="redo windows an earlier backfill finished (default: skip them)"),
    },
    default_args=default_args(),
    tags=["msgaudit", "backfill"],
    doc_md=__doc__,
) as dag:
    planned: Any = plan()
    steps = {step: SparkSubmitOperator(
        task_id=step,
        conn_id="spark_default",
        application=planned["application"],
        jars=planned["jars"],
        py_files=planned["py_files"],
        conf=planned["conf"],
        application_args=planned[step],
        env_vars=planned["env"],
        name=f"msgaudit-{step}",
    ) for step in ("ingest", "backfill")}
    alias = backfill_alias()
    steps["ingest"] >> steps["backfill"] >> publish.override(outlets=[AssetAlias(alias)])(alias).as_teardown()
