"""``voice_tools/procfile_run.py``: honcho's manager run inside the calling process, a thread per line.

Real shells, real processes: each line gets the environment ``honcho start`` would give it (PORT
counting up by 100, HONCHO_PROCESS_NAME, the env file's variables), its output comes out prefixed, and
a line that ends stops the others (SIGTERM, no SIGKILL needed) and gives its exit status; nothing is left.
A stop's SIGTERM reaches a line's own program, so a Celery worker's running task finishes."""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import psutil

from voice_tools import procfile_run


def test_each_line_gets_honchos_environment_and_one_ending_stops_the_others(tmp_path, capfd):
    procfile = tmp_path / "Procfile"
    procfile.write_text(textwrap.dedent("""\
        first: echo "first $PORT $HONCHO_PROCESS_NAME $FROM_FILE $FROM_ENV"; exec sleep 60
        second: echo "second $PORT"; sleep 0.5; exit 3
    """))
    env_file = tmp_path / ".env"
    env_file.write_text("FROM_FILE=from-the-file\n")
    manager = procfile_run.manager_for(procfile, {**os.environ, "PORT": "7000", "FROM_ENV": "from-the-env"}, env_file)
    manager.loop()

    assert manager.returncode == 3
    out = capfd.readouterr().out
    assert "first 7000 first.1 from-the-file from-the-env" in out, out
    assert "second 7100" in out, out
    assert "second.1 stopped (rc=3)" in out and "sending SIGTERM to first.1" in out, out
    assert "first.1 stopped (rc=-15)" in out and "SIGKILL" not in out, out
    assert [child for child in psutil.Process().children(recursive=True) if child.status() != psutil.STATUS_ZOMBIE] == []


def test_what_runs_in_the_calling_process_prints_among_the_lines_under_its_own_name(tmp_path, capfd):
    """``LinesOf``: log records of a thread of the calling process (``voice-tools run``'s Flower) come out
    as a line's would, prefixed with their name, while the manager runs; ``line_names`` reads the lines."""
    procfile = tmp_path / "Procfile"
    procfile.write_text("only: sleep 1\n")
    assert procfile_run.line_names(procfile) == {"only"}
    manager = procfile_run.manager_for(procfile, dict(os.environ))
    lines = procfile_run.LinesOf(manager, "beside")
    lines.setFormatter(logging.Formatter("said: %(message)s"))
    logger = logging.getLogger("tests.procfile_run.beside")
    logger.addHandler(lines)
    logger.propagate = False
    try:
        threading.Timer(0.2, logger.warning, args=("from a thread",)).start()
        manager.loop()
    finally:
        logger.removeHandler(lines)
    out = capfd.readouterr().out
    said = [line for line in out.splitlines() if "said: from a thread" in line]
    assert len(said) == 1 and said[0].split()[1:3] == ["beside", "|"], out


SLOW_APP = '''
import os, time
from celery import Celery

app = Celery("slow", broker=os.environ["SLOW_BROKER"])
app.conf.update(task_acks_late=True, worker_prefetch_multiplier=1, broker_connection_retry_on_startup=True)


@app.task
def slow(marks):
    open(os.path.join(marks, "started"), "w").close()
    time.sleep(2)
    open(os.path.join(marks, "finished"), "w").close()
'''


def test_a_signal_gives_a_celery_worker_its_warm_shutdown_its_running_task_finishing(tmp_path, capfd):
    """SIGTERM reaches a line's own process, not its whole process group: a Celery worker's pool child, which
    a SIGTERM of its own ends at once (``WorkerLostError``), finishes the task it runs, as Celery's warm
    shutdown promises; a line of several commands still gets honcho's SIGTERM to its group."""
    (tmp_path / "slowapp.py").write_text(SLOW_APP)
    marks = tmp_path / "marks"
    marks.mkdir()
    broker = os.environ["REDIS_URL"]
    procfile = tmp_path / "Procfile"
    procfile.write_text(f"worker: {sys.executable} -m celery -A slowapp worker --pool prefork --concurrency 1 "
                        f"--without-mingle --without-gossip --loglevel INFO\n"
                        "several: trap 'echo several stopping; exit 0' TERM; sleep 60 & wait\n")
    env = {**os.environ, "SLOW_BROKER": broker, "PYTHONPATH": str(tmp_path)}
    manager = procfile_run.manager_for(procfile, env)
    sent: list[str] = []

    def send_then_stop() -> None:
        subprocess.run([sys.executable, "-c", f"import slowapp; slowapp.slow.delay({str(marks)!r})"],
                       cwd=tmp_path, env=env, check=True, timeout=30)
        deadline = time.monotonic() + 60
        while not (marks / "started").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        sent.append("started" if (marks / "started").exists() else "never started")
        os.kill(os.getpid(), signal.SIGTERM)  # as ``voice-tools run`` is stopped: honcho's handler

    threading.Thread(target=send_then_stop, daemon=True).start()
    manager.loop()

    out = capfd.readouterr().out
    assert sent == ["started"], out
    assert (marks / "finished").exists(), out
    assert "WorkerLostError" not in out and "SIGKILL" not in out, out
    assert "several stopping" in out, out
    assert [child for child in psutil.Process().children(recursive=True) if child.status() != psutil.STATUS_ZOMBIE] == []


def test_every_shipped_procfile_line_is_one_command_its_shell_execs():
    """The stop above reaches each shipped line's own program: every line of Procfile and Procfile.local is one
    command, run with exec; a line of several is told apart and left to its shell."""
    root = Path(__file__).resolve().parent.parent
    for name in ("Procfile", "Procfile.local"):
        lines = procfile_run.parse_procfile((root / name).read_text()).processes
        assert lines and {line: procfile_run.exec_form(cmd) for line, cmd in lines.items()} == \
            {line: f"exec {cmd}" for line, cmd in lines.items()}, name
    for several in ("a; b", "a && b", "a | b", "sleep 1 &", "A=1 prog", "if true; then a; fi", "(a)", "a\nb", "'open"):
        assert procfile_run.exec_form(several) is None, several
    assert procfile_run.exec_form("exec prog --flag") == "exec prog --flag"
    one = "env A='x; y' prog --flag \"$B\" > log"
    assert procfile_run.exec_form(one) == f"exec {one}"
