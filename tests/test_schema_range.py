"""Each release knows the schema revisions it runs on, and every process checks (``models/schema.py``).

On a schema older than the release needs, the API answers 503 (REST and MCP, ``/readyz`` saying why)
naming the revision found, the one needed and the command, and a worker consumes nothing; within the
range, or on a newer schema (the next release's migrations expand it), everything runs.
"""
from __future__ import annotations

import re
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
from sqlalchemy import text

from app import mcp_server
from models import db, schema
from tasks.calls.callers import Caller
from tests.conftest import AUTH
from tests.helpers import make_call

ROOT = Path(__file__).resolve().parent.parent


@contextmanager
def database_at(revision: str):
    """The database says it is at ``revision`` (its tables stay this release's), then its own again."""
    with db.session() as s:
        own = s.execute(text("SELECT version_num FROM alembic_version")).scalar()
        s.execute(text("UPDATE alembic_version SET version_num = :r"), {"r": revision})
    try:
        yield own
    finally:
        with db.session() as s:
            s.execute(text("UPDATE alembic_version SET version_num = :r"), {"r": own})


@pytest.fixture
def fresh_gate(monkeypatch):
    """This process as if it had just started (its gate passed long ago, at its first request)."""
    gate = schema.Gate(every_s=0.0)
    monkeypatch.setattr(schema, "GATE", gate)
    return gate


def test_the_release_knows_its_newest_revision_and_the_oldest_it_needs():
    from alembic.script import ScriptDirectory

    from voice_tools.schema_migrations import alembic_config

    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    assert schema.NEWEST == head
    assert int(schema.OLDEST) <= int(schema.NEWEST)
    assert schema.Verdict(head).too_old is False and schema.Verdict(head).newer is False
    old = schema.Verdict("0017")
    assert old.too_old and not old.newer
    assert old.line() == (f"the database schema is at revision 0017; this release needs revision {schema.OLDEST} "
                          "or newer: run `voice-tools migrate` (nothing is served until then)")
    newer = schema.Verdict(f"{int(head) + 1:04d}")
    assert newer.newer and not newer.too_old and "newer than this release knows" in newer.line()
    assert schema.Verdict(None).too_old and "never migrated" in schema.Verdict(None).line()


def test_on_a_schema_too_old_the_api_answers_503_naming_it_and_serves_again_once_migrated(client, fresh_gate,
                                                                                           caplog):
    call = make_call()
    with database_at("0017"):
        refused = client.get(f"/voice-tools/status/{call.tool_call_id}", headers=AUTH)
        assert refused.status_code == 503, refused.get_json()
        assert refused.headers["Retry-After"] == "1"
        body = refused.get_json()
        assert body["error"] == "unavailable"
        assert body["details"] == {"service": "database", "reason": "schema", "retry_after": 1, "found": "0017",
                                   "needed": schema.OLDEST}
        assert "revision 0017" in body["message"] and schema.OLDEST in body["message"]
        assert "voice-tools migrate" in body["message"]
        pending = client.post("/voice-tools/pending", headers=AUTH,
                              json={"session_id": "s_schema", "function": "send_email",
                                    "parameters": {"to": "a@example.com", "subject": "Hi"}})
        assert pending.status_code == 503  # recorded nothing
        with db.session() as s:
            assert s.execute(text("SELECT count(*) FROM tool_calls WHERE session_id = 's_schema'")).scalar() == 0
        assert client.get("/healthz").status_code == 200  # alive: a supervisor must not restart it for this
        ready = client.get("/readyz", headers=AUTH)
        assert ready.status_code == 503
        assert ready.get_json()["details"]["schema"] == {"found": "0017", "needed": schema.OLDEST}
        assert "voice-tools migrate" in ready.get_json()["message"]
        over_mcp = mcp_server.call(mcp_server.FACES_BY_NAME["get_status"], {"tool_call_id": call.tool_call_id},
                                   Caller("tests"))
        assert over_mcp.is_error and over_mcp.meta["voice-tools/http_status"] == 503
        assert over_mcp.structured_content["details"]["found"] == "0017"
    assert [r for r in caplog.records if "this release needs revision" in r.getMessage()], caplog.text
    assert client.get(f"/voice-tools/status/{call.tool_call_id}", headers=AUTH).status_code == 200
    assert client.get("/readyz", headers=AUTH).status_code == 200
    assert fresh_gate.passed


