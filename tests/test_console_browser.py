"""The operator console in a real browser: Debian's Chromium, headless, driven by Selenium through the
system's chromedriver (``/usr/bin/chromedriver``: Selenium Manager is never asked, nothing is downloaded).

One browser and one API server (werkzeug, threaded: its event streams go to the stream loop as
under gunicorn) for the module; each test signs in with its own token. After each test, every request
the page made went to the API's origin and the browser's log holds no error. The screenshots of the
list, a call, a call's retried run and the tools view go to the test's folder; with ``VOICE_TOOLS_SCREENSHOTS=<folder>``
(``docs/console`` for the operator guide's) they are copied there too.

Skipped where Chromium or its driver is not installed (``apt-get install chromium chromium-driver``;
``.ci/run`` installs them), except under ``CI=true``, where that is a failure. On each page and dialog
checked for its controls' names, axe-core (``tests/axe``, installed from its lock by ``.ci/run``'s
``npm ci``, injected by the driver) must find no serious or critical violation.
"""
from __future__ import annotations

import itertools
import json
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any, Callable

import pytest
import requests
from sqlalchemy import text

from support.browser import chromium, installed as browser_installed
from tests.api_fixtures import GUIDE_EMAIL, served_api
from models import db
from tests.conftest import API_TOKEN, AUTH
from tasks.calls import actions
from tasks.tools import Step, TransientError
from tests.helpers import deliveries, make_call
from tests.test_chains import make_tool, register  # noqa: F401  (a fixture: a tool the running worker takes)

AXE = Path(__file__).parent / "axe" / "node_modules" / "axe-core" / "axe.min.js"  # npm ci in tests/axe, once (serious_violations)
TOKENS = f"tests:{API_TOKEN},bob:bob-token,ops:ops-token:admin,cpu:cpu-token"
CPU = {"Authorization": "Bearer cpu-token"}
BOB = {"Authorization": "Bearer bob-token"}
OPS_TOKEN = "ops-token"

if not browser_installed():
    if os.environ.get("CI") == "true":
        raise RuntimeError("CI: the console's browser tests need Debian's chromium and chromium-driver")
    pytest.skip("chromium and chromium-driver are not installed", allow_module_level=True)

from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.common.keys import Keys  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tokens():
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VOICE_TOOLS_API_TOKENS", TOKENS)
        yield


@pytest.fixture(scope="module")
def origin(database_and_broker, tokens):
    """The API (``create_app()``) in a threaded werkzeug server on a free port, for the module."""
    with served_api() as url:
        yield url


@pytest.fixture(scope="module")
def browser(origin):
    driver = chromium({"browser": "ALL", "performance": "ALL"})
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture
def page(browser, origin, tmp_path, request):
    """The browser, its logs drained first; after the test, every request it made went to ``origin`` and
    its log holds no error but those the test expected (``page.expected_errors``)."""
    browser.get_log("browser")
    browser.get_log("performance")
    browser.expected_errors = []
    yield browser
    urls = []
    for entry in browser.get_log("performance"):
        message = json.loads(entry["message"])["message"]
        if message["method"] == "Network.requestWillBeSent":
            urls.append(message["params"]["request"]["url"])
    assert urls, "the page made no request?"
    # (a data: URL is no request: Chromium's own picture of a date field's calendar button)
    assert [u for u in urls if not u.startswith((f"{origin}/", "data:image/"))] == [], urls
    assert not [u for u in urls if API_TOKEN in u or OPS_TOKEN in u or "bob-token" in u]
    errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    unexpected = [e for e in errors if not any(part in e["message"] for part in browser.expected_errors)]
    assert unexpected == [], unexpected


def until(driver, found: Callable[[Any], Any], timeout: float = 10.0, what: str = "") -> Any:
    """``found(driver)`` once it is truthy, asked again while an element it read is missing or was drawn anew
    between its lookup and its read (the pages draw again on live events)."""
    return WebDriverWait(driver, timeout, poll_frequency=0.05,
                         ignored_exceptions=(NoSuchElementException, StaleElementReferenceException)).until(
        lambda d: found(d), message=what)


def sign_in(driver, origin: str, token: str, path: str = "/console") -> None:
    """Open ``path`` signed out, then sign in with the keyboard only: the token, then Enter."""
    driver.get(f"{origin}/healthz")  # a page of the origin that reads nothing: forget the last test's token
    driver.execute_script("sessionStorage.clear()")
    driver.get(f"{origin}{path}")
    field = until(driver, lambda d: d.find_element(By.ID, "token") if d.find_element(By.ID, "token").is_displayed()
                  else None, what="the sign-in form")
    assert driver.switch_to.active_element == field  # the token field has the focus
    field.send_keys(token + Keys.ENTER)
    until(driver, lambda d: d.find_element(By.ID, "who").text.startswith("Signed in as"), what="signed in")


def rows(driver) -> list[str]:
    return driver.execute_script(
        "return [...document.querySelectorAll('#calls-rows > [role=row]')].map(r => r.dataset.id)")


def status_in_row(driver, tool_call_id: str) -> str | None:
    return driver.execute_script(
        "const r = document.querySelector(`#calls [data-id='${arguments[0]}'] .status`);"
        " return r ? r.textContent : null", tool_call_id)


def record(origin: str, headers=AUTH, session_id: str = "sess_console", **extra: Any) -> str:
    answer = requests.post(f"{origin}/voice-tools/pending", headers=headers, timeout=10, json={
        "session_id": session_id, "function": "send_email", "parameters": dict(GUIDE_EMAIL), **extra})
    assert answer.status_code == 201, answer.text
    return answer.json()["tool_call_id"]


