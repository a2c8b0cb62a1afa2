"""What the msgaudit DAGs share: their `default_args`, and what they compute inside their tasks
(never at import): the spark-submit target, the window's completeness events and a downstream
DAG's view of them.

Airflow is imported only inside functions, so `audit` stays importable without it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from datetime import datetime, timedelta
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


def backfill_alias() -> str:
    """The asset alias the backfill DAG emits the completeness events of the windows it finishes through."""
    return "msgaudit_backfill"


def _emit(context: Mapping[str, Any], alias: str, cfg: Config, topics: list[str], start: datetime, end: datetime,
          as_of: datetime) -> list[dict[str, Any]]:
    """One completeness event per topic of a final window (`completeness.window_events`), on the
    topic's asset, through the task's asset alias `alias`; returns the events' assets and extras."""
    from airflow.sdk import Asset, AssetAlias

    from audit.serving import completeness

    events = context["outlet_events"][AssetAlias(alias)]
    out = []
    for uri, extra in completeness.window_events(cfg, topics, start, end, as_of):
        events.add(Asset(uri), extra=extra)
        out.append({"asset": uri, "extra": extra})
    return out


def publish_window(alias: str, context: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The window DAG's `publish` task: one completeness event per topic of the run's window
    (`audit.serving.completeness`), on the topic's asset, through the DAG's asset alias `alias`.

    It runs once `window` is done: after a success, or after an SLA breach (exit 3: the report is
    final, the breach is in the event's counts). Any other outcome, or a run whose plan was
    skipped, emits nothing (the task is skipped, saying why). Returns the events' assets and extras."""
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
    return _emit(context, alias, cfg, topics, start, end, as_of)


def backfill_done(cfg: Config) -> list[str]:
    """The (topic, window, as_of) keys the backfill state holds as finished (`<home>/backfill-state.json`):
    what the backfill DAG's `plan` records before the range runs."""
    from spark_jobs.pipeline.backfill import STATE_FILE, BackfillState

    return sorted(BackfillState(cfg.home / STATE_FILE).done)


def publish_backfill(alias: str, context: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The backfill DAG's `publish` task: one completeness event per topic of every window of the range
    that the run finished -- recorded in the backfill state now and not before the run (`plan`'s
    `done_before`; empty with `force`, whose windows are all redone) -- on the topic's asset, through
    `alias`. It runs whatever `backfill` did: after an SLA breach (exit 3) every window ran; after
    another failure the windows finished before it are final and emit, the others do not (a rerun
    finishes them and emits theirs). Returns the events' assets and extras, oldest window first."""
    from airflow.sdk.exceptions import AirflowSkipException

    from audit.core import config as config_mod
    from audit.core.windows import parse_instant
    from spark_jobs.pipeline.backfill import STATE_FILE, BackfillState, state_key

    ti = context["ti"]
    windows = ti.xcom_pull(task_ids="plan")
    config = ti.xcom_pull(task_ids="plan", key="config")
    if not windows or not config:
        raise AirflowSkipException("no window planned in this run: no completeness event")
    before = set(ti.xcom_pull(task_ids="plan", key="done_before") or [])
    cfg = config_mod.load(config)
    state = BackfillState(cfg.home / STATE_FILE)
    out: list[dict[str, Any]] = []
    for w in sorted(windows, key=lambda w: (w["start"], w["end"])):
        start, end, as_of = (parse_instant(w[k], k) for k in ("start", "end", "as_of"))
        done = [t for t in w["topics"] if (key := state_key(t, start, as_of)) in state and key not in before]
        if done:
            out += _emit(context, alias, cfg, done, start, end, as_of)
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
