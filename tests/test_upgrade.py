"""An upgrade from the previous release to this one with calls in flight, in the documented order.

The previous release (``support/releases.py``: the newest release of CHANGELOG.md older than this
one, found from the history) runs from its own tree and lock, its Procfile's processes on a database
and a broker of this test's own, with calls in every state: PENDING, PREPARED at the checkpoint,
EXECUTING with their links queued behind a stopped worker, and an event stream open. Then the order
``docs/operations.md`` ("Upgrading") gives: this release's workers started before the migration
consume nothing (when it needs a newer schema than the previous release's; on the same schema they serve); ``voice-tools migrate`` under the running processes (from 0.1.0, whose processes do not
prepare a refused plan again, they are restarted right after it, as the docs say for that hop); the web
process replaced, the workers replaced with a warm shutdown, beat replaced; the calls confirmed and
resumed through the new API; the stream reconnected with ``Last-Event-ID``. Then the rollback the docs
give: the previous release's code first, then ``voice-tools migrate --to`` its revision, which keeps
the data, and a call through the previous release again.

Held: every call COMPLETED, each email sent once, every callback verified with ``standardwebhooks``,
no ``seq`` gap or repeat in the callbacks or the stream, no event lost across the reconnect, no 5xx
answered, no traceback logged.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import requests
from sqlalchemy import create_engine, make_url, text
from standardwebhooks import Webhook

from models import release, schema
from support.relay import Relay
from support.releases import installed, previous_release
from support.sse_client import Stream
from support.system import System
from tasks.delivery.signing import parse_secrets

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
WORKERS = ("writes", "reads", "callbacks")
EMAIL = {"to": "john@example.com", "subject": "Upgrade", "body": "Sent once."}


@pytest.fixture(scope="module")
def previous():
    return installed(previous_release(release.VERSION))


@pytest.fixture
def database_url():
    """A database of this test's own in this run's PostgreSQL."""
    base = os.environ["DATABASE_URL"]
    name = f"vt_upgrade_{os.getpid()}"
    admin = create_engine(base.replace("postgresql://", "postgresql+psycopg2://", 1), isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f"DROP DATABASE IF EXISTS {name}"))
        conn.execute(text(f"CREATE DATABASE {name}"))
    url = make_url(base).set(database=name).render_as_string(hide_password=False)
    try:
        yield url
    finally:
        with admin.connect() as conn:
            conn.execute(text(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
        admin.dispose()


class Api:
    """The relay's side: every answer kept, to hold the 5xx count at zero."""

    def __init__(self, url: str, headers: dict[str, str]):
        self.url, self.headers = url, headers
        self.answers: list[tuple[str, int]] = []

    def call(self, method: str, path: str, **kw: Any) -> requests.Response:
        answer = requests.request(method, f"{self.url}{path}", headers=self.headers, timeout=40, **kw)
        self.answers.append((f"{method} {path}", answer.status_code))
        assert answer.status_code < 500, (method, path, answer.status_code, answer.text)
        return answer

    def record(self, session: str, callback: str) -> str:
        answer = self.call("POST", "/voice-tools/pending", json={
            "session_id": session, "function": "send_email", "parameters": EMAIL, "callback_url": callback})
        assert answer.status_code == 201, answer.text
        return answer.json()["tool_call_id"]

    def status(self, tool_call_id: str) -> dict[str, Any]:
        return self.call("GET", f"/voice-tools/status/{tool_call_id}").json()


