"""create_task: the local ``todo_tasks`` table, Google Tasks
through the real google-api-python-client (``HttpMockSequence`` for the requests'
shape, the ``google_api`` HTTP double end to end through a worker), idempotency on
``tool_call_id`` (the marker found on redelivery: no second insert), a 503 whose task never
shows ending unconfirmed (never inserted again), a refusal ending FAILED with "was not created",
the 422s, and a pool child SIGKILLed inside the side effect (no second task)."""
from __future__ import annotations

import json
from datetime import date, datetime, timezone
from urllib.parse import parse_qs, unquote, urlsplit

import pytest
from googleapiclient.http import HttpMockSequence
from sqlalchemy import func, select, text

from models import db
from models.task_list import TodoTask
from tasks import app, tools
from tasks.calls import actions
from voice_tools_backends import google, task_list
from tests.api_fixtures import created_id, snapshot
from tests.conftest import AUTH
from tests.helpers import make_call, row, wait_status

TOOL = tools.TOOLS["create_task"]
TASKS = r"^/tasks/v1/lists/[^/]+/tasks$"
PRINTER = {"title": "Call the printer", "notes": "Ask about the brochure proofs.", "due": "2026-11-27",
           "priority": "high"}
DRAFT = dict(PRINTER)


def run(client, parameters, relay=None, session_id="sess_tasks"):
    """POST /voice-tools/execute?wait=30 (recorded and confirmed at once); the settled record."""
    body = {"session_id": session_id, "function": "create_task", "parameters": parameters}
    if relay is not None:
        body["callback_url"] = relay.url
    answer = client.post("/voice-tools/execute?wait=30", headers=AUTH, json=body)
    assert answer.status_code == 200, answer.get_json()
    return answer.get_json()


def todo_rows() -> list[TodoTask]:
    with db.session() as s:
        return list(s.scalars(select(TodoTask).order_by(TodoTask.created_at)))


def expected_voice(title: str, due: str) -> str:
    day = date.fromisoformat(due)
    said = f"{day:%A} {day:%B} {day.day}" + ("" if day.year == date.today().year else f", {day.year}")
    return f"Added '{title}' to your tasks, due {said}."


# -- local backend, end to end through the API and a worker -------------------------------------

def test_local_task_end_to_end_with_callbacks(client, worker, relay):
    body = run(client, PRINTER, relay)
    assert body["status"] == "COMPLETED", body
    stored = row(body["tool_call_id"])
    [task] = todo_rows()
    assert (task.tool_call_id, task.title, task.notes, task.due, task.priority, task.status) == (
        stored.tool_call_id, "Call the printer", "Ask about the brochure proofs.", date(2026, 11, 27), "high",
        "needsAction")
    assert stored.result == {"task_id": task.id, "title": "Call the printer", "due": "2026-11-27",
                             "priority": "high", "web_link": None}
    assert task.id == task_list.task_id_for(stored.tool_call_id)
    assert TOOL.result_schema().validate(stored.result) == {}
    assert stored.voice_response == expected_voice("Call the printer", "2026-11-27")
    if date.today().year == 2026:
        assert stored.voice_response == "Added 'Call the printer' to your tasks, due Friday November 27."
    assert stored.committed_at is not None and stored.current_step == "COMPLETED"

    completed = relay.wait_for(stored.tool_call_id, "completed")
    assert completed["result"] == stored.result and completed["voice_response"] == stored.voice_response
    events = relay.events_for(stored.tool_call_id)
    assert [(e["event"], e["step"], e["gate"], e["cancellable"]) for e in events] == [
        ("progress", "PREPARING", 1, True), ("progress", "CREATING", 2, False), ("completed", "COMPLETED", 3, False)]
    assert events[1]["message"] == "Adding 'Call the printer' to your tasks."
    assert relay.bad_signatures == 0


def test_defaults_and_a_task_without_due_date(client, worker):
    body = run(client, {"title": "Water the plants"})
    stored = row(body["tool_call_id"])
    assert stored.status == "COMPLETED", stored.error_message
    assert stored.parameters == {"title": "Water the plants", "notes": "", "priority": "medium"}
    assert stored.result["due"] is None and stored.result["priority"] == "medium"
    assert stored.voice_response == "Added 'Water the plants' to your tasks."
    [task] = todo_rows()
    assert (task.due, task.priority, task.notes) == (None, "medium", "")


