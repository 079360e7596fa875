"""Prometheus metrics of the API: request count and latency by method, endpoint and status, and the
event streams open (the stream loop's gauge, ``app/stream_gauges.py``).

A method outside HTTP's standard ones is counted as ``other``: any token a client sends
is a method name to gunicorn, and each would otherwise be a new label value.

Under gunicorn with several workers set ``PROMETHEUS_MULTIPROC_DIR`` (an empty
folder) so ``/metrics`` adds up every worker's numbers (prometheus-client's
multiprocess collector). The page is Prometheus' text format 0.0.4, with exactly its
``Content-Type`` (``text/plain; version=0.0.4; charset=utf-8``).
"""
from __future__ import annotations

import os
import time

from flask import Flask, Response, g, request
from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client import multiprocess
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

from app import stream_gauges  # noqa: F401 - the stream loop's gauges, shown on this page too

REQUESTS = Counter("voice_tools_http_requests_total", "HTTP requests answered",
                   ["method", "endpoint", "status"])
LATENCY = Histogram("voice_tools_http_request_duration_seconds", "Time to answer an HTTP request",
                    ["method", "endpoint"])


STANDARD_METHODS = frozenset({"GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"})


def _method() -> str:
    return request.method if request.method in STANDARD_METHODS else "other"


def _endpoint() -> str:
    rule = request.url_rule
    return rule.rule if rule is not None else "unmatched"


def register(app: Flask) -> None:
    @app.before_request
    def _start_clock() -> None:
        g.metrics_started = time.perf_counter()

    @app.after_request
    def _count(response):
        started = g.pop("metrics_started", None)
        endpoint = _endpoint()
        method = _method()
        REQUESTS.labels(method, endpoint, str(response.status_code)).inc()
        if started is not None:
            LATENCY.labels(method, endpoint).observe(time.perf_counter() - started)
        return response


def render() -> Response:
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
    else:
        registry = REGISTRY
    # the whole header as given (``mimetype=`` would add a second charset): the text format
    # 0.0.4 that ``generate_latest`` writes, which every Prometheus reads
    return Response(generate_latest(registry), content_type=CONTENT_TYPE_PLAIN_0_0_4)
