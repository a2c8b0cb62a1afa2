"""`msgaudit follow`: each window run once, when final, judged at its end + grace; ingest first; a
failed window holds the cursor and is retried while later ones run; a failed ingest runs no window;
a restart resumes at the saved cursor; the state keeps only windows it may still run. The clock is
simulated: `sleep` moves it."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml

from audit.core import config as config_mod
from audit.core.config import Config
from audit.core.errors import InputError
from spark_jobs.pipeline.follow import RETRY, FollowState, config_watch, first_not_final, follow
from tests.reconcile_cases import (
    GROUP,
    T0,
    TOPIC,
    TWO_WINDOWS_REPORT,
    at,
    norm_rows,
    write_two_windows_one_lost,
)


def _cfg(make_config: Callable[..., Config], tmp_path: Path) -> Config:
    return make_config(tmp_path, topics={
        TOPIC: {"window": "1h", "grace": "15m", "groups": [GROUP], "sla": {"max_lost": 0},
                "sinks": [{"name": "s1", "format": "delta", "location": "sinks/s1", "group": GROUP}]},
        "u": {"window": "30m", "grace": "5m"}})


class Clock:
    """The simulated wall clock: `sleep` moves it; every call is recorded."""

    def __init__(self, now: datetime) -> None:
        self.now = now
        self.slept: list[float] = []

    def __call__(self) -> datetime:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += timedelta(seconds=seconds)


class Calls:
    """The steps' and ingest's calls, in order, at the clock's time; chosen windows fail (once each, or always)."""

    def __init__(self, clock: Clock, fail: set[tuple[str, datetime]] | None = None, always: bool = False,
                 ingest_fails: int = 0) -> None:
        self.clock, self.fail, self.always, self.ingest_fails = clock, set(fail or ()), always, ingest_fails
        self.log: list[tuple[Any, ...]] = []

    def step(self, spark: Any, cfg: Config, topics: tuple[str, ...], ws: datetime, we: datetime,
             as_of: datetime) -> None:
        for t in topics:
            if (t, ws) in self.fail:
                if not self.always:
                    self.fail.discard((t, ws))
                raise InputError(f"no table for {t}")
        self.log.append(("x", self.clock(), topics, ws, as_of))

    step.per_window = True  # type: ignore[attr-defined]

    def ingest(self, spark: Any, cfg: Config) -> None:
        if self.ingest_fails:
            self.ingest_fails -= 1
            raise InputError("broker unreachable")
        self.log.append(("ingest", self.clock()))


def _follow(cfg: Config, clock: Clock, calls: Calls, **kw: Any) -> tuple[Any, list[str], list[str]]:
    said: list[str] = []
    warned: list[str] = []
    result = follow(None, cfg, steps=[("x", calls.step)], ingest=calls.ingest, clock=clock, sleep=clock.sleep,
                    say=said.append, warn=warned.append, **kw)
    return result, said, warned


@pytest.mark.unit
def test_each_window_runs_once_when_final_ingest_first_and_sleeps_until_the_next(
        make_config: Callable[..., Config], tmp_path: Path) -> None:
    cfg = _cfg(make_config, tmp_path)
    clock = Clock(at(40))
    calls = Calls(clock)
    result, said, warned = _follow(cfg, clock, calls, since=T0, max_ticks=4)
    assert calls.log == [
        ("ingest", at(40)), ("x", at(40), ("u",), T0, at(35)),
        ("ingest", at(65)), ("x", at(65), ("u",), at(30), at(65)),
        ("ingest", at(75)), ("x", at(75), (TOPIC,), T0, at(75)),
        ("ingest", at(95)), ("x", at(95), ("u",), at(60), at(95)),
    ]
    assert clock.slept == [25 * 60, 10 * 60, 20 * 60]  # to 11:05, 11:15, 11:35
    assert result.ticks == 4 and len(result.done) == 4 and warned == []
    assert said[0] == ("follow: windows from 2026-11-21T10:00:00+00:00 of every configured topic, each when final "
                       "(its end + grace)")
    assert re.fullmatch(r"follow: window 2026-11-21T10:00:00\+00:00\.\.2026-11-21T10:30:00\+00:00 \(as of "
                        r"2026-11-21T10:35:00\+00:00\) u: done in [\d.]+ s \(ingest [\d.]+ s, x [\d.]+ s\), "
                        r"0 anomalies, 0 error-severity SLA failures", said[1]), said[1]
    assert said[2] == "follow: next window final at 2026-11-21T11:05:00+00:00"
    assert FollowState(cfg.home / "follow-state.json").cursor == at(60)  # t [11:00, 12:00) is not final at 11:35


