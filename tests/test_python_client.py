"""The Python relay client (clients/python, module ``voice_tools_relay``) and the example relay
(examples/python_relay.py), against this run's real API, worker and callbacks.

The client is imported from its source folder (nothing installed); it and the example import
nothing of the product.
"""
from __future__ import annotations

import ast
import base64
import json
import os
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import requests

from tasks.delivery import attempts
from tests.api_fixtures import BrokerDown
from tests.conftest import API_TOKEN
from tests.helpers import deliveries, progress_event, wait_status

ROOT = Path(__file__).resolve().parent.parent
CLIENT_SRC = ROOT / "clients" / "python" / "src"
EXAMPLE = ROOT / "examples" / "python_relay.py"
sys.path.insert(0, str(CLIENT_SRC))

from voice_tools_relay import Client, RelayError, SignatureError, trace_context, verify  # noqa: E402

NEW_SECRET = "whsec_" + base64.b64encode(b"N" * 32).decode()
OLD_SECRET = "whsec_" + base64.b64encode(b"O" * 32).decode()
EMAIL = {"to": "john@example.com", "subject": "Meeting Tomorrow"}


def top_imports(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level:
            found.add((node.module or "").split(".")[0])
    return found


def test_the_client_and_the_example_import_nothing_of_the_product():
    stdlib = set(sys.stdlib_module_names) | {"__future__"}
    client = set().union(*(top_imports(p) for p in (CLIENT_SRC / "voice_tools_relay").rglob("*.py")))
    assert client - stdlib == {"requests", "standardwebhooks", "voice_tools_relay"}
    assert top_imports(EXAMPLE) - stdlib == {"voice_tools_relay"}


# --- verify() on real callbacks -----------------------------------------------------------------------

def delivered(relay) -> tuple[dict, bytes]:
    """A real callback (a send_email's progress event) as the relay received it: headers, raw body."""
    _, event_id = progress_event(relay.url)
    assert attempts.attempt(event_id).delivered
    return relay.headers[-1], relay.bodies[-1]


def test_verify_returns_the_event_of_a_real_callback(relay):
    head, body = delivered(relay)
    [secret] = relay.webhook_secrets
    event = verify(head, body, secret)
    assert event == json.loads(body) and event["event_id"] == head["webhook-id"]
    assert verify(head, body, [OLD_SECRET, secret]) == event  # any secret of several may match
    with pytest.raises(SignatureError, match="no signature matches"):
        verify(head, body, OLD_SECRET)


def test_trace_context_reads_a_callbacks_traceparent_whatever_its_case():
    """tests/test_tracing.py reads a traced server's real callbacks with it; here its reading of the headers."""
    parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    assert trace_context({"TraceParent": parent, "TRACESTATE": "vendor=x", "webhook-id": "e"}) == {
        "traceparent": parent, "tracestate": "vendor=x"}
    assert trace_context({"traceparent": parent}) == {"traceparent": parent}
    assert trace_context({"tracestate": "vendor=x", "webhook-id": "e"}) == {}


def test_verify_during_a_rotation_with_either_secret(relay, monkeypatch):
    """Two secrets in VOICE_TOOLS_CALLBACK_SECRETS: a relay holding either one verifies."""
    monkeypatch.setenv("VOICE_TOOLS_CALLBACK_SECRETS", f"{NEW_SECRET},{OLD_SECRET}")
    relay.webhook_secrets = [OLD_SECRET]
    head, body = delivered(relay)
    assert len(head["webhook-signature"].split(" ")) == 2
    assert verify(head, body, NEW_SECRET)["event_id"] == head["webhook-id"]
    assert verify(head, body, OLD_SECRET)["event_id"] == head["webhook-id"]
    with pytest.raises(SignatureError):
        verify(head, body, "whsec_" + base64.b64encode(b"x" * 32).decode())


def test_verify_refuses_a_tampered_body_a_stale_or_future_timestamp_and_missing_headers(relay):
    head, body = delivered(relay)
    [secret] = relay.webhook_secrets
    tampered = body.replace(b"john@example.com", b"evil@example.com")
    assert tampered != body
    with pytest.raises(SignatureError, match="no signature matches"):
        verify(head, tampered, secret)
    sent = int(head["webhook-timestamp"])
    # the same signed request, as if received 10 minutes later (a replay), or signed for 10 minutes ahead
    real_time = time.time
    try:
        time.time = lambda: sent + 600
        with pytest.raises(SignatureError, match="too old"):
            verify(head, body, secret)
        assert verify(head, body, secret, tolerance=900)["event_id"] == head["webhook-id"]
        time.time = lambda: sent - 600
        with pytest.raises(SignatureError, match="too new"):
            verify(head, body, secret)
    finally:
        time.time = real_time
    with pytest.raises(SignatureError, match="missing"):
        verify({k: v for k, v in head.items() if k.lower() != "webhook-signature"}, body, secret)
    with pytest.raises(SignatureError):
        verify({**head, "webhook-timestamp": "soon"}, body, secret)
    with pytest.raises(SignatureError):
        verify(head, b"\xff" + body, secret)
    assert isinstance(SignatureError("x"), __import__("standardwebhooks").WebhookVerificationError)


# --- the REST calls ------------------------------------------------------------------------------------

@pytest.fixture
def client(api_url):
    return Client(api_url, API_TOKEN)


@pytest.mark.slow
def test_a_send_email_walkthrough_through_the_client(client, worker):
    call = client.pending("sess_client", "send_email", dict(EMAIL), idempotency_key="relay-key-1")
    assert call["status"] == "PENDING" and call["message"].startswith("Ready to send email to john@example.com")
    again = client.pending("sess_client", "send_email", dict(EMAIL), idempotency_key="relay-key-1")
    assert again["tool_call_id"] == call["tool_call_id"]  # the same key: the same call, no second row
    other = client.pending("sess_client", "send_email", dict(EMAIL))  # a key made for each
    assert other["tool_call_id"] != call["tool_call_id"]
    client.cancel(other["tool_call_id"], reason="not this one")
    with pytest.raises(RelayError) as conflict:
        client.pending("sess_client", "send_email", {**EMAIL, "subject": "Other"}, idempotency_key="relay-key-1")
    assert (conflict.value.status, conflict.value.error) == (409, "idempotency_conflict")

    tc = call["tool_call_id"]
    changed = client.modify(tc, {"to": "john.smith@example.com"})
    assert changed["changes"] == [{"field": "to", "old": "john@example.com", "new": "john.smith@example.com"}]
    prepared = client.confirm(tc, wait=15)
    assert prepared["status"] == "PREPARED" and prepared["actions_available"] == ["proceed", "cancel"]
    context = client.context("sess_client")
    assert [c["tool_call_id"] for c in context["pending"]] == [tc]
    done = client.resume(tc, "proceed", wait=15)
    assert done["status"] == "COMPLETED", done
    assert done["voice_response"] == "Email sent to john.smith@example.com."
    assert client.status(tc)["result"]["to"] == "john.smith@example.com"
    with pytest.raises(RelayError) as late:
        client.cancel(tc)
    assert (late.value.status, late.value.error) == (409, "already_terminal") and late.value.message

    assert "send_email" in {tool["name"] for tool in client.tools()["tools"]}
    executed = client.execute("sess_client", "query_vector_db", {"user_query": "Q3 sales northwest"}, wait=15)
    assert executed["status"] == "COMPLETED" and executed["voice_response"]
    with pytest.raises(RelayError) as missing:
        client.status("tc_000000000000")
    assert (missing.value.status, missing.value.error) == (404, "not_found") and missing.value.message
    with pytest.raises(RelayError) as invalid:
        client.pending("sess_client", "send_email", {"subject": "no recipient"})
    assert invalid.value.status == 422 and invalid.value.details["fields"]["parameters"]["to"]


@pytest.mark.slow
def test_a_confirm_answered_503_is_sent_again_and_starts_the_call_once(client, worker, celery_app_instance):
    """The broker is down at the first confirm (503, the call PENDING again); the client sends it again
    after its pause, by then the broker is back: one chain, the call reaches its checkpoint."""
    tc = client.pending("sess_retry", "send_email", dict(EMAIL))["tool_call_id"]
    down = BrokerDown(celery_app_instance)
    timer = threading.Timer(0.3, down.restore)
    timer.start()
    try:
        http = requests.Session()
        statuses: list[int] = []
        http.hooks["response"].append(lambda response, *args, **kwargs: statuses.append(response.status_code))
        answer = Client(client.base_url, API_TOKEN, retries=6, session=http).confirm(tc)
    finally:
        timer.cancel()
        down.restore()
    assert answer["status"] == "EXECUTING"
    assert statuses[0] == 503 and statuses[-1] == 202 and set(statuses[:-1]) == {503}
    wait_status(tc, "PREPARED")
    assert [d.payload["step"] for d in deliveries(tc)] == ["PREPARING", "READY_TO_SEND"]


class Refusing:
    """An HTTP double of a server past a caller's share: the first ``refusals`` requests are 429 with
    ``Retry-After``, then 200; it records when each request came."""

    def __init__(self, refusals: int, retry_after: str = "1"):
        self.times: list[float] = []
        self.keys: list[str | None] = []
        double = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):  # noqa: N802
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                double.times.append(time.monotonic())
                double.keys.append(self.headers.get("Idempotency-Key"))
                if len(double.times) <= refusals:
                    body = json.dumps({"error": "too_many_open", "message": "Try again.",
                                       "details": {"retry_after": 1}}).encode()
                    self.send_response(429)
                    self.send_header("Retry-After", retry_after)
                else:
                    body = json.dumps({"tool_call_id": "tc_1", "status": "PENDING"}).encode()
                    self.send_response(201)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_port}"


