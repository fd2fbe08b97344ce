"""Open the built docs site in headless chromium and check that it renders.

    python docs/check_site.py [--site build/site] [--screenshot docs/site-start.png]

Serves the site (`mkdocs build` first if it is not built) on a local port, drives Debian's
chromium over the DevTools protocol on a pipe (`--remote-debugging-pipe`: fd 3 in, fd 4
out, one JSON message per NUL) and checks that:
  - the start page renders its title and nav;
  - the API page renders mkdocstrings' objects (Engine among them);
  - the search, typed into, lists results;
  - no page logs a console error, an uncaught exception or a failed load.
Saves a screenshot of the start page. Exits 1 with the failures listed, 0 when all pass.
"""

from __future__ import annotations

import argparse
import base64
import functools
import http.server
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--remote-debugging-pipe", "--window-size=1280,800"]


class Browser:
    """chromium over --remote-debugging-pipe, one page attached (flat session)."""

    def __init__(self, binary: str, profile: str):
        to_chrome_r, self._out = os.pipe()
        self._in, from_chrome_w = os.pipe()
        # chromium reads commands from fd 3 and writes replies to fd 4
        self.proc = subprocess.Popen(
            [binary, *FLAGS, f"--user-data-dir={profile}", "about:blank"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            pass_fds=(3, 4), preexec_fn=lambda: (os.dup2(to_chrome_r, 3), os.dup2(from_chrome_w, 4)))
        os.close(to_chrome_r)
        os.close(from_chrome_w)
        self._buf = b""
        self._next_id = 0
        self.events: list[dict] = []
        target = self.call("Target.createTarget", url="about:blank")["targetId"]
        self.session = self.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        for domain in ("Page", "Runtime", "Log", "Network"):
            self.call(f"{domain}.enable", session=True)

    def _read(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while b"\0" not in self._buf:
            if time.monotonic() > deadline:
                raise TimeoutError("chromium did not answer")
            chunk = os.read(self._in, 1 << 16)
            if not chunk:
                raise RuntimeError("chromium closed its pipe")
            self._buf += chunk
        message, self._buf = self._buf.split(b"\0", 1)
        return json.loads(message)

    def call(self, method: str, session: bool = False, timeout: float = 30, **params) -> dict:
        """Send one command and return its result; events read meanwhile go to `events`."""
        self._next_id += 1
        message = {"id": self._next_id, "method": method, "params": params}
        if session:
            message["sessionId"] = self.session
        os.write(self._out, json.dumps(message).encode() + b"\0")
        while True:
            reply = self._read(timeout)
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply["result"]
            self.events.append(reply)

    def evaluate(self, expression: str):
        result = self.call("Runtime.evaluate", session=True, expression=expression, returnByValue=True)
        return result["result"].get("value")

    def goto(self, url: str, timeout: float = 30) -> None:
        """Navigate and wait for the load event."""
        start = len(self.events)
        self.call("Page.navigate", session=True, url=url)
        deadline = time.monotonic() + timeout
        while not any(e.get("method") == "Page.loadEventFired" for e in self.events[start:]):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{url} did not load")
            self.events.append(self._read(deadline - time.monotonic()))

    def wait_for(self, expression: str, timeout: float = 15) -> bool:
        """Poll a JS expression until it is truthy."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.evaluate(expression):
                return True
            time.sleep(0.2)
        return False

    def errors(self) -> list[str]:
        """Console errors, uncaught exceptions and failed loads seen so far."""
        found = []
        for event in self.events:
            method, params = event.get("method"), event.get("params", {})
            if method == "Runtime.exceptionThrown":
                found.append("exception: " + params["exceptionDetails"].get("text", ""))
            elif method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
                found.append("console.error: " + " ".join(str(a.get("value", a.get("description")))
                                                          for a in params.get("args", [])))
            elif method == "Log.entryAdded" and params["entry"].get("level") == "error":
                found.append(f"log: {params['entry'].get('text')} {params['entry'].get('url', '')}")
            elif method == "Network.loadingFailed" and not params.get("canceled"):
                found.append(f"load failed: {params.get('errorText')}")
        return found

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


def serve(site: Path) -> http.server.ThreadingHTTPServer:
    """The site on 127.0.0.1, a free port, in a daemon thread."""
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args) -> None:  # one line per request would bury the result
            pass

    handler = functools.partial(Quiet, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def check(browser: Browser, base: str, screenshot: Path) -> list[str]:
    """Run the three checks; return the failures (empty: all passed)."""
    failures = []
    browser.goto(base + "/")
    if "LongStraw" not in (browser.evaluate("document.querySelector('h1')?.textContent") or ""):
        failures.append("start page: no LongStraw title")
    if not browser.evaluate("document.querySelectorAll('.md-nav__link').length > 5"):
        failures.append("start page: no navigation")
    shot = browser.call("Page.captureScreenshot", session=True, format="png")["data"]
    screenshot.write_bytes(base64.b64decode(shot))
    print(f"start page rendered; screenshot {screenshot}")

    browser.goto(base + "/api/")
    n = browser.evaluate("document.querySelectorAll('.doc-object').length")
    has_engine = browser.evaluate("[...document.querySelectorAll('.doc-heading')]"
                                  ".some(h => h.textContent.includes('Engine'))")
    if not n or not has_engine:
        failures.append(f"API page: {n} documented objects, Engine found: {has_engine}")
    else:
        print(f"API page rendered: {n} documented objects")

    browser.evaluate("""(() => { const box = document.querySelector('input.md-search__input');
        box.focus(); box.value = 'fit_config'; box.dispatchEvent(new Event('input', {bubbles: true})); })()""")
    if browser.wait_for("document.querySelectorAll('.md-search-result__item').length > 0"):
        hits = browser.evaluate("document.querySelectorAll('.md-search-result__item').length")
        print(f"search for 'fit_config': {hits} results")
    else:
        failures.append("search: no results for 'fit_config'")
    failures += browser.errors()
    return failures


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--site", type=Path, default=ROOT / "build" / "site")
    parser.add_argument("--screenshot", type=Path, default=ROOT / "docs" / "site-start.png")
    parser.add_argument("--chromium", default=shutil.which("chromium") or "chromium")
    args = parser.parse_args(argv)
    if not shutil.which(args.chromium):
        print("check_site: chromium not found (apt-get install -y chromium)", file=sys.stderr)
        return 2
    if not (args.site / "index.html").exists():
        subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(args.site)],
                       cwd=ROOT, check=True, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    server = serve(args.site)
    base = f"http://127.0.0.1:{server.server_address[1]}"
    with tempfile.TemporaryDirectory() as profile:
        browser = Browser(args.chromium, profile)
        try:
            failures = check(browser, base, args.screenshot)
        finally:
            browser.close()
            server.shutdown()
    for failure in failures:
        print("FAIL", failure)
    print("docs site: OK" if not failures else f"docs site: {len(failures)} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
