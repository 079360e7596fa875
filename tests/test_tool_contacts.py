"""search_contacts: the local contacts table with its demo data, the
People API through the real google-api-python-client (``HttpMockSequence`` for the
requests' shape, the ``google_api`` HTTP double end to end through a worker), the
three spoken answers (one, several, none) and the 422s."""
from __future__ import annotations

import json
from urllib.parse import parse_qs, urlsplit

import pytest
from googleapiclient.http import HttpMockSequence
from sqlalchemy import select

from models import db
from models.contacts import Contact
from tasks import tools
from voice_tools_backends import contacts, google
from tests.api_fixtures import snapshot
from tests.conftest import AUTH
from tests.helpers import deliveries, row

TOOL = tools.TOOLS["search_contacts"]
PEOPLE_SEARCH = r"^/v1/people:searchContacts$"


@pytest.fixture
def demo():
    assert contacts.load_demo() == len(contacts.DEMO_CONTACTS)


def run(client, parameters, relay=None, session_id="sess_contacts"):
    """POST /voice-tools/execute?wait=30 (recorded and confirmed at once); the settled record."""
    body = {"session_id": session_id, "function": "search_contacts", "parameters": parameters}
    if relay is not None:
        body["callback_url"] = relay.url
    answer = client.post("/voice-tools/execute?wait=30", headers=AUTH, json=body)
    assert answer.status_code == 200, answer.get_json()
    return answer.get_json()


def people(*entries):
    """A People API searchContacts answer."""
    return {"results": [{"person": p} for p in entries]}


ANN = {"resourceName": "people/c1", "names": [{"displayName": "Ann Lee"}],
       "emailAddresses": [{"value": "ann@old.example.com"},
                          {"value": "ann.lee@contoso.example.com", "metadata": {"primary": True}}],
       "phoneNumbers": [{"value": "+1 503 555 0117"}], "organizations": [{"name": "Contoso Ltd"}]}


# -- local backend ------------------------------------------------------------------------------

def test_demo_contacts_load_once_and_include_the_email_scenario_address(demo):
    assert contacts.load_demo() == 0, "a second load adds nothing (ON CONFLICT on email)"
    with db.session() as s:
        emails = list(s.scalars(select(Contact.email)))
    assert len(emails) == len(contacts.DEMO_CONTACTS) == 12
    assert "john.smith@example.com" in emails
    assert contacts.local_search("john smith") == [
        {"name": "John Smith", "email": "john.smith@example.com", "phone": "+1 206 555 0142",
         "organization": "Northwind Traders"}]


def test_local_search_ranks_exact_then_prefix_names_first_and_matches_email_and_organization(demo):
    with db.session() as s:
        s.add_all([Contact(name="Leeann Brown", email="leeann@example.com"),     # inside a name: last
                   Contact(name="Mary Annett", email="mary@example.com"),        # a word of the name starts with it
                   Contact(name="Ann", email="ann@example.com"),                 # the exact name: first
                   Contact(name="Zoe Quinn", email="zq@annex.example.com")])     # only the email matches
    names = [c["name"] for c in contacts.local_search("ANN", limit=25)]
    assert names == ["Ann", "Ann Lee", "Ann Park", "Annabel Diaz", "Mary Annett", "Leeann Brown", "Zoe Quinn"]
    assert [c["name"] for c in contacts.local_search("ann", limit=2)] == ["Ann", "Ann Lee"]
    # every word must match some field: name and organization together
    assert [c["name"] for c in contacts.local_search("ann contoso")] == ["Ann Lee"]
    assert [c["name"] for c in contacts.local_search("Northwind")] == ["John Smith", "Maria Garcia"]
    assert [c["name"] for c in contacts.local_search("ann.park@example")] == ["Ann Park"]
    # LIKE wildcards in the query are literal characters
    assert contacts.local_search("%") == [] and contacts.local_search("a_n") == []
    assert contacts.local_search("Zed") == []


# -- end to end on the local backend, through the API and a worker ------------------------------

