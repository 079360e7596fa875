"""schemathesis against the app's own /openapi.json: the document and the server agree.

The engine of the ``schemathesis run`` command, driven from here against the Procfile's
web line (real gunicorn, this run's database and broker, a worker for the calls it
starts), with every check and the phases examples, coverage, fuzzing and stateful; a
fixed seed, deterministic generation and a bounded number of examples per operation.

Every failure fails the test, with one exception: a 422 to a request the document
allows (``positive_data_acceptance``) is let through when every field it names is
refused by a rule the document states in words because a schema cannot say it
(``app.openapi.RULES``), each listed in :data:`STATED_IN_WORDS`. Anything else refused,
any 5xx, any answer off its response schema, any undocumented status or content type
fails. The callback URLs schemathesis generates are pointed at the test's relay (a host
VOICE_TOOLS_CALLBACK_HOSTS lists) so its calls run; the coverage phase takes no hooks,
and its URLs are the refusals by the allow-list (configuration) that remain.
"""
from __future__ import annotations

import json
import re
import time
from collections import Counter
from typing import Any, Callable

import pytest
import schemathesis
from schemathesis.config import SchemathesisConfig
from schemathesis.engine import Status, events, from_schema
from sqlalchemy import text

from models import db

from tests.conftest import AUTH
from tests.web_server import gunicorn_web

pytestmark = pytest.mark.slow  # gunicorn and schemathesis's generated requests

SEED = 20261124
MAX_EXAMPLES = 10
FREE_FORM = re.compile(r"(^|\.)filters(\.|$)")  # query_vector_db's structured_query.filters: any JSON object

# (why, test on (operation label, field path, message)): a refusal the document states in words
STATED_IN_WORDS: list[tuple[str, Callable[[str, str, str], bool]]] = [
    ("callback host not in VOICE_TOOLS_CALLBACK_HOSTS (configuration)",
     lambda op, path, msg: "VOICE_TOOLS_CALLBACK_HOSTS" in msg),
    ("reference_context names no stored session context (data)", lambda op, path, msg: msg.startswith("No context ")),
    ("last_event_id names no event of the session (data)", lambda op, path, msg: msg.startswith("No event ")),
    ("modify's parameters are the stored call's tool's (data)",
     lambda op, path, msg: "/modify/" in op and path.startswith("parameters")),
    ("field names of free-form objects (OpenAPI 3.0 has no propertyNames)",
     lambda op, path, msg: msg.startswith("Field names must not hold")),
    ("dates, times and time zones of tool parameters are readable (ISO 8601, IANA)",
     lambda op, path, msg: msg.startswith(("Not a valid date", "Not an ISO 8601", "Not a known time zone"))),
    ("strings inside a free-form object", lambda op, path, msg: msg.startswith("Must not hold") and
     bool(FREE_FORM.search(path))),
]


def config(url: str) -> SchemathesisConfig:
    return SchemathesisConfig.from_dict({
        "seed": SEED,
        "base-url": url,
        "continue-on-failure": True,
        "request-timeout": 35,  # ?wait= holds an answer up to 30 s (schemathesis' default is 10)
        "headers": dict(AUTH),
        "generation": {"max-examples": MAX_EXAMPLES, "deterministic": True, "database": "none"},
        # error-feedback: 4.32 reads our 422 envelope {error, message, details: {fields}} as a marshmallow
        # one and takes `details` for a request field, then sends it where the schema forbids it
        "phases": {"stateful": {"enabled": True, "max-steps": 20},
                   "fuzzing": {"error-feedback": {"enabled": False}}},
        "checks": {"enabled": True},
        "operations": [
            # an event stream never ends: read one event, or a quarter of a second of it
            {"include-path": "/voice-tools/events/{session_id}", "request-timeout": 0.25, "max-stream-events": 1},
            # the coverage phase's boundary values of PendingRequest's nine variants are thousands of
            # requests; the other phases cover these two operations
            {"include-path-regex": "/voice-tools/(pending|execute)$", "phases": {"coverage": {"enabled": False}}},
            # the /webhook aliases are the same views, documented alike (test_aliases_are_documented_alike)
            {"include-path-regex": "^/webhook/", "enabled": False},
        ],
    })


def leaves(fields: Any, prefix: str = "") -> list[tuple[str, str]]:
    """``details.fields`` of a 422 as (path, message) pairs."""
    if isinstance(fields, dict):
        return [leaf for key, sub in fields.items() for leaf in leaves(sub, f"{prefix}{key}.")]
    if isinstance(fields, list) and fields and all(isinstance(m, str) for m in fields):
        return [(prefix.rstrip("."), message) for message in fields]
    if isinstance(fields, list):
        return [leaf for i, sub in enumerate(fields) for leaf in leaves(sub, f"{prefix}{i}.")]
    return [(prefix.rstrip("."), str(fields))]


def stated_in_words(label: str, status: int, content: bytes) -> list[str] | None:
    """The rules (STATED_IN_WORDS) a refusal is explained by; None if any field it names is not."""
    if status != 422:
        return None
    try:
        fields = json.loads(content)["details"]["fields"]
    except (ValueError, KeyError, TypeError):
        return None
    reasons = []
    for path, message in leaves(fields):
        why = next((why for why, test in STATED_IN_WORDS if test(label, path, message)), None)
        if why is None:
            return None
        reasons.append(why)
    return reasons or None


