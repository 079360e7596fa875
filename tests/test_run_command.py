"""``voice-tools run`` as a user starts it: embedded servers, migrations, ``Procfile.local``
under honcho's manager in that process (gunicorn, MCP loaded at its first connection, one worker for every queue with
beat and the workers' /metrics inside it, Flower); the API answers, Flower asks for its password and shows the tools' tasks and queues, the demo
plays its scenarios through the real worker, ``voice-tools env`` and ``migrate``
come and go beside it, ``voice-tools footprint`` measures it, and SIGTERM leaves no process
behind.

One system is started for the whole module (it takes a while on two cores); the tests
run in file order and the last one stops it.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import pytest
import requests

from tasks import app as celery_app
from tasks import tools
from support.procs import (ROOT, bare_env, describe, free_port, running, running_with, stop_process, voice_tools,
                           wait_listening, wait_none_running)

pytestmark = pytest.mark.slow  # the whole system, started once for the module

TOKEN = "run-command-test-token"
SECRET = "run-command-test-secret"
FLOWER_AUTH = ("ops", "flower-test-password")
START_TIMEOUT = 180


class System:
    def __init__(self) -> None:
        self.data_dir = Path(tempfile.mkdtemp(prefix="voice-tools-run-", dir=tempfile.gettempdir()))
        self.port, self.flower_port, self.mcp_port = free_port(), free_port(), free_port()
        self.metrics_port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.flower_url = f"http://127.0.0.1:{self.flower_port}"
        self.env = bare_env(
            VOICE_TOOLS_DATA_DIR=str(self.data_dir),
            PORT=str(self.port),
            FLOWER_PORT=str(self.flower_port),
            MCP_PORT=str(self.mcp_port),
            WORKER_METRICS_PORT=str(self.metrics_port),
            VOICE_TOOLS_API_TOKENS=f"runtest:{TOKEN}",
            VOICE_TOOLS_CALLBACK_SECRET=SECRET,
            VOICE_TOOLS_CALLBACK_HOSTS="127.0.0.1",
            FLOWER_BASIC_AUTH=":".join(FLOWER_AUTH),
            FLOWER_UNAUTHENTICATED_API="true",  # the Procfile must not let this open Flower's API
            VOICE_TOOLS_WORKER_CONCURRENCY="1",
            WEB_CONCURRENCY="1",
            # the two sweeps test_beat_ticks_inside_the_worker waits for, every 3 s (30 s and 15 s by default)
            VOICE_TOOLS_EXPIRE_EVERY="3",
            VOICE_TOOLS_CALLBACK_SWEEP_EVERY="3",
            # This checkout's code in every process, also where the console scripts come
            # from an editable install of another checkout (the same tree in CI).
            PYTHONPATH=str(ROOT),
        )
        self.env.pop("HOST", None)  # a local run's default is what is under test
        self.log_path = self.data_dir.with_suffix(".log")
        self.log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [str(Path(sys.executable).with_name("voice-tools")), "run"],
            cwd=tempfile.gettempdir(), env=self.env, stdout=self.log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def tail(self, lines: int = 60) -> str:
        return "\n".join(self.output().splitlines()[-lines:])

    def wait_healthy(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"voice-tools run exited {self.proc.returncode}:\n{self.tail()}")
            try:
                if requests.get(f"{self.url}/healthz", timeout=5).status_code == 200:
                    return
            except requests.RequestException:  # not listening yet, or workers still booting
                pass
            time.sleep(0.5)
        pytest.fail(f"/healthz did not answer 200 in {START_TIMEOUT}s:\n{self.tail()}")

    def wait_listening(self, port: int) -> None:
        if not wait_listening(port, START_TIMEOUT):
            pytest.fail(f"nothing listens on port {port} after {START_TIMEOUT}s:\n{self.tail()}")

    def api(self, method: str, path: str, **kw) -> requests.Response:
        headers = {"Authorization": f"Bearer {TOKEN}"}
        return requests.request(method, self.url + path, headers=headers, timeout=40, **kw)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=90)
        finally:
            self.log.close()

    def remove(self) -> None:
        shutil.rmtree(self.data_dir, ignore_errors=True)
        self.log_path.unlink(missing_ok=True)


@pytest.fixture(scope="module")
def system():
    started = System()
    try:
        started.wait_healthy()
        yield started
    finally:
        if started.proc.poll() is None:
            started.stop()
        left = wait_none_running(started.data_dir)
        for proc in left:  # only ours: they carry this test's data dir
            proc.kill()
        started.remove()


def test_the_api_runs_under_gunicorn_on_port(system):
    health = requests.get(f"{system.url}/healthz", timeout=5)
    assert health.status_code == 200
    assert requests.get(f"{system.url}/voice-tools/tools", timeout=5).status_code == 401  # token needed

    created = system.api("POST", "/voice-tools/pending", json={
        "session_id": "sess_run", "function": "send_email",
        "parameters": {"to": "john@example.com", "subject": "Meeting Tomorrow"},
    })
    assert created.status_code == 201, created.text
    call_id = created.json()["tool_call_id"]
    assert created.json()["status"] == "PENDING"

    status = system.api("GET", f"/voice-tools/status/{call_id}")
    assert status.status_code == 200, status.text
    body = status.json()
    assert body["tool_call_id"] == call_id and body["status"] == "PENDING"
    assert body["parameters"]["to"] == "john@example.com"
    assert body["caller"] == "runtest"

    ready = system.api("GET", "/readyz")
    assert ready.status_code == 200, ready.text


def test_the_mcp_face_is_served_by_the_apis_worker_behind_the_token(system):
    """No MCP process: gunicorn's master listens on MCP_PORT from the start, and its worker loads the face
    (the MCP SDK, pydantic ...) at its first connection and serves it."""
    deadline = time.monotonic() + START_TIMEOUT
    while not (face := [proc for proc in running(system.data_dir) if _alive(proc) and _listens(proc, system.mcp_port)]):
        assert time.monotonic() < deadline, f"nothing listens on port {system.mcp_port}:\n{system.tail()}"
        time.sleep(0.5)
    web = [proc for proc in face if "gunicorn" in " ".join(proc.cmdline())]
    assert web == face and len(face) == 2, describe(face)  # the master, which bound it, and its one worker
    master = next(proc for proc in face if proc.ppid() not in {p.pid for p in face})
    worker = next(proc for proc in face if proc.ppid() == master.pid)
    assert _listens(master, system.port) and not any("voice-tools mcp" in " ".join(p.cmdline())
                                                     for p in running(system.data_dir))
    assert not any("pydantic_core" in mapped.path for mapped in worker.memory_maps()), "loaded before it was used"
    mcp = f"http://127.0.0.1:{system.mcp_port}"
    assert requests.get(f"{mcp}/healthz", timeout=60).status_code == 200  # the first: it loads the face
    assert any("pydantic_core" in mapped.path for mapped in worker.memory_maps())
    hello = {"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {}}
    refused = requests.post(f"{mcp}/mcp", json=hello, timeout=60, headers={"Accept": "application/json, text/event-stream"})
    assert refused.status_code == 401 and refused.json()["error"] == "unauthorized"
    listed = requests.post(f"{mcp}/mcp", json=hello, timeout=60, headers={
        "Accept": "application/json, text/event-stream", "Authorization": f"Bearer {TOKEN}"})
    assert listed.status_code == 200, listed.text
    assert "list_tools" in {tool["name"] for tool in listed.json()["result"]["tools"]}


def test_the_api_mcp_and_flower_listen_on_the_loopback_only(system):
    """HOST unset: the Procfile's 0.0.0.0 is for production; a local run binds 127.0.0.1."""
    system.wait_listening(system.mcp_port)
    system.wait_listening(system.flower_port)
    system.wait_listening(system.metrics_port)
    ports = {system.port, system.mcp_port, system.flower_port, system.metrics_port}
    bound: dict[int, set[str]] = {port: set() for port in ports}
    for proc in running(system.data_dir):
        try:
            connections = proc.net_connections(kind="inet")
        except psutil.Error:
            continue
        for conn in connections:
            if conn.status == psutil.CONN_LISTEN and conn.laddr.port in ports:
                bound[conn.laddr.port].add(conn.laddr.ip)
    assert bound == {port: {"127.0.0.1"} for port in ports}, describe(running(system.data_dir))
    # the workers' /metrics is a thread of the worker's main process: no exporter process
    assert {proc.pid for proc in running(system.data_dir) if _listens(proc, system.metrics_port)} == worker_mains(system)


