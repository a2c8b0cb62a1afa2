"""The Spark jobs a session has run, as the Spark UI lists them (read from the driver's status store)."""

from __future__ import annotations

from typing import Any


def job_descriptions(spark: Any) -> dict[int, str]:
    """Every Spark job of the session so far by id: its description ("" when it has none)."""
    jobs = spark.sparkContext._jsc.sc().statusStore().jobsList(None)
    return {j.jobId(): j.description().get() if j.description().isDefined() else ""
            for j in (jobs.apply(i) for i in range(jobs.size()))}


def ours(description: str) -> str:
    """A job description without the "Delta: " prefixes Delta puts before the name of the work its
    own jobs serve."""
    while description.startswith("Delta: "):
        description = description[len("Delta: "):]
    return description
