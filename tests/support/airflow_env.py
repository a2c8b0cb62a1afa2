"""A throw-away Airflow installation for tests: AIRFLOW_HOME in a tmp folder, SQLite metadata db,
the repo's `dags/` as the DAGs folder, the `spark_default` connection and the msgaudit Variables.

Airflow reads its configuration when `airflow` is first imported, so `configure()` must run before
anything imports it (the fixtures in tests/test_dags.py call it first). It never touches ~/airflow.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
DAGS_FOLDER = REPO / "dags"


def airflow_environ(home: Path, dags_folder: Path = DAGS_FOLDER) -> dict[str, str]:
    """The environment variables that make Airflow live entirely under `home`."""
    return {
        "AIRFLOW_HOME": str(home),
        "AIRFLOW__CORE__DAGS_FOLDER": str(dags_folder),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{home / 'airflow.db'}",
        "AIRFLOW__LOGGING__BASE_LOG_FOLDER": str(home / "logs"),
        "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION": "False",
    }


def configure(home: Path, dags_folder: Path = DAGS_FOLDER) -> dict[str, str]:
    """Point this process's Airflow at `home`. Refuses if Airflow was already imported elsewhere."""
    env = airflow_environ(home, dags_folder)
    current = os.environ.get("AIRFLOW_HOME")
    if "airflow" in sys.modules and current != env["AIRFLOW_HOME"]:
        raise RuntimeError("airflow was imported before tests.support.airflow_env.configure(); "
                           f"it is configured for AIRFLOW_HOME={current!r}")
    home.mkdir(parents=True, exist_ok=True)
    os.environ.update(env)
    return env


def init_db() -> None:
    """Create the metadata tables in the SQLite db (fresh schema, no migrations replayed)."""
    from airflow import settings
    from airflow.utils import db

    settings.configure_orm()
    db.resetdb(skip_init=False)


def set_connection(conn_id: str, conn_type: str, host: str, extra: Mapping[str, Any] | None = None) -> None:
    """Create or replace a connection in the metadata db."""
    from airflow.models import Connection
    from airflow.utils.session import create_session

    with create_session() as session:
        session.query(Connection).filter(Connection.conn_id == conn_id).delete()
        session.add(Connection(conn_id=conn_id, conn_type=conn_type, host=host,
                               extra=json.dumps(dict(extra or {}))))


def set_variables(values: Mapping[str, str]) -> None:
    """Create or replace Airflow Variables in the metadata db."""
    from airflow.models import Variable

    for key, value in values.items():
        Variable.set(key, value)


def delete_variables(keys: list[str]) -> None:
    from airflow.models import Variable

    for key in keys:
        Variable.delete(key)


def setup(home: Path, spark_master: str = "local[2]", variables: Mapping[str, str] | None = None,
          dags_folder: Path = DAGS_FOLDER) -> dict[str, str]:
    """configure() + init_db() + `spark_default` (master `spark_master`) + Variables."""
    env = configure(home, dags_folder)
    init_db()
    set_connection("spark_default", "spark", spark_master)
    if variables:
        set_variables(variables)
    return env
