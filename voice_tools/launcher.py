"""The ``voice-tools`` command: run the whole system, migrate, print the servers, demo, serve worker metrics.

``voice-tools run`` starts what is missing (``servers.ensure_servers``), migrates,
then runs ``Procfile.local`` with honcho's manager in this process (``voice_tools/procfile_run.py``:
the API, whose worker also serves the MCP face, loaded at its first connection; one worker for every
queue with beat and the workers' metrics inside it) and serves Flower from a thread of this process
(a Procfile without a ``flower`` line), until interrupted; on SIGINT or SIGTERM it stops the Procfile's
processes first, then Flower, and the embedded servers last. ``Procfile`` keeps production's process groups
(``VOICE_TOOLS_PROCFILE=Procfile voice-tools run`` runs them locally).

Both Procfiles ship inside this package (in a checkout, links to the top-level files), so
an installed wheel runs from any folder: the processes work in the data dir (nothing there
shadows the installed ``app``, ``tasks`` or ``celeryconfig``), and honcho reads ``.env``
from the current directory.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import secrets
import shutil
import signal
import subprocess
import time
import sys
from pathlib import Path
from typing import Any

import voice_tools_tracing  # noqa: F401  (first: with tracing off, redis-py will not load the SDK; voice_tools_tracing/)
from models import logs, release, settings
from voice_tools import ports
from voice_tools.servers import (LOCAL_SECRETS, _started, default_data_dir, ensure_servers, forget_run, migrate,
                                 record_run, stop_servers)

PROCFILES = Path(__file__).parent  # Procfile and Procfile.local, shipped with this package
LOCAL_PROCFILE = "Procfile.local"  # what a laptop needs; ``Procfile`` keeps production's groups
FLOWER_PASSWORD = "flower_password"  # its key in local-secrets.json: the banner names it
CONSOLE_TOKEN = "console_token"  # its key in local-secrets.json: the admin token the console signs in with
CONSOLE_NAME = "operator"  # that token's name: who acted, in a call's history
FLOWER_LINE = "flower"  # a Procfile without this line has Flower served by the run's own process


def procfile_path(name: str) -> Path:
    """The Procfile ``name`` names: a path to one (absolute, or from the current directory), else
    the shipped Procfile of that name (``Procfile`` or ``Procfile.local``)."""
    given = Path(name)
    if given.is_absolute() or given.exists() or not (PROCFILES / given).is_file():
        return given.resolve()
    return PROCFILES / given


def local_defaults(data_dir: Path) -> dict[str, str]:
    """Values for the unset secrets, so a fresh clone runs and the demo can call it.

    Made once and kept in ``<data_dir>/local-secrets.json`` (mode 0600), so a restart
    keeps the same token. Variables that are set always win.
    """
    from tasks.delivery import signing  # here: the other commands (voice-tools mcp, flower) need it not

    path = data_dir / LOCAL_SECRETS
    try:
        stored = json.loads(path.read_text())
    except (OSError, ValueError):
        stored = {}
    wanted = {
        "api_token": lambda: secrets.token_urlsafe(24),
        CONSOLE_TOKEN: lambda: secrets.token_urlsafe(24),
        "callback_secret": lambda: secrets.token_urlsafe(32),
        "webhook_secret": signing.new_secret,  # Standard Webhooks: whsec_ + base64 of 32 random bytes
        FLOWER_PASSWORD: lambda: secrets.token_urlsafe(12),
    }
    if not all(stored.get(key) for key in wanted):
        stored = {key: stored.get(key) or make() for key, make in wanted.items()}
        data_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            json.dump(stored, fh)
    return {
        # the relay's token first (the demo takes the first), then the console's operator, an admin
        "VOICE_TOOLS_API_TOKENS": f"local:{stored['api_token']},{CONSOLE_NAME}:{stored[CONSOLE_TOKEN]}:admin",
        "VOICE_TOOLS_CALLBACK_SECRET": stored["callback_secret"],
        "VOICE_TOOLS_CALLBACK_SECRETS": stored["webhook_secret"],
        "VOICE_TOOLS_CALLBACK_HOSTS": "127.0.0.1,localhost",
        "FLOWER_BASIC_AUTH": f"admin:{stored[FLOWER_PASSWORD]}",
    }


def run_environment(data_dir: Path) -> tuple[dict[str, str], list[str]]:
    """The environment of the Procfile's processes, and the names we filled in."""
    env = dict(os.environ)
    filled = []
    for name, value in local_defaults(data_dir).items():
        if not env.get(name, "").strip():  # set but empty is unset: callbacks are never unsigned
            env[name] = value
            filled.append(name)
    # A local run is local: the Procfile's processes bind HOST, whose production default
    # (the Procfile's) is 0.0.0.0; here it is the loopback unless HOST says otherwise.
    if not env.get("HOST"):
        env["HOST"] = "127.0.0.1"
    # Read by celeryconfig: silences Celery's superuser warning for this run only (see there).
    env["VOICE_TOOLS_LOCAL_RUN"] = "1"
    for name, default, _who in ports.RUN_PORTS:  # PORT, MCP_PORT, WORKER_METRICS_PORT, FLOWER_PORT
        env.setdefault(name, str(default))
    # honcho gives each process its own PORT (8000, 8100, ...): every process learns the API's here
    # (the callbacks' own-ports guard, docs/operations.md, Configuration).
    env["VOICE_TOOLS_API_PORT"] = env["PORT"]
    env.setdefault("VOICE_TOOLS_PUBLIC_URL", f"http://127.0.0.1:{env['PORT']}")
    env["VOICE_TOOLS_DATA_DIR"] = str(data_dir)
    # The Procfile's commands (gunicorn, celery) live beside this Python: the README
    # runs .venv/bin/voice-tools without activating the venv.
    scripts = str(Path(sys.executable).parent)
    if scripts not in env.get("PATH", "").split(os.pathsep):
        env["PATH"] = os.pathsep.join(filter(None, [scripts, env.get("PATH")]))
    env.pop("FLOWER_UNAUTHENTICATED_API", None)
    # Each side's own multiprocess folder: the API's (gunicorn's workers) and the
    # workers' (every pool child; the Procfile's worker lines pass it on). Flower keeps
    # its series in its own process (its Procfile line unsets the variable).
    folders = {name: Path(env.get(name) or data_dir / "prometheus" / default)
               for name, default in (("PROMETHEUS_MULTIPROC_DIR", "api"), ("VOICE_TOOLS_WORKER_METRICS_DIR", "workers"))}
    if len({folder.resolve() for folder in folders.values()}) < len(folders):
        raise SystemExit("voice-tools: PROMETHEUS_MULTIPROC_DIR (the API's metrics) and "
                         "VOICE_TOOLS_WORKER_METRICS_DIR (the workers') must be two folders")
    for name, folder in folders.items():
        shutil.rmtree(folder, ignore_errors=True)  # stale files of a past run
        folder.mkdir(parents=True, exist_ok=True)
        env[name] = str(folder)
    return env, filled


