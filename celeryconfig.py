"""Celery settings: queues, routes, acknowledgements and beat's schedule.

Queues: one per tool, ``tools.<name>`` (declared from the tool registry by the app in
``tasks/celery_app.py``), plus ``callbacks`` (delivery retries) and ``maintenance``
(beat sweeps). Task names are dotted; the router sends ``tools.<name>.<step>`` to
``tools.<name>`` and ``callbacks.*`` / ``maintenance.*`` to their own queue.

The broker is Redis unless ``CELERY_BROKER_URL`` names RabbitMQ (``amqp://``): there
every queue is a quorum queue (replicated on a cluster), see :func:`queue`.
"""
import os
import time
import warnings
from urllib.parse import urlsplit

from celery.beat import BeatLazyFunc
from celery.exceptions import SecurityWarning
from kombu import Exchange, Queue

from models.settings import load as _load_settings

_settings = _load_settings()

broker_url = _settings.broker_url or "redis://127.0.0.1:6379/0"
broker_connection_retry_on_startup = True
# A publish waits at most this long for a producer of the app's pool (``broker_pool_limit``, 10), then
# gives up (kombu's OperationalError: the API answers 503 with Retry-After); Celery waits for ever
# otherwise. A publish holds its producer only while it sends (tasks/chains.py, ``enqueue``).
broker_pool_acquire_timeout = 5.0
# RabbitMQ (py-amqp, kombu's "amqp" driver): its schemes as kombu names them.
AMQP = urlsplit(broker_url.split(";")[0]).scheme in ("amqp", "amqps", "pyamqp", "pyamqps")


def restore_lock_s(visibility_timeout: int) -> int:
    """How long the sweep's lock in Redis may outlive a worker killed while holding it.

    The sweep takes the lock for its scan (milliseconds). A worker killed meanwhile leaves
    it to expire, and until then no worker restores anything: kombu's 300 s would hold
    every lost link up to 300 s past a shorter timeout (seen in the fault suite: a worker
    SIGKILLed mid-sweep, then a link lost in a Redis restart sat unrestored past the
    test's wait). So the lock lasts no longer than the timeout itself (5 s at least).
    """
    return max(5, min(300, visibility_timeout))


if AMQP:
    # RabbitMQ gives an unacknowledged message back to its queue as soon as the
    # connection of the worker that held it closes (a worker SIGKILLed as a whole):
    # no visibility timeout to set. Quorum queues need per-consumer prefetch (no
    # global QoS): Celery sees them (worker_detect_quorum_queues, on by default).
    worker_detect_quorum_queues = True
    # A link's countdown retry and a callback's eta retry go through Celery's native
    # delayed delivery: a chain of delay queues in the broker (quorum ones here), so no
    # worker holds a message waiting for its time (see queue()).
    broker_native_delayed_delivery_queue_type = "quorum"
    # Publisher confirms: a publish returns once RabbitMQ has taken the message, and raises
    # when it refuses it, as a Redis LPUSH answers once Redis has it. Without them a refused
    # or lost publish looks sent, and the API would answer 202 for a chain that is not there.
    broker_transport_options = {"confirm_publish": True}
    # A queue Celery makes from a bare name (a worker's -Q naming a tool that an --include'd
    # module registers after the app was set up) is the same as queue(name) makes.
    # (``control add_consumer`` of a name the worker does not know still makes a classic one.)
    task_create_missing_queue_type = "quorum"
    task_create_missing_queue_exchange_type = "topic"
