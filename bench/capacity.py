"""What one call costs the servers, measured from outside: ``python -m bench.capacity [--calls N]``.

It starts embedded PostgreSQL and Redis (or uses ``DATABASE_URL`` / ``REDIS_URL``, as
``python -m bench``), the Procfile's ``web``, ``writes``, ``reads`` and ``callbacks`` lines
(``bench/stack.py``) and a local relay (``support/relay.py``), then runs ``N`` calls of each
kind, one after another, each kind in a block of its own:

- ``send_email``: pending, confirm → ``checkpoint`` callback, resume ``proceed`` → ``completed``;
- ``get_calendar_availability`` and ``search_contacts`` (read tools): pending, confirm → ``completed``;
- ``status`` and ``context``: one ``GET`` of a finished call's record / of its session's context.

Around each block it reads, from outside the processes:

- PostgreSQL: write transactions (the next transaction id, exact), commits
  (``pg_stat_database.xact_commit``: every transaction, but the server publishes backends'
  counts up to a second late), WAL bytes (``pg_wal_lsn_diff`` of ``pg_current_wal_lsn``),
  and the bytes of each table with its indexes and TOAST (``pg_total_relation_size``);
- Redis: commands by name (``INFO commandstats``): ``LPUSH`` is one broker message sent,
  ``BRPOP`` one taken (or a poll that timed out), ``PUBLISH`` a fan-out;
- CPU milliseconds of each process group (``bench/cpu.py``: API, workers, PostgreSQL,
  Redis, this process).

Each block ends with ``--settle`` seconds (11) of quiet before its counters are read, so every
backend has published its commits. Workers poll the broker and the servers do housekeeping when
idle: a quiet window as long as the longest block is measured last, and its rate is subtracted
from every block (the ``idle`` row shows it per second).

From those figures it derives (``model``) the figures of one tool call of a voice session's mix
(``MIX``), the calls/s one core of each process group carries, and what 1,000 and 10,000
sessions need. The table is printed and written with the machine to
``bench/results/capacity-<date>.json``; docs/scaling.md is the capacity model made from it.
Asserts no time.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import cpu, load  # noqa: E402
from bench.calls import AUTH  # noqa: E402
from bench.run import bench_servers, machine  # noqa: E402
from bench.stack import Stack  # noqa: E402

TABLES_SQL = """
SELECT c.relname, pg_total_relation_size(c.oid)
FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE c.relkind = 'r' AND n.nspname = 'public'
"""
# after a block: the last attempts are recorded, and every backend has published its counts to
# pg_stat_database (a busy backend publishes at most once a second, an idle one within 10 s)
SETTLE_S = 11.0
REDIS_COMMANDS = ("lpush", "brpop", "publish")


class Engine(Stack):
    """The Procfile's ``web``, ``writes``, ``reads`` and ``callbacks`` lines: no floor."""

    WORKERS = ("writes", "reads", "callbacks")

    def __init__(self, data_dir: Path):
        super().__init__(data_dir)
        self.commands = {name: self.commands[name] for name in ("web", *self.WORKERS)}

    def _wait_ready(self, timeout: float) -> None:
        from tasks import app

        deadline = time.monotonic() + timeout
        self._until(lambda: self._answers(self.urls["web"]), "web", deadline)
        silent = set(self.WORKERS)

        def pinged() -> bool:
            silent.difference_update(host.split("@")[0] for reply in app.control.ping(timeout=1.0) or []
                                     for host in reply)
            return not silent

        self._until(pinged, "the workers", deadline)


# -- the counters ------------------------------------------------------------------------