def rest_status(origin: str, tool_call_id: str, headers=AUTH) -> str:
    return requests.get(f"{origin}/voice-tools/status/{tool_call_id}", headers=headers, timeout=10).json()["status"]


def screenshot(driver, tmp_path: Path, name: str) -> None:
    """The whole page (up to 1,400 pixels high) as ``<name>.png``."""
    path = tmp_path / f"{name}.png"
    width, height = driver.get_window_size()["width"], driver.get_window_size()["height"]
    tall = driver.execute_script("return document.documentElement.scrollHeight")
    driver.set_window_size(width, min(1400, max(height, tall + 140)))
    try:
        driver.save_screenshot(str(path))
    finally:
        driver.set_window_size(width, height)
    assert path.stat().st_size < 400_000
    into = os.environ.get("VOICE_TOOLS_SCREENSHOTS")
    if into:
        Path(into).mkdir(parents=True, exist_ok=True)
        shutil.copy(path, Path(into) / path.name)


def shown_labels(driver) -> list[str]:
    """The result panel's labels shown (each only when it has something), read in one script: the page draws
    again on live events."""
    return driver.execute_script(
        "return [...document.querySelectorAll('#call-ending dt')].filter(dt => dt.offsetParent !== null)"
        ".map(dt => dt.innerText)")


def step_rows(driver) -> list[tuple[str, str]]:
    """The call's steps as the page lists them: (step, kind), in the chain's order, read in one script."""
    return [tuple(row) for row in driver.execute_script(
        "return [...document.querySelectorAll('#call-steps tbody tr[data-step]')]"
        ".map(r => [r.querySelector('th').innerText, r.querySelector('td').innerText])")]


def serious_violations(driver) -> list[dict]:
    """axe-core's serious and critical violations on the page as it is now (the installed copy,
    injected by the driver: nothing from a CDN, nothing fetched by the page)."""
    if not AXE.is_file() and shutil.which("npm") is not None:  # its locked version, installed once
        subprocess.run(["npm", "ci", "--no-audit", "--no-fund", "--silent"], cwd=AXE.parents[2], check=True,
                       capture_output=True, timeout=300)
    if not AXE.is_file():
        if os.environ.get("CI") == "true":
            raise RuntimeError("CI: axe-core is not installed (cd tests/axe && npm ci)")
        pytest.skip("axe-core is not installed (cd tests/axe && npm ci)")
    if not driver.execute_script("return !!window.axe"):
        driver.execute_script(AXE.read_text())
    found = driver.execute_async_script("""
        const done = arguments[arguments.length - 1];
        axe.run(document, {resultTypes: ["violations"]}).then(
          (r) => done(r.violations.filter(v => ["serious", "critical"].includes(v.impact))
                       .map(v => ({id: v.id, impact: v.impact, nodes: v.nodes.map(n => n.html).slice(0, 3)}))),
          (e) => done([{id: "axe failed", impact: "critical", nodes: [String(e)]}]));""")
    return found


def every_control_named(driver) -> list[str]:
    """The controls of the page shown with no name a screen reader would say; and axe-core finds no
    serious or critical violation on it (asserted here, where every test checks its page's names)."""
    assert serious_violations(driver) == []
    return _unnamed(driver)


def _unnamed(driver) -> list[str]:
    """The controls of the page shown with no name a screen reader would say."""
    return driver.execute_script("""
        return [...document.querySelectorAll('button, input, select, a[href]')]
          .filter(e => e.offsetParent !== null)
          .filter(e => !((e.labels && e.labels.length) || e.getAttribute('aria-label') || e.textContent.trim()))
          .map(e => e.outerHTML);""")


# -- the tests -------------------------------------------------------------------------------

