"""A real headless Chromium for tests, driven over the DevTools protocol on a pipe
(``--remote-debugging-pipe``: commands in on fd 3, answers and events out on fd 4, each a JSON
message ending in a NUL byte), so no WebDriver and no websocket library: open pages in tabs of their
own, run script in them, read back what it returns.

    with Browser(tmp_path, resolve={"evil.example": "127.0.0.1"}) as browser:
        page = browser.page()
        page.open("http://evil.example:8080/attack.html")
        results = page.evaluate("window.attack")  # a promise: its value, once settled

Chromium is Debian's ``chromium`` (scripts/browser/install.sh; ``make test`` installs it):
``require_chromium()`` skips a test where it is missing, and fails it under ``CI=true``.
"""

from __future__ import annotations

import contextlib
import fcntl
import http.server
import json
import os
import select
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

# What works in a container as root, without a display or a GPU, and talks to nothing unasked.
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--no-first-run", "--no-default-browser-check", "--disable-extensions", "--mute-audio",
         "--remote-debugging-pipe")
INSTALL = "scripts/browser/install.sh (`make browser`; `make test` runs it)"
# Where tests write what a page looked like (git-ignored: .loopline/), for a person to look at.
SCREENSHOTS = Path(__file__).resolve().parents[2] / ".loopline" / "screenshots"


def chromium_path() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def require_chromium() -> str:
    """Chromium's path; a skip saying why where it is missing, a failure under CI=true."""
    path = chromium_path()
    if path is None:
        why = f"chromium is not installed: {INSTALL}"
        if os.environ.get("CI") == "true":
            pytest.fail(why)
        pytest.skip(why)
    return path


class BrowserError(Exception):
    pass


def _above_4(fd: int) -> int:
    moved = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10)
    os.close(fd)
    return moved


