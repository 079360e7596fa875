"""The tools' data belongs to a caller (docs/promises.md, Callers; docs/relay-guide.md, Tokens and callers).

Each local backend row records its owner (the token name of the call that wrote it, '' for the
shared set every caller sees: the demo data, documents ingested without ``--owner``). A caller
reads its own rows and the shared ones, never another caller's, and no sentence it hears names
another caller's data. Google credentials are per caller where a file is given for the caller
(``VOICE_TOOLS_GOOGLE_CREDENTIALS_DIR``), else the shared file.
"""
from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone

import pytest
from sqlalchemy import select

from models import db
from models.calendar import CalendarEvent
from models.contacts import Contact
from models.email import EmailOutbox
from models.task_list import TodoTask
from models.training import KnowledgeQuestion, Learner, TrainingModule, TrainingProgress
from voice_tools_backends import calendar, contacts, documents, training
from tasks import tools
from tasks.tools import StepInput
from tests.conftest import API_TOKEN, AUTH
from tests.helpers import wait_status
from tests.http_double import HttpDouble

BOB = {"Authorization": "Bearer bob-token"}
UTC = timezone.utc
SECRET = "Secret merger talk with Acme"


@pytest.fixture(autouse=True)
def two_tokens(monkeypatch):
    monkeypatch.setenv("VOICE_TOOLS_API_TOKENS", f"tests:{API_TOKEN},bob:bob-token")


def step(tool_call_id: str, caller: str, parameters: dict, outputs: dict | None = None) -> StepInput:
    return StepInput(tool_call_id=tool_call_id, session_id="sess_owners", parameters=parameters,
                     outputs=outputs or {}, caller=caller)


def ten_tomorrow() -> datetime:
    tomorrow = datetime.now(UTC).date() + timedelta(days=1)
    return datetime(tomorrow.year, tomorrow.month, tomorrow.day, 10, tzinfo=UTC)


# -- calendar: schedule_meeting and get_calendar_availability ----------------------------------

def test_booking_at_the_time_of_another_callers_meeting_books_and_never_names_it(client, worker):
    start = ten_tomorrow().isoformat()

    def book(headers, title):
        answer = client.post("/voice-tools/execute?wait=15", headers=headers, json={
            "session_id": "sess_cal", "function": "schedule_meeting",
            "parameters": {"title": title, "start": start, "duration_minutes": 30, "timezone": "UTC"}})
        assert answer.status_code == 200, answer.get_json()
        tool_call_id = answer.get_json()["tool_call_id"]
        if answer.get_json()["status"] == "PREPARED":
            done = client.post(f"/voice-tools/resume/{tool_call_id}?wait=15", headers=headers,
                               json={"action": "proceed"})
            assert done.status_code == 200, done.get_json()
        return wait_status(tool_call_id)

    ours = book(AUTH, SECRET)
    assert ours.status == "COMPLETED", ours.error_message
    bobs = book(BOB, "Lunch")
    said = json.dumps({"error": bobs.error_message, "voice": bobs.voice_response, "result": bobs.result})
    assert "Secret" not in said and "Acme" not in said
    assert bobs.status == "COMPLETED", bobs.error_message
    with db.session() as s:
        owners = dict(s.execute(select(CalendarEvent.title, CalendarEvent.owner)).all())
    assert owners == {SECRET: "tests", "Lunch": "bob"}


def test_the_conflict_sentence_and_availability_see_only_ones_own_meetings():
    schedule, availability = tools.TOOLS["schedule_meeting"], tools.TOOLS["get_calendar_availability"]
    start = ten_tomorrow()
    meeting = {"title": SECRET, "start": start.isoformat(), "duration_minutes": 30, "timezone": "UTC"}
    checked = schedule.steps[0].run(step("tc_alice_1", "alice", meeting))
    schedule.steps[2].run(step("tc_alice_1", "alice", meeting, {"CHECKING_AVAILABILITY": checked}))

    # alice is told about her own meeting; bob is not told about it
    with pytest.raises(tools.PermanentError, match="Secret merger"):
        schedule.steps[0].run(step("tc_alice_2", "alice", {**meeting, "title": "Lunch"}))
    assert schedule.steps[0].run(step("tc_bob_1", "bob", {**meeting, "title": "Lunch"}))["title"] == "Lunch"

    window = {"start": (start - timedelta(hours=1)).isoformat(), "end": (start + timedelta(hours=2)).isoformat(),
              "timezone": "UTC"}
    planned = availability.steps[0].run(step("tc_bob_2", "bob", window))
    assert availability.steps[1].run(step("tc_bob_2", "bob", window, {"PLANNING": planned}))["busy"] == []
    alices = availability.steps[1].run(step("tc_alice_3", "alice", window, {"PLANNING": planned}))["busy"]
    assert len(alices) == 1


