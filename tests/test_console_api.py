"""The operator console's server side (``app/console/``): its pages open and locked down, its data
fenced as REST is, its list paged by keyset on an index, its live list told of every call.

The browser itself drives the console in ``tests/test_console_browser.py``.
"""
from __future__ import annotations

import queue
import re
from datetime import datetime, timezone
import threading
import time
from html.parser import HTMLParser

import pytest
import requests
from sqlalchemy import text
from sqlalchemy.dialects import postgresql

from models import browse, db
from support.sse_client import Stream
from tests.api_fixtures import GUIDE_EMAIL
from tests.conftest import API_TOKEN, AUTH

BOB = {"Authorization": "Bearer bob-token"}
OPS = {"Authorization": "Bearer ops-token"}
PAGES = ("/console", "/console/calls/tc_abc", "/console/sessions/sess_1", "/console/tools")
FILES = {"/console/static/console.js": "javascript", "/console/static/console.css": "text/css",
         "/console/static/icon.svg": "image/svg+xml", "/favicon.ico": "image/svg+xml"}


@pytest.fixture(autouse=True)
def three_tokens(monkeypatch):
    monkeypatch.setenv("VOICE_TOOLS_API_TOKENS", f"tests:{API_TOKEN},bob:bob-token,ops:ops-token:admin")


def record(client, headers=AUTH, session_id="sess_console", **parameters) -> str:
    answer = client.post("/voice-tools/pending", headers=headers,
                         json={"session_id": session_id, "function": "send_email",
                               "parameters": {**GUIDE_EMAIL, **parameters}})
    assert answer.status_code == 201, answer.get_json()
    return answer.get_json()["tool_call_id"]


