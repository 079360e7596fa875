"""Every guarantee across hosts: the system on eight hosts (network namespaces), four hosts lost or cut.

The hosts (``tests/multihost_system.py``, made by ``tests/netns.py``): ``db`` (PostgreSQL),
``broker`` (RabbitMQ with quorum queues, then Redis: the same test on each), ``api-1`` and
``api-2`` (gunicorn and the MCP server), ``worker-1..3`` (the writes, reads and callbacks workers
and a beat each) and ``relay`` (the test's relay: its callback receiver, its sessions and its
event streams). Each talks to the others by their namespace addresses only.

While relay sessions run (``tests/multihost_traffic.py``: all nine tools by their registry
examples, some recorded through the MCP face, write tools confirmed and resumed, cancels racing
resumes across the two API hosts,
every session's event stream followed), one after the other:

1. **a worker host killed**: ``worker-2``'s link taken down and every process on it SIGKILLed,
   mid-send; it stays dead;
2. **a host cut off**: ``worker-3``'s link down for ``CUT_S`` (past the Redis visibility timeout
   and RabbitMQ's missed heartbeats: a link it held runs elsewhere meanwhile), then up again;
3. **an API host lost**: ``api-1`` SIGKILLed while relays hold ``?wait`` requests and event
   streams on it; they are sent again to ``api-2``, the streams resumed there with Last-Event-ID;
4. **the beat host lost**: beat on ``worker-1`` SIGKILLed (``worker-2``'s died in 1): the sweeps
   still run, from ``worker-3``'s beat, once a period (``models/sweep_runs.py``).

Then, once the system settles: every call terminal or waiting (PENDING, PREPARED), and waiting
only for what its caller has not done (never PENDING after a confirm taken, nor PREPARED after a
resume taken); every side
effect at most once (``email_outbox``, ``calendar_events``, ``todo_tasks``: one for each COMPLETED
write call, none otherwise); every event delivered, each event_id once at the relay (a copy again
only of an event whose first copy came while its worker's host was being lost or cut off, or after
an attempt its row records failed: its sender never had the relay's whole answer, and delivery is
at least once), and each stream
gapless by seq with each event once; a call whose cancel answered 200 CANCELLED (and never
with its side effect), whatever the resume it raced answered; no answer but the
expected ones (no 5xx, no request left unanswered by both API hosts); no call EXECUTING longer
than the stuck-call bound allows. The counts are printed; the problems must be none.
"""
from __future__ import annotations

import glob
import os
import random
import re
import shutil
import tempfile
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

import pytest
from sqlalchemy import select, text

from models.lifecycle import REDRIVEN_REASON
from tests import netns
from tests.invariants import check, settle

pytestmark = [pytest.mark.multihost, pytest.mark.slow]

_why_not = netns.unavailable()
if _why_not:
    pytest.skip(_why_not, allow_module_level=True)

from tests.multihost_system import (APIS, MCP_PORT, PREFIX, RELAY_PORT, STUCK_AFTER, SWEEP_EVERY, MultiHost,  # noqa: E402
                                    VISIBILITY_TIMEOUT, HEARTBEAT_S)
from tests.multihost_traffic import Followers, HostsTraffic  # noqa: E402

CONCURRENCY = 6  # relay sessions at once
OPS = 4  # operations per session
AROUND_S = 5  # the stream runs this long before the first fault and after each
CUT_S = 15  # worker-3 cut off: past VISIBILITY_TIMEOUT (8 s) and 2 x HEARTBEAT_S (10 s)
SETTLE_S = 150
BUSY_WAIT_S = 15  # how long a fault waits for its host to be running a link
# The longest a call may stay EXECUTING: a link lost with a lost host is judged by the stuck-call
# sweep once its call has been quiet past the link's hard time limit (the tool's time_limit + 10 s,
# 70 s at most here) or, when its queue cannot be read whole, past STUCK_AFTER; the sweep runs
# every SWEEP_EVERY; a side effect's claim held by a lost link lapses after the same 70 s.
LONGEST_LINK_S = 70
STUCK_BOUND_S = max(LONGEST_LINK_S, STUCK_AFTER) + 3 * SWEEP_EVERY + 30
assert CUT_S > max(VISIBILITY_TIMEOUT, 2 * HEARTBEAT_S)