class Browser:
    """One Chromium process with its own throwaway profile under ``folder``. ``resolve`` maps host
    names to addresses (``--host-resolver-rules``), so a page can come from ``evil.example``."""

    def __init__(self, folder: Path, *, resolve: dict[str, str] | None = None, timeout_s: float = 30.0):
        self.folder = folder
        self.timeout_s = timeout_s
        self._next_id = 0
        self._buffer = b""
        self._events: list[dict[str, Any]] = []
        rules = ",".join(f"MAP {name} {address}" for name, address in (resolve or {}).items())
        argv = [require_chromium(), *FLAGS, f"--user-data-dir={folder / 'profile'}",
                *([f"--host-resolver-rules={rules}"] if rules else []), "about:blank"]
        commands_r, self._commands = os.pipe()
        self._answers, answers_w = os.pipe()
        # Above 4, so that putting one on 3 or 4 never closes the other.
        commands_r, answers_w = (_above_4(fd) for fd in (commands_r, answers_w))
        # Chromium wants the pipe's ends as its fds 3 and 4: bash puts them there and execs it.
        script = f'exec 3<&{commands_r} 4>&{answers_w} {commands_r}<&- {answers_w}>&-; exec "$@"'
        folder.mkdir(parents=True, exist_ok=True)
        self.log = folder / "chromium.log"
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(["bash", "-c", script, "chromium", *argv], stdin=subprocess.DEVNULL,
                                         stdout=log, stderr=log, pass_fds=(commands_r, answers_w),
                                         start_new_session=True)
        os.close(commands_r)
        os.close(answers_w)  # only Chromium writes it now: EOF when it exits

    def __enter__(self) -> Browser:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def page(self) -> Page:
        """A new tab, at about:blank."""
        target = self.call("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        page = Page(self, session)
        page.call("Page.enable")
        page.call("Runtime.enable")
        return page

    def call(self, method: str, params: dict[str, Any] | None = None, *, session: str | None = None,
             timeout_s: float | None = None) -> dict[str, Any]:
        """Send one DevTools command and wait for its answer; events that arrive meanwhile are kept
        for ``wait_event``."""
        self._next_id += 1
        message: dict[str, Any] = {"id": self._next_id, "method": method, "params": params or {}}
        if session is not None:
            message["sessionId"] = session
        os.write(self._commands, json.dumps(message).encode() + b"\0")
        answer = self._read_until(lambda m: m.get("id") == message["id"], timeout_s, f"{method}'s answer")
        if "error" in answer:
            raise BrowserError(f"{method}: {answer['error']}")
        return answer.get("result", {})

    def wait_event(self, method: str, *, session: str | None = None,
                   timeout_s: float | None = None) -> dict[str, Any]:
        """The first event ``method`` (of ``session``) not yet waited for: its params."""
        def wanted(m: dict[str, Any]) -> bool:
            return m.get("method") == method and m.get("sessionId") == session

        for event in self._events:
            if wanted(event):
                self._events.remove(event)
                return event.get("params", {})
        return self._read_until(wanted, timeout_s, method).get("params", {})

    def forget_events(self, method: str, *, session: str | None = None) -> None:
        """Drop the events ``method`` (of ``session``) received and not waited for, and any that
        have arrived unread."""
        while True:  # read what Chromium has sent so far, without waiting
            ready, _, _ = select.select([self._answers], [], [], 0)
            if not ready:
                break
            chunk = os.read(self._answers, 1 << 16)
            if not chunk:
                break
            self._buffer += chunk
            while b"\0" in self._buffer:
                raw, self._buffer = self._buffer.split(b"\0", 1)
                self._events.append(json.loads(raw))
        self._events = [e for e in self._events
                        if not (e.get("method") == method and e.get("sessionId") == session)]

    def _read_until(self, done, timeout_s: float | None, what: str) -> dict[str, Any]:
        deadline = time.monotonic() + (timeout_s or self.timeout_s)
        # Invariant: _buffer holds the bytes after the last complete message read.
        while True:
            while b"\0" in self._buffer:
                raw, self._buffer = self._buffer.split(b"\0", 1)
                message = json.loads(raw)
                if done(message):
                    return message
                if "method" in message:  # an event (a stale answer is dropped: calls wait for theirs)
                    self._events.append(message)
            left = deadline - time.monotonic()
            if left <= 0:
                raise BrowserError(f"no {what} from Chromium in {timeout_s or self.timeout_s} s")
            ready, _, _ = select.select([self._answers], [], [], left)
            if ready:
                chunk = os.read(self._answers, 1 << 16)
                if not chunk:
                    raise BrowserError(f"Chromium exited ({self.proc.poll()}):\n{self.log_tail()}")
                self._buffer += chunk

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def close(self) -> None:
        try:
            if self.proc.poll() is None:
                self.call("Browser.close", timeout_s=5)
        except (BrowserError, OSError):
            pass
        finally:
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)  # its session: the renderer and GPU processes too
                self.proc.wait()
            for fd in (self._commands, self._answers):
                try:
                    os.close(fd)
                except OSError:
                    pass


