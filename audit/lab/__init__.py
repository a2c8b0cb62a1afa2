"""The fault-injection lab: every failure the audit claims to detect, produced on a real broker.

`proxy` is a Kafka-aware fault-injecting TCP proxy, `truth` records what a scenario actually did
(independently of the audit), `scenarios` runs each fault against a broker and returns that
ground truth, and `demo` is `msgaudit demo`. Users can run the scenarios against their own
cluster; see docs/lab.md. Nothing here imports Spark at module level.
"""

from __future__ import annotations
