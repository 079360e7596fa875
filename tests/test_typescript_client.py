"""The TypeScript client (``clients/typescript``) against a live API, worker and relay.

The package is installed from its lock (``npm ci``, once: ``node_modules`` stays in the checkout,
ignored by git) and built with ``tsc`` (``npm run build``, which first writes ``openapi.json`` with
``voice-tools openapi`` and generates the event types from it with openapi-typescript). Its script ``test/live.ts`` then
plays each part against the API: a send_email walkthrough with every REST call, ``verify()`` on the
callbacks the walkthrough received during a secret rotation (either secret verifies; a tampered body,
a stale timestamp, another secret are refused), and the event stream dropped mid-event and resumed
with ``Last-Event-ID``, no event lost or repeated. The example relay runs the voice flow with the
client alone. The build's ``openapi.json`` is the live document, so the types never drift.
"""
from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import API_TOKEN, AUTH

PACKAGE = Path(__file__).resolve().parent.parent / "clients" / "typescript"
NEW_SECRET = "whsec_" + base64.b64encode(b"N" * 32).decode()
OLD_SECRET = "whsec_" + base64.b64encode(b"O" * 32).decode()


def test_the_builds_copy_of_the_document_is_the_live_document(client, tmp_path):
    """The client's build (``npm run generate``) writes its ``openapi.json`` with ``voice-tools openapi``,
    which writes exactly what GET /openapi.json answers; no copy is committed, so a new tool needs no
    other file touched."""
    scripts = json.loads((PACKAGE / "package.json").read_text())["scripts"]
    assert scripts["openapi"] == "voice-tools openapi -o openapi.json"
    assert scripts["generate"].startswith("npm run openapi && ") and scripts["build"].startswith("npm run generate")
    done = subprocess.run([str(Path(sys.executable).parent / "voice-tools"), "openapi", "-o", "openapi.json"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    live = client.get("/openapi.json", headers=AUTH).get_json()
    assert json.loads((tmp_path / "openapi.json").read_text()) == live
    ignored = subprocess.run(["git", "check-ignore", "-q", str(PACKAGE / "openapi.json")], cwd=PACKAGE)
    assert ignored.returncode == 0, "clients/typescript/openapi.json is made by the build: git ignores it"


@pytest.fixture(scope="module")
def built() -> Path:
    """The package installed from its lock and built (node_modules kept between runs)."""
    if shutil.which("node") is None or shutil.which("npm") is None:
        pytest.skip("Node and npm are not installed")
    lock = PACKAGE / "package-lock.json"
    installed = PACKAGE / "node_modules" / ".package-lock.json"
    if not installed.is_file() or installed.stat().st_mtime < lock.stat().st_mtime:
        subprocess.run(["npm", "ci", "--no-audit", "--no-fund"], cwd=PACKAGE, check=True, capture_output=True,
                       timeout=600)
    scripts = str(Path(sys.executable).parent)  # voice-tools, which the build runs to write openapi.json
    done = subprocess.run(["npm", "run", "build"], cwd=PACKAGE, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PATH": os.pathsep.join([scripts, os.environ.get("PATH", "")])})
    assert done.returncode == 0, done.stdout + done.stderr
    return PACKAGE / "dist"


def node(built: Path, script: str, *args: str, env: dict[str, str], stdin: str | None = None,
         timeout: float = 120) -> subprocess.CompletedProcess:
    done = subprocess.run(["node", str(built / script), *args], input=stdin, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **env})
    assert done.returncode == 0, done.stdout + done.stderr
    return done


@pytest.mark.slow
def test_the_client_walks_a_call_verifies_its_callbacks_and_resumes_its_stream(
        built, api_url, worker, relay, monkeypatch, tmp_path):
    # a rotation is under way: the server signs with both secrets, newest first
    monkeypatch.setenv("VOICE_TOOLS_CALLBACK_SECRETS", f"{NEW_SECRET},{OLD_SECRET}")
    relay.webhook_secrets = [OLD_SECRET]
    session = "ts_client"
    env = {"API_URL": api_url, "API_TOKEN": API_TOKEN, "RELAY_URL": relay.url, "SESSION": session}
    walked = json.loads(node(built, "test/live.js", "walkthrough", env=env).stdout)
    call, cancelled = walked["tool_call_id"], walked["cancelled"]
    relay.wait_for(call, "completed")
    for other in cancelled:
        relay.wait_for(other, "cancelled")
    assert relay.bad_signatures == 0
    assert [e for _, e in relay.events_at(call)] == ["progress", "checkpoint", "progress", "completed"]

    # verify() on every callback received, as its raw bytes and headers
    callbacks = [{"headers": headers, "body": body.decode()} for headers, body in zip(relay.headers, relay.bodies)]
    file = tmp_path / "callbacks.json"
    file.write_text(json.dumps({"callbacks": callbacks, "secrets": [NEW_SECRET, OLD_SECRET]}))
    checked = json.loads(node(built, "test/live.js", "verify", str(file), env={}).stdout)
    assert checked["kinds"] == [event["event"] for event in relay.events]

    # the stream: every event of the session, a drop mid-event resumed with no loss and no duplicate
    streamed = json.loads(node(built, "test/live.js", "stream", env={**env, "EXPECTED": str(len(relay.events))},
                               timeout=180).stdout)
    assert sorted(streamed["ids"]) == sorted(event["event_id"] for event in relay.events)
    assert [i for i in streamed["ids"] if i in {e["event_id"] for e in relay.events_for(call)}] == [
        e["event_id"] for e in relay.events_for(call)]


@pytest.mark.slow
@pytest.mark.parametrize("answers, status, said", [
    (["yes", "yes"], "COMPLETED", "Email sent to ann@example.com."),
    (["yes", "no"], "CANCELLED", "Cancelled. The email was not sent."),
    (["no"], "CANCELLED", "Cancelled. The email was not sent."),
])
def test_the_example_relay_plays_the_voice_flow(built, api_url, worker, answers, status, said):
    call = {"type": "response.function_call_arguments.done", "call_id": f"call_{status}_{len(answers)}",
            "name": "send_email", "arguments": json.dumps({"to": "ann@example.com", "subject": "Lunch"})}
    done = node(built, "examples/relay.js", *answers, stdin=json.dumps(call),
                env={"VOICE_TOOLS_URL": api_url, "VOICE_TOOLS_TOKEN": API_TOKEN, "SESSION_ID": "ts_relay"})
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    spoken = [line["say"] for line in lines if "say" in line]
    assert spoken[0] == "Ready to send email to ann@example.com. Confirm to proceed."
    if answers[0] == "yes":
        assert len(spoken) == 3 and "ann@example.com" in spoken[1], spoken  # the checkpoint, announced
    assert spoken[-1] == said
    output = lines[-1]
    assert output["type"] == "conversation.item.create" and output["item"]["call_id"] == call["call_id"]
    result = json.loads(output["item"]["output"])
    assert result["status"] == status and result["voice_response"] == said


@pytest.mark.slow
def test_the_client_retries_503_and_429_after_retry_after_then_throws(built):
    """Against an HTTP double in the script: a 503 then a 429 (Retry-After: 3600, bounded to the
    client's maximum) are tried again with the same Idempotency-Key; four 503s are three retries then
    a VoiceToolsError; a 409 is thrown at once."""
    assert json.loads(node(built, "test/live.js", "retries", env={}).stdout) == {"ok": True}


@pytest.mark.slow
def test_the_built_package_hands_its_generated_types_to_a_program_using_it(built, tmp_path):
    """A program compiled against the built package (dist's declarations, as an installed package
    gives them) sees the generated event types: narrowing on ``event`` gives a checkpoint's fields,
    and a field no event has is a type error."""
    program = tmp_path / "relay.ts"
    program.write_text(f"""
import {{ verify, type CallbackEvent, type CheckpointEvent }} from "{built / 'src' / 'index.js'}";
const event: CallbackEvent = verify({{}}, "", "whsec_x");
if (event.event === "checkpoint") {{
  const checkpoint: CheckpointEvent = event;
  const url: string | null = checkpoint.resume_url;
  console.log(url, checkpoint.preview);
}}
// @ts-expect-error: no event has this field
console.log(event.no_such_field);
""")
    done = subprocess.run([str(PACKAGE / "node_modules" / ".bin" / "tsc"), "--noEmit", "--strict", "--module", "NodeNext",
                           "--moduleResolution", "NodeNext", "--types", "node", "--typeRoots",
                           str(PACKAGE / "node_modules" / "@types"), str(program)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