@pytest.mark.unit
def test_a_failed_window_holds_the_cursor_is_retried_and_later_windows_still_run(
        make_config: Callable[..., Config], tmp_path: Path) -> None:
    cfg = _cfg(make_config, tmp_path)
    clock = Clock(at(140))  # 12:20: t's windows of 10:00 and 11:00 are both final
    calls = Calls(clock, fail={(TOPIC, T0)})
    result, _, warned = _follow(cfg, clock, calls, since=T0, topics=[TOPIC], max_ticks=2)
    assert [c[1:4] for c in calls.log if c[0] == "x"] == [
        (at(140), (TOPIC,), at(60)),  # the first tick: the failed window's successor still runs
        (at(140) + RETRY, (TOPIC,), T0),  # retried RETRY later; the done one is not run again
    ]
    assert warned == [f"follow: t 2026-11-21T10:00:00+00:00: InputError: no table for t (not done; tried again "
                      f"from {(at(140) + RETRY).isoformat()})"]
    assert clock.slept == [RETRY.total_seconds()]
    assert result.failed == [] and FollowState(cfg.home / "follow-state.json").cursor == at(120)


@pytest.mark.unit
def test_a_window_that_keeps_failing_is_retried_every_tick_and_keeps_the_cursor(
        make_config: Callable[..., Config], tmp_path: Path) -> None:
    cfg = _cfg(make_config, tmp_path)
    clock = Clock(at(80))
    calls = Calls(clock, fail={(TOPIC, T0)}, always=True)
    result, _, warned = _follow(cfg, clock, calls, since=T0, topics=[TOPIC], max_ticks=3)
    assert calls.log == [("ingest", at(80)), ("ingest", at(80) + RETRY), ("ingest", at(80) + 2 * RETRY)]
    assert len(warned) == 3 and result.failed == [(TOPIC, T0, "InputError: no table for t")]
    assert FollowState(cfg.home / "follow-state.json").cursor == T0


@pytest.mark.unit
def test_a_failed_ingest_runs_no_window_and_the_tick_is_tried_again(
        make_config: Callable[..., Config], tmp_path: Path) -> None:
    cfg = _cfg(make_config, tmp_path)
    clock = Clock(at(80))
    calls = Calls(clock, ingest_fails=1)
    _, _, warned = _follow(cfg, clock, calls, since=T0, topics=[TOPIC], max_ticks=2)
    assert calls.log == [("ingest", at(80) + RETRY), ("x", at(80) + RETRY, (TOPIC,), T0, at(75))]
    assert warned == [f"follow: broker unreachable (no window run; tried again from {(at(80) + RETRY).isoformat()})"]
    with pytest.raises(InputError, match="broker unreachable"):  # --once: the error is the exit
        _follow(cfg, Clock(at(200)), Calls(clock, ingest_fails=1), topics=[TOPIC], once=True)


