"""The page of the workers' series: what ``voice-tools worker-metrics`` (a process of its own,
``voice_tools/worker_metrics.py``) and a worker's ``--worker-metrics-port`` thread
(``tasks/worker/metrics_thread.py``) both serve.

- every worker process's numbers, from the workers' multiprocess folder
  (prometheus-client's ``MultiProcessCollector``);
- ``voice_tools_queue_depth{queue}``, read from the broker at each scrape;
- ``voice_tools_calls{tool,status}``, read from the database at each scrape: every call by
  its status now, whoever changed it (a worker, the API, the MCP face, the operator CLI).
  A worker counts what it ends in ``voice_tools_calls_ended_total``; a cancel through the
  API or the CLI happens in no worker, and shows here.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Iterator

from prometheus_client import CollectorRegistry, multiprocess
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from models import db, queries

log = logging.getLogger(__name__)


class QueueDepth(Collector):
    """``voice_tools_queue_depth{queue}``: messages waiting in each declared queue, read from the broker."""

    def __init__(self, app: Any):
        self.app = app

    def describe(self) -> list[GaugeMetricFamily]:
        return [self._family()]

    def _family(self) -> GaugeMetricFamily:
        return GaugeMetricFamily("voice_tools_queue_depth", "Messages waiting in the queue (read from the broker "
                                 "at each scrape)", labels=["queue"])

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = self._family()
        try:
            with self.app.connection_for_read() as conn:
                conn.ensure_connection(max_retries=1, timeout=2)
                for queue in self.app.conf.task_queues:
                    family.add_metric([queue.name], self._depth(conn, queue))
        except Exception as exc:  # the broker is away: no depths this scrape, the rest is served
            log.warning("queue depths not read: %s", exc)
            return
        yield family

    @staticmethod
    def _depth(conn: Any, queue: Any) -> int:
        channel = conn.channel()  # an AMQP channel error closes its channel: one per queue
        try:
            return queue.bind(channel).queue_declare(passive=True).message_count
        except conn.channel_errors:  # Redis keeps no empty list; RabbitMQ: not declared yet
            return 0
        finally:
            try:
                channel.close()
            except Exception:
                pass


class CallsByStatus(Collector):
    """``voice_tools_calls{tool,status}``: how many calls of each tool are in each status, read from the database."""

    def describe(self) -> list[GaugeMetricFamily]:
        return [self._family()]

    def _family(self) -> GaugeMetricFamily:
        return GaugeMetricFamily("voice_tools_calls", "Calls in the database by tool and status (read at each "
                                 "scrape; counts every door: workers, API, MCP, operator CLI)", labels=["tool", "status"])

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = self._family()
        try:
            with db.statement() as conn:
                counts = queries.count_by_tool_and_status(conn)
        except Exception as exc:  # the database is away: no counts this scrape, the rest is served
            log.warning("calls by status not read: %s", exc)
            return
        for (tool, status), count in sorted(counts.items()):
            family.add_metric([tool, status], count)
        yield family


def registry(directory: str | Path, app: Any) -> CollectorRegistry:
    """Every worker process's numbers in ``directory``, the queue depths and the calls by status."""
    exported = CollectorRegistry()
    multiprocess.MultiProcessCollector(exported, path=str(directory))
    exported.register(QueueDepth(app))
    exported.register(CallsByStatus())
    return exported