# -- contacts -------------------------------------------------------------------------------------

def test_search_contacts_finds_only_ones_own_and_the_shared_contacts():
    with db.session() as s:
        s.add_all([Contact(name="Sam Secretsource", email="sam@acme.example", owner="alice"),
                   Contact(name="Sam Shared", email="sam@shared.example", owner="")])
    search = tools.TOOLS["search_contacts"].steps[0].run
    assert [c["name"] for c in search(step("tc_a", "alice", {"query": "sam"}))["contacts"]] == \
        ["Sam Secretsource", "Sam Shared"]
    found = search(step("tc_b", "bob", {"query": "sam"}))["contacts"]
    assert [c["name"] for c in found] == ["Sam Shared"]
    voice = tools.TOOLS["search_contacts"].voice_response({"query": "sam"}, {"contacts": found})
    assert "Secretsource" not in voice


def test_two_callers_may_each_have_a_contact_with_the_same_address():
    with db.session() as s:
        s.add_all([Contact(name="Ann of Alice", email="ann@example.com", owner="alice"),
                   Contact(name="Ann of Bob", email="ann@example.com", owner="bob")])
    search = tools.TOOLS["search_contacts"].steps[0].run
    assert [c["name"] for c in search(step("tc_b", "bob", {"query": "ann"}))["contacts"]] == ["Ann of Bob"]


# -- writes: create_task and send_email record their owner ---------------------------------------------

def test_create_task_and_send_email_rows_record_the_callers_name():
    create_task, send_email = tools.TOOLS["create_task"], tools.TOOLS["send_email"]
    draft = create_task.steps[0].run(step("tc_task_b", "bob", {"title": "Call Acme"}))
    create_task.steps[1].run(step("tc_task_b", "bob", {"title": "Call Acme"}, {"PREPARING": draft}))
    email = {"to": "john@example.com", "subject": "Hello"}
    prepared = send_email.steps[0].run(step("tc_mail_a", "alice", email))
    send_email.steps[2].run(step("tc_mail_a", "alice", email, {"PREPARING": prepared}))
    with db.session() as s:
        assert s.execute(select(TodoTask.tool_call_id, TodoTask.owner)).all() == [("tc_task_b", "bob")]
        assert s.execute(select(EmailOutbox.tool_call_id, EmailOutbox.owner)).all() == \
            [("tc_mail_a", "alice")]


# -- training -----------------------------------------------------------------------------------

def alices_training() -> None:
    with db.session() as s:
        s.add(Learner(id="lrn-alice-1", email="zed@acme.example", name="Zed Secret", owner="alice"))
        s.add(TrainingModule(id="acme-merger", title="Acme merger briefing", lesson_count=2, owner="alice"))
        s.flush()
        s.add(TrainingProgress(learner_id="lrn-alice-1", module_id="acme-merger", lessons_completed=1,
                               status="in_progress"))
        s.add(KnowledgeQuestion(module_id="acme-merger", number=1, question="Who buys whom?",
                                choices=["Acme buys us", "We buy Acme"], answer="B"))


def test_get_training_progress_does_not_find_another_callers_learner():
    alices_training()
    tool = tools.TOOLS["get_training_progress"]
    params = {"learner": "zed@acme.example"}
    assert tool.steps[0].run(step("tc_a", "alice", params))["learner"]["name"] == "Zed Secret"
    found = tool.steps[0].run(step("tc_b", "bob", params))
    assert found["learner"] is None
    progress = tool.steps[1].run(step("tc_b", "bob", params, {"FINDING_LEARNER": found}))
    said = tool.voice_response(params, tool.result({"FINDING_LEARNER": found, "READING_PROGRESS": progress}))
    assert "Zed" not in said and "merger" not in said.lower()


