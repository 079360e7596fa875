"""The one Task base class of every task (links, callback delivery, sweeps), in the
style of Warehouse's ``warehouse/tasks.py``: retries, metrics and after-commit
enqueueing in one place. The app makes it the default (``Celery(task_cls=...)``), so a
plain ``@app.task`` gets it; :class:`tasks.chains.Link` subclasses it.

- **Retries.** The database went away in a task's own statements (a restart, a
  failover): the task runs again later with backoff (Celery's ``autoretry_for``).
  Every task is idempotent, so this is safe. A sweep opts out (beat runs it again).
- **Metrics.** Each run is timed (Celery's ``task_prerun`` / ``task_postrun``) and
  ``on_success`` / ``on_retry`` / ``on_failure`` count its outcome
  (``tasks/metrics.py``); a subclass says what else a run means with
  :meth:`Task.begun` and :meth:`Task.ran`. Only memory-mapped files are touched: no
  database round trip is added to any task.
- **After-commit enqueueing.** ``apply_async`` inside an open ``db.session()`` block
  publishes once that transaction has committed, and never if it rolls back; outside
  one it publishes at once (and returns the ``AsyncResult``, as Celery does).
- **Bounded publishing.** A publish given no producer takes one on the publishing path
  (``tasks/publishing.py``: one pooled connection, taken within ``broker_pool_acquire_timeout``,
  checked with the publish's own retry policy), never Celery's producer pool, whose connection
  wait has no bound: a pool still empty after the wait is kombu's ``OperationalError``.
"""
from __future__ import annotations

import time
from typing import Any

import celery
from celery.signals import task_postrun, task_prerun, worker_init
from sqlalchemy.exc import InterfaceError, OperationalError

from models import db
from tasks import publishing
from tasks.worker import metrics


class Task(celery.Task):
    # The database went away in the task's own statements: run it again later. The
    # message is acknowledged only when the retry has been published.
    autoretry_for = (OperationalError, InterfaceError)
    retry_backoff = 1
    retry_backoff_max = 30
    retry_jitter = True
    max_retries = 40

    # -- what a run means; a subclass says more (called from the signals below) --------

    def begun(self) -> None:
        """Called as a run begins (in the process that runs it)."""

    def ran(self, seconds: float) -> None:
        """Called as a run ends, however it ended (not when its process was killed)."""
        metrics.task_ran(self.name, seconds)

    # -- outcomes ---------------------------------------------------------------------

    def on_success(self, retval: Any, task_id: str, args: Any, kwargs: Any) -> None:
        metrics.task_outcome(self.name, "succeeded")

    def on_retry(self, exc: BaseException, task_id: str, args: Any, kwargs: Any, einfo: Any) -> None:
        metrics.task_outcome(self.name, "retried")

    def on_failure(self, exc: BaseException, task_id: str, args: Any, kwargs: Any, einfo: Any) -> None:
        """Also called in the worker's main process when a pool child was killed at the hard time limit."""
        metrics.task_outcome(self.name, "failed")

    # -- enqueueing --------------------------------------------------------------------

    def apply_async(self, args: Any = None, kwargs: Any = None, **options: Any) -> Any:
        s = db.current()
        if s is not None:
            db.after_commit(s, self._publish, args, kwargs, **options)
            return None
        return self._publish(args, kwargs, **options)

    def _publish(self, args: Any, kwargs: Any, **options: Any) -> Any:
        """Celery's ``apply_async`` on a producer of the publishing path, unless one is given."""
        if options.get("producer") is not None or self.app.conf.task_always_eager:
            return super().apply_async(args, kwargs, **options)
        policy = options.get("retry_policy") or self.app.conf.task_publish_retry_policy
        with publishing.producer(self.app, policy) as producer:
            return super().apply_async(args, kwargs, producer=producer, **options)


@worker_init.connect
def _record_worker_metrics(**_: object) -> None:
    """A worker's main process, before its pool forks: its children record too."""
    metrics.start_recording()


# Each run is timed between Celery's own signals rather than in an overridden
# ``__call__``: the worker then calls ``run`` directly (its fast path), and the request a
# link changes (``request.chain = None`` ends its chain) is the one Celery reads after.

@task_prerun.connect
def _begun(sender: Any = None, **_: Any) -> None:
    if isinstance(sender, Task):
        sender.request.metrics_started = time.perf_counter()
        sender.begun()


@task_postrun.connect
def _ran(sender: Any = None, **_: Any) -> None:
    started = getattr(sender.request, "metrics_started", None) if isinstance(sender, Task) else None
    if started is not None:
        sender.ran(time.perf_counter() - started)
