"""Scheduled reconciliation: one DAG per window size, `msgaudit_window_<size>` (docs/design.md §2, §6).

Each run handles exactly its data interval (one UTC-aligned window) for the configured topics
whose window has that size:

    plan -> wait_for_grace -> window -> publish      (window: ingest -> capture -> reconcile -> sla)

`plan` reads the msgaudit config (path in the Airflow Variable `msgaudit_config`), picks the
topics and fixes `as_of` by the pipeline's one rule (`spark_jobs.pipeline.plan.final_as_of`:
window end + the largest grace among the topics of this window size), so a rerun of the same
interval gives the same rows, SLA `checked_at` included. `wait_for_grace` defers until `as_of`.
`window` is one `spark-submit spark_jobs/pipeline/submit.py window` through the `spark_default`
connection (its host is the master: `local[2]`, `spark://...`, `yarn`, `k8s://...`): the four
pipeline steps in order in one Spark application, so a window pays the JVM and session start
(and a cold JIT) once instead of four times -- more than a small window's own work. Its log holds
each step's summary lines; an error-severity SLA failure fails it with exit code 3 (no retry, an
alert); any other failure is retried, from ingest (every step replaces its own rows).
`publish` (after a success or an SLA breach) emits one completeness event per topic on the asset
`msgaudit://<first bootstrap server>/<topic>`, through the asset alias `msgaudit_window_<size>`
(`spark_jobs.pipeline.airflow.publish_window`): a DAG scheduled on the asset starts with it. It is
a teardown task, so it runs whatever `window` did and the run's state stays `window`'s.

Window sizes come from the environment variable MSGAUDIT_WINDOWS (comma-separated, default
`1h`), read when the file is parsed -- no Variable or database lookup at import time.

This file only declares: no I/O, no Spark, no config parsing at import time.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import pendulum
from airflow.providers.apache.spark.operators.spark_submit import SparkSubmitOperator
from airflow.providers.standard.sensors.date_time import DateTimeSensorAsync
from airflow.sdk import DAG, AssetAlias, Param, task
from airflow.timetables.interval import CronDataIntervalTimetable

from audit.core.config import parse_duration
from spark_jobs.pipeline.airflow import default_args, submit_target, window_alias

WINDOWS_ENV = "MSGAUDIT_WINDOWS"


def window_label(size: timedelta) -> str:
    seconds = int(size.total_seconds())
    for unit, n in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds % n == 0:
            return f"{seconds // n}{unit}"
    return f"{seconds}s"


def window_cron(size: timedelta) -> str:
    """UTC-aligned cron for a window size that divides an hour or a day in whole hours."""
    minutes, rem = divmod(int(size.total_seconds()), 60)
    if rem == 0 and 0 < minutes < 60 and 60 % minutes == 0:
        return f"*/{minutes} * * * *"
    hours, rem = divmod(minutes, 60)
    if rem == 0 and 0 < hours < 24 and 24 % hours == 0:
        return f"0 */{hours} * * *"
    if minutes == 24 * 60:
        return "0 0 * * *"
    raise ValueError(f"{WINDOWS_ENV}: a scheduled window must divide an hour (1m..30m) or a day in whole "
                     f"hours (1h..12h, 1d); got {window_label(size)}")


@task(multiple_outputs=True)
def plan(window: str, params: dict[str, Any] | None = None, data_interval_start: Any = None,
         data_interval_end: Any = None) -> dict[str, Any]:
    """Topics, as_of and spark-submit arguments of this run's data interval (no Spark, no Kafka).

    Pure function of (config file, data interval, params): never the wall clock."""
    from datetime import UTC, datetime
    from pathlib import Path

    from airflow.sdk import Variable
    from airflow.sdk.exceptions import AirflowFailException, AirflowSkipException

    from audit.core import config as config_mod
    from audit.core.errors import MsgauditError
    from audit.core.windows import floor_window
    from spark_jobs.pipeline.plan import plan_windows

    size = parse_duration(window, "window")
    start = datetime.fromtimestamp(data_interval_start.timestamp(), UTC)
    end = datetime.fromtimestamp(data_interval_end.timestamp(), UTC)
    if end - start != size or floor_window(start, size) != start:
        raise AirflowFailException(f"data interval [{start.isoformat()}, {end.isoformat()}) is not one "
                                   f"UTC-aligned {window} window")
    path = Path(Variable.get("msgaudit_config", default="msgaudit.yaml")).resolve()
    try:
        cfg = config_mod.load(path)
        wanted = [cfg.topic(t).name for t in (params or {}).get("topics") or []]
        topics = sorted(n for n, t in cfg.topics.items() if t.window == size and (not wanted or n in wanted))
        if not topics:
            raise AirflowSkipException(f"{cfg.source}: no topic with a {window} window"
                                       + (f" among {', '.join(wanted)}" if wanted else ""))
        [run] = plan_windows(cfg, start, end, topics)
    except MsgauditError as e:  # a bad config will not get better by retrying
        raise AirflowFailException(str(e)) from None
    return {"topics": list(run.topics), "as_of": run.as_of.isoformat(), "window": run.argv("window", str(path)),
            **submit_target(cfg)}


@task
def publish(alias: str, **context: Any) -> list[dict[str, Any]]:
    """One completeness event per topic of the window, once `window` is done (docs/design.md §6.5)."""
    from spark_jobs.pipeline.airflow import publish_window

    return publish_window(alias, context)


def build(size: timedelta) -> DAG:
    label = window_label(size)
    with DAG(
        dag_id=f"msgaudit_window_{label}",
        description=f"msgaudit: ingest, capture, reconcile and check SLAs of every {label} window",
        schedule=CronDataIntervalTimetable(window_cron(size), timezone="UTC"),
        start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
        catchup=False,
        max_active_runs=1,  # one writer per Delta table at a time
        params={"topics": Param([], type="array", items={"type": "string"},
                                description="only these topics (default: every topic with this window size)")},
        default_args=default_args(),
        tags=["msgaudit", "reconcile"],
        doc_md=__doc__,
    ) as dag:
        planned: Any = plan(label)
        wait: Any = DateTimeSensorAsync(task_id="wait_for_grace", target_time=planned["as_of"])
        alias = window_alias(label)
        wait >> SparkSubmitOperator(
            task_id="window",
            conn_id="spark_default",
            application=planned["application"],
            jars=planned["jars"],
            py_files=planned["py_files"],
            conf=planned["conf"],
            application_args=planned["window"],
            env_vars=planned["env"],
            name=f"msgaudit-window-{label}",
        ) >> publish.override(outlets=[AssetAlias(alias)])(alias).as_teardown()  # runs whatever `window` did
    return dag


for _size in dict.fromkeys(parse_duration(w.strip(), WINDOWS_ENV)
                           for w in os.environ.get(WINDOWS_ENV, "1h").split(",") if w.strip()):
    globals()[f"msgaudit_window_{window_label(_size)}"] = build(_size)
