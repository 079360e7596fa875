"""The wheel runs outside a checkout: it carries the Procfiles and the migrations, and ``voice-tools run``
works from an empty folder with nothing of the checkout on the path.

``voice_tools/`` holds links to the top-level ``Procfile``, ``Procfile.local`` and ``migrations/``
(one copy of each, read through the links in a checkout and an editable install); the wheel
holds the files themselves. The slow test builds the wheel, installs it into a virtualenv of the exact
versions of ``requirements.lock`` (made once per lock on a machine, outside the checkout), and runs the system from an empty temporary folder:
migrations, the demo data, the API, ``voice-tools demo``, and SIGTERM leaving no process behind.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import re
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import zipfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import psutil
import pytest
import requests

from support.procs import (ROOT, describe, free_port, hold_servers, running, running_with, stop_process, wait_for_log,
                           wait_none_running)
from voice_tools import launcher, servers

SHIPPED = ("Procfile", "Procfile.local", "migrations")
START_TIMEOUT = 240
WHEEL_VENVS = Path(os.environ.get("VOICE_TOOLS_WHEEL_VENVS", Path.home() / ".cache" / "voice-tools" / "wheel-venvs"))


def test_the_package_links_to_the_top_level_procfiles_and_migrations():
    """One copy of each: the package's names are links to the files operators and Alembic's CLI use."""
    package = Path(launcher.__file__).parent
    for name in SHIPPED:
        assert (package / name).is_symlink(), f"voice_tools/{name} must be a link to ../{name}, not a copy"
        assert (package / name).resolve() == (ROOT / name).resolve()
    assert servers.MIGRATIONS == package / "migrations"
    assert launcher.PROCFILES == package


def test_the_default_data_dir_is_dot_voice_tools_in_the_current_directory(tmp_path, monkeypatch):
    monkeypatch.delenv("VOICE_TOOLS_DATA_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    assert servers.default_data_dir() == tmp_path.resolve() / ".voice-tools"
    monkeypatch.setenv("VOICE_TOOLS_DATA_DIR", str(tmp_path / "elsewhere"))
    assert servers.default_data_dir() == tmp_path.resolve() / "elsewhere"


def test_a_procfile_is_the_named_file_else_the_shipped_one(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert launcher.procfile_path("Procfile.local") == launcher.PROCFILES / "Procfile.local"
    assert launcher.procfile_path("Procfile") == launcher.PROCFILES / "Procfile"
    (tmp_path / "Procfile").write_text("web: true\n")  # an operator's own Procfile, where they run
    assert launcher.procfile_path("Procfile") == tmp_path.resolve() / "Procfile"
    assert launcher.procfile_path(str(tmp_path / "mine")) == tmp_path.resolve() / "mine"


def test_alembic_is_configured_in_code_with_the_shipped_scripts():
    from alembic.script import ScriptDirectory

    scripts = ScriptDirectory.from_config(servers.alembic_config())
    assert Path(scripts.dir) == servers.MIGRATIONS
    versions = sorted(p.name for p in (ROOT / "migrations" / "versions").glob("*.py"))
    assert len(scripts.get_heads()) == 1 and len(list(scripts.walk_revisions())) == len(versions)


# -- the wheel, installed and run outside the checkout -------------------------------------------------

def _shipped_files() -> dict[str, Path]:
    """Each file the wheel must carry that is not a module → the checkout's file: under ``voice_tools/``
    the Procfiles and migrations; the console's page template, script, style and icon; the embedding
    model's tokenizer with its licence (``voice_tools_backends/data/``)."""
    files = {f"voice_tools/{name}": ROOT / name for name in ("Procfile", "Procfile.local")}
    for path in sorted((ROOT / "migrations").rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts:
            files[f"voice_tools/{path.relative_to(ROOT).as_posix()}"] = path
    for path in sorted((ROOT / "app" / "console").rglob("*")):
        if path.is_file() and path.suffix in (".html", ".js", ".css", ".svg"):
            files[path.relative_to(ROOT).as_posix()] = path
    for path in sorted((ROOT / "voice_tools_backends" / "data").rglob("*")):
        if path.is_file():
            files[path.relative_to(ROOT).as_posix()] = path
    return files


def _run(argv: list[str], cwd: Path, env: dict[str, str] | None = None, timeout: float = 900) -> str:
    done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)
    assert done.returncode == 0, f"{' '.join(argv)} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def _clean_env(**extra: str) -> dict[str, str]:
    """What a person's shell has: no PYTHONPATH, no server or secret variables, no virtualenv."""
    kept = ("PATH", "HOME", "USER", "LOGNAME", "LANG", "LC_ALL", "TMPDIR", "TERM")
    env = {name: os.environ[name] for name in kept if name in os.environ}
    env.update(extra)
    return env


