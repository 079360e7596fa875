"""Debian's headless Chromium driven by Selenium, as the console's browser tests and its CPU benchmark use it."""
from __future__ import annotations

from pathlib import Path
from typing import Any

CHROMEDRIVER = Path("/usr/bin/chromedriver")
CHROMIUM = Path("/usr/bin/chromium")

FLAGS = ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--window-size=1280,860",
         "--no-first-run", "--no-default-browser-check", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--disable-default-apps", "--disable-extensions",
         "--metrics-recording-only",
         "--host-resolver-rules=MAP * ~NOTFOUND , EXCLUDE 127.0.0.1")  # nothing but this machine


def installed() -> bool:
    return CHROMIUM.exists() and CHROMEDRIVER.exists()


def chromium(logs: dict[str, str] | None = None) -> Any:
    """A new headless Chromium (``logs``: its ``goog:loggingPrefs``, e.g. ``{"browser": "ALL"}``)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in FLAGS:
        options.add_argument(flag)
    if logs:
        options.set_capability("goog:loggingPrefs", logs)
    return webdriver.Chrome(service=Service(executable_path=str(CHROMEDRIVER)), options=options)
