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

And a worker stopped while its broker is gone (lost, and not back yet) shuts down
quietly: its consumer steps (gossip's) close their channels with
``kombu.common.ignore_errors(consumer.connection, channel.close)``, and that connection
is None while the consumer waits to reconnect, so kombu's own error filter raises
``AttributeError`` instead of ignoring the broker's connection error; the worker then
dies with a chained traceback of some 100 lines, which the worker's stderr redirection
logs as about 1,700 lines. Given a connection object that was never connected (it only
knows the transport's error classes), those closes fail as ignorable connection errors.
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

    def shutdown(self) -> None:
        if self.connection is None:  # stopped while the broker is gone: see above
            self.connection = self.app.connection_for_read()  # lazy: never connects
        super().shutdown()
