"""Headless Chromium for the atlas's pages (``test_atlas_browser.py`` and
``benchmarks/bench_atlas_pages.py``): selenium and chromedriver, a fresh profile, the console
log kept, and a probe that times when a neuron page shows its top contexts."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

CHROME = next(filter(None, map(shutil.which, ["chromium", "chromium-browser", "google-chrome"])),
              None)  # fmt: skip
CHROMEDRIVER = shutil.which("chromedriver")
#: Headless, as root (no sandbox), and nothing of its own on the network (background
#: networking, component updates, sync, QUIC), which a closed network refuses.
CHROME_FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]  # fmt: skip
#: Installed before any script of a page runs: ``window.__shown`` becomes the time (ms since the
#: navigation started, ``performance.now()``) at which a neuron's first top context is in the DOM.
SHOWN_PROBE = """window.__shown = null;
new MutationObserver(function (m, obs) {
  if (document.querySelector('#main .ctx')) {
    window.__shown = performance.now(); obs.disconnect();
  }
}).observe(document, {childList: true, subtree: true});"""


def chrome() -> Any:
    """A selenium ``webdriver.Chrome`` on headless Chromium with a fresh empty profile, its
    console log kept (``goog:loggingPrefs``) and :data:`SHOWN_PROBE` in every page; close it with
    :func:`close` (which removes the profile)."""
    from selenium import webdriver

    options = webdriver.ChromeOptions()
    options.binary_location = CHROME
    for flag in CHROME_FLAGS:
        options.add_argument(flag)
    profile = tempfile.mkdtemp(prefix="atlas-chrome-")
    options.add_argument(f"--user-data-dir={profile}")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=webdriver.ChromeService(CHROMEDRIVER))
    driver.profile_dir = profile
    driver.execute_cdp_cmd("Page.addScriptToEvaluateOnNewDocument", {"source": SHOWN_PROBE})
    return driver


def close(driver: Any) -> None:
    """Quits the browser and removes its profile."""
    driver.quit()
    shutil.rmtree(driver.profile_dir, ignore_errors=True)


def url(path: Path, fragment: str = "") -> str:
    """The ``file://`` URL of ``path``, with ``fragment`` (``#L1N34``)."""
    return path.resolve().as_uri() + fragment


def shown_neuron(driver: Any, label: str, timeout: float = 20.0) -> float:
    """Waits until the page shows ``label`` (its title, set once rendered) with its top contexts;
    returns the ms from the navigation's start to the first top context in the DOM."""
    from selenium.webdriver.support.ui import WebDriverWait

    WebDriverWait(driver, timeout).until(
        lambda d: d.title == label and d.execute_script("return window.__shown") is not None
    )
    return driver.execute_script("return window.__shown")