def test_a_call_recorded_through_rest_appears_within_2s_and_is_cancelled_from_its_page(page, origin, tmp_path):
    sign_in(page, origin, OPS_TOKEN)
    until(page, lambda d: d.find_element(By.ID, "live-state").text == "live", what="the live list")
    for i in range(3):  # some history to show
        earlier = record(origin, session_id=f"sess_{i}", parameters={**GUIDE_EMAIL, "subject": f"Offer {i}"})
    requests.delete(f"{origin}/voice-tools/cancel/{earlier}", headers=AUTH, timeout=10)
    record(origin, headers=BOB, session_id="sess_bob")
    tool_call_id = record(origin)
    recorded = time.monotonic()
    until(page, lambda d: tool_call_id in rows(d), timeout=2.0, what="the new call in the list within 2 s")
    assert time.monotonic() - recorded < 2.0
    assert rows(page)[0] == tool_call_id  # newest first
    assert status_in_row(page, tool_call_id) == "PENDING"
    assert every_control_named(page) == []
    screenshot(page, tmp_path, "calls")

    link = page.find_element(By.LINK_TEXT, tool_call_id)
    link.send_keys(Keys.ENTER)  # the keyboard opens it
    cancel = until(page, lambda d: d.find_element(By.ID, "action-cancel"), what="Cancel, offered")
    assert page.find_elements(By.ID, "action-proceed") == []  # a PENDING call is not at a checkpoint
    assert "Recorded" in page.find_element(By.ID, "call-timeline").text
    assert '"subject": "Test"' in page.find_element(By.ID, "call-parameters").text
    assert page.find_element(By.ID, "call-open").is_displayed()  # an open call: no empty box, no "Error"
    assert not page.find_element(By.ID, "call-ending").is_displayed()
    assert page.find_element(By.ID, "call-steps").text.endswith("No step has recorded an output yet.")
    page.execute_script("window.notReloaded = true")
    cancel.send_keys(Keys.ENTER)  # asks first, for an optional reason
    reason = until(page, lambda d: d.find_element(By.ID, "cancel-reason") if d.find_element(By.ID, "cancel-dialog")
                   .is_displayed() else None, what="the cancel dialog")
    assert page.switch_to.active_element == reason
    assert rest_status(origin, tool_call_id) == "PENDING"  # nothing done yet
    page.find_element(By.ID, "cancel-back").send_keys(Keys.ENTER)  # Keep it: nothing happens
    until(page, lambda d: not d.find_element(By.ID, "cancel-dialog").is_displayed(), what="the dialog closed")
    assert page.switch_to.active_element == page.find_element(By.ID, "action-cancel")  # focus back where it was
    assert rest_status(origin, tool_call_id) == "PENDING"
    page.find_element(By.ID, "action-cancel").send_keys(Keys.ENTER)
    until(page, lambda d: d.find_element(By.ID, "cancel-dialog").is_displayed(), what="the cancel dialog again")
    page.switch_to.active_element.send_keys("Wrong recipient")
    page.find_element(By.ID, "cancel-confirm").send_keys(Keys.ENTER)
    until(page, lambda d: d.find_element(By.ID, "call-status").text == "CANCELLED", what="CANCELLED on the page")
    assert rest_status(origin, tool_call_id) == "CANCELLED"
    last = page.find_elements(By.CSS_SELECTOR, "#call-timeline li")[-1].text
    assert "CANCELLED Wrong recipient by ops via console" in last, last
    assert page.execute_script("return window.notReloaded") is True
    assert page.find_elements(By.ID, "action-cancel") == []  # nothing offered on an ended call
    assert page.find_element(By.ID, "call-outcome").text == "not_done"
    assert shown_labels(page) == ["Outcome", "Spoken", "Error"]  # no result: no Result label
    assert page.find_element(By.ID, "call-error").text == "Wrong recipient"

    page.find_element(By.ID, "sign-out").click()
    until(page, lambda d: d.find_element(By.ID, "token").is_displayed(), what="signed out")
    assert page.execute_script("return sessionStorage.length") == 0
    assert every_control_named(page) == []  # the sign-in page too


BIDI = "\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069"
DRAWN_AT = """
const walker = document.createTreeWalker(document.getElementById(arguments[0]), NodeFilter.SHOW_TEXT);
for (let n = walker.nextNode(); n; n = walker.nextNode()) {
  const i = n.data.indexOf(arguments[1]);
  if (i < 0) continue;
  const at = (k) => { const r = document.createRange(); r.setStart(n, k); r.setEnd(n, k + 1); return r.getBoundingClientRect().left; };
  return [at(i), at(i + arguments[1].length - 1)];
}
return null;"""


def test_bidi_controls_a_relay_sent_are_shown_never_applied(page, origin, tmp_path):
    """A subject RIGHT-TO-LEFT OVERRIDE + ``txt.exe`` + POP is drawn in the order it was written, each control
    shown as what it is; the page holds none of them (Parameters, the changes, the sentence, the error)."""
    tool_call_id = record(origin, parameters={**GUIDE_EMAIL, "subject": "\u202etxt.exe\u202c"})
    changed = requests.patch(f"{origin}/voice-tools/modify/{tool_call_id}", headers=AUTH, timeout=10,
                             json={"parameters": {"body": "\u2067gpj.\u2069\u202dfdp.\u202a\u202b\u202c"}})
    assert changed.status_code == 200, changed.text
    sign_in(page, origin, OPS_TOKEN, f"/console/calls/{tool_call_id}")
    until(page, lambda d: "txt.exe" in d.find_element(By.ID, "call-parameters").get_attribute("textContent"),
          what="the parameters")
    first, last = page.execute_script(DRAWN_AT, "call-parameters", "txt.exe")
    assert first < last, (first, last)  # the "t" left of the last "e": not reversed
    shown = page.execute_script("return document.querySelector('main').textContent")
    assert not [c for c in shown if c in BIDI], [hex(ord(c)) for c in shown if c in BIDI]
    assert "U+202E" in page.find_element(By.ID, "call-parameters").text  # shown, as what it is
    screenshot(page, tmp_path, "bidi")


def test_a_status_changes_in_the_list_without_a_reload(page, origin):
    sign_in(page, origin, API_TOKEN)
    tool_call_id = record(origin)
    until(page, lambda d: status_in_row(d, tool_call_id) == "PENDING", timeout=2.0, what="listed")
    page.execute_script("window.notReloaded = true")
    requests.delete(f"{origin}/voice-tools/cancel/{tool_call_id}", headers=AUTH, timeout=10)
    until(page, lambda d: status_in_row(d, tool_call_id) == "CANCELLED", timeout=2.0, what="CANCELLED in place")
    assert page.execute_script("return window.notReloaded") is True

    other = record(origin, session_id="sess_other")
    until(page, lambda d: rows(d) == [other, tool_call_id], timeout=2.0, what="both listed")
    page.find_element(By.CSS_SELECTOR, "#f-statuses input[value='CANCELLED']").send_keys(" ")  # from the keyboard
    page.find_element(By.ID, "f-session").send_keys("sess_console" + Keys.ENTER)
    until(page, lambda d: rows(d) == [tool_call_id], what="the filter applied")
    record(origin, session_id="sess_other")  # matches no filter: never shown
    third = record(origin, session_id="sess_console")
    requests.delete(f"{origin}/voice-tools/cancel/{third}", headers=AUTH, timeout=10)
    until(page, lambda d: rows(d) == [third, tool_call_id], timeout=2.0, what="a match, live")
    page.find_element(By.ID, "f-id").send_keys(tool_call_id + Keys.ENTER)  # the search by id
    until(page, lambda d: rows(d) == [tool_call_id], what="found by id")


