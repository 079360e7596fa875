"""Queues declared right: each with an exchange and a routing key of its own.

A message routed to one tool's queue lands in that queue only, on Redis (the broker the
suite runs on) and on RabbitMQ (127.0.0.1:5672 where it runs, as on these machines).
"""
from __future__ import annotations

import socket

import pytest
from kombu import Connection

from tasks import app, chains


def test_every_queue_has_an_exchange_and_routing_key_of_its_own():
    for queue in app.amqp.queues.values():
        assert (queue.exchange.name, queue.routing_key, queue.exchange.type) == (queue.name, queue.name, "direct")
    routed = app.amqp.router.route({}, "tools.send_email.SENDING")
    assert routed["queue"].name == "tools.send_email"


def _depths(conn: Connection) -> dict[str, int]:
    channel = conn.default_channel
    if conn.transport_cls in ("redis", "rediss") or conn.transport.driver_type == "redis":
        return {name: channel.client.llen(name) for name in app.amqp.queues}  # an empty queue is no key
    return {name: channel.queue_declare(queue=name, passive=True).message_count for name in app.amqp.queues}


def _publish_one_of_each(conn: Connection) -> None:
    for queue in app.amqp.queues.values():
        queue.bind(conn.default_channel).declare()
        queue.bind(conn.default_channel).purge()
    chains.LINKS["send_email"][0].si("tc_route_check").apply_async(connection=conn)
    app.send_task("maintenance.expire_stale", connection=conn)


def test_a_link_and_a_sweep_each_land_in_their_own_queue_only_on_redis():
    # on a Redis database of its own, out of reach of the suite's in-process worker
    with Connection(app.conf.broker_url, virtual_host="13", transport_options=app.conf.broker_transport_options) \
            as conn:
        _publish_one_of_each(conn)
        depths = _depths(conn)
        for queue in app.amqp.queues.values():
            queue.bind(conn.default_channel).purge()
    assert {name: n for name, n in depths.items() if n} == {"tools.send_email": 1, "maintenance": 1}


RABBITMQ = "amqp://guest:guest@127.0.0.1:5672//"


def _rabbitmq_listening() -> bool:
    try:
        socket.create_connection(("127.0.0.1", 5672), timeout=1).close()
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _rabbitmq_listening(), reason="no RabbitMQ on 127.0.0.1:5672 (these machines run one)")
def test_a_link_and_a_sweep_each_land_in_their_own_queue_only_on_rabbitmq():
    with Connection(RABBITMQ) as conn:
        _publish_one_of_each(conn)
        depths = _depths(conn)
        for queue in app.amqp.queues.values():
            queue.bind(conn.default_channel).delete()
    assert {name: n for name, n in depths.items() if n} == {"tools.send_email": 1, "maintenance": 1}
