"""The MCP face's port listened on at once, the face (``app/mcp_server.py``) loaded at its first connection.

Loading the face imports the MCP SDK, pydantic, starlette and uvicorn (about 40 MB PSS on top of the
tasks app): a process that may never be asked over MCP listens on the port with nothing of that
loaded, and a first connection waits in the listen backlog while the face loads (a few seconds),
then uvicorn serves it and every later one on the same socket. Two hosts use it:

- ``voice-tools mcp --lazy``, a process of its own (``voice_tools/mcp_command.py``);
- the API's gunicorn worker when ``VOICE_TOOLS_MCP_BIND`` (``HOST:PORT``) is set (``Procfile.local``):
  gunicorn's master binds the port before it forks (``app/gunicorn_conf.py``), and each worker serves
  the face from a thread of its own (uvicorn on its own event loop), beside the REST API and the
  event streams, with the same database pool, listener and callers' shares. A local run thus keeps
  no process for the MCP face.

This module imports nothing of the face itself.
"""
from __future__ import annotations

import logging
import select
import socket
import threading
from typing import Any

log = logging.getLogger(__name__)

BIND_VARIABLE = "VOICE_TOOLS_MCP_BIND"  # HOST:PORT: the API's workers also serve the MCP face there
STOP_WAIT_S = 5.0

_served: dict[str, Any] = {}  # this process's face served from a thread: its uvicorn server, once loaded


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` and listening, as uvicorn would make it."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family, backlog=2048)


def address(bind: str) -> tuple[str, int]:
    """``(host, port)`` of ``HOST:PORT`` (an IPv6 host bare or in brackets: ``::1:8001``, ``[::1]:8001``)."""
    host, sep, port = bind.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"{BIND_VARIABLE} must be HOST:PORT, not {bind!r}")
    return host.strip("[]"), int(port)


def wait_for_first_connection(sock: socket.socket) -> None:
    """Return once a connection waits to be accepted on ``sock`` (it is left there for the server)."""
    while not select.select([sock], [], [])[0]:
        pass


def serve_in_thread(sock: socket.socket, host: str, port: int) -> threading.Thread:
    """Serve the face on ``sock`` (listening) from a daemon thread of this process, loaded at its first connection."""
    def serve() -> None:
        wait_for_first_connection(sock)
        log.info("first connection: loading the MCP face")
        from app import mcp_server

        server = mcp_server.uvicorn_server(host, port, configure_logging=False)
        _served["server"] = server
        server.run(sockets=[sock])

    thread = threading.Thread(target=serve, name="voice-tools-mcp", daemon=True)
    _served["thread"] = thread
    thread.start()
    return thread


def stop_thread(wait_s: float = STOP_WAIT_S) -> None:
    """Stop the face served by :func:`serve_in_thread`: uvicorn closes its connections and ends its lifespan.
    A face never loaded has nothing to stop (its thread waits in ``select`` and ends with the process)."""
    server, thread = _served.get("server"), _served.get("thread")
    if server is None or thread is None:
        return
    server.should_exit = True
    thread.join(wait_s)
