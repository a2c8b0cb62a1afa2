"""Real services for the test tiers: a throwaway PostgreSQL cluster from Debian's packages.

The Kafka broker comes from `audit.runtime.local_kafka` (the same code users run); Spark from
`spark_jobs.io.session`. Nothing here is a stand-in: these are the real servers.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from audit.runtime.local_kafka import free_port


def _pg_bin() -> Path:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    if found:
        return Path(found[-1]).parent
    initdb = shutil.which("initdb")
    if initdb:
        return Path(initdb).parent
    raise RuntimeError("PostgreSQL server binaries not found: apt-get install -y postgresql (the CI script does)")


def _as_postgres(cmd: list[str]) -> list[str]:
    # initdb refuses to run as root; hand the cluster to the postgres system user.
    if os.geteuid() == 0:
        return ["runuser", "-u", "postgres", "--", *cmd]
    return cmd


@contextmanager
def postgres_server() -> Iterator[str]:
    """Start a private PostgreSQL on a free loopback port; yield a SQLAlchemy URL to database 'msgaudit'."""
    url = os.environ.get("MSGAUDIT_TEST_PG_URL")
    if url:
        yield url
        return
    bindir = _pg_bin()
    root = Path(tempfile.mkdtemp(prefix="msgaudit-pg-"))
    data = root / "data"
    if os.geteuid() == 0:
        pw = pwd.getpwnam("postgres")
        os.chown(root, pw.pw_uid, pw.pw_gid)
    port = free_port()
    subprocess.run(_as_postgres([str(bindir / "initdb"), "-D", str(data), "-U", "postgres", "-A", "trust",
                                 "--no-sync", "-E", "UTF8"]), check=True, capture_output=True)
    opts = f"-c listen_addresses=127.0.0.1 -c port={port} -c unix_socket_directories={root} -c fsync=off"
    subprocess.run(_as_postgres([str(bindir / "pg_ctl"), "-D", str(data), "-o", opts, "-l", str(root / "log"),
                                 "-w", "start"]), check=True, capture_output=True)
    try:
        for _ in range(50):
            r = subprocess.run(_as_postgres([str(bindir / "psql"), "-h", "127.0.0.1", "-p", str(port), "-U",
                                             "postgres", "-c", "CREATE DATABASE msgaudit"]),
                               capture_output=True, text=True)
            if r.returncode == 0:
                break
            time.sleep(0.2)
        else:
            raise RuntimeError(f"could not create the test database: {r.stderr}")
        yield f"postgresql+psycopg://postgres@127.0.0.1:{port}/msgaudit"
    finally:
        subprocess.run(_as_postgres([str(bindir / "pg_ctl"), "-D", str(data), "-m", "immediate", "stop"]),
                       capture_output=True)
        shutil.rmtree(root, ignore_errors=True)
