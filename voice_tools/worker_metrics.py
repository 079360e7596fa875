"""``voice-tools worker-metrics``: one exporter that serves the workers' series.

Every worker process (each pool child, each worker line of the Procfile) writes its
numbers into the workers' own multiprocess folder (``VOICE_TOOLS_WORKER_METRICS_DIR``,
which the Procfile's worker lines pass to prometheus-client as
``PROMETHEUS_MULTIPROC_DIR``). This process serves their page (``tasks/worker/metrics_page.py``):
their numbers added up, and, read at each scrape, the depth of every queue from the
broker and the calls by status from the database: nothing is measured per task for them.

It is a separate process from the API (whose ``/metrics`` shows the API's series
only) and from Flower (which serves its own ``/metrics``). A system with one worker
serves the same registry from that worker instead (``tasks/worker/metrics_thread.py``).
"""
from __future__ import annotations

import argparse
import logging
import logging.config
import os
import signal
import sys
from pathlib import Path

from prometheus_client import start_http_server

from models import logs
from tasks.worker import metrics_page

log = logging.getLogger(__name__)

DIR_VARIABLE = "VOICE_TOOLS_WORKER_METRICS_DIR"
DEFAULT_PORT = 9101


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

    server, _thread = start_http_server(args.port, addr=args.host, registry=metrics_page.registry(args.dir, app))
    log.info("worker metrics of %s on http://%s:%s/metrics", args.dir, args.host, args.port)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        signal.pause()
    except (KeyboardInterrupt, SystemExit):
        pass
    finally:
        server.shutdown()
    return 0