@pytest.mark.slow
def test_a_429_is_sent_again_after_its_retry_after_with_the_same_idempotency_key():
    double = Refusing(refusals=2)
    try:
        answer = Client(double.url, "t").pending("s", "send_email", dict(EMAIL))
        assert answer["status"] == "PENDING" and len(double.times) == 3
        assert double.times[1] - double.times[0] >= 0.95 and double.times[2] - double.times[1] >= 0.95
        assert double.keys[0] and len(set(double.keys)) == 1
    finally:
        double.server.shutdown()
    always = Refusing(refusals=100, retry_after="3600")
    try:
        started = time.monotonic()
        with pytest.raises(RelayError) as refused:  # bounded: past its retries the 429 is raised, each pause capped
            Client(always.url, "t", retries=2, max_wait=0.2).pending("s", "send_email", dict(EMAIL))
    finally:
        always.server.shutdown()
    assert len(always.times) == 3 and time.monotonic() - started < 5
    assert (refused.value.status, refused.value.error, refused.value.message, refused.value.details,
            refused.value.retry_after) == (429, "too_many_open", "Try again.", {"retry_after": 1}, 3600.0)


# --- the event stream --------------------------------------------------------------------------------

class CuttableProxy:
    """A TCP proxy to the API whose open connections :meth:`cut` drops (a network drop mid-stream);
    it keeps accepting new ones."""

    def __init__(self, target_port: int):
        self.target_port = target_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.sockets: list[socket.socket] = []
        self.accepted = 0
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                inside, _ = self.listener.accept()
            except OSError:
                return
            outside = socket.create_connection(("127.0.0.1", self.target_port))
            with self.lock:
                self.sockets += [inside, outside]
                self.accepted += 1
            for a, b in ((inside, outside), (outside, inside)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(source, sink):
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for s in (source, sink):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def cut(self):
        with self.lock:
            for s in self.sockets:
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            self.sockets = []

    def close(self):
        self.cut()
        self.listener.close()


@pytest.mark.slow
def test_follow_resumes_after_a_dropped_connection_with_no_loss_and_no_duplicate(api_url, worker):
    proxy = CuttableProxy(int(api_url.rsplit(":", 1)[1]))
    direct = Client(api_url, API_TOKEN)
    through = Client(f"http://127.0.0.1:{proxy.port}", API_TOKEN)
    try:
        first = direct.pending("sess_follow", "send_email", dict(EMAIL))["tool_call_id"]
        direct.confirm(first)
        wait_status(first, "PREPARED")
        events = through.follow("sess_follow")
        seen = [next(events)]
        assert seen[0].kind == "progress" and seen[0].id == seen[0]["event_id"]
        proxy.cut()  # dropped after the first event; more happens while the relay is away
        second = direct.pending("sess_follow", "send_email", dict(EMAIL))["tool_call_id"]
        direct.confirm(second)
        wait_status(second, "PREPARED")
        direct.cancel(first)
        wait_status(first, "CANCELLED")
        expected = len(deliveries(first)) + len(deliveries(second))
        seen += [next(events) for _ in range(expected - 1)]
        assert proxy.accepted >= 2  # it did connect again
        direct.resume(second, "cancel")  # and goes on following new events
        last = next(events)
        events.close()
    finally:
        proxy.close()
    assert (last["tool_call_id"], last.kind) == (second, "cancelled")
    seen.append(last)
    ids = [e.id for e in seen]
    assert len(ids) == len(set(ids))
    assert set(ids) == {d.event_id for d in deliveries(first) + deliveries(second)}
    assert all(e.kind == e["event"] for e in seen)
    for call in (first, second):
        seqs = [e["seq"] for e in seen if e["tool_call_id"] == call]
        assert seqs == list(range(1, len(seqs) + 1))
    # resuming after a given event: what comes after it, from the start of a new follow
    after = direct.follow("sess_follow", last_event_id=ids[-2])
    assert next(after).id == ids[-1]
    after.close()


@pytest.mark.slow
def test_follow_raises_the_servers_error(api_url):
    with pytest.raises(RelayError) as refused:
        next(Client(api_url, API_TOKEN).follow("sess_x", last_event_id="0" * 32))
    assert (refused.value.status, refused.value.error) == (422, "validation_error")
    with pytest.raises(RelayError) as unauthorized:
        next(Client(api_url, "wrong").follow("sess_x"))
    assert unauthorized.value.status == 401


# --- the example relay ---------------------------------------------------------------------------------

def run_example(api_url: str, answers: str, session: str) -> str:
    function_call = {"type": "response.function_call_arguments.done", "name": "send_email",
                     "call_id": f"call_{session}", "arguments": json.dumps(EMAIL)}
    done = subprocess.run([sys.executable, str(EXAMPLE), json.dumps(function_call), "--api", api_url,
                           "--session", session], input=answers, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "VOICE_TOOLS_TOKEN": API_TOKEN, "PYTHONPATH": str(CLIENT_SRC)})
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.slow
def test_the_example_relay_sends_the_email_on_two_yeses(api_url, worker):
    out = run_example(api_url, "yes\nyes\n", "sess_example")
    assert out.splitlines()[:5] == [
        "assistant: Ready to send email to john@example.com. Confirm to proceed.", "caller: yes",
        "assistant: The email to john@example.com is ready. Send it?", "caller: yes",
        "assistant: Email sent to john@example.com."]
    output = json.loads(out.splitlines()[5].split("to the model: ", 1)[1])
    assert output["item"]["call_id"] == "call_sess_example"
    assert json.loads(output["item"]["output"])["status"] == "COMPLETED"


