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

from audit.core.errors import ConfigError

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


SCRAM_MODULE = "org.apache.kafka.common.security.scram.ScramLoginModule"
_JAAS = {
    "PLAIN": "org.apache.kafka.common.security.plain.PlainLoginModule",
    "SCRAM-SHA-256": SCRAM_MODULE,
    "SCRAM-SHA-512": SCRAM_MODULE,
}


def jaas(user: str, password: str, module: str = SCRAM_MODULE) -> str:
    """The Java client's `sasl.jaas.config` line of a login (quotes and backslashes escaped)."""
    def esc(v: str) -> str:
        return v.replace("\\", "\\\\").replace('"', '\\"')

    return f'{module} required username="{esc(user)}" password="{esc(password)}";'


_SAME_NAME = ("bootstrap.servers", "client.id", "sasl.kerberos.service.name", "ssl.key.password")


def java_client_settings(kafka: Mapping[str, str], client: str = "the Java client") -> dict[str, str]:
    """librdkafka settings (cfg.kafka, ledger.kafka, mirrors[].kafka) -> the Java client's settings, for
    Spark's Kafka source (capture, the ledger-topic ingest) and MirrorMaker 2. `client` names the
    reader in errors.

    Mapped: bootstrap.servers, client.id, sasl.kerberos.service.name, ssl.key.password (same
    names); security.protocol (upper-cased); sasl.mechanism(s) -> sasl.mechanism;
    sasl.username + sasl.password -> sasl.jaas.config (PLAIN, SCRAM-SHA-256/512);
    ssl.ca.location -> PEM truststore file; ssl.ca.pem -> ssl.truststore.certificates;
    ssl.certificate.pem + ssl.key.pem -> PEM keystore (inline); ssl.certificate.location and
    ssl.key.location naming one combined PEM file -> PEM keystore file;
    ssl.endpoint.identification.algorithm (none -> empty, as Java spells it).
    Any other sasl.* / ssl.* setting raises ConfigError (a security setting is never dropped);
    the rest are librdkafka tuning that means nothing to the Java client and is not passed on.
    """
    out: dict[str, str] = {}
    rest = dict(kafka)

    def take(key: str) -> str | None:
        return rest.pop(key, None)

    for key in _SAME_NAME:
        value = take(key)
        if value is not None:
            out[key] = value
    if "bootstrap.servers" not in out:
        raise ConfigError("kafka: bootstrap.servers is required")
    protocol = take("security.protocol")
    if protocol is not None:
        out["security.protocol"] = protocol.upper()
    mechanism = take("sasl.mechanism") or take("sasl.mechanisms")
    rest.pop("sasl.mechanisms", None)
    if mechanism is not None:
        out["sasl.mechanism"] = mechanism.upper()
    user, password = take("sasl.username"), take("sasl.password")
    if user is not None or password is not None:
        module = _JAAS.get((mechanism or "").upper())
        if module is None or user is None or password is None:
            raise ConfigError(
                f"kafka: sasl.username/sasl.password map to {client} only with "
                f"sasl.mechanism PLAIN or SCRAM-SHA-256/512 and both set (got mechanism {mechanism!r})"
            )
        out["sasl.jaas.config"] = jaas(user, password, module)
    ca_location, ca_pem = take("ssl.ca.location"), take("ssl.ca.pem")
    if ca_location is not None:
        out["ssl.truststore.type"] = "PEM"
        out["ssl.truststore.location"] = ca_location
    if ca_pem is not None:
        out["ssl.truststore.type"] = "PEM"
        out["ssl.truststore.certificates"] = ca_pem
    cert_pem, key_pem = take("ssl.certificate.pem"), take("ssl.key.pem")
    if cert_pem is not None or key_pem is not None:
        if cert_pem is None or key_pem is None:
            raise ConfigError("kafka: ssl.certificate.pem and ssl.key.pem must be set together")
        out["ssl.keystore.type"] = "PEM"
        out["ssl.keystore.certificate.chain"] = cert_pem
        out["ssl.keystore.key"] = key_pem
    cert_loc, key_loc = take("ssl.certificate.location"), take("ssl.key.location")
    if cert_loc is not None or key_loc is not None:
        if cert_loc != key_loc:
            raise ConfigError(
                f"kafka: {client} reads the client key and certificate from one PEM file; "
                "point ssl.certificate.location and ssl.key.location at the same combined file, "
                "or use ssl.certificate.pem / ssl.key.pem"
            )
        out["ssl.keystore.type"] = "PEM"
        out["ssl.keystore.location"] = str(cert_loc)
    algorithm = take("ssl.endpoint.identification.algorithm")
    if algorithm is not None:
        out["ssl.endpoint.identification.algorithm"] = "" if algorithm.lower() == "none" else algorithm
    unmapped = sorted(k for k in rest if k.startswith(("sasl.", "ssl.")))
    if unmapped:
        raise ConfigError(
            f"kafka: {', '.join(unmapped)} cannot be passed to {client}; "
            "see audit.core.kafka_conf.java_client_settings for the settings that map"
        )
    return out