def run(bin_dir: Path | None, cwd: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    command = [str(bin_dir / "voice-tools")] if bin_dir else [sys.executable, "-m", "voice_tools"]
    done = subprocess.run([*command, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (args, done.stdout, done.stderr)
    return done


class Collector:
    """The session's event stream read in a thread; reconnected with ``Last-Event-ID`` to another URL."""

    def __init__(self, headers: dict[str, str], session: str):
        self.headers, self.session = headers, session
        self.events: list[tuple[str, dict[str, Any]]] = []
        self.stream: Stream | None = None
        self.thread: threading.Thread | None = None

    def open(self, url: str) -> None:
        headers = dict(self.headers)
        if self.events:
            headers["Last-Event-ID"] = self.events[-1][0]
        self.stream = Stream(f"{url}/voice-tools/events/{self.session}", headers)
        assert self.stream.response.status_code == 200
        stream = self.stream

        def read() -> None:
            try:
                while True:
                    self.events.append(stream.next_event())
            except Exception:  # closed
                return

        self.thread = threading.Thread(target=read, daemon=True)
        self.thread.start()

    def close(self) -> None:
        if self.stream is not None:
            self.stream.close()
            self.thread.join(10)


def wait_until(check, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.3)


def schema_head(previous, env: dict[str, str]) -> str:
    """The newest revision the previous release's migrations know."""
    head = subprocess.run([str(previous.bin / "python"), "-c",
                           "from alembic.script import ScriptDirectory; from voice_tools import servers; "
                           "print(ScriptDirectory.from_config(servers.alembic_config()).get_current_head())"],
                          cwd=previous.root, env=env, capture_output=True, text=True, timeout=60)
    assert head.returncode == 0 and head.stdout.strip(), head.stderr
    return head.stdout.strip()


def test_an_upgrade_from_the_previous_release_with_calls_in_flight_loses_nothing(previous, database_url, tmp_path):
    old = System(tmp_path / "old", release=previous, DATABASE_URL=database_url)
    shared = {k: v for k, v in old.env.items()
              if k.startswith(("VOICE_TOOLS_API_TOKENS", "VOICE_TOOLS_CALLBACK_SECRET", "FLOWER_BASIC_AUTH"))}
    new = System(tmp_path / "new", redis=old.redis, DATABASE_URL=database_url, PORT=str(old.port),
                 VOICE_TOOLS_PUBLIC_URL=old.url, **shared)
    new.port, new.url = old.port, old.url  # the relays' address stays
    run(previous.bin, previous.root, old.env, "migrate")
    old.redis.start()
    relay = Relay(secret=old.env["VOICE_TOOLS_CALLBACK_SECRET"],
                  webhook_secrets=parse_secrets(old.env["VOICE_TOOLS_CALLBACK_SECRETS"]))
    relay.__enter__()
    stream = Collector(old.auth, "s_upgrade")
    try:
        for name in ("web", *WORKERS, "beat"):
            old.start_process(name)
        old.wait_ready()
        api = Api(old.url, old.auth)
        stream.open(old.url)
        hook = relay.url
        pending = [api.record("s_upgrade", hook) for _ in range(3)]
        prepared = [api.record("s_upgrade", hook) for _ in range(3)]
        for tool_call_id in prepared:
            assert api.call("POST", f"/voice-tools/confirm/{tool_call_id}?wait=20").json()["status"] == "PREPARED"
        old.stop_process("writes")  # as in a worker restart: its queue fills
        queued = [api.record("s_upgrade", hook) for _ in range(3)]
        for tool_call_id in queued:
            assert api.call("POST", f"/voice-tools/confirm/{tool_call_id}").json()["status"] == "EXECUTING"

        previous_head = schema_head(previous, old.env)
        # the wrong order first: this release's worker before the migration takes nothing (when this release
        # needs a newer schema; on the same schema it serves at once, which is the rolling order too)
        new.start_process("writes")
        checked = subprocess.run([sys.executable, "-m", "voice_tools", "migrate", "--check"], cwd=ROOT, env=new.env,
                                 capture_output=True, text=True, timeout=120)
        if previous_head != schema.NEWEST:
            wait_until(lambda: "this release needs revision" in new.log("writes"), 90, new.log("writes")[-3000:])
            time.sleep(2)
            assert all(api.status(t)["status"] == "EXECUTING" for t in queued)
            assert checked.returncode == 1 and "would run" in checked.stdout, checked.stdout + checked.stderr
        else:
            assert checked.returncode == 0, checked.stdout + checked.stderr

        # the migration, under the previous release's running processes
        run(None, ROOT, new.env, "migrate")
        if previous.release.version == "0.1.0":  # its processes do not prepare a refused plan again
            for name in ("web", "reads", "callbacks", "beat"):
                old.stop_process(name)
                old.start_process(name)
            old.wait_ready(("reads", "callbacks"))
        for tool_call_id in pending + prepared + queued:
            api.status(tool_call_id)  # the previous release's web answers on the new schema

        # the web replaced (same address), the workers with a warm shutdown, then beat
        old.stop_process("web")
        new.start_process("web")
        new.wait_api_ready()
        stream.close()
        stream.open(new.url)
        api = Api(new.url, new.auth)
        for name in ("reads", "callbacks"):
            old.stop_process(name)
            new.start_process(name)
        old.stop_process("beat")
        new.start_process("beat")
        new.wait_ready(WORKERS)

        for tool_call_id in queued:  # the links queued behind the stopped worker ran on this release's
            wait_until(lambda: api.status(tool_call_id)["status"] == "PREPARED", 60, f"{tool_call_id} not PREPARED")
        for tool_call_id in pending:
            assert api.call("POST", f"/voice-tools/confirm/{tool_call_id}?wait=20").json()["status"] == "PREPARED"
        for tool_call_id in pending + prepared + queued:
            done = api.call("POST", f"/voice-tools/resume/{tool_call_id}?wait=20", json={"action": "proceed"})
            assert done.json()["status"] == "COMPLETED", done.text
        every = pending + prepared + queued
        wait_until(lambda: all([e["event"] for e in relay.events_for(t)][-1:] == ["completed"] for t in every),
                   30, "a completed callback missing")
        wait_until(lambda: {d.get("tool_call_id") for _, d in stream.events if d.get("event") == "completed"}
                   >= set(every), 30, "a completed event missing from the stream")

        with create_engine(database_url.replace("postgresql://", "postgresql+psycopg2://", 1)).connect() as conn:
            sent = dict(conn.execute(text("SELECT tool_call_id, count(*) FROM email_outbox GROUP BY tool_call_id")).all())
            statuses = dict(conn.execute(text("SELECT tool_call_id, status FROM tool_calls")).all())
        assert sent == {t: 1 for t in every}, sent
        assert statuses == {t: "COMPLETED" for t in every}, statuses

        assert relay.bad_signatures == 0
        webhooks = [Webhook(secret) for secret in parse_secrets(old.env["VOICE_TOOLS_CALLBACK_SECRETS"])]
        for body, headers in zip(relay.bodies, relay.headers):
            lowered = {k.lower(): v for k, v in headers.items()}
            webhooks[0].verify(body, lowered)  # raises unless signed with the secret
        by_call: dict[str, list[int]] = defaultdict(list)
        for event in relay.events:
            by_call[event["tool_call_id"]].append(event["seq"])
        for tool_call_id in every:
            seqs = sorted(set(by_call[tool_call_id]))
            assert seqs == list(range(1, len(seqs) + 1)), (tool_call_id, by_call[tool_call_id])
        streamed: dict[str, list[int]] = defaultdict(list)
        for _, data in stream.events:
            if "seq" in data:
                streamed[data["tool_call_id"]].append(data["seq"])
        for tool_call_id in every:
            assert streamed[tool_call_id] == list(range(1, len(streamed[tool_call_id]) + 1)), \
                (tool_call_id, streamed[tool_call_id])  # no gap, no repeat, across the reconnect
            assert streamed[tool_call_id] == sorted(set(by_call[tool_call_id]))

        # the rollback: the previous release's code first, then the downgrade to its revision
        for name in ("web", *WORKERS, "beat"):
            new.stop_process(name)
        for name in ("web", *WORKERS, "beat"):
            old.start_process(name)
        old.wait_ready()
        run(None, ROOT, new.env, "migrate", "--to", previous_head)
        run(previous.bin, previous.root, old.env, "migrate")  # the previous release knows its schema again
        api = Api(old.url, old.auth)
        again = api.record("s_rollback", hook)
        assert api.call("POST", f"/voice-tools/confirm/{again}?wait=20").json()["status"] == "PREPARED"
        done = api.call("POST", f"/voice-tools/resume/{again}?wait=20", json={"action": "proceed"})
        assert done.json()["status"] == "COMPLETED", done.text
        with create_engine(database_url.replace("postgresql://", "postgresql+psycopg2://", 1)).connect() as conn:
            kept = conn.execute(text("SELECT count(*) FROM tool_calls WHERE link_attempts <> '[]'::jsonb")).scalar()
            revision = conn.execute(text("SELECT version_num FROM alembic_version")).scalar()
        assert revision == previous_head
        assert kept >= len(every), kept  # the downgrade kept this release's data

        logs = {f"{side}/{name}": system.log(name) for side, system in (("old", old), ("new", new))
                for name in ("web", *WORKERS, "beat")}
        assert [name for name, text_ in logs.items() if "Traceback" in text_] == [], \
            {name: text_[text_.index("Traceback") - 500:][:3000] for name, text_ in logs.items() if "Traceback" in text_}
    finally:
        stream.close()
        relay.__exit__(None, None, None)
        new.stop()
        old.stop()
        old.redis.kill()
