"""The logs: one JSON line per event, carrying the call it belongs to, and no secret.

The end-to-end test runs the Procfile's own ``web`` (gunicorn) and ``writes`` (Celery
worker) lines as processes, plays a send_email call through them with a known API
token, callback secret and email body, and reads everything both wrote.
"""
from __future__ import annotations

import json
import logging
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from models import logs
from tasks import app as celery_app
from tests.helpers import row, wait_status
from support.procs import ROOT, free_port
from support.relay import Relay
from tests.test_mcp import mcp_url  # noqa: F401  (the MCP server fixture)
from support.worker_process import queues_taken_from_others

TOKEN = "logs-test-token-5f0c1e"
SECRET = "logs-test-callback-secret-9d2a"
BODY = "The quarterly numbers are attached, logs-test-body-7b41."
SESSION = "sess_logs_e2e"


def procfile_command(name: str) -> str:
    for line in (ROOT / "Procfile").read_text().splitlines():
        if line.startswith(f"{name}:"):
            return line.split(":", 1)[1].strip()
    raise AssertionError(f"no {name} line in the Procfile")


class ProcfileProcess:
    """One Procfile line run as honcho runs it (``sh -c``), its stdout and stderr in one file."""

    def __init__(self, name: str, env: dict[str, str], folder: Path):
        self.name, self.out = name, folder / f"{name}.log"
        with open(self.out, "wb") as out:
            self.proc = subprocess.Popen(["sh", "-c", f"exec {procfile_command(name)}"], cwd=ROOT, env=env,
                                         stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True)

    def text(self) -> str:
        return self.out.read_text(errors="replace")

    def alive(self) -> None:
        if self.proc.poll() is not None:
            raise AssertionError(f"{self.name} exited {self.proc.returncode}:\n{self.text()[-3000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def wait_until(check, what: str, processes: list[ProcfileProcess], timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        for process in processes:
            process.alive()
        try:
            if check():
                return
        except requests.RequestException:
            pass
        assert time.monotonic() < deadline, f"{what} not ready after {timeout}s"
        time.sleep(0.3)


def lines_of(text: str) -> list[dict]:
    parsed = []
    for line in text.splitlines():
        if line.strip():
            try:
                parsed.append(json.loads(line))
            except ValueError:
                raise AssertionError(f"not a JSON line: {line!r}") from None
    return parsed


@pytest.fixture
def procfile_system(tmp_path):
    port = free_port()
    env = dict(os.environ, VOICE_TOOLS_API_TOKENS=f"logtest:{TOKEN}", VOICE_TOOLS_CALLBACK_SECRET=SECRET,
               HOST="127.0.0.1", PORT=str(port), WEB_CONCURRENCY="1", GUNICORN_THREADS="2",
               VOICE_TOOLS_WORKER_CONCURRENCY="1", PYTHONPATH=str(ROOT),
               PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
    env.pop("VOICE_TOOLS_LOG_FORMAT", None)  # the default is what is under test
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    (tmp_path / "worker-metrics").mkdir()
    env["VOICE_TOOLS_WORKER_METRICS_DIR"] = str(tmp_path / "worker-metrics")  # the worker lines require their own folder
    url = f"http://127.0.0.1:{port}"
    with queues_taken_from_others(celery_app, ["tools.send_email"]):
        started = [ProcfileProcess("web", env, tmp_path), ProcfileProcess("writes", env, tmp_path)]
        try:
            wait_until(lambda: requests.get(f"{url}/healthz", timeout=2).status_code == 200, "the API", started)
            wait_until(lambda: any(name.startswith("writes@") for reply in celery_app.control.ping(timeout=0.5)
                                   for name in reply), "the writes worker", started)
            yield url, started
        finally:
            for process in started:
                process.stop()


@pytest.mark.slow
def test_one_send_email_call_is_followed_by_its_ids_through_the_api_and_worker_logs(procfile_system):
    url, processes = procfile_system
    auth = {"Authorization": f"Bearer {TOKEN}"}
    with Relay(secret=SECRET) as relay:
        pending = requests.post(f"{url}/voice-tools/pending", headers={**auth, "X-Request-ID": "req-logs-pending"},
                                json={"session_id": SESSION, "function": "send_email",
                                      "parameters": {"to": "logs@example.com", "subject": "Numbers", "body": BODY}},
                                timeout=30)
        assert pending.status_code == 201, pending.text
        assert pending.headers["X-Request-ID"] == "req-logs-pending"
        tc = pending.json()["tool_call_id"]
        confirm = requests.post(f"{url}/voice-tools/confirm/{tc}", json={"callback_url": relay.url},
                                headers={**auth, "X-Request-ID": "req-logs-confirm"}, timeout=30)
        assert confirm.status_code == 202, confirm.text
        relay.wait_for(tc, "checkpoint", timeout=60)
        trace = "0af7651916cd43dd8448eb211c80319c"
        resume = requests.post(f"{url}/voice-tools/resume/{tc}", json={"action": "proceed"},
                               headers={**auth, "traceparent": f"00-{trace}-b7ad6b7169203331-01"}, timeout=30)
        assert resume.status_code == 202, resume.text
        assert resume.headers["X-Request-ID"] == trace
        relay.wait_for(tc, "completed", timeout=60)
        assert wait_status(tc).status == "COMPLETED"
        assert row(tc).parameters["body"] == BODY
        status = requests.get(f"{url}/voice-tools/status/{tc}", headers=auth, timeout=30)
        minted = status.headers["X-Request-ID"]
        assert len(minted) == 32 and minted not in ("req-logs-pending", "req-logs-confirm", trace)
        refused = requests.get(f"{url}/voice-tools/status/{tc}", headers={"Authorization": "Bearer wrong"}, timeout=30)
        assert refused.status_code == 401 and refused.headers["X-Request-ID"]
    for process in processes:
        process.stop()
    web, writes = (process.text() for process in processes)

    for text in (web, writes):
        for secret in (TOKEN, SECRET, BODY, "logs-test-body"):
            assert secret not in text, f"{secret!r} logged"
    web_lines, worker_lines = lines_of(web), lines_of(writes)  # every line is JSON, banners too

    requests_sent = {"req-logs-pending", "req-logs-confirm", trace, minted}
    of_call = [line for line in web_lines + worker_lines if tc in json.dumps(line)]
    refused_line, = [line for line in of_call if line.get("status") == 401]  # no session for a stranger
    assert refused_line["tool_call_id"] == tc and "session_id" not in refused_line
    for line in of_call:
        if line is not refused_line:
            assert line["tool_call_id"] == tc and line.get("session_id") == SESSION, line
            assert line["request_id"] in requests_sent, line

    access = {line["request_id"]: line for line in web_lines if line["logger"] == "gunicorn.access"}
    assert set(access) >= requests_sent
    assert access["req-logs-pending"]["path"] == "/voice-tools/pending"
    assert access["req-logs-pending"]["status"] == 201
    assert access[minted]["method"] == "GET" and access[minted]["tool_call_id"] == tc
    assert all(access[rid]["tool_call_id"] == tc and access[rid]["session_id"] == SESSION for rid in requests_sent)

    in_tasks = [line for line in worker_lines if line.get("tool_call_id") == tc]
    steps = ("PREPARING", "SENDING")  # READY_TO_SEND and COMPLETED have no work of their own: no links of their own
    assert {line["task"] for line in in_tasks} == {f"tools.send_email.{step}" for step in steps}, in_tasks
    for line in in_tasks:
        assert line["task_id"] and line["task"].startswith("tools.send_email.") and line["step"], line
        assert line["task"].endswith("." + line["step"]), line
    # the link up to the checkpoint ran for the confirm, the one after it for the resume
    by_request = {line["step"]: (line["request_id"], line.get("trace_id")) for line in in_tasks}
    assert by_request == {"PREPARING": ("req-logs-confirm", None), "SENDING": (trace, trace)}, by_request
    assert access[trace]["trace_id"] == trace and "trace_id" not in access["req-logs-confirm"]
    assert any(line["message"].startswith("worker writes@") for line in worker_lines)


def test_the_request_id_sent_is_answered_back_or_one_is_made(client):
    assert client.get("/healthz", headers={"X-Request-ID": "abc-123"}).headers["X-Request-ID"] == "abc-123"
    made = client.get("/healthz", headers={"X-Request-ID": "no spaces; or {braces}"}).headers["X-Request-ID"]
    assert len(made) == 32 and made.isalnum()
    made = client.get("/healthz", headers={"traceparent": "00-" + "0" * 32 + "-b7ad6b7169203331-01"})
    assert made.headers["X-Request-ID"] != "0" * 32  # an invalid trace id is not taken
    assert client.get("/voice-tools/tools").headers["X-Request-ID"]  # a 401 too


def test_a_request_logs_with_its_call_and_session(client):
    seen = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(json.loads(self.format(record)))

    keep = Keep()
    keep.setFormatter(logs.JsonLines())
    keep.addFilter(logs.ContextFilter())
    logger = logging.getLogger("app.test_logs")
    logger.addHandler(keep)
    logger.setLevel(logging.INFO)
    try:
        @client.application.after_request
        def _say(response):
            logger.info("answered %s", response.status_code)
            return response

        headers = {"Authorization": "Bearer test-token", "X-Request-ID": "req-in-app"}
        tc = "tc_0123456789ab"  # the relay's id: bound from the body
        answer = client.post("/voice-tools/pending", headers=headers,
                             json={"session_id": "sess_in_app", "function": "send_email", "tool_call_id": tc,
                                   "parameters": {"to": "a@example.com", "subject": "S", "body": BODY}})
        assert answer.status_code == 201, answer.get_json()
        client.get(f"/voice-tools/status/{tc}", headers={**headers, "X-Request-ID": "req-status"})
    finally:
        logger.removeHandler(keep)
    assert [(line["request_id"], line["tool_call_id"], line["session_id"]) for line in seen] == [
        ("req-in-app", tc, "sess_in_app"), ("req-status", tc, "sess_in_app")]
    assert not logs.current(), "nothing stays bound after a request"


def test_text_format_for_humans(monkeypatch):
    monkeypatch.setenv(logs.FORMAT_VARIABLE, "text")
    record = logging.LogRecord("x", logging.INFO, __file__, 1, "hello %s", ("there",), None)
    with logs.bound(tool_call_id="tc_abc", request_id="r1"):
        logs.ContextFilter().filter(record)
    line = logs.formatter().format(record)
    assert line.endswith("INFO x: hello there [request_id=r1 tool_call_id=tc_abc]"), line
    monkeypatch.delenv(logs.FORMAT_VARIABLE)
    assert json.loads(logs.formatter().format(record))["tool_call_id"] == "tc_abc"


def test_each_json_line_names_the_release_that_wrote_it():
    from models import release

    record = logging.LogRecord("x", logging.INFO, __file__, 1, "hello", (), None)
    assert json.loads(logs.JsonLines().format(record))["version"] == release.VERSION


CONTROLS = "".join(chr(c) for c in (*range(0x00, 0x20), 0x7f, *range(0x80, 0xa0)))  # C0, DEL, C1


@pytest.mark.parametrize("chosen", ["text", "json"])
def test_every_line_escapes_control_characters_in_every_format(monkeypatch, chosen):
    """A control character (C0, DEL, C1) in a message, an argument, a context field or an exception's text
    never reaches the line raw: a terminal shown the log runs no escape sequence, and a newline forges no line."""
    monkeypatch.setenv(logs.FORMAT_VARIABLE, chosen)
    try:
        raise ValueError(f"boom{CONTROLS}")
    except ValueError:
        exc_info = sys.exc_info()
    record = logging.LogRecord("x\x9b", logging.WARNING, __file__, 1, f"sent %s{CONTROLS}", (f"\x1b[31m{CONTROLS}",),
                               exc_info)
    with logs.bound(tool_call_id=f"tc_{CONTROLS}", session_id="sess\u009b"):
        logs.ContextFilter().filter(record)
    line = logs.formatter().format(record)
    if chosen == "text":  # a traceback keeps its own line ends, and nothing else
        assert [c for c in line if c in CONTROLS] == ["\n"] * line.count("\n") and line.count("\n") >= 3, line
        head = line.split("\n", 1)[0]
        assert "\\x1b[31m" in head and "\\x9b" in head and "tool_call_id=tc_\\x00" in head, head
        assert "\\x7f\\x80" in line.rsplit("\n", 1)[1], line  # the exception's own text
    else:
        assert "\n" not in line and not [c for c in line if c in CONTROLS], repr(line)
        found = json.loads(line)  # the same text, read back
        assert found["message"] == f"sent \x1b[31m{CONTROLS}{CONTROLS}" and found["tool_call_id"] == f"tc_{CONTROLS}"
        assert found["exc_info"].endswith(f"boom{CONTROLS}")


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_an_mcp_call_runs_its_links_under_the_mcp_requests_id(anyio_backend, mcp_url, worker, relay):
    from celery import signals

    import httpx2
    from mcp import Client
    from mcp.client.streamable_http import streamable_http_client

    from tests.test_mcp import MCP_TOKEN, answer

    seen: list[dict[str, str]] = []

    def _in_task(sender=None, **_):
        seen.append({**logs.current(), "name": sender.name})

    signals.task_prerun.connect(_in_task)  # after tasks.worker.log_context's receiver: the task's context is bound
    try:
        headers = {"Authorization": f"Bearer {MCP_TOKEN}", "X-Request-ID": "req-over-mcp"}
        async with httpx2.AsyncClient(headers=headers) as http:
            async with Client(streamable_http_client(mcp_url, http_client=http)) as mcp:
                pending = await answer(mcp, "request_tool", {
                    "session_id": "sess_mcp_logs", "function": "send_email", "callback_url": relay.url,
                    "parameters": {"to": "mcp@example.com", "subject": "Over MCP", "body": BODY}})
                tc = pending["tool_call_id"]
                await answer(mcp, "confirm_tool", {"tool_call_id": tc})
                relay.wait_for(tc, "checkpoint")
    finally:
        signals.task_prerun.disconnect(_in_task)
    links = [context for context in seen if context.get("tool_call_id") == tc]
    assert [context["step"] for context in links] == ["PREPARING"], seen  # which also did READY_TO_SEND
    for context in links:
        assert context["request_id"] == "req-over-mcp" and context["session_id"] == "sess_mcp_logs", context
