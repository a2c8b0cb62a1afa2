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


# The librdkafka error names of an ACL denial (KafkaError.name()), and the kafka-acls flag of
# each resource type.
DENIED = {"TOPIC_AUTHORIZATION_FAILED": "topic", "GROUP_AUTHORIZATION_FAILED": "group",
          "CLUSTER_AUTHORIZATION_FAILED": "cluster", "TRANSACTIONAL_ID_AUTHORIZATION_FAILED": "transactional-id"}
AUTHENTICATION_FAILED = "_AUTHENTICATION"


def principal(conf: Mapping[str, Any]) -> str:
    """The client's user name as the broker knows it (SASL), or what to call it without one."""
    return str(conf.get("sasl.username") or "this client's principal (no sasl.username set)")


def denied_line(conf: Mapping[str, Any], operation: str, resource: str, name: str = "") -> str:
    """One line for an ACL denial: who may not do what on which resource, and the grant that allows
    it (`resource`: topic, group, cluster, transactional-id; `operation`: READ, WRITE, DESCRIBE,
    DESCRIBE_CONFIGS, ...). Names no setting's value but the user name."""
    user = principal(conf)
    what = f"{resource} {name}" if name else resource
    flag = "--cluster" if resource == "cluster" else f"--{resource} {name}"
    op = "".join(w.capitalize() for w in operation.split("_"))
    return (f"user {user} may not {operation.upper()} {what}: grant it with kafka-acls --bootstrap-server "
            f"{conf.get('bootstrap.servers', '<brokers>')} --command-config <admin client properties> --add "
            f"--allow-principal User:{conf.get('sasl.username') or '<user>'} --operation {op} {flag}")


def authentication_line(conf: Mapping[str, Any]) -> str:
    """One line for a failed SASL login (the password is never shown)."""
    return (f"SASL authentication of user {principal(conf)} failed at {conf.get('bootstrap.servers', '?')}: "
            f"check sasl.username, sasl.password and sasl.mechanism ({conf.get('sasl.mechanism') or conf.get('sasl.mechanisms') or 'unset'})")


def access_line(conf: Mapping[str, Any], error_name: str, ops: Mapping[str, str], names: Mapping[str, str]) -> str | None:
    """`denied_line` when librdkafka's error `error_name` is an ACL denial (the resource type comes
    from the error; `ops` and `names`: the operation needed on, and the name of, each resource type
    the caller uses, e.g. {"topic": "READ", "group": "READ"}), `authentication_line` for a failed
    login, None for any other error."""
    if error_name == AUTHENTICATION_FAILED:
        return authentication_line(conf)
    kind = DENIED.get(error_name)
    if kind is None:
        return None
    return denied_line(conf, ops.get(kind, "the needed operation"), kind, names.get(kind, ""))
