"""The console tab's CPU with the live list open at 2 calls a second: ``python -m bench.console_cpu``.

The Procfile's web line (gunicorn) on embedded servers, ``--held`` calls already recorded, and Debian's
Chromium, headless, driven through its chromedriver (``/usr/bin/chromium``, ``/usr/bin/chromedriver``;
Selenium from the dev lock, nothing downloaded), signed in on the list of calls. Meanwhile a client records
a call every half second and cancels the one before (``--rate`` calls a second: each a new row on top of the
list, then its status changed in place). The CPU time (user + system, from ``/proc``) of every process of
the browser (the browser process, its renderer, its GPU process, its utility processes; chromedriver
not counted) and of the web line's processes is read before and after each window of ``--seconds``, in
three phases, each round in another order:

- ``live``: the list open and live (each change drawn);
- ``paused``: the same page with the list paused (the changes counted, none drawn);
- ``blank``: the tab on ``about:blank`` (the browser's own floor), the traffic going on.

Printed as a table of each phase's share of one CPU (the median of the rounds, and each round), and
written with every figure to ``--results`` (``bench/results/console-cpu-<date>.json``). Asserts no
time; it fails if the live list did not show the calls recorded during its windows.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import psutil
import requests

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.calls import API_TOKEN, AUTH  # noqa: E402
from bench.run import bench_servers, machine  # noqa: E402
from bench.stack import Stack  # noqa: E402
from support import browser  # noqa: E402

PHASES = ("live", "paused", "blank")
KINDS = ("browser", "renderer", "gpu-process", "utility", "other")
PARAMETERS = {"to": "ann@example.com", "subject": "Bench", "body": "The console's CPU."}

_HELD = """
    INSERT INTO tool_calls (tool_call_id, session_id, function_name, action_level, parameters, status, caller,
                            created_at)
    SELECT 'tc_held_' || lpad(i::text, 6, '0'), 'sess_held_' || (i % 50), 'send_email', 'write', '{}'::jsonb,
           CASE WHEN i % 3 = 0 THEN 'COMPLETED' ELSE 'CANCELLED' END, 'bench', now() - make_interval(secs => i * 7)
    FROM generate_series(1, %(count)s) AS i
"""


def _seconds(process: psutil.Process) -> float:
    try:
        times = process.cpu_times()  # /proc/<pid>/stat: utime + stime
        return times.user + times.system
    except psutil.Error:
        return 0.0


def _kind(process: psutil.Process) -> str:
    try:
        command = process.cmdline()
    except psutil.Error:
        return "other"
    if not command or "chromium" not in Path(command[0]).name:
        return "other"
    for part in command:
        if part.startswith("--type="):
            kind = part.split("=", 1)[1]
            return kind if kind in KINDS else "other"
    return "browser"


def browser_cpu(driver_pid: int) -> dict[int, tuple[str, float]]:
    """Every process of the browser chromedriver started (its descendants, not chromedriver): pid ->
    (kind, CPU seconds so far)."""
    try:
        family = psutil.Process(driver_pid).children(recursive=True)
    except psutil.Error:
        return {}
    return {p.pid: (_kind(p), _seconds(p)) for p in family}


def web_cpu(stack: Stack) -> dict[int, float]:
    try:
        root = psutil.Process(stack.procs["web"].pid)
        return {p.pid: _seconds(p) for p in [root, *root.children(recursive=True)]}
    except psutil.Error:
        return {}


class Traffic(threading.Thread):
    """A call recorded every ``1 / rate`` seconds, and the one before it cancelled meanwhile."""

    def __init__(self, url: str, rate: float):
        super().__init__(daemon=True)
        self.http = requests.Session()
        self.http.headers.update(AUTH)
        self.url, self.interval = url, 1.0 / rate
        self.recorded: list[str] = []
        self.failed: list[str] = []
        self.stopped = threading.Event()

    def run(self) -> None:
        n = 0
        while not self.stopped.is_set():
            due = time.monotonic() + self.interval
            n += 1
            try:
                made = self.http.post(f"{self.url}/voice-tools/pending", timeout=30, json={
                    "session_id": f"sess_bench_cpu_{n % 20}", "function": "send_email", "parameters": PARAMETERS})
                if made.status_code == 201:
                    if self.recorded:
                        gone = self.http.delete(f"{self.url}/voice-tools/cancel/{self.recorded[-1]}", timeout=30)
                        if gone.status_code != 200:
                            self.failed.append(f"cancel {gone.status_code}")
                    self.recorded.append(made.json()["tool_call_id"])
                else:
                    self.failed.append(f"pending {made.status_code}")
            except requests.RequestException as exc:
                self.failed.append(type(exc).__name__)
            time.sleep(max(0.0, due - time.monotonic()))


def start_browser() -> Any:
    return browser.chromium()  # the same flags as the browser tests


def until(driver: Any, found: Any, timeout: float = 30.0, what: str = "") -> Any:
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout, poll_frequency=0.1).until(lambda d: found(d), message=what)


def open_list(driver: Any, origin: str) -> None:
    """The list of calls, signed in (the token kept by the tab for the origin), live."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    driver.get(f"{origin}/console")

    def form_or_list(d: Any) -> Any:
        field = d.find_element(By.ID, "token")
        return field if field.is_displayed() else d.find_element(By.ID, "live-state").text == "live"

    field = until(driver, form_or_list, what="the sign-in form or the live list")
    if field is not True:
        field.send_keys(API_TOKEN + Keys.ENTER)
    until(driver, lambda d: d.find_element(By.ID, "live-state").text == "live", what="the live list")


