"""One headless Chromium for several page checks, driven over the DevTools protocol.

Starting Chromium costs a second or two, so a test opens one `Browser` and navigates it from page
to page, evaluating JavaScript in each. Fails (never skips) when Chromium is missing.
"""

from __future__ import annotations

import base64
import contextlib
import json
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from websockets.sync.client import ClientConnection, connect

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run", "--hide-scrollbars",
         "--remote-debugging-address=127.0.0.1", "--remote-debugging-port=0", "--remote-allow-origins=*"]
# What Chromium answers a script sent while the page is being replaced: asked again, the new page answers.
NAVIGATING = ("Inspected target navigated or closed", "Execution context was destroyed",
              "Cannot find context with specified id")


class Navigating(AssertionError):
    """The page went away under a script (a navigation was under way)."""


class Browser:
    def __init__(self, profile: Path, width: int = 1400, height: int = 900) -> None:
        exe = shutil.which("chromium") or shutil.which("chromium-browser")
        if exe is None:
            pytest.fail("chromium is not installed: apt-get update && apt-get install -y chromium")
        self.proc = subprocess.Popen([exe, *FLAGS, f"--user-data-dir={profile}", f"--window-size={width},{height}",
                                      "about:blank"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        port_file = profile / "DevToolsActivePort"
        deadline = time.monotonic() + 60
        while not (port_file.is_file() and port_file.read_text().strip()):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                pytest.fail("chromium did not start its DevTools endpoint")
            time.sleep(0.05)
        port = int(port_file.read_text().split()[0])
        import urllib.request

        while True:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as resp:  # noqa: S310
                pages = [t for t in json.load(resp) if t["type"] == "page"]
            if pages or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        self._stack = contextlib.ExitStack()
        self.ws: ClientConnection = self._stack.enter_context(
            connect(pages[0]["webSocketDebuggerUrl"], max_size=None, open_timeout=30))
        self._id = 0
        self.requests: list[str] = []  # every URL the page asked for since the last navigate
        self.send("Page.enable")
        self.send("Network.enable")
        self.send("Emulation.setDeviceMetricsOverride", {"width": width, "height": height, "deviceScaleFactor": 1,
                                                         "mobile": False})

    def send(self, method: str, params: dict[str, Any] | None = None, timeout: float = 60) -> dict[str, Any]:
        self._id += 1
        self.ws.send(json.dumps({"id": self._id, "method": method, "params": params or {}}))
        deadline = time.monotonic() + timeout
        while True:
            msg = json.loads(self.ws.recv(timeout=max(0.1, deadline - time.monotonic())))
            if msg.get("method") == "Network.requestWillBeSent":
                self.requests.append(msg["params"]["request"]["url"])
            if msg.get("id") == self._id:
                if "error" in msg:
                    error = str(msg["error"].get("message", ""))
                    raise (Navigating if error.startswith(NAVIGATING) else AssertionError)(f"{method}: {msg['error']}")
                return dict(msg["result"])

    def evaluate(self, expression: str, timeout: float = 60) -> Any:
        """The JSON value of `expression` (awaited if it is a promise)."""
        res = self.send("Runtime.evaluate", {"expression": expression, "awaitPromise": True, "returnByValue": True,
                                             "timeout": int(timeout * 1000)}, timeout=timeout + 5)
        if "exceptionDetails" in res:
            raise AssertionError(f"page script failed: {res['exceptionDetails']}")
        return res["result"].get("value")

    def _poll(self, expression: str, what: str, timeout: float) -> Any:
        """The first non-null value of `expression`, asked every 50 ms; a navigation under way
        counts as null."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(Navigating):
                value = self.evaluate(expression)
                if value is not None:
                    return value
            time.sleep(0.05)
        raise AssertionError(f"{what} within {timeout}s")

    def open(self, url: str, timeout: float = 60) -> int:
        """Navigate and wait until every chart is drawn; returns the page's data-rendered-ms."""
        self.requests = []
        self.send("Page.navigate", {"url": url})
        return int(self._poll("document.readyState === 'complete' && location.href === " + json.dumps(url)
                              + " ? document.body.getAttribute('data-rendered-ms') : null",
                              f"{url}: charts not drawn", timeout))

    def click(self, selector: str, timeout: float = 60) -> str:
        """Click the first element matching `selector` (a link to another page) and wait until that
        page's charts are drawn; returns its URL (with the fragment)."""
        before = self.evaluate("location.href.split('#')[0]")
        self.requests = []
        with contextlib.suppress(Navigating):  # the click's navigation may replace the page before the answer
            self.evaluate(f"document.querySelector({json.dumps(selector)}).click()")
        return str(self._poll("location.href.split('#')[0] !== " + json.dumps(before) + " && document.readyState "
                              "=== 'complete' && document.body.getAttribute('data-rendered-ms') !== null "
                              "? location.href : null", f"{selector}: the linked page did not load", timeout))

    def screenshot(self, path: Path, full_height: int | None = None) -> None:
        params: dict[str, Any] = {"format": "png"}
        if full_height:
            params["clip"] = {"x": 0, "y": 0, "width": 1400, "height": full_height, "scale": 1}
            params["captureBeyondViewport"] = True
        path.write_bytes(base64.b64decode(self.send("Page.captureScreenshot", params)["data"]))

    def close(self) -> None:
        try:
            if hasattr(self, "_stack"):
                self._stack.close()
        finally:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> Browser:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
