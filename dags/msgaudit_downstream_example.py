"""Example downstream job: `msgaudit_downstream_example`, started by msgaudit's completeness event of a topic.

    exactly_once -> load

The window DAG's `publish` task emits one event per topic and final window on the topic's asset,
`msgaudit://<first bootstrap server>/<topic>` (docs/airflow.md "Completeness events"). This DAG is
scheduled on one such asset (the environment variable MSGAUDIT_DOWNSTREAM_ASSET, read when the file
is parsed; default `msgaudit://127.0.0.1:9092/orders`, the quick start's topic on the local broker).
`exactly_once` lets the run go on only when every window event that triggered it says the window
was complete and exactly once in every stage; otherwise `load` is skipped. `load` stands for your
job: here it returns the windows it would load.

Copy it and replace `load`. This file only declares: no I/O at import time.
"""

from __future__ import annotations

import os
from typing import Any

import pendulum
from airflow.sdk import DAG, Asset, task

ASSET_ENV = "MSGAUDIT_DOWNSTREAM_ASSET"


@task.short_circuit
def exactly_once(triggering_asset_events: Any = None) -> bool:
    """True when every window event of this run was complete and exactly once in every stage."""
    from audit.serving.completeness import all_exactly_once
    from spark_jobs.pipeline.airflow import completeness_events

    return all_exactly_once(completeness_events(triggering_asset_events))


@task
def load(triggering_asset_events: Any = None) -> list[dict[str, Any]]:
    """Your job. The events' extras say which windows are ready: topic, window_start, window_end."""
    from spark_jobs.pipeline.airflow import completeness_events

    return [{k: e[k] for k in ("topic", "window_start", "window_end")}
            for e in completeness_events(triggering_asset_events)]


with DAG(
    dag_id="msgaudit_downstream_example",
    description="example: load a topic's window once msgaudit says it is complete and exactly once",
    schedule=[Asset(os.environ.get(ASSET_ENV, "msgaudit://127.0.0.1:9092/orders"))],
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    tags=["msgaudit", "example"],
    doc_md=__doc__,
) as dag:
    exactly_once() >> load()
