"""``voice-tools worker-metrics``: one exporter that serves the workers' series.

Every worker process (each pool child, each worker line of the Procfile) writes its
numbers into the workers' own multiprocess folder (``VOICE_TOOLS_WORKER_METRICS_DIR``,
which the Procfile's worker lines pass to prometheus-client as
``PROMETHEUS_MULTIPROC_DIR``). This process adds them up (prometheus-client's
``MultiProcessCollector``) and, at each scrape, reads the depth of every queue from
the broker (``voice_tools_queue_depth``): nothing is measured per task for it.

It is a separate process from the API (whose ``/metrics`` shows the API's series
only) and from Flower (which serves its own ``/metrics``). A system with one worker
serves the same registry from that worker instead (``tasks/metrics_thread.py``).
"""
from __future__ import annotations

import argparse
import logging
import logging.config
import os
import signal
import sys
from pathlib import Path
from typing import Any, Iterator

from prometheus_client import CollectorRegistry, multiprocess, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

import logs

log = logging.getLogger(__name__)

DIR_VARIABLE = "VOICE_TOOLS_WORKER_METRICS_DIR"
DEFAULT_PORT = 9101


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


def registry(directory: str | Path, app: Any) -> CollectorRegistry:
    """The exporter's registry: every worker process's numbers in ``directory``, and the queue depths."""
    exported = CollectorRegistry()
    multiprocess.MultiProcessCollector(exported, path=str(directory))
    exported.register(QueueDepth(app))
    return exported


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="voice-tools worker-metrics",
                                     description="Serve the workers' Prometheus metrics at /metrics.")
    parser.add_argument("--host", default=os.environ.get("HOST", "0.0.0.0"))
    parser.add_argument("--port", type=int, default=int(os.environ.get("WORKER_METRICS_PORT", DEFAULT_PORT)))
    parser.add_argument("--dir", default=os.environ.get(DIR_VARIABLE),
                        help=f"the workers' multiprocess folder (default: ${DIR_VARIABLE})")
    args = parser.parse_args(argv)
    if not args.dir or not Path(args.dir).is_dir():
        parser.error(f"set {DIR_VARIABLE} (or --dir) to the workers' metrics folder (an existing folder)")
    logging.config.dictConfig(logs.dict_config())  # one JSON line per event, as every process of the Procfile
    from tasks.celery_app import app

    server, _thread = start_http_server(args.port, addr=args.host, registry=registry(args.dir, app))
    log.info("worker metrics of %s on http://%s:%s/metrics", args.dir, args.host, args.port)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        signal.pause()
    except (KeyboardInterrupt, SystemExit):
        pass
    finally:
        server.shutdown()
    return 0
