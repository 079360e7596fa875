"""This release's processes survive a schema change under them.

The Procfile's processes run with calls in every state (PENDING, PREPARED at the checkpoint, EXECUTING
with links queued) while the test changes the type of each column their hot statements return, as a
migration does, and adds a column. PostgreSQL then refuses every prepared plan that returns a changed
column (``cached plan must not change result type``); each is prepared again and run again in the same
call (``models/compiled.py``). Held: every call completes, each email once, no answer is a 5xx, no link
fails.
"""
from __future__ import annotations

import time

import pytest
import requests
from sqlalchemy import text

from models import db
from support.system import System

pytestmark = pytest.mark.slow

EMAIL = {"to": "john@example.com", "subject": "Schema", "body": "Sent once."}
# each column the hot statements return, with a type it may widen to (no table rewrite) and back
CHANGES = {"current_step": ("varchar(60)", "varchar(50)"), "session_id": ("varchar(120)", "varchar(100)"),
           "workflow_id": ("varchar(120)", "varchar(100)"), "function_name": ("varchar(120)", "varchar(100)")}


def alter(sql: str) -> None:
    with db.session() as s:
        s.execute(text("SET lock_timeout = '5s'"))
        s.execute(text(sql))


def test_calls_in_every_state_complete_across_changed_column_types(tmp_path):
    system = System(tmp_path)
    answers: list[int] = []

    def call(method: str, path: str, **kw) -> dict:
        answer = requests.request(method, f"{system.url}{path}", headers=system.auth, timeout=40, **kw)
        answers.append(answer.status_code)
        assert answer.status_code < 500, (method, path, answer.status_code, answer.text)
        return answer.json()

    def record() -> str:
        return call("POST", "/voice-tools/pending", json={"session_id": "s_schema_change", "function": "send_email",
                                                          "parameters": EMAIL})["tool_call_id"]

    try:
        system.start()
        warm = [record() for _ in range(2)]  # every hot statement prepared on the processes' connections
        for tool_call_id in warm:
            assert call("POST", f"/voice-tools/confirm/{tool_call_id}?wait=20")["status"] == "PREPARED"
            assert call("POST", f"/voice-tools/resume/{tool_call_id}?wait=20", json={"action": "proceed"})["status"] \
                == "COMPLETED"
        pending = [record() for _ in range(3)]
        prepared = [record() for _ in range(3)]
        for tool_call_id in prepared:
            assert call("POST", f"/voice-tools/confirm/{tool_call_id}?wait=20")["status"] == "PREPARED"
        system.stop_process("writes")
        queued = [record() for _ in range(3)]
        for tool_call_id in queued:
            assert call("POST", f"/voice-tools/confirm/{tool_call_id}")["status"] == "EXECUTING"
        changed: list[str] = []
        try:
            for column, (wider, _) in CHANGES.items():
                alter(f"ALTER TABLE tool_calls ALTER COLUMN {column} TYPE {wider}")
                changed.append(column)
            alter("ALTER TABLE tool_calls ADD COLUMN schema_change_probe text")
            for tool_call_id in pending + prepared + queued:  # the API's reads and the statuses' statements
                call("GET", f"/voice-tools/status/{tool_call_id}")
            system.start_process("writes")
            system.wait_ready(("writes",))
            for tool_call_id in pending:
                assert call("POST", f"/voice-tools/confirm/{tool_call_id}?wait=20")["status"] == "PREPARED"
            for tool_call_id in queued:  # the links queued behind the stopped worker run to the checkpoint
                deadline = time.monotonic() + 60
                while call("GET", f"/voice-tools/status/{tool_call_id}")["status"] != "PREPARED":
                    assert time.monotonic() < deadline, f"{tool_call_id} not PREPARED"
                    time.sleep(0.3)
            for tool_call_id in pending + prepared + queued:
                done = call("POST", f"/voice-tools/resume/{tool_call_id}?wait=20", json={"action": "proceed"})
                assert done["status"] == "COMPLETED", done
        finally:
            alter("ALTER TABLE tool_calls DROP COLUMN IF EXISTS schema_change_probe")
            for column in changed:
                alter(f"ALTER TABLE tool_calls ALTER COLUMN {column} TYPE {CHANGES[column][1]}")
        every = warm + pending + prepared + queued
        with db.session() as s:
            sent = dict(s.execute(text("SELECT tool_call_id, count(*) FROM email_outbox "
                                       "WHERE tool_call_id = ANY(:ids) GROUP BY tool_call_id"), {"ids": every}).all())
            failed_runs = s.execute(text(
                "SELECT count(*) FROM tool_calls, jsonb_array_elements(link_attempts) run "
                "WHERE tool_call_id = ANY(:ids) AND run->>'outcome' <> 'done'"), {"ids": every}).scalar()
        assert sent == {t: 1 for t in every}, sent
        assert failed_runs == 0  # prepared again in the same run: not even a retry
        logs = "".join(system.log(name) for name in ("web", "writes", "reads", "callbacks"))
        assert "Traceback" not in logs, logs[logs.find("Traceback") - 300:][:3000]
        assert "prepared again" in logs  # the processes did meet refused plans
    finally:
        system.stop()