@pytest.fixture(params=["rabbitmq", "redis"])
def hosts(request, tmp_path):
    """The hosts, on RabbitMQ and on Redis; removed afterwards, pass or fail (their logs kept in tmp_path)."""
    for leftover in glob.glob(os.path.join(tempfile.gettempdir(), f"{PREFIX}-*")):
        shutil.rmtree(leftover, ignore_errors=True)  # a killed run's data dirs
    system = MultiHost(Path(tempfile.mkdtemp(prefix=f"{PREFIX}-{request.param}-")), request.param)
    try:
        system.start()
        yield system
    finally:
        system.stop(keep_logs=tmp_path / "logs")


def on_host(system: MultiHost, host: str, fn: Callable[[], Any]) -> Any:
    """``fn()`` in a thread of this process that entered ``host``: what it opens and starts is there."""
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            with netns.enter(system.net.namespace(host)):
                result["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - raised below
            result["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if "error" in result:
        raise result["error"]
    return result.get("value")


def clock(moment: float | None = None) -> str:
    """The wall-clock time (UTC, to the millisecond) of a ``time.monotonic()`` moment (now by default)."""
    ago = 0.0 if moment is None else time.monotonic() - moment
    return datetime.fromtimestamp(time.time() - ago, timezone.utc).strftime("%H:%M:%S.%f")[:-3]


def wait_until(predicate: Callable[[], bool], timeout: float, what: str) -> float:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        time.sleep(0.1)
    return time.monotonic()


def sweeps_claimed_since(moment: datetime) -> int:
    from models import db

    with db.session() as s:
        return s.scalar(text("SELECT count(*) FROM sweep_runs WHERE sweep = 'maintenance.fail_stuck' "
                             "AND period_start > :moment"), {"moment": moment})


def stream_rows() -> dict[str, list[tuple[str, str, int]]]:
    """Session -> (event_id, tool_call_id, seq) of each of its events."""
    from models import db
    from models.calls import CallbackDelivery, ToolCall

    rows: dict[str, list[tuple[str, str, int]]] = {}
    with db.session() as s:
        for session, event_id, call, seq in s.execute(
                select(ToolCall.session_id, CallbackDelivery.event_id, CallbackDelivery.tool_call_id,
                       CallbackDelivery.seq).join(ToolCall, ToolCall.tool_call_id == CallbackDelivery.tool_call_id)):
            rows.setdefault(session, []).append((event_id, call, seq))
    return rows


def failed_attempts() -> dict[str, int]:
    """event_id -> the failed attempts its row records (each one's copy may have reached the relay)."""
    from models import db

    with db.session() as s:
        return dict(s.execute(text(
            "SELECT event_id, count(*) FROM callback_deliveries, jsonb_array_elements(attempt_log) AS attempt "
            "WHERE attempt->>'error' IS NOT NULL GROUP BY event_id")).all())


def resume_url_problems(relay: Any, hosts: MultiHost) -> list[str]:
    """Every resume URL the relay was sent names the API's public URL (never a worker host's)."""
    public = hosts.env("relay")["VOICE_TOOLS_PUBLIC_URL"]
    with relay._lock:
        urls = {event[key] for event in relay.events for key in ("resume_url", "resume_webhook") if event.get(key)}
    if not urls:
        return ["no event carried a resume URL"]
    return [f"a resume URL off the API: {url}" for url in urls if not url.startswith(f"{public}/voice-tools/")]


def open_calls(hosts: MultiHost) -> list[str]:
    """Each call left EXECUTING: its step, history, timestamps and link attempts, and every log line of
    every process that names it (what to follow it by when the settle did not end it)."""
    from models import db
    from models.calls import ToolCall

    with db.session() as s:
        calls = list(s.scalars(select(ToolCall).where(ToolCall.status == "EXECUTING")))
        found = [(c.tool_call_id, f"{c.tool_call_id} {c.function_name} at {c.current_step} (outputs "
                  f"{sorted(c.step_outputs)}, confirmed {c.confirmed_at}, step started {c.step_started_at}, "
                  f"committed {c.committed_at}, chain {c.workflow_id}): "
                  + " -> ".join(f"{h['status']} {h['at'][11:23]} {h.get('reason', '')}" for h in c.status_history)
                  + f"; attempts {c.link_attempts}") for c in calls]
    logs = {log.name: log.read_text(errors="replace").splitlines() for log in sorted(hosts.dir.glob("*.log"))}
    lines = []
    for tool_call_id, about in found:
        lines.append(about)
        tasks = {task for log in logs.values() for line in log if tool_call_id in line
                 for task in re.findall(r'"task_id": "([0-9a-f-]{36})"', line)}
        for name, log in logs.items():
            lines += [f"    {name}: {line[:400]}" for line in log
                      if tool_call_id in line or any(task in line for task in tasks)][:40]
    if found:  # the database's sessions in a transaction or waiting (a lock held by a lost host's?), every
        # error logged, and what the stuck-call sweeps saw and did (the last of them)
        with db.session() as s:
            lines += [f"    session {row}" for row in s.execute(text(
                "SELECT pid, client_addr, state, wait_event_type, wait_event, now() - xact_start AS xact_age, "
                "left(query, 120) FROM pg_stat_activity WHERE datname = current_database() "
                "AND pid <> pg_backend_pid() AND state <> 'idle'")).all()]
        lines += [f"    {name}: {line[:400]}" for name, log in logs.items() for line in log
                  if '"level": "ERROR"' in line][:30]
        lines += [f"    {name}: {line[:300]}" for name, log in logs.items() for line in log
                  if "stuck-call" in line or "fail_stuck" in line and "received" not in line][-30:]
    return lines


def failed_calls() -> list[str]:
    """Each FAILED call: its tool, step and history (to follow it in the processes' logs)."""
    from models import db
    from models.calls import ToolCall

    with db.session() as s:
        return [f"{c.tool_call_id} {c.function_name} at {c.current_step}: "
                + " -> ".join(f"{h['status']} {h['at'][11:23]}" for h in c.status_history)
                for c in s.scalars(select(ToolCall).where(ToolCall.status == "FAILED"))]


def call_statuses() -> dict[str, str]:
    from models import db

    with db.session() as s:
        return dict(s.execute(text("SELECT tool_call_id, status FROM tool_calls")).all())


def fault_marks() -> str:
    """What the faults left on the calls: side effects claimed more than once, runs again by the sweep."""
    from models import db

    with db.session() as s:
        claimed, redriven = s.execute(text(
            "SELECT count(*) FILTER (WHERE effect_attempts > 1), "
            "count(*) FILTER (WHERE status_history::text LIKE :redriven) FROM tool_calls"),
            {"redriven": f"%{REDRIVEN_REASON}%"}).one()
    return f"{claimed} side effects claimed again after a lost claim, {redriven} calls run again by the sweep"


def longest_executing_s() -> tuple[float, str]:
    """The longest time any call stayed EXECUTING (from entering it to leaving it, redrives included)."""
    from models import db
    from models.calls import ToolCall

    longest, which = 0.0, ""
    with db.session() as s:
        for call in s.scalars(select(ToolCall)):
            entered = None
            for entry in call.status_history:
                at = datetime.fromisoformat(entry["at"])
                if entry["status"] == "EXECUTING":
                    entered = entered or at
                elif entered is not None:
                    if (at - entered).total_seconds() > longest:
                        longest, which = (at - entered).total_seconds(), call.tool_call_id
                    entered = None
    return longest, which


def test_every_guarantee_holds_across_hosts(hosts: MultiHost):
    from support.relay import Relay
    from tasks.delivery.signing import parse_secrets

    began = time.monotonic()
    env = hosts.env("relay")
    relay = on_host(hosts, "relay", lambda: Relay(
        secret=env["VOICE_TOOLS_CALLBACK_SECRET"], webhook_secrets=parse_secrets(env["VOICE_TOOLS_CALLBACK_SECRETS"]),
        host=hosts.address("relay"), port=RELAY_PORT).__enter__())
    assert relay.url == hosts.relay_url
    bases = [hosts.api_url(host) for host in APIS]
    seed = random.randrange(10**6)
    traffic = HostsTraffic(bases, hosts.auth, relay, ops=OPS, seed=seed,
                           mcp_urls=[f"http://{hosts.address(host)}:{MCP_PORT}/mcp" for host in APIS])
    followers = Followers(bases, hosts.auth)
    faults: list[str] = []
    windows: list[tuple[float, float]] = []  # when a worker host was lost or cut off (padded by the callback timeout)
    pad = float(env["VOICE_TOOLS_CALLBACK_TIMEOUT"]) + 1
    try:
        on_host(hosts, "relay", followers.start)
        stream = traffic.streaming(CONCURRENCY)
        on_host(hosts, "relay", stream.__enter__)
        try:
            time.sleep(AROUND_S)

            # 1. a worker host killed mid-send (while its workers run a link, when that is seen in time)
            busy = hosts.wait_busy("worker-2", BUSY_WAIT_S)
            lost = time.monotonic()
            killed = hosts.lose_host("worker-2")
            windows.append((lost - pad, time.monotonic() + pad))
            faults.append(f"{clock(lost)} worker-2 lost running {busy} links ({killed} processes SIGKILLed, link down)")
            time.sleep(AROUND_S)

            # 2. a host cut off, then back
            busy = hosts.wait_busy("worker-3", BUSY_WAIT_S)
            cut = time.monotonic()
            hosts.net.link("worker-3", up=False)
            time.sleep(CUT_S)
            hosts.net.link("worker-3", up=True)
            restored = time.monotonic()
            windows.append((cut - pad, restored + pad))
            rejoined = wait_until(lambda: hosts.expected_workers(["worker-3"]) <= hosts.answering_workers(), 60,
                                  "worker-3's workers answering again after its link came back") - restored
            faults.append(f"{clock(cut)} worker-3 cut off {CUT_S} s running {busy} links (its workers answered again "
                          f"{rejoined:.0f} s after)")
            time.sleep(AROUND_S)

            # 3. an API host lost while relays hold ?wait requests and streams on it
            wait_until(lambda: traffic.waiting[0] > 0 and 0 in followers.on_host.values(), 20,
                       "a ?wait request and a stream under way on api-1")
            held = (traffic.waiting[0], sum(1 for h in followers.on_host.values() if h == 0))
            failovers, resumed = traffic.failovers, followers.resumed
            api_lost = time.monotonic()
            killed = hosts.kill_api_host("api-1")
            faults.append(f"{clock(api_lost)} api-1 lost ({killed} processes SIGKILLed holding {held[0]} ?wait requests "
                          f"and {held[1]} streams)")
            time.sleep(AROUND_S)

            # 4. a beat host lost: the sweeps still run from another
            lost_beat = time.monotonic()
            hosts.kill_line("worker-1", "beat")
            with hosts.database():
                beat_lost = datetime.now(timezone.utc)
                wait_until(lambda: sweeps_claimed_since(beat_lost) > 0, 6 * SWEEP_EVERY,
                           "a stuck-call sweep run after worker-1's beat was lost")
            faults.append(f"{clock(lost_beat)} beat on worker-1 lost (worker-2's went with its host)")
        finally:
            stream.__exit__(None, None, None)
        traffic_s = time.monotonic() - began

        with hosts.database():
            settled = time.monotonic()
            settle(timeout=SETTLE_S)
            settle_s = time.monotonic() - settled
            rows = stream_rows()
            followers.wait_for({session: len(events) for session, events in rows.items()}, timeout=30)
            followers.stop()
            verdict = check(relay, answered_cancelled=traffic.cancelled)
            longest, longest_call = longest_executing_s()
            marks = fault_marks()
            statuses = call_statuses()
            failed = failed_calls()
            left_open = open_calls(hosts)
            attempts_failed = failed_attempts()
    finally:
        followers.stop()
        relay.__exit__(None, None, None)

    problems = (verdict.problems + traffic.problems() + traffic.waiting_problems(statuses)
                + traffic.duplicate_problems(windows, attempts_failed)
                + followers.problems(rows) + resume_url_problems(relay, hosts)
                + ([f"{longest_call} EXECUTING {longest:.0f} s, past the bound of {STUCK_BOUND_S} s"]
                   if longest > STUCK_BOUND_S else []))
    print(f"\nmultihost on {hosts.kind} (seed {seed}): {verdict.calls} calls, {verdict.events} events "
          f"({followers.received()} on {len(rows)} streams, resumed {followers.resumed} times), "
          f"{len(faults)} faults, {len(problems)} problems; {verdict.summary()}; {traffic.summary()}; "
          f"{marks}; {traffic.resent(attempts_failed)} copies received again after a failed attempt; "
          f"longest EXECUTING {longest:.0f} s; traffic {traffic_s:.0f} s, settled in {settle_s:.0f} s\n  faults: "
          + "; ".join(faults) + "".join(f"\n  FAILED {line}" for line in failed)
              + "".join(f"\n  OPEN {line}" for line in left_open))
    assert problems == [], problems[:20]
    # each fault did what it says: the relays went over to api-2, and every tool ran
    assert traffic.failovers > failovers and followers.resumed > resumed, (traffic.failovers, followers.resumed)
    assert len(traffic.tools_used) == 9, traffic.tools_used
    assert verdict.statuses["COMPLETED"] > 0 and verdict.statuses["CANCELLED"] > 0, verdict.statuses
    assert traffic.races, "no resume raced a cancel"
    assert traffic.codes()[201] and any(a.operation == "mcp_request" and a.status == 201 for a in traffic.answers)