def set_paused(driver: Any, on: bool) -> None:
    from selenium.webdriver.common.by import By

    button = driver.find_element(By.ID, "pause")
    if (button.get_attribute("aria-pressed") == "true") != on:
        button.click()
    until(driver, lambda d: d.find_element(By.ID, "pause").get_attribute("aria-pressed") == str(on).lower(),
          what="paused" if on else "resumed")


def shown(driver: Any) -> set[str]:
    return set(driver.execute_script(
        "return [...document.querySelectorAll('#calls-rows > [role=row]')].map(r => r.dataset.id)"))


def window(driver_pid: int, stack: Stack, seconds: float) -> dict[str, Any]:
    """The share of one CPU each kind of browser process, the browser in all, and the web line took over
    ``seconds`` of wall time (a process started meanwhile counts from 0)."""
    before_browser, before_web, begun = browser_cpu(driver_pid), web_cpu(stack), time.monotonic()
    time.sleep(seconds)
    after_browser, after_web, took = browser_cpu(driver_pid), web_cpu(stack), time.monotonic() - begun
    kinds = dict.fromkeys(KINDS, 0.0)
    for pid, (kind, spent) in after_browser.items():
        kinds[kind] += spent - before_browser.get(pid, (kind, 0.0))[1]
    web = sum(spent - before_web.get(pid, 0.0) for pid, spent in after_web.items())
    return {"seconds": round(took, 2), "browser_total": round(sum(kinds.values()) / took, 4),
            "by_kind": {kind: round(spent / took, 4) for kind, spent in kinds.items()},
            "web": round(web / took, 4)}


def measure(driver: Any, stack: Stack, traffic: Traffic, seconds: float, rounds: int,
            settle: float = 2.0) -> dict[str, list[dict]]:
    origin, driver_pid = stack.urls["web"], driver.service.process.pid
    taken: dict[str, list[dict]] = {phase: [] for phase in PHASES}
    for r in range(rounds):
        order = PHASES[r % 3:] + PHASES[:r % 3]
        for phase in order:
            if phase == "blank":
                driver.get("about:blank")
            else:
                if driver.current_url == "about:blank" or not driver.current_url.startswith(origin):
                    open_list(driver, origin)
                set_paused(driver, phase == "paused")
            time.sleep(settle)  # the page settled (a resumed list draws what arrived)
            first = len(traffic.recorded)
            figures = window(driver_pid, stack, seconds)
            if phase == "live":  # the calls recorded meanwhile are on the list
                made = traffic.recorded[first:-1]
                until(driver, lambda d: set(made[-5:]) <= shown(d), timeout=10.0, what="the new calls, live")
                figures["calls_shown"] = len(made)
            taken[phase].append(figures)
            print(f"round {r + 1} {phase:>6}: browser {figures['browser_total']:.2%} of one CPU "
                  f"({', '.join(f'{k} {v:.2%}' for k, v in figures['by_kind'].items() if v)}), "
                  f"web {figures['web']:.2%}", flush=True)
    return taken


