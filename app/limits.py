"""What the API accepts at most: the body (Flask), the request line and headers (gunicorn reads
them before the app: ``app/gunicorn_conf.py`` sets them, ``/openapi.json`` states them)."""

MAX_BODY_BYTES = 256 * 1024
# the request line (method, path, query string, version), each header line, the number of headers
MAX_REQUEST_LINE = 4094
MAX_HEADER_BYTES = 8190
MAX_HEADER_FIELDS = 100
