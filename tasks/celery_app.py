"""The Celery app, made here and nowhere else; no task module is imported here (the
``tasks`` package does that, so ``celery -A tasks`` finds the app with every task).

Queues are declared here from the tool registry (one ``tools.<name>`` per tool, plus
``callbacks`` and ``maintenance``) so Flower knows them with no worker online, and a
plain ``celery -A tasks worker`` consumes them all.
"""
import gc

import voice_tools_tracing  # noqa: F401  (first: with tracing off, redis-py will not load the SDK)
from tasks.worker import tracing
from celery import Celery
from celery.signals import worker_before_create_process, worker_process_init

from celeryconfig import queue
from models import db
from tasks import base, tools
from tasks.flower_app import data_dir_option
from tasks.worker import beat_thread
from tasks.worker import log_context
from tasks.worker import metrics_thread
from tasks.worker import groups
from tasks.worker import late_sigterm
from tasks.worker import schema_wait

app = Celery("tasks", task_cls=base.Task,  # every task's base class (tasks/base.py)
             events="tasks.worker.task_events:Events")  # task events published off the loop (tasks/worker/task_events.py)
app.config_from_object("celeryconfig")
app.conf.task_queues = tuple(
    [queue(tool.queue) for tool in tools.TOOLS.values()] + [queue("callbacks"), queue("maintenance")]
)

# A preload option: Celery gives it to every command (worker, inspect, status, events, flower, calls …)
# and sends ``user_preload_options`` with it before the command runs. The handler, which joins the
# data dir's embedded servers when no server variable is set, is the commands floor's
# (``voice_tools/celery_commands.py``, loaded by Celery's CLI as the ``celery.commands`` plug-in).
app.user_options["preload"].add(data_dir_option())

groups.install(app)
late_sigterm.install(app)  # a SIGTERM again as a stopped worker exits: still exit 0
beat_thread.install(app)
metrics_thread.install(app)
schema_wait.install(app)  # on a schema too old for this release, the worker consumes nothing until migrated
tracing.install(app)  # with OTEL_EXPORTER_OTLP_ENDPOINT set: a span per task, in a worker and in beat (tasks/worker/tracing.py)


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

