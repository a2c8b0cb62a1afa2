"""What the msgaudit DAGs share: their `default_args`, and what they compute inside their tasks
(never at import): the spark-submit target.

Airflow is imported only inside functions, so `audit` stays importable without it.
"""

from __future__ import annotations

import os
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
    """Where spark-submit finds the application, the jars it must ship, the driver JVM's settings
    (`--conf`s: heap and collector, `Config.driver_jvm`; spark-submit's own default heap is 1 GB), and
    (local master) which Python runs.

    The jars go on `--jars`: under spark-submit the driver JVM exists before `build_spark` runs, so
    setting `spark.jars` there would be too late for the Delta extension. With a `local[...]` master
    the driver runs on this worker, so the driver Python and `spark-submit` must be this environment's.
    Variables `msgaudit_spark_application` and `msgaudit_spark_jars` override both for a cluster whose
    workers see other paths.
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
    env: dict[str, str] = {}
    if str(BaseHook.get_connection("spark_default").host or "").startswith("local"):
        bindir = str(Path(sys.executable).parent)
        env = {"PYSPARK_PYTHON": sys.executable, "PYSPARK_DRIVER_PYTHON": sys.executable,
               "PATH": bindir + os.pathsep + os.environ.get("PATH", "")}
    return {"application": application, "jars": jar_list, "env": env, "conf": cfg.driver_jvm}
