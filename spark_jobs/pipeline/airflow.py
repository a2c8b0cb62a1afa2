"""What the msgaudit DAGs share: their `default_args`, and what they compute inside their tasks
(never at import): the spark-submit target, the window's completeness events and a downstream
DAG's view of them.

Airflow is imported only inside functions, so `audit` stays importable without it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from datetime import timedelta
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from audit.core.config import Config


def default_args() -> dict[str, Any]:
    """`default_args` of every msgaudit DAG: 3 retries with exponential backoff (1 min, at most 30 min),
    except an SLA breach, which fails at once (`spark_submit_retry_policy`); every failure alerts.

    No I/O: DAG files call it at import time."""
    from audit.serving.alerts import sla_failure_callback, spark_submit_retry_policy

    return {
        "retries": 3,
        "retry_delay": timedelta(minutes=1),
        "retry_exponential_backoff": 2.0,  # the multiplier (Airflow 3.3 turns True into 2.0 only when deserializing)
        "max_retry_delay": timedelta(minutes=30),
        "retry_policy": spark_submit_retry_policy(),
        "on_failure_callback": sla_failure_callback,
    }


def submit_target(cfg: Config) -> dict[str, Any]:
    """Where spark-submit finds the application, the jars it must ship, the project's Python for the
    executors, the driver JVM's settings (`--conf`s: heap and collector, `Config.driver_jvm`;
    spark-submit's own default heap is 1 GB), and which Python runs.

    The jars go on `--jars`: under spark-submit the driver JVM exists before `build_spark` runs, so
    setting `spark.jars` there would be too late for the Delta extension. The driver runs on this
    worker (client deploy mode), so the driver Python and `spark-submit` are this environment's.
    With a cluster master (`spark://...`, `yarn`, `k8s://...`) the executors run elsewhere: they get
    `audit` + `spark_jobs` as a zip on `--py-files` (`audit.runtime.bundle.python_bundle`) and
    PYSPARK_PYTHON names their interpreter (this one, unless the Variable `msgaudit_spark_python`
    names the workers' own). Variables `msgaudit_spark_application`, `msgaudit_spark_jars` and
    `msgaudit_spark_py_files` override the paths for a cluster whose machines see other paths.
    """
    import sys
    from pathlib import Path

    from airflow.sdk import BaseHook, Variable
    from airflow.sdk.exceptions import AirflowFailException

    from audit.core.errors import SetupError
    from audit.runtime import jars

    application = Variable.get("msgaudit_spark_application", default=None)
    if not application:
        from spark_jobs.pipeline import submit  # light: argument parsing, no Spark at import

        application = submit.__file__
    jar_list = Variable.get("msgaudit_spark_jars", default=None)
    if not jar_list:
        try:
            jar_list = ",".join(str(p) for p in jars.jars("spark-deps"))
        except SetupError as e:
            raise AirflowFailException(str(e)) from None
    master = str(BaseHook.get_connection("spark_default").host or "")
    bindir = str(Path(sys.executable).parent)
    env = {"PYSPARK_PYTHON": sys.executable, "PYSPARK_DRIVER_PYTHON": sys.executable,
           "PATH": bindir + os.pathsep + os.environ.get("PATH", "")}
    py_files = ""
    if not master.startswith("local"):
        from audit.runtime.bundle import python_bundle

        env["PYSPARK_PYTHON"] = Variable.get("msgaudit_spark_python", default=None) or sys.executable
        py_files = Variable.get("msgaudit_spark_py_files", default=None) or str(python_bundle())
    return {"application": application, "jars": jar_list, "py_files": py_files, "env": env,
            "conf": cfg.driver_jvm}


def window_alias(label: str) -> str:
    """The asset alias the window DAG `msgaudit_window_<label>` emits its topics' completeness events through."""
    return f"msgaudit_window_{label}"


def publish_window(alias: str, context: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The window DAG's `publish` task: one completeness event per topic of the run's window
    (`audit.serving.completeness`), on the topic's asset, through the DAG's asset alias `alias`.

    It runs once `window` is done: after a success, or after an SLA breach (exit 3: the report is
    final, the breach is in the event's counts). Any other outcome, or a run whose plan was
    skipped, emits nothing (the task is skipped, saying why). Returns the events' assets and extras."""
    from airflow.sdk import Asset, AssetAlias
    from airflow.sdk.exceptions import AirflowSkipException

    from audit.core import config as config_mod
    from audit.core.windows import parse_instant
    from audit.serving import completeness
    from audit.serving.alerts import parse_submit_args

    ti = context["ti"]
    argv = ti.xcom_pull(task_ids="plan", key="window")
    if not argv:
        raise AirflowSkipException("no window planned in this run: no completeness event")
    args = parse_submit_args(argv)
    start, end, as_of = (parse_instant(args[k], k) for k in ("start", "end", "as_of"))
    topics = list(args["topics"])
    cfg = config_mod.load(args["config"])
    state = ti.get_task_states(dag_id=ti.dag_id, task_ids=["window"], run_ids=[ti.run_id]).get(ti.run_id, {})
    outcome = state.get("window")
    if outcome != "success" and not completeness.sla_breached(cfg.report_store, topics, start, end, as_of):
        raise AirflowSkipException(f"window [{start.isoformat()}, {end.isoformat()}) did not finish (task window: "
                                   f"{outcome}): no completeness event; a rerun of the window emits it")
    events = context["outlet_events"][AssetAlias(alias)]
    out = []
    for topic, extra in completeness.window_extras(cfg.report_store, topics, start, end, as_of).items():
        uri = completeness.asset_uri(cfg.kafka.get("bootstrap.servers", ""), topic)
        events.add(Asset(uri), extra=extra)
        out.append({"asset": uri, "extra": extra})
    return out


def completeness_events(triggering_asset_events: Any) -> list[dict[str, Any]]:
    """The extras of the msgaudit completeness events that triggered a downstream run, oldest first
    (each event once, though the accessor also lists it under the alias it came through)."""
    from airflow.sdk import Asset

    out = []
    for key in triggering_asset_events or {}:
        if isinstance(key, Asset) and key.uri.startswith("msgaudit://"):
            out += [dict(e.extra) for e in triggering_asset_events[key]]
    return out