def test_a_checkpoint_answered_proceed_from_the_page_completes_the_call(page, origin, worker, relay, tmp_path):
    sign_in(page, origin, API_TOKEN)
    tool_call_id = record(origin, session_id="sess_checkpoint", callback_url=relay.url)
    confirmed = requests.post(f"{origin}/voice-tools/confirm/{tool_call_id}", headers=AUTH, json={}, timeout=10)
    assert confirmed.status_code == 202, confirmed.text
    page.get(f"{origin}/console/calls/{tool_call_id}")
    until(page, lambda d: d.find_element(By.ID, "action-proceed"), timeout=15.0,
          what="Proceed, offered at the checkpoint")
    assert page.find_element(By.ID, "call-status").text == "PREPARED"
    assert page.find_element(By.ID, "action-cancel").text == "Cancel call…"
    assert every_control_named(page) == []
    assert step_rows(page) == [("PREPARING", "step"), ("READY_TO_SEND", "checkpoint (preview)")]
    # asks first, showing the email as it will go; clicked in script: the page draws its buttons again on a live
    # event (the element found may be gone by the time Selenium clicks it)
    until(page, lambda d: d.execute_script("const b = document.getElementById('action-proceed');"
                                           " if (b) b.click(); return !!b"), what="Proceed, clicked")
    until(page, lambda d: d.find_element(By.ID, "proceed-dialog").is_displayed(), what="the proceed dialog")
    assert serious_violations(page) == []  # the dialog open
    outputs = requests.get(f"{origin}/console/api/calls/{tool_call_id}", headers=AUTH, timeout=10).json()
    draft = outputs["steps"][0]["output"]  # PREPARING's: the email as the checkpoint previews it
    assert page.find_element(By.ID, "proceed-title").text == "Proceed to SENDING?"
    shown = {dd.get_attribute("data-field"): dd.text for dd in page.find_elements(By.CSS_SELECTOR, "#proceed-preview dd")}
    assert set(shown) == {"to", "cc", "subject", "body"}
    assert shown["to"] == GUIDE_EMAIL["to"] and shown["subject"] == GUIDE_EMAIL["subject"]
    assert shown["body"] == (draft["body"] or "(none)")
    assert "can no longer be cancelled" in page.find_element(By.ID, "proceed-warning").text
    assert rest_status(origin, tool_call_id) == "PREPARED"  # nothing done yet
    page.find_element(By.ID, "proceed-confirm").click()
    until(page, lambda d: d.find_element(By.ID, "call-status").text == "COMPLETED", timeout=15.0,
          what="COMPLETED on the page")
    assert rest_status(origin, tool_call_id) == "COMPLETED"
    until(page, lambda d: d.find_element(By.ID, "call-outcome").text == "done", what="the outcome")
    assert page.find_element(By.ID, "call-voice").text
    assert shown_labels(page) == ["Outcome", "Result", "Spoken"]  # no error: no Error label
    assert step_rows(page) == [("PREPARING", "step"), ("READY_TO_SEND", "checkpoint (preview)"),
                               ("SENDING", "side effect")]
    steps = page.find_element(By.ID, "call-links").text
    assert "PREPARING" in steps and "SENDING" in steps
    relay.wait_for(tool_call_id, "completed")
    page.refresh()  # the delivered attempts are recorded a moment after their post: read them all
    until(page, lambda d: d.find_element(By.ID, "call-events").text.count("HTTP 200") == 4, timeout=10.0,
          what="each event delivered, with its attempt")
    webhook_ids = [e["event_id"] for e in relay.events_for(tool_call_id)]
    assert all(i in page.find_element(By.ID, "call-events").text for i in webhook_ids)
    screenshot(page, tmp_path, "call")

    page.get(f"{origin}/console/sessions/sess_checkpoint")  # the session, as the relay's context reads it
    until(page, lambda d: tool_call_id in d.find_element(By.ID, "session-calls").text, what="the session's call")
    assert every_control_named(page) == []


def cells(driver, tool_call_id: str) -> list[str]:
    return driver.execute_script(
        "const r = document.querySelector(`#calls [data-id='${arguments[0]}']`);"
        " return r ? [...r.children].map(c => c.textContent) : null", tool_call_id)


