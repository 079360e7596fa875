"""gunicorn settings read by the Procfile's web line (``--config python:app.gunicorn_conf``).

Only what the command line does not say: when a worker exits, its Prometheus
multiprocess files are marked dead so ``/metrics`` stops counting its live gauges.
"""
import os


def child_exit(server, worker):
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(worker.pid)
