"""What the msgaudit DAGs compute inside their tasks (never at import): the spark-submit target.

Airflow is imported only inside functions, so `audit` stays importable without it.
"""

from __future__ import annotations

import os
from typing import Any


def submit_target() -> dict[str, Any]:
    """Where spark-submit finds the application, the jars it must ship, and (local master) which Python runs.

    The jars go on `--jars`: under spark-submit the driver JVM exists before `build_spark` runs, so
    setting `spark.jars` there would be too late for the Delta extension. With a `local[...]` master
    the driver runs on this worker, so the driver Python and `spark-submit` must be this environment's.
    Variables `msgaudit_spark_application` and `msgaudit_spark_jars` override both for a cluster whose
    workers see other paths.
    """
    import importlib.util
    import sys
    from pathlib import Path

    from airflow.sdk import BaseHook, Variable
    from airflow.sdk.exceptions import AirflowFailException

    from audit import jars
    from audit.errors import SetupError

    application = Variable.get("msgaudit_spark_application", default=None)
    if not application:
        spec = importlib.util.find_spec("spark_jobs.submit")
        if spec is None or spec.origin is None:
            raise AirflowFailException("spark_jobs.submit not found: install msgaudit on the Airflow workers "
                                       "or set the Variable msgaudit_spark_application")
        application = spec.origin
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
    return {"application": application, "jars": jar_list, "env": env}
