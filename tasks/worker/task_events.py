"""Celery's task events (what Flower shows) published by a thread of each process, off the loop that dispatches links.

The worker sends ``task-received``, ``task-started`` and ``task-succeeded`` of every task from its
main process, buffered and flushed by the event loop that also hands the next link to the pool;
each process that sends a task (a pool child sending a chain's next link, the API sending a chain)
publishes its ``task-sent`` right after it. Celery publishes each of them there and then: one
Redis ``PUBLISH`` round trip (and a Redis client made for it), on the loop's or the link's clock.
Measured with py-spy on a busy worker: 45 % of its main process's samples.

Here the event dispatcher is Celery's own (:class:`celery.events.EventDispatcher`: the same
events, clock, hostname and groups, the same buffering of the ``task`` group), except that the
publish itself hands the event to a thread of the process (one per process, made again in a
forked child; ``tasks/worker/lingering.py``), which publishes what has queued up in one batch
(kombu's ``Producer.batch``: one pipeline on Redis) through a broker connection of its own. The thread waits :data:`LINGER_S`
after an event arrives before it publishes, so that the events of the next moments go with it: a
link's four events, and a chain's, cost one pipeline instead of one each (measured on Redis:
0.25 ms of CPU for an event published alone, 0.06 in a batch of ten, 0.04 in a hundred); Flower
shows a task at most that much later. Events stay in their order; a broker
away makes the thread reconnect and try again, and past :data:`BACKLOG` queued events the oldest
are dropped (events are for watching, the database holds every outcome). A dispatcher closed (the
worker stopping) first waits, briefly, for what it queued to be published.

The app takes it with ``Celery(events="tasks.worker.task_events:Events")`` (``tasks/celery_app.py``).
"""
from __future__ import annotations

import logging
import time
from typing import Any

from celery.app.events import Events as CeleryEvents
from celery.events.dispatcher import EventDispatcher

from tasks.worker.lingering import LingeringThread, per_process

log = logging.getLogger(__name__)

BACKLOG = 10_000  # events queued at most per process; past it the oldest are dropped
BATCH = 500  # events published in one pipeline at most
RECONNECT_S = 1.0  # the wait before trying a broker that refused again
CLOSE_WAIT_S = 2.0  # how long a closing dispatcher waits for its events to be published
LINGER_S = 0.1  # how long the first event of a batch waits for others to join it


class _Publisher(LingeringThread):
    """The process's publishing thread: takes events from :meth:`put`, publishes them in order."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.connection: Any = None
        self.producer: Any = None
        super().__init__("task-events", LINGER_S, BATCH, backlog=BACKLOG)

    def handle(self, batch: list[tuple[Any, ...]]) -> None:
        for attempt in (1, 2):
            try:
                producer = self._producer()
                if producer.supports_batch_publish:
                    with producer.batch(max_size=BATCH):
                        for item in batch:
                            self._publish(producer, *item)
                else:
                    for item in batch:
                        self._publish(producer, *item)
                break
            except Exception as exc:  # the broker is away: a new connection, once more, then drop them
                self._reset()
                if attempt == 2:
                    log.warning("%d task events not published: %s", len(batch), exc)
                    break
                time.sleep(RECONNECT_S)
        if self.dropped:
            log.warning("%d task events dropped: more than %d were waiting", self.dropped, BACKLOG)
            self.dropped = 0

    @staticmethod
    def _publish(producer: Any, event: Any, routing_key: str, exchange: Any, serializer: str,
                 headers: dict[str, Any], delivery_mode: int) -> None:
        producer.publish(event, routing_key=routing_key, exchange=exchange.name, declare=[exchange],
                         serializer=serializer, headers=headers, delivery_mode=delivery_mode)

    def _producer(self) -> Any:
        if self.producer is None:
            from kombu import Producer

            self.connection = self.app.connection_for_write()
            self.connection.ensure_connection(max_retries=1)
            self.producer = Producer(self.connection, auto_declare=False)
        return self.producer

    def _reset(self) -> None:
        connection, self.connection, self.producer = self.connection, None, None
        if connection is not None:
            try:
                connection.release()
            except Exception:
                pass


# this process's publishing thread (started at its first event; a forked child starts its own)
publisher = per_process(_Publisher)


class Dispatcher(EventDispatcher):
    """Celery's event dispatcher, whose publishes are made by the process's publishing thread."""

    def _publish(self, event: Any, producer: Any, routing_key: str, retry: bool = False,
                 retry_policy: Any = None, **_: Any) -> None:
        if producer is None:  # closed, or disabled: as Celery's, nothing is sent
            return
        publisher(self.app).put((event, routing_key, self.exchange, self.serializer, self.headers,
                                 self.delivery_mode))

    def close(self) -> None:
        found = publisher.here() if self.producer is not None else None
        if found is not None:
            found.drain(CLOSE_WAIT_S)
        super().close()


class Events(CeleryEvents):
    dispatcher_cls = "tasks.worker.task_events:Dispatcher"
