"""Completeness events posted to Airflow's REST API: what `msgaudit follow` (which runs outside
Airflow) emits when a window becomes final (docs/design.md §6.5, §8 `airflow:`).

Each event is (asset URI, extra), built by `audit.serving.completeness.window_events`, as the DAGs
emit theirs. `Outbox` keeps the events not yet accepted by Airflow in a JSON file (written
atomically): an event is added there as soon as its window is done, and `Outbox.flush` posts every
pending event (`POST <url>/api/v2/assets/events` with the asset's id, looked up once by
`GET <url>/api/v2/assets?uri_pattern=<uri>`). Airflow missing, unreachable or refusing the
credentials is one line per flush; the events stay in the file and the next flush (follow's next
tick) sends them again, oldest first. An asset Airflow does not know (no DAG is scheduled on it)
cannot take an event: that is one line and the event is dropped (nothing waits for it).

Authentication: `airflow.token` is sent as a bearer token as is; with `airflow.username` and
`airflow.password` a token is obtained from `POST <url>/auth/token` (Airflow 3's JWT endpoint)
and obtained again when the API answers 401. No secret is ever part of a line.

No Airflow import: plain HTTP through `urllib`.
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from audit.core.config import AirflowConfig
from audit.core.errors import InputError

OUTBOX_FILE = "airflow-events.json"


class _Refused(Exception):
    """Airflow answered, but not with what was asked: a status line, what to do."""


@dataclass
class Flushed:
    sent: int = 0
    failed: int = 0  # events kept for the next flush
    dropped: int = 0  # events of assets Airflow does not know


class AirflowApi:
    """The few calls of Airflow 3's REST API the events need."""

    def __init__(self, cfg: AirflowConfig) -> None:
        assert cfg.url is not None
        self.cfg, self.url = cfg, cfg.url
        self.token = cfg.token
        self.ids: dict[str, int | None] = {}

    def _call(self, method: str, path: str, body: Any = None, auth: bool = True) -> Any:
        headers = {"Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = "application/json"
        if auth:
            if self.token is None:
                self.token = self._login()
            headers["Authorization"] = f"Bearer {self.token}"
        req = urllib.request.Request(self.url + path, method=method, headers=headers,
                                     data=None if body is None else json.dumps(body).encode("utf-8"))
        with urllib.request.urlopen(req, timeout=self.cfg.timeout.total_seconds()) as resp:
            return json.loads(resp.read() or b"null")

    def _login(self) -> str | None:
        if self.cfg.username is None:
            return None  # an API without authentication (or one that lets everyone in)
        try:
            out = self._call("POST", "/auth/token", {"username": self.cfg.username, "password": self.cfg.password},
                             auth=False)
        except urllib.error.HTTPError as e:
            raise _Refused(f"{self.url}/auth/token answered {e.code} for user {self.cfg.username!r}; check "
                           "airflow.username and airflow.password") from None
        return str(out["access_token"])

    def request(self, method: str, path: str, body: Any = None) -> Any:
        try:
            return self._call(method, path, body)
        except urllib.error.HTTPError as e:
            if e.code == 401 and self.cfg.username is not None:  # an expired token: log in again, once
                self.token = None
                return self._call(method, path, body)
            raise

    def asset_id(self, uri: str) -> int | None:
        if uri not in self.ids:
            query = urllib.parse.urlencode({"uri_pattern": uri, "limit": 100})
            found = self.request("GET", f"/api/v2/assets?{query}")
            self.ids[uri] = next((int(a["id"]) for a in found.get("assets", []) if a.get("uri") == uri), None)
        return self.ids[uri]

    def post_event(self, asset_id: int, extra: dict[str, Any]) -> None:
        self.request("POST", "/api/v2/assets/events", {"asset_id": asset_id, "extra": extra})


class Outbox:
    """The completeness events not yet accepted by Airflow, in `path` (JSON, written atomically)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.pending: list[dict[str, Any]] = []
        if path.exists():
            try:
                self.pending = [{"asset": str(e["asset"]), "extra": dict(e["extra"])}
                                for e in json.loads(path.read_text(encoding="utf-8"))["pending"]]
            except (ValueError, KeyError, TypeError):
                raise InputError(f"{path}: pending completeness events are not valid JSON; delete the file "
                                 "(its events are then not sent)") from None

    def _write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"pending": self.pending}, indent=1, sort_keys=True), encoding="utf-8")
        os.replace(tmp, self.path)

    def add(self, events: Sequence[tuple[str, dict[str, Any]]]) -> None:
        if events:
            self.pending += [{"asset": uri, "extra": extra} for uri, extra in events]
            self._write()

    def flush(self, cfg: AirflowConfig, warn: Callable[[str], None]) -> Flushed:
        """Post every pending event, oldest first; stop at the first that cannot be sent (one line)
        and keep it and the rest for the next flush."""
        out = Flushed()
        if not self.pending:
            return out
        if cfg.url is None:
            out.failed = len(self.pending)
            warn(f"follow: airflow: {out.failed} completeness event(s) pending and no airflow.url set; set it "
                 "to send them (or delete the pending file to give them up)")
            return out
        api = AirflowApi(cfg)
        while self.pending:
            event = self.pending[0]
            try:
                asset_id = api.asset_id(event["asset"])
                if asset_id is not None:
                    api.post_event(asset_id, event["extra"])
            except (OSError, urllib.error.URLError, _Refused, ValueError, KeyError) as e:
                out.failed = len(self.pending)
                why = (f"answered {e.code} {e.reason}" if isinstance(e, urllib.error.HTTPError)
                       else f"{e}" if isinstance(e, _Refused) else f"cannot be reached: {e}")
                hint = ("; check airflow.token, or airflow.username and airflow.password"
                        if isinstance(e, urllib.error.HTTPError) and e.code in (401, 403) else "")
                warn(f"follow: airflow: {cfg.url} {why}{hint}; {out.failed} completeness event(s) kept, sent "
                     "again on the next tick")
                break
            self.pending.pop(0)
            if asset_id is None:
                out.dropped += 1
                warn(f"follow: airflow: no asset {event['asset']} in Airflow (no DAG is scheduled on it): the "
                     f"completeness event of window {event['extra'].get('window_start')} is not sent")
            else:
                out.sent += 1
        self._write()
        return out