@pytest.mark.unit
def test_a_restart_resumes_at_the_saved_cursor_and_catches_up_in_one_tick(
        make_config: Callable[..., Config], tmp_path: Path) -> None:
    cfg = _cfg(make_config, tmp_path)
    assert first_not_final(cfg, at(40), [TOPIC]) == T0
    assert first_not_final(cfg, at(80), [TOPIC]) == at(60)  # 10:00 was final at 11:15
    clock = Clock(at(40))
    calls = Calls(clock)
    _follow(cfg, clock, calls, topics=[TOPIC], max_ticks=2)  # no --since, no state: the first window not final
    assert [c[3] for c in calls.log if c[0] == "x"] == [T0]
    clock.now = at(260)  # 14:20: down since 11:15; the windows of 11:00, 12:00 and 13:00 are final
    calls.log.clear()
    result, _, _ = _follow(cfg, clock, calls, topics=[TOPIC], once=True)
    assert [c[3] for c in calls.log if c[0] == "x"] == [at(60), at(120), at(180)]
    assert [c[0] for c in calls.log] == ["ingest", "x", "x", "x"] and result.ticks == 1
    # the backfill state keeps only windows at or after the cursor (14:00)
    state = json.loads((cfg.home / "backfill-state.json").read_text())
    assert state == {"done": {}}
    # --since wins over the saved cursor
    calls.log.clear()
    _follow(cfg, clock, calls, topics=[TOPIC], since=at(180), once=True)
    assert [c[3] for c in calls.log if c[0] == "x"] == [at(180)]


@pytest.mark.unit
def test_unexpected_errors_are_retried_and_the_third_in_a_row_is_raised(
        make_config: Callable[..., Config], tmp_path: Path) -> None:
    cfg = _cfg(make_config, tmp_path)
    clock = Clock(at(80))

    def broken(spark: Any, cfg: Config, topics: Any, ws: datetime, we: datetime, as_of: datetime) -> None:
        raise RuntimeError("Py4J gateway gone")

    broken.per_window = True  # type: ignore[attr-defined]
    warned: list[str] = []
    with pytest.raises(RuntimeError, match="gateway gone"):
        follow(None, cfg, since=T0, topics=[TOPIC], steps=[("x", broken)], ingest=lambda s, c: None, clock=clock,
               sleep=clock.sleep, say=lambda _line: None, warn=warned.append)
    assert [w.split(" (")[0] for w in warned] == ["follow: unexpected RuntimeError: Py4J gateway gone"] * 2
    assert clock.slept == [RETRY.total_seconds()] * 2


@pytest.mark.unit
def test_a_corrupt_state_file_and_a_future_since_are_one_clear_error(
        make_config: Callable[..., Config], tmp_path: Path) -> None:
    p = tmp_path / "follow-state.json"
    p.write_text('{"cursor": 12}')
    with pytest.raises(InputError, match="follow state is not valid; delete it .* or pass --since"):
        FollowState(p)
    clock = Clock(at(40))
    with pytest.raises(InputError, match=r"--since 2026-11-21T11:00:00\+00:00 is in the future"):
        _follow(_cfg(make_config, tmp_path), clock, Calls(clock), since=at(60), once=True)


def _config_file(tmp_path: Path, lake: str, topics: dict[str, Any]) -> str:
    return yaml.safe_dump({"home": str(tmp_path / "home"), "lake": str(tmp_path / lake),
                           "ledger_dir": str(tmp_path / "ledger"), "report_store": f"sqlite:///{tmp_path / 'r.db'}",
                           "topics": topics})


