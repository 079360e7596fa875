"""gunicorn settings read by the Procfile's web line (``--config python:app.gunicorn_conf``).

Only what the command line does not say:

- the log: gunicorn's own lines, its access lines and the app's go to stderr and stdout
  in the format of ``VOICE_TOOLS_LOG_FORMAT`` (``logs``: one JSON line per event by
  default). An access line keeps gunicorn's text as its ``message`` and adds the
  request's fields (``method``, ``path``, ``status``, ``duration_ms``) and the context
  the app left in the WSGI environ (``app.request_log``): ``request_id``,
  ``tool_call_id``, ``session_id``. Never a header's value, a query string or a body.
- when a worker exits, its Prometheus multiprocess files are marked dead so
  ``/metrics`` stops counting its live gauges.
"""
from __future__ import annotations

import logging
import os
from typing import Any

import logs

# Without the query string (%(U)s, not %(r)s): a query may carry ids but is not ours to log.
access_log_format = '%(h)s "%(m)s %(U)s" %(s)s %(B)s %(M)sms'


class AccessFields(logging.Filter):
    """Turns gunicorn's access atoms (the record's args) into fields of the line."""

    def filter(self, record: logging.LogRecord) -> bool:
        atoms = record.args
        if isinstance(atoms, dict):
            record.__dict__.update(method=atoms.get("m"), path=atoms.get("U"), status=_int(atoms.get("s")),
                                   duration_ms=atoms.get("M"))
            context = atoms.get("{voice_tools.log}e")
            if isinstance(context, dict):
                for key, value in context.items():
                    record.__dict__.setdefault(key, value)
        return True


def _int(value: Any) -> Any:
    try:
        return int(value)
    except (TypeError, ValueError):
        return value


def _logconfig() -> dict[str, Any]:
    config = logs.dict_config(loggers={
        "gunicorn.error": {"level": "INFO", "handlers": ["stderr"], "propagate": False},
        "gunicorn.access": {"level": "INFO", "handlers": ["stdout"], "propagate": False},
    })
    config["filters"]["access"] = {"()": AccessFields}
    config["handlers"]["stdout"] = {"class": "logging.StreamHandler", "stream": "ext://sys.stdout",
                                    "formatter": "lines", "filters": ["access", "context"]}
    return config


logconfig_dict = _logconfig()


def child_exit(server, worker):
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(worker.pid)