def findings(event: events.ScenarioFinished, tolerated: Counter) -> list[str]:
    found = []
    recorder = event.recorder
    for case_id, checks in recorder.checks.items():
        for check in checks:
            if check.status != Status.FAILURE:
                continue
            response = recorder.find_response(case_id=case_id)
            info = check.failure_info
            if check.name == "positive_data_acceptance" and response is not None:
                reasons = stated_in_words(info.failure.operation or recorder.label, response.status_code,
                                          response.content)
                if reasons:
                    tolerated.update(f"{event.phase}: {why}" for why in reasons)
                    continue
            answer = f"{response.status_code} {response.content[:500]!r}" if response else "no response"
            found.append(f"{recorder.label} {check.name}: {info.failure.title}: {info.failure.message[:300]}\n"
                         f"    {info.code_sample[:600]}\n    => {answer}")
    return found


# what the document allows for a callback URL (schemas.CallbackUrl): anything else is a negative case
DOCUMENTED_URL = re.compile(r"https?://[^/?#\x00-\x20]+[^\x00-\x08\x0b\x0c\x0e-\x1f]*")


def _relayed(url: Any, relay_url: str) -> Any:
    """The relay's URL in place of a URL the document allows; a negative case (a value of another type,
    too long, not a URL) stays as it is, to be refused."""
    if isinstance(url, str) and len(url) <= 2000 and DOCUMENTED_URL.fullmatch(url):
        return relay_url
    return url


def to_relay(body: Any, relay_url: str) -> Any:
    """``body`` with every callback URL pointing at the test's relay (the host VOICE_TOOLS_CALLBACK_HOSTS
    lists), so the calls schemathesis makes get past the allow-list and run."""
    if isinstance(body, dict):
        if "callback_url" in body:
            body["callback_url"] = _relayed(body["callback_url"], relay_url)
        if isinstance(body.get("callback_urls"), dict):
            body["callback_urls"] = {event: _relayed(url, relay_url) for event, url in body["callback_urls"].items()}
    return body


def settle(timeout: float = 60.0) -> None:
    """Let the calls schemathesis started finish running and their callbacks reach the relay while it
    still listens, so the session's worker carries none of them into the tests after this one."""
    deadline = time.monotonic() + timeout
    busy = text("SELECT (SELECT count(*) FROM tool_calls WHERE status = 'EXECUTING') + "
                "(SELECT count(*) FROM callback_deliveries WHERE state = 'pending' AND url IS NOT NULL)")
    while time.monotonic() < deadline:
        with db.engine().connect() as conn:
            if conn.execute(busy).scalar_one() == 0:
                return
        time.sleep(0.5)


def test_aliases_are_documented_alike(client):
    """Each /webhook alias is its canonical operation in the document (so schemathesis tests one of them)."""
    paths = client.get("/openapi.json", headers=AUTH).get_json()["paths"]
    aliases = [(path, method, operation) for path, item in paths.items() for method, operation in item.items()
               if "x-alias-of" in operation]
    assert aliases and {path for path, _, _ in aliases} == {p for p in paths if p.startswith("/webhook/")}
    for path, method, operation in aliases:
        canonical = paths[operation["x-alias-of"]][method]
        # an alias's operationId is its own, and it is marked deprecated, saying what to use instead
        strip = ("summary", "x-alias-of", "operationId", "deprecated", "description")
        assert {k: v for k, v in operation.items() if k not in strip} == \
            {k: v for k, v in canonical.items() if k not in strip}, path
        assert operation["deprecated"] is True and operation["description"], path
        assert operation["operationId"].startswith("webhook") and not canonical["operationId"].startswith("webhook")


def test_schemathesis_finds_no_disagreement(worker, relay):
    with gunicorn_web(GUNICORN_THREADS="32") as url:
        schema = schemathesis.openapi.from_url(f"{url}/openapi.json", config=config(url), headers=AUTH)
        schema.hook("map_body")(lambda context, body: to_relay(body, relay.url))
        documented = {f"{method.upper()} {path}" for path, item in schema.raw_schema["paths"].items()
                      for method in item if not path.startswith("/webhook/")} - {"GET /openapi.json"}  # its source
        problems: list[str] = []
        tolerated: Counter = Counter()
        tested: Counter = Counter()  # cases sent, by phase and operation
        finished = None
        for event in from_schema(schema).execute():
            if isinstance(event, events.ScenarioFinished):
                tested[(event.phase, event.recorder.label)] += len(event.recorder.cases)
                problems.extend(findings(event, tolerated))
            elif isinstance(event, (events.NonFatalError, events.FatalError)):
                problems.append(f"error: {event!r}")
            elif isinstance(event, events.EngineFinished):
                finished = event
        settle()
    print("refusals stated in words:", dict(tolerated))
    assert finished is not None and finished.stop_reason == "completed", finished
    assert {label for (phase, label), cases in tested.items() if phase == "fuzzing" and cases} == documented
    assert sum(cases for (phase, _), cases in tested.items() if phase == "stateful") > 50
    assert not problems, f"{len(problems)} findings:\n" + "\n".join(problems)
