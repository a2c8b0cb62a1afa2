"""On-demand backfill: `msgaudit_backfill`, triggered by hand with params `start`, `end`, `topics`.

    plan -> ingest -> capture[w] -> reconcile[w] -> sla[w]     (one mapped task per window w)

`plan` lists every UTC-aligned window of each selected topic's size that overlaps [start, end)
(`spark_jobs.pipeline.plan.plan_windows`), groups the topics that share a window, and gives each
window the as_of a scheduled run of `msgaudit_window_<size>` uses (`plan.final_as_of`) -- so a
backfill produces the same report rows as the scheduled runs, SLA `checked_at` included, and
re-running it replaces them with identical rows. Windows that are not final yet (as_of still in the future) are refused:
those belong to the scheduled DAG.

Spark steps are `spark-submit spark_jobs/pipeline/submit.py <step>` through the `spark_default`
connection, one window at a time (Delta tables get one writer at a time).

This file only declares: no I/O, no Spark, no config parsing at import time.
"""

from __future__ import annotations

from typing import Any

import pendulum
from airflow.providers.apache.spark.operators.spark_submit import SparkSubmitOperator
from airflow.sdk import DAG, Param, task

from spark_jobs.pipeline.airflow import default_args, submit_target
from spark_jobs.pipeline.plan import WINDOW_STEPS


# What each mapped step takes from a window of `plan` (named functions: DAG serialization needs them).
def capture_args(window: dict[str, list[str]]) -> list[str]:
    return window["capture"]


def reconcile_args(window: dict[str, list[str]]) -> list[str]:
    return window["reconcile"]


def sla_args(window: dict[str, list[str]]) -> list[str]:
    return window["sla"]


STEP_ARGS = {"capture": capture_args, "reconcile": reconcile_args, "sla": sla_args}


@task
def plan(params: dict[str, Any] | None = None, ti: Any = None, dag_run: Any = None) -> list[dict[str, list[str]]]:
    """Per-window spark-submit arguments for [start, end) (no Spark, no Kafka).

    Returns one {capture, reconcile, sla: argv} per window (the list the steps map over) and
    pushes `ingest` (argv), `application` and `env` as XComs of their own."""
    from datetime import UTC, datetime
    from pathlib import Path

    from airflow.sdk import Variable
    from airflow.sdk.exceptions import AirflowFailException

    from audit.core import config as config_mod
    from audit.core.errors import MsgauditError
    from audit.core.windows import parse_instant
    from spark_jobs.pipeline.plan import not_final, plan_windows

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
    per_window = [{step: run.argv(step, str(path)) for step in WINDOW_STEPS} for run in runs]
    ti.xcom_push(key="ingest", value=["ingest", "--config", str(path), "--start", runs[0].start.isoformat(),
                                      "--end", max(r.end for r in runs).isoformat()])
    for key, value in submit_target(cfg).items():
        ti.xcom_push(key=key, value=value)
    return per_window


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
    },
    default_args=default_args(),
    tags=["msgaudit", "backfill"],
    doc_md=__doc__,
) as dag:
    planned: Any = plan()
    previous: Any = SparkSubmitOperator(
        task_id="ingest",
        conn_id="spark_default",
        application=planned["application"],
        jars=planned["jars"],
        py_files=planned["py_files"],
        conf=planned["conf"],
        application_args=planned["ingest"],
        env_vars=planned["env"],
        name="msgaudit-ingest",
    )
    for step in WINDOW_STEPS:
        mapped = SparkSubmitOperator.partial(
            task_id=step,
            conn_id="spark_default",
            application=planned["application"],
            jars=planned["jars"],
            py_files=planned["py_files"],
            conf=planned["conf"],
            env_vars=planned["env"],
            name=f"msgaudit-{step}",
            max_active_tis_per_dagrun=1,
        ).expand(application_args=planned.map(STEP_ARGS[step]))
        previous >> mapped
        previous = mapped
