"""The producer every publish sends on: one connection of the Celery app's broker pool, taken within a
bound, checked, and nothing else pooled taken while it is held. A chain's start takes it here
(``tasks/chains.py``, ``enqueue``); every other publish (a callback's dispatch or retry, a task's
retry, a worker's next link) takes it in the one base Task's ``apply_async`` (``tasks/base.py``).

Celery's own way (``producer_or_acquire``) takes a producer from the app's producer pool, whose
producer then takes a connection from the connection pool with no bound (kombu's ``ProducerPool``
acquires it with ``block=True``). The producer pool also counts twice the connections there are
(Celery sets its limit after kombu made it, and kombu's resize fills it again), so it never refuses
and ``broker_pool_acquire_timeout`` never applies: a thread short of a connection waits for ever.
:func:`producer` takes the connection itself, with Celery's bounded acquire
(``connection_or_acquire``: ``broker_pool_acquire_timeout`` in ``celeryconfig``), and makes the
producer on it; a pool still empty after that wait, or a broker that does not answer the quick
reconnect, is kombu's ``OperationalError`` (the API answers 503 with ``Retry-After``).
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from celery import Celery
from kombu import Producer

# The faces publish while a caller waits on the line: one quick reconnect, then the
# broker is "unavailable" (503; the relay may retry). Left to kombu's defaults, a
# process that has never reached the broker keeps trying for about 6 s first
# (``broker_connection_timeout`` around redis-py's connect).
QUICK_RETRY = {"max_retries": 1, "interval_start": 0, "interval_step": 0.2, "interval_max": 0.2}

RECONNECT = ("max_retries", "interval_start", "interval_step", "interval_max")  # of a retry policy: the reconnects


@contextmanager
def producer(app: Celery, retry_policy: dict[str, float] | None = None) -> Iterator[Producer]:
    """A producer on one of ``app``'s pooled connections, taken within ``broker_pool_acquire_timeout`` and
    checked (with ``retry_policy``'s reconnects: by default one quick one); the connection goes back to the
    pool at the end."""
    policy = QUICK_RETRY if retry_policy is None else retry_policy
    with app.connection_or_acquire() as connection:
        connection.ensure_connection(timeout=1, **{key: value for key, value in policy.items() if key in RECONNECT})
        yield app.amqp.Producer(connection)
