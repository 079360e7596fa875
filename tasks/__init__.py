"""The Celery app with every task: ``celery -A tasks worker|beat|flower`` from the repo root.

The app is made in ``tasks/celery_app.py``; importing the task modules here registers
their tasks. A module of this package imports ``tasks.celery_app`` for the app, never
this package's ``app``.
"""
from tasks.celery_app import app
from tasks import chains
from tasks.calls import actions
from tasks.delivery import attempts
from tasks import sweeps

__all__ = ["app"]
