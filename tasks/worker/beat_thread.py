"""``celery -A tasks worker --beat-thread``: beat inside the worker, as a thread of its main process.

Celery's own ``--beat`` runs the embedded beat (``celery.beat.EmbeddedService``) in a
forked process, which costs ~30 MB once its pages are copied; Celery makes the same
service as a thread when asked (``thread=True``), which this worker option and bootstep
do. For a system with one worker (``voice-tools run``'s ``Procfile.local``); production
runs ``celery -A tasks beat`` beside its workers, on one host or more (each sweep works once a
period however many beats send it: ``tasks/sweeps.py``). Either keeps its schedule in memory
(``celeryconfig.beat_scheduler``): the schedule file Celery passes is never written.
"""
from __future__ import annotations

from typing import Any

import click
from celery import bootsteps


class BeatThread(bootsteps.StartStopStep):
    """Start and stop the embedded beat service as a thread (``--beat-thread``)."""

    label = "Beat (thread)"
    conditional = True

    def __init__(self, worker: Any, beat_thread: bool = False, **options: Any) -> None:
        self.enabled = bool(beat_thread)
        super().__init__(worker, **options)

    def create(self, worker: Any) -> Any:
        from celery.beat import EmbeddedService

        return EmbeddedService(worker.app, schedule_filename=worker.schedule_filename,
                               scheduler_cls=worker.scheduler, thread=True)


def install(app: Any) -> None:
    app.user_options["worker"].add(click.Option(
        ["--beat-thread"], is_flag=True, default=False,
        help="Run beat inside this worker as a thread (--beat forks a process for it)."))
    app.steps["worker"].add(BeatThread)
