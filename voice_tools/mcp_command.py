"""``voice-tools mcp``: serve the MCP face (``app/mcp_server.py``) at ``/mcp``, at once or at its first connection.

With ``--lazy`` the process binds and listens on its port at once
but imports nothing of the face (the MCP SDK, pydantic, starlette, uvicorn, the tasks
app: ~95 MB PSS) until the first connection arrives; that connection waits in the
listen backlog while the face loads (a few seconds), then uvicorn serves it and every
later one on the same socket. An idle local run thus keeps a ~10 MB process for the
face; a used one pays for it once (``app/mcp_lazy.py``). Production's ``Procfile`` loads at start;
``Procfile.local`` has no MCP process: the API's worker serves the face (``VOICE_TOOLS_MCP_BIND``).
"""
from __future__ import annotations

import argparse
import logging
import logging.config
import os

from app import mcp_lazy
from models import logs

log = logging.getLogger(__name__)

DEFAULT_PORT = 8001


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
        sock = mcp_lazy.listening_socket(args.host, args.port)
        log.info("MCP face on http://%s:%s/mcp, loaded at its first connection", args.host, args.port)
        try:
            mcp_lazy.wait_for_first_connection(sock)
        except KeyboardInterrupt:
            return 0
        log.info("first connection: loading the MCP face")
        sockets = [sock]
    from app import mcp_server

    mcp_server.serve(args.host, args.port, sockets)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