def test_the_list_is_a_link_with_its_filters_back_and_forward_counts_times_zones_and_a_pause(page, origin):
    first = record(origin, session_id="sess_url_a")
    second = record(origin, session_id="sess_url_b")
    assert requests.delete(f"{origin}/voice-tools/cancel/{second}", headers=AUTH, timeout=10).ok
    sign_in(page, origin, OPS_TOKEN, "/console?status=PENDING,CANCELLED&session_id=sess_url_a")  # a bookmark
    until(page, lambda d: rows(d) == [first], what="the bookmarked view")
    checked = lambda d: [b.get_attribute("value") for b in d.find_elements(By.CSS_SELECTOR, "#f-statuses input")
                         if b.is_selected()]
    assert checked(page) == ["PENDING", "CANCELLED"]
    assert page.find_element(By.ID, "f-session").get_attribute("value") == "sess_url_a"
    tools = [o.get_attribute("value") for o in page.find_elements(By.CSS_SELECTOR, "#f-tool option")]
    assert tools[0] == "" and {"send_email", "create_task"} <= set(tools)  # the registry's list

    session = page.find_element(By.ID, "f-session")
    session.clear()
    session.send_keys("sess_url_b" + Keys.ENTER)
    until(page, lambda d: rows(d) == [second], what="the other session")
    assert "session_id=sess_url_b" in page.current_url and "status=PENDING%2CCANCELLED" in page.current_url
    until(page, lambda d: d.find_element(By.CSS_SELECTOR, ".count[data-status='CANCELLED']").text == "(1)",
          what="the counts by status of this filter")
    assert page.find_element(By.CSS_SELECTOR, ".count[data-status='PENDING']").text == "(0)"
    started, ended, took = cells(page, second)[5:8]
    assert started and ended and started <= ended and not took.endswith("…")  # an ended call's columns
    page.back()
    until(page, lambda d: rows(d) == [first], what="back: the first view")
    assert page.find_element(By.ID, "f-session").get_attribute("value") == "sess_url_a"
    assert cells(page, first)[6] == "" and cells(page, first)[7].endswith("…")  # open: no end, a duration so far
    page.forward()
    until(page, lambda d: rows(d) == [second], what="forward: the second view")

    page.find_element(By.ID, "f-tool").send_keys("create_task")  # the registry's tool, chosen
    page.find_element(By.ID, "f-session").send_keys(Keys.ENTER)
    until(page, lambda d: d.find_element(By.ID, "calls-empty").is_displayed(), what="no create_task call")
    assert "tool=create_task" in page.current_url

    page.get(f"{origin}/console?session_id=sess_url_a&range=15m")  # a preset counts back from now
    until(page, lambda d: rows(d) == [first], what="the last 15 minutes")
    assert page.find_element(By.ID, "f-range").get_attribute("value") == "15m"
    page.get(f"{origin}/console?session_id=sess_url_a&from=2099-01-01T00:00:00.000Z")
    until(page, lambda d: d.find_element(By.ID, "calls-empty").is_displayed(), what="nothing from 2099")
    assert page.find_element(By.ID, "f-custom").is_displayed()
    assert page.find_element(By.ID, "f-from").get_attribute("value").startswith("2099-01-01T00:00")

    page.execute_cdp_cmd("Emulation.setTimezoneOverride", {"timezoneId": "Asia/Kolkata"})  # UTC+05:30
    try:
        page.get(f"{origin}/console?session_id=sess_url_a")
        until(page, lambda d: rows(d) == [first], what="the first call")
        utc = cells(page, first)[5]
        assert "(UTC)" in page.find_element(By.CSS_SELECTOR, "#calls .head").text  # UTC by default
        page.find_element(By.ID, "local-time").click()
        until(page, lambda d: "(Asia/Calcutta)" in d.find_element(By.CSS_SELECTOR, "#calls .head").text or
              "(Asia/Kolkata)" in d.find_element(By.CSS_SELECTOR, "#calls .head").text, what="the local zone")
        local = until(page, lambda d: cells(d, first)[5] if cells(d, first) and cells(d, first)[5] != utc else None,
                      what="the local time")
        from datetime import datetime, timedelta
        assert datetime.fromisoformat(local) - datetime.fromisoformat(utc) == timedelta(hours=5, minutes=30)
        assert "tz=local" in page.current_url
    finally:
        page.execute_cdp_cmd("Emulation.setTimezoneOverride", {"timezoneId": ""})

    page.get(f"{origin}/console?session_id=sess_url_c")
    until(page, lambda d: d.find_element(By.ID, "live-state").text == "live", what="the live list")
    page.find_element(By.ID, "pause").click()
    assert page.find_element(By.ID, "pause").get_attribute("aria-pressed") == "true"
    third = record(origin, session_id="sess_url_c")
    record(origin, session_id="sess_other_c")  # not this view's: not counted
    until(page, lambda d: "Paused: 1 new call" in d.find_element(By.ID, "paused-note").text, timeout=3.0,
          what="counted while paused")
    assert rows(page) == []
    page.find_element(By.ID, "pause").click()  # Resume
    until(page, lambda d: rows(d) == [third], what="shown once resumed")
    assert page.find_element(By.ID, "paused-note").text == ""


def test_another_caller_never_sees_the_first_callers_calls_and_is_refused_their_page(page, origin):
    theirs = record(origin)
    page.expected_errors = [f"/console/api/calls/{theirs} - Failed to load resource: the server responded with "
                            "a status of 404"]
    sign_in(page, origin, "bob-token")
    mine = record(origin, headers=BOB, session_id="sess_bob")
    until(page, lambda d: mine in rows(d), timeout=2.0, what="bob's own call")
    later = record(origin)  # recorded while bob watches: announced to every list, shown to none but its caller's
    last = record(origin, headers=BOB, session_id="sess_bob")
    until(page, lambda d: last in rows(d), timeout=2.0, what="bob's second call")
    assert rows(page) == [last, mine]
    assert theirs not in page.page_source and later not in page.page_source
    assert not page.find_element(By.ID, "nav-tools").is_displayed()  # the tools' figures are an admin's

    page.get(f"{origin}/console/calls/{theirs}")
    until(page, lambda d: d.find_element(By.ID, "problem").text, what="refused")
    assert page.find_element(By.ID, "problem").text == f"No call {theirs} that this token may see."
    assert not page.find_element(By.ID, "view-call").is_displayed()
    assert page.find_element(By.ID, "call-parameters").get_attribute("textContent") == ""