@pytest.mark.unit
def test_the_config_file_is_read_again_before_each_tick(tmp_path: Path) -> None:
    """A topic added is run from the cursor on; a broken file is said once and the config last read
    stays; a removed topic stops; a lake changed is said and waits for a restart."""
    path = tmp_path / "msgaudit.yaml"
    u = {"window": "30m", "grace": "5m", "groups": [GROUP], "sla": {"max_lost": 0},
         "sinks": [{"name": "s1", "format": "delta", "location": "sinks/s1", "group": GROUP}]}
    path.write_text(_config_file(tmp_path, "lake", {"u": u}))
    cfg = config_mod.load(path)
    edits = {1: _config_file(tmp_path, "lake2", {"u": u, "v": u}), 2: "topics: [", 4: _config_file(tmp_path, "lake2", {"u": u})}
    clock = Clock(at(40))
    ran: list[tuple[datetime, tuple[str, ...], datetime, str]] = []

    def step(spark: Any, cfg: Config, topics: tuple[str, ...], ws: datetime, we: datetime, as_of: datetime) -> None:
        ran.append((clock(), topics, ws, cfg.lake))

    step.per_window = True  # type: ignore[attr-defined]

    def sleep(seconds: float) -> None:
        clock.sleep(seconds)
        if len(clock.slept) in edits:
            path.write_text(edits[len(clock.slept)])

    said: list[str] = []
    warned: list[str] = []
    follow(None, cfg, since=T0, steps=[("x", step)], ingest=lambda s, c: None, clock=clock, sleep=sleep,
           say=said.append, warn=warned.append, max_ticks=6, watch=config_watch(cfg, None))
    lake = str(tmp_path / "lake")
    assert ran == [(at(40), ("u",), T0, lake),
                   (at(65), ("u", "v"), at(30), lake),  # v from the cursor on; the lake as follow started
                   (at(95), ("u", "v"), at(60), lake),  # the file is broken: the config last read
                   (at(125), ("u", "v"), at(90), lake),
                   (at(155), ("u",), at(120), lake),
                   (at(185), ("u",), at(150), lake)]  # the same file read again: nothing said
    assert [line for line in said if "read again" in line] == [f"follow: {path} read again (topics added: v)",
                                                                f"follow: {path} read again (removed: v)"]
    assert warned[0] == f"follow: lake changed in {path}; that applies when follow is restarted"
    assert len(warned) == 2 and warned[1].startswith(f"follow: {path}: not valid YAML") \
        and warned[1].endswith("(the config last read stays in use; fix the file)")
    assert config_watch(config_mod.from_dict({}, source="<defaults>"), None) is None


@pytest.mark.spark
def test_follow_publishes_the_rows_a_backfill_publishes_and_alerts_on_an_sla_breach(
        spark: Any, make_config: Callable[..., Config], tmp_path: Path) -> None:
    from dataclasses import replace

    from audit.core.config import AlertsConfig, MetricsConfig
    from audit.serving.report_store import ANOMALIES, PARTITION_REPORT, SLA_RESULTS, ReportStore
    from spark_jobs.pipeline.backfill import reconcile_step, sla_step
    from tests.support.monitoring import Webhook, samples

    hook = Webhook()  # the SLA step routes its failed rules here, and writes the metrics textfile
    cfg = replace(_cfg(make_config, tmp_path), alerts=AlertsConfig(webhook=hook.url),
                  metrics=MetricsConfig(textfile=tmp_path / "metrics.prom"))
    write_two_windows_one_lost(spark, cfg.lake, tmp_path / "sinks" / "s1")
    clock = Clock(at(80))
    warned: list[str] = []
    alerts = tmp_path / "alerts.jsonl"
    try:
        result = follow(spark, cfg, since=T0, topics=[TOPIC], steps=[("reconcile", reconcile_step), ("sla", sla_step)],
                        ingest=lambda s, c: None, clock=clock, sleep=clock.sleep, say=lambda _line: None,
                        warn=warned.append, alert_log=alerts, max_ticks=2)
    finally:
        hook.close()
    assert result.done == [(TOPIC, T0), (TOPIC, at(60))] and result.sla_errors == 1
    assert clock.slept == [55 * 60]  # 11:20 -> 12:15
    with ReportStore(cfg.report_store) as store:
        report, anomalies, sla = (norm_rows(store.read(t, TOPIC)) for t in (PARTITION_REPORT, ANOMALIES, SLA_RESULTS))
    assert sorted((r["window_start"], r["stage"], r["expected"], r["lost"]) for r in report) == TWO_WINDOWS_REPORT
    assert {r["status"] for r in report} == {"final"}
    assert [(a["anomaly"], a["seq"]) for a in anomalies] == [("lost_acked", 3)]
    assert sorted((r["window_start"], r["rule"]) for r in sla if not r["passed"]) == [(at(60), "max_lost")]
    assert warned == ["follow: sla: 1 error-severity SLA check(s) failed for window 2026-11-21T11:00:00+00:00 of t "
                      "(see `msgaudit dashboard`)"]
    (alert,) = [json.loads(line) for line in alerts.read_text().splitlines()]
    assert (alert["dag_id"], alert["window_start"], alert["sla_breach"], alert["exit_code"]) == (
        "msgaudit-follow", "2026-11-21T11:00:00+00:00", True, 3)
    assert [(r["rule"], r["observed"], r["threshold"], r["severity"]) for r in alert["failed_rules"]] == [
        ("max_lost", 1.0, 0.0, "error")]
    (failed,) = [r for r in sla if not r["passed"]]
    assert [(h["dedup_key"], h["status"], h["partitions"], h["observed"]) for h in hook.received] == [
        ("msgaudit/t/2026-11-21T11:00:00Z/log/max_lost", "firing", [failed["partition"]], 1.0)]
    exposed = samples((tmp_path / "metrics.prom").read_text())
    assert exposed[("msgaudit_messages_lost_total", (("stage", "log"), ("topic", TOPIC)))] == 1
    assert exposed[("msgaudit_sla_ok", (("rule", "max_lost"), ("stage", "log"), ("topic", TOPIC)))] == 0


