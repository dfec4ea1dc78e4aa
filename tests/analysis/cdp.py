"""A minimal Chrome DevTools Protocol client over ``--remote-debugging-pipe`` (stdlib only).

Debian's headless Chromium is driven through two pipes (fd 3: commands in, fd 4: replies and
events out, NUL-separated JSON), so no websocket library and no browser download is needed.
Used by the report's browser test and by ``benchmarks/report_screenshots.py``.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--remote-debugging-pipe",
)


def find_chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        p = shutil.which(name) or (f"/usr/bin/{name}" if Path(f"/usr/bin/{name}").exists() else None)
        if p:
            return p
    return None


class Browser:
    """One headless Chromium with a fresh profile; :meth:`open` a page, then :meth:`send`."""

    def __init__(self, exe: str, profile: str | os.PathLike, *, timeout: float = 60.0):
        self.timeout = timeout
        to_chrome_r, self._w = os.pipe()
        self._r, from_chrome_w = os.pipe()

        def wire():  # in the child: the protocol's fds 3 and 4 (the pipe fds may be 3 or 4 already)
            a = fcntl.fcntl(to_chrome_r, fcntl.F_DUPFD, 10)
            b = fcntl.fcntl(from_chrome_w, fcntl.F_DUPFD, 10)
            os.dup2(a, 3)
            os.dup2(b, 4)
            os.set_inheritable(3, True)
            os.set_inheritable(4, True)

        # close_fds=False: subprocess would close fds 3/4 after preexec_fn; every other fd of
        # this process is close-on-exec already (PEP 446)
        self.proc = subprocess.Popen(
            [exe, *FLAGS, f"--user-data-dir={profile}", "about:blank"],
            preexec_fn=wire,
            close_fds=False,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        os.close(to_chrome_r)
        os.close(from_chrome_w)
        self._buf = b""
        self._id = 0
        self.events: list[dict] = []
        self.session: str | None = None

    def _read(self) -> dict:
        while b"\0" not in self._buf:
            chunk = os.read(self._r, 1 << 20)
            if not chunk:
                raise RuntimeError(f"chromium closed the pipe: {self.proc.stderr.read().decode()[-2000:]}")
            self._buf += chunk
        msg, self._buf = self._buf.split(b"\0", 1)
        return json.loads(msg)

    def send(self, method: str, params: dict | None = None, *, session: bool = True) -> dict:
        self._id += 1
        msg = {"id": self._id, "method": method, "params": params or {}}
        if session and self.session:
            msg["sessionId"] = self.session
        os.write(self._w, json.dumps(msg).encode() + b"\0")
        t0 = time.monotonic()
        while time.monotonic() - t0 < self.timeout:
            m = self._read()
            if m.get("id") == self._id:
                if "error" in m:
                    raise RuntimeError(f"{method}: {m['error']}")
                return m.get("result", {})
            self.events.append(m)
        raise TimeoutError(method)

    def wait_event(self, method: str) -> dict:
        for e in self.events:
            if e.get("method") == method:
                return e
        t0 = time.monotonic()
        while time.monotonic() - t0 < self.timeout:
            m = self._read()
            self.events.append(m)
            if m.get("method") == method:
                return m
        raise TimeoutError(method)

    def open(self, url: str, *, width: int = 1280, height: int = 900) -> None:
        """A new tab at ``width`` x ``height`` CSS px, console and log collected, ``url`` loaded."""
        target = self.send("Target.createTarget", {"url": "about:blank"}, session=False)["targetId"]
        self.session = self.send("Target.attachToTarget", {"targetId": target, "flatten": True}, session=False)[
            "sessionId"
        ]
        for domain in ("Page", "Runtime", "Log"):
            self.send(f"{domain}.enable")
        self.send(
            "Emulation.setDeviceMetricsOverride",
            {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False},
        )
        self.send("Page.navigate", {"url": url})
        self.wait_event("Page.loadEventFired")

    def evaluate(self, js: str):
        r = self.send("Runtime.evaluate", {"expression": js, "returnByValue": True, "awaitPromise": True})
        if "exceptionDetails" in r:
            raise RuntimeError(f"page script failed: {r['exceptionDetails']}")
        return r["result"].get("value")

    def errors(self) -> list[str]:
        """Console errors, uncaught exceptions and error log entries seen so far."""
        out = []
        for e in self.events:
            m, p = e.get("method"), e.get("params", {})
            if m == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
                out.append("console: " + " ".join(str(a.get("value", a.get("description"))) for a in p.get("args", [])))
            elif m == "Runtime.exceptionThrown":
                out.append("exception: " + json.dumps(p.get("exceptionDetails", {}))[:500])
            elif m == "Log.entryAdded" and p.get("entry", {}).get("level") == "error":
                out.append("log: " + p["entry"].get("text", ""))
        return out

    def screenshot(self, path: str | os.PathLike, clip: dict | None = None) -> Path:
        params = {"format": "png", "captureBeyondViewport": True}
        if clip:
            params["clip"] = {**clip, "scale": 1}
        data = self.send("Page.captureScreenshot", params)["data"]
        p = Path(path)
        p.write_bytes(base64.b64decode(data))
        return p

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.send("Browser.close", session=False)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self._w)
        os.close(self._r)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


#: the page facts the report test checks (sections, images, overflow at the window width)
PAGE_FACTS = """(() => {
  const imgs = [...document.images];
  return {
    sections: [...document.querySelectorAll('section[id]')].map(s => s.id),
    headings: [...document.querySelectorAll('h2')].map(h => h.textContent.trim()),
    images: imgs.map(i => ({alt: i.alt, complete: i.complete, w: i.naturalWidth, h: i.naturalHeight})),
    scrollWidth: document.documentElement.scrollWidth,
    clientWidth: document.documentElement.clientWidth,
    wide: [...document.querySelectorAll('body *')].filter(e => e.getBoundingClientRect().right > document.documentElement.clientWidth + 1)
                .slice(0, 5).map(e => e.tagName + '#' + e.id),
  };
})()"""

SECTION_RECTS = """(() => [...document.querySelectorAll('section[id]')].map(s => {
  const r = s.getBoundingClientRect();
  return {id: s.id, x: r.left + window.scrollX, y: r.top + window.scrollY, width: r.width, height: r.height};
}))()"""
