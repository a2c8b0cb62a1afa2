"""A throw-away Airflow installation for tests: AIRFLOW_HOME in a tmp folder, SQLite metadata db,
the repo's `dags/` as the DAGs folder, the `spark_default` connection and the msgaudit Variables.

Airflow reads its configuration when `airflow` is first imported, so `configure()` must run before
anything imports it (the fixtures in tests/test_dags.py call it first). It never touches ~/airflow.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
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
        # Every sync stores a changed DAG at once (default: at most every 30 s), e.g. a downstream
        # DAG whose asset a test names in the environment.
        "AIRFLOW__CORE__MIN_SERIALIZED_DAG_UPDATE_INTERVAL": "0",
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


def run_asset_triggered(dag: Any) -> Any:
    """The scheduler's own step for `dag`'s queued asset events (`_create_dag_runs_asset_triggered`:
    one asset-triggered run consuming them), then that run's tasks in this process, as `dag.test()`
    runs a manual run's. `dag` is the parsed (SDK) DAG. Returns the run's state, its tasks' states,
    the extras of the events it consumed and its tasks' return values, or None when no event was
    queued for it."""
    from airflow.jobs.job import Job
    from airflow.jobs.scheduler_job_runner import SchedulerJobRunner
    from airflow.models.dag import DagModel
    from airflow.models.dagrun import DagRun
    from airflow.models.xcom import XComModel
    from airflow.sdk.definitions.dag import _run_task
    from airflow.serialization.serialized_objects import DagSerialization
    from airflow.utils.session import create_session
    from airflow.utils.state import DagRunState, TaskInstanceState
    from airflow.utils.types import DagRunType

    with create_session() as session:
        query, triggered = DagModel.dags_needing_dagruns(session)
        due = [d for d in query.all() if d.dag_id == dag.dag_id and d.dag_id in triggered]
        if not due:
            return None
        SchedulerJobRunner(job=Job())._create_dag_runs_asset_triggered(dag_models=due, session=session)
    with create_session() as session:
        dr = session.query(DagRun).filter(DagRun.dag_id == dag.dag_id, DagRun.run_type == DagRunType.ASSET_TRIGGERED,
                                          DagRun.state == DagRunState.QUEUED).one()
        run_id = dr.run_id
        dr.state = DagRunState.RUNNING  # what the scheduler does next with a queued run
        session.commit()
        dr.dag = DagSerialization.deserialize_dag(DagSerialization.serialize_dag(dag))
        for _ in range(100):  # a few rounds for a few tasks; never hang a test
            if dr.state != DagRunState.RUNNING:
                break
            session.expire_all()
            schedulable, _ = dr.update_state(session=session)
            for ti in schedulable:
                ti.try_number += 1
                ti.state = TaskInstanceState.SCHEDULED
            session.commit()
            for ti in [t for t in dr.get_task_instances(session=session) if t.state == TaskInstanceState.SCHEDULED]:
                _run_task(ti=ti, task=dag.task_dict[ti.task_id])
    with create_session() as session:
        dr = session.query(DagRun).filter(DagRun.dag_id == dag.dag_id, DagRun.run_id == run_id).one()
        xcom = session.query(XComModel).filter(XComModel.dag_id == dag.dag_id, XComModel.run_id == run_id,
                                               XComModel.key == "return_value").all()
        return {"state": str(dr.state), "run_type": str(dr.run_type),
                "states": {ti.task_id: str(ti.state) for ti in dr.get_task_instances(session=session)},
                "consumed": [dict(e.extra) for e in dr.consumed_asset_events],
                "returned": {x.task_id: XComModel.deserialize_value(x) for x in xcom}}


def asset_events(uri: str) -> list[dict[str, Any]]:
    """Every event of the asset `uri` in the metadata db, oldest first: source dag/run/task and extra."""
    from airflow.models.asset import AssetEvent, AssetModel
    from airflow.utils.session import create_session

    with create_session() as session:
        rows = (session.query(AssetEvent).join(AssetModel, AssetEvent.asset_id == AssetModel.id)
                .filter(AssetModel.uri == uri).order_by(AssetEvent.timestamp, AssetEvent.id).all())
        return [{"dag_id": e.source_dag_id, "run_id": e.source_run_id, "task_id": e.source_task_id,
                 "extra": dict(e.extra)} for e in rows]


API_USER, API_PASSWORD = "msgaudit", "test-password"


@contextmanager
def api_server(home: Path) -> Iterator[str]:
    """Airflow's own REST API app (`airflow.api_fastapi.app.create_app`, the one `airflow api-server`
    serves) under uvicorn in a thread of this process, on this metadata db, with the simple auth
    manager's user `API_USER` / `API_PASSWORD` (an admin); yields its base URL."""
    import threading
    import time

    import uvicorn

    passwords = home / "api-passwords.json"
    passwords.write_text(json.dumps({API_USER: API_PASSWORD}), encoding="utf-8")
    env = {"AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": f"{API_USER}:admin",
           "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(passwords),
           "AIRFLOW__API_AUTH__JWT_SECRET": "a-test-only-secret-" + "x" * 64}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    server = None
    thread = None
    try:
        from airflow.api_fastapi.app import create_app

        server = uvicorn.Server(uvicorn.Config(create_app(apps="core"), host="127.0.0.1", port=0, log_level="warning"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        deadline = time.monotonic() + 60
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the Airflow API server did not start")
            time.sleep(0.05)
        yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    finally:
        if server is not None and thread is not None:
            server.should_exit = True
            thread.join(timeout=30)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
