"""The Celery app, made here and nowhere else; no task module is imported here (the
``tasks`` package does that, so ``celery -A tasks`` finds the app with every task).

Queues are declared here from the tool registry (one ``tools.<name>`` per tool, plus
``callbacks`` and ``maintenance``) so Flower knows them with no worker online, and a
plain ``celery -A tasks worker`` consumes them all.
"""
import gc

from celery import Celery
from celery.signals import worker_before_create_process, worker_process_init

from celeryconfig import queue
from models import db
from tasks import base, tools
from tasks.worker import beat_thread
from tasks.worker import log_context
from tasks.worker import metrics_thread
from tasks.worker import groups

app = Celery("tasks", task_cls=base.Task)  # every task's base class (tasks/base.py)
app.config_from_object("celeryconfig")
app.conf.task_queues = tuple(
    [queue(tool.queue) for tool in tools.TOOLS.values()] + [queue("callbacks"), queue("maintenance")]
)

groups.install(app)
beat_thread.install(app)
metrics_thread.install(app)


@worker_before_create_process.connect
def _freeze_before_fork(**_: object) -> None:
    """Keep the parent's objects out of the children's garbage collections (``gc.freeze``, as
    Python's docs advise before a fork): a collection writes to every object it scans,
    which copies each page of the parent's memory into every pool child (measured: 20-30 MB each)."""
    gc.freeze()


@worker_process_init.connect
def _fresh_connections_after_fork(**_: object) -> None:
    """A forked child must not share the parent's database connections (the HTTP session of
    callbacks is made again by ``tasks/delivery/transport.py`` itself, at every fork)."""
    db.dispose()