@pytest.mark.e2e
@pytest.mark.kafka
@pytest.mark.spark
def test_follow_ingests_captures_reconciles_and_checks_real_windows(
        spark: Any, kafka_bootstrap: str, make_config: Callable[..., Config], tmp_path: Path) -> None:
    """The default steps against a real broker: the produced messages' windows, judged at their end +
    grace on the simulated clock, come out delivered once with nothing else to report."""
    from audit.clients.producer import AuditedProducer
    from audit.core.windows import floor_window
    from audit.serving.report_store import ANOMALIES, PARTITION_REPORT, SLA_RESULTS, ReportStore
    from tests.conftest import new_topic

    topic = new_topic(kafka_bootstrap, partitions=2, prefix="follow")
    cfg = make_config(tmp_path, topics={topic: {"window": "1h", "grace": "15m", "sla": {"max_lost": 0}}})
    ws = floor_window(datetime.now(tz=T0.tzinfo), timedelta(hours=1))
    p = AuditedProducer({"bootstrap.servers": kafka_bootstrap, "linger.ms": 5}, producer_name="follow-e2e",
                        ledger_dir=cfg.ledger_dir / "producer")
    for i in range(50):
        p.produce(topic, b"%d" % i)
    assert p.flush(30) == 0
    p.close()
    # both windows the messages may fall in (a run across the hour) are final on this clock
    clock = Clock(ws + timedelta(hours=2, minutes=15))
    said: list[str] = []
    warned: list[str] = []
    result = follow(spark, cfg, since=ws, clock=clock, sleep=clock.sleep, say=said.append, warn=warned.append,
                    once=True)
    assert result.done == [(topic, ws), (topic, ws + timedelta(hours=1))] and result.sla_errors == 0
    assert warned == [] and [line.split(" (as of")[0] for line in said if line.startswith("follow: window ")] == [
        f"follow: window {ws.isoformat()}..{(ws + timedelta(hours=1)).isoformat()}",
        f"follow: window {(ws + timedelta(hours=1)).isoformat()}..{(ws + timedelta(hours=2)).isoformat()}"]
    with ReportStore(cfg.report_store) as store:
        report = store.read(PARTITION_REPORT, topic=topic)
        assert store.read(ANOMALIES, topic=topic) == []
        sla = store.read(SLA_RESULTS, topic=topic)
    assert sum(r["expected"] for r in report) == sum(r["delivered"] for r in report) == 50
    assert {r["status"] for r in report} == {"final"} and {r["stage"] for r in report} == {"log"}
    assert sla and all(r["passed"] for r in sla)
    assert FollowState(cfg.home / "follow-state.json").cursor == ws + timedelta(hours=2)


