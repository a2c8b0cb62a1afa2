"""Manual check (not collected by default): `spark-submit spark_jobs/pipeline/submit.py capture` end to end.

It launches a real spark-submit driver JVM of its own, which the shared-session rule keeps out of
the default suite. Run it explicitly when the jars, session or submit entry point change:

    .venv/bin/python -m pytest tests/support/capture_spark_submit_check.py -p no:cacheprovider
"""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from audit.core import headers as H
from audit.core.windows import to_millis


@pytest.mark.e2e
@pytest.mark.kafka
def test_spark_submit_capture(kafka_bootstrap: str, tmp_path: Path) -> None:
    from confluent_kafka import Producer

    from tests.conftest import new_topic

    topic = new_topic(kafka_bootstrap)
    now = datetime.now(UTC)
    p = Producer({"bootstrap.servers": kafka_bootstrap})
    acks: list[Any] = []
    for seq in range(3):
        headers: list[Any] = H.stamp(None, "p:1", seq, to_millis(now))
        p.produce(topic, value=b"v", headers=headers,
                  on_delivery=lambda err, msg: acks.append(err))
    p.flush(30)
    assert acks == [None, None, None]
    conf = tmp_path / "msgaudit.yaml"
    conf.write_text(f"kafka: {{bootstrap.servers: '{kafka_bootstrap}'}}\nlake: lake\nhome: home\n"
                    f"spark: {{master: 'local[1]'}}\ntopics:\n  {topic}: {{}}\n")
    from spark_jobs.io.session import spark_jar_paths

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable, "PYSPARK_DRIVER_PYTHON": sys.executable}
    out = subprocess.run(
        # The driver JVM exists before submit.py runs, so the jars must be given to spark-submit.
        [str(Path(sys.executable).parent / "spark-submit"), "--jars", ",".join(spark_jar_paths()),
         str(root / "spark_jobs" / "pipeline" / "submit.py"), "capture",
         "--config", str(conf), "--start", now.isoformat(), "--end", (now + timedelta(minutes=1)).isoformat()],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=900,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"  {topic}: 3 records in 3 offsets over 1 partitions, 3 new or changed" in out.stdout