@pytest.mark.slow
def test_the_example_relay_cancels_at_the_checkpoint_on_no(api_url, worker):
    out = run_example(api_url, "yes\nno\n", "sess_example_no")
    assert "assistant: Cancelled. The email was not sent." in out.splitlines()
    assert '\\"status\\": \\"CANCELLED\\"' in out


@pytest.mark.slow
def test_the_guides_example_command_runs_twice_each_a_call_of_its_own(api_url, worker):
    """docs/relay-guide.md's command for the example relay, run as written (bash, from the repository's root)
    two times: each run is a new call (a fresh call_id) and sends its email."""
    guide = (ROOT / "docs" / "relay-guide.md").read_text()
    after = guide.split("`examples/python_relay.py` is a relay's whole flow", 1)[1]
    block = after.split("```sh\n", 1)[1].split("```", 1)[0]
    command = "\n".join(line for line in block.splitlines() if not line.startswith("#"))
    env = {**os.environ, "API": api_url, "T": API_TOKEN,
           "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])}
    said = []
    for _ in range(2):
        done = subprocess.run(["bash", "-c", command], cwd=ROOT, input="yes\nyes\n", capture_output=True, text=True,
                              timeout=60, env=env)
        assert done.returncode == 0, done.stdout + done.stderr
        lines = done.stdout.splitlines()
        assert "assistant: Email sent to john@example.com." in lines, done.stdout
        said.append(json.loads(lines[-1].split("to the model: ", 1)[1])["item"]["call_id"])
    assert len(set(said)) == 2, said
