"""The Procfile, the lock files and the README's commands (run, quick and full tests) stay in step with the code and CI."""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from support.procs import ROOT
from tasks import app as celery_app
from tasks import tools
from tasks.worker import groups

README = (ROOT / "README.md").read_text()


def procfile(name: str = "Procfile") -> dict[str, list[str]]:
    lines = {}
    for line in (ROOT / name).read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, command = line.split(":", 1)
            lines[name.strip()] = shlex.split(command)
    return lines


def option(words: list[str], name: str) -> str:
    for i, word in enumerate(words):
        if word == name:
            return words[i + 1]
        if word.startswith(name + "="):
            return word.split("=", 1)[1]
    raise AssertionError(f"{name} not in {words}")


def command(words: list[str]) -> list[str]:
    """The command of a line, without a leading ``env`` and its ``-u NAME`` / ``NAME=value`` words."""
    if words[:1] != ["env"]:
        return words
    i = 1
    while i < len(words) and (words[i] == "-u" or "=" in words[i]):
        i += 2 if words[i] == "-u" else 1
    return words[i:]


def worker_lines(name: str = "Procfile") -> dict[str, list[str]]:
    return {line: command(words) for line, words in procfile(name).items() if command(words)[3:4] == ["worker"]}


def env_of(words: list[str]) -> tuple[dict[str, str], list[str]]:
    """What a line's leading ``env`` sets and unsets."""
    head = words[: len(words) - len(command(words))]
    unset = [head[i + 1] for i, word in enumerate(head) if word == "-u"]
    return dict(word.split("=", 1) for word in head[1:] if "=" in word and word not in unset), unset


def declared_queues() -> set[str]:
    return {queue.name for queue in celery_app.conf.task_queues}


def consumed_by(words: list[str]) -> list[str]:
    """The queues a worker line consumes: its ``--queues`` plus its ``--group``'s tools' queues
    (neither: every declared queue, as a plain ``celery -A tasks worker``)."""
    if "--queues" not in words and "--group" not in words:
        return sorted(declared_queues())
    queues = [q for q in option(words, "--queues").split(",")] if "--queues" in words else []
    if "--group" in words:
        queues += groups.queues_of([option(words, "--group")])
    return queues


def test_every_queue_is_consumed_by_exactly_one_worker_line():
    workers = worker_lines()
    consumed = [q for words in workers.values() for q in consumed_by(words)]
    declared = declared_queues()
    assert declared == {tool.queue for tool in tools.TOOLS.values()} | {"callbacks", "maintenance"}
    assert sorted(consumed) == sorted(declared), "give each worker group of the tools a worker line (--group)"
    assert {option(words, "--hostname").split("@")[0] for words in workers.values()} == set(workers)


def test_tool_queues_come_from_the_registry_not_the_procfile():
    """A new tool in an existing group needs no Procfile change: no line names a tool queue."""
    for name, words in worker_lines().items():
        if "--queues" in words:
            assert not any(q.startswith("tools.") for q in option(words, "--queues").split(",")), name
    named = {option(words, "--group") for words in worker_lines().values() if "--group" in words}
    assert named == set(tools.worker_groups())


def test_web_beat_and_flower_lines():
    lines = procfile()
    web = lines["web"]
    assert web[0] == "gunicorn" and "--no-control-socket" in web and web[-1] == "app:create_app()"
    assert option(web, "--worker-class") == "app.gunicorn_worker.WholeRequestWorker"  # gthread, requests read whole first
    assert option(web, "--bind").endswith("${PORT:-8000}")
    assert lines["beat"][:5] == ["celery", "-A", "tasks", "--quiet", "beat"]  # no banner: its log is JSON lines
    flower = lines["flower"]
    assert env_of(flower)[1] == ["FLOWER_UNAUTHENTICATED_API", "PROMETHEUS_MULTIPROC_DIR"]
    assert command(flower)[:2] == ["voice-tools", "flower"]  # celery -A tasks.flower_app flower, ending promptly on SIGTERM
    assert option(flower, "--port") == "${FLOWER_PORT:-5555}"
    # every face binds HOST: 0.0.0.0 in production, 127.0.0.1 under `voice-tools run`
    assert option(flower, "--address") == "${HOST:-0.0.0.0}"
    assert option(web, "--bind") == "${HOST:-0.0.0.0}:${PORT:-8000}"
    assert option(lines["mcp"], "--host") == "${HOST:-0.0.0.0}"
    # Flower's users come from FLOWER_BASIC_AUTH in its environment (voice-tools flower refuses to start
    # without it): never from its command line, which `ps` shows every local user
    assert not any(word.startswith("--basic-auth") or "FLOWER_BASIC_AUTH" in word for word in flower), flower