def test_confirmation_and_modify_sentences(client):
    answer = client.post("/voice-tools/pending", headers=AUTH, json={
        "session_id": "sess_tasks", "function": "create_task", "parameters": {"title": "Call the printer"}})
    assert answer.status_code == 201
    assert answer.get_json()["message"] == "Ready to add 'Call the printer' to your tasks. Confirm to proceed."
    tool_call_id = answer.get_json()["tool_call_id"]
    modified = client.patch(f"/voice-tools/modify/{tool_call_id}", headers=AUTH,
                            json={"parameters": {"due": "2027-01-08"}})
    assert modified.status_code == 200, modified.get_json()
    said = "Friday January 8" + ("" if date.today().year == 2027 else ", 2027")
    assert modified.get_json()["message"] == f"Updated the task to 'Call the printer', due {said}. Confirm?"
    assert row(tool_call_id).parameters["due"] == "2027-01-08"


def test_local_create_is_idempotent_on_tool_call_id():
    first = task_list.local_create("tc_same", DRAFT)
    again = task_list.local_create("tc_same", {**DRAFT, "title": "Something else"})
    assert again == first and first["title"] == "Call the printer"
    assert len(todo_rows()) == 1


@pytest.mark.parametrize("parameters, field", [
    ({**PRINTER, "priority": "urgent"}, "priority"),
    ({**PRINTER, "due": "2026-02-30"}, "due"),
    ({**PRINTER, "due": "next friday"}, "due"),
    ({**PRINTER, "due": "2026-11-27T10:00:00"}, "due"),
    ({**PRINTER, "title": ""}, "title"),
    ({**PRINTER, "title": " \t"}, "title"),
    ({"notes": "no title"}, "title"),
])
def test_bad_parameters_are_422_naming_the_field_and_change_nothing(client, parameters, field):
    before = snapshot()
    answer = client.post("/voice-tools/pending", headers=AUTH, json={
        "session_id": "sess_tasks", "function": "create_task", "parameters": parameters})
    assert answer.status_code == 422, answer.get_json()
    assert list(answer.get_json()["details"]["fields"]["parameters"]) == [field]
    assert snapshot() == before


def test_modify_to_a_bad_priority_is_422_and_changes_nothing(client):
    tool_call_id = created_id(client, function="create_task", parameters=dict(PRINTER))
    before = snapshot()
    answer = client.patch(f"/voice-tools/modify/{tool_call_id}", headers=AUTH,
                          json={"parameters": {"priority": "asap"}})
    assert answer.status_code == 422, answer.get_json()
    assert "priority" in answer.get_json()["details"]["fields"]["parameters"]
    assert snapshot() == before


# -- Google Tasks through google-api-python-client (HttpMockSequence) ---------------------------

NOW = datetime(2026, 11, 23, 19, 0, tzinfo=timezone.utc)


def tasks_service(*answers):
    http = HttpMockSequence([({"status": str(status)}, json.dumps(body)) for status, body in answers])
    return google.build_service("tasks", "v1", http=http), http


def test_google_lists_for_the_marker_then_inserts_with_marker_priority_and_due():
    created = {"id": "T1", "title": "Call the printer", "webViewLink": "https://tasks.google.com/task/T1"}
    other = {"id": "T0", "title": "Old", "notes": "Priority: low\n\nvoice-tools:tc_other"}
    svc, http = tasks_service((200, {"items": [other], "nextPageToken": "p2"}), (200, {"items": []}), (200, created))
    result = task_list.google_create(svc, "tc_printer", DRAFT, "@default", now=NOW)
    assert result == {"task_id": "T1", "title": "Call the printer", "due": "2026-11-27", "priority": "high",
                      "web_link": "https://tasks.google.com/task/T1"}
    (list1, m1, _, _), (list2, m2, _, _), (insert_uri, m3, body, _) = http.request_sequence
    assert (m1, m2, m3) == ("GET", "GET", "POST")
    for uri in (list1, list2, insert_uri):
        assert unquote(urlsplit(uri).path) == "/tasks/v1/lists/@default/tasks"
    q = parse_qs(urlsplit(list1).query)
    assert (q["showCompleted"], q["showHidden"], q["maxResults"]) == (["true"], ["true"], ["100"])
    assert q["updatedMin"] == ["2026-11-22T19:00:00.000Z"], "a day back"
    assert parse_qs(urlsplit(list2).query)["pageToken"] == ["p2"], "every page is searched"
    sent = json.loads(body)
    assert sent == {"title": "Call the printer", "due": "2026-11-27T00:00:00.000Z",
                    "notes": "Priority: high\n\nAsk about the brochure proofs.\n\nvoice-tools:tc_printer"}
    assert sent["notes"].splitlines()[0] == "Priority: high"
    assert sent["notes"].splitlines()[-1] == task_list.marker_for("tc_printer")