def _processes_of(venv: Path) -> list[psutil.Process]:
    """Live processes running the new virtualenv's programs."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.status() != psutil.STATUS_ZOMBIE and any(str(venv) in part for part in proc.cmdline()):
                found.append(proc)
        except psutil.Error:
            continue
    return found


@pytest.fixture(scope="module")
def installed():
    """The wheel built from a copy of the tree in a temporary folder outside the checkout (removed afterwards),
    installed into the virtualenv of ``requirements.lock``'s exact versions (and taken out of it again at the
    end): ``(folder, venv)``."""
    outside = Path(tempfile.mkdtemp(prefix="voice-tools-wheel-", dir=tempfile.gettempdir())).resolve()
    assert not outside.is_relative_to(ROOT.resolve())
    try:
        source, dist = outside / "source", outside / "dist"
        # Built from a copy of the tree, as from a fresh clone: setuptools' build/ folder in a checkout
        # keeps files its sources no longer have.
        shutil.copytree(ROOT, source, symlinks=True, ignore=shutil.ignore_patterns(
            ".git", ".venv*", "build", "*.egg-info", "__pycache__", ".pytest_cache", ".voice-tools", "bench",
            "node_modules"))
        _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(dist), "."], cwd=source)
        (wheel,) = dist.glob("voice_tools-*.whl")
        with zipfile.ZipFile(wheel) as archive:
            names = set(archive.namelist())
            for name, shipped in _shipped_files().items():
                assert name in names, f"{name} is not in the wheel"
                assert archive.read(name) == shipped.read_bytes(), f"{name} differs from {shipped}"
            tops = {name.split("/")[0].removesuffix(".py") for name in names if ".dist-info/" not in name}
        # the user's names and the product's own: no stray top-level name
        assert tops == {"app", "celeryconfig", "models", "tasks", "voice_tools", "voice_tools_backends",
                        "voice_tools_tracing"}
        assert "voice_tools_backends/data/all-MiniLM-L6-v2/tokenizer.json" in names

        # as docs/operations.md, "Installing the wheel", says: the lock's exact versions, then the wheel
        with _lock_installed() as venv:
            pip = [str(venv / "bin" / "pip"), "install", "-q", "--no-compile"]
            _run([*pip, "--no-deps", str(wheel)], cwd=outside)
            try:
                yield outside, venv
            finally:
                _run([str(venv / "bin" / "pip"), "uninstall", "-q", "-y", "voice-tools"], cwd=outside)
    finally:
        shutil.rmtree(outside, ignore_errors=True)


@contextmanager
def _lock_installed() -> Iterator[Path]:
    """A virtualenv outside the checkout with exactly ``requirements.lock`` installed (``--require-hashes``),
    made once per lock and Python on this machine (``~/.cache/voice-tools/wheel-venvs``) and held by one test
    run at a time; it holds no voice-tools when it is handed out, nor after."""
    key = hashlib.sha256((ROOT / "requirements.lock").read_bytes() + sys.version.encode()).hexdigest()[:16]
    home = WHEEL_VENVS / key
    home.parent.mkdir(parents=True, exist_ok=True)
    with open(home.parent / f"{key}.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        venv, done = home / "venv", home / "installed"
        if not done.exists():
            shutil.rmtree(home, ignore_errors=True)
            home.mkdir()
            _run([sys.executable, "-m", "venv", str(venv)], cwd=home)
            # --no-compile: Python writes the bytecode of what it imports when it imports it; pip's compiling
            # of every module of every package at install was most of this install's time
            _run([str(venv / "bin" / "pip"), "install", "-q", "--no-compile", "--require-hashes", "-r",
                  str(ROOT / "requirements.lock")], cwd=home)
            done.write_text(key)
        else:  # a run stopped before it could take its wheel out
            _run([str(venv / "bin" / "pip"), "uninstall", "-q", "-y", "voice-tools"], cwd=home)
        yield venv


@pytest.mark.slow
def test_the_wheel_installed_from_the_lock_runs_from_an_empty_folder(installed):
    outside, venv = installed
    work = outside / "work"
    work.mkdir()

    env = _clean_env(PORT=str(free_port()), MCP_PORT=str(free_port()), FLOWER_PORT=str(free_port()),
                     WORKER_METRICS_PORT=str(free_port()), VOICE_TOOLS_WORKER_CONCURRENCY="1")
    where = json.loads(_run([str(venv / "bin" / "python"), "-c", (
        "import json, app, tasks, models, celeryconfig, voice_tools, voice_tools_backends, voice_tools_tracing;"
        "print(json.dumps({m.__name__: m.__file__ for m in (app, tasks, models, voice_tools_backends,"
        " voice_tools_tracing, celeryconfig, voice_tools)}))")],
        cwd=work, env=env))
    site = venv / "lib"
    assert all(Path(path).is_relative_to(site) for path in where.values()), where

    data_dir = work / ".voice-tools"
    url = f"http://127.0.0.1:{env['PORT']}"
    log_path = outside / "run.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([str(venv / "bin" / "voice-tools"), "run"], cwd=work, env=env,
                                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        _wait_healthy(proc, url, log_path)
        out = log_path.read_text(errors="replace")
        assert f"data in {data_dir}" in out
        assert "demo data loaded: " in out, out[-3000:]  # migrated, then loaded the demo into the new database

        secrets = json.loads((data_dir / "local-secrets.json").read_text())
        auth = {"Authorization": f"Bearer {secrets['api_token']}"}
        assert requests.get(f"{url}/voice-tools/tools", timeout=10).status_code == 401
        listed = requests.get(f"{url}/voice-tools/tools", headers=auth, timeout=10)
        assert listed.status_code == 200 and "send_email" in listed.text, listed.text
        assert requests.get(f"{url}/readyz", headers=auth, timeout=10).status_code == 200
        for page in ("/console", "/console/static/console.js", "/console/static/console.css", "/favicon.ico"):
            assert requests.get(f"{url}{page}", timeout=10).status_code == 200, page  # the console, from the wheel

        # as a person would: the demo once the run's worker says it is ready (on a loaded machine the web
        # answers well before it, and the demo waits 30 s for each callback)
        wait_for_log(log_path, re.compile(r"worker@\S+ ready\."), proc, timeout=START_TIMEOUT, every=0.5)
        played = subprocess.run([str(venv / "bin" / "voice-tools"), "demo"], cwd=work, env=env,
                                capture_output=True, text=True, timeout=240, stdin=subprocess.DEVNULL)
        assert played.returncode == 0, (played.stdout[-3000:] + played.stderr[-3000:],
                                        log_path.read_text(errors="replace")[-6000:])
        assert "PENDING -> MODIFIED -> PENDING -> EXECUTING -> PREPARED -> EXECUTING -> COMPLETED" in played.stdout

        before = running(data_dir)
        commands = " ".join(" ".join(p.cmdline()) for p in before if p.is_running())
        for part in ("postgres", "redis-server", "gunicorn", "celery -A tasks worker"):
            assert part in commands, f"{part} not running: {describe(before)}"
        assert running_with(before, "gunicorn", "VOICE_TOOLS_MCP_BIND"), describe(before)  # the web line serves MCP
        # Flower, served by the run's own process from the installed package, behind its password
        flower = f"http://127.0.0.1:{env['FLOWER_PORT']}/api/workers"
        assert requests.get(flower, timeout=30).status_code == 401
        assert requests.get(flower, auth=("admin", secrets["flower_password"]), timeout=30).status_code == 200
        assert "honcho" not in commands, describe(before)  # its manager runs inside `voice-tools run`
        assert str(ROOT) not in commands, describe(before)

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=90) == 128 + signal.SIGTERM
        assert wait_none_running(data_dir) == [], describe(running(data_dir))
        left = _processes_of(venv)
        assert left == [], describe(left)
        out = log_path.read_text(errors="replace")
        assert out.splitlines()[-1].endswith("stopped") and "Traceback" not in out, out[-4000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for leftover in running(data_dir) + _processes_of(venv):  # only ours: this test's folder
            try:
                leftover.kill()
            except psutil.Error:
                pass


def _wait_healthy(proc: subprocess.Popen, url: str, log_path: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"voice-tools run exited {proc.returncode}:\n{log_path.read_text(errors='replace')[-4000:]}")
        try:
            if requests.get(f"{url}/healthz", timeout=5).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(0.5)
    pytest.fail(f"/healthz did not answer 200 in {START_TIMEOUT}s:\n{log_path.read_text(errors='replace')[-4000:]}")


@pytest.mark.slow
def test_the_operations_page_installs_the_wheel_migrates_and_runs_the_procfile_with_honcho(installed):
    """docs/operations.md, "Installing the wheel", done as written, on servers of its own (the embedded ones,
    held by a process of the test's as real servers would run): ``voice-tools migrate``, then ``honcho start
    -f`` the shipped Procfile from a folder of one's own, the venv's ``bin`` on PATH; a call runs through it."""
    page = (ROOT / "docs" / "operations.md").read_text().split("\n### Installing the wheel\n", 1)[1].split("\n### ", 1)[0]
    for step in ("pip install --require-hashes -r requirements.lock", "pip install --no-deps voice_tools-",
                 "export PATH=/opt/voice-tools/bin:$PATH", "voice-tools migrate\n",
                 """honcho start -f "$(python -c 'import voice_tools, pathlib; print(pathlib.Path(voice_tools.__file__).with_name("Procfile"))')\""""):
        assert step in page, step  # the steps this test takes

    outside, venv = installed
    work = outside / "honcho-work"
    work.mkdir()
    holder, urls = hold_servers(outside / "servers")
    token, port = "wheel-page-token", free_port()
    env = _clean_env(
        PATH=os.pathsep.join([str(venv / "bin"), os.environ["PATH"]]),
        DATABASE_URL=urls["DATABASE_URL"], REDIS_URL=urls["REDIS_URL"],
        HOST="127.0.0.1", PORT=str(port), MCP_PORT=str(free_port()), WORKER_METRICS_PORT=str(free_port()),
        FLOWER_PORT=str(free_port()), VOICE_TOOLS_API_TOKENS=f"page:{token}",
        VOICE_TOOLS_CALLBACK_SECRET="wheel-page-secret", VOICE_TOOLS_CALLBACK_HOSTS="127.0.0.1",
        FLOWER_BASIC_AUTH="ops:wheel-page-password", VOICE_TOOLS_PUBLIC_URL=f"http://127.0.0.1:{port}",
        PROMETHEUS_MULTIPROC_DIR=str(work / "metrics-api"), VOICE_TOOLS_WORKER_METRICS_DIR=str(work / "metrics-workers"),
        VOICE_TOOLS_WORKER_CONCURRENCY="1", WEB_CONCURRENCY="1")
    for folder in ("metrics-api", "metrics-workers"):
        (work / folder).mkdir()
    log_path = outside / "honcho.log"
    proc = None
    try:
        _run(["voice-tools", "migrate"], cwd=work, env=env, timeout=300)
        procfile = _run(["python", "-c", "import voice_tools, pathlib; "
                         "print(pathlib.Path(voice_tools.__file__).with_name('Procfile'))"], cwd=work, env=env).strip()
        assert Path(procfile).is_relative_to(venv)
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(["honcho", "start", "-f", procfile], cwd=work, env=env, stdout=log,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        url = f"http://127.0.0.1:{port}"
        _wait_healthy(proc, url, log_path)
        auth = {"Authorization": f"Bearer {token}"}
        made = requests.post(f"{url}/voice-tools/pending", headers=auth, timeout=30, json={
            "session_id": "wheel_page", "function": "send_email",
            "parameters": {"to": "ann@example.com", "subject": "Lunch", "body": "At noon?"}})
        assert made.status_code == 201, made.text
        call = made.json()["tool_call_id"]
        confirmed = requests.post(f"{url}/voice-tools/confirm/{call}", headers=auth, timeout=30)
        assert confirmed.status_code == 202, confirmed.text
        assert _settled(url, call, auth) == "PREPARED"
        resumed = requests.post(f"{url}/voice-tools/resume/{call}", headers=auth, json={"action": "proceed"},
                                timeout=30)
        assert resumed.status_code == 202, resumed.text
        assert _settled(url, call, auth) == "COMPLETED"
        out = log_path.read_text(errors="replace")
        for line in ("web.1", "mcp.1", "writes.1", "reads.1", "callbacks.1", "worker-metrics.1", "beat.1", "flower.1"):
            assert f"{line} started" in out, out[-3000:]
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=90)
        left = _processes_of(venv)
        assert left == [], describe(left)
    finally:
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for leftover in _processes_of(venv):
            try:
                leftover.kill()
            except psutil.Error:
                pass
        stop_process(holder)


def _settled(url: str, call: str, auth: dict[str, str]) -> str:
    """The call's status once PREPARED or ended (asked every half second while the workers start)."""
    deadline = time.monotonic() + START_TIMEOUT
    while True:
        answer = requests.get(f"{url}/voice-tools/status/{call}", headers=auth, timeout=30)
        assert answer.status_code == 200, answer.text
        status = answer.json()["status"]
        if status != "EXECUTING" or time.monotonic() > deadline:
            return status
        time.sleep(0.5)