def table(taken: dict[str, list[dict]], header: list[str]) -> str:
    def median(phase: str, get: Any) -> float:
        return statistics.median(get(f) for f in taken[phase])

    lines = [*header, "", "| phase | browser in all (median) | each round | renderer | GPU process | browser process "
             "| utility | web line (gunicorn) |", "|---|---|---|---|---|---|---|---|"]
    for phase in PHASES:
        rounds = ", ".join(f"{f['browser_total']:.2%}" for f in taken[phase])
        lines.append(
            f"| {phase} | **{median(phase, lambda f: f['browser_total']):.2%}** | {rounds} | "
            + " | ".join(f"{median(phase, lambda f, k=k: f['by_kind'][k]):.2%}"
                         for k in ("renderer", "gpu-process", "browser", "utility"))
            + f" | {median(phase, lambda f: f['web']):.2%} |")
    live, blank = median("live", lambda f: f["browser_total"]), median("blank", lambda f: f["browser_total"])
    paused = median("paused", lambda f: f["browser_total"])
    lines += ["", f"The live list costs the browser **{live - blank:+.2%}** of one CPU over the blank tab, "
              f"{live - paused:+.2%} over the same page paused."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.console_cpu", description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=30.0, help="each window (default 30)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the three phases (default 3)")
    parser.add_argument("--rate", type=float, default=2.0, help="calls a second (default 2)")
    parser.add_argument("--settle", type=float, default=2.0, help="seconds before each window (default 2)")
    parser.add_argument("--held", type=int, default=1000, help="calls recorded before the list opens (default 1000)")
    parser.add_argument("--results", default=str(ROOT / "bench" / "results"), help="folder of console-cpu-<date>.json")
    args = parser.parse_args(argv)
    if not browser.installed():
        print("needs Debian's chromium and chromium-driver (apt-get install chromium chromium-driver)", file=sys.stderr)
        return 2
    started = time.monotonic()
    with bench_servers("vt-bench-console-cpu-") as data_dir:
        from sqlalchemy import text

        from models import db

        with db.session() as s:
            s.execute(text(_HELD.replace("%(count)s", ":count")), {"count": args.held})
        stack = Stack(data_dir / "stack", names=("web",)).start()
        driver = traffic = None
        try:
            driver = start_browser()
            open_list(driver, stack.urls["web"])
            traffic = Traffic(stack.urls["web"], args.rate)
            traffic.start()
            taken = measure(driver, stack, traffic, args.seconds, args.rounds, args.settle)
            version = driver.capabilities.get("browserVersion", "?")
        finally:
            if traffic is not None:
                traffic.stopped.set()
                traffic.join(30)
            if driver is not None:
                driver.quit()
            stack.stop()
        info = machine()
    if traffic.failed:
        raise RuntimeError(f"the traffic's requests failed: {traffic.failed[:10]}")
    now = datetime.now(timezone.utc)
    command = (f"python -m bench.console_cpu --seconds {args.seconds:g} --rounds {args.rounds} --rate {args.rate:g} "
               f"--held {args.held}" + (f" --settle {args.settle:g}" if args.settle != 2.0 else ""))
    header = [
        f"## The console tab's CPU, the live list open at {args.rate:g} calls a second "
        f"({now.strftime('%Y-%m-%d %H:%M')} UTC, `{command}`, {time.monotonic() - started:.0f} s)", "",
        f"- machine: {info['cpu']}; {info['load']}",
        f"- Chromium {version}, headless, through chromedriver; the Procfile's web line; {args.held:,} calls held, "
        f"a call recorded and the one before cancelled every {1 / args.rate:g} s ({len(traffic.recorded)} in all)",
        "- share of one CPU (user + system from /proc) of each kind of the browser's processes, and of the web line's; "
        f"{args.rounds} rounds of the three phases of {args.seconds:g} s each, each round in another order",
    ]
    text_table = table(taken, header)
    out = Path(args.results) / f"console-cpu-{now.strftime('%Y-%m-%d')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"date": now.isoformat(timespec="seconds"), "command": command, "machine": info,
                               "browser": version, "calls_recorded": len(traffic.recorded), "results": taken,
                               "table": text_table}, indent=1, ensure_ascii=False) + "\n")
    print(text_table)
    print(f"written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