def test_google_redelivery_finds_the_marker_and_never_inserts_twice():
    mine = {"id": "T1", "title": "Call the printer", "status": "needsAction", "webViewLink": "https://t/T1",
            "notes": task_list.google_notes("tc_printer", DRAFT)}
    svc, http = tasks_service((200, {"items": [{"id": "T0", "title": "x"}, mine]}))
    assert task_list.google_create(svc, "tc_printer", DRAFT, "work-list", now=NOW) == {
        "task_id": "T1", "title": "Call the printer", "due": "2026-11-27", "priority": "high",
        "web_link": "https://t/T1"}
    assert [(method, unquote(urlsplit(uri).path)) for uri, method, _, _ in http.request_sequence] == [
        ("GET", "/tasks/v1/lists/work-list/tasks")], "no insert"


def test_google_marker_must_be_a_whole_line():
    """``tc_printer`` must not match the task of ``tc_printer2``."""
    svc, http = tasks_service((200, {"items": [{"id": "T9", "notes": "voice-tools:tc_printer2"}]}), (200, {"id": "T1"}))
    assert task_list.google_create(svc, "tc_printer", DRAFT, now=NOW)["task_id"] == "T1"
    assert [m for _, m, _, _ in http.request_sequence] == ["GET", "POST"]


@pytest.mark.parametrize("answers, message", [
    ([(200, {}), (400, {"error": {"code": 400, "message": "Invalid task."}})],
     r"^Google Tasks refused it \(Invalid task\)$"),
    ([(403, {"error": {"code": 403, "message": "Insufficient Permission"}})],
     r"^Google Tasks refused it \(Insufficient Permission\)$"),
    ([(404, {"error": {"code": 404, "message": "Not Found"}})], r"^the task list @default was not found$"),
])
def test_google_refusals_are_refused(answers, message):
    svc, http = tasks_service(*answers)
    with pytest.raises(task_list.Refused, match=message):
        task_list.google_create(svc, "tc_printer", DRAFT, now=NOW)
    assert len(http.request_sequence) == len(answers)


# -- Google Tasks end to end: the worker's real client against the google_api double ------------

@pytest.mark.slow
def test_google_a_503_whose_task_never_shows_is_unconfirmed_never_inserted_again(client, worker, google_api,
                                                                                  monkeypatch):
    """The insert answers 503 (it may have added the task) and the list keeps answering without it: a
    list may lag by any time, so the call says it cannot tell, and never inserts a second time."""
    monkeypatch.setenv("VOICE_TOOLS_GOOGLE_TASKLIST", "work-list")
    monkeypatch.setenv("VOICE_TOOLS_GOOGLE_CONFIRM_WAIT", "1")
    google_api.answer("GET", TASKS, {"items": []}, times=None)
    google_api.answer("POST", TASKS, {"error": {"code": 503, "message": "Backend Error"}}, status=503, times=None)
    body = run(client, PRINTER)
    stored = row(body["tool_call_id"])
    assert stored.status == "FAILED" and stored.outcome == "unconfirmed", stored.error_message
    assert stored.result is None
    assert stored.voice_response == ("I could not confirm that the task 'Call the printer' was created. "
                                     "Please check your task list before trying again.")
    assert stored.error_message == "Google Tasks did not show whether the task was added"
    inserts = google_api.requests_to("POST", TASKS)
    assert len(inserts) == 1, "the insert whose answer was lost is never sent again"
    assert unquote(inserts[0].path) == "/tasks/v1/lists/work-list/tasks"
    assert inserts[0].json == {"title": "Call the printer", "due": "2026-11-27T00:00:00.000Z",
                               "notes": "Priority: high\n\nAsk about the brochure proofs.\n\n"
                                        f"voice-tools:{stored.tool_call_id}"}
    at = {id(r): n for n, r in enumerate(google_api.requests)}  # each request's place in the exchange
    looks = [at[id(r)] for r in google_api.requests_to("GET", TASKS)]
    the_insert = at[id(inserts[0])]
    assert looks[0] < the_insert, "the attempt looked for its marker first"
    assert len([n for n in looks if n > the_insert]) >= 3, "after the 503 the list was asked again for the confirm wait"
    assert stored.effect_attempts == 1, "no second attempt at the effect"
    assert todo_rows() == [], "the local table was not used"


