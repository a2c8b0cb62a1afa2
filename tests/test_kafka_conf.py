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
