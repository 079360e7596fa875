"""gunicorn settings read by the Procfile's web line (``--config python:app.gunicorn_conf``).

Only what the command line does not say:

- the limits gunicorn enforces before the app (``app.limits.MAX_REQUEST_LINE`` and the header
  limits, stated in /openapi.json);
- its own error answers (a request line or a header over those limits, a request it
  cannot parse) are JSON ``{error, message, details}`` like the app's, not its HTML page:
  gunicorn has no setting for that (benoitc/gunicorn#993), so its one writer of them,
  ``gunicorn.util.write_error``, is replaced here (tests/test_web_errors.py holds it to it);
- an answer whose app says ``Connection: close`` (``app.inputs``: the request's body was left
  unread) closes its connection and says so: gunicorn drops a hop-by-hop header the app gives,
  announces keep-alive, then closes anyway when the unread body is over its drain limit, so the
  client's next request on that connection would die; its ``Response.process_headers`` is
  wrapped here to take the app's word (tests/test_early_answers.py);
- an idle kept-alive connection stays open ``app.limits.KEEPALIVE_SECONDS`` (75 s; gunicorn's own
  2 s would close a relay's connection between two requests of one call, and lose the request
  sent just as it closes); a stopping worker still closes them within gunicorn's short stop
  linger. ``--keep-alive`` on the command line (or in ``GUNICORN_CMD_ARGS``) overrides it;
- the log: gunicorn's own lines, its access lines and the app's go to stderr and stdout
  in the format of ``VOICE_TOOLS_LOG_FORMAT`` (``logs``: one JSON line per event by
  default). An access line keeps gunicorn's text as its ``message`` and adds the
  request's fields (``method``, ``path``, ``status``, ``duration_ms``) and the context
  the app left in the WSGI environ (``app.request_log``): ``request_id``,
  ``tool_call_id``, ``session_id``. Never a header's value, a query string or a body.
- when a worker exits, its Prometheus multiprocess files are marked dead so
  ``/metrics`` stops counting its live gauges;
- each worker knows the threads it runs with (``--threads``): it keeps 2 of them from the
  long-held requests that hold a thread, those it cannot hand to its stream loop
  (docs/operations.md, "Fair shares");
- with ``VOICE_TOOLS_MCP_BIND`` (``HOST:PORT``, ``Procfile.local``) the workers also serve the MCP
  face there, loaded at its first connection (``app/mcp_lazy.py``): the master binds the port
  before it forks, each worker serves it from a thread and stops it when it exits.
"""
from __future__ import annotations

import logging
import os
from typing import Any

import voice_tools_tracing  # noqa: F401  (first, in the master too: with tracing off, redis-py will not load the SDK in a worker)
from gunicorn import util
from gunicorn.http import wsgi

from models import logs
from app import http_framing, mcp_lazy
from app.limits import KEEPALIVE_SECONDS, MAX_HEADER_BYTES, MAX_HEADER_FIELDS, MAX_REQUEST_LINE

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

keepalive = KEEPALIVE_SECONDS

limit_request_line = MAX_REQUEST_LINE
limit_request_field_size = MAX_HEADER_BYTES
limit_request_fields = MAX_HEADER_FIELDS

# gunicorn's statuses as JSON: the same answers as the read-ahead's and the MCP port's refusals
error_answer = http_framing.answer


def write_json_error(sock, status_int, reason, mesg):  # gunicorn.util.write_error's signature
    util.write_nonblock(sock, error_answer(status_int, reason, mesg))


util.write_error = write_json_error

_process_headers = wsgi.Response.process_headers


def _process_headers_taking_close(self, headers):  # gunicorn.http.wsgi.Response.process_headers's signature
    _process_headers(self, headers)
    if any(name.lower() == "connection" and "close" in value.lower() for name, value in headers):
        self.force_close()


wsgi.Response.process_headers = _process_headers_taking_close


def child_exit(server, worker):
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(worker.pid)


def post_fork(server, worker):
    from app import shares  # the worker's own, after the fork (the master never loads the app)

    shares.serve_with_threads(server.cfg.threads)


_mcp: dict[str, object] = {}  # the MCP face's listening socket and address, bound by the master


def when_ready(server):
    bind = os.environ.get(mcp_lazy.BIND_VARIABLE)
    if bind and "socket" not in _mcp:  # once: a reload (SIGHUP) keeps the socket
        host, port = mcp_lazy.address(bind)
        _mcp.update(socket=mcp_lazy.listening_socket(host, port), host=host, port=port)
        server.log.info("MCP face on http://%s:%s/mcp, served by the workers, loaded at its first connection",
                        host, port)


def post_worker_init(worker):
    if "socket" in _mcp:
        mcp_lazy.serve_in_thread(_mcp["socket"], _mcp["host"], _mcp["port"])


def worker_exit(server, worker):
    if "socket" in _mcp:
        mcp_lazy.stop_thread()