# --------------------------------------------------------------------------------------------
# unit: completeness events posted to Airflow's REST API (a tiny local HTTP server stands in for it)


class FakeAirflow:
    """Airflow 3's API as follow uses it: `POST /auth/token` (JSON user + password -> a JWT),
    `GET /api/v2/assets?uri_pattern=` (a substring match, as Airflow's) and `POST /api/v2/assets/events`,
    both behind the bearer token. Records every event it accepts."""

    def __init__(self, assets: list[str], username: str = "msgaudit", password: str = "s3cret") -> None:
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
        from urllib.parse import parse_qs, urlsplit

        self.assets = {uri: i + 1 for i, uri in enumerate(assets)}
        self.events: list[tuple[str, dict[str, Any]]] = []
        self.logins = 0
        self.tokens: set[str] = set()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _send(self, code: int, body: Any) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _authorized(self) -> bool:
                token = self.headers.get("Authorization", "").removeprefix("Bearer ")
                if token not in fake.tokens:
                    self._send(401, {"detail": "Not authenticated"})
                    return False
                return True

            def do_GET(self) -> None:
                url = urlsplit(self.path)
                if url.path != "/api/v2/assets":
                    return self._send(404, {"detail": "Not Found"})
                if self._authorized():
                    pattern = parse_qs(url.query)["uri_pattern"][0]
                    found = [{"id": i, "uri": u} for u, i in fake.assets.items() if pattern in u]
                    self._send(200, {"assets": found, "total_entries": len(found)})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path == "/auth/token":
                    if body != {"username": username, "password": password}:
                        return self._send(401, {"detail": "Invalid credentials"})
                    fake.logins += 1
                    fake.tokens.add(f"jwt-{fake.logins}")
                    return self._send(201, {"access_token": f"jwt-{fake.logins}"})
                if self.path == "/api/v2/assets/events" and self._authorized():
                    uri = {i: u for u, i in fake.assets.items()}[body["asset_id"]]
                    fake.events.append((uri, body["extra"]))
                    self._send(200, {"id": len(fake.events), "asset_id": body["asset_id"]})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fake_airflow() -> Any:
    server = FakeAirflow(["msgaudit://127.0.0.1:9092/t", "msgaudit://127.0.0.1:9092/u"])
    yield server
    server.close()


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _airflow(cfg: Config, url: str, token: str | None = None, username: str | None = None,
             password: str | None = None) -> Config:
    from dataclasses import replace

    from audit.core.config import AirflowConfig

    return replace(cfg, airflow=AirflowConfig(url=url, token=token, username=username, password=password))


def _event(topic: str, ws: datetime, we: datetime, as_of: datetime) -> dict[str, Any]:
    return {"topic": topic, "window_start": ws.isoformat(), "window_end": we.isoformat(), "as_of": as_of.isoformat(),
            "complete": True, "exactly_once": True, "stages": {}}  # no report rows: nothing was produced


