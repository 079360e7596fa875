"""``voice-tools demo``: conversations played against the running system as a relay would.

``--scenario email`` (the default) is the "updating email" conversation: the caller asks
for an email to john@example.com, corrects the address to john.smith@example.com,
confirms; voice-tools prepares the email and stops at its checkpoint
(READY_TO_SEND), the caller says "send it", the email is sent.
``--scenario calendar``: "when am I free on <the next weekday>?", then "book a
project sync in the first free slot" (a checkpoint READY_TO_BOOK, then booked).
``--scenario docs``: "what were Q3 sales in the northwest?", "what's John Smith's
address?", then "email him the results" (the email draws on the search's results
through ``reference_context``). ``--scenario all`` plays the three.

Every request goes over HTTP to the running system (``voice-tools run``, which loads
the demo data set on a fresh database); callbacks come to a small receiver this
command serves on 127.0.0.1, which checks their signatures when it knows the secrets:
the older scheme's with ``VOICE_TOOLS_CALLBACK_SECRET``, the Standard Webhooks one with
``VOICE_TOOLS_CALLBACK_SECRETS`` (else the ones ``voice-tools run`` made for the data dir). The receiver stays up
until every event a write is expected to send has come (its ``checkpoint``, then its last event, which the
worker posts just after the resume's answer), each within 30 s, or the demo says which one did not come and
exits 1: a demo leaves no callback to fail behind it. Each line the assistant would speak is printed. The
exit status is 0 when every call a scenario makes ends COMPLETED.
"""
from __future__ import annotations

import argparse
import json
import os
import queue
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from datetime import date, datetime, timedelta, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import requests

from tasks.delivery.signing import parse_secrets, verify, verify_standard

WAIT_S = 30
TERMINAL = ("completed", "failed", "cancelled", "expired")  # a call's last event


@dataclass(frozen=True)
class Secrets:
    """What the receiver checks a callback with: the older scheme's secret, the Standard Webhooks ones."""

    older: str | None = None
    standard: list[str] = field(default_factory=list)

    def verify(self, headers: Any, body: bytes) -> bool:
        """Both schemes' signatures, each when its secret is known (a 5-minute replay window)."""
        return (not self.older or verify(self.older, headers, body)) and \
            (not self.standard or verify_standard(self.standard, headers, body))