def test_knowledge_check_does_not_find_another_callers_module():
    alices_training()
    tool = tools.TOOLS["knowledge_check"]
    params = {"module": "Acme merger briefing"}
    assert tool.steps[0].run(step("tc_a", "alice", params))["questions"][0]["question"] == "Who buys whom?"
    loaded = tool.steps[0].run(step("tc_b", "bob", params))
    assert loaded["module"] is None and loaded["questions"] == []
    assert training.find_module("acme-merger", caller="bob") is None
    assert training.questions("acme-merger", caller="bob") == []


# -- documents ------------------------------------------------------------------------------------

def test_documents_ingested_for_a_caller_are_found_by_that_caller_only(tmp_path):
    memo = tmp_path / "merger-memo.md"
    memo.write_text("# Acme merger memo\n\nThe secret merger with Acme closes in March at forty million.\n")
    documents.ingest([str(memo)], owner="alice")
    question = {"query": "When does the Acme merger close?"}
    search = tools.TOOLS["search_documentation"]
    for who, expected in (("alice", ["Acme merger memo"]), ("bob", [])):
        understood = search.steps[0].run(step(f"tc_{who}", who, question))
        found = search.steps[1].run(step(f"tc_{who}", who, question, {"QUERYING": understood}))
        assert [d["title"] for d in found["documents"]] == expected, who
    query_tool = tools.TOOLS["query_vector_db"]
    asked = {"user_query": "When does the Acme merger close?"}
    planned = query_tool.steps[0].run(step("tc_q_bob", "bob", asked))
    found = query_tool.steps[1].run(step("tc_q_bob", "bob", asked, {"QUERYING": planned}))
    assert found["documents"] == [] and "merger" not in found["summary"].lower()


def test_the_same_file_ingested_for_two_callers_is_two_documents(tmp_path):
    memo = tmp_path / "notes.md"
    memo.write_text("# Notes\n\nAlice's notes about the quarterly plan.\n")
    documents.ingest([str(memo)], owner="alice")
    memo.write_text("# Notes\n\nBob's notes about the quarterly plan.\n")
    documents.ingest([str(memo)], owner="bob")
    assert [d["snippet"] for d in documents.search("quarterly plan notes", caller="alice")] == \
        ["Alice's notes about the quarterly plan."]
    assert [d["snippet"] for d in documents.search("quarterly plan notes", caller="bob")] == \
        ["Bob's notes about the quarterly plan."]


def test_voice_tools_ingest_owner_stores_a_callers_documents_and_without_it_shared_ones(tmp_path, capsys):
    from models.documents import DocumentChunk
    from voice_tools import launcher

    (tmp_path / "own.md").write_text("# Own\n\nAlice's own notes.\n")
    (tmp_path / "shared.md").write_text("# Shared\n\nEveryone's notes.\n")
    assert launcher.main(["ingest", "--owner", "alice", str(tmp_path / "own.md")]) == 0
    assert launcher.main(["ingest", str(tmp_path / "shared.md")]) == 0
    with db.session() as s:
        assert dict(s.execute(select(DocumentChunk.title, DocumentChunk.owner)).all()) == \
            {"Own": "alice", "Shared": ""}


# -- Google credentials per caller ---------------------------------------------------------------------

def authorized_user(path, token: str) -> str:
    expiry = (datetime.now(UTC) + timedelta(hours=1)).strftime("%Y-%m-%dT%H:%M:%SZ")
    path.write_text(json.dumps({"type": "authorized_user", "client_id": "c.apps.googleusercontent.com",
                                "client_secret": "s", "refresh_token": "r", "token": token, "expiry": expiry}))
    return str(path)


def test_each_caller_with_a_credentials_file_uses_its_own_and_the_others_the_shared_one(tmp_path, monkeypatch):
    folder = tmp_path / "callers"
    folder.mkdir()
    authorized_user(folder / "alice.json", "alice-access-token")
    shared = authorized_user(tmp_path / "shared.json", "shared-access-token")
    with HttpDouble() as api:
        monkeypatch.setenv("VOICE_TOOLS_GOOGLE_CREDENTIALS", shared)
        monkeypatch.setenv("VOICE_TOOLS_GOOGLE_CREDENTIALS_DIR", str(folder))
        monkeypatch.setenv("VOICE_TOOLS_GOOGLE_API_ENDPOINT", api.url + "/")
        monkeypatch.setenv("VOICE_TOOLS_GOOGLE_SERVICES", "calendar,people")
        api.answer("POST", r"/freeBusy$",
                   {"calendars": {"primary": {"busy": []}}}, times=None)
        api.answer("GET", r"/v1/people:searchContacts$", {}, times=None)
        start = ten_tomorrow()
        for who in ("alice", "bob", "alice"):
            assert calendar.busy(start, start + timedelta(hours=1), caller=who) == []
            assert contacts.search("ann", caller=who) == []
        tokens = [r.headers["authorization"] for r in api.requests_to("POST", r"/freeBusy$")]
        searches = [r.headers["authorization"] for r in api.requests_to("GET", r"/v1/people:searchContacts$")
                    if r.query.get("query") == ["ann"]]
    assert tokens == searches == ["Bearer alice-access-token", "Bearer shared-access-token",
                                  "Bearer alice-access-token"]