def counters(stack: Any) -> dict[str, Any]:
    """Every counter at once: PostgreSQL's, Redis's and the CPU of each process group."""
    from models import db
    from tasks import app

    with db.engine().connect() as conn:
        xid, commits, wal = conn.exec_driver_sql(
            "SELECT pg_snapshot_xmax(pg_current_snapshot())::text::bigint, "
            "(SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()), "
            "pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')").one()
        tables = dict(conn.exec_driver_sql(TABLES_SQL).all())
        conn.rollback()
    with app.connection_for_read() as conn:
        stats = conn.default_channel.client.info("commandstats")
    redis = {name.split("_", 1)[1]: int(value["calls"]) for name, value in stats.items()}
    return {"at": time.monotonic(), "xid": int(xid), "commits": int(commits), "wal": float(wal),
            "tables": {name: int(size) for name, size in tables.items()}, "redis": redis,
            "cpu": cpu.snapshot(stack, "api", server_pids())}


def server_pids() -> dict[str, int]:
    """The PostgreSQL postmaster's pid and the Redis server's: their families are the servers' CPU
    (not every ``postgres`` / ``redis`` process of a shared machine)."""
    global _SERVERS
    if _SERVERS is None:
        import psutil

        from models import db
        from tasks import app

        with db.engine().connect() as conn:
            backend = psutil.Process(conn.exec_driver_sql("SELECT pg_backend_pid()").scalar())
        with app.connection_for_read() as conn:
            redis_pid = int(conn.default_channel.client.info("server")["process_id"])
        _SERVERS = {"PostgreSQL": backend.ppid(), "Redis": redis_pid}
    return _SERVERS


_SERVERS: dict[str, int] | None = None


def delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """What the servers did between two readings (the readings' own queries included)."""
    redis = {name: after["redis"].get(name, 0) - before["redis"].get(name, 0) for name in after["redis"]}
    return {
        "seconds": after["at"] - before["at"],
        "write_xacts": after["xid"] - before["xid"],
        "commits": after["commits"] - before["commits"],
        "wal_bytes": after["wal"] - before["wal"],
        "tables": {name: size - before["tables"].get(name, 0) for name, size in after["tables"].items()},
        "redis_commands": sum(redis.values()),
        **{f"redis_{name}": redis.get(name, 0) for name in REDIS_COMMANDS},
        "cpu_ms": {group: seconds * 1000 for group, seconds in cpu._spent(before["cpu"], after["cpu"]).items()},
    }


def per_call(raw: dict[str, Any], idle: dict[str, Any] | None, calls: int) -> dict[str, Any]:
    """A block's figures per call, less the idle rate over the block's seconds (never below 0)."""
    scale = raw["seconds"] / idle["seconds"] if idle else 0.0

    def net(value: float, quiet: float) -> float:
        return max(value - quiet * scale, 0.0) / calls

    out: dict[str, Any] = {"wall_ms": round(raw["wall"] * 1000 / calls, 1)} if "wall" in raw else {}
    for key in ("write_xacts", "commits", "wal_bytes", "redis_commands", *[f"redis_{n}" for n in REDIS_COMMANDS]):
        out[key] = round(net(raw[key], idle[key] if idle else 0.0), 2)
    # tables grow by whole 8 kB pages: no idle rate, the total over the block divided
    out["table_bytes"] = {name: round(size / calls) for name, size in sorted(raw["tables"].items()) if size}
    out["table_bytes_total"] = round(sum(raw["tables"].values()) / calls)
    out["cpu_ms"] = {group: round(net(ms, idle["cpu_ms"][group] if idle else 0.0), 2)
                     for group, ms in raw["cpu_ms"].items()}
    return out


# -- the calls ---------------------------------------------------------------------------

