"""Real monitoring servers for the tests: Prometheus and Alertmanager from Debian's packages
(`prometheus`, `prometheus-alertmanager`; `./dev test` installs them), each on a free loopback port
in a throwaway folder, and a small HTTP server that records the JSON bodies POSTed to it (the
generic webhook's receiving end)."""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import yaml

from audit.runtime.local_kafka import free_port


def binary(name: str, package: str) -> str:
    found = shutil.which(name)
    if found is None:
        raise RuntimeError(f"{name} not found: apt-get install -y {package} (./dev test does)")
    return found


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Prometheus text -> {(sample name, sorted labels): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def get_json(url: str, timeout: float = 5.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return json.loads(resp.read())


def _wait_ready(url: str, proc: subprocess.Popen[bytes], log: Path, seconds: float = 30.0) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url} exited with {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(f"{url}/-/ready", timeout=1) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} not ready after {seconds:.0f} s: {log.read_text()[-2000:]}")


@contextmanager
def _server(cmd: Sequence[str], url: str, folder: Path) -> Iterator[str]:
    log = folder / "server.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(list(cmd), stdout=out, stderr=subprocess.STDOUT, cwd=folder)
    try:
        _wait_ready(url, proc, log)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(folder, ignore_errors=True)


@contextmanager
def prometheus(target: str, rule_files: Sequence[Path] = ()) -> Iterator[str]:
    """Prometheus scraping `target` (host:port, path /metrics) every second, evaluating `rule_files`
    every second; yields its base URL."""
    folder = Path(tempfile.mkdtemp(prefix="msgaudit-prom-"))
    rules = []
    for i, f in enumerate(rule_files):
        rules.append(str(shutil.copy(f, folder / f"rules-{i}.yml")))
    (folder / "prometheus.yml").write_text(yaml.safe_dump({
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": rules,
        "scrape_configs": [{"job_name": "msgaudit", "static_configs": [{"targets": [target]}]}],
    }))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with _server([binary("prometheus", "prometheus"), f"--config.file={folder / 'prometheus.yml'}",
                  f"--storage.tsdb.path={folder / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
                 url, folder) as u:
        yield u


def query(prom: str, promql: str) -> list[dict[str, Any]]:
    """The result vector of an instant PromQL query over the HTTP API (status must be success)."""
    body = get_json(f"{prom}/api/v1/query?" + urllib.parse.urlencode({"query": promql}))
    assert body["status"] == "success", body
    result: list[dict[str, Any]] = body["data"]["result"]
    return result


@contextmanager
def alertmanager() -> Iterator[str]:
    """Alertmanager (API v2) with one receiver that sends nothing, no cluster; yields its base URL."""
    folder = Path(tempfile.mkdtemp(prefix="msgaudit-am-"))
    (folder / "alertmanager.yml").write_text(yaml.safe_dump({
        "route": {"receiver": "none", "group_wait": "1h"}, "receivers": [{"name": "none"}]}))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with _server([binary("prometheus-alertmanager", "prometheus-alertmanager"),
                  f"--config.file={folder / 'alertmanager.yml'}", f"--storage.path={folder / 'data'}",
                  f"--web.listen-address=127.0.0.1:{port}", "--cluster.listen-address="], url, folder) as u:
        yield u


class Webhook:
    """An HTTP server on a free loopback port recording every JSON body POSTed to it."""

    def __init__(self) -> None:
        received: list[Any] = []
        self.received = received

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                length = int(self.headers.get("Content-Length", 0))
                received.append(json.loads(self.rfile.read(length)))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/hook"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@contextmanager
def pushgateway() -> Iterator[str]:
    """A Prometheus Pushgateway (Debian's `prometheus-pushgateway`); yields its base URL."""
    folder = Path(tempfile.mkdtemp(prefix="msgaudit-pgw-"))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with _server([binary("prometheus-pushgateway", "prometheus-pushgateway"),
                  f"--web.listen-address=127.0.0.1:{port}"], url, folder) as u:
        yield u