def test_flower_in_the_runs_process_is_not_served_without_a_password(monkeypatch):
    """``voice-tools run`` serving Flower itself (``Procfile.local``) refuses as ``voice-tools flower`` does."""
    from voice_tools import flower

    for name in ("FLOWER_BASIC_AUTH", "FLOWER_AUTH"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(SystemExit, match="set FLOWER_BASIC_AUTH=user:password"):
        flower.serve_in_thread("127.0.0.1", 1)


def test_voice_tools_flower_refuses_to_start_without_a_password():
    env = {k: v for k, v in os.environ.items() if k not in ("FLOWER_BASIC_AUTH", "FLOWER_AUTH")}
    done = subprocess.run([sys.executable, "-m", "voice_tools", "flower", "--port=1"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "set FLOWER_BASIC_AUTH=user:password" in done.stderr


def test_the_local_procfile_runs_one_worker_for_every_queue_with_beat_and_metrics_inside():
    """``voice-tools run``'s process list: what a laptop needs, the same commands as production's, light:
    beat and the workers' /metrics are threads of the one worker, which has one pool child by default,
    and the API's worker serves the MCP face (no MCP process), loaded at its first connection; ``voice-tools run``
    serves Flower from its own process where production has a ``flower`` line."""
    from voice_tools import launcher

    local, production = procfile("Procfile.local"), procfile()
    assert set(local) == {"web", "worker"}
    assert launcher.FLOWER_LINE in production and launcher.FLOWER_LINE not in local
    worker = command(local["worker"])
    assert env_of(local["worker"])[0] == env_of(production["writes"])[0]  # the workers' own metrics folder
    assert worker[:4] == ["celery", "-A", "tasks", "worker"] and "--beat-thread" in worker
    # no beat keeps a schedule file: beat's schedule is in memory, the database says what ran
    assert not any(w.startswith("--schedule") for w in worker + production["beat"]), (worker, production["beat"])
    assert celery_app.conf.beat_scheduler == "celery.beat:Scheduler"
    assert sorted(consumed_by(worker)) == sorted(declared_queues())
    assert option(worker, "--concurrency") == "${VOICE_TOOLS_WORKER_CONCURRENCY:-1}"
    # the exporter's address, served by the worker: production's worker-metrics line, on the loopback
    exporter = production["worker-metrics"]
    assert option(worker, "--worker-metrics-port") == option(exporter, "--port")
    assert option(worker, "--worker-metrics-host") == option(exporter, "--host").replace("0.0.0.0", "127.0.0.1")
    assert option(local["web"], "--workers") == "${WEB_CONCURRENCY:-1}"
    # the MCP face where production's mcp line serves it (its host on the loopback, its port), from the web line
    mcp = production["mcp"]
    assert env_of(local["web"]) == ({"VOICE_TOOLS_MCP_BIND": option(mcp, "--host").replace("0.0.0.0", "127.0.0.1")
                                     + ":" + option(mcp, "--port")}, [])
    # the same command, one gunicorn worker and the loopback by default
    same = [w.replace("${WEB_CONCURRENCY:-1}", "${WEB_CONCURRENCY:-2}").replace("127.0.0.1", "0.0.0.0")
            for w in command(local["web"])]
    assert same == command(production["web"])


# The README's commands: install from the lock files (exact versions, with hashes), then this tree.
RUN = ("python3 -m venv .venv && .venv/bin/pip install --require-hashes -r requirements.lock"
       " && .venv/bin/pip install --no-deps -e . && .venv/bin/voice-tools run")
TESTS_FULL = ("python3 -m venv .venv && .venv/bin/pip install --require-hashes -r requirements-dev.lock"
              " && .venv/bin/pip install --no-deps -e . && .venv/bin/python -m pytest -n 3 --dist loadfile")
TESTS_QUICK = '.venv/bin/python -m pytest -n 3 --dist loadfile -m "not slow and not fault"'


def readme_commands(section: str) -> list[str]:
    """Every line of the ``sh`` blocks under ``## section``."""
    body = README.split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0] if f"\n## {section}\n" in README else ""
    lines = [line.strip() for block in re.findall(r"```sh\n(.+?)\n```", body, re.S) for line in block.splitlines()]
    assert lines, f"no command under '## {section}'"
    return lines


def test_ci_runs_exactly_the_readme_test_command():
    assert RUN in readme_commands("Run it")
    assert TESTS_FULL in readme_commands("Test it") and TESTS_QUICK in readme_commands("Test it")
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines()
          if line.strip() and not line.startswith("#")]
    assert ci[:2] == ["set -euo pipefail", 'cd "$(dirname "${BASH_SOURCE[0]}")/.."'] and ci[-1] == TESTS_FULL
    # only what the tests need of the machine: Debian's packages, the RabbitMQ management plugin, podman's settings
    assert all("apt-get install" in line or "rabbitmq-plugins enable" in line or "/etc/containers/containers.conf" in line
               for line in ci[2:-1]), ci[2:-1]
    assert "docs/relay-guide.md" in README and "docs/operations.md" in README


def test_the_lock_files_pin_every_requirement_with_hashes_and_agree():
    """requirements.lock (the product, its tracing extra included) and requirements-dev.lock (with the tests' extras) pin one version
    of each package, with hashes, and the same version where both have it; every range of setup.cfg
    is met by its pin."""
    import configparser

    from packaging.requirements import Requirement

    def pins(name: str) -> dict[str, str]:
        text = (ROOT / name).read_text()
        found = re.findall(r"^([A-Za-z0-9_.\-]+)==(\S+) \\\n    --hash=sha256:", text, re.M)
        assert len(found) == len(re.findall(r"^[A-Za-z0-9]", text, re.M)), f"{name}: a line is not a hashed pin"
        return {re.sub(r"[-_.]+", "-", n).lower(): v for n, v in found}

    product, dev = pins("requirements.lock"), pins("requirements-dev.lock")
    assert {name: dev.get(name) for name in product} == product
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    declared = {"product": cfg["options"]["install_requires"], "tracing": cfg["options.extras_require"]["tracing"],
                "dev": cfg["options.extras_require"]["dev"]}  # the tracing extra is in both locks
    for side, text in declared.items():
        lock = product if side == "product" else dev
        for line in text.splitlines():
            if line.strip() and not line.strip().startswith("#"):
                req = Requirement(line.strip())
                pinned = lock.get(re.sub(r"[-_.]+", "-", req.name).lower())
                assert pinned and req.specifier.contains(pinned, prereleases=True), (side, str(req), pinned)


@pytest.mark.slow
def test_flask_cli_finds_the_app_factory():
    """``flask --app app`` (as docs/operations.md says) loads ``create_app``."""
    flask = Path(sys.executable).with_name("flask")
    done = subprocess.run([str(flask), "--app", "app", "routes"], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    routes = {line.split()[-1] for line in done.stdout.splitlines()[2:] if line.strip()}
    assert {"/voice-tools/pending", "/voice-tools/modify/<tool_call_id>", "/voice-tools/confirm/<tool_call_id>",
            "/voice-tools/execute", "/voice-tools/resume/<tool_call_id>", "/voice-tools/cancel/<tool_call_id>",
            "/voice-tools/status/<tool_call_id>", "/voice-tools/context/<session_id>", "/voice-tools/session-context",
            "/voice-tools/tools", "/execute-gmail", "/query-vector-db", "/get-session-context", "/healthz",
            "/readyz", "/metrics", "/openapi.json"} <= routes, done.stdout


def test_metrics_folders_are_each_sides_own():
    """The workers write into their own folder, Flower keeps its series in its process, and
    the API's folder (PROMETHEUS_MULTIPROC_DIR as the run sets it) is the web line's alone;
    one exporter line serves the workers' folder."""
    lines = procfile()
    for name, words in worker_lines().items():
        assert env_of(lines[name])[0] == {"PROMETHEUS_MULTIPROC_DIR": "${VOICE_TOOLS_WORKER_METRICS_DIR:?set "
                                          "VOICE_TOOLS_WORKER_METRICS_DIR to the workers own metrics folder}"}, name
    assert "PROMETHEUS_MULTIPROC_DIR" in env_of(lines["flower"])[1]
    exporter = lines["worker-metrics"]
    assert exporter[:2] == ["voice-tools", "worker-metrics"]
    assert option(exporter, "--host") == "${HOST:-0.0.0.0}"
    assert option(exporter, "--port") == "${WORKER_METRICS_PORT:-9101}"


def test_the_readme_reports_the_local_runs_footprint_and_the_command_that_measures_it():
    """A local run idles at 255 MB PSS at most, as measured by ``voice-tools footprint`` (``python -m
    bench.footprint``: measured, idle, and written down: a memory bound asserted here would be flaky).
    The bound was 250 until the OpenTelemetry SDK came with the install: redis-py imports the SDK's
    metrics module whenever it is installed. With tracing off, the tracing module keeps it out of the API
    and the ``voice-tools`` command, not out of a ``celery`` command (Flower's plug-in imports redis
    before any module of ours): the run idles at 250 MB, give or take 2."""
    section = README.split("## Run it", 1)[1].split("\n## ", 1)[0]
    assert "```sh\n.venv/bin/voice-tools footprint\n```" in section
    measured = re.search(r"it is (\d+) processes and (\d+) MB PSS", section)
    assert measured and int(measured.group(2)) <= 255, measured


def test_the_across_hosts_rows_give_each_host_what_it_needs():
    """docs/operations.md, Across hosts: the API and worker rows list the tokens, callback hosts and signing
    secrets; the section says each worker host needs its own host name, and how long a dead worker host's
    links wait on Redis (the visibility timeout's default, as celeryconfig reads it) and which setting shortens it."""
    operations = (ROOT / "docs" / "operations.md").read_text()
    section = operations.split("\n### Across hosts\n", 1)[1].split("\n### ", 1)[0]
    rows = {line.split(" | ")[0].lstrip("| ").split(" (")[0]: line for line in section.splitlines()
            if line.startswith("| ")}
    signing = ("VOICE_TOOLS_CALLBACK_SECRET`", "VOICE_TOOLS_CALLBACK_SECRETS`")
    for needed in ("DATABASE_URL", "CELERY_BROKER_URL", "VOICE_TOOLS_API_TOKENS", "VOICE_TOOLS_CALLBACK_HOSTS",
                   "VOICE_TOOLS_PUBLIC_URL", *signing):
        assert needed in rows["API hosts"], needed
    for needed in ("DATABASE_URL", "CELERY_BROKER_URL", "VOICE_TOOLS_CALLBACK_HOSTS", "VOICE_TOOLS_PUBLIC_URL",
                   "VOICE_TOOLS_WORKER_METRICS_DIR", *signing):
        assert needed in rows["worker hosts"], needed
    assert "FLOWER_BASIC_AUTH" in rows["Flower's host"]
    assert "host name of its own" in section and "`%h`" in section
    default = re.search(r'"VOICE_TOOLS_VISIBILITY_TIMEOUT", "(\d+)"', (ROOT / "celeryconfig.py").read_text()).group(1)
    assert f"`VOICE_TOOLS_VISIBILITY_TIMEOUT` has passed since they were handed out ({default} s by" in section
