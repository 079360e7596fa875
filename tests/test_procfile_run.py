"""``voice_tools/procfile_run.py``: honcho's manager run inside the calling process, a thread per line.

Real shells, real processes: each line gets the environment ``honcho start`` would give it (PORT
counting up by 100, HONCHO_PROCESS_NAME, the env file's variables), its output comes out prefixed, and
a line that ends stops the others (SIGTERM, no SIGKILL needed) and gives its exit status; nothing is left."""
from __future__ import annotations

import os
import textwrap

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
    import logging
    import threading

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