def _listens(proc: psutil.Process, port: int) -> bool:
    try:
        return any(conn.status == psutil.CONN_LISTEN and conn.laddr.port == port
                   for conn in proc.net_connections(kind="inet"))
    except psutil.Error:
        return False


def worker_mains(system: System) -> set[int]:
    """The pid of the worker's main process (not a pool child, nor honcho's `sh -c` around it)."""
    workers = [proc for proc in running(system.data_dir) if _alive(proc) and "celery -A tasks worker" in " ".join(proc.cmdline())
               and not proc.cmdline()[0].endswith("sh")]
    return {proc.pid for proc in workers if proc.ppid() not in {other.pid for other in workers}}


def test_the_banner_names_the_secrets_file_and_flowers_user_and_prints_no_secret(system):
    out = system.output()
    lines = out.splitlines()
    banner = next(i for i, line in enumerate(lines) if line.startswith("voice-tools: API on "))
    # the first lines a newcomer sees are the run's own: no library's warning before the banner
    assert all(line.startswith("voice-tools: ") for line in lines[:banner]), lines[:banner]
    secrets_file = system.data_dir / "local-secrets.json"
    assert f"local secrets kept in {secrets_file} (mode 0600)" in out
    assert "Flower user: ops" in out
    assert "listening on 127.0.0.1 only" in out
    assert f"API on http://127.0.0.1:{system.port}" in out
    assert f"worker metrics on http://127.0.0.1:{system.metrics_port}/metrics" in out
    stored = json.loads(secrets_file.read_text())
    for secret in (TOKEN, SECRET, FLOWER_AUTH[1], *stored.values()):
        assert secret not in out  # every secret was set: none is printed, not even the API token
    assert "superuser privileges" not in out  # Celery's root warning, once per worker start
    if os.geteuid() == 0:
        assert "running as root: Celery's superuser warning is silenced for this local run" in out


