"""Settings of the confluent_kafka clients msgaudit creates for its own work (capture's and doctor's
AdminClient, `msgaudit ship`'s and the ledger shipper's Producer): not the application's
AuditedProducer / AuditedConsumer, whose settings are the user's.

librdkafka prints its log lines to stderr at `log_level` 6 (info) by default, e.g. "BGQUEUE ...
Purging 1 unserved events from background queue" when an AdminClient is destroyed: a command's
terminal must show only its own output (docs/design.md §9), so these clients log warnings and
worse only (`log_level` 4), unless the config sets `log_level` itself or `--verbose` is on.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

# The environment variable `--verbose` sets (the same name as audit.runtime.quiet.ENV_VERBOSE).
ENV_VERBOSE = "MSGAUDIT_VERBOSE"
QUIET_LOG_LEVEL = 4  # syslog "warning"


def internal_client_conf(conf: Mapping[str, Any], **extra: Any) -> dict[str, Any]:
    """`conf` plus `extra`, with `log_level` 4 unless either sets it or `--verbose` is on."""
    out = {**conf, **extra}
    if "log_level" not in out and os.environ.get(ENV_VERBOSE, "") in ("", "0"):
        out["log_level"] = QUIET_LOG_LEVEL
    return out