def test_a_failed_callback_redelivered_from_the_page_arrives_at_the_relay(page, origin, worker, relay,
                                                                           monkeypatch):
    monkeypatch.setenv("VOICE_TOOLS_CALLBACK_MAX_ATTEMPTS", "1")
    relay.answer(lambda event: 503)  # the relay is down
    tool_call_id = record(origin, callback_url=relay.url)
    assert requests.delete(f"{origin}/voice-tools/cancel/{tool_call_id}", headers=AUTH, timeout=10).ok
    until(page, lambda d: [(x.event, x.state) for x in deliveries(tool_call_id)] == [("cancelled", "failed")],
          timeout=15.0, what="the cancelled event given up")
    relay.answer(lambda event: None)  # back up

    sign_in(page, origin, OPS_TOKEN, f"/console/calls/{tool_call_id}")
    until(page, lambda d: d.find_element(By.CSS_SELECTOR, "button.redeliver"), what="Redeliver, offered")
    assert "HTTP 503" in page.find_element(By.ID, "call-events").text
    assert every_control_named(page) == []
    time.sleep(0.5)  # the page reads the call again once its live stream listens: the button drawn anew
    until(page, lambda d: d.execute_script("const b = document.querySelector('button.redeliver');"
                                           " if (b) b.click(); return !!b"), what="Redeliver, clicked")
    relay_events = lambda: [e["event"] for e in relay.events_for(tool_call_id)]
    until(page, lambda d: relay_events() == ["cancelled", "cancelled"], timeout=15.0, what="redelivered")
    until(page, lambda d: "HTTP 200" in d.find_element(By.ID, "call-events").text, timeout=10.0,
          what="the delivered attempt on the page")
    assert page.find_elements(By.CSS_SELECTOR, "button.redeliver") == []
    timeline = page.find_element(By.ID, "call-timeline").text.splitlines()
    assert timeline[-1].endswith("CANCELLED Callback redelivered: event 1 (cancelled) by ops via console"), timeline


def test_the_tools_view_shows_each_tools_figures(page, origin, worker, tmp_path):
    for subject in ("One", "Two"):
        done = requests.post(f"{origin}/voice-tools/execute?wait=10", headers=AUTH, timeout=20, json={
            "session_id": "sess_tools", "function": "create_task", "parameters": {"title": subject}})
        assert done.status_code == 200, done.text
    record(origin)
    sign_in(page, origin, OPS_TOKEN, "/console/tools")
    until(page, lambda d: d.find_elements(By.CSS_SELECTOR, "#tools tr[data-tool='create_task'] svg rect"),
          what="the create_task row with its chart")
    row = page.find_element(By.CSS_SELECTOR, "#tools tr[data-tool='create_task']")
    figures = requests.get(f"{origin}/console/api/tools", headers={"Authorization": f"Bearer {OPS_TOKEN}"},
                           timeout=10).json()
    [task] = [t for t in figures["tools"] if t["tool"] == "create_task"]
    for step in task["steps"]:  # each step's figures, with the count of runs they are read from
        assert step["runs"] == 2, step
        js = lambda ms: str(ms).removesuffix(".0")  # as the page's script writes a number
        assert f"{step['step']}: p50 {js(step['p50_ms'])} ms, p99 {js(step['p99_ms'])} ms (2 runs)" in row.text
    ticks = [t.text for t in row.find_elements(By.CSS_SELECTOR, "svg text")]
    assert ticks == [f"{max(task['per_minute'])}/min", "0", "60 min ago", "now"]  # the line's scale
    email = page.find_element(By.CSS_SELECTOR, "#tools tr[data-tool='send_email']")
    assert "1 PENDING" in email.text
    assert every_control_named(page) == []
    screenshot(page, tmp_path, "tools")


def test_a_link_retried_once_shows_both_its_runs_and_why_on_the_call_page(page, origin, register, relay, tmp_path):
    tries = itertools.count(1)

    def busy_once(step):
        if next(tries) == 1:
            raise TransientError("HTTP 503 from the service")
        return {"found": True}

    tool = register(make_tool("console_once", (Step("FETCH", run=busy_once), Step("COMPLETED"))))
    call = make_call(tool.name, {"what": "lookup"}, callback_url=relay.url)
    actions.confirm(call.tool_call_id)
    relay.wait_for(call.tool_call_id, "completed")
    sign_in(page, origin, OPS_TOKEN, f"/console/calls/{call.tool_call_id}")
    until(page, lambda d: len(d.find_elements(By.CSS_SELECTOR, "#call-links tbody tr.run")) == 2, what="two runs")
    runs = [[cell.text for cell in row.find_elements(By.TAG_NAME, "td")]
            for row in page.find_elements(By.CSS_SELECTOR, "#call-links tbody tr")]
    assert [(r[0], r[3], r[4]) for r in runs] == [("FETCH", "retried", "TransientError"),  # a tool's own text: never
                                                  ("FETCH", "done", "")]
    assert all(r[1] and r[2].endswith(" ms") for r in runs)  # when each began, how long it took
    assert runs[0][1] < runs[1][1]
    screenshot(page, tmp_path, "runs")