def declared_queues() -> set[str]:
    return {queue.name for queue in celery_app.conf.task_queues}


def flower_get(system: System, path: str, **params) -> requests.Response:
    return requests.get(f"{system.flower_url}{path}", params=params, auth=FLOWER_AUTH, timeout=30)


def test_flower_knows_the_worker_without_a_refresh_and_logs_no_failed_inspection(system):
    """Flower starts before the worker: it learns of it from its events, with no ``?refresh=1``, and
    logs no "Inspect method … failed" for an inspection nobody could answer yet."""
    system.wait_listening(system.flower_port)
    deadline = time.monotonic() + 60
    seen: dict[str, set[str]] = {}
    while time.monotonic() < deadline:
        answer = flower_get(system, "/api/workers")  # no refresh: what Flower knows by itself
        assert answer.status_code == 200, answer.text
        seen = {name.split("@")[0]: {q["name"] for q in info.get("active_queues") or []}
                for name, info in answer.json().items()}
        if seen.get("worker"):
            break
        time.sleep(1)
    assert seen == {"worker": declared_queues()}
    assert "Inspect method" not in system.output(), [line for line in system.output().splitlines()
                                                     if "Inspect method" in line]


def test_flower_needs_its_password_and_sees_one_worker_consuming_every_queue(system):
    """The local run's one worker consumes every tool's queue, ``callbacks`` and ``maintenance``."""
    workers_url = f"{system.flower_url}/api/workers"
    system.wait_listening(system.flower_port)  # Flower may come up after the API
    assert requests.get(workers_url, timeout=10).status_code == 401
    assert requests.get(workers_url, auth=("ops", "wrong"), timeout=10).status_code == 401

    expected = {"worker": declared_queues()}
    assert expected["worker"] >= {tool.queue for tool in tools.TOOLS.values()} | {"callbacks", "maintenance"}
    deadline = time.monotonic() + 60
    seen: dict[str, set[str]] = {}
    while time.monotonic() < deadline:
        answer = flower_get(system, "/api/workers", refresh="1")
        assert answer.status_code == 200, answer.text
        seen = {name.split("@")[0]: {q["name"] for q in info.get("active_queues") or []}
                for name, info in answer.json().items()}
        if seen == expected:
            break
        time.sleep(1)
    assert seen == expected