def test_several_contacts_end_to_end_with_callbacks(client, worker, relay, demo):
    body = run(client, {"query": "Ann"}, relay)
    assert body["status"] == "COMPLETED", body
    stored = row(body["tool_call_id"])
    assert stored.parameters == {"query": "Ann", "limit": 5}
    assert stored.result == {"count": 3, "contacts": [
        {"name": "Ann Lee", "email": "ann.lee@example.com", "phone": "+1 503 555 0117", "organization": "Contoso Ltd"},
        {"name": "Ann Park", "email": "ann.park@example.com", "phone": "+1 415 555 0163",
         "organization": "Fabrikam Inc"},
        {"name": "Annabel Diaz", "email": "annabel.diaz@example.com", "phone": "+1 602 555 0188",
         "organization": "Tailspin Toys"}]}
    assert TOOL.result_schema().validate(stored.result) == {}
    assert stored.voice_response == "I found 3 contacts: Ann Lee, Ann Park and Annabel Diaz."
    assert body["result"] == stored.result and body["voice_response"] == stored.voice_response

    completed = relay.wait_for(stored.tool_call_id, "completed")
    assert completed["result"] == stored.result and completed["voice_response"] == stored.voice_response
    events = relay.events_for(stored.tool_call_id)
    assert [(e["event"], e["step"], e["gate"]) for e in events] == [
        ("progress", "SEARCHING", 1), ("completed", "COMPLETED", 2)]
    assert events[0]["message"] == "Looking up Ann in your contacts." and events[0]["cancellable"] is True
    seqs = [d.seq for d in deliveries(stored.tool_call_id)]
    assert [e["seq"] for e in events] == seqs == sorted(set(seqs))
    assert relay.bad_signatures == 0


@pytest.mark.parametrize("query, limit, sentence, count", [
    ("john.smith@example.com", 5, "John Smith's email is john.smith@example.com.", 1),
    ("Ann", 1, "Ann Lee's email is ann.lee@example.com.", 1),
    ("Zed", 5, "I couldn't find a contact named Zed.", 0),
])
def test_one_or_none_found_is_said_and_completed(client, worker, demo, query, limit, sentence, count):
    body = run(client, {"query": query, "limit": limit})
    stored = row(body["tool_call_id"])
    assert stored.status == "COMPLETED", stored.error_message
    assert stored.voice_response == sentence
    assert stored.result["count"] == len(stored.result["contacts"]) == count
    assert stored.error_message is None


@pytest.mark.parametrize("parameters, field", [
    ({"query": ""}, "query"),
    ({"query": "   "}, "query"),
    ({"query": "x" * 201}, "query"),
    ({}, "query"),
    ({"query": "Ann", "limit": 0}, "limit"),
    ({"query": "Ann", "limit": 26}, "limit"),
    ({"query": "Ann", "limit": "many"}, "limit"),
])
def test_bad_parameters_are_422_naming_the_field_and_change_nothing(client, parameters, field):
    before = snapshot()
    answer = client.post("/voice-tools/pending", headers=AUTH, json={
        "session_id": "sess_contacts", "function": "search_contacts", "parameters": parameters})
    assert answer.status_code == 422, answer.get_json()
    body = answer.get_json()
    assert body["error"] and body["message"]
    assert list(body["details"]["fields"]["parameters"]) == [field]
    assert snapshot() == before


# -- People API through google-api-python-client (HttpMockSequence) ------------------------------

def people_service(*answers):
    http = HttpMockSequence([({"status": str(status)}, json.dumps(body)) for status, body in answers])
    return google.build_service("people", "v1", http=http), http


def query_of(uri: str) -> dict[str, list[str]]:
    return parse_qs(urlsplit(uri).query, keep_blank_values=True)


