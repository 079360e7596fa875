"""``celery -A tasks worker --worker-metrics-port PORT``: the workers' series served by the worker itself.

``voice-tools worker-metrics`` (``voice_tools/worker_metrics.py``) is a process of its own, which
production runs once beside its several worker lines. A system with one worker
(``voice-tools run``'s ``Procfile.local``) serves the same page from a thread of that
worker's main process instead (prometheus-client's HTTP server over the same registry:
every pool child's numbers from the multiprocess folder, the queue depths from the
broker), which saves the exporter's process (~60 MB PSS). The server starts after the
pool, so the pool's first children are forked without its listening socket; a child
forked later (replacing a lost one) closes its copy at once.
"""
from __future__ import annotations

import logging
import os
from typing import Any

import click
from celery import bootsteps
from celery.signals import worker_process_init

log = logging.getLogger(__name__)

_serving: list[Any] = []  # the server of this process (the worker's main process), once started


class MetricsThread(bootsteps.StartStopStep):
    """Serve ``/metrics`` of the workers from a thread of the worker's main process (``--worker-metrics-port``)."""

    label = "Worker metrics (thread)"
    conditional = True
    requires = ("celery.worker.components:Pool",)

    def __init__(self, worker: Any, worker_metrics_port: int | None = None,
                 worker_metrics_host: str = "127.0.0.1", **options: Any) -> None:
        self.enabled = worker_metrics_port is not None
        self.address = (worker_metrics_host, worker_metrics_port)
        self.server: Any = None
        super().__init__(worker, **options)

    def start(self, worker: Any) -> None:
        from prometheus_client import start_http_server

        from tasks.worker import metrics_page

        folder = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
        if not folder:
            raise RuntimeError("--worker-metrics-port serves the workers' multiprocess folder: set PROMETHEUS_MULTIPROC_DIR")
        host, port = self.address
        self.server, _thread = start_http_server(port, addr=host, registry=metrics_page.registry(folder, worker.app))
        _serving.append(self.server)
        log.info("worker metrics of %s on http://%s:%s/metrics", folder, host, port)

    def stop(self, worker: Any) -> None:
        if self.server is not None:
            _serving.remove(self.server)
            self.server.shutdown()
            self.server.server_close()
            self.server = None

    shutdown = stop


@worker_process_init.connect
def _close_inherited_socket(**_: Any) -> None:
    """A pool child forked after the server started holds a copy of its listening socket: close it
    (the child has no thread serving it; the port is the main process's alone)."""
    while _serving:
        _serving.pop().socket.close()


def install(app: Any) -> None:
    app.user_options["worker"].add(click.Option(
        ["--worker-metrics-port"], type=int, default=None,
        help="Serve the workers' Prometheus metrics at /metrics on this port, from this worker's main process."))
    app.user_options["worker"].add(click.Option(
        ["--worker-metrics-host"], default="127.0.0.1", show_default=True,
        help="The address --worker-metrics-port binds."))
    app.steps["worker"].add(MetricsThread)
