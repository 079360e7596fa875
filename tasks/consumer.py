"""The worker's broker consumer: Celery's own, made to survive a broker restart with links in flight.

When the broker connection is lost, Celery 5.7 (``on_connection_error_after_connected``)
``collect()``\\ s the broken connection, which closes it and detaches its transport, and
then ``close()``\\ s it a second time. With the Redis transport and a link still running
(``task_acks_late``: its message is unacknowledged) that second close raises
``AttributeError`` (the channel tries to requeue the message through the detached
transport, after dropping its own Redis connection pool). Celery takes that for an
unrecoverable error and the whole worker exits, leaving the call EXECUTING (and
``voice-tools run`` stops: honcho ends every process when one ends).

So the second close is skipped: ``collect()`` has already released the connection,
as it did before Celery 5.7. The old channel keeps its Redis pool, so the running link
is acknowledged on the restarted server when it ends, and the consumer reconnects.
"""
from __future__ import annotations

from celery.worker.consumer import Consumer as CeleryConsumer


def _already_released() -> None:
    return None


class Consumer(CeleryConsumer):
    def on_connection_error_after_connected(self, exc: Exception) -> None:
        if self.connection is not None:
            self.connection.close = _already_released  # Celery calls it after collect(); see above
        super().on_connection_error_after_connected(exc)