# -- the tab's CPU with a long list ------------------------------------------------------------

HELD = 10_000
BUSY_BOUND = 0.03  # of one CPU: "a few percent"

_MANY_CALLS = text("""
    INSERT INTO tool_calls (tool_call_id, session_id, function_name, action_level, parameters, status, caller,
                            created_at)
    SELECT 'tc_held_' || lpad(i::text, 6, '0'), 'sess_held_' || (i % 50), 'send_email', 'write', '{}'::jsonb,
           CASE WHEN i % 3 = 0 THEN 'COMPLETED' ELSE 'CANCELLED' END, :caller, now() - make_interval(secs => i * 7)
    FROM generate_series(1, :count) AS i
""")


def held(driver) -> int:
    """How many calls the page's list holds (on screen or not)."""
    return driver.execute_script("return Number(document.getElementById('calls').dataset.held || 0)")


def main_thread_busy(driver, seconds: float, each_second: Callable[[int], None] = lambda n: None) -> float:
    """The share of ``seconds`` of wall time the tab's main thread spent running tasks (script, style,
    layout, paint: CDP's ``TaskDuration`` in the thread's own CPU time, so a busy machine does not stretch
    it), calling ``each_second`` once a second meanwhile."""
    def task_s() -> float:
        return {m["name"]: m["value"] for m in driver.execute_cdp_cmd("Performance.getMetrics", {})["metrics"]}[
            "TaskDuration"]

    driver.execute_cdp_cmd("Performance.enable", {"timeDomain": "threadTicks"})
    begun, tasks = time.monotonic(), task_s()
    for n in range(int(seconds)):
        each_second(n)
        time.sleep(max(0.0, begun + n + 1 - time.monotonic()))
    return (task_s() - tasks) / (time.monotonic() - begun)


def test_a_list_of_10000_calls_taking_a_change_a_second_keeps_the_tab_a_few_percent_busy(page, origin):
    with db.session() as s:
        s.execute(_MANY_CALLS, {"caller": "cpu", "count": HELD})
    sign_in(page, origin, "cpu-token")
    until(page, lambda d: d.find_element(By.ID, "live-state").text == "live", what="the live list")
    until(page, lambda d: held(d) == 50, what="the first page")
    older = page.find_element(By.ID, "older")
    while held(page) < HELD:  # Older calls, until the list holds every one
        before = held(page)
        older.click()
        until(page, lambda d: held(d) != before, timeout=20.0, what="the next page of calls")
    assert held(page) == HELD
    page.execute_script("scrollTo(0, 0)")  # back to the newest (the button scrolled the page to the bottom)
    time.sleep(3)  # the last page drawn

    idle = main_thread_busy(page, 10)
    recorded: list[str] = []

    def change(n: int) -> None:  # a new call one second, a change of status the next
        if n % 2 == 0 or not recorded:
            recorded.append(record(origin, headers=CPU, session_id="sess_cpu"))
        else:
            assert requests.delete(f"{origin}/voice-tools/cancel/{recorded[-1]}", headers=CPU, timeout=10).ok

    busy = main_thread_busy(page, 24, change)
    print(f"\nthe tab's main thread, {HELD} calls held: {idle:.1%} busy idle, {busy:.1%} busy with a change a second"
          f" (load average {os.getloadavg()[0]:.2f})")
    until(page, lambda d: status_in_row(d, recorded[-1]) == "CANCELLED", timeout=3.0, what="the last change")
    assert rows(page)[: len(recorded)] == recorded[::-1]  # each new call on top, newest first
    assert held(page) == HELD + len(recorded)
    assert busy <= BUSY_BOUND, f"{busy:.1%} busy with a change a second ({idle:.1%} idle)"
    assert idle <= BUSY_BOUND, f"{idle:.1%} busy idle"


def test_a_calls_page_links_to_its_trace_from_the_configured_template(page, origin, monkeypatch):
    tool_call_id = record(origin)
    with db.session() as s:
        s.execute(text("UPDATE tool_calls SET trace_context = :t WHERE tool_call_id = :i"),
                  {"t": f"00-{'ab' * 16}-{'cd' * 8}-01", "i": tool_call_id})
    monkeypatch.setenv("VOICE_TOOLS_TRACE_URL", "http://tempo.invalid/trace/{trace_id}")
    sign_in(page, origin, OPS_TOKEN, f"/console/calls/{tool_call_id}")
    link = until(page, lambda d: d.execute_script(  # read at once: the page draws the call again as it changes
        "const a = document.querySelector('#call-trace a'); return a && [a.href, a.rel, a.textContent]"),
        what="the trace link")
    assert link == [f"http://tempo.invalid/trace/{'ab' * 16}", "noopener noreferrer", "Trace ↗"]


