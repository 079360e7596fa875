"""The Celery app with every task: ``celery -A tasks worker|beat|flower`` from the repo root.

The app is made in ``tasks/celery_app.py``; ``tasks.app`` (what ``celery -A tasks`` and
``from tasks import app`` read) imports the task modules first, so it has every task.
Importing a module of this package imports nothing else: a light process takes
``tasks.delivery.signing`` without Celery. A module of this package imports
``tasks.celery_app`` for the app, never this package's ``app``.
"""
from __future__ import annotations

from typing import Any

__all__ = ["app"]


def __getattr__(name: str) -> Any:
    if name != "app":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from tasks.celery_app import app
    from tasks import chains  # noqa: F401  (each import registers its tasks)
    from tasks.delivery import attempts  # noqa: F401
    from tasks.delivery import transport  # noqa: F401  (the workers' callbacks: loaded before the pool forks)
    from tasks import sweeps  # noqa: F401

    globals()["app"] = app
    return app
