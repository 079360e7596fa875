"""What the API accepts at most: the body (Flask), the request line and headers (gunicorn reads
them before the app: ``app/gunicorn_conf.py`` sets them, ``/openapi.json`` states them), and how
long a client may take to send a request (``app/gunicorn_worker.py`` reads it before a thread serves it),
and how long an idle kept-alive connection stays open (REST's gunicorn and the MCP face's uvicorn)."""

MAX_BODY_BYTES = 256 * 1024
# the request line (method, path, query string, version), each header line, the number of headers
MAX_REQUEST_LINE = 4094
MAX_HEADER_BYTES = 8190
MAX_HEADER_FIELDS = 100
# a request's head within this many seconds of its first byte (or of its connection), its body of its head
HEAD_SECONDS = 10
BODY_SECONDS = 30
# an idle kept-alive connection stays open this long, on the REST port (gunicorn's keepalive; its own
# default is 2 s) and the MCP port (uvicorn's timeout_keep_alive; its own, 5 s). A relay's requests about a
# call come seconds apart (the caller speaks in between), and a request sent just as the server closes its
# connection is lost (RemoteDisconnected; HTTP libraries do not send a POST again by themselves).
# Longer than the idle timeout of the usual fronts (nginx's upstream keep-alive and cloud load balancers':
# 60 s), so a front closes first; a stopping server closes its idle connections all the same (gunicorn
# within 2 s, uvicorn at once).
KEEPALIVE_SECONDS = 75
