"""``voice-tools mcp``: serve the MCP face (``app/mcp_server.py``) at ``/mcp``, at once or at its first connection.

With ``--lazy`` (``Procfile.local``) the process binds and listens on its port at once
but imports nothing of the face (the MCP SDK, pydantic, starlette, uvicorn, the tasks
app: ~95 MB PSS) until the first connection arrives; that connection waits in the
listen backlog while the face loads (a few seconds), then uvicorn serves it and every
later one on the same socket. An idle local run thus keeps a ~10 MB process for the
face; a used one pays for it once. Production's ``Procfile`` loads at start.
"""
from __future__ import annotations

import argparse
import logging
import logging.config
import os
import select
import socket

from models import logs

log = logging.getLogger(__name__)

DEFAULT_PORT = 8001


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` and listening, as uvicorn would make it."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family, backlog=2048)


def wait_for_first_connection(sock: socket.socket) -> None:
    """Return once a connection waits to be accepted on ``sock`` (it is left there for the server)."""
    while not select.select([sock], [], [])[0]:
        pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="voice-tools mcp", description="Serve the MCP face at /mcp.")
    parser.add_argument("--host", default=os.environ.get("HOST") or "127.0.0.1")
    parser.add_argument("--port", type=int, default=int(os.environ.get("MCP_PORT") or DEFAULT_PORT))
    parser.add_argument("--lazy", action="store_true",
                        help="listen at once, load the face at the first connection (a light idle process)")
    args = parser.parse_args(argv)
    sockets = None
    if args.lazy:
        logging.config.dictConfig(logs.dict_config())
        sock = listening_socket(args.host, args.port)
        log.info("MCP face on http://%s:%s/mcp, loaded at its first connection", args.host, args.port)
        try:
            wait_for_first_connection(sock)
        except KeyboardInterrupt:
            return 0
        log.info("first connection: loading the MCP face")
        sockets = [sock]
    from app import mcp_server

    mcp_server.serve(args.host, args.port, sockets)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