class Page:
    """One tab of a Browser."""

    def __init__(self, browser: Browser, session: str):
        self.browser = browser
        self.session = session

    def call(self, method: str, params: dict[str, Any] | None = None, **kw: Any) -> dict[str, Any]:
        return self.browser.call(method, params, session=self.session, **kw)

    def open(self, url: str) -> None:
        """Go to ``url`` and wait until it has loaded (its scripts ran; what they started may not
        have finished: evaluate a promise they left to wait for it)."""
        # A navigation the page made by itself (a form submitted, a redirect) left its own load
        # events unread: drop them, or the wait below would return before this page has loaded.
        self.browser.forget_events("Page.loadEventFired", session=self.session)
        navigated = self.call("Page.navigate", {"url": url})
        if navigated.get("errorText"):
            raise BrowserError(f"{url}: {navigated['errorText']}")
        self.browser.wait_event("Page.loadEventFired", session=self.session)

    def evaluate(self, expression: str, *, timeout_s: float | None = None) -> Any:
        """``expression``'s value in the page (a promise's once it settles), as JSON would carry it."""
        result = self.call("Runtime.evaluate", {"expression": expression, "awaitPromise": True,
                                                "returnByValue": True}, timeout_s=timeout_s)
        if "exceptionDetails" in result:
            details = result["exceptionDetails"]
            raise BrowserError(f"{expression[:80]!r} threw: "
                               f"{details.get('exception', {}).get('description') or details.get('text')}")
        return result["result"].get("value")

    def wait_for(self, expression: str, *, timeout_s: float = 30.0, every_s: float = 0.2) -> Any:
        """Evaluate ``expression`` until its value is truthy; that value (a BrowserError after
        ``timeout_s``, with the last value seen)."""
        deadline = time.monotonic() + timeout_s
        value = None
        while time.monotonic() < deadline:
            value = self.evaluate(expression)
            if value:
                return value
            time.sleep(every_s)
        raise BrowserError(f"{expression[:120]!r} still {value!r} after {timeout_s} s")

    def record_changes(self, element_id: str, value: str, name: str = "seen") -> None:
        """From now on, each time anything under ``#element_id`` changes, push ``value`` (a script
        expression) onto ``window[name]``: what a live page showed, update by update."""
        store = f"window[{json.dumps(name)}]"
        target = f"document.getElementById({json.dumps(element_id)})"
        self.evaluate(f"{store} = []; new MutationObserver(() => {store}.push({value}))"
                      f".observe({target}, {{childList: true, subtree: true}})")

    def viewport(self, width: int, height: int, *, mobile: bool = False) -> None:
        """Lay the page out as a window (``mobile``: a phone's) of this many CSS pixels."""
        self.call("Emulation.setDeviceMetricsOverride", {"width": width, "height": height,
                                                          "deviceScaleFactor": 1, "mobile": mobile})

    def screenshot(self, path: Path) -> Path:
        """What the page shows now, as a PNG at ``path``."""
        import base64

        shot = self.call("Page.captureScreenshot", {"format": "png"})
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(shot["data"]))
        return path

    def without_javascript(self) -> None:
        """Run no script in this tab from its next page on (as a browser with JavaScript off)."""
        self.call("Emulation.setScriptExecutionDisabled", {"value": True})

    def press(self, key: str, code: str, key_code: int, text: str = "") -> None:
        """One key pressed and released, as the keyboard would (Tab: "Tab", "Tab", 9; Enter:
        "Enter", "Enter", 13, "\r")."""
        down = {"type": "keyDown", "text": text} if text else {"type": "rawKeyDown"}
        for event in (down, {"type": "keyUp"}):
            self.call("Input.dispatchKeyEvent", {**event, "key": key, "code": code,
                                                 "windowsVirtualKeyCode": key_code})

    def type_text(self, text: str) -> None:
        """``text`` typed into the focused field."""
        self.call("Input.insertText", {"text": text})


class Site:
    """A web site of another origin: ``html`` is the page it serves at ``url`` (any path);
    ``cookies`` the ``Cookie`` header of each request it got (what a browser gave it)."""

    def __init__(self, name: str, port: int):
        self.url = f"http://{name}:{port}/"
        self.html = b""
        self.cookies: list[str] = []


@contextlib.contextmanager
def other_site(name: str) -> Iterator[Site]:
    """``http://<name>:<port>/``, served from this process (give the Browser ``resolve={name:
    "127.0.0.1"}``), for the page of an attacker's site."""
    site: Site

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # http.server's name
            site.cookies.append(self.headers.get("Cookie", ""))
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(site.html)))
            self.end_headers()
            self.wfile.write(site.html)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    site = Site(name, server.server_address[1])
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield site
    finally:
        server.shutdown()
        server.server_close()
