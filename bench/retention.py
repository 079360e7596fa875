"""The retention purge on a full table, while the API serves: ``python -m bench.retention [--calls N]``.

Seeds ``N`` calls (``bench/scale.py``: one in 20 still open, the others COMPLETED, created and
ended one a second over the last ``N`` seconds) with one settled event each, starts the API
under gunicorn from the Procfile's ``web`` line (``bench/stack.py``), and times ``GET
/voice-tools/status`` of calls the purge keeps (4 clients, keep-alive): first for
``--seconds`` with nothing else running, then while ``tasks.calls.maintenance.purge`` removes
the ended calls older than half the seeded span, with their events, in batches of 1000. It
prints (and, with ``--out``, writes as JSON) the two p50/p99, their ratios, and the purge's
rows, batches and seconds. Embedded servers under a temporary folder, as ``python -m bench``.
Asserts no time: the figures are for docs/operations.md (Retention).
"""
from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import load, scale  # noqa: E402
from bench.calls import AUTH  # noqa: E402
from bench.run import bench_servers  # noqa: E402
from bench.stack import Stack  # noqa: E402

CLIENTS = 4
BATCH = 1000

EVENTS = """
INSERT INTO callback_deliveries (event_id, tool_call_id, event, seq, payload, url, session_id, state, created_at)
SELECT md5(tool_call_id), tool_call_id, 'completed', 1, '{}'::jsonb, NULL, session_id, 'none', created_at
FROM tool_calls WHERE status = 'COMPLETED'
"""


class WebOnly(Stack):
    """The Procfile's ``web`` line alone: the purge runs in this process, no worker is needed."""

    def __init__(self, data_dir: Path):
        super().__init__(data_dir)
        self.commands = {"web": self.commands["web"]}

    def _wait_ready(self, timeout: float) -> None:
        self._until(lambda: self._answers(self.urls["web"]), "web", time.monotonic() + timeout)


def reads(web: str, calls: int, until: Any) -> list[float]:
    """Seconds of each ``status`` read of a call the purge keeps (created in the newest half),
    from ``CLIENTS`` threads, until ``until()`` says stop."""
    samples: list[float] = []
    lock = threading.Lock()
    spread = 7919  # a prime: reads all over the kept half

    def client(c: int) -> None:
        i = c
        while not until():
            tool_call_id = scale.call_id(1 + (i * spread) % (calls // 2))
            seconds, _ = load.call("GET", f"{web}/voice-tools/status/{tool_call_id}", 200, headers=AUTH)
            with lock:
                samples.append(seconds)
            i += CLIENTS

    threads = [threading.Thread(target=client, args=(c,)) for c in range(CLIENTS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return samples


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.retention", description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=1_000_000, help="calls seeded (default 1,000,000)")
    parser.add_argument("--seconds", type=float, default=20.0, help="seconds of reads with no purge (default 20)")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args(argv)

    with bench_servers("voice-tools-bench-retention-") as data_dir:
        from sqlalchemy import text

        from models import db
        from tasks.calls import maintenance

        print(f"seeding {args.calls:,} calls and their events ...", flush=True)
        started = time.perf_counter()
        scale.seed(args.calls, max(args.calls // 10, 1))
        with db.engine().begin() as conn:
            conn.execute(text(EVENTS))
        with db.engine().connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.exec_driver_sql("ANALYZE")
        seeded_s = time.perf_counter() - started
        with WebOnly(data_dir) as stack:
            web = stack.urls["web"]
            load.call("GET", f"{web}/voice-tools/status/{scale.call_id(1)}", 200, headers=AUTH)  # warm
            quiet_until = time.monotonic() + args.seconds
            quiet = reads(web, args.calls, lambda: time.monotonic() > quiet_until)

            outcome: dict[str, Any] = {}

            def purge() -> None:
                begun = time.perf_counter()
                outcome["purged"] = maintenance.purge(calls_s=args.calls / 2, events_s=0, batch=BATCH)
                outcome["seconds"] = time.perf_counter() - begun

            purging = threading.Thread(target=purge)
            purging.start()
            during = reads(web, args.calls, lambda: not purging.is_alive())
            purging.join()
    purged = outcome["purged"]
    base, busy = load.summary(quiet), load.summary(during)
    from models import settings

    results = {
        "calls": args.calls, "seeded_s": round(seeded_s, 1), "pause": settings.load().purge_pause,
        "purge": {"calls": purged.calls, "events": purged.events, "batches": purged.batches,
                  "seconds": round(outcome["seconds"], 1),
                  "rows_per_s": round((purged.calls + purged.events) / outcome["seconds"])},
        "status_quiet_ms": {k: round(v, 2) for k, v in base.items()},
        "status_during_purge_ms": {k: round(v, 2) for k, v in busy.items()},
        "p50_ratio": round(busy["p50"] / base["p50"], 2), "p99_ratio": round(busy["p99"] / base["p99"], 2),
    }
    print(json.dumps(results, indent=2))
    if args.out:
        args.out.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