class CallbackReceiver:
    """A relay's callback endpoint: records each event, answers ``{"received": true}``."""

    def __init__(self, secret: Secrets | None):
        self.secret = secret or Secrets()
        self.events: queue.Queue[dict[str, Any]] = queue.Queue()
        self.bad_signatures = 0
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:  # noqa: N802
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if not receiver.secret.verify(self.headers, body):
                    receiver.bad_signatures += 1
                    self._reply(401, {"error": "bad signature"})
                    return
                self._reply(200, {"received": True})
                try:  # recorded once answered: the demo may stop the receiver as soon as it has the event
                    receiver.events.put(json.loads(body))
                except ValueError:
                    pass

            def _reply(self, status: int, payload: dict[str, Any]) -> None:
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = False  # closing the receiver waits for the answers under way
        self.server.block_on_close = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/callbacks"

    def wait_for(self, event: str, timeout: float, seen: list[dict[str, Any]]) -> dict[str, Any]:
        """Collect events into ``seen`` until one of type ``event`` (or a terminal one) arrives; a
        :class:`DemoError` naming it if none does within ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                got = self.events.get(timeout=max(deadline - time.monotonic(), 0))
            except queue.Empty:
                came = ", ".join(e.get("event", "?") for e in seen) or "none"
                raise DemoError(f"the {event} callback did not come within {timeout:.0f} s "
                                f"(callbacks that came: {came})") from None
            seen.append(got)
            if got.get("event") in (event, *TERMINAL):
                return got

    def __enter__(self) -> "CallbackReceiver":
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.shutdown()
        self.server.server_close()


class Relay:
    """The HTTP side of a relay: one session, Bearer token, JSON in and out."""

    def __init__(self, base_url: str, token: str):
        self.base_url = base_url.rstrip("/")
        self.http = requests.Session()
        self.http.headers["Authorization"] = f"Bearer {token}"

    def call(self, method: str, path: str, expect: tuple[int, ...], **kw: Any) -> dict[str, Any]:
        response = self.http.request(method, self.base_url + path, timeout=WAIT_S + 10, **kw)
        print(f"    {method} {path} -> {response.status_code}", flush=True)
        try:
            body = response.json()
        except ValueError:
            body = {"error": "not_json", "message": response.text[:200]}
        if response.status_code not in expect:
            raise DemoError(f"{method} {path} answered {response.status_code}: {body}")
        return body


class DemoError(Exception):
    pass


def caller(text: str) -> None:
    print(f'\nCaller:    "{text}"', flush=True)


def assistant(text: str | None) -> None:
    print(f'Assistant: "{text}"', flush=True)


def play_email(base_url: str, token: str, secret: Secrets | None) -> list[dict[str, Any]]:
    """The "updating email" conversation; return the final status record of the call."""
    relay = Relay(base_url, token)
    session_id = f"sess_demo_{uuid.uuid4().hex[:8]}"
    with CallbackReceiver(secret) as receiver:
        caller("Send an email to john@example.com about the meeting tomorrow.")
        created = relay.call("POST", "/voice-tools/pending", (201,), json={
            "session_id": session_id,
            "function": "send_email",
            "intent_id": "intent_demo",
            "parameters": {"to": "john@example.com", "subject": "Meeting Tomorrow",
                           "body": "Let's discuss the project tomorrow at 10."},
        })
        call_id = created["tool_call_id"]
        print(f"    {call_id} is {created['status']}")
        assistant(created["message"])

        caller("Wait, that should be john.smith@example.com.")
        modified = relay.call("PATCH", f"/voice-tools/modify/{call_id}", (200,),
                              json={"parameters": {"to": "john.smith@example.com"}})
        for change in modified.get("changes", []):
            print(f"    {change['field']}: {change['old']} -> {change['new']}")
        assistant(modified["message"])

        caller("Yes, send it.")
        final = _confirm_through_checkpoint(relay, receiver, call_id, "Yes, go ahead.")
        return [final]


def _trail(relay: Relay, call_id: str) -> dict[str, Any]:
    final = relay.call("GET", f"/voice-tools/status/{call_id}", (200,))
    trail = " -> ".join(entry["status"] for entry in final.get("status_history", []))
    print(f"\n{call_id}: {trail}", flush=True)
    return final


def _run_read(relay: Relay, session_id: str, function: str, parameters: dict[str, Any]) -> dict[str, Any]:
    """A read the relay already agreed with the caller: ``/execute?wait``, answered when done."""
    done = relay.call("POST", f"/voice-tools/execute?wait={WAIT_S}", (200,), json={
        "session_id": session_id, "function": function, "parameters": parameters})
    if done["status"] != "COMPLETED":
        raise DemoError(f"{function} ended {done['status']}: {done.get('error_message')}")
    assistant(done.get("voice_response"))
    return done


def _confirm_through_checkpoint(relay: Relay, receiver: CallbackReceiver, call_id: str, go: str) -> dict[str, Any]:
    """Confirm a write, wait for its checkpoint, say the preview, proceed; return the final record."""
    confirmed = relay.call("POST", f"/voice-tools/confirm/{call_id}", (202,), json={"callback_url": receiver.url})
    assistant(confirmed["message"])
    events: list[dict[str, Any]] = []
    checkpoint = receiver.wait_for("checkpoint", WAIT_S, events)
    _said(events)
    if checkpoint.get("event") != "checkpoint":
        raise DemoError(f"expected a checkpoint, got {checkpoint.get('event')}: {checkpoint}")
    print(f"    preview: {json.dumps(checkpoint.get('preview'))[:600]}")
    assistant(checkpoint.get("message"))
    caller(go)
    resumed = relay.call("POST", f"/voice-tools/resume/{call_id}?wait={WAIT_S}", (200, 202),
                         json={"action": "proceed"})
    print(f"    {call_id} is {resumed['status']}; result {json.dumps(resumed.get('result'))[:300]}")
    assistant(resumed.get("voice_response") or resumed.get("message"))
    # the call's last event is posted after the answer above: the receiver stays up until it has come
    after: list[dict[str, Any]] = []
    receiver.wait_for("completed", WAIT_S, after)
    _said(after)
    if receiver.bad_signatures:
        raise DemoError(f"{receiver.bad_signatures} callbacks had a bad signature")
    return _trail(relay, call_id)


def _said(events: list[dict[str, Any]]) -> None:
    for event in events:
        print(f"    callback {event.get('event')} step={event.get('step')} status={event.get('status')}")


def next_weekday(today: date | None = None) -> date:
    day = (today or datetime.now(timezone.utc).date()) + timedelta(days=1)
    while day.weekday() >= 5:
        day += timedelta(days=1)
    return day


def play_calendar(base_url: str, token: str, secret: Secrets | None) -> list[dict[str, Any]]:
    """"When am I free?", then "book the first free slot"."""
    relay = Relay(base_url, token)
    session_id = f"sess_demo_{uuid.uuid4().hex[:8]}"
    day = next_weekday()
    with CallbackReceiver(secret) as receiver:
        caller(f"What does my calendar look like on {day:%A}? When am I free?")
        found = _run_read(relay, session_id, "get_calendar_availability", {
            "start": f"{day.isoformat()}T09:00:00Z", "end": f"{day.isoformat()}T17:00:00Z", "duration_minutes": 30})
        free = found["result"]["free"]
        if not free:
            raise DemoError(f"no free slot on {day}: {found['result']}")
        caller("Book a project sync with John Smith in the first free slot.")
        created = relay.call("POST", "/voice-tools/pending", (201,), json={
            "session_id": session_id, "function": "schedule_meeting",
            "parameters": {"title": "Project sync", "start": free[0]["start"], "duration_minutes": 30,
                           "attendees": ["john.smith@example.com"], "timezone": "UTC"}})
        assistant(created["message"])
        caller("Yes.")
        booked = _confirm_through_checkpoint(relay, receiver, created["tool_call_id"], "Book it.")
    return [found, booked]


def play_docs(base_url: str, token: str, secret: Secrets | None) -> list[dict[str, Any]]:
    """Search the documents, find a contact, email the results (``reference_context``)."""
    relay = Relay(base_url, token)
    session_id = f"sess_demo_{uuid.uuid4().hex[:8]}"
    with CallbackReceiver(secret) as receiver:
        caller("What were our Q3 sales in the northwest?")
        searched = _run_read(relay, session_id, "query_vector_db", {
            "user_query": "Q3 sales northwest",
            "structured_query": {"semantic_query": "quarterly sales northwest region", "filters": {"region": "northwest"}}})
        caller("What's John Smith's email address?")
        contact = _run_read(relay, session_id, "search_contacts", {"query": "John Smith", "limit": 1})
        contacts = contact["result"]["contacts"]
        if not contacts:
            raise DemoError("the demo contacts have no John Smith: run `voice-tools load-demo`")
        to = contacts[0]["email"]
        caller("Email him those results.")
        created = relay.call("POST", "/voice-tools/pending", (201,), json={
            "session_id": session_id, "function": "send_email",
            "parameters": {"to": to, "subject": "Q3 sales: Northwest", "body": "Here are the Q3 numbers you asked about.",
                           "reference_context": "last_query_results"}})
        assistant(created["message"])
        caller("Yes.")
        sent = _confirm_through_checkpoint(relay, receiver, created["tool_call_id"], "Send it.")
    return [searched, contact, sent]


SCENARIOS = {"email": play_email, "calendar": play_calendar, "docs": play_docs}


def play(base_url: str, token: str, secret: Secrets | None, scenario: str = "email") -> list[dict[str, Any]]:
    """Play ``scenario`` (or ``all``); return the final records of the calls it made."""
    names = list(SCENARIOS) if scenario == "all" else [scenario]
    finals: list[dict[str, Any]] = []
    for name in names:
        if len(names) > 1:
            print(f"\n=== {name} ===", flush=True)
        finals += SCENARIOS[name](base_url, token, secret)
    return finals


def api_url(given: str | None) -> tuple[str, str]:
    """The API's URL, and where it came from: ``--url``, ``VOICE_TOOLS_PUBLIC_URL``, ``PORT``, else the
    data dir's running ``voice-tools run`` (its record, as the token comes from its secrets), else 8000."""
    from voice_tools.servers import RUN_RECORD, default_data_dir, recorded_run

    if given:
        return given, "--url"
    if os.environ.get("VOICE_TOOLS_PUBLIC_URL", "").strip():
        return os.environ["VOICE_TOOLS_PUBLIC_URL"].strip(), "VOICE_TOOLS_PUBLIC_URL"
    if os.environ.get("PORT", "").strip():
        return f"http://127.0.0.1:{os.environ['PORT'].strip()}", "PORT"
    recorded = recorded_run().get("api_url")
    if recorded:
        return recorded, f"the run recorded in {default_data_dir() / RUN_RECORD}"
    return "http://127.0.0.1:8000", f"the default; no run is recorded in {default_data_dir()}"


