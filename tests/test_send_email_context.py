"""send_email with ``reference_context``: the email carries what the
session's context holds, e.g. the last query's top results, in its draft and in its
checkpoint preview; a context that expired before the call ran fails it before the
point of no return (nothing is sent).

End to end through the in-process worker on the local backends: query_vector_db over
the demo documents stores ``last_query_results``, then send_email draws on it.
"""
from __future__ import annotations

from sqlalchemy import select, text

from models import db, session_context
from models.email import EmailOutbox
from tasks.calls import actions
from voice_tools_backends import documents
from tasks.tools.send_email import MAX_REFERENCED, SNIPPET_CHARS, summarise_context
from tests.helpers import make_call, row, wait_status

SESSION = "sess_ctx"
KEY = "last_query_results"


def load_demo_documents() -> None:
    documents.load_demo()


def outbox(tool_call_id: str) -> list[EmailOutbox]:
    with db.session() as s:
        return list(s.scalars(select(EmailOutbox).where(EmailOutbox.tool_call_id == tool_call_id)))


def search(user_query: str) -> dict:
    call = make_call("query_vector_db", {"user_query": user_query}, session_id=SESSION)
    actions.confirm(call.tool_call_id)
    done = wait_status(call.tool_call_id, timeout=60)
    assert done.status == "COMPLETED", (done.status, done.error_message)
    assert done.result["documents"], "the demo documents answer this query"
    return done.result


def test_the_email_carries_the_last_query_results_in_its_preview_and_its_body(worker, relay):
    load_demo_documents()
    found = search("Q3 sales northwest")
    top = found["documents"][0]

    call = make_call(session_id=SESSION, callback_url=relay.url, parameters={
        "to": "john@example.com", "subject": "Q3 sales", "body": "Hi John, here are the numbers.",
        "reference_context": KEY})
    id_ = call.tool_call_id
    actions.confirm(id_)
    checkpoint = relay.wait_for(id_, "checkpoint", timeout=30)
    body = checkpoint["preview"]["body"]
    intro, results = body.split("\n\n", 1)
    assert intro == "Hi John, here are the numbers."
    lines = results.split("\n")
    assert lines[0] == "Results for 'Q3 sales northwest':"
    assert lines[1].startswith(f"1. {top['title']}: ")
    assert len(lines) - 1 == min(len(found["documents"]), MAX_REFERENCED)
    assert all(len(line) <= len("5. ") + 120 + 2 + SNIPPET_CHARS for line in lines[1:])
    prepared = wait_status(id_, "PREPARED")
    assert prepared.step_outputs["PREPARING"]["body"] == body
    assert prepared.step_outputs["PREPARING"]["reference"]["document_ids"][0] == top["id"]

    # The draft was read once, at PREPARING: the send does not read the context again.
    with db.session() as s:
        s.execute(text("DELETE FROM session_context WHERE session_id = :s"), {"s": SESSION})
    actions.resume(id_)
    done = wait_status(id_, timeout=30)
    assert done.status == "COMPLETED", (done.status, done.error_message)
    [sent] = outbox(id_)
    assert sent.body == body and top["title"] in sent.body


def test_an_expired_context_fails_the_call_before_anything_is_sent(worker, relay):
    with db.session() as s:
        session_context.put_context(s, SESSION, KEY, {"query": "Q3 sales northwest", "documents": []}, 3600, caller="tests")
    call = make_call(session_id=SESSION, callback_url=relay.url, parameters={
        "to": "john@example.com", "subject": "Q3 sales", "reference_context": KEY})
    # It expires between the pending call and its execution.
    with db.session() as s:
        s.execute(text("UPDATE session_context SET expires_at = now() - interval '1 second' "
                       "WHERE session_id = :s"), {"s": SESSION})
    actions.confirm(call.tool_call_id)
    failed = relay.wait_for(call.tool_call_id, "failed", timeout=30)
    done = row(call.tool_call_id)
    assert done.status == "FAILED" and failed["step"] == "PREPARING"
    assert done.error_message == "the referenced results (last_query_results) have expired"
    assert done.voice_response == ("The email to john@example.com was not sent: "
                                   "the referenced results (last_query_results) have expired.")
    assert done.committed_at is None and outbox(call.tool_call_id) == []
    assert [e["event"] for e in relay.events_for(call.tool_call_id)] == ["failed"]


def test_a_search_that_found_nothing_says_so_in_the_email(worker):
    with db.session() as s:
        session_context.put_context(s, SESSION, KEY, {"query": "zebra migration", "documents": []}, 3600, caller="tests")
    call = make_call(session_id=SESSION, parameters={
        "to": "john@example.com", "subject": "Zebras", "reference_context": KEY})
    actions.confirm(call.tool_call_id)
    prepared = wait_status(call.tool_call_id, "PREPARED", timeout=30)
    assert prepared.step_outputs["PREPARING"]["body"] == "Results for 'zebra migration': no matching documents."


def test_summary_keeps_at_most_five_results_each_on_one_line():
    long_snippet = "Northwest region Q3 sales totalled $4.2M\nacross four states; " * 10
    documents_ = [{"id": f"d{n}", "title": f"Report {n}", "snippet": long_snippet} for n in range(1, 8)]
    summary = summarise_context(KEY, {"query": "Q3", "documents": documents_})
    lines = summary.split("\n")
    assert lines[0] == "Results for 'Q3':"
    assert [line.split(":")[0] for line in lines[1:6]] == [f"{n}. Report {n}" for n in range(1, 6)]
    assert lines[6] == "(2 more not shown.)" and len(lines) == 7
    assert all(len(line) <= len("1. Report 1: ") + SNIPPET_CHARS and line.endswith("...") for line in lines[1:6])
    # a context that is not a query's results: its summary
    assert summarise_context("notes", {"summary": "Q3: $4.2M"}) == "From notes: Q3: $4.2M"
