"""``celery -A tasks worker --group reads``: a worker consumes its group's tool queues.

A tool declares its worker group (``Tool.group``; ``writes`` or ``reads`` by default),
so the Procfile's worker lines name a group, never a list of queues: a new tool in an
existing group is consumed with no Procfile change. ``--group`` adds to ``--queues``
when both are given; it may be repeated or comma-separated (``--group reads,writes``).

Celery's own machinery does the work: a worker command-line option
(``app.user_options``) and a worker bootstep that narrows the queues the worker
consumes (``WorkController.setup_queues``, the same call ``-Q`` makes) before the
consumer starts.
"""
from __future__ import annotations

from typing import Any

import click
from celery import bootsteps
from celery.exceptions import ImproperlyConfigured

from tasks import tools


def queues_of(groups: list[str]) -> list[str]:
    """The queues of ``groups``; an unknown group is an error naming the known ones."""
    known = tools.worker_groups()
    unknown = [g for g in groups if g not in known]
    if unknown:
        raise ImproperlyConfigured(
            f"unknown worker group {', '.join(unknown)}: the tools declare {', '.join(sorted(known))}")
    return [queue for group in groups for queue in known[group]]


def _split(values: Any) -> list[str]:
    if not values:
        return []
    if isinstance(values, str):
        values = [values]
    return [part.strip() for value in values for part in str(value).split(",") if part.strip()]


class ToolGroupQueues(bootsteps.Step):
    """Consume the queues of the worker's ``--group`` (plus any ``--queues``)."""

    def __init__(self, worker: Any, group: Any = None, queues: Any = None, exclude_queues: Any = None,
                 **options: Any) -> None:
        groups = _split(group)
        if groups:
            wanted = _split(queues) + [q for q in queues_of(groups) if q not in _split(queues)]
            worker.setup_queues(wanted, exclude_queues)
        super().__init__(worker, **options)


def install(app: Any) -> None:
    app.user_options["worker"].add(click.Option(
        ["--group"], multiple=True,
        help="Consume the queues of the tools of this worker group (see Tool.group); repeatable."))
    app.steps["worker"].add(ToolGroupQueues)