def test_google_redelivered_link_finds_its_task_and_does_not_insert(client, worker, google_api):
    """As after a worker died between Google's insert and the link's record: the task is in the list."""
    call = make_call("create_task", dict(PRINTER), session_id="sess_tasks")
    existing = {"id": "G7", "title": "Call the printer", "webViewLink": "https://tasks.google.com/task/G7",
                "notes": task_list.google_notes(call.tool_call_id, DRAFT)}
    google_api.answer("GET", TASKS, {"items": [existing]}, times=None)
    actions.confirm(call.tool_call_id)
    done = wait_status(call.tool_call_id)
    assert done.status == "COMPLETED", done.error_message
    assert done.result["task_id"] == "G7" and done.result["web_link"] == "https://tasks.google.com/task/G7"
    assert google_api.requests_to("POST", TASKS) == []


@pytest.mark.parametrize("status, reason", [(400, "Invalid value for due"), (403, "Insufficient Permission")])
def test_google_refusal_ends_failed_saying_the_task_was_not_created(client, worker, google_api, relay, status, reason):
    google_api.answer("GET", TASKS, {"items": []}, times=None)
    google_api.answer("POST", TASKS, {"error": {"code": status, "message": reason}}, status=status, times=None)
    body = run(client, PRINTER, relay)
    stored = row(body["tool_call_id"])
    assert stored.status == "FAILED" and body["status"] == "FAILED"
    assert stored.voice_response == f"The task 'Call the printer' was not created: Google Tasks refused it ({reason})."
    assert stored.error_message == f"Google Tasks refused it ({reason})"
    failed = relay.wait_for(stored.tool_call_id, "failed")
    assert failed["voice_response"] == stored.voice_response and failed["step"] == "CREATING"
    assert len(google_api.requests_to("POST", TASKS)) == 1, "a refusal is not retried"
    assert todo_rows() == []


# -- a pool child SIGKILLed inside the side effect (model: tests/test_worker_loss.py) ------------

QUEUE = "tools.create_task"
CREATING = "tools.create_task.CREATING"


def todo_inserts_waiting() -> int:
    with db.engine().connect() as conn:
        return conn.scalar(text(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND pid <> pg_backend_pid() AND wait_event_type = 'Lock' AND query ILIKE 'INSERT INTO todo_tasks%'"))


@pytest.mark.slow
def test_prefork_child_killed_inside_creating_adds_exactly_one_task(tmp_path):
    import psutil

    from tests.test_worker_loss import wait_until
    from support.worker_process import WorkerProcess, queues_taken_from_others

    with queues_taken_from_others(app, [QUEUE]), \
            WorkerProcess(app, [QUEUE], pool="prefork", concurrency=2, log_dir=tmp_path, name="task-loss") as worker:
        call = make_call("create_task", dict(PRINTER), session_id="sess_task_loss")
        tool_call_id = call.tool_call_id
        # An uncommitted row with the call's tool_call_id: the link's INSERT (the side effect) waits on it.
        with db.engine().connect() as conn:
            held = conn.begin()
            conn.execute(text("INSERT INTO todo_tasks (id, tool_call_id, title, priority) "
                              "VALUES ('held-by-test', :id, 'held', 'low')"), {"id": tool_call_id})
            try:
                actions.confirm(tool_call_id)
                first = worker.wait_active(CREATING, [tool_call_id])
                wait_until(lambda: todo_inserts_waiting() >= 1, "the CREATING link's INSERT to wait on the held row")
                inside = row(tool_call_id)
                assert inside.status == "EXECUTING" and inside.current_step == "CREATING"
                assert inside.committed_at is not None, "the link is past the point of no return"
                worker.kill_child(first["worker_pid"])
                again = worker.wait_active(CREATING, [tool_call_id], not_pid=first["worker_pid"], timeout=60)
                assert again["id"] == first["id"], "the same message, delivered again"
                assert not psutil.pid_exists(first["worker_pid"]) or \
                    psutil.Process(first["worker_pid"]).status() == psutil.STATUS_ZOMBIE
            finally:
                held.rollback()
        done = wait_status(tool_call_id, timeout=60)
        assert done.status == "COMPLETED", (done.status, done.error_message)
        with db.session() as s:
            assert s.scalar(select(func.count()).select_from(TodoTask)) == 1
            task = s.scalars(select(TodoTask)).one()
        assert task.tool_call_id == tool_call_id and task.id == done.result["task_id"] != "held-by-test"
        assert done.attempts == len(TOOL.steps) + 1, "CREATING claimed twice, everything else once"
        assert "signal 9 (SIGKILL)" in worker.log()
