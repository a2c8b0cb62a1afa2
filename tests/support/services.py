"""Real services for the test tiers: a throwaway PostgreSQL cluster from Debian's packages, and an
S3-compatible object store (moto's server mode, from PyPI).

The Kafka broker comes from `audit.runtime.local_kafka` (the same code users run); Spark from
`spark_jobs.io.session`. Nothing here is a stand-in: these are the real servers.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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


@dataclass(frozen=True)
class S3Server:
    """An S3-compatible HTTP server on 127.0.0.1 (moto's server mode) with one bucket."""

    endpoint: str
    bucket: str
    pid: int = 0  # the server's process
    access_key: str = "msgaudit-test-key"
    secret_key: str = "msgaudit-test-secret"

    def client(self) -> Any:
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=self.access_key,
                            aws_secret_access_key=self.secret_key, region_name="us-east-1")

    def keys(self, prefix: str = "") -> list[str]:
        """Every object key under `prefix` (paged)."""
        out: list[str] = []
        for page in self.client().get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix):
            out.extend(o["Key"] for o in page.get("Contents", []))
        return out


def s3a_settings(endpoint: str, access_key: str = S3Server.access_key,
                 secret_key: str = S3Server.secret_key) -> dict[str, str]:
    """The `spark:` settings that point S3A (Spark, and the settling tasks' pyarrow through them) at a
    local S3 server over plain HTTP, path-style, with these credentials (or `${ENV}` references)."""
    return {"spark.hadoop.fs.s3a.endpoint": endpoint, "spark.hadoop.fs.s3a.endpoint.region": "us-east-1",
            "spark.hadoop.fs.s3a.path.style.access": "true", "spark.hadoop.fs.s3a.connection.ssl.enabled": "false",
            "spark.hadoop.fs.s3a.access.key": access_key, "spark.hadoop.fs.s3a.secret.key": secret_key}


@contextmanager
def s3_server(bucket: str = "audit-lake") -> Iterator[S3Server]:
    """moto's S3 server (its own process, 127.0.0.1, a free port), with `bucket` created."""
    port = free_port()
    log = tempfile.NamedTemporaryFile(prefix="msgaudit-moto-", suffix=".log", delete=False)  # noqa: SIM115
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=log, stderr=subprocess.STDOUT)
    server = S3Server(f"http://127.0.0.1:{port}", bucket, proc.pid)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                server.client().create_bucket(Bucket=bucket)
                break
            except Exception:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"moto S3 server did not start: {Path(log.name).read_text()[-800:]}") from None
                time.sleep(0.1)
        yield server
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        log.close()
        os.unlink(log.name)
