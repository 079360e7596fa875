"""``voice-tools demo`` in a second terminal with none of the run's variables: it takes the API's URL
from the data dir's run record (as it takes the token from the data dir's secrets), and says in a
sentence when nothing answers there; every scenario, played against the API and a worker, leaves no failed
callback delivery behind. Playing the scenarios against a real run is in ``tests/test_run_command.py``."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from support.procs import ROOT, bare_env, free_port
from tasks.delivery.signing import parse_secrets

LATE_S = 1.0
RUN_VARIABLES = ("PORT", "VOICE_TOOLS_PUBLIC_URL", "VOICE_TOOLS_API_TOKENS", "VOICE_TOOLS_CALLBACK_SECRET")


def data_dir_of_a_run(path: Path, api_url: str) -> Path:
    """A data dir as ``voice-tools run`` leaves it while it runs: its secrets and its record."""
    (path / "local-secrets.json").write_text(json.dumps(
        {"api_token": "recorded-token", "callback_secret": "s", "flower_password": "f"}))
    (path / "run.json").write_text(json.dumps({"api_url": api_url, "pid": 1}))
    return path


def demo(data_dir: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in bare_env(VOICE_TOOLS_DATA_DIR=str(data_dir)).items() if k not in RUN_VARIABLES}
    return subprocess.run([sys.executable, "-m", "voice_tools", "demo"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=60, stdin=subprocess.DEVNULL)


def test_the_demo_calls_the_url_the_data_dirs_run_recorded_with_its_token(tmp_path):
    seen: list[tuple[str, str, str | None]] = []

    class Refuse(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

        def do_POST(self) -> None:  # noqa: N802
            seen.append(("POST", self.path, self.headers.get("Authorization")))
            body = json.dumps({"error": "unauthorized", "message": "no"}).encode()
            self.send_response(401)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Refuse)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        played = demo(data_dir_of_a_run(tmp_path, f"http://127.0.0.1:{server.server_address[1]}"))
    finally:
        server.shutdown()
        server.server_close()
    assert played.returncode == 1, played.stdout + played.stderr
    assert seen == [("POST", "/voice-tools/pending", "Bearer recorded-token")]  # not port 8000
    assert "POST /voice-tools/pending answered 401" in played.stderr


def test_an_unreachable_api_is_said_in_a_sentence_naming_the_url_and_where_it_came_from(tmp_path):
    port = free_port()  # nothing listens there
    played = demo(data_dir_of_a_run(tmp_path, f"http://127.0.0.1:{port}"))
    assert played.returncode == 1
    said = played.stderr.strip().splitlines()
    assert said[-1] == (f"voice-tools demo failed: nothing answers at http://127.0.0.1:{port} (taken from the run "
                        f"recorded in {tmp_path / 'run.json'}). Is `voice-tools run` running? Start it, or give the "
                        "API's address with --url."), played.stderr
    assert "HTTPConnectionPool" not in played.stdout + played.stderr


def settled_deliveries(call_ids: set[str], within_s: float = 30.0) -> list:
    """The callback deliveries of ``call_ids`` once each has had its first attempt (or ``within_s`` passed)."""
    from sqlalchemy import select

    from models import db
    from models.calls import CallbackDelivery

    deadline = time.monotonic() + within_s
    while True:
        with db.session() as s:
            rows = s.scalars(select(CallbackDelivery).where(CallbackDelivery.tool_call_id.in_(call_ids),
                                                            CallbackDelivery.url.is_not(None))).all()
        if all(row.attempts or row.state != "pending" for row in rows) or time.monotonic() > deadline:
            return rows
        time.sleep(0.2)


def completed_posted_late(monkeypatch, late_s: float) -> None:
    """Each ``completed`` event's post leaves the worker ``late_s`` after the resume's answer, as on a busy
    machine (the in-process worker's threads are quick enough to win the race otherwise)."""
    from tasks.delivery import transport

    exchange = transport.exchange

    def late(url, body, headers, *args, **kwargs):
        if headers.get("X-Voice-Tools-Event") == "completed":
            time.sleep(late_s)
        return exchange(url, body, headers, *args, **kwargs)

    monkeypatch.setattr(transport, "exchange", late)


@pytest.fixture
def completed_comes_late(monkeypatch):
    completed_posted_late(monkeypatch, LATE_S)


def test_every_scenario_leaves_no_failed_delivery_behind(worker, api_url, completed_comes_late, capsys):
    """The demo's receiver stays up until every event it expects has come (the ``completed`` one after the
    resume's answer): each of the scenarios' callbacks is delivered at its first attempt."""
    from tests.conftest import API_TOKEN
    from voice_tools import demo as the_demo
    from voice_tools_backends import load_demo

    load_demo()
    secrets = the_demo.Secrets(os.environ["VOICE_TOOLS_CALLBACK_SECRET"],
                               parse_secrets(os.environ["VOICE_TOOLS_CALLBACK_SECRETS"]))
    finals = the_demo.play(api_url, API_TOKEN, secrets, "all")
    out = capsys.readouterr().out
    assert [final["status"] for final in finals] == ["COMPLETED"] * 6, out
    written = {final["tool_call_id"] for final in finals if final["function_name"] in ("send_email", "schedule_meeting")}
    assert len(written) == 3
    deliveries = settled_deliveries(written)
    assert {(d.tool_call_id, d.event) for d in deliveries if d.event in ("checkpoint", "completed")} == \
        {(call_id, event) for call_id in written for event in ("checkpoint", "completed")}
    failed = [(d.tool_call_id, d.event, d.state, d.attempt_log) for d in deliveries
              if d.state != "delivered" or d.attempts != 1]
    assert failed == [], f"{failed}\n{out}"
    assert out.count("callback completed") == 3, out  # the demo saw each one come


def test_with_nothing_running_the_demo_says_only_that_in_one_sentence(tmp_path, monkeypatch):
    """No run recorded and nothing on port 8000's stand-in: no line of the conversation is printed before the
    error, which is one sentence with no brackets inside brackets."""
    port = free_port()  # nothing listens there
    env = {k: v for k, v in bare_env(VOICE_TOOLS_DATA_DIR=str(tmp_path)).items() if k not in RUN_VARIABLES}
    played = subprocess.run([sys.executable, "-m", "voice_tools", "demo", "--token", "t"], cwd=ROOT,
                            env={**env, "PORT": str(port)}, capture_output=True, text=True, timeout=60,
                            stdin=subprocess.DEVNULL)
    assert played.returncode == 1
    assert played.stdout == "", played.stdout  # not the caller's first line
    assert played.stderr.strip().splitlines() == [
        f"voice-tools demo failed: nothing answers at http://127.0.0.1:{port} (taken from PORT). Is `voice-tools "
        "run` running? Start it, or give the API's address with --url."], played.stderr


def test_the_default_address_is_said_without_brackets_in_brackets(tmp_path, monkeypatch):
    from voice_tools import demo as the_demo

    for name in RUN_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("VOICE_TOOLS_DATA_DIR", str(tmp_path))
    url, source = the_demo.api_url(None)
    assert url == "http://127.0.0.1:8000"
    assert source == f"the default; no run is recorded in {tmp_path}"


def test_an_event_that_does_not_come_is_said_within_the_bound(worker, api_url, monkeypatch, capsys):
    """The ``completed`` callback later than the demo waits for (2 s here, 30 s in the command): the demo
    says which event did not come, and what did, instead of waiting on."""
    from tests.conftest import API_TOKEN
    from voice_tools import demo as the_demo

    monkeypatch.setattr(the_demo, "WAIT_S", 2)
    completed_posted_late(monkeypatch, 4.0)
    secrets = the_demo.Secrets(os.environ["VOICE_TOOLS_CALLBACK_SECRET"],
                               parse_secrets(os.environ["VOICE_TOOLS_CALLBACK_SECRETS"]))
    with pytest.raises(the_demo.DemoError) as said:
        the_demo.play(api_url, API_TOKEN, secrets, "email")
    assert str(said.value) == "the completed callback did not come within 2 s (callbacks that came: progress)", \
        capsys.readouterr().out


def test_the_readmes_tour_has_the_reader_paste_nothing_by_hand():
    """The tour's commands capture the token and the call's id in shell variables: no `tc_...` or `T=...` to fill
    in (its API part was run as written against a `voice-tools run`)."""
    readme = (ROOT / "README.md").read_text()
    tour = readme.split("\n## A 30-second tour\n", 1)[1].split("\n## ", 1)[0]
    commands = "\n".join(block.split("```", 1)[0] for block in tour.split("```sh\n")[1:])
    assert "tc_..." not in commands and "=..." not in commands, commands
    assert 'ID=$(curl -s -X POST $API/voice-tools/pending' in commands
    assert "/voice-tools/confirm/$ID?wait=10" in commands and "/voice-tools/resume/$ID?wait=10" in commands
    assert "calls show $ID" in commands