def test_on_a_newer_schema_the_api_serves_and_says_so(client, fresh_gate, caplog):
    newer = f"{int(schema.NEWEST) + 1:04d}"
    call = make_call()
    with database_at(newer):
        assert client.get(f"/voice-tools/status/{call.tool_call_id}", headers=AUTH).status_code == 200
        assert client.get("/readyz", headers=AUTH).status_code == 200
    assert any("newer than this release knows" in r.getMessage() for r in caplog.records), caplog.text


def migrate_command(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "voice_tools", "migrate", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def test_migrate_check_says_what_would_run_and_exits_1_on_a_schema_too_old():
    with database_at("0017") as own:
        checked = migrate_command("--check")
        assert checked.returncode == 1, checked.stdout + checked.stderr
        out = checked.stdout
        assert "revision 0017" in out and "would run 4 migration(s)" in out, out
        assert re.search(r"0020 .*\n\s+NOT safe under the previous release's running processes", out), out
        assert re.search(r"0022 .*\n\s+safe under running processes", out), out
        with db.session() as s:  # it changed nothing
            assert s.execute(text("SELECT version_num FROM alembic_version")).scalar() == "0017"
    checked = migrate_command("--check")
    assert checked.returncode == 0 and "nothing to run" in checked.stdout, checked.stdout
    assert own == schema.NEWEST


def test_migrate_on_a_newer_schema_runs_nothing_and_says_so():
    newer = f"{int(schema.NEWEST) + 1:04d}"
    with database_at(newer):
        migrated = migrate_command()
        assert migrated.returncode == 0, migrated.stderr
        assert "newer than this release knows" in migrated.stdout and "nothing to run" in migrated.stdout
        checked = migrate_command("--check")
        assert checked.returncode == 0 and "newer than this release knows" in checked.stdout
        with db.session() as s:
            assert s.execute(text("SELECT version_num FROM alembic_version")).scalar() == newer


@pytest.mark.slow
def test_a_worker_on_a_schema_too_old_consumes_nothing_until_migrated(tmp_path):
    """A worker of this release started on an older schema (the wrong order: workers before the
    migration) takes no message and logs one line naming the schema; once the database is at a revision
    it runs on, it consumes, and the links queued meanwhile run."""
    from models import lifecycle
    from support.system import System
    from tasks import chains, tools
    from tests.helpers import wait_status

    system = System(tmp_path)
    system.redis.start()
    try:
        with database_at("0017"):
            system.start_process("reads")
            deadline = time.monotonic() + 90
            while "this release needs revision" not in system.log("reads"):
                assert time.monotonic() < deadline, system.log("reads")[-3000:]
                time.sleep(0.3)
            call = make_call("search_contacts", {"query": "john"})
            with db.session() as s:
                assert lifecycle.confirm(s, call.tool_call_id) is not None
            with system.control.connection_for_write() as conn:  # queued behind the waiting worker
                chains.signature(tools.get("search_contacts"), call.tool_call_id).apply_async(connection=conn)
            time.sleep(3)
            with db.session() as s:
                outputs = s.execute(text("SELECT step_outputs FROM tool_calls WHERE tool_call_id = :i"),
                                    {"i": call.tool_call_id}).scalar()
            assert outputs == {}, outputs  # nothing ran
            assert not (system.control.control.ping(timeout=1.0) or []), "consuming: it answers a ping"
        wait_status(call.tool_call_id, "COMPLETED", timeout=60)
        assert system.log("reads").count("this release needs revision") == 1, system.log("reads")[-3000:]
    finally:
        system.stop()