@pytest.mark.unit
def test_follow_posts_each_final_windows_event_and_keeps_it_while_airflow_is_unreachable(
        make_config: Callable[..., Config], tmp_path: Path, fake_airflow: FakeAirflow) -> None:
    """Airflow down: one line, the event stays in the outbox file (a restart keeps it) and the next
    tick comes RETRY later; Airflow back: the kept event and the new ones are posted, oldest first,
    with a JWT got from /auth/token -- and the password appears in no line."""
    from audit.serving.airflow_events import Outbox

    cfg = _cfg(make_config, tmp_path)
    down = _airflow(cfg, f"http://127.0.0.1:{_closed_port()}", username="msgaudit", password="s3cret")
    clock = Clock(at(40))
    calls = Calls(clock)
    result, _, warned = _follow(down, clock, calls, since=T0, max_ticks=2)
    assert (result.events_sent, result.events_failed) == (0, 1)
    assert clock.slept == [RETRY.total_seconds()]  # u's next window is final at 11:05; the retry comes first
    assert len(warned) == 2 and all(re.fullmatch(  # one line per tick
        r"follow: airflow: http://127\.0\.0\.1:\d+ cannot be reached: .*; 1 completeness event\(s\) kept, sent "
        r"again on the next tick", w) for w in warned), warned
    assert Outbox(cfg.home / "airflow-events.json").pending == [
        {"asset": "msgaudit://127.0.0.1:9092/u", "extra": _event("u", T0, at(30), at(35))}]

    clock.now = at(75)  # follow restarted with Airflow up: t's first and u's second window are final
    up = _airflow(cfg, fake_airflow.url, username="msgaudit", password="s3cret")
    result, _, warned = _follow(up, clock, calls, max_ticks=1)
    assert warned == [] and (result.events_sent, result.events_failed) == (3, 0)
    assert fake_airflow.events == [
        ("msgaudit://127.0.0.1:9092/u", _event("u", T0, at(30), at(35))),
        ("msgaudit://127.0.0.1:9092/t", _event("t", T0, at(60), at(75))),
        ("msgaudit://127.0.0.1:9092/u", _event("u", at(30), at(60), at(65)))]
    assert fake_airflow.logins == 1
    assert Outbox(cfg.home / "airflow-events.json").pending == []


@pytest.mark.unit
def test_refused_credentials_keep_the_events_and_an_unknown_asset_drops_its_event(
        make_config: Callable[..., Config], tmp_path: Path, fake_airflow: FakeAirflow) -> None:
    from audit.serving.airflow_events import Outbox

    cfg = _cfg(make_config, tmp_path)
    outbox = Outbox(tmp_path / "events.json")
    outbox.add([("msgaudit://127.0.0.1:9092/t", {"window_start": "w1"}),
                ("msgaudit://127.0.0.1:9092/nobody", {"window_start": "w2"}),
                ("msgaudit://127.0.0.1:9092/u", {"window_start": "w3"})])
    warned: list[str] = []
    wrong = outbox.flush(_airflow(cfg, fake_airflow.url, username="msgaudit", password="wrong").airflow,
                         warned.append)
    assert (wrong.sent, wrong.failed, wrong.dropped) == (0, 3, 0)
    assert warned == [f"follow: airflow: {fake_airflow.url} {fake_airflow.url}/auth/token answered 401 for user "
                      "'msgaudit'; check airflow.username and airflow.password; 3 completeness event(s) kept, "
                      "sent again on the next tick"]
    bad_token = outbox.flush(_airflow(cfg, fake_airflow.url, token="expired").airflow, warned.append)
    assert (bad_token.sent, bad_token.failed) == (0, 3)
    assert warned[1] == (f"follow: airflow: {fake_airflow.url} answered 401 Unauthorized; check airflow.token, or "
                         "airflow.username and airflow.password; 3 completeness event(s) kept, sent again on the next "
                         "tick")
    fake_airflow.tokens.add("given")
    ok = outbox.flush(_airflow(cfg, fake_airflow.url, token="given").airflow, warned.append)
    assert (ok.sent, ok.failed, ok.dropped) == (2, 0, 1)
    assert warned[2:] == ["follow: airflow: no asset msgaudit://127.0.0.1:9092/nobody in Airflow (no DAG is "
                          "scheduled on it): the completeness event of window w2 is not sent"]
    assert fake_airflow.events == [("msgaudit://127.0.0.1:9092/t", {"window_start": "w1"}),
                                   ("msgaudit://127.0.0.1:9092/u", {"window_start": "w3"})]
    assert fake_airflow.logins == 0 and Outbox(tmp_path / "events.json").pending == []
