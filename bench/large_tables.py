"""Reads on a large table against a small one, in one run: ``python -m bench.large_tables [--calls N]``.

Two databases on one PostgreSQL: ``small`` holds 100,000 calls over 10,000 sessions, ``large``
holds ``--calls`` (10,000,000 by default) over a tenth as many sessions, so a session has ten
calls in both (``bench/scale.py``'s rows, seeded in transactions of a million). One API under
gunicorn from the Procfile's ``web`` line serves each (``bench/retention.py``'s ``WebOnly``);
one client asks ``status`` of a call and ``context`` of a session all over the table,
alternately of the small and the large one, so both sides share every moment's load. It prints
(and, with ``--out``, writes as JSON) each side's p50/p99 and the large/small ratios. Embedded
servers under a temporary folder, as ``python -m bench``; asserts no time.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import load, report, scale  # noqa: E402
from bench.calls import AUTH  # noqa: E402
from bench.retention import WebOnly  # noqa: E402
from bench.run import bench_servers  # noqa: E402

SMALL = 100_000
CALLS_PER_SESSION = 10
STEP = 1_000_000  # calls seeded per transaction
SPREAD = 7919  # a prime: request i reads call/session i * SPREAD, all over the table


def database(url: str, name: str) -> str:
    """Create and migrate ``name`` beside the database of ``url``; its URL."""
    import os

    from voice_tools import servers

    parts = urlsplit(url)
    servers.create_database(urlunsplit(parts._replace(path="/postgres")), name, drop=True)
    made = urlunsplit(parts._replace(path=f"/{name}"))
    before, os.environ["DATABASE_URL"] = os.environ["DATABASE_URL"], made
    try:
        servers.migrate()
    finally:
        os.environ["DATABASE_URL"] = before
    return made


def seed(url: str, calls: int) -> float:
    """``calls`` calls in the database of ``url``, a million per transaction, then VACUUM ANALYZE; seconds."""
    from sqlalchemy import create_engine

    from models.db import database_url

    import os

    before, os.environ["DATABASE_URL"] = os.environ["DATABASE_URL"], url
    try:
        engine = create_engine(database_url())
    finally:
        os.environ["DATABASE_URL"] = before
    started = time.perf_counter()
    sessions = max(calls // CALLS_PER_SESSION, 1)
    for first in range(1, calls + 1, STEP):
        last = min(first + STEP - 1, calls)
        with engine.begin() as conn:
            conn.execute(scale.SEED, {"first": first, "last": last, "sessions": sessions, "caller": scale.CALLER})
        print(f"  {last:,} of {calls:,} ({time.perf_counter() - started:.0f} s)", flush=True)
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.exec_driver_sql("VACUUM ANALYZE tool_calls")
    engine.dispose()
    return time.perf_counter() - started


def pairs(small: str, large: str, calls: int) -> dict[str, Any]:
    """The two reads, each a pair of the same request to the small table's API and the large one's."""
    sides = {"small": (small, SMALL), "large": (large, calls)}

    def status(i: int) -> dict[str, float]:
        return {side: load.call("GET", f"{web}/voice-tools/status/{scale.call_id(1 + (i * SPREAD) % n)}",
                                200, headers=AUTH)[0] for side, (web, n) in sides.items()}

    def context(i: int) -> dict[str, float]:
        return {side: load.call("GET", f"{web}/voice-tools/context/"
                                       f"{scale.session_id(i * SPREAD, max(n // CALLS_PER_SESSION, 1))}",
                                200, headers=AUTH)[0] for side, (web, n) in sides.items()}

    return {"status": status, "context": context}


def main(argv: list[str] | None = None) -> int:
    import os

    parser = argparse.ArgumentParser(prog="python -m bench.large_tables", description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=10_000_000, help="calls in the large table (10,000,000)")
    parser.add_argument("--requests", type=int, default=400, help="timed requests of each kind to each side")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args(argv)

    with bench_servers("voice-tools-bench-large-") as data_dir:
        urls = {"small": database(os.environ["DATABASE_URL"], "voice_tools_small"),
                "large": database(os.environ["DATABASE_URL"], "voice_tools_large")}
        seeded = {}
        for side, calls in (("small", SMALL), ("large", args.calls)):
            print(f"seeding {calls:,} calls ({side}) ...", flush=True)
            seeded[side] = round(seed(urls[side], calls), 1)
        stacks = {}
        try:
            for side, url in urls.items():
                (data_dir / side).mkdir()
                stack = WebOnly(data_dir / side)
                stack.env["DATABASE_URL"] = url
                stacks[side] = stack.start()
            web = {side: stack.urls["web"] for side, stack in stacks.items()}
            results: dict[str, Any] = {"calls": {"small": SMALL, "large": args.calls}, "seeded_s": seeded}
            for name, pair in pairs(web["small"], web["large"], args.calls).items():
                print(f"{name}: {args.requests} of each side, alternately ...", flush=True)
                summary = report.summarize(load.run_pairs(pair, args.requests, warmup=20))
                results[name] = {**summary, "p50_ratio": round(summary["large"]["p50"] / summary["small"]["p50"], 2),
                                 "p99_ratio": round(summary["large"]["p99"] / summary["small"]["p99"], 2)}
        finally:
            for stack in stacks.values():
                stack.stop()
    print(json.dumps(results, indent=2))
    if args.out:
        args.out.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