def test_a_caller_name_that_is_not_a_plain_file_name_uses_the_shared_credentials(tmp_path, monkeypatch):
    from voice_tools_backends import google

    folder = tmp_path / "callers"
    folder.mkdir()
    authorized_user(tmp_path / "secret.json", "outside-token")
    monkeypatch.setenv("VOICE_TOOLS_GOOGLE_CREDENTIALS", "/shared.json")
    monkeypatch.setenv("VOICE_TOOLS_GOOGLE_CREDENTIALS_DIR", str(folder))
    assert google.credentials_file("../secret") == "/shared.json"
    assert google.credentials_file(".hidden") == "/shared.json"
    assert google.credentials_file("") == "/shared.json"


# -- the schema --------------------------------------------------------------------------------------

OWNED = ("calendar_events", "contacts", "todo_tasks", "email_outbox", "documents", "learners", "training_modules")


def test_the_migration_gives_every_owned_table_its_owner_and_the_reads_an_index_leading_with_it():
    from alembic.autogenerate import compare_metadata
    from alembic.migration import MigrationContext
    from sqlalchemy import text

    from models.calls import Base

    with db.engine().connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn, opts={"compare_type": True}), Base.metadata)
        columns = dict(conn.execute(text(
            "SELECT table_name, column_default FROM information_schema.columns "
            "WHERE column_name = 'owner' AND is_nullable = 'NO'")).all())
        indexes = {r.indexname: r.indexdef for r in conn.execute(text(
            f"SELECT indexname, indexdef FROM pg_indexes WHERE tablename IN {OWNED!r}"))}
    touched = [d for d in diff if isinstance(d, tuple) and any(
        getattr(x, "name", None) in OWNED or getattr(getattr(x, "table", None), "name", None) in OWNED for x in d)]
    assert touched == [], touched
    assert set(columns) == set(OWNED) and all(d.startswith("''") for d in columns.values()), columns
    assert "(owner, starts_at, ends_at)" in indexes["idx_calendar_events_owner_span"]
    assert "(owner, email)" in indexes["uq_contacts_owner_email"]
    assert "(owner, id)" in indexes["documents_pkey"]
    assert "(owner, document_id)" in indexes["ix_documents_owner_document_id"]
    assert "UNIQUE" in indexes["uq_learners_owner_email_lower"]
    for name in ("ix_todo_tasks_owner", "ix_email_outbox_owner", "ix_training_modules_owner"):
        assert "(owner)" in indexes[name]


@pytest.mark.slow
def test_rows_stored_before_the_migration_become_shared_and_its_downgrade_keeps_one_row_per_address():
    """Down to 0010 (two owners' contacts with one address become one row, the shared one) and up again
    (a contact stored without an owner is shared)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from sqlalchemy import text

    def alembic(*args: str) -> None:
        done = subprocess.run([sys.executable, "-m", "alembic", *args], cwd=Path(__file__).resolve().parents[1],
                              env=dict(os.environ), capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr

    with db.session() as s:
        s.add_all([Contact(name="Ann Shared", email="ann@example.com", owner=""),
                   Contact(name="Ann of Alice", email="ann@example.com", owner="alice")])
    db.dispose()  # no pooled connection of ours in the way of ALTER TABLE
    alembic("downgrade", "0010")
    with db.engine().begin() as conn:
        assert conn.execute(text("SELECT name FROM contacts")).scalars().all() == ["Ann Shared"]
        conn.execute(text("INSERT INTO contacts (name, email) VALUES ('Old Row', 'old@example.com')"))
    db.dispose()
    alembic("upgrade", "head")
    with db.engine().connect() as conn:
        assert dict(conn.execute(text("SELECT name, owner FROM contacts")).all()) == \
            {"Ann Shared": "", "Old Row": ""}
