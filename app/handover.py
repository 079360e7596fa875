"""Taking a client's connection from the WSGI server, for the stream loop (``app/stream_loop.py``) to
answer on it: an event stream (``app/stream.py``) and a ``?wait`` (``app/wait_answer.py``) hold no web
thread.

gunicorn and werkzeug hand the app the client's socket in the WSGI environ. The connection is taken by
duplicating its descriptor; the server's descriptor is then made to name a closed pipe, so whatever the
server writes after (the rest of its answer, the end of a chunked body) reaches no one, and it closes its
descriptor as after any answer: the client's connection is the stream loop's alone.
"""
from __future__ import annotations

import os
import socket
from typing import Any


def socket_of(environ: dict[str, Any], methods: tuple[str, ...] = ("GET",)) -> socket.socket | None:
    """The client's plain TCP socket, if the server hands one over (gunicorn's and werkzeug's do) and
    the request is HTTP/1.1 over it, with one of ``methods``; else None (TLS or HTTP/2 in the app server,
    HTTP/1.0, a test client: the request is served from its thread)."""
    sock = environ.get("gunicorn.socket") or environ.get("werkzeug.socket")
    if type(sock) is not socket.socket or environ.get("SERVER_PROTOCOL") != "HTTP/1.1":
        return None
    if environ.get("wsgi.url_scheme") != "http" or environ.get("REQUEST_METHOD") not in methods:
        return None
    return sock


def take(sock: socket.socket) -> socket.socket:
    """The client's connection as a socket of the caller's own; ``sock``'s descriptor (the server's) now
    names a closed pipe."""
    own = socket.socket(fileno=os.dup(sock.fileno()))
    dead, peer = socket.socketpair()
    peer.close()
    os.dup2(dead.fileno(), sock.fileno())
    dead.close()
    return own