class Tags(HTMLParser):
    """Every start tag of a page, with its attributes."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str | None]]] = []
        self.labels: set[str] = set()

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))
        if tag == "label":
            self.labels.add(dict(attrs).get("for") or "")


@pytest.mark.parametrize("path", PAGES)
def test_a_page_is_served_without_a_token_locked_down_and_with_no_inline_script_or_style(client, path):
    answer = client.get(path)
    assert answer.status_code == 200 and answer.mimetype == "text/html"
    csp = answer.headers["Content-Security-Policy"]
    assert "default-src 'none'" in csp and "script-src 'self'" in csp and "style-src 'self'" in csp
    assert "unsafe-inline" not in csp and "frame-ancestors 'none'" in csp and "connect-src 'self'" in csp
    assert answer.headers["X-Frame-Options"] == "DENY"
    assert answer.headers["X-Content-Type-Options"] == "nosniff"
    page = Tags()
    page.feed(answer.get_data(as_text=True))
    assert not [t for t, a in page.tags if t == "style"] and not [a for _, a in page.tags if "style" in a]
    scripts = [a for t, a in page.tags if t == "script"]
    assert scripts == [{"src": "/console/static/console.js", "defer": None}]
    assert not [a for _, a in page.tags if any(name.startswith("on") for name in a)]  # no inline handlers
    for tag, attrs in page.tags:  # every control has a name: a <label for> or an aria-label
        if tag in ("input", "select") and attrs.get("type") != "hidden":
            assert attrs["id"] in page.labels or attrs.get("aria-label"), attrs
    for url in (a.get("src") or a.get("href") for _, a in page.tags):
        assert url is None or url.startswith("/"), url  # nothing from another origin


@pytest.mark.parametrize("path,kind", FILES.items())
def test_the_script_style_and_icon_are_served_without_a_token(client, path, kind):
    answer = client.get(path)
    assert answer.status_code == 200 and kind in answer.content_type
    assert answer.headers["X-Frame-Options"] == "DENY"


def test_the_data_needs_a_token_and_says_whose_it_is(client):
    refused = client.get("/console/api/me")
    assert refused.status_code == 401 and refused.get_json()["error"] == "unauthorized"
    assert refused.headers["X-Frame-Options"] == "DENY"
    assert client.get("/console/api/calls").status_code == 401
    from tasks import tools

    assert client.get("/console/api/me", headers=AUTH).get_json() == {"name": "tests", "admin": False,
                                                                        "tools": tools.names()}
    assert client.get("/console/api/me", headers=OPS).get_json() == {"name": "ops", "admin": True,
                                                                       "tools": tools.names()}


def test_the_list_is_fenced_as_rest_is(client):
    ours = record(client)
    bobs = record(client, headers=BOB, session_id="sess_bob")
    listed = lambda headers, query="": [c["tool_call_id"] for c in client.get(
        f"/console/api/calls{query}", headers=headers).get_json()["calls"]]
    assert listed(AUTH) == [ours]
    assert listed(BOB) == [bobs]
    assert listed(OPS) == [bobs, ours]  # an admin: everyone's, newest first
    assert listed(OPS, "?caller=tests") == [ours]
    assert listed(BOB, "?caller=tests") == []  # a caller filter never widens the fence
    assert client.get(f"/console/api/calls/{ours}", headers=BOB).status_code == 404
    assert client.get(f"/console/api/calls/{ours}", headers=AUTH).status_code == 200
    assert client.get(f"/console/api/calls/{ours}", headers=OPS).status_code == 200


def test_the_filters_and_the_search_by_id(client):
    first = record(client, session_id="sess_a")
    second = record(client, session_id="sess_b")
    client.delete(f"/voice-tools/cancel/{first}", headers=AUTH)
    listed = lambda query: [c["tool_call_id"] for c in client.get(
        f"/console/api/calls?{query}", headers=AUTH).get_json()["calls"]]
    assert listed("status=CANCELLED") == [first]
    assert listed("status=PENDING") == [second]
    assert listed("session_id=sess_a") == [first]
    assert listed("tool=send_email") == [second, first]
    assert listed("tool=create_task") == []
    assert listed(f"tool_call_id={second}") == [second]
    assert client.get("/console/api/calls?status=LOST", headers=AUTH).status_code == 422
    assert client.get("/console/api/calls?offset=3", headers=AUTH).status_code == 422
    assert listed("status=CANCELLED,PENDING") == [second, first]  # several statuses at once
    assert client.get("/console/api/calls?status=PENDING,LOST", headers=AUTH).status_code == 422


def test_a_time_range_and_the_counts_by_status_of_the_current_filter(client):
    from datetime import datetime, timedelta, timezone

    old = record(client, session_id="sess_range")
    with db.session() as s:  # recorded two hours ago
        s.execute(text("UPDATE tool_calls SET created_at = now() - interval '2 hours' WHERE tool_call_id = :i"),
                  {"i": old})
    new = record(client, session_id="sess_range")
    client.delete(f"/voice-tools/cancel/{new}", headers=AUTH)
    hour_ago = (datetime.now(timezone.utc) - timedelta(hours=1)).isoformat()
    listed = lambda query: [c["tool_call_id"] for c in client.get(
        "/console/api/calls", query_string={"session_id": "sess_range", **query}, headers=AUTH).get_json()["calls"]]
    assert listed({"created_from": hour_ago}) == [new]
    assert listed({"created_to": hour_ago}) == [old]
    assert listed({}) == [new, old]
    row = client.get("/console/api/calls", query_string={"session_id": "sess_range"}, headers=AUTH).get_json()["calls"][0]
    assert row["completed_at"] and row["created_at"] <= row["completed_at"]  # ended: the list's own columns
    assert client.get("/console/api/calls?created_from=yesterday", headers=AUTH).status_code == 422
    assert client.get("/console/api/calls?created_from=2026-01-01T00:00:00", headers=AUTH).status_code == 422  # a zone

    counted = client.get("/console/api/counts", query_string={"session_id": "sess_range"}, headers=AUTH).get_json()
    assert counted["more"] is False and counted["counted"] == 2
    assert {k: v for k, v in counted["counts"].items() if v} == {"PENDING": 1, "CANCELLED": 1}
    ranged = client.get("/console/api/counts", query_string={"session_id": "sess_range", "created_from": hour_ago},
                        headers=AUTH).get_json()
    assert {k: v for k, v in ranged["counts"].items() if v} == {"CANCELLED": 1}
    assert client.get("/console/api/counts?session_id=sess_range", headers=BOB).get_json()["counted"] == 0  # fenced
    assert client.get("/console/api/counts?status=PENDING", headers=AUTH).status_code == 422  # not a count's filter
    assert set(client.get("/console/api/me", headers=AUTH).get_json()["tools"]) >= {"send_email", "create_task"}


def test_paging_by_keyset_gives_every_call_once_newest_first(client):
    made = [record(client, subject=f"Subject {i}") for i in range(7)]
    seen: list[str] = []
    query = {"limit": 3}
    while True:
        page = client.get("/console/api/calls", headers=AUTH, query_string=query).get_json()
        seen += [c["tool_call_id"] for c in page["calls"]]
        if page["next"] is None:
            break
        query = {"limit": 3, **page["next"]}
    assert seen == list(reversed(made))


PLANS = {
    "everyone's": {"scope": None},
    "a caller's own": {"scope": "tests"},
    "one tool's": {"scope": None, "tool": "send_email"},
    "a session's": {"scope": None, "session_id": "sess_a"},
    "a caller's, one tool's, one open status": {"scope": "tests", "tool": "send_email", "statuses": ["PENDING"]},
    "several statuses, a time range": {"scope": None, "statuses": ["FAILED", "CANCELLED"],
                                       "created_from": datetime(2026, 1, 1, tzinfo=timezone.utc),
                                       "created_to": datetime(2027, 1, 1, tzinfo=timezone.utc)},
    "a caller's, one tool's, from a time": {"scope": "tests", "tool": "create_task",
                                            "created_from": datetime(2026, 1, 1, tzinfo=timezone.utc)},
}


def _nodes(plan: dict) -> list[str]:
    return [plan["Node Type"], *(n for child in plan.get("Plans", []) for n in _nodes(child))]


@pytest.mark.parametrize("filters", PLANS.values(), ids=PLANS.keys())
def test_a_page_is_one_index_range_at_any_depth(filters):
    """Held without ten million rows: with sequential scans and sorts priced out, a page of the list
    (the first, and one after a cursor) must still be an index scan with no sort of the whole
    selection; a plan that needed either (no index on the order) shows it anyway."""
    from datetime import datetime, timezone

    for before in (None, (datetime.now(timezone.utc), "tc_zzzz")):
        stmt = browse.page_statement(**filters, before=before, limit=50)
        sql = str(stmt.compile(dialect=postgresql.dialect(), compile_kwargs={"literal_binds": True}))
        assert "OFFSET" not in sql.upper()
        with db.engine().connect() as conn:
            conn.execute(text("SET LOCAL enable_seqscan = off"))
            conn.execute(text("SET LOCAL enable_sort = off"))
            plan = conn.execute(text(f"EXPLAIN (FORMAT JSON) {sql}")).scalar_one()[0]["Plan"]
        nodes = _nodes(plan)
        assert "Seq Scan" not in nodes and "Sort" not in nodes, (filters, nodes)
        assert any("Index" in n for n in nodes), nodes


@pytest.mark.parametrize("filters", PLANS.values(), ids=PLANS.keys())
def test_the_counts_by_status_are_a_bounded_read_of_one_index_range(filters):
    """The counts read the newest ``MAX_COUNTED`` and one of the filter's calls, in the index's order:
    bounded however many calls match (more than that: the answer says so)."""
    filters = {k: v for k, v in filters.items() if k != "statuses"}
    sql = str(browse.counts_statement(**filters).compile(dialect=postgresql.dialect(),
                                                         compile_kwargs={"literal_binds": True}))
    assert f"LIMIT {browse.MAX_COUNTED + 1}" in sql
    with db.engine().connect() as conn:
        conn.execute(text("SET LOCAL enable_seqscan = off"))
        conn.execute(text("SET LOCAL enable_sort = off"))
        plan = conn.execute(text(f"EXPLAIN (FORMAT JSON) {sql}")).scalar_one()[0]["Plan"]
    nodes = _nodes(plan)
    assert "Seq Scan" not in nodes and "Limit" in nodes and any("Index" in n for n in nodes), nodes


def test_the_migration_matches_the_models_indexes():
    from alembic.autogenerate import compare_metadata
    from alembic.migration import MigrationContext

    from models.calls import Base

    with db.engine().connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn, opts={"compare_type": True}), Base.metadata)
    touched = [d for d in diff if "tool_calls_created" in repr(d) or "caller_created" in repr(d)]
    assert touched == [], touched


class Frames:
    """The live list's frames, read by a thread of their own: :meth:`next` waits at most ``timeout``
    (keep-alive comments never hold a test past its deadline)."""

    def __init__(self, url: str, headers: dict[str, str]):
        self.stream = Stream(url, headers)
        self.queue: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        try:
            while True:
                _, data = self.stream.next_event()
                self.queue.put((self.stream.kinds[-1], data))
        except Exception as exc:  # closed
            self.queue.put(("ended", repr(exc)))

    def next(self, timeout: float) -> tuple[str, object]:
        try:
            return self.queue.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"no frame within {timeout} s") from None

    def until(self, found, timeout: float, check=lambda data: None) -> float:
        """Frames until ``found(kind, data)``; ``check(data)`` on each ``calls`` frame; the seconds it took."""
        started = time.monotonic()
        while True:
            kind, data = self.next(max(0.0, timeout - (time.monotonic() - started)))
            if kind == "calls":
                check(data)
            if found(kind, data):
                return time.monotonic() - started

    def close(self) -> None:
        self.stream.close()


def names(tool_call_id: str, status: str | None = None):
    return lambda kind, data: kind == "calls" and any(
        c["tool_call_id"] == tool_call_id and status in (None, c["status"]) for c in data)


def test_the_live_list_is_told_of_a_new_call_and_of_each_change_only_what_its_caller_may_see(api_url):
    ours_live = Frames(f"{api_url}/console/api/live", AUTH)
    ops_live = Frames(f"{api_url}/console/api/live", OPS)
    only_ours = lambda data: [c for c in data if c["caller"] != "tests"] == [] or pytest.fail(f"not ours: {data}")
    try:
        for live in (ours_live, ops_live):
            assert live.next(5.0) == ("reread", {})  # subscribed: the page reads its list now
        bobs = requests.post(f"{api_url}/voice-tools/pending", headers=BOB, timeout=10, json={
            "session_id": "sess_bob", "function": "send_email", "parameters": GUIDE_EMAIL}).json()["tool_call_id"]
        assert ops_live.until(names(bobs, "PENDING"), 2.0) < 2.0  # an admin's firehose: every caller's calls
        ours = requests.post(f"{api_url}/voice-tools/pending", headers=AUTH, timeout=10, json={
            "session_id": "sess_ours", "function": "send_email", "parameters": GUIDE_EMAIL}).json()["tool_call_id"]
        ours_live.until(names(ours, "PENDING"), 2.0, only_ours)
        requests.delete(f"{api_url}/voice-tools/cancel/{ours}", headers=AUTH, timeout=10)
        ours_live.until(names(ours, "CANCELLED"), 2.0, only_ours)
        ops_live.until(names(ours, "CANCELLED"), 2.0)
    finally:
        ours_live.close()
        ops_live.close()


class StreamReads:
    """The statements the process's stream readers run (the live lists' reads of changed rows), counted."""

    def __init__(self) -> None:
        self.count = 0

    def __enter__(self) -> "StreamReads":
        from sqlalchemy import event

        event.listen(db.engine(), "before_cursor_execute", self._seen)
        return self

    def __exit__(self, *_: object) -> None:
        from sqlalchemy import event

        event.remove(db.engine(), "before_cursor_execute", self._seen)

    def _seen(self, conn, cursor, statement, *_: object) -> None:
        if threading.current_thread().name.startswith("voice-tools-stream-read") and "tool_calls" in statement:
            self.count += 1


LISTS = 12


def test_live_lists_cost_one_read_per_batch_of_changes_whatever_their_number_and_none_for_others_calls(
        api_url, monkeypatch):
    """Twelve live lists of bob's: another caller's changes wake none of them, and the changed rows are read
    once per batch for them all (a new call of an unknown caller), never once per list; bob's own change reaches
    every one of his lists from that one read."""
    from app.console import live as live_module

    monkeypatch.setattr(live_module, "KEEPALIVE_S", 1.0)  # a closed list's stream ends at its next write
    lists = [Frames(f"{api_url}/console/api/live", BOB) for _ in range(LISTS)]
    try:
        for live in lists:
            assert live.next(5.0) == ("reread", {})
        ours = []
        with StreamReads() as reads:
            for i in range(4):  # another caller's: a new call, then its change, each its own batch
                ours.append(requests.post(f"{api_url}/voice-tools/pending", headers=AUTH, timeout=10, json={
                    "session_id": f"sess_other_{i}", "function": "send_email", "parameters": GUIDE_EMAIL}
                ).json()["tool_call_id"])
                time.sleep(0.4)
                requests.delete(f"{api_url}/voice-tools/cancel/{ours[-1]}", headers=AUTH, timeout=10)
                time.sleep(0.4)
            others = reads.count
            bobs = requests.post(f"{api_url}/voice-tools/pending", headers=BOB, timeout=10, json={
                "session_id": "sess_bob", "function": "send_email", "parameters": GUIDE_EMAIL}).json()["tool_call_id"]
            for live in lists:
                live.until(names(bobs, "PENDING"), 3.0,
                           lambda data: [c for c in data if c["caller"] != "bob"] == [] or pytest.fail(str(data)))
            mine = reads.count - others
        assert others <= 4, f"{others} reads for another caller's 8 changes beside {LISTS} lists"  # one per new call
        assert mine <= 2, f"{mine} reads for one change shown on {LISTS} lists"
        for live in lists:  # told of nothing of the other caller's
            assert live.queue.empty() or all(kind != "calls" for kind, _ in list(live.queue.queue)), live.queue.queue
    finally:
        for live in lists:
            live.close()


def test_a_redelivery_is_refused_where_the_record_does_not_offer_it(client):
    ours = record(client)
    client.delete(f"/voice-tools/cancel/{ours}", headers=AUTH)  # a cancelled event with no URL: nothing to send
    shown = client.get(f"/console/api/calls/{ours}", headers=AUTH).get_json()
    [event] = shown["events"]
    assert (event["event"], event["state"], event["actions_available"]) == ("cancelled", "none", [])
    again = client.post(f"/console/api/calls/{ours}/events/{event['event_id']}/redeliver", headers=AUTH)
    assert again.status_code == 409
    assert client.post(f"/console/api/calls/{ours}/events/{event['event_id']}/redeliver",
                       headers=BOB).status_code == 404


def test_the_tools_figures_are_an_admins(client):
    record(client)
    assert client.get("/console/api/tools", headers=AUTH).status_code == 403
    figures = client.get("/console/api/tools", headers=OPS).get_json()["tools"]
    email = next(t for t in figures if t["tool"] == "send_email")
    assert email["queue"] == "tools.send_email" and email["calls_last_hour"] == 1
    assert email["open"] == {"PENDING": 1} and len(email["per_minute"]) == 60
    assert email["queue_depth"] == 0


def test_no_token_reaches_a_log_line_or_a_url(client, caplog):
    import logging

    caplog.set_level(logging.DEBUG)
    client.get("/console/api/calls", headers=AUTH)
    client.get("/console", headers=AUTH)
    assert API_TOKEN not in caplog.text
    script = client.get("/console/static/console.js").get_data(as_text=True)
    assert "sessionStorage" in script and "localStorage" not in script and "document.cookie" not in script
    assert not re.search(r"[?&](token|access_token)=", script)


def test_a_steps_percentiles_are_runs_own_times_never_a_buckets_edge():
    """One run of 84 ms reads 84 ms at p50 and p99 (the buckets' reading said 5 and 9.9 ms); each figure is
    a run's own time, by nearest rank."""
    from tasks.calls import browse as views

    assert views._step_figures({"step": "PREPARING", "took_ms": [84.2]}) == {
        "step": "PREPARING", "runs": 1, "p50_ms": 84.2, "p99_ms": 84.2}
    hundred = [float(ms) for ms in range(100, 0, -1)]
    assert (views.nearest_rank(0.5, hundred), views.nearest_rank(0.99, hundred)) == (50.0, 99.0)
    assert views.nearest_rank(0.99, [3.0, 1.0, 2.0]) == 3.0 and views.nearest_rank(0.5, [3.0, 1.0]) == 1.0


def test_a_calls_trace_link_comes_from_the_configured_template(client, monkeypatch):
    tool_call_id = record(client)
    with db.session() as s:
        s.execute(text("UPDATE tool_calls SET trace_context = :t WHERE tool_call_id = :i"),
                  {"t": f"00-{'ab' * 16}-{'cd' * 8}-01", "i": tool_call_id})
    untraced = record(client)
    read = lambda i: client.get(f"/console/api/calls/{i}", headers=AUTH).get_json()["trace_url"]
    assert read(tool_call_id) is None  # no template: no link
    monkeypatch.setenv("VOICE_TOOLS_TRACE_URL", "http://jaeger.example:16686/trace/{trace_id}")
    assert read(tool_call_id) == f"http://jaeger.example:16686/trace/{'ab' * 16}"
    assert read(untraced) is None  # recorded while tracing was off
    monkeypatch.setenv("VOICE_TOOLS_TRACE_URL", "javascript:alert({trace_id})")
    assert read(tool_call_id) is None  # only an http(s) link


def test_the_sign_in_page_says_where_a_token_comes_from(client):
    page = client.get("/console").get_data(as_text=True)
    help_text = page.split('id="sign-in-help"', 1)[1].split("</div>", 1)[0]
    assert "VOICE_TOOLS_API_TOKENS" in help_text and "name:token:admin" in help_text
    assert "voice-tools run" in help_text and "console admin token" in help_text and "console_token" in help_text