class Calls:
    def __init__(self, web: str, relay: Any):
        self.web, self.relay = web, relay
        self.finished: list[str] = []  # calls whose status the ``status`` kind reads

    def record(self, tool_name: str) -> str:
        from tasks import tools

        tool = tools.TOOLS[tool_name]
        _s, created = load.call("POST", f"{self.web}/voice-tools/pending", 201, headers=AUTH, json={
            "session_id": f"capacity-{len(self.finished) % 50}", "function": tool.name,
            "parameters": dict(tool.example), "callback_url": self.relay.url})
        return created["tool_call_id"]

    def write(self) -> None:
        """send_email: confirm to the checkpoint, resume to the end."""
        tool_call_id = self.record("send_email")
        load.call("POST", f"{self.web}/voice-tools/confirm/{tool_call_id}", 202, headers=AUTH)
        self.relay.wait_for(tool_call_id, "checkpoint", timeout=60)
        load.call("POST", f"{self.web}/voice-tools/resume/{tool_call_id}", 202, headers=AUTH,
                  json={"action": "proceed"})
        done = self.relay.wait_for(tool_call_id, "completed", timeout=60)
        assert done["status"] == "COMPLETED", done
        self.finished.append(tool_call_id)

    def read(self, tool_name: str) -> Callable[[], None]:
        def one() -> None:
            tool_call_id = self.record(tool_name)
            load.call("POST", f"{self.web}/voice-tools/confirm/{tool_call_id}", 202, headers=AUTH)
            done = self.relay.wait_for(tool_call_id, "completed", timeout=60)
            assert done["status"] == "COMPLETED" and done["result"], done
            self.finished.append(tool_call_id)
        return one

    def status(self) -> None:
        tool_call_id = self.finished[len(self.finished) // 2]
        self.finished.append(self.finished.pop(0))  # the next read is of another call
        load.call("GET", f"{self.web}/voice-tools/status/{tool_call_id}", 200, headers=AUTH)

    def context(self) -> None:
        self.finished.append(self.finished.pop(0))
        load.call("GET", f"{self.web}/voice-tools/context/capacity-{len(self.finished) % 50}", 200, headers=AUTH)


KINDS = {  # name → (what a call is, how to run one)
    "send_email": "pending + confirm → checkpoint + resume → completed",
    "get_calendar_availability": "pending + confirm → completed",
    "search_contacts": "pending + confirm → completed",
    "status": "GET /voice-tools/status/<id> of a finished call",
    "context": "GET /voice-tools/context/<session_id>",
}


def measure(stack: Any, relay: Any, calls: int, settle: float = SETTLE_S) -> dict[str, Any]:
    runner = Calls(stack.urls["web"], relay)
    actions = {"send_email": runner.write, "get_calendar_availability": runner.read("get_calendar_availability"),
               "search_contacts": runner.read("search_contacts"), "status": runner.status,
               "context": runner.context}
    for one in (runner.write, runner.read("get_calendar_availability"), runner.read("search_contacts")):
        one()  # warm every worker's pool and the API's connections
    time.sleep(settle)
    raw: dict[str, dict[str, Any]] = {}
    for kind, one in actions.items():
        print(f"{kind}: {calls} calls ...", flush=True)
        before = counters(stack)
        for _ in range(calls):
            one()
        wall = time.monotonic() - before["at"]
        time.sleep(settle)
        raw[kind] = {**delta(before, counters(stack)), "wall": wall}
    quiet_s = max(block["seconds"] for block in raw.values())
    print(f"idle: {quiet_s:.1f} s with no call ...", flush=True)
    before = counters(stack)
    time.sleep(quiet_s)
    idle = delta(before, counters(stack))
    results = {kind: {"what": KINDS[kind], **per_call(block, idle, calls)} for kind, block in raw.items()}
    results["idle (per second)"] = {"what": "the stack with no call, per second (subtracted above)",
                                    **per_call(idle, None, max(round(idle["seconds"]), 1))}
    return results


# -- the model: derived from the figures above ----------------------------------------------

# A voice session's tool calls, per tool call: one in four a write (send_email, confirmed and
# resumed), three in four a read tool; and one status or context read by the relay per call.
MIX = {"send_email": 0.25, "get_calendar_availability": 0.75, "status": 0.5, "context": 0.5}
CALLS_PER_SESSION_MINUTE = 2  # the worked examples' assumption
SESSIONS = (1_000, 10_000)


def model(results: dict[str, Any]) -> dict[str, Any]:
    """Per tool call of ``MIX``: each figure weighted; the calls/s one core of each process group
    carries (1000 ms / its CPU ms per call); the broker's messages/s, WAL and table growth at the
    sessions of the worked examples. Derived, not measured."""
    def mixed(get: Callable[[dict[str, Any]], float]) -> float:
        return sum(share * get(results[kind]) for kind, share in MIX.items())

    cpu_ms = {group: round(mixed(lambda row, group=group: row["cpu_ms"][group]), 2) for group in cpu.GROUPS}
    per_call = {"cpu_ms": cpu_ms, "write_xacts": round(mixed(lambda row: row["write_xacts"]), 2),
                "commits": round(mixed(lambda row: row["commits"]), 2),
                "wal_bytes": round(mixed(lambda row: row["wal_bytes"])),
                "table_bytes": round(mixed(lambda row: row["table_bytes_total"])),
                "broker_messages": round(mixed(lambda row: row["redis_lpush"]), 2),
                "redis_commands": round(mixed(lambda row: row["redis_commands"]), 1)}
    per_core = {group: round(1000 / ms, 1) if ms > 0 else None for group, ms in cpu_ms.items()
                if group != "bench (client, relay)"}
    sessions = {}
    for count in SESSIONS:
        rate = count * CALLS_PER_SESSION_MINUTE / 60
        sessions[str(count)] = {
            "calls_per_s": round(rate, 1),
            "cores": {group: round(rate / carried, 2) for group, carried in per_core.items() if carried},
            "pg_transactions_per_s": round(rate * max(per_call["commits"], per_call["write_xacts"])),
            "broker_messages_per_s": round(rate * per_call["broker_messages"]),
            "redis_commands_per_s": round(rate * per_call["redis_commands"]),
            "wal_mb_per_s": round(rate * per_call["wal_bytes"] / 1e6, 2),
            "table_gb_per_day": round(rate * per_call["table_bytes"] * 86400 / 1e9, 1),
        }
    return {"mix": MIX, "calls_per_session_minute": CALLS_PER_SESSION_MINUTE, "per_call": per_call,
            "calls_per_s_per_core": per_core, "sessions": sessions}


def model_table(derived: dict[str, Any]) -> str:
    per_call, per_core = derived["per_call"], derived["calls_per_s_per_core"]
    mix = ", ".join(f"{share:g} {kind}" for kind, share in derived["mix"].items())
    lines = ["", f"## Derived: per tool call of the mix ({mix})", "",
             "- CPU ms: " + ", ".join(f"{group} {ms}" for group, ms in per_call["cpu_ms"].items()),
             (f"- PostgreSQL: {per_call['write_xacts']} write transactions, {per_call['commits']} commits, "
              f"{per_call['wal_bytes']:,} WAL bytes, {per_call['table_bytes']:,} table bytes"),
             f"- broker: {per_call['broker_messages']} messages, {per_call['redis_commands']} Redis commands",
             "- calls/s one core carries: " + ", ".join(f"{group} {n}" for group, n in per_core.items()),
             "", f"| sessions ({derived['calls_per_session_minute']} calls/min each) | calls/s | cores: "
             + " | cores: ".join(per_core) + " | PG xacts/s | broker msgs/s | Redis cmds/s | WAL MB/s | table GB/day |",
             "|---" * (7 + len(per_core)) + "|"]
    for count, row in derived["sessions"].items():
        lines.append(f"| {int(count):,} | {row['calls_per_s']} | "
                     + " | ".join(str(row["cores"].get(group, "–")) for group in per_core)
                     + f" | {row['pg_transactions_per_s']:,} | {row['broker_messages_per_s']:,} | "
                       f"{row['redis_commands_per_s']:,} | {row['wal_mb_per_s']} | {row['table_gb_per_day']} |")
    return "\n".join(lines) + "\n"


# -- the table ---------------------------------------------------------------------------

def table(results: dict[str, Any], header: list[str]) -> str:
    groups = list(cpu.GROUPS)
    short = {"API (gunicorn)": "API", "workers": "workers", "PostgreSQL": "PG", "Redis": "Redis",
             "bench (client, relay)": "bench"}
    lines = [*header, "", "## Per call (idle rate subtracted)", "",
             "| kind | wall ms | PG write xacts | PG commits | WAL bytes | table bytes | Redis cmds | LPUSH | BRPOP | "
             + " | ".join(f"CPU ms {short[g]}" for g in groups) + " |",
             "|---" * (9 + len(groups)) + "|"]
    for kind, row in results.items():
        lines.append(
            f"| {kind} | {format(row['wall_ms'], '.0f') if 'wall_ms' in row else '–'} | {row['write_xacts']:.1f} | {row['commits']:.1f} | "
            f"{row['wal_bytes']:,.0f} | {row['table_bytes_total']:,} | {row['redis_commands']:.1f} | "
            f"{row['redis_lpush']:.1f} | {row['redis_brpop']:.1f} | "
            + " | ".join(f"{row['cpu_ms'][g]:.1f}" for g in groups) + " |")
    lines += ["", "## Table growth per call, bytes (tables with indexes and TOAST; whole 8 kB pages)", ""]
    for kind, row in results.items():
        if row["table_bytes"] and not kind.startswith("idle"):
            lines.append(f"- {kind}: " + ", ".join(f"{name} {size:,}" for name, size in row["table_bytes"].items()))
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.capacity", description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=40, help="calls of each kind (default 40)")
    parser.add_argument("--settle", type=float, default=SETTLE_S,
                        help=f"seconds waited after each block before reading the counters (default {SETTLE_S:g}: "
                             "less makes the commits column lag)")
    parser.add_argument("--results", default=str(ROOT / "bench" / "results"), help="folder of capacity-<date>.json")
    args = parser.parse_args(argv)
    started = time.monotonic()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))

    with bench_servers("voice-tools-bench-capacity-") as data_dir:
        from voice_tools_backends import load_demo
        from support.relay import Relay
        from tasks import app, tools

        load_demo()
        with app.connection_for_write() as conn:  # nothing left over from an earlier run on these servers
            for name in [tool.queue for tool in tools.TOOLS.values()] + ["callbacks"]:
                conn.default_channel.queue_purge(name)
        print("starting the Procfile's web, writes, reads and callbacks ...", flush=True)
        with Relay(secret=os.environ["VOICE_TOOLS_CALLBACK_SECRET"]) as relay, Engine(data_dir) as stack:
            results = measure(stack, relay, args.calls, args.settle)
            assert relay.bad_signatures == 0
        info = machine()
    now = datetime.now(timezone.utc)
    command = f"python -m bench.capacity --calls {args.calls}" + (
        f" --settle {args.settle:g}" if args.settle != SETTLE_S else "")
    header = [
        "# voice-tools capacity figures", "",
        f"- measured on {now.strftime('%Y-%m-%d')} with `.venv/bin/{command}` ({time.monotonic() - started:.0f} s)",
        f"- machine: {info['cpu']}; {info['os']}; Python {info['python']}",
        f"- {info['versions']}; servers {info['servers']}",
        f"- {info['load']}",
        ("- one client, calls one after another; per call: PostgreSQL write transactions (transaction ids), "
         "commits (pg_stat_database), WAL bytes, table growth; Redis commands (LPUSH = a broker message sent); "
         "CPU ms by process group"),
    ]
    derived = model(results)
    text = table(results, header) + model_table(derived)
    out = Path(args.results) / f"capacity-{now.strftime('%Y-%m-%d')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"date": now.isoformat(timespec="seconds"), "command": command, "machine": info,
                               "calls": args.calls, "settle_s": args.settle, "results": results,
                               "model": derived, "table": text},
                              indent=1, ensure_ascii=False) + "\n")
    print(text)
    print(f"written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