def _local_secrets() -> dict[str, str]:
    """The values ``voice-tools run`` made for this data dir, when the variables are unset."""
    from voice_tools.servers import LOCAL_SECRETS, default_data_dir

    try:
        return json.loads((default_data_dir() / LOCAL_SECRETS).read_text())
    except (OSError, ValueError):
        return {}


def _first_token(tokens: str) -> str | None:
    for entry in tokens.split(","):
        entry = entry.strip()
        if entry:
            return entry.split(":", 1)[1] if ":" in entry else entry
    return None


def _answers(url: str) -> None:
    """Does anything answer at ``url``? (``/healthz``, which needs no token; any answer will do.) Raises
    ``requests.ConnectionError`` or ``requests.Timeout`` when nothing does."""
    requests.get(url.rstrip("/") + "/healthz", timeout=10)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="voice-tools demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="the API (default: VOICE_TOOLS_PUBLIC_URL, else http://127.0.0.1:$PORT, else "
                                      "the URL of the data dir's running `voice-tools run`, else port 8000)")
    parser.add_argument("--token", help="an API token (default: the first of VOICE_TOOLS_API_TOKENS,"
                                        " else the one `voice-tools run` made)")
    parser.add_argument("--scenario", choices=[*SCENARIOS, "all"], default="email",
                        help="which conversation to play (default: email, the caller correcting an email's "
                             "address before it is sent)")
    args = parser.parse_args(argv)
    local = _local_secrets()
    url, source = api_url(args.url)
    token = args.token or _first_token(os.environ.get("VOICE_TOOLS_API_TOKENS", "")) or local.get("api_token")
    secret = Secrets(os.environ.get("VOICE_TOOLS_CALLBACK_SECRET") or local.get("callback_secret"),
                     parse_secrets(os.environ.get("VOICE_TOOLS_CALLBACK_SECRETS", "")
                                   or local.get("webhook_secret", "")))
    if not token:
        print("voice-tools demo: no API token (set VOICE_TOOLS_API_TOKENS or pass --token)", file=sys.stderr)
        return 2
    try:
        _answers(url)  # before the conversation's first line: nothing running is said alone
        finals = play(url, token, secret, args.scenario)
    except requests.ConnectionError:
        print(f"\nvoice-tools demo failed: nothing answers at {url} (taken from {source}). "
              "Is `voice-tools run` running? Start it, or give the API's address with --url.", file=sys.stderr)
        return 1
    except requests.Timeout:
        print(f"\nvoice-tools demo failed: the API at {url} (taken from {source}) did not answer in time.",
              file=sys.stderr)
        return 1
    except (DemoError, requests.RequestException, queue.Empty) as exc:
        print(f"\nvoice-tools demo failed: {str(exc) or type(exc).__name__}", file=sys.stderr)
        return 1
    return 0 if all(final.get("status") == "COMPLETED" for final in finals) else 1


if __name__ == "__main__":
    sys.exit(main())
