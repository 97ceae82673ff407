"""Open a local HTML page the way a person does: Debian's chromium, headless, through selenium
and the Debian chromedriver, with no network.

Tests of anything a person reads (the access report, the HTML run report) load the file here
and assert on what came back: the console log, every request the page made (anything that is
not ``file:`` or ``data:`` is both blocked and reported), whether each ``<img>`` decoded, the
title, the visible text (as loaded, and with every ``<details>`` opened) and a full-page
screenshot PNG. One browser serves a whole test module (it takes seconds to start)::

    @pytest.fixture(scope="module")
    def chromium():
        with headless_chromium() as browser:
            yield browser

    def test_page(chromium, tmp_path):
        page = chromium.open(path, tmp_path / "page.png")

A machine without chromium or chromedriver fails the test, naming the apt packages (CI and
``make setup`` install them); it never skips.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
WINDOW = (1280, 900)  # CSS pixels; the device scale factor is pinned to 1, so also screenshot pixels
LOCAL_SCHEMES = ("file", "data")
# every scheme that could leave the machine; blocked before a request starts
_BLOCKED = ["http://*", "https://*", "ws://*", "wss://*", "ftp://*"]


@dataclass(frozen=True)
class Image:
    """One ``<img>`` after the page loaded: decoded means ``complete`` and ``naturalWidth > 0``."""

    src: str
    complete: bool
    natural_width: int
    natural_height: int

    @property
    def decoded(self) -> bool:
        return self.complete and self.natural_width > 0


@dataclass(frozen=True)
class Page:
    """What chromium made of one local HTML file."""

    url: str
    title: str
    text: str  # document.body.innerText as loaded (what is on screen without a click)
    text_expanded: str  # the same with every <details> opened (what a reader can reach)
    console: list[dict]  # the browser log: {"level": "SEVERE" | "WARNING" | "INFO" | ..., "message": ...}
    requests: list[str]  # every URL the page asked for, the document itself included
    images: list[Image]
    screenshot: Path  # a full-page PNG of the page as loaded
    content_size: tuple[int, int]  # the page's full width and height in CSS pixels (= the PNG's size)
    expanded_width: int  # the page's full width with every <details> opened (> the window: sideways scrolling)
    viewport: tuple[int, int]  # the window's inner width and height

    @property
    def external_requests(self) -> list[str]:
        """Requests that are not ``file:`` or ``data:`` (blocked, but a self-contained page makes none)."""
        return [u for u in self.requests if urlsplit(u).scheme not in LOCAL_SCHEMES]

    def console_at(self, *levels: str) -> list[dict]:
        return [m for m in self.console if m.get("level") in levels]


def _missing() -> list[str]:
    return [p for p in (CHROMIUM, CHROMEDRIVER) if not (os.access(p, os.X_OK) or shutil.which(p))]


class Browser:
    """One headless chromium session (``headless_chromium`` starts and stops it)."""

    def __init__(self, driver: Any) -> None:
        self.driver = driver

    def open(self, path: str | Path, screenshot: str | Path) -> Page:
        """Load the local file ``path``, wait for its load event, and report (see ``Page``)."""
        d = self.driver
        d.get_log("performance"), d.get_log("browser")  # drop what an earlier page left
        url = Path(path).absolute().as_uri()
        d.get(url)
        requests = self._requests()
        console = d.get_log("browser")
        title = d.title
        text = d.execute_script("return document.body ? document.body.innerText : ''")
        images = [Image(i["src"], bool(i["complete"]), int(i["w"]), int(i["h"])) for i in d.execute_script(
            "return Array.from(document.images).map(i => ({src: i.currentSrc || i.src, complete: i.complete,"
            " w: i.naturalWidth, h: i.naturalHeight}))")]
        viewport = tuple(d.execute_script("return [window.innerWidth, window.innerHeight]"))
        size = self._screenshot(Path(screenshot))
        text_expanded, expanded_width = d.execute_script(
            "document.querySelectorAll('details').forEach(x => x.open = true);"
            " return [document.body ? document.body.innerText : '', document.documentElement.scrollWidth]")
        requests += self._requests()  # opening <details> may load what they hold
        console += d.get_log("browser")
        return Page(url=url, title=title, text=text, text_expanded=text_expanded, console=console,
                    requests=requests, images=images, screenshot=Path(screenshot), content_size=size,
                    expanded_width=int(expanded_width), viewport=viewport)

    def _requests(self) -> list[str]:
        urls = []
        for entry in self.driver.get_log("performance"):
            msg = json.loads(entry["message"])["message"]
            if msg.get("method") == "Network.requestWillBeSent":
                urls.append(msg["params"]["request"]["url"])
        return urls

    def _screenshot(self, target: Path) -> tuple[int, int]:
        """A PNG of the whole page (not only the window) at scale 1; returns its size in pixels."""
        m = self.driver.execute_cdp_cmd("Page.getLayoutMetrics", {})["cssContentSize"]
        w, h = int(m["width"]), int(m["height"])
        shot = self.driver.execute_cdp_cmd("Page.captureScreenshot", {
            "format": "png", "captureBeyondViewport": True, "fromSurface": True,
            "clip": {"x": 0, "y": 0, "width": w, "height": h, "scale": 1}})
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(base64.b64decode(shot["data"]))
        return w, h


@contextmanager
def headless_chromium(window: tuple[int, int] = WINDOW) -> Iterator[Browser]:
    """Start chromium (headless, no sandbox, no GPU, no network) and chromedriver; stop both after."""
    missing = _missing()
    if missing:
        pytest.fail(f"{' and '.join(missing)} not found: tests of HTML a person reads run in Debian's chromium; "
                    "install it with `make setup` or `sudo apt-get install chromium chromium-driver`", pytrace=False)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                f"--window-size={window[0]},{window[1]}", "--force-device-scale-factor=1", "--hide-scrollbars",
                '--host-resolver-rules=MAP * ~NOTFOUND', "--disable-background-networking",
                "--disable-component-update", "--disable-sync", "--disable-default-apps", "--no-first-run",
                "--disable-extensions", "--lang=en-US"):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL", "performance": "ALL"})
    opts.add_experimental_option("perfLoggingPrefs", {"enableNetwork": True, "enablePage": False})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    try:
        driver.execute_cdp_cmd("Network.enable", {})
        driver.execute_cdp_cmd("Network.setBlockedURLs", {"urls": _BLOCKED})
        # the window size includes the (absent) browser frame: make the page itself exactly `window`
        driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", {
            "width": window[0], "height": window[1], "deviceScaleFactor": 1, "mobile": False})
        yield Browser(driver)
    finally:
        driver.quit()


def screenshot_pixels(page: "Page") -> Any:
    """The page's screenshot as grey levels (float32, one per pixel), after checking that it is a
    PNG of exactly the page's content size."""
    import numpy as np
    from PIL import Image

    with Image.open(page.screenshot) as im:
        assert im.format == "PNG"
        im.load()
        assert im.size == page.content_size
        return np.asarray(im.convert("L"), dtype=np.float32)