def test_a_failed_call_is_run_again_from_its_page_and_an_unconfirmed_one_only_acknowledged(page, origin):
    from models import lifecycle

    def failed(outcome: str) -> str:
        call = make_call(session_id="sess_again")
        with db.session() as s:
            lifecycle.fail(s, call.tool_call_id, "The mail server refused it.", "It failed.",
                           from_statuses=("PENDING",), outcome=outcome)
        return call.tool_call_id

    old = failed("unconfirmed")
    sign_in(page, origin, OPS_TOKEN, f"/console/calls/{old}")
    until(page, lambda d: d.find_element(By.ID, "action-run-again"), what="Run again, offered")
    time.sleep(0.5)  # the page reads the call again once its live stream listens: the button drawn anew
    until(page, lambda d: d.execute_script("const b = document.getElementById('action-run-again');"
                                           " if (b) b.click(); return !!b"), what="Run again, clicked")
    until(page, lambda d: d.find_element(By.ID, "again-dialog").is_displayed(), what="the dialog")
    assert page.find_element(By.ID, "again-ack-line").is_displayed()
    page.find_element(By.ID, "again-confirm").send_keys(Keys.ENTER)  # not acknowledged: refused here
    assert "Tick the acknowledgment" in page.find_element(By.ID, "again-error").text
    assert "run_again_as" not in json.dumps(requests.get(f"{origin}/voice-tools/status/{old}", headers=AUTH,
                                                         timeout=10).json()["status_history"])
    assert every_control_named(page) == []
    page.find_element(By.ID, "again-ack").send_keys(" ")
    page.find_element(By.ID, "again-confirm").send_keys(Keys.ENTER)
    until(page, lambda d: f"Runs again {old}" in d.find_element(By.ID, "actions").text, what="the new call's page")
    new = page.current_url.rsplit("/", 1)[1]
    assert new != old and rest_status(origin, new) in ("EXECUTING", "PREPARED", "COMPLETED", "FAILED")
    page.get(f"{origin}/console/calls/{old}")
    until(page, lambda d: f"Run again as {new}" in d.find_element(By.ID, "actions").text, what="linked back")
    assert page.find_elements(By.ID, "action-run-again") == []  # once only


def test_the_matching_calls_are_cancelled_at_once_after_their_count_is_confirmed(page, origin):
    made = [record(origin, session_id="sess_bulk_page") for _ in range(2)]
    sign_in(page, origin, OPS_TOKEN, "/console?session_id=sess_bulk_page")
    until(page, lambda d: sorted(rows(d)) == sorted(made), what="the two calls")
    page.find_element(By.ID, "bulk-cancel").click()
    until(page, lambda d: d.find_element(By.ID, "bulk-dialog").is_displayed(), what="the count, to confirm")
    assert page.find_element(By.ID, "bulk-what").text.startswith("This will cancel 2 calls")
    assert [rest_status(origin, i) for i in made] == ["PENDING", "PENDING"]  # nothing done yet
    assert every_control_named(page) == []
    page.find_element(By.ID, "bulk-reason").send_keys("Test run")
    page.find_element(By.ID, "bulk-confirm").click()
    until(page, lambda d: len(d.find_elements(By.CSS_SELECTOR, "#bulk-results li")) == 2, what="each call's result")
    assert all(li.text.endswith(": CANCELLED") for li in page.find_elements(By.CSS_SELECTOR, "#bulk-results li"))
    assert page.find_element(By.ID, "bulk-progress").text == "2 of 2 calls done: cancelled 2."
    assert every_control_named(page) == []  # the results too
    assert [rest_status(origin, i) for i in made] == ["CANCELLED", "CANCELLED"]
    until(page, lambda d: [status_in_row(d, i) for i in made] == ["CANCELLED", "CANCELLED"], what="live, in place")


def test_the_matching_calls_callbacks_are_redelivered_at_once_and_each_call_says_who_asked(page, origin, worker,
                                                                                              relay, monkeypatch):
    monkeypatch.setenv("VOICE_TOOLS_CALLBACK_MAX_ATTEMPTS", "1")
    relay.answer(lambda event: 503)  # the relay is down
    made = [record(origin, session_id="sess_bulk_redeliver", callback_url=relay.url) for _ in range(2)]
    for tool_call_id in made:
        assert requests.delete(f"{origin}/voice-tools/cancel/{tool_call_id}", headers=AUTH, timeout=10).ok
    until(page, lambda d: all([x.state for x in deliveries(i)] == ["failed"] for i in made), timeout=15.0,
          what="both cancelled events given up")
    relay.answer(lambda event: None)  # back up

    sign_in(page, origin, OPS_TOKEN, "/console?session_id=sess_bulk_redeliver")
    until(page, lambda d: sorted(rows(d)) == sorted(made), what="the two calls")
    page.find_element(By.ID, "bulk-redeliver").click()
    until(page, lambda d: d.find_element(By.ID, "bulk-dialog").is_displayed(), what="the count, to confirm")
    assert page.find_element(By.ID, "bulk-what").text.startswith("This will redeliver the failed callbacks of 2 calls")
    assert not page.find_element(By.ID, "bulk-reason-line").is_displayed()  # a reason is a cancel's
    page.find_element(By.ID, "bulk-confirm").click()
    until(page, lambda d: d.find_element(By.ID, "bulk-progress").text == "2 of 2 calls done: queued 2.",
          what="the counts by outcome")
    assert all(li.text.endswith(": 1 event queued") for li in page.find_elements(By.CSS_SELECTOR, "#bulk-results li"))
    assert every_control_named(page) == []
    until(page, lambda d: all(len(relay.events_for(i)) == 2 for i in made), timeout=15.0, what="redelivered")
    for tool_call_id in made:
        last = requests.get(f"{origin}/voice-tools/status/{tool_call_id}", headers=AUTH,
                            timeout=10).json()["status_history"][-1]
        assert (last["reason"], last["by"], last["via"]) == ("Callback redelivered: event 1 (cancelled)", "ops",
                                                             "console")