else:
    # Redis redelivers an unacknowledged message after this many seconds (a worker that
    # was SIGKILLed as a whole). Keep it above the longest step time limit.
    _visibility_timeout = int(os.environ.get("VOICE_TOOLS_VISIBILITY_TIMEOUT", "600"))
    broker_transport_options = {
        "visibility_timeout": _visibility_timeout,
        # How often a worker sweeps for such messages. kombu's default sweep runs about
        # every 100 s (interval 10 s x throttle 10), which would hold a lost link for up
        # to 100 s past the timeout; sweep every tenth of the timeout (1..10 s) instead.
        "unacked_restore_interval": max(1, min(10, _visibility_timeout // 10)),
        "unacked_restore_throttle": 1,
        "unacked_mutex_expire": restore_lock_s(_visibility_timeout),
    }
# The database holds every outcome: no result backend.
result_backend = None
task_ignore_result = True

# Celery warns at every worker start when it runs as root. With JSON only (no pickle) a
# root worker runs no code a message sends, so Celery only warns; the cause is the user
# the processes run as, which production fixes (an unprivileged user, or --uid). A local
# ``voice-tools run`` (VOICE_TOOLS_LOCAL_RUN, set by the launcher) on a machine where
# everything is root says so once in its banner instead of once per worker start.
if os.environ.get("VOICE_TOOLS_LOCAL_RUN") == "1":
    warnings.filterwarnings("ignore", category=SecurityWarning)

task_serializer = "json"
accept_content = ["json"]
timezone = "UTC"
enable_utc = True

# A link is acknowledged only after it ran, and redelivered if its worker died.
task_acks_late = True
task_reject_on_worker_lost = True
worker_prefetch_multiplier = 1
# Celery's consumer, kept alive when the broker restarts with links in flight (see tasks/worker/consumer.py).
worker_consumer = "tasks.worker.consumer:Consumer"
task_time_limit = 120
task_soft_time_limit = 90

worker_send_task_events = True
task_send_sent_event = True

task_default_queue = "maintenance"
task_default_exchange = "maintenance"
task_default_routing_key = "maintenance"


def queue(name: str) -> Queue:
    """A queue with an exchange and a routing key of its own (``tools.send_email`` → exchange and key
    ``tools.send_email``), as the Celery routing docs declare them: a message routed to one queue
    lands in that queue only, on Redis and on RabbitMQ alike.

    On RabbitMQ the queue is a durable quorum queue, and its exchange a topic one: Celery's
    native delayed delivery (the only way a quorum queue delays a message) forwards a due
    message to the queue's exchange with the key ``<delay bits>.<name>``, which a direct
    exchange would drop; the worker binds ``#.<name>`` for it. With no wildcard in the
    queue's own key, the topic exchange routes ``<name>`` to that queue only, as a direct one.
    """
    if AMQP:
        return Queue(name, Exchange(name, type="topic"), routing_key=name, durable=True,
                     queue_arguments={"x-queue-type": "quorum"})
    return Queue(name, Exchange(name, type="direct"), routing_key=name)


def route_by_name(name, args, kwargs, options, task=None, **kw):
    """``tools.send_email.SENDING`` -> ``tools.send_email``; ``callbacks.x`` -> ``callbacks``."""
    parts = name.split(".")
    if parts[0] == "tools" and len(parts) >= 3:
        return {"queue": f"tools.{parts[1]}"}
    if parts[0] in ("callbacks", "maintenance"):
        return {"queue": parts[0]}
    return None


task_routes = (route_by_name,)

# beat's sweeps, each every so many seconds (models.settings.SWEEPS: VOICE_TOOLS_*_EVERY,
# docs/operations.md "Configuration"). Each is sent with its period and the time beat sent it
# (a BeatLazyFunc is called at each send): of any number of beats' sends in one period, one run
# works (tasks/sweeps.py, models/sweep_runs.py).
beat_schedule = {task: {"task": task, "schedule": every, "kwargs": {"every": every, "sent_at": BeatLazyFunc(time.time)}}
                 for task, every in _settings.sweep_every_s.items()}
# Beat keeps its schedule in memory (Celery's base scheduler): no schedule file on any disk. The
# database says whether a period's sweep ran, so a beat that restarts, or a second one, has
# nothing of its own to remember.
beat_scheduler = "celery.beat:Scheduler"