def celery_command(*args: str) -> list[str]:
    """Celery's own command line (the ``celery`` script of this Python), on the ``tasks`` app."""
    return [str(Path(sys.executable).with_name("celery")), "-A", "tasks", *args]


def second_terminal(system: System, **extra: str) -> dict[str, str]:
    """A second terminal: no server variable exported (no DATABASE_URL, REDIS_URL, CELERY_BROKER_URL), only
    the run's data dir (a terminal in the folder of ``./.voice-tools`` needs not even that)."""
    return bare_env(VOICE_TOOLS_DATA_DIR=str(system.data_dir), PYTHONPATH=str(ROOT), **extra)


def test_celerys_own_inspect_and_status_from_a_second_terminal_reach_the_run(system):
    """``celery -A tasks inspect ping|active_queues`` and ``status`` with no exports: the tasks app joins the
    data dir's embedded Redis (not Celery's default redis://127.0.0.1:6379/0), and the run's worker answers."""
    def celery(*args: str, **env: str) -> subprocess.CompletedProcess:
        done = subprocess.run(celery_command(*args), env=second_terminal(system, **env), cwd=tempfile.gettempdir(),
                              capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
        assert done.returncode == 0, done.stdout + done.stderr
        return done

    pinged = celery("inspect", "ping", "--timeout", "5").stdout
    assert "worker@" in pinged and "pong" in pinged, pinged
    listed = celery("inspect", "active_queues", "--json", "--timeout", "5").stdout
    answers = json.loads(listed)
    assert [name.split("@")[0] for name in answers] == ["worker"], listed
    assert {q["name"] for q in next(iter(answers.values()))} == declared_queues()
    # the data dir given as the option every command of the tasks app takes
    status = subprocess.run(celery_command("status", "--timeout", "5", "--data-dir", str(system.data_dir)),
                            env=bare_env(PYTHONPATH=str(ROOT)), cwd=tempfile.gettempdir(), capture_output=True,
                            text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert status.returncode == 0, status.stdout + status.stderr
    assert "1 node online." in status.stdout and "worker@" in status.stdout, status.stdout

    from voice_tools import servers

    assert servers.redis_users(system.data_dir / "redis") == [system.proc.pid]  # they joined, and left it running


def test_celerys_own_events_dump_from_a_second_terminal_sees_the_runs_worker(system):
    dump = subprocess.Popen(celery_command("events", "--dump"), env=second_terminal(system, PYTHONUNBUFFERED="1"),
                            cwd=tempfile.gettempdir(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            stdin=subprocess.DEVNULL)
    seen: list[str] = []

    def read() -> None:  # in a thread: no read blocks the test
        for line in dump.stdout:
            seen.append(line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not any("worker@" in line and "heartbeat" in line for line in seen):
            time.sleep(0.5)
    finally:
        assert stop_process(dump) in (0, -signal.SIGTERM, 128 + signal.SIGTERM)
        reader.join(10)
    assert any("worker@" in line and "heartbeat" in line for line in seen), "".join(seen)[-3000:]

    from voice_tools import servers

    assert servers.redis_users(system.data_dir / "redis") == [system.proc.pid]


def test_flowers_metrics_need_its_password_and_no_command_line_shows_it(system):
    system.wait_listening(system.flower_port)
    metrics = f"{system.flower_url}/metrics"
    assert requests.get(metrics, timeout=10).status_code == 401
    assert requests.get(metrics, auth=("ops", "wrong"), timeout=10).status_code == 401
    answer = requests.get(metrics, auth=FLOWER_AUTH, timeout=10)
    assert answer.status_code == 200 and "flower_" in answer.text, answer.text[:300]

    # no Flower process: the run's own process serves it
    flowers = {proc.pid for proc in running(system.data_dir) if _alive(proc) and _listens(proc, system.flower_port)}
    assert flowers == {system.proc.pid}, describe(running(system.data_dir))
    for proc in running(system.data_dir):  # the run's, honcho's `sh -c` around each line, and every other
        try:
            cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue  # ended meanwhile
        assert FLOWER_AUTH[1] not in cmdline, (proc.pid, cmdline.replace("\0", " "))


def test_beat_ticks_inside_the_worker(system):
    """No beat process: the worker's embedded beat sends the sweeps, which the same worker runs."""
    deadline = time.monotonic() + 90
    done: set[str] = set()
    while time.monotonic() < deadline and not {"maintenance.expire_stale", "maintenance.retry_callbacks"} <= done:
        answer = flower_get(system, "/api/tasks", state="SUCCESS")
        assert answer.status_code == 200, answer.text
        done = {task["name"] for task in answer.json().values() if task["worker"].startswith("worker@")}
        time.sleep(1)
    assert {"maintenance.expire_stale", "maintenance.retry_callbacks"} <= done, done
    assert "Scheduler: Sending due task" in system.output()
    # a thread of the worker's main process, not a forked process: its JSON line carries that pid
    starting = [json.loads(line.partition("| ")[2]) for line in system.output().splitlines() if "beat: Starting" in line]
    assert starting, system.output()[-3000:]
    mains = worker_mains(system)
    assert len(mains) == 1 and {line["pid"] for line in starting} == mains, (starting, mains)
    commands = [" ".join(proc.cmdline()) for proc in running(system.data_dir) if _alive(proc)]
    assert not any("celery -A tasks beat" in command for command in commands), commands


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def test_the_demo_plays_the_updating_email_scenario(system):
    played = subprocess.run(
        [str(Path(sys.executable).with_name("voice-tools")), "demo", "--url", system.url],
        env=system.env, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
    )
    out = played.stdout
    assert played.returncode == 0, out + played.stderr
    assistant = [line for line in out.splitlines() if line.startswith("Assistant:")]
    # pending, modify, confirm, checkpoint, resume: five things said, each with the address
    assert len(assistant) == 5, out
    assert "john@example.com" in assistant[0]
    assert all("john.smith@example.com" in line for line in assistant[1:]), assistant
    assert "callback checkpoint step=READY_TO_SEND status=PREPARED" in out
    trail = "PENDING -> MODIFIED -> PENDING -> EXECUTING -> PREPARED -> EXECUTING -> COMPLETED"
    assert trail in out

    call_id = next(line.split()[0] for line in out.splitlines() if line.startswith("    tc_"))
    final = system.api("GET", f"/voice-tools/status/{call_id}").json()
    assert final["status"] == "COMPLETED"
    assert final["parameters"]["to"] == "john.smith@example.com"
    assert final["result"]["to"] == "john.smith@example.com" and final["result"]["message_id"]
    assert [(c["field"], c["old"], c["new"]) for c in final["parameters_history"]] == \
        [("to", "john@example.com", "john.smith@example.com")]


def test_the_demo_in_a_second_terminal_finds_the_runs_port_in_the_data_dir(system):
    """No --url, no PORT nor VOICE_TOOLS_PUBLIC_URL (the run's port is not 8000): the data dir's run record."""
    assert json.loads((system.data_dir / "run.json").read_text())["api_url"] == system.url
    env = {k: v for k, v in system.env.items() if k not in ("PORT", "VOICE_TOOLS_PUBLIC_URL")}
    played = subprocess.run([str(Path(sys.executable).with_name("voice-tools")), "demo"], env=env,
                            capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert played.returncode == 0, played.stdout + played.stderr
    assert "PENDING -> MODIFIED -> PENDING -> EXECUTING -> PREPARED -> EXECUTING -> COMPLETED" in played.stdout


@pytest.mark.parametrize("scenario, calls", [("calendar", 2), ("docs", 3)])
def test_the_demo_plays_the_calendar_and_docs_scenarios_on_the_demo_data(system, scenario, calls):
    """A fresh `voice-tools run` loaded the demo data set, so every tool works from the first command."""
    played = subprocess.run(
        [str(Path(sys.executable).with_name("voice-tools")), "demo", "--scenario", scenario, "--url", system.url],
        env=system.env, capture_output=True, text=True, timeout=180, stdin=subprocess.DEVNULL,
    )
    out = played.stdout
    assert played.returncode == 0, out + played.stderr
    trails = [line for line in out.splitlines() if line.startswith("tc_")]
    ids = [line.split(":")[0] for line in trails]
    assert len(ids) == 1, out  # the write; the reads answer at once with ?wait
    final = system.api("GET", f"/voice-tools/status/{ids[0]}").json()
    assert final["status"] == "COMPLETED", final
    assert "PREPARED -> EXECUTING -> COMPLETED" in trails[0]
    session = final["session_id"]
    context = system.api("GET", f"/voice-tools/context/{session}").json()
    assert len(context["recent"]) == calls and {c["status"] for c in context["recent"]} == {"COMPLETED"}, context
    if scenario == "calendar":
        assert final["result"]["event_id"] and final["result"]["start"]
        assert "callback checkpoint step=READY_TO_BOOK status=PREPARED" in out
    else:
        searched = next(c for c in context["recent"] if c["function_name"] == "query_vector_db")
        top = searched["result"]["documents"][0]["title"]
        assert "Northwest" in top, searched["result"]
        assert top in out.split("preview:", 1)[1], "the email's draft carries the search's results"
        assert final["result"]["to"] == "john.smith@example.com"


def test_the_embedding_model_was_prepared_once_in_the_data_dir_before_the_first_query(system):
    """After the docs demo's searches: `voice-tools run` prepared the offline model in <data dir>/embedding-models
    before the workers started; the worker only loaded it (it never says it prepares one)."""
    models = system.data_dir / "embedding-models"
    made = sorted(p.name for p in models.iterdir() if not p.name.startswith("."))
    assert len(made) == 2 and made[0].endswith(".onnx") and made[1] == f"{made[0]}.sha256", made
    assert "preparing the offline embedding model" not in system.output()


def test_the_workers_series_are_served_apart_from_the_apis(system):
    """After the demos ran through the real workers: the worker's /metrics shows what they did, and the
    API's /metrics shows the API's series only (neither the workers' nor Flower's)."""
    from prometheus_client.parser import text_string_to_metric_families

    def families(text: str) -> dict[str, list]:
        return {family.name: family.samples for family in text_string_to_metric_families(text)}

    system.wait_listening(system.metrics_port)
    workers = families(requests.get(f"http://127.0.0.1:{system.metrics_port}/metrics", timeout=30).text)

    def total(name: str, **labels: str) -> float:
        return sum(sample.value for sample in workers.get(name, [])
                   if all(sample.labels.get(k) == v for k, v in labels.items()))

    assert total("voice_tools_calls_ended", tool="send_email", status="COMPLETED") >= 2  # two demos sent one
    assert total("voice_tools_calls_started", tool="send_email") >= 2
    assert total("voice_tools_step_duration_seconds", tool="send_email", step="SENDING") > 0
    assert total("voice_tools_callback_attempts", event="checkpoint", outcome="delivered") >= 2
    depths = {sample.labels["queue"] for sample in workers["voice_tools_queue_depth"]}
    assert depths == {tool.queue for tool in tools.TOOLS.values()} | {"callbacks", "maintenance"}

    api = system.api("GET", "/metrics")
    assert api.status_code == 200
    names = set(families(api.text))
    assert "voice_tools_http_requests" in names
    # the API's own series, and no other: its requests, and the event streams it serves
    assert names <= {"voice_tools_http_requests", "voice_tools_http_request_duration_seconds",
                     "voice_tools_event_streams_open"}, names


def test_flower_shows_each_tools_tasks_their_states_and_the_queue_lengths(system):
    """After the demos: Flower's HTTP API names each tool's step tasks with their states, and every queue's length."""
    answer = flower_get(system, "/api/tasks", limit="1000")
    assert answer.status_code == 200, answer.text
    states: dict[str, set[str]] = {}
    for task in answer.json().values():
        states.setdefault(task["name"], set()).add(task["state"])
    # send_email ran twice (email and docs scenarios), query_vector_db once, schedule_meeting once
    for tool in ("send_email", "query_vector_db", "schedule_meeting"):
        steps = {name: seen for name, seen in states.items() if name.startswith(f"tools.{tool}.")}
        assert steps, (tool, sorted(states))
        assert all(seen == {"SUCCESS"} for seen in steps.values()), steps
    assert "tools.send_email.SENDING" in states and "tools.query_vector_db.SEARCHING" in states

    lengths = flower_get(system, "/api/queues/length")
    assert lengths.status_code == 200, lengths.text
    queues = {queue["name"]: queue["messages"] for queue in lengths.json()["active_queues"]}
    assert set(queues) == declared_queues(), queues
    assert all(isinstance(count, int) and count >= 0 for count in queues.values()), queues


def test_env_and_migrate_come_and_go_beside_the_run_and_a_call_still_completes(system):
    from voice_tools import servers

    redis_dir = system.data_dir / "redis"
    users = servers.redis_users(redis_dir)
    assert users == [system.proc.pid], users  # the run started the servers

    env = voice_tools(system.data_dir, "env", stdout=subprocess.PIPE)
    exports = dict(env.stdout.readline().removeprefix("export ").strip().split("=", 1) for _ in range(2))
    assert set(exports) == {"DATABASE_URL", "REDIS_URL"}, exports
    assert sorted(servers.redis_users(redis_dir)) == sorted([system.proc.pid, env.pid])  # it joined
    migrate = voice_tools(system.data_dir, "migrate", stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    _out, err = migrate.communicate(timeout=180)
    assert migrate.returncode == 0, err
    assert stop_process(env) == 0
    assert servers.redis_users(redis_dir) == [system.proc.pid]

    assert system.api("GET", "/readyz").status_code == 200, "the API still reaches the database and the broker"
    played = subprocess.run(
        [str(Path(sys.executable).with_name("voice-tools")), "demo", "--url", system.url],
        env=system.env, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
    )
    assert played.returncode == 0, played.stdout + played.stderr
    call_id = next(line.split()[0] for line in played.stdout.splitlines() if line.startswith("    tc_"))
    assert system.api("GET", f"/voice-tools/status/{call_id}").json()["status"] == "COMPLETED"


def test_footprint_lists_every_process_of_the_run(system):
    measured = subprocess.run(
        [str(Path(sys.executable).with_name("voice-tools")), "footprint", "--width", "400"],
        env=system.env, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
    )
    assert measured.returncode == 0, measured.stdout + measured.stderr
    lines = measured.stdout.splitlines()
    tree = [system.proc.pid] + [child.pid for child in psutil.Process(system.proc.pid).children(recursive=True)]
    listed = {int(line.split()[0]) for line in lines if line.split() and line.split()[0].isdigit()}
    assert set(tree) <= listed, (tree, measured.stdout)
    for part in ("voice-tools run", "gunicorn", "celery -A tasks worker", "postgres", "redis-server"):
        assert part in measured.stdout, (part, measured.stdout)
    total = next(line for line in lines if line.startswith("voice-tools run: "))
    assert total.startswith(f"voice-tools run: {len(tree)} processes, ") and total.endswith(" MB PSS"), total
    assert any(line.startswith("embedded servers (PostgreSQL, Redis): ") for line in lines), measured.stdout
    # no honcho process, nor a forked Python process per line, nor a Flower process: the run's own children are
    # the Procfile's lines (each one's program, which its shell exec'd: no shell is left), and the run's process,
    # which serves Flower on its light app, maps none of the product's libraries (psycopg2 it maps to create the
    # database)
    from honcho.environ import parse_procfile

    lines_run = parse_procfile((ROOT / "Procfile.local").read_text()).processes
    children = psutil.Process(system.proc.pid).children()
    assert sorted(Path(child.cmdline()[1]).name for child in children) == ["celery", "gunicorn"], describe(children)
    assert len(children) == len(lines_run), describe(children)
    assert not any("voice-tools flower" in " ".join(proc.cmdline())
                   for proc in psutil.Process(system.proc.pid).children(recursive=True))
    mapped = [m.path for m in psutil.Process(system.proc.pid).memory_maps()]
    assert any("/tornado/" in path for path in mapped), mapped  # Flower's (tornado's speedups)
    assert not [path for path in mapped if "/sqlalchemy/" in path or "pydantic_core" in path], mapped


def test_a_second_run_on_the_same_data_dir_is_refused(system):
    second = subprocess.run(
        [str(Path(sys.executable).with_name("voice-tools")), "run"], env=dict(system.env, PORT=str(free_port())),
        capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
    )
    assert second.returncode == 1
    assert "another voice-tools run is using" in second.stdout
    assert requests.get(f"{system.url}/healthz", timeout=5).status_code == 200  # the first one is untouched


def test_sigterm_stops_every_process_it_started(system):
    before = running(system.data_dir)
    commands = " ".join(" ".join(p.cmdline()) for p in before)
    for part in ("pginstall/bin/postgres", "redis-server", "gunicorn", "celery -A tasks worker",
                 "--beat", "--worker-metrics-port"):
        assert part in commands, f"{part} not running: {describe(before)}"
    assert running_with(before, "gunicorn", "VOICE_TOOLS_MCP_BIND"), describe(before)  # the web line serves MCP
    assert "voice-tools mcp" not in commands, describe(before)  # the API's worker serves the MCP face
    assert "voice-tools flower" not in commands, describe(before)  # the run's process serves Flower
    assert "honcho" not in commands, describe(before)  # its manager runs inside `voice-tools run`

    assert system.stop() == 128 + signal.SIGTERM
    assert not (system.data_dir / "run.json").exists()  # a stopped run is no longer where the demo looks
    left = wait_none_running(system.data_dir)
    assert left == [], describe(left)
    out = system.output()
    assert "stopped" in out.splitlines()[-1]
    assert "forcefully killing" not in out
    assert "SIGKILL" not in out  # honcho had to kill none of them
    assert "voice-tools: Flower stopped" in out  # after the Procfile's lines, before the servers
    assert out.index("worker.1 stopped") < out.index("voice-tools: Flower stopped") < out.index("voice-tools: stopped")
    assert out.count("Traceback") == 0, out[-4000:]
    assert "logs: one JSON line per event (VOICE_TOOLS_LOG_FORMAT=text for plain lines)" in out
    for secret in (TOKEN, SECRET):
        assert secret not in out  # after the demo's calls too
    json_lines, web_loggers = set(), set()
    for line in out.splitlines():  # honcho's "08:15:00 web.1 | <the process's line>"
        prefix, sep, payload = line.partition("| ")
        name = prefix.split()[1].split(".")[0] if sep and len(prefix.split()) == 2 else None
        if name in ("web", "worker") and payload.strip():
            try:
                parsed = json.loads(payload)
                assert isinstance(parsed, dict)
            except ValueError:
                pytest.fail(f"not a JSON line: {line!r}")
            json_lines.add(name)
            if name == "web":
                web_loggers.add(parsed.get("logger"))
    assert json_lines == {"web", "worker"}, json_lines  # Procfile.local's processes but Flower (beat and metrics are inside the worker)
    # the MCP face's lines are the API worker's, in the same format: loaded, served, stopped with it
    assert {"app.mcp_lazy", "uvicorn.access", "uvicorn.error"} <= web_loggers, web_loggers
