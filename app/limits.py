"""What the API accepts at most: the body (Flask), the request line and headers (gunicorn reads
them before the app: ``app/gunicorn_conf.py`` sets them, ``/openapi.json`` states them), and how
long a client may take to send a request (``app/gunicorn_worker.py`` reads it before a thread serves it)."""

MAX_BODY_BYTES = 256 * 1024
# the request line (method, path, query string, version), each header line, the number of headers
MAX_REQUEST_LINE = 4094
MAX_HEADER_BYTES = 8190
MAX_HEADER_FIELDS = 100
# a request's head within this many seconds of its first byte (or of its connection), its body of its head
HEAD_SECONDS = 10
BODY_SECONDS = 30
