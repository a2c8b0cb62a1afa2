"""msgaudit's own confluent_kafka clients keep librdkafka's info lines off the terminal
(audit/core/kafka_conf.py); the application's clients are not touched."""

from __future__ import annotations

import pytest

from audit.core.kafka_conf import ENV_VERBOSE, internal_client_conf


@pytest.mark.unit
def test_internal_clients_log_warnings_only_unless_configured_or_verbose(monkeypatch: pytest.MonkeyPatch) -> None:
    from audit.clients.ledger_ship import shipper_conf
    from audit.runtime import quiet

    assert ENV_VERBOSE == quiet.ENV_VERBOSE
    monkeypatch.delenv(ENV_VERBOSE, raising=False)
    assert internal_client_conf({"bootstrap.servers": "b:9092"}, **{"group.id": "g"}) == {
        "bootstrap.servers": "b:9092", "group.id": "g", "log_level": 4}
    assert internal_client_conf({"bootstrap.servers": "b:9092", "log_level": 7})["log_level"] == 7  # the user's
    assert shipper_conf({"bootstrap.servers": "b:9092"})["log_level"] == 4
    monkeypatch.setenv(ENV_VERBOSE, "1")
    assert internal_client_conf({"bootstrap.servers": "b:9092"}) == {"bootstrap.servers": "b:9092"}


@pytest.mark.unit
def test_capture_and_doctor_create_their_admin_clients_quiet(monkeypatch: pytest.MonkeyPatch) -> None:
    """The AdminClients of capture and doctor get the quiet settings (the client class replaced by a
    recorder: no broker in the unit tier)."""
    import confluent_kafka.admin

    from audit.clients import doctor
    from audit.core import config as config_mod
    from spark_jobs import capture

    monkeypatch.delenv(ENV_VERBOSE, raising=False)
    made: list[dict[str, object]] = []

    class Recorder:
        def __init__(self, conf: dict[str, object]) -> None:
            made.append(conf)

        def list_topics(self, *_: object, **__: object) -> object:
            raise RuntimeError("no broker in a unit test")

    monkeypatch.setattr(confluent_kafka.admin, "AdminClient", Recorder)
    cfg = config_mod.from_dict({"kafka": {"bootstrap.servers": "b:9092"}, "topics": {"t": {}}}, source="<test>")
    capture._admin(cfg)
    with pytest.raises(Exception, match="no broker"):
        doctor.diagnose(cfg)
    assert made == [{"bootstrap.servers": "b:9092", "log_level": 4}] * 2


@pytest.mark.unit
def test_an_acl_denial_is_one_line_naming_the_user_the_operation_and_the_grant() -> None:
    from audit.core.kafka_conf import access_line

    conf = {"bootstrap.servers": "b:9093", "sasl.username": "alice", "sasl.password": "s3cret",
            "sasl.mechanism": "SCRAM-SHA-512"}
    ops, names = {"topic": "READ", "group": "READ"}, {"topic": "orders", "group": "loader"}
    assert access_line(conf, "TOPIC_AUTHORIZATION_FAILED", ops, names) == (
        "user alice may not READ topic orders: grant it with kafka-acls --bootstrap-server b:9093 --command-config "
        "<admin client properties> --add --allow-principal User:alice --operation Read --topic orders")
    assert access_line(conf, "GROUP_AUTHORIZATION_FAILED", ops, names).endswith(  # type: ignore[union-attr]
        "--operation Read --group loader")
    assert access_line(conf, "_AUTHENTICATION", ops, names) == (
        "SASL authentication of user alice failed at b:9093: check sasl.username, sasl.password and "
        "sasl.mechanism (SCRAM-SHA-512)")
    assert access_line(conf, "UNKNOWN_TOPIC_OR_PART", ops, names) is None
    assert access_line({"bootstrap.servers": "b:9092"}, "TOPIC_AUTHORIZATION_FAILED", {"topic": "DESCRIBE_CONFIGS"},
                       names) == (
        "user this client's principal (no sasl.username set) may not DESCRIBE_CONFIGS topic orders: grant it with "
        "kafka-acls --bootstrap-server b:9092 --command-config <admin client properties> --add --allow-principal "
        "User:<user> --operation DescribeConfigs --topic orders")