def test_people_search_request_and_answer_mapping():
    svc, http = people_service((200, {}), (200, people(ANN, {"names": [{"displayName": "Ann Park"}],
                                                           "phoneNumbers": [{"value": "+1 415 555 0163"}]})))
    contacts.warm_up(svc)
    found = contacts.google_search(svc, "Ann", 5)
    assert found == [
        {"name": "Ann Lee", "email": "ann.lee@contoso.example.com", "phone": "+1 503 555 0117",
         "organization": "Contoso Ltd"},
        {"name": "Ann Park", "email": None, "phone": "+1 415 555 0163", "organization": None}]
    [(warm_uri, warm_method, warm_body, _), (uri, method, body, _)] = http.request_sequence
    assert (warm_method, urlsplit(warm_uri).path) == ("GET", "/v1/people:searchContacts")
    assert query_of(warm_uri)["query"] == [""], "the warm-up is an empty query"
    assert (method, urlsplit(uri).path, body) == ("GET", "/v1/people:searchContacts", None)
    q = query_of(uri)
    assert q["query"] == ["Ann"] and q["pageSize"] == ["5"]
    assert q["readMask"] == ["names,emailAddresses,phoneNumbers,organizations"]
    assert TOOL.voice_response(TOOL.schema().load({"query": "Ann"}), result={"contacts": found}) == \
        "I found 2 contacts: Ann Lee and Ann Park."
    assert TOOL.voice_response({"query": "Ann Park"}, result={"contacts": found[1:]}) == \
        "Ann Park's phone number is +1 415 555 0163."


@pytest.mark.parametrize("status", [400, 403])
def test_people_refusal_is_refused(status):
    svc, _ = people_service((status, {"error": {"code": status, "message": "The caller does not have permission."}}))
    with pytest.raises(contacts.Refused, match=r"^Google Contacts refused the search \(The caller does not have "
                                               r"permission\)$"):
        contacts.google_search(svc, "Ann", 5)


def test_people_server_error_goes_through_as_transient():
    svc, _ = people_service((503, {"error": {"code": 503, "message": "Backend Error"}}))
    with pytest.raises(google.HttpError) as raised:
        contacts.google_search(svc, "Ann", 5)
    assert tools.is_transient(raised.value)


# -- People API end to end: the worker's real client against the google_api double --------------

def test_google_search_end_to_end(client, worker, google_api):
    google_api.answer("GET", PEOPLE_SEARCH, {})  # the warm-up (once per process and endpoint)
    google_api.answer("GET", PEOPLE_SEARCH, people(ANN))
    body = run(client, {"query": "Ann Lee", "limit": 3})
    stored = row(body["tool_call_id"])
    assert stored.status == "COMPLETED", stored.error_message
    assert stored.result == {"count": 1, "contacts": [
        {"name": "Ann Lee", "email": "ann.lee@contoso.example.com", "phone": "+1 503 555 0117",
         "organization": "Contoso Ltd"}]}
    assert stored.voice_response == "Ann Lee's email is ann.lee@contoso.example.com."
    warm, search = google_api.requests_to("GET", PEOPLE_SEARCH)
    assert warm.query.get("query", [""]) == [""] and warm.query["pageSize"] == ["1"]  # parse_qs drops blanks
    assert search.query["query"] == ["Ann Lee"] and search.query["pageSize"] == ["3"]
    assert search.query["readMask"] == ["names,emailAddresses,phoneNumbers,organizations"]
    assert search.headers["authorization"] == "Bearer test-access-token"
    with db.session() as s:
        assert s.scalars(select(Contact)).all() == [], "the local table was not used"

    # a second search in the same process is not warmed up again
    google_api.answer("GET", PEOPLE_SEARCH, people())
    again = row(run(client, {"query": "Zed"})["tool_call_id"])
    assert again.status == "COMPLETED" and again.voice_response == "I couldn't find a contact named Zed."
    assert len(google_api.requests_to("GET", PEOPLE_SEARCH)) == 3


def test_google_refusal_ends_failed_saying_the_search_did_not_run(client, worker, google_api, relay):
    google_api.answer("GET", PEOPLE_SEARCH, {})
    google_api.answer("GET", PEOPLE_SEARCH, {"error": {"code": 403, "message": "Request had insufficient "
                                                       "authentication scopes."}}, status=403)
    body = run(client, {"query": "Ann"}, relay)
    stored = row(body["tool_call_id"])
    assert stored.status == "FAILED" and body["status"] == "FAILED"
    assert stored.error_message == "Google Contacts refused the search (Request had insufficient authentication scopes)"
    assert stored.voice_response == ("The contact search for Ann did not run: Google Contacts refused the search "
                                     "(Request had insufficient authentication scopes).")
    failed = relay.wait_for(stored.tool_call_id, "failed")
    assert failed["voice_response"] == stored.voice_response and failed["step"] == "SEARCHING"
    assert len(google_api.requests_to("GET", PEOPLE_SEARCH)) == 2, "a refusal is not retried"
