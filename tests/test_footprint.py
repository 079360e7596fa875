"""``voice-tools footprint`` on a real process tree: every command line whole, so two processes whose
lines differ only at their end (two Celery workers of one Procfile, ``celery -A tasks worker …``) are told apart.
The whole run measured is in ``tests/test_run_command.py``."""
from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import psutil

from support.procs import ROOT, bare_env

PREFIX = "x" * 150  # longer than any column a terminal would cut at

TREE = textwrap.dedent(f"""
    import subprocess, sys, time
    children = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "{PREFIX}", end])
                for end in ("the-first-end", "the-second-end")]
    print("ready", flush=True)
    time.sleep(60)
""")


def test_footprint_shows_each_command_line_whole(tmp_path):
    root = subprocess.Popen([sys.executable, "-c", TREE], stdout=subprocess.PIPE, text=True)
    try:
        assert root.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + 10
        while len(psutil.Process(root.pid).children()) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        (tmp_path / "run.lock").write_text(f"{root.pid}\n")
        measured = subprocess.run([sys.executable, "-m", "voice_tools", "footprint"], cwd=ROOT,
                                  env=bare_env(VOICE_TOOLS_DATA_DIR=str(tmp_path)), capture_output=True, text=True,
                                  timeout=60)
    finally:
        for child in psutil.Process(root.pid).children(recursive=True):
            child.kill()
        root.kill()
        root.wait()
    assert measured.returncode == 0, measured.stdout + measured.stderr
    for end in ("the-first-end", "the-second-end"):
        assert sum(line.endswith(f"{PREFIX} {end}") for line in measured.stdout.splitlines()) == 1, measured.stdout
    assert "voice-tools run: 3 processes, " in measured.stdout


def probed(probe: str) -> subprocess.CompletedProcess:
    """``probe`` run by a fresh Python of this checkout (what a process of the run imports), which must succeed."""
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=bare_env(), capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    return done


def print_loaded(*modules: str) -> str:
    """A probe's statement printing which of ``modules`` are imported by then, on one line."""
    return f"print(' '.join(m for m in {modules!r} if m in sys.modules))"


def test_flowers_app_declares_the_tasks_apps_queues_without_importing_a_task_or_tool_module():
    """Flower's app (``tasks/flower_app.py``) has the tasks app's queues, exchanges and keys, read without
    importing the registry, the task modules or what they pull in (SQLAlchemy, marshmallow, the backends)."""
    from tasks import app as tasks_app
    from tasks import flower_app

    def declared(app):
        return sorted((q.name, q.exchange.name, q.exchange.type, q.routing_key) for q in app.conf.task_queues)

    assert declared(flower_app.app) == declared(tasks_app)
    assert flower_app.app.main == tasks_app.main
    probe = ("import sys, tasks.flower_app; print(' '.join(sorted(m for m in sys.modules if m.split('.')[0] in "
             "('sqlalchemy', 'marshmallow', 'psycopg2', 'requests') or m.startswith(('tasks.tools', 'voice_tools_backends', "
             "'tasks.celery_app', 'tasks.chains', 'tasks.worker')))))")
    done = probed(probe)
    assert done.stdout.split() == [], done.stdout


def test_the_mcp_face_imports_no_flask():
    """The MCP face is served by uvicorn and starlette: Flask, Werkzeug and Jinja2 (about 5 MB) stay out of its process."""
    probe = "import sys, app.mcp_server; " + print_loaded("flask", "werkzeug", "jinja2")
    done = probed(probe)
    assert done.stdout.split() == [], done.stdout


def test_flowers_process_imports_no_repl():
    """``voice-tools flower`` loads Celery's CLI without ``click_repl`` and prompt_toolkit (about 6.5 MB),
    which only ``celery amqp repl`` uses; the other ``amqp`` commands are still there."""
    probe = ("import sys; from voice_tools import flower; flower.without_the_amqp_repl(); "
             "from celery.bin.celery import celery; from flower.command import flower as command; "
             + print_loaded("prompt_toolkit", "wcwidth", "click_repl._repl") + "; "
             "print(sorted(celery.commands['amqp'].commands))")
    done = probed(probe)
    loaded, amqp_commands = done.stdout.splitlines()
    assert loaded.split() == [], loaded
    assert "repl" not in amqp_commands and "queue.declare" in amqp_commands, amqp_commands


def test_the_api_imports_no_http_client_until_it_sends_a_callback_and_a_worker_has_it_before_its_fork():
    """The callbacks' HTTP client (requests, urllib3: about 5 MB) is the workers': ``tasks.app``, which a
    worker loads before its pool forks, imports it (shared by every pool child); the API's process, which
    sends a callback itself only for a cancel, does not hold it until then."""
    probe = ("import sys; from app import create_app; create_app(); "
             + print_loaded("requests", "urllib3", "tasks.delivery.transport")
             + "; from tasks import app; " + print_loaded("requests", "tasks.delivery.transport"))
    done = probed(probe)
    api, worker = done.stdout.splitlines()
    assert api.split() == [], api
    assert worker.split() == ["requests", "tasks.delivery.transport"], worker