class _Stop(Exception):
    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _raise_stop(signum: int, _frame: Any) -> None:
    # A second signal while stopping is ignored: the stop is already under way.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise _Stop(signum)


def _lock_data_dir(data_dir: Path) -> Any:
    """Hold ``<data_dir>/run.lock`` for this process's life, or None if another run holds it.

    Two runs on one data dir would run two sets of processes on one system (and fight
    over the ports). Other commands (env, migrate, the operator CLI) may join its servers.
    """
    import fcntl

    data_dir.mkdir(parents=True, exist_ok=True)
    handle = open(data_dir / "run.lock", "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        return None
    handle.seek(0)
    handle.truncate()
    handle.write(f"{os.getpid()}\n")  # for ``voice-tools footprint``
    handle.flush()
    _started["_run_lock"] = handle
    return handle


def _unlock_data_dir(data_dir: Path, handle: Any, made: bool) -> None:
    """A run refused before it started anything leaves nothing behind: its ``run.lock`` removed (while
    held, so no other run was let in on it), then the data dir if this run ``made`` it and it is empty."""
    (data_dir / "run.lock").unlink(missing_ok=True)
    handle.close()
    _started.pop("_run_lock", None)
    if made:
        try:
            data_dir.rmdir()
        except OSError:  # something else is in it now: it stays
            pass


def run(procfile: str | None = None) -> int:
    """Start what is missing, migrate, run the Procfile; stop everything on a signal."""
    from voice_tools import procfile_run  # here: the other commands (voice-tools mcp, flower) need not honcho

    data_dir = default_data_dir()
    made = not data_dir.exists()
    lock = _lock_data_dir(data_dir)
    if lock is None:
        _say(f"another voice-tools run is using {data_dir}; stop it first or set VOICE_TOOLS_DATA_DIR")
        return 1
    taken = ports.problems(os.environ)  # before anything starts: a taken port is said now, in words
    if taken:
        for sentence in taken:
            _say(sentence)
        _unlock_data_dir(data_dir, lock, made)
        _say("nothing was started")
        return 1
    signal.signal(signal.SIGTERM, _raise_stop)
    signal.signal(signal.SIGINT, _raise_stop)
    honcho = flower_app = None
    try:
        urls = ensure_servers(data_dir)
        _prepare_in_child(data_dir)
        env, filled = run_environment(data_dir)
        procfile_file = procfile_path(procfile or os.environ.get("VOICE_TOOLS_PROCFILE") or LOCAL_PROCFILE)
        _say(f"database {_redact(urls['DATABASE_URL'])}, broker {_redact(urls['REDIS_URL'])}")
        _say(f"data in {data_dir}")
        for line in banner(env, filled, data_dir):
            _say(line)
        record_run(data_dir, faces(env))
        for line in made_tokens(env, filled):
            _say(line)
        honcho = procfile_run.manager_for(procfile_file, env, Path.cwd() / ".env")
        if FLOWER_LINE not in procfile_run.line_names(procfile_file):
            flower_app = serve_flower(env, honcho)
        honcho.loop()  # its own SIGINT and SIGTERM handlers stop every process, then it returns
        return int(honcho.returncode or 0)
    except _Stop as stop:
        _say(f"{signal.Signals(stop.signum).name} received, stopping")
        return 128 + stop.signum
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        if honcho is not None:
            procfile_run.stop(honcho)
        if flower_app is not None:
            from voice_tools import flower

            if flower.stop_thread(flower_app):  # before the broker stops: its last inspections end
                _say("Flower stopped")
            else:
                _run_end["flower_stuck"] = True
                _say("Flower stopped; an inspection of its still retries the broker: the run ends without it")
        forget_run(data_dir)
        stop_servers()
        _say("stopped")


_run_end: dict[str, bool] = {}  # what the run learnt as it ended: Flower left a thread that would hold the exit


def serve_flower(env: dict[str, str], honcho: Any) -> Any:
    """Flower on ``HOST:FLOWER_PORT`` from a thread of this process (``voice_tools/flower.py``), for a Procfile
    without a ``flower`` line (``Procfile.local``): its ``FLOWER_*`` variables are the run's, its lines
    printed as ``flower``'s among the Procfile's."""
    from tornado.log import LogFormatter

    from voice_tools import flower, procfile_run

    for name, value in env.items():
        if name.startswith("FLOWER_"):
            os.environ[name] = value
    lines = procfile_run.LinesOf(honcho, FLOWER_LINE)
    lines.setFormatter(LogFormatter(color=False))
    return flower.serve_in_thread(env["HOST"], int(env["FLOWER_PORT"]), lines)


def prepare() -> int:
    """Migrate, prepare the offline embedding model, and load the demo data set into a database
    that has never had a call. Its warnings are the run's lines (``voice-tools: …``)."""
    logging.basicConfig(level=logging.WARNING, format="voice-tools: %(message)s")
    migrate()
    _say_if_no_document_search()
    prepare_model()
    if _never_used():
        _say(f"demo data loaded: {_describe(load_demo())}")
    return 0


def document_search_problem() -> str | None:
    """Why document search cannot work on this database (no pgvector, or a table made without it), or None."""
    from voice_tools_backends import documents
    from models import db

    with db.engine().connect() as conn:
        return documents.vector_support_error(conn)


def _say_if_no_document_search() -> None:
    problem = document_search_problem()
    if problem:
        _say(f"document search will not work: {problem} (query_vector_db and search_documentation will fail; "
             f"every other tool works)")


def prepare_model() -> None:
    """The offline embedding model made ready in ``<data dir>/models`` now (once for every process of
    the system: a worker's first query then prepares nothing)."""
    from voice_tools_backends import embeddings

    embeddings.prepare()


def _move_old_model_folder(data_dir: Path) -> None:
    """A data dir made before keeps its prepared model in ``models``, which a process working there
    imports in place of the ``models`` package: renamed to ``settings.MODEL_FOLDER`` before any of them starts."""
    old, new = data_dir / settings.OLD_MODEL_FOLDER, data_dir / settings.MODEL_FOLDER
    if old.is_dir() and not (old / "__init__.py").exists():
        if new.exists():
            shutil.rmtree(old)
        else:
            old.rename(new)


def _prepare_in_child(data_dir: Path) -> None:
    """``prepare`` in a child process, so this one (which lives as long as the run) never holds
    what migrating and loading the demo import (Alembic, the embedding model for the documents).
    It works in the data dir, as the Procfile's processes do: ``-c`` puts its folder first on the path."""
    _move_old_model_folder(data_dir)
    done = subprocess.run([sys.executable, "-c", "from voice_tools import launcher; import sys; sys.exit(launcher.prepare())"],
                          cwd=data_dir, env={**os.environ, "VOICE_TOOLS_DATA_DIR": str(data_dir)})
    if done.returncode != 0:
        raise SystemExit(f"voice-tools: migrating or loading the demo data failed (exit {done.returncode})")


def made_tokens(env: dict[str, str], filled: list[str]) -> list[str]:
    """The tokens this run made, the only secrets it prints: the relay's (for ``voice-tools demo``) and
    the console's admin (every caller's calls, the Tools page). None when the variable was set."""
    if "VOICE_TOOLS_API_TOKENS" not in filled:
        return []
    tokens = {entry.split(":")[0]: entry.split(":")[1] for entry in env["VOICE_TOOLS_API_TOKENS"].split(",")}
    lines = [f"API token: {tokens['local']}   (try: voice-tools demo)"]
    if CONSOLE_NAME in tokens:
        lines.append(f"console admin token: {tokens[CONSOLE_NAME]}   (sign in at {faces(env)['api_url']}/console; "
                     f"kept as {CONSOLE_TOKEN} in {LOCAL_SECRETS})")
    return lines


def faces(env: dict[str, str]) -> dict[str, str]:
    """Where the run's faces answer on this machine: HOST, or the loopback when it binds every address."""
    host = "127.0.0.1" if env["HOST"] in ("0.0.0.0", "::") else env["HOST"]
    host = f"[{host}]" if ":" in host else host
    return {"api_url": f"http://{host}:{env['PORT']}", "mcp_url": f"http://{host}:{env['MCP_PORT']}/mcp",
            "flower_url": f"http://{host}:{env['FLOWER_PORT']}",
            "worker_metrics_url": f"http://{host}:{env['WORKER_METRICS_PORT']}/metrics"}


def banner(env: dict[str, str], filled: list[str], data_dir: Path) -> list[str]:
    """What the run says about itself: where each face listens, where the secrets are, who logs into Flower.

    Secrets never go to stdout, except the API token this run made (the demo needs it).
    """
    host = env["HOST"]
    shown = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    lines = [f"API on http://{shown}:{env['PORT']}, MCP on http://{shown}:{env['MCP_PORT']}/mcp, "
             f"Flower on http://{shown}:{env['FLOWER_PORT']}",
             f"worker metrics on http://{shown}:{env['WORKER_METRICS_PORT']}/metrics "
             f"(the API's own at /metrics of the API)"]
    if host in ("127.0.0.1", "localhost", "::1"):
        lines.append(f"listening on {host} only (set HOST=0.0.0.0 to serve other machines)")
    else:
        lines.append(f"listening on {host} (HOST): reachable from other machines")
    users = [pair.split(":", 1)[0] for pair in env.get("FLOWER_BASIC_AUTH", "").split(",") if pair]
    if "FLOWER_BASIC_AUTH" in filled:
        password = f"password: {FLOWER_PASSWORD} in that file, made for it; FLOWER_BASIC_AUTH=user:password sets your own"
    else:
        password = "password: as set in FLOWER_BASIC_AUTH"
    lines.append(f"local secrets kept in {data_dir / LOCAL_SECRETS} (mode 0600); "
                 f"Flower user: {', '.join(users) or 'none'} ({password})")
    if logs.log_format(env) == "json":
        lines.append(f"logs: one JSON line per event ({logs.FORMAT_VARIABLE}=text for plain lines)")
    else:
        lines.append(f"logs: plain lines ({logs.FORMAT_VARIABLE}=text)")
    lines.append(tracing_line(env))
    if filled:
        lines.append(f"set for this local run (unset in the environment): {', '.join(filled)}")
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        lines.append("running as root: Celery's superuser warning is silenced for this local run;"
                     " in production run the workers as an unprivileged user")
    return lines


def tracing_line(env: dict[str, str]) -> str:
    """The banner's line on tracing: off (and how to turn it on), on (where every process's spans go), or asked
    for without its packages (then the processes run untraced: ``voice_tools_tracing.missing_line``)."""
    import voice_tools_tracing as tracing

    if not tracing.enabled(env):
        if tracing.asked_by(env):
            return "tracing off (OTEL_SDK_DISABLED=true)"
        return "tracing off (OTEL_EXPORTER_OTLP_ENDPOINT=http://collector:4318 sends every process's spans there)"
    missing = tracing.missing_line(env)
    if missing:
        return missing
    named = env.get("OTEL_SERVICE_NAME", "").strip()
    services = f"service {named}" if named else "services voice-tools-api, voice-tools-worker, ..."
    return (f"tracing on ({' and '.join(tracing.asked_by(env))}): every process's spans ({services}) go to "
            f"{tracing.destination(env)}")


def _never_used() -> bool:
    """No call was ever recorded: a fresh system, which gets the demo data set."""
    from sqlalchemy import select

    from models import db
    from models.calls import ToolCall

    with db.session() as s:
        return s.scalars(select(ToolCall.id).limit(1)).first() is None


def load_demo() -> dict[str, int]:
    from voice_tools_backends import load_demo as load_every_backends_demo

    return load_every_backends_demo()


def _describe(added: dict[str, int]) -> str:
    return ", ".join(f"{name} +{count}" for name, count in added.items()) or "nothing to load"


class IngestProgress:
    """How far an ingest is: a tqdm bar on a terminal (files, with the chunks stored and their rate),
    else a plain line per stored batch; the same for a --reembed's chunks."""

    def __init__(self, stream: Any = None) -> None:
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.bars: dict[str, Any] = {}
        self.started = time.monotonic()

    def _bar(self, name: str, total: int, unit: str) -> Any:
        from tqdm import tqdm

        if name not in self.bars:
            self.bars[name] = tqdm(total=total, unit=unit, file=self.stream, dynamic_ncols=True,
                                   desc=f"voice-tools ingest{' --reembed' if name == 'reembed' else ''}")
        return self.bars[name]

    def files(self, done: int, files: int, chunks: int) -> None:
        if self.tty:
            bar = self._bar("files", files, "file")
            bar.set_postfix_str(f"{chunks} chunks", refresh=False)
            bar.update(done - bar.n)
        else:
            rate = chunks / max(time.monotonic() - self.started, 1e-9)
            print(f"voice-tools ingest: {done}/{files} files, {chunks} chunks ({rate:.0f} chunks/s)",
                  file=self.stream, flush=True)

    def reembedded(self, done: int, total: int) -> None:
        if self.tty:
            bar = self._bar("reembed", total, "chunk")
            bar.update(done - bar.n)
        else:
            print(f"voice-tools ingest: re-embedded {done}/{total} chunks", file=self.stream, flush=True)

    def close(self) -> None:
        for bar in self.bars.values():
            bar.close()


def ingest(paths: list[str], reembed: bool = False, owner: str = "") -> int:
    from voice_tools_backends import documents

    progress = IngestProgress()
    try:
        report = documents.ingest(paths, reembed=reembed, owner=owner, progress=progress.files,
                                  reembed_progress=progress.reembedded)
    except documents.PERMANENT_ERRORS as exc:
        progress.close()
        print(f"voice-tools ingest: {exc}", file=sys.stderr, flush=True)
        return 2
    progress.close()
    for skipped in report["skipped"]:
        print(f"voice-tools ingest: skipped {skipped['file']}: {skipped['reason']}", file=sys.stderr, flush=True)
    print(json.dumps(report, indent=2), flush=True)
    return 0


def _say(text: str) -> None:
    print(f"voice-tools: {text}", flush=True)


def _redact(url: str) -> str:
    """Hide a password in a URL before printing it (urllib, not SQLAlchemy: this process lives
    as long as the run, and SQLAlchemy would cost it ~12 MB)."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(url)
    if parts.password is None:
        return url
    userinfo, host = parts.netloc.rsplit("@", 1)
    return urlunsplit(parts._replace(netloc=f"{userinfo.split(':', 1)[0]}:***@{host}"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="voice-tools", description="Run voice-tools: the API, workers, beat and Flower.")
    parser.add_argument("--version", action="version", version=f"voice-tools {release.VERSION}")
    sub = parser.add_subparsers(dest="command")
    sub.add_parser("run", help="start what is missing, migrate, run the Procfile (default)")
    sub.add_parser("migrate", add_help=False,
                   help="migrate the database (starting the embedded one if needed); --check changes nothing "
                        "and says what would run; --to REVISION goes down to an older one")
    sub.add_parser("env", help="start the embedded servers, print their URLs as shell exports, wait")
    sub.add_parser("demo", add_help=False, help="play a conversation (the updating-email one by default) against a running system")
    sub.add_parser("mcp", add_help=False, help="serve the MCP face at /mcp (--host, --port; MCP_PORT, default 8001; --lazy)")
    sub.add_parser("worker-metrics", add_help=False,
                   help="serve the workers' Prometheus metrics (--host, --port; WORKER_METRICS_PORT, default 9101)")
    sub.add_parser("flower", add_help=False, help="Flower on the tasks app (Flower's options), ending promptly on SIGTERM")
    sub.add_parser("footprint", add_help=False, help="the memory (PSS) of the running system, per process")
    sub.add_parser("openapi", add_help=False, help="print the API's OpenAPI document (-o FILE: write it there)")
    sub.add_parser("load-demo", help="load the demo data set (contacts, calendar, training, documents); safe to run twice")
    ingest_parser = sub.add_parser("ingest", help="read, chunk, embed and store .md/.html/.pdf/.txt files in the document store")
    ingest_parser.add_argument("paths", nargs="*", metavar="PATH", help="files or folders")
    ingest_parser.add_argument("--reembed", action="store_true",
                               help="first re-embed every stored chunk with the active model (after changing it)")
    ingest_parser.add_argument("--owner", default="", metavar="CALLER",
                               help="the caller (a token's name) whose documents these are; "
                                    "default: shared, every caller searches them")
    args, rest = parser.parse_known_args(argv)
    command = args.command or "run"
    if command == "demo":
        from voice_tools import demo

        return demo.main(rest)
    if command == "flower":
        from voice_tools import flower

        return flower.main(rest)
    if command == "footprint":
        from voice_tools import footprint

        return footprint.main(rest)
    if command == "openapi":
        from voice_tools import openapi_document

        return openapi_document.main(rest)
    if command == "mcp":
        from voice_tools import mcp_command

        return mcp_command.main(rest)
    if command == "worker-metrics":
        from voice_tools import worker_metrics

        return worker_metrics.main(rest)
    if command == "migrate":
        from voice_tools import schema_migrations

        if "-h" not in rest and "--help" not in rest:
            ensure_servers(need=("postgres",))
        code = schema_migrations.main(rest)
        if code == 0 and not rest:
            _say_if_no_document_search()
        return code
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if command == "run":
        code = run()
        if _run_end.get("flower_stuck"):  # Python would wait at exit for Flower's thread that retries a broker gone
            logging.shutdown()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        return code
    if command != "env":  # migrate, load-demo and ingest need the database only
        ensure_servers(need=("postgres",))
    if command == "load-demo":
        migrate()
        prepare_model()
        print(f"demo data loaded: {_describe(load_demo())}", flush=True)
        return 0
    if command == "ingest":
        if not args.paths and not args.reembed:
            parser.error("ingest needs a PATH (or --reembed)")
        migrate()
        prepare_model()
        return ingest(args.paths, args.reembed, args.owner.strip())
    urls = ensure_servers()
    # blocked before the exports: whoever reads them may stop this command at once, and that signal
    # must end the wait below (then the exit handlers leave the servers), not kill the process
    stops = {signal.SIGINT, signal.SIGTERM}
    signal.pthread_sigmask(signal.SIG_BLOCK, stops)
    for key, value in urls.items():
        print(f"export {key}='{value}'", flush=True)
    signal.sigwait(stops)
    return 0


if __name__ == "__main__":
    sys.exit(main())
