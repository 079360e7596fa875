"""The workers' Prometheus series (docs/operations.md, Metrics, lists them all).

They live in a registry of their own (:data:`REGISTRY`), never in prometheus-client's
default one, so the API's ``/metrics`` (which renders the default registry, or the
API's multiprocess folder) never shows them. The workers run in prefork mode with
``PROMETHEUS_MULTIPROC_DIR`` set to a folder that is theirs alone (the Procfile's
worker lines set it from ``VOICE_TOOLS_WORKER_METRICS_DIR``); every pool child writes
its own files there and the exporter (``voice_tools/worker_metrics.py``) adds them up.

Nothing is recorded outside a worker process (:func:`start_recording` is called at
``worker_init``): the API imports the same modules, and its transitions (a caller's
cancel) must not write worker series into the API's folder. The recording functions
only touch memory-mapped files: no database, no broker, no network.
"""
from __future__ import annotations

import functools
import logging
import os
from typing import Any, Callable

from prometheus_client import CollectorRegistry, Counter, Histogram

log = logging.getLogger(__name__)

REGISTRY = CollectorRegistry(auto_describe=True)

STEP_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
CALLBACK_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

CALLS_STARTED = Counter(
    "voice_tools_calls_started_total", "Chains begun on a worker: the first link of a tool's chain ran",
    ["tool"], registry=REGISTRY)
CALLS_ENDED = Counter(
    "voice_tools_calls_ended_total", "Calls a worker ended, by final status", ["tool", "status"], registry=REGISTRY)
STEP_DURATION = Histogram(
    "voice_tools_step_duration_seconds", "Time a link's run took up to its record on the call (gate, claim, the step, "
    "its record), one sample a run recorded (models/link_attempts.py)",
    ["tool", "step"], buckets=STEP_BUCKETS, registry=REGISTRY)
TASK_DURATION = Histogram(
    "voice_tools_task_duration_seconds", "Time a task other than a link took (callback delivery, sweeps)",
    ["task"], buckets=STEP_BUCKETS, registry=REGISTRY)
TASKS = Counter(
    "voice_tools_tasks_total", "Task runs by outcome (succeeded, retried, failed)", ["task", "outcome"],
    registry=REGISTRY)
CALLBACK_ATTEMPTS = Counter(
    "voice_tools_callback_attempts_total", "Callback delivery attempts by event and outcome "
    "(delivered, will_retry, gave_up)", ["event", "outcome"], registry=REGISTRY)
CALLBACK_DURATION = Histogram(
    "voice_tools_callback_attempt_duration_seconds", "Time one callback attempt took, by outcome",
    ["outcome"], buckets=CALLBACK_BUCKETS, registry=REGISTRY)
REDRIVES = Counter(
    "voice_tools_redrives_total", "Committed calls whose stopped chain the stuck-call sweep ran again",
    ["tool"], registry=REGISTRY)

_recording = False


def start_recording() -> None:
    """This process is a worker: record from now on (its forked pool children inherit it).

    The multiprocess folder is made if it is missing; if it cannot be, nothing is recorded
    (a warning says why): metrics never stop a worker from working.
    """
    global _recording
    folder = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    try:
        if folder:
            os.makedirs(folder, exist_ok=True)
    except OSError as exc:
        log.warning("worker metrics not recorded: PROMETHEUS_MULTIPROC_DIR %s: %s", folder, exc)
        return
    _recording = True


def recording() -> bool:
    return _recording


def _quiet(record: Callable[..., None]) -> Callable[..., None]:
    """Record only in a worker, and never let a metric fail the task that records it."""

    @functools.wraps(record)
    def quietly(*args: Any) -> None:
        if not _recording:
            return
        try:
            record(*args)
        except Exception:
            log.warning("metric not recorded: %s%r", record.__name__, args, exc_info=True)

    return quietly


@_quiet
def call_started(tool: str) -> None:
    CALLS_STARTED.labels(tool).inc()


@_quiet
def call_ended(tool: str, status: str) -> None:
    CALLS_ENDED.labels(tool, status).inc()


@_quiet
def step_ran(tool: str, step: str, seconds: float) -> None:
    STEP_DURATION.labels(tool, step).observe(seconds)


@_quiet
def task_ran(task: str, seconds: float) -> None:
    TASK_DURATION.labels(task).observe(seconds)


@_quiet
def task_outcome(task: str, outcome: str) -> None:
    TASKS.labels(task, outcome).inc()


@_quiet
def callback_attempt(event: str, state: str, seconds: float) -> None:
    """One attempt's outcome from the row's new ``state``: delivered, pending (will_retry), failed (gave_up)."""
    outcome = {"delivered": "delivered", "pending": "will_retry"}.get(state, "gave_up")
    CALLBACK_ATTEMPTS.labels(event, outcome).inc()
    CALLBACK_DURATION.labels(outcome).observe(seconds)


@_quiet
def redriven(tool: str) -> None:
    REDRIVES.labels(tool).inc()

