"""A release's migrations on a large table under steady traffic: ``python -m bench.migration [--calls N]``.

A database of ``--calls`` calls (1,000,000 by default; ``bench/scale.py``'s rows), the Procfile's
web and worker processes of this checkout on it, and one client recording and running a
``search_contacts`` call (``pending``, then ``confirm?wait``) at a steady rate (``--rate``, per second)
the whole time. While it runs: ``voice-tools migrate --to`` the first release's revision (every
downgrade keeps the data: the indexes and the trigger go, the columns stay), then ``voice-tools migrate``,
which runs this release's migrations again over the million rows (the console's three indexes built
concurrently, the columns' statements finding them there). Printed (and, with ``--out``, written as
JSON): each phase's requests, p50/p99/max in ms, the answers that were not 2xx and the calls that did
not complete, and how long each migration command took. Embedded servers under a temporary folder, as
``python -m bench``; asserts no time.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import large_tables  # noqa: E402
from bench.calls import AUTH  # noqa: E402
from bench.load import summary  # noqa: E402
from bench.run import bench_servers  # noqa: E402
from bench.stack import Stack  # noqa: E402

FIRST_RELEASE_HEAD = "0017"  # 0.1.0's newest revision: this release's migrations are the ones after it


class Traffic(threading.Thread):
    """Calls at a steady rate; each request's latency kept under the phase it began in."""

    def __init__(self, url: str, rate: float):
        super().__init__(daemon=True)
        import requests

        self.http = requests.Session()
        self.http.headers.update(AUTH)
        self.url, self.interval = url, 1.0 / rate
        self.phase = "before"
        self.samples: dict[str, list[float]] = {}
        self.errors: dict[str, list[str]] = {}
        self.stopped = threading.Event()

    def request(self, method: str, path: str, **kw: Any) -> Any:
        phase, started = self.phase, time.perf_counter()
        try:
            answer = self.http.request(method, f"{self.url}{path}", timeout=30, **kw)
            ok = answer.status_code < 300
            body = answer.json() if ok else None
            if not ok:
                self.errors.setdefault(phase, []).append(f"{method} {path.split('/')[2]} {answer.status_code}")
        except Exception as exc:  # a refused or cut request counts as failed
            body = None
            self.errors.setdefault(phase, []).append(f"{method} {type(exc).__name__}")
        self.samples.setdefault(phase, []).append(time.perf_counter() - started)
        return body

    def run(self) -> None:
        n = 0
        while not self.stopped.is_set():
            due = time.perf_counter() + self.interval
            n += 1
            made = self.request("POST", "/voice-tools/pending", json={
                "session_id": f"s_migration_{n % 50}", "function": "search_contacts", "parameters": {"query": "john"}})
            if made:
                done = self.request("POST", f"/voice-tools/confirm/{made['tool_call_id']}?wait=20")
                if done and done.get("status") != "COMPLETED":
                    self.errors.setdefault(self.phase, []).append(f"call {done.get('status')}")
            time.sleep(max(0.0, due - time.perf_counter()))


def migrate(*args: str) -> float:
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "voice_tools", "migrate", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=3600, env=dict(os.environ))
    if done.returncode != 0:
        raise RuntimeError(f"voice-tools migrate {' '.join(args)} failed:\n{done.stdout}\n{done.stderr}")
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.migration", description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=1_000_000)
    parser.add_argument("--rate", type=float, default=5.0, help="calls per second (each a pending and a confirm)")
    parser.add_argument("--settle", type=float, default=10.0, help="seconds of traffic before and after")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    with bench_servers("vt-bench-migration-") as data_dir:
        print(f"seeding {args.calls:,} calls", flush=True)
        seeded = large_tables.seed(os.environ["DATABASE_URL"], args.calls)
        stack = Stack(data_dir / "stack", names=("web", "writes", "reads", "callbacks")).start()
        traffic = Traffic(stack.urls["web"], args.rate)
        took: dict[str, float] = {}
        try:
            traffic.start()
            time.sleep(args.settle)
            traffic.phase = "downgrade"
            took["downgrade"] = migrate("--to", FIRST_RELEASE_HEAD)
            traffic.phase = "migrate"
            took["migrate"] = migrate()
            traffic.phase = "after"
            time.sleep(args.settle)
        finally:
            traffic.stopped.set()
            traffic.join(60)
            stack.stop()
    phases = {phase: {**summary(samples), "requests": len(samples), "failed": traffic.errors.get(phase, [])}
              for phase, samples in traffic.samples.items()}
    result = {"calls": args.calls, "seeded_s": round(seeded, 1), "rate": args.rate,
              "commands_s": {k: round(v, 1) for k, v in took.items()}, "phases": phases}
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
